"""Several edges' local training as one batched computation (``fl-sim --batch-edges``).

Edges hosted in one process take turns in ``train_local``: each steps a small batch on a
small model, so a GPU idles between them. Here the edges of one group train together:
their parameters, BatchNorm buffers and momentum buffers are stacked along a leading
"edge" dimension and one ``torch.func.vmap`` of ``functional_call`` + ``grad_and_value``
takes every edge's step at once. Only for a local step that is the loop's default (the
contract ``batch_refusal`` checks on the method's declared hooks, never its name);
everything else keeps ``train_local``.

What is kept of the sequential loop, per edge: its data order (its own ``ShuffledBatches``
generator, seeded with its ``loader_seed``), its augmentation stream
(``augment_generator``), its BatchNorm running statistics (buffers stacked per edge and
updated by the vmapped batch norm, never shared, never replaced by
``replace_all_batch_norm_modules_``), its steps (an edge with fewer batches is masked out
of the steps it does not take: ``torch.where`` keeps its tensors bit for bit; an epoch's
short last batch trains its edge alone, in a stack of width 1), its SGD
update (the formula of ``torch.optim.SGD``, elementwise), its reported losses. Random ops in
the model (dropout) cannot keep one stream per edge under vmap: such a model is refused
(and vmap's ``randomness="error"`` guards what the check misses).

What differs: a vmapped matmul or convolution may sum in another order than the edge's
own, so results agree with ``train_local`` within rounding, not bit for bit
(tests/test_sim_batched.py measures it). Rounding also depends on an edge's position in
the stack and the stack's width, never on the other edges' values: each edge has a fixed
``slot`` in a stack of fixed ``width`` (empty slots compute on a copy of another edge's
tensors and are discarded), so a run is bit-identical to a rerun with the same width.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedattn_shared.augment import InputPipeline
from fedattn_shared.data.npz import Split, decode_images
from fedattn_shared.methods.base import EdgeAlgorithm, LoopSchedule
from fedattn_shared.rng import GLOBAL_RNG_LOCK
from fl_edge.trainer import ShuffledBatches, TrainResult, augment_generator, autocast_dtype

#: The hooks that shape the local step. A method's edge that overrides one is batched only
#: where it declares it in ``EdgeAlgorithm.batched_hooks`` (what that declaration means
#: for each hook is in ``batch_refusal``).
LOOP_HOOKS = ("training_step", "post_backward", "begin_train", "end_train", "train_mode",
              "parameter_groups", "optimizers")


@dataclass
class EdgeJob:
    """One edge's round of local training, as ``train_local`` is given it."""

    algo: EdgeAlgorithm
    data: Split
    epochs: int
    batch_size: int
    seed: int
    lr: float | None = None
    inputs: InputPipeline = field(default_factory=InputPipeline)
    on_step: Callable[[], None] | None = None
    slot: int = 0
    #: As ``train_local``'s ``augment_rng``: by default ``augment_generator(seed)``.
    augment_rng: torch.Generator | None = None


def batch_refusal(algo: EdgeAlgorithm, amp: bool = False, grad_accum: int = 1,
                  privacy: object | None = None, clip_grad_norm: float = 0.0,
                  device: torch.device | None = None) -> str | None:
    """Why ``algo``'s local training cannot join a batched group with these loop options
    (None: it can). The contract: one model ``model``, cross-entropy as ``training_step``,
    the default schedule, one plain SGD optimizer over one parameter group, optimizer
    state reset each round; a ``post_backward`` only where the edge declares it batched
    (``batched_hooks``) and it is ``proximal_term``'s pull; no dropout."""
    cls = type(algo)
    for hook in LOOP_HOOKS:
        if getattr(cls, hook) is not getattr(EdgeAlgorithm, hook) and hook not in cls.batched_hooks:
            return f"{cls.__name__} overrides {hook} (not declared in batched_hooks)"
    if "post_backward" in cls.batched_hooks and algo.proximal_term() is None:
        return f"{cls.__name__} declares post_backward batched but has no proximal_term"
    if algo.schedule != LoopSchedule():
        return f"{cls.__name__} changes the loop's schedule"
    if set(algo.models) != {"model"}:
        return f"{cls.__name__} trains models {sorted(algo.models)}, not one 'model'"
    train = algo.method.train
    if train.optimizer != "sgd":
        return f"train.optimizer {train.optimizer!r} (the batched step is SGD's)"
    if train.optimizer_state != "reset":
        return "train.optimizer_state 'carry' (the batched step starts SGD afresh)"
    if privacy is not None:
        return "DP-SGD (per-sample clipping and noise run per edge)"
    if grad_accum != 1 or clip_grad_norm:
        return "train.grad_accum > 1 or train.clip_grad_norm (not batched)"
    if amp and device is not None and autocast_dtype(device) == torch.float16:
        return "fp16 autocast needs a gradient scaler per edge (bf16 only)"
    for module in algo.models["model"].modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"the model draws dropout ({type(module).__name__}): one RNG stream per edge"
    return None


def _sgd_group(algo: EdgeAlgorithm) -> dict:
    """The one parameter group of the edge's one SGD optimizer (its hyperparameters)."""
    optimizers = algo.optimizers()
    if len(optimizers) != 1 or type(optimizers[0]) is not torch.optim.SGD:
        raise ValueError("the batched step needs one torch.optim.SGD")
    groups = optimizers[0].param_groups
    if len(groups) != 1 or groups[0]["maximize"]:
        raise ValueError("the batched step needs one SGD parameter group, minimizing")
    return groups[0]


def group_key(job: EdgeJob) -> tuple:
    """Edges that can share one stack: the same model shapes, loop shape and hyperparameters."""
    model = job.algo.models["model"]
    shapes = tuple((k, tuple(v.shape), v.dtype, v.requires_grad)
                   for k, v in model.state_dict(keep_vars=True).items())
    group = _sgd_group(job.algo)
    proximal = job.algo.proximal_term()
    return (type(job.algo), type(model), shapes, job.epochs, job.batch_size, job.lr,
            group["lr"] if job.lr is None else None, group["momentum"], group["dampening"],
            group["weight_decay"], group["nesterov"], None if proximal is None else proximal[1],
            job.inputs.identity)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.detach() for t in tensors])


def _where(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` at the masked edges (dimension 0), ``old`` elsewhere, bit for bit."""
    return torch.where(mask.view(-1, *([1] * (new.dim() - 1))), new, old)


def train_batched(jobs: list[EdgeJob], width: int, device: torch.device,
                  amp: bool = False) -> list[TrainResult]:
    """Trains ``jobs`` (each at its ``slot`` < ``width``, slots distinct, all of one
    ``group_key``) as one stacked computation and writes each edge's trained parameters,
    BatchNorm buffers and SGD momentum back into its models and optimizer, as
    ``train_local`` leaves them. Nothing of an edge is written before the whole group has
    trained: an error leaves every edge as it was (its caller can train it sequentially).
    Each result's ``seconds`` is the group's."""
    slots = [job.slot for job in jobs]
    if len(set(slots)) != len(slots) or not all(0 <= s < width for s in slots):
        raise ValueError(f"slots {slots} must be distinct and < width {width}")
    if len({group_key(job) for job in jobs}) != 1:
        raise ValueError("the jobs of one batched group must share a group_key")
    with GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _train(jobs, width, device, amp)


def _train(jobs: list[EdgeJob], width: int, device: torch.device, amp: bool) -> list[TrainResult]:
    start = time.perf_counter()
    lead = jobs[0]
    at = {job.slot: job for job in jobs}
    for job in jobs:
        job.algo.train_mode()
        job.algo.num_examples = len(job.data)
        job.algo.begin_train()
        for opt in job.algo.optimizers():
            opt.state.clear()  # optimizer_state "reset": a fresh SGD, as train_local
    group = _sgd_group(lead.algo)
    lr = group["lr"] if lead.lr is None else lead.lr * group.get("lr_scale", 1.0)
    momentum, dampening = group["momentum"], group["dampening"]
    decay, nesterov = group["weight_decay"], group["nesterov"]
    proximal = lead.algo.proximal_term()
    mu = 0.0 if proximal is None else proximal[1]

    model = lead.algo.models["model"]
    trained = [k for k, p in model.named_parameters() if p.requires_grad]
    fixed = [k for k, _ in model.named_parameters() if k not in trained]
    buffer_names = [k for k, _ in model.named_buffers()]

    def tensors(job: EdgeJob | None, names: list[str], buffers: bool) -> list[torch.Tensor]:
        source = (job or lead).algo.models["model"]
        table = dict(source.named_buffers() if buffers else source.named_parameters())
        return [table[k] for k in names]

    def stacked(names: list[str], buffers: bool) -> dict[str, torch.Tensor]:
        per_slot = [tensors(at.get(s), names, buffers) for s in range(width)]
        return {k: _stack([per_slot[s][i] for s in range(width)]).to(device)
                for i, k in enumerate(names)}

    params = stacked(trained, False)
    frozen = {**stacked(fixed, False), **stacked(buffer_names, True)}
    reference = None
    if proximal is not None:
        refs = [(at.get(s) or lead).algo.proximal_term()[0] for s in range(width)]
        reference = {k: _stack([refs[s][f"model/{k}"] for s in range(width)]).to(device)
                     for k in trained if f"model/{k}" in refs[0]}
    velocity: dict[str, torch.Tensor] = {}
    started = torch.zeros(width, dtype=torch.bool, device=device)
    begun: set[int] = set()  # the slots that have stepped, as ``started`` (known on the host)

    skeleton = copy.deepcopy(model).to("meta")

    def loss_of(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(skeleton, (p, b), (x,)), y)

    step = vmap(grad_and_value(loss_of), randomness="error")
    dtype = autocast_dtype(device)
    # Per slot: the summed epoch means, the last epoch's mean. The batch losses add up on
    # the device in float64 (as train_local's LossBook, in the same order: equal sums),
    # read once an epoch (a read per step would stall a GPU).
    totals = {job.slot: [0.0, 0.0] for job in jobs}
    tally = {job.slot: [0, 0] for job in jobs}  # steps, examples
    epochs = lead.algo.schedule.epochs(lead.epochs)

    def apply(mask: torch.Tensor | None, members: list[int], grads: dict, work: dict) -> None:
        """One SGD step (torch.optim.SGD's formula) at the masked edges (None: at all,
        the common step, without the selections: ``torch.where`` of an all-true mask is
        its first operand, so the bits are the same)."""
        nonlocal started
        pick = _where if mask is not None else (lambda _, new, old: new)
        for k in trained:
            d_p = grads[k].to(params[k].dtype)
            if reference is not None and k in reference:
                d_p = d_p.add(params[k] - reference[k], alpha=mu)  # FedProx's post_backward
            if decay:
                d_p = d_p.add(params[k], alpha=decay)
            if momentum:
                old = velocity.get(k)
                if old is None:
                    buf = d_p.clone()
                elif len(begun) == width:  # every slot has its buffer (no device read)
                    buf = old.mul(momentum).add_(d_p, alpha=1 - dampening)
                else:
                    buf = _where(started, old.mul(momentum).add_(d_p, alpha=1 - dampening), d_p)
                velocity[k] = buf if old is None else pick(mask, buf, old)
                d_p = d_p.add(buf, alpha=momentum) if nesterov else buf
            params[k] = pick(mask, params[k].add(d_p, alpha=-lr), params[k])
        for k in buffer_names:
            frozen[k] = pick(mask, work[k], frozen[k])
        started = started | mask if mask is not None else torch.ones_like(started)
        begun.update(members)

    def lone(slot: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A short batch (an epoch's last, smaller than the batch size) trains this slot
        alone, in a stack of width 1: a whole-width pass for it would cost a full step of
        every slot, and width 1 is the same computation whichever edges share the group.
        Returns its loss."""
        sub = slice(slot, slot + 1)
        p = {k: v[sub] for k, v in params.items()}
        b = {k: (v[sub].clone() if k in buffer_names else v[sub]) for k, v in frozen.items()}
        with torch.autocast(device.type, dtype=dtype, enabled=amp):
            grads, losses = step(p, b, x[None], y[None])
        for k in trained:
            d_p = grads[k].to(p[k].dtype)
            if reference is not None and k in reference:
                d_p = d_p.add(p[k] - reference[k][sub], alpha=mu)
            if decay:
                d_p = d_p.add(p[k], alpha=decay)
            if momentum:
                if k not in velocity:
                    velocity[k] = torch.zeros_like(params[k])
                if slot in begun:
                    buf = velocity[k][sub].mul(momentum).add_(d_p, alpha=1 - dampening)
                else:
                    buf = d_p.clone()
                velocity[k][sub].copy_(buf)
                d_p = d_p.add(buf, alpha=momentum) if nesterov else buf
            params[k][sub].copy_(p[k].add(d_p, alpha=-lr))
        for k in buffer_names:
            frozen[k][sub].copy_(b[k])
        started[slot] = True
        begun.add(slot)
        return losses[0].detach().double()

    # Each edge's own streams, as train_local draws them: its data order, its augmentation.
    loaders = {job.slot: ShuffledBatches(
        job.data, job.batch_size, torch.Generator().manual_seed(job.seed),
        drop_last=len(job.data) % job.batch_size == 1 and len(job.data) > 1) for job in jobs}
    augment = {job.slot: job.augment_rng if job.augment_rng is not None
               else augment_generator(job.seed) for job in jobs}
    for _ in range(epochs):
        iters = {slot: iter(loader) for slot, loader in loaders.items()}
        sums = torch.zeros(width, dtype=torch.float64, device=device)
        batches = dict.fromkeys(at, 0)
        while iters:
            batch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for slot in list(iters):
                item = next(iters[slot], None)
                if item is None:
                    del iters[slot]
                    continue
                x, y = item
                x = decode_images(x.to(device, non_blocking=True))
                if not at[slot].inputs.identity:
                    x = at[slot].inputs.train_batch(x, augment[slot])
                batch[slot] = (x, y.to(device, non_blocking=True))
            sizes: dict[int, list[int]] = {}
            for slot, (_, y) in batch.items():
                sizes.setdefault(int(y.shape[0]), []).append(slot)
            for size in sorted(sizes, reverse=True):
                members = sizes[size]
                if size < lead.batch_size:
                    for s in members:
                        sums[s] += lone(s, *batch[s])
                        batches[s] += 1
                        tally[s][0] += 1
                        tally[s][1] += size
                    continue
                first = batch[members[0]]
                xs = torch.stack([batch[s][0] if s in members else first[0] for s in range(width)])
                ys = torch.stack([batch[s][1] if s in members else first[1] for s in range(width)])
                mask = None  # every slot takes this step: no selection
                work = frozen
                if len(members) < width:
                    mask = torch.zeros(width, dtype=torch.bool)
                    mask[members] = True
                    mask = mask.to(device)
                    work = {k: (v.clone() if k in buffer_names else v) for k, v in frozen.items()}
                with torch.autocast(device.type, dtype=dtype, enabled=amp):
                    grads, losses = step(params, work, xs, ys)
                losses = losses.detach().double()
                sums += losses if mask is None else torch.where(mask, losses, 0.0)  # x + 0.0 == x
                for s in members:
                    batches[s] += 1
                    tally[s][0] += 1
                    tally[s][1] += size
                apply(mask, members, grads, work)
            for slot in batch:
                if at[slot].on_step is not None:
                    at[slot].on_step()
        read = sums.tolist()
        for slot, total in totals.items():
            if not math.isfinite(read[slot]):
                raise FloatingPointError(f"training loss became {read[slot]} by step "
                                         f"{tally[slot][0]} (slot {slot}, non-finite)")
            total[1] = read[slot] / max(batches[slot], 1)
            total[0] += total[1]
    seconds = time.perf_counter() - start
    for job in jobs:
        _write_back(job, width, params, frozen, velocity, trained, buffer_names)
        job.algo.end_train(())
    return [TrainResult(tally[j.slot][0], tally[j.slot][1], totals[j.slot][0] / max(epochs, 1),
                        totals[j.slot][1], seconds) for j in jobs]


def _write_back(job: EdgeJob, width: int, params: dict, frozen: dict, velocity: dict,
                trained: list[str], buffer_names: list[str]) -> None:
    """The edge's slot of the stacks into its live tensors and its SGD's momentum buffers."""
    model = job.algo.models["model"]
    live_params = dict(model.named_parameters())
    live_buffers = dict(model.named_buffers())
    opt = job.algo.optimizers()[0]
    with torch.no_grad():
        for k in trained:
            live_params[k].copy_(params[k][job.slot])
            if k in velocity:
                opt.state[live_params[k]] = {"momentum_buffer": velocity[k][job.slot].clone()}
        for k in buffer_names:
            live_buffers[k].copy_(frozen[k][job.slot])

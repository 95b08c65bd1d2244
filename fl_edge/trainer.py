"""The one generic local training loop, and evaluation of the personalized model.

Methods never write their own loop: they plug into it through ``EdgeAlgorithm`` hooks.
Batches are gathers of the split's tensors in a seeded order (``ShuffledBatches``), in the
process (gRPC is not fork-safe).

The loop does not know whether it runs DP-SGD: its batches, backward pass and optimizer
step come from a ``LoopSteps`` (``PlainSteps``, or ``PrivateTraining`` under DP-SGD), and
the options a kind of step refuses are refused by it, in ``_check_options``. A concern
that changes how a step is taken (DP-SGD today) plugs in there instead of as branches.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from fedattn_shared.augment import InputPipeline
from fedattn_shared.data.npz import Split, decode_images
from fedattn_shared.methods.base import EdgeAlgorithm
from fedattn_shared.rng import GLOBAL_RNG_LOCK

from .memory import MemoryBackoff, micro_batches, out_of_memory

if TYPE_CHECKING:
    from fedattn_shared.privacy.dp import PrivateTraining

log = logging.getLogger("fl_edge.trainer")


@dataclass
class TrainResult:
    """What one local training did: the steps, samples and losses the edge reports and
    the throughput it monitors."""
    steps: int
    examples: int
    mean_loss: float
    last_epoch_loss: float
    seconds: float
    # With train.clip_grad_norm: the stepped gradients' mean L2 norm before clipping and the
    # steps whose norm exceeded the bound (does the clip act, and how often?).
    grad_norm_mean: float = 0.0
    clipped_steps: int = 0

    @property
    def samples_per_second(self) -> float:
        """Training throughput (0 for an instant round)."""
        return self.examples / self.seconds if self.seconds > 0 else 0.0


@dataclass
class EvalCounts:
    """Counts on one split, summed on the server into global metrics (the edge sends
    counts, never rates, so the server can weigh edges exactly)."""
    split: str
    confusion: np.ndarray  # [true, predicted] counts
    loss_sum: float
    brier_sum: float

    @property
    def total(self) -> int:
        """Samples scored."""
        return int(self.confusion.sum())

    @property
    def correct(self) -> int:
        """Samples whose top prediction is the label."""
        return int(np.trace(self.confusion))

    @property
    def accuracy(self) -> float:
        """The fraction scored correctly (0 on an empty split)."""
        return self.correct / max(self.total, 1)


# Flips the seed of the forked global RNG away from the loader generator's seed: the same
# Mersenne Twister stream would otherwise drive both the data order and dropout.
GLOBAL_STREAM = 1 << 62


def loader_seed(seed: int, round_number: int, edge_id: str) -> int:
    """The seed of one edge's round: its data order and every other random draw of its
    training (see ``train_local``), a pure function of the run seed, round and edge."""
    return (seed * 1_000_003 + round_number * 7919 + zlib.crc32(edge_id.encode())) % (2**63)


#: Offsets the augmentation stream from the loader's (same per-edge-per-round seed, another
#: stream): shuffling and augmentation draw independently.
AUGMENT_STREAM = zlib.crc32(b"fedattn augment")


def augment_generator(seed: int) -> torch.Generator:
    """The CPU generator augmentation draws from, for a ``loader_seed`` value."""
    return torch.Generator().manual_seed((seed + AUGMENT_STREAM) % (2**63))


def clip_gradients(optimizers: list[torch.optim.Optimizer], max_norm: float) -> torch.Tensor:
    """Clip the joint L2 norm of the gradients the optimizers are about to apply (each
    parameter once, however many groups or optimizers hold it) to ``max_norm``; returns the
    norm before clipping. One norm over all of them, as ``clip_grad_norm_`` over a model's
    parameters with a single optimizer."""
    seen: dict[int, torch.Tensor] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    seen.setdefault(id(param), param)
    return torch.nn.utils.clip_grad_norm_(list(seen.values()), max_norm)


# cuBLAS's deterministic workspace setting (the CUDA docs' ":4096:8": 8 buffers of 4 MiB).
CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic_algorithms(mode: bool, warn_only: bool = True) -> None:
    """``torch.use_deterministic_algorithms(mode, warn_only=warn_only)`` without its import
    of ``torch._inductor`` (to set the compiler's own flag), which pulls in
    ``torch._dynamo``: 1-4 s at every edge's first join, for a compiler fedattn never runs.
    The compiler's flag is still set when something in the process has imported it, and has
    the flag (torch 2.4's compiler has none, and refuses to set an unknown one)."""
    torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None and hasattr(inductor, "deterministic"):
        inductor.deterministic = mode


def configure_determinism(deterministic: bool, threads: int, strict: bool = False) -> None:
    """The process-wide settings a bit-identical run needs (``train.deterministic``,
    ``train.threads``), applied by the edge once it has the server's configuration.
    Deterministic algorithms cost nothing measurable on CPU (its kernels are deterministic
    for a fixed thread count). ``strict`` (the edge on CUDA, unless its operator passed
    ``--cuda-nondeterministic-ok``): an op without a deterministic CUDA kernel raises
    instead of warning, so a run claimed bit-identical is; without it such an op only
    warns (and ``warn_only`` also switches off the deterministic kernels some ops have,
    such as the memory-efficient attention backward). On CUDA, cuBLAS picks its reduction
    order per stream workspace unless ``CUBLAS_WORKSPACE_CONFIG`` fixes the workspace
    (read when the first cuBLAS handle is made, so set here, before training; an
    operator's own value is kept). Without determinism cuDNN autotunes its kernels (the
    fastest per shape, possibly another per run). Threads > 0 pin intra-op parallelism: a
    reduction split over another number of threads rounds differently."""
    set_deterministic_algorithms(deterministic, warn_only=not strict)
    # autotuning may pick another kernel per run: only when determinism is not asked for
    torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if threads > 0:
        torch.set_num_threads(threads)


def autocast_dtype(device: torch.device) -> torch.dtype:
    """AMP's half precision on ``device``: bf16 where the GPU has it (sm_80+, Orin) and on
    the CPU, fp16 (with a gradient scaler) on older GPUs."""
    if device.type != "cuda":
        return torch.bfloat16
    try:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.4 (JetPack's) has no emulation to rule out
        native = torch.cuda.is_bf16_supported()
    return torch.bfloat16 if native else torch.float16


def train_local(algo: EdgeAlgorithm, data: Split, epochs: int, batch_size: int, seed: int,
                device: torch.device, progress: bool | None = None, lr: float | None = None,
                amp: bool = False, grad_accum: int = 1,
                privacy: PrivateTraining | None = None, clip_grad_norm: float = 0.0,
                inputs: InputPipeline | None = None,
                augment_rng: torch.Generator | None = None,
                deterministic: bool = True, log_every: float = 0.0,
                memory: MemoryBackoff | None = None, channels_last: bool = False,
                on_step: Callable[[], None] | None = None) -> TrainResult:
    """E local epochs over shuffled batches (the algorithm may add epochs: FedRep's head
    epochs). ``grad_accum`` micro-batches make one optimizer step (for small devices);
    ``amp`` runs the forward pass in half precision (fp16 with a gradient scaler on CUDA,
    bf16 on CPU). ``steps`` counts optimizer steps; an algorithm with ``steps_per_batch``
    K > 1 takes K of them on every batch (pFedMe's inner solve). With ``privacy`` every
    step is DP-SGD's: Poisson-sampled batches, per-sample clipping and noise, then the
    method's ``post_backward``; ``steps`` counts the steps taken (physical batches that
    only accumulate toward a logical one are not steps).

    ``clip_grad_norm`` > 0 clips the gradient each optimizer step applies (after the AMP
    unscale and the method's ``post_backward``, so the bound holds on what is stepped): the
    accumulated gradient once per step under ``grad_accum``, each of a method's
    ``steps_per_batch`` steps. It does not combine with DP-SGD, whose per-sample clipping
    (dp.max_grad_norm) is the only clipping there. ``inputs`` augments every training batch
    (drawing from ``augment_rng``, by default ``augment_generator(seed)``) and resizes it;
    the statistics pass of ``end_train`` is resized, never augmented. Without progress
    bars, ``log_every`` > 0 logs steps, samples/s and the ETA every that many seconds (a
    daemon's log is otherwise silent for a whole epoch).

    ``memory`` (``fl_edge.memory``): the device's limit on samples per pass and its
    back-off on out-of-memory errors (by default none, and an out-of-memory error still
    halves a whole batch and retries). ``channels_last``: on a GPU, 4-D inputs are passed
    channels-last (cuDNN's faster layout for convolutions). ``on_step`` is called after
    every batch (the edge's health: progress is being made).

    ``seed`` (``loader_seed``: per edge and round) drives everything random in the round:
    the data order (``generator``) and, through a forked global torch RNG seeded with it,
    dropout and any method's draws, so a round is a pure function of the seed and the
    state it starts from and leaves the caller's RNG untouched. DP-SGD's noise is not among
    them: it comes from ``privacy``'s own generator. With ``deterministic``
    (``train.deterministic``) rounds of edges sharing a process (fl-sim) take turns, since
    they share the global RNG; an edge alone in its process never waits."""
    devices = [device] if device.type == "cuda" else []
    turn = GLOBAL_RNG_LOCK if deterministic else nullcontext()
    with turn, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed ^ GLOBAL_STREAM)  # not the data order's stream
        steps = privacy if privacy is not None else PlainSteps(device, amp, clip_grad_norm)
        loop = _Loop(device, amp, grad_accum, memory or MemoryBackoff(),
                     channels_last and device.type == "cuda", on_step)
        return _train_local(algo, data, epochs, batch_size, seed, loop, progress, lr, steps,
                            clip_grad_norm, inputs, augment_rng, log_every)


class LoopSteps(Protocol):
    """What the one training loop asks of whatever supplies its steps: the batches, the
    backward pass, the optimizer step, and the options it refuses. ``PlainSteps`` here;
    ``fedattn_shared.privacy.dp.PrivateTraining`` under DP-SGD (Poisson-sampled batches,
    per-sample clipping and noise). The loop itself has no branch on which it is."""

    def check_options(self, amp: bool, grad_accum: int, clip_grad_norm: float) -> None:
        """Refuses the loop options these steps do not combine with."""

    def loader(self, data: Split, batch_size: int, generator: torch.Generator) -> Iterable:
        """The round's batches, ordered by ``generator``."""

    def begin(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Told the method's optimizers before the first batch."""

    def backward(self, loss: torch.Tensor, share: float = 1.0) -> None:
        """The backward pass of one (micro-)batch's loss; ``share`` < 1: the loss is of a
        part of the batch holding that fraction of its samples (out-of-memory splits)."""

    def partial(self) -> None:
        """After a part of a split batch that is not its last (nothing to step yet)."""

    def discard(self) -> bool:
        """Drops what a pass that ran out of memory left behind; True when the step's
        gradients went with it (its earlier micro-batches must be run again)."""

    def empty_batch(self) -> None:
        """Stands in for the backward pass of a batch with no sample."""

    def step(self, post_backward: Callable[[], None]) -> bool:
        """One optimizer step; False when nothing was stepped (an accumulating batch)."""

    def clip_figures(self) -> tuple[float, int]:
        """train.clip_grad_norm's figures: summed pre-clip norms, steps clipped."""



class ShuffledBatches:
    """An epoch's shuffled mini-batches, each one indexing of the split's tensors wherever
    they live (host or device), in the order ``DataLoader(TensorDataset(x, y),
    shuffle=True, generator=generator)`` gives: the same draws from ``generator``, so a seed
    gives the same batches as before (tests/test_trainer.py compares them). Why not the
    DataLoader: it fetches a batch sample by sample and stacks them, one small tensor
    operation per sample on the device when the data lives there; here a batch is one
    gather. No worker processes either way (gRPC is not fork-safe)."""

    def __init__(self, data: Split, batch_size: int, generator: torch.Generator,
                 drop_last: bool, pin: bool = False):
        self.data, self.batch_size, self.generator = data, batch_size, generator
        self.drop_last = drop_last
        # Gather host batches into pinned memory (for a GPU): the copy to the device is then
        # asynchronous; PyTorch's host allocator caches the pinned blocks.
        self.pin = pin and data.x.device.type == "cpu"

    def __len__(self) -> int:
        n = len(self.data)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.data)
        # DataLoader's draws per epoch: its iterator's base seed, the sampler's permutation,
        # and one more permutation its sampler draws when the batch sampler exhausts it.
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        order = torch.randperm(n, generator=self.generator)
        torch.randperm(n, generator=self.generator)
        order = order.to(self.data.x.device)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start : start + self.batch_size]
            if self.pin:
                yield _pinned(self.data.x, index), _pinned(self.data.y, index)
            else:
                yield self.data.x[index], self.data.y[index]


def _pinned(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source[index]`` gathered into page-locked host memory."""
    if not isinstance(source, torch.Tensor):  # images decoded per batch (data/encoded.py)
        return source[index].pin_memory()
    out = torch.empty((len(index), *source.shape[1:]), dtype=source.dtype, pin_memory=True)
    return torch.index_select(source, 0, index, out=out)


class PlainSteps:
    """The loop's steps without DP-SGD: shuffled batches, an AMP gradient scaler (fp16 on
    CUDA only), train.clip_grad_norm on what each step applies. One per local training."""

    def __init__(self, device: torch.device, amp: bool, clip_grad_norm: float):
        fp16 = device.type == "cuda" and autocast_dtype(device) == torch.float16
        self.scaler = torch.amp.GradScaler("cuda", enabled=amp and fp16)
        self.pin = device.type == "cuda"
        self.clip_grad_norm = clip_grad_norm
        self.optimizers: list[torch.optim.Optimizer] = []
        self.norm_sum = 0.0
        self.clipped = 0

    def check_options(self, amp: bool, grad_accum: int, clip_grad_norm: float) -> None:
        """Every option combines with plain steps."""

    def loader(self, data: Split, batch_size: int, generator: torch.Generator) -> Iterable:
        """Shuffled batches from ``generator`` (``ShuffledBatches``)."""
        # A last batch of one sample would break BatchNorm's training-mode statistics.
        drop_last = len(data) % batch_size == 1 and len(data) > 1
        return ShuffledBatches(data, batch_size, generator, drop_last, pin=self.pin)

    def begin(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The method's optimizers, as ``begin_train`` left them."""
        self.optimizers = optimizers

    def backward(self, loss: torch.Tensor, share: float = 1.0) -> None:
        """Scaled under fp16 AMP (the scaler is a no-op otherwise); a part of a split batch
        weighs its share, so the parts' gradients sum to the batch's mean gradient."""
        self.scaler.scale(loss * share if share != 1.0 else loss).backward()

    def partial(self) -> None:
        """Nothing: the parts' gradients accumulate in ``.grad``."""

    def discard(self) -> bool:
        """The step's gradients are dropped (a failed backward may have added part of its
        own): its micro-batches are run again."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return True

    def empty_batch(self) -> None:
        """Never called: a plain loader yields no empty batch."""

    def step(self, post_backward: Callable[[], None]) -> bool:
        """Unscale, the method's gradient post-processing, clip, step, zero: always a step."""
        optimizers = self.optimizers
        for opt in optimizers:
            self.scaler.unscale_(opt)
        post_backward()
        if self.clip_grad_norm:
            norm = float(clip_gradients(optimizers, self.clip_grad_norm))
            self.norm_sum += norm
            self.clipped += norm > self.clip_grad_norm
        for opt in optimizers:
            self.scaler.step(opt)
        self.scaler.update()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        return True

    def clip_figures(self) -> tuple[float, int]:
        """The summed pre-clip norms and the number of steps the clip acted on."""
        return self.norm_sum, self.clipped


def _check_options(algo: EdgeAlgorithm, steps: LoopSteps, amp: bool, grad_accum: int,
                   clip_grad_norm: float) -> None:
    """Every combination of loop options the loop refuses, in one place."""
    repeats = algo.schedule.steps_per_batch
    if repeats > 1 and grad_accum > 1:
        raise ValueError(f"{algo.method.name} takes {repeats} optimizer steps per batch; "
                         "that does not combine with gradient accumulation (grad_accum > 1)")
    steps.check_options(amp, grad_accum, clip_grad_norm)
    if not 0 <= clip_grad_norm < float("inf"):
        raise ValueError(f"clip_grad_norm must be >= 0 and finite, got {clip_grad_norm}")


@dataclass
class _Tally:
    steps: int = 0
    examples: int = 0


@dataclass
class _Loop:
    """How this device runs the loop: where, in what precision, within what memory."""
    device: torch.device
    amp: bool
    grad_accum: int
    memory: MemoryBackoff
    channels_last: bool = False
    on_step: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.dtype = autocast_dtype(self.device)


class LossBook:
    """The epoch's summed batch losses and the finiteness check. On the CPU each loss is
    read as it comes (reading a CPU tensor costs nothing; the figures are the ones the
    edge always reported). On a GPU a read waits for the GPU to finish (a host sync per
    step idles it between steps): the sum (float64, as Python's) and a non-finite flag
    stay on the device and are read every ``CHECK_EVERY`` batches and at the epoch's end."""

    CHECK_EVERY = 64

    def __init__(self, device: torch.device):
        self.on_device = device.type != "cpu"
        self.total = torch.zeros((), dtype=torch.float64, device=device) if self.on_device else 0.0
        self.bad = torch.zeros((), dtype=torch.bool, device=device) if self.on_device else None
        self.batches = 0

    def check(self, loss: torch.Tensor, step: int) -> None:
        """Raise FloatingPointError on a non-finite loss (on a GPU: flag it, read later)."""
        if not self.on_device:
            if not torch.isfinite(loss):
                raise FloatingPointError(f"training loss became {loss.item()} at step {step}")
        else:
            torch.logical_or(self.bad, ~torch.isfinite(loss.detach()), out=self.bad)

    def add(self, loss: torch.Tensor, step: int) -> None:
        """Books one batch's loss."""
        self.batches += 1
        if not self.on_device:
            self.total += float(loss.detach())
            return
        self.total += loss.detach().double()
        if self.batches % self.CHECK_EVERY == 0:
            self.read(step)

    def read(self, step: int) -> float:
        """The mean batch loss so far (one host read on a GPU), after the finiteness check."""
        if self.on_device:
            if bool(self.bad):
                raise FloatingPointError(f"training loss became {float(self.total)} by step "
                                         f"{step} (non-finite)")
            return float(self.total) / max(self.batches, 1)
        return self.total / max(self.batches, 1)


def _train_local(algo: EdgeAlgorithm, data: Split, epochs: int, batch_size: int, seed: int,
                 loop: _Loop, progress: bool | None, lr: float | None, steps: LoopSteps,
                 clip_grad_norm: float, inputs: InputPipeline | None,
                 augment_rng: torch.Generator | None, log_every: float = 0.0) -> TrainResult:
    device = loop.device
    _check_options(algo, steps, loop.amp, loop.grad_accum, clip_grad_norm)
    inputs = inputs or InputPipeline()
    augment_rng = augment_rng if augment_rng is not None else augment_generator(seed)
    epochs = algo.schedule.epochs(epochs)
    generator = torch.Generator().manual_seed(seed)
    loader = steps.loader(data, batch_size, generator)
    show = sys.stderr.isatty() if progress is None else progress
    algo.train_mode()
    algo.num_examples = len(data)
    algo.begin_train()
    optimizers = algo.optimizers()
    if algo.method.train.optimizer_state == "reset":
        # A fresh optimizer each round, as the papers: torch builds SGD's momentum buffers
        # and Adam's moments lazily from an empty state, so clearing it is exactly a new
        # optimizer (and keeps the objects DP-SGD has wrapped).
        for opt in optimizers:
            opt.state.clear()
    if lr is not None:
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
    steps.begin(optimizers)
    tally = _Tally()
    total_loss = epoch_loss = 0.0
    start = time.perf_counter()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    for epoch in range(epochs):
        algo.schedule.begin_epoch(epoch)
        batches = tqdm(loader, desc=f"epoch {epoch + 1}/{epochs}", leave=False, disable=not show)
        if not show and log_every > 0:
            batches = _logged(batches, tally, epoch, epochs, start, log_every)
        epoch_loss = _epoch(algo, batches, steps, tally, loop, inputs, augment_rng)
        total_loss += epoch_loss
        if not show:
            log.info("epoch %d/%d loss=%.4f", epoch + 1, epochs, epoch_loss)
    algo.end_train((inputs.eval_batch(x), y) for x, y in _batches(data, batch_size, device))
    seconds = time.perf_counter() - start
    norm_sum, clipped = steps.clip_figures()
    return TrainResult(tally.steps, tally.examples, total_loss / max(epochs, 1), epoch_loss,
                       seconds, norm_sum / max(tally.steps, 1), clipped)


def _logged(batches: Iterable, tally: _Tally, epoch: int, epochs: int, start: float,
            every: float) -> Iterator:
    """``batches``, logging progress every ``every`` seconds: steps, samples/s and the ETA
    of the round's training (from this epoch's pace; none where the loader has no length,
    as DP-SGD's Poisson batches)."""
    try:
        per_epoch = len(batches)
    except TypeError:
        per_epoch = 0
    epoch_start = last = time.perf_counter()
    for index, batch in enumerate(batches):
        yield batch
        now = time.perf_counter()
        if now - last < every:
            continue
        last = now
        rate = tally.examples / max(now - start, 1e-9)
        eta = ""
        if per_epoch:
            left = (epochs - epoch) * per_epoch - (index + 1)
            eta = f", ETA {left * (now - epoch_start) / (index + 1):.0f}s"
        log.info("epoch %d/%d: batch %d%s, %d steps, %.1f samples/s%s", epoch + 1, epochs,
                 index + 1, f"/{per_epoch}" if per_epoch else "", tally.steps, rate, eta)


def _epoch(algo: EdgeAlgorithm, batches: Iterable, steps: LoopSteps, tally: _Tally,
           loop: _Loop, inputs: InputPipeline, augment_rng: torch.Generator) -> float:
    """One pass over the loader; returns the epoch's mean batch loss."""
    repeats = algo.schedule.steps_per_batch
    device, grad_accum = loop.device, loop.grad_accum
    book = LossBook(device)
    pending = 0
    earlier: list[tuple[torch.Tensor, torch.Tensor]] = []  # the step's earlier micro-batches
    for x, y in batches:
        # uint8 images travel as uint8 (a quarter of the bytes) and are decoded there
        x = decode_images(x.to(device, non_blocking=True))
        y = y.to(device, non_blocking=True)
        empty = y.shape[0] == 0  # Poisson sampling (DP-SGD) may draw no sample
        if not empty and not inputs.identity:
            x = inputs.train_batch(x, augment_rng)
        if loop.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        for _ in range(repeats):
            if empty:
                steps.empty_batch()
            else:
                loss = _fitted(algo, steps, x, y, loop, book, tally.steps, earlier)
                if grad_accum > 1:
                    earlier.append((x, y))
            pending += 1
            if pending == grad_accum:
                tally.steps += steps.step(algo.post_backward)
                pending = 0
                earlier.clear()
        algo.schedule.after_batch()
        if loop.on_step is not None:
            loop.on_step()
        if empty:
            continue
        book.add(loss, tally.steps)
        tally.examples += int(y.shape[0])
    if pending:
        tally.steps += steps.step(algo.post_backward)
    return book.read(tally.steps)


class _Progress:
    """How far a batch's pass got: samples whose gradients are in, and their summed loss."""

    def __init__(self) -> None:
        self.done = 0
        self.loss: torch.Tensor | None = None


def _fitted(algo: EdgeAlgorithm, steps: LoopSteps, x: torch.Tensor, y: torch.Tensor,
            loop: _Loop, book: LossBook, step: int,
            earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The forward and backward pass of one batch within the device's memory
    (``fl_edge.memory``): in parts of at most ``loop.memory.limit`` samples; on an
    out-of-memory error the limit is halved and the pass retried from what is safely in
    (DP-SGD: the parts already clipped into the sum; plain steps: nothing, the step's
    earlier micro-batches are run again). Returns the batch's mean loss."""
    progress = _Progress()
    replay: list[tuple[torch.Tensor, torch.Tensor]] = []
    while True:
        try:
            for rx, ry in replay:
                _pass(algo, steps, rx, ry, loop, book, step, _Progress())
            return _pass(algo, steps, x, y, loop, book, step, progress)
        except (RuntimeError, MemoryError) as err:
            if not out_of_memory(err):
                raise
        # Out of the except block: the error's frames (holding the failed pass's tensors)
        # are gone before the retry allocates.
        loop.memory.shrink(int(y.shape[0]) - progress.done, loop.device)
        if steps.discard():
            progress = _Progress()
            replay = list(earlier)


def _pass(algo: EdgeAlgorithm, steps: LoopSteps, x: torch.Tensor, y: torch.Tensor, loop: _Loop,
          book: LossBook, step: int, progress: _Progress) -> torch.Tensor:
    """Forward and backward of samples ``progress.done`` onward, in parts (one part, the
    batch itself, unless the device's limit splits it)."""
    n = int(y.shape[0])
    parts = micro_batches(n, loop.memory.limit, progress.done)
    if len(parts) == 1 and progress.done == 0:
        with torch.autocast(loop.device.type, dtype=loop.dtype, enabled=loop.amp):
            loss = algo.training_step((x, y))
        book.check(loss, step)
        steps.backward(loss / loop.grad_accum)
        return loss
    for i, part in enumerate(parts):
        with torch.autocast(loop.device.type, dtype=loop.dtype, enabled=loop.amp):
            loss = algo.training_step((x[part], y[part]))
        book.check(loss, step)
        share = (part.stop - part.start) / n
        steps.backward(loss / loop.grad_accum, share)
        if i < len(parts) - 1:
            steps.partial()
        weighted = loss.detach().float() * share
        progress.loss = weighted if progress.loss is None else progress.loss + weighted
        progress.done = part.stop
    return progress.loss


def _batches(data: Split, batch_size: int, device: torch.device):
    """In order; a last batch of one sample joins the one before (train-mode BatchNorm
    cannot normalise a single sample)."""
    n = len(data)
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else n
        yield decode_images(data.x[start:end].to(device)), data.y[start:end].to(device)


@torch.no_grad()
def evaluate(algo: EdgeAlgorithm, data: Split, split: str, num_classes: int, batch_size: int,
             device: torch.device, inputs: InputPipeline | None = None) -> EvalCounts:
    """Counts on a split as it is: ``inputs`` only resizes (evaluation is never augmented)."""
    inputs = inputs or InputPipeline()
    algo.eval_mode()
    confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
    loss_sum = brier_sum = 0.0
    for x, y in _batches(data, batch_size, device):
        logits = algo.predict(inputs.eval_batch(x)).float()
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        probs = logits.softmax(dim=1)
        onehot = F.one_hot(y, num_classes).float()
        brier_sum += float((probs - onehot).square().sum())
        pred = logits.argmax(dim=1)
        np.add.at(confusion, (y.cpu().numpy(), pred.cpu().numpy()), 1)
    return EvalCounts(split, confusion, loss_sum, brier_sum)


@contextmanager
def recalibrated_bn(algo: EdgeAlgorithm, data: Split, batch_size: int, device: torch.device,
                    inputs: InputPipeline | None = None) -> Iterator[bool]:
    """Within the block, every BatchNorm layer of ``algo``'s models holds running statistics
    recomputed on ``data`` (``train.bn_recalibrated_eval``); on leaving, the layers'
    buffers and momentum are put back bit for bit, so the edge's state is as before. Yields
    False, changing nothing, for models without BatchNorm running statistics.

    Why: with BN statistics averaged across edges (FedAvg), an edge's shared statistics
    describe the federation's mix of features, not its own; scoring again after each edge
    recomputes them on its own data, weights untouched, measures how much of the error is
    the statistics alone. Recomputed as PyTorch's cumulative average (``momentum=None``:
    every batch weighs the same), one pass in order, no augmentation (``inputs`` only
    resizes), no gradient; only the BN layers are in train mode (dropout stays off)."""
    layers = [m for model in algo.models.values() for m in model.modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not layers:
        yield False
        return
    inputs = inputs or InputPipeline()
    saved = [(m.momentum, {k: b.clone() for k, b in m.named_buffers(recurse=False)})
             for m in layers]
    try:
        algo.eval_mode()
        for m in layers:
            m.reset_running_stats()
            m.momentum = None
            m.train()
        with torch.no_grad():
            for x, _ in _batches(data, batch_size, device):
                algo.predict(inputs.eval_batch(x))
        algo.eval_mode()
        yield True
    finally:
        with torch.no_grad():
            for m, (momentum, buffers) in zip(layers, saved, strict=True):
                m.momentum = momentum
                for name, value in buffers.items():
                    getattr(m, name).copy_(value)

"""Central pretraining for the ANFR bench's ``--pretrained`` protocol: the stand-in for the
paper's ImageNet weights, which this machine cannot download.

Why it exists: from scratch, timm zero-initialises the last layer of every residual branch
(an NF block's conv3 gain), so an ANFR block starts as exactly the NF-ResNet function and
its channel-attention module sees a constant input and gets no gradient; in a short CPU
federation its gates never leave 0.5 and "ANFR vs NF-ResNet" tests nothing. The paper
starts from pretrained weights, whose residual branches are live. We make such weights
locally: the compact model trained centrally on CIFAR-10 training images that no
federation of the bench uses.

Data: ``data_batch_2..5`` (training images 10,000-49,999). ``fl-partition --limit N``
keeps the first N training images and draws ``global_test`` from ``test_batch``, so with
``--limit`` <= 10,000 the pretraining images are disjoint from every edge's training and
local test split and from the global test set.

ANFR's file is NF-ResNet's, plus the attention modules' fresh seeded initialisation
(their only tensors NF-ResNet lacks): at the start an ANFR block then computes the
pretrained NF-ResNet function exactly (gate 0.5 x attn_gain 2.0 only where the SE input is
constant; elsewhere the gates already vary), so both start from the same features.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

PRETRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(2, 6))
FIRST_PRETRAIN_IMAGE = 10_000  # data_batch_1 (images 0-9,999) stays for the federations


def load_pretrain_images(cifar10: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 training images 10,000-49,999, normalised as the edges' loader does
    (x / 255 - 0.5) / 0.5."""
    raw = np.concatenate([np.fromfile(cifar10 / name, np.uint8).reshape(-1, 3073)
                          for name in PRETRAIN_FILES])
    x = torch.from_numpy(raw[:, 1:].reshape(-1, 3, 32, 32).copy()).float().div_(255).sub_(0.5).div_(0.5)
    return x, torch.from_numpy(raw[:, 0].astype(np.int64))


def parameter_groups(model: torch.nn.Module, decay: float,
                     attention_decay: bool) -> list[dict]:
    """SGD parameter groups: weight decay ``decay`` on everything, or with
    ``attention_decay`` False none on the channel-attention modules' tensors (decay shrank
    the SE weights in the first pretraining, docs/methods/anfr.md)."""
    from fedattn_shared.methods.split import attention_types

    attention = {id(p) for m in model.modules() if isinstance(m, attention_types())
                 for p in m.parameters()}
    rest = [p for p in model.parameters() if id(p) not in attention]
    gates = [p for p in model.parameters() if id(p) in attention]
    groups = [{"params": rest, "weight_decay": decay},
              {"params": gates, "weight_decay": decay if attention_decay else 0.0}]
    return [g for g in groups if g["params"]]


def pretrain(model_name: str, cifar10: Path, out: Path | None, epochs: int, seed: int = 0,
             lr: float = 0.05, batch_size: int = 64, max_steps: int = 0, log_every: int = 0,
             attention_decay: bool = True) -> dict[str, float]:
    """Train ``model_name`` (a registry name, 10 classes, 32 px) for ``epochs`` over the
    pretraining images: SGD momentum 0.9, weight decay 5e-4 (``attention_decay`` False:
    none on the attention modules), cosine lr over the epochs, crop-flip, gradient clip
    1.0; deterministic for a seed. Writes the state dict to ``out`` (safetensors, timm's
    keys; None: nothing written) and returns loss and accuracy on the last epoch.

    ``max_steps`` > 0 stops after that many steps (the cosine schedule still spans the
    epochs: a cheap look at the start of the same run); ``log_every`` > 0 prints, every so
    many steps, the attention gates' class-to-class spread over those steps' training
    batches (``gate_class_std``, the figure the ANFR edges report) and the mean gate."""
    from fedattn_shared.augment import augment_batch
    from fedattn_shared.methods.anfr import GateSpread
    from fedattn_shared.models.registry import build_model
    from fedattn_shared.state import save_tensors

    torch.manual_seed(seed)
    model = build_model(model_name, 10, 3, 32)
    x, y = load_pretrain_images(cifar10)
    generator = torch.Generator().manual_seed(seed)
    per_epoch = len(x) // batch_size
    steps = epochs * per_epoch
    opt = torch.optim.SGD(parameter_groups(model, 5e-4, attention_decay), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gates = GateSpread(model, 10) if log_every else None
    model.train()
    started, loss_sum, correct, seen, step = time.time(), 0.0, 0, 0, 0
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        loss_sum, correct, seen = 0.0, 0, 0
        for i in range(per_epoch):
            idx = order[i * batch_size:(i + 1) * batch_size]
            xb = augment_batch(x[idx], "crop-flip", generator)
            if gates is not None:
                gates.count(y[idx])
                gates.labels = y[idx]
            logits = model(xb)
            if gates is not None:
                gates.labels = None
            loss = F.cross_entropy(logits, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_sum += float(loss.detach()) * len(idx)
            correct += int((logits.argmax(1) == y[idx]).sum())
            seen += len(idx)
            step += 1
            if gates is not None and step % log_every == 0:
                f = gates.figures()  # empty for a model without attention
                shown = (f"gate_class_std {f['gate_class_std']:.4f} gate_mean "
                         f"{f['gate_mean']:.3f} " if f else "")
                print(f"  {model_name} step {step}: {shown}loss {loss_sum / seen:.3f} "
                      f"acc {correct / seen:.3f} ({time.time() - started:.0f} s)", flush=True)
                gates.reset()
            if max_steps and step >= max_steps:
                break
        print(f"  pretrain {model_name} epoch {epoch + 1}/{epochs}: loss {loss_sum / seen:.3f} "
              f"train acc {correct / seen:.3f} ({time.time() - started:.0f} s)", flush=True)
        if max_steps and step >= max_steps:
            break
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_tensors(out, {k: v.detach().contiguous() for k, v in model.state_dict().items()})
    return {"loss": loss_sum / seen, "accuracy": correct / seen, "seconds": time.time() - started}


def graft(source: Path, model_name: str, out: Path, seed: int = 0) -> list[str]:
    """``model_name`` (seeded fresh) with every tensor of ``source`` it shares by name and
    shape; the rest (ANFR's attention modules) keep the fresh initialisation. Writes
    ``out`` and returns the names of the fresh tensors. Refuses a source tensor the model
    has no place for, so a mismatch of families cannot pass silently."""
    from fedattn_shared.models.registry import build_model
    from fedattn_shared.state import load_tensors, save_tensors

    torch.manual_seed(seed)
    state = build_model(model_name, 10, 3, 32).state_dict()
    tensors, _ = load_tensors(source)
    misfits = [k for k, v in tensors.items() if k not in state or state[k].shape != v.shape]
    if misfits:
        raise ValueError(f"{source}: tensors {model_name} has no place for: {misfits[:5]}")
    fresh = sorted(set(state) - set(tensors))
    state.update(tensors)
    save_tensors(out, {k: v.detach().contiguous() for k, v in state.items()})
    return fresh


def weights_file(folder: Path, model_name: str, epochs: int, attention_decay: bool,
                 seed: int = 0) -> Path:
    """Where a pretraining run's weights go (bench/anfr.py --pretrained reads the same)."""
    nowd = "" if attention_decay else "-attn-nowd"
    return folder / f"{model_name}-e{epochs}{nowd}-s{seed}.safetensors"


def main() -> None:
    """``bench/anfr_pretrain.py probe``: the cheap check of which model form's gates move —
    the first ``--steps`` steps of the pretraining run of each ``--models``, printing the
    gates' class-to-class spread every ``--log-every`` steps; writes nothing.
    ``bench/anfr_pretrain.py pretrain --out DIR``: the whole run, gates logged the same
    way, weights written where ``bench/anfr.py --pretrained EPOCHS --out`` looks for them
    (``DIR`` = its ``--out``/pretrained), so the bench reuses them."""
    import argparse

    from _harness import SHARED_DATA

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("command", choices=["probe", "pretrain"])
    p.add_argument("--models", nargs="+", default=["anfr-se-compact", "anfr-se-compact-skipinit"])
    p.add_argument("--steps", type=int, default=300, help="probe: steps to run")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--epochs", type=int, default=3, help="the schedule's length (cosine)")
    p.add_argument("--no-attention-decay", action="store_true",
                   help="no weight decay on the attention modules' tensors")
    p.add_argument("--out", type=Path, help="pretrain: the folder for the weights")
    p.add_argument("--seed", type=int, default=0, help="the pretraining run's seed")
    p.add_argument("--cifar10", type=Path,
                   default=SHARED_DATA / "cifar-10" / "cifar-10-batches-bin")
    args = p.parse_args()
    if args.command == "pretrain" and args.out is None:
        p.error("pretrain needs --out")
    decay = not args.no_attention_decay
    for name in args.models:
        out = (weights_file(args.out, name, args.epochs, decay, args.seed)
               if args.command == "pretrain" else None)
        figures = pretrain(name, args.cifar10, out, args.epochs, seed=args.seed,
                           max_steps=args.steps if args.command == "probe" else 0,
                           log_every=args.log_every, attention_decay=decay)
        print(f"  {name}: {figures} -> {out}", flush=True)


if __name__ == "__main__":
    main()

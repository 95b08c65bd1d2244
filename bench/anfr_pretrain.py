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


def pretrain(model_name: str, cifar10: Path, out: Path, epochs: int, seed: int = 0,
             lr: float = 0.05, batch_size: int = 64) -> dict[str, float]:
    """Train ``model_name`` (a registry name, 10 classes, 32 px) for ``epochs`` over the
    pretraining images: SGD momentum 0.9, weight decay 5e-4, cosine lr, crop-flip,
    gradient clip 1.0; deterministic for a seed. Writes the state dict to ``out``
    (safetensors, timm's keys) and returns loss and accuracy on the last epoch."""
    from fedattn_shared.augment import augment_batch
    from fedattn_shared.models.registry import build_model
    from fedattn_shared.state import save_tensors

    torch.manual_seed(seed)
    model = build_model(model_name, 10, 3, 32)
    x, y = load_pretrain_images(cifar10)
    generator = torch.Generator().manual_seed(seed)
    steps = epochs * (len(x) // batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    model.train()
    started, loss_sum, correct, seen = time.time(), 0.0, 0, 0
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        loss_sum, correct, seen = 0.0, 0, 0
        for i in range(len(x) // batch_size):
            idx = order[i * batch_size:(i + 1) * batch_size]
            xb = augment_batch(x[idx], "crop-flip", generator)
            logits = model(xb)
            loss = F.cross_entropy(logits, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_sum += float(loss.detach()) * len(idx)
            correct += int((logits.argmax(1) == y[idx]).sum())
            seen += len(idx)
        print(f"  pretrain {model_name} epoch {epoch + 1}/{epochs}: loss {loss_sum / seen:.3f} "
              f"train acc {correct / seen:.3f} ({time.time() - started:.0f} s)", flush=True)
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

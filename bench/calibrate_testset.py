"""Is the calibration's test set easier than CIFAR-10's test distribution?

Why: ``bench/calibrate.py`` scores every round on 860 images (the first 86 of each class
of the official test set: the copy in ../shared/data holds only its first 1,000 records),
where the published table scores 10,000. A random subset of 860 adds about 1.6 points of
noise to a read; it can also sit above or below the distribution as a whole, and every
read of every row then carries that offset. The 9,000 missing test records cannot be read
here, but CIFAR-10's training and test images are drawn alike, so held-out training images
stand in for the distribution: train the calibration's model centrally on the training
images 10,000-49,999, and score it after every epoch on both the 860 test images and the
10,000 held-out training images (data_batch_1). A subset that is easier than the
distribution scores above the held-out images at every epoch, by more than their
sampling noise.

The training is the calibration's local step: ``niid-cnn``, SGD lr 0.01 momentum 0.9
weight decay 1e-5, batch 64, crop + flip through the system's input pipeline
(``InputPipeline``), seeded. Each seed is a separate model.

    .venv/bin/python bench/calibrate_testset.py --epochs 30 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _harness import SHARED_DATA

CIFAR10 = SHARED_DATA / "cifar-10" / "cifar-10-batches-bin"
HELD_OUT = 10_000  # data_batch_1: never trained on here


def load(cifar10: Path, per_class: int):
    """(train x, train y) for images 10,000-49,999; (held-out x, y) for 0-9,999; (test x,
    y): the calibration's test set, as fl-partition selects it."""
    from fedattn_shared.data.partition import select_global_test
    from fedattn_shared.data.sources import load_source

    data = load_source(cifar10)  # uint8 (N, H, W, C), as fl-partition reads it
    gt = select_global_test(data, per_class, 10)
    x = torch.from_numpy(data.train_x).permute(0, 3, 1, 2).contiguous()
    y = torch.from_numpy(data.train_y.astype(np.int64))
    tx = torch.from_numpy(gt.x).permute(0, 3, 1, 2).contiguous()
    return (x[HELD_OUT:], y[HELD_OUT:]), (x[:HELD_OUT], y[:HELD_OUT]), \
        (tx, torch.from_numpy(gt.y.astype(np.int64)))


@torch.no_grad()
def accuracy(model, x: torch.Tensor, y: torch.Tensor, inputs) -> float:
    from fedattn_shared.data.npz import decode_images

    model.eval()
    correct = 0
    for start in range(0, len(y), 1000):
        logits = model(inputs.eval_batch(decode_images(x[start:start + 1000])))
        correct += int((logits.argmax(1) == y[start:start + 1000]).sum())
    model.train()
    return 100.0 * correct / len(y)


def run_seed(seed: int, epochs: int, train, held, test) -> list[tuple[float, float]]:
    from fedattn_shared.augment import InputPipeline
    from fedattn_shared.data.npz import decode_images
    from fedattn_shared.models import build_model

    torch.manual_seed(seed)
    model = build_model("niid-cnn", 10, 3, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)
    inputs = InputPipeline("crop-flip")
    order, augment = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    x, y = train
    reads = []
    for epoch in range(1, epochs + 1):
        started = time.time()
        perm = torch.randperm(len(y), generator=order)
        for start in range(0, len(y), 64):
            idx = perm[start:start + 64]
            batch = inputs.train_batch(decode_images(x[idx]), augment)
            loss = F.cross_entropy(model(batch), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        reads.append((accuracy(model, *test, inputs), accuracy(model, *held, inputs)))
        print(f"  seed {seed} epoch {epoch:2d}: test subset {reads[-1][0]:.2f}  held-out "
              f"training images {reads[-1][1]:.2f}  ({time.time() - started:.0f} s)", flush=True)
    return reads


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--test-per-class", type=int, default=86)
    p.add_argument("--from-epoch", type=int, default=10,
                   help="the summary averages the epochs from this one on (past the steep start)")
    p.add_argument("--cifar10", type=Path, default=CIFAR10)
    args = p.parse_args()
    if not args.cifar10.exists():
        print(f"bench/calibrate_testset.py: {args.cifar10} is missing (set FEDATTN_DATA or "
              "pass --cifar10): skipped", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    train, held, test = load(args.cifar10, args.test_per_class)
    n_test, n_held = len(test[1]), len(held[1])
    print(f"niid-cnn trained centrally on {len(train[1])} CIFAR-10 training images "
          f"(10,000-49,999), SGD lr 0.01 momentum 0.9 wd 1e-5 batch 64, crop-flip; scored on "
          f"the calibration's {n_test} test images and on {n_held} held-out training images")
    diffs = []
    for seed in args.seeds:
        reads = run_seed(seed, args.epochs, train, held, test)
        later = reads[args.from_epoch - 1:]
        d = [t - h for t, h in later]
        diffs.append(statistics.mean(d))
        print(f"seed {seed}: epochs {args.from_epoch}-{args.epochs}: test subset "
              f"{statistics.mean(t for t, _ in later):.2f}, held-out "
              f"{statistics.mean(h for _, h in later):.2f}, subset - held-out "
              f"{statistics.mean(d):+.2f} (per epoch {min(d):+.2f} .. {max(d):+.2f})", flush=True)
    # One read's sampling noise at ~65 %: the subset's binomial standard error dominates.
    se = 100 * math.sqrt(0.65 * 0.35 * (1 / n_test + 1 / n_held))
    spread = f" ± {statistics.stdev(diffs):.2f} over seeds" if len(diffs) > 1 else ""
    print(f"subset - held-out, mean over seeds {statistics.mean(diffs):+.2f}{spread}; "
          f"one read's standard error at 65 %: {se:.2f} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())

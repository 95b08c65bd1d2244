"""The edge's local training throughput against a plain PyTorch loop on the same device.

Issue #24 asks that a federation on a GPU train at >= 0.8x the speed of a plain loop, so
that GPU time goes to training, not to the edge's own bookkeeping. Both sides train the
same architecture (built from the registry, same initial weights) on the same tensors with
the same optimizer (SGD, lr 0.05, momentum 0.9), batch size and number of epochs:

  plain: ``for idx in randperm(n).split(B): loss = CE(model(x[idx]), y[idx]); backward;
         step; zero_grad`` - nothing else;
  edge:  ``fl_edge.trainer.train_local`` with a FedAvg edge algorithm - fl-edge's loop
         (seeded data order, forked RNG, finite-loss check, loss bookkeeping, the
         statistics pass of ``end_train``, AMP and clipping switches), as a round runs it.

Both are timed on the data where it lives (``--data-on``: the host, copied batch by batch as
a real edge does, or the device, copied once), alternating plain/edge over ``--reps``
repetitions after one warm-up of each; the best repetition of each is compared (the one
least disturbed by the machine's other work). Each side's CPU time (the process's, over
the same repetition) is compared too: on a CPU the edge's bookkeeping must cost no CPU
time beyond the bare loop's (ratio 0.99-1.01). The images are random tensors of the
dataset's shape (``--image-size`` overrides the side: small on a CPU to keep it short):
throughput does not depend on their content, and the bench then needs no dataset. Figures
are printed (and written with ``--json``), never asserted.

    .venv/bin/python bench/edge_throughput.py --models mobilenet-v3-small resnet18-cifar \
        --image-size 32 --images 512 --reps 5                      # CPU
    .venv/bin/python bench/edge_throughput.py --device cuda --models mobilenet-v3-small \
        resnet18-cifar --images 10000 --batch-size 64 --data-on host device [--amp] \
        [--deterministic] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fedattn_shared.config import TrainConfig
from fedattn_shared.data.npz import Split
from fedattn_shared.methods import MethodContext, load_method
from fl_edge.trainer import autocast_dtype, configure_determinism, train_local

# The shape of each model's input (channels, side): MNIST for the MNIST backbones.
SHAPES = {"lenet-bn": (1, 28), "se-cnn": (1, 28)}
CIFAR = (3, 32)


@dataclass
class Setup:
    model: str
    images: int
    batch_size: int
    epochs: int
    device: torch.device
    data_on: str
    amp: bool
    image_size: int | None = None


@dataclass
class Timing:
    """One side's best repetition: wall seconds and the process's CPU seconds."""
    wall: float
    cpu: float


def edge_algorithm(setup: Setup, channels: int, side: int):
    """A FedAvg edge as fl-edge builds it, on ``setup.device``."""
    cls = load_method("fedavg")
    train = TrainConfig(model=setup.model, lr=0.05, momentum=0.9, in_channels=channels,
                        image_size=side)
    method = cls(MethodContext(train, cls.Params()))
    torch.manual_seed(0)
    models = method.build_models()
    return method.edge({k: m.to(setup.device) for k, m in models.items()}, setup.device)


def data(setup: Setup, channels: int, side: int) -> Split:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(setup.images, channels, side, side, generator=g)
    y = torch.randint(0, 10, (setup.images,), generator=g)
    if setup.data_on == "device":
        x, y = x.to(setup.device), y.to(setup.device)
    return Split(x, y)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_epochs(model: torch.nn.Module, split: Split, setup: Setup) -> Timing:
    """Wall and CPU seconds for ``setup.epochs`` epochs of the plain loop."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    g = torch.Generator().manual_seed(1)
    dtype = autocast_dtype(setup.device)
    scaler = torch.amp.GradScaler("cuda", enabled=setup.amp and dtype == torch.float16
                                  and setup.device.type == "cuda")
    sync(setup.device)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(setup.epochs):
        for idx in torch.randperm(len(split), generator=g).split(setup.batch_size):
            idx = idx.to(split.x.device)
            x = split.x[idx].to(setup.device, non_blocking=True)
            y = split.y[idx].to(setup.device, non_blocking=True)
            with torch.autocast(setup.device.type, dtype=dtype, enabled=setup.amp):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    sync(setup.device)
    return Timing(time.perf_counter() - start, time.process_time() - cpu)


def edge_epochs(algo, split: Split, setup: Setup) -> Timing:
    """Wall and CPU seconds for ``setup.epochs`` epochs of fl-edge's loop, as a round runs
    it (on a GPU with its channels-last inputs)."""
    sync(setup.device)
    start, cpu = time.perf_counter(), time.process_time()
    train_local(algo, split, setup.epochs, setup.batch_size, seed=1, device=setup.device,
                progress=False, amp=setup.amp, channels_last=True)
    sync(setup.device)
    return Timing(time.perf_counter() - start, time.process_time() - cpu)


def measure(setup: Setup, reps: int) -> tuple[Timing, Timing]:
    """(plain, edge), each the best (by wall time) of ``reps`` alternating runs."""
    channels, side = SHAPES.get(setup.model, CIFAR)
    side = setup.image_size or side
    split = data(setup, channels, side)
    algo = edge_algorithm(setup, channels, side)
    plain_model = edge_algorithm(setup, channels, side).models["model"]
    best_plain = best_edge = Timing(float("inf"), float("inf"))
    for rep in range(reps + 1):  # the first of each warms caches and the allocator up
        p, e = plain_epochs(plain_model, split, setup), edge_epochs(algo, split, setup)
        if rep:
            best_plain = min(best_plain, p, key=lambda t: t.wall)
            best_edge = min(best_edge, e, key=lambda t: t.wall)
    return best_plain, best_edge


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mobilenet-v3-small", "resnet18-cifar"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--image-size", type=int, default=None,
                   help="image side (default: the dataset's: 28 for MNIST models, 32 else)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--data-on", nargs="+", choices=["host", "device"], default=["host"])
    p.add_argument("--amp", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="train.deterministic's settings for both loops (fl-edge's default; "
                        "strict on CUDA: an op without a deterministic kernel raises)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    configure_determinism(args.deterministic, args.threads,
                          strict=args.deterministic and device.type == "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"edge loop vs plain loop, {name}, {args.threads} thread(s), "
          f"{args.images} images x {args.epochs} epoch(s), batch {args.batch_size}, "
          f"amp {args.amp}, deterministic {args.deterministic}, best of {args.reps}")
    print(f"{'model':<22} {'data on':<8} {'plain img/s':>12} {'edge img/s':>11} "
          f"{'edge/plain':>10} {'plain CPU s':>11} {'edge CPU s':>10} {'CPU edge/plain':>14}")
    rows = []
    for model in args.models:
        for where in args.data_on:
            setup = Setup(model, args.images, args.batch_size, args.epochs, device, where,
                          args.amp, args.image_size)
            plain, edge = measure(setup, args.reps)
            samples = setup.images * setup.epochs
            row = {**{k: v for k, v in asdict(setup).items() if k != "device"},
                   "device": name, "deterministic": args.deterministic,
                   "plain_images_per_s": samples / plain.wall, "edge_images_per_s": samples / edge.wall,
                   "speed_ratio": plain.wall / edge.wall, "plain_cpu_s": plain.cpu,
                   "edge_cpu_s": edge.cpu, "cpu_ratio": edge.cpu / plain.cpu}
            rows.append(row)
            print(f"{model:<22} {where:<8} {row['plain_images_per_s']:>12.1f} "
                  f"{row['edge_images_per_s']:>11.1f} {row['speed_ratio']:>10.3f} "
                  f"{plain.cpu:>11.2f} {edge.cpu:>10.2f} {row['cpu_ratio']:>14.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()

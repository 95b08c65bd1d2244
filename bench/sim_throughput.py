"""Federation images/s with batched edges (fl-sim --batch-edges) against a plain loop.

Issue #44 asks that fl-sim on a GPU train several edges at a throughput near a plain
single-model PyTorch loop with the same total batch. Three sides train the same
architecture (FedAvg edges built from the registry, one set of initial weights) on uint8
images kept where training runs (the device) and decoded batch by batch, SGD lr 0.05
momentum 0.9, for the same number of steps:

  plain:      one model, batch E x B: ``for idx in randperm(n).split(E*B): decode;
              CE(model(x), y); backward; step; zero_grad`` - nothing else;
  batched:    E edges of n/E images, batch B each, as one group of
              ``fl_tools.sim_batched.train_batched`` (stacked weights, vmap over edges): what
              fl-sim --batch-edges E runs for the edges of one worker;
  sequential: the same E edges one after another through ``train_local``: what fl-sim
              runs without the option (its edges take turns).

Both federation sides move E x n/E images per epoch as the plain loop does, in steps of
E x B images. Alternating plain/batched/sequential over ``--reps`` repetitions after one
warm-up of each, the best repetition of each is compared (the least disturbed by the
machine's other work). Figures are printed (and written with ``--out``), never asserted.
The CUDA path (``--device cuda``, with ``--amp``: bf16 autocast) runs unchanged on a GPU
machine; no CUDA figure is in this repository until one has been measured there.

    python bench/sim_throughput.py --edges 8 --batch-size 32 --images 2048 --reps 3 \
        --out bench/results/sim-throughput-cpu-DATE.txt                      # CPU
    python bench/sim_throughput.py --device cuda --amp --edges 16 64 --batch-size 32 \
        --images 65536 --model lenet-bn resnet18-cifar                        # GPU
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fedattn_shared.config import TrainConfig
from fedattn_shared.data.npz import Split, decode_images
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.schema import TRAIN, Kind, Payload, Section
from fl_edge.trainer import autocast_dtype, configure_determinism, train_local
from fl_tools.sim_batched import EdgeJob, batch_refusal, train_batched

SHAPES = {"lenet-bn": (1, 28), "se-cnn": (1, 28)}  # MNIST models; CIFAR's (3, 32) else
LR = 0.05


def cpu_name() -> str:
    """The processor's model name (Linux), else what Python knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def edges(model: str, count: int, device: torch.device) -> list:
    """``count`` FedAvg edges of ``model``, each having received the same weights."""
    channels, side = SHAPES.get(model, (3, 32))
    cls = load_method("fedavg")
    train = TrainConfig(model=model, lr=LR, momentum=0.9, in_channels=channels, image_size=side)
    method = cls(MethodContext(train, cls.Params()))
    torch.manual_seed(0)
    models = method.build_models()
    out = []
    for _ in range(count):
        algo = method.edge({k: copy.deepcopy(m).to(device) for k, m in models.items()}, device)
        algo.receive(TRAIN, Payload([Section(Kind.SHARED_TENSORS, "", algo.shared_values())]),
                     Payload())
        out.append(algo)
    return out


def images(model: str, total: int, parts: int, device: torch.device,
           unequal: bool = False) -> list[Split]:
    """``total`` random uint8 images of the model's shape on ``device``, in ``parts``:
    equal, or (``unequal``) edge i holding a share proportional to i + 1 (as a skewed
    partition: a batched group steps as long as its largest edge, the others masked)."""
    channels, side = SHAPES.get(model, (3, 32))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (total, channels, side, side), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (total,), generator=g)
    x, y = x.to(device), y.to(device)
    weights = [i + 1 if unequal else 1 for i in range(parts)]
    bounds = [total * sum(weights[:i]) // sum(weights) for i in range(parts + 1)]
    return [Split(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def plain(algo, split: Split, batch: int, epochs: int, device: torch.device, amp: bool) -> float:
    """Wall seconds of the plain loop on one model."""
    model = algo.models["model"]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model.train()
    g = torch.Generator().manual_seed(1)
    dtype = autocast_dtype(device)
    sync(device)
    start = time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(len(split), generator=g).to(device).split(batch):
            x = decode_images(split.x[idx])
            with torch.autocast(device.type, dtype=dtype, enabled=amp):
                loss = F.cross_entropy(model(x), split.y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - start


def batched(algos: list, splits: list[Split], batch: int, epochs: int, device: torch.device,
            amp: bool) -> float:
    """Wall seconds of one batched group of all the edges."""
    sync(device)
    start = time.perf_counter()
    train_batched([EdgeJob(a, s, epochs, batch, seed=i, lr=LR, slot=i)
                   for i, (a, s) in enumerate(zip(algos, splits, strict=True))],
                  len(algos), device, amp)
    sync(device)
    return time.perf_counter() - start


def sequential(algos: list, splits: list[Split], batch: int, epochs: int, device: torch.device,
               amp: bool) -> float:
    """Wall seconds of the edges trained one after another (fl-sim without the option)."""
    sync(device)
    start = time.perf_counter()
    for i, (algo, split) in enumerate(zip(algos, splits, strict=True)):
        train_local(algo, split, epochs, batch, seed=i, device=device, progress=False, lr=LR,
                    amp=amp, channels_last=False)
    sync(device)
    return time.perf_counter() - start


def measure(model: str, count: int, args: argparse.Namespace, device: torch.device) -> dict:
    """Best-of-reps images/s of the three sides for ``count`` edges."""
    total = args.images - args.images % (count * args.batch_size)
    splits = images(model, total, count, device, args.unequal)
    whole = Split(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]))
    fed = edges(model, count, device)
    refusal = batch_refusal(fed[0], amp=args.amp, device=device)
    if refusal:
        raise SystemExit(f"{model}: not batchable: {refusal}")
    single = edges(model, 1, device)[0]
    seq = edges(model, count, device)
    best = {"plain": float("inf"), "batched": float("inf"), "sequential": float("inf")}
    for rep in range(args.reps + 1):  # the first warms caches and the allocator up
        times = {"plain": plain(single, whole, count * args.batch_size, args.epochs, device,
                                args.amp),
                 "batched": batched(fed, splits, args.batch_size, args.epochs, device, args.amp)}
        if not args.skip_sequential:
            times["sequential"] = sequential(seq, splits, args.batch_size, args.epochs, device,
                                             args.amp)
        if rep:
            best = {k: min(best[k], times.get(k, float("inf"))) for k in best}
    samples = total * args.epochs
    return {"model": model, "edges": count, "images": total,
            **{f"{k}_img_s": samples / v for k, v in best.items()},
            "batched_over_plain": best["plain"] / best["batched"],
            "sequential_over_plain": best["plain"] / best["sequential"]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=["lenet-bn"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--edges", type=int, nargs="+", default=[8])
    p.add_argument("--batch-size", type=int, default=32, help="each edge's batch (B)")
    p.add_argument("--images", type=int, default=2048, help="images in all (split over edges)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--amp", action="store_true", help="autocast (bf16; fp16 GPUs: refused)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--skip-sequential", action="store_true", help="plain and batched only")
    p.add_argument("--unequal", action="store_true",
                   help="edge i holds a share of the images proportional to i + 1 (else equal)")
    p.add_argument("--out", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    configure_determinism(True, args.threads, strict=False)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    load = os.getloadavg()
    lines = [f"$ python {' '.join(shlex.quote(a) for a in ['bench/sim_throughput.py', *sys.argv[1:]])}"
             if argv is None else f"# main({argv})",
             f"# device {args.device} ({name}), torch {torch.__version__}, {args.threads} "
             f"thread(s), {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
             f"{load[2]:.2f} at start",
             f"# batch {args.batch_size} per edge (plain loop: edges x batch), "
             f"{args.epochs} epoch(s), amp {args.amp}, best of {args.reps}, "
             f"{'unequal (edge i: share i + 1)' if args.unequal else 'equal'} partitions",
             f"{'model':<16} {'edges':>5} {'images':>7} {'plain img/s':>12} {'batched img/s':>14} "
             f"{'sequential img/s':>17} {'batched/plain':>14} {'sequential/plain':>17}"]
    for line in lines:
        print(line, flush=True)
    rows = []
    for model in args.model:
        for count in args.edges:
            row = measure(model, count, args, device)
            rows.append(row)
            line = (f"{model:<16} {count:>5} {row['images']:>7} {row['plain_img_s']:>12.1f} "
                    f"{row['batched_img_s']:>14.1f} {row['sequential_img_s']:>17.1f} "
                    f"{row['batched_over_plain']:>14.3f} {row['sequential_over_plain']:>17.3f}")
            lines.append(line)
            print(line, flush=True)
    load = os.getloadavg()
    lines.append(f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    print(lines[-1])
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()

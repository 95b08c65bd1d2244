"""DP-SGD's cost in accuracy and in step time: a GN-ResNet and the compact ANFR under
FedAvg at epsilon = inf (no DP), 8 and 1, with real fl-server and fl-edge daemons (fl-sim)
on loopback. The ANFR paper's Table 4 (FedPathology, 3 clients, pretrained -50 models)
claims GN-ResNet loses about 17 points at epsilon = 1 (84.79 -> 67.27) and ANFR about 3
(84.47 -> 81.11).

Data: CIFAR-10 from ../shared/data/cifar-10, cut by fl-partition per seed into
Dirichlet(--alpha) label skew over --edges edges (the paper's DP setting: 3 clients,
Dirichlet 0.5), a stratified 20 % local test split per edge and the same balanced
global_test set on every edge.

DP (fl-server --dp): sample-level DP-SGD on every edge, Poisson sampling at q = B/|D_k|,
per-sample clipping to C = 1.0, sigma calibrated per edge (RDP accountant) so that the
whole run (rounds x local epochs x int(1/q) steps) spends exactly the target epsilon at
delta = 0.1/|D_k| (the paper's settings: C = 1.0, delta = 0.1/|D_i|).

Figures: the final round's accuracy of the global model on the balanced global_test set
and the mean over edges on their local test splits; the epsilon each edge's ledger
recorded; DP-SGD's step time over the non-DP step time of the same model in the same
invocation (train_seconds / steps per edge and round, mean over edges and rounds).

    .venv/bin/python bench/dp.py                 # CPU protocol (below)
    .venv/bin/python bench/dp.py --full --device cuda

Protocol (CPU, sized for a shared 2-core machine): compact depth (gn-resnet-compact,
anfr-se-compact), 3 edges, --limit 900 training images, 4 rounds x 1 local epoch, SGD lr
0.05 momentum 0.9, batch 32, seed 0 (--seeds for more). From scratch (the paper starts
from ImageNet weights).
--full: the -50 models, all 50,000 images, 25 rounds (a GPU machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from _harness import ROOT, SHARED_DATA, fl_partition, pm, run

CIFAR10 = SHARED_DATA / "cifar-10" / "cifar-10-batches-bin"
ARCHS = {"GN-ResNet": ("gn-resnet-compact", "gn-resnet-50"),
         "ANFR": ("anfr-se-compact", "anfr-se-50")}
EPSILONS = [math.inf, 1.0, 8.0]  # the paper's pair first
PAPER = {("GN-ResNet", math.inf): 84.79, ("GN-ResNet", 1.0): 67.27,
         ("ANFR", math.inf): 84.47, ("ANFR", 1.0): 81.11}


def partition(args, seed: int) -> Path:
    out = args.out / "data" / f"dirichlet-a{args.alpha}-e{args.edges}-s{seed}-n{args.limit or 'all'}"
    limit = ["--limit", str(args.limit)] if args.limit else []
    fl_partition(out, args.out, ["--source", str(CIFAR10), "--edges", str(args.edges), "--seed",
                                 str(seed), "--scheme", "dirichlet", "--alpha", str(args.alpha),
                                 "--min-per-edge", "50", "--global-test-per-class",
                                 str(args.global_test_per_class), *limit])
    return out


def label(eps: float) -> str:
    return "inf" if math.isinf(eps) else f"{eps:g}"


def federate(args, arch: str, eps: float, seed: int) -> Path:
    out = args.out / "runs" / f"{arch}-eps{label(eps)}-s{seed}"
    history = out / "server" / "history.json"
    if history.exists() and len(json.loads(history.read_text())["rounds"]) == args.rounds:
        return history  # finished earlier: --out doubles as a cache
    data = partition(args, seed)
    sets = {"train.model": ARCHS[arch][1 if args.full else 0], "train.in_channels": 3,
            "train.image_size": 32, "train.lr": args.lr, "train.momentum": args.momentum,
            "train.batch_size": args.batch_size, "train.local_epochs": args.epochs,
            "server.eval_every": args.eval_every, "server.round_timeout": 3600}
    if not math.isinf(eps):
        sets.update({"dp.enabled": True, "dp.target_epsilon": eps,
                     "dp.max_grad_norm": args.max_grad_norm})
    flags = [f"--set={k}={json.dumps(v)}" for k, v in sets.items()]
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "fl_tools.sim", "--method", "fedavg", "--edges", str(args.edges),
         "--fraction", "1", "--rounds", str(args.rounds), "--procs", str(args.procs),
         "--data-root", str(data), "--out", str(out), "--seed", str(seed),
         "--device", args.device, *flags], out / "fl-sim.log")
    print(f"  {arch:<9} eps {label(eps):<4} seed {seed}: {time.time() - started:5.0f} s", flush=True)
    last = json.loads(history.read_text())["rounds"][-1]
    if len(last.get("evaluate", {}).get("received", [])) != args.edges:
        raise SystemExit(f"{out}: edges failed (see {out / 'logs'}); the run is not counted")
    return history


def figures(history_file: Path) -> dict[str, float]:
    from fl_tools.report import analyze_run, load_history

    history = load_history(history_file)
    out = {split: 100 * analyze_run(history_file, history, split)["final"]["mean_accuracy"]
           for split in ("test", "global_test")}
    per_step, spent = [], []
    for record in history["rounds"]:
        for metrics in record["train"]["edge_metrics"].values():
            if metrics.get("steps"):
                per_step.append(metrics["train_seconds"] / metrics["steps"])
            if "dp_epsilon" in metrics:
                spent.append(metrics["dp_epsilon"])
    out["step_seconds"] = statistics.mean(per_step)
    out["epsilon"] = max(spent) if spent else math.inf
    return out




def report(results: dict, args) -> str:
    lines = ["\nFinal-round accuracy (%), mean ± std over seeds; [paper Table 4, FedPathology, "
             "pretrained -50 models]",
             "| architecture | epsilon | spent (max over edges) | global model, global_test "
             "| mean over edges, local test | drop vs eps=inf (global_test) | paper |",
             "|---|---|---|---|---|---|---|"]
    for arch in ARCHS:
        base = [r["global_test"] for r in results.get((arch, math.inf), [])]
        for eps in EPSILONS:
            runs = results.get((arch, eps), [])
            if not runs:
                continue
            acc = [r["global_test"] for r in runs]
            drop = (f"{statistics.mean(base) - statistics.mean(acc):+.1f}"
                    if base and not math.isinf(eps) else "")
            paper = PAPER.get((arch, eps))
            paper_cell = "" if paper is None else f"{paper}"
            if paper is not None and not math.isinf(eps):
                paper_cell += f" (drop {PAPER[(arch, math.inf)] - paper:.1f})"
            spent = "-" if math.isinf(eps) else pm([r["epsilon"] for r in runs], 3)
            lines.append(f"| {arch} | {label(eps)} | {spent} | {pm(acc)} | "
                         f"{pm([r['test'] for r in runs])} | {drop} | {paper_cell} |")
    lines += ["\nStep time per edge (train_seconds / optimizer steps, mean over edges and rounds),"
              " DP-SGD over non-DP of the same model in this invocation",
              "| architecture | non-DP ms/step | DP ms/step (eps 8, 1) | overhead |", "|---|---|---|---|"]
    for arch in ARCHS:
        plain = [r["step_seconds"] for r in results.get((arch, math.inf), [])]
        private = [r["step_seconds"] for eps in EPSILONS if not math.isinf(eps)
                   for r in results.get((arch, eps), [])]
        if plain and private:
            ratio = statistics.mean(private) / statistics.mean(plain)
            lines.append(f"| {arch} | {1000 * statistics.mean(plain):.1f} | "
                         f"{1000 * statistics.mean(private):.1f} | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the -50 models on all data (GPU)")
    p.add_argument("--epsilons", nargs="+", type=float, default=EPSILONS,
                   help="inf for the non-DP baseline")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--edges", type=int, default=3)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--limit", type=int, default=900, help="training images in all (CPU)")
    p.add_argument("--global-test-per-class", type=int, default=50)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-dp")
    p.add_argument("--report-only", action="store_true",
                   help="print the tables from the finished runs under --out, run nothing")
    args = p.parse_args()
    if not CIFAR10.exists():
        print(f"bench/dp.py: {CIFAR10} is missing (set FEDATTN_DATA to the datasets' folder)",
              file=sys.stderr)
        return 2
    if args.full:
        args.limit, args.rounds = 0, 25
    args.out = args.out.resolve()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"CIFAR-10, {args.edges} edges, Dirichlet({args.alpha}), "
          f"{'-50' if args.full else 'compact'} models, FedAvg, {args.rounds} rounds x "
          f"{args.epochs} epochs, {args.limit or 'all'} training images, SGD lr {args.lr} "
          f"momentum {args.momentum} batch {args.batch_size}, DP: C {args.max_grad_norm}, "
          f"delta 0.1/|D_k|, RDP, epsilons {[label(e) for e in args.epsilons]}, "
          f"seeds {args.seeds}", flush=True)
    results: dict[tuple[str, float], list[dict]] = {}
    for seed in args.seeds:
        for eps in args.epsilons:
            for arch in ARCHS:
                history = (args.out / "runs" / f"{arch}-eps{label(eps)}-s{seed}" / "server"
                           / "history.json") if args.report_only else federate(args, arch, eps, seed)
                if history.exists():
                    results.setdefault((arch, eps), []).append(figures(history))
    print(report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Buffered asynchronous aggregation (FedBuff, ``--mode async``) against synchronous rounds
when some edges are slow and some drop out: time, edge compute and bytes to a target
accuracy, and the final accuracy.

Real daemons: fl-sim hosts the edges (full EdgeDaemons over gRPC on loopback) against a
real fl-server. Data: MNIST (../shared/data/mnist, $FEDATTN_DATA) or CIFAR-10, cut by
fl-partition into ``--edges`` folders per seed: Dirichlet(alpha 0.5) label skew, a 20 %
local test split per edge and the same balanced global test set (100 per class) in every
folder. Heterogeneity (fl-sim, chosen by the seed): ``--slow`` FRACTION:FACTOR edges run
``fl-edge --throttle FACTOR`` (same result, FACTOR x the wall time), ``--flaky``
FRACTION:P:SECONDS edges lose a task's result with probability P and stay away SECONDS
(``fl-edge --disconnect``).

Rows, all FedAvg with the same model, data, learning rate and seeds:

- ``sync-all``: rounds that wait for every selected edge (``--round-timeout`` the backstop);
- ``sync-qQ``: rounds that close at Q results (default: the edges that are not slow), the
  slow edges' work past the quorum thrown away: the synchronous setting tuned for this fleet;
- ``async-kK``: FedBuff with buffer K, staleness weight poly:0.5, --max-staleness 20,
  async lr 1.

Budgets are equal in results: R rounds of sync, and R x edges / K versions of async;
evaluation every ``--eval-every`` rounds (default 2; async: every eval-every x edges / K
versions), so both modes score about as often per result. Every row needs only the
quorum's worth of edges connected to start a round (``server.min_edges``), so a sync round
does not wait for a flaky edge to come back. A sync evaluation is a phase of its round:
every connected edge scores the global, the slow ones 5x slower too, and the next round
waits for it; an async evaluation runs beside training. That difference is part of what
the figures measure.

Figures per row, mean +- std over seeds: wall seconds until the global test accuracy (mean
over edges) first reaches ``--target``, measured from the first round's (version's) start
to the moment the global that reached it existed; the edge compute spent on the results
that were applied until then (their train_seconds plus throttle_seconds: a slow device's
compute is its slowed time; work thrown away is not counted, which favours sync); wire
bytes until then; the final and best accuracy on both test splits; the whole run's wall
time; and for async the staleness histogram of the applied results. The goal (printed, not
asserted): async reaches the target in <= 0.5x the wall time of the best sync row at equal
or better final accuracy.

    .venv/bin/python bench/async.py                                  # MNIST, 3 seeds
    .venv/bin/python bench/async.py --seeds 0 --rounds 6 --edges 8 --procs 2 --limit 4000

An async run is not reproducible bit for bit (arrival order decides versions): its spread
over seeds includes that.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from _harness import SHARED_DATA, dirichlet_partition, pm, run

SOURCES = {"mnist": (SHARED_DATA / "mnist", "lenet-bn", 1, 28),
           "cifar10": (SHARED_DATA / "cifar-10" / "cifar-10-batches-bin", "resnet10-cifar-compact", 3, 32)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", choices=sorted(SOURCES), default="mnist")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--edges", type=int, default=20)
    p.add_argument("--slow", default="0.25:5", help="FRACTION:FACTOR (fl-sim --throttle)")
    p.add_argument("--flaky", default="0.1:0.3:5",
                   help="FRACTION:P:SECONDS (fl-sim --disconnect)")
    p.add_argument("--rounds", type=int, default=20, help="sync rounds; async: the same results")
    p.add_argument("--buffers", type=int, nargs="+", default=[5, 10])
    p.add_argument("--quorum", type=int, default=None,
                   help="the tuned sync row's quorum (default: the edges that are not slow)")
    p.add_argument("--round-timeout", type=float, default=120.0)
    p.add_argument("--eval-every", type=int, default=2, help="sync rounds between evaluations")
    p.add_argument("--target", type=float, default=0.90,
                   help="global test accuracy (mean over edges, 0-1) to time")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--limit", type=int, default=0, help="training samples in all (0: all)")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--procs", type=int, default=4, help="fl-sim worker processes")
    p.add_argument("--out", type=Path, default=Path("bench-out/async"))
    return p.parse_args(argv)


def rows(args) -> list[tuple[str, dict]]:
    """(name, server settings) per row."""
    slow_fraction = float(args.slow.split(":")[0]) if args.slow else 0.0
    quorum = args.quorum or args.edges - round(slow_fraction * args.edges)
    # Every row starts a round (the run) with the quorum's worth of edges connected: with
    # fl-sim's default (all of them) a sync round would wait for a flaky edge to return.
    common = {"server.min_edges": quorum}
    out = [("sync-all", {"server.mode": "sync", "server.eval_every": args.eval_every,
                         **common}),
           (f"sync-q{quorum}", {"server.mode": "sync", "server.quorum": quorum,
                                "server.eval_every": args.eval_every, **common})]
    for k in args.buffers:
        out.append((f"async-k{k}", {
            **common, "server.mode": "async", "server.buffer": k, "server.max_staleness": 20,
            "server.staleness_weight": "poly:0.5", "server.async_lr": 1.0,
            "server.eval_every": max(1, round(args.eval_every * args.edges / k))}))
    return out


def budget(args, settings: dict) -> int:
    """Rounds (sync) or versions (async, equal results: rounds x edges / K)."""
    if settings["server.mode"] == "async":
        return max(1, round(args.rounds * args.edges / settings["server.buffer"]))
    return args.rounds


def partition(args, seed: int) -> Path:
    source = SOURCES[args.data][0]
    out = args.out / "data" / f"{args.data}-{args.edges}-{args.alpha}-s{seed}-n{args.limit or 'all'}"
    return dirichlet_partition(out, args.out, source, args.edges, args.alpha, seed, args.limit)


def federate(args, name: str, settings: dict, seed: int) -> Path:
    """One run, or its finished history from an earlier bench (--out is a cache)."""
    out = args.out / "runs" / f"{args.data}-e{args.edges}-r{args.rounds}" / f"{name}-s{seed}"
    history = out / "server" / "history.json"
    rounds = budget(args, settings)
    if history.exists() and len(json.loads(history.read_text())["rounds"]) == rounds:
        return history
    shutil.rmtree(out, ignore_errors=True)
    data = partition(args, seed)
    _, model, channels, size = SOURCES[args.data]
    sets = {"train.model": model, "train.in_channels": channels, "train.image_size": size,
            "train.lr": args.lr, "train.batch_size": args.batch_size,
            "train.local_epochs": args.epochs, "train.lr_schedule": "constant",
            "server.round_timeout": args.round_timeout, **settings}
    flags = [f"--set={k}={json.dumps(v)}" for k, v in sets.items()]
    if args.slow:
        flags.append(f"--throttle={args.slow}")
    if args.flaky:
        flags.append(f"--disconnect={args.flaky}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    run([sys.executable, "-m", "fl_tools.sim", "--method", "fedavg", "--edges",
         str(args.edges), "--fraction", "1", "--rounds", str(rounds), "--procs",
         str(args.procs), "--data-root", str(data), "--out", str(out), "--seed", str(seed),
         *flags], out / "fl-sim.log")
    print(f"  {name:<10} seed {seed}: {time.time() - started:6.0f} s", flush=True)
    return history


def _contributions(record: dict) -> list[dict]:
    """The figures of each result a round (version) applied."""
    train = record.get("train") or {}
    if "contributors" in train:
        return [c.get("metrics") or {} for c in train["contributors"]]
    metrics = train.get("edge_metrics") or {}
    return [metrics.get(edge, {}) for edge in train.get("received", [])]


def _wire(record: dict) -> float:
    total = 0.0
    for kinds in (record.get("bytes") or {}).values():
        for entry in kinds.values():
            tallies = [entry] if "wire" in entry else list(entry.values())
            total += sum(t["wire"] for t in tallies)
    return total


def figures(history_file: Path, target: float) -> dict:
    """Time, compute and bytes to the target; final and best accuracy; staleness."""
    rounds = json.loads(history_file.read_text())["rounds"]
    start = rounds[0]["started"]
    compute = wire = 0.0
    reached: dict | None = None
    curve = []
    staleness: Counter = Counter()
    for record in rounds:
        compute += sum(m.get("train_seconds", 0.0) + m.get("throttle_seconds", 0.0)
                       for m in _contributions(record))
        wire += _wire(record)
        for tau, count in ((record.get("train") or {}).get("staleness") or {}).items():
            staleness[int(tau)] += count
        summary = (record.get("evaluation") or {}).get("summary") or {}
        if "global_test" not in summary:
            continue
        at = record["started"] + record["seconds"] - start
        point = {"at": at, "global": 100 * summary["global_test"]["mean_accuracy"],
                 "local": 100 * summary["test"]["mean_accuracy"]}
        curve.append(point)
        if reached is None and point["global"] >= 100 * target:
            reached = {"wall": at, "compute": compute, "bytes": wire}
    last = rounds[-1]
    return {"reached": reached, "final": curve[-1] if curve else None,
            "best_global": max((p["global"] for p in curve), default=float("nan")),
            "wall": last["started"] + last["seconds"] - start, "staleness": staleness,
            "results": sum(len(_contributions(r)) for r in rounds)}


def _values(results: list[dict], get) -> list[float]:
    out = []
    for r in results:
        try:
            out.append(float(get(r)))
        except (TypeError, KeyError):
            continue
    return out


def table(args, names: list[str], results: dict[str, list[dict]]) -> str:
    target = 100 * args.target
    lines = [f"| row | reached {target:.0f} % | wall s to target | edge compute s to target | "
             "MB to target | final global % | final local % | best global % | run wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        rs = results[name]
        hit = [r for r in rs if r["reached"]]
        lines.append(
            f"| {name} | {len(hit)}/{len(rs)} | {pm(_values(hit, lambda r: r['reached']['wall']))} "
            f"| {pm(_values(hit, lambda r: r['reached']['compute']))} "
            f"| {pm(_values(hit, lambda r: r['reached']['bytes'] / 1e6))} "
            f"| {pm(_values(rs, lambda r: r['final']['global']))} "
            f"| {pm(_values(rs, lambda r: r['final']['local']))} "
            f"| {pm(_values(rs, lambda r: r['best_global']))} "
            f"| {pm(_values(rs, lambda r: r['wall']), 0)} |")
    return "\n".join(lines)


def verdict(names: list[str], results: dict[str, list[dict]]) -> list[str]:
    """Each async row's wall time to target against the best sync row's, per seed."""
    def wall(name, i):
        r = results[name][i]
        return r["reached"]["wall"] if r["reached"] else float("inf")

    seeds = len(next(iter(results.values())))
    sync = [n for n in names if n.startswith("sync")]
    out = []
    for name in (n for n in names if n.startswith("async")):
        ratios = []
        for i in range(seeds):
            best = min(wall(s, i) for s in sync)
            ratios.append(wall(name, i) / best if best < float("inf") else float("nan"))
        final = statistics.mean(_values(results[name], lambda r: r["final"]["global"]))
        sync_final = max(statistics.mean(_values(results[s], lambda r: r["final"]["global"]))
                         for s in sync)
        meets = all(r <= 0.5 for r in ratios) and final >= sync_final - 0.5
        out.append(f"{name}: wall time to target / best sync per seed "
                   f"{', '.join(f'{r:.2f}x' for r in ratios)}; final global {final:.1f} % vs "
                   f"{sync_final:.1f} % ({'meets' if meets else 'misses'} the goal <= 0.5x "
                   "at equal or better final accuracy)")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = SOURCES[args.data][0]
    if not source.exists():
        print(f"{source} is missing: this bench needs the team's {args.data} copy "
              "($FEDATTN_DATA)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    plan = rows(args)
    results: dict[str, list[dict]] = {name: [] for name, _ in plan}
    for seed in args.seeds:
        for name, settings in plan:
            results[name].append(figures(federate(args, name, settings, seed), args.target))
    names = [name for name, _ in plan]
    print(f"\nFedAvg, {args.data}, {args.edges} edges (Dirichlet {args.alpha}), slow "
          f"{args.slow or 'none'} (FRACTION:FACTOR), flaky {args.flaky or 'none'} "
          f"(FRACTION:P:SECONDS), {args.rounds} sync rounds' worth of results, seeds "
          f"{args.seeds}\n")
    print(table(args, names, results))
    print()
    for line in verdict(names, results):
        print(line)
    for name in (n for n in names if n.startswith("async")):
        histogram: Counter = Counter()
        for r in results[name]:
            histogram.update(r["staleness"])
        total = sum(histogram.values()) or 1
        shown = ", ".join(f"{t}: {100 * c / total:.0f}%" for t, c in sorted(histogram.items()))
        print(f"{name} staleness of applied results (versions: share): {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

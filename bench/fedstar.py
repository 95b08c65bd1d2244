"""FedSTAR reproduction: FedProto, the attention-only ablation and FedSTAR (the paper's
Table 1 and ablation study), with FedAvg / Ditto (and FedRep once it is a registered
method) as references, all on the same compact backbone, with real fl-server and fl-edge
daemons (fl-sim: many edges in 2 processes) on loopback.

Data: MNIST (../shared/data/mnist) and CIFAR-10 (../shared/data/cifar-10); the paper's
Fashion-MNIST images are not available to us. fl-partition cuts each into --edges
folders per seed with Dirichlet(alpha = 0.1) label skew (the paper's alpha) and a
stratified 20 % local test split per edge (what the paper scores), and a shared balanced
global test set of --global-test images per class (default 30, from the source's test
split, disjoint from every edge's data; 0: none) that every evaluated edge is also scored
on. A seed fixes the partition, the client sampling and the initialisation, so every
method sees the same partitions.

Metrics (the paper's Table 1, METHODS.md 2.3): per evaluated round, on the pooled local
test splits of all edges: accuracy (total correct / total samples; "mean over edges" and
its std beside it), weighted and macro F1, Brier score (mean over samples of
sum_c (p_c - y_c)^2); best accuracy and F1 over rounds (the round in parentheses), minimum
Brier, and the convergence round (first evaluated round whose pooled accuracy reaches
95 % of that run's maximum). Bytes: the mean wire bytes per round (up + down, all kinds,
evaluation included) and its ratio to FedAvg's on the same backbone and data.
Issue #24's table beside it: both test metrics, best and final round; the edges' mean
feature norm |h| (``feature_norm``); the server's ``proto_energy`` / ``client_energy``
(shares of the LayerNorm input's energy) and ``proto_cosine``, means over the last 10
rounds (they swing with the sampled edges); and each
row against FedProto seed by seed. Rows beyond Table 1 (--methods): the lambda_shared
sweep (fedstar-ls0.3, fedstar-ls0.1; "fedstar" is the paper's 1.0), the scaled client
embedding (fedstar-e0.1, fedstar-ls0.1-e0.1: embed_std 0.1, a deviation from the paper).
--readings scores each FedSTAR run's final models with and without the style branch
(``readings``): the predicted-style figure there is what a ``predict = "predicted-style"``
run would evaluate in its final round, without training the run again.

Protocols:
  default (CPU, the comparison of record): 20 edges, 30 % sampled per round (--fraction
    0.3, the paper's join ratio), --limit training images per dataset, --rounds rounds
    of --epochs local epochs, SGD lr 0.01 momentum 0.9 batch 32, seeds 0 1 2;
  --full: the paper's schedule: 100 edges (>= 50 samples each), 200 rounds of 5 epochs on
    all training images, SGD lr 0.005 without momentum, batch 8192, evaluation every 5
    rounds, the edges on --device (a GPU machine); images at their own size (the paper says
    320 px, the authors' code resizes only Office-31).

    .venv/bin/python bench/fedstar.py                       # both datasets, 3 seeds
    .venv/bin/python bench/fedstar.py --datasets mnist --seeds 0
    .venv/bin/python bench/fedstar.py --full --device cuda
    .venv/bin/python bench/fedstar.py --full --device cuda --datasets mnist --seeds 0 \
        --methods fedproto ablation fedstar --budget-seconds 540   # repeat to resume (exit 3)

It prints one Table 1-like table per dataset (mean +- std over seeds) beside the paper's
Fashion-MNIST figures, whether FedSTAR > ablation > FedProto holds, and writes accuracy
curves (PNG) and every run under --out (a finished run is reused).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _harness import (
    BUDGET_SPENT,
    ROOT,
    SHARED_DATA,
    BudgetSpent,
    add_optimizer_state,
    deadline,
    fl_partition,
    optimizer_state_tag,
    optimizer_state_words,
    pm_seeds,
    resumable,
    run,
)
from _harness import pm as harness_pm

SOURCES = {
    "mnist": (SHARED_DATA / "mnist", 1, 28),
    "cifar10": (SHARED_DATA / "cifar-10" / "cifar-10-batches-bin", 3, 32),
}
# Table 1 (Fashion-MNIST, 100 clients, alpha 0.1, 200 rounds): best test accuracy, best
# F1, min Brier, convergence round.
PAPER_TABLE_1 = {
    "fedproto": (0.8580, 0.8578, 0.2288, 105),
    "ablation": (0.8657, 0.8657, 0.2173, 200),
    "fedstar": (0.8937, 0.8936, 0.3488, 55),
    "ditto": (0.8310, 0.8306, 0.4393, 155),
    "fedrep": (0.8436, 0.8430, 0.2442, 165),
}


@dataclass
class Config:
    label: str
    method: str
    params: dict[str, object] = field(default_factory=dict)


CONFIGS = [
    Config("fedproto", "fedproto"),
    Config("ablation", "fedstar", {"variant": "ablation"}),
    Config("fedstar", "fedstar"),
    Config("fedavg", "fedavg"),
    Config("ditto", "ditto"),
    Config("fedrep", "fedrep"),
]
# Diagnostics, run only when named in --methods: FedSTAR without L_shared, and the
# ablation with L_shared instead of FedProto's MSE.
EXTRA = [
    Config("fedstar-no-shared", "fedstar", {"lambda_shared": 0.0}),
    Config("ablation-shared", "fedstar", {"variant": "ablation", "ablation_loss": "shared"}),
    # Issue #24: the lambda_shared sweep (the paper's 1.0 is "fedstar") ...
    Config("fedstar-ls0.3", "fedstar", {"lambda_shared": 0.3}),
    Config("fedstar-ls0.1", "fedstar", {"lambda_shared": 0.1}),
    # ... and client embeddings drawn at a tenth of nn.Embedding's N(0, 1) (a deviation
    # from the paper): the prototypes, not the client rows, then carry the LayerNorm input.
    Config("fedstar-e0.1", "fedstar", {"embed_std": 0.1}),
    Config("fedstar-ls0.1-e0.1", "fedstar", {"lambda_shared": 0.1, "embed_std": 0.1}),
]


def registered(method: str) -> bool:
    from fedattn_shared.methods.registry import available_methods

    return method in available_methods()


def partition(args, dataset: str, seed: int) -> Path:
    source, _, _ = SOURCES[dataset]
    out = (args.out / "data" / (f"{dataset}-a{args.alpha}-e{args.edges}-s{seed}"
           f"-n{args.limit or 'all'}" + (f"-g{args.global_test}" if args.global_test else "")))
    limit = ["--limit", str(args.limit)] if args.limit else []
    fl_partition(out, args.out, ["--source", str(source), "--edges", str(args.edges), "--seed",
                                 str(seed), "--scheme", "dirichlet", "--alpha", str(args.alpha),
                                 "--min-per-edge", str(args.min_per_edge),
                                 "--global-test-per-class", str(args.global_test), *limit])
    return out


def run_dir(args, dataset: str, label: str, seed: int) -> Path:
    """One run's folder under --out (its cache key, with the optimizer's)."""
    return args.out / "runs" / dataset / f"{label}{optimizer_state_tag(args)}-s{seed}"


def federate(args, config: Config, dataset: str, seed: int) -> Path:
    _, channels, size = SOURCES[dataset]
    out = run_dir(args, dataset, config.label, seed)
    history = out / "server" / "history.json"
    if history.exists() and len(json.loads(history.read_text())["rounds"]) == args.rounds:
        return history  # finished earlier: --out doubles as a cache
    resume = resumable(out)  # an unfinished run continues from its last round checkpoint
    data = partition(args, dataset, seed)
    sets = {"train.model": args.model, "train.in_channels": channels, "train.image_size": size,
            "train.lr": args.lr, "train.momentum": args.momentum,
            "train.batch_size": args.batch_size, "train.local_epochs": args.epochs,
            "train.lr_schedule": "constant", "server.eval_every": args.eval_every,
            "train.optimizer_state": args.optimizer_state,
            # Table 1's F1 columns need the per-class counts (public datasets: nothing to hide)
            "server.eval_detail": True,
            **{f"{config.method}.{k}": v for k, v in config.params.items()}}
    flags = [f"--set={k}={json.dumps(v) if isinstance(v, (str, bool)) else v}"  # JSON: true
             for k, v in sets.items()]
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    run([sys.executable, "-m", "fl_tools.sim", "--method", config.method, "--edges",
         str(args.edges), "--fraction", str(args.fraction), "--rounds", str(args.rounds),
         "--procs", str(args.procs), "--data-root", str(data), "--out", str(out),
         "--seed", str(seed), "--device", args.device, *(["--resume"] if resume else []),
         *flags], out / "fl-sim.log", args.until)
    print(f"  {dataset:<8} {config.label:<9} seed {seed}: {time.time() - started:6.0f} s"
          + (" (resumed)" if resume else ""), flush=True)
    return history


def figures(history_file: Path) -> dict:
    """Table 1's figures of one run, on the pooled local test splits, and issue #24's:
    both test metrics best and final, the edges' feature norm |h| and the server's
    prototype figures (``proto_energy``, ``proto_cosine``: fedstar.py, prototypes.py)."""
    from fl_tools.report import convergence_round, load_history, round_figures

    history = load_history(history_file)
    rounds, global_rounds = [], []
    for record in history["rounds"]:
        per_edge = (record.get("evaluation") or {}).get("per_edge") or {}
        evaluated = round_figures(per_edge, "test")
        if evaluated is not None:
            rounds.append({"round": record["round"], **evaluated})
        on_global = round_figures(per_edge, "global_test")
        if on_global is not None:
            global_rounds.append(on_global["pooled_accuracy"])
    numbers = [r["round"] for r in rounds]

    def best(key: str, lowest: bool = False) -> tuple[float, int]:
        pick = min if lowest else max
        value = pick(r[key] for r in rounds)
        return value, next(r["round"] for r in rounds if r[key] == value)

    accuracy, at = best("pooled_accuracy")
    at_best = next(r for r in rounds if r["round"] == at)
    wire = [sum(tally["wire"] for kinds in record["bytes"].values() for tally in kinds.values())
            for record in history["rounds"]]
    up = [sum(tally["wire"] for tally in record["bytes"].get("up", {}).values())
          for record in history["rounds"]]
    # |h| and the server's prototype figures swing from round to round with the 6 sampled
    # edges: the table takes their mean over the last 10 rounds (max |h| over all).
    tail = history["rounds"][-10:]
    norms = [m["feature_norm"] for r in tail for m in r.get("train", {}).get("edge_metrics", {}).values()
             if "feature_norm" in m]
    every_norm = [m["feature_norm"] for r in history["rounds"]
                  for m in r.get("train", {}).get("edge_metrics", {}).values() if "feature_norm" in m]

    def late(key: str) -> float:
        values = [r["aggregate"][key] for r in tail if key in r.get("aggregate", {})]
        return statistics.mean(values) if values else float("nan")

    nan = float("nan")
    return {
        "seed": history["manifest"]["train"]["seed"],
        "accuracy": accuracy, "accuracy_round": at,
        "edge_mean": at_best["mean_accuracy"], "edge_std": at_best["std_accuracy"],
        "best_edge_mean": best("mean_accuracy")[0],
        "weighted_f1": best("weighted_f1")[0], "macro_f1": best("macro_f1")[0],
        "brier": best("brier", lowest=True)[0],
        "convergence": convergence_round(numbers, [r["pooled_accuracy"] for r in rounds]),
        "bytes_per_round": statistics.mean(wire), "up_per_round": statistics.mean(up),
        "curve": [(r["round"], r["pooled_accuracy"]) for r in rounds],
        "local_final": rounds[-1]["pooled_accuracy"],
        "global_best": max(global_rounds) if global_rounds else nan,
        "global_final": global_rounds[-1] if global_rounds else nan,
        "norm_final": statistics.mean(norms) if norms else nan,
        "norm_max": max(every_norm, default=nan),
        "proto_energy": late("proto_energy"), "client_energy": late("client_energy"),
        "proto_cosine": late("proto_cosine"), "upload_norm": late("upload_norm"),
    }


def pm(values: list[float], digits: int = 4) -> str:
    return harness_pm(values, digits)


def ps(runs: list[dict], key: str, digits: int = 4) -> str:
    """A figure over seeds: mean ± std, then every seed's own (``pm_seeds``)."""
    return pm_seeds([r[key] for r in runs], [r["seed"] for r in runs], digits)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(results: dict, labels: list[str], dataset: str) -> str:
    reference = results.get(("fedavg", dataset), [])
    fedavg_bytes = statistics.mean(r["bytes_per_round"] for r in reference) if reference else None
    lines = [f"\n{dataset}, each figure mean ± std over seeds then each seed's: best pooled test "
             "accuracy (round) | mean ± std over edges at that "
             "round | best weighted F1 | best macro F1 | min Brier | conv. round | wire bytes "
             "per round (up) | vs FedAvg   [paper, Fashion-MNIST: acc / F1 / Brier / conv.]",
             "| method | accuracy | over edges | weighted F1 | macro F1 | Brier | conv. | "
             "bytes/round (up) | ratio | paper |", "|---" * 10 + "|"]
    for label in labels:
        runs = results.get((label, dataset), [])
        if not runs:
            continue
        rounds = ",".join(str(r["accuracy_round"]) for r in runs)
        per_round = statistics.mean(r["bytes_per_round"] for r in runs)
        up = statistics.mean(r["up_per_round"] for r in runs)
        ratio = f"{per_round / fedavg_bytes:.4f}" if fedavg_bytes else "-"
        paper = PAPER_TABLE_1.get(label)
        paper_cell = (f"{paper[0]:.4f} / {paper[1]:.4f} / {paper[2]:.4f} / {paper[3]}"
                      if paper else "-")
        edge_std = statistics.mean(r["edge_std"] for r in runs)
        lines.append(
            f"| {label} | {ps(runs, 'accuracy')} ({rounds}) "
            f"| {ps(runs, 'edge_mean', 3)} (edges ± {edge_std:.3f}) "
            f"| {ps(runs, 'weighted_f1')} | {ps(runs, 'macro_f1')} "
            f"| {ps(runs, 'brier')} | {ps(runs, 'convergence', 1)} "
            f"| {human(per_round)} ({human(up)}) | {ratio} | {paper_cell} |")
    return "\n".join(lines)


def issue_table(results: dict, labels: list[str], dataset: str) -> str:
    """Issue #24's view: both test metrics best and final, |h| and the server's prototype
    figures in the last round, mean ± std over seeds, and each row against FedProto seed by
    seed (same seed = same partition, sampling and initialisation)."""
    lines = [f"\n{dataset}: pooled accuracy on the edges' local test splits and on the shared "
             "global test set, best over evaluated rounds / final round; |h| = mean feature "
             "norm of the trained edges over the last 10 rounds (max over all rounds and "
             "edges); |p| = mean norm of the uploaded prototypes (eval mode) over the last 10 "
             "rounds; proto energy / client energy = shares of the server LayerNorm's input "
             "energy, cos = mean cos(p_global_c, p_k,c), both means over the last 10 rounds; "
             "vs FedProto: seeds "
             "where the row's best local accuracy is higher, and the mean per-seed difference",
             "| method | local best | local final | global best | global final | |h| last 10 "
             "(max) | |p| | proto energy | client energy | cos | vs FedProto (local best) |",
             "|---" * 11 + "|"]
    reference = results.get(("fedproto", dataset), [])
    for label in labels:
        runs = results.get((label, dataset), [])
        if not runs:
            continue
        versus = "-"
        if reference and label != "fedproto" and len(reference) == len(runs):
            diffs = [r["accuracy"] - f["accuracy"] for r, f in zip(runs, reference, strict=True)]
            versus = (f"{sum(d > 0 for d in diffs)}/{len(diffs)} higher, "
                      f"{statistics.mean(diffs):+.4f} ({', '.join(f'{d:+.3f}' for d in diffs)})")
        lines.append(
            f"| {label} | {ps(runs, 'accuracy')} | {ps(runs, 'local_final')} "
            f"| {ps(runs, 'global_best')} | {ps(runs, 'global_final')} "
            f"| {ps(runs, 'norm_final', 1)} ({max(r['norm_max'] for r in runs):.1f}) "
            f"| {ps(runs, 'upload_norm', 1)} "
            f"| {ps(runs, 'proto_energy', 3)} | {ps(runs, 'client_energy', 3)} "
            f"| {ps(runs, 'proto_cosine', 3)} | {versus} |")
    return "\n".join(lines)


READINGS = ("head", "predicted-style", "true-label style")


def readings(args, label: str, dataset: str, seed: int) -> dict[str, dict[str, float]] | None:
    """How FedSTAR's prediction uses the style branch, on one finished run's final models:
    each trained edge's personalized model (its state dir, as ``fl-edge export`` loads
    it) scores its local test split and the global test set three ways: ``head`` =
    head(h), what the run evaluated (``predict = "head"``); ``predicted-style`` =
    head(FiLM(h, s_k,argmax head(h))), what ``predict = "predicted-style"`` evaluates (only
    evaluation differs, so this is that run's final round); ``true-label style`` =
    head(FiLM(h, s_k,y)) with the TEST LABEL y, the later author code's leak: not a
    predictor, a bound on what choosing the style could give. Pooled accuracy over the
    edges that have trained (an edge never sampled has no state). None: not FedSTAR."""
    from fedattn_shared.data import load_edge_data
    from fl_edge.export import from_state_dir

    out = run_dir(args, dataset, label, seed)
    correct = {(r, s): 0 for r in READINGS for s in ("test", "global_test")}
    total = dict.fromkeys(("test", "global_test"), 0)
    for state in sorted((out / "state").iterdir()):
        if not (state / "private.safetensors").exists():
            continue
        model = from_state_dir(state)
        algo = model.algo
        if getattr(algo, "personal", None) is None:
            return None
        data = load_edge_data(partition(args, dataset, seed) / state.name, model.train)
        for split, part in (("test", data.test), ("global_test", data.global_test)):
            if part is None or not len(part.y):
                continue
            with torch.no_grad():
                h, logits = algo.features(part.x)
                styles = algo.personal.style
                guesses = {"head": logits,
                           "predicted-style": algo.head(algo.personal.film(h, styles[logits.argmax(1)])),
                           "true-label style": algo.head(algo.personal.film(h, styles[part.y]))}
            for reading, scores in guesses.items():
                correct[(reading, split)] += int((scores.argmax(1) == part.y).sum())
            total[split] += len(part.y)
    return {r: {s: correct[(r, s)] / total[s] if total[s] else float("nan")
                for s in total} for r in READINGS}


def readings_table(args, labels: list[str], dataset: str) -> str:
    lines = [f"\n{dataset}: FedSTAR's prediction with and without the style branch, final "
             "round, pooled accuracy over the trained edges (mean ± std over seeds; "
             "true-label style leaks the test label: a bound, not a predictor)",
             "| method | split | " + " | ".join(READINGS) + " | predicted-style - head, per seed |",
             "|---" * (len(READINGS) + 3) + "|"]
    for label in labels:
        per_seed = [readings(args, label, dataset, seed) for seed in args.seeds]
        if any(r is None for r in per_seed):
            continue
        for split in ("test", "global_test"):
            cells = [pm_seeds([r[reading][split] for r in per_seed], args.seeds, 4)
                     for reading in READINGS]
            diffs = [r["predicted-style"][split] - r["head"][split] for r in per_seed]
            lines.append(f"| {label} | {split} | " + " | ".join(cells)
                         + f" | {', '.join(f'{d:+.4f}' for d in diffs)} |")
    return "\n".join(lines)


def ordering(results: dict, dataset: str, seeds: list[int]) -> str:
    names = ("fedstar", "ablation", "fedproto")
    runs = {n: results.get((n, dataset), []) for n in names}
    if any(len(runs[n]) != len(seeds) for n in names):
        return f"{dataset}: FedSTAR > ablation > FedProto not checked (runs missing)"
    means = {n: statistics.mean(r["accuracy"] for r in runs[n]) for n in names}
    holds = means["fedstar"] > means["ablation"] > means["fedproto"]
    per_seed = [runs["fedstar"][i]["accuracy"] > runs["ablation"][i]["accuracy"]
                > runs["fedproto"][i]["accuracy"] for i in range(len(seeds))]
    return (f"{dataset}: FedSTAR > ablation > FedProto (best pooled accuracy, mean over seeds: "
            f"{means['fedstar']:.4f} / {means['ablation']:.4f} / {means['fedproto']:.4f}): "
            f"{'holds' if holds else 'does NOT hold'}; per seed: {per_seed}")


def plot(results: dict, labels: list[str], dataset: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label in labels:
        runs = results.get((label, dataset), [])
        if not runs:
            continue
        rounds = [r for r, _ in runs[0]["curve"]]
        mean = [statistics.mean(run["curve"][i][1] for run in runs) for i in range(len(rounds))]
        ax.plot(rounds, mean, label=label)
    ax.set_title(f"{dataset}, Dirichlet 0.1: pooled local-test accuracy (mean over seeds)")
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", choices=sorted(SOURCES), default=["mnist", "cifar10"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=[c.label for c in CONFIGS],
                   help="labels: " + " ".join(c.label for c in CONFIGS + EXTRA))
    p.add_argument("--full", action="store_true",
                   help="the paper's protocol: 100 edges, 200 rounds, all data, eval every 5")
    p.add_argument("--model", default="mobilenet-v3-compact")
    p.add_argument("--edges", type=int, default=20)
    p.add_argument("--fraction", type=float, default=0.3)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--limit", type=int, default=4000, help="training images per dataset (CPU)")
    p.add_argument("--min-per-edge", type=int, default=20)
    p.add_argument("--global-test", type=int, default=30,
                   help="images per class of the shared global test set every edge is also "
                        "scored on (from the source's test split; 0: none, the paper's "
                        "protocol scores each client's own split only)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=None, help="default 0.01; 0.005 with --full")
    p.add_argument("--momentum", type=float, default=None, help="default 0.9; 0 with --full")
    add_optimizer_state(p)
    p.add_argument("--batch-size", type=int, default=None,
                   help="default 32; 8192 with --full (the paper's: full-batch for most clients)")
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--readings", action="store_true",
                   help="also score each FedSTAR run's final models with and without the "
                        "style branch (head, predicted-style, true-label style)")
    p.add_argument("--device", default="cpu", help="the edges' device (cuda with --full)")
    p.add_argument("--budget-seconds", type=float, default=0,
                   help="> 0: stop the run under way after this many seconds and exit "
                        f"{BUDGET_SPENT}; the same command resumes it from its last round "
                        "checkpoint (a GPU lease's 10-minute commands: 540)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-fedstar")
    args = p.parse_args()
    args.until = deadline(args.budget_seconds)
    for dataset in args.datasets:
        if not SOURCES[dataset][0].exists():
            print(f"bench/fedstar.py: {SOURCES[dataset][0]} is missing (set FEDATTN_DATA "
                  "to the datasets' folder)", file=sys.stderr)
            return 2
    if args.full:
        args.edges, args.limit, args.rounds, args.eval_every, args.min_per_edge = 100, 0, 200, 5, 50
        args.epochs = 5
    # The paper's optimiser (METHODS.md 2.3) with --full; the CPU protocol's otherwise (the
    # paper's full-batch lr 0.005 does not train within a CPU budget).
    for name, cpu, paper in (("lr", 0.01, 0.005), ("momentum", 0.9, 0.0), ("batch_size", 32, 8192)):
        if getattr(args, name) is None:
            setattr(args, name, paper if args.full else cpu)
    args.out = args.out.resolve()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    configs = [c for c in CONFIGS + EXTRA if c.label in args.methods]
    for config in list(configs):
        if not registered(config.method):
            print(f"note: {config.method!r} is not a registered method here; {config.label} is "
                  "skipped")
            configs.remove(config)
    print(f"{', '.join(args.datasets)}: {args.edges} edges, {args.fraction:.0%} per round, "
          f"Dirichlet {args.alpha}, {args.model}, {args.rounds} rounds x {args.epochs} epochs, "
          f"{args.limit or 'all'} training images, lr {args.lr} momentum {args.momentum} batch "
          f"{args.batch_size}, {optimizer_state_words(args)}, eval every {args.eval_every}, "
          f"seeds {args.seeds}", flush=True)
    results: dict[tuple[str, str], list] = {}
    try:
        for dataset in args.datasets:
            for seed in args.seeds:
                for config in configs:
                    results.setdefault((config.label, dataset), []).append(
                        figures(federate(args, config, dataset, seed)))
    except BudgetSpent:
        done = sum(len(runs) for runs in results.values())
        print(f"\ntime budget spent ({args.budget_seconds:.0f} s) with {done} runs finished; "
              "repeat the command to resume the unfinished run from its last round checkpoint",
              flush=True)
        return BUDGET_SPENT
    labels = [c.label for c in configs]
    for dataset in args.datasets:
        print(table(results, labels, dataset))
        print(issue_table(results, labels, dataset))
        if args.readings:
            print(readings_table(args, labels, dataset))
    print()
    for dataset in args.datasets:
        print(ordering(results, dataset, args.seeds))
    for dataset in args.datasets:
        path = args.out / f"accuracy-{dataset}.png"
        plot(results, labels, dataset, path)
        print(f"accuracy curves: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

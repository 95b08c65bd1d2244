"""Fed-SAP reproduction: the paper's Table IV comparison and its ablations (Tables I-III),
with real fl-server and fl-edge daemons (fl-sim: 10 edges in 2 processes) on loopback.

Data: CIFAR-10 from ../shared/data/cifar-10 (and MNIST from ../shared/data/mnist with
--dataset mnist; the paper's Fashion-MNIST images are not available to us), cut by
fl-partition into 10 edges per (alpha, seed): Dirichlet(alpha) label skew or IID, a
stratified 20 % local test split per edge, and the same balanced global_test set in every
edge folder (CIFAR-10: the 1,000 official test images we have, 100 per class). A seed
fixes the partition and the run, so every method sees the same partitions.

Metric (Table IV's): the mean over edges of each edge's personalized model's accuracy,
final and best round, on the edge's local test split and on the shared global_test.

Protocols:
  default (CPU, the comparison of record): se-cnn (3 SE modules), --limit training images
    in all (about --limit/10 per edge), --rounds rounds of --epochs local epochs, seeds
    0 1 2. MobileNetV3-small from scratch does not learn within a CPU budget (6 centralised
    epochs on 3,170 CIFAR-10 images at 32x32: 10-20 % on the global test set; its BN
    momentum is 0.01, so eval-mode statistics lag for hundreds of steps);
  --full: the paper's backbone (MobileNetV3-small) and T = 50 rounds on all 50,000
    training images (a GPU machine).
MNIST is single-channel: the models are built with a 1-channel stem (MobileNetV3's first
conv takes 1 input channel), nothing is replicated.

    .venv/bin/python bench/fedsap.py                        # Table IV at alpha 0.5 + ablations
    .venv/bin/python bench/fedsap.py --alphas 0.5 1.0 iid   # more columns
    .venv/bin/python bench/fedsap.py --full --device cuda --jobs 4
    .venv/bin/python bench/fedsap.py --full --device cuda --what table --seeds 0 --jobs 7 \
        --only local fedavg fedprox fedbn fedper pse-only fedsap --budget-seconds 540
        # the Table IV core set in 10-minute commands: repeat it to resume (exit 3: unfinished)

Controls (issue #24): a FedPer row (on se-cnn the last SE module feeds the pooled
classifier, so Fed-SAP's private excitation of it is a per-edge head); --model se-cnn-tail
(a conv block after the last SE); the per-module swap diagnostic of every pSE run; rows
sum-{train,eval}-lambda=... (eq. 6 as printed, with wait_for_stats).

    .venv/bin/python bench/fedsap.py --what table --model se-cnn-tail --only fedavg fedper fedsap
    .venv/bin/python bench/fedsap.py --what table --report-only   # finished runs only

It prints a Table IV-like table (mean +- std over seeds) beside the paper's figures, a
per-seed table, the ablation tables, the swap diagnostic, an analysis of what GSR acts
on (the between-edge spread of the final models' squeeze statistics, and the GSR figures
the edges report), and writes
convergence curves (PNG) and all runs under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

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

SOURCES = {
    "cifar10": (SHARED_DATA / "cifar-10" / "cifar-10-batches-bin", 3, 32),
    "mnist": (SHARED_DATA / "mnist", 1, 28),
}
# Table IV (final average test accuracy %, T = 50), CIFAR-10 columns.
PAPER_TABLE_IV = {
    "local": {"iid": 52.1, "1.0": 51.3, "0.8": 48.9, "0.5": 46.1},
    "fedavg": {"iid": 71.34, "1.0": 60.26, "0.8": 55.38, "0.5": 53.18},
    "fedprox": {"iid": 71.77, "1.0": 71.62, "0.8": 70.0, "0.5": 66.8},
    "fedbn": {"iid": 72.35, "1.0": 74.0, "0.8": 73.1, "0.5": 71.5},
    "fedsap": {"iid": 77.64, "1.0": 76.21, "0.8": 76.82, "0.5": 75.32},
}
# Ablations, CIFAR-10 alpha 0.5 (Tables I-III; Table I gives average accuracy).
PAPER_ABLATIONS = {
    "pse-only": 71.4, "agg-se-e": 15.22, "local-align": 46.22, "l2": 71.98,
    "lambda=0.1": 66.19, "lambda=0.5": 67.31, "lambda=1.0": 69.26, "lambda=2.0": 75.11,
    "lambda=5.0": 68.9,
}


@dataclass
class Config:
    label: str
    method: str
    params: dict[str, object] = field(default_factory=dict)
    train: dict[str, object] = field(default_factory=dict)  # [train] values beside the method's


# FedPer (classifier private, no SE personalisation) is the control Table IV lacks: on
# se-cnn the last SE module sits right before the pooled classifier, so Fed-SAP's private
# excitation of it is itself a per-edge head (issue #24).
TABLE_IV = [Config("local", "local"), Config("fedavg", "fedavg"), Config("fedprox", "fedprox"),
            Config("fedbn", "fedbn"), Config("fedper", "fedper"), Config("fedsap", "fedsap")]
# Seeded like the main table: what the bar compares (GSR vs pSE alone) gets every seed,
# and GSR with the squeezes taken under BN's running statistics (fedsap.stats_mode).
PSE_ONLY = Config("pse-only", "fedsap", {"target": "off"})
FEDSAP_RUNNING = Config("fedsap-running", "fedsap", {"stats_mode": "eval"})
ABLATIONS = [
    Config("agg-se-e", "fedsap", {"personalization": "agg-se-e", "target": "off"}),
    Config("local-align", "fedsap", {"target": "local-align"}),
    Config("l2", "fedsap", {"target": "l2"}),
    *[Config(f"lambda={lam}", "fedsap", {"lam": lam}) for lam in (0.1, 0.5, 1.0, 5.0)],
    # GSR under running statistics, without round 1's pull toward S_G^0 = 0 / gentler.
    Config("running-wait", "fedsap", {"stats_mode": "eval", "wait_for_stats": True}),
    Config("running-lambda=0.5", "fedsap", {"stats_mode": "eval", "lam": 0.5}),
    # The pSE split with BN local as well (FedBN's rule): the squeezes then differ across
    # edges (26 % under FedBN), so GSR has something to align; with GSR and without.
    Config("fedsap+bn-local", "fedsap", train={"private": ["bn"]}),
    Config("pse-only+bn-local", "fedsap", {"target": "off"}, train={"private": ["bn"]}),
    # Eq. 6 as printed (sum over channels) with round 1's pull toward S_G^0 = 0 skipped,
    # under batch and running statistics (issue #24).
    *[Config(f"sum-{mode}-lambda={lam}", "fedsap",
             {"reduction": "sum", "wait_for_stats": True, "stats_mode": mode, "lam": lam})
      for mode in ("train", "eval") for lam in (0.1, 0.5, 2.0)],
]
# Ablation rows run with every seed (the comparisons that need the seed spread).
SEEDED = {"fedsap", "pse-only", "fedsap+bn-local", "pse-only+bn-local"}


def partition(args, alpha: str, seed: int) -> Path:
    source, _, _ = SOURCES[args.dataset]
    out = args.out / "data" / f"{args.dataset}-{alpha}-s{seed}-n{args.limit or 'all'}"
    scheme = ["--scheme", "iid"] if alpha == "iid" else ["--scheme", "dirichlet", "--alpha", alpha]
    limit = ["--limit", str(args.limit)] if args.limit else []
    fl_partition(out, args.out, ["--source", str(source), "--edges", str(args.edges), "--seed",
                                 str(seed), "--min-per-edge", "20", *scheme, *limit])
    return out


def run_protocol(args, alpha: str) -> str:
    """The folder of a protocol's runs under --out (its cache key, with the optimizer's)."""
    return (f"{args.dataset}-{alpha}-{args.model}-n{args.limit or 'all'}-b{args.batch_size}"
            f"{optimizer_state_tag(args)}")


def finished(args, config: Config, alpha: str, seed: int) -> Path | None:
    """The run's history when a run of this row, alpha and seed finished under --out."""
    protocol = run_protocol(args, alpha)
    history = args.out / "runs" / protocol / f"{config.label}-s{seed}" / "server" / "history.json"
    if not history.exists():
        return None
    rounds = json.loads(history.read_text())["rounds"]
    # The last round must have been scored by every edge: a worker killed in the last
    # round (out of memory, say) leaves all rounds recorded but no final evaluation.
    last = rounds[-1] if rounds else {}
    scored = last.get("evaluation", {}).get("summary", {}).get("test", {}).get("edges")
    if len(rounds) == args.rounds and scored == args.edges:
        return history
    return None


def federate(args, config: Config, alpha: str, seed: int) -> Path:
    _, channels, size = SOURCES[args.dataset]
    protocol = run_protocol(args, alpha)
    out = args.out / "runs" / protocol / f"{config.label}-s{seed}"
    history = out / "server" / "history.json"
    if finished(args, config, alpha, seed):
        return history  # finished earlier: --out doubles as a cache
    resume = resumable(out)  # an unfinished run continues from its last checkpoint
    data = partition(args, alpha, seed)
    sets = {"train.model": args.model, "train.in_channels": channels, "train.image_size": size,
            "train.lr": args.lr, "train.momentum": args.momentum, "train.batch_size": args.batch_size,
            "train.local_epochs": args.epochs, "server.eval_every": args.eval_every,
            "train.lr_schedule": "constant", "train.optimizer_state": args.optimizer_state,
            **{f"train.{k}": v for k, v in config.train.items()},
            **{f"{config.method}.{k}": v for k, v in config.params.items()}}
    flags = [f"--set={k}={json.dumps(v)}" for k, v in sets.items()]  # JSON scalars are TOML
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "fl_tools.sim", "--method", config.method, "--edges",
         str(args.edges), "--fraction", "1", "--rounds", str(args.rounds), "--procs",
         str(args.procs), "--data-root", str(data), "--out", str(out), "--seed", str(seed),
         "--device", args.device, *(["--data-on-device"] if args.device == "cuda" else []),
         *(["--resume"] if resume else []), *flags], out / "fl-sim.log", args.until)
    print(f"  {config.label:<14} alpha {alpha:<4} seed {seed}: {time.time() - started:6.0f} s"
          + (" (resumed)" if resume else ""), flush=True)
    return history


def squeeze_dispersion(run_dir: Path, data_root: Path, device: str) -> dict[str, float]:
    """What GSR acts on: the spread, across edges, of the final personalized models' mean
    squeeze statistics on each edge's own training data. Per SE module l,
    sqrt(sum_k w_k ||s_k,l - s_l||^2) / ||s_l|| with s_l = sum_k w_k s_k,l (w_k = n_k / N),
    averaged over modules; under BN's batch statistics ("train") and its running
    statistics ("eval", what the models predict with)."""
    import torch

    from fedattn_shared.data import load_edge_data
    from fedattn_shared.methods.fedsap import SqueezeRecorder
    from fl_edge.export import from_state_dir

    per_edge: dict[str, list[tuple[int, dict[str, torch.Tensor]]]] = {"eval": [], "train": []}
    for state in sorted(p for p in (run_dir / "state").iterdir() if p.is_dir()):
        personalized = from_state_dir(state, torch.device(device))
        data = load_edge_data(data_root / state.name, personalized.train).train
        model = personalized.algo.models["model"]
        recorder = SqueezeRecorder(model)
        for mode in ("eval", "train"):  # eval first: the train pass moves running statistics
            model.train(mode == "train")
            sums: dict[str, torch.Tensor] = {}
            with torch.no_grad():
                for start in range(0, len(data) - 1, 256):
                    x = data.x[start : start + 256].to(device)
                    for name, s in recorder.forward(model, x)[1].items():
                        sums[name] = sums.get(name, 0) + s.double().sum(dim=0)
            per_edge[mode].append((len(data), {k: v / len(data) for k, v in sums.items()}))
    out = {}
    for mode, edges in per_edge.items():
        total = sum(n for n, _ in edges)
        spreads = []
        for name in edges[0][1]:
            mean = sum(n * s[name] for n, s in edges) / total
            spread = sum(n * float((s[name] - mean).square().sum()) for n, s in edges) / total
            if mean.norm() > 0:
                spreads.append(math.sqrt(spread) / float(mean.norm()))
        out[mode] = 100 * statistics.mean(spreads) if spreads else float("nan")
    return out


def swap_diagnostic(run_dir: Path, data_root: Path, device: str) -> dict[str, dict[str, float]]:
    """The per-module swap diagnostic, offline from the run's saved edge states: for each SE
    module m (and all of them at once), every edge's personalized model with only m's
    private excitation replaced by the edges' n_k-weighted mean, scored on the edge's local
    test split and on global_test (mean over edges, %). "none" is the models as saved,
    which is the run's final evaluation. A module whose swap costs nothing carries no
    personalisation; one whose swap drops accuracy to FedAvg's level acts as a private head."""
    import torch

    from fedattn_shared.augment import InputPipeline
    from fedattn_shared.data import load_edge_data
    from fedattn_shared.methods.fedsap import mean_excitation, swapped_excitation
    from fedattn_shared.methods.split import squeeze_excitation_modules
    from fl_edge.export import from_state_dir
    from fl_edge.trainer import evaluate
    from fl_tools.report import accuracy

    dev = torch.device(device)
    edges = []
    for state in sorted(p for p in (run_dir / "state").iterdir() if p.is_dir()):
        personalized = from_state_dir(state, dev)
        edges.append((personalized, load_edge_data(data_root / state.name, personalized.train)))
    models = [p.algo.models["model"] for p, _ in edges]
    weights = [len(data.train) for _, data in edges]
    names = [name for name, _ in squeeze_excitation_modules(models[0])]

    def score(swap: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
        accs: dict[str, list[float]] = {"test": [], "global_test": []}
        for (p, data), model in zip(edges, models, strict=True):
            with contextlib.ExitStack() as stack:
                for name, tensors in swap.items():
                    stack.enter_context(swapped_excitation(model, name, tensors))
                for split in accs:
                    counts = evaluate(p.algo, getattr(data, split), split, p.train.num_classes,
                                      256, dev, InputPipeline(input_size=p.train.input_size))
                    accs[split].append(accuracy(counts.confusion))
        return {split: 100 * statistics.mean(values) for split, values in accs.items()}

    means = {name: mean_excitation(models, weights, name) for name in names}
    out = {"none": score({})}
    for name in names:
        out[name] = score({name: means[name]})
    out["all"] = score(means)
    return out


def reported_gsr(history_file: Path) -> dict[str, float]:
    """The edges' own GSR figures of the last training round (mean over edges)."""
    rounds = json.loads(history_file.read_text())["rounds"]
    metrics = list(rounds[-1]["train"]["edge_metrics"].values()) if rounds else []
    out = {}
    for key in ("gsr_loss", "stats_drift"):
        values = [m[key] for m in metrics if key in m]
        if values:
            out[key] = statistics.mean(values)
    return out


def figures(history_file: Path, seed: int, analysis: dict | None = None) -> dict:
    from fl_tools.report import analyze_run, load_history

    history = load_history(history_file)
    out: dict = {"seed": seed, "analysis": analysis or {}}
    for split in ("test", "global_test"):
        run_figures = analyze_run(history_file, history, split)
        out[split] = {"final": 100 * run_figures["final"]["mean_accuracy"],
                      "best": 100 * run_figures["best"]["mean_accuracy"],
                      "curve": [(r["round"], 100 * r["mean_accuracy"]) for r in run_figures["rounds"]]}
    return out




def table(results: dict, labels: list[str], alphas: list[str], paper: dict | None) -> str:
    lines = []
    for split, name in (("global_test", "shared global_test"), ("test", "each edge's local test")):
        lines.append(f"\nmean accuracy over edges (%), {name}: final / best, each mean ± std "
                     "over seeds (then every seed's own)"
                     + (" [paper, final]" if paper else ""))
        header = "| method | " + " | ".join(f"alpha {a}"
                                          for a in alphas) + " |"
        lines += [header, "|---" * (len(alphas) + 1) + "|"]
        for label in labels:
            cells = []
            for alpha in alphas:
                runs = results.get((label, alpha), [])
                seeds = [r["seed"] for r in runs]
                final = [r[split]["final"] for r in runs]
                best = [r[split]["best"] for r in runs]
                cell = f"{pm_seeds(final, seeds)} / {pm_seeds(best, seeds)}" if runs else "-"
                if paper is not None and label in paper:
                    cell += f" [{paper[label].get(alpha, '-')}]"
                cells.append(cell)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean_of(runs: list[dict], key: str, scale: float, digits: int) -> str:
    values = [r["analysis"][key] * scale for r in runs if key in r["analysis"]]
    return f"{statistics.mean(values):.{digits}f}" if values else "-"


def analysis_table(results: dict, labels: list[str], alphas: list[str]) -> str:
    lines = ["\nwhat GSR acts on (final models; mean over seeds): between-edge spread of the "
             "squeeze statistics, % of their norm,\nunder BN's running / batch statistics; "
             "the edges' mean GSR term (before lambda) and ||s_up - S_G|| / ||S_G||, last round",
             "| method | alpha | spread, running stats % | spread, batch stats % | GSR term | drift % |",
             "|---|---|---|---|---|---|"]
    for alpha in alphas + (["0.5"] if "0.5" not in alphas else []):
        for label in labels:
            runs = results.get((label, alpha), [])
            if not runs:
                continue

            cells = [_mean_of(runs, "eval", 1, 1), _mean_of(runs, "train", 1, 1),
                     _mean_of(runs, "gsr_loss", 1, 4), _mean_of(runs, "stats_drift", 100, 1)]
            lines.append(f"| {label} | {alpha} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_seed_table(results: dict, labels: list[str], alphas: list[str]) -> str:
    """Final accuracy per seed (local test / global_test): every row of a seed saw the
    same partition, so where the means are within the spread the paired view decides."""
    lines = ["\nper seed, final: each edge's local test / shared global_test (%)"]
    for alpha in alphas:
        seeds = sorted({r["seed"] for label in labels for r in results.get((label, alpha), [])})
        if not seeds:
            continue
        lines += [f"| alpha {alpha} | " + " | ".join(f"seed {s}" for s in seeds) + " |",
                  "|---" * (len(seeds) + 1) + "|"]
        for label in labels:
            by_seed = {r["seed"]: r for r in results.get((label, alpha), [])}
            if by_seed:
                lines.append(f"| {label} | " + " | ".join(
                    f"{by_seed[s]['test']['final']:.1f} / {by_seed[s]['global_test']['final']:.1f}"
                    if s in by_seed else "-" for s in seeds) + " |")
    return "\n".join(lines)


def swap_table(results: dict, labels: list[str], alphas: list[str]) -> str:
    """The per-module swap diagnostic: accuracy as saved, and its change when one SE
    module's private excitation (or all of them) is replaced by the edges' mean."""
    lines = ["\nper-module swap diagnostic (final models): accuracy as saved, and the change "
             "when only module m's private excitation\nis replaced by the edges' n_k-weighted "
             "mean on every edge (mean +- std over seeds; changes in points)"]
    for alpha in alphas:
        for label in labels:
            runs = [r for r in results.get((label, alpha), []) if "swap" in r]
            if not runs:
                continue
            modules = [m for m in runs[0]["swap"] if m != "none"]
            if len(lines) == 1:
                lines += ["| method | alpha | split | as saved | " + " | ".join(
                    f"swap {m}" for m in modules) + " | seeds |",
                    "|---" * (len(modules) + 5) + "|"]
            seeds = [r["seed"] for r in runs]
            for split in ("test", "global_test"):
                base = [r["swap"]["none"][split] for r in runs]
                cells = [pm_seeds([r["swap"][m][split] - r["swap"]["none"][split] for r in runs],
                                  seeds) for m in modules]
                lines.append(f"| {label} | {alpha} | {split} | {pm_seeds(base, seeds)} | "
                             + " | ".join(cells) + f" | {len(runs)} |")
    return "\n".join(lines)


def plot(results: dict, labels: list[str], alpha: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, split in zip(axes, ("global_test", "test"), strict=True):
        for label in labels:
            runs = results.get((label, alpha), [])
            if not runs:
                continue
            rounds = [r for r, _ in runs[0][split]["curve"]]
            mean = [statistics.mean(run[split]["curve"][i][1] for run in runs)
                    for i in range(len(rounds))]
            ax.plot(rounds, mean, label=label)
        ax.set_title(f"alpha {alpha}: {split} (mean over edges and seeds)")
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy %")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=sorted(SOURCES), default="cifar10")
    p.add_argument("--alphas", nargs="+", default=["0.5"],
                   help="Dirichlet alphas and/or 'iid' (the paper: iid 1.0 0.8 0.5)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--what", choices=["table", "ablations", "all"], default="all")
    p.add_argument("--full", action="store_true", help="the paper's 50 rounds on all data")
    p.add_argument("--model", default=None,
                   help="default se-cnn (CPU protocol), mobilenet-v3-small with --full")
    p.add_argument("--edges", type=int, default=10)
    p.add_argument("--limit", type=int, default=None,
                   help="training images in all (default 4000; all with --full)")
    p.add_argument("--rounds", type=int, default=None, help="default 16; 50 with --full")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    add_optimizer_state(p)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=None, help="default 2; 5 with --full")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the edges train (fl-sim --device)")
    p.add_argument("--jobs", type=int, default=1, help="federations run at once")
    p.add_argument("--only", nargs="+", metavar="LABEL",
                   help="run only these rows (e.g. fedsap pse-only fedsap-running)")
    p.add_argument("--report-only", action="store_true",
                   help="report the finished runs under --out; start none")
    p.add_argument("--budget-seconds", type=float, default=0,
                   help="> 0: stop the runs under way after this many seconds and exit "
                        f"{BUDGET_SPENT}; the same command resumes each from its last round "
                        "checkpoint (a GPU lease's 10-minute commands: 540)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-fedsap")
    args = p.parse_args()
    args.until = deadline(args.budget_seconds)
    source = SOURCES[args.dataset][0]
    if not source.exists():
        print(f"bench/fedsap.py: {source} is missing (set FEDATTN_DATA to the datasets' folder)",
              file=sys.stderr)
        return 2
    for name, cpu, full in (("limit", 4000, 0), ("rounds", 16, 50), ("eval_every", 2, 5)):
        if getattr(args, name) is None:
            setattr(args, name, full if args.full else cpu)
    args.model = args.model or ("mobilenet-v3-small" if args.full else "se-cnn")
    args.out = args.out.resolve()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{args.dataset}, {args.edges} edges, {args.model}, {args.rounds} rounds x "
          f"{args.epochs} epochs, {args.limit or 'all'} training images, lr {args.lr} "
          f"momentum {args.momentum} batch {args.batch_size}, {optimizer_state_words(args)}, "
          f"seeds {args.seeds}", flush=True)

    results: dict[tuple[str, str], list] = {}
    main_table = [*TABLE_IV, PSE_ONLY, FEDSAP_RUNNING]
    jobs: list[tuple[Config, str, int]] = []
    if args.what in ("table", "all"):
        # Seed by seed: every row of a seed finishes before the next seed starts.
        jobs += [(c, a, s) for a in args.alphas for s in args.seeds for c in main_table]
    if args.what in ("ablations", "all"):
        extra = [*TABLE_IV[-1:], PSE_ONLY] if args.what == "ablations" else []
        jobs += [(c, "0.5", s) for c in extra + ABLATIONS
                 for s in (args.seeds if c.label in SEEDED else args.seeds[:1])]
    if args.only:
        jobs = [job for job in jobs if job[0].label in args.only]
    if args.report_only:
        jobs = [job for job in jobs if finished(args, *job)]
    for alpha, seed in dict.fromkeys((a, s) for _, a, s in jobs):
        partition(args, alpha, seed)  # before the runs start: they share the partitions

    def one(job: tuple[Config, str, int]) -> None:
        config, alpha, seed = job
        history = federate(args, config, alpha, seed)
        data = partition(args, alpha, seed)
        spread = history.parent.parent / "squeeze-spread.json"  # cached like the runs
        if not spread.exists():
            spread.write_text(json.dumps(squeeze_dispersion(history.parent.parent, data,
                                                            args.device)))
        analysis = {**json.loads(spread.read_text()), **reported_gsr(history)}
        result = figures(history, seed, analysis)
        if config.method == "fedsap" and config.params.get("personalization", "pse") == "pse":
            cache = history.parent.parent / "swap.json"  # --out caches the diagnostic too
            if not cache.exists():
                swap = swap_diagnostic(history.parent.parent, data, args.device)
                cache.write_text(json.dumps(swap, indent=1))
            result["swap"] = json.loads(cache.read_text())
            for split in ("test", "global_test"):  # the saved models are what was scored
                if abs(result["swap"]["none"][split] - result[split]["final"]) > 1e-6:
                    print(f"  WARNING {config.label} seed {seed}: saved models score "
                          f"{result['swap']['none'][split]:.2f} on {split}, the run's final "
                          f"evaluation {result[split]['final']:.2f}", flush=True)
        results.setdefault((config.label, alpha), []).append(result)
        print(f"  {config.label:<14} alpha {alpha:<4} seed {seed}: final local test "
              f"{result['test']['final']:.1f}, global_test {result['global_test']['final']:.1f}",
              flush=True)

    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for future in [pool.submit(one, job) for job in jobs]:
                future.result()
    except BudgetSpent:
        done = sum(len(runs) for runs in results.values())
        print(f"\ntime budget spent ({args.budget_seconds:.0f} s): {done} of {len(jobs)} runs "
              "finished; repeat the command to resume the others from their last round "
              "checkpoint (--report-only prints the finished ones)", flush=True)
        return BUDGET_SPENT
    for runs in results.values():  # seed order, whatever order the jobs finished in
        runs.sort(key=lambda r: r["seed"])

    paper = PAPER_TABLE_IV if args.dataset == "cifar10" else None
    labels = [c.label for c in main_table if any((c.label, a) in results for a in args.alphas)]
    print(table(results, labels, args.alphas, paper))
    print(per_seed_table(results, labels, args.alphas))
    print(analysis_table(results, [c.label for c in main_table + ABLATIONS], args.alphas))
    print(swap_table(results, [c.label for c in main_table + ABLATIONS],
                     sorted({a for _, a in results})))
    if args.what in ("ablations", "all"):
        ablation_labels = ["fedsap", "pse-only", *[c.label for c in ABLATIONS]]
        print("\nablations, alpha 0.5 (paper, CIFAR-10 alpha 0.5: "
              + ", ".join(f"{k} {v}" for k, v in PAPER_ABLATIONS.items()) + ")")
        print(table(results, ablation_labels, ["0.5"], None))
    for alpha in args.alphas:
        if not any((label, alpha) in results for label in labels):
            continue  # an ablations-only run must not overwrite the table's curves
        path = args.out / f"convergence-{args.dataset}-{alpha}-{args.model}.png"
        plot(results, labels, alpha, path)
        print(f"\nconvergence curves: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

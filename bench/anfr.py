"""ANFR under label skew: BN / GN / SE / NF-ResNet and ANFR under FedAvg, FedProx, FedAdam,
SCAFFOLD and FedPer (the paper's Tables 1-2 comparison), plus its Fig. 3 check (channel
attention weights across classes after federated training, SE-ResNet vs ANFR), with real
fl-server and fl-edge daemons (fl-sim) on loopback.

Data: CIFAR-10 from ../shared/data/cifar-10, cut by fl-partition per seed into
  * "shards" (the paper's 'split-2' style, Qu et al. 2022: every edge holds a few whole
    classes and none of the others): --edges edges x --classes-per-edge classes;
  * "dirichlet": Dirichlet(--alpha) label skew (Hsu et al.),
each edge with a stratified 20 % local test split and the same balanced global_test set.
A seed fixes partition and run, so every architecture sees the same partitions.

Metrics: GFL methods (FedAvg, FedProx, FedAdam, SCAFFOLD) report the global model's
accuracy on the shared balanced global_test set (the paper's metric: one global model);
FedPer (pFL) reports the mean over edges of each edge's personalized model on its own
local test split. Both columns are printed for every method.

Protocols:
  default (CPU): compact depth (1 bottleneck per stage, quarter width; ~0.5 M parameters),
    5 edges x 4 classes, --limit 1,500 training images, 8 rounds of 1 local epoch, SGD
    lr 0.03 with cosine decay (the paper's CIFAR-10 optimiser) momentum 0.9 (0 under
    SCAFFOLD, whose update assumes plain SGD), batch 32,
    seeds 0 1 2; every method on "shards", FedAvg also on Dirichlet(0.5). From scratch.
  --full: the -50 models (bn-resnet-50, gn-resnet-50, se-resnet-50, nf-resnet-50,
    anfr-se-50), 10 edges x 4 classes, all 50,000 images, 50 rounds (a GPU machine; the
    paper trains 100 rounds from ImageNet weights at 224x224, which we cannot download).

    .venv/bin/python bench/anfr.py                      # the CPU protocol
    .venv/bin/python bench/anfr.py --full --device cuda
    .venv/bin/python bench/anfr.py attention --data-dir EDGE_DIR RUN_DIR...  # Fig. 3 only
    .venv/bin/python bench/anfr.py --pretrained 3 --clip-grad-norm 1 --augment crop-flip \
        --schemes shards --methods fedavg --archs ANFR NF-ResNet BN-ResNet --eval-every 2
        # from centrally pretrained weights (see anfr_pretrain.py)
    .venv/bin/python bench/anfr.py --pretrained 30 --pretrain-no-attention-decay --skipinit \
        --clip-grad-norm 1 --augment crop-flip --schemes shards --methods fedavg \
        --archs ANFR NF-ResNet --eval-every 2 --seeds 0 1 2 3 4 5 6 7 8 9
        # ANFR vs NF-ResNet in timm's SkipInit form: the protocol where ANFR's gates move
        # (docs/methods/anfr.md, "Gates that move")

FedAdam's server learning rate (Reddi et al., https://arxiv.org/abs/2003.00295, tune it
per task over a grid) is swept: each value of --fedadam-server-lrs (default 1e-3,3e-3,1e-2)
is its own column, "fedadam-slr<lr>", so the table reports FedAdam at each rate.
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

import torch
from _harness import (
    ROOT,
    SHARED_DATA,
    add_optimizer_state,
    fl_partition,
    optimizer_state_tag,
    optimizer_state_words,
    pm_seeds,
    resumable,
    run,
)

CIFAR10 = SHARED_DATA / "cifar-10" / "cifar-10-batches-bin"
ARCHS = {  # label -> (compact model, -50 model)
    "BN-ResNet": ("bn-resnet-compact", "bn-resnet-50"),
    "GN-ResNet": ("gn-resnet-compact", "gn-resnet-50"),
    "SE-ResNet": ("se-resnet-compact", "se-resnet-50"),
    "NF-ResNet": ("nf-resnet-compact", "nf-resnet-50"),
    "ANFR": ("anfr-se-compact", "anfr-se-50"),
}
# --skipinit: the NF families in timm's SkipInit form (conv3 gain 1, a scalar branch scale
# starting at 0), whose attention sees live features from the first step; compact only.
SKIPINIT = {"ANFR": "anfr-se-compact-skipinit", "NF-ResNet": "nf-resnet-compact-skipinit"}


def model_name(args, arch: str) -> str:
    """The registry model of ``arch`` under this run's flags."""
    if args.skipinit and arch in SKIPINIT:
        return SKIPINIT[arch]
    return ARCHS[arch][1 if args.full else 0]


METHODS = ["fedavg", "fedprox", "fedadam", "scaffold", "fedper"]
GFL = {"fedavg", "fedprox", "fedadam", "scaffold"}
# Paper, CIFAR-10 split-2, pretrained -50 models at 224x224 (Table 1, GFL accuracy %): only
# the figures its text keeps (METHODS.md 5.4).
PAPER = {
    ("ANFR", "fedavg"): 97.42, ("NF-ResNet", "fedavg"): 96.72, ("BN-ResNet", "fedavg"): 91.71,
    ("ANFR", "fedprox"): 96.33, ("NF-ResNet", "fedprox"): 96.82, ("ANFR", "fedadam"): 96.93,
    ("ANFR", "scaffold"): 97.38,
}


DEFAULT_FEDADAM_SERVER_LRS = (1e-3, 3e-3, 1e-2)
SWEPT = "fedadam"


def server_lrs(text: str) -> list[float]:
    """``--fedadam-server-lrs 1e-3,3e-3``: positive rates, each once, in the given order."""
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not rates or any(not 0 < r < float("inf") for r in rates) or len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"need distinct positive rates, got {text!r}")
    return rates


def variant(method: str, server_lr: float) -> str:
    return f"{method}-slr{server_lr:g}"


def expand(methods: list[str], rates: list[float]) -> list[str]:
    """Run labels: FedAdam becomes one label per server learning rate, the others stay."""
    return [label for m in methods
            for label in ([variant(m, r) for r in rates] if m == SWEPT else [m])]


def base_method(label: str) -> tuple[str, dict[str, float]]:
    """``fedadam-slr0.003`` -> ("fedadam", {"fedadam.server_lr": 0.003})."""
    method, sep, rate = label.partition("-slr")
    return (method, {f"{method}.server_lr": float(rate)}) if sep else (label, {})


def partition(args, scheme: str, seed: int) -> Path:
    detail = (f"{args.classes_per_edge}c" if scheme == "shards" else f"a{args.alpha}")
    out = args.out / "data" / f"{scheme}-{detail}-e{args.edges}-s{seed}-n{args.limit or 'all'}"
    options = (["--shards-per-edge", str(args.classes_per_edge)] if scheme == "shards"
               else ["--alpha", str(args.alpha), "--min-per-edge", "20"])
    limit = ["--limit", str(args.limit)] if args.limit else []
    fl_partition(out, args.out, ["--source", str(args.cifar10), "--edges", str(args.edges), "--seed",
                                 str(seed), "--scheme", scheme, "--global-test-per-class",
                                 str(args.global_test_per_class), *options, *limit])
    return out


def recipe_tag(args) -> str:
    """Run-folder suffix for a non-default recipe, so --out's cache never mixes recipes."""
    parts = ([f"clip{args.clip_grad_norm:g}"] if args.clip_grad_norm else []) + \
        ([args.augment] if args.augment != "none" else []) + \
        (["skipinit"] if args.skipinit else []) + \
        ([f"pre{args.pretrained}"] if args.pretrained else []) + \
        (["attn-nowd"] if args.pretrained and args.pretrain_no_attention_decay else []) + \
        ([f"ps{args.pretrain_seed}"] if args.pretrained and args.pretrain_seed else []) + \
        (["graft"] if args.pretrained and args.anfr_from_nf else [])
    return "".join(f"-{p}" for p in parts) + optimizer_state_tag(args)


# --pretrained --anfr-from-nf: the attention families graft fresh attention modules onto
# their attention-free twin's pretrained weights (anfr_pretrain.graft).
GRAFT_SOURCE = {"ANFR": "NF-ResNet", "SE-ResNet": "BN-ResNet"}


def init_weights(args, arch: str) -> Path | None:
    """The ``--init-weights`` file of ``arch`` under ``--pretrained`` (made on first use,
    then reused from --out): the compact model pretrained for ``args.pretrained`` epochs
    on CIFAR-10 images 10,000-49,999 (seed --pretrain-seed, default 0), each architecture
    itself, as the paper pretrains ANFR itself on ImageNet; with ``--anfr-from-nf`` ANFR
    (SE-ResNet) takes NF-ResNet's (BN-ResNet's) weights plus fresh attention. None without
    --pretrained."""
    if not args.pretrained:
        return None
    from anfr_pretrain import graft, pretrain, weights_file

    source = GRAFT_SOURCE.get(arch, arch) if args.anfr_from_nf else arch
    folder = args.out / "pretrained"
    base = weights_file(folder, model_name(args, source), args.pretrained,
                        not args.pretrain_no_attention_decay, args.pretrain_seed)
    if not base.exists():
        figures = pretrain(model_name(args, source), args.cifar10, base, args.pretrained,
                           seed=args.pretrain_seed,
                           attention_decay=not args.pretrain_no_attention_decay)
        print(f"  pretrained {source}: {figures}", flush=True)
    if source == arch:
        return base
    grafted = folder / f"{model_name(args, arch)}-from-{base.name}"
    if not grafted.exists():
        graft(base, model_name(args, arch), grafted)
    return grafted


def run_dir(args, scheme: str, arch: str, method: str, seed: int) -> Path:
    return args.out / "runs" / scheme / f"{arch}-{method}{recipe_tag(args)}-s{seed}"


def finished(history: Path, rounds: int) -> bool:
    return history.exists() and len(json.loads(history.read_text())["rounds"]) == rounds


def federate(args, scheme: str, arch: str, method: str, seed: int) -> Path:
    out = run_dir(args, scheme, arch, method, seed)
    history = out / "server" / "history.json"
    if finished(history, args.rounds):
        return history  # finished earlier: --out doubles as a cache
    resume = resumable(out)  # an unfinished run continues from its last checkpoint
    data = partition(args, scheme, seed)
    model = model_name(args, arch)
    label = method
    method, method_sets = base_method(label)
    init = init_weights(args, arch)
    # The head stays fresh (seeded per run), as the paper re-heads its ImageNet weights.
    init_sets = {"server.init_weights": str(init), "server.init_skip_head": True} if init else {}
    sets = {"train.model": model, "train.in_channels": 3, "train.image_size": 32,
            "train.lr": args.lr, "train.batch_size": args.batch_size,
            # SCAFFOLD's control-variate update assumes plain SGD (and refuses momentum).
            "train.momentum": 0.0 if method == "scaffold" else args.momentum,
            "train.local_epochs": args.epochs, "train.lr_schedule": "cosine",
            "train.optimizer_state": args.optimizer_state, "server.eval_every": args.eval_every,
            "server.round_timeout": 3600,
            "train.clip_grad_norm": args.clip_grad_norm, "train.augment": args.augment,
            **init_sets, **method_sets}
    # ANFR under FedAvg runs as --method anfr (FedAvg over an ANFR model, the same
    # aggregation), whose edges report the gates' class-to-class spread every round.
    method = "anfr" if (arch, method) == ("ANFR", "fedavg") else method
    flags = [f"--set={k}={json.dumps(v) if isinstance(v, (str, bool)) else v}" for k, v in sets.items()]
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "fl_tools.sim", "--method", method, "--edges", str(args.edges),
         "--fraction", "1", "--rounds", str(args.rounds), "--procs", str(args.procs),
         "--data-root", str(data), "--out", str(out), "--seed", str(seed),
         *(["--resume"] if resume else []), *flags], out / "fl-sim.log")
    print(f"  {scheme:<9} {arch:<9} {label:<8} seed {seed}: {time.time() - started:5.0f} s"
          + (" (resumed)" if resume else ""), flush=True)
    return history


def figures(history_file: Path) -> dict:
    """Accuracy (%) on both splits at the final round (``test``, ``global_test``) and at
    the split's best evaluated round (``test-best``, ...), and the per-round mean over
    edges of the training figure ``gate_class_std`` (runs whose edges report it)."""
    from fl_tools.report import analyze_run, load_history

    history = load_history(history_file)
    out: dict = {}
    for split in ("test", "global_test"):
        analysis = analyze_run(history_file, history, split)
        out[split] = 100 * analysis["final"]["mean_accuracy"]
        out[f"{split}-best"] = 100 * analysis["best"]["mean_accuracy"]
    gates = []
    for record in history["rounds"]:
        edges = (record.get("train") or {}).get("edge_metrics") or {}
        values = [m["gate_class_std"] for m in edges.values() if "gate_class_std" in m]
        gates.append(statistics.mean(values) if values else math.nan)
    out["gates"] = gates
    return out




def table(results: dict, scheme: str, methods: list[str], split: str, paper: bool,
          archs: tuple[str, ...] | list[str] = tuple(ARCHS), best: bool = False) -> str:
    name = {"global_test": "global model on the shared balanced global_test",
            "test": "mean over edges, each edge's model on its local test split"}[split]
    when = "best-round" if best else "final-round"
    key = f"{split}-best" if best else split
    lines = [f"\n{scheme}: {when} accuracy (%), {name}, mean ± std over seeds (then each seed's)"
             + (" [paper Table 1, pretrained -50 at 224 px]" if paper else ""),
             "| architecture | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for arch in archs:
        cells = []
        for method in methods:
            runs = results.get((scheme, arch, method), [])
            cell = pm_seeds([r[key] for r in runs], [r["seed"] for r in runs]) if runs else "-"
            if paper and (arch, base_method(method)[0]) in PAPER:
                cell += f" [{PAPER[arch, base_method(method)[0]]}]"
            cells.append(cell)
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_seed(results: dict, scheme: str, methods: list[str], seeds: list[int],
             archs: list[str], pair: tuple[str, str] = ("ANFR", "NF-ResNet")) -> str:
    """Final-round accuracy per seed on both splits, and ``pair[0]`` minus ``pair[1]``:
    effects of a point or two need the seeds side by side, not just means."""
    if not all(a in archs for a in pair):
        return ""
    lines = [f"\n{scheme}: per seed, final round, global_test / local test (%); "
             f"{pair[0]} - {pair[1]} in the last column",
             "| method | seed | " + " | ".join(archs) + f" | {pair[0]} - {pair[1]} |",
             "|---" * (len(archs) + 3) + "|"]
    gaps: dict[str, list[tuple[float, float]]] = {}
    for method in methods:
        for seed in seeds:
            runs = {a: [r for r in results.get((scheme, a, method), []) if r["seed"] == seed]
                    for a in archs}
            if not (runs[pair[0]] and runs[pair[1]]):
                continue
            cells = [f"{runs[a][0]['global_test']:.1f} / {runs[a][0]['test']:.1f}" if runs[a]
                     else "-" for a in archs]
            first, second = runs[pair[0]][0], runs[pair[1]][0]
            delta = (f"{first['global_test'] - second['global_test']:+.1f}"
                     f" / {first['test'] - second['test']:+.1f}")
            lines.append(f"| {method} | {seed} | " + " | ".join(cells) + f" | {delta} |")
            gaps.setdefault(method, []).append((first["global_test"] - second["global_test"],
                                                first["test"] - second["test"]))
    for method, pairs in gaps.items():
        lines.append(f"{method}: paired {pair[0]} - {pair[1]} over {len(pairs)} seeds, global_test "
                     f"{paired(p[0] for p in pairs)}; local test {paired(p[1] for p in pairs)}")
    return "\n".join(lines)


def paired(gaps) -> str:
    """Mean ± sample std of per-seed differences and how many favour the first model."""
    values = list(gaps)
    spread = f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""
    return (f"{statistics.mean(values):+.2f}{spread} "
            f"({sum(v > 0 for v in values)}/{len(values)} positive)")


GATES_MOVED = 0.05  # the bar: gates that differ by class at least this much


def gate_table(results: dict, scheme: str) -> str:
    """The training figure gate_class_std (mean over edges) per round of the ANFR FedAvg
    runs: how far the attention moved from treating every class alike."""
    runs = results.get((scheme, "ANFR", "fedavg"), [])
    if not runs or all(math.isnan(g) for r in runs for g in r["gates"]):
        return ""
    rounds = len(runs[0]["gates"])
    lines = [f"\n{scheme}: ANFR under FedAvg, gate_class_std by round (training figure: mean "
             "over attention modules of the std over classes of the per-class mean gate, on "
             f"each edge's own training batches; mean over edges); moved = max > {GATES_MOVED}",
             "| seed | " + " | ".join(f"r{i + 1}" for i in range(rounds)) + " | max | moved |",
             "|---" * (rounds + 3) + "|"]
    for run_ in runs:
        seed, gates = run_["seed"], run_["gates"]
        peak = max(g for g in gates if not math.isnan(g))
        lines.append(f"| {seed} | " + " | ".join(f"{g:.4f}" for g in gates)
                     + f" | {peak:.4f} | {'yes' if peak > GATES_MOVED else 'no'} |")
    return "\n".join(lines)


# ---- Fig. 3: channel-attention weights across classes ---------------------------------


@torch.no_grad()
def attention_variability(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                          num_classes: int, batch_size: int = 250) -> dict[str, float]:
    """Figures of the attention gates (the paper's Fig. 3): per module, the per-class mean
    gate vector A (classes x channels) over ``x``. For the last module: ``class_std``, the
    std across classes per channel averaged over channels (does attention still depend on
    the class?), ``spread`` the std of all entries of A, ``mean`` its mean and
    ``saturated`` the share of entries above 0.9 (gates saturating toward 1 turn the module
    into an identity map up to scale); ``class_std_all`` is ``class_std`` averaged over
    every module (the offline twin of the edges' training figure ``gate_class_std``)."""
    from fedattn_shared.methods.anfr import attention_gates, class_std

    gates = attention_gates(model)
    captured: dict[str, list[torch.Tensor]] = {name: [] for name, _ in gates}
    handles = [gate.register_forward_hook(
        lambda _m, _i, out, name=name: captured[name].append(out.flatten(1)))
        for name, gate in gates]
    try:
        model.eval()
        for i in range(0, len(x), batch_size):
            model(x[i:i + batch_size])
    finally:
        for handle in handles:
            handle.remove()
    per_class = {}
    for name, outputs in captured.items():
        values = torch.cat(outputs).double()
        per_class[name] = torch.stack([values[y == c].mean(0) for c in range(num_classes)
                                       if (y == c).any()])
    last_name = gates[-1][0]
    last = per_class[last_name]
    return {"module": last_name, "channels": last.shape[1],
            "class_std": class_std(last), "spread": float(last.std()),
            "mean": float(last.mean()), "saturated": float((last > 0.9).double().mean()),
            "class_std_all": statistics.mean(class_std(a) for a in per_class.values())}


def analyse_run(path: Path, data_dir: Path) -> dict[str, dict[str, float]]:
    """Before (the run's initial model: seeded, or its --init-weights as the server loaded
    them) and after (the first edge's model at the end, global weights loaded) on the
    global_test images of ``data_dir``."""
    from fedattn_shared.data import load_edge_data
    from fl_edge import export as tools
    from fl_server.initial import load_initial_weights

    after = tools.from_state_dir(sorted((path / "state").iterdir())[0])
    data = load_edge_data(data_dir, after.train)
    split = data.global_test or data.test
    models = after.method.build_models()
    server = json.loads((path / "server" / "history.json").read_text())["manifest"]["server"]
    if server.get("init_weights"):
        load_initial_weights(models, Path(server["init_weights"]), after.method.head,
                             bool(server.get("init_skip_head")))
    fresh = models["model"]
    return {"before": attention_variability(fresh, split.x, split.y, after.train.num_classes),
            "after": attention_variability(after.algo.models["model"], split.x, split.y,
                                           after.train.num_classes)}


def attention_report(paths: list[Path], data_dir: Path) -> str:
    lines = ["\nFig. 3: channel-attention gates on the global_test set, per-class mean vectors "
             "(before = the run's initial model, seeded or its --init-weights; after = the "
             "end of the run); last "
             "module unless marked",
             "| run | channels | class std before -> after | all modules' class std | "
             "spread | mean gate | share > 0.9 |", "|---|---|---|---|---|---|---|"]
    for path in paths:
        f = analyse_run(path, data_dir)
        b, a = f["before"], f["after"]
        lines.append(f"| {path.name} | {a['channels']} | {b['class_std']:.4f} -> {a['class_std']:.4f}"
                     f" | {b['class_std_all']:.4f} -> {a['class_std_all']:.4f}"
                     f" | {b['spread']:.4f} -> {a['spread']:.4f} | {b['mean']:.3f} -> {a['mean']:.3f}"
                     f" | {b['saturated']:.2f} -> {a['saturated']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "attention":
        p = argparse.ArgumentParser(prog="bench/anfr.py attention",
                                    description="Fig. 3 figures of finished runs (fl-sim --out)")
        p.add_argument("--data-dir", type=Path, required=True,
                       help="an edge data folder with global_test (fl-partition output)")
        p.add_argument("runs", nargs="+", type=Path)
        sub = p.parse_args(sys.argv[2:])
        print(attention_report(sub.runs, sub.data_dir))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the -50 models on all data (GPU)")
    p.add_argument("--schemes", nargs="+", default=["shards", "dirichlet"],
                   choices=["shards", "dirichlet"])
    p.add_argument("--methods", nargs="+", choices=METHODS,
                   default=["fedavg", "fedper", "scaffold", "fedprox", "fedadam"],
                   help="in the order they run (FedAvg first: the paper's headline)")
    p.add_argument("--dirichlet-methods", nargs="+", default=["fedavg"], choices=METHODS,
                   help="methods run on the Dirichlet partition (default FedAvg only)")
    p.add_argument("--fedadam-server-lrs", type=server_lrs,
                   default=list(DEFAULT_FEDADAM_SERVER_LRS), metavar="LR,LR,...",
                   help="FedAdam server learning rates, each run and reported as its own "
                        "column (default 1e-3,3e-3,1e-2)")
    p.add_argument("--clip-grad-norm", type=float, default=0.0,
                   help="train.clip_grad_norm for every run (the ANFR paper uses 1.0; 0: off)")
    p.add_argument("--augment", choices=["none", "crop-flip", "resized-crop"], default="none",
                   help="train.augment for every run (crop-flip: the CIFAR recipe)")
    p.add_argument("--pretrained", type=int, default=0, metavar="EPOCHS",
                   help="start every run from its family's compact model pretrained centrally "
                        "for EPOCHS epochs on CIFAR-10 images 10,000-49,999 (disjoint from "
                        "the federations' first --limit images); 0: from scratch")
    p.add_argument("--pretrain-no-attention-decay", action="store_true",
                   help="with --pretrained: no weight decay on the attention modules' tensors "
                        "while pretraining (decay shrinks the SE weights; the gates need them)")
    p.add_argument("--pretrain-seed", type=int, default=0,
                   help="with --pretrained: the pretraining run's seed (one checkpoint per "
                        "architecture, shared by every federation seed)")
    p.add_argument("--anfr-from-nf", action="store_true",
                   help="with --pretrained: ANFR starts from NF-ResNet's pretrained weights "
                        "plus fresh attention modules (SE-ResNet from BN-ResNet's)")
    p.add_argument("--skipinit", action="store_true",
                   help="ANFR and NF-ResNet in timm's SkipInit form (anfr-se-compact-skipinit, "
                        "nf-resnet-compact-skipinit): conv3 gain 1, a zero-initialised branch "
                        "scale, so the attention is live from the first step")
    p.add_argument("--archs", nargs="+", choices=list(ARCHS), default=list(ARCHS),
                   help="architectures to run (default all)")
    p.add_argument("--cifar10", type=Path, default=CIFAR10,
                   help="the cifar-10-batches-bin folder (default ../shared/data/cifar-10/...)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--edges", type=int, default=5)
    p.add_argument("--classes-per-edge", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--limit", type=int, default=1500, help="training images in all (CPU)")
    p.add_argument("--global-test-per-class", type=int, default=100)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--momentum", type=float, default=0.9)
    add_optimizer_state(p)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-anfr")
    p.add_argument("--no-attention", action="store_true",
                   help="leave out the offline Fig. 3 table (two forward passes over "
                        "global_test per run: minutes on a loaded machine)")
    p.add_argument("--report-only", action="store_true",
                   help="print the tables from the finished runs under --out, run nothing")
    args = p.parse_args()
    if not args.cifar10.exists():
        print(f"bench/anfr.py: {args.cifar10} is missing (set FEDATTN_DATA "
              "or pass --cifar10)", file=sys.stderr)
        return 2
    if args.full:
        args.edges, args.limit, args.rounds = 10, 0, 50
    args.out = args.out.resolve()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    depth = "-50" if args.full else "compact"
    print(f"CIFAR-10, {args.edges} edges, {depth} models, {args.rounds} rounds x {args.epochs} "
          f"epochs, {args.limit or 'all'} training images, SGD lr {args.lr} cosine momentum "
          f"{args.momentum} batch {args.batch_size}, {optimizer_state_words(args)}, seeds "
          f"{args.seeds}; shards: "
          f"{args.classes_per_edge} classes per edge, dirichlet: alpha {args.alpha}; FedAdam "
          f"server lr {', '.join(f'{r:g}' for r in args.fedadam_server_lrs)}; gradient clip "
          f"{args.clip_grad_norm or 'off'}, augmentation {args.augment}, "
          + (f"pretrained {args.pretrained} epochs on CIFAR-10 images 10,000-49,999"
             + (" (no weight decay on attention)" if args.pretrain_no_attention_decay else "")
             + (f", pretraining seed {args.pretrain_seed}" if args.pretrain_seed else "")
             if args.pretrained else "from scratch")
          + (", ANFR and NF-ResNet in the SkipInit form" if args.skipinit else ""), flush=True)
    if args.skipinit and args.full:
        print("bench/anfr.py: --skipinit has compact models only", file=sys.stderr)
        return 2
    if args.pretrained and not 0 < args.limit <= 10_000:
        print("bench/anfr.py: --pretrained needs --limit <= 10,000 (the pretraining images "
              "start at 10,000)", file=sys.stderr)
        return 2

    # Seed-major: every cell gets its first seed before any gets its second, so an
    # interrupted run (rerun with --report-only) still covers the whole table.
    plan = [(scheme, label) for scheme in args.schemes for method in args.methods
            if scheme == "shards" or method in args.dirichlet_methods
            for label in expand([method], args.fedadam_server_lrs)]
    results: dict[tuple[str, str, str], list[dict]] = {}
    for seed in args.seeds:
        for scheme, method in plan:
            for arch in args.archs:
                history = (run_dir(args, scheme, arch, method, seed) / "server" / "history.json"
                           if args.report_only else federate(args, scheme, arch, method, seed))
                if finished(history, args.rounds):
                    results.setdefault((scheme, arch, method), []).append(
                        {**figures(history), "seed": seed})
    for scheme in args.schemes:
        methods = [m for s, m in plan if s == scheme]
        gfl = [m for m in methods if base_method(m)[0] in GFL]
        for best in (False, True):
            if gfl:
                print(table(results, scheme, gfl, "global_test", paper=scheme == "shards" and not best,
                            archs=args.archs, best=best))
            print(table(results, scheme, methods, "test", paper=False, archs=args.archs, best=best))
        print(per_seed(results, scheme, methods, args.seeds, args.archs))
        print(gate_table(results, scheme))
    for seed in [] if args.no_attention else args.seeds:
        runs = [run_dir(args, "shards", arch, "fedavg", seed) for arch in ("SE-ResNet", "ANFR")
                if arch in args.archs]
        if all(finished(r / "server" / "history.json", args.rounds) for r in runs):
            print(attention_report(runs, partition(args, "shards", seed) / "edge_00"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

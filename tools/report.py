"""``fl-report``: figures, tables and plots from one or more fl-server ``history.json`` files.

Usage::

    fl-report RUN_DIR [RUN_DIR ...] [--out DIR] [--split test|global_test]
    fl-report --edge-state STATE_DIR [STATE_DIR ...] [--out DIR]

A RUN_DIR is a server ``--checkpoint-dir`` (the one holding ``history.json``) or the path
of a ``history.json`` itself. Output in ``--out``: ``summary.md``, ``summary.json``,
``accuracy.png`` and, per run, ``bytes_<run>.png``, ``participation_<run>.png``, ``edges_<run>.png``
(accuracy per edge and round) and, when the method records it, ``similarity_<run>.png``;
with two runs or more, ``bytes_vs_accuracy.png`` (one point per run: wire bytes per round
against final and best accuracy, labelled with the run's ``--compress`` spec, for
comparing codecs); the markdown tables are also printed to stdout. Bad input (a missing directory or history,
unreadable JSON, a history without any evaluated round for the split) exits with status 2
and a message that names the path.

Conventions (as in the FedSTAR code base's metrics, where they overlap):

- Everything is recomputed from the per-edge sums the edges sent
  (``rounds[i].evaluation.per_edge[edge][split]``: ``correct`` of ``n`` samples, and the
  ``loss`` and ``brier`` means); the accuracies and summaries the server precomputed are
  never read. Edges without a sample are left out of a round, as the server does. A
  history from before protocol 4 holds each edge's ``confusion`` instead: its trace and
  sum are the same two counts.
- mean accuracy = mean over edges of each edge's accuracy; the "std over edges" beside it
  is the population std (ddof=0) of those per-edge accuracies.
- pooled accuracy = total correct / total samples over all edges.
- Per-class figures need the per-class counts, which edges send only when the server ran
  with ``--eval-detail`` (``confusion``: rows = true class, columns = predicted class);
  without them a round's F1 figures are NaN ("n/a"). The pooled confusion is the sum of
  the edges' confusions. F1 of class c = 2 TP_c / (support_c + predicted_c) (= 2PR /
  (P + R), and 0 when TP_c = 0). macro F1 = unweighted mean over the classes that have
  support or predictions in the pooled confusion; a class with neither is left out
  (scikit-learn's default when the labels are inferred from the data), a class predicted
  but absent counts with F1 = 0. weighted F1 = support-weighted mean of the per-class F1
  of the pooled confusion.
- Brier = (sum over edges of brier_e * n_e) / (sum of n_e): the per-edge ``brier`` in the
  history is brier_sum / n, so this is the mean over all samples of sum_c (p_c - y_c)^2.
  The pooled loss is reconstructed the same way.
- Per run: best round = the evaluated round with the highest mean accuracy (the earliest
  one on ties); final round = the last evaluated round; convergence round = the first
  evaluated round whose mean accuracy reaches 95 % of the best.
- Runs are grouped by configuration: the same manifest ``method``, ``train`` without
  ``seed``, ``params``, and ``server`` without ``checkpoint_dir``, ``port``,
  ``metrics_port`` and ``resume``. Per group: mean and population std (ddof=0) over its
  runs (seeds) of the figures at the final round and at each run's best round.
- Bytes are the wire bytes (protobuf + gRPC prefix) per round, direction and payload kind
  as the server counted them (``rounds[i].bytes``). Participation is the ``train`` phase's
  selected, received and dropped edges.
- Bytes vs accuracy: a run's wire bytes per round in a direction = its total over all
  kinds and rounds / the rounds that recorded bytes (the mean round, meta and statistics
  included: what a link carries); its compress spec = manifest ``server.compress`` (""
  and a history from before the setting: "none").
- ``--edge-state``: the edges' own state dirs (or their ``private-history.json``), copied
  from the devices. Their private figures are merged into ``attention_weights.md``: the
  hybrid attention weights per edge, mechanism and layer at each edge's last training round
  (pFedLA's Table 5), layers in the backbone's order, with the mean over layers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# *_bnrecal: the BN-recalibrated diagnostic (train.bn_recalibrated_eval)
SPLITS = ("test", "global_test", "test_bnrecal", "global_test_bnrecal")
IGNORED_SERVER_KEYS = frozenset({"checkpoint_dir", "port", "metrics_port", "resume"})
CONVERGENCE_FRACTION = 0.95
FINAL_METRICS = ("mean_accuracy", "pooled_accuracy", "macro_f1", "weighted_f1", "brier")
BEST_METRICS = ("mean_accuracy", "pooled_accuracy", "macro_f1")


class ReportError(Exception):
    """Bad input; the message names the offending path."""


# ---- pure figures ----------------------------------------------------------------------------

def as_confusion(confusion: Any) -> np.ndarray:
    """A square, non-negative integer count matrix (rows = true class, columns = predicted)."""
    matrix = np.asarray(confusion)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise ValueError(f"confusion must be a non-empty square matrix, got shape {matrix.shape}")
    if not np.issubdtype(matrix.dtype, np.number) or np.any(matrix < 0) or np.any(matrix != np.round(matrix)):
        raise ValueError("confusion counts must be non-negative integers")
    return matrix.astype(np.int64)


def accuracy(confusion: Any) -> float:
    """trace / total; NaN for a matrix without samples."""
    matrix = as_confusion(confusion)
    total = int(matrix.sum())
    return float(np.trace(matrix)) / total if total else math.nan


def pooled(confusions: Iterable[Any]) -> np.ndarray:
    """The element-wise sum of confusion matrices of one shape."""
    matrices = [as_confusion(c) for c in confusions]
    if not matrices:
        raise ValueError("no confusion matrices to pool")
    shapes = {m.shape for m in matrices}
    if len(shapes) != 1:
        raise ValueError(f"confusion matrices differ in shape: {sorted(shapes)}")
    return np.sum(matrices, axis=0)


def mean_accuracy(confusions: Iterable[Any]) -> float:
    """Mean over matrices (edges) of their accuracy; matrices without samples are skipped."""
    accs = [accuracy(c) for c in confusions if as_confusion(c).sum()]
    return float(np.mean(accs)) if accs else math.nan


def std_accuracy(confusions: Iterable[Any]) -> float:
    """Population std (ddof=0) over matrices (edges) of their accuracy."""
    accs = [accuracy(c) for c in confusions if as_confusion(c).sum()]
    return float(np.std(accs)) if accs else math.nan


def class_f1(confusion: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per class: (F1, support = row sum, predicted = column sum); F1 = 2TP / (support +
    predicted), 0 where both are 0 (such classes are the ones macro F1 leaves out)."""
    matrix = as_confusion(confusion)
    tp = np.diag(matrix).astype(np.float64)
    support = matrix.sum(axis=1).astype(np.float64)
    predicted = matrix.sum(axis=0).astype(np.float64)
    denominator = support + predicted
    f1 = np.divide(2 * tp, denominator, out=np.zeros_like(tp), where=denominator > 0)
    return f1, support, predicted


def macro_f1(confusion: Any) -> float:
    """Unweighted mean F1 over classes with support or predictions (NaN if none)."""
    f1, support, predicted = class_f1(confusion)
    present = (support + predicted) > 0
    return float(f1[present].mean()) if present.any() else math.nan


def weighted_f1(confusion: Any) -> float:
    """Support-weighted mean F1 (NaN without samples)."""
    f1, support, _ = class_f1(confusion)
    total = support.sum()
    return float((f1 * support).sum() / total) if total else math.nan


def pooled_mean(per_edge_means: Sequence[float], counts: Sequence[int]) -> float:
    """Per-sample mean over all edges from per-edge means and sample counts: sum(m*n)/sum(n).
    With the per-edge ``brier`` (= brier_sum / n) this is the pooled Brier score."""
    if len(per_edge_means) != len(counts):
        raise ValueError("per_edge_means and counts differ in length")
    total = sum(counts)
    if not total:
        return math.nan
    return float(sum(m * n for m, n in zip(per_edge_means, counts, strict=True)) / total)


def mean_std(values: Sequence[float]) -> dict[str, float | int]:
    """Mean and population std (ddof=0) of the values, and their count."""
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    return {"mean": float(array.mean()), "std": float(array.std()), "n": int(array.size)}


def best_round(rounds: Sequence[int], values: Sequence[float]) -> tuple[int, float]:
    """The round with the highest value (the earliest on ties) and that value."""
    if not rounds:
        raise ValueError("no rounds")
    index = int(np.argmax(np.asarray(values, dtype=np.float64)))
    return int(rounds[index]), float(values[index])


def convergence_round(rounds: Sequence[int], values: Sequence[float],
                      fraction: float = CONVERGENCE_FRACTION) -> int:
    """The first round whose value reaches ``fraction`` of the maximum."""
    target = fraction * max(values)
    return next(int(r) for r, v in zip(rounds, values, strict=True) if v >= target)


def entry_counts(entry: dict) -> tuple[int, int, np.ndarray | None]:
    """(correct, n, confusion or None) of one edge's split entry. A protocol-4 history
    holds ``correct`` and ``n`` (and ``confusion`` only under --eval-detail, which must
    agree with them); an older one holds only ``confusion``, whose trace and sum they are."""
    confusion = as_confusion(entry["confusion"]) if "confusion" in entry else None
    if "correct" not in entry:
        if confusion is None:
            raise ValueError("an evaluation entry holds neither correct/n nor a confusion")
        return int(np.trace(confusion)), int(confusion.sum()), confusion
    correct, n = entry["correct"], entry["n"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (correct, n)) \
            or not 0 <= correct <= n:
        raise ValueError(f"correct {correct!r} of n {n!r} are not counts with correct <= n")
    if confusion is not None and (int(confusion.sum()) != n or int(np.trace(confusion)) != correct):
        raise ValueError(f"the confusion (sum {int(confusion.sum())}, trace "
                         f"{int(np.trace(confusion))}) disagrees with n {n}, correct {correct}")
    return correct, n, confusion


def round_figures(per_edge: dict[str, dict[str, dict]], split: str) -> dict | None:
    """Figures of one evaluated round from the per-edge entries of one split, or None when
    no edge reported a sample for it. F1 only when every such edge sent its per-class
    counts (--eval-detail); NaN otherwise."""
    rights, counts, confusions, briers, losses = [], [], [], [], []
    for edge in sorted(per_edge):
        entry = per_edge[edge].get(split)
        if entry is None:
            continue
        correct, n, confusion = entry_counts(entry)
        if not n:
            continue
        rights.append(correct)
        counts.append(n)
        confusions.append(confusion)
        briers.append(float(entry["brier"]))
        losses.append(float(entry["loss"]))
    if not counts:
        return None
    accs = [c / n for c, n in zip(rights, counts, strict=True)]
    detail = all(c is not None for c in confusions)
    total = pooled(confusions) if detail else None
    return {
        "edges": len(counts),
        "n": sum(counts),
        "mean_accuracy": float(np.mean(accs)),
        "std_accuracy": float(np.std(accs)),
        "pooled_accuracy": sum(rights) / sum(counts),
        "macro_f1": macro_f1(total) if detail else math.nan,
        "weighted_f1": weighted_f1(total) if detail else math.nan,
        "brier": pooled_mean(briers, counts),
        "loss": pooled_mean(losses, counts),
    }


def edge_accuracies(per_edge: dict[str, dict[str, dict]], split: str) -> dict[str, float]:
    """Each edge's accuracy on ``split`` in one evaluated round (edges without a sample of
    it are left out)."""
    out = {}
    for edge in sorted(per_edge, key=_natural):
        entry = per_edge[edge].get(split)
        if entry is None:
            continue
        correct, n, _ = entry_counts(entry)
        if n:
            out[edge] = correct / n
    return out


# ---- histories and runs ----------------------------------------------------------------------

def history_path(arg: str | Path) -> Path:
    path = Path(arg)
    if path.is_dir():
        candidate = path / "history.json"
        if not candidate.is_file():
            raise ReportError(f"{path}: no history.json in this directory")
        return candidate
    if path.is_file():
        return path
    raise ReportError(f"{path}: no such file or directory")


def load_history(path: Path) -> dict:
    try:
        history = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: cannot read history ({exc})") from exc
    if not isinstance(history, dict) or not isinstance(history.get("rounds"), list) \
            or not isinstance(history.get("manifest"), dict):
        raise ReportError(f"{path}: not an fl-server history (needs 'manifest' and 'rounds')")
    return history


def config_key(manifest: dict) -> dict:
    """What makes two runs the same experiment up to the seed."""
    train = {k: v for k, v in (manifest.get("train") or {}).items() if k != "seed"}
    server = {k: v for k, v in (manifest.get("server") or {}).items() if k not in IGNORED_SERVER_KEYS}
    return {"method": manifest.get("method"), "train": train,
            "params": manifest.get("params") or {}, "server": server}


def config_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:10]


def analyze_run(path: Path, history: dict, split: str) -> dict:
    manifest = history["manifest"]
    seed = (manifest.get("train") or {}).get("seed", (manifest.get("seeds") or {}).get("train"))
    rounds, byte_rounds, participation, similarity = [], [], [], []
    edge_accuracy: list[dict] = []
    for index, record in enumerate(history["rounds"]):
        where = f"round {record.get('round', index + 1) if isinstance(record, dict) else index + 1}"
        try:
            number = int(record["round"])
            per_edge = (record.get("evaluation") or {}).get("per_edge") or {}
            figures = round_figures(per_edge, split)
            if figures is not None:
                rounds.append({"round": number, **figures})
                edge_accuracy.append({"round": number, "edges": edge_accuracies(per_edge, split)})
            byte_rounds.append({"round": number, **{
                direction: {kind: int(tally["wire"]) for kind, tally in kinds.items()}
                for direction, kinds in (record.get("bytes") or {}).items()}})
            cosine = (record.get("aggregate") or {}).get("cosine_similarity")
            if cosine:
                similarity.append({"round": number, **{g: float(v) for g, v in cosine.items()}})
            train = record.get("train")
            if isinstance(train, dict) and "contributors" in train:  # --mode async
                participation.append({"round": number, "selected": int(train["in_flight"])
                                      + len(train["contributors"]),
                                      "received": len(train["contributors"]), "dropped": 0})
            elif isinstance(train, dict):
                participation.append({"round": number, "selected": len(train["selected"]),
                                      "received": len(train["received"]),
                                      "dropped": len(train.get("dropped") or {})})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ReportError(f"{path}: malformed {where} ({type(exc).__name__}: {exc})") from exc
    if not rounds:
        raise ReportError(f"{path}: no evaluated rounds with split {split!r}")
    numbers = [r["round"] for r in rounds]
    means = [r["mean_accuracy"] for r in rounds]
    best, _ = best_round(numbers, means)
    by_round = {r["round"]: r for r in rounds}
    key = config_key(manifest)
    return {
        "path": str(path), "method": manifest.get("method"), "seed": seed,
        "config_id": config_id(key), "config": key,
        "evaluated_rounds": len(rounds), "best_round": best, "best": by_round[best],
        "final_round": numbers[-1], "final": rounds[-1],
        "convergence_round": convergence_round(numbers, means),
        "rounds": rounds, "bytes": byte_rounds, "participation": participation,
        "similarity": similarity, "edge_accuracy": edge_accuracy,
        "wire_bytes_total": {d: sum(sum(r.get(d, {}).values()) for r in byte_rounds)
                             for d in ("up", "down")},
        "wire_bytes_per_round": {d: (sum(sum(r.get(d, {}).values()) for r in byte_rounds)
                                     / len(byte_rounds)) if byte_rounds else math.nan
                                 for d in ("up", "down")},
        "compress": compress_label(manifest),
        # --mode async: a record is a version (an applied buffer), not a round
        "unit": "version" if manifest.get("mode") == "async" else "round",
    }


def compress_label(manifest: dict) -> str:
    """The run's ``--compress`` spec as the server recorded it; "none" for no compression
    (an empty spec, or a history from before the setting existed)."""
    spec = (manifest.get("server") or {}).get("compress")
    return spec.strip() if isinstance(spec, str) and spec.strip() else "none"


def label_runs(runs: list[dict]) -> None:
    """``method seed S``; made unique with the run directory (and a counter) if needed."""
    for run in runs:
        run["label"] = f"{run['method']} seed {run['seed']}"
    counts: dict[str, int] = {}
    for run in runs:
        counts[run["label"]] = counts.get(run["label"], 0) + 1
    for run in runs:
        if counts[run["label"]] > 1:
            run["label"] += f" ({Path(run['path']).resolve().parent.name})"
    seen: dict[str, int] = {}
    for run in runs:
        seen[run["label"]] = seen.get(run["label"], 0) + 1
        if seen[run["label"]] > 1:
            run["label"] += f" #{seen[run['label']]}"
    slugs: set[str] = set()
    for run in runs:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", run["label"]).strip("-") or "run"
        base, i = slug, 1
        while slug in slugs:
            i += 1
            slug = f"{base}-{i}"
        slugs.add(slug)
        run["slug"] = slug


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def _shown(name: str, value: Any) -> str:
    if any(word in name.lower() for word in ("token", "secret", "password")):
        return "<redacted>"
    return json.dumps(value, default=str)


def group_runs(runs: list[dict]) -> list[dict]:
    """Runs with the same config key, in order of first appearance, with mean +- std over
    their seeds of the final figures and of the figures at each run's best round."""
    groups: dict[str, dict] = {}
    for run in runs:
        group = groups.setdefault(run["config_id"], {"id": run["config_id"], "method": run["method"],
                                                      "config": run["config"], "members": []})
        group["members"].append(run)
    # Groups that share a method are told apart by the settings in which they differ.
    flat = {}
    for gid, group in groups.items():
        flat[gid] = {}
        _flatten("", {k: v for k, v in group["config"].items() if k != "method"}, flat[gid])
    for gid, group in groups.items():
        siblings = [g for g in groups if groups[g]["method"] == group["method"]]
        names = sorted({n for g in siblings for n in flat[g]})
        differing = [n for n in names if len({json.dumps(flat[g].get(n), sort_keys=True, default=str)
                                              for g in siblings}) > 1]
        shown = [f"{n}={_shown(n, flat[gid].get(n))}" for n in differing[:3]]
        if len(differing) > 3:
            shown.append("...")
        group["label"] = f"{group['method']}" + (f" [{', '.join(shown)}]" if shown else "")
    out = []
    for group in groups.values():
        members = group.pop("members")
        group.pop("config")
        group["runs"] = [m["label"] for m in members]
        group["seeds"] = [m["seed"] for m in members]
        for metric in FINAL_METRICS:
            group[f"final_{metric}"] = mean_std([m["final"][metric] for m in members])
        for metric in BEST_METRICS:
            group[f"best_{metric}"] = mean_std([m["best"][metric] for m in members])
        out.append(group)
    return out


# ---- output ----------------------------------------------------------------------------------

def _f(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.4f}"


def _pm(stats: dict) -> str:
    return f"{_f(stats['mean'])} ± {_f(stats['std'])}"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


def markdown(runs: list[dict], groups: list[dict], split: str) -> str:
    lines = [f"# fl-report ({split} split)", "",
             "Accuracy and Brier recomputed from the per-edge sums (correct, samples, loss, "
             "Brier); F1 from the per-class counts, which edges send only under --eval-detail "
             "(n/a without them). "
             "mean acc = mean over edges (± population std over edges); pooled = all samples; "
             "macro F1 leaves out classes with neither support nor predictions; "
             "std over seeds is the population std (ddof=0).", "",
             "## Runs", "",
             "| run | method | seed | evaluated | best round | best mean acc | conv. round | final round "
             "| final mean acc | final pooled acc | final macro F1 | final weighted F1 | final Brier |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        final = run["final"]
        lines.append(
            f"| {_cell(run['label'])} | {_cell(run['method'])} | {run['seed']} | {run['evaluated_rounds']} "
            f"| {run['best_round']} | {_f(run['best']['mean_accuracy'])} | {run['convergence_round']} "
            f"| {run['final_round']} | {_f(final['mean_accuracy'])} ± {_f(final['std_accuracy'])} "
            f"| {_f(final['pooled_accuracy'])} | {_f(final['macro_f1'])} | {_f(final['weighted_f1'])} "
            f"| {_f(final['brier'])} |")
    lines += ["", "## Configurations (mean ± std over seeds)", "",
              "| configuration | runs | seeds | final mean acc | best mean acc | final pooled acc "
              "| best pooled acc | final macro F1 | best macro F1 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for group in groups:
        lines.append(
            f"| {_cell(group['label'])} | {len(group['runs'])} | {', '.join(map(str, group['seeds']))} "
            f"| {_pm(group['final_mean_accuracy'])} | {_pm(group['best_mean_accuracy'])} "
            f"| {_pm(group['final_pooled_accuracy'])} | {_pm(group['best_pooled_accuracy'])} "
            f"| {_pm(group['final_macro_f1'])} | {_pm(group['best_macro_f1'])} |")
    lines += ["", "## Bytes vs accuracy", "",
              "Mean wire bytes per round over all edges (every kind, meta included), by the "
              "run's --compress spec.", "",
              "| run | compress | up per round | down per round | final mean acc | best mean acc |",
              "|---|---|---|---|---|---|"]
    for run in runs:
        per_round = run["wire_bytes_per_round"]
        lines.append(f"| {_cell(run['label'])} | {_cell(run['compress'])} "
                     f"| {_human_bytes(per_round['up'])} | {_human_bytes(per_round['down'])} "
                     f"| {_f(run['final']['mean_accuracy'])} | {_f(run['best']['mean_accuracy'])} |")
    return "\n".join(lines) + "\n"


def _human_bytes(value: float, decimals: int = 1) -> str:
    if not math.isfinite(value):
        return "n/a"
    scale, unit = _byte_unit(value)
    return f"{value / scale:.{decimals}f} {unit}" if scale > 1 else f"{value:.0f} B"


def _finite(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become null."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _byte_unit(largest: float) -> tuple[float, str]:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if largest >= scale:
            return scale, unit
    return 1.0, "B"


def plot_accuracy(runs: list[dict], split: str, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for run in runs:
        ax.plot([r["round"] for r in run["rounds"]], [r["mean_accuracy"] for r in run["rounds"]],
                marker="o", markersize=3, label=run["label"])
    ax.set_xlabel(" / ".join(sorted({run.get("unit", "round") for run in runs})))
    ax.set_ylabel(f"mean accuracy over edges, {split} split (0-1)")
    ax.set_title(f"Accuracy per round ({split} split)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_bytes(run: dict, path: Path) -> None:
    """Top: per round two bars, up (left, plain) and down (right, hatched), stacked by
    kind. Bottom: each kind and direction as a line on a log scale, so that what the
    tensors dwarf (meta messages, statistics vectors: the protocol's own overhead) can be
    read too."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    records = run["bytes"]
    rounds = [r["round"] for r in records]
    kinds = sorted({k for r in records for d in ("up", "down") for k in r.get(d, {})})
    largest = max([sum(r.get(d, {}).values()) for r in records for d in ("up", "down")] or [0])
    scale, unit = _byte_unit(largest)
    colors = {kind: f"C{i % 10}" for i, kind in enumerate(kinds)}
    fig = Figure(figsize=(min(16, max(8, 0.3 * len(rounds) + 6)), 8))
    FigureCanvasAgg(fig)
    ax, log_ax = fig.subplots(2, 1, sharex=True)
    x = np.asarray(rounds, dtype=np.float64)
    width = 0.4
    for offset, direction, hatch in ((-width / 2, "up", None), (width / 2, "down", "//")):
        bottom = np.zeros(len(rounds))
        for kind in kinds:
            values = np.array([r.get(direction, {}).get(kind, 0) for r in records], dtype=np.float64) / scale
            ax.bar(x + offset, values, width, bottom=bottom, color=colors[kind], hatch=hatch,
                   edgecolor="black", linewidth=0.3)
            bottom += values
    for direction, style in (("up", "-"), ("down", "--")):
        for kind in kinds:
            values = [r.get(direction, {}).get(kind, 0) for r in records]
            if any(values):
                log_ax.plot(x, [v if v > 0 else np.nan for v in values], style, marker="o",
                            markersize=3, color=colors[kind])
    handles = [Patch(facecolor=colors[k], edgecolor="black", label=k) for k in kinds]
    handles += [Patch(facecolor="white", edgecolor="black", label="up (edge -> server)"),
                Patch(facecolor="white", edgecolor="black", hatch="//", label="down (server -> edge)")]
    ax.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylabel(f"wire bytes per round ({unit})")
    ax.set_title(f"Bytes on the wire per round, by kind and direction: {run['label']}")
    ax.grid(True, axis="y", alpha=0.3)
    log_ax.set_yscale("log")
    log_ax.set_ylabel("wire bytes per round (B, log scale)")
    log_ax.set_title("The same per kind on a log scale (solid: up, dashed: down)",
                     fontsize="medium")
    log_ax.xaxis.get_major_locator().set_params(integer=True)
    log_ax.set_xlabel(run.get("unit", "round"))
    log_ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_bytes_vs_accuracy(runs: list[dict], split: str, path: Path) -> None:
    """One point per run and direction: mean wire bytes per round (log scale: codecs span
    orders of magnitude) against the final (filled) and best (open) mean accuracy, joined
    by a line. Colour = compress spec, so the seeds of one codec read as one cloud and the
    legend names each spec once, outside the axes. Each final point is annotated with its
    spec; runs on the same spot stack their annotations instead of hiding each other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    specs = list(dict.fromkeys(run["compress"] for run in runs))
    methods = sorted({str(run["method"]) for run in runs})
    colors = {spec: f"C{i % 10}" for i, spec in enumerate(specs)}
    fig = Figure(figsize=(12, 5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    stacked: dict[str, dict[tuple[str, str], int]] = {"up": {}, "down": {}}
    for ax, direction, title in ((axes[0], "up", "upload (edge -> server)"),
                                 (axes[1], "down", "download (server -> edge)")):
        shown = [run["wire_bytes_per_round"][direction] for run in runs]
        shown = [x for x in shown if math.isfinite(x) and x > 0]
        if shown:  # at least a factor 4 wide: log ticks 1-2-5 and room for the annotations
            low, high = min(shown), max(shown)
            pad = max(1.6, math.sqrt(4 * low / high))
            ax.set_xlim(low / pad, high * pad)
        for run in runs:
            x = run["wire_bytes_per_round"][direction]
            if not (math.isfinite(x) and x > 0):
                continue
            final, best = run["final"]["mean_accuracy"], run["best"]["mean_accuracy"]
            color = colors[run["compress"]]
            ax.plot([x, x], [final, best], color=color, linewidth=1, alpha=0.6)
            ax.plot([x], [final], "o", color=color, markersize=7)
            ax.plot([x], [best], "o", markerfacecolor="none", markeredgecolor=color, markersize=9)
            spot = (f"{x:.3g}", f"{final:.3g}")
            stacked[direction][spot] = stacked[direction].get(spot, 0) + 1
            text = run["compress"] if len(methods) == 1 else f"{run['method']}: {run['compress']}"
            ax.annotate(text, (x, final), textcoords="offset points",
                        xytext=(8, -4 - 11 * (stacked[direction][spot] - 1)),
                        fontsize="x-small", color=color)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _human_bytes(v, 0)))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"{direction}load wire bytes per round, all edges (log scale)")
        ax.set_title(title)
        ax.margins(y=0.12)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"mean accuracy over edges, {split} split (0-1)")
    handles = [Line2D([], [], color=colors[s], marker="o", linestyle="", label=s) for s in specs]
    handles += [Line2D([], [], color="grey", marker="o", linestyle="", label="final round"),
                Line2D([], [], color="grey", marker="o", markerfacecolor="none", linestyle="",
                       markersize=9, label="best round")]
    axes[1].legend(handles=handles, title="--compress", fontsize="small",
                   loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("Bytes on the wire vs accuracy, one point per run ("
                 + ", ".join(methods) + f"; {len(runs)} runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_participation(run: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = run["participation"]
    rounds = [r["round"] for r in records]
    fig = Figure(figsize=(min(16, max(6, 0.3 * len(rounds) + 3)), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = np.asarray(rounds, dtype=np.float64)
    width = 0.27
    for i, (field, color) in enumerate((("selected", "C0"), ("received", "C2"), ("dropped", "C3"))):
        ax.bar(x + (i - 1) * width, [r[field] for r in records], width, color=color, label=field)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel(run.get("unit", "round"))
    ax.set_ylabel("edges")
    ax.set_title(f"Participation per round (train phase): {run['label']}")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def similarity_limits(values: list[float]) -> tuple[float, float]:
    """The similarity plot's y-axis: the cosine's own scale, from 0 (or below, where a
    value is) to 1, never autoscaled to the data: uploads at 0.9911-0.9918 are alike, and
    an axis spanning only that range draws their noise as a trend."""
    return min([0.0, *values]) - 0.02, 1.02


def plot_similarity(run: dict, path: Path) -> Figure:
    """Mean pairwise cosine similarity of the edges' uploads per layer group (Fed-SAP's
    Fig. 1: conv vs SE excitation). Returns the figure it saved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = run["similarity"]
    groups = sorted({g for r in records for g in r if g != "round"})
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for group in groups:
        points = [(r["round"], r[group]) for r in records if group in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                label=group)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(*similarity_limits([r[g] for r in records for g in groups if g in r]))
    ax.set_xlabel(run.get("unit", "round"))
    ax.set_ylabel("mean pairwise cosine similarity")
    ax.set_title(f"How alike the edges' uploads are, per layer group: {run['label']}\n"
                 "(cosine similarity averaged over pairs of edges: 1 = the same direction, "
                 "0 = unrelated)", fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return fig


def plot_edges(run: dict, split: str, path: Path) -> None:
    """Each edge's accuracy over the evaluated rounds: who the federation serves and who
    it leaves behind (a mean hides both). Rows are edges, columns evaluated rounds; the
    figure grows with the number of edges so 2 and 200 stay readable."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = run["edge_accuracy"]
    rounds = [r["round"] for r in records]
    edges = sorted({e for r in records for e in r["edges"]}, key=_natural)
    grid = np.full((len(edges), len(rounds)), np.nan)
    for j, record in enumerate(records):
        for i, edge in enumerate(edges):
            grid[i, j] = record["edges"].get(edge, np.nan)
    fig = Figure(figsize=(min(16, max(6, 0.35 * len(rounds) + 4)),
                          min(40, max(3, 0.3 * len(edges) + 2))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0,
                      interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"accuracy, {split} split (0-1)")
    step = max(1, len(rounds) // 20)
    ax.set_xticks(range(0, len(rounds), step), [str(r) for r in rounds[::step]])
    ax.set_yticks(range(len(edges)), edges, fontsize="small" if len(edges) <= 40 else 5)
    ax.set_xlabel(run.get("unit", "round"))
    ax.set_ylabel("edge")
    ax.set_title(f"Accuracy per edge and round: {run['label']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_report(runs: list[dict], groups: list[dict], split: str, out: Path) -> str:
    try:
        out.mkdir(parents=True, exist_ok=True)
        figures = ["accuracy.png"]
        plot_accuracy(runs, split, out / "accuracy.png")
        for run in runs:
            run["figures"] = {"bytes": f"bytes_{run['slug']}.png",
                              "participation": f"participation_{run['slug']}.png",
                              "edges": f"edges_{run['slug']}.png"}
            plot_bytes(run, out / run["figures"]["bytes"])
            plot_participation(run, out / run["figures"]["participation"])
            plot_edges(run, split, out / run["figures"]["edges"])
            if run["similarity"]:
                run["figures"]["similarity"] = f"similarity_{run['slug']}.png"
                plot_similarity(run, out / run["figures"]["similarity"])
            figures += list(run["figures"].values())
        if len(runs) > 1:
            figures.append("bytes_vs_accuracy.png")
            plot_bytes_vs_accuracy(runs, split, out / "bytes_vs_accuracy.png")
        table = markdown(runs, groups, split)
        (out / "summary.md").write_text(table)
        summary = {
            "split": split,
            "conventions": {
                "source": "per-edge correct, n, loss and Brier sums; per-class counts "
                          "(confusion, rows true, columns predicted) only from runs with "
                          "--eval-detail; server accuracies not used",
                "mean_accuracy": "mean over edges with samples; std_accuracy = population std over edges",
                "pooled_accuracy": "total correct / total samples over the edges",
                "macro_f1": "mean per-class F1 of the pooled confusion over classes with support "
                            "or predictions; NaN (null) unless every edge sent its confusion "
                            "(--eval-detail)",
                "weighted_f1": "support-weighted per-class F1 of the pooled confusion",
                "brier": "sum(brier_e * n_e) / sum(n_e)",
                "best_round": "highest mean accuracy, earliest on ties",
                "convergence_round": f"first round reaching {CONVERGENCE_FRACTION:g} x best mean accuracy",
                "std_over_seeds": "population std (ddof=0)",
                "group_by": "manifest method, train minus seed, params, server minus "
                            + ", ".join(sorted(IGNORED_SERVER_KEYS)),
            },
            "runs": [{k: v for k, v in run.items() if k not in ("config", "slug")} for run in runs],
            "groups": groups,
            "figures": figures,
        }
        (out / "summary.json").write_text(json.dumps(_finite(summary), indent=1, allow_nan=False) + "\n")
    except OSError as exc:
        raise ReportError(f"{out}: cannot write the report ({exc})") from exc
    return table


def _natural(name: str) -> list:
    """features.3.1 before features.17.1 (the backbone's order, not the string order)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def load_edge_history(arg: str | Path) -> tuple[str, dict]:
    """(edge label, the last round's private figures) from a state dir or its file."""
    path = Path(arg)
    if path.is_dir():
        path = path / "private-history.json"
    if not path.is_file():
        raise ReportError(f"{path}: no private history (an edge state dir holds "
                          "private-history.json once the edge has trained a round)")
    try:
        history = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: unreadable private history ({exc})") from exc
    rounds = history.get("rounds") if isinstance(history, dict) else None
    if not rounds or not isinstance(rounds, list) or not isinstance(rounds[-1], dict):
        raise ReportError(f"{path}: holds no round")
    label = path.parent.name
    identity = path.parent / "identity.json"
    if identity.is_file():
        try:
            label = json.loads(identity.read_text())["edge_id"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return label, rounds[-1].get("figures", {})


def attention_table(edges: list[tuple[str, dict]]) -> str:
    """pFedLA's Table 5: per edge (and model, where a method keeps two), per mechanism,
    the weight of each hybrid layer and their mean."""
    blocks = []
    for label, figures in edges:
        by_model: dict[str, list[tuple[str, dict]]] = {}
        for key, value in figures.items():
            if isinstance(value, dict) and value and all(
                    isinstance(v, (int, float)) for v in value.values()):
                model, _, module = key.partition("/")
                by_model.setdefault(model, []).append((module, value))
        for model, layers in sorted(by_model.items()):
            layers.sort(key=lambda item: _natural(item[0]))
            name = label if len(by_model) == 1 else f"{label} ({model})"
            blocks.append((name, layers))
    if not blocks:
        raise ReportError("no hybrid attention weights in the given edge histories")
    width = max(len(layers) for _, layers in blocks)
    header = ["edge", "att."] + [f"layer {j + 1}" for j in range(width)] + ["average"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, layers in blocks:
        order = ("se", "eca", "ca")  # the paper's rows; the history file sorts its keys
        mechanisms = sorted(layers[0][1], key=lambda m: (order.index(m) if m in order else 3, m))
        for i, mechanism in enumerate(mechanisms):
            values = [layer[mechanism] for _, layer in layers]
            cells = [name if i == 0 else "", mechanism.upper()]
            cells += [f"{v:.4f}" for v in values] + [""] * (width - len(values))
            cells.append(f"{sum(values) / len(values):.4f}")
            lines.append("| " + " | ".join(cells) + " |")
    layers_of = "; ".join(f"{name}: " + ", ".join(m for m, _ in layers) for name, layers in blocks[:1])
    return ("## Hybrid attention weights (last training round)\n\n" + "\n".join(lines)
            + f"\n\nLayers in order ({layers_of}).\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fl-report",
        description="Accuracy, F1, Brier, bytes and participation from fl-server history.json "
                    "files, recomputed from the per-edge sums (F1 from per-class counts, "
                    "sent only under fl-server --eval-detail); runs that differ "
                    "only in the seed are summarised as mean ± std.")
    parser.add_argument("runs", nargs="*", metavar="RUN_DIR",
                        help="a server --checkpoint-dir holding history.json, or a history.json path")
    parser.add_argument("--edge-state", nargs="+", default=[], metavar="STATE_DIR",
                        help="edge state dirs (or their private-history.json) whose hybrid "
                             "attention weights go into attention_weights.md (pFedLA Table 5)")
    parser.add_argument("--out", type=Path, default=Path("report"),
                        help="output directory for summary.md, summary.json and the PNGs "
                             "(default: ./report)")
    parser.add_argument("--split", choices=SPLITS, default="test",
                        help="evaluation split to report (default: test)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.runs and not args.edge_state:
        parser.error("give at least one RUN_DIR or --edge-state")
    if args.edge_state:
        try:
            table = attention_table([load_edge_history(a) for a in args.edge_state])
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "attention_weights.md").write_text(table)
        except OSError as exc:
            print(f"fl-report: {args.out}: cannot write the report ({exc})", file=sys.stderr)
            return 2
        except ReportError as exc:
            print(f"fl-report: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(table)
        if not args.runs:
            return 0
    try:
        runs: list[dict] = []
        seen: set[Path] = set()
        for arg in args.runs:
            path = history_path(arg)
            if path.resolve() in seen:
                print(f"fl-report: {path}: given twice, counted once", file=sys.stderr)
                continue
            seen.add(path.resolve())
            runs.append(analyze_run(path, load_history(path), args.split))
        label_runs(runs)
        groups = group_runs(runs)
        table = write_report(runs, groups, args.split, args.out)
    except ReportError as exc:
        print(f"fl-report: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(table)
    pngs = 1 + sum(len(run["figures"]) for run in runs) + (len(runs) > 1)
    print(f"fl-report: wrote {args.out}/summary.md, summary.json and {pngs} PNG file(s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Evaluation figures derived from the sums edges return.

By default an edge sends, per split, only what the fleet's figures need: samples scored
(``total``), samples right (``correct``) and the loss and Brier sums. Per-class counts
(the confusion matrix) travel only under ``--eval-detail``: their row sums are the edge's
label histogram. Everything here works from the sums; the matrix, when there is one, is
kept for the per-class figures fl-report computes from it.
"""

from __future__ import annotations

import numpy as np


def split_figures(correct: int, total: int, loss_sum: float, brier_sum: float,
                  confusion: np.ndarray | None = None) -> dict:
    """One edge's figures of one split from its sums: the edge sends sums, not rates, so
    the server can pool them exactly. ``confusion`` (rows true, columns predicted) only
    under --eval-detail, when it is recorded as it came (the gate checked that it sums to
    ``total`` with ``correct`` on its diagonal)."""
    figures = {
        "n": int(total),
        "correct": int(correct),
        "accuracy": correct / total if total else 0.0,
        "loss": loss_sum / total if total else 0.0,
        "brier": brier_sum / total if total else 0.0,
    }
    if confusion is not None:
        figures["confusion"] = confusion.tolist()
    return figures


def summarize(per_edge: dict[str, dict[str, dict]]) -> dict:
    """Mean over edges and pooled (all samples: total correct / total scored) accuracy,
    per split."""
    splits = sorted({s for figures in per_edge.values() for s in figures})
    out = {}
    for split in splits:
        entries = [f[split] for f in per_edge.values() if split in f and f[split]["n"]]
        if not entries:
            continue
        accs = [e["accuracy"] for e in entries]
        out[split] = {
            "edges": len(entries),
            "mean_accuracy": float(np.mean(accs)),
            "std_accuracy": float(np.std(accs)),
            "pooled_accuracy": sum(e["correct"] for e in entries) / sum(e["n"] for e in entries),
            "mean_loss": float(np.mean([e["loss"] for e in entries])),
        }
    return out

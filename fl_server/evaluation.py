"""Evaluation figures derived from the confusion counts edges return."""

from __future__ import annotations

import numpy as np


def split_figures(confusion: np.ndarray, loss_sum: float, brier_sum: float) -> dict:
    """One edge's figures of one split from its confusion counts and loss/Brier sums:
    the edge sends counts, not rates, so the server can pool them exactly."""
    total = int(confusion.sum())
    return {
        "n": total,
        "accuracy": float(np.trace(confusion)) / total if total else 0.0,
        "loss": loss_sum / total if total else 0.0,
        "brier": brier_sum / total if total else 0.0,
        "confusion": confusion.tolist(),
    }


def summarize(per_edge: dict[str, dict[str, dict]]) -> dict:
    """Mean over edges and pooled (all samples) accuracy, per split."""
    splits = sorted({s for figures in per_edge.values() for s in figures})
    out = {}
    for split in splits:
        entries = [f[split] for f in per_edge.values() if split in f and f[split]["n"]]
        if not entries:
            continue
        pooled = sum(np.array(e["confusion"]) for e in entries)
        accs = [e["accuracy"] for e in entries]
        out[split] = {
            "edges": len(entries),
            "mean_accuracy": float(np.mean(accs)),
            "std_accuracy": float(np.std(accs)),
            "pooled_accuracy": float(np.trace(pooled) / pooled.sum()),
            "mean_loss": float(np.mean([e["loss"] for e in entries])),
        }
    return out

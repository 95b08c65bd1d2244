"""What one round may change under SecAgg+, whatever an edge adds to its masked words.

Masking hides each edge's vector, so the server cannot range-check it: an edge may add
anything to its masked words (mod the ring), and only the unmasked sum can be checked.
Without proofs of each input's range (zero-knowledge range proofs, not built), one edge can
therefore place the sum anywhere the server's checks let through. This module makes that
region small and states it:

- every honest edge clips its change of the global to the L2 norm C (``clip_change``)
  before masking, so the weighted mean of honest changes has norm <= C (a convex
  combination of vectors in the ball stays in it);
- the server aborts a round whose unmasked mean moves the global by more than C plus the
  fixed point's rounding (``check_update``): the global is kept;
- the public scales of integer masking never exceed a ceiling nor grow by more than a
  fixed factor per round (``bound_scales``): they cannot follow a mean the attacker made;
- under 32 bits the edge saturates its model values into the clip box the server checks
  the mean against (``saturate``) instead of sitting out, so a global pushed to the box's
  edge never locks honest edges out.

So one cheating edge can move the global by at most C (L2) per round -- the direction is
its own choice -- and, per coordinate, within the box of the round's fixed point.
"""

from __future__ import annotations

import math

import numpy as np

from .secagg_ring import SecAggError


def clip_change(change: np.ndarray, model: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """(``change`` with its ``model`` values scaled onto the L2 ball of radius ``bound``,
    their norm before): an edge's change of the global, as it masks it. Values outside
    ``model`` (no global to change) are left as they are; ``bound`` 0: no clip."""
    norm = math.sqrt(float(np.dot(change[model], change[model])))
    if not bound or norm <= bound:
        return change, norm
    out = change.copy()
    out[model] *= bound / norm
    return out, norm


def saturate(values: np.ndarray, model: np.ndarray, clip: float) -> tuple[np.ndarray, int]:
    """(``values`` with their ``model`` values held to [-clip, clip], how many moved): the
    box the server checks the 32-bit mean against. The server's check keeps the global in
    the box, so a model value outside it is a global at the box's edge plus this edge's
    change: saturating it keeps the edge in the round (sitting out would hand the round to
    whoever pushed the global there). Non-model values beyond the clip stay refused."""
    outside = model & (np.abs(values) > clip)
    count = int(np.count_nonzero(outside))
    if not count:
        return values, 0
    out = values.copy()
    out[outside] = np.clip(out[outside], -clip, clip)
    return out, count


def rounding_norm(per_value: np.ndarray | float, model: np.ndarray) -> float:
    """The L2 norm over ``model`` of a per-value rounding bound of the unmasked mean."""
    if np.isscalar(per_value):
        return float(per_value) * math.sqrt(int(np.count_nonzero(model)))
    err = np.asarray(per_value)[model]
    return math.sqrt(float(np.dot(err, err)))


def check_update(change: np.ndarray, model: np.ndarray, bound: float,
                 rounding: float) -> float:
    """The L2 norm over ``model`` of the unmasked mean's change of the global; SecAggError
    beyond ``bound`` (the edges' clip) plus ``rounding`` (the fixed point's, an L2 norm):
    no honest edges produce it, so nothing is aggregated and the global is kept."""
    norm = math.sqrt(float(np.dot(change[model], change[model])))
    limit = bound * (1 + 1e-9) + rounding
    if not (math.isfinite(norm) and norm <= limit):
        raise SecAggError(f"the unmasked mean moves the global by {norm:.6g} (L2 over its model "
                          f"tensors), beyond server.secagg_max_update {bound:g} (+ {rounding:.3g} "
                          "of fixed-point rounding); every honest edge clips its change to it "
                          "before masking: an edge tampered with its masked values; nothing is "
                          "aggregated, the global is kept")
    return norm


def bound_scales(scales: np.ndarray, previous: np.ndarray | None, ceiling: float,
                 growth: float) -> np.ndarray:
    """The public scales of a round, at most ``ceiling`` and at most ``growth`` x the
    previous round's (when there were any, of the same blocks): they follow the last
    unmasked mean, which one edge can make as large as the checks let it, and would
    otherwise let it double the global every round."""
    out = np.minimum(scales.astype(np.float64), ceiling)
    if previous is not None and previous.shape == scales.shape:
        out = np.minimum(out, growth * previous.astype(np.float64))
    return out.astype(np.float32)

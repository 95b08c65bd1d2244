"""FedMedian (Yin et al., 2018): the coordinate-wise median of the shared tensors, or with
``trim_fraction`` the same paper's coordinate-wise trimmed mean -- the robust aggregates for
fleets whose edges cannot all be trusted. Both need every individual upload
(collect-then-learn), so neither combines with secure aggregation.

Why they defend the global where a mean does not: a weighted mean follows any single upload
as far as it likes (one edge sending 1e30, or a tiny model with a huge num_examples, moves
every coordinate of the global). The median of k uploads moves only as far as the middle
values do, so fewer than half of the edges, whatever they send, keep each coordinate
between two honest values; the beta-trimmed mean drops the floor(beta k) largest and
smallest values of each coordinate before averaging the rest, tolerating that many
poisoned uploads with less variance than the median when the honest ones agree. Both
ignore num_examples: an edge that lies about its weight gains nothing. With an even
number of uploads the median is the mean of the two middle values. The middle values are
averaged in float64, so two values near float32's limit do not overflow.

``--clip-update-norm`` (any method) complements them: it bounds each upload's distance
from the global before it reaches the aggregator.
"""

from dataclasses import dataclass

import torch

from ..schema import Kind
from .aggregators import CollectThenLearn
from .base import Method

SHARED = (Kind.SHARED_TENSORS, "")
# Float32 values of all uploads sorted at once. 1 MiB, not 8: the close runs on a worker
# thread, whose malloc arena keeps freed 8-16 MB temporaries (stacked, sorted values,
# int64 indices) as fragmented heap; at 8 MiB a server's close peaked at +3.4 to +5
# models (bench/wire.py --breakdown), at 1 MiB at the new global's +1.2.
STEP_BYTES = 1 << 20


@dataclass
class FedMedianParams:
    # 0: the coordinate-wise median. beta in (0, 0.5): the beta-trimmed mean, dropping the
    # floor(beta k) largest and smallest of the k uploads' values of each coordinate.
    trim_fraction: float = 0.0


class MedianAggregator(CollectThenLearn):
    def learn(self, uploads):
        payloads = [payload for payload, _ in uploads.values()]
        trim = self.method.params.trim_fraction
        current = self.state[SHARED]
        k = len(payloads)
        # Coordinates are independent: a slice of STEP_BYTES of the k uploads' values at a
        # time (stacked, sorted values and indices: ~3x that) instead of whole tensors,
        # which for 64 ResNet-18 uploads took 2.4 GB at the largest tensor. Every value
        # is computed as over the whole tensor, so the bits are the same.
        step = max(1, STEP_BYTES // (4 * k))
        for name, x in current.items():
            columns = [p.tensors(*SHARED)[name].reshape(-1) for p in payloads]
            out = torch.empty(x.numel(), dtype=x.dtype)
            rows = torch.empty((k, min(step, x.numel())), dtype=columns[0].dtype)
            for start in range(0, x.numel(), step):
                end = min(start + step, x.numel())
                if all(c.dtype == rows.dtype for c in columns):
                    # Read into one buffer (from disk when spilled, never through the map).
                    for row, c in zip(rows, columns, strict=True):
                        self.read(c[start:end], row[: end - start])
                    stacked = rows[:, : end - start].float()
                else:
                    stacked = torch.stack([c[start:end].float() for c in columns])
                ordered = stacked.sort(dim=0).values
                if trim > 0:
                    cut = int(trim * k)
                    value = ordered[cut : k - cut].to(torch.float64).mean(dim=0)
                elif k % 2:
                    value = ordered[(k - 1) // 2]
                else:
                    value = (ordered[k // 2 - 1].to(torch.float64) + ordered[k // 2]) / 2
                out[start:end] = value.to(x.dtype)
            current[name] = out.view(x.shape)
        return {}


class FedMedian(Method):
    name = "fedmedian"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    Params = FedMedianParams
    aggregator = MedianAggregator

    def __init__(self, context):
        super().__init__(context)
        if not 0 <= self.params.trim_fraction < 0.5:
            raise ValueError(f"fedmedian.trim_fraction must be in [0, 0.5) (0: the median), "
                             f"got {self.params.trim_fraction}")

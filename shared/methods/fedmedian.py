"""FedMedian (Yin et al., 2018): the coordinate-wise median of the shared tensors, a
robust aggregate that needs every individual upload (collect-then-learn). With an even
number of uploads the median is the mean of the two middle values."""

import torch

from ..wire.codec import Kind
from .aggregators import CollectThenLearn
from .base import AggregatorKind, Method

SHARED = (Kind.SHARED_TENSORS, "")


class MedianAggregator(CollectThenLearn):
    def learn(self, uploads):
        payloads = [payload for payload, _ in uploads.values()]
        current = self.state[SHARED]
        for name, x in current.items():
            stacked = torch.stack([p.tensors(*SHARED)[name].float() for p in payloads])
            ordered = stacked.sort(dim=0).values
            k = ordered.shape[0]
            median = ordered[(k - 1) // 2] if k % 2 else (ordered[k // 2 - 1] + ordered[k // 2]) / 2
            current[name] = median.to(x.dtype)
        return {}


class FedMedian(Method):
    name = "fedmedian"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    aggregator_kind = AggregatorKind.COLLECT

    def server(self, models):
        return MedianAggregator(self, models)

"""A fedattn method outside fedattn: FedAvg whose edges train on label-smoothed targets
(Szegedy et al., 2016): cross-entropy against (1 - eps) one-hot + eps / C uniform.

It is registered the way a third party would register it: the distribution
``fedattn_example_plugin`` (its ``.dist-info`` folder beside this module, as pip writes
one) declares the entry point ``example-smooth`` in the ``fedattn.methods`` group, so
``fedattn_shared.methods.available_methods()`` lists it wherever this folder is on the
path, and the conformance suite (tests/test_conformance.py) runs it like any installed
method. The smoothing is per-sample cross-entropy, so DP-SGD covers it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedattn_shared.methods import EdgeAlgorithm, Method


@dataclass
class SmoothParams:
    """``epsilon``: the probability mass spread evenly over all classes."""

    epsilon: float = 0.1


class SmoothEdge(EdgeAlgorithm):
    """The edge half: FedAvg's, with the smoothed loss."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.models["model"](x), y,
                               label_smoothing=self.method.params.epsilon)


class LabelSmoothingAvg(Method):
    """The server half is FedAvg's weighted mean (the base class's default aggregator)."""

    name = "example-smooth"
    Params = SmoothParams
    dp_support = True

    def __init__(self, context):
        super().__init__(context)
        if not 0.0 <= self.params.epsilon < 1.0:
            raise ValueError(f"example-smooth: epsilon {self.params.epsilon} is not in [0, 1)")

    def edge(self, models, device):
        return SmoothEdge(self, models, device)

"""Ditto (Li et al., 2021): a global model trained as in FedAvg plus a personal model
trained with a proximal pull lambda/2 ||v - w^t||^2 toward the round's global model.

Both models train on the same batches; their losses are summed, which gives each model
exactly its own gradient because their parameters are disjoint. The pull is gradient
post-processing on the personal model only. ``predict`` uses the personal model.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import EdgeAlgorithm, Method, qualified
from .fedprox import add_proximal_gradient


@dataclass
class DittoParams:
    lam: float = 0.1  # weight of the personal model's pull (lam/2) ||v - w^t||^2


class DittoEdge(EdgeAlgorithm):
    def begin_train(self) -> None:
        # w^t: the global model as received (its private parts, if any, as they are now).
        self.reference = {
            qualified("personal", key): p.detach().clone()
            for key, p in self.models["global"].named_parameters()
        }

    def training_step(self, batch):
        x, y = batch
        return (F.cross_entropy(self.models["global"](x), y)
                + F.cross_entropy(self.models["personal"](x), y))

    def post_backward(self) -> None:
        add_proximal_gradient(self, self.reference, self.method.params.lam)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.models["personal"](x)


class Ditto(Method):
    name = "ditto"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    Params = DittoParams
    personal_copy = ("global", "personal")

    def edge(self, models, device):
        return DittoEdge(self, models, device)

"""FedAvg-FT: FedAvg, and before each evaluation the edge fine-tunes a private copy of the
global model on its own training data and scores that copy.

Training and the upload are exactly FedAvg's (the ``model`` model, n_k-weighted mean). At
evaluation the global model is copied into ``finetuned`` (split rule ``all``: it never
travels), which the one training loop trains for ``finetune_epochs`` epochs at the round's
learning rate with a fresh optimizer; ``predict`` (evaluation, export) uses it. Each
evaluation starts again from the current global model, so fine-tuning never feeds back
into what is uploaded.

The fine-tuning budget is a choice of the comparison, not of FedAvg; the default is one
local epoch, the same local budget as a training round (the usual setting of the
"FedAvg + fine-tuning" baseline, e.g. Per-FedAvg's one personalization epoch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import EdgeAlgorithm, Method, MethodContext


@dataclass
class FedAvgFTParams:
    finetune_epochs: int = 1  # epochs of fine-tuning the private copy before each evaluation


class FineTuner(EdgeAlgorithm):
    """Trains the private copy, starting from the global model at ``begin_train``."""

    def __init__(self, method: FedAvgFT, source: nn.Module, target: nn.Module,
                 device: torch.device):
        super().__init__(method, {"finetuned": target}, device)
        self.source = source

    def begin_train(self) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.models["finetuned"].state_dict(keep_vars=True).values(),
                                    self.source.state_dict().values(), strict=True):
                mine.copy_(theirs)

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.models["finetuned"](x), y)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.models["finetuned"](x)


class FedAvgFTEdge(EdgeAlgorithm):
    def parameter_groups(self) -> list[dict]:
        return [{"params": [p for _, p in self.named_trainable("model")]}]

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        if self.method.params.finetune_epochs:
            return self.models["finetuned"](x)
        return self.models["model"](x)

    def before_evaluate(self) -> tuple[EdgeAlgorithm, int]:
        epochs = self.method.params.finetune_epochs
        if not epochs:
            return self, 0
        tuner = FineTuner(self.method, self.models["model"], self.models["finetuned"],
                          self.device)
        return tuner, epochs


class FedAvgFT(Method):
    name = "fedavgft"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    Params = FedAvgFTParams
    personal_copy = ("model", "finetuned")

    def __init__(self, context: MethodContext):
        super().__init__(context)
        if self.params.finetune_epochs < 0:
            raise ValueError("fedavgft.finetune_epochs must be >= 0, got "
                             f"{self.params.finetune_epochs}")

    def edge(self, models, device):
        return FedAvgFTEdge(self, models, device)

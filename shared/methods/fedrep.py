"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021): a shared representation
(the body) and a private head.

Each round an edge first trains its head for ``head_epochs`` epochs with the body frozen,
then the body for the configured E local epochs with the head frozen (the paper: 10 head
epochs, 1 body epoch). Only the body travels and is averaged (n_k-weighted, as FedAvg);
the head (the model's classifier, split rule ``head``) never leaves the edge.

Freezing turns ``requires_grad`` off, so the frozen part gets no gradient and the optimizer
(SGD, momentum and weight decay included) leaves it exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import EdgeAlgorithm, LoopSchedule, Method, MethodContext
from .split import private_names


@dataclass
class FedRepParams:
    head_epochs: int = 10  # epochs of the head (body frozen) before the body's epochs


class FedRepEdge(EdgeAlgorithm):
    def __init__(self, method: FedRep, models, device):
        super().__init__(method, models, device)
        model = self.models["model"]
        head = private_names(model, ("head",), method.head)
        self.head_params = [p for k, p in model.named_parameters() if k in head]
        self.body_params = [p for k, p in model.named_parameters() if k not in head]
        self.schedule = LoopSchedule(epochs=self._epochs, begin_epoch=self._begin_epoch)

    def _epochs(self, configured: int) -> int:
        # E = 0 means no local training at all (a transport measurement): no head epochs.
        return self.method.params.head_epochs + configured if configured else 0

    def _begin_epoch(self, epoch: int) -> None:
        head_turn = epoch < self.method.params.head_epochs
        for p in self.head_params:
            p.requires_grad_(head_turn)
        for p in self.body_params:
            p.requires_grad_(not head_turn)

    def end_train(self, batches) -> None:
        for p in self.head_params + self.body_params:
            p.requires_grad_(True)


class FedRep(Method):
    name = "fedrep"
    dp_support = True  # cross-entropy only; the frozen part takes no per-sample gradient
    Params = FedRepParams
    private_rules = ("head",)

    def __init__(self, context: MethodContext):
        super().__init__(context)
        if self.params.head_epochs < 0:
            raise ValueError(f"fedrep.head_epochs must be >= 0, got {self.params.head_epochs}")

    def edge(self, models, device):
        return FedRepEdge(self, models, device)

"""ANFR (Siomos et al.): an architecture, not an aggregation rule. ``--method anfr`` is
FedAvg over an ANFR model (the whole model shared, weights n_k / N,
as in the paper's FedAvg runs); every
other aggregator runs ANFR by naming the model (``--method scaffold --model anfr-se-50``).

Its default model is ``anfr-se-compact`` (CPU-sized: compact depth and width); the paper's
networks are ``anfr-se-50``, ``anfr-eca-50`` and ``anfr-cbam-50``. A model that is not an
ANFR network (weight-standardised convolutions plus channel attention) is refused: run it
under ``fedavg`` instead.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import EdgeAlgorithm, Method, MethodContext
from .split import attention_types


def is_anfr(model) -> bool:
    """Weight-standardised convolutions (timm's StdConv2d family) and channel attention."""
    from timm.layers import ScaledStdConv2d, StdConv2d

    modules = list(model.modules())
    return (any(isinstance(m, (ScaledStdConv2d, StdConv2d)) for m in modules)
            and any(isinstance(m, attention_types()) for m in modules))


def attention_gates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The sigmoid gate of every channel-attention module (timm SE/ECA: ``gate``; CBAM:
    its channel branch's ``gate``), in forward order."""
    gates = []
    for name, module in model.named_modules():
        if isinstance(module, attention_types()):
            owner = module.channel if hasattr(module, "channel") else module
            gates.append((name, owner.gate))
    return gates


def class_std(per_class: torch.Tensor) -> float:
    """The spread across classes of one module's gates: ``per_class`` holds the per-class
    mean gate vectors (classes x channels); the figure is the sample std over classes
    (n - 1), averaged over channels. 0 means the module treats every class alike."""
    return float(per_class.double().std(0).mean())


class GateSpread:
    """Accumulates, per channel-attention module, the per-class sum of the gate vectors of
    the samples the model sees while ``labels`` are set (forward hooks on the gates), and
    reports ``gate_class_std``: the mean over modules of ``class_std`` of the per-class
    mean gate vectors (classes with at least one sample; none with fewer than two
    classes). Why this figure: the ANFR paper's Fig. 3 claim is that ANFR's attention stays
    class-dependent where SE-with-BN saturates; a gate that never leaves its initial value
    (0.5, what timm's zero-initialised residual branches give from scratch) scores 0."""

    def __init__(self, model: nn.Module, num_classes: int):
        self.num_classes = num_classes
        self.labels: torch.Tensor | None = None
        self.sums: dict[str, torch.Tensor] = {}
        self.counts = torch.zeros(num_classes, dtype=torch.float64)
        self._handles = [gate.register_forward_hook(
            lambda _m, _i, out, name=name: self._observe(name, out))
            for name, gate in attention_gates(model)]

    def reset(self) -> None:
        self.sums, self.counts = {}, torch.zeros(self.num_classes, dtype=torch.float64)

    def _observe(self, name: str, gate: torch.Tensor) -> None:
        if self.labels is None:
            return  # a forward pass outside training (evaluation, statistics)
        values = gate.detach().flatten(1).double().cpu()
        total = self.sums.setdefault(name, torch.zeros(self.num_classes, values.shape[1],
                                                       dtype=torch.float64))
        total.index_add_(0, self.labels, values)

    def count(self, labels: torch.Tensor) -> None:
        """Counts a batch's labels once (however many modules it passes)."""
        self.counts += torch.bincount(labels, minlength=self.num_classes).double()

    def figures(self) -> dict[str, float]:
        seen = self.counts > 0
        if int(seen.sum()) < 2 or not self.sums:
            return {}
        means = [total[seen] / self.counts[seen, None] for total in self.sums.values()]
        return {"gate_class_std": sum(class_std(m) for m in means) / len(means),
                "gate_mean": float(torch.cat([m.flatten() for m in means]).mean())}


class ANFREdge(EdgeAlgorithm):
    """FedAvg's edge, reporting the attention gates' class-to-class spread over the
    round's own training batches (augmented, in training mode, as the loss saw them):
    no extra data and no extra forward pass. Two scalars per round, aggregate over the
    edge's classes and channels."""

    def __init__(self, method: Method, models: dict[str, nn.Module], device: torch.device):
        super().__init__(method, models, device)
        self.gates = GateSpread(self.models["model"], method.train.num_classes)

    def begin_train(self) -> None:
        self.gates.reset()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        labels = batch[1].detach().cpu()
        self.gates.count(labels)
        self.gates.labels = labels
        try:
            return super().training_step(batch)
        finally:
            self.gates.labels = None

    def training_metrics(self) -> dict[str, float]:
        return self.gates.figures()


class ANFR(Method):
    name = "anfr"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    default_model = "anfr-se-compact"
    extra_metrics = ("gate_class_std", "gate_mean")  # ANFREdge.training_metrics

    def __init__(self, context: MethodContext):
        super().__init__(context)
        if not is_anfr(self.probe_model()):
            raise ValueError(f"anfr: model {self.train.model!r} is not an ANFR network "
                             "(weight-standardised convolutions with channel attention: "
                             "anfr-se-*, anfr-eca-*, anfr-cbam-*); use --method fedavg for it")

    def edge(self, models: dict[str, nn.Module], device: torch.device) -> EdgeAlgorithm:
        return ANFREdge(self, models, device)

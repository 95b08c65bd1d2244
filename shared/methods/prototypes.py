"""What the prototype methods (FedSTAR, FedProto) share.

* Every model tensor stays on the edge; what travels is one PROTOTYPES section of class
  prototypes: the mean feature h of each class the edge has training samples of, a
  d-vector named by the class index. The server sends back the global prototypes in a
  PROTOTYPES section named ``global`` (every class it has seen so far).
* The feature h is the input of the model's classifier head (the registered model's
  ``head``, which must be a Linear layer), taken by a forward pre-hook: any registered
  classifier becomes an encoder plus a head without a second copy of the network.
* Uploaded tensors are optional in the schema (an edge sends only its own classes) but
  each one must be a float32 d-vector named by a valid class index.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from ..models import build_model
from ..schema import TRAIN, Kind, Payload, Section, SectionSpec, TensorSpec
from .base import EdgeAlgorithm, Method, MethodContext

LOCAL = (Kind.PROTOTYPES, "")           # uplink: the edge's class prototypes
GLOBAL = (Kind.PROTOTYPES, "global")    # downlink: the global prototypes
ProtoNorm = Literal["none", "layernorm"]  # "layernorm": standardise each h first
PROTO_NORMS: tuple[str, ...] = get_args(ProtoNorm)


def prototype_logits(h: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """FedSTAR eq. 2: l_c = 2 h.p_c - ||h||^2 - ||p_c||^2 (the negative squared distance),
    for h (batch, d) and prototypes (classes, d)."""
    return (2 * h @ prototypes.T - h.square().sum(dim=1, keepdim=True)
            - prototypes.square().sum(dim=1))


def head_module(model: nn.Module, head: str, model_name: str) -> nn.Linear:
    module = model.get_submodule(head)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"model {model_name!r}: the head {head!r} is a "
                         f"{type(module).__name__}, not a Linear layer; prototype methods "
                         "need the head's input as the feature vector")
    return module


class FeatureTap:
    """Records the input of the head (the feature h) on every forward pass."""

    def __init__(self, head: nn.Linear):
        self.h: torch.Tensor | None = None
        head.register_forward_pre_hook(self._capture)

    def _capture(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        self.h = inputs[0]

    def forward(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, head(h)) of one batch."""
        logits = model(x)
        h, self.h = self.h, None
        return h, logits


def class_keys(num_classes: int) -> list[str]:
    return [str(c) for c in range(num_classes)]


def stack_prototypes(tensors: dict[str, torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """(sorted class indices, their prototypes stacked (classes, d)) of a section."""
    classes = sorted(int(k) for k in tensors)
    if not classes:
        return [], torch.zeros(0, 0)
    return classes, torch.stack([tensors[str(c)].float() for c in classes])


class PrototypeEdge(EdgeAlgorithm):
    """Edge side common to prototype methods: the head tap, the received global prototypes
    and, after training, the class means of h over the edge's training set."""

    def __init__(self, method: PrototypeMethod, models: dict[str, nn.Module],
                 device: torch.device):
        super().__init__(method, models, device)
        self.model = self.models["model"]
        self.head = head_module(self.model, method.head, method.train.model)
        self.tap = FeatureTap(self.head)
        self.num_classes = method.train.num_classes
        self.feature_dim = self.head.in_features
        # Global prototypes as a (classes, d) table and which rows exist (classes nobody
        # has uploaded yet have none).
        self.global_table = torch.zeros(self.num_classes, self.feature_dim, device=device)
        self.has_global = torch.zeros(self.num_classes, dtype=torch.bool, device=device)
        self.local_prototypes: dict[str, torch.Tensor] = {}
        self.local_counts: dict[str, int] = {}
        self._norm_sum, self._norm_count = 0.0, 0

    def begin_train(self) -> None:
        self._norm_sum, self._norm_count = 0.0, 0

    def observe_features(self, h: torch.Tensor) -> None:
        """Adds a training batch's feature norms to the round's ``feature_norm``: a loss
        that rewards a large |h| (FedSTAR's unnormalised L_shared) shows here first."""
        self._norm_sum += float(h.detach().float().norm(dim=1).sum())
        self._norm_count += h.shape[0]

    def training_metrics(self) -> dict[str, float]:
        """``feature_norm``: the mean L2 norm of h over the round's training samples (in
        train mode, before each step). One scalar of the edge's own features: it says how
        far the features grew, not what they encode."""
        if not self._norm_count:
            return {}
        return {"feature_norm": self._norm_sum / self._norm_count}

    def receive(self, phase: str, common: Payload, personal: Payload) -> None:
        received = common.tensors(*GLOBAL)
        if received:
            table = torch.zeros_like(self.global_table)
            has = torch.zeros_like(self.has_global)
            for key, value in received.items():
                table[int(key)] = value.to(self.device, torch.float32)
                has[int(key)] = True
            self.global_table, self.has_global = table, has

    def features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tap.forward(self.model, x)

    @torch.no_grad()
    def end_train(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """m_k,c: the mean feature of each class over the training set, in eval mode (no
        dropout, BatchNorm's running statistics), after local training."""
        self.eval_mode()
        d = self.feature_dim
        sums = torch.zeros(self.num_classes, d, dtype=torch.float64, device=self.device)
        counts = torch.zeros(self.num_classes, dtype=torch.int64, device=self.device)
        for x, y in batches:
            h, _ = self.features(x)
            h = h.float()
            if self.method.params.proto_norm == "layernorm":
                h = F.layer_norm(h, (d,))  # per-sample standardisation (the authors' code)
            sums.index_add_(0, y, h.double())
            counts += torch.bincount(y, minlength=self.num_classes)
        present = counts.nonzero().flatten().tolist()
        self.local_prototypes = {str(c): (sums[c] / counts[c]).float() for c in present}
        self.local_counts = {str(c): int(counts[c]) for c in present}

    def after_train(self, steps: int) -> Payload:
        return Payload([Section(*LOCAL, dict(self.local_prototypes))])


def alignment(global_prototypes: dict[str, torch.Tensor],
              uploads: Iterable[dict[str, torch.Tensor]]) -> float | None:
    """``proto_cosine``: the mean over the round's uploaded (edge k, class c) of
    cos(p_global_c, p_k,c), the new global prototype against the class means it was made
    from. A global prototype that carries its class's content points where the members
    do (FedProto's weighted mean: by construction toward them); one dominated by other
    inputs (FedSTAR's client embeddings) does not. None when nothing was uploaded."""
    cosines = [float(F.cosine_similarity(global_prototypes[key].double(), local.double(), dim=0))
               for upload in uploads for key, local in upload.items()]
    return sum(cosines) / len(cosines) if cosines else None


def upload_norm(uploads: Iterable[dict[str, torch.Tensor]]) -> float | None:
    """``upload_norm``: the mean L2 norm of the round's uploaded prototypes. They are class
    means of h in eval mode (BatchNorm's running statistics), so they can be far larger
    than the train-mode ``feature_norm`` the edges report: this is the scale the server's
    LayerNorm input actually gets. None when nothing was uploaded."""
    norms = [float(p.double().norm()) for upload in uploads for p in upload.values()]
    return sum(norms) / len(norms) if norms else None


class PrototypeMethod(Method):
    """Everything private; uplink = a PROTOTYPES section with the class means of h."""

    private_rules = ("all",)
    extra_metrics = ("feature_norm",)  # PrototypeEdge.training_metrics

    def __init__(self, context: MethodContext):
        super().__init__(context)
        t = self.train
        with torch.device("meta"):  # shapes only: no memory, no draw from the RNG
            probe = build_model(t.model, t.num_classes, t.in_channels, t.model_size)
        self.feature_dim = head_module(probe, self.head, t.model).in_features

    def split_rules(self) -> dict[str, tuple[str, ...]]:
        return {name: ("all",) for name in self.model_names()}

    def prototype_specs(self) -> dict[str, TensorSpec]:
        return {key: TensorSpec(torch.float32, (self.feature_dim,), optional=True)
                for key in class_keys(self.train.num_classes)}

    def uplink_schema(self, phase: str, models: dict[str, nn.Module]) -> list[SectionSpec]:
        if phase != TRAIN:
            return []
        return [SectionSpec(*LOCAL, self.prototype_specs())]

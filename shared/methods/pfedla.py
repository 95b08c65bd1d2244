"""pFedLA: personalized federated learning with local attention.

Source: the pFedLA paper (Liang, Tian, Yang, Zhang; arXiv 2304.01783; team copy
papers/004_f1265bb2a3cfb5a1.txt); METHODS.md section 4.

A local attention layer goes after each conv block of the backbone (the backbone names its
sites: ``lenet-bn``, ``alexnet-bn``, ``mobilenet-v2``): SE, ECA, CoordAtt, CBAM (pFedLA_s:
one mechanism everywhere) or the hybrid (pFedLA_h: a softmax-weighted convex combination of
the SE, ECA and CoordAtt masks per layer, eqs. 7-8). Everything else is the host method
(``base``: FedAvg, FedProx, FedBN, Ditto or pFedMe), composed through the Method API, not
re-implemented: pFedLA is the host method applied to models with attention inserted, with
the split rule ``attention`` added to the host's private rules, so the attention layers
(their weights, the hybrid logits, CoordAtt's and CBAM's BatchNorm statistics) stay on the
edge in every model the host keeps (Ditto's and pFedMe's personal models have their own).
The wire carries exactly the host's sections; the server averages the base layers with
the host's aggregator, weighted uniformly (1/N, Algorithm 1 line 6) or by samples.

``share_attention`` aggregates the attention layers too (the paper's "non-local"
comparison, Fig. 4b). Each edge records the hybrid weights per layer after every training
round in its private history file (``fl-report --edge-state`` turns those into Table 5).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import apply_values, parse_set
from ..models import MODELS, build_model, model_spec
from ..models.attention import KINDS, AttentionSpec, insert_attention
from .base import Method, MethodContext, TensorSpec
from .registry import load_method

# The hosts of the paper's experiments (Table 1).
HOSTS = ("fedavg", "fedprox", "fedbn", "ditto", "pfedme")
WEIGHTINGS = ("uniform", "samples")


@dataclass
class PFedLAParams:
    attention: str = "hybrid"           # se | eca | ca | cbam | hybrid
    base: str = "fedavg"                # the host method
    base_params: list[str] = field(default_factory=list)  # the host's, "key=value" (TOML values)
    weighting: str = "uniform"          # the paper's 1/N; "samples" = n_k-weighted
    share_attention: bool = False       # the "non-local" comparison: attention aggregated too
    se_reduction: int = 0               # 0: the backbone's (lenet-bn 4, alexnet-bn 16)
    eca_min_kernel: int = 3             # timm's floor (reproduces 45,950 on LeNet); 1 = ECA paper
    ca_reduction: int = 32
    cbam_reduction: int = 16


class PFedLA(Method):
    """The host method's declarations, delegated, on models with attention layers."""

    name = "pfedla"
    Params = PFedLAParams

    def __init__(self, context: MethodContext):
        super().__init__(context)
        p: PFedLAParams = self.params
        if p.attention not in KINDS:
            raise ValueError(f"pfedla.attention: {p.attention!r} is not one of {', '.join(KINDS)}")
        if p.base not in HOSTS:
            raise ValueError(f"pfedla.base: {p.base!r} is not one of {', '.join(HOSTS)}")
        if p.weighting not in WEIGHTINGS:
            raise ValueError(f"pfedla.weighting: {p.weighting!r} is not uniform or samples")
        spec = model_spec(self.train.model)
        if spec.attention_sites is None:
            with_sites = ", ".join(sorted(name for name, s in MODELS.items()
                                          if s.attention_sites is not None))
            raise ValueError(f"pfedla: model {self.train.model!r} has no attention sites "
                             f"(use {with_sites})")
        self.attention = AttentionSpec(
            p.attention, se_reduction=p.se_reduction or spec.se_reduction,
            eca_min_kernel=p.eca_min_kernel, ca_reduction=p.ca_reduction,
            cbam_reduction=p.cbam_reduction)
        host_cls = load_method(p.base)
        host_params = host_cls.Params()
        settings = parse_set([f"{p.base}.{item}" for item in p.base_params]).get(p.base, {})
        apply_values(host_params, p.base, settings, "pfedla.base_params")
        private = list(self.train.private)
        if not p.share_attention and "attention" not in private:
            private.append("attention")
        self.host = host_cls(MethodContext(dataclasses.replace(self.train, private=private),
                                           host_params, probe=self._model_with_attention))
        self.aggregator_kind = self.host.aggregator_kind
        self.phases = self.host.phases

    # ---- the host's declarations on models with attention ------------------------------
    def model_names(self) -> tuple[str, ...]:
        return self.host.model_names()

    def metric_names(self) -> frozenset[str]:
        return self.host.metric_names()

    def dp_refusal(self) -> str | None:
        refusal = self.host.dp_refusal()
        return f"pfedla over {refusal}" if refusal else None

    def build_models(self) -> dict[str, nn.Module]:
        models = self.host.build_models()
        sites = model_spec(self.train.model).attention_sites
        for model in models.values():
            # The same draw for every model: Ditto's and pFedMe's personal models start as
            # copies of the global one, attention included.
            torch.manual_seed(self.train.seed + 1)
            insert_attention(model, sites(model), self.attention.build)
        return models

    def _model_with_attention(self) -> nn.Module:
        """One model as the host will hold it (the host checks its split rules on it)."""
        t = self.train
        model = build_model(t.model, t.num_classes, t.in_channels, t.model_size)
        insert_attention(model, model_spec(t.model).attention_sites(model), self.attention.build)
        return model

    def split_rules(self) -> dict[str, tuple[str, ...]]:
        return self.host.split_rules()

    def shared_specs(self, models: dict[str, nn.Module]) -> dict[str, TensorSpec]:
        return self.host.shared_specs(models)

    def initial_state(self, models):
        return self.host.initial_state(models)

    def uplink_schema(self, phase, models):
        return self.host.uplink_schema(phase, models)

    def similarity_groups(self, models):
        return self.host.similarity_groups(models)

    def aggregation_weight(self, num_examples: int) -> float:
        if self.params.weighting == "uniform":
            return 1.0
        return self.host.aggregation_weight(num_examples)

    def fingerprint(self, models: dict[str, nn.Module]) -> str:
        blob = f"{super().fingerprint(models)}|{self.host.fingerprint(models)}".encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def edge(self, models, device):
        return self.host.edge(models, device)

    def server(self, models):
        return self.host.server(models)

"""pFedLA: personalized federated learning with local attention.

Source: the pFedLA paper (Liang, Tian, Yang, Zhang; https://arxiv.org/abs/2304.01783);
the choices it leaves open and our measurements are on docs/methods/pfedla.md.

A local attention layer goes after each conv block of the backbone (the backbone names its
sites: ``lenet-bn``, ``alexnet-bn``, ``mobilenet-v2``): SE, ECA, CoordAtt, CBAM (pFedLA_s:
one mechanism everywhere) or the hybrid (pFedLA_h: a softmax-weighted convex combination of
the SE, ECA and CoordAtt masks per layer, eqs. 7-8). Everything else is the host method
(``base``: FedAvg, FedProx, FedBN, Ditto or pFedMe), not re-implemented: pFedLA is a model
transform over the host -- building it gives a ``PFedLA[host]``, a subclass of the host's
class that inherits every hook (nothing forwarded by hand) and changes only the models
(attention inserted), the weighting and the name -- with the split rule ``attention``
added to the host's private rules, so the attention layers
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
import functools
import hashlib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..config import apply_values, check_choices, parse_set
from ..models import MODELS, build_model, model_spec
from ..models.attention import KINDS, AttentionSpec, insert_attention
from ..models.reference import DECLARE
from .base import Method, MethodContext, MethodSpec, fingerprint_of
from .registry import load_method

# The hosts of the paper's experiments (Table 1).
Host = Literal["fedavg", "fedprox", "fedbn", "ditto", "pfedme"]
HOSTS: tuple[str, ...] = typing.get_args(Host)
Attention = Literal["se", "eca", "ca", "cbam", "hybrid"]
assert typing.get_args(Attention) == tuple(KINDS), "pfedla.attention's choices follow KINDS"


@dataclass
class PFedLAParams:
    attention: Attention = "hybrid"  # one mechanism everywhere, or the hybrid of SE, ECA, CA
    base: Host = "fedavg"               # the host method
    base_params: list[str] = field(default_factory=list)  # the host's, "key=value" (TOML values)
    weighting: Literal["uniform", "samples"] = "uniform"  # the paper's 1/N, or n_k-weighted
    share_attention: bool = False       # the "non-local" comparison: attention aggregated too
    se_reduction: int = 0               # 0: the backbone's (lenet-bn 4, alexnet-bn 16)
    eca_min_kernel: int = 3             # timm's floor (reproduces 45,950 on LeNet); 1 = ECA paper
    ca_reduction: int = 32             # CoordAtt: mip = max(8, C // ca_reduction)
    cbam_reduction: int = 16           # CBAM's channel-MLP reduction


class PFedLA(Method):
    """The host method on models with attention layers: building one returns an instance
    of ``PFedLA[host]``, a subclass of both this class and the host's, so every host
    declaration and hook (schema, upload checks, privacy traits, edge and server halves)
    is the host's own, by inheritance; this class adds only the model transform (attention
    inserted, the ``attention`` rule added to the split), the weighting and its name."""

    name = "pfedla"
    Params = PFedLAParams
    default_model = "lenet-bn"  # the paper's LeNet, with attention sites
    dp_params = {"attention": "se"}  # the hybrid's CA and CBAM hold BatchNorm (dp_refusal)

    def __new__(cls, context: MethodContext) -> PFedLA:
        if cls is not PFedLA:
            return super().__new__(cls)
        check_choices(context.params, "pfedla")
        return super().__new__(_hosted(load_method(context.params.base)))

    def __init__(self, context: MethodContext):
        p: PFedLAParams = context.params
        check_choices(p, "pfedla")
        self.options = p
        spec = model_spec(context.train.model)
        if spec.attention_sites is None:
            with_sites = ", ".join(sorted(name for name, s in MODELS.items()
                                          if s.attention_sites is not None))
            raise ValueError(f"pfedla: no attention sites found in {context.train.model}; "
                             f"{DECLARE.format(what='attention_sites')} (built-ins with sites: "
                             f"{with_sites})")
        self.attention = AttentionSpec(
            p.attention, se_reduction=p.se_reduction or spec.se_reduction,
            eca_min_kernel=p.eca_min_kernel, ca_reduction=p.ca_reduction,
            cbam_reduction=p.cbam_reduction)
        host_cls = load_method(p.base)
        host_params = host_cls.Params()
        settings = parse_set([f"{p.base}.{item}" for item in p.base_params]).get(p.base, {})
        apply_values(host_params, p.base, settings, "pfedla.base_params")
        private = list(context.train.private)
        if not p.share_attention and "attention" not in private:
            private.append("attention")
        # The host, built on the same instance: its hooks read its own params and see
        # the train config with the attention rule; pFedLA's own options are ``options``.
        super().__init__(MethodContext(dataclasses.replace(context.train, private=private),
                                       host_params, probe=self._model_with_attention,
                                       dp=context.dp))

    @property
    def host(self) -> Method:
        """The host method: this very instance (pFedLA is the host on other models)."""
        return self

    @property
    def host_name(self) -> str:
        return self.options.base

    # ---- the transform ------------------------------------------------------------
    def build_models(self) -> dict[str, nn.Module]:
        models = super().build_models()
        sites = model_spec(self.train.model).attention_sites
        for model in models.values():
            # The same draw for every model: Ditto's and pFedMe's personal models start as
            # copies of the global one, attention included.
            torch.manual_seed(self.train.seed + 1)
            insert_attention(model, sites(model), self.attention.build)
        return models

    def _model_with_attention(self) -> nn.Module:
        """One model as the host will hold it (the split rules are checked on it)."""
        t = self.train
        model = build_model(t.model, t.num_classes, t.in_channels, t.model_size)
        insert_attention(model, model_spec(t.model).attention_sites(model), self.attention.build)
        return model

    # ---- what pFedLA changes beyond the models -------------------------------------
    def dp_refusal(self) -> str | None:
        """The host's refusal, or the attention layers': coordinate attention, CBAM and the
        hybrid hold BatchNorm of their own, inserted after ``--dp-fix-model`` replaced the
        backbone's, and batch statistics mix samples, which per-sample clipping does not
        bound."""
        refusal = super().dp_refusal()
        if refusal:
            return f"pfedla over {refusal}"
        with torch.device("meta"):
            layer = self.attention.build(64)
        if any(isinstance(m, _BatchNorm) for m in layer.modules()):
            return (f"pfedla.attention={self.options.attention!r} holds BatchNorm inside its "
                    "attention layers, which DP-SGD cannot cover (--dp-fix-model converts the "
                    "backbone's only): use pfedla.attention='se' or 'eca' under --dp")
        return None

    def aggregation_weight(self, num_examples: int) -> float:
        if self.options.weighting == "uniform":
            return 1.0
        return super().aggregation_weight(num_examples)

    def fingerprint(self, models: dict[str, nn.Module]) -> str:
        own = fingerprint_of(self.name, self.train, self.split_rules(), models)
        host = fingerprint_of(self.host_name, self.train, self.split_rules(), models)
        return hashlib.sha256(f"{own}|{host}".encode()).hexdigest()[:32]

    def describe_params(self) -> dict[str, Any]:
        return dataclasses.asdict(self.options)


@functools.cache
def _hosted(host_cls: type[Method]) -> type[PFedLA]:
    """``PFedLA[host]``: pFedLA's transform first, then the host's class. Its declaration
    is the host's, under pFedLA's name and parameters."""
    declared: dict[str, Any] = {f.name: getattr(host_cls.spec, f.name)
                                for f in dataclasses.fields(MethodSpec)}
    declared.update(name="pfedla", Params=PFedLAParams)
    name = f"PFedLA[{host_cls.name}]"
    return types.new_class(name, (PFedLA, host_cls), declared, lambda ns: ns.update(
        __module__=__name__, __qualname__=name))

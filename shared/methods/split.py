"""Split rules: which tensors of a model are shared (travel, get aggregated) and which
stay private on the edge. Rules compose: a method's own private rules plus the user's
``train.private`` list (e.g. FedProx with ``private = ["bn"]``).

Integer buffers (BatchNorm's ``num_batches_tracked``) never travel: they are counters,
not something to average.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _module_tensor_names(model: nn.Module, match: Callable[[str, nn.Module], bool]) -> set[str]:
    names: set[str] = set()
    for module_name, module in model.named_modules():
        if match(module_name, module):
            prefix = f"{module_name}." if module_name else ""
            names.update(prefix + k for k in module.state_dict())
    return names


def _batchnorm(model: nn.Module, head: str) -> set[str]:
    return _module_tensor_names(model, lambda _, m: isinstance(m, _BatchNorm))


def _head(model: nn.Module, head: str) -> set[str]:
    return {k for k in model.state_dict() if k == head or k.startswith(head + ".")}


def _squeeze_excitation_types() -> tuple[type, ...]:
    """Squeeze-excitation classes with excitation FCs ``fc1``/``fc2`` (1x1 convs) applied to
    the global average pool of the module's input: torchvision's ``SqueezeExcitation``
    (MobileNetV3, ``se-cnn``) and timm's ``SEModule`` (SE-ResNet, ANFR(SE))."""
    from timm.layers import SEModule
    from torchvision.ops.misc import SqueezeExcitation

    return SqueezeExcitation, SEModule


def squeeze_excitation_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every squeeze-excitation module, in registration order, which is forward order for
    every model in the registry."""
    types = _squeeze_excitation_types()
    return [(name, m) for name, m in model.named_modules() if isinstance(m, types)]


def _se_excitation(model: nn.Module, head: str) -> set[str]:
    """The excitation FCs (fc1, fc2: weights and biases) of every squeeze-excitation module."""
    names: set[str] = set()
    for module_name, module in squeeze_excitation_modules(model):
        for fc in ("fc1", "fc2"):
            names.update(f"{module_name}.{fc}.{k}" for k in getattr(module, fc).state_dict())
    return names


def _all_but_se_excitation(model: nn.Module, head: str) -> set[str]:
    """Everything except the SE excitation FCs (Fed-SAP's Agg-SE-E ablation)."""
    return set(model.state_dict()) - _se_excitation(model, head)


def attention_types() -> tuple[type, ...]:
    """Channel/spatial attention classes the ``attention`` rule knows: the SE classes above
    and timm's ECA, CBAM and their variants (what ANFR and pFedLA's backbones use)."""
    from timm.layers import EcaModule, EffectiveSEModule
    from timm.layers.cbam import CbamModule, LightCbamModule
    from timm.layers.eca import CecaModule

    return (*_squeeze_excitation_types(), EffectiveSEModule, EcaModule, CecaModule, CbamModule,
            LightCbamModule)


def _attention(model: nn.Module, head: str) -> set[str]:
    """Every channel/spatial attention module: the known classes and modules that declare
    ``is_attention``."""
    types = attention_types()
    return _module_tensor_names(
        model, lambda _, m: isinstance(m, types) or getattr(m, "is_attention", False))


def _everything(model: nn.Module, head: str) -> set[str]:
    return set(model.state_dict())


PRIVATE_RULES: dict[str, Callable[[nn.Module, str], set[str]]] = {
    "bn": _batchnorm,
    "head": _head,
    "se-e": _se_excitation,
    "all-but-se-e": _all_but_se_excitation,
    "attention": _attention,
    "all": _everything,
}


def check_rules(rules: list[str] | tuple[str, ...], where: str = "train.private") -> None:
    for rule in rules:
        if rule not in PRIVATE_RULES:
            known = ", ".join(sorted(PRIVATE_RULES))
            raise ValueError(f"{where}: unknown split rule {rule!r} (known: {known})")


# What a rule needs in a model to select anything (the message when it selects nothing).
RULE_NEEDS = {
    "bn": "BatchNorm layers",
    "head": "the classifier head",
    "se-e": "squeeze-excitation modules",
    "all-but-se-e": "tensors outside squeeze-excitation modules",
    "attention": "attention modules",
    "all": "tensors",
}


def check_rules_apply(model: nn.Module, rules: tuple[str, ...], head: str, model_name: str,
                      where: str) -> None:
    """Refuse a rule that selects no tensor of the model: a method built on it (FedBN on a
    BN-free model) would otherwise run as something else (plain FedAvg) without a word."""
    for rule in rules:
        if not PRIVATE_RULES[rule](model, head):
            raise ValueError(f"{where}: split rule {rule!r} selects nothing in model "
                             f"{model_name!r}, which has no {RULE_NEEDS[rule]}; it does not "
                             "apply to this model")


def private_names(model: nn.Module, rules: tuple[str, ...], head: str) -> set[str]:
    names: set[str] = set()
    for rule in rules:
        names |= PRIVATE_RULES[rule](model, head)
    return names


def shared_names(model: nn.Module, rules: tuple[str, ...], head: str) -> list[str]:
    """State-dict keys that travel, in state-dict order."""
    private = private_names(model, rules, head)
    return [k for k, v in model.state_dict().items()
            if k not in private and torch.is_floating_point(v)]

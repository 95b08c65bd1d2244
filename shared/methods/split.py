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


def squeeze_excitation_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every squeeze-excitation module (torchvision's ``SqueezeExcitation``, as MobileNetV3
    and ``se-cnn`` use), in registration order, which is forward order for both."""
    from torchvision.ops.misc import SqueezeExcitation

    return [(name, m) for name, m in model.named_modules() if isinstance(m, SqueezeExcitation)]


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


def _attention(model: nn.Module, head: str) -> set[str]:
    """Every channel/spatial attention module (modules that declare ``is_attention``)."""
    from torchvision.ops.misc import SqueezeExcitation

    return _module_tensor_names(
        model, lambda _, m: isinstance(m, SqueezeExcitation) or getattr(m, "is_attention", False)
    )


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

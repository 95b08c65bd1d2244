"""What DP-SGD needs of a model's modules, asked of any model (the privacy layer's own
checks, so that it never imports a model module): no BatchNorm, whose batch statistics
mix samples, and no in-place activation, which Opacus' per-sample hooks cannot follow."""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of every BatchNorm layer, subclasses included. Opacus' ModuleValidator matches
    exact types, so it passes timm's ``BatchNormAct2d`` (CBAM's spatial norm): a DP check
    must ask this too, or batch statistics would mix samples under DP-SGD unnoticed."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def disable_inplace_activations(model: nn.Module) -> nn.Module:
    """Turn off in-place activations (timm's NF blocks apply ReLU in place to a conv's
    output), which Opacus' per-sample-gradient backward hooks cannot follow. Same outputs,
    a little more memory; DP-SGD needs it."""
    for module in model.modules():
        if getattr(module, "inplace", False) is True:
            module.inplace = False
    return model

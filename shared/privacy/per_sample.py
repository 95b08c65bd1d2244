"""Per-sample gradients for DP-SGD: Opacus' grad samplers behind tensor hooks."""

from __future__ import annotations

import functools

from opacus import GradSampleModule
from opacus.grad_sample.functorch import prepare_layer
from torch import nn


class OutputHookGradSampleModule(GradSampleModule):
    """Opacus' per-sample gradients with the gradient of each layer's output taken by a
    tensor hook set in the forward pass, instead of a full backward hook. A full backward
    hook hands the parent module a view that must not be modified in place, and residual
    blocks add their shortcut in place (timm's ResNet ``x += shortcut``, torchvision's
    BasicBlock and MobileNetV3); a tensor hook receives the gradient of the output as the
    layer produced it, whatever happens to it afterwards. The hook is only set when the
    layer's activations were captured, so a layer frozen for a while (FedRep's head during
    the body's epochs) is skipped in both directions."""

    def add_hooks(self, *, loss_reduction: str = "mean", batch_first: bool = True,
                  force_functorch: bool = False) -> None:
        if hasattr(self._module, "autograd_grad_sample_hooks"):
            raise ValueError("Trying to add hooks twice to the same model")
        self._module.autograd_grad_sample_hooks = []
        self.autograd_grad_sample_hooks = self._module.autograd_grad_sample_hooks
        for module in self.iterate_submodules(self._module):
            if force_functorch or type(module) not in self.GRAD_SAMPLERS:
                prepare_layer(module, batch_first=batch_first)
            hook = functools.partial(self._forward_hook, loss_reduction=loss_reduction,
                                     batch_first=batch_first)
            self.autograd_grad_sample_hooks.append(module.register_forward_hook(hook))
        self.enable_hooks()

    def _forward_hook(self, module: nn.Module, inputs, output, *, loss_reduction: str,
                      batch_first: bool) -> None:
        captured = len(getattr(module, "activations", ()))
        self.capture_activations_hook(module, inputs, output)
        if len(getattr(module, "activations", ())) == captured:
            return  # frozen, evaluation mode, no grad or hooks off: nothing to pair with
        first = output[0] if isinstance(output, (tuple, list)) else output
        first.register_hook(lambda grad: self.capture_backprops_hook(
            module, inputs, (grad,), loss_reduction=loss_reduction, batch_first=batch_first))

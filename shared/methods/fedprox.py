"""FedProx (Li et al., 2020): local objective + (mu/2)||w - w_global||^2.

The proximal term depends on parameters only, so it is applied as gradient
post-processing (grad += mu (w - w_global)) rather than added to the loss; that keeps it
exact under DP-SGD, whose per-sample clipping would otherwise clip it too.
"""

from dataclasses import dataclass

from .base import EdgeAlgorithm, Method


@dataclass
class FedProxParams:
    mu: float = 0.01  # weight of the proximal term (mu/2) ||w - w_global||^2


def add_proximal_gradient(edge: EdgeAlgorithm, reference: dict, mu: float) -> None:
    """grad += mu * (w - reference[w]) for every trainable tensor that has a reference."""
    for name, ref in reference.items():
        param = edge.live_tensor(name)
        if param.requires_grad and param.grad is not None:
            param.grad.add_(param.detach() - ref, alpha=mu)


class FedProxEdge(EdgeAlgorithm):
    # Its post_backward is proximal_term's pull: fl-sim --batch-edges applies it batched.
    batched_hooks = ("post_backward",)

    def proximal_term(self):
        return self.global_tensors, self.method.params.mu

    def post_backward(self) -> None:
        reference, mu = self.proximal_term()
        add_proximal_gradient(self, reference, mu)


class FedProx(Method):
    name = "fedprox"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    Params = FedProxParams

    def edge(self, models, device):
        return FedProxEdge(self, models, device)

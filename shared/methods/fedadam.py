"""FedAdam (Reddi et al., 2021, Algorithm 2): the server treats the mean client change
Delta = mean_k(x_k) - x as a pseudo-gradient and takes an Adam step

    m <- b1 m + (1 - b1) Delta;  v <- b2 v + (1 - b2) Delta^2;  x <- x + eta m / (sqrt(v) + tau)

with v initialised to tau^2 as in the paper. The moments stay on the server (checkpointed)
and never travel. Float buffers (BatchNorm running statistics) are averaged, not stepped.
"""

from dataclasses import dataclass

import torch

from ..schema import Kind
from .aggregators import ServerOptimizer
from .base import Method

SHARED = (Kind.SHARED_TENSORS, "")


@dataclass
class FedAdamParams:
    server_lr: float = 0.01  # the server's Adam step size
    beta1: float = 0.9       # first-moment decay
    beta2: float = 0.99      # second-moment decay
    tau: float = 1e-3        # adaptivity: added to sqrt(v) in the denominator


class FedAdamAggregator(ServerOptimizer):
    def apply(self, means):
        p = self.method.params
        current = self.state[SHARED]
        for name, mean in means[SHARED].items():
            x = current[name]
            if self.specs[name].is_buffer:
                current[name] = mean.to(x.dtype)
                continue
            delta = mean - x.float()
            m = self.optimizer_state.get(f"m:{name}", torch.zeros_like(delta))
            v = self.optimizer_state.get(f"v:{name}", torch.full_like(delta, p.tau**2))
            m = p.beta1 * m + (1 - p.beta1) * delta
            v = p.beta2 * v + (1 - p.beta2) * delta.square()
            self.optimizer_state[f"m:{name}"] = m
            self.optimizer_state[f"v:{name}"] = v
            current[name] = (x.float() + p.server_lr * m / (v.sqrt() + p.tau)).to(x.dtype)


class FedAdam(Method):
    name = "fedadam"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    Params = FedAdamParams
    aggregator = FedAdamAggregator

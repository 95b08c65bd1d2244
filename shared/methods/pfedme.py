"""pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020): personalization with Moreau envelopes.

Each edge holds its local copy w of the global model (the ``global`` model: it travels)
and a personalized model theta (``personal``: private, what ``predict`` uses). On every
batch D:

* inner solve, K = ``inner_steps`` optimizer steps on the same batch:
  theta <- theta - personal_lr (grad f(theta; D) + lam (theta - w)),
  the Moreau-envelope pull lam (theta - w) applied as gradient post-processing (so it is
  exact under DP-SGD's clipping, like FedProx's pull);
* outer local update: w <- w - eta lam (w - theta), eta the round's learning rate.

Server (a server optimizer over the streamed n_k-weighted mean of the uploaded w_i):
w <- (1 - beta) w + beta mean_i(w_i); beta = 1 is FedAvg's mean.

Following the authors' code (github.com/CharlieDinh/pFedMe, FLAlgorithms/users/
userpFedMe.py): theta starts each round from the received w and is warm-started from one
batch's solve to the next; after training, theta (the last approximate solve) is the
personalized model evaluation scores. The paper's models have no BatchNorm; here w's float
buffers (BN running statistics) take theta's after local training, since w itself never
runs a forward pass (``buffers_from_personal``, a reconstruction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..schema import Kind
from .aggregators import ServerOptimizer
from .base import EdgeAlgorithm, LoopSchedule, Method, MethodContext, qualified
from .fedprox import add_proximal_gradient

SHARED = (Kind.SHARED_TENSORS, "")


@dataclass
class PFedMeParams:
    lam: float = 15.0             # lambda, the Moreau-envelope weight (paper: 15 on MNIST)
    inner_steps: int = 5          # K (paper: 5)
    personal_lr: float = 0.09     # the inner solver's step (paper: 0.09 on MNIST, 0.01 CIFAR)
    beta: float = 1.0             # server mixing (paper: 1, or 2 for accelerated pFedMe)
    buffers_from_personal: bool = True  # [reconstructed] w's BN statistics follow theta's


class PFedMeEdge(EdgeAlgorithm):
    def __init__(self, method: PFedMe, models, device):
        super().__init__(method, models, device)
        # K inner steps on each batch, then the outer update of w.
        self.schedule = LoopSchedule(steps_per_batch=method.params.inner_steps,
                                     after_batch=self._after_batch)
        local, personal = self.models["global"], self.models["personal"]
        # Live views of w: the pull toward w follows w's updates within the round.
        self.anchor = {qualified("personal", k): p.detach()
                       for k, p in local.named_parameters()}
        self.pairs = [(w.detach(), theta.detach()) for w, theta in
                      zip(local.parameters(), personal.parameters(), strict=True)]

    def parameter_groups(self) -> list[dict]:
        """Only theta is stepped by the optimizer; w moves after each batch. The group's
        learning rate follows the round's schedule scaled to ``personal_lr``."""
        scale = self.method.params.personal_lr / self.method.train.lr
        return [{"params": [p for _, p in self.named_trainable("personal")],
                 "lr": self.method.params.personal_lr, "lr_scale": scale}]

    def begin_train(self) -> None:
        with torch.no_grad():  # theta^0 = w^t (the received global model)
            for theta, w in zip(self.models["personal"].state_dict(keep_vars=True).values(),
                                self.models["global"].state_dict().values(), strict=True):
                theta.copy_(w)

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.models["personal"](x), y)

    def post_backward(self) -> None:
        add_proximal_gradient(self, self.anchor, self.method.params.lam)

    def outer_lr(self) -> float:
        group = self.optimizers()[0].param_groups[0]
        return group["lr"] / group["lr_scale"]

    @torch.no_grad()
    def _after_batch(self) -> None:
        step = self.outer_lr() * self.method.params.lam
        for w, theta in self.pairs:
            w.sub_(w - theta, alpha=step)

    @torch.no_grad()
    def end_train(self, batches) -> None:
        if not self.method.params.buffers_from_personal:
            return
        personal = dict(self.models["personal"].named_buffers())
        for key, buffer in self.models["global"].named_buffers():
            if buffer.is_floating_point():
                buffer.copy_(personal[key])

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.models["personal"](x)


class PFedMeAggregator(ServerOptimizer):
    def apply(self, means):
        beta = self.method.params.beta
        current = self.state[SHARED]
        for name, mean in means[SHARED].items():
            w = current[name]
            if self.specs[name].is_buffer:
                current[name] = mean.to(w.dtype)
            else:
                current[name] = ((1 - beta) * w.float() + beta * mean).to(w.dtype)


class PFedMe(Method):
    name = "pfedme"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    Params = PFedMeParams
    personal_copy = ("global", "personal")
    aggregator = PFedMeAggregator

    def __init__(self, context: MethodContext):
        super().__init__(context)
        p: PFedMeParams = self.params
        if not 0 < p.lam < float("inf"):
            raise ValueError(f"pfedme.lam must be a finite number > 0, got {p.lam}")
        if p.inner_steps < 1:
            raise ValueError(f"pfedme.inner_steps must be >= 1, got {p.inner_steps}")
        if not 0 < p.personal_lr < float("inf"):
            raise ValueError(f"pfedme.personal_lr must be a finite number > 0, got {p.personal_lr}")
        if not 0 < p.beta < float("inf"):
            raise ValueError(f"pfedme.beta must be a finite number > 0, got {p.beta}")
        if not self.train.lr > 0:
            raise ValueError(f"pfedme needs train.lr > 0 (the outer step eta), got {self.train.lr}")

    def edge(self, models, device):
        return PFedMeEdge(self, models, device)

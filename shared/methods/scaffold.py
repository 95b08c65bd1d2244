"""SCAFFOLD (Karimireddy et al., 2020, https://arxiv.org/abs/1910.06378), option II control
variates.

Edge: y <- y - lr (g(y) - c_i + c), applied as gradient post-processing; after K local
steps c_i+ = c_i - c + (x - y) / (K lr); it uploads y (SHARED_TENSORS) and
Delta c_i = c_i+ - c_i (CONTROL). c_i is private edge state.
Server: x <- x + eta_g mean(y - x);  c <- c + (|S| / N) mean(Delta c_i), means uniform over
the round's participants as in the paper, N = every edge known to the server.
Control variates cover trainable shared tensors; float buffers are averaged.

``correction = "step"`` and ``weighting = "examples"`` are the form NIID-Bench's published
reproduction runs (Flower's baselines/niid_bench, the table ``bench/calibrate.py`` checks
against): the optimiser (SGD with momentum and weight decay) steps on the plain gradient g,
then every parameter moves by -lr (c - c_i) outside the momentum buffer; c_i+ keeps option
II's formula; both means weigh each edge by its number of examples. The defaults are the
paper's.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from ..schema import Kind, Payload, Section, SectionSpec
from .aggregators import ServerOptimizer
from .base import EdgeAlgorithm, Method

SHARED = (Kind.SHARED_TENSORS, "")
CONTROL = (Kind.CONTROL, "")


@dataclass
class ScaffoldParams:
    server_lr: float = 1.0  # global step size on the mean update (1: plain averaging)
    # Where c - c_i enters: "gradient" (the paper: added to g, plain SGD only) or "step"
    # (NIID-Bench's reproduction: applied after each optimiser step, momentum allowed).
    correction: Literal["gradient", "step"] = "gradient"
    # The means over the round's edges: "uniform" (the paper) or "examples" (by data size).
    weighting: Literal["uniform", "examples"] = "uniform"


def control_specs(method: Method, models) -> dict:
    return {k: s for k, s in method.shared_specs(models).items() if not s.is_buffer}


class ScaffoldEdge(EdgeAlgorithm):
    def __init__(self, method, models, device):
        super().__init__(method, models, device)
        self.control_names = list(control_specs(method, self.models))
        self.c_local = {name: torch.zeros_like(self.live_tensor(name)).detach()
                        for name in self.control_names}
        self.c_global = dict(self.c_local)
        self._correction = dict(self.c_local)  # c - c_i, set at each begin_train
        self._corrects = False  # the step hook is registered once per optimizer

    def receive(self, phase, common, personal):
        super().receive(phase, common, personal)
        control = common.tensors(*CONTROL)
        self.c_global = {name: control[name].to(self.device).clone() for name in self.control_names}

    def begin_train(self) -> None:
        super().begin_train()
        # c - c_i is fixed through a round's steps: one subtraction per round, not per step.
        self._correction = {name: self.c_global[name] - self.c_local[name]
                            for name in self.control_names}

    def optimizers(self):
        optimizers = super().optimizers()
        if self.method.params.correction == "step" and not self._corrects:
            for opt in optimizers:
                opt.register_step_post_hook(self._correct_after_step)
            self._corrects = True
        return optimizers

    def _correct_after_step(self, optimizer, *_) -> None:
        """y <- y - lr (c - c_i) after the optimiser's own step (on g, with its momentum)."""
        lr = optimizer.param_groups[0]["lr"]
        with torch.no_grad():
            for name in self.control_names:
                self.live_tensor(name).sub_(self._correction[name], alpha=lr)

    def post_backward(self) -> None:
        if self.method.params.correction == "step":
            return
        for name in self.control_names:
            param = self.live_tensor(name)
            if param.grad is not None:
                param.grad.add_(self._correction[name])

    def after_train(self, steps: int) -> Payload:
        lr = self.optimizers()[0].param_groups[0]["lr"]
        delta_c = {}
        for name in self.control_names:
            if steps > 0:
                y = self.live_tensor(name).detach()
                drift = (self.global_tensors[name] - y) / (steps * lr)
                new = self.c_local[name] - self.c_global[name] + drift
            else:
                new = self.c_local[name]
            delta_c[name] = new - self.c_local[name]
            self.c_local[name] = new
        return Payload([Section(Kind.SHARED_TENSORS, "", self.shared_values()),
                        Section(Kind.CONTROL, "", delta_c)])

    def extra_state(self):
        return {f"c_local/{k}": v for k, v in self.c_local.items()}

    def load_extra_state(self, tensors):
        for name in self.control_names:
            key = f"c_local/{name}"
            if key in tensors:
                self.c_local[name] = tensors[key].to(self.device).clone()


class ScaffoldAggregator(ServerOptimizer):
    def apply(self, means):
        eta = self.method.params.server_lr
        x = self.state[SHARED]
        for name, mean in means[SHARED].items():
            if self.specs[name].is_buffer:
                x[name] = mean.to(x[name].dtype)
            else:
                x[name] = (x[name].float() + eta * (mean - x[name].float())).to(x[name].dtype)
        share = self._count / max(self.known_edges, self._count)
        c = self.state[CONTROL]
        for name, mean_delta in means[CONTROL].items():
            c[name] = c[name] + share * mean_delta


class Scaffold(Method):
    name = "scaffold"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    Params = ScaffoldParams
    aggregator = ScaffoldAggregator
    # c_i+ = c_i - c + (x - y) / (K lr) is the displacement of plain SGD steps.
    train_settings = {"optimizer": "sgd", "momentum": 0.0, "weight_decay": 0.0}

    def __init__(self, context):
        super().__init__(context)
        t = self.train
        if t.optimizer != "sgd":
            raise ValueError("scaffold steps SGD (plain SGD in the paper's form): use "
                             "train.optimizer = 'sgd'")
        if self.params.correction == "gradient" and (t.momentum or t.weight_decay):
            # c_i+ = c_i - c + (x - y) / (K lr) is the displacement of plain SGD steps.
            raise ValueError("scaffold's control-variate update assumes plain SGD: use "
                             "train.optimizer = 'sgd' with momentum = 0 and weight_decay = 0, "
                             "or scaffold.correction = 'step' (NIID-Bench's form, which "
                             "steps momentum SGD and applies the correction after each step)")

    def initial_state(self, models):
        state = super().initial_state(models)
        state[CONTROL] = {k: torch.zeros(s.shape, dtype=s.dtype)
                          for k, s in control_specs(self, models).items()}
        return state

    def uplink_schema(self, phase, models):
        schema = super().uplink_schema(phase, models)
        if schema:
            schema.append(SectionSpec(Kind.CONTROL, "", control_specs(self, models)))
        return schema

    def aggregation_weight(self, num_examples: int) -> float:
        return 1.0 if self.params.weighting == "uniform" else float(num_examples)

    def edge(self, models, device):
        return ScaffoldEdge(self, models, device)

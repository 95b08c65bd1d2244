"""SCAFFOLD (Karimireddy et al., 2020), option II control variates.

Edge: y <- y - lr (g(y) - c_i + c), applied as gradient post-processing; after K local
steps c_i+ = c_i - c + (x - y) / (K lr); it uploads y (SHARED_TENSORS) and
Delta c_i = c_i+ - c_i (CONTROL). c_i is private edge state.
Server: x <- x + eta_g mean(y - x);  c <- c + (|S| / N) mean(Delta c_i), means uniform over
the round's participants as in the paper, N = every edge known to the server.
Control variates cover trainable shared tensors; float buffers are averaged.
"""

from dataclasses import dataclass

import torch

from ..schema import Kind, Payload, Section, SectionSpec
from .aggregators import ServerOptimizer
from .base import EdgeAlgorithm, Method

SHARED = (Kind.SHARED_TENSORS, "")
CONTROL = (Kind.CONTROL, "")


@dataclass
class ScaffoldParams:
    server_lr: float = 1.0  # global step size on the mean update (1: plain averaging)


def control_specs(method: Method, models) -> dict:
    return {k: s for k, s in method.shared_specs(models).items() if not s.is_buffer}


class ScaffoldEdge(EdgeAlgorithm):
    def __init__(self, method, models, device):
        super().__init__(method, models, device)
        self.control_names = list(control_specs(method, self.models))
        self.c_local = {name: torch.zeros_like(self.live_tensor(name)).detach()
                        for name in self.control_names}
        self.c_global = dict(self.c_local)

    def receive(self, phase, common, personal):
        super().receive(phase, common, personal)
        control = common.tensors(*CONTROL)
        self.c_global = {name: control[name].to(self.device).clone() for name in self.control_names}

    def post_backward(self) -> None:
        for name in self.control_names:
            param = self.live_tensor(name)
            if param.grad is not None:
                param.grad.add_(self.c_global[name] - self.c_local[name])

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
        if t.optimizer != "sgd" or t.momentum or t.weight_decay:
            # c_i+ = c_i - c + (x - y) / (K lr) is the displacement of plain SGD steps.
            raise ValueError("scaffold's control-variate update assumes plain SGD: use "
                             "train.optimizer = 'sgd' with momentum = 0 and weight_decay = 0")

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
        return 1.0

    def edge(self, models, device):
        return ScaffoldEdge(self, models, device)

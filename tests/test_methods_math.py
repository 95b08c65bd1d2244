"""Methods against hand-computed numbers: aggregators, edge hooks, schemas, registry."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import (
    AggregatorKind,
    Method,
    MethodContext,
    available_methods,
    load_method,
)
from fedattn_shared.schema import EVALUATE, TRAIN, Kind, Payload, Section
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import PayloadAssembler, payload_chunks

SHARED = (Kind.SHARED_TENSORS, "")
CONTROL = (Kind.CONTROL, "")
CPU = torch.device("cpu")

ALL_METHODS = ["anfr", "ditto", "fedadam", "fedavg", "fedavgft", "fedbn", "fedmedian", "fedper",
               "fedproto", "fedprox", "fedrep", "fedsap", "fedstar", "local", "pfedka", "pfedla",
               "pfedme", "scaffold"]


class Tiny(nn.Module):
    """fc.weight [1, 2], fc.bias [1], bn.{weight, bias, running_mean, running_var} [1]."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.bn = nn.BatchNorm1d(1)

    def forward(self, x):
        return self.bn(self.fc(x))


def make(name: str, params: dict | None = None, **train) -> Method:
    cls = load_method(name)
    return cls(MethodContext(TrainConfig(**train), cls.Params(**(params or {}))))


def t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


TINY_NAMES = ["model/fc.weight", "model/fc.bias", "model/bn.weight", "model/bn.bias",
              "model/bn.running_mean", "model/bn.running_var"]


def tiny_values(w0, w1, b, bn_w=1.0, bn_b=0.0, mean=0.0, var=1.0) -> dict[str, torch.Tensor]:
    return {"model/fc.weight": t([w0, w1]), "model/fc.bias": t(b), "model/bn.weight": t(bn_w),
            "model/bn.bias": t(bn_b), "model/bn.running_mean": t(mean),
            "model/bn.running_var": t(var)}


def upload(tensors: dict[str, torch.Tensor], control: dict | None = None) -> Payload:
    sections = [Section(Kind.SHARED_TENSORS, "", tensors)]
    if control is not None:
        sections.append(Section(Kind.CONTROL, "", control))
    return Payload(sections)


def over_the_wire(payload: Payload) -> Payload:
    encoded = encode(payload)
    assembler = PayloadAssembler(encoded.manifest, 1 << 30, 64)
    for _, chunk in payload_chunks(encoded, 64):
        assembler.add(chunk)
    return assembler.finish()


def close(a: torch.Tensor, b, tol: float = 1e-6) -> bool:
    """Same shape (or ``b`` a scalar) and equal within ``tol``."""
    b = torch.as_tensor(b, dtype=a.dtype)
    if b.dim() and b.shape != a.shape:
        return False
    return torch.allclose(a, b, rtol=tol, atol=tol)


# ---- StreamingMean (FedAvg) -----------------------------------------------------------


def test_streaming_mean_weighted_mean():
    method = make("fedavg")
    agg = method.server({"model": Tiny()})
    assert agg.kind is AggregatorKind.STREAMING_SUM
    assert list(agg.state[SHARED]) == TINY_NAMES
    agg.begin_round(1, ["a", "b"], known_edges=2)
    a = tiny_values(1.0, 2.0, 0.0, mean=0.0, var=1.0)
    b = tiny_values(5.0, -2.0, 4.0, mean=4.0, var=2.0)
    a_before = {k: v.clone() for k, v in a.items()}
    agg.accept("a", upload(a), method.aggregation_weight(1))
    agg.accept("b", upload(b), method.aggregation_weight(3))
    figures = agg.finish()
    assert figures == {"aggregated": 2, "total_weight": 4.0}
    x = agg.state[SHARED]
    # (1*a + 3*b) / 4
    assert close(x["model/fc.weight"], [[4.0, -1.0]])
    assert close(x["model/fc.bias"], [3.0])
    assert close(x["model/bn.running_mean"], [3.0])
    assert close(x["model/bn.running_var"], [1.75])
    assert close(x["model/bn.weight"], [1.0])
    assert all(torch.equal(a[k], a_before[k]) for k in a)  # uploads are not modified
    assert torch.equal(agg.broadcast(TRAIN).tensors(*SHARED)["model/fc.weight"], x["model/fc.weight"])


def test_streaming_mean_untouched_round_keeps_state():
    method = make("fedavg")
    agg = method.server({"model": Tiny()})
    before = {k: v.clone() for k, v in agg.state[SHARED].items()}
    agg.begin_round(1, ["a"], known_edges=1)
    assert agg.finish() == {"aggregated": 0, "total_weight": 0.0}
    assert all(torch.equal(agg.state[SHARED][k], before[k]) for k in before)


def test_streaming_mean_rounds_are_independent_and_keep_dtype():
    method = make("fedavg")
    agg = method.server({"model": Tiny()})
    agg.state[SHARED]["model/fc.bias"] = torch.zeros(1, dtype=torch.float64)
    agg.begin_round(1, ["a"], 1)
    agg.accept("a", upload(tiny_values(9.0, 9.0, 9.0)), 2.0)
    agg.finish()
    agg.begin_round(2, ["a"], 1)
    agg.accept("a", upload(tiny_values(1.0, -1.0, 0.5)), 5.0)
    agg.finish()
    assert close(agg.state[SHARED]["model/fc.weight"], [[1.0, -1.0]])  # round 1 sum forgotten
    assert agg.state[SHARED]["model/fc.bias"].dtype == torch.float64
    assert agg.state[SHARED]["model/fc.bias"].item() == 0.5


def test_streaming_mean_refuses_non_positive_weight():
    agg = make("fedavg").server({"model": Tiny()})
    agg.begin_round(1, ["a"], 1)
    for weight in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="weight must be > 0"):
            agg.accept("a", upload(tiny_values(1, 1, 1)), weight)


def test_fedavg_end_to_end_over_the_wire():
    method = make("fedavg", in_channels=3)
    models = method.build_models()
    agg = method.server(models)
    x = agg.broadcast(TRAIN)
    edges = []
    for shift in (1.0, 2.0):
        edge = method.edge(method.build_models(), CPU)
        edge.receive(TRAIN, over_the_wire(x), Payload())
        with torch.no_grad():
            edge.models["model"].classifier[6].bias.add_(shift)
        edges.append(edge)
    agg.begin_round(1, ["a", "b"], 2)
    agg.accept("a", over_the_wire(edges[0].after_train(1)), method.aggregation_weight(10))
    agg.accept("b", over_the_wire(edges[1].after_train(1)), method.aggregation_weight(30))
    agg.finish()
    start = x.tensors(*SHARED)["model/classifier.6.bias"]
    # (10 * (x+1) + 30 * (x+2)) / 40 = x + 1.75
    assert close(agg.state[SHARED]["model/classifier.6.bias"], start + 1.75, 1e-5)
    # Untouched tensors: the mean of identical values (up to float32 rounding).
    assert close(agg.state[SHARED]["model/features.0.weight"],
                 x.tensors(*SHARED)["model/features.0.weight"])


# ---- FedAdam --------------------------------------------------------------------------

ADAM = {"server_lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 0.5}


def _adam_round(agg, method, values_a, values_b):
    agg.begin_round(agg.round + 1, ["a", "b"], 2)
    agg.accept("a", upload(values_a), method.aggregation_weight(1))
    agg.accept("b", upload(values_b), method.aggregation_weight(1))
    agg.finish()


def test_fedadam_two_steps_by_hand():
    method = make("fedadam", ADAM)
    agg = method.server({"model": Tiny()})
    assert agg.kind is AggregatorKind.SERVER_OPTIMIZER
    agg.state[SHARED].update(tiny_values(1.0, -1.0, 0.0, mean=0.0, var=1.0))

    # Round 1: fc.weight[0] uploads 2 and 4 -> mean 3, Delta = 2; fc.weight[1] Delta = 0.
    _adam_round(agg, method, tiny_values(2.0, -1.0, 0.0, mean=2.0, var=1.0),
                tiny_values(4.0, -1.0, 0.0, mean=4.0, var=3.0))
    m1 = 0.1 * 2.0                               # (1 - b1) Delta
    v1 = 0.99 * 0.5**2 + 0.01 * 2.0**2           # v0 = tau^2 = 0.25 -> 0.2875
    x1 = 1.0 + 0.1 * m1 / (math.sqrt(v1) + 0.5)  # 1.0193012...
    assert abs(v1 - 0.2875) < 1e-12 and abs(x1 - 1.0193012) < 1e-6
    state = agg.state[SHARED]
    assert close(state["model/fc.weight"], [[x1, -1.0]])
    assert close(agg.optimizer_state["m:model/fc.weight"], [[m1, 0.0]])
    assert close(agg.optimizer_state["v:model/fc.weight"], [[v1, 0.99 * 0.25]])
    # Buffers are the plain mean, not stepped; they have no moments.
    assert close(state["model/bn.running_mean"], [3.0])
    assert close(state["model/bn.running_var"], [2.0])
    assert "m:model/bn.running_mean" not in agg.optimizer_state
    assert "v:model/bn.running_var" not in agg.optimizer_state
    assert "m:model/bn.weight" in agg.optimizer_state  # BN affine weights are stepped

    # Checkpoint and restore into a fresh aggregator before round 2.
    saved, meta = agg.state_tensors(), agg.state_meta()
    assert "opt:m:model/fc.weight" in saved and "global:shared_tensors::model/fc.weight" in saved
    agg2 = method.server({"model": Tiny()})
    agg2.load_state({k: v.clone() for k, v in saved.items()}, meta)

    # Round 2: both upload 0 -> Delta = -x1.
    _adam_round(agg2, method, tiny_values(0.0, -1.0, 0.0), tiny_values(0.0, -1.0, 0.0))
    d2 = -x1
    m2 = 0.9 * m1 + 0.1 * d2
    v2 = 0.99 * v1 + 0.01 * d2**2
    x2 = x1 + 0.1 * m2 / (math.sqrt(v2) + 0.5)
    assert close(agg2.state[SHARED]["model/fc.weight"][0, 0], x2)
    assert close(agg2.optimizer_state["m:model/fc.weight"][0, 0], m2)
    assert close(agg2.optimizer_state["v:model/fc.weight"][0, 0], v2)
    assert agg2.round == 2


def test_fedadam_zero_init_of_v_would_differ():
    # Guards the tau^2 initialisation: with v0 = 0 the first step would be 0.1*0.2/(0.2+0.5).
    method = make("fedadam", ADAM)
    agg = method.server({"model": Tiny()})
    agg.state[SHARED].update(tiny_values(1.0, 0.0, 0.0))
    _adam_round(agg, method, tiny_values(3.0, 0.0, 0.0), tiny_values(3.0, 0.0, 0.0))
    got = agg.state[SHARED]["model/fc.weight"][0, 0].item()
    assert abs(got - (1.0 + 0.02 / (math.sqrt(0.2875) + 0.5))) < 1e-6
    assert abs(got - (1.0 + 0.02 / 0.7)) > 1e-3


# ---- SCAFFOLD -------------------------------------------------------------------------


def test_scaffold_server_update_by_hand():
    method = make("scaffold", {"server_lr": 0.5})
    agg = method.server({"model": Tiny()})
    assert set(agg.state[CONTROL]) == {"model/fc.weight", "model/fc.bias", "model/bn.weight",
                                       "model/bn.bias"}  # no control variate for buffers
    assert all(not v.any() for v in agg.state[CONTROL].values())
    agg.state[SHARED].update(tiny_values(1.0, 1.0, 0.0, mean=0.0))
    agg.state[CONTROL]["model/fc.weight"] = t([0.5, 0.5])
    zero_c = {k: torch.zeros_like(v) for k, v in agg.state[CONTROL].items()}

    agg.begin_round(1, ["a", "b"], known_edges=4)
    # Uniform weights whatever the number of examples.
    assert method.aggregation_weight(100) == method.aggregation_weight(1) == 1.0
    agg.accept("a", upload(tiny_values(2.0, 0.0, 0.0, mean=2.0),
                           {**zero_c, "model/fc.weight": t([1.0, -1.0])}),
               method.aggregation_weight(100))
    agg.accept("b", upload(tiny_values(4.0, 0.0, 0.0, mean=4.0),
                           {**zero_c, "model/fc.weight": t([3.0, 1.0])}),
               method.aggregation_weight(1))
    agg.finish()
    # x += 0.5 * (mean(y) - x): mean(y) = [3, 0] -> [1 + 1, 1 - 0.5]
    assert close(agg.state[SHARED]["model/fc.weight"], [[2.0, 0.5]])
    # c += (|S|/N) mean(dc) = 0.5 + (2/4) * [2, 0]
    assert close(agg.state[CONTROL]["model/fc.weight"], [[1.5, 0.5]])
    # Buffers: plain mean, no server step (eta would have given 1.5).
    assert close(agg.state[SHARED]["model/bn.running_mean"], [3.0])
    down = agg.broadcast(TRAIN)
    assert close(down.tensors(*CONTROL)["model/fc.weight"], [[1.5, 0.5]])


def test_scaffold_share_never_exceeds_one():
    method = make("scaffold")
    agg = method.server({"model": Tiny()})
    zero = {k: torch.zeros_like(v) for k, v in agg.state[CONTROL].items()}
    agg.begin_round(1, ["a"], known_edges=0)  # server lost count: |S|/N capped at 1
    agg.accept("a", upload(dict(agg.state[SHARED]), {**zero, "model/fc.bias": t(2.0)}), 1.0)
    agg.finish()
    assert close(agg.state[CONTROL]["model/fc.bias"], [2.0])


def test_scaffold_schema():
    method = make("scaffold")
    models = {"model": Tiny()}
    shared, control = method.uplink_schema(TRAIN, models)
    assert (shared.kind, control.kind) == (Kind.SHARED_TENSORS, Kind.CONTROL)
    assert list(shared.tensors) == TINY_NAMES
    assert list(control.tensors) == TINY_NAMES[:4]
    assert method.uplink_schema(EVALUATE, models) == []


def scaffold_edge(method: Method):
    """A SCAFFOLD edge on nn.Linear(2, 3) that has received a global x and the server's c,
    holding its own c_i: (edge, model, x, c, c_i), the same seeded values every call."""
    torch.manual_seed(1)
    model = nn.Linear(2, 3)
    edge = method.edge({"model": model}, CPU)
    torch.manual_seed(2)
    x = {"model/weight": torch.randn(3, 2), "model/bias": torch.randn(3)}
    c = {"model/weight": torch.full((3, 2), 0.3), "model/bias": t(0.3, -0.2, 0.1)}
    c_i = {"model/weight": torch.full((3, 2), -0.1), "model/bias": t(0.05, 0.0, 0.2)}
    edge.load_extra_state({f"c_local/{k}": v for k, v in c_i.items()})
    edge.receive(TRAIN, Payload([Section(Kind.SHARED_TENSORS, "", x),
                                 Section(Kind.CONTROL, "", c)]), Payload())
    return edge, model, x, c, c_i


def test_scaffold_edge_control_variate_after_k_steps():
    lr, K = 0.1, 2
    method = make("scaffold", lr=lr, num_classes=3)
    edge, model, x, c, c_i = scaffold_edge(method)
    names = ["model/weight", "model/bias"]
    assert edge.control_names == names
    assert torch.equal(model.weight, x["model/weight"])
    edge.train_mode()
    edge.begin_train()
    batches = [(torch.randn(4, 2), torch.tensor([0, 1, 2, 1])) for _ in range(K)]

    # Reference: y <- y - lr (g(y) - c_i + c), gradients by autograd on plain tensors.
    y = {k: v.clone() for k, v in x.items()}
    raw_grads = []
    for inputs, labels in batches:
        w = {k: v.clone().requires_grad_(True) for k, v in y.items()}
        loss = F.cross_entropy(F.linear(inputs, w["model/weight"], w["model/bias"]), labels)
        g = dict(zip(names, torch.autograd.grad(loss, [w[k] for k in names]), strict=True))
        raw_grads.append(g)
        y = {k: y[k] - lr * (g[k] - c_i[k] + c[k]) for k in names}

    edge.optimizers()
    for (inputs, labels), g in zip(batches, raw_grads, strict=True):
        for p in model.parameters():
            p.grad = None
        edge.training_step((inputs, labels)).backward()
        assert close(model.weight.grad, g["model/weight"], 1e-5)
        edge.post_backward()
        assert close(model.weight.grad, g["model/weight"] - c_i["model/weight"] + c["model/weight"],
                     1e-5)
        with torch.no_grad():  # a manual SGD step
            for p in model.parameters():
                p.sub_(lr * p.grad)
    assert close(model.weight, y["model/weight"], 1e-5)

    up = edge.after_train(K)
    expected_c = {k: c_i[k] - c[k] + (x[k] - y[k]) / (K * lr) for k in names}
    for k in names:
        # Option II's identity: with plain SGD, c_i+ is the mean raw gradient.
        assert close(expected_c[k], (raw_grads[0][k] + raw_grads[1][k]) / 2, 1e-5)
        assert close(edge.c_local[k], expected_c[k], 1e-5)
        assert close(up.tensors(*CONTROL)[k], expected_c[k] - c_i[k], 1e-5)
        assert close(up.tensors(*SHARED)[k], y[k], 1e-5)
        assert close(edge.extra_state()[f"c_local/{k}"], expected_c[k], 1e-5)


def test_scaffold_step_correction_is_niid_bench_form():
    """correction = "step": momentum SGD with weight decay steps on the plain gradient, then
    y -= lr (c - c_i) outside the momentum buffer, as NIID-Bench's reproduction; c_i+ keeps
    option II's formula; means weigh edges by their examples."""
    lr, K, momentum, decay = 0.1, 3, 0.9, 1e-2
    params = {"correction": "step", "weighting": "examples"}
    with pytest.raises(ValueError, match="correction = 'step'"):
        make("scaffold", lr=lr, momentum=momentum)  # the paper's form refuses momentum
    method = make("scaffold", params, lr=lr, momentum=momentum, weight_decay=decay,
                  num_classes=3)
    assert method.aggregation_weight(100) == 100.0 and method.aggregation_weight(7) == 7.0
    edge, model, x, c, c_i = scaffold_edge(method)
    names = ["model/weight", "model/bias"]
    edge.train_mode()
    edge.begin_train()
    batches = [(torch.randn(4, 2), torch.tensor([0, 1, 2, 1])) for _ in range(K)]

    # Reference: torch's momentum SGD on a plain copy, then the correction after each step.
    ref = nn.Linear(2, 3)
    with torch.no_grad():
        ref.weight.copy_(x["model/weight"])
        ref.bias.copy_(x["model/bias"])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum, weight_decay=decay)
    for inputs, labels in batches:
        ref_opt.zero_grad()
        F.cross_entropy(ref(inputs), labels).backward()
        ref_opt.step()
        with torch.no_grad():
            ref.weight.sub_(lr * (c["model/weight"] - c_i["model/weight"]))
            ref.bias.sub_(lr * (c["model/bias"] - c_i["model/bias"]))

    (opt,) = edge.optimizers()
    assert edge.optimizers() == [opt]  # asking again registers no second correction
    for inputs, labels in batches:
        opt.zero_grad()
        edge.training_step((inputs, labels)).backward()
        grad = model.weight.grad.clone()
        edge.post_backward()
        assert torch.equal(model.weight.grad, grad)  # nothing is added to the gradient
        opt.step()
    assert close(model.weight, ref.weight, 1e-6) and close(model.bias, ref.bias, 1e-6)

    up = edge.after_train(K)
    y = {"model/weight": ref.weight.detach(), "model/bias": ref.bias.detach()}
    for k in names:
        expected = c_i[k] - c[k] + (x[k] - y[k]) / (K * lr)
        assert close(up.tensors(*CONTROL)[k], expected - c_i[k], 1e-5)


# ---- FedProx --------------------------------------------------------------------------


def test_fedprox_post_backward_adds_the_proximal_gradient():
    method = make("fedprox", {"mu": 0.5})
    torch.manual_seed(0)
    model = Tiny()
    edge = method.edge({"model": model}, CPU)
    x = {k: v.detach().clone() for k, v in edge.shared_values().items()}
    edge.receive(TRAIN, upload(x), Payload())
    with torch.no_grad():
        model.fc.weight.add_(t([1.0, -2.0]))
        model.bn.weight.add_(3.0)
    edge.train_mode()
    edge.begin_train()
    # Tiny has one output, so a squared error stands in for the task loss.
    F.mse_loss(model(torch.randn(4, 2)), torch.ones(4, 1)).backward()
    g_w, g_b, g_bn = (model.fc.weight.grad.clone(), model.fc.bias.grad.clone(),
                      model.bn.weight.grad.clone())
    edge.post_backward()
    assert close(model.fc.weight.grad, g_w + 0.5 * t([1.0, -2.0]))
    assert close(model.fc.bias.grad, g_b)  # w == w_global there
    assert close(model.bn.weight.grad, g_bn + 0.5 * 3.0)
    assert close(model.bn.running_mean, edge.shared_values()["model/bn.running_mean"])


def test_fedprox_does_not_pull_private_tensors():
    method = make("fedprox", {"mu": 0.5}, private=["bn"])
    model = Tiny()
    edge = method.edge({"model": model}, CPU)
    assert "model/bn.weight" not in edge.shared_specs
    edge.receive(TRAIN, upload(edge.shared_values()), Payload())
    with torch.no_grad():
        model.bn.weight.add_(3.0)
        model.fc.weight.add_(1.0)
    F.mse_loss(model(torch.randn(4, 2)), torch.ones(4, 1)).backward()
    g_bn, g_w = model.bn.weight.grad.clone(), model.fc.weight.grad.clone()
    edge.post_backward()
    assert torch.equal(model.bn.weight.grad, g_bn)
    assert close(model.fc.weight.grad, g_w + 0.5)


# ---- Ditto ----------------------------------------------------------------------------


def test_ditto_one_step_by_hand():
    lr, lam = 0.1, 0.5
    method = make("ditto", {"lam": lam}, lr=lr, num_classes=3)
    assert method.model_names() == ("global", "personal")
    torch.manual_seed(3)
    glob, pers = nn.Linear(2, 3), nn.Linear(2, 3)  # v != w, so the pull is not zero
    edge = method.edge({"global": glob, "personal": pers}, CPU)
    assert set(edge.shared_specs) == {"global/weight", "global/bias"}
    torch.manual_seed(4)
    w = {"weight": torch.randn(3, 2), "bias": torch.randn(3)}
    edge.receive(TRAIN, upload({f"global/{k}": v for k, v in w.items()}), Payload())
    v = {"weight": pers.weight.detach().clone(), "bias": pers.bias.detach().clone()}
    assert not torch.equal(v["weight"], w["weight"])
    edge.train_mode()
    edge.begin_train()
    batch = (torch.randn(5, 2), torch.tensor([0, 2, 1, 1, 0]))

    def ce_grad(params):
        p = {k: x.clone().requires_grad_(True) for k, x in params.items()}
        loss = F.cross_entropy(F.linear(batch[0], p["weight"], p["bias"]), batch[1])
        return dict(zip(p, torch.autograd.grad(loss, list(p.values())), strict=True))

    gv, gw = ce_grad(v), ce_grad(w)
    opt = edge.optimizers()[0]
    opt.zero_grad()
    edge.training_step(batch).backward()
    edge.post_backward()
    opt.step()
    for k in ("weight", "bias"):
        assert close(getattr(pers, k), v[k] - lr * (gv[k] + lam * (v[k] - w[k])), 1e-5)
        assert close(getattr(glob, k), w[k] - lr * gw[k], 1e-5)
    assert torch.equal(edge.predict(batch[0]), pers(batch[0]))
    up = edge.after_train(1)
    assert set(up.tensors(*SHARED)) == {"global/weight", "global/bias"}


def test_ditto_builds_identical_models_and_keeps_personal_private():
    method = make("ditto")
    models = method.build_models()
    for (ka, a), (kb, b) in zip(models["global"].state_dict().items(),
                                models["personal"].state_dict().items(), strict=True):
        assert ka == kb and torch.equal(a, b)
    assert models["global"] is not models["personal"]
    schema = method.uplink_schema(TRAIN, models)
    assert all(name.startswith("global/") for name in schema[0].tensors)


# ---- FedMedian ------------------------------------------------------------------------


def _median_round(agg, uploads):
    agg.begin_round(agg.round + 1, [f"e{i}" for i in range(len(uploads))], len(uploads))
    base = {k: v.clone() for k, v in agg.state[SHARED].items()}
    for i, (w_row, weight) in enumerate(uploads):
        values = {**base, "model/fc.weight": t(w_row)}
        payload = upload(values)
        agg.accept(f"e{i}", payload, weight)
        values["model/fc.weight"].fill_(1e9)  # the aggregator must have kept a copy
    return agg.finish()


def test_fedmedian_odd_and_even():
    method = make("fedmedian")
    agg = method.server({"model": Tiny()})
    assert agg.kind is AggregatorKind.COLLECT
    # Odd: columns {1, 5, 3} -> 3 and {10, -1, 0} -> 0; weights are ignored.
    figures = _median_round(agg, [([1.0, 10.0], 1.0), ([5.0, -1.0], 100.0), ([3.0, 0.0], 1.0)])
    assert figures == {"aggregated": 3}
    assert close(agg.state[SHARED]["model/fc.weight"], [[3.0, 0.0]])
    # Even: {1, 5, 3, 10} -> (3 + 5) / 2 = 4; {10, -1, 0, 2} -> (0 + 2) / 2 = 1.
    _median_round(agg, [([1.0, 10.0], 1.0), ([5.0, -1.0], 1.0), ([3.0, 0.0], 1.0),
                        ([10.0, 2.0], 1.0)])
    assert close(agg.state[SHARED]["model/fc.weight"], [[4.0, 1.0]])
    # One upload: itself.
    _median_round(agg, [([-7.0, 0.25], 1.0)])
    assert close(agg.state[SHARED]["model/fc.weight"], [[-7.0, 0.25]])
    before = agg.state[SHARED]["model/fc.weight"].clone()
    agg.begin_round(9, [], 0)
    assert agg.finish() == {"aggregated": 0}
    assert torch.equal(agg.state[SHARED]["model/fc.weight"], before)


# ---- Local-only, FedBN, FedPer schemas ------------------------------------------------


def test_local_only_uploads_nothing():
    method = make("local")
    models = method.build_models()
    assert method.shared_specs(models) == {}
    assert method.uplink_schema(TRAIN, models) == []
    assert method.uplink_schema(EVALUATE, models) == []
    assert method.initial_state(models) == {}
    edge = method.edge(models, CPU)
    payload = edge.after_train(10)
    assert payload.sections == []
    assert encode(payload).total_bytes == 0
    agg = method.server(models)
    assert agg.broadcast(TRAIN).sections == []


def test_fedbn_and_fedper_schemas_exclude_private_tensors():
    specs = {}
    for name in ("fedavg", "fedbn", "fedper"):
        method = make(name)
        models = method.build_models()
        schema = method.uplink_schema(TRAIN, models)
        assert len(schema) == 1 and schema[0].kind is Kind.SHARED_TENSORS and schema[0].name == ""
        assert method.uplink_schema(EVALUATE, models) == []
        specs[name] = set(schema[0].tensors)
    bn = {f"model/{m}.{k}" for m in ("features.1", "features.5", "classifier.1", "classifier.4")
          for k in ("weight", "bias", "running_mean", "running_var")}
    head = {"model/classifier.6.weight", "model/classifier.6.bias"}
    assert len(specs["fedavg"]) == 26
    assert bn | head <= specs["fedavg"]
    assert specs["fedbn"] == specs["fedavg"] - bn
    assert specs["fedper"] == specs["fedavg"] - head


# ---- fingerprint ----------------------------------------------------------------------


def test_fingerprint_tracks_model_and_split():
    def fp(name="fedavg", **train):
        method = make(name, **train)
        return method.fingerprint(method.build_models())

    base = fp()
    assert base == fp()                             # deterministic
    assert base == fp(seed=5)                       # values do not matter, layout does
    assert base != fp(num_classes=5)                # a different head
    assert base != fp(in_channels=3)                # a different stem
    assert base != fp(image_size=32)                # a different FC input
    assert base != fp(private=["bn"])               # a different split
    assert fp(private=["bn"]) != fp(private=["head"])
    assert base != fp("fedbn")                      # a different method
    method = make("fedavg")
    assert method.fingerprint({"model": Tiny()}) != base  # the models themselves count


# ---- registry -------------------------------------------------------------------------


def test_registry_lists_every_method():
    assert available_methods() == ALL_METHODS
    for name in ALL_METHODS:
        cls = load_method(name)
        assert issubclass(cls, Method) and cls.name == name
    assert load_method("fedmedian").aggregator_kind is AggregatorKind.COLLECT
    assert load_method("fedadam").aggregator_kind is AggregatorKind.SERVER_OPTIMIZER
    assert load_method("fedavg").aggregator_kind is AggregatorKind.STREAMING_SUM


PLUGIN = '''
from dataclasses import dataclass

from fedattn_shared.methods import Method


@dataclass
class PluginParams:
    alpha: float = 2.0


class Plugin(Method):
    name = "plugin"
    Params = PluginParams
    private_rules = ("head",)


NOT_A_CLASS = 3
'''


def test_load_method_by_module_path(tmp_path, monkeypatch):
    module = "fedattn_test_plugin_4d1c"
    (tmp_path / f"{module}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    cls = load_method(f"{module}:Plugin")
    assert cls.__name__ == "Plugin" and issubclass(cls, Method)
    method = cls(MethodContext(TrainConfig(), cls.Params()))
    assert method.describe_params() == {"alpha": 2.0}
    specs = method.shared_specs(method.build_models())
    assert "model/classifier.6.weight" not in specs and "model/classifier.3.weight" in specs
    with pytest.raises(ValueError, match="is not a fedattn Method"):
        load_method(f"{module}:NOT_A_CLASS")
    with pytest.raises(ValueError, match="cannot load method"):
        load_method(f"{module}:Missing")
    monkeypatch.delitem(sys.modules, module, raising=False)


@pytest.mark.parametrize("name, message", [
    ("fedattn_no_such_module_xyz:Thing", "cannot load method"),
    ("fedattn_shared.methods.fedavg:FedAvgg", "cannot load method"),
    ("fedattn_shared.config:TrainConfig", "is not a fedattn Method"),
    ("fedattn_shared.methods.base:TRAIN", "is not a fedattn Method"),
    ("fedavgg", r"unknown method 'fedavgg' \(known: .*ditto, fedadam"),
    ("", "unknown method"),
])
def test_load_method_garbage(name, message):
    with pytest.raises(ValueError, match=message):
        load_method(name)


def test_declarations_are_one_frozen_spec_checked_when_the_class_is_built():
    """A method's constants become ``cls.spec`` (validated at class creation, inherited and
    overridden per subclass); the kind comes from the aggregator class, never declared."""
    from fedattn_shared.methods import MethodSpec
    from fedattn_shared.methods.aggregators import CollectThenLearn

    fedmedian = load_method("fedmedian")
    assert isinstance(fedmedian.spec, MethodSpec)
    assert fedmedian.aggregator_kind is fedmedian.spec.aggregator.kind is AggregatorKind.COLLECT
    with pytest.raises(TypeError, match="aggregator kind comes from the aggregator class"):
        type("Declared", (Method,), {"name": "x", "aggregator_kind": AggregatorKind.COLLECT})
    with pytest.raises(TypeError, match="phases"):
        type("NoTrain", (Method,), {"name": "x", "phases": ("evaluate",)})
    with pytest.raises(ValueError, match="unknown"):
        type("BadRule", (Method,), {"name": "x", "private_rules": ("nonsense",)})
    child = type("Child", (fedmedian,), {"name": "child", "aggregator": CollectThenLearn})
    assert child.spec.Params is fedmedian.Params and child.name == "child"
    assert fedmedian.name == "fedmedian"
    # An edge half written against the old one-off hooks is refused, naming the new place.
    from fedattn_shared.methods import EdgeAlgorithm
    with pytest.raises(TypeError, match=r"steps_per_batch: this hook is now schedule"):
        type("OldEdge", (EdgeAlgorithm,), {"steps_per_batch": 5})
    with pytest.raises(TypeError, match="now extra_state"):
        type("OldState", (EdgeAlgorithm,), {"state_tensors": lambda self: {}})

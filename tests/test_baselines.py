"""pFedMe, FedRep and FedAvg-FT: their updates against hand-computed steps through the one
training loop, the pFedMe server step, and FedAvg-FT's fine-tuning over real gRPC."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_method_matrix import ALL_FLOAT, HEAD, SHARED, run_federation
from torch import nn

from fedattn_shared.config import TrainConfig
from fedattn_shared.data.npz import Split
from fedattn_shared.methods import Method, MethodContext, load_method
from fedattn_shared.schema import EVALUATE, TRAIN, Kind, Payload, Section
from fl_edge.trainer import train_local

CPU = torch.device("cpu")


def make(name: str, params: dict | None = None, **train) -> Method:
    cls = load_method(name)
    return cls(MethodContext(TrainConfig(**train), cls.Params(**(params or {}))))


def downlink(tensors: dict[str, torch.Tensor]) -> Payload:
    return Payload([Section(Kind.SHARED_TENSORS, "", tensors)])


def ce_grads(forward, params: dict[str, torch.Tensor], x, y) -> dict[str, torch.Tensor]:
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss = F.cross_entropy(forward(p, x), y)
    return dict(zip(p, torch.autograd.grad(loss, list(p.values())), strict=True))


def linear(p, x):
    return F.linear(x, p["weight"], p["bias"])


BATCH = (torch.randn(4, 2, generator=torch.Generator().manual_seed(5)),
         torch.tensor([0, 2, 1, 1]))


# ---- pFedMe ---------------------------------------------------------------------------


def test_pfedme_inner_solve_and_outer_update_by_hand():
    lr, plr, lam, K = 0.05, 0.1, 2.0, 3
    method = make("pfedme", {"lam": lam, "inner_steps": K, "personal_lr": plr},
                  lr=lr, num_classes=3)
    torch.manual_seed(0)
    local, personal = nn.Linear(2, 3), nn.Linear(2, 3)
    edge = method.edge({"global": local, "personal": personal}, CPU)
    assert set(edge.shared_specs) == {"global/weight", "global/bias"}
    torch.manual_seed(1)
    w0 = {"weight": torch.randn(3, 2), "bias": torch.randn(3)}
    edge.receive(TRAIN, downlink({f"global/{k}": v for k, v in w0.items()}), Payload())

    # Reference: theta^0 = w; K steps theta <- theta - plr (g(theta) + lam (theta - w));
    # then w <- w - lr lam (w - theta^K).
    theta = {k: v.clone() for k, v in w0.items()}
    for _ in range(K):
        g = ce_grads(linear, theta, *BATCH)
        theta = {k: theta[k] - plr * (g[k] + lam * (theta[k] - w0[k])) for k in theta}
    w1 = {k: w0[k] - lr * lam * (w0[k] - theta[k]) for k in w0}

    result = train_local(edge, Split(*BATCH), epochs=1, batch_size=4, seed=0, device=CPU,
                         progress=False, lr=lr)
    assert result.steps == K and result.examples == 4
    for k in ("weight", "bias"):
        assert torch.allclose(getattr(personal, k), theta[k], atol=1e-6)
        assert torch.allclose(getattr(local, k), w1[k], atol=1e-6)
    assert torch.equal(edge.predict(BATCH[0]), personal(BATCH[0]))
    up = edge.after_train(result.steps)
    assert [(s.kind, s.name) for s in up.sections] == [SHARED]
    assert set(up.tensors(*SHARED)) == {"global/weight", "global/bias"}

    # The next round starts theta from the new global model again.
    w2 = {"global/weight": torch.zeros(3, 2), "global/bias": torch.ones(3)}
    edge.receive(TRAIN, downlink(w2), Payload())
    edge.begin_train()
    assert torch.equal(personal.bias, torch.ones(3))


def test_pfedme_local_model_takes_the_personal_bn_statistics():
    method = make("pfedme", {"inner_steps": 2}, model="lenet-bn")
    models = method.build_models()
    edge = method.edge(models, CPU)
    edge.receive(TRAIN, downlink(edge.shared_values()), Payload())
    x = torch.randn(8, 1, 28, 28)
    train_local(edge, Split(x, torch.arange(8) % 10), 1, 8, 0, CPU, progress=False)
    bn_w = models["global"].features[1]
    bn_p = models["personal"].features[1]
    assert not torch.equal(bn_p.running_mean, torch.zeros(6))
    assert torch.equal(bn_w.running_mean, bn_p.running_mean)
    assert torch.equal(bn_w.running_var, bn_p.running_var)


def test_pfedme_server_beta_step_by_hand():
    beta = 2.0
    method = make("pfedme", {"beta": beta}, num_classes=3)
    models = {"global": nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)),
              "personal": nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))}
    agg = method.server(models)
    x = {k: v.clone() for k, v in agg.state[SHARED].items()}
    assert "global/1.running_mean" in x and not any(k.startswith("personal/") for k in x)
    a = {k: v + 1.0 for k, v in x.items()}
    b = {k: v - 3.0 for k, v in x.items()}
    agg.begin_round(1, ["a", "b"], 2)
    agg.accept("a", downlink(a), 3.0)
    agg.accept("b", downlink(b), 1.0)
    agg.finish()
    for k, value in agg.state[SHARED].items():
        mean = (3 * a[k] + b[k]) / 4  # = x
        if k.endswith(("running_mean", "running_var")):
            assert torch.allclose(value, mean)  # buffers are averaged, not stepped
        else:
            assert torch.allclose(value, (1 - beta) * x[k] + beta * mean)


def test_pfedme_refuses_gradient_accumulation_and_bad_params():
    method = make("pfedme", num_classes=3)
    edge = method.edge({"global": nn.Linear(2, 3), "personal": nn.Linear(2, 3)}, CPU)
    with pytest.raises(ValueError, match="gradient accumulation"):
        train_local(edge, Split(*BATCH), 1, 4, 0, CPU, progress=False, grad_accum=2)
    for params, field in [({"lam": 0.0}, "pfedme.lam"), ({"inner_steps": 0}, "inner_steps"),
                          ({"personal_lr": -1.0}, "personal_lr"), ({"beta": 0.0}, "beta")]:
        with pytest.raises(ValueError, match=field):
            make("pfedme", params)


# ---- FedRep ---------------------------------------------------------------------------


class BodyHead(nn.Module):
    """body Linear(2, 4) -> ReLU -> classifier Linear(4, 3); ``classifier`` is se-cnn's head
    name, so the split rule ``head`` finds it under ``model = "se-cnn"``."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 4)
        self.classifier = nn.Linear(4, 3)

    def forward(self, x):
        return self.classifier(torch.relu(self.body(x)))


def body_head(p, x):
    return F.linear(torch.relu(F.linear(x, p["body.weight"], p["body.bias"])),
                    p["classifier.weight"], p["classifier.bias"])


def test_fedrep_trains_the_head_first_then_the_body_by_hand():
    lr, wd = 0.1, 0.05
    method = make("fedrep", {"head_epochs": 1}, model="se-cnn", lr=lr, momentum=0.9,
                  weight_decay=wd, num_classes=3)
    torch.manual_seed(2)
    model = BodyHead()
    edge = method.edge({"model": model}, CPU)
    assert set(edge.shared_specs) == {"model/body.weight", "model/body.bias"}
    p0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    edge.receive(TRAIN, downlink({f"model/{k}": p0[k] for k in ("body.weight", "body.bias")}),
                 Payload())

    # Epoch 1 (head; body frozen): one SGD step on the head. Epoch 2 (body; head frozen):
    # one SGD step on the body at the new head. Each tensor steps once, so momentum has no
    # history yet; weight decay would move a frozen tensor if it got a zero gradient.
    g = ce_grads(body_head, p0, *BATCH)
    p1 = dict(p0)
    for k in ("classifier.weight", "classifier.bias"):
        p1[k] = p0[k] - lr * (g[k] + wd * p0[k])
    g = ce_grads(body_head, p1, *BATCH)
    p2 = dict(p1)
    for k in ("body.weight", "body.bias"):
        p2[k] = p1[k] - lr * (g[k] + wd * p1[k])

    result = train_local(edge, Split(*BATCH), epochs=1, batch_size=4, seed=0, device=CPU,
                         progress=False, lr=lr)
    assert result.steps == 2
    for k, v in model.state_dict().items():
        assert torch.allclose(v, p2[k], atol=1e-6), k
    assert all(p.requires_grad for p in model.parameters())
    up = edge.after_train(result.steps)
    assert set(up.tensors(*SHARED)) == {"model/body.weight", "model/body.bias"}


def test_fedrep_epochs_and_bad_params():
    method = make("fedrep", {"head_epochs": 10}, model="se-cnn", num_classes=3)
    edge = method.edge({"model": BodyHead()}, CPU)
    assert edge.schedule.epochs(1) == 11 and edge.schedule.epochs(0) == 0
    with pytest.raises(ValueError, match="fedrep.head_epochs"):
        make("fedrep", {"head_epochs": -1})


# ---- FedAvg-FT ------------------------------------------------------------------------


def test_fedavgft_fine_tunes_a_private_copy_only():
    lr = 0.1
    method = make("fedavgft", {"finetune_epochs": 2}, lr=lr, num_classes=3)
    models = {"model": nn.Linear(2, 3), "finetuned": nn.Linear(2, 3)}
    edge = method.edge(models, CPU)
    assert set(edge.shared_specs) == {"model/weight", "model/bias"}
    torch.manual_seed(3)
    w = {"model/weight": torch.randn(3, 2), "model/bias": torch.randn(3)}
    edge.receive(EVALUATE, downlink(w), Payload())
    tuner, epochs = edge.before_evaluate()
    assert epochs == 2 and tuner is not edge

    theta = {"weight": w["model/weight"].clone(), "bias": w["model/bias"].clone()}
    for _ in range(epochs):
        g = ce_grads(linear, theta, *BATCH)
        theta = {k: theta[k] - lr * g[k] for k in theta}
    train_local(tuner, Split(*BATCH), epochs, 4, 0, CPU, progress=False, lr=lr)
    assert torch.allclose(models["finetuned"].weight, theta["weight"], atol=1e-6)
    assert torch.equal(models["model"].weight, w["model/weight"])  # the shared model: untouched
    assert torch.equal(edge.shared_values()["model/bias"], w["model/bias"])
    assert torch.equal(edge.predict(BATCH[0]), models["finetuned"](BATCH[0]))
    assert make("fedavgft", {"finetune_epochs": 0}).edge(models, CPU).before_evaluate()[1] == 0
    with pytest.raises(ValueError, match="fedavgft.finetune_epochs"):
        make("fedavgft", {"finetune_epochs": -1})


@pytest.mark.slow
def test_fedavgft_uploads_exactly_what_fedavg_uploads(tmp_path):
    """Same data and seeds: FedAvg-FT's global model equals FedAvg's after two rounds (the
    fine-tuning never reaches the wire), while its evaluation scores the fine-tuned copy."""
    received_ft, engine_ft = run_federation(tmp_path / "ft", "fedavgft")
    _, engine_avg = run_federation(tmp_path / "avg", "fedavg")
    for _, sections in received_ft:
        assert set(sections[SHARED]) == {f"model/{k}" for k in ALL_FLOAT}
    ft, avg = engine_ft.aggregator.state[SHARED], engine_avg.aggregator.state[SHARED]
    assert ft.keys() == avg.keys()
    for k in ft:
        assert torch.allclose(ft[k], avg[k], atol=1e-5), k
    last = engine_ft.history["rounds"][-1]
    assert set(last["evaluate"]["edge_metrics"]) == {"e0", "e1"}
    assert all(m["finetune_loss"] > 0 for m in last["evaluate"]["edge_metrics"].values())
    loss_ft = last["evaluation"]["per_edge"]["e0"]["test"]["loss"]
    loss_avg = engine_avg.history["rounds"][-1]["evaluation"]["per_edge"]["e0"]["test"]["loss"]
    assert loss_ft != pytest.approx(loss_avg, rel=1e-4)


@pytest.mark.slow
def test_pfedme_and_fedrep_over_grpc_keep_private_parts_home(tmp_path):
    received, _ = run_federation(tmp_path / "pfedme", "pfedme", params={"inner_steps": 2})
    assert len(received) == 4
    for _, sections in received:
        assert set(sections[SHARED]) == {f"global/{k}" for k in ALL_FLOAT}
    received, _ = run_federation(tmp_path / "fedrep", "fedrep", params={"head_epochs": 1})
    for _, sections in received:
        assert set(sections[SHARED]) == {f"model/{k}" for k in ALL_FLOAT - HEAD}

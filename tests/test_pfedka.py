"""pFedKA: the reconstructed formulas against hand-computed cases (METHODS.md 1.2-1.4,
1.8), gradients on the benchmark backbone, the GRU gate (FedAvg at first, trained by the
surrogate, checkpointed), the edge's private state, and the two-phase round over real
gRPC with a spy on what the server received."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_method_matrix import run_federation

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.data.npz import Split
from fedattn_shared.methods import MethodContext
from fedattn_shared.methods.pfedka import (
    UPLOAD,
    PFedKA,
    PFedKAParams,
    gate_departure,
    kd_loss,
    kd_weight,
    surrogate_loss,
    temperature,
)
from fedattn_shared.schema import EVALUATE, TRAIN, Kind, Payload, Section
from fl_edge.store import PrivateStore
from fl_edge.trainer import train_local

CPU = torch.device("cpu")
SCALARS = (Kind.SCALAR_SUMMARY, "")
SHARED = (Kind.SHARED_TENSORS, "")
MODEL = "resnet10-cifar-compact"


def pfedka(model: str = MODEL, channels: int = 1, size: int = 28, **params):
    train = TrainConfig(model=model, in_channels=channels, image_size=size, lr=0.05)
    method = PFedKA(MethodContext(train, PFedKAParams(**params)))
    return method, method.build_models()


def scalars(**values: float) -> Payload:
    return Payload([Section(Kind.SCALAR_SUMMARY, "", {
        k: torch.tensor(v, dtype=torch.float32) for k, v in values.items()})])


def global_payload(method, models) -> Payload:
    state = method.initial_state(models)
    return Payload([Section(kind, name, tensors) for (kind, name), tensors in state.items()])


# ---- formulas ------------------------------------------------------------------------
def test_lambda_and_tau_match_methods_md_hand_computed_case():
    # CE^prev = 1.0, KD^prev = 0.5, p_k = 0.02, K = 100, KL gap 0.3 (METHODS.md 1.4)
    assert kd_weight(1.0, 0.5, 0.02, 100, "p_k_rel") == pytest.approx(0.630930, abs=1e-6)
    assert kd_weight(1.0, 0.5, 0.02, 100, "p_k") == pytest.approx(0.012619, abs=1e-6)
    assert kd_weight(1.0, 0.5, 0.02, 100, "p_k_rel", "kd_share") == pytest.approx(
        1 - 0.630930, abs=1e-6)
    assert temperature(0.3) == pytest.approx(1.262364, abs=1e-6)
    # No history: lambda = U_k / 2, tau = tau_0; a large gap is clipped to tau_max.
    assert kd_weight(None, None, 0.02, 100, "p_k_rel") == 0.5
    assert kd_weight(None, None, 0.02, 100, "p_k") == 0.01
    assert kd_weight(1.0, 0.5, 0.5, 10, "p_k_rel") == pytest.approx(0.630930, abs=1e-6)  # U = 1
    assert temperature(None) == 1.0 and temperature(50.0) == 2.0
    assert temperature(0.3, rule="fixed", tau_0=1.5) == 1.5



@pytest.mark.parametrize("bound, first, later", [("p_k_rel", 0.5, 0.630930),
                                                  ("p_k", 0.005, 0.0063093)])
def test_the_lambda_bound_reading_decides_whether_kd_is_on_at_100_edges(bound, first, later):
    """100 equal edges (p_k = 0.01): the literal bound caps lambda at 0.01, K p_k at 1."""
    method, models = pfedka(lambda_bound=bound)
    edge = method.edge(models, CPU)
    edge.population = (40.0, 100.0)  # what the server sends: mean n_j, K
    edge.num_examples = 40
    edge.begin_train()
    assert edge.lam == pytest.approx(first, rel=1e-6)  # no history: U_k / 2
    edge.history = (1.0, 0.5, 0.3)
    edge.begin_train()
    assert edge.lam == pytest.approx(later, rel=1e-4)  # U_k * b / (a + b)

def test_kd_loss_is_tau_squared_times_batchmean_kl():
    z_s = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    z_t = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])
    tau = 2.0
    expected = 0.0
    for s, t in zip(z_s.tolist(), z_t.tolist(), strict=True):
        q = [math.exp(v / tau) / sum(math.exp(u / tau) for u in t) for v in t]
        p = [math.exp(v / tau) / sum(math.exp(u / tau) for u in s) for v in s]
        expected += sum(qc * math.log(qc / pc) for qc, pc in zip(q, p, strict=True))
    expected = tau * tau * expected / 2
    assert float(kd_loss(z_s, z_t, tau)) == pytest.approx(expected, rel=1e-6)
    assert float(kd_loss(z_t, z_t, tau)) == pytest.approx(0.0, abs=1e-7)


def test_surrogate_hand_computed():
    alpha, p = torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.75])
    losses = torch.tensor([1.0, 3.0])  # standardised: -1, +1 -> sum alpha l~ = 0
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert float(surrogate_loss(alpha, losses, p, 1.0)) == pytest.approx(kl, rel=1e-6)
    assert float(surrogate_loss(torch.tensor([0.2, 0.8]), losses, torch.tensor([0.2, 0.8]),
                                1.0)) == pytest.approx(0.6, rel=1e-6)


# ---- models and the edge ----------------------------------------------------------------
def test_backbones_expose_enough_tokens_and_bad_setups_are_refused_by_name():
    assert (pfedka()[0].num_tokens, pfedka()[0].width) == (16, 128)
    big, _ = (PFedKA(MethodContext(TrainConfig(model="resnet18-cifar", in_channels=3,
                                               image_size=32), PFedKAParams())), None)
    assert (big.num_tokens, big.width) == (16, 512)
    with pytest.raises(ValueError, match="no encoder tokens found in"):
        pfedka(model="lenet-bn")
    with pytest.raises(ValueError, match="leaves 1 token"):
        pfedka(size=8)
    for key, value in [("tau_rule", "anneal"), ("lambda_bound", "n"), ("student_init", "x"),
                       ("gru_train", "adam"), ("lambda_direction", "up")]:
        with pytest.raises(ValueError, match=f"pfedka.{key}"):
            pfedka(**{key: value})
    with pytest.raises(ValueError, match="tau_min/tau_max"):
        pfedka(tau_min=2.0, tau_max=1.0)
    with pytest.raises(ValueError, match="gru_hidden"):
        pfedka(gru_hidden=0)


@pytest.mark.parametrize("name", [MODEL, "resnet18-cifar"])
def test_the_models_forward_is_its_head_on_the_mean_token(name):
    from fedattn_shared.models import build_model, model_spec

    model = build_model(name, 10, 3, 32).eval()
    x = torch.randn(2, 3, 32, 32)
    tokens = model_spec(name).tokens(model, x)
    assert tokens.shape[1:] == ((16, 128) if name == MODEL else (16, 512))
    assert torch.allclose(model.fc(tokens.mean(1)), model(x), atol=1e-5)


@pytest.mark.parametrize("residual", [True, False])
def test_gradients_reach_student_encoder_and_projections_never_the_teacher(residual):
    """On the benchmark backbone at the benchmark input size (32x32 RGB)."""
    method, models = pfedka(channels=3, size=32, ca_residual=residual)
    edge = method.edge(models, CPU)
    edge.num_examples = 8
    edge.train_mode()
    edge.begin_train()
    edge.schedule.begin_epoch(0)
    torch.manual_seed(0)
    loss = edge.training_step((torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))))
    loss.backward()
    student = models["model"]
    for name in ("backbone.conv1.weight", "backbone.layer1.0.conv1.weight",
                 "backbone.layer4.0.conv2.weight", "ca.w_q.weight", "ca.w_k.weight",
                 "ca.w_v.weight", "backbone.fc.weight"):
        grad = student.get_parameter(name).grad
        assert grad is not None and float(grad.abs().sum()) > 0, name
    assert all(p.grad is None and not p.requires_grad for p in models["teacher"].parameters())


def test_training_loss_is_ce_plus_lambda_tau2_kd_and_ce_is_the_last_epochs():
    method, models = pfedka()
    edge = method.edge(models, CPU)
    edge.receive(TRAIN, global_payload(method, models), scalars(n_mean=40.0, edges=4.0))
    with torch.no_grad():  # a student that differs from its teacher
        for p in models["model"].backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    edge.history = (1.0, 0.5, 0.3)  # CE, KD, gap of the previous participation
    edge.num_examples = 20          # p_k = 20 / (4 * 40): U = min(1, 4 p_k) = 0.5
    edge.train_mode()
    edge.begin_train()
    assert edge.lam == pytest.approx(0.5 * 0.630930, abs=1e-6)
    assert edge.tau == pytest.approx(1.262364, abs=1e-6)
    torch.manual_seed(1)
    batches = [(torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))) for _ in range(3)]

    def by_hand(x, y):
        tokens = method_tokens(models["teacher"], x)
        z_t = models["teacher"].fc(tokens.mean(1))
        z_s = models["model"](x, tokens)
        return F.cross_entropy(z_s, y), kd_loss(z_s, z_t, edge.tau)

    ces = []
    for epoch, epoch_batches in ((0, batches[:1]), (1, batches[1:])):
        edge.schedule.begin_epoch(epoch)
        for batch in epoch_batches:
            ce, kd = by_hand(*batch)
            ces.append(float(ce.detach()))
            expected = float((ce + edge.lam * kd).detach())
            assert float(edge.training_step(batch).detach()) == pytest.approx(expected, rel=1e-5)
    upload = edge.after_train(3)
    assert set(upload.tensors(*SCALARS)) == {"n", "ce"}
    assert float(upload.tensors(*SCALARS)["ce"]) == pytest.approx((ces[1] + ces[2]) / 2, rel=1e-5)
    assert float(upload.tensors(*SCALARS)["n"]) == 20.0
    method2, models2 = pfedka(kd=False)
    edge2 = method2.edge(models2, CPU)
    edge2.num_examples = 20
    edge2.begin_train()
    assert edge2.lam == 0.0  # w/o KD: the loss is the cross-entropy alone


def method_tokens(model, x):
    from fedattn_shared.models.resnet import resnet_tokens

    return resnet_tokens(model, x)


@pytest.mark.parametrize("init", ["round", "persistent"])
def test_student_init_and_the_evaluated_model(init):
    method, models = pfedka(student_init=init)
    edge = method.edge(models, CPU)
    first = global_payload(method, models)
    data = Split(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    edge.receive(TRAIN, first, scalars(n_mean=0.0, edges=2.0))
    train_local(edge, data, 1, 8, seed=0, device=CPU, progress=False)
    edge.after_train(2)
    trained = {k: v.clone() for k, v in models["model"].state_dict().items()}
    x = torch.randn(4, 1, 28, 28)
    edge.eval_mode()
    before = edge.predict(x)
    # A new global: evaluation keeps the personalized model (last student + its teacher).
    moved = Payload([Section(Kind.SHARED_TENSORS, "", {
        k: v + 0.1 if v.is_floating_point() else v for k, v in first.tensors(*SHARED).items()})])
    edge.receive(EVALUATE, moved, Payload())
    assert torch.equal(edge.predict(x), before)
    edge.receive(TRAIN, moved, scalars(n_mean=16.0, edges=2.0))
    student = models["model"].state_dict()
    teacher = models["teacher"].state_dict()
    for name, value in moved.tensors(*SHARED).items():
        key = name.split("/", 1)[1]
        if key.startswith("backbone."):
            assert torch.equal(teacher[key[len("backbone."):]], value)
        expected = value if init == "round" else trained[key]
        assert torch.equal(student[key], expected), key


def test_restarted_edge_reloads_student_teacher_and_history(tmp_path):
    method, models = pfedka()
    edge = method.edge(models, CPU)
    edge.receive(TRAIN, global_payload(method, models), scalars(n_mean=0.0, edges=2.0))
    data = Split(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    train_local(edge, data, 1, 8, seed=0, device=CPU, progress=False)
    edge.after_train(2)
    fingerprint = method.fingerprint(models)
    PrivateStore(tmp_path).save(edge, fingerprint, 1, TRAIN)
    x = torch.randn(4, 1, 28, 28)
    edge.eval_mode()
    expected = edge.predict(x)

    method2, models2 = pfedka()
    fresh = method2.edge(models2, CPU)
    PrivateStore(tmp_path).load(fresh, fingerprint)
    fresh.receive(EVALUATE, Payload(), Payload())  # trained: keeps what it reloaded
    fresh.eval_mode()
    assert torch.equal(fresh.predict(x), expected)
    assert fresh.history == pytest.approx(edge.history) and fresh.trained


# ---- the GRU gate ----------------------------------------------------------------------
def gate_round(aggregator, round_number: int, reports: dict[str, tuple[float, float]]):
    aggregator.begin_round(round_number, sorted(reports), 4)
    for edge, (n, ce) in reports.items():
        aggregator.accept_phase(TRAIN, edge, scalars(n=n, ce=ce), n)
    return aggregator.close_phase(TRAIN)["gate"]


def test_gate_starts_as_fedavg_and_the_surrogate_moves_weight_to_low_loss_edges():
    method, models = pfedka(gru_lr=0.05)
    aggregator = method.server(models)
    reports = {"a": (10.0, 2.0), "b": (30.0, 1.0), "c": (60.0, 0.5)}
    first = gate_round(aggregator, 1, reports)
    for edge, n in (("a", 10), ("b", 30), ("c", 60)):
        assert first["alpha"][edge] == pytest.approx(n / 100, abs=1e-6)
    for r in range(2, 30):
        figures = gate_round(aggregator, r, reports)
        alpha = list(figures["alpha"].values())
        assert all(a >= 0 for a in alpha) and sum(alpha) == pytest.approx(1.0, abs=1e-6)
    # the surrogate's optimum is alpha ~ p exp(-l~): the worst edge loses weight, the best gains
    assert figures["alpha"]["a"] < 0.1 - 0.01 and figures["alpha"]["c"] > 0.6 + 0.01

    for params in ({"gru_train": "frozen"}, {"gating": False}):
        method, models = pfedka(gru_lr=0.05, **params)
        aggregator = method.server(models)
        for r in range(1, 5):
            figures = gate_round(aggregator, r, reports)
        assert figures["alpha"] == pytest.approx(figures["fedavg_weight"], abs=1e-6)


def test_gate_refuses_unusable_scalars():
    method, models = pfedka()
    aggregator = method.server(models)
    aggregator.begin_round(1, ["a"], 1)
    with pytest.raises(ValueError, match="whole number"):
        aggregator.accept_phase(TRAIN, "a", scalars(n=2.5, ce=1.0), 2)
    with pytest.raises(ValueError, match="ce"):
        aggregator.accept_phase(TRAIN, "a", scalars(n=3.0, ce=-1.0), 3)
    with pytest.raises(ValueError, match="no scalars"):
        aggregator.accept_phase(UPLOAD, "a", Payload(), 3)


def test_gate_state_survives_a_checkpoint_and_unsampled_edges_keep_their_hidden_state():
    method, models = pfedka(gru_lr=0.05)
    aggregator = method.server(models)
    gate_round(aggregator, 1, {"a": (10.0, 2.0), "b": (30.0, 1.0)})
    h_a = aggregator.hidden["a"].clone()
    cell = {k: v.clone() for k, v in aggregator.gate.cell.state_dict().items()}
    gate_round(aggregator, 2, {"b": (30.0, 1.2), "c": (20.0, 0.7)})
    assert torch.equal(aggregator.hidden["a"], h_a)  # not sampled: unchanged
    # c was new: its hidden state came from zeros (with the GRU of round 2, before its step)
    gru = torch.nn.GRUCell(2, 32)
    gru.load_state_dict(cell)
    expected = gru(torch.tensor([[0.4, 0.7]]), torch.zeros(1, 32))[0]
    assert torch.allclose(aggregator.hidden["c"], expected, atol=1e-6)

    tensors = {k: v.clone() for k, v in aggregator.state_tensors().items()}
    meta = json.loads(json.dumps(aggregator.state_meta()))
    method2, models2 = pfedka(gru_lr=0.05)
    restored = method2.server(models2)
    restored.load_state(tensors, meta)
    assert restored.hidden.keys() == {"a", "b", "c"}
    assert all(torch.equal(restored.hidden[e], aggregator.hidden[e]) for e in "abc")
    assert restored.sizes == {"a": 10, "b": 30, "c": 20}
    reports = {"a": (10.0, 1.5), "c": (20.0, 0.9)}
    assert gate_round(restored, 3, reports) == gate_round(aggregator, 3, reports)


# ---- over real gRPC --------------------------------------------------------------------
def spy_phases(engine) -> list[tuple[str, str, dict]]:
    seen: list[tuple[str, str, dict]] = []
    accept_phase = engine.aggregator.accept_phase

    def spy(phase, edge_id, payload, weight):
        seen.append((phase, edge_id, {(s.kind, s.name): {k: v.clone() for k, v in s.tensors.items()}
                                      for s in payload.sections}))
        return accept_phase(phase, edge_id, payload, weight)

    engine.aggregator.accept_phase = spy
    return seen


def test_ca_shared_decides_whether_the_projections_travel():
    for ca_shared, travels in ((True, True), (False, False)):
        method, models = pfedka(ca_shared=ca_shared)
        names = set(method.shared_specs(models))
        projections = {f"model/ca.{w}.weight" for w in ("w_q", "w_k", "w_v")}
        assert (projections <= names) is travels
        assert bool(projections & names) is travels
        assert not any(name.startswith("teacher/") for name in names)
    method, models = pfedka(cross_attention=False)
    assert models["model"].ca is None


@pytest.mark.slow
def test_two_phase_round_over_grpc_and_the_gate_survives_a_server_restart(tmp_path, monkeypatch):
    import fl_server.cli as cli

    seen: list = []
    original = cli.ServerApp.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(spy_phases(self.engine))

    monkeypatch.setattr(cli.ServerApp, "__init__", init)
    params = {"gru_lr": 0.5}
    _, engine = run_federation(tmp_path, "pfedka", model=MODEL, rounds=2, sizes=[60, 150],
                               params=params)
    received = seen[0]
    method, models = pfedka(**params)
    student = {k for k, v in models["model"].state_dict().items() if v.is_floating_point()}
    assert [phase for phase, _, _ in received] == [TRAIN, TRAIN, UPLOAD, UPLOAD] * 2
    assert all({e for _, e, _ in received[i:i + 2]} == {"e0", "e1"} for i in range(0, 8, 2))
    for phase, _, sections in received:
        if phase == TRAIN:
            assert set(sections) == {SCALARS} and set(sections[SCALARS]) == {"n", "ce"}
        else:
            assert set(sections) == {SHARED}
            assert set(sections[SHARED]) == {f"model/{k}" for k in student}
    record = engine.history["rounds"][-1]
    reported = {e: float(s[SCALARS]["n"]) for p, e, s in received if p == TRAIN}
    assert reported == {e: float(v) for e, v in record["train"]["num_examples"].items()}
    assert set(record["bytes"]["up"]) == {"meta", "scalar_summary", "shared_tensors"}
    assert record["bytes"]["up"]["scalar_summary"]["raw"] == 2 * 2 * 4   # n, ce per edge
    assert record["bytes"]["down"]["scalar_summary"]["raw"] == 2 * 3 * 4  # n_mean, edges; alpha
    # Round 1 is FedAvg; round 2's weights moved (gru_lr 0.5), and the new global is the
    # alpha-weighted sum of the uploads, not the n-weighted one.
    first = engine.history["rounds"][0]["aggregate"]["gate"]
    assert first["alpha"] == pytest.approx(first["fedavg_weight"], abs=1e-6)
    gate = record["aggregate"]["gate"]
    assert abs(gate["alpha"]["e0"] - gate["fedavg_weight"]["e0"]) > 1e-3
    uploads = {e: s[SHARED] for _, e, s in received[-2:]}
    name = "model/backbone.fc.weight"
    expected = sum(gate["alpha"][e] * uploads[e][name] for e in uploads)
    assert torch.allclose(engine.aggregator.state[SHARED][name], expected, atol=1e-5)

    # A server restarted from the checkpoint has the GRU, its Adam state, every hidden state.
    old = engine.aggregator
    cfg = ServerConfig(method="pfedka", rounds=3, min_edges=2, host="127.0.0.1", port=0,
                       checkpoint_dir=str(tmp_path / "server"), insecure=True, resume=True)
    train = TrainConfig(lr=0.05, model=MODEL)
    app = cli.ServerApp(cfg, train, PFedKA(MethodContext(train, PFedKAParams(**params))))
    app.engine.resume()
    new = app.engine.aggregator
    assert app.engine.round == 2 and new.hidden.keys() == {"e0", "e1"}
    assert all(torch.equal(new.hidden[e], old.hidden[e]) for e in ("e0", "e1"))
    assert all(torch.equal(a, b) for a, b in zip(new.gate.parameters(), old.gate.parameters(),
                                                 strict=True))
    old_state = old.optimizer.state_dict()["state"]
    assert old_state and all(
        torch.equal(new.optimizer.state_dict()["state"][i][k], v)
        for i, entries in old_state.items() for k, v in entries.items())
    assert new.sizes == old.sizes == record["train"]["num_examples"]


# ---- the issue #24 switches --------------------------------------------------------------
def test_teacher_logits_through_ca_are_the_teachers_head_behind_its_own_attention():
    """z_T by hand: H_T + softmax(H_T Wq (H_T Wk)^T / sqrt(d)) H_T Wv, averaged over the
    tokens, through the teacher's head; the projections are the round's global ones."""
    method, models = pfedka(teacher_logits="through_ca")
    start = global_payload(method, models)
    torch.manual_seed(3)
    moved = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v
             for k, v in start.tensors(*SHARED).items()}  # a global unlike the student
    edge = method.edge(models, CPU)
    edge.receive(TRAIN, Payload([Section(Kind.SHARED_TENSORS, "", moved)]),
                 scalars(n_mean=0.0, edges=2.0))
    with torch.no_grad():  # the student's own projections move; the teacher's must not
        models["model"].ca.w_q.weight.add_(1.0)
    edge.train_mode()
    x = torch.randn(3, 1, 28, 28)
    tokens, z_t = edge._teacher_forward(x)
    h = method_tokens(models["teacher"], x)
    wq, wk, wv = (moved[f"model/ca.{w}.weight"] for w in ("w_q", "w_k", "w_v"))
    attention = torch.softmax((h @ wq.T) @ (h @ wk.T).transpose(1, 2) / math.sqrt(128), dim=-1)
    fused = h + attention @ (h @ wv.T)
    expected = fused.mean(1) @ moved["model/backbone.fc.weight"].T + moved["model/backbone.fc.bias"]
    assert torch.equal(tokens, h)
    assert torch.allclose(z_t, expected, atol=1e-5)
    plain, plain_models = pfedka()
    plain_edge = plain.edge(plain_models, CPU)
    plain_edge.receive(TRAIN, Payload([Section(Kind.SHARED_TENSORS, "", moved)]),
                       scalars(n_mean=0.0, edges=2.0))
    plain_edge.train_mode()
    _, z_mean = plain_edge._teacher_forward(x)  # the default: the head on the mean token
    assert torch.allclose(z_mean, models["teacher"].fc(h.mean(1)), atol=1e-6)
    assert not torch.allclose(z_mean, z_t, atol=1e-3)
    with pytest.raises(ValueError, match="teacher_logits.*cross_attention"):
        pfedka(teacher_logits="through_ca", cross_attention=False)


def test_gate_departure_hand_computed():
    figures = gate_departure(torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.75]))
    assert figures["alpha_tv"] == pytest.approx(0.25)
    assert figures["alpha_max_rel"] == pytest.approx(1.0)  # 0.5 / 0.25 - 1
    assert gate_departure(torch.tensor([0.3, 0.7]), torch.tensor([0.3, 0.7])) == {
        "alpha_tv": 0.0, "alpha_max_rel": 0.0}


def test_plain_gate_has_no_prior_learns_and_logs_its_departure_every_round():
    reports = {"a": (10.0, 2.0), "b": (30.0, 1.0), "c": (60.0, 0.5)}
    method, models = pfedka(gate_init="plain", gru_lr=0.05)
    aggregator = method.server(models)
    cell = {k: v.clone() for k, v in aggregator.gate.state_dict().items()}
    first = gate_round(aggregator, 1, reports)
    # round 1 by hand: softmax(w^T GRU(s_k, 0) + b), no log p_k, w not zero
    gate = torch.nn.Module()
    gate.cell, gate.out = torch.nn.GRUCell(2, 32), torch.nn.Linear(32, 1)
    gate.load_state_dict(cell)
    assert float(gate.out.weight.detach().abs().sum()) > 0
    s = torch.tensor([[0.1, 2.0], [0.3, 1.0], [0.6, 0.5]])
    alpha = torch.softmax(gate.out(gate.cell(s, torch.zeros(3, 32))).squeeze(-1), dim=0)
    assert [first["alpha"][e] for e in "abc"] == pytest.approx(alpha.tolist(), abs=1e-6)
    assert first["alpha_tv"] == pytest.approx(
        0.5 * sum(abs(first["alpha"][e] - first["fedavg_weight"][e]) for e in "abc"), abs=1e-6)
    shifts = [gate_round(aggregator, r, reports)["alpha_tv"] for r in range(2, 30)]
    assert shifts[-1] > 0.1  # the surrogate moves weight to the low-loss edge, away from p
    assert gate_round(aggregator, 30, reports)["alpha"]["c"] > 0.6 + 0.05
    fedavg, fedavg_models = pfedka()  # the default start: round 1 is FedAvg exactly
    start = gate_round(fedavg.server(fedavg_models), 1, reports)
    assert start["alpha_tv"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="pfedka.gate_init"):
        pfedka(gate_init="prior")

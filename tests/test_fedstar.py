"""FedSTAR, its ablation and FedProto: the paper's equations against hand-computed cases,
what travels over real gRPC (prototypes of the edge's own classes, nothing else), and the
server aggregator's state through the checkpoint and a server restart."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_method_matrix import run_federation

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.data.npz import Split
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.methods.aggregators import AggregatorKind
from fedattn_shared.methods.fedproto import COUNTS
from fedattn_shared.methods.fedstar import (
    StylePersonalization,
    attention_aggregate,
    content_style,
    server_loss,
)
from fedattn_shared.methods.prototypes import GLOBAL, LOCAL, prototype_logits
from fedattn_shared.models import build_model, model_spec
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire.serialize import encode
from fl_edge.trainer import train_local
from fl_server.checkpoint import CheckpointStore

CPU = torch.device("cpu")
COMPACT = "mobilenet-v3-compact"


def method(name: str = "fedstar", model: str = COMPACT, **params):
    cls = load_method(name)
    train = TrainConfig(model=model, in_channels=1, image_size=28, lr=0.05)
    return cls(MethodContext(train, cls.Params(**params)))


def upload(prototypes: dict[int, list[float]], counts: dict[int, int] | None = None) -> Payload:
    sections = [Section(*LOCAL, {str(c): torch.tensor(v, dtype=torch.float32)
                                 for c, v in prototypes.items()})]
    if counts is not None:
        sections.append(Section(*COUNTS, {str(c): torch.tensor(float(n)) for c, n in counts.items()}))
    return Payload(sections)


# ---- the model -----------------------------------------------------------------------------


def test_compact_encoder_is_the_authors_layout_with_d_128():
    model = build_model(COMPACT, 10, 3, 32)
    assert model_spec(COMPACT).head == "fc" and model.fc.in_features == 128
    # METHODS.md 2.1's layout (stem 8, nine inverted residuals at width 0.5, 1x1 to 128,
    # fc): 31,906 parameters, counted on a model built independently from that description.
    assert sum(p.numel() for p in model.parameters()) == 31_906
    assert len([m for m in model.features if type(m).__name__ == "InvertedResidual"]) == 9
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert build_model(COMPACT, 10, 1, 28)(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="image_size must be >= 16"):
        build_model(COMPACT, 10, 1, 8)


# ---- edge equations ------------------------------------------------------------------------


def test_prototype_logits_hand_computed():
    h = torch.tensor([[1.0, 2.0]])
    prototypes = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 2.0]])
    # 2 h.p - |h|^2 - |p|^2: 2 - 5 - 1, 8 - 5 - 4, 10 - 5 - 5 (= minus the squared distances)
    assert prototype_logits(h, prototypes).tolist() == [[-4.0, -1.0, 0.0]]


def test_content_and_style_reconstruct_u_and_style_is_unit_orthogonal():
    u = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    g = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    content, style = content_style(u, g)
    assert torch.allclose(content[0], torch.tensor([3.0, 0.0]), atol=1e-5)   # (6 / 4) * g
    assert torch.allclose(style[0], torch.tensor([0.0, 1.0]), atol=1e-5)     # residual (0, 4)
    residual_norm = (u[0] - content[0]).norm()
    # Before the normalisation, content + residual is u exactly.
    assert torch.allclose(content[0] + style[0] * (residual_norm + 1e-6), u[0], atol=1e-6)
    assert abs(float(style[0] @ g[0])) < 1e-5
    assert style[1].abs().max() == 0  # u = 0 (the start): no style


def test_film_is_the_identity_when_gamma_and_beta_are_zero():
    personal = StylePersonalization(3, 8)
    h = torch.randn(5, 8)
    style = torch.randn(5, 8)
    assert not torch.allclose(personal.film(h, style), h)
    with torch.no_grad():
        for layer in (personal.gamma, personal.beta):
            layer.weight.zero_()
            layer.bias.zero_()
    assert torch.equal(personal.film(h, style), h)


def test_gate_mixes_global_and_personal_prototypes():
    personal = StylePersonalization(2, 8)
    with torch.no_grad():
        personal.u.copy_(torch.randn(2, 8))
        last = personal.gate[2]
        last.weight.zero_()
        last.bias.fill_(math.log(3.0))  # sigmoid(log 3) = 0.75
    g = torch.randn(2, 8)
    mixed, a = personal.personal_prototypes(g)
    assert torch.allclose(a, torch.full((2, 1), 0.75))
    assert torch.allclose(mixed, 0.75 * g + 0.25 * personal.u, atol=1e-6)


def edge_with_globals(m, classes: list[int]):
    edge = m.edge(m.build_models(), CPU)
    table = {str(c): torch.randn(128) for c in classes}
    edge.receive("train", Payload([Section(*GLOBAL, table)]), Payload())
    return edge


def test_training_loss_is_ce_plus_pull_plus_shared_over_classes_with_a_global_prototype():
    torch.manual_seed(0)
    m = method(lambda_pull=0.7, lambda_shared=1.0)
    edge = edge_with_globals(m, [1, 4, 7])
    personal = edge.personal
    with torch.no_grad():
        personal.u.copy_(torch.randn(10, 128))
    edge.begin_train()
    assert personal.style[[1, 4, 7]].norm(dim=1).allclose(torch.ones(3), atol=1e-5)
    assert personal.style[[0, 2, 3]].abs().max() == 0  # no global prototype: no style
    edge.eval_mode()  # deterministic forward passes (no dropout) for the comparison
    x, y = torch.randn(6, 1, 28, 28), torch.tensor([1, 4, 7, 1, 2, 3])
    loss = edge.training_step((x, y))

    h, _ = edge.features(x)
    h_personal = personal.film(h, personal.style[y])
    ce = F.cross_entropy(edge.head(h_personal), y)
    known = torch.tensor([True, True, True, True, False, False])
    g = edge.global_table[[1, 4, 7]]
    shared = F.cross_entropy(prototype_logits(h[known], g), torch.tensor([0, 1, 2, 0]))
    a = torch.sigmoid(personal.gate(torch.cat([g, personal.u[[1, 4, 7]],
                                               (g - personal.u[[1, 4, 7]]).abs(),
                                               g * personal.u[[1, 4, 7]]], 1)))
    p_personal = dict(zip([1, 4, 7], a * g + (1 - a) * personal.u[[1, 4, 7]], strict=True))
    target = torch.stack([p_personal[int(c)] for c in y[known]])
    pull = (1 - F.cosine_similarity(h_personal[known], target, dim=1)).mean()
    assert torch.allclose(loss, ce + 0.7 * pull + 1.0 * shared, rtol=1e-5)


def test_u_film_and_gate_learn_through_the_pull_unless_frozen():
    torch.manual_seed(0)
    for frozen, learns in (({}, True), ({"train_u": False, "train_film": False,
                                         "train_gate": False}, False)):
        m = method(**frozen)
        edge = edge_with_globals(m, list(range(10)))
        personal = edge.personal
        with torch.no_grad():
            personal.u.copy_(torch.randn(10, 128))  # u = 0 has no style: gamma's W gets no gradient
        before = {k: v.clone() for k, v in personal.state_dict().items() if k != "style"}
        data = Split(torch.randn(16, 1, 28, 28), torch.arange(16) % 10)
        train_local(edge, data, 1, 8, seed=0, device=CPU, progress=False)
        after = personal.state_dict()
        for key in ("u", "gamma.weight", "gate.0.weight"):
            assert (not torch.equal(before[key], after[key])) == learns, (frozen, key)
    groups = method().edge(method().build_models(), CPU).parameter_groups()
    assert groups[1]["lr_scale"] == 10.0 and len(groups[1]["params"]) == 1  # u at lr x 10


def test_round_one_without_global_prototypes_trains_with_ce_alone():
    m = method()
    edge = m.edge(m.build_models(), CPU)
    edge.begin_train()
    edge.eval_mode()
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    h, _ = edge.features(x)
    expected = F.cross_entropy(edge.head(edge.personal.film(h, torch.zeros(4, 128))), y)
    assert torch.allclose(edge.training_step((x, y)), expected)


def test_ablation_trains_with_fedprotos_loss_and_has_no_personal_model():
    torch.manual_seed(0)
    m = method(variant="ablation")
    assert m.model_names() == ("model",)
    edge = edge_with_globals(m, [2])
    edge.eval_mode()
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([2, 2, 5, 6])
    h, logits = edge.features(x)
    mse = F.mse_loss(h[:2], edge.global_table[[2, 2]])
    assert torch.allclose(edge.training_step((x, y)), F.cross_entropy(logits, y) + mse)


def test_predict_never_needs_the_label():
    torch.manual_seed(0)
    for predict in ("head", "predicted-style"):
        m = method(predict=predict)
        edge = edge_with_globals(m, list(range(10)))
        with torch.no_grad():
            edge.personal.u.copy_(torch.randn(10, 128))
        edge.begin_train()
        edge.eval_mode()
        x = torch.randn(5, 1, 28, 28)
        plain = edge.model(x)
        with torch.no_grad():
            out = edge.predict(x)
            h, _ = edge.features(x)
            styled = edge.head(edge.personal.film(h, edge.personal.style[plain.argmax(1)]))
        assert torch.allclose(out, plain if predict == "head" else styled)


# ---- server equations ----------------------------------------------------------------------


def test_attention_weights_sum_to_one_over_the_clients_that_uploaded_the_class():
    z = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],
                      [[0.0, 2.0], [5.0, 5.0]],
                      [[3.0, 0.0], [1.0, 1.0]]])        # 3 clients x 2 classes x d = 2
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    merged, alpha = attention_aggregate(z, e, mask)
    assert torch.allclose(alpha.sum(0), torch.ones(2))
    assert alpha[1, 1] == 0  # client 1 did not upload class 1
    scores = torch.tensor([1.0, 0.0, 3.0]) / math.sqrt(2)  # Z_k,0 . e_0 / sqrt(d)
    expected = scores.softmax(0)
    assert torch.allclose(alpha[:, 0], expected)
    assert torch.allclose(merged[0], (expected[:, None] * z[:, 0]).sum(0))
    pair = (torch.tensor([1.0, 1.0]) / math.sqrt(2)).softmax(0)
    assert torch.allclose(merged[1], pair[0] * z[0, 1] + pair[1] * z[2, 1])


def test_server_loss_is_eq_15():
    z = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])         # mean over clients: (0.5, 0.5)
    cp = torch.tensor([[[1.0, 0.0]], [[0.0, 3.0]]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    assert math.isclose(float(server_loss(z, cp, mask)), 1 - 1 / math.sqrt(2), rel_tol=1e-6)


@pytest.mark.parametrize("axis", ["classes", "clients"])
def test_aggregator_merges_per_class_subsets_and_keeps_unseen_classes(axis):
    torch.manual_seed(0)
    m = method(attn_axis=axis)
    agg = m.server(m.build_models())
    assert agg.broadcast("train").sections == []  # no global prototype before the first round
    agg.begin_round(1, ["a", "b"], 2)
    agg.accept("b", upload({1: [1.0] * 128, 2: [2.0] * 128}), 1.0)
    agg.accept("a", upload({1: [0.5] * 128}), 1.0)
    net_before = {k: v.clone() for k, v in agg.net.state_dict().items()}
    figures = agg.finish()
    assert set(agg.state[GLOBAL]) == {"1", "2"}
    assert figures["classes"] == 2 and figures["server_loss"] > 0
    assert any(not torch.equal(v, agg.net.state_dict()[k]) for k, v in net_before.items())
    assert torch.allclose(agg.net.class_embed.weight.norm(dim=1), torch.ones(10))
    kept = agg.state[GLOBAL]["2"].clone()
    agg.begin_round(2, ["c"], 3)
    agg.accept("c", upload({5: [1.0] * 128}), 1.0)
    agg.finish()
    assert set(agg.state[GLOBAL]) == {"1", "2", "5"} and torch.equal(agg.state[GLOBAL]["2"], kept)
    # A client's embedding row depends on its id and the seed, never on arrival order.
    assert agg.client_rows == {"a": 0, "b": 1, "c": 2}
    fresh, other = m.server(m.build_models()), m.server(m.build_models())
    fresh.row("c")
    other.row("a")
    other.row("c")
    assert torch.equal(fresh.client_embed[0], other.client_embed[1])
    assert not torch.equal(other.client_embed[0], other.client_embed[1])


def run_round(agg, number: int, uploads: dict[str, Payload]) -> dict:
    agg.begin_round(number, sorted(uploads), len(uploads))
    for edge, payload in uploads.items():
        agg.accept(edge, payload, 1.0)
    torch.manual_seed(number)  # the Transformer's dropout
    return agg.finish()


def test_aggregator_state_round_trips_through_the_checkpoint_store(tmp_path):
    m = method(server_momentum=0.9)  # momentum: optimizer state that must survive too
    torch.manual_seed(0)
    uploads = [{e: upload({c: torch.randn(128).tolist() for c in classes})
                for e, classes in (("a", [0, 1]), ("b", [1, 2, 3]))},
               {"a": upload({0: torch.randn(128).tolist()}),
                "c": upload({3: torch.randn(128).tolist(), 4: torch.randn(128).tolist()})},
               {"b": upload({1: torch.randn(128).tolist()}),
                "d": upload({1: torch.randn(128).tolist(), 4: torch.randn(128).tolist()})}]
    first = m.server(m.build_models())
    run_round(first, 1, uploads[0])
    run_round(first, 2, uploads[1])
    store = CheckpointStore(tmp_path / "ckpt")
    store.save(2, first.state_tensors(), {"aggregator": first.state_meta()})
    _, tensors, state = store.load()
    restored = m.server(m.build_models())
    restored.load_state(tensors, state["aggregator"])
    assert restored.client_rows == first.client_rows == {"a": 0, "b": 1, "c": 2}
    assert restored.state_tensors().keys() == first.state_tensors().keys()
    assert any(k.startswith("opt:") for k in first.state_tensors())
    # The next round (with a new edge, d) gives the same result bit for bit.
    run_round(first, 3, uploads[2])
    run_round(restored, 3, uploads[2])
    for key, value in first.state_tensors().items():
        assert torch.equal(restored.state_tensors()[key], value), key


def test_fedproto_averages_with_the_class_counts_and_checks_them():
    m = method("fedproto")
    agg = m.server(m.build_models())
    agg.begin_round(1, ["a", "b"], 2)
    agg.accept("a", upload({0: [1.0] * 128, 3: [4.0] * 128}, {0: 3, 3: 1}), 1.0)
    agg.accept("b", upload({0: [5.0] * 128}, {0: 1}), 1.0)
    agg.finish()
    merged = agg.state[GLOBAL]
    assert set(merged) == {"0", "3"}
    assert torch.allclose(merged["0"], torch.full((128,), 2.0))  # (3 * 1 + 1 * 5) / 4
    assert torch.allclose(merged["3"], torch.full((128,), 4.0))
    with pytest.raises(ValueError, match="exactly the uploaded prototypes' classes"):
        m.check_upload("train", upload({0: [1.0] * 128}, {1: 2}))
    with pytest.raises(ValueError, match=r"class_counts\[0\] = 0.5"):
        m.check_upload("train", upload({0: [1.0] * 128}, {0: 0.5}))


# ---- declarations, schema, bad input -------------------------------------------------------


def test_secure_aggregation_declaration():
    for name, model in (("fedavg", "lenet-bn"), ("fedsap", "se-cnn")):
        m = method(name, model=model)
        schema = m.uplink_schema("train", m.build_models())
        assert m.privacy("train", m.build_models()).summable == {(s.kind, s.name) for s in schema}
    for name in ("fedstar", "fedproto", "fedmedian"):
        m = method(name) if name != "fedmedian" else method(name, model="lenet-bn")
        assert m.aggregator_kind == AggregatorKind.COLLECT
        assert m.uplink_schema("train", m.build_models())
        assert m.privacy("train", m.build_models()).summable == set()


def engine_for(tmp_path, name: str, model: str):
    from fl_server.app import ServerApp

    m = method(name, model=model)
    cfg = ServerConfig(method=name, checkpoint_dir=str(tmp_path / name), insecure=True, port=0)
    return ServerApp(cfg, m.train, m).engine


def test_optional_schema_tensors_accept_a_class_subset_and_nothing_else(tmp_path):
    from fl_server.phase import Refused

    engine = engine_for(tmp_path, "fedstar", COMPACT)
    schema = next(driver for driver in engine.plan if driver.name == "train").schema()
    [spec] = schema
    assert spec.nbytes_of(["1", "7"]) == 2 * 128 * 4

    def check(payload):
        engine.gate.check_manifest(encode(payload).manifest, schema)

    check(upload({1: [0.0] * 128, 7: [0.0] * 128}))
    with pytest.raises(Refused, match=r"unexpected \['10'\]"):
        check(upload({10: [0.0] * 128}))
    with pytest.raises(Refused, match="shape \\[64\\], expected \\[128\\]"):
        check(upload({3: [0.0] * 64}))
    with pytest.raises(Refused, match="not in method fedstar's upload schema"):
        check(upload({3: [0.0] * 128}, {3: 5}))  # FedSTAR sends no counts
    # Schemas without optional tensors stay strict: every tensor, exactly.
    strict = engine_for(tmp_path, "fedavg", "lenet-bn")
    strict_schema = next(driver for driver in strict.plan if driver.name == "train").schema()
    tensors = {name: torch.zeros(spec.shape) for name, spec in strict_schema[0].tensors.items()}
    tensors.pop(sorted(tensors)[0])
    with pytest.raises(Refused, match="missing \\['model/classifier.0.bias'\\]"):
        strict.gate.check_manifest(
            encode(Payload([Section(Kind.SHARED_TENSORS, "", tensors)])).manifest, strict_schema)


@pytest.mark.parametrize("params, message", [
    ({"variant": "personal"}, "fedstar.variant: 'personal' is not one of full, ablation"),
    ({"heads": 3}, "fedstar.heads: 3 does not divide the feature dimension 128"),
    ({"lambda_pull": -1.0}, "fedstar.lambda_pull must be a finite number >= 0"),
    ({"attn_axis": "rows"}, "fedstar.attn_axis"),
    ({"variant": "ablation", "predict": "predicted-style"}, "the ablation variant has no FiLM"),
    ({"proto_norm": "batch"}, "fedstar.proto_norm"),
])
def test_bad_parameters_are_refused_by_name(params, message):
    with pytest.raises(ValueError, match=message):
        method(**params)


# ---- over real gRPC ------------------------------------------------------------------------


@pytest.mark.slow
def test_only_the_edges_own_class_prototypes_travel_and_the_server_survives_a_restart(tmp_path):
    """3 edges with different label sets, 2 trained per round (--fraction 0.5), 3 rounds.
    The server receives one PROTOTYPES section per upload, with exactly the classes the
    edge has; every edge is evaluated, including one that has not trained yet. A restarted
    server (--resume) holds the aggregator state bit for bit and continues identically.
    The exported model (style vectors included) predicts what the edge evaluated."""
    from fedattn_shared.data import load_edge_data
    from fl_edge import export as tools
    from fl_server.app import ServerApp

    classes = [[0, 1, 2], [2, 3], [5, 6, 7, 8]]
    received, engine = run_federation(tmp_path, "fedstar", model=COMPACT, edges=3, rounds=3,
                                      fraction=0.5, classes=classes, sizes=[60, 60, 60],
                                      params={"predict": "predicted-style"}, eval_detail=True)
    train_rounds = [r["train"]["received"] for r in engine.history["rounds"]]
    assert all(len(r) == 2 for r in train_rounds)
    assert len(received) == 6
    for edge, sections in received:
        assert list(sections) == [(Kind.PROTOTYPES, "")]
        own = {str(c) for c in classes[int(edge[1:])]}
        assert set(sections[(Kind.PROTOTYPES, "")]) == own  # every generated class is in train
    first = engine.history["rounds"][0]
    assert first["bytes"]["up"].keys() == {"meta", "prototypes"}
    assert first["bytes"]["down"].keys() <= {"meta", "prototypes"}
    assert set(first["evaluation"]["per_edge"]) == {"e0", "e1", "e2"}
    # Issue #24's figures cross the wire into history.json: |h| per trained edge, the
    # prototypes' share of the server LayerNorm's input and their cosine with the uploads.
    for record in engine.history["rounds"]:
        metrics = record["train"]["edge_metrics"]
        assert sorted(metrics) == sorted(record["train"]["received"])
        assert all(m["feature_norm"] > 0 for m in metrics.values())
        shares = [record["aggregate"][k] for k in ("proto_energy", "client_energy", "class_energy")]
        assert all(0 <= v <= 1 for v in shares) and math.isclose(sum(shares), 1, rel_tol=1e-9)
        assert -1 <= record["aggregate"]["proto_cosine"] <= 1
        assert record["aggregate"]["upload_norm"] > 0
    aggregator = engine.aggregator
    participated = sorted({e for r in train_rounds for e in r})
    assert sorted(aggregator.client_rows) == participated
    assert set(aggregator.state[GLOBAL]) == {str(c) for e in participated for c in classes[int(e[1:])]}

    trained = sorted(participated)[0]
    out = tmp_path / "exported.safetensors"
    tools.export(tmp_path / f"state-{trained[1:]}", out)
    exported = tools.from_export(out)
    assert exported.algo.personal.style.abs().sum() > 0
    test = load_edge_data(tmp_path / f"classes-{trained[1:]}" / "data-0", exported.train).test
    predicted = tools.predict(exported, test.x).argmax(1)
    confusion = torch.zeros(10, 10, dtype=torch.int64)
    confusion.index_put_((test.y, predicted), torch.tensor(1), accumulate=True)
    evaluated = engine.history["rounds"][-1]["evaluation"]["per_edge"][trained]["test"]
    assert confusion.tolist() == evaluated["confusion"]

    cfg = ServerConfig(method="fedstar", rounds=3, checkpoint_dir=str(tmp_path / "server"),
                       insecure=True, port=0, fraction=0.5, resume=True, eval_detail=True)
    restarted = ServerApp(cfg, engine.train, engine.method).engine
    restarted.resume()
    resumed = restarted.aggregator
    assert resumed.client_rows == aggregator.client_rows
    before = aggregator.state_tensors()
    assert resumed.state_tensors().keys() == before.keys()
    assert all(torch.equal(resumed.state_tensors()[k], v) for k, v in before.items())
    next_round = {"e0": upload({1: [0.3] * 128}), "e9": upload({1: [0.1] * 128, 4: [0.2] * 128})}
    run_round(aggregator, 4, next_round)
    run_round(resumed, 4, next_round)
    assert all(torch.equal(resumed.state_tensors()[k], v)
               for k, v in aggregator.state_tensors().items())


@pytest.mark.slow
@pytest.mark.parametrize("name, params, sections", [
    ("fedproto", None, {(Kind.PROTOTYPES, ""), COUNTS}),
    ("fedstar", {"variant": "ablation"}, {(Kind.PROTOTYPES, "")}),
])
def test_fedproto_sends_counts_and_the_ablation_does_not(tmp_path, name, params, sections):
    received, engine = run_federation(tmp_path, name, model=COMPACT, rounds=2, params=params,
                                      classes=[[0, 1], [1, 4]], sizes=[40, 40])
    for edge, uploaded in received:
        assert set(uploaded) == sections
        own = {"e0": ["0", "1"], "e1": ["1", "4"]}[edge]
        assert all(names == own for names in uploaded.values())
    assert set(engine.aggregator.state[GLOBAL]) == {"0", "1", "4"}
    for record in engine.history["rounds"]:
        assert all(m["feature_norm"] > 0 for m in record["train"]["edge_metrics"].values())
        assert -1 <= record["aggregate"]["proto_cosine"] <= 1


def test_the_server_refuses_an_upload_that_fails_the_methods_check(tmp_path):
    """FedProto's counts must name exactly its prototypes' classes: the engine turns the
    method's ValueError into a refusal that drops the task, before the aggregator sees it."""
    import asyncio

    from fedattn_shared.wire import fedattn_pb2 as pb
    from fl_server.phase import Phase, Refused, Task

    engine = engine_for(tmp_path, "fedproto", COMPACT)
    engine.aggregator.begin_round(1, ["e0"], 1)
    driver = next(driver for driver in engine.plan if driver.name == "train")
    phase = Phase(name="train", round=1, tasks={"e0": Task(1, "e0")}, quorum=1, common_id="c",
                  common=encode(Payload()), personal={}, spec_json="{}",
                  driver=driver, schema=driver.schema())
    header = pb.SubmitHeader(edge_id="e0", num_examples=10)

    async def submit(payload):  # the gate's value check, then into the phase
        engine.gate.check_values(phase, "e0", payload)
        await engine.gate.take(phase, header, payload)

    with pytest.raises(Refused, match="class_counts must name exactly") as refused:
        asyncio.run(submit(upload({1: [0.0] * 128}, {2: 10})))
    assert refused.value.drop and engine.aggregator.uploads == {}
    asyncio.run(submit(upload({1: [0.0] * 128}, {1: 10})))
    assert list(engine.aggregator.uploads) == ["e0"]


# ---- issue #24's figures: |h| on the edge, the prototypes' content share on the server -------


@pytest.mark.parametrize("name", ["fedstar", "fedproto"])
def test_feature_norm_is_the_mean_norm_of_the_rounds_training_features(name):
    torch.manual_seed(0)
    m = method(name)
    assert "feature_norm" in m.metric_names()
    edge = edge_with_globals(m, [1, 2])
    edge.begin_train()
    assert edge.training_metrics() == {}  # nothing trained yet: no figure
    edge.eval_mode()  # the same h in the step and in the check below
    batches = [(torch.randn(3, 1, 28, 28), torch.tensor([1, 2, 3])),
               (torch.randn(5, 1, 28, 28), torch.tensor([0, 1, 1, 2, 4]))]
    norms = []
    for x, y in batches:
        edge.training_step((x, y))
        with torch.no_grad():
            norms.append(edge.features(x)[0].norm(dim=1))
    expected = float(torch.cat(norms).mean())  # over samples, not the mean of batch means
    assert math.isclose(edge.training_metrics()["feature_norm"], expected, rel_tol=1e-5)
    edge.begin_train()  # a new round starts from zero
    assert edge.training_metrics() == {}


def test_alignment_is_the_mean_cosine_of_each_upload_with_its_global_prototype():
    from fedattn_shared.methods.prototypes import alignment

    global_prototypes = {"0": torch.tensor([1.0, 0.0]), "1": torch.tensor([0.0, 2.0])}
    uploads = [{"0": torch.tensor([3.0, 0.0])},                                # cos 1
               {"0": torch.tensor([0.0, 1.0]), "1": torch.tensor([0.0, -1.0])}]  # cos 0, -1
    assert math.isclose(alignment(global_prototypes, uploads), 0.0, abs_tol=1e-12)
    assert math.isclose(alignment(global_prototypes, uploads[:1]), 1.0)
    assert alignment(global_prototypes, []) is None


def test_upload_norm_is_the_mean_norm_of_the_uploaded_prototypes():
    from fedattn_shared.methods.prototypes import upload_norm

    uploads = [{"0": torch.tensor([3.0, 4.0])}, {"0": torch.tensor([0.0, 1.0]), "5": torch.zeros(2)}]
    assert math.isclose(upload_norm(uploads), (5 + 1 + 0) / 3)
    assert upload_norm([{}]) is None


def test_input_energy_shares_count_only_uploaded_pairs_after_removing_each_mean():
    from fedattn_shared.methods.fedstar import input_energy

    # d = 2. Centred: p[0,0] = (1, -1) -> 2, p[1,0] = (2, 2) -> 0 (a constant vector carries
    # no energy through LayerNorm), p[0,1] masked out (its 100s must not count).
    prototypes = torch.tensor([[[2.0, 0.0], [100.0, -100.0]], [[2.0, 2.0], [0.0, 0.0]]])
    client = torch.tensor([[0.0, 4.0], [1.0, 1.0]])    # centred energies 8 and 0
    class_embed = torch.tensor([[1.0, 0.0], [5.0, -5.0]])  # 0.5 and (class 1 only masked) 50
    mask = torch.tensor([[True, False], [True, False]])
    shares = input_energy(prototypes, client, class_embed, mask)
    total = 2 + 0 + 8 + 0 + 0.5 + 0.5
    assert math.isclose(shares["proto_energy"], 2 / total)
    assert math.isclose(shares["client_energy"], 8 / total)
    assert math.isclose(shares["class_energy"], 1 / total)


def test_aggregators_report_the_prototype_figures():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.randn(128, generator=generator) for _ in range(2))
    uploads = {"a": upload({1: a.tolist()}), "b": upload({1: b.tolist(), 2: (2 * b).tolist()})}
    # embed_std = 0: no client energy; the shares are the prototypes' and the class rows'.
    m = method(embed_std=0.0)
    agg = m.server(m.build_models())
    classes = agg.net.class_embed.weight.detach()[[1, 2]].clone()
    figures = run_round(agg, 1, uploads)
    assert figures["client_energy"] == 0.0
    centred = [v - v.mean() for v in (a, b, 2 * b)]
    proto = sum(float(v.square().sum()) for v in centred)
    cls = [float((c - c.mean()).square().sum()) for c in classes]
    assert math.isclose(figures["proto_energy"], proto / (proto + 2 * cls[0] + cls[1]), rel_tol=1e-5)
    glob = agg.state[GLOBAL]
    expected = (F.cosine_similarity(glob["1"], a, dim=0) + F.cosine_similarity(glob["1"], b, dim=0)
                + F.cosine_similarity(glob["2"], 2 * b, dim=0)) / 3
    assert math.isclose(figures["proto_cosine"], float(expected), rel_tol=1e-5)
    assert math.isclose(figures["upload_norm"], float(a.norm() + b.norm() + 2 * b.norm()) / 3,
                        rel_tol=1e-5)
    # FedProto's global prototype is the count-weighted mean of the uploads.
    fp = method("fedproto")
    fagg = fp.server(fp.build_models())
    counted = {"a": upload({1: a.tolist()}, {1: 1}), "b": upload({1: b.tolist()}, {1: 3})}
    figures = run_round(fagg, 1, counted)
    mean = (a + 3 * b) / 4
    expected = (F.cosine_similarity(mean, a, dim=0) + F.cosine_similarity(mean, b, dim=0)) / 2
    assert math.isclose(figures["proto_cosine"], float(expected), rel_tol=1e-5)
    assert math.isclose(figures["upload_norm"], float(a.norm() + b.norm()) / 2, rel_tol=1e-5)

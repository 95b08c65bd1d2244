"""pFedLA: the host methods composed on models with local attention; attention, hybrid
logits and CoordAtt statistics never on the wire (real gRPC, a spy on the server); uniform
vs sample weighting; the private hybrid-weight history and its Table 5."""

from __future__ import annotations

import json

import pytest
import torch
from test_method_matrix import ALL_FLOAT, BN, SHARED, run_federation

from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import AggregatorKind, MethodContext, load_method
from fedattn_shared.models.attention import attention_modules
from fedattn_shared.schema import TRAIN, Kind, Payload, Section
from fl_tools import report

HOST_PRIVATE = {"fedavg": set(), "fedprox": set(), "fedbn": BN, "ditto": set(), "pfedme": set()}


def make(params: dict | None = None, **train):
    cls = load_method("pfedla")
    return cls(MethodContext(TrainConfig(**train), cls.Params(**(params or {}))))


@pytest.mark.parametrize("host", sorted(HOST_PRIVATE))
def test_every_host_uploads_its_own_sections_without_attention(host):
    method = make({"base": host, "attention": "hybrid"})
    models = method.build_models()
    assert tuple(models) == load_method(host)(MethodContext(TrainConfig(), load_method(
        host).Params())).model_names()
    for model in models.values():  # every model the host keeps has its own attention
        assert [n for n, _ in attention_modules(model)] == ["features.3.1", "features.7.1"]
    schema = method.uplink_schema(TRAIN, models)
    assert [(s.kind, s.name) for s in schema] == [SHARED]
    shared_model = "model" if "model" in models else "global"
    assert set(schema[0].tensors) == {f"{shared_model}/{k}" for k in ALL_FLOAT - HOST_PRIVATE[host]}
    assert method.aggregator_kind == load_method(host).aggregator_kind
    assert method.edge(models, torch.device("cpu")).method is method.host


def test_host_parameters_pass_through_and_bad_input_names_the_field():
    assert make({"base": "fedprox", "base_params": ["mu=0.25"]}).host.params.mu == 0.25
    assert make({"base": "pfedme", "base_params": ["inner_steps=2", "beta=1.5"]}).host.params.beta == 1.5
    for params, message in [
        ({"attention": "nonlocal"}, "pfedla.attention"),
        ({"base": "scaffold"}, "pfedla.base"),
        ({"weighting": "median"}, "pfedla.weighting"),
        ({"base": "fedprox", "base_params": ["nu=1"]}, "pfedla.base_params: unknown key fedprox.nu"),
    ]:
        with pytest.raises(ValueError, match=message):
            make(params)
    with pytest.raises(ValueError, match="no attention sites found in se-cnn; declare them with a ModelSpec"):
        make(model="se-cnn")


def test_share_attention_puts_the_attention_layers_on_the_wire():
    method = make({"attention": "ca", "share_attention": True})
    models = method.build_models()
    shared = set(method.uplink_schema(TRAIN, models)[0].tensors)
    assert {"model/features.3.1.conv1.weight", "model/features.7.1.bn1.running_mean"} <= shared
    local = make({"attention": "ca"})
    assert not any(k.startswith(("model/features.3.1.", "model/features.7.1."))
                   for k in local.uplink_schema(TRAIN, local.build_models())[0].tensors)


def test_weighting_changes_exactly_the_averaging_weights():
    """The engine weighs each upload by ``method.aggregation_weight(n_k)``: uniform gives the
    plain mean (Algorithm 1 line 6), samples the n_k-weighted one; nothing else differs."""
    results = {}
    for weighting in ("uniform", "samples"):
        method = make({"attention": "se", "weighting": weighting})
        agg = method.server(method.build_models())
        start = {k: v.clone() for k, v in agg.state[SHARED].items()}
        agg.begin_round(1, ["a", "b"], 2)
        for edge, n, delta in (("a", 10, 1.0), ("b", 30, -1.0)):
            upload = {k: v + delta for k, v in start.items()}
            agg.accept(edge, Payload([Section(Kind.SHARED_TENSORS, "", upload)]),
                       method.aggregation_weight(n))
        agg.finish()
        results[weighting] = {k: agg.state[SHARED][k] - start[k] for k in start}
    for k in results["uniform"]:
        if not k.endswith("num_batches_tracked"):
            assert torch.allclose(results["uniform"][k], torch.zeros(()), atol=1e-6)
            assert torch.allclose(results["samples"][k], torch.tensor(-0.5), atol=1e-6)
    assert make({"weighting": "uniform"}).aggregation_weight(30) == 1.0
    assert make({"weighting": "samples"}).aggregation_weight(30) == 30.0


@pytest.mark.slow
def test_over_grpc_attention_never_travels_and_costs_no_bytes(tmp_path):
    received, engine = run_federation(tmp_path / "la", "pfedla",
                                      params={"attention": "hybrid", "base": "fedavg"})
    _, host = run_federation(tmp_path / "avg", "fedavg")
    assert len(received) == 4
    for _, sections in received:
        assert list(sections) == [SHARED]
        assert set(sections[SHARED]) == {f"model/{k}" for k in ALL_FLOAT}
    for la, avg in zip(engine.history["rounds"], host.history["rounds"], strict=True):
        assert la["bytes"]["up"]["shared_tensors"]["raw"] == avg["bytes"]["up"]["shared_tensors"]["raw"]
        assert la["bytes"]["down"]["shared_tensors"]["raw"] == avg["bytes"]["down"]["shared_tensors"]["raw"]
    # The hybrid weights: in each edge's own history, one entry per training round.
    history = json.loads((tmp_path / "la" / "state-0" / "private-history.json").read_text())
    assert [r["round"] for r in history["rounds"]] == [1, 2]
    weights = history["rounds"][-1]["figures"]["model/features.7.1"]
    assert set(weights) == {"se", "eca", "ca"} and abs(sum(weights.values()) - 1) < 1e-5
    assert weights != pytest.approx({"se": 1 / 3, "eca": 1 / 3, "ca": 1 / 3}, abs=1e-7)
    out = tmp_path / "report"
    assert report.main(["--edge-state", str(tmp_path / "la" / "state-0"),
                        str(tmp_path / "la" / "state-1"), "--out", str(out)]) == 0
    table = (out / "attention_weights.md").read_text()
    assert "| e0 | SE |" in table and "| e1 | SE |" in table and "layer 2" in table
    assert f"{weights['ca']:.4f}" in table


@pytest.mark.slow
def test_over_grpc_with_pfedme_host_personal_attention_stays_home(tmp_path):
    received, engine = run_federation(
        tmp_path, "pfedla", params={"attention": "eca", "base": "pfedme",
                                    "base_params": ["inner_steps=2"]})
    for _, sections in received:
        assert set(sections[SHARED]) == {f"global/{k}" for k in ALL_FLOAT}
    assert engine.aggregator.kind == AggregatorKind.SERVER_OPTIMIZER


def test_report_refuses_histories_without_hybrid_weights(tmp_path, capsys):
    (tmp_path / "private-history.json").write_text(json.dumps({"rounds": [{"round": 1, "figures": {}}]}))
    assert report.main(["--edge-state", str(tmp_path)]) == 2
    assert "no hybrid attention weights" in capsys.readouterr().err
    assert report.main(["--edge-state", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("host", sorted(HOST_PRIVATE))
def test_every_host_hook_is_inherited_not_forwarded(host):
    """pFedLA is the host on other models (``PFedLA[host]``): the host's upload checks and
    privacy traits are its own by construction, none forwarded (and so none missed)."""
    method = make({"base": host})
    host_cls = load_method(host)
    assert isinstance(method, host_cls) and method.host is method
    assert type(method).check_upload is host_cls.check_upload
    assert type(method).privacy is host_cls.privacy
    assert method.spec.aggregator is host_cls.spec.aggregator
    assert (method.name, method.Params, method.phases) == ("pfedla", load_method("pfedla").Params,
                                                           host_cls.phases)
    models = method.build_models()
    summable = method.privacy(TRAIN, models).summable
    assert summable == {(s.kind, s.name) for s in method.uplink_schema(TRAIN, models)}

"""Every method end to end: a real ServerApp and real EdgeDaemons talking gRPC over
loopback, in one process (threads) to keep the matrix fast. A spy on the aggregator
records what the server received, to prove nothing private travelled."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from conftest import write_edge_dirs
from torch.nn.modules.batchnorm import _BatchNorm

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.models import build_model
from fedattn_shared.schema import Kind
from fl_edge.daemon import EdgeDaemon, EdgeOptions
from fl_server.app import ServerApp


def run_federation(tmp_path, method_name: str, private: list[str] | None = None,
                   edges: int = 2, rounds: int = 2, sizes: list[int] | None = None,
                   lr: float = 0.05, init_weights: str = "", model: str = "lenet-bn",
                   params: dict | None = None, device: str = "cpu", fraction: float = 1.0,
                   classes: list[list[int]] | None = None, dp=None, eval_detail: bool = False):
    """``classes``: the labels each edge's generated data draws from (all by default);
    ``dp``: a DPConfig to run under DP-SGD; ``eval_detail``: evaluations carry per-class
    counts (server.eval_detail)."""
    train = TrainConfig(private=private or [], lr=lr, model=model)
    cls = load_method(method_name)
    method = cls(MethodContext(train, cls.Params(**(params or {})), dp=dp))
    server_cfg = ServerConfig(method=method_name, rounds=rounds, min_edges=edges, host="127.0.0.1",
                              port=0, checkpoint_dir=str(tmp_path / "server"), insecure=True,
                              poll_timeout=2.0, round_timeout=60, init_weights=init_weights,
                              fraction=fraction, eval_detail=eval_detail)
    app = ServerApp(server_cfg, train, method)
    received: list[tuple[str, dict]] = []
    accept = app.engine.aggregator.accept

    def spy(edge_id, payload, weight):
        received.append((edge_id, {(s.kind, s.name): sorted(s.tensors) for s in payload.sections}))
        return accept(edge_id, payload, weight)

    app.engine.aggregator.accept = spy
    loop = asyncio.new_event_loop()
    port = loop.run_until_complete(app.start())
    server_thread = threading.Thread(target=loop.run_until_complete, args=(app.run(),))
    server_thread.start()
    results: dict[str, int] = {}

    def edge(i: int, data_dir):
        # A module:Class method is this harness's own choice: its edges opt into importing it.
        options = EdgeOptions(server=f"127.0.0.1:{port}", data_dir=data_dir,
                              state_dir=tmp_path / f"state-{i}", name=f"e{i}", device=device,
                              retry_for=30, progress=False,
                              allow_methods=(method_name,) if ":" in method_name else ())
        results[f"e{i}"] = EdgeDaemon(options).run()

    per_edge = sizes or [120] * edges
    dirs = ([write_edge_dirs(tmp_path / f"classes-{i}", 1, [per_edge[i]], classes=c)[0]
             for i, c in enumerate(classes)] if classes else write_edge_dirs(tmp_path, edges, per_edge))
    threads = [threading.Thread(target=edge, args=(i, d)) for i, d in enumerate(dirs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    server_thread.join(timeout=60)
    loop.close()
    assert results == {f"e{i}": 0 for i in range(edges)}
    history = app.engine.history
    assert len(history["rounds"]) == rounds
    assert history["rounds"][-1]["evaluate"]["received"] == [f"e{i}" for i in range(edges)]
    return received, app.engine


def lenet_names(predicate=lambda module: True) -> set[str]:
    model = build_model("lenet-bn", 10, 1, 28)
    names = set()
    for module_name, module in model.named_modules():
        if predicate(module) and module_name:
            names.update(f"{module_name}.{k}" for k in module.state_dict())
    return names


ALL_FLOAT = {k for k, v in build_model("lenet-bn", 10, 1, 28).state_dict().items()
             if v.is_floating_point()}
BN = lenet_names(lambda m: isinstance(m, _BatchNorm))
HEAD = {"classifier.6.weight", "classifier.6.bias"}
SHARED = (Kind.SHARED_TENSORS, "")


@pytest.mark.parametrize("method_name,private,expected", [
    ("fedavg", None, ALL_FLOAT),
    ("fedprox", None, ALL_FLOAT),
    ("fedadam", None, ALL_FLOAT),
    ("fedmedian", None, ALL_FLOAT),
    ("fedbn", None, ALL_FLOAT - BN),
    ("fedper", None, ALL_FLOAT - HEAD),
    ("fedprox", ["bn"], ALL_FLOAT - BN),
    ("fedavg", ["bn", "head"], ALL_FLOAT - BN - HEAD),
])
def test_single_model_methods_upload_only_shared(tmp_path, method_name, private, expected):
    received, _ = run_federation(tmp_path, method_name, private)
    assert len(received) == 4  # 2 edges x 2 rounds
    for _, sections in received:
        assert list(sections) == [SHARED]
        assert set(sections[SHARED]) == {f"model/{k}" for k in expected}


def test_local_only_uploads_nothing(tmp_path):
    received, engine = run_federation(tmp_path, "local")
    assert all(sections == {} for _, sections in received)
    assert engine.history["rounds"][-1]["bytes"]["up"].keys() == {"meta"}


def test_ditto_keeps_the_personal_model_home(tmp_path):
    received, _ = run_federation(tmp_path, "ditto")
    for _, sections in received:
        assert set(sections[SHARED]) == {f"global/{k}" for k in ALL_FLOAT}


def test_scaffold_sends_control_variates(tmp_path):
    received, engine = run_federation(tmp_path, "scaffold")
    params = {f"model/{k}" for k, _ in build_model("lenet-bn", 10, 1, 28).named_parameters()}
    for _, sections in received:
        assert set(sections[(Kind.CONTROL, "")]) == params
    control = engine.aggregator.state[(Kind.CONTROL, "")]
    assert any(float(t.abs().sum()) > 0 for t in control.values())
    assert all(torch.isfinite(t).all() for t in control.values())


def test_plugin_method_with_its_own_phase_and_per_edge_downlink(tmp_path):
    """A method loaded as module:Class adds a phase before train and sends each edge its
    own section; each edge echoes what it got, so the server can check the routing."""
    _, engine = run_federation(tmp_path, "plugin_methods:CensusAvg", sizes=[50, 150])
    record = engine.history["rounds"][-1]
    n = record["census"]["num_examples"]
    assert 30 < n["e0"] < 50 and 110 < n["e1"] < 130  # the train splits of 50 and 150 samples
    expected = {e: round(n[e] / (n["e0"] + n["e1"]), 6) for e in n}
    assert engine.aggregator.echoes == [expected, expected]
    assert record["census"]["received"] == ["e0", "e1"]
    assert record["bytes"]["up"]["scalar_summary"]["raw"] == 4 * 4  # census + echo, 2 edges


@pytest.mark.parametrize("method_name", ["fedbn", "ditto", "pfedme", "fedavgft", "pfedla"])
def test_export_and_predict_equal_the_edges_own_evaluation(tmp_path, method_name):
    from fedattn_shared.data import load_edge_data
    from fl_edge import export as tools

    run_federation(tmp_path, method_name, rounds=2, eval_detail=True)  # the matrix: the full check
    history = json.loads((tmp_path / "server" / "history.json").read_text())
    history_eval = history["rounds"][-1]["evaluation"]["per_edge"]["e1"]["test"]
    out = tmp_path / "e1.safetensors"
    model = tools.export(tmp_path / "state-1", out)
    data = load_edge_data(tmp_path / "data-1", model.train)
    for loaded in (model, tools.from_export(out)):
        probs = tools.predict(loaded, data.test.x)
        confusion = torch.zeros(10, 10, dtype=torch.int64)
        confusion.index_put_((data.test.y, probs.argmax(1)), torch.tensor(1), accumulate=True)
        assert confusion.tolist() == history_eval["confusion"]


def test_init_weights_reach_shared_and_private_tensors(tmp_path):
    """--init-weights: the global starts from the file, and edges without state get the
    full initial models once, so private tensors (FedPer's head) start there too."""
    from fedattn_shared.state import StateError, save_tensors
    from fl_edge import export as tools

    pretrained = build_model("lenet-bn", 10, 1, 28)
    with torch.no_grad():
        for p in pretrained.parameters():
            p.fill_(0.0125)
    save_tensors(tmp_path / "pretrained.safetensors", pretrained.state_dict())
    run_federation(tmp_path, "fedper", rounds=1, lr=1e-9,
                   init_weights=str(tmp_path / "pretrained.safetensors"))
    for edge in ("state-0", "state-1"):
        model = tools.from_state_dir(tmp_path / edge).algo.models["model"]
        head = model.state_dict()["classifier.6.weight"]  # private: only the init can set it
        assert torch.allclose(head, torch.full_like(head, 0.0125), atol=1e-6)
        conv = model.state_dict()["features.0.weight"]
        assert torch.allclose(conv, torch.full_like(conv, 0.0125), atol=1e-6)

    save_tensors(tmp_path / "bad.safetensors", {"features.0.weight": torch.zeros(3)})
    with pytest.raises(StateError, match="features.0.weight has shape"):
        run_federation(tmp_path / "bad", "fedper", init_weights=str(tmp_path / "bad.safetensors"))

"""The run configuration a server sends every edge (``fedattn_shared.runconfig``): one
typed, versioned value, serialised once on the server and parsed once on the edge.

The bytes a server sends are what they were before the contract was typed (compared
with the dictionary the server used to build, key by key); a garbled, adversarial or
later-version config is one ``RunConfigError`` naming its key, and a real fl-edge given
one by a real server exits 2 with one line that says why (the server hears why when the
refusal is a contract version), never a traceback from deep in training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys

import pytest
import torch
from conftest import edge_data, serving, wait_for

from fedattn_shared.compress import CompressSpec
from fedattn_shared.config import DPConfig, ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.privacy.secagg import SecAggPolicy
from fedattn_shared.runconfig import RUN_CONFIG_VERSION, RunConfig, RunConfigError
from fedattn_shared.state import StateError
from fl_edge.export import build
from fl_server.app import ServerApp


def method(name: str = "fedavg", dp: DPConfig | None = None, **train):
    cls = load_method(name)
    return cls(MethodContext(TrainConfig(**train), cls.Params(), dp=dp))


def legacy_json(m, *, secagg=None, compress="", mode="sync", eval_detail=False) -> str:
    """The run config as the server built it before ``RunConfig`` (fl_server.history,
    31fb8f5): the bytes the typed contract must keep."""
    config = {"method": m.name, "train": m.train.__dict__, "params": m.describe_params()}
    if m.dp is not None:
        config["dp"] = dataclasses.asdict(m.dp)
    if secagg is not None:
        config["secagg"] = secagg.to_config()
    if compress:
        config["compress"] = compress
    if mode == "async":
        config["mode"] = "async"
    if eval_detail:
        config["eval_detail"] = True
    return json.dumps(config, sort_keys=True)


DP = DPConfig(enabled=True, target_epsilon=8.0, planned_rounds=3)
POLICY = SecAggPolicy(threshold=0.6, graph="full", clip=8.0, bits=8, block=256, max_update=4.0)
CASES = {
    "plain": (method(), {}),
    "dp": (method(dp=DP, model="lenet-bn+gn"), {}),
    "secagg+int8": (method(), {"secagg": POLICY, "compress": "up=int8:256"}),
    "async+codecs": (method(), {"compress": "up=topk:0.1+ef,down=fp16", "mode": "async"}),
    "eval-detail": (method("fedprox", lr=0.1, private=["bn"]), {"eval_detail": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_server_sends_the_bytes_it_sent_before_the_contract_was_typed(case):
    m, extra = CASES[case]
    config = RunConfig(method=m.name, train=m.train, params=m.describe_params(), dp=m.dp,
                       secagg=extra.get("secagg"),
                       compress=CompressSpec.parse(extra.get("compress", "")),
                       mode=extra.get("mode", "sync"), eval_detail=extra.get("eval_detail", False))
    text = config.to_json()
    assert text == legacy_json(m, **extra)
    assert "version" not in json.loads(text)  # version 1 is the config without the key
    parsed = RunConfig.from_json(text)
    assert parsed.to_json() == text  # parsed once, it says the same
    assert (parsed.train, parsed.dp, parsed.secagg, parsed.mode, parsed.version) == (
        m.train, m.dp, extra.get("secagg"), extra.get("mode", "sync"), RUN_CONFIG_VERSION)
    assert parsed.compress.text == extra.get("compress", "")


def test_the_engine_serialises_the_servers_config_once_as_a_run_config(tmp_path):
    """What a ServerApp sends is ``RunConfig.to_json`` of its settings."""
    m = method()
    cfg = ServerConfig(insecure=True, port=0, checkpoint_dir=str(tmp_path / "s"),
                       compress="up=int8,down=fp16", mode="async")
    app = ServerApp(cfg, m.train, m)
    assert app.engine.config_json == legacy_json(m, compress="up=int8:256,down=fp16", mode="async")
    assert RunConfig.from_json(app.engine.config_json).mode == "async"


GOOD = json.loads(legacy_json(method()))


def garbled(**changes) -> str:
    return json.dumps({k: v for k, v in {**GOOD, **changes}.items() if v is not ...})


@pytest.mark.parametrize("text, key, needle", [
    ("", "", "not valid JSON"),
    ("{\"method\": \"fedavg\"", "", "not valid JSON"),
    (b"\xff\xfe{}", "", "not valid JSON"),
    ("[" * 200_000 + "]" * 200_000, "", "nested too deeply"),
    ("[1, 2]", "", "expected a JSON object, got list"),
    ("null", "", "got NoneType"),
    (garbled(version=2), "version", "run config version 2 is not one this fedattn knows"),
    (garbled(version=10**30), "version", "is not one this fedattn knows"),
    (garbled(version="1"), "version", "version must be an integer"),
    (garbled(version=True), "version", "version must be an integer"),
    (garbled(version=1.0), "version", "version must be an integer"),
    (garbled(schedule="x"), "schedule", "unknown keys ['schedule']"),
    (garbled(method=...), "method", "missing 'method'"),
    (garbled(train=...), "train", "missing 'train'"),
    (garbled(method=["fedavg"]), "method", "method must be a string"),
    (garbled(train=[1]), "train", "train must be an object"),
    (garbled(train={"lr": "fast"}), "train", "train.lr: expected float"),
    (garbled(train={"lr": -1.0}), "train", "train.lr must be > 0"),
    (garbled(train={"x" * 10_000: 1}), "train", "unknown key train.xxx"),
    (garbled(params=7), "params", "params must be an object"),
    (garbled(dp={"enabled": True}), "dp", "--dp needs dp.target_epsilon"),
    (garbled(dp={"enabled": True, "target_epsilon": 1.0},
             train={"clip_grad_norm": 1.0}), "dp", "does not combine with --dp"),
    (garbled(secagg={"threshold": 0.1}), "secagg", "secagg.threshold must be in"),
    (garbled(secagg={"moduli": 1}), "secagg", "unknown fields"),
    (garbled(compress="up=zstd"), "compress", "unknown codec 'zstd'"),
    (garbled(compress=8), "compress", "compress must be a string"),
    (garbled(mode="both"), "mode", "mode 'both' is not one of \"sync\", \"async\""),
    (garbled(mode=["async"]), "mode", "is not one of"),
    (garbled(eval_detail=1), "eval_detail", "is not one of false, true"),
])
def test_a_garbled_or_unknown_run_config_is_one_error_naming_its_key(text, key, needle):
    with pytest.raises(RunConfigError) as err:
        RunConfig.from_json(text)
    assert err.value.key == key
    assert needle in str(err.value)
    assert len(str(err.value)) < 600  # a hostile server does not choose the message's size


def test_an_unknown_method_name_is_left_to_the_edges_allowlist():
    """Parsing imports nothing: a module:Class the server names is a string until the
    edge's allowlist accepts it."""
    config = RunConfig.from_json(garbled(method="evil.module:Class"))
    assert config.method == "evil.module:Class"
    assert "evil" not in sys.modules


# ---- a real fl-edge against a real server serving a bad config ------------------------------
def test_a_real_edge_refuses_a_later_or_garbled_run_config_with_one_line(cluster, tmp_path,
                                                                         caplog):
    """A server (a later release, or a hostile one) serves a contract version this edge
    does not know, then a garbled config: a real fl-edge exits 2 before it builds
    anything, with one line naming the problem and no traceback; the version refusal is
    told to the server, which logs why the edge left."""
    caplog.set_level(logging.INFO, logger="fl_server")
    m = method()
    cfg = ServerConfig(rounds=1, min_edges=1, host="127.0.0.1", port=0, insecure=True,
                       checkpoint_dir=str(tmp_path / "server"), poll_timeout=2.0)
    app = ServerApp(cfg, m.train, m)
    later = json.dumps({**json.loads(app.engine.config_json), "version": 2, "schedule": "x"},
                       sort_keys=True)
    data = edge_data(tmp_path / "data")
    with serving(app) as port:
        app.engine.config_json = later
        edge = cluster.edge(data, "v", port=port)
        assert edge.wait(90) == 2
        refusal = ("refusing the server's run configuration: run config version 2 is not one "
                   "this fedattn knows (it reads version 1)")
        lines = [line for line in edge.log().splitlines() if "error" in line.lower()]
        assert len(lines) == 1 and refusal in lines[0], edge.log()
        assert "Traceback" not in edge.log() and "trained" not in edge.log()
        told = "refused the server's run configuration: run config version 2"
        wait_for(lambda: any("edge v left" in r.getMessage() and told in r.getMessage()
                             for r in caplog.records), 30, "the server hearing why")

        app.engine.config_json = '{"method": "fedavg", "train": {"lr": 0.1}, "params": [}'
        edge = cluster.edge(data, "g", port=port)
        assert edge.wait(90) == 2
        lines = [line for line in edge.log().splitlines() if "error" in line.lower()]
        assert len(lines) == 1, edge.log()
        assert "cannot use the server's configuration: not valid JSON" in lines[0]
        assert "Traceback" not in edge.log()
    assert not (tmp_path / "state-v" / "run-config.json").exists()
    assert not (tmp_path / "state-g" / "run-config.json").exists()


def test_a_stored_run_config_is_read_through_the_same_contract():
    """``fl-edge export``/``predict`` rebuild the model from the config the state dir
    stored: parsed by ``RunConfig`` too, a damaged one is a StateError naming it."""
    method_, _, train, fingerprint = build(legacy_json(method()), torch.device("cpu"))
    assert (method_.name, train, fingerprint) == ("fedavg", TrainConfig(),
                                                  method().fingerprint(method().build_models()))
    for text, needle in [("{", "not valid JSON"), (garbled(version=3), "version 3"),
                         (garbled(params={"mu": 1}), "unknown key fedavg.mu")]:
        with pytest.raises(StateError, match=f"stored run config: .*{needle}"):
            build(text, torch.device("cpu"))

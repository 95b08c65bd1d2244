"""The method conformance suite: what every method promises, checked for every method the
registry lists (``available_methods()``, including the entry-point plug-in in
tests/plugins/) and the module:Class test methods, on a small model and a few samples.
A new method gets these tests for free, as a new optimizer gets torch's.

1. its uploads match its declared schema, in every phase it declares, after a real
   codec/transport round trip;
2. its private tensors never travel: a real federation (ServerApp serving gRPC, two
   EdgeDaemons) with a spy on what the aggregator receives, checked by name and by value;
3. the edge's private state and the server's aggregator state round-trip bit-identically;
4. DP-SGD support and refusal agree with what actually runs under Opacus;
5. secure aggregation accepts it exactly when its summable and clear sections cover its
   schema;
6. a method is found by entry point like an installed one;
7. on models by reference (a timm model, a user's bare builder, a declared entry point), it
   runs a round whose uploads match its schema, or refuses naming what the model lacks."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import read_history, serving, write_edge_dirs
from test_bad_input import assert_bit_identical, tensor_bytes
from test_dp import dp_config, private_edge, split
from test_serialize import transmit

from fedattn_shared.compress import load_codec
from fedattn_shared.compress.apply import UplinkCompression
from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import (
    AggregatorKind,
    Method,
    MethodContext,
    SectionSpec,
    available_methods,
    check_method_allowed,
    load_method,
)
from fedattn_shared.privacy.dp import check_dp
from fedattn_shared.schema import EVALUATE, TRAIN, Payload
from fedattn_shared.state import load_tensors, save_tensors
from fedattn_shared.wire.payload import nonfinite_tensors
from fl_edge.daemon import EdgeDaemon, EdgeOptions
from fl_edge.store import PrivateStore
from fl_edge.trainer import train_local
from fl_server.app import ServerApp
from fl_server.secagg import SecAggDriver
from fl_server.settings import resolve_settings

CPU = torch.device("cpu")
PLUGINS = Path(__file__).resolve().parent / "plugins"
PLUGIN = "example-smooth"  # the entry point tests/plugins' distribution declares
MODULE_METHODS = ["plugin_methods:CensusAvg", "marker_method:MarkedAvg"]
# Tried in order until the method accepts one: what a method needs of its model (squeeze-
# excitation, encoder tokens, a feature width its heads divide) is the method's to refuse.
SMALL_MODELS = ("lenet-bn", "se-cnn", "mobilenet-v3-compact", "resnet10-cifar-compact")
EDGES = ("e0", "e1")
BATCH = 8


def registered_methods() -> list[str]:
    """``available_methods()`` with the plug-in's folder on the path, for parametrizing:
    the folder leaves the path again, so other test modules see the installed set only."""
    sys.path.insert(0, str(PLUGINS))
    try:
        return available_methods()
    finally:
        sys.path.remove(str(PLUGINS))


METHODS = registered_methods() + MODULE_METHODS
#: The methods that declare ``dp_params`` (the built-in ones: the plug-ins declare none).
DP_PARAMS_METHODS = [m for m in available_methods() if load_method(m).dp_params]


# Known defects, by test: each keeps failing (a strict xfail) until the defect is fixed.
KNOWN_DEFECTS: dict[str, dict[str, str]] = {
    # private tensors whose values the method publishes under a shared name
    "travel": {
        "pfedme": "pfedme (buffers_from_personal=True, the default): the personal model's BN "
                  "running statistics are copied into the global model w, which is uploaded, so "
                  "personal/*.running_mean|var travel by value as global/*; a reconstruction the "
                  "module documents, but the split declares them private",
    },
    # aggregator state that the checkpoint does not hold (none known)
    "server state": {},
    # the method says it supports DP-SGD, yet nothing it accepts runs under it (none known)
    "dp": {},
}


def methods_except(defects: dict[str, str], raises: type | tuple[type, ...] = AssertionError):
    """METHODS as parameters, those with a known defect marked as strict xfails naming it:
    the test must keep failing on them until the defect is fixed."""
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, raises=raises, reason=defects[n]))
            if n in defects else n for n in METHODS]


@pytest.fixture(autouse=True)
def plugin_installed(monkeypatch) -> None:
    """The plug-in distribution is installed for the test: importable and registered here,
    and in any process started from here."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(PLUGINS), os.environ.get("PYTHONPATH", "")) if p))


def small_method(name: str, dp=None, gn: bool = False, params: dict | None = None,
                 **train) -> Method:
    """The method on the first small model it accepts (its own default model first);
    ``gn``: the models' GroupNorm variants (what DP-SGD needs); ``params`` over the
    method's defaults."""
    cls = load_method(name)
    refusals = []
    for model in dict.fromkeys([cls.default_model or SMALL_MODELS[0], *SMALL_MODELS]):
        model = f"{model}+gn" if gn and not model.startswith("anfr") else model
        config = TrainConfig(model=model, lr=0.05, batch_size=BATCH, **train)
        try:
            return cls(MethodContext(config, dataclasses.replace(cls.Params(), **(params or {})),
                                     dp=dp))
        except ValueError as err:
            refusals.append(f"{model}: {err}")
    raise LookupError(f"{name} accepts none of the small models: {refusals}")


def qualified_state(models: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {f"{m}/{k}": t for m, model in models.items() for k, t in model.state_dict().items()}


def private_state(method: Method, models: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every model tensor the method's split keeps on the edge (not a shared tensor)."""
    shared = method.shared_specs(models)
    return {k: t for k, t in qualified_state(models).items() if k not in shared}


def assert_same_payload(a: Payload, b: Payload, ordered: bool = True) -> None:
    """Bit for bit the same sections and tensors; ``ordered``: in the same order too."""
    def layout(payload):
        sections = [(s.kind, s.name, list(s.tensors) if ordered else sorted(s.tensors))
                    for s in payload.sections]
        return sections if ordered else sorted(sections)

    assert layout(a) == layout(b)
    for sa in a.sections:
        sb = b.get(sa.kind, sa.name)
        for name, t in sa.tensors.items():
            u = sb.tensors[name]
            assert (t.dtype, t.shape, tensor_bytes(t)) == (u.dtype, u.shape, tensor_bytes(u)), \
                f"{sa.kind.name}:{sa.name!r} {name} differs"


def assert_matches_schema(upload: Payload, schema: list[SectionSpec]) -> None:
    """The server's rule for an upload: exactly the schema's sections, each once; in each,
    every required tensor and no unknown one, each of the declared dtype and shape."""
    expected = {(s.kind, s.name): s for s in schema}
    got = [(s.kind, s.name) for s in upload.sections]
    assert len(set(got)) == len(got), f"a section appears twice: {got}"
    assert set(got) == set(expected), f"sections {got}, schema {list(expected)}"
    for section in upload.sections:
        spec = expected[(section.kind, section.name)]
        names = set(section.tensors)
        assert spec.required <= names <= set(spec.tensors), \
            f"{section.kind.name}: missing {spec.required - names}, unknown {names - set(spec.tensors)}"
        for name in names:
            t, want = section.tensors[name], spec.tensors[name]
            assert (t.dtype, tuple(t.shape)) == (want.dtype, want.shape), f"{name}: {t.dtype} {t.shape}"


class Round:
    """One round of a method driven by hand over the real codec: the aggregator's downlinks
    to two edges, the real trainer, each upload checked against the schema and accepted."""

    def __init__(self, name: str, method: Method | None = None):
        if method is not None:
            self.method = method
        else:
            try:  # momentum: optimizer state for the edge to save
                self.method = small_method(name, momentum=0.9)
            except LookupError:  # a method that takes plain SGD only (SCAFFOLD) has none
                self.method = small_method(name)
        t = self.method.train
        self.data = split(3 * BATCH, channels=t.in_channels, size=t.image_size, seed=3)
        torch.manual_seed(0)
        self.server_models = self.method.build_models()
        self.aggregator = self.method.server(self.server_models)
        self.edges = {e: self.method.edge(self.method.build_models(), CPU) for e in EDGES}
        self.aggregator.begin_round(1, list(EDGES), len(EDGES))
        self.uploads: dict[str, list[Payload]] = {}
        for phase in self.method.phases:
            if phase != EVALUATE:
                self.run_phase(phase)

    def run_phase(self, phase: str) -> None:
        common = transmit(self.aggregator.broadcast(phase), 1 << 16)
        schema = self.method.uplink_schema(phase, self.server_models)
        self.uploads[phase] = []
        for i, (edge_id, algo) in enumerate(self.edges.items()):
            algo.receive(phase, common, transmit(self.aggregator.personal(edge_id, phase), 1 << 16))
            if phase == TRAIN:
                steps = train_local(algo, self.data, 1, BATCH, i, CPU, progress=False).steps
                assert steps > 0
                upload = algo.after_train(steps)
            else:
                upload = algo.phase_upload(phase)
            received = transmit(upload, 1 << 16)
            assert_matches_schema(received, schema)
            assert nonfinite_tensors(received) == []
            self.uploads[phase].append(received)
            self.aggregator.accept_phase(phase, edge_id, received, float(len(self.data)))
        self.aggregator.close_phase(phase)


@pytest.fixture(scope="module")
def rounds() -> dict[str, Round]:
    """One hand-driven round per method, shared by the tests that look at its results."""
    return {}


def driven(rounds: dict[str, Round], name: str) -> Round:
    if name not in rounds:
        rounds[name] = Round(name)
    return rounds[name]


# ---- 1. uploads match the schema --------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
def test_uploads_match_the_declared_schema_in_every_phase(name, rounds):
    """Every upload of every phase the method declares, from edges that received the
    server's downlinks and trained with the real loop, passes the server's schema rule
    after the codec; nothing is uploaded in evaluate, where the edge scores every class."""
    r = driven(rounds, name)
    assert set(r.uploads) == set(r.method.phases) - {EVALUATE}
    assert r.method.uplink_schema(EVALUATE, r.server_models) == []
    for edge_id, algo in r.edges.items():
        algo.receive(EVALUATE, transmit(r.aggregator.broadcast(EVALUATE), 1 << 16),
                     transmit(r.aggregator.personal(edge_id, EVALUATE), 1 << 16))
        scorer, _ = algo.before_evaluate()
        with torch.no_grad():
            scores = scorer.predict(r.data.x[:5])
        assert scores.shape == (5, r.method.train.num_classes)
        assert torch.isfinite(scores).all()


@pytest.mark.parametrize("name", METHODS)
def test_every_upload_survives_the_codec_path(name, rounds):
    """``--compress up=fp16`` on every phase's uploads, each section by the method's rule
    for its kind: coded exactly as the server's coded schema says, decoded back to the
    method's schema, the values within fp16's precision (exact sections unchanged)."""
    r = driven(rounds, name)
    up = UplinkCompression(r.method, r.server_models, load_codec("fp16"))
    for phase, uploads in r.uploads.items():
        common = r.aggregator.broadcast(phase)
        schema = r.method.uplink_schema(phase, r.server_models)
        for upload in uploads:
            coded, _ = up.encode(phase, upload, common, torch.Generator().manual_seed(0))
            assert_matches_schema(coded, up.schema(phase))
            decoded = up.decode(phase, coded, common)
            assert_matches_schema(decoded, schema)
            for sent, got in zip(upload.sections, decoded.sections, strict=True):
                for tensor, value in sent.tensors.items():
                    back = got.tensors[tensor]
                    if not value.is_floating_point() or up.rule(
                            next(s for s in schema if (s.kind, s.name) == (sent.kind, sent.name))
                    ) == "exact":
                        assert torch.equal(back, value), f"{phase} {tensor}"
                        continue
                    scale = max(1.0, float(value.abs().max()))
                    torch.testing.assert_close(back, value, rtol=0, atol=2e-3 * scale,
                                               msg=lambda m, t=tensor, p=phase: f"{p} {t}: {m}")


# ---- 3. state round trips --------------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
def test_edge_private_state_round_trips_bit_identically(name, rounds, tmp_path):
    """What PrivateStore saves of a trained edge (private model tensors, method state,
    optimizer state) loads into a fresh edge bit for bit."""
    r = driven(rounds, name)
    trained = r.edges[EDGES[0]]
    fingerprint = r.method.fingerprint(trained.models)
    PrivateStore(tmp_path / "a").save(trained, fingerprint, 1, TRAIN)
    torch.manual_seed(99)  # a fresh edge starts elsewhere
    fresh = r.method.edge(r.method.build_models(), CPU)
    PrivateStore(tmp_path / "a").load(fresh, fingerprint)
    assert_bit_identical(private_state(r.method, fresh.models),
                         private_state(r.method, trained.models))
    # Method state and optimizer state: what the reloaded edge saves is what was saved.
    PrivateStore(tmp_path / "b").save(fresh, fingerprint, 1, TRAIN)
    saved, meta = load_tensors(tmp_path / "a" / "private.safetensors")
    again, meta_again = load_tensors(tmp_path / "b" / "private.safetensors")
    assert meta == meta_again
    assert_bit_identical(again, saved)


@pytest.mark.parametrize("name", methods_except(KNOWN_DEFECTS["server state"]))
def test_aggregator_state_round_trips_to_the_same_server(name, rounds, tmp_path):
    """The aggregator's state through the checkpoint's formats (safetensors, JSON) into a
    fresh aggregator: the same downlinks now, and after one more round of the same uploads
    (which also covers state no downlink shows, a server optimizer's moments)."""
    r = driven(rounds, name)
    save_tensors(tmp_path / "state.safetensors", r.aggregator.state_tensors())
    meta = json.loads(json.dumps(r.aggregator.state_meta()))
    torch.manual_seed(99)  # fresh models start elsewhere
    restored = r.method.server(r.method.build_models())
    restored.load_state(load_tensors(tmp_path / "state.safetensors")[0], meta)
    servers = (r.aggregator, restored)
    for phase in r.method.phases:
        assert_same_payload(*(s.broadcast(phase) for s in servers), ordered=False)
    for server in servers:  # the original goes on too: this test is the last to use it
        server.begin_round(2, list(EDGES), len(EDGES))
        for phase, uploads in r.uploads.items():
            for edge_id, upload in zip(EDGES, uploads, strict=True):
                server.personal(edge_id, phase)
                server.accept_phase(phase, edge_id, upload, float(len(r.data)))
            server.close_phase(phase)
    for phase in r.method.phases:
        assert_same_payload(*(s.broadcast(phase) for s in servers), ordered=False)
    for edge_id in EDGES:
        assert_same_payload(*(s.personal(edge_id, TRAIN) for s in servers), ordered=False)


def test_a_checkpointed_aggregator_broadcasts_in_the_same_order(tmp_path):
    method = small_method("fedavg")
    aggregator = method.server(method.build_models())
    save_tensors(tmp_path / "state.safetensors", aggregator.state_tensors())
    restored = method.server(method.build_models())
    restored.load_state(load_tensors(tmp_path / "state.safetensors")[0], aggregator.state_meta())
    assert_same_payload(aggregator.broadcast(TRAIN), restored.broadcast(TRAIN))


# ---- 2. private tensors never travel ------------------------------------------------------


def spy_on_uploads(method: Method) -> list[tuple[str, str, dict[str, bytes]]]:
    """Wraps the aggregator the server builds: every upload it accepts is recorded as
    (phase, edge, {section:tensor name: raw bytes}), copied before the buffer is reused."""
    received: list[tuple[str, str, dict[str, bytes]]] = []
    build = method.server

    def server(models):
        aggregator = build(models)
        accept = aggregator.accept_phase

        def spy(phase, edge_id, upload, weight):
            received.append((phase, edge_id, {f"{s.kind.name}:{s.name}:{n}": tensor_bytes(t)
                                              for s in upload.sections
                                              for n, t in s.tensors.items()}))
            return accept(phase, edge_id, upload, weight)

        aggregator.accept_phase = spy
        return aggregator

    method.server = server
    return received


def federate(tmp_path: Path, name: str, method: Method) -> list[tuple[str, str, dict[str, bytes]]]:
    """One round, two edges, the real server and edges over gRPC on loopback."""
    received = spy_on_uploads(method)
    cfg = ServerConfig(method=name, rounds=1, min_edges=len(EDGES), host="127.0.0.1", port=0,
                       checkpoint_dir=str(tmp_path / "server"), insecure=True,
                       poll_timeout=2.0, round_timeout=60)
    dirs = write_edge_dirs(tmp_path, len(EDGES), 30)
    codes: dict[str, int] = {}
    with serving(ServerApp(cfg, method.train, method)) as port:
        def edge(edge_id: str, data_dir: Path) -> None:
            options = EdgeOptions(server=f"127.0.0.1:{port}", data_dir=data_dir,
                                  state_dir=tmp_path / f"state-{edge_id}", name=edge_id,
                                  device="cpu", retry_for=30, progress=False,
                                  allow_methods=(name,) if ":" in name else ())
            codes[edge_id] = EdgeDaemon(options).run()

        threads = [threading.Thread(target=edge, args=a) for a in zip(EDGES, dirs, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert codes == {e: 0 for e in EDGES}
    history = read_history(tmp_path / "server")
    assert len(history["rounds"]) == 1
    assert history["rounds"][0]["evaluate"]["received"] == list(EDGES)
    return received


def telling(tensor: torch.Tensor) -> bool:
    """A tensor whose bytes identify it: floating, not tiny, not one repeated value."""
    return tensor.is_floating_point() and tensor.numel() >= 16 and \
        bool((tensor != tensor.reshape(-1)[0]).any())


@pytest.mark.parametrize("name", methods_except(KNOWN_DEFECTS["travel"]))
def test_private_tensors_never_travel(name, tmp_path):
    """A real federation: every phase's upload of both edges passed the server's gate and
    reached the aggregator; none carries a private tensor's name, nor its bytes."""
    method = small_method(name)
    received = federate(tmp_path, name, method)
    phases = [p for p in method.phases if p != EVALUATE]
    assert sorted((p, e) for p, e, _ in received) == sorted((p, e) for p in phases for e in EDGES)
    uploaded = [(key, blob) for _, _, tensors in received for key, blob in tensors.items()]
    for edge_id in EDGES:
        store = PrivateStore(tmp_path / f"state-{edge_id}")
        algo = method.edge(method.build_models(), CPU)
        store.load(algo, store.stored_fingerprint())
        private = private_state(method, algo.models)
        names = {key.rsplit(":", 1)[1] for key, _ in uploaded}
        assert not names & set(private), f"private tensors uploaded: {sorted(names & set(private))}"
        for key, tensor in private.items():
            if telling(tensor):
                leaked = [where for where, blob in uploaded if tensor_bytes(tensor) in blob]
                assert not leaked, f"{edge_id}'s private {key} travelled inside {leaked}"


# ---- 4. DP-SGD: declared support agrees with what runs ---------------------------------------


@pytest.mark.parametrize("name", methods_except(KNOWN_DEFECTS["dp"], (ValueError, LookupError)))
def test_dp_refusal_is_none_exactly_when_a_dp_sgd_step_runs(name):
    """A method without a DP refusal passes check_dp on a GroupNorm model and takes real
    DP-SGD steps (Opacus); one with a refusal is refused by check_dp with it, naming itself."""
    refusal = small_method(name).dp_refusal()
    if refusal is not None:
        method = small_method(name, dp=dp_config())
        with pytest.raises(ValueError) as refused:
            check_dp(method)
        assert refusal in str(refused.value) and method.name in refusal
        return
    method = small_method(name, dp=dp_config(stats_in_clear=True), gn=True)
    check_dp(method)
    data = split(4 * BATCH, seed=5)
    algo, privacy = private_edge(method, data, BATCH)
    before = {k: t.clone() for k, t in qualified_state(algo.models).items()}
    steps = train_local(algo, data, 1, BATCH, 5, CPU, progress=False, privacy=privacy).steps
    after = qualified_state(algo.models)
    assert steps > 0 and all(torch.isfinite(t).all() for t in after.values() if t.is_floating_point())
    assert any(not torch.equal(before[k], t) for k, t in after.items() if t.is_floating_point())


@pytest.mark.parametrize("name", DP_PARAMS_METHODS)
def test_dp_params_are_what_dp_sgd_needs(name):
    """A method's declared ``dp_params`` (what fl-demo --dp sets for the user) are what
    its DP refusal asks for: refused without them, covered with them."""
    assert small_method(name).dp_refusal() is not None
    assert small_method(name, params=dict(load_method(name).dp_params)).dp_refusal() is None


# ---- 5. secure aggregation: summability agrees with the uploads ------------------------------


@pytest.mark.parametrize("name", METHODS)
def test_secagg_accepts_exactly_what_its_sections_cover(name):
    """Summable and clear sections lie within the schema and apart; secure aggregation
    accepts the method exactly when they cover every phase's schema and something is
    summed, masks exactly the summable phases, and never takes a collect-then-learn method."""
    method = small_method(name)
    models = method.build_models()
    covered, summed = True, False
    for phase in (p for p in method.phases if p != EVALUATE):
        schema = {(s.kind, s.name) for s in method.uplink_schema(phase, models)}
        privacy = method.privacy(phase, models)
        summable, clear = set(privacy.summable), set(privacy.clear)
        assert summable <= schema and clear <= schema and not summable & clear, phase
        covered &= summable | clear == schema
        summed |= bool(summable)
    cfg = ServerConfig(secagg=True, secagg_graph="full")
    try:
        driver = SecAggDriver(resolve_settings(cfg), method, models, method.server(models))
    except ValueError as err:
        assert not (covered and summed), f"refused although its sections are covered: {err}"
        assert repr(method.name) in str(err)
        return
    assert covered and summed
    assert method.aggregator_kind != AggregatorKind.COLLECT
    assert all(driver.owns(p) == bool(method.privacy(p, models).summable)
               for p in method.phases if p != EVALUATE)


# ---- 7. referenced models ------------------------------------------------------------------

#: Models by reference (shared/models/reference.py): a timm model by name, a user's bare
#: builder (module:callable, declaring nothing), the same network declared in full as a
#: fedattn.models entry point of tests/plugins' distribution.
REFERENCED_MODELS = ("timm:test_resnet", "fedattn_example_model:tiny_se_net", "example-tiny-se")
#: What a method needs that a referenced model lacks: its refusal, which names the model
#: and what to declare (or why the model does not fit). Every other pair must run.
NOT_ANFR = "is not an ANFR network (weight-standardised convolutions with channel attention"
REFUSALS = {
    ("pfedla", "timm:test_resnet"): "no attention sites found in timm:test_resnet; declare "
                                    "them with a ModelSpec(..., attention_sites)",
    ("pfedla", "fedattn_example_model:tiny_se_net"):
        "no attention sites found in fedattn_example_model:tiny_se_net; declare them with a "
        "ModelSpec(..., attention_sites)",
    ("pfedka", "fedattn_example_model:tiny_se_net"):
        "no encoder tokens found in fedattn_example_model:tiny_se_net; declare them with a "
        "ModelSpec(..., tokens)",
    ("fedsap", "timm:test_resnet"): "fedsap: model 'timm:test_resnet' has no squeeze-excitation "
                                    "modules",
    **{("anfr", model): f"anfr: model {model!r} {NOT_ANFR}" for model in REFERENCED_MODELS},
}
#: timm's test_resnet downsamples 32x: at 64 px it leaves pFedKA 2x2 tokens.
IMAGE_SIZE = {"timm:test_resnet": 64}


def referenced_method(name: str, model: str) -> Method:
    cls = load_method(name)
    config = TrainConfig(model=model, lr=0.05, batch_size=BATCH,
                         image_size=IMAGE_SIZE.get(model, 28))
    return cls(MethodContext(config, cls.Params()))


@pytest.mark.parametrize("model", REFERENCED_MODELS)
@pytest.mark.parametrize("name", METHODS)
def test_every_method_runs_or_refuses_by_name_on_a_referenced_model(name, model):
    """Every method on every referenced model: a round over the real codec whose uploads
    match the schema, carrying no private tensor's name; or, where the model lacks what the
    method needs, a refusal at construction naming the model and what to declare."""
    try:
        method = referenced_method(name, model)
    except ValueError as err:
        assert (name, model) in REFUSALS, f"{name} refused {model}: {err}"
        assert REFUSALS[name, model] in str(err)
        return
    assert (name, model) not in REFUSALS, f"{name} runs on {model}; the table says it refuses"
    driven = Round(name, method)
    models = driven.method.build_models()
    private = set(private_state(driven.method, models))
    for uploads in driven.uploads.values():
        for upload in uploads:
            for section in upload.sections:
                assert not private & set(section.tensors), f"{name} uploads private tensors"


# ---- 6. registration by entry point ---------------------------------------------------------


def test_plugin_is_registered_through_its_entry_point(monkeypatch):
    """tests/plugins' distribution registers its method through the fedattn.methods entry
    point: listed and loaded here and in a child process, allowed on an edge without
    --allow-method, and gone again once the folder leaves the path."""
    cls = load_method(PLUGIN)
    assert PLUGIN in available_methods() and cls.name == PLUGIN
    assert cls.__module__ == "fedattn_example_plugin"
    check_method_allowed(PLUGIN)  # an edge takes it as installed, no --allow-method needed
    out = subprocess.run(
        [sys.executable, "-c", "from fedattn_shared.methods import available_methods as a; "
                               "print(' '.join(a()))"],
        capture_output=True, text=True, check=True, env=os.environ.copy()).stdout.split()
    assert PLUGIN in out
    monkeypatch.undo()  # uninstalled: the registry forgets it
    assert PLUGIN not in available_methods()
    with pytest.raises(ValueError, match=f"unknown method '{PLUGIN}'"):
        load_method(PLUGIN)


def test_every_registered_method_is_in_the_suite():
    """The suite's parameters are the registry: the installed methods and the plug-in."""
    assert PLUGIN in METHODS
    assert set(available_methods()) | {PLUGIN} <= set(METHODS)

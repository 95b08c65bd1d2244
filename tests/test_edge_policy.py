"""The edge's defences against a hostile server: its privacy policy (``--dp-max-epsilon``,
``--require-dp``, the budget pinned in its ledger, the bounds on delta), the method
allowlist (``--allow-method``: no import of a module the server names), and the downlink
cap derived from the run's models.

The policy and cap logic are tested as units; the refusals on the wire run a real
``fl-server`` (or, where the real server would refuse the hostile setting itself, a real
ServerApp in this process configured past its own checks, as a hostile operator would)
against real ``fl-edge`` processes, which must exit 2 naming the setting, before any
training."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import edge_data, serving

from fedattn_shared.config import ConfigError, DPConfig, ServerConfig, TrainConfig
from fedattn_shared.methods import (
    Method,
    MethodContext,
    available_methods,
    check_method_allowed,
    load_method,
)
from fedattn_shared.privacy.dp import PinnedPolicy, PolicyRefusal, PrivacyPolicy, PrivateTraining
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.state import StateError
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.serialize import encode
from fl_edge.daemon import EdgeDaemon, EdgeExit, EdgeOptions
from fl_edge.run import DOWNLINK_SLACK, downlink_cap
from fl_edge.session import DOWNLINK_CAP_BEFORE_SETUP
from fl_server import service as server_service
from fl_server.app import ServerApp
from fl_server.cli import main as server_main

CPU = torch.device("cpu")
GN = "lenet-bn+gn"
# Opacus' note on calibrating a short run (the alphas it searches): beside the point here.
pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")


def dp(**values) -> DPConfig:
    return DPConfig(**{"enabled": True, "target_epsilon": 8.0, "planned_rounds": 2, **values})


def fedavg(dp_config: DPConfig | None, model: str = GN) -> Method:
    cls = load_method("fedavg")
    return cls(MethodContext(TrainConfig(model=model), cls.Params(), dp=dp_config))


def private(dp_config: DPConfig, n: int = 100, ledger: dict | None = None,
            policy: PrivacyPolicy | None = None) -> PrivateTraining:
    method = fedavg(dp_config)
    return PrivateTraining(method.edge(method.build_models(), CPU), dp_config, n, 20, ledger,
                           policy=policy)


# ---- units: delta bounds, the policy, the pin ------------------------------------------------


@pytest.mark.parametrize("delta", [0.5, 0.6, 0.99, math.nan, -0.1])
def test_dp_config_refuses_a_delta_from_one_half(delta):
    with pytest.raises(ConfigError, match=r"dp.delta must be in \[0, 0.5\)"):
        dp(delta=delta).validate()
    dp(delta=0.49).validate()


def test_the_server_refuses_to_start_with_delta_0_6(capsys):
    assert server_main(["--insecure", "--dp", "--dp-epsilon", "8", "--dp-fix-model",
                        "--dp-delta", "0.6"]) == 2
    assert "dp.delta must be in [0, 0.5)" in capsys.readouterr().err


PIN = PinnedPolicy(epsilon=8.0, delta=1e-3, noise_multiplier=1.0, accountant="rdp")
MAX8 = PrivacyPolicy(max_epsilon=8.0)


@pytest.mark.parametrize("policy, pinned, config, refusal", [
    (MAX8, None, dp(target_epsilon=1000.0),
     "dp.target_epsilon: the server asks for 1000; this edge allows at most 8 (--dp-max-epsilon)"),
    (MAX8, None, dp(target_epsilon=8.0), None),
    (MAX8, None, dp(target_epsilon=0.0, noise_multiplier=1.0),
     "dp.target_epsilon: the server sets no budget (a fixed noise multiplier, unbounded spend); "
     "this edge allows at most 8 (--dp-max-epsilon)"),
    (MAX8, None, None, "dp: the server runs without DP-SGD (epsilon unbounded); this edge allows "
                       "at most epsilon 8 (--dp-max-epsilon)"),
    (PrivacyPolicy(require_dp=True), None, None, "this edge trains only under DP-SGD (--require-dp)"),
    (PrivacyPolicy(require_dp=True), None, dp(target_epsilon=1000.0), None),
    (PrivacyPolicy(), PIN, dp(target_epsilon=1000.0),
     "dp.target_epsilon: the server asks for 1000; this edge allows at most 8 (pinned in this "
     "state dir's privacy ledger"),
    (PrivacyPolicy(), PIN, None, "dp: the server runs without DP-SGD, but this state dir's "
                                 "privacy ledger is pinned to DP-SGD (epsilon 8, delta 0.001)"),
    (PrivacyPolicy(), PIN, dp(target_epsilon=4.0), None),  # stricter: fine
    (PrivacyPolicy(), PIN, dp(delta=0.01),
     "dp.delta: the server sends 0.01; this edge allows at most 0.001 (pinned"),
    (PrivacyPolicy(), PIN, dp(accountant="gdp"),
     "dp.accountant: the server uses 'gdp'; this state dir's privacy ledger is kept with 'rdp'"),
    (PrivacyPolicy(), None, None, None),
    # [dp] sections that skipped validate(), as a hostile server's would:
    (PrivacyPolicy(), None, dp(delta=0.6), "dp.delta: the server sends 0.6; this edge refuses "
                                           "any delta >= 0.5"),
    (MAX8, None, dp(target_epsilon=math.nan), "dp.target_epsilon: the server sends nan"),
    (PrivacyPolicy(), PIN, dp(target_epsilon=-1.0), "dp.target_epsilon: the server sends -1.0"),
])
def test_policy_check_names_the_field_the_server_value_and_the_limit(policy, pinned, config,
                                                                      refusal):
    if refusal is None:
        policy.check(config, pinned)
        return
    with pytest.raises(PolicyRefusal) as err:
        policy.check(config, pinned)
    assert refusal in str(err.value)


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_a_max_epsilon_must_be_finite_and_positive(value):
    with pytest.raises(ValueError, match="--dp-max-epsilon must be a finite number > 0"):
        PrivacyPolicy(max_epsilon=value)


def test_delta_must_be_below_one_over_n_k_and_the_pin():
    check = PrivacyPolicy.check_calibrated
    with pytest.raises(PolicyRefusal, match=r"dp.delta: the server's delta 0.01 is not below "
                                            r"1/n_k = 0.01 for this edge's 100 training samples"):
        check(0.01, 100, None, None)
    check(0.0099, 100, None, None)
    with pytest.raises(PolicyRefusal, match="resolves to delta 0.002 on this edge; it allows at "
                                            "most 0.001"):
        check(0.002, 100, 1.0, PIN)
    with pytest.raises(PolicyRefusal, match="dp.noise_multiplier: the server's run gives sigma "
                                            "0.9 per sampled batch on this edge; it allows no "
                                            "less than 1"):
        check(0.001, 100, 0.9, PIN)
    check(0.001, 100, 1.0, PIN)
    for nan in [(math.nan, 100, None, None), (0.001, 100, math.nan, PIN)]:
        with pytest.raises(PolicyRefusal):
            check(*nan)


def test_the_first_dp_run_pins_its_limits_and_later_runs_may_be_stricter_never_weaker():
    first = private(dp())
    assert first.pinned == PinnedPolicy(8.0, 0.001, first.batch_sigma, "rdp")
    ledger = json.loads(json.dumps(first.ledger()))  # as the store writes and reads it
    assert ledger["policy"] == {"epsilon": 8.0, "delta": 0.001,
                                "noise_multiplier": first.batch_sigma, "accountant": "rdp"}
    for weaker, field in [(dp(target_epsilon=1000.0), "dp.target_epsilon"),
                          (dp(planned_rounds=1), "dp.noise_multiplier"),  # less noise per step
                          (dp(noise_multiplier=first.batch_sigma / 2), "dp.noise_multiplier"),
                          (dp(delta=0.005), "dp.delta")]:
        with pytest.raises(PolicyRefusal, match=field):
            private(weaker, ledger=ledger)
    with pytest.raises(PolicyRefusal, match="resolves to delta 0.002"):
        private(dp(), n=50, ledger=ledger)  # delta 0.1/n_k grows when n_k shrinks
    again = private(dp(), ledger=ledger)  # the same run restarted: the same calibration
    assert again.pinned == first.pinned and again.budget == 8.0
    stricter = private(dp(target_epsilon=4.0), ledger=ledger)
    assert stricter.budget == 4.0
    assert stricter.ledger()["policy"]["epsilon"] == 8.0  # the ceiling stays the first one
    capped = private(dp(target_epsilon=0.0, noise_multiplier=5.0), policy=PrivacyPolicy(
        require_dp=True))
    assert math.isinf(capped.budget) and capped.ledger()["policy"]["epsilon"] is None


@pytest.fixture(scope="module")
def epsilon_8_ledger() -> dict:
    """The ledger of a first DP-SGD run at epsilon 8 (fresh copies for each test)."""
    return json.loads(json.dumps(private(dp()).ledger()))


def test_a_ledger_from_before_pins_pins_what_it_recorded(epsilon_8_ledger):
    legacy = {key: value for key, value in epsilon_8_ledger.items() if key != "policy"}
    with pytest.raises(PolicyRefusal, match="at most 8 .pinned"):
        private(dp(target_epsilon=1000.0), ledger=legacy)
    continued = private(dp(), ledger=legacy)
    assert continued.pinned == PinnedPolicy(8.0, 0.001, continued.batch_sigma, "rdp")


@pytest.mark.parametrize("policy", [{"epsilon": "x", "delta": 1e-3, "noise_multiplier": 1.0,
                                     "accountant": "rdp"},
                                    {"epsilon": 8.0, "delta": 0.7, "noise_multiplier": 1.0,
                                     "accountant": "rdp"},
                                    {"epsilon": 8.0}, "pinned"])
def test_an_unreadable_pin_is_never_reset_silently(policy, epsilon_8_ledger):
    ledger = {**epsilon_8_ledger, "policy": policy}
    with pytest.raises(StateError, match="pinned policy"):
        private(dp(), ledger=ledger)


# ---- units: the method allowlist -----------------------------------------------------------


@pytest.fixture
def probe_module(tmp_path, monkeypatch):
    """A module on sys.path that leaves a marker file when imported: (spec, marker)."""
    name = f"edge_policy_probe_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
        "from fedattn_shared.methods.fedavg import FedAvg\n\n\n"
        "class Probe(FedAvg):\n    name = 'probe'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{name}:Probe", marker
    sys.modules.pop(name, None)


def test_a_module_method_is_refused_before_import_unless_allowed(probe_module):
    spec, marker = probe_module
    with pytest.raises(ValueError, match="a module:Class outside the installed methods; this "
                                         "edge imports no module a server names unless started "
                                         "with --allow-method"):
        check_method_allowed(spec, allowed_specs=("other.module:Probe",))
    assert spec.partition(":")[0] not in sys.modules and not marker.exists()
    check_method_allowed(spec, allowed_specs=(spec,))
    assert load_method(spec).name == "probe" and marker.exists()  # the probe does work


def test_registered_methods_pass_and_anything_else_is_refused():
    for name in available_methods():
        check_method_allowed(name)
    for name, message in [("fedavg2", "is not installed on this edge"), ("", "is not installed"),
                          (42, "method must be a string"), ("x" * 10_000, "x" * 120 + "'...")]:
        with pytest.raises(ValueError, match=message):
            check_method_allowed(name)


def make_daemon(tmp_path: Path, data: Path, **options) -> EdgeDaemon:
    return EdgeDaemon(EdgeOptions(server="127.0.0.1:1", data_dir=data,
                                  state_dir=tmp_path / "state", name="unit", progress=False,
                                  **options))


def run_config(method: Method, name: str) -> tuple[str, str]:
    """The configuration JSON and fingerprint a server would send (as its Engine builds them)."""
    config = {"method": name, "train": method.train.__dict__, "params": method.describe_params()}
    if method.dp is not None:
        config["dp"] = dataclasses.asdict(method.dp)
    return json.dumps(config, sort_keys=True), method.fingerprint(method.build_models())


def test_the_edge_setup_refuses_a_server_named_module_before_importing_it(tmp_path, probe_module):
    spec, marker = probe_module
    data = edge_data(tmp_path / "data")
    config_json, fingerprint = run_config(fedavg(None, "lenet-bn"), spec)
    with pytest.raises(EdgeExit) as err:
        make_daemon(tmp_path, data)._setup(config_json, fingerprint)
    assert err.value.code == 2 and "--allow-method" in str(err.value)
    assert spec.partition(":")[0] not in sys.modules and not marker.exists()
    probe = load_method(spec)  # the fingerprint covers the method's name
    config_json, fingerprint = run_config(probe(MethodContext(TrainConfig(), probe.Params())), spec)
    allowed = make_daemon(tmp_path, data, allow_methods=(spec,))
    allowed._setup(config_json, fingerprint)
    assert allowed.run_state.method.name == "probe"


# ---- units: the downlink cap ---------------------------------------------------------------

MODELS_FOR = {"fedsap": ("se-cnn", 1, 28), "fedstar": ("se-cnn", 1, 28),
              "pfedka": ("resnet10-cifar-compact", 3, 32)}


@pytest.mark.parametrize("name", available_methods())
def test_the_downlink_cap_holds_every_downlink_of_every_method(name):
    """What the server's aggregator broadcasts and sends each edge, and the initial models,
    fit the cap the edge derives from the same models; the cap is a small multiple of
    them, far from the 16 GiB an edge used to accept."""
    cls = load_method(name)
    model, channels, size = MODELS_FOR.get(name, (cls.default_model or "lenet-bn", 1, 28))
    method = cls(MethodContext(TrainConfig(model=model, in_channels=channels, image_size=size),
                               cls.Params()))
    models = method.build_models()
    cap = downlink_cap(models)
    state = sum(t.numel() * t.element_size() for m in models.values()
                for t in m.state_dict().values())
    assert cap == 4 * state + DOWNLINK_SLACK < DOWNLINK_CAP_BEFORE_SETUP
    aggregator = method.server(models)
    aggregator.begin_round(1, ["e0"], 1)
    init = Payload([Section(Kind.SHARED_TENSORS, "init", {
        f"{n}/{k}": t for n, m in models.items() for k, t in m.state_dict().items()})])
    sizes = [encode(init).total_bytes]
    for phase in method.phases:
        sizes += [encode(aggregator.broadcast(phase)).total_bytes,
                  encode(aggregator.personal("e0", phase)).total_bytes]
    assert max(sizes) <= cap - DOWNLINK_SLACK


def test_the_cap_before_setup_is_conservative_and_setup_derives_the_runs(tmp_path):
    data = edge_data(tmp_path / "data")
    daemon = make_daemon(tmp_path, data)
    assert daemon.session.downlink_cap == DOWNLINK_CAP_BEFORE_SETUP == 1 << 30
    method = fedavg(None, "lenet-bn")
    daemon._setup(*run_config(method, "fedavg"))
    assert daemon.session.downlink_cap == downlink_cap(method.build_models())
    assert daemon.session.downlink_cap < DOWNLINK_SLACK + (1 << 20)  # LeNet: 181 kB of state


# ---- real processes ------------------------------------------------------------------------

DP_SERVER = ("--dp", "--dp-fix-model", "--batch-size", "20", "--round-timeout", "60", "--rounds", "1")


def test_a_weaker_budget_or_no_dp_is_refused_by_the_edge_policy_and_the_pinned_ledger(
        cluster, tmp_path):
    """Run 1: epsilon 8, accepted by an edge whose limit is 8; its ledger pins 8. Run 2, a
    server asking for epsilon 1000: refused by that state dir (no flag: the pin) and by a
    fresh edge with --dp-max-epsilon 8. Run 3, a server without DP: refused by the pinned
    state dir and by a fresh edge with --require-dp. Run 4, the pinned epsilon with less
    noise than run 1 calibrated: refused. The ledger is never rewritten."""
    data = edge_data(tmp_path / "data")
    first = cluster.server(*DP_SERVER, "--dp-epsilon", "8", "--min-edges", "1",
                           checkpoint="run-1", name="server-1")
    assert cluster.edge(data, "p", "--dp-max-epsilon", "8").wait(150) == 0
    ledger_path = tmp_path / "state-p" / "privacy-ledger.json"
    ledger = json.loads(ledger_path.read_text())
    assert ledger["policy"]["epsilon"] == 8.0 and ledger["budget"] == 8.0
    assert len(ledger["rounds"]) == 1
    pinned = ledger_path.read_bytes()
    first.kill()

    second = cluster.server(*DP_SERVER, "--dp-epsilon", "1000", "--min-edges", "2",
                            checkpoint="run-2", name="server-2")
    pinned_edge = cluster.edge(data, "p")
    capped = cluster.edge(data, "m", "--dp-max-epsilon", "8")
    assert pinned_edge.wait(90) == 2 and capped.wait(90) == 2
    assert ("refusing the server's privacy settings: dp.target_epsilon: the server asks for "
            "1000; this edge allows at most 8 (pinned in this state dir's privacy ledger"
            in pinned_edge.log())
    assert ("dp.target_epsilon: the server asks for 1000; this edge allows at most 8 "
            "(--dp-max-epsilon)" in capped.log())
    assert ledger_path.read_bytes() == pinned
    assert not (tmp_path / "state-m" / "privacy-ledger.json").exists()
    # The server hears why each edge left, and nothing of the edge's disk.
    left = [line for line in second.log().splitlines() if " left (" in line]
    assert len(left) == 2 and all("refused the server's privacy settings: "
                                  "dp.target_epsilon: the server asks for 1000" in line
                                  and str(tmp_path) not in line for line in left)
    second.kill()

    cluster.server("--model", GN, "--batch-size", "20", "--rounds", "1", "--min-edges", "2",
                   checkpoint="run-3", name="server-3")
    pinned_edge = cluster.edge(data, "p")
    required = cluster.edge(data, "r", "--require-dp")
    assert pinned_edge.wait(90) == 2 and required.wait(90) == 2
    assert ("dp: the server runs without DP-SGD, but this state dir's privacy ledger is pinned "
            "to DP-SGD (epsilon 8" in pinned_edge.log())
    assert "this edge trains only under DP-SGD (--require-dp)" in required.log()
    assert ledger_path.read_bytes() == pinned

    # Run 4: the pinned epsilon, but a fixed sigma below the one run 1 calibrated.
    cluster.server(*DP_SERVER, "--dp-epsilon", "8", "--dp-noise-multiplier", "0.3",
                   "--min-edges", "1", checkpoint="run-4", name="server-4")
    pinned_edge = cluster.edge(data, "p")
    assert pinned_edge.wait(90) == 2
    assert (f"dp.noise_multiplier: the server's run gives sigma 0.3 per sampled batch on this "
            f"edge; it allows no less than {ledger['policy']['noise_multiplier']:.4g}"
            in pinned_edge.log())
    assert ledger_path.read_bytes() == pinned
    assert pinned_edge.log().count("round 1: trained") == 1  # run 1's round, none since
    assert "trained" not in capped.log() and "trained" not in required.log()


@contextmanager
def server_in_process(tmp_path: Path, method: Method, name: str, **server_values):
    """A real ServerApp, serving gRPC on a free port from a thread, built from a Method
    that did not pass fl-server's own checks (a hostile operator's server)."""
    cfg = ServerConfig(method=name, rounds=1, min_edges=1, host="127.0.0.1", port=0,
                       checkpoint_dir=str(tmp_path / "hostile"), insecure=True,
                       poll_timeout=2.0, round_timeout=60, **server_values)
    with serving(ServerApp(cfg, method.train, method)) as port:
        yield port


def test_delta_is_refused_at_one_over_n_k_and_at_one_half_on_the_edge(cluster, tmp_path):
    """A real fl-server sends delta 0.05 to an edge of 100 samples (1/n_k = 0.01); a server
    built past fl-server's own check sends delta 0.6. Both edges exit 2 naming dp.delta."""
    data = edge_data(tmp_path / "data")
    cluster.server(*DP_SERVER, "--dp-epsilon", "8", "--dp-delta", "0.05", "--min-edges", "1")
    small = cluster.edge(data, "small")
    hostile = fedavg(dp(delta=0.6, planned_rounds=1))
    hostile.train.batch_size = 20
    with server_in_process(tmp_path, hostile, "fedavg") as port:
        half = cluster.edge(data, "half", port=port)
        assert half.wait(90) == 2
    assert small.wait(90) == 2
    assert ("dp.delta: the server's delta 0.05 is not below 1/n_k = 0.01 for this edge's 100 "
            "training samples" in small.log())
    assert "cannot use the server's configuration: dp.delta must be in [0, 0.5)" in half.log()
    assert "got 0.6" in half.log()
    for name in ("small", "half"):
        assert not (tmp_path / f"state-{name}" / "privacy-ledger.json").exists()


def test_a_server_named_module_is_never_imported_by_an_edge_without_the_allow_flag(
        cluster, tmp_path):
    """The server runs ``tests.marker_method:MarkedAvg`` (importing it itself, without the
    marker variable). An edge without --allow-method exits 2 and its marker file never
    appears; an edge with it imports the module (its marker names its pid) and trains."""
    data = edge_data(tmp_path / "data")
    spec = "tests.marker_method:MarkedAvg"
    cluster.server("--method", spec, "--model", "lenet-bn", "--batch-size", "20", "--rounds",
                   "1", "--min-edges", "1", "--round-timeout", "60")
    refused_marker, allowed_marker = tmp_path / "marker-refused", tmp_path / "marker-allowed"
    refusing = cluster.edge(data, "x", env={"FEDATTN_IMPORT_MARKER": str(refused_marker)})
    assert refusing.wait(90) == 2
    assert (f"method '{spec}': a module:Class outside the installed methods; this edge imports "
            f"no module a server names unless started with --allow-method '{spec}'"
            in refusing.log())
    assert not refused_marker.exists()
    allowed = cluster.edge(data, "y", "--allow-method", spec,
                           env={"FEDATTN_IMPORT_MARKER": str(allowed_marker)})
    assert allowed.wait(150) == 0
    assert allowed_marker.read_text().split() == [str(allowed.popen.pid)]
    assert "round 1: trained" in allowed.log()


def test_a_downlink_declared_over_the_cap_is_refused_before_allocating(cluster, tmp_path,
                                                                        monkeypatch):
    """A server whose task header declares a 1 TiB tensor in the common downlink: the edge
    exits 2 naming the part, the declared size and the cap of this run's models (it would
    have died allocating the terabyte, or taken anything up to 16 GiB)."""
    original = server_service.FederatedLearningService.NextTask

    class HeaderSent(Exception):
        """Ends the server's task stream after the inflated header."""

    class Inflating:
        """The call's context, but a task header is inflated on its way out and no data
        follows it: the edge must refuse on the header alone."""

        def __init__(self, context):
            self.context = context

        def __getattr__(self, name):
            return getattr(self.context, name)

        async def write(self, message):
            if isinstance(message, pb.TaskMessage) and message.header.status == pb.TaskHeader.TASK:
                common = message.header.common
                common.sections[0].tensors.add(name="model/huge", dtype=pb.FLOAT32,
                                               shape=[1 << 38])
                common.total_bytes += 4 << 38
                await self.context.write(message)
                raise HeaderSent
            await self.context.write(message)

    async def inflated(self, request, context):
        try:
            await original(self, request, Inflating(context))
        except HeaderSent:
            return

    monkeypatch.setattr(server_service.FederatedLearningService, "NextTask", inflated)
    method = fedavg(None, "lenet-bn")
    data = edge_data(tmp_path / "data")
    with server_in_process(tmp_path, method, "fedavg") as port:
        edge = cluster.edge(data, "big", port=port)
        assert edge.wait(90) == 2
    models = method.build_models()
    cap = downlink_cap(models)
    declared = encode(method.server(models).broadcast("train")).total_bytes + (4 << 38)
    assert (f"sent a task this edge refuses: its round 1 'train' task declares a common "
            f"downlink of {declared} bytes, over this edge's cap of {cap} bytes "
            f"(4 x the run's model state + 64 MiB)" in edge.log())
    assert "MemoryError" not in edge.log() and "Traceback" not in edge.log()

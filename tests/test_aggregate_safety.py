"""The aggregate and the round loop against poisoned uploads and failing methods, in
process and by hand: the float64 running sum, the per-edge weight cap, the update-norm
bound (refuse and scale), and rounds that abort (an aggregator that raises, a non-finite
aggregate, a half-added upload) with the global bit-identical and the next round running.

Rounds run through the real engine: ``run_round`` hands out tasks, each upload goes
through the upload gate's ``check_header``, ``check_values`` and ``take`` as the gRPC
service sends it (encoded and decoded), refusals drop the edge as the service does. The wire itself is
``test_adversarial_aggregate.py``'s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.config import ConfigError, ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.methods.aggregators import StreamingMean
from fedattn_shared.methods.fedavg import FedAvg
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import ByteMeter
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import PayloadAssembler, payload_chunks
from fl_server.cli import build_parser, resolve
from fl_server.engine import Engine
from fl_server.metrics import ServerMetrics
from fl_server.phase import Refused
from fl_server.settings import resolve_settings

SHARED = (Kind.SHARED_TENSORS, "")
CONTROL = (Kind.CONTROL, "")
F32_MAX = torch.finfo(torch.float32).max
BIAS = "model/classifier.6.bias"              # a parameter
STATS = "model/classifier.1.running_mean"     # a BatchNorm statistic: model tensors too
KEY = b"k" * 32


# ---- the harness -------------------------------------------------------------------------


def make_engine(tmp_path: Path, method: str = "fedavg", cls: type | None = None,
                params: dict | None = None, **server) -> Engine:
    train = TrainConfig()  # lenet-bn, 10 classes
    cls = cls or load_method(method)
    cfg = ServerConfig(method=method, rounds=10, min_edges=1, eval_every=0, round_timeout=60,
                       checkpoint_dir=str(tmp_path / "state"), **server)
    cfg.validate()
    (tmp_path / "state").mkdir(exist_ok=True)
    registry = CollectorRegistry()
    return Engine(resolve_settings(cfg), train, cls(MethodContext(train, cls.Params(**(params or {})))),
                  ByteMeter(registry), ServerMetrics(registry))


def connect(engine: Engine, declared: dict[str, str | None]) -> None:
    """Edges joined and present; ``declared``: what each put in info["num_examples"]."""
    for edge, count in declared.items():
        info = {} if count is None else {"num_examples": count}
        engine.edges.join(edge, "s" * 32, info, KEY).connected = True


def over_the_wire(payload: Payload) -> tuple[pb.PayloadManifest, Payload]:
    encoded = encode(payload)
    assembler = PayloadAssembler(encoded.manifest, 1 << 30, 1 << 16)
    for _, chunk in payload_chunks(encoded, 1 << 16):
        assembler.add(chunk)
    return encoded.manifest, assembler.finish()


def play_round(engine: Engine, uploads: dict[str, tuple[Payload, int]]) -> dict[str, str]:
    """Runs the engine's next round; every selected edge submits its upload (payload,
    num_examples) as the service would. Returns {edge: reason} of the refused ones."""

    async def scenario() -> dict[str, str]:
        number = engine.round + 1
        running = asyncio.create_task(engine.schedule.run_round(number))
        while engine.phase is None or engine.phase.round != number or engine.phase.closed:
            assert not running.done(), running.result()
            await asyncio.sleep(0.005)
        phase = engine.phase
        refused = {}
        for edge, (payload, num_examples) in uploads.items():
            task = phase.tasks[edge]
            manifest, decoded = over_the_wire(payload)
            header = pb.SubmitHeader(
                protocol_version=PROTOCOL_VERSION, edge_id=edge, round=number,
                task_id=task.task_id, phase=phase.name, task_nonce=task.nonce,
                num_examples=num_examples, payload=manifest)
            try:  # the upload gate's header and value checks, then into the phase
                engine.gate.check_header(header, phase)
                engine.gate.check_values(phase, edge, decoded)
                await engine.gate.take(phase, header, decoded)
            except Refused as err:
                refused[edge] = str(err)
                if err.drop and edge in phase.pending() and not phase.closed:
                    engine.context.drop(phase, edge, f"bad upload: {err}")
        await asyncio.wait_for(running, 60)
        await engine.durable()
        return refused

    return asyncio.run(scenario())


def global_copy(engine: Engine, section=SHARED) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.aggregator.state[section].items()}


def shared(tensors: dict[str, torch.Tensor], *extra: Section) -> Payload:
    return Payload([Section(Kind.SHARED_TENSORS, "", tensors), *extra])


def plus(tensors: dict[str, torch.Tensor], delta: float) -> dict[str, torch.Tensor]:
    return {k: (v + delta).to(v.dtype) for k, v in tensors.items()}


def assert_bits(after: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(after) == sorted(expected)
    for name, value in expected.items():
        assert after[name].dtype == value.dtype, name
        assert torch.equal(after[name], value), f"{name} differs"


def counter(engine: Engine, name: str) -> float:
    return engine.metrics._registry.get_sample_value(name) or 0.0


# ---- the float64 running sum -------------------------------------------------------------


def fedavg_aggregator() -> tuple[StreamingMean, dict[str, torch.Tensor]]:
    method = load_method("fedavg")(MethodContext(TrainConfig(), FedAvg.Params()))
    aggregator = method.server(method.build_models())
    return aggregator, {k: v.clone() for k, v in aggregator.state[SHARED].items()}


@pytest.mark.parametrize("wire", [True, False], ids=["flat-section", "tensor-by-tensor"])
def test_large_finite_uploads_average_to_a_finite_global(wire):
    # 3e38 is finite in float32 (max 3.4028e38); weight 5 times it is not. A float32 sum
    # made the global Inf; the float64 one gives back 3e38 exactly.
    aggregator, start = fedavg_aggregator()
    huge = {k: torch.full_like(v, 3e38) for k, v in start.items()}
    aggregator.begin_round(1, ["a", "b"], 2)
    for edge, weight in (("a", 5.0), ("b", 1e6)):
        upload = over_the_wire(shared(huge))[1] if wire else shared(huge)
        aggregator.accept(edge, upload, weight)
    assert aggregator.finish()["aggregated"] == 2
    assert_bits(aggregator.state[SHARED], huge)


def test_the_mean_of_one_upload_is_the_upload_bit_for_bit():
    # In float32, (5 x) / 5 is x only up to an ulp; in float64 the product is exact (24 +
    # 3 bits) and so is the quotient, cast back to the tensor's dtype.
    aggregator, start = fedavg_aggregator()
    values = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) * 7
              for i, (k, v) in enumerate(start.items())}
    float32_rounds = sum(int(((v * 5) / 5 != v).sum()) for v in values.values())
    assert float32_rounds > 0, "the values do not exercise float32's rounding"
    aggregator.begin_round(1, ["a"], 1)
    aggregator.accept("a", over_the_wire(shared(values))[1], 5.0)
    aggregator.finish()
    assert_bits(aggregator.state[SHARED], values)
    assert all(v.dtype == torch.float32 for v in aggregator.state[SHARED].values())


# ---- the weight cap ---------------------------------------------------------------------


def test_weight_cap_is_the_join_declaration_never_above_max_weight(tmp_path):
    engine = make_engine(tmp_path, max_weight=1000)
    connect(engine, {"plain": None, "small": "40", "large": "5000", "neg": "-5", "exp": "1e9",
                     "zero": "0", "arabic": "\u0661\u0662"})
    assert engine.gate.weight_cap("plain")[0] == 1000
    assert "declared no num_examples" in engine.gate.weight_cap("plain")[1]
    assert engine.gate.weight_cap("small") == (40, "the num_examples the edge declared at join")
    assert engine.gate.weight_cap("large")[0] == 1000
    assert "raise --max-weight" in engine.gate.weight_cap("large")[1]
    for edge in ("neg", "exp", "zero", "arabic"):
        cap, why = engine.gate.weight_cap(edge)
        assert cap == 0 and "not a whole number" in why, edge


def test_weights_over_the_cap_are_refused_before_they_reach_the_sum(tmp_path):
    engine = make_engine(tmp_path)  # max_weight 1e6
    connect(engine, {"liar": "40", "greedy": None, "honest": "5"})
    start = global_copy(engine)
    zeros = {k: torch.zeros_like(v) for k, v in start.items()}
    honest = plus(start, 1.0)
    refused = play_round(engine, {"liar": (shared(zeros), 41),
                                  "greedy": (shared(zeros), 2**64 - 1),
                                  "honest": (shared(honest), 5)})
    assert sorted(refused) == ["greedy", "liar"]
    assert "num_examples 41 exceeds the weight cap 40 of edge liar" in refused["liar"]
    assert f"num_examples {2**64 - 1} exceeds the weight cap 1000000" in refused["greedy"]
    assert "--max-weight 1000000" in refused["greedy"]
    assert_bits(engine.aggregator.state[SHARED], honest)  # the mean of the honest upload
    record = engine.history["rounds"][-1]
    assert record["train"]["received"] == ["honest"]
    assert record["aggregate"] == {"aggregated": 1, "total_weight": 5.0}
    assert "aborted" not in record


# ---- rounds that cannot close ------------------------------------------------------------


class CloseFails(StreamingMean):
    """Applies round 1's mean, then raises: the engine must undo the half-done close."""

    def finish(self):
        figures = super().finish()
        if self.round == 1:
            raise RuntimeError("the aggregator's close failed after applying the mean")
        return figures


class CloseFailsAvg(FedAvg):
    def server(self, models):
        return CloseFails(self, models)


def test_an_aggregator_that_raises_in_close_aborts_the_round_and_the_next_runs(tmp_path, caplog):
    engine = make_engine(tmp_path, cls=CloseFailsAvg)
    connect(engine, {"a": None})
    start = global_copy(engine)
    version = engine.state_version
    assert play_round(engine, {"a": (shared(plus(start, 1.0)), 5)}) == {}
    record = engine.history["rounds"][-1]
    assert record["round"] == 1 and engine.round == 1
    assert record["aborted"].startswith("train: RuntimeError: the aggregator's close failed")
    assert record["aggregate"] == {} and record["train"]["received"] == ["a"]
    assert_bits(engine.aggregator.state[SHARED], start)
    assert engine.state_version == version  # edges keep their cached copy: it is current
    assert counter(engine, "fedattn_rounds_aborted_total") == 1
    assert any("round aborted" in r.message and r.exc_info for r in caplog.records)
    # The next round starts from a clean sum: its mean is its own upload, exactly.
    second = plus(start, 2.0)
    assert play_round(engine, {"a": (shared(second), 3)}) == {}
    record = engine.history["rounds"][-1]
    assert record["round"] == 2 and "aborted" not in record
    assert record["aggregate"] == {"aggregated": 1, "total_weight": 3.0}
    assert_bits(engine.aggregator.state[SHARED], second)
    assert engine.history["rounds"][0]["aborted"]  # kept for the checkpoint's history


class AcceptFails(StreamingMean):
    """A method bug triggered by an upload: part of it is already in the sum."""

    def accept(self, edge_id, upload, weight):
        super().accept(edge_id, upload, weight)
        if edge_id == "trigger" and self.round == 1:
            raise KeyError("a method bug after adding the upload")


class AcceptFailsAvg(FedAvg):
    def server(self, models):
        return AcceptFails(self, models)


def test_an_aggregator_bug_on_an_upload_refuses_it_and_the_tainted_round_aborts(tmp_path):
    engine = make_engine(tmp_path, cls=AcceptFailsAvg)
    connect(engine, {"honest": None, "trigger": None})
    start = global_copy(engine)
    refused = play_round(engine, {"honest": (shared(plus(start, 1.0)), 5),
                                  "trigger": (shared(plus(start, 100.0)), 5)})
    assert refused == {"trigger": "train upload: the server could not aggregate it (KeyError)"}
    record = engine.history["rounds"][-1]
    assert record["train"]["received"] == ["honest"]
    assert record["train"]["dropped"]["trigger"].startswith("bad upload")
    assert "the aggregator failed on trigger's upload" in record["aborted"]
    assert_bits(engine.aggregator.state[SHARED], start)  # +100 half-added: never applied
    honest = plus(start, 1.0)
    assert play_round(engine, {"honest": (shared(honest), 5), "trigger": (shared(honest), 5)}) == {}
    assert "aborted" not in engine.history["rounds"][-1]
    assert_bits(engine.aggregator.state[SHARED], honest)


def test_a_non_finite_aggregate_is_never_applied(tmp_path):
    # FedAdam's step from a global at +3e38 toward a mean at -3e38: Delta = -6e38 is -Inf
    # in float32, so m = -Inf, v = Inf and the new global NaN. The round aborts with the
    # global and the moments as they were; the next round steps normally.
    engine = make_engine(tmp_path, "fedadam")
    connect(engine, {"a": None})
    engine.aggregator.state[SHARED][BIAS] = torch.full((10,), 3e38)  # the previous global
    start = global_copy(engine)
    poisoned = dict(start, **{BIAS: torch.full((10,), -3e38)})
    assert play_round(engine, {"a": (shared(poisoned), 5)}) == {}
    record = engine.history["rounds"][-1]
    assert "the aggregate is not finite within float32 range" in record["aborted"]
    assert f"global:shared_tensors::{BIAS}" in record["aborted"]
    assert_bits(engine.aggregator.state[SHARED], start)
    assert engine.aggregator.optimizer_state == {}
    assert counter(engine, "fedattn_rounds_aborted_total") == 1
    assert play_round(engine, {"a": (shared(start), 5)}) == {}  # Delta = 0
    assert "aborted" not in engine.history["rounds"][-1]
    assert_bits(engine.aggregator.state[SHARED], start)
    moments = engine.aggregator.optimizer_state
    assert moments and all(bool(torch.isfinite(v).all()) for v in moments.values())


# ---- the update-norm bound ------------------------------------------------------------


def zeroed_global(engine: Engine) -> dict[str, torch.Tensor]:
    """The previous global with BIAS and STATS at 0, so deltas are exact numbers."""
    for name in (BIAS, STATS):
        engine.aggregator.state[SHARED][name] = torch.zeros_like(engine.aggregator.state[SHARED][name])
    return global_copy(engine)


def moved(start: dict[str, torch.Tensor], bias: float, stats: float) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in start.items()}
    out[BIAS][3] += bias
    out[STATS][7] += stats
    return out


def test_clip_update_norm_refuses_an_update_over_the_bound_by_name(tmp_path):
    engine = make_engine(tmp_path, clip_update_norm=2.5)
    connect(engine, {"far": None, "near": None})
    start = zeroed_global(engine)
    near = moved(start, 1.5, 2.0)  # ||(1.5, 2)|| = 2.5: on the bound, accepted
    refused = play_round(engine, {"far": (shared(moved(start, 3.0, 4.0)), 5),  # ||(3, 4)|| = 5
                                  "near": (shared(near), 5)})
    assert refused == {"far": "update norm 5 exceeds --clip-update-norm 2.5 (L2 norm of the "
                              "upload minus the global over its shared model tensors)"}
    assert_bits(engine.aggregator.state[SHARED], near)
    assert engine.history["rounds"][-1]["train"]["update_norm"] == {"near": 2.5}


def test_clip_update_norm_scale_moves_the_update_onto_the_bound(tmp_path):
    engine = make_engine(tmp_path, clip_update_norm=2.5, clip_update_mode="scale")
    connect(engine, {"far": None, "still": None})
    start = zeroed_global(engine)
    # far's delta (3, 4) is scaled by 2.5 / 5 to (1.5, 2); still uploads the global. The
    # mean of the two, weights 1 and 1: (0.75, 1) on those two coordinates, the global
    # everywhere else (bit for bit: g + 0.5 * (g - g) and (g + g) / 2 are g).
    assert play_round(engine, {"far": (shared(moved(start, 3.0, 4.0)), 1),
                               "still": (shared(start), 1)}) == {}
    assert_bits(engine.aggregator.state[SHARED], moved(start, 0.75, 1.0))
    assert engine.history["rounds"][-1]["train"]["update_norm"] == {"far": 5.0, "still": 0.0}
    assert counter(engine, "fedattn_updates_scaled_total") == 1


def test_clip_update_norm_bounds_model_tensors_only(tmp_path):
    # SCAFFOLD's control variates are corrections, not weights: no global value to take a
    # difference from, so a large one is left to the method; the model delta is 0 here.
    engine = make_engine(tmp_path, "scaffold", clip_update_norm=1.0)
    connect(engine, {"a": None})
    start = global_copy(engine)
    control = {k: torch.full_like(v, 1000.0) for k, v in engine.aggregator.state[CONTROL].items()}
    assert play_round(engine, {"a": (shared(start, Section(Kind.CONTROL, "", control)), 5)}) == {}
    assert engine.history["rounds"][-1]["train"]["update_norm"] == {"a": 0.0}


# ---- the robust aggregates ------------------------------------------------------------


def median_round(params: dict, values: list[float]) -> dict[str, torch.Tensor]:
    """One fedmedian round in which upload i holds ``values[i]`` in every coordinate."""
    cls = load_method("fedmedian")
    method = cls(MethodContext(TrainConfig(), cls.Params(**params)))
    aggregator = method.server(method.build_models())
    start = aggregator.state[SHARED]
    aggregator.begin_round(1, [str(i) for i in range(len(values))], len(values))
    for i, value in enumerate(values):  # weights ignored: the liar's 1e6 buys nothing
        upload = {k: torch.full_like(v, value) for k, v in start.items()}
        aggregator.accept(str(i), over_the_wire(shared(upload))[1], 1e6 if i == 0 else 1.0)
    assert aggregator.finish() == {"aggregated": len(values)}
    return aggregator.state[SHARED]


def test_median_and_trimmed_mean_keep_poisoned_values_out_of_the_global():
    poisoned = [1e30, 1.0, 2.0, 3.0, -5e29]  # two of five edges lie, far out on either side
    assert all(bool((v == 2.0).all()) for v in median_round({}, poisoned).values())
    # trim 0.2 of 5: the largest and the smallest value go, mean(1, 2, 3) = 2
    trimmed = median_round({"trim_fraction": 0.2}, poisoned)
    assert all(bool((v == 2.0).all()) for v in trimmed.values())
    # An even count near float32's limit: (3e38 + 3.2e38) / 2 in float64, not Inf.
    middle = median_round({}, [3.3e38, 3e38, 1.0, 3.2e38])
    expected = ((torch.tensor(3e38).double() + torch.tensor(3.2e38).double()) / 2).float()
    assert all(bool((v == expected).all()) for v in middle.values())
    with pytest.raises(ValueError, match="trim_fraction must be in"):
        load_method("fedmedian")(MethodContext(TrainConfig(), load_method("fedmedian").Params(0.5)))


def test_pfedka_weighs_edges_by_the_capped_header_not_its_own_scalar():
    # pFedKA's gate takes n_k from the upload's scalars: it must be the header's
    # num_examples, which the weight cap bounds, or an edge could claim any share of alpha.
    from fedattn_shared.methods.pfedka import PFedKA, PFedKAParams

    train = TrainConfig(model="resnet10-cifar-compact", in_channels=1, image_size=28)
    method = PFedKA(MethodContext(train, PFedKAParams()))
    aggregator = method.server(method.build_models())
    aggregator.begin_round(1, ["a"], 1)
    n = {k: torch.tensor(v) for k, v in (("n", 1e9), ("ce", 1.0))}
    with pytest.raises(ValueError, match=r"n = 1e\+09 is not the submission's num_examples \(40\)"):
        aggregator.accept_phase("train", "a", Payload([Section(Kind.SCALAR_SUMMARY, "", n)]), 40.0)
    n["n"] = torch.tensor(40.0)
    aggregator.accept_phase("train", "a", Payload([Section(Kind.SCALAR_SUMMARY, "", n)]), 40.0)


# ---- configuration ---------------------------------------------------------------------


def resolved(*argv: str):
    return resolve(build_parser().parse_args(list(argv)))


def test_flags_and_their_validation():
    server, _, _ = resolved()
    assert (server.max_weight, server.clip_update_norm, server.clip_update_mode) == (
        1_000_000, 0.0, "refuse")
    server, _, _ = resolved("--max-weight", "5000", "--clip-update-norm", "2.5",
                            "--clip-update-mode", "scale")
    assert (server.max_weight, server.clip_update_norm, server.clip_update_mode) == (
        5000, 2.5, "scale")
    for argv, message in [
        (("--max-weight", "0"), "server.max_weight must be in"),
        (("--clip-update-norm", "-1"), "server.clip_update_norm must be >= 0"),
        (("--clip-update-norm", "inf"), "server.clip_update_norm must be >= 0 and finite"),
        (("--clip-update-mode", "scale"), "clip_update_norm is 0"),
        (("--set", "server.clip_update_mode='median'"), "is not one of refuse, scale"),
        (("--secagg", "--clip-update-norm", "3"), "secure aggregation"),
    ]:
        with pytest.raises(ConfigError, match=message):
            resolved(*argv)

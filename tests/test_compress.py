"""Update compression wired into both daemons (issue #26), piece by piece: the method's
per-kind rules, the uplink's code/decode pair the edge and the server share, the downlink
reference that keeps the edges' global and the server's R bit-identical, the residuals
an edge persists, the edge's refusal of a codec it lacks, the byte accounting's codec
label, and the server's wrapper driver (coded schema, decode before the value checks).
The real federation is ``test_compress_e2e.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from fedattn_shared.compress import CompressSpec, load_codec
from fedattn_shared.compress.apply import (
    DownlinkReference,
    EdgeReference,
    UplinkCompression,
    section_spec,
)
from fedattn_shared.compress.section import PART_PREFIX, decode_section, encode_section
from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.methods.base import Method
from fedattn_shared.schema import COMPRESSION, TRAIN, Kind, Payload, Section
from fedattn_shared.wire.accounting import ByteMeter
from fedattn_shared.wire.payload import WireError
from fl_edge.options import EdgeExit, EdgeOptions
from fl_edge.run import read_config
from fl_edge.store import PrivateStore
from fl_server.drivers import Compressed, round_plan
from fl_server.settings import resolve_settings

CODECS = ["fp16", "bf16", "int8", "int4", "topk:0.05"]


def fedavg() -> Method:
    cls = load_method("fedavg")
    return cls(MethodContext(TrainConfig(model="lenet-bn"), cls.Params()))


def global_payload(method: Method, models: dict) -> Payload:
    return method.server(models).broadcast(TRAIN)


def trained(common: Payload, scale: float, seed: int) -> Payload:
    """An upload as an edge's training leaves it: the global plus a small change."""
    generator = torch.Generator().manual_seed(seed)
    sections = []
    for s in common.sections:
        tensors = {n: (t + scale * torch.randn(t.shape, generator=generator)).to(t.dtype)
                   if t.is_floating_point() else t.clone() for n, t in s.tensors.items()}
        sections.append(Section(s.kind, s.name, tensors))
    return Payload(sections)


# ---- the method's rules ------------------------------------------------------------------


def test_rules_default_per_kind_and_a_method_may_override_them():
    assert dict(fedavg().compression) == COMPRESSION
    assert COMPRESSION[Kind.SHARED_TENSORS] == "delta" and COMPRESSION[Kind.SECAGG] == "exact"
    base = load_method("fedavg")

    class Exact(base):
        compression = {Kind.SHARED_TENSORS: "exact"}

    assert dict(Exact.compression)[Kind.SHARED_TENSORS] == "exact"
    assert dict(Exact.compression)[Kind.CONTROL] == "values"  # the defaults fill the rest
    with pytest.raises(TypeError, match="compression"):
        class Bad(base):
            compression = {Kind.SHARED_TENSORS: "lossy"}


def test_an_exact_rule_keeps_the_section_as_it_is():
    base = load_method("fedavg")

    class Exact(base):
        compression = {Kind.SHARED_TENSORS: "exact"}

    method = Exact(MethodContext(TrainConfig(model="lenet-bn"), Exact.Params()))
    models = method.build_models()
    up = UplinkCompression(method, models, load_codec("int8"))
    assert up.schema(TRAIN) == method.uplink_schema(TRAIN, models)
    common = global_payload(method, models)
    upload = trained(common, 0.01, 1)
    coded, sizes = up.encode(TRAIN, upload, common, torch.Generator().manual_seed(0))
    assert sizes == {} and coded.sections[0] is upload.sections[0]


# ---- uplink: the edge codes, the server decodes -------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_uplink_codes_as_a_delta_to_the_common_and_decodes_on_the_server(codec):
    method = fedavg()
    models = method.build_models()
    common = global_payload(method, models)
    upload = trained(common, 1e-3, 2)
    up = UplinkCompression(method, models, load_codec(codec))
    coded, sizes = up.encode(TRAIN, upload, common, torch.Generator().manual_seed(0))
    (spec,), (section,) = up.schema(TRAIN), coded.sections
    # The coded section is exactly the coded schema (what the gate's manifest check reads).
    assert list(section.tensors) == list(spec.tensors)
    for name, t in section.tensors.items():
        assert (t.dtype, tuple(t.shape)) == (spec.tensors[name].dtype, spec.tensors[name].shape)
    raw_spec = method.uplink_schema(TRAIN, models)[0]
    assert sizes[(Kind.SHARED_TENSORS, "")].raw_bytes == raw_spec.nbytes
    assert sizes[(Kind.SHARED_TENSORS, "")].label == codec.split(":")[0]
    decoded = up.decode(TRAIN, coded, common)
    errors = []
    for name, value in upload.sections[0].tensors.items():
        got = decoded.sections[0].tensors[name]
        assert got.dtype == value.dtype and got.shape == value.shape
        if not value.is_floating_point():
            assert torch.equal(got, value)
        else:
            errors.append(float((got - value).abs().max()))
    # Coded as the change (1e-3) against the common: the error is the change's, not the
    # weights' (top-k drops most of the change, never more than it).
    assert max(errors) <= 1e-2


def test_decode_refuses_bad_parts_naming_them():
    method = fedavg()
    models = method.build_models()
    common = global_payload(method, models)
    up = UplinkCompression(method, models, load_codec("int8"))
    coded, _ = up.encode(TRAIN, trained(common, 1e-3, 3), common, torch.Generator().manual_seed(0))
    tensors = dict(coded.sections[0].tensors)
    tensors[PART_PREFIX + "scale"] = tensors[PART_PREFIX + "scale"].clone()
    tensors[PART_PREFIX + "scale"][0] = float("nan")
    with pytest.raises(WireError, match="shared_tensors.*int8 scale.*non-finite"):
        up.decode(TRAIN, Payload([Section(Kind.SHARED_TENSORS, "", tensors)]), common)


def test_a_decoded_value_beyond_float32_is_refused_by_name():
    # The change is finite; added to a base near float32's largest value it is not.
    spec = section_spec(Section(Kind.SHARED_TENSORS, "", {"w": torch.zeros(4)}))
    codec = load_codec("topk:1").codec  # float32 values: a change as large as float32 holds
    coded, _ = encode_section(Section(Kind.SHARED_TENSORS, "", {"w": torch.full((4,), 2e38)}),
                              spec, codec)
    with pytest.raises(WireError, match="shared_tensors/w: non-finite"):
        decode_section(coded, spec, codec, base={"w": torch.full((4,), 3e38)})


def test_error_feedback_carries_what_the_codec_dropped():
    method = fedavg()
    models = method.build_models()
    common = global_payload(method, models)
    upload = trained(common, 1e-2, 4)
    up = UplinkCompression(method, models, load_codec("topk:0.01+ef"))
    residuals: dict[str, torch.Tensor] = {}
    coded, _ = up.encode(TRAIN, upload, common, torch.Generator().manual_seed(0), residuals)
    (key,) = residuals
    assert key == "train/shared_tensors/"
    decoded = up.decode(TRAIN, coded, common)
    # sent + residual == the whole change, exactly what was meant to go up.
    spec = method.uplink_schema(TRAIN, models)[0]
    floats = [n for n, t in spec.tensors.items() if t.dtype.is_floating_point]
    change = torch.cat([(upload.sections[0].tensors[n] - common.sections[0].tensors[n]).reshape(-1)
                        for n in floats])
    sent = torch.cat([(decoded.sections[0].tensors[n] - common.sections[0].tensors[n]).reshape(-1)
                      for n in floats])
    torch.testing.assert_close(sent + residuals[key], change, rtol=0, atol=1e-6)
    assert int((residuals[key] != 0).sum()) > 0.9 * change.numel()


def test_residuals_persist_bit_identically_and_refuse_another_run(tmp_path):
    store = PrivateStore(tmp_path)
    residuals = {"train/shared_tensors/": torch.randn(1000, generator=torch.Generator().manual_seed(5)),
                 "train/control/": torch.randn(7, generator=torch.Generator().manual_seed(6))}
    store.save_feedback(residuals, "fp-1", 3)
    loaded = store.load_feedback("fp-1")
    assert sorted(loaded) == sorted(residuals)
    for key, value in residuals.items():
        assert torch.equal(loaded[key].view(torch.int32), value.view(torch.int32))
    assert PrivateStore(tmp_path / "fresh").load_feedback("fp-1") == {}
    with pytest.raises(Exception, match="another run"):
        store.load_feedback("fp-2")


# ---- downlink: the reference R -------------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4"])
def test_edges_hold_the_servers_reference_bit_for_bit_and_nothing_drifts(codec):
    method = fedavg()
    models = method.build_models()
    g = global_payload(method, models)
    choice = load_codec(codec)
    server = DownlinkReference(choice, seed=7)
    edge = EdgeReference(choice)
    late = None  # an edge that joins late: it gets R whole
    r, delta = server.publish(g)
    assert r is g and delta is None  # the first version goes whole
    server.published("v0")
    held, moved = edge.receive("v0", "", r)
    assert not moved and held.sections[0].tensors.keys() == g.sections[0].tensors.keys()
    gaps = []
    for version in range(1, 6):
        g = trained(g, 1e-3, version)  # the next global
        r, delta = server.publish(g)
        assert delta is not None and delta[0] == f"v{version - 1}"
        again, same = server.publish(g)
        assert again is r and same is delta  # one version, however often it is asked for
        server.published(f"v{version}")
        held, moved = edge.receive(f"v{version}", delta[0], delta[1])
        assert moved
        for ours, theirs in zip(held.sections, r.sections, strict=True):
            for name, t in theirs.tensors.items():
                assert torch.equal(ours.tensors[name].reshape(-1).view(torch.uint8),
                                   t.reshape(-1).view(torch.uint8)), name
        gaps.append(max(float((r.sections[0].tensors[n] - t).abs().max())
                        for n, t in g.sections[0].tensors.items() if t.is_floating_point()))
        if version == 3:
            late = EdgeReference(choice)
            late.receive(f"v{version}", "", r)  # R whole: no delta to a base it lacks
    # R - G is one coding error of one change, never a sum of them.
    assert max(gaps) <= 2 * min(gaps) + 1e-3
    assert late.reference_id == "v3"
    with pytest.raises(WireError, match="delta to 'v4'.*holds 'v3'"):
        late.receive("v6", "v4", delta[1])
    assert late.reference is None  # refused: it asks for the whole global next


def test_a_delta_that_does_not_fit_the_reference_is_refused_by_name():
    method = fedavg()
    models = method.build_models()
    g = global_payload(method, models)
    choice = load_codec("int8")
    server = DownlinkReference(choice, seed=1)
    server.publish(g)
    server.published("a")
    _, (_, delta) = server.publish(trained(g, 1e-3, 1))
    edge = EdgeReference(choice)
    edge.receive("a", "", g)
    tensors = dict(delta.sections[0].tensors)
    tensors[PART_PREFIX + "q"] = tensors[PART_PREFIX + "q"][:-1]
    with pytest.raises(WireError, match="codec:q"):
        edge.receive("b", "a", Payload([Section(Kind.SHARED_TENSORS, "", tensors)]))


# ---- the edge's refusal, the server's driver, the accounting ------------------------------


def _compress(spec: str):
    """The run's codecs as an edge reads them from a server's run config."""
    config = {"method": "fedavg", "train": {}, "params": {}, "compress": spec}
    opts = EdgeOptions(server="127.0.0.1:1", data_dir=Path("."), state_dir=Path("."), name="e")
    return read_config(json.dumps(config), opts).compress


def test_edge_refuses_a_codec_it_does_not_have_naming_the_setting():
    with pytest.raises(EdgeExit) as err:
        _compress("up=zstd9")
    assert err.value.code == 2 and "compress" in str(err.value) and "zstd9" in str(err.value)
    assert "zstd9" in err.value.tell_server
    assert _compress("up=int8,down=fp16").text == CompressSpec.parse("up=int8,down=fp16").text


def test_the_plan_wraps_every_method_phase_and_schemas_are_coded():
    method = fedavg()
    models = method.build_models()
    aggregator = method.server(models)
    plain = round_plan(method, models, aggregator, resolve_settings(ServerConfig()), None)
    plan = round_plan(method, models, aggregator,
                      resolve_settings(ServerConfig(compress="up=int8,down=fp16")), None)
    assert all(type(d) is Compressed for d in plan)
    assert [d.traits for d in plan] == [d.traits for d in plain]  # weighted, evaluates, ...
    train = plan[0]
    (spec,) = train.schema()
    codec = load_codec("int8").codec
    assert spec.nbytes < plain[0].schema()[0].nbytes / 3
    assert f"{PART_PREFIX}q" in spec.tensors and f"{PART_PREFIX}scale" in spec.tensors
    common = train.common()
    upload = trained(common, 1e-3, 9)
    up = UplinkCompression(method, models, load_codec("int8"))
    coded, _ = up.encode(TRAIN, upload, common, torch.Generator().manual_seed(0))
    decoded = train.decode("e0", coded)
    assert list(decoded.sections[0].tensors) == list(upload.sections[0].tensors)
    n = sum(t.numel() for t in upload.sections[0].tensors.values() if t.is_floating_point())
    assert spec.tensors[f"{PART_PREFIX}q"].shape == tuple(codec.layout(n)["q"][1])


def test_byte_meter_labels_the_codec_and_splits_the_round_by_it():
    registry = CollectorRegistry()
    meter = ByteMeter(registry)
    meter.count("up", "shared_tensors", wire=110, raw=0, edge="e1", codec="int8")
    meter.count("up", "shared_tensors", wire=0, raw=400, edge="e1", codec="int8", messages=0)
    meter.count("down", "shared_tensors", wire=410, raw=400, edge="e1")
    assert registry.get_sample_value("fedattn_wire_bytes_total", {
        "kind": "shared_tensors", "direction": "up", "edge": "e1", "codec": "int8"}) == 110
    assert registry.get_sample_value("fedattn_raw_tensor_bytes_total", {
        "kind": "shared_tensors", "direction": "up", "edge": "e1", "codec": "int8"}) == 400
    assert registry.get_sample_value("fedattn_messages_total", {
        "kind": "shared_tensors", "direction": "up", "edge": "e1", "codec": "int8"}) == 1
    assert meter.take_round() == {
        "down": {"shared_tensors": {"wire": 410, "raw": 400, "messages": 1}},
        "up": {"shared_tensors": {"wire": 110, "raw": 400, "messages": 1,
                                  "codecs": {"int8": {"wire": 110, "raw": 400, "messages": 1}}}},
    }

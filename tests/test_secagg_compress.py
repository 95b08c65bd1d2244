"""SecAgg+ under --compress up=int8/int4, in process: values quantized to integers with
public per-block scales, masked in a ring of R = bits + ceil(log2 parties) bits, packed at
R bits on the wire; the sum unmasked, checked against |sum| <= parties x L, dequantized.

What is checked: the packing round-trips for every ring width; the unmasked sum is exactly
the sum of the edges' integers and the weighted mean within the stated quantization bound
(int8 and int4, with dropouts); a masked upload costs ~R/32 of the raw float32 bytes; the
edge refuses, naming the field, scales and fixed points the run config does not allow; the
server refuses a packed vector of the wrong length before reading it and an unmasked sum
beyond the bound (nothing aggregated); and a server that gives one edge other scales (to
read it off the sum) gets no unmask."""

from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_secagg import public, reveal

from fedattn_shared.compress import load_codec
from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.privacy import secagg_ring
from fedattn_shared.privacy.secagg import ClientRound, SecAggError, SecAggPolicy, ServerRound
from fedattn_shared.privacy.secagg_layout import base_vector, flatten_upload, masked_phases
from fedattn_shared.privacy.secagg_ring import (
    IntegerQuantizer,
    levels,
    pack_bits,
    packed_length,
    public_scales,
    ring_bits,
    unpack_bits,
)
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.state import load_tensors
from fedattn_shared.wire.serialize import encode
from fl_edge.secagg import RESIDUAL_FILE, EdgeSecAgg, rounding_seed
from fl_edge.store import load_or_create_signing_key
from fl_server.edges import EdgeBook
from fl_server.gate import UploadGate
from fl_server.phase import Refused
from fl_server.secagg import SecAggDriver, request
from fl_server.settings import resolve_settings

# ---- the ring and the packing --------------------------------------------------------------


@pytest.mark.parametrize("ring", range(1, 33))
def test_packing_round_trips_for_every_ring_width(ring, monkeypatch):
    monkeypatch.setattr(secagg_ring, "PACK_CHUNK", 3)  # chunks of 24 values: boundaries tested
    rng = np.random.default_rng(ring)
    for n in (0, 1, 7, 8, 9, 23, 24, 25, 100, 1001):
        words = rng.integers(0, 2**ring, n, dtype=np.uint64).astype(np.uint32)
        packed = pack_bits(words, ring)
        assert packed.dtype == np.uint8 and packed.size == packed_length(n, ring) == \
            math.ceil(n * ring / 8)
        assert np.array_equal(unpack_bits(packed, ring, n), words)
    with pytest.raises(SecAggError, match="packed vector of 4 bytes, expected"):
        unpack_bits(np.zeros(4, np.uint8), ring, 100)


def test_pack_keeps_the_low_bits_at_their_place():
    # 3-bit values 1..8 (8 -> 0): bit i x 3 onwards holds value i, little-endian
    packed = pack_bits(np.arange(1, 9, dtype=np.uint32), 3)
    assert int.from_bytes(packed.tobytes(), "little") == sum((v % 8) << (3 * i)
                                                              for i, v in enumerate(range(1, 9)))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_ring_holds_every_honest_sum_and_no_bit_more(bits):
    L = levels(bits)
    assert L == {4: 7, 8: 127}[bits]
    for parties in range(1, 300):
        ring = ring_bits(bits, parties)
        assert parties * L < 2 ** (ring - 1)           # no honest sum wraps
        assert ring == bits + math.ceil(math.log2(parties))
    assert ring_bits(8, 10) == 12  # the bench: 10 edges at int8


# ---- the protocol in process with an integer fixed point ----------------------------------


def through_receive(ids: list[str], policy: SecAggPolicy, length: int,
                    rng: random.Random | None = None):
    """A masked phase's protocol for ``ids`` up to the masking: adverts, shares, receive
    (every edge honest). Returns the server round, the client rounds and signing keys."""
    keys = {e: Ed25519PrivateKey.generate() for e in ids}
    server = ServerRound(1, "train", length, -1, 0.5, public(keys),
                         **({"rng": rng} if rng is not None else {}))
    clients = {e: ClientRound.fresh(1, "train", e) for e in ids}
    for e in ids:
        server.accept_advert(e, clients[e].advertise(keys[e]))
    server.close_advertise()
    for e in ids:
        info, adverts = server.share_request(e)
        server.accept_shares(e, clients[e].share(info["threshold"], info["index"], adverts,
                                                 server.signing_keys, info["parties"], policy))
    server.close_share()
    for e in ids:
        server.accept_receive(e, clients[e].receive(server.receive_request(e)))
    server.close_receive()
    return server, clients, keys


def int_codec(bits: int, block: int):
    """The built-in integer codec of that width and block size (``int8:64``)."""
    return load_codec(f"int{bits}:{block}").codec


def integer_protocol(bits: int, n: int = 6, length: int = 500, block: int = 64,
                     drop: dict | None = None, seed: int = 0):
    """One masked phase, every edge quantizing w_e x_e with the same public scales (a
    margin over the largest |w_e / w_ref x_e| of each block, so nothing is clipped) and
    stochastic rounding; returns (the unmasked integer sum, the sum of the integers the
    surviving edges sent, the quantizer, (values, weight) unmasked, expected weighted sum
    and weight over the survivors)."""
    drop = drop or {}
    ids = [f"e{i}" for i in range(n)]
    policy = SecAggPolicy(graph="full", clip=4.0, max_weight=1000.0, bits=bits, block=block)
    server, clients, keys = through_receive(ids, policy, length + 1, random.Random(seed))
    rng = np.random.default_rng(seed)
    direction = rng.normal(0, 0.01, length)
    xs = {e: direction * rng.uniform(0.5, 1.5) + rng.normal(0, 0.002, length) for e in ids}
    ws = {e: float(10 + 3 * i) for i, e in enumerate(ids)}
    weight_ref = sum(ws.values()) / n
    peak = np.max([np.abs(ws[e] / weight_ref * xs[e]) for e in ids], axis=0)
    scales = public_scales(peak, block, 1.05)
    quantizer = IntegerQuantizer(int_codec(bits, block), n, policy.max_weight, scales, weight_ref)
    server.fixed_point = quantizer.digest
    sent = {}
    for e in ids:
        if e in drop.get("masked", ()):
            continue
        words, _ = quantizer.quantize(xs[e], ws[e], torch.Generator().manual_seed(hash(e) % 999))
        sent[e] = words.view(np.int32).astype(np.int64)
        y = clients[e].mask_words(server.mask_request(e), words, quantizer.ring, quantizer.digest)
        assert int(y[:-1].max(initial=0)) < 2 ** quantizer.ring  # what travels: R bits a value
        server.accept_masked(e, y)
    server.close_masked()
    for e in sorted(server.masked):
        if e not in drop.get("confirm", ()):
            server.accept_confirm(e, clients[e].confirm(server.confirm_request(e)["survivors"],
                                                        keys[e]))
    server.close_confirm()
    for e in sorted(server.confirmations) if not server.abort_reason else ():
        if e not in drop.get("unmask", ()):
            server.accept_reveal(e, reveal(clients[e], server))
    total = server.unmask()
    count = len(server.masked)
    values, weight = quantizer.dequantize(total, count)
    ring_sum = (total[:-1] & np.uint32(2**quantizer.ring - 1)).astype(np.int64)
    ring_sum[ring_sum >= 2 ** (quantizer.ring - 1)] -= 2**quantizer.ring
    plain = sum(sent[e] for e in server.masked)
    expected = sum(ws[e] * xs[e] for e in server.masked)
    return ring_sum, plain, quantizer, (values, weight), (expected, sum(ws[e] for e in server.masked))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("drop", [{}, {"masked": ["e1"]}, {"unmask": ["e2", "e4"]}])
def test_integer_secagg_unmasks_the_weighted_mean_of_the_plain_uploads(bits, drop):
    ring_sum, plain, quantizer, (values, weight), (expected, total) = integer_protocol(
        bits, drop=drop)
    count = 6 - len(drop.get("masked", ()))
    assert np.array_equal(ring_sum, plain[:-1])  # the masks cancel exactly
    assert weight == pytest.approx(total, abs=count / quantizer._weight().weight_scale)
    # Stochastic rounding moves each edge's value by less than one level, w_ref s_b / L
    # in the weighted sum: |error of the weighted mean| < count x w_ref x s_b / (L x W).
    step = np.repeat(quantizer.scales.astype(np.float64), quantizer.block)[:values.size]
    bound = count * quantizer.weight_ref * step / quantizer.levels / total
    error = np.abs(values / weight - expected / total)
    assert np.all(error <= bound * (1 + 1e-9) + 1e-12), (error / bound).max()
    # ... and it is a quantization error, not noise: far below the values themselves at
    # int8, and unbiased overall (the mean error over 500 values near zero)
    relative = np.abs(values / weight - expected / total).mean() / np.abs(expected / total).mean()
    assert relative < {8: 0.02, 4: 0.4}[bits]


def test_a_dropout_between_masking_and_confirming_aborts_under_integer_compression():
    """The price of the isolation defence (below): every survivor's signature of the
    scales is needed, so an edge lost after its masked upload is not recovered."""
    with pytest.raises(SecAggError, match=r"edge\(s\) \['e1'\] masked but did not sign"):
        integer_protocol(8, drop={"confirm": ["e1"]})


def test_stochastic_rounding_is_unbiased_and_clips_beyond_the_scale():
    q = IntegerQuantizer(int_codec(8, 8), 1, 100.0, np.array([1.0], np.float32), 1.0)
    x = np.array([0.3 / 127, -2.5 / 127, 0.0, 1.0, -1.0, 3.0, -7.0, 0.5])
    draws = np.stack([q.quantize(x, 1.0, torch.Generator().manual_seed(s))[0][:-1]
                      .view(np.int32) for s in range(4000)])
    assert np.allclose(draws.mean(axis=0)[:5], [0.3, -2.5, 0, 127, -127], atol=0.05)
    assert set(np.unique(draws[:, 0])) == {0, 1}
    assert np.all(draws[:, 5] == 127) and np.all(draws[:, 6] == -127)  # clipped
    _, error = q.quantize(x, 1.0, torch.Generator().manual_seed(0))
    assert error[5] == pytest.approx(2.0) and error[6] == pytest.approx(-6.0)  # the edge's own


def test_an_unmasked_sum_beyond_the_levels_is_refused():
    q = IntegerQuantizer(int_codec(8, 8), 3, 100.0, np.ones(1, np.float32), 1.0)
    words = [q.quantize(np.full(5, 1.0), 1.0, torch.Generator().manual_seed(i))[0]
             for i in range(3)]
    total = (sum(w.astype(np.uint64) for w in words) % 2**32).astype(np.uint32)
    values, weight = q.dequantize(total, 3)  # every value at +L: the honest extreme
    assert np.allclose(values, 3.0) and weight == pytest.approx(3.0, rel=1e-6)
    with pytest.raises(SecAggError, match=r"beyond 2 edges x 127 \(int8 levels\)"):
        q.dequantize(total, 2)
    over = total.copy()
    over[2] = (int(over[2]) + 1) % 2**32
    with pytest.raises(SecAggError, match=r"reaches \|382\|.*nothing is aggregated"):
        q.dequantize(over, 3)
    heavy = total.copy()
    heavy[-1] = (int(heavy[-1]) + 2**31) % 2**32
    with pytest.raises(SecAggError, match="total weight .* is outside"):
        q.dequantize(heavy, 3)


def test_public_scales_follow_the_last_mean_per_block_with_a_floor():
    mean = np.zeros(10)
    mean[:4] = [0.1, -0.3, 0.2, 0.0]
    scales = public_scales(mean, 4, 2.0)
    assert scales.dtype == np.float32 and scales.shape == (3,)
    assert scales[0] == pytest.approx(0.6)
    assert scales[1] == scales[2] == pytest.approx(2.0 * 0.3e-4)  # still blocks: a floor
    assert np.all(public_scales(np.zeros(3), 2, 4.0) > 0)


# ---- the driver and the edges, in process --------------------------------------------------


class CompressedRounds:
    """The server's SecAggDriver with EdgeSecAgg edges under an integer fixed point, as
    the engine runs them (requests, uploads, close) without gRPC. Each edge's upload is
    the global it received plus its own fixed update. ``tamper(name, edge, personal or
    upload)`` may replace a request before the edge sees it or an upload before the
    server does."""

    def __init__(self, tmp_path, n: int = 4, bits: int = 8, block: int = 64,
                 feedback: bool = False, margin: float = 4.0, codec: str = ""):
        self.ids = [f"e{i}" for i in range(n)]
        cls = load_method("fedavg")
        self.method = cls(MethodContext(TrainConfig(model="lenet-bn"), cls.Params()))
        self.models = self.method.build_models()
        self.aggregator = self.method.server(self.models)
        cfg = ServerConfig(secagg=True, secagg_graph="full", secagg_clip=8.0,
                           secagg_max_weight=1000.0, secagg_margin=margin,
                           compress=f"up={codec or f'int{bits}:{block}'}"
                           + ("+ef" if feedback else ""))
        settings = resolve_settings(cfg)
        self.up = settings.compression.up  # the run's codec: the edges quantize with it
        self.driver = SecAggDriver(settings, self.method, self.models, self.aggregator)
        assert (self.driver.policy.bits, self.driver.policy.block, self.driver.policy.feedback
                ) == (self.up.codec.integer_bits, self.up.codec.block, feedback)
        self.policy = SecAggPolicy.from_config(self.driver.policy.to_config())  # the run config
        self.registry = EdgeBook()
        self.edges = {}
        for e in self.ids:
            (tmp_path / e).mkdir()
            key = load_or_create_signing_key(tmp_path / e)
            self.registry.join(e, "s" * 32, {}, signing_key=key.public_key().public_bytes_raw())
            self.edges[e] = EdgeSecAgg(tmp_path / e, e, key, self.policy)
        self.spec = masked_phases(self.method, self.models)["train"][0]
        generator = torch.Generator().manual_seed(7)
        direction = {k: torch.randn(s.shape, generator=generator) * 0.01
                     for k, s in self.spec.tensors.items() if s.dtype.is_floating_point}
        self.updates = {e: {k: d * (0.6 + 0.2 * i) for k, d in direction.items()}
                        for i, e in enumerate(self.ids)}
        for e in self.ids:  # value 0 moves for nobody: its sum is exactly 0
            next(iter(self.updates[e].values())).view(-1)[0] = 0.0
        self.weights = {e: 10.0 + i for i, e in enumerate(self.ids)}
        self.errors: dict[str, str] = {}
        self.uploads: dict[str, Payload] = {}

    def global_model(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.aggregator.state[(Kind.SHARED_TENSORS, "")].items()}

    def upload_of(self, e: str, base: dict[str, torch.Tensor]) -> Payload:
        tensors = {k: base[k] + self.updates[e][k] if k in self.updates[e] else base[k].clone()
                   for k in self.spec.tensors}
        return Payload([Section(Kind.SHARED_TENSORS, "", tensors)])

    def expected(self) -> dict[str, torch.Tensor]:
        """The weighted mean of this round's uploads in the clear."""
        total = sum(self.weights.values())
        names = self.uploads[self.ids[0]].sections[0].tensors
        return {k: sum(self.weights[e] * self.uploads[e].sections[0].tensors[k].double()
                       for e in self.ids) / total for k in names}

    def run(self, round_number: int, tamper=None) -> dict:
        self.aggregator.begin_round(round_number, self.ids, len(self.ids))
        self.driver.begin_round(round_number, self.registry)
        common = self.aggregator.broadcast("train")
        base = {k: v.clone() for k, v in common.sections[0].tensors.items()}
        participants, figures, self.errors = list(self.ids), {}, {}
        for name in self.driver.expand(("train",)):
            if self.driver.skip(name):
                continue
            received = []
            for i, e in enumerate(participants):
                personal = self.driver.personal(e, name)
                if tamper is not None:
                    personal = tamper(name, e, personal)
                try:
                    if name == "train":
                        self.uploads[e] = self.upload_of(e, base)
                        upload = self.edges[e].mask(round_number, "train", personal,
                                                    self.uploads[e], self.weights[e],
                                                    self.method, self.models, common=common,
                                                    seed=1000 * round_number + i,
                                                    codec=self.up)
                    else:
                        upload = self.edges[e].step(name, round_number, personal)
                except SecAggError as err:  # the edge sits the step out
                    self.errors[e] = str(err)
                    continue
                if tamper is not None:
                    upload = tamper(name, e, upload)
                try:
                    if name == "train":  # the header's weight, as SecAggStep hands it over
                        self.driver.state_weight(name, e, self.weights[e])
                    self.driver.accept(name, e, upload)
                except ValueError as err:  # refused: dropped from the phase
                    self.errors[e] = str(err)
                    continue
                received.append(e)
            figures.update(self.driver.close(name, lambda: common))
            participants = received
        return figures


def assert_mean_within(rounds: CompressedRounds, bound_per_value) -> float:
    expected = torch.cat([t.reshape(-1) for t in rounds.expected().values()])
    after = torch.cat([t.reshape(-1).double() for t in rounds.global_model().values()])
    error = (after - expected).abs().numpy()
    assert np.all(error <= bound_per_value), (error - bound_per_value).max()
    return float(error.max())


@pytest.mark.parametrize("bits", [8, 4])
def test_driven_rounds_first_at_32_bits_then_packed_integers(tmp_path, bits):
    rounds = CompressedRounds(tmp_path, bits=bits)
    n = rounds.driver.lengths["train"] - 1
    first = rounds.run(1)
    assert "secagg-aborted" not in first and first["aggregated"] == 4
    assert "ring_bits" not in first["secagg-unmask"]  # no earlier sum to scale by: 32 bits
    quantizer = rounds.driver.quantizer("train")
    assert_mean_within(rounds, 4 / (2 * quantizer.scale * 46.0) + 1e-6)
    # round 2: each edge's change against the global it got, at R = bits + 2 bits a value
    second = rounds.run(2)
    assert "secagg-aborted" not in second, second
    ring = bits + 2
    assert second["secagg-unmask"]["ring_bits"] == ring
    integer = rounds.driver.integer("train")
    schema = rounds.driver.schema("train")[0].tensors
    assert schema["y"].dtype == torch.uint8 and schema["y"].shape == (packed_length(n, ring),)
    assert schema["weight"].shape == (1,)
    step = np.repeat(integer.scales.astype(np.float64), integer.block)[:n]
    bound = 4 * integer.weight_ref * step / integer.levels / 46.0 + 1e-6  # + float32 storage
    assert_mean_within(rounds, bound)


def test_a_masked_int8_upload_costs_r_over_32_of_the_raw_bytes(tmp_path):
    rounds = CompressedRounds(tmp_path, n=4)
    sizes = {}

    def measure(name, e, payload):
        if name == "train" and payload.sections and payload.sections[0].kind == Kind.SECAGG \
                and payload.sections[0].name == "masked":
            sizes[e] = sum(t.numel() * t.element_size()
                           for t in payload.sections[0].tensors.values())
        return payload

    rounds.run(1, measure)
    n = rounds.driver.lengths["train"] - 1
    assert sizes["e0"] == 4 * (n + 1)  # the 32-bit path: a word a value and the weight
    rounds.run(2, measure)
    ring = ring_bits(8, 4)
    assert sizes["e0"] == packed_length(n, ring) + 4
    assert sizes["e0"] / (4 * n) == pytest.approx(ring / 32, rel=1e-3)  # 10/32 = 0.3125
    # the bench, 10 edges: R = 12 -> 0.375 of raw (an exact sum of 10 int8 values
    # needs 8 + ceil(log2 10) bits)
    assert (packed_length(n, ring_bits(8, 10)) + 4) / (4 * n) == pytest.approx(0.375, rel=1e-3)


def test_without_compression_the_request_and_the_upload_are_as_before(tmp_path):
    rounds = CompressedRounds(tmp_path)
    rounds.driver.policy = replace(rounds.driver.policy, bits=0)
    assert "bits" not in rounds.driver.policy.to_config()  # the run config as before
    for e in rounds.ids:
        rounds.edges[e].policy = replace(rounds.policy, bits=0)
    seen = {}

    def look(name, e, payload):
        if name == "train":
            seen.setdefault(e, []).append(payload)
        return payload

    rounds.run(1)
    rounds.run(2, look)
    personal, upload = seen["e0"]
    info = personal.get(Kind.SECAGG, "request").tensors
    assert set(info) == {"info"}  # no scales
    assert set(upload.sections[0].tensors) == {"y"}
    assert upload.sections[0].tensors["y"].dtype == torch.int32


def test_error_feedback_carries_what_an_edge_did_not_send_across_a_restart(tmp_path):
    """+ef: the edge keeps (its change + residual) - what it sent as private state (0600),
    reads it back after a restart and adds it to the next round's change; the unmasked
    global is exactly what the edges' integers say, residual included."""
    rounds = CompressedRounds(tmp_path, feedback=True, margin=1.0)  # clips: a residual
    rounds.run(1)  # 32 bits: everything sent, the residual zero
    path = tmp_path / "e0" / RESIDUAL_FILE
    assert np.all(load_tensors(path)[0]["train"].numpy() == 0)
    residuals = {}
    for round_number in (2, 3):
        base = {k: v.clone() for k, v in rounds.global_model().items()}
        for e in rounds.ids:  # a restart before each round: the residual comes from disk
            rounds.edges[e] = EdgeSecAgg(tmp_path / e, e, rounds.edges[e].signing_key,
                                         rounds.policy)
            residuals[e] = load_tensors(tmp_path / e / RESIDUAL_FILE)[0]["train"].double()
        figures = rounds.run(round_number)
        assert "secagg-aborted" not in figures
        integer = rounds.driver.integer("train")
        common = Payload([Section(Kind.SHARED_TENSORS, "", base)])
        specs = masked_phases(rounds.method, rounds.models)["train"]
        total = 0
        for i, e in enumerate(rounds.ids):
            x = (flatten_upload(specs, rounds.uploads[e]) - base_vector(specs, common)
                 + residuals[e].numpy())
            generator = torch.Generator().manual_seed(rounding_seed(1000 * round_number + i,
                                                                    "train"))
            words, error = integer.quantize(x, rounds.weights[e], generator)
            total = total + words[:-1].view(np.int32).astype(np.int64)
            kept = load_tensors(tmp_path / e / RESIDUAL_FILE)[0]["train"].numpy()
            assert np.allclose(kept, error.astype(np.float32), atol=1e-7)
            assert os.stat(tmp_path / e / RESIDUAL_FILE).st_mode & 0o777 == 0o600
        assert np.abs(error).max() > 0  # there is something to carry
        step = np.repeat(integer.scales.astype(np.float64), integer.block)[:total.size]
        mean = total * step * integer.weight_ref / integer.levels / 46.0
        after = torch.cat([t.reshape(-1).double() for t in rounds.global_model().values()])
        expected = base_vector(specs, common) + mean
        assert np.allclose(after.numpy(), expected, atol=2e-6)


# ---- what an attacker sends -------------------------------------------------------------


def request_with(personal: Payload, info_changes: dict | None = None,
                 scales: bytes | None = None) -> Payload:
    section = personal.get(Kind.SECAGG, "request")
    tensors = {k: t.numpy().tobytes() for k, t in section.tensors.items()}
    info = json.loads(tensors.pop("info"))
    info.update(info_changes or {})
    if scales == b"":
        del tensors["scales"]
    elif scales is not None:
        tensors["scales"] = scales
    return request(info, tensors)


@pytest.mark.parametrize("change, reason", [
    ({"scales": "nan"}, "scales hold non-finite values"),
    ({"scales": "inf"}, "scales hold non-finite values"),
    ({"scales": "zero"}, r"scales hold values <= 0"),
    ({"scales": "negative"}, r"scales hold values <= 0"),
    ({"scales": "short"}, r"scales: \d+ bytes, expected"),
    ({"scales": "none"}, r"scales: 0 bytes, expected"),
    ({"weight_ref": float("nan")}, "weight_ref nan is not in"),
    ({"weight_ref": 0.0}, "weight_ref 0.0 is not in"),
    ({"weight_ref": 1e9}, "weight_ref 1000000000.0 is not in"),
    ({"weight_ref": "1"}, "weight_ref '1' is not in"),
    ({"bits": 4}, r"bits/block \(4, 64\) differ from the run config's \(8, 64\)"),
    ({"block": 128}, r"bits/block \(8, 128\) differ"),
    ({"parties": 9}, "fixed point .* differs from the run config's"),
])
def test_the_edge_refuses_a_fixed_point_the_run_config_does_not_allow(tmp_path, change, reason):
    rounds = CompressedRounds(tmp_path)
    rounds.run(1)

    def spoil(name, e, payload):
        if name != "train" or e != "e1" or payload.get(Kind.SECAGG, "request") is None:
            return payload
        kind = change.get("scales")
        if kind is None:
            return request_with(payload, change)
        scales = np.frombuffer(payload.get(Kind.SECAGG, "request").tensors["scales"]
                               .numpy().tobytes(), np.float32).copy()
        if kind == "short":
            return request_with(payload, scales=scales[:-1].tobytes())
        if kind == "none":
            return request_with(payload, scales=b"")
        scales[3] = {"nan": np.nan, "inf": np.inf, "zero": 0.0, "negative": -1.0}[kind]
        return request_with(payload, scales=scales.tobytes())

    figures = rounds.run(2, spoil)
    assert "e1" in rounds.errors and re.search(reason, rounds.errors["e1"]), rounds.errors
    # the others still sum (e1 sat the masked step out: a dropout the protocol recovers)
    assert figures.get("aggregated") == 3, figures


def test_no_integer_request_is_accepted_without_integer_compression(tmp_path):
    rounds = CompressedRounds(tmp_path)
    rounds.run(1)
    for e in rounds.ids:  # edges whose run config says no compression
        rounds.edges[e].policy = replace(rounds.policy, bits=0)
    rounds.run(2)
    assert all("the run config has no integer compression" in rounds.errors[e]
               for e in rounds.ids), rounds.errors


def test_a_packed_vector_of_the_wrong_length_is_refused_before_its_body_is_read(tmp_path):
    rounds = CompressedRounds(tmp_path)
    rounds.run(1)
    method = rounds.method
    gate = UploadGate(ServerConfig(), TrainConfig(), method, rounds.registry, rounds.aggregator,
                      None, None, None)

    def short(name, e, payload):
        if name == "train" and e == "e2" and payload.sections[0].name == "masked":
            tensors = dict(payload.sections[0].tensors)
            schema = rounds.driver.schema("train")
            gate.check_manifest(encode(payload).manifest, schema)  # the honest one passes
            tensors["y"] = tensors["y"][:-1]
            spoiled = Payload([Section(Kind.SECAGG, "masked", tensors)])
            with pytest.raises(Refused, match=r"tensor 'y': shape \[\d+\], expected"):
                gate.check_manifest(encode(spoiled).manifest, schema)
            return spoiled  # and should it get past the gate, the driver refuses it too
        return payload

    figures = rounds.run(2, short)
    assert "packed vector of" in rounds.errors["e2"]
    assert figures["aggregated"] == 3 and "secagg-aborted" not in figures


def test_a_sum_beyond_the_levels_aborts_the_round_by_name_and_leaves_the_global(tmp_path):
    rounds = CompressedRounds(tmp_path)
    rounds.run(1)
    before = rounds.global_model()
    n = rounds.driver.lengths["train"] - 1

    def shift_value_zero(name, e, payload):  # value 0's honest sum is exactly 0
        if name == "train" and e == "e3" and payload.sections[0].name == "masked":
            ring = rounds.driver.integer("train").ring
            words = unpack_bits(payload.sections[0].tensors["y"].numpy(), ring, n)
            words[0] = (int(words[0]) + 2 ** (ring - 1)) % 2**ring
            return Payload([Section(Kind.SECAGG, "masked", {
                "y": torch.from_numpy(pack_bits(words, ring)),
                "weight": payload.sections[0].tensors["weight"]})])
        return payload

    figures = rounds.run(2, shift_value_zero)
    assert "beyond 4 edges x 127 (int8 levels)" in figures["secagg-aborted"]
    assert "nothing is aggregated" in figures["secagg-aborted"] and figures["aggregated"] == 0
    after = rounds.global_model()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "secagg-aborted" not in rounds.run(3)  # the next honest round runs


def test_a_server_that_gives_one_edge_other_scales_gets_no_unmask(tmp_path):
    """Huge scales for all but e0 would make the others' integers ~0 and the sum e0's:
    each edge signs the digest of its scales with the survivor list, the server's check
    finds e0's signature over other scales, and no edge reveals a seed of a survivor that
    did not sign its own scales."""
    rounds = CompressedRounds(tmp_path)
    rounds.run(1)

    def isolate(name, e, payload):
        if name == "train" and e != "e0" and payload.get(Kind.SECAGG, "request") is not None:
            integer = rounds.driver.integer("train")
            huge = replace(integer, scales=integer.scales * np.float32(1e6))
            # the server's own check, as a server that means it would set it
            rounds.driver.rounds["train"].fixed_point = huge.digest
            return request_with(payload, scales=huge.scales.tobytes())
        return payload

    figures = rounds.run(2, isolate)
    assert "did not sign the survivor list" in figures["secagg-aborted"]
    assert figures["aggregated"] == 0


def test_an_edge_reveals_no_seed_of_a_survivor_without_its_signature_of_the_same_scales():
    ids = ["a", "b", "c"]
    policy = SecAggPolicy(graph="full", clip=4.0, max_weight=100.0, bits=8, block=8)
    server, clients, keys = through_receive(ids, policy, 9)
    honest = IntegerQuantizer(int_codec(8, 8), 3, 100.0, np.ones(1, np.float32), 1.0)
    target = replace(honest, scales=np.full(1, 1e-3, np.float32))  # a malicious server's
    signatures = {}
    for e in ids:
        q = target if e == "a" else honest
        words, _ = q.quantize(np.zeros(8), 1.0, torch.Generator().manual_seed(1))
        clients[e].mask_words(server.mask_request(e), words, q.ring, q.digest)
        signatures[e] = clients[e].confirm(ids, keys[e])
    # a server that withholds a's signature or passes it on: b reveals nothing either way
    for given in ({"c": signatures["c"]}, {"a": signatures["a"], "c": signatures["c"]}):
        with pytest.raises(SecAggError, match=r"survivors \['a'\] did not sign the survivor "
                                              "list under the fixed point"):
            clients["b"].unmask(ids, given)
    assert clients["b"].step == "confirmed"  # nothing revealed, the step not spent


# ---- end to end: real gRPC, a real ServerApp and EdgeDaemons ------------------------------


def int8_installed() -> bool:
    from fedattn_shared.compress.registry import available_codecs
    return "int8" in available_codecs()


class ShortPackedVector(EdgeSecAgg):
    """The real SecAgg client, except that edge e2 uploads its round-3 packed vector one
    byte short (what an attacker's manifest would declare). ``plain`` (set per test)
    records each upload in the clear with its weight and the global it is against."""

    plain: dict = {}

    def mask(self, round_number, phase, personal, upload, weight, method, models, **kwargs):
        specs = masked_phases(method, models)[phase]
        self.plain[(round_number, self.edge_id)] = (
            weight, flatten_upload(specs, upload), base_vector(specs, kwargs["common"]))
        masked = super().mask(round_number, phase, personal, upload, weight, method, models,
                              **kwargs)
        if self.edge_id != "e2" or round_number != 3:
            return masked
        tensors = dict(masked.sections[0].tensors)
        tensors["y"] = tensors["y"][:-1].clone()
        return Payload([Section(Kind.SECAGG, "masked", tensors)])


@pytest.mark.skipif(not int8_installed(), reason="the int8 codec is not installed here (it "
                                                  "lands with the codec library)")
def test_int8_under_secagg_over_grpc_sends_r_bits_a_value(tmp_path, monkeypatch, caplog):
    import asyncio
    import threading

    from conftest import write_edge_dirs

    from fl_edge import daemon as edge_daemon
    from fl_edge.daemon import EdgeDaemon, EdgeOptions
    from fl_server.app import ServerApp

    train = TrainConfig(lr=0.05, model="lenet-bn", local_epochs=1)
    cls = load_method("fedavg")
    method = cls(MethodContext(train, cls.Params()))
    cfg = ServerConfig(method="fedavg", rounds=3, min_edges=3, host="127.0.0.1", port=0,
                       checkpoint_dir=str(tmp_path / "server"), insecure=True, poll_timeout=2.0,
                       round_timeout=60, eval_every=0, secagg=True, compress="up=int8")
    app = ServerApp(cfg, train, method)
    engine = app.engine
    assert engine.secagg.policy.bits == 8 and engine.secagg.policy.block == 256
    masked_bytes: dict[tuple[int, str], int] = {}
    accept = engine.secagg.accept

    def server_spy(name, edge, payload):
        if name == "train":
            masked_bytes[(engine.round + 1, edge)] = sum(  # the round under way
                t.numel() * t.element_size() for t in payload.sections[0].tensors.values())
        return accept(name, edge, payload)

    engine.secagg.accept = server_spy
    monkeypatch.setattr(edge_daemon, "EdgeSecAgg", ShortPackedVector)
    monkeypatch.setattr(ShortPackedVector, "plain", {})
    loop = asyncio.new_event_loop()
    port = loop.run_until_complete(app.start())
    server = threading.Thread(target=loop.run_until_complete, args=(app.run(),))
    server.start()
    outcome = {}

    def edge(i, data_dir):
        options = EdgeOptions(server=f"127.0.0.1:{port}", data_dir=data_dir,
                              state_dir=tmp_path / f"state-{i}", name=f"e{i}", device="cpu",
                              retry_for=30, progress=False)
        outcome[f"e{i}"] = EdgeDaemon(options).run()

    dirs = write_edge_dirs(tmp_path, 3, [60, 90, 120])
    try:
        threads = [threading.Thread(target=edge, args=(i, d)) for i, d in enumerate(dirs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        server.join(timeout=60)
    finally:
        loop.close()
    assert outcome == {"e0": 0, "e1": 0, "e2": 0}
    rounds = engine.history["rounds"]
    n = engine.secagg.lengths["train"] - 1
    ring = ring_bits(8, 3)  # 10 bits
    assert "ring_bits" not in rounds[0]["aggregate"]["secagg-unmask"]  # round 1: 32 bits
    assert rounds[1]["aggregate"]["secagg-unmask"]["ring_bits"] == ring
    assert rounds[1]["aggregate"]["aggregated"] == 3
    for e in ("e0", "e1", "e2"):
        assert masked_bytes[(1, e)] == 4 * (n + 1)
        assert masked_bytes[(2, e)] == packed_length(n, ring) + 4
        assert masked_bytes[(2, e)] / (4 * n) == pytest.approx(ring / 32, rel=1e-3)
    # What traveled (history's wire count of the SECAGG kind, all steps): the protocol's
    # other messages cost the same in both rounds, so the drop is the masked vectors'
    saved = rounds[0]["bytes"]["up"]["secagg"]["wire"] - rounds[1]["bytes"]["up"]["secagg"]["wire"]
    expected = 3 * (4 * (n + 1) - packed_length(n, ring) - 4)
    assert saved == pytest.approx(expected, rel=0.01)
    # round 3: e2's short vector refused by the schema before its body was read; the
    # round completes with the other two
    assert (3, "e2") not in masked_bytes
    assert any("submission from e2 refused" in r.message and "tensor 'y': shape" in r.message
               for r in caplog.records)
    assert rounds[2]["aggregate"]["secagg-unmask"]["unmasked"] == 2
    state = engine.aggregator.state[(Kind.SHARED_TENSORS, "")]
    assert all(bool(torch.isfinite(t.double()).all()) for t in state.values())
    # the final global against the weighted mean of round 3's uploads in the clear (e0, e1)
    plain = ShortPackedVector.plain
    weights = {e: plain[(3, e)][0] for e in ("e0", "e1")}
    mean = sum(weights[e] * plain[(3, e)][1] for e in weights) / sum(weights.values())
    base = plain[(3, "e0")][2]
    assert np.array_equal(base, plain[(3, "e1")][2])  # both changed the same global
    final = np.concatenate([state[k].reshape(-1).double().numpy()
                            for spec in engine.secagg.masked["train"] for k in spec.tensors])
    change = mean - base
    error = np.linalg.norm(final - mean) / np.linalg.norm(change)
    print(f"int8 under SecAgg+: masked upload {masked_bytes[(2, 'e0')]} B for {n} values "
          f"({masked_bytes[(2, 'e0')] / (4 * n):.4f} of raw, R = {ring}); round 3 mean "
          f"update's relative L2 error {error:.4g}")
    assert error < 0.1  # a broken sum is off by ~1 (deterministic: seeded rounding)

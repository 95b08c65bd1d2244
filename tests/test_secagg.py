"""SecAgg+ building blocks and the protocol, in process: Shamir against hand-computed
values, the mask PRG, fixed point, the neighbour graph, dropouts at every step (full and
sparse graph), tampering, colluders, the edge's secrets on disk, refusals at start."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scipy import stats

from fedattn_shared.config import ConfigError, ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.privacy.secagg import (
    CIPHERTEXT_BYTES,
    PRIME,
    ClientRound,
    Quantizer,
    SecAggError,
    ServerRound,
    auto_degree,
    masked_phases,
    neighbour_graph,
    prg_words,
    shamir_combine,
    shamir_split,
)
from fedattn_shared.wire.codec import Kind, Payload, Section
from fl_edge.secagg import ROUND_FILE, EdgeSecAgg
from fl_edge.store import load_or_create_signing_key
from fl_server.cli import main as server_main
from fl_server.registry import AuthError, EdgeRegistry

# ---- Shamir ------------------------------------------------------------------------------


def test_shamir_combine_matches_a_hand_computed_polynomial():
    # f(x) = 42 + 5x + 7x^2 over GF(97): f(1) = 54, f(2) = 80, f(3) = 120 - 97 = 23,
    # f(4) = 174 - 97 = 77
    assert shamir_combine({1: 54, 2: 80, 3: 23}, prime=97) == 42
    assert shamir_combine({2: 80, 3: 23, 4: 77}, prime=97) == 42
    assert shamir_combine({1: 54, 3: 23, 4: 77}, prime=97) == 42
    # two points fix a line, not this parabola: 2 f(1) - f(2) = 28 (mod 97)
    assert shamir_combine({1: 54, 2: 80}, prime=97) == 28


def test_shamir_split_any_t_shares_recover_the_secret():
    secret = int.from_bytes(os.urandom(32), "big")
    shares = shamir_split(secret, 4, list(range(1, 8)))
    for subset in ([1, 2, 3, 4], [4, 5, 6, 7], [1, 3, 5, 7]):
        assert shamir_combine({x: shares[x] for x in subset}) == secret
    assert shamir_combine({x: shares[x] for x in [1, 2, 3]}) != secret


def test_fewer_than_t_shares_are_consistent_with_every_secret():
    """Perfect secrecy, exhaustively in GF(13): for t = 3, any two shares of a split fit
    exactly one degree-2 polynomial through (0, s) for every candidate s."""
    shares = shamir_split(5, 3, [1, 2, 3, 4], prime=13)
    seen = {}
    for s in range(13):
        through = {0: s, 1: shares[1], 2: shares[2]}
        # the polynomial through these three points, evaluated at x = 3
        value = sum(y * np.prod([(3 - xj) for xj in through if xj != xi])
                    * pow(int(np.prod([(xi - xj) for xj in through if xj != xi])), -1, 13)
                    for xi, y in through.items()) % 13
        seen[s] = value
    assert len(set(seen.values())) == 13  # each candidate secret predicts a distinct 3rd share
    assert seen[5] == shares[3]


def test_shamir_refuses_bad_arguments():
    with pytest.raises(ValueError, match="threshold"):
        shamir_split(1, 5, [1, 2, 3])
    with pytest.raises(ValueError, match="distinct"):
        shamir_split(1, 2, [1, 1, 2])
    with pytest.raises(ValueError, match="secret"):
        shamir_split(PRIME, 2, [1, 2])


# ---- masks, fixed point, graph ----------------------------------------------------------


def chi_square_p(data: bytes) -> float:
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
    return float(stats.chisquare(counts).pvalue)


def test_prg_is_the_aes_ctr_keystream_of_the_full_seed():
    seed = bytes(range(32))
    words = prg_words(seed, 1000)
    assert words.dtype == np.uint32 and words.shape == (1000,)
    assert np.array_equal(words, prg_words(seed, 1000))
    flipped = bytes([seed[0] ^ 1]) + seed[1:]  # every bit of the seed matters
    assert not np.array_equal(words[:8], prg_words(flipped, 8))
    flipped_last = seed[:-1] + bytes([seed[-1] ^ 0x80])
    assert not np.array_equal(words[:8], prg_words(flipped_last, 8))
    with pytest.raises(ValueError, match="32 bytes"):
        prg_words(seed[:4], 8)


def test_quantizer_bounds_and_round_trip():
    q = Quantizer(clip=2.0, max_weight=100.0, parties=10)
    assert 10 * 100 * 2.0 * q.scale + 10 < 2**31
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-2, 2, 500) for _ in range(10)]
    ws = [100.0] * 10  # the worst case: every weight and value at its bound
    xs[0][:] = 2.0
    xs[1][:] = 2.0
    total = sum(q.quantize(x, w).astype(np.uint64) for x, w in zip(xs, ws, strict=True)) % 2**32
    values, weight = q.dequantize(total.astype(np.uint32))
    expected = sum(w * x for x, w in zip(xs, ws, strict=True))
    assert np.abs(values - expected).max() <= 10 / (2 * q.scale) + 1e-9
    assert weight == pytest.approx(1000.0, abs=1e-5)


def test_the_edge_checks_its_values_before_masking():
    q = Quantizer(clip=1.0, max_weight=10.0, parties=3)
    with pytest.raises(SecAggError, match="non-finite"):
        q.quantize(np.array([0.0, np.nan]), 1.0)
    with pytest.raises(SecAggError, match="clip range"):
        q.quantize(np.array([0.5, -1.5]), 1.0)
    with pytest.raises(SecAggError, match="secagg_max_weight"):
        q.quantize(np.array([0.5]), 11.0)


def test_neighbour_graph_is_k_regular_and_symmetric():
    parties = [f"e{i:03d}" for i in range(100)]
    k = auto_degree(100)
    assert k == 20  # smallest even >= 3 log2(100) = 19.9
    graph = neighbour_graph(parties, k, random.Random(1))
    assert {len(n) for n in graph.values()} == {k}
    assert all(u in graph[v] for u in graph for v in graph[u])
    full = neighbour_graph(parties[:8], 0, random.Random(1))
    assert all(len(n) == 7 for n in full.values())


# ---- the protocol in process -----------------------------------------------------------


def public(keys: dict[str, Ed25519PrivateKey]) -> dict[str, bytes]:
    return {e: k.public_key().public_bytes_raw() for e, k in keys.items()}


def protocol(n=6, length=400, degree=-1, drop=None, tamper=None, seed=0):
    """One masked phase with dropouts ``drop = {step: [edges]}``; returns the server's
    unmasked (values, weight) and the expected pair over the survivors."""
    drop = drop or {}
    ids = [f"e{i}" for i in range(n)]
    keys = {e: Ed25519PrivateKey.generate() for e in ids}
    server = ServerRound(1, "train", length + 1, degree, 0.5, public(keys), rng=random.Random(seed))
    clients = {e: ClientRound.fresh(1, "train", e) for e in ids}
    for e in ids:
        if e not in drop.get("advertise", ()):
            server.accept_advert(e, clients[e].advertise(keys[e]))
    server.close_advertise()
    for e in sorted(server.adverts):
        if e not in drop.get("share", ()):
            info, adverts = server.share_request(e)
            server.accept_shares(e, clients[e].share(info["threshold"], info["index"], adverts,
                                                     server.signing_keys))
    server.close_share()
    quantizer = Quantizer(4.0, 1000.0, len(server.adverts))
    rng = np.random.default_rng(seed)
    xs = {e: rng.uniform(-1, 1, length) for e in ids}
    ws = {e: float(10 + i) for i, e in enumerate(ids)}
    if not server.abort_reason:
        for e in sorted(server.sharers):
            if e not in drop.get("masked", ()):
                survivors, ciphertexts = server.mask_request(e)
                if tamper and tamper[0] == e:
                    blob = bytearray(ciphertexts[tamper[1]])
                    blob[20] ^= 1
                    ciphertexts[tamper[1]] = bytes(blob)
                server.accept_masked(e, clients[e].mask(survivors, ciphertexts, xs[e], ws[e],
                                                        quantizer))
        server.close_masked()
    if not server.abort_reason:
        for e in sorted(server.masked):
            if e not in drop.get("unmask", ()):
                r = server.unmask_request(e)
                server.accept_reveal(e, clients[e].unmask(r["alive"], r["dropped"],
                                                          r["survivors"]))
    total = server.unmask()
    values, weight = quantizer.dequantize(total)
    expected = sum(ws[e] * xs[e] for e in server.masked)
    return values, weight, expected, sum(ws[e] for e in server.masked), quantizer, server


def assert_exact(result):
    values, weight, expected, total_weight, quantizer, _ = result
    assert np.abs(values - expected).max() <= quantizer.parties / (2 * quantizer.scale)
    assert weight == pytest.approx(total_weight, abs=quantizer.parties / quantizer.weight_scale)


@pytest.mark.parametrize("step", ["advertise", "share", "masked", "unmask"])
@pytest.mark.parametrize("dropped", [0, 1, 3])
def test_full_graph_sum_is_exact_with_up_to_n_minus_t_dropouts_at_each_step(step, dropped):
    # n = 7, full graph: 7 holders, t = floor(7 / 2) + 1 = 4, so n - t = 3 may drop
    result = protocol(n=7, drop={step: [f"e{i}" for i in range(1, 1 + dropped)]})
    holders = 7 - dropped if step == "advertise" else 7
    assert result[-1].threshold == holders // 2 + 1
    assert_exact(result)


@pytest.mark.parametrize("step", ["share", "masked", "unmask"])
def test_one_dropout_past_the_tolerance_aborts_without_unmasking(step):
    with pytest.raises(SecAggError, match="threshold"):
        protocol(n=7, drop={step: [f"e{i}" for i in range(4)]})


def test_sparse_graph_survives_ten_percent_dropouts():
    # 40 edges, k = 2 ceil(1.5 log2 40) = 16: 17 holders per edge, t = 9
    for seed, step in enumerate(["share", "masked", "unmask"]):
        dropped = [f"e{i}" for i in random.Random(seed).sample(range(40), 4)]
        result = protocol(n=40, length=64, degree=0, drop={step: dropped}, seed=seed)
        assert result[-1].threshold == 9
        assert {len(v) for v in result[-1].graph.values()} == {16}
        assert_exact(result)


def test_a_tampered_share_is_detected_by_its_receiver():
    with pytest.raises(SecAggError, match="share from edge e1 failed authentication"):
        protocol(n=4, tamper=("e0", "e1"))


def test_a_tampered_revealed_share_is_detected_by_the_server():
    ids = [f"e{i}" for i in range(4)]
    keys = {e: Ed25519PrivateKey.generate() for e in ids}
    server = ServerRound(1, "train", 9, -1, 0.5, public(keys))
    clients = {e: ClientRound.fresh(1, "train", e) for e in ids}
    for e in ids:
        server.accept_advert(e, clients[e].advertise(keys[e]))
    server.close_advertise()
    for e in ids:
        info, adverts = server.share_request(e)
        server.accept_shares(e, clients[e].share(info["threshold"], info["index"], adverts,
                                                 server.signing_keys))
    quantizer = Quantizer(1.0, 1.0, 4)
    for e in ids:
        survivors, cts = server.mask_request(e)
        server.accept_masked(e, clients[e].mask(survivors, cts, np.zeros(8), 1.0, quantizer))
    for e in ids:
        r = server.unmask_request(e)
        revealed = clients[e].unmask(r["alive"], r["dropped"], r["survivors"])
        if e == "e2":
            share = bytearray(revealed["b:e0"])
            share[-1] ^= 1
            revealed["b:e0"] = bytes(share)
        server.accept_reveal(e, revealed)
    with pytest.raises(SecAggError, match="e0"):
        server.unmask()


def test_an_advert_signed_by_another_key_is_refused():
    client = ClientRound.fresh(1, "train", "e0")
    bound = Ed25519PrivateKey.generate()
    server = ServerRound(1, "train", 9, -1, 0.5, {"e0": bound.public_key().public_bytes_raw()})
    with pytest.raises(SecAggError, match="identity key bound"):
        server.accept_advert("e0", client.advertise(Ed25519PrivateKey.generate()))
    advert = client.advertise(bound)
    advert["c_pk"] = bytes(32)  # a key swapped after signing
    with pytest.raises(SecAggError, match="not signed"):
        server.accept_advert("e0", advert)
    server.accept_advert("e0", client.advertise(bound))


def test_t_minus_one_colluders_learn_nothing_of_a_masked_vector():
    """The server and t - 1 = 3 edges pool everything they hold about e0 (their shares of
    b_0 and s_sk_0, their pairwise keys with e0, every ciphertext): what is left of y_0
    once they remove all the masks they can compute is still uniform bytes. One more
    share (t colluders) recovers b_0 exactly, which shows the attack is a real one."""
    n, length = 7, 50_000
    ids = [f"e{i}" for i in range(n)]
    keys = {e: Ed25519PrivateKey.generate() for e in ids}
    server = ServerRound(1, "train", length + 1, -1, 0.5, public(keys))
    clients = {e: ClientRound.fresh(1, "train", e) for e in ids}
    for e in ids:
        server.accept_advert(e, clients[e].advertise(keys[e]))
    server.close_advertise()
    t = server.threshold
    assert t == 4
    for e in ids:
        info, adverts = server.share_request(e)
        server.accept_shares(e, clients[e].share(info["threshold"], info["index"], adverts,
                                                 server.signing_keys))
    quantizer = Quantizer(1.0, 1.0, n)
    x = np.full(length, 0.25)  # a very structured input
    y = {}
    for e in ids:
        survivors, cts = server.mask_request(e)
        y[e] = clients[e].mask(survivors, cts, x, 1.0, quantizer)
    q0 = quantizer.quantize(x, 1.0)
    assert chi_square_p(q0.tobytes()) < 1e-6          # the input itself is far from uniform
    assert chi_square_p(y["e0"].tobytes()) > 1e-6     # a single masked upload is uniform
    colluders = ids[1:t]                              # t - 1 edges
    index = server.index

    def seed_from(holders):
        shares = {index[h]: int(clients[h].held["e0"][0], 16) for h in holders}
        return shamir_combine(shares) % 2**256

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from fedattn_shared.privacy.secagg import agree, pair_info

    residual = y["e0"] - prg_words(seed_from(colluders).to_bytes(32, "big"), length + 1)
    for c in colluders:  # pairwise masks the colluders share with e0
        key = agree(X25519PrivateKey.from_private_bytes(clients[c].s_sk),
                    server.adverts["e0"]["s_pk"], pair_info("mask", 1, "train", c, "e0"))
        residual = residual - prg_words(key, length + 1) if c > "e0" else \
            residual + prg_words(key, length + 1)
    assert chi_square_p(residual.tobytes()) > 1e-6
    assert not np.array_equal(residual[:100], q0[:100])
    # with t shares the seed falls out: the colluders were one short
    assert seed_from(ids[1:t + 1]).to_bytes(32, "big") == clients["e0"].seed


def test_an_edge_never_reveals_both_shares_nor_unmasks_too_few():
    result = protocol(n=4)
    server = result[-1]
    assert server.threshold == 3
    client = ClientRound.fresh(1, "train", "x")
    client.step, client.threshold, client.held = "masked", 3, {"a": ("00", "00")}
    with pytest.raises(SecAggError, match="both shares"):
        client.unmask(["a"], ["a"], 3)
    with pytest.raises(SecAggError, match="refusing to unmask"):
        client.unmask(["a"], [], 2)


# ---- the edge's secrets on disk ---------------------------------------------------------


def test_round_secrets_survive_a_restart_in_0600_files_and_are_deleted_after_unmask(tmp_path):
    ids = ["a", "b", "c"]
    for e in ids:
        (tmp_path / e).mkdir()
    keys = {e: load_or_create_signing_key(tmp_path / e) for e in ids}
    edges = {e: EdgeSecAgg(tmp_path / e, e, keys[e]) for e in ids}
    server = ServerRound(3, "train", 5, -1, 0.5, public(keys))

    def bytes_of(payload: Payload) -> dict[str, bytes]:
        return {k: t.numpy().tobytes() for k, t in payload.sections[0].tensors.items()}

    def request(info, tensors=None):
        from fl_server.secagg import request as make
        return make(info, tensors)

    for e in ids:
        advert = edges[e].step("secagg-advertise:train", 3, Payload())
        server.accept_advert(e, bytes_of(advert))
    for e in ids:
        assert os.stat(tmp_path / e / ROUND_FILE).st_mode & 0o777 == 0o600
        assert os.stat(tmp_path / e / "signing.key").st_mode & 0o777 == 0o600
    server.close_advertise()
    edges = {e: EdgeSecAgg(tmp_path / e, e, load_or_create_signing_key(tmp_path / e))
             for e in ids}  # every edge restarts here
    for e in ids:
        info, adverts = server.share_request(e)
        shares = edges[e].step("secagg-share:train", 3, request(info, {
            f"{v}/{k}": b for v, a in adverts.items() for k, b in a.items()}))
        assert all(t.numel() == CIPHERTEXT_BYTES for t in shares.sections[0].tensors.values())
        server.accept_shares(e, bytes_of(shares))
    edges = {e: EdgeSecAgg(tmp_path / e, e, load_or_create_signing_key(tmp_path / e))
             for e in ids}  # and again
    method_cls = load_method("fedavg")
    method = method_cls(MethodContext(TrainConfig(model="lenet-bn"), method_cls.Params()))
    models = method.build_models()
    spec = masked_phases(method, models)["train"]
    assert spec  # the whole shared model
    quantizer_info = {"clip": 8.0, "max_weight": 10.0, "parties": 3}
    tensors = {name: torch.full(s.shape, 0.5) for name, s in spec[0].tensors.items()}
    server.length = sum(t.numel() for t in tensors.values()) + 1
    for e in ids:
        survivors, cts = server.mask_request(e)
        masked = edges[e].mask(3, "train", request({"survivors": survivors, **quantizer_info},
                                                   cts),
                               Payload([Section(Kind.SHARED_TENSORS, "", tensors)]), 2.0,
                               method, models)
        server.accept_masked(e, masked.sections[0].tensors["y"].numpy().view(np.uint32))
        with pytest.raises(SecAggError, match="masks once"):  # not even after a restart
            EdgeSecAgg(tmp_path / e, e, keys[e]).mask(3, "train", request(
                {"survivors": survivors, **quantizer_info}, cts),
                Payload([Section(Kind.SHARED_TENSORS, "", tensors)]), 2.0, method, models)
    for e in ids:
        r = server.unmask_request(e)
        server.accept_reveal(e, bytes_of(edges[e].step("secagg-unmask:train", 3, request(r))))
        assert not (tmp_path / e / ROUND_FILE).exists()
    values, weight = Quantizer(8.0, 10.0, 3).dequantize(server.unmask())
    assert weight == pytest.approx(6.0, abs=1e-4)
    assert np.abs(values - 3.0).max() < 1e-4  # three edges x weight 2 x 0.5


def test_the_signing_key_binding_survives_a_server_restart():
    registry = EdgeRegistry()
    registry.join("edge-1", "s" * 32, {}, signing_key=b"\xab" * 32)
    restored = EdgeRegistry.from_json(registry.to_json())
    assert restored.records["edge-1"].signing_key == "ab" * 32
    with pytest.raises(AuthError, match="different signing key"):
        restored.join("edge-1", "s" * 32, {}, signing_key=b"\xcd" * 32)
    with pytest.raises(AuthError, match="32-byte"):
        restored.join("edge-2", "s" * 32, {})


# ---- refusals at start -----------------------------------------------------------------


@pytest.mark.parametrize("method_name, section", [
    ("fedstar", "PROTOTYPES"), ("fedproto", "PROTOTYPES"), ("fedmedian", "SHARED_TENSORS")])
def test_methods_needing_individual_uploads_are_refused_naming_the_section(method_name, section):
    cls = load_method(method_name)
    model = "mobilenet-v3-compact" if method_name == "fedstar" else "lenet-bn"
    method = cls(MethodContext(TrainConfig(model=model), cls.Params()))
    with pytest.raises(ValueError, match=f"section {section}.*edge by edge"):
        masked_phases(method, method.build_models())


def test_local_only_has_nothing_to_sum():
    cls = load_method("local")
    method = cls(MethodContext(TrainConfig(), cls.Params()))
    with pytest.raises(ValueError, match="uploads nothing"):
        masked_phases(method, method.build_models())


def test_pfedka_sends_its_scalars_clear_and_masks_the_students():
    cls = load_method("pfedka")
    method = cls(MethodContext(TrainConfig(model="resnet10-cifar-compact"), cls.Params()))
    phases = masked_phases(method, method.build_models())
    assert list(phases) == ["upload"]
    assert [(s.kind, s.name) for s in phases["upload"]] == [(Kind.SHARED_TENSORS, "")]


def test_fl_server_exits_2_for_an_incompatible_method(tmp_path, capsys):
    code = server_main(["--method", "fedmedian", "--secagg", "--insecure", "--port", "0",
                        "--checkpoint-dir", str(tmp_path / "s")])
    assert code == 2
    assert "--secagg: method 'fedmedian' uploads section SHARED_TENSORS" in capsys.readouterr().err


def test_secagg_settings_are_validated():
    with pytest.raises(ConfigError, match="secagg_graph"):
        ServerConfig(secagg_graph="ring").validate()
    with pytest.raises(ConfigError, match="secagg_threshold"):
        ServerConfig(secagg_threshold=1.0).validate()
    with pytest.raises(ConfigError, match="secagg_clip"):
        ServerConfig(secagg_clip=0.0).validate()


@pytest.mark.parametrize("method_name", ["fedavg", "fedprox", "fedbn", "fedper", "fedrep",
                                         "fedavgft", "ditto", "fedadam", "scaffold", "pfedme",
                                         "anfr", "pfedla", "fedsap"])
def test_weighted_sum_methods_run_under_secagg(method_name):
    cls = load_method(method_name)
    model = cls.default_model or ("se-cnn" if method_name == "fedsap" else "lenet-bn")
    method = cls(MethodContext(TrainConfig(model=model), cls.Params()))
    models = method.build_models()
    phases = masked_phases(method, models)
    assert "train" in phases
    assert {(s.kind, s.name) for s in phases["train"]} == {
        (s.kind, s.name) for s in method.uplink_schema("train", models)}


def test_the_unmasked_sum_check_admits_every_honest_extreme():
    q = Quantizer(clip=2.0, max_weight=100.0, parties=10)
    xs = [np.full(50, 2.0)] * 3 + [np.full(50, -2.0)] * 3  # every value and weight at its bound
    total = sum(q.quantize(x, 100.0).astype(np.uint64) for x in xs) % 2**32
    values, weight = q.dequantize(total.astype(np.uint32))
    q.check_sum(values, weight, 6)
    plus = sum(q.quantize(x, 100.0).astype(np.uint64) for x in xs[:3]) % 2**32
    values, weight = q.dequantize(plus.astype(np.uint32))
    q.check_sum(values, weight, 3)  # the mean is exactly the clip
    with pytest.raises(SecAggError, match="secagg_max_weight x 2 edges"):
        q.check_sum(values, weight, 2)  # 3 edges' weight claimed by 2
    with pytest.raises(SecAggError, match="clip range"):
        q.check_sum(values * 1.01, weight, 3)
    with pytest.raises(SecAggError, match="outside"):
        q.check_sum(values, -1.0, 3)

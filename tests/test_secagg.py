"""SecAgg+ building blocks and the protocol, in process: Shamir against hand-computed
values, the mask PRG, fixed point, the neighbour graph, dropouts at every step (full and
sparse graph), tampering, colluders, the edge's secrets on disk, refusals at start."""

from __future__ import annotations

import os
import random
import re

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scipy import stats

from fedattn_shared.config import ConfigError, ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.privacy.secagg import (
    ClientRound,
    Quantizer,
    SecAggError,
    SecAggPolicy,
    ServerRound,
    auto_degree,
    graph_degree,
    neighbour_graph,
)
from fedattn_shared.privacy.secagg_crypto import (
    CIPHERTEXT_BYTES,
    PRIME,
    prg_words,
    robust_combine,
    shamir_combine,
    shamir_split,
)
from fedattn_shared.privacy.secagg_layout import masked_phases
from fedattn_shared.schema import Kind, Payload, Section
from fl_edge.secagg import ROUND_FILE, EdgeSecAgg
from fl_edge.store import load_or_create_signing_key
from fl_server.cli import main as server_main
from fl_server.edges import AuthError, EdgeBook
from fl_server.secagg import SecAggDriver
from fl_server.settings import resolve_settings

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


def policy_for(degree: int, clip: float = 4.0, max_weight: float = 1000.0) -> SecAggPolicy:
    """The run config an edge holds the in-process server to (degree -1: the full graph)."""
    return SecAggPolicy(threshold=0.5, graph="full" if degree == -1 else "sparse",
                        degree=max(degree, 0), clip=clip, max_weight=max_weight)


def flip_last_bit(blob: bytes) -> bytes:
    return blob[:-1] + bytes([blob[-1] ^ 1])


def protocol(n=6, length=400, degree=-1, drop=None, garble=None, tamper=None, seed=0):
    """One masked phase with dropouts ``drop = {step: [edges]}``, senders whose encrypted
    shares are garbage ``garble = {sender: [holders]}`` and holders that flip a bit of
    every share they reveal ``tamper = [holders]``; returns the server's unmasked (values,
    weight), the expected pair over the survivors, the quantizer and the server."""
    drop, garble, tamper = drop or {}, garble or {}, tamper or []
    ids = [f"e{i}" for i in range(n)]
    keys = {e: Ed25519PrivateKey.generate() for e in ids}
    policy = policy_for(degree)
    server = ServerRound(1, "train", length + 1, degree, 0.5, public(keys), rng=random.Random(seed))
    clients = {e: ClientRound.fresh(1, "train", e) for e in ids}
    for e in ids:
        if e not in drop.get("advertise", ()):
            server.accept_advert(e, clients[e].advertise(keys[e]))
    server.close_advertise()
    for e in sorted(server.adverts):
        if e not in drop.get("share", ()):
            info, adverts = server.share_request(e)
            shares = clients[e].share(info["threshold"], info["index"], adverts,
                                      server.signing_keys, info["parties"], policy)
            for holder in garble.get(e, ()):
                shares[holder] = os.urandom(CIPHERTEXT_BYTES)
            server.accept_shares(e, shares)
    server.close_share()
    quantizer = Quantizer(policy.clip, policy.max_weight, len(server.adverts))
    rng = np.random.default_rng(seed)
    xs = {e: rng.uniform(-1, 1, length) for e in ids}
    ws = {e: float(10 + i) for i, e in enumerate(ids)}
    steps = [
        ("receive", sorted(server.sharers), lambda e: server.accept_receive(
            e, clients[e].receive(server.receive_request(e))), server.close_receive),
        ("masked", lambda: sorted(server.survivors), lambda e: server.accept_masked(
            e, clients[e].mask(server.mask_request(e), xs[e], ws[e], quantizer)),
         server.close_masked),
        ("confirm", lambda: sorted(server.masked), lambda e: server.accept_confirm(
            e, clients[e].confirm(server.confirm_request(e)["survivors"], keys[e])),
         server.close_confirm),
        ("unmask", lambda: sorted(server.confirmations), lambda e: server.accept_reveal(
            e, reveal(clients[e], server, e in tamper)), lambda: None),
    ]
    for step, participants, act, close in steps:
        if server.abort_reason:
            break
        for e in participants if isinstance(participants, list) else participants():
            if e not in drop.get(step, ()):
                act(e)
        close()
    total = server.unmask()
    values, weight = quantizer.dequantize(total)
    expected = sum(ws[e] * xs[e] for e in server.masked)
    return values, weight, expected, sum(ws[e] for e in server.masked), quantizer, server


def reveal(client: ClientRound, server: ServerRound, tampered: bool = False) -> dict[str, bytes]:
    info, signatures = server.unmask_request(client.edge)
    revealed = client.unmask(info["survivors"], signatures)
    return {k: flip_last_bit(v) for k, v in revealed.items()} if tampered else revealed


def assert_exact(result):
    values, weight, expected, total_weight, quantizer, _ = result
    assert np.abs(values - expected).max() <= quantizer.parties / (2 * quantizer.scale)
    assert weight == pytest.approx(total_weight, abs=quantizer.parties / quantizer.weight_scale)


@pytest.mark.parametrize("step", ["advertise", "share", "receive", "masked", "confirm", "unmask"])
@pytest.mark.parametrize("dropped", [0, 1, 3])
def test_full_graph_sum_is_exact_with_up_to_n_minus_t_dropouts_at_each_step(step, dropped):
    # n = 7, full graph: 7 holders, t = floor(7 / 2) + 1 = 4, so n - t = 3 may drop
    result = protocol(n=7, drop={step: [f"e{i}" for i in range(1, 1 + dropped)]})
    holders = 7 - dropped if step == "advertise" else 7
    assert result[-1].threshold == holders // 2 + 1
    assert_exact(result)


@pytest.mark.parametrize("step", ["share", "receive", "masked", "confirm", "unmask"])
def test_one_dropout_past_the_tolerance_aborts_without_unmasking(step):
    with pytest.raises(SecAggError, match="threshold"):
        protocol(n=7, drop={step: [f"e{i}" for i in range(4)]})


def test_sparse_graph_survives_ten_percent_dropouts():
    # 40 edges, k = 2 ceil(1.5 log2 40) = 16: 17 holders per edge, t = 9
    for seed, step in enumerate(["share", "receive", "masked", "confirm", "unmask"]):
        dropped = [f"e{i}" for i in random.Random(seed).sample(range(40), 4)]
        result = protocol(n=40, length=64, degree=0, drop={step: dropped}, seed=seed)
        assert result[-1].threshold == 9
        assert {len(v) for v in result[-1].graph.values()} == {16}
        assert_exact(result)


def test_graph_degree_is_what_neighbour_graph_draws():
    """What an edge checks the server's graph against is exactly the graph's degree."""
    for n in range(2, 30):
        for k in range(0, n + 2):
            graph = neighbour_graph([f"p{i}" for i in range(n)], k, random.Random(n * 31 + k))
            assert {len(v) for v in graph.values()} == {graph_degree(n, k)}, (n, k)


# ---- share authentication: a sender whose shares fail is dropped before masking ------------


def test_garbage_shares_are_reported_and_their_sender_dropped_before_masking():
    # full graph over 5 edges (t = 3): e1 sends every holder garbage
    result = protocol(n=5, garble={"e1": ["e0", "e2", "e3", "e4"]})
    server = result[-1]
    assert server.reported() == {"e1": ["e0", "e2", "e3", "e4"]}
    assert server.survivors == server.masked == {"e0", "e2", "e3", "e4"}
    assert all("e1" not in server.mask_request(e) for e in server.survivors)  # its mask: not expected
    assert_exact(result)  # the sum of the other four, exactly


def test_garbage_to_one_holder_suffices_to_drop_the_sender():
    result = protocol(n=5, garble={"e3": ["e4"]})
    assert result[-1].reported() == {"e3": ["e4"]}
    assert "e3" not in result[-1].masked
    assert_exact(result)


def test_a_reported_sender_cannot_mask_and_an_edge_never_masks_against_one():
    ids = ["a", "b", "c", "d"]
    keys = {e: Ed25519PrivateKey.generate() for e in ids}
    policy = policy_for(-1, clip=1.0, max_weight=1.0)
    server = ServerRound(1, "train", 9, -1, 0.5, public(keys))
    clients = {e: ClientRound.fresh(1, "train", e) for e in ids}
    for e in ids:
        server.accept_advert(e, clients[e].advertise(keys[e]))
    server.close_advertise()
    for e in ids:
        info, adverts = server.share_request(e)
        shares = clients[e].share(info["threshold"], info["index"], adverts,
                                  server.signing_keys, info["parties"], policy)
        if e == "d":
            shares["a"] = flip_last_bit(shares["a"])  # one tampered ciphertext
        server.accept_shares(e, shares)
    for e in ids:
        server.accept_receive(e, clients[e].receive(server.receive_request(e)))
    assert clients["a"].reported == ["d"] and "d" not in clients["a"].held
    with pytest.raises(SecAggError, match="never sent"):
        server.accept_receive("b", ["zz"])
    server.close_receive()
    assert server.survivors == {"a", "b", "c"}
    quantizer = Quantizer(1.0, 1.0, 4)
    with pytest.raises(SecAggError, match=r"edge d is not among the round's survivors \(its "
                                          r"shares failed authentication at \['a'\]\)"):
        server.accept_masked("d", clients["d"].mask(server.mask_request("d"), np.zeros(8), 1.0,
                                                    quantizer))
    # a server that still lists d as a survivor: a cannot mask against an edge it reported
    with pytest.raises(SecAggError, match="does not hold"):
        clients["a"].mask(["b", "c", "d"], np.zeros(8), 1.0, quantizer)


# ---- inconsistent reveals: set aside, the holder named, the round goes on -----------------


def test_robust_combine_finds_t_consistent_shares_and_names_the_others():
    # f(x) = 42 + 5x + 7x^2 over GF(97): f(1..5) = 54, 80, 23, 77, 48
    shares = {1: 54, 2: 80, 3: 23, 4: 77, 5: 48}
    assert robust_combine(shares, 3, lambda s: s == 42, prime=97) == (42, set())
    bad = {**shares, 1: 55, 4: 70}  # two wrong, three right: just enough
    assert robust_combine(bad, 3, lambda s: s == 42, prime=97) == (42, {1, 4})
    # three wrong: no three shares fit (in GF(97) a wrong subset hits 42 by chance 1 in 97,
    # e.g. with 81 here; over GF(2^521 - 1) against a SHA-256 commitment, never)
    with pytest.raises(SecAggError, match="fewer than 3 consistent"):
        robust_combine({**bad, 2: 82}, 3, lambda s: s == 42, prime=97)
    with pytest.raises(SecAggError, match="only 2 of the threshold 3"):
        robust_combine({1: 54, 2: 80}, 3, lambda s: s == 42, prime=97)


def test_a_tampered_revealed_share_is_set_aside_and_its_holder_named():
    # four edges, t = 3: e2 flips a bit of every share it reveals; the other three suffice
    result = protocol(n=4, tamper=["e2"])
    assert result[-1].inconsistent == {"e2"}
    assert_exact(result)


def test_two_tampering_holders_with_a_dropout_are_still_outvoted():
    # seven edges, t = 4: e6 drops after masking (its s_sk is rebuilt), e1 and e2 tamper;
    # four honest shares of every secret remain
    result = protocol(n=7, drop={"confirm": ["e6"]}, tamper=["e1", "e2"])
    server = result[-1]
    assert server.inconsistent == {"e1", "e2"} and "e6" in server.masked
    assert_exact(result)
    result = protocol(n=7, drop={"masked": ["e6"]}, tamper=["e1", "e2"])
    assert result[-1].inconsistent == {"e1", "e2"}
    assert "e6" in result[-1].survivors - result[-1].masked  # its s_sk was rebuilt
    assert_exact(result)


def test_fewer_than_t_honest_reveals_abort_the_round():
    with pytest.raises(SecAggError, match="cannot be reconstructed.*nothing is unmasked"):
        protocol(n=4, tamper=["e1", "e2"])  # 2 honest shares of each secret, t = 3


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
    policy = policy_for(-1, clip=1.0, max_weight=1.0)
    for e in ids:
        info, adverts = server.share_request(e)
        server.accept_shares(e, clients[e].share(info["threshold"], info["index"], adverts,
                                                 server.signing_keys, info["parties"], policy))
    for e in ids:
        server.accept_receive(e, clients[e].receive(server.receive_request(e)))
    server.close_receive()
    quantizer = Quantizer(1.0, 1.0, n)
    x = np.full(length, 0.25)  # a very structured input
    y = {}
    for e in ids:
        y[e] = clients[e].mask(server.mask_request(e), x, 1.0, quantizer)
    q0 = quantizer.quantize(x, 1.0)
    assert chi_square_p(q0.tobytes()) < 1e-6          # the input itself is far from uniform
    assert chi_square_p(y["e0"].tobytes()) > 1e-6     # a single masked upload is uniform
    colluders = ids[1:t]                              # t - 1 edges
    index = server.index

    def seed_from(holders):
        shares = {index[h]: int(clients[h].held["e0"][0], 16) for h in holders}
        return shamir_combine(shares) % 2**256

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from fedattn_shared.privacy.secagg_crypto import agree, pair_info

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


# ---- against a malicious server: the run config, the consistency check ---------------------


class MaliciousServerSetup:
    """Five edges (full graph, t = 3) that have masked: the server's part is the test's."""

    def __init__(self, n: int = 5):
        self.ids = [f"e{i}" for i in range(n)]
        self.keys = {e: Ed25519PrivateKey.generate() for e in self.ids}
        self.server = ServerRound(1, "train", 9, -1, 0.5, public(self.keys))
        self.clients = {e: ClientRound.fresh(1, "train", e) for e in self.ids}
        self.policy = policy_for(-1, clip=1.0, max_weight=1.0)
        for e in self.ids:
            self.server.accept_advert(e, self.clients[e].advertise(self.keys[e]))
        self.server.close_advertise()
        for e in self.ids:
            info, adverts = self.server.share_request(e)
            self.server.accept_shares(e, self.clients[e].share(
                info["threshold"], info["index"], adverts, self.server.signing_keys,
                info["parties"], self.policy))
        for e in self.ids:
            self.server.accept_receive(e, self.clients[e].receive(self.server.receive_request(e)))
        self.server.close_receive()
        quantizer = Quantizer(1.0, 1.0, n)
        for e in self.ids:
            self.server.accept_masked(e, self.clients[e].mask(self.server.mask_request(e),
                                                              np.zeros(8), 1.0, quantizer))

    def signatures(self, signers: list[str], survivors: list[str]) -> dict[str, bytes]:
        return {e: self.clients[e].confirm(survivors, self.keys[e]) for e in signers}


def test_the_edge_holds_the_share_request_to_the_run_config():
    client = ClientRound.fresh(1, "train", "e0")
    others = {f"e{i}": ClientRound.fresh(1, "train", f"e{i}") for i in range(1, 5)}
    keys = {e: Ed25519PrivateKey.generate() for e in others}
    adverts = {e: {k: v for k, v in c.advertise(keys[e]).items() if k != "sign_pk"}
               for e, c in others.items()}
    signing = public(keys)
    index = {f"e{i}": i + 1 for i in range(5)}
    full = policy_for(-1)
    # five holders: t must be at least 3, whatever the server asks
    with pytest.raises(SecAggError, match=r"threshold 2 is not in \[3, 5\]"):
        client.share(2, index, adverts, signing, 5, full)
    # a run configured with threshold 0.7: t >= floor(3.5) + 1 = 4
    with pytest.raises(SecAggError, match=r"threshold 3 is not in \[4, 5\]"):
        client.share(3, index, adverts, signing, 5, SecAggPolicy(threshold=0.7, graph="full"))
    # the full graph over 5 parties gives 4 neighbours, not 2 (a smaller group, lower t)
    two = {e: adverts[e] for e in ("e1", "e2")}
    with pytest.raises(SecAggError, match="gives this edge 2 neighbours; the run config "
                                          "implies 4"):
        client.share(2, {e: index[e] for e in ("e0", "e1", "e2")}, two, signing, 5, full)
    assert client.step == "advertised"  # nothing was shared
    assert len(client.share(3, index, adverts, signing, 5, full)) == 4


def test_the_run_config_carries_a_policy_with_a_majority_floor():
    assert SecAggPolicy.from_config(policy_for(0).to_config()) == policy_for(0)
    with pytest.raises(ValueError, match=r"secagg.threshold must be in \[0.5, 1\)"):
        SecAggPolicy.from_config({**policy_for(0).to_config(), "threshold": 0.3})
    with pytest.raises(ValueError, match="secagg.clip"):
        SecAggPolicy.from_config({**policy_for(0).to_config(), "clip": float("inf")})
    with pytest.raises(ValueError, match="unknown fields"):
        SecAggPolicy.from_config({**policy_for(0).to_config(), "t": 2})
    with pytest.raises(ConfigError, match=r"secagg_threshold must be in \[0.5, 1\)"):
        ServerConfig(secagg_threshold=0.4).validate()


def test_too_few_signatures_of_the_survivor_list_refuse_the_unmask():
    s = MaliciousServerSetup()
    survivors = s.ids
    for e in s.ids:
        s.clients[e].confirm(survivors, s.keys[e])
    only = s.signatures(["e1"], survivors)  # e0 itself + e1: 2 < t = 3
    with pytest.raises(SecAggError, match="only 2 of this edge's share holders"):
        s.clients["e0"].unmask(survivors, only)
    forged = {**only, "e2": bytes(64), "e3": only["e1"]}  # garbage and a copied signature
    with pytest.raises(SecAggError, match="only 2 of this edge's share holders"):
        s.clients["e0"].unmask(survivors, forged)
    assert s.clients["e0"].step == "confirmed"  # nothing revealed; honest signatures still do
    revealed = s.clients["e0"].unmask(survivors, s.signatures(["e1", "e2"], survivors))
    assert set(revealed) == {f"b:{e}" for e in s.ids}


def test_signatures_over_another_survivor_list_do_not_count():
    """The split view: the server tells e0, e1 and e4 that e4 is alive and e2, e3 that it
    dropped, to get b_4 from some holders and s_sk_4 from others. e2 and e3 hold only
    each other's signature of their list (2 < t = 3) and reveal nothing."""
    s = MaliciousServerSetup()
    alive, dropped = s.ids, [e for e in s.ids if e != "e4"]
    for e in ("e0", "e1", "e4"):
        s.clients[e].confirm(alive, s.keys[e])
    for e in ("e2", "e3"):
        s.clients[e].confirm(dropped, s.keys[e])
    told_alive = s.signatures(["e0", "e1", "e4"], alive)
    with pytest.raises(SecAggError, match="only 2 of this edge's share holders"):
        s.clients["e2"].unmask(dropped, {**told_alive, "e3": s.clients["e3"].confirm(
            dropped, s.keys["e3"])})
    # nor does a list other than the one the edge signed, whoever signed it
    with pytest.raises(SecAggError, match="differs from the one this edge signed"):
        s.clients["e2"].unmask(alive, told_alive)
    # and an edge signs one list per round
    with pytest.raises(SecAggError, match="second, different survivor list"):
        s.clients["e2"].confirm(alive, s.keys["e2"])
    # the server refuses a signature that is not over U3 itself
    s.server.close_masked()
    with pytest.raises(SecAggError, match="signature of the survivor list is not valid"):
        s.server.accept_confirm("e2", s.clients["e2"].confirm(dropped, s.keys["e2"]))


def test_an_edge_never_reveals_s_of_a_peer_it_saw_alive_nor_its_own():
    # dropouts after sharing and after masking: every reveal follows from U3 alone
    result = protocol(n=7, drop={"masked": ["e5"], "confirm": ["e6"]})
    server = result[-1]
    assert server.survivors - server.masked == {"e5"}
    for holder, revealed in server.reveals.items():
        assert f"b:{holder}" in revealed and f"s:{holder}" not in revealed
        s_of = {k[2:] for k in revealed if k.startswith("s:")}
        b_of = {k[2:] for k in revealed if k.startswith("b:")}
        assert s_of == {"e5"} and not s_of & b_of and b_of <= server.masked
    # a server that leaves the edge itself out of U3 (to rebuild its s_sk) is refused
    s = MaliciousServerSetup()
    with pytest.raises(SecAggError, match="leaves out this edge"):
        s.clients["e0"].confirm(["e1", "e2", "e3", "e4"], s.keys["e0"])
    # and so is one that names a neighbour this edge never masked against
    client = s.clients["e1"]
    client.survivors = ["e0", "e2"]  # as if e3 and e4 had not been survivors when it masked
    with pytest.raises(SecAggError, match="did not mask against"):
        client.confirm(s.ids, s.keys["e1"])


def test_too_few_survivors_are_refused_before_signing():
    s = MaliciousServerSetup()
    with pytest.raises(SecAggError, match="only 2 edges survived.*refusing to unmask"):
        s.clients["e0"].confirm(["e0", "e1"], s.keys["e0"])
    with pytest.raises(SecAggError, match="unmask asked in state masked"):
        s.clients["e0"].unmask(s.ids, {})  # no reveal without signing first


# ---- the edge's secrets on disk ---------------------------------------------------------


def test_round_secrets_survive_a_restart_in_0600_files_and_are_deleted_after_unmask(tmp_path):
    ids = ["a", "b", "c"]
    for e in ids:
        (tmp_path / e).mkdir()
    keys = {e: load_or_create_signing_key(tmp_path / e) for e in ids}
    policy = policy_for(-1, clip=8.0, max_weight=10.0)

    def restart() -> dict[str, EdgeSecAgg]:  # every edge restarts between two steps
        return {e: EdgeSecAgg(tmp_path / e, e, load_or_create_signing_key(tmp_path / e), policy)
                for e in ids}

    edges = restart()
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
    edges = restart()
    for e in ids:
        info, adverts = server.share_request(e)
        shares = edges[e].step("secagg-share:train", 3, request(info, {
            f"{v}/{k}": b for v, a in adverts.items() for k, b in a.items()}))
        assert all(t.numel() == CIPHERTEXT_BYTES for t in shares.sections[0].tensors.values())
        server.accept_shares(e, bytes_of(shares))
    edges = restart()
    for e in ids:
        checked = edges[e].step("secagg-receive:train", 3, request({}, server.receive_request(e)))
        assert checked.sections[0].name == "receive" and not checked.sections[0].tensors
        server.accept_receive(e, [])
    server.close_receive()
    edges = restart()
    method_cls = load_method("fedavg")
    method = method_cls(MethodContext(TrainConfig(model="lenet-bn"), method_cls.Params()))
    models = method.build_models()
    spec = masked_phases(method, models)["train"]
    assert spec  # the whole shared model
    quantizer_info = {"clip": 8.0, "max_weight": 10.0, "parties": 3}
    tensors = {name: torch.full(s.shape, 0.5) for name, s in spec[0].tensors.items()}
    server.length = sum(t.numel() for t in tensors.values()) + 1
    upload = Payload([Section(Kind.SHARED_TENSORS, "", tensors)])
    with pytest.raises(SecAggError, match="differs from the run config"):  # the server's word
        edges["a"].mask(3, "train", request({"survivors": server.mask_request("a"),
                                             **quantizer_info, "clip": 80.0}),
                        upload, 2.0, method, models)
    for e in ids:
        mask_request = request({"survivors": server.mask_request(e), **quantizer_info})
        masked = edges[e].mask(3, "train", mask_request, upload, 2.0, method, models)
        server.accept_masked(e, masked.sections[0].tensors["y"].numpy().view(np.uint32))
        with pytest.raises(SecAggError, match="masks once"):  # not even after a restart
            EdgeSecAgg(tmp_path / e, e, keys[e], policy).mask(3, "train", mask_request, upload,
                                                              2.0, method, models)
    edges = restart()
    for e in ids:
        confirm = request(server.confirm_request(e))
        signature = bytes_of(edges[e].step("secagg-confirm:train", 3, confirm))
        # asked again after a restart, it signs the same list again
        assert bytes_of(restart()[e].step("secagg-confirm:train", 3, confirm)) == signature
        server.accept_confirm(e, signature["sig"])
    edges = restart()
    for e in ids:
        info, signatures = server.unmask_request(e)
        server.accept_reveal(e, bytes_of(edges[e].step("secagg-unmask:train", 3, request(
            info, {f"sig:{v}": sig for v, sig in signatures.items()}))))
        assert not (tmp_path / e / ROUND_FILE).exists()
    values, weight = Quantizer(8.0, 10.0, 3).dequantize(server.unmask())
    assert weight == pytest.approx(6.0, abs=1e-4)
    assert np.abs(values - 3.0).max() < 1e-4  # three edges x weight 2 x 0.5


def test_an_edge_refuses_malformed_requests_by_name(tmp_path):
    edge = EdgeSecAgg(tmp_path, "a", load_or_create_signing_key(tmp_path), policy_for(-1))
    with pytest.raises(SecAggError, match="no secure-aggregation secrets on disk"):
        edge.step("secagg-share:train", 1, Payload())
    edge.step("secagg-advertise:train", 1, Payload())
    from fl_server.secagg import request
    garbage = Payload([Section(Kind.SECAGG, "request", {"info": torch.tensor([1, 2, 3],
                                                                             dtype=torch.uint8)})])
    with pytest.raises(SecAggError, match="no readable info"):
        edge.step("secagg-share:train", 1, garbage)
    with pytest.raises(SecAggError, match="malformed request"):
        edge.step("secagg-share:train", 1, request({"threshold": 2}))
    with pytest.raises(SecAggError, match="run config does not enable secure aggregation"):
        EdgeSecAgg(tmp_path, "a", load_or_create_signing_key(tmp_path)).step(
            "secagg-advertise:train", 1, Payload())


def test_the_signing_key_binding_survives_a_server_restart():
    registry = EdgeBook()
    registry.join("edge-1", "s" * 32, {}, signing_key=b"\xab" * 32)
    restored = EdgeBook.from_json(registry.to_json())
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


# ---- the driver: what reaches the aggregator --------------------------------------------


class DrivenRounds:
    """The server's SecAggDriver with EdgeSecAgg edges, in process: what the engine does
    for each phase (requests, uploads, close) without gRPC. ``attack(name, edge, upload)``
    may replace an edge's upload before the driver sees it."""

    def __init__(self, tmp_path, n: int = 4):
        self.ids = [f"e{i}" for i in range(n)]
        cls = load_method("fedavg")
        self.method = cls(MethodContext(TrainConfig(model="lenet-bn"), cls.Params()))
        self.models = self.method.build_models()
        self.aggregator = self.method.server(self.models)
        cfg = ServerConfig(secagg=True, secagg_graph="full", secagg_clip=8.0,
                           secagg_max_weight=1000.0)
        self.driver = SecAggDriver(resolve_settings(cfg), self.method, self.models, self.aggregator)
        self.registry = EdgeBook()
        self.edges = {}
        policy = SecAggPolicy.from_config(self.driver.policy.to_config())  # the run config
        for e in self.ids:
            (tmp_path / e).mkdir()
            key = load_or_create_signing_key(tmp_path / e)
            self.registry.join(e, "s" * 32, {}, signing_key=key.public_key().public_bytes_raw())
            self.edges[e] = EdgeSecAgg(tmp_path / e, e, key, policy)
        spec = masked_phases(self.method, self.models)["train"][0]
        self.values = {e: {name: torch.full(s.shape, 0.1 * (i + 1))
                           for name, s in spec.tensors.items()} for i, e in enumerate(self.ids)}
        self.weights = {e: 10.0 + i for i, e in enumerate(self.ids)}
        self.common: Payload | None = None  # the global the edges hold (None: not given)

    def global_model(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.aggregator.state[(Kind.SHARED_TENSORS, "")].items()}

    def run(self, round_number: int, attack=None) -> dict:
        self.aggregator.begin_round(round_number, self.ids, len(self.ids))
        self.driver.begin_round(round_number, self.registry)
        participants, figures = list(self.ids), {}
        for name in self.driver.expand(("train",)):
            if self.driver.skip(name):
                continue
            received = []
            for e in participants:
                personal = self.driver.personal(e, name)
                if name == "train":
                    upload = self.edges[e].mask(round_number, "train", personal, Payload(
                        [Section(Kind.SHARED_TENSORS, "", self.values[e])]), self.weights[e],
                        self.method, self.models, common=self.common)
                else:
                    upload = self.edges[e].step(name, round_number, personal)
                if attack is not None:
                    upload = attack(name, e, upload)
                try:
                    if name == "train":  # the header's weight, as SecAggStep hands it over
                        self.driver.state_weight(name, e, self.weights[e])
                    self.driver.accept(name, e, upload)
                except ValueError:
                    continue  # the engine refuses the upload and drops the edge from the phase
                received.append(e)
            figures.update(self.driver.close(name))
            participants = received
        return figures


def add_to_masked_word(edge: str, word: int, amount: int):
    """An edge that adds ``amount`` to one word of its masked vector (-1: the weight)."""
    def attack(name, e, upload):
        if name != "train" or e != edge:
            return upload
        y = upload.sections[0].tensors["y"].clone()
        y.view(-1)[word] = int((int(y.view(-1)[word]) + amount + 2**31) % 2**32 - 2**31)
        return Payload([Section(Kind.SECAGG, "masked", {"y": y})])
    return attack


@pytest.mark.parametrize("word, amount, reason", [
    (-1, 2**31, "total weight .* differs from .* stated"),      # wraps negative
    (-1, 3 * 2**30, "total weight .* differs from .* stated"),  # 2^30 subtracted: below zero
    (-1, 2**26, "total weight .* differs from .* stated"),      # +125: within n x max_weight
    (5, 2**30, "beyond the clip range"),             # one value far outside the clip
])
def test_a_tampered_masked_vector_aborts_the_round_by_name_and_the_next_one_runs(
        tmp_path, word, amount, reason):
    rounds = DrivenRounds(tmp_path)
    before = rounds.global_model()
    figures = rounds.run(1, attack=add_to_masked_word("e3", word, amount))
    assert re.search(reason, figures["secagg-aborted"])
    assert "nothing is aggregated" in figures["secagg-aborted"]
    assert figures["aggregated"] == 0
    after = rounds.global_model()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the global is untouched
    figures = rounds.run(2)  # the honest round after it aggregates
    assert "secagg-aborted" not in figures and figures["aggregated"] == 4
    total = sum(rounds.weights.values())
    expected = sum(rounds.weights[e] * 0.1 * (i + 1) for i, e in enumerate(rounds.ids)) / total
    after = rounds.global_model()
    assert all(torch.allclose(t, torch.full_like(t, expected), atol=1e-4) for t in after.values())


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

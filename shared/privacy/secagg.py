"""SecAgg+ (Bell et al., CCS 2020): secure aggregation that survives dropouts, with the
consistency check of Bonawitz et al. (CCS 2017) against an actively malicious server.

The server learns the sum over the round's surviving edges of each edge's quantized,
weighted vector and nothing else about any single one. One masked phase runs six steps:

1. advertise -- each edge u makes two X25519 key pairs (c: encryption of shares, s: mask
   agreement) and a 256-bit self-mask seed b_u, and uploads c_pk, s_pk and a commitment
   to b_u, signed with its Ed25519 identity key (bound to its edge id on the server).
2. share -- the server draws the neighbour graph over the advertisers U1 (SecAgg+'s
   random k-regular Harary graph, or the full graph) and relays each edge its neighbours'
   signed adverts; u checks the graph's degree and the threshold t against the run config
   it got at join (``SecAggPolicy``; never below a majority of its holders), verifies the
   adverts, Shamir-shares b_u and s_sk_u (threshold t) among its neighbours and itself, and
   uploads each neighbour's pair of shares AES-GCM-encrypted under a key that only u and
   that neighbour can derive (X25519 + HKDF).
3. receive -- the server relays each edge the ciphertexts addressed to it; the edge keeps
   the shares that authenticate and reports the senders whose shares do not. A reported
   sender is dropped before masking: U2 is the edges that shared, answered this step and
   were reported by nobody, so no edge masks against it and its shares are never asked for.
4. masked input -- u uploads
   y_u = q_u + PRG(b_u) + sum_{v in N(u) & U2} sign(u, v) PRG(s_uv)  (mod 2^32),
   q_u its fixed-point vector; the pairwise terms cancel in the sum. U3: the inputs that
   arrived.
5. confirm -- the server sends every edge of U3 the list U3; each signs (round, phase, its
   s_pk, sorted U3) with its identity key, once: it never signs another list that round.
6. unmask -- the server relays each edge U3 and its neighbours' signatures; the edge
   reveals nothing unless U3 is the list it signed and at least t holders of its shares
   (itself and its neighbours) signed that same list. It then derives what to reveal from
   U3 itself: its share of b for each neighbour in U3 and for itself, of s_sk for each
   neighbour in U2 \\ U3 -- never s_sk of an edge it saw alive, never its own. With t shares
   of each the server removes every self mask and the pairwise masks that dropped edges
   left behind. A revealed share that does not lie on the polynomial through t others whose
   secret matches the edge's signed commitment (b) or public key (s_sk) is set aside and
   its holder named; the round aborts only when fewer than t consistent shares remain.
   Before the sum reaches the aggregator, the server checks it against the bounds every
   honest edge obeys (``Quantizer.check_sum``), the weights the edges stated in the clear
   and the bound on one round's change of the global (``secagg_bound``): an edge can add
   anything to its masked vector, and the checks refuse a sum that no honest edges could
   have produced.

Masks come from AES-256-CTR keystreams keyed by the full 256-bit seed (never a
general-purpose RNG). Shamir's scheme is over GF(2^521 - 1); the field holds any 256-bit
secret whole. The primitives are in ``secagg_crypto.py``, the fixed-point arithmetic in
``secagg_ring.py``, and which uploads are masked, laid out as one vector, in
``secagg_layout.py``.
"""

from __future__ import annotations

import json
import math
import random
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..compress.integer import MAX_BITS, MAX_BLOCK, MIN_BITS, MIN_BLOCK
from .secagg_crypto import (
    NONCE_BYTES,
    PRIME,
    SEED_BYTES,
    SHARE_BYTES,
    advert_message,
    agree,
    int_to_share,
    pair_info,
    prg_words,
    raw_private,
    raw_public,
    robust_combine,
    seed_commitment,
    shamir_split,
    share_to_int,
    signed_by,
    survivors_message,
    verify_advert,
)
from .secagg_ring import (
    RING_BITS,
    Quantizer,
    SecAggError,
)

MIN_THRESHOLD_FRACTION = 0.5  # the edges' own floor: t > half of an edge's share holders

ADVERTISE, SHARE, RECEIVE = "secagg-advertise", "secagg-share", "secagg-receive"
CONFIRM, UNMASK = "secagg-confirm", "secagg-unmask"
BEFORE_MASKING = (ADVERTISE, SHARE, RECEIVE)   # the protocol's steps before the masked phase
AFTER_MASKING = (CONFIRM, UNMASK)              # and after it


def protocol_step(name: str) -> tuple[str, str] | None:
    """("secagg-share", "train") for the phase "secagg-share:train"; None for any phase
    that is not a step of the protocol."""
    step, sep, masked = name.partition(":")
    return (step, masked) if sep and step in BEFORE_MASKING + AFTER_MASKING else None


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# ---- the neighbour graph ---------------------------------------------------------------------
def auto_degree(parties: int) -> int:
    """SecAgg+'s O(log n) degree [reconstructed: the paper's constant depends on its
    security parameters]: the smallest even number >= 3 log2(n)."""
    return 2 * math.ceil(1.5 * math.log2(max(parties, 2)))


def neighbour_graph(parties: list[str], degree: int, rng: random.Random) -> dict[str, list[str]]:
    """A Harary graph H(k, n) over a random ordering of the parties (SecAgg+): each node
    joined to the k/2 nearest on either side; k >= n - 1 gives the full graph."""
    n = len(parties)
    if degree <= 0 or degree >= n - 1:
        return {p: sorted(q for q in parties if q != p) for p in parties}
    order = list(parties)
    rng.shuffle(order)
    half = (degree + 1) // 2
    graph: dict[str, set[str]] = {p: set() for p in parties}
    for i, p in enumerate(order):
        for step in range(1, half + 1):
            q = order[(i + step) % n]
            graph[p].add(q)
            graph[q].add(p)
    return {p: sorted(q) for p, q in graph.items()}


def holder_threshold(holders: int, fraction: float) -> int:
    """t for ``holders`` share holders (the neighbours and the edge itself)."""
    return max(2, math.floor(fraction * holders) + 1)


def graph_degree(parties: int, degree: int) -> int:
    """Neighbours of every party in ``neighbour_graph(parties, degree)``: the Harary graph
    joins each party to the ceil(k/2) nearest on either side, so it is regular."""
    if parties < 2:
        return 0
    if degree <= 0 or degree >= parties - 1:
        return parties - 1
    return min(2 * ((degree + 1) // 2), parties - 1)


@dataclass(frozen=True)
class SecAggPolicy:
    """The secure-aggregation parameters of a run, as the server's run config sent at join
    states them. An edge holds each round's requests to them (the neighbour count for the
    number of parties, the threshold t, the fixed point) instead of trusting what the
    server says per round, and never accepts t at or below half of its share holders
    (``MIN_THRESHOLD_FRACTION``), whatever the config says: below that, two disjoint
    groups of holders could each hand the server t shares."""

    threshold: float = MIN_THRESHOLD_FRACTION
    graph: str = "sparse"
    degree: int = 0
    clip: float = 16.0
    max_weight: float = 65536.0
    # --compress up=int8/int4 (0: none): the integer width, values per public scale, and
    # whether the edge carries what it did not send into the next round (``+ef``).
    bits: int = 0
    block: int = 256
    feedback: bool = False
    # The L2 norm an edge clips its change of the global to before masking (the server
    # refuses a mean that moves the global further); 0: a config without it, no clip.
    max_update: float = 0.0

    @classmethod
    def from_config(cls, section: Any) -> SecAggPolicy:
        """From the config's ``secagg`` object; ValueError names a field out of range."""
        if not isinstance(section, Mapping):
            raise ValueError("secagg: expected an object")
        extra = set(section) - {"threshold", "graph", "degree", "clip", "max_weight", "bits",
                                "block", "feedback", "max_update"}
        if extra:
            raise ValueError(f"secagg: unknown fields {sorted(extra)}")
        policy = cls(**section)
        if not (isinstance(policy.threshold, float | int) and not isinstance(policy.threshold, bool)
                and MIN_THRESHOLD_FRACTION <= policy.threshold < 1):
            raise ValueError(f"secagg.threshold must be in [{MIN_THRESHOLD_FRACTION}, 1), got "
                             f"{policy.threshold!r}")
        if policy.graph not in ("sparse", "full"):
            raise ValueError(f"secagg.graph must be sparse or full, got {policy.graph!r}")
        if not (type(policy.degree) is int and policy.degree >= 0):
            raise ValueError(f"secagg.degree must be an integer >= 0, got {policy.degree!r}")
        for name in ("clip", "max_weight"):
            value = getattr(policy, name)
            if not (isinstance(value, float | int) and not isinstance(value, bool)
                    and 0 < value < math.inf):
                raise ValueError(f"secagg.{name} must be > 0 and finite, got {value!r}")
        if not (isinstance(policy.max_update, float | int) and not isinstance(policy.max_update, bool)
                and 0 <= policy.max_update < math.inf):
            raise ValueError(f"secagg.max_update must be >= 0 and finite, got "
                             f"{policy.max_update!r}")
        if type(policy.bits) is not int or not (policy.bits == 0 or MIN_BITS <= policy.bits <= MAX_BITS):
            raise ValueError(f"secagg.bits must be 0 (none) or in [{MIN_BITS}, {MAX_BITS}], got "
                             f"{policy.bits!r}")
        if not (type(policy.block) is int and MIN_BLOCK <= policy.block <= MAX_BLOCK):
            raise ValueError(f"secagg.block must be an integer in [{MIN_BLOCK}, {MAX_BLOCK}], "
                             f"got {policy.block!r}")
        if type(policy.feedback) is not bool:
            raise ValueError(f"secagg.feedback must be true or false, got {policy.feedback!r}")
        return policy

    def to_config(self) -> dict[str, Any]:
        """The run config's ``secagg`` object; without integer compression and an update
        bound exactly the keys it had before either existed."""
        out = {"threshold": self.threshold, "graph": self.graph, "degree": self.degree,
               "clip": self.clip, "max_weight": self.max_weight}
        if self.max_update:
            out["max_update"] = self.max_update
        if self.bits:
            out.update(bits=self.bits, block=self.block, feedback=self.feedback)
        return out

    def neighbours(self, parties: int) -> int:
        """An edge's neighbours when ``parties`` edges advertised keys."""
        degree = -1 if self.graph == "full" else (self.degree or auto_degree(parties))
        return graph_degree(parties, degree)

    def min_threshold(self, holders: int) -> int:
        """The least t an edge accepts for ``holders`` share holders."""
        return holder_threshold(holders, max(self.threshold, MIN_THRESHOLD_FRACTION))


# ---- the edge ---------------------------------------------------------------------------------
def _hex(data: bytes) -> str:
    return data.hex()


def _edge_ids(value: Any, what: str) -> list[str]:
    """A list of edge ids from a server request (every byte of it is the server's)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SecAggError(f"the server's {what} is not a list of edge ids")
    if len(set(value)) != len(value):
        raise SecAggError(f"the server's {what} names an edge twice")
    return value


@dataclass
class ClientRound:
    """An edge's secrets for one masked phase; ``to_json`` is what it keeps on disk (0600)
    between the protocol's phases, so a restart inside a round loses nothing and never
    makes the edge mask twice or sign two survivor lists."""

    round: int
    phase: str
    edge: str
    c_sk: bytes
    s_sk: bytes
    seed: bytes
    step: str = "advertised"    # advertised | shared | received | masked | confirmed | done
    threshold: int = 0
    parties: int = 0
    index: dict[str, int] = field(default_factory=dict)
    neighbours: list[str] = field(default_factory=list)
    adverts: dict[str, dict[str, str]] = field(default_factory=dict)  # neighbour -> hex keys
    own_shares: tuple[str, str] = ("", "")
    held: dict[str, tuple[str, str]] = field(default_factory=dict)     # from -> (b, s) hex
    reported: list[str] = field(default_factory=list)   # senders whose shares failed
    survivors: list[str] = field(default_factory=list)  # U2 neighbours, masked against
    confirmed: list[str] = field(default_factory=list)  # the U3 this edge signed
    fixed_point: str = ""       # hex digest of the integer fixed point it masked with

    @classmethod
    def fresh(cls, round_number: int, phase: str, edge: str) -> ClientRound:
        return cls(round_number, phase, edge, raw_private(X25519PrivateKey.generate()),
                   raw_private(X25519PrivateKey.generate()), secrets.token_bytes(SEED_BYTES))

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "phase": self.phase, "edge": self.edge,
                "c_sk": _hex(self.c_sk), "s_sk": _hex(self.s_sk), "seed": _hex(self.seed),
                "step": self.step, "threshold": self.threshold, "parties": self.parties,
                "index": self.index, "neighbours": self.neighbours, "adverts": self.adverts,
                "own_shares": list(self.own_shares),
                "held": {k: list(v) for k, v in self.held.items()}, "reported": self.reported,
                "survivors": self.survivors, "confirmed": self.confirmed,
                "fixed_point": self.fixed_point}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClientRound:
        return cls(int(data["round"]), data["phase"], data["edge"], bytes.fromhex(data["c_sk"]),
                   bytes.fromhex(data["s_sk"]), bytes.fromhex(data["seed"]), data["step"],
                   int(data["threshold"]), int(data["parties"]), dict(data["index"]),
                   list(data["neighbours"]), dict(data["adverts"]), tuple(data["own_shares"]),
                   {k: tuple(v) for k, v in data["held"].items()}, list(data["reported"]),
                   list(data["survivors"]), list(data["confirmed"]),
                   str(data.get("fixed_point", "")))

    def _expect(self, *steps: str, asked: str) -> None:
        if self.step not in steps:
            raise SecAggError(f"{asked} asked in state {self.step}")

    # ---- step 1 ----------------------------------------------------------------------
    def advertise(self, signing_key: Ed25519PrivateKey) -> dict[str, bytes]:
        c_pk = raw_public(X25519PrivateKey.from_private_bytes(self.c_sk))
        s_pk = raw_public(X25519PrivateKey.from_private_bytes(self.s_sk))
        commit = seed_commitment(self.round, self.phase, self.edge, self.seed)
        sig = signing_key.sign(advert_message(self.round, self.phase, self.edge, c_pk, s_pk,
                                              commit))
        return {"c_pk": c_pk, "s_pk": s_pk, "commit": commit, "sig": sig,
                "sign_pk": raw_public(signing_key)}

    # ---- step 2 ----------------------------------------------------------------------
    def share(self, threshold: int, index: dict[str, int], adverts: dict[str, dict[str, bytes]],
              signing_keys: dict[str, bytes], parties: int, policy: SecAggPolicy) -> dict[str, bytes]:
        """Check the graph and t against the run's ``policy`` (not the server's word), verify
        the neighbours' signed adverts, then encrypt each neighbour its shares."""
        self._expect("advertised", asked="share step")
        if self.edge not in index or set(adverts) - set(index) or self.edge in adverts:
            raise SecAggError("the server's share request is inconsistent")
        if any(type(x) is not int or not 0 < x < PRIME for x in index.values()) \
                or len(set(index.values())) != len(index):
            raise SecAggError("the server's share indices are not distinct field points")
        if len(adverts) != policy.neighbours(parties):
            raise SecAggError(f"the server gives this edge {len(adverts)} neighbours; the run "
                              f"config implies {policy.neighbours(parties)} for {parties} edges")
        holders = [self.edge, *sorted(adverts)]
        floor = policy.min_threshold(len(holders))
        if not floor <= threshold <= len(holders):
            raise SecAggError(f"threshold {threshold} is not in [{floor}, {len(holders)}] for "
                              f"{len(holders)} holders (the run config's "
                              f"secagg.threshold {policy.threshold}, at least a majority)")
        for v, advert in adverts.items():
            verify_advert(self.round, self.phase, v, advert, signing_keys[v])
        xs = [index[h] for h in holders]
        b_shares = shamir_split(int.from_bytes(self.seed, "big"), threshold, xs)
        s_shares = shamir_split(int.from_bytes(self.s_sk, "big"), threshold, xs)
        c_key = X25519PrivateKey.from_private_bytes(self.c_sk)
        out = {}
        for v in holders[1:]:
            key = agree(c_key, adverts[v]["c_pk"], pair_info("enc", self.round, self.phase,
                                                             self.edge, v))
            nonce = secrets.token_bytes(NONCE_BYTES)
            plain = int_to_share(b_shares[index[v]]) + int_to_share(s_shares[index[v]])
            out[v] = nonce + AESGCM(key).encrypt(nonce, plain, self._aad(self.edge, v))
        self.threshold, self.parties, self.index = threshold, parties, dict(index)
        self.neighbours = holders[1:]
        self.adverts = {v: {"c_pk": a["c_pk"].hex(), "s_pk": a["s_pk"].hex(),
                            "sign_pk": signing_keys[v].hex()} for v, a in adverts.items()}
        own = index[self.edge]
        self.own_shares = (int_to_share(b_shares[own]).hex(), int_to_share(s_shares[own]).hex())
        self.step = "shared"
        return out

    def _aad(self, sender: str, receiver: str) -> bytes:
        return f"fedattn-secagg/share|{self.round}|{self.phase}|{sender}->{receiver}".encode()

    # ---- step 3 ----------------------------------------------------------------------
    def receive(self, ciphertexts: dict[str, bytes]) -> list[str]:
        """Decrypt the shares addressed to this edge; keep those that authenticate and
        return the senders of the others (their shares are garbage, tampered or misrouted:
        the server drops them before masking, so nobody masks against them)."""
        self._expect("shared", "received", asked="receive step")  # again after a restart
        if set(ciphertexts) - set(self.neighbours):
            raise SecAggError(f"the server relays shares from edges that are not this edge's "
                              f"neighbours: {sorted(set(ciphertexts) - set(self.neighbours))[:5]}")
        c_key = X25519PrivateKey.from_private_bytes(self.c_sk)
        held, reported = {}, []
        for u in sorted(ciphertexts):
            blob = ciphertexts[u]
            key = agree(c_key, bytes.fromhex(self.adverts[u]["c_pk"]),
                        pair_info("enc", self.round, self.phase, u, self.edge))
            try:
                plain = AESGCM(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:],
                                            self._aad(u, self.edge))
                if len(plain) != 2 * SHARE_BYTES:
                    raise SecAggError("a share pair of the wrong length")
                share_to_int(plain[:SHARE_BYTES])
                share_to_int(plain[SHARE_BYTES:])
            except (InvalidTag, ValueError):  # SecAggError is a ValueError
                reported.append(u)
                continue
            held[u] = (plain[:SHARE_BYTES].hex(), plain[SHARE_BYTES:].hex())
        self.held, self.reported, self.step = held, reported, "received"
        return reported

    # ---- step 4 ----------------------------------------------------------------------
    def mask(self, survivors: list[str], values: np.ndarray, weight: float,
             quantizer: Quantizer) -> np.ndarray:
        """The masked vector y_u. ``survivors``: the neighbours in U2; each must be one whose
        shares this edge holds (a sender it reported is no survivor)."""
        return self.mask_words(survivors, quantizer.quantize(values, weight))

    def mask_words(self, survivors: list[str], q: np.ndarray, ring: int = RING_BITS,
                   fixed_point: bytes = b"") -> np.ndarray:
        """``mask`` of words already quantized: values then the weight. Below 32 bits the
        value words are masked mod 2^ring (the PRG words reduced: 2^ring divides 2^32, so
        the server may sum mod 2^32 and reduce last); the weight stays a 32-bit word.
        ``fixed_point``: the digest this edge signs with the survivor list."""
        if self.step != "received":
            raise SecAggError(f"masked input asked in state {self.step}: an edge masks once, "
                              "after checking the shares it holds")
        survivors = _edge_ids(survivors, "survivor list")
        if set(survivors) - set(self.held):
            raise SecAggError(f"the server's masking request names edges whose shares this edge "
                              f"does not hold: {sorted(set(survivors) - set(self.held))[:5]}")
        if len(survivors) + 1 < self.threshold:
            raise SecAggError(f"only {len(survivors)} neighbours shared keys; fewer than the "
                              f"threshold {self.threshold} could ever unmask")
        y = q + prg_words(self.seed, q.size)
        s_key = X25519PrivateKey.from_private_bytes(self.s_sk)
        for v in survivors:
            seed = agree(s_key, bytes.fromhex(self.adverts[v]["s_pk"]),
                         pair_info("mask", self.round, self.phase, self.edge, v))
            if v > self.edge:
                y += prg_words(seed, q.size)
            else:
                y -= prg_words(seed, q.size)
        if ring < RING_BITS:
            y[:-1] &= np.uint32((1 << ring) - 1)
        self.survivors, self.step = sorted(survivors), "masked"
        self.fixed_point = fixed_point.hex()
        return y

    # ---- step 5 ----------------------------------------------------------------------
    def confirm(self, survivors: list[str], signing_key: Ed25519PrivateKey) -> bytes:
        """Sign the survivor list U3 the server gives this edge -- one list per round: the
        signature is what lets the neighbours check that the server told everyone the same."""
        self._expect("masked", "confirmed", asked="confirm step")
        survivors = sorted(_edge_ids(survivors, "survivor list"))
        if self.step == "confirmed" and survivors != self.confirmed:
            raise SecAggError("the server asks this edge to sign a second, different survivor "
                              "list this round")
        if self.edge not in survivors:
            raise SecAggError("the server's survivor list leaves out this edge, whose masked "
                              "input it accepted")
        strangers = (set(survivors) & set(self.neighbours)) - set(self.survivors)
        if strangers:
            raise SecAggError(f"the server's survivor list names neighbours this edge did not "
                              f"mask against: {sorted(strangers)[:5]}")
        if len(survivors) < self.threshold:
            raise SecAggError(f"only {len(survivors)} edges survived, fewer than the threshold "
                              f"{self.threshold}: refusing to unmask")
        s_pk = raw_public(X25519PrivateKey.from_private_bytes(self.s_sk))
        signature = signing_key.sign(survivors_message(self.round, self.phase, self.edge, s_pk,
                                                       survivors, bytes.fromhex(self.fixed_point)))
        self.confirmed, self.step = survivors, "confirmed"
        return signature

    # ---- step 6 ----------------------------------------------------------------------
    def unmask(self, survivors: list[str], signatures: dict[str, bytes]) -> dict[str, bytes]:
        """Reveal, once at least t holders (this edge and its neighbours) signed the same
        list U3 that this edge signed: b shares of U3's members (this edge included), s_sk
        shares of the neighbours that shared but are not in U3. What to reveal follows from
        U3 alone: never s_sk of an edge in U3, never this edge's own."""
        self._expect("confirmed", asked="unmask")
        survivors = sorted(_edge_ids(survivors, "survivor list"))
        if survivors != self.confirmed:
            raise SecAggError("the unmask request's survivor list differs from the one this "
                              "edge signed: refusing to unmask")
        signers = {self.edge}
        for v, signature in signatures.items():
            advert = self.adverts.get(v)
            if advert is None or v not in survivors:
                continue  # not a holder of this edge's shares, or not a survivor
            if signed_by(bytes.fromhex(advert["sign_pk"]), signature, survivors_message(
                    self.round, self.phase, v, bytes.fromhex(advert["s_pk"]), survivors,
                    bytes.fromhex(self.fixed_point))):
                signers.add(v)
        if len(signers) < self.threshold:
            raise SecAggError(f"only {len(signers)} of this edge's share holders (itself "
                              f"included) signed the survivor list, fewer than the threshold "
                              f"{self.threshold}: refusing to unmask")
        alive = set(survivors)
        unsigned = sorted((alive & set(self.survivors)) - signers)
        if self.fixed_point and unsigned:
            # A server that gave one edge other scales than the rest could read that
            # edge's values off the sum, were its self-mask seed revealed.
            raise SecAggError(f"survivors {unsigned[:5]} did not sign the survivor list under "
                              "the fixed point this edge masked with (the same public scales): "
                              "refusing to unmask")
        out = {}
        for u in [*self.survivors, self.edge]:
            b, s = self.own_shares if u == self.edge else self.held[u]
            if u in alive:
                out[f"b:{u}"] = bytes.fromhex(b)
            elif u != self.edge:
                out[f"s:{u}"] = bytes.fromhex(s)
        self.step = "done"
        return out


# ---- the server ------------------------------------------------------------------------------
@dataclass
class ServerRound:
    """The server's side of one masked phase. It never sees a seed or a private key
    except those that the unmask step reconstructs for exactly the sum's needs."""

    round: int
    phase: str
    length: int                 # words of each masked vector (values + the weight)
    degree: int                 # 0: auto_degree(n); -1: the full graph
    threshold_fraction: float
    signing_keys: dict[str, bytes]   # edge -> Ed25519 public key bound to its id at join
    rng: random.Random = field(default_factory=lambda: random.Random(secrets.randbits(64)))
    adverts: dict[str, dict[str, bytes]] = field(default_factory=dict)
    graph: dict[str, list[str]] = field(default_factory=dict)
    index: dict[str, int] = field(default_factory=dict)
    threshold: int = 0
    shares: dict[str, dict[str, bytes]] = field(default_factory=dict)   # to -> from -> ct
    sharers: set[str] = field(default_factory=set)
    reports: dict[str, list[str]] = field(default_factory=dict)  # holder -> senders it refused
    survivors: set[str] = field(default_factory=set)    # U2: shared, checked, not reported
    total: np.ndarray | None = None
    masked: set[str] = field(default_factory=set)       # U3
    confirmations: dict[str, bytes] = field(default_factory=dict)  # edge -> its signature of U3
    reveals: dict[str, dict[str, bytes]] = field(default_factory=dict)  # holder -> reveals
    inconsistent: set[str] = field(default_factory=set)  # holders whose shares did not fit
    abort_reason: str = ""
    fixed_point: bytes = b""    # the digest of the integer fixed point every edge was sent

    # ---- step 1 ----------------------------------------------------------------------
    def accept_advert(self, edge: str, advert: dict[str, bytes]) -> None:
        key = advert["sign_pk"]
        if self.signing_keys.get(edge) != key:
            raise SecAggError(f"edge {edge}: advert signed with a key other than the identity "
                              "key bound to this edge")
        verify_advert(self.round, self.phase, edge, advert, key)
        for name in ("c_pk", "s_pk"):
            try:
                X25519PublicKey.from_public_bytes(advert[name])
            except ValueError:
                raise SecAggError(f"edge {edge}: {name} is not an X25519 public key") from None
        self.adverts[edge] = dict(advert)

    def close_advertise(self) -> None:
        parties = sorted(self.adverts)
        degree = {0: auto_degree(len(parties)), -1: len(parties)}.get(self.degree, self.degree)
        self.graph = neighbour_graph(parties, degree, self.rng)
        self.index = {p: i + 1 for i, p in enumerate(parties)}
        holders = min((len(n) + 1 for n in self.graph.values()), default=0)
        self.threshold = holder_threshold(holders, self.threshold_fraction)
        if len(parties) < 2 or self.threshold > holders:
            self.abort_reason = (f"{len(parties)} edge(s) advertised keys: too few for a "
                                 f"threshold of {self.threshold}")

    def share_request(self, edge: str) -> tuple[dict[str, Any], dict[str, dict[str, bytes]]]:
        neighbours = self.graph[edge]
        info = {"threshold": self.threshold, "parties": len(self.adverts),
                "index": {p: self.index[p] for p in [edge, *neighbours]}}
        return info, {v: self.adverts[v] for v in neighbours}

    # ---- step 2 ----------------------------------------------------------------------
    def accept_shares(self, edge: str, ciphertexts: dict[str, bytes]) -> None:
        if set(ciphertexts) != set(self.graph.get(edge, ())):
            raise SecAggError(f"edge {edge}: shares must go to exactly its neighbours")
        for to, blob in ciphertexts.items():
            self.shares.setdefault(to, {})[edge] = blob
        self.sharers.add(edge)

    def close_share(self) -> None:
        if len(self.sharers) < self.threshold:
            self.abort_reason = (f"{len(self.sharers)} edge(s) shared keys, fewer than the "
                                 f"threshold {self.threshold}")

    # ---- step 3 ----------------------------------------------------------------------
    def receive_request(self, edge: str) -> dict[str, bytes]:
        """The ciphertexts addressed to ``edge``, by sender."""
        return {u: self.shares[edge][u] for u in self.graph[edge] if u in self.sharers}

    def accept_receive(self, edge: str, reported: list[str]) -> None:
        if edge not in self.sharers:
            raise SecAggError(f"edge {edge} did not share keys this round")
        senders = set(self.receive_request(edge))
        if set(reported) - senders:
            raise SecAggError(f"edge {edge} reports shares it was never sent, from "
                              f"{sorted(set(reported) - senders)[:5]}")
        self.reports[edge] = sorted(reported)

    def reported(self) -> dict[str, list[str]]:
        """sender -> the holders whose share from it failed authentication."""
        out: dict[str, list[str]] = {}
        for holder, senders in sorted(self.reports.items()):
            for u in senders:
                out.setdefault(u, []).append(holder)
        return out

    def close_receive(self) -> None:
        """U2: the sharers that answered this step, less every reported sender -- dropped
        before masking, so no edge masks against it and nothing of it is ever unmasked."""
        self.survivors = set(self.reports) - set(self.reported())
        if len(self.survivors) < self.threshold:
            self.abort_reason = (f"{len(self.survivors)} edge(s) left after the share check "
                                 f"(reported: {sorted(self.reported())}), fewer than the "
                                 f"threshold {self.threshold}")

    def mask_request(self, edge: str) -> list[str]:
        return [u for u in self.graph[edge] if u in self.survivors]

    # ---- step 4 ----------------------------------------------------------------------
    def accept_masked(self, edge: str, y: np.ndarray) -> None:
        if edge not in self.survivors:
            why = (f"its shares failed authentication at {self.reported()[edge]}"
                   if edge in self.reported() else "it did not complete the share check")
            raise SecAggError(f"edge {edge} is not among the round's survivors ({why})")
        if y.shape != (self.length,):
            raise SecAggError(f"masked vector of {y.shape} words, expected {self.length}")
        y = y.view(np.uint32) if y.dtype != np.uint32 else y
        if self.total is None:
            self.total = y.copy()
        else:
            self.total += y
        self.masked.add(edge)

    def close_masked(self) -> None:
        if len(self.masked) < self.threshold:
            self.abort_reason = (f"{len(self.masked)} masked input(s) arrived, fewer than the "
                                 f"threshold {self.threshold}: nothing is unmasked")

    # ---- step 5 ----------------------------------------------------------------------
    def confirm_request(self, edge: str) -> dict[str, Any]:
        return {"survivors": sorted(self.masked)}

    def accept_confirm(self, edge: str, signature: bytes) -> None:
        if edge not in self.masked:
            raise SecAggError(f"edge {edge} has no masked input this round")
        message = survivors_message(self.round, self.phase, edge, self.adverts[edge]["s_pk"],
                                    sorted(self.masked), self.fixed_point)
        if not signed_by(self.signing_keys[edge], signature, message):
            raise SecAggError(f"edge {edge}: the signature of the survivor list is not valid "
                              "under its identity key")
        self.confirmations[edge] = signature

    def close_confirm(self) -> None:
        if len(self.confirmations) < self.threshold:
            self.abort_reason = (f"{len(self.confirmations)} edge(s) signed the survivor list, "
                                 f"fewer than the threshold {self.threshold}")
        elif self.fixed_point and self.masked - set(self.confirmations):
            # Under an integer fixed point an edge reveals a survivor's seed only with its
            # signature of the same scales (``ClientRound.unmask``): nothing would unmask.
            self.abort_reason = (f"edge(s) {sorted(self.masked - set(self.confirmations))[:5]} "
                                 "masked but did not sign the survivor list; under integer "
                                 "compression every survivor must")

    # ---- step 6 ----------------------------------------------------------------------
    def unmask_request(self, edge: str) -> tuple[dict[str, Any], dict[str, bytes]]:
        """U3, and the signatures of it by ``edge``'s neighbours (what it checks first)."""
        return ({"survivors": sorted(self.masked)},
                {v: self.confirmations[v] for v in self.graph[edge] if v in self.confirmations})

    def expected_reveal(self, edge: str) -> set[str]:
        """What an honest ``edge`` reveals: b of its U3 neighbours and itself, s of its U2
        neighbours outside U3."""
        held = self.mask_request(edge)
        return ({f"b:{u}" for u in held if u in self.masked} | {f"b:{edge}"}
                | {f"s:{u}" for u in held if u not in self.masked})

    def accept_reveal(self, edge: str, revealed: dict[str, bytes]) -> None:
        if edge not in self.confirmations:
            raise SecAggError(f"edge {edge} did not sign the survivor list")
        if set(revealed) != self.expected_reveal(edge):
            raise SecAggError(f"edge {edge}: revealed shares differ from the request")
        for blob in revealed.values():
            share_to_int(blob)
        self.reveals[edge] = dict(revealed)

    def _reconstruct(self, kind: str, u: str, valid: Callable[[bytes], bool]) -> bytes:
        """u's seed (kind b) or mask key (s) from the revealed shares: the first t that
        give a secret passing ``valid``; holders whose shares do not fit are set aside."""
        what = "self-mask seed" if kind == "b" else "mask key"
        holders = sorted((h for h, r in self.reveals.items() if f"{kind}:{u}" in r),
                         key=lambda h: (h in self.inconsistent, h))  # trusted ones first
        points = {self.index[h]: share_to_int(self.reveals[h][f"{kind}:{u}"]) for h in holders}

        def fits(secret: int) -> bool:
            return secret < 2 ** (8 * SEED_BYTES) and valid(secret.to_bytes(SEED_BYTES, "big"))

        try:
            secret, off = robust_combine(points, self.threshold, fits)
        except SecAggError as err:
            raise SecAggError(f"edge {u}'s {what} cannot be reconstructed: {err}; the round is "
                              "aborted, nothing is unmasked") from None
        self.inconsistent |= {h for h in holders if self.index[h] in off}
        return secret.to_bytes(SEED_BYTES, "big")

    def unmask(self) -> np.ndarray:
        """sum_u q_u over U3 (mod 2^32); raises SecAggError (nothing unmasked) when a
        needed secret cannot be reconstructed from shares that match its commitment."""
        if self.abort_reason:
            raise SecAggError(self.abort_reason)
        if self.total is None:
            raise SecAggError("no masked input arrived")
        total = self.total.copy()
        for u in sorted(self.masked):
            commit = self.adverts[u]["commit"]
            seed = self._reconstruct("b", u, lambda b, u=u, c=commit:
                                     seed_commitment(self.round, self.phase, u, b) == c)
            total -= prg_words(seed, self.length)
        for u in sorted(self.survivors - self.masked):
            s_pk = self.adverts[u]["s_pk"]
            s_sk = self._reconstruct("s", u, lambda k, p=s_pk: raw_public(
                X25519PrivateKey.from_private_bytes(k)) == p)
            key = X25519PrivateKey.from_private_bytes(s_sk)
            for v in self.graph[u]:
                if v not in self.masked:
                    continue
                seed = agree(key, self.adverts[v]["s_pk"],
                             pair_info("mask", self.round, self.phase, u, v))
                # What u would have added, so that v's opposite term cancels.
                if v > u:
                    total += prg_words(seed, self.length)
                else:
                    total -= prg_words(seed, self.length)
        return total


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()

"""The cryptography SecAgg+ is built from, apart from the protocol (``secagg.py``) so
each can be read alone: Shamir's secret sharing over GF(2^521 - 1) with the robust
reconstruction that names tampered shares, the AES-256-CTR mask stream, X25519 + HKDF key
agreement, and the exact byte strings an edge signs with its Ed25519 identity key.

Nothing here keeps state or knows about rounds beyond the labels bound into what is
signed and derived; every check raises ``SecAggError`` naming what failed.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import secrets
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .secagg_ring import SecAggError

PRIME = 2**521 - 1          # a Mersenne prime: the field holds every 256-bit secret
SHARE_BYTES = 66            # ceil(521 / 8)
SEED_BYTES = 32
KEY_BYTES = 32
NONCE_BYTES = 12
CIPHERTEXT_BYTES = NONCE_BYTES + 2 * SHARE_BYTES + 16  # nonce | b share | s share | tag
SIGNATURE_BYTES = 64
MAX_SUBSETS = 20_000        # t-subsets the server tries per secret before it gives up


# ---- Shamir secret sharing over GF(p) ----------------------------------------------------
def shamir_split(secret: int, threshold: int, xs: list[int], prime: int = PRIME) -> dict[int, int]:
    """Shares f(x) for each x in ``xs`` of a random polynomial f of degree threshold - 1
    with f(0) = secret: any ``threshold`` shares give the secret, fewer say nothing."""
    if not 0 <= secret < prime:
        raise ValueError("the secret must lie in [0, prime)")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} must be in [1, {len(xs)}] (the holders)")
    if len(set(xs)) != len(xs) or any(not 0 < x < prime for x in xs):
        raise ValueError("share points must be distinct and non-zero")
    coefficients = [secret] + [secrets.randbelow(prime) for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        value = 0
        for c in reversed(coefficients):  # Horner
            value = (value * x + c) % prime
        shares[x] = value
    return shares


def shamir_combine(shares: Mapping[int, int], prime: int = PRIME) -> int:
    """f(0) by Lagrange interpolation through the given points."""
    return interpolator(shares, prime)(0)


def lagrange_at(shares: Mapping[int, int], x: int, prime: int = PRIME) -> int:
    """f(x) for the polynomial of least degree through the given points."""
    return interpolator(shares, prime)(x)


def interpolator(shares: Mapping[int, int], prime: int = PRIME) -> Callable[[int], int]:
    """x -> f(x) for the polynomial of least degree through the given points: the t
    inverses of the Lagrange denominators once, then O(t) per point (prefix and suffix
    products of x - x_j), since the server checks every further share against f."""
    xs = list(shares)
    if not xs:
        raise ValueError("no shares to combine")
    weights = []
    for i, xi in enumerate(xs):
        denominator = 1
        for j, xj in enumerate(xs):
            if i != j:
                denominator = denominator * (xi - xj) % prime
        weights.append(shares[xi] * pow(denominator, -1, prime) % prime)

    def at(x: int) -> int:
        diffs = [(x - xj) % prime for xj in xs]
        suffix = [1] * (len(xs) + 1)
        for i in range(len(xs) - 1, -1, -1):
            suffix[i] = suffix[i + 1] * diffs[i] % prime
        value, prefix = 0, 1
        for i, weight in enumerate(weights):
            value = (value + weight * prefix % prime * suffix[i + 1]) % prime
            prefix = prefix * diffs[i] % prime
        return value

    return at


def robust_combine(shares: Mapping[int, int], threshold: int, valid: Callable[[int], bool],
                   max_subsets: int = MAX_SUBSETS, prime: int = PRIME) -> tuple[int, set[int]]:
    """The secret of t = ``threshold`` of the shares that passes ``valid`` (the check against
    what its owner published: a commitment, a public key), and the points of the other
    shares that do not lie on the polynomial those t fix (tampered, or dealt wrong).

    Any t shares fix a polynomial; a set with a wrong share gives a secret that fails
    ``valid`` unless its author knew the secret and the other shares. Subsets are tried in
    the given order, dropping as few of the first points as possible: with e wrong shares
    among the first t + e, at most C(t + e - 1, e) tries per extra point. Raises
    SecAggError when no subset passes, i.e. fewer than t consistent shares arrived."""
    xs = list(shares)
    if len(xs) < threshold:
        raise SecAggError(f"only {len(xs)} of the threshold {threshold} shares arrived")
    tried = 0
    for extra in range(len(xs) - threshold + 1):
        pool = xs[:threshold + extra]
        # a subset without the pool's last point was already tried with one point fewer
        for left_out in itertools.combinations(pool[:-1], extra):
            tried += 1
            if tried > max_subsets:
                raise SecAggError(f"no {threshold} of the {len(xs)} shares fit together within "
                                  f"{max_subsets} tries (too many inconsistent shares)")
            chosen = {x: shares[x] for x in pool if x not in left_out}
            f = interpolator(chosen, prime)
            secret = f(0)
            if valid(secret):
                return secret, {x for x in xs if x not in chosen and f(x) != shares[x]}
    raise SecAggError(f"no {threshold} of the {len(xs)} shares give the published secret: "
                      f"fewer than {threshold} consistent shares")


def int_to_share(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "big")


def share_to_int(data: bytes) -> int:
    if len(data) != SHARE_BYTES:
        raise SecAggError(f"a share must be {SHARE_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    if value >= PRIME:
        raise SecAggError("a share lies outside the field")
    return value


# ---- primitives ------------------------------------------------------------------------
def prg_words(seed: bytes, length: int) -> np.ndarray:
    """``length`` uniform 32-bit words: the AES-256-CTR keystream of the 256-bit seed.
    Every seed keys one stream only (seeds are fresh per round), so the zero IV is safe."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed must be {SEED_BYTES} bytes")
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    out = bytearray(4 * length + 15)  # update_into wants a block's worth of spare room
    encryptor.update_into(_zeros(4 * length), out)
    return np.frombuffer(out, dtype="<u4", count=length)


@functools.lru_cache(maxsize=4)
def _zeros(size: int) -> bytes:
    """The plaintext of a keystream (immutable; one per vector length in use)."""
    return bytes(size)


def hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def agree(private: X25519PrivateKey, peer_public: bytes, info: bytes) -> bytes:
    """A 256-bit key both ends of an X25519 pair derive (HKDF-SHA256 over the shared
    point, bound to ``info``)."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as err:
        raise SecAggError(f"bad X25519 public key: {err}") from None
    return hkdf(shared, info)


def raw_public(key: X25519PrivateKey | Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def raw_private(key: X25519PrivateKey | Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def pair_info(label: str, round_number: int, phase: str, u: str, v: str) -> bytes:
    a, b = sorted((u, v))
    return f"fedattn-secagg/{label}|{round_number}|{phase}|{a}|{b}".encode()


def advert_message(round_number: int, phase: str, edge: str, c_pk: bytes, s_pk: bytes,
                   commitment: bytes) -> bytes:
    """What an edge signs: its keys for exactly this round, phase and identity."""
    return (f"fedattn-secagg/advert|{round_number}|{phase}|{edge}|".encode()
            + c_pk + s_pk + commitment)


def seed_commitment(round_number: int, phase: str, edge: str, seed: bytes) -> bytes:
    return hashlib.sha256(f"fedattn-secagg/b|{round_number}|{phase}|{edge}|".encode()
                          + seed).digest()


def verify_advert(round_number: int, phase: str, edge: str, advert: Mapping[str, bytes],
                  signing_key: bytes) -> None:
    try:
        Ed25519PublicKey.from_public_bytes(signing_key).verify(
            advert["sig"], advert_message(round_number, phase, edge, advert["c_pk"],
                                          advert["s_pk"], advert["commit"]))
    except (InvalidSignature, ValueError):
        raise SecAggError(f"edge {edge}: the advertised keys are not signed by its "
                          "identity key") from None


def survivors_message(round_number: int, phase: str, signer: str, s_pk: bytes,
                      survivors: list[str], fixed_point: bytes = b"") -> bytes:
    """What an edge signs in the confirm step: the survivor list U3 it was told, bound to
    the round, the phase, the signer and the signer's mask key of this very round (fresh
    per round, so a signature from an earlier run of the same round number never counts).
    Under integer compression also the digest of the public scales it quantized with
    (``IntegerQuantizer.digest``): a server that gave edges different scales (huge ones
    to all but one, to read that one's values off the sum) gets no matching signatures
    and no unmask."""
    return (f"fedattn-secagg/survivors|{round_number}|{phase}|{signer}|".encode() + s_pk
            + json.dumps(sorted(survivors)).encode()
            + (b"|fixed-point|" + fixed_point if fixed_point else b""))


def signed_by(signing_key: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(signing_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True

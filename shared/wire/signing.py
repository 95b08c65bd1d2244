"""Signed submissions: every result is bound to (edge, round, phase, task id, task nonce)
and to its exact body by an Ed25519 signature with the edge's signing key, whose public
half the server bound to the edge id at its first join.

The body enters the signature through a GMAC tag (AES-256-GCM over the data as additional
data, nothing encrypted) under a key the edge and the server agree on at join, rather than
through a SHA-256 of it: GHASH runs about 4x faster than SHA-256 on CPUs with carry-less
multiply (x86 PCLMULQDQ, ARMv8 PMULL), and the body is hashed on both ends of every
upload. The key comes from an X25519 exchange whose edge half is signed with the edge's
signing key, so nobody between the two can learn the server's copy of it; a tag under a
key unknown to an attacker cannot be matched by an altered body, and the signature pins
the tag. Each submission draws a fresh random IV, so no (key, IV) pair is used twice.
"""

from __future__ import annotations

import hashlib
import os

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from . import fedattn_pb2 as pb

CONTEXT = b"fedattn-submit/2"
SHARE_CONTEXT = b"fedattn-upload-key-share/1"
MAC_KEY_INFO = b"fedattn-upload-mac/1"
BODY_MAC_IV_BYTES = 12
BODY_MAC_BYTES = 16


def submission_digest(header: pb.SubmitHeader, body_mac: bytes) -> bytes:
    unsigned = pb.SubmitHeader()
    unsigned.CopyFrom(header)
    unsigned.ClearField("signature")
    return (CONTEXT + hashlib.sha256(unsigned.SerializeToString(deterministic=True)).digest()
            + body_mac)


def sign_submission(key: Ed25519PrivateKey, header: pb.SubmitHeader, body_mac: bytes) -> bytes:
    return key.sign(submission_digest(header, body_mac))


def verify_submission(public_key: bytes, header: pb.SubmitHeader, body_mac: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            header.signature, submission_digest(header, body_mac))
    except (InvalidSignature, ValueError):
        return False
    return True


# ---- the upload MAC key, agreed at join -----------------------------------------------
def _share_message(edge_id: str, share: bytes) -> bytes:
    return SHARE_CONTEXT + edge_id.encode() + b"\0" + share


def new_key_share(signing_key: Ed25519PrivateKey, edge_id: str
                  ) -> tuple[X25519PrivateKey, bytes, bytes]:
    """An ephemeral X25519 key for one session: (private key, public share, the share's
    signature with the edge's signing key)."""
    private = X25519PrivateKey.generate()
    share = private.public_key().public_bytes_raw()
    return private, share, signing_key.sign(_share_message(edge_id, share))


def verify_key_share(signing_key: bytes, edge_id: str, share: bytes, proof: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(signing_key).verify(
            proof, _share_message(edge_id, share))
    except (InvalidSignature, ValueError):
        return False
    return True


def exchange(private: X25519PrivateKey, peer_share: bytes) -> bytes:
    """The X25519 shared secret. Raises ValueError on a malformed or degenerate share."""
    return private.exchange(X25519PublicKey.from_public_bytes(peer_share))


def answer_key_share(peer_share: bytes) -> tuple[bytes, bytes]:
    """The server's side of the exchange: (the shared secret, the server's own public
    share for the reply). Raises ValueError on a malformed or degenerate share."""
    private = X25519PrivateKey.generate()
    return exchange(private, peer_share), private.public_key().public_bytes_raw()


def upload_mac_key(shared: bytes, edge_id: str, session: str) -> bytes:
    """The session's 256-bit upload MAC key, from the exchange's shared secret."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=MAC_KEY_INFO + edge_id.encode() + b"\0" + session.encode()).derive(shared)


class BodyMac:
    """GMAC of the data bytes of one submission, fed chunk by chunk."""

    def __init__(self, key: bytes, iv: bytes):
        if len(iv) != BODY_MAC_IV_BYTES:
            raise ValueError(f"body MAC IV must be {BODY_MAC_IV_BYTES} bytes, got {len(iv)}")
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(iv)).encryptor()

    @staticmethod
    def new_iv() -> bytes:
        return os.urandom(BODY_MAC_IV_BYTES)

    def update(self, data) -> None:
        self._gcm.authenticate_additional_data(data)

    def tag(self) -> bytes:
        self._gcm.finalize()
        return self._gcm.tag

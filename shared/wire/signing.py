"""Signed submissions: every result is bound to (edge, round, phase, task id, task nonce)
and to its exact body by an Ed25519 signature with the edge's signing key, whose public
half the server bound to the edge id at its first join."""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import fedattn_pb2 as pb

CONTEXT = b"fedattn-submit/1"


def submission_digest(header: pb.SubmitHeader, body_sha256: bytes) -> bytes:
    unsigned = pb.SubmitHeader()
    unsigned.CopyFrom(header)
    unsigned.ClearField("signature")
    return (CONTEXT + hashlib.sha256(unsigned.SerializeToString(deterministic=True)).digest()
            + body_sha256)


def sign_submission(key: Ed25519PrivateKey, header: pb.SubmitHeader, body_sha256: bytes) -> bytes:
    return key.sign(submission_digest(header, body_sha256))


def verify_submission(public_key: bytes, header: pb.SubmitHeader, body_sha256: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            header.signature, submission_digest(header, body_sha256))
    except (InvalidSignature, ValueError):
        return False
    return True

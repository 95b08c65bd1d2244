"""The upload MAC key agreed at join, and the signature that pins header and body."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.signing import (
    BodyMac,
    answer_key_share,
    exchange,
    new_key_share,
    sign_submission,
    upload_mac_key,
    verify_key_share,
    verify_submission,
)


def agree(edge_id: str = "edge-1", session: str = "s1") -> tuple[bytes, bytes, bytes, bytes]:
    """(edge's key, server's key, edge's share, its proof) after one exchange."""
    signing = Ed25519PrivateKey.generate()
    private, share, proof = new_key_share(signing, edge_id)
    assert verify_key_share(signing.public_key().public_bytes_raw(), edge_id, share, proof)
    shared, server_share = answer_key_share(share)
    server_key = upload_mac_key(shared, edge_id, session)
    edge_key = upload_mac_key(exchange(private, server_share), edge_id, session)
    return edge_key, server_key, share, proof


def test_both_ends_derive_the_same_key_and_each_session_a_new_one():
    edge_key, server_key, _, _ = agree()
    assert edge_key == server_key and len(edge_key) == 32
    again, _, _, _ = agree()
    assert again != edge_key  # ephemeral X25519 on both sides


def test_the_key_depends_on_edge_and_session():
    private, share, _ = new_key_share(Ed25519PrivateKey.generate(), "edge-1")
    shared, _ = answer_key_share(share)
    keys = {upload_mac_key(shared, e, s) for e, s in
            (("edge-1", "s1"), ("edge-2", "s1"), ("edge-1", "s2"))}
    assert len(keys) == 3


def test_a_share_proof_binds_the_edge_id_the_share_and_the_signing_key():
    signing = Ed25519PrivateKey.generate()
    public = signing.public_key().public_bytes_raw()
    _, share, proof = new_key_share(signing, "edge-1")
    _, other_share, _ = new_key_share(signing, "edge-1")
    assert verify_key_share(public, "edge-1", share, proof)
    assert not verify_key_share(public, "edge-2", share, proof)
    assert not verify_key_share(public, "edge-1", other_share, proof)
    other = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    assert not verify_key_share(other, "edge-1", share, proof)
    assert not verify_key_share(b"short", "edge-1", share, proof)


@pytest.mark.parametrize("share", [b"", b"\x01" * 31, bytes(32)])
def test_a_malformed_or_degenerate_share_is_refused(share):
    with pytest.raises(ValueError):
        answer_key_share(share)  # bytes(32) is a low-order point: an all-zero secret


def test_the_signature_covers_header_and_body_mac():
    edge_key, server_key, _, _ = agree()
    signing = Ed25519PrivateKey.generate()
    public = signing.public_key().public_bytes_raw()
    header = pb.SubmitHeader(edge_id="edge-1", session="s1", round=3, task_id=7, phase="train",
                             num_examples=10, task_nonce=b"n" * 16, body_mac_iv=BodyMac.new_iv())
    body = [b"chunk-one", b"chunk-two"]

    def mac(key: bytes, chunks: list[bytes]) -> bytes:
        m = BodyMac(key, header.body_mac_iv)
        for c in chunks:
            m.update(c)
        return m.tag()

    header.signature = sign_submission(signing, header, mac(edge_key, body))
    assert verify_submission(public, header, mac(server_key, body))
    assert not verify_submission(public, header, mac(server_key, [b"chunk-one", b"chunk-twO"]))
    assert not verify_submission(public, header, mac(bytes(32), body))
    header.num_examples = 11
    assert not verify_submission(public, header, mac(server_key, body))


def test_a_body_mac_iv_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="12 bytes"):
        BodyMac(bytes(32), b"\x00" * 8)

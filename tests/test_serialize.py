"""Wire codec and byte accounting: round trips, chunk layout, and every refusal."""

from __future__ import annotations

import struct
import threading
import zlib

import pytest
import torch
from prometheus_client import CollectorRegistry

from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.tensors import contiguous_run
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import GRPC_FRAME_PREFIX, ByteMeter, message_wire_bytes
from fedattn_shared.wire.payload import TensorViews, WireError, nonfinite_tensors
from fedattn_shared.wire.serialize import (
    MAX_REMEMBERED_LAYOUT_BYTES,
    decode,
    encode,
    section_layout,
    section_sizes,
)
from fedattn_shared.wire.transport import PayloadAssembler, payload_chunks

BIG = 1 << 30


def wire_copy(manifest: pb.PayloadManifest) -> pb.PayloadManifest:
    """The manifest as the receiver sees it: serialized and parsed again."""
    return pb.PayloadManifest.FromString(manifest.SerializeToString())


def transmit(payload: Payload, chunk_bytes: int, max_bytes: int = BIG) -> Payload:
    encoded = encode(payload)
    assembler = PayloadAssembler(wire_copy(encoded.manifest), max_bytes, chunk_bytes)
    for kind, chunk in payload_chunks(encoded, chunk_bytes):
        assert assembler.add(chunk) == kind
    assert assembler.complete
    return assembler.finish()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


ALL_DTYPES = {
    "f32": torch.tensor([[1.5, -2.25, 3.0e38], [0.0, -0.0, 1e-40]], dtype=torch.float32),
    "f16": torch.tensor([0.5, -65504.0, 6.0e-8], dtype=torch.float16),
    "bf16": torch.tensor([1.0, -2.5, 3.0e38], dtype=torch.bfloat16),
    "f64": torch.tensor([1 / 3, 1e-300, -1e300], dtype=torch.float64),
    "i64": torch.tensor([2**62, -1, -(2**63)], dtype=torch.int64),
    "i32": torch.tensor([2**31 - 1, -(2**31)], dtype=torch.int32),
    "u8": torch.tensor([0, 1, 255], dtype=torch.uint8),
    "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
    "bool": torch.tensor([True, False, True, True]),
    "scalar_f32": torch.tensor(7.25),
    "scalar_i64": torch.tensor(-3),
    "scalar_bool": torch.tensor(True),
    "empty_f32": torch.empty(0),
    "empty_2d_i32": torch.zeros(2, 0, dtype=torch.int32),
    "empty_bool": torch.zeros(0, 3, dtype=torch.bool),
}
# Hand-computed raw sizes: elements * bytes per element.
ALL_DTYPES_BYTES = (6 * 4 + 3 * 2 + 3 * 2 + 3 * 8 + 3 * 8 + 2 * 4 + 3 + 3 + 4
                    + 4 + 8 + 1 + 0 + 0 + 0)


# ---- round trips ----------------------------------------------------------------------

def test_round_trip_every_dtype_and_shape():
    payload = Payload([Section(Kind.SHARED_TENSORS, "", dict(ALL_DTYPES))])
    encoded = encode(payload)
    assert encoded.total_bytes == ALL_DTYPES_BYTES == payload.raw_bytes
    for chunk_bytes in (1, 7, 1 << 20):
        out = transmit(payload, chunk_bytes)
        assert len(out.sections) == 1
        assert out.sections[0].kind is Kind.SHARED_TENSORS
        assert_same(out.tensors(Kind.SHARED_TENSORS), ALL_DTYPES)
    assert out.tensors(Kind.SHARED_TENSORS)["f32"][1, 1].item() == 0.0
    assert torch.signbit(out.tensors(Kind.SHARED_TENSORS)["f32"][1, 1])  # -0.0 kept bit-exact


def test_round_trip_each_dtype_alone_in_a_section():
    # Every dtype at an odd offset after a 3-byte tensor: unaligned views must still decode.
    for name, tensor in ALL_DTYPES.items():
        tensors = {"pad": torch.tensor([1, 2, 3], dtype=torch.uint8), name: tensor}
        out = transmit(Payload([Section(Kind.CONTROL, "c", tensors)]), 5)
        assert_same(out.tensors(Kind.CONTROL, "c"), tensors)
        decoded = out.tensors(Kind.CONTROL, "c")[name]
        assert torch.equal(decoded.clone(), tensor)


def test_raw_layout_is_little_endian_and_crc_covers_all_bytes():
    payload = Payload([
        Section(Kind.SHARED_TENSORS, "", {"a": torch.tensor([1.0, -2.0]),
                                          "b": torch.tensor([258], dtype=torch.int32)}),
        Section(Kind.STAT_VECTORS, "s", {"c": torch.tensor([True, False])}),
    ])
    encoded = encode(payload)
    expected = struct.pack("<ffi", 1.0, -2.0, 258) + bytes([1, 0])
    assert b"".join(chunk for _, chunk in payload_chunks(encoded, 1 << 20)) == expected
    assert expected[:4] == b"\x00\x00\x80\x3f"
    assert encoded.manifest.total_bytes == 14
    assert encoded.manifest.crc32 == zlib.crc32(expected)
    sections = encoded.manifest.sections
    assert [(s.kind, s.name) for s in sections] == [(pb.SHARED_TENSORS, ""), (pb.STAT_VECTORS, "s")]
    assert [(t.name, t.dtype, list(t.shape)) for t in sections[0].tensors] == [
        ("a", pb.FLOAT32, [2]), ("b", pb.INT32, [1])]
    assert section_sizes(encoded.manifest) == [12, 2]


def test_non_contiguous_and_grad_tensors_round_trip():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    param = torch.nn.Parameter(torch.tensor([0.5, 1.5]))
    payload = Payload([Section(Kind.SHARED_TENSORS, "", {"t": base.t(), "p": param})])
    out = transmit(payload, 5).tensors(Kind.SHARED_TENSORS)
    assert out["t"].shape == (4, 3)
    assert torch.equal(out["t"], base.t())
    assert torch.equal(out["p"], torch.tensor([0.5, 1.5]))
    assert not out["p"].requires_grad


def test_empty_payload_and_all_empty_sections():
    out = transmit(Payload(), 8)
    assert out.sections == []
    payload = Payload([Section(Kind.SCALAR_SUMMARY, "x", {"e": torch.empty(0)}),
                       Section(Kind.PROTOTYPES, "y", {})])
    encoded = encode(payload)
    assert list(payload_chunks(encoded, 8)) == []
    assembler = PayloadAssembler(encoded.manifest, BIG, 8)
    assert assembler.complete
    with pytest.raises(WireError, match="after the declared payload ended"):
        assembler.add(b"\x00")
    out = assembler.finish()
    assert [(s.kind, s.name) for s in out.sections] == [(Kind.SCALAR_SUMMARY, "x"),
                                                        (Kind.PROTOTYPES, "y")]
    assert out.tensors(Kind.SCALAR_SUMMARY, "x")["e"].shape == (0,)


def test_unsupported_dtype_refused_on_encode():
    payload = Payload([Section(Kind.SHARED_TENSORS, "", {"z": torch.zeros(2, dtype=torch.complex64)})])
    with pytest.raises(WireError, match="cannot travel"):
        encode(payload)


# ---- chunk boundaries -----------------------------------------------------------------

def _layout_payload() -> Payload:
    # Section sizes: 20 + 3 = 23 bytes, 0 bytes (skipped), 16 bytes.
    return Payload([
        Section(Kind.SHARED_TENSORS, "", {"w": torch.arange(5, dtype=torch.float32),
                                          "m": torch.tensor([-1, 0, 1], dtype=torch.int8)}),
        Section(Kind.STAT_VECTORS, "empty", {"nothing": torch.empty(0)}),
        Section(Kind.CONTROL, "", {"c": torch.tensor([0.25, -4.0], dtype=torch.float64)}),
    ])


@pytest.mark.parametrize("chunk_bytes, expected", [
    (1, [1] * 23 + [1] * 16),
    (7, [7, 7, 7, 2, 7, 7, 2]),
    (23, [23, 16]),              # exactly the first section
    (16, [16, 7, 16]),           # exactly the last section
    (1000, [23, 16]),            # larger than the whole payload
])
def test_chunks_stay_inside_sections(chunk_bytes, expected):
    payload = _layout_payload()
    encoded = encode(payload)
    chunks = list(payload_chunks(encoded, chunk_bytes))
    assert [len(c) for _, c in chunks] == expected
    assert all(0 < len(c) <= chunk_bytes for _, c in chunks)
    # Walk the byte offsets: each chunk must lie within one section's [start, end).
    bounds = [(0, 23, Kind.SHARED_TENSORS), (23, 39, Kind.CONTROL)]
    offset = 0
    for kind, chunk in chunks:
        start, end = offset, offset + len(chunk)
        owners = [k for s, e, k in bounds if s <= start and end <= e]
        assert owners == [kind], (start, end, kind)
        offset = end
    assert offset == 39 == encoded.total_bytes
    out = transmit(payload, chunk_bytes)
    assert_same(out.tensors(Kind.SHARED_TENSORS), payload.tensors(Kind.SHARED_TENSORS))
    assert_same(out.tensors(Kind.CONTROL), payload.tensors(Kind.CONTROL))
    assert out.tensors(Kind.STAT_VECTORS, "empty")["nothing"].numel() == 0


@pytest.mark.parametrize("chunk_bytes", [1, 7, 16, 23, 1000])
def test_frames_and_body_mac_equal_the_joined_chunks(chunk_bytes):
    """The sender's one-copy frames and its body MAC, read from tensor memory, are what
    the receiver sees: protobuf frames of the chunks, and the AES-GCM tag of an empty
    message with their concatenation as additional data (GMAC), as a one-shot AES-GCM
    computes it."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from fedattn_shared.wire.signing import BodyMac
    from fedattn_shared.wire.transport import data_frames

    encoded = encode(_layout_payload())
    chunks = list(payload_chunks(encoded, chunk_bytes))
    frames = list(data_frames(encoded, chunk_bytes))
    assert [(k, pb.SubmitMessage(data=c).SerializeToString(), len(c)) for k, c in chunks] == frames
    key, iv = bytes(range(32)), BodyMac.new_iv()
    body = b"".join(c for _, c in chunks)
    assert encoded.body_mac(key, iv) == AESGCM(key).encrypt(iv, b"", body)
    receiver = BodyMac(key, iv)
    for _, chunk in chunks:
        receiver.update(memoryview(chunk))
    assert receiver.tag() == encoded.body_mac(key, iv)
    assert encoded.body_mac(key, BodyMac.new_iv()) != encoded.body_mac(key, iv)


def test_frames_resume_from_any_byte_a_chunk_s_tail_first():
    """A download the server cut into pieces is resumed from the piece the edge holds,
    inside a chunk: ``data_frames_from`` starts with the tail of that chunk, then whole
    chunks; the bytes from the offset are the payload's from there, and from offset 0
    the frames are ``data_frames``'."""
    from fedattn_shared.wire.transport import data_frames, data_frames_from, data_of_frame

    encoded = encode(_layout_payload())
    body = b"".join(c for _, c in payload_chunks(encoded, 23))
    assert list(data_frames_from(encoded, 23, 0)) == list(data_frames(encoded, 23))
    for offset in [*range(0, len(body), 5), len(body)]:  # inside chunks and on their ends
        frames = list(data_frames_from(encoded, 23, offset))
        assert b"".join(bytes(data_of_frame(f)) for _, f, _ in frames) == body[offset:]
        assert [size for _, _, size in frames] == [len(data_of_frame(f)) for _, f, _ in frames]
        assert all(0 < size <= 23 for _, _, size in frames)
    with pytest.raises(ValueError, match="past the payload"):
        list(data_frames_from(encoded, 23, len(body) + 1))


@pytest.mark.parametrize("chunk_bytes", [1, 5, 7, 16, 23, 1000])
def test_frames_from_an_offset_are_the_whole_walk_s_from_there(chunk_bytes):
    """The chunks from any offset are found without walking the ones before it (by each
    section's chunk arithmetic), and are exactly the whole walk's from there: the chunk
    the offset falls in as its tail, then the same chunks, kinds and boundaries."""
    from fedattn_shared.wire.transport import chunk_views_from

    encoded = encode(_layout_payload())
    whole, position = [], 0
    for kind, chunk in payload_chunks(encoded, chunk_bytes):
        whole.append((position, kind, chunk))
        position += len(chunk)
    for offset in range(position + 1):
        expected = [(kind, chunk[max(0, offset - at):]) for at, kind, chunk in whole
                    if at + len(chunk) > offset]
        got = [(kind, b"".join(bytes(v) for v in views), size)
               for kind, views, size in chunk_views_from(encoded, chunk_bytes, offset)]
        assert [(k, c) for k, c, _ in got] == expected, offset
        assert [size for _, _, size in got] == [len(c) for _, c in expected]


def test_chunks_refuse_a_non_positive_size():
    encoded = encode(_layout_payload())
    for bad in (0, -1):
        with pytest.raises(ValueError):
            next(iter(payload_chunks(encoded, bad)))


# ---- corruption and refusals ----------------------------------------------------------

def _sent(chunk_bytes: int = 7):
    encoded = encode(_layout_payload())
    return encoded, [c for _, c in payload_chunks(encoded, chunk_bytes)]


def test_flipped_byte_fails_the_crc():
    encoded, chunks = _sent()
    bad = bytearray(chunks[2])
    bad[3] ^= 0x01
    chunks[2] = bytes(bad)
    assembler = PayloadAssembler(encoded.manifest, BIG, 7)
    for chunk in chunks:
        assembler.add(chunk)
    assert assembler.complete
    with pytest.raises(WireError, match="CRC"):
        assembler.finish()


def test_wrong_manifest_crc_fails():
    encoded, chunks = _sent()
    manifest = wire_copy(encoded.manifest)
    manifest.crc32 ^= 1
    assembler = PayloadAssembler(manifest, BIG, 7)
    for chunk in chunks:
        assembler.add(chunk)
    with pytest.raises(WireError, match="CRC"):
        assembler.finish()


def test_upload_without_checksum_round_trips_and_leaves_the_crc_unchecked():
    # Uploads carry no CRC-32 (their signed body MAC binds the bytes): the manifest says 0
    # and the receiving assembler does not compare it.
    payload = _layout_payload()
    unchecked = encode(payload, checksum=False)
    assert unchecked.manifest.crc32 == 0 != encode(payload).manifest.crc32
    chunks = [c for _, c in payload_chunks(unchecked, 7)]
    assembler = PayloadAssembler(unchecked.manifest, BIG, 7, checksum=False)
    for chunk in chunks:
        assembler.add(chunk)
    decoded = assembler.finish()
    for section, original in zip(decoded.sections, payload.sections, strict=True):
        for name, tensor in original.tensors.items():
            assert torch.equal(section.tensors[name], tensor)
    # The same bytes with checking on are refused: 0 is not their CRC.
    checked = PayloadAssembler(unchecked.manifest, BIG, 7)
    for chunk in chunks:
        checked.add(chunk)
    with pytest.raises(WireError, match="CRC"):
        checked.finish()


def test_truncated_payload_fails():
    encoded, chunks = _sent()
    assembler = PayloadAssembler(encoded.manifest, BIG, 7)
    for chunk in chunks[:-1]:
        assembler.add(chunk)
    assert not assembler.complete
    with pytest.raises(WireError, match="truncated: 37 of 39"):
        assembler.finish()


def test_extra_chunk_after_the_end_fails():
    encoded, chunks = _sent()
    assembler = PayloadAssembler(encoded.manifest, BIG, 7)
    for chunk in chunks:
        assembler.add(chunk)
    with pytest.raises(WireError, match="after the declared payload ended"):
        assembler.add(b"\x00")


def test_chunk_crossing_a_section_end_fails():
    encoded, _ = _sent()
    whole = b"".join(c for _, c in payload_chunks(encoded, 1000))
    assembler = PayloadAssembler(encoded.manifest, BIG, 1000)
    with pytest.raises(WireError, match="crosses the end of section 0"):
        assembler.add(whole)
    # A chunk ending one byte past section 0 after a valid prefix is refused too.
    assembler = PayloadAssembler(encoded.manifest, BIG, 1000)
    assembler.add(whole[:20])
    with pytest.raises(WireError, match="crosses"):
        assembler.add(whole[20:24])
    assert assembler.add(whole[20:23]) is Kind.SHARED_TENSORS
    assert assembler.add(whole[23:]) is Kind.CONTROL
    assert_same(assembler.finish().tensors(Kind.CONTROL),
                _layout_payload().tensors(Kind.CONTROL))


def test_oversize_and_empty_chunks_fail():
    encoded, _ = _sent()
    whole = b"".join(c for _, c in payload_chunks(encoded, 1000))
    assembler = PayloadAssembler(encoded.manifest, BIG, 8)
    with pytest.raises(WireError, match="chunk of 9 bytes exceeds 8"):
        assembler.add(whole[:9])
    with pytest.raises(WireError, match="empty"):
        assembler.add(b"")
    assert assembler.add(whole[:8]) is Kind.SHARED_TENSORS  # nothing was taken before
    assert assembler.received == 8


def test_total_bytes_must_match_the_shapes():
    encoded, _ = _sent()
    for delta in (1, -1):
        manifest = wire_copy(encoded.manifest)
        manifest.total_bytes = 39 + delta
        with pytest.raises(WireError, match=f"total_bytes {39 + delta} != 39"):
            PayloadAssembler(manifest, BIG, 7)


def _manifest(*tensors: tuple[str, int, list[int]], kind: int = pb.SHARED_TENSORS,
              total: int | None = None) -> pb.PayloadManifest:
    manifest = pb.PayloadManifest()
    section = manifest.sections.add(kind=kind, name="")
    for name, dtype, shape in tensors:
        section.tensors.add(name=name, dtype=dtype, shape=shape)
    if total is not None:
        manifest.total_bytes = total
    return manifest


def test_payload_over_the_cap_is_refused_before_allocation():
    # 4 TiB declared consistently: allocating it first would fail with MemoryError instead.
    huge = _manifest(("w", pb.FLOAT32, [1 << 40]), total=4 << 40)
    with pytest.raises(WireError, match="exceeds the cap"):
        PayloadAssembler(huge, 1 << 20, 1 << 20)
    # Exactly at the cap is allowed; one byte over is not.
    at_cap = _manifest(("w", pb.FLOAT32, [4]), total=16)
    assert len(PayloadAssembler(at_cap, 16, 16).buffer) == 16
    with pytest.raises(WireError, match="16 bytes exceeds the cap of 15"):
        PayloadAssembler(at_cap, 15, 16)


@pytest.mark.parametrize("shape", [[-1, 4], [-2, -3], [3, -1]])
def test_negative_dims_refused(shape):
    with pytest.raises(WireError, match="negative dimension"):
        PayloadAssembler(_manifest(("w", pb.FLOAT32, shape), total=24), BIG, 8)


def test_too_many_dims_refused():
    with pytest.raises(WireError, match="9 dims"):
        PayloadAssembler(_manifest(("w", pb.UINT8, [1] * 9), total=1), BIG, 8)
    assert len(PayloadAssembler(_manifest(("w", pb.UINT8, [1] * 8), total=1), BIG, 8).buffer) == 1


@pytest.mark.parametrize("code", [0, 10, 99])
def test_unknown_dtype_code_refused(code):
    with pytest.raises(WireError, match=f"unknown wire dtype code {code}"):
        PayloadAssembler(_manifest(("w", code, [2]), total=8), BIG, 8)


@pytest.mark.parametrize("kind", [0, 7, 99])
def test_unknown_section_kind_refused(kind):
    with pytest.raises(WireError, match=f"unknown kind {kind}"):
        PayloadAssembler(_manifest(("w", pb.FLOAT32, [1]), kind=kind, total=4), BIG, 8)


def test_duplicate_tensor_names_refused():
    manifest = _manifest(("w", pb.FLOAT32, [1]), ("w", pb.FLOAT32, [1]), total=8)
    data = struct.pack("<ff", 1.0, 2.0)
    manifest.crc32 = zlib.crc32(data)
    # Refused from the manifest alone, before any data is buffered; decode checks too.
    with pytest.raises(WireError, match="duplicate tensor 'w'"):
        PayloadAssembler(manifest, BIG, 8)
    with pytest.raises(WireError, match="duplicate tensor 'w'"):
        decode(manifest, data)
    twice = pb.PayloadManifest(total_bytes=8, crc32=zlib.crc32(data))
    for _ in range(2):
        twice.sections.add(kind=pb.SHARED_TENSORS).tensors.add(name="w", dtype=pb.FLOAT32, shape=[1])
    with pytest.raises(WireError, match="appears twice"):
        PayloadAssembler(twice, BIG, 8)
    # The same name in two different sections is fine.
    ok = pb.PayloadManifest(total_bytes=8, crc32=zlib.crc32(data))
    for kind in (pb.SHARED_TENSORS, pb.CONTROL):
        ok.sections.add(kind=kind).tensors.add(name="w", dtype=pb.FLOAT32, shape=[1])
    out = decode(ok, data)
    assert out.tensors(Kind.SHARED_TENSORS)["w"].item() == 1.0
    assert out.tensors(Kind.CONTROL)["w"].item() == 2.0


def test_decode_checks_the_data_length():
    manifest = _manifest(("w", pb.FLOAT32, [2]))
    with pytest.raises(WireError, match="runs past the end"):
        decode(manifest, b"\x00" * 7)
    with pytest.raises(WireError, match="1 bytes of data beyond"):
        decode(manifest, b"\x00" * 9)
    out = decode(manifest, struct.pack("<ff", 0.5, 2.0))  # bytes (not bytearray) are copied
    assert out.tensors(Kind.SHARED_TENSORS)["w"].tolist() == [0.5, 2.0]


def test_repeated_manifests_reuse_their_layout_and_encode_hands_out_copies():
    payload = Payload([Section(Kind.SHARED_TENSORS, "", {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "n": torch.tensor([7], dtype=torch.int64)})])
    first = encode(payload)
    layout = section_layout(wire_copy(first.manifest).sections[0])
    assert layout.names == ("w", "n") and layout.shapes == ((2, 3), (1,))
    assert layout.dtypes == (torch.float32, torch.int64) and layout.nbytes == 32
    assert layout.single_dtype is None
    assert section_layout(wire_copy(first.manifest).sections[0]) is layout  # remembered
    # Each encode's manifest is its own: changing one leaves the next encode intact.
    first.manifest.sections[0].tensors[0].shape[:] = [6]
    first.manifest.sections[0].name = "changed"
    again = encode(payload)
    assert again.manifest.sections[0].name == ""
    assert list(again.manifest.sections[0].tensors[0].shape) == [2, 3]
    assert_same(decode(again.manifest, b"".join(c for _, c in payload_chunks(again))).tensors(
        Kind.SHARED_TENSORS), payload.sections[0].tensors)


def test_large_manifests_are_not_remembered():
    # A peer sending ever-new large manifests must not grow the server's memory.
    from fedattn_shared.wire.serialize import _layout_of_serialized

    manifest = pb.PayloadManifest()
    section = manifest.sections.add(kind=pb.SHARED_TENSORS)
    count = MAX_REMEMBERED_LAYOUT_BYTES // 20
    for i in range(count):
        section.tensors.add(name=f"tensor-{i:08d}", dtype=pb.FLOAT32, shape=[1])
    assert len(section.SerializeToString()) > MAX_REMEMBERED_LAYOUT_BYTES
    before = _layout_of_serialized.cache_info().currsize
    layout = section_layout(section)
    assert layout.nbytes == 4 * count and layout.single_dtype == torch.float32
    assert _layout_of_serialized.cache_info().currsize == before


def test_decoded_views_are_made_on_first_use_and_equal_the_sent_tensors():
    sent = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "e": torch.empty(0, 4), "b": torch.tensor([-1.5])}
    out = transmit(Payload([Section(Kind.SHARED_TENSORS, "", dict(sent))]), 1 << 20)
    views = out.tensors(Kind.SHARED_TENSORS)
    assert isinstance(views, TensorViews)
    assert list(views) == ["w", "e", "b"] and len(views) == 3
    assert views._views is None  # names and length come from the manifest alone
    assert_same(dict(views.items()), sent)
    assert "w" in views and "x" not in views and views.get("x") is None
    # The views share the section's flat vector (and through it, the receive buffer).
    views.flat[0] = 42.0
    assert views["w"][0, 0].item() == 42.0


def test_contiguous_run_only_for_tensors_back_to_back_in_order():
    base = torch.arange(10, dtype=torch.float32)
    a, b, c = base[:4].view(2, 2), base[4:4], base[4:10]
    run = contiguous_run([a, b, c])
    assert run is not None and run.data_ptr() == base.data_ptr() and run.tolist() == base.tolist()
    assert contiguous_run([c, a]) is None  # out of order
    assert contiguous_run([base[:4], base[5:]]) is None  # a gap
    assert contiguous_run([base[:4], base[4:].view(torch.int32)]) is None  # two dtypes
    grid = torch.arange(12.0).reshape(3, 4)
    assert contiguous_run([grid.t()]) is None  # not contiguous
    assert contiguous_run([torch.zeros(3), torch.zeros(2)]) is None  # two storages
    assert contiguous_run([]) is None and contiguous_run([torch.empty(0)]) is None


def test_encoding_tensors_laid_out_as_one_reads_them_as_one_view():
    base = torch.randn(50)
    tensors = {"w": base[:40].view(5, 8), "b": base[40:]}
    contiguous = encode(Payload([Section(Kind.SHARED_TENSORS, "", tensors)]))
    separate = encode(Payload([Section(Kind.SHARED_TENSORS, "", {
        name: t.clone() for name, t in tensors.items()})]))
    assert len(contiguous.section_views[0]) == 1 and len(separate.section_views[0]) == 2
    assert contiguous.manifest == separate.manifest  # same layout, same CRC
    assert b"".join(c for _, c in payload_chunks(contiguous)) == b"".join(
        c for _, c in payload_chunks(separate))
    # A decoded section encodes from its flat vector too, byte for byte.
    received = transmit(Payload([Section(Kind.SHARED_TENSORS, "", tensors)]), 64)
    again = encode(received)
    assert len(again.section_views[0]) == 1 and again.manifest == separate.manifest
    assert received.sections[0].tensors._views is None  # its manifest came from the layout


def test_nonfinite_tensors_names_every_bad_tensor():
    payload = Payload([
        Section(Kind.SHARED_TENSORS, "", {
            "ok": torch.tensor([1.0, -2.0]),
            "nan": torch.tensor([0.0, float("nan")]),
            "inf": torch.tensor([float("inf")], dtype=torch.float16),
            "ints": torch.tensor([2**31 - 1], dtype=torch.int32),
            "empty": torch.empty(0),
        }),
        Section(Kind.CONTROL, "x", {"ninf": torch.tensor(float("-inf"), dtype=torch.bfloat16),
                                    "fine": torch.zeros(3, dtype=torch.float64)}),
    ])
    assert nonfinite_tensors(payload) == ["shared_tensors/nan", "shared_tensors/inf",
                                          "control:x/ninf"]
    # After a trip over the wire, NaN/Inf survive and are still found.
    assert nonfinite_tensors(transmit(payload, 3)) == nonfinite_tensors(payload)
    clean = Payload([Section(Kind.SHARED_TENSORS, "", {"ok": torch.ones(2)})])
    assert nonfinite_tensors(clean) == []
    # Finite values whose sum overflows (float16 tops out at 65504) are not flagged.
    big = transmit(Payload([
        Section(Kind.SHARED_TENSORS, "", {"a": torch.full((4,), 60000.0, dtype=torch.float16)}),
        Section(Kind.CONTROL, "", {"b": torch.full((2,), 3e38)})]), 2)
    assert all(section.flat is not None for section in big.sections)  # the one-sum path
    assert nonfinite_tensors(big) == []


# ---- byte accounting ------------------------------------------------------------------

def test_byte_meter_round_and_totals():
    meter = ByteMeter(None)
    meter.count("up", "shared_tensors", wire=100, raw=80, edge="e1")
    meter.count("up", "shared_tensors", wire=50, raw=40, edge="e2")
    meter.count("down", "meta", wire=10)
    first = {
        "down": {"meta": {"wire": 10, "raw": 0, "messages": 1}},
        "up": {"shared_tensors": {"wire": 150, "raw": 120, "messages": 2}},
    }
    assert meter.take_round() == first
    assert meter.take_round() == {}
    meter.count("up", "control", wire=7, raw=4)
    assert meter.take_round() == {"up": {"control": {"wire": 7, "raw": 4, "messages": 1}}}
    assert meter.totals() == {
        "down": {"meta": {"wire": 10, "raw": 0, "messages": 1}},
        "up": {"control": {"wire": 7, "raw": 4, "messages": 1},
               "shared_tensors": {"wire": 150, "raw": 120, "messages": 2}},
    }


def test_byte_meter_prometheus_counters():
    registry = CollectorRegistry()
    meter = ByteMeter(registry)
    meter.count("up", "shared_tensors", wire=100, raw=80, edge="e1")
    meter.count("up", "shared_tensors", wire=50, raw=40, edge="e1")
    meter.count("up", "shared_tensors", wire=9, raw=8, edge="e2")
    meter.count("down", "meta", wire=10, edge="e1")

    def sample(metric, kind, direction, edge):
        return registry.get_sample_value(
            f"fedattn_{metric}_total", {"kind": kind, "direction": direction, "edge": edge,
                                        "codec": "none"})

    assert sample("wire_bytes", "shared_tensors", "up", "e1") == 150
    assert sample("raw_tensor_bytes", "shared_tensors", "up", "e1") == 120
    assert sample("messages", "shared_tensors", "up", "e1") == 2
    assert sample("wire_bytes", "shared_tensors", "up", "e2") == 9
    assert sample("wire_bytes", "meta", "down", "e1") == 10
    assert sample("messages", "meta", "down", "e1") == 1
    assert sample("raw_tensor_bytes", "meta", "down", "e1") is None  # raw 0: never incremented
    # take_round resets only the per-round tally, never the counters.
    meter.take_round()
    assert sample("wire_bytes", "shared_tensors", "up", "e1") == 150

    other = CollectorRegistry()
    ByteMeter(other, namespace="edge").count("up", "meta", wire=3)
    assert other.get_sample_value("edge_wire_bytes_total",
                                  {"kind": "meta", "direction": "up", "edge": "",
                                   "codec": "none"}) == 3


def test_count_message_adds_the_grpc_prefix():
    # Field 2 (total_bytes) = 300: tag byte 0x10 + varint 0xac 0x02 = 3 bytes.
    message = pb.PayloadManifest(total_bytes=300)
    assert message.SerializeToString() == b"\x10\xac\x02"
    assert GRPC_FRAME_PREFIX == 5
    assert message_wire_bytes(message) == 8
    registry = CollectorRegistry()
    meter = ByteMeter(registry)
    meter.count_message("down", message, edge="e3")
    meter.count_message("up", message, kind="control", raw=12)
    assert meter.take_round() == {
        "down": {"meta": {"wire": 8, "raw": 0, "messages": 1}},
        "up": {"control": {"wire": 8, "raw": 12, "messages": 1}},
    }
    assert registry.get_sample_value("fedattn_wire_bytes_total",
                                     {"kind": "meta", "direction": "down", "edge": "e3",
                                      "codec": "none"}) == 8


def test_byte_meter_is_thread_safe():
    meter = ByteMeter(CollectorRegistry())

    def work():
        for _ in range(2000):
            meter.count("up", "shared_tensors", wire=3, raw=2)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert meter.totals() == {"up": {"shared_tensors": {"wire": 24000, "raw": 16000,
                                                        "messages": 8000}}}


def test_data_frames_are_exactly_protobufs_encoding():
    """Pre-built data frames must be byte-identical to protobuf's own serialization, and
    reading one back must give the chunk; other messages go through protobuf."""
    from fedattn_shared.wire.transport import data_frame, data_of_frame, deserializer

    for n in (0, 1, 127, 128, 300, 16_384, (1 << 20) + 7):
        chunk = bytes(i % 251 for i in range(n))
        frame = data_frame(chunk)
        assert frame == pb.SubmitMessage(data=chunk).SerializeToString()
        assert frame == pb.TaskMessage(data=chunk).SerializeToString()
        assert bytes(data_of_frame(frame)) == chunk
        assert bytes(deserializer(pb.SubmitMessage)(frame)) == chunk
    header = pb.SubmitMessage(header=pb.SubmitHeader(edge_id="cam1")).SerializeToString()
    assert data_of_frame(header) is None
    assert deserializer(pb.SubmitMessage)(header).header.edge_id == "cam1"
    # A length that lies about the frame is not taken as a data frame.
    assert data_of_frame(b"\x12\x05abc") is None

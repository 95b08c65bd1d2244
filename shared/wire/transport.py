"""What both ends of the gRPC channel agree on: message caps, keepalive, and the
streaming of an encoded payload as (header, data chunks) with byte accounting."""

from __future__ import annotations

from collections.abc import Iterator

from .codec import DEFAULT_CHUNK_BYTES, EncodedPayload, Kind

# Data chunks stay well under gRPC's 4 MiB default; headers (manifests) are small.
MAX_MESSAGE_BYTES = 4 << 20


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Keepalive pings keep NAT'd edges' connections open and detect dead peers."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return channel_options(max_message_bytes) + [
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


__all__ = ["DEFAULT_CHUNK_BYTES", "MAX_MESSAGE_BYTES", "channel_options", "server_options"]


# ---- data frames -------------------------------------------------------------------------
# TaskMessage and SubmitMessage carry data chunks in field 2 (``bytes data``). A message
# with only that field set is the tag byte 0x12, the length as a varint, then the bytes.
# Building and reading that frame directly spares protobuf's two copies of every chunk per
# message (construct + serialize, parse); anything else goes through protobuf as usual.
DATA_TAG = 0x12


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def data_frame(*parts: bytes | memoryview) -> bytes:
    """The serialized form of ``TaskMessage(data=chunk)`` / ``SubmitMessage(data=chunk)``,
    the chunk being ``parts`` end to end (copied once, into the frame)."""
    return b"".join((bytes((DATA_TAG,)), _varint(sum(len(p) for p in parts)), *parts))


def data_frames(encoded: EncodedPayload, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                ) -> Iterator[tuple[Kind, bytes, int]]:
    """(kind, frame, chunk length) for each chunk of ``encoded``: each frame is built
    straight from tensor memory, the one copy a chunk costs before gRPC takes it."""
    for kind, views in encoded.chunk_views(chunk_bytes):
        frame = data_frame(*views)
        yield kind, frame, sum(len(v) for v in views)


def data_of_frame(raw: bytes) -> memoryview | None:
    """The chunk of a data-only frame, as a view of ``raw``; None for any other message."""
    if not raw or raw[0] != DATA_TAG:
        return None
    length, shift, pos = 0, 0, 1
    while pos < len(raw) and pos <= 5:
        byte = raw[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return memoryview(raw)[pos:] if len(raw) - pos == length else None
        shift += 7
    return None


def serialize(message) -> bytes:
    """Pre-serialized frames pass through; protobuf messages serialize."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def deserializer(message_type):
    """Data-only frames become a memoryview of the chunk; everything else is parsed into
    ``message_type`` (a parsed message that holds only data also becomes its chunk)."""

    def parse(raw: bytes):
        chunk = data_of_frame(raw)
        if chunk is not None:
            return chunk
        message = message_type.FromString(raw)
        if message.WhichOneof("body") == "data":
            return memoryview(message.data)
        return message

    return parse

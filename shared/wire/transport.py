"""What both ends of the gRPC channel agree on: message caps, keepalive, and the
streaming of an encoded payload as (header, data chunks) with byte accounting."""

from __future__ import annotations

from .codec import DEFAULT_CHUNK_BYTES

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

"""Byte accounting: every message counted by kind and direction, on both daemons.

Wire bytes are what gRPC carries for a message (its serialized size plus gRPC's 5-byte
length prefix); raw bytes are the tensor bytes inside it. Data chunks belong to exactly
one section, so both are attributed to that section's kind; headers, joins, polls and
replies are counted as kind "meta". Totals go to Prometheus counters (labels kind,
direction, edge, codec) and to a per-round tally that the server writes into history.json.

Under update compression (``--compress``) a coded section's raw bytes are what its tensors
would be uncompressed (the decoded section), its wire bytes what traveled, and its
``codec`` label the codec's registered name (``int8``, ``topk+ef``; bounded: only
registered names) instead of ``none``: wire / raw is the compression ratio. The raw bytes
of a coded payload are counted once per payload (``messages=0``), its chunks carry wire
bytes only. An upload's coded chunks are held (``CodedUpload``) and counted with its raw
bytes when it is complete: a per-round tally taken while an upload is under way (an async
version applied by another edge's result) would otherwise pair one upload's wire bytes
with another's raw ones, and its wire / raw would not be a compression ratio.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter

GRPC_FRAME_PREFIX = 5
META = "meta"
UP = "up"      # edge -> server
DOWN = "down"  # server -> edge
NO_CODEC = "none"  # the codec label of bytes that travel as they are


def message_wire_bytes(message) -> int:
    return message.ByteSize() + GRPC_FRAME_PREFIX


def data_message_wire_bytes(chunk_length: int) -> int:
    """Wire size of a message whose only field is ``bytes data = 2`` (TaskMessage or
    SubmitMessage), computed rather than measured: tag byte + length varint + data."""
    return 1 + _varint_length(chunk_length) + chunk_length + GRPC_FRAME_PREFIX


def count_coded(meter: ByteMeter, direction: str, coded: dict[str, tuple[str, int]],
                edge: str = "") -> None:
    """The raw (decoded) bytes of a coded payload, once: ``coded`` maps a kind label to
    (codec label, decoded bytes); its chunks were counted with their wire bytes only."""
    for kind, (codec, raw) in coded.items():
        meter.count(direction, kind, 0, raw, edge, codec, messages=0)


class CodedUpload:
    """One upload's byte counts: chunks of a kind that travels as it is are counted as they
    arrive; the wire bytes of coded kinds are held and counted together with their raw
    (decoded) bytes when the upload is complete (``complete``), so that both land in the
    same round's tally, or alone when it is not (``abandon``: they traveled all the same)."""

    def __init__(self, meter: ByteMeter, direction: str, coded: dict[str, tuple[str, int]],
                 edge: str = ""):
        self.meter, self.direction, self.coded, self.edge = meter, direction, coded, edge
        self.held: dict[str, list[int]] = {}  # kind -> [wire, messages]

    def chunk(self, kind: str, size: int) -> None:
        """A data chunk of ``size`` bytes of section kind ``kind``."""
        wire = data_message_wire_bytes(size)
        if kind not in self.coded:
            self.meter.count(self.direction, kind, wire, size, self.edge)
            return
        held = self.held.setdefault(kind, [0, 0])
        held[0] += wire
        held[1] += 1

    def complete(self) -> None:
        """The whole upload arrived: each coded kind's wire and raw bytes, at once."""
        for kind, (codec, raw) in self.coded.items():
            wire, messages = self.held.pop(kind, (0, 0))
            self.meter.count(self.direction, kind, wire, raw, self.edge, codec, messages=messages)

    def abandon(self) -> None:
        """The upload ended short: the wire bytes that did travel, without raw ones."""
        for kind, (wire, messages) in self.held.items():
            self.meter.count(self.direction, kind, wire, 0, self.edge, self.coded[kind][0],
                             messages=messages)
        self.held.clear()


def _varint_length(value: int) -> int:
    length = 1
    while value >= 0x80:
        value >>= 7
        length += 1
    return length


class ByteMeter:
    """Thread-safe tallies of wire and raw bytes, mirrored into Prometheus counters."""

    def __init__(self, registry: CollectorRegistry | None, namespace: str = "fedattn"):
        self._lock = threading.Lock()
        self._round: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        self._total: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        self._wire = self._raw = self._messages = None
        self._children: dict[tuple[str, str, str, str], tuple] = {}
        self._raw_children: dict[tuple[str, str, str, str], object] = {}
        if registry is not None:
            labels = ["kind", "direction", "edge", "codec"]
            self._wire = Counter(f"{namespace}_wire_bytes", "Bytes on the wire (protobuf + gRPC prefix)",
                                 labels, registry=registry)
            self._raw = Counter(f"{namespace}_raw_tensor_bytes",
                                "Raw tensor bytes carried (a coded section's: decoded)",
                                labels, registry=registry)
            self._messages = Counter(f"{namespace}_messages", "gRPC messages", labels,
                                     registry=registry)

    def count(self, direction: str, kind: str, wire: int, raw: int = 0, edge: str = "",
              codec: str = NO_CODEC, messages: int = 1) -> None:
        with self._lock:
            for table in (self._round, self._total):
                entry = table[(direction, kind, codec)]
                entry[0] += wire
                entry[1] += raw
                entry[2] += messages
        if self._wire is not None:
            # Resolving labels costs ~5 us of Python each time: once per label set, not
            # three times per chunk. A raw series exists only once raw bytes were counted
            # (meta messages carry none).
            key = (kind, direction, edge, codec)
            counters = self._children.get(key)
            if counters is None:
                counters = self._children.setdefault(
                    key, (self._wire.labels(*key), self._messages.labels(*key)))
            if wire or messages:
                counters[0].inc(wire)
                counters[1].inc(messages)
            if raw:
                raw_counter = self._raw_children.get(key)
                if raw_counter is None:
                    raw_counter = self._raw_children.setdefault(key, self._raw.labels(*key))
                raw_counter.inc(raw)

    def count_message(self, direction: str, message, edge: str = "", kind: str = META,
                      raw: int = 0) -> None:
        self.count(direction, kind, message_wire_bytes(message), raw, edge)

    @staticmethod
    def _as_dict(table) -> dict:
        """{direction: {kind: {wire, raw, messages}}}, summed over codecs; a kind that
        traveled coded adds ``codecs``: {codec: {wire, raw, messages}}."""
        out: dict = {}
        for (direction, kind, codec), (wire, raw, messages) in sorted(table.items()):
            entry = out.setdefault(direction, {}).setdefault(
                kind, {"wire": 0, "raw": 0, "messages": 0})
            entry["wire"] += wire
            entry["raw"] += raw
            entry["messages"] += messages
            entry.setdefault("_by", {})[codec] = {"wire": wire, "raw": raw, "messages": messages}
        for kinds in out.values():
            for entry in kinds.values():
                by = entry.pop("_by")
                if set(by) != {NO_CODEC}:
                    entry["codecs"] = by
        return out

    def take_round(self) -> dict:
        """The tally since the last call, as {direction: {kind: {wire, raw, messages}}}
        (plus ``codecs`` where a kind traveled coded)."""
        with self._lock:
            out = self._as_dict(self._round)
            self._round.clear()
        return out

    def totals(self) -> dict:
        with self._lock:
            return self._as_dict(self._total)

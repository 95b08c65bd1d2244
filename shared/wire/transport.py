"""What both ends of the gRPC channel agree on: message caps and keepalive, and all of
chunking: an encoded payload cut into data chunks that never span two sections (so every
chunk's bytes are attributable to one kind), sent as hand-built frames (no protobuf
copies), and received back into one buffer by ``PayloadAssembler``, which refuses
anything off the declared layout (the byte cap before any allocation, each chunk against
the layout, the CRC at the end)."""

from __future__ import annotations

import math
import mmap
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..kernels import compiled
from ..schema import Kind, Payload
from . import fedattn_pb2 as pb
from .payload import WireError
from .serialize import EncodedPayload, crc32, decode, section_layout, section_sizes

DEFAULT_CHUNK_BYTES = 1 << 20

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


# The calls one edge may have open at once: its presence stream, a NextTask, a Submit, and
# one spare (a Join or a health check).
CALLS_PER_EDGE = 4


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES,
                   max_edges: int = 0, keepalive_ms: int = 30_000) -> list[tuple[str, int]]:
    """The server's channel arguments. ``max_edges`` sizes grpc core's backlog of calls the
    application has not picked up yet. Past 1,000 such calls core drops new ones at random
    (all of them past 3,000), answering CANCELLED before any handler sees them. The
    asyncio server picks calls up one at a time, so a phase opening for 10,000 edges at
    once (every edge told at the same instant) overran that backlog and lost thousands of
    downloads and uploads per round. Sized to every call the registered edges may have
    open, no honest call is dropped. The backlog stays bounded: calls past it are still
    refused. ``keepalive_ms``: the server's HTTP/2 PING interval on each connection (behind
    nginx, one connection per call: the pings keep a call whose headers went out from its
    idle timeout)."""
    options = [(key, keepalive_ms if key == "grpc.keepalive_time_ms" else value)
               for key, value in channel_options(max_message_bytes)] + [
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]
    if max_edges > 0:
        backlog = CALLS_PER_EDGE * max_edges
        options += [("grpc.server.max_pending_requests", backlog),
                    ("grpc.server.max_pending_requests_hard_limit", backlog)]
    return options


__all__ = ["CALLS_PER_EDGE", "DEFAULT_CHUNK_BYTES", "MAX_MESSAGE_BYTES", "BufferPool",
           "DownloadTerms", "FiniteScan", "PayloadAssembler", "Spool", "call_seconds",
           "channel_options", "server_options"]


# ---- a task download's terms --------------------------------------------------------------
def call_seconds(no_wait: bool, poll: float, idle: float, window: int, min_rate: float) -> float:
    """The longest deadline a NextTask call may carry: its long poll (unless ``no_wait``),
    a wait for room in the server's download memory, then its window of data at the
    slowest rate the server accepts. gRPC cannot end a stream whose data the client stops
    taking, but the call's deadline ends it, so the server requires one this long at most
    and the edge sets exactly this."""
    return (0.0 if no_wait else poll) + 2 * idle + window / min_rate


@dataclass(frozen=True)
class DownloadTerms:
    """What the server's JoinReply says of task downloads (protocol 4)."""

    idle_timeout: float = 30.0
    min_rate: float = 32768.0
    window: int = 4 << 20
    poll_timeout: float = 20.0

    @classmethod
    def of(cls, reply) -> DownloadTerms:
        """The terms of a ``JoinReply``."""
        return cls(reply.download_idle_timeout, reply.download_min_rate,
                   reply.download_window, reply.poll_timeout)

    def deadline(self, no_wait: bool) -> float:
        """The deadline of a NextTask call (``call_seconds``)."""
        return call_seconds(no_wait, self.poll_timeout, self.idle_timeout, self.window,
                            self.min_rate)


@dataclass(frozen=True)
class UploadTerms:
    """What the server's JoinReply says of result uploads: the body of an upload must
    arrive within ``idle_timeout`` plus its size at ``min_rate``, each chunk within
    ``idle_timeout`` plus the chunk's size at ``min_rate`` (``chunk_seconds``). The server
    cuts an upload past either and holds what arrived for the edge to resume; the edge
    sizes its call's deadline from the same terms, so a slow link that moves at the rate
    the server accepts always finishes its call."""

    idle_timeout: float = 30.0
    min_rate: float = 32768.0

    @classmethod
    def of(cls, reply) -> UploadTerms:
        """The terms of a ``JoinReply``; a value a server left out (0), or one no server
        should send (negative, NaN), is the default's."""
        default = cls()
        idle, rate = reply.upload_idle_timeout, reply.upload_min_rate
        return cls(idle if math.isfinite(idle) and idle > 0 else default.idle_timeout,
                   rate if math.isfinite(rate) and rate > 0 else default.min_rate)

    def chunk_seconds(self, size: int) -> float:
        """The longest ``size`` bytes may take to arrive: the idle timeout, plus the bytes
        at the minimum rate (a chunk arrives only once all of it has: a 1 MiB chunk takes
        33 s at 256 kbit/s, and the idle timeout alone cut every slow link's upload)."""
        return self.idle_timeout + size / self.min_rate


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
    return data_frames_from(encoded, chunk_bytes, 0)


def data_frames_from(encoded: EncodedPayload, chunk_bytes: int, offset: int
                     ) -> Iterator[tuple[Kind, bytes, int]]:
    """``data_frames`` from data byte ``offset`` on (``chunk_views_from``'s chunks, each
    built into its frame)."""
    for kind, views, size in chunk_views_from(encoded, chunk_bytes, offset):
        yield kind, data_frame(*views), size


def chunk_views_from(encoded: EncodedPayload, chunk_bytes: int, offset: int
                     ) -> Iterator[tuple[Kind, list[memoryview], int]]:
    """``chunk_views`` from data byte ``offset`` on, with each chunk's length: the chunks
    before it are not built (a window's call costs its own chunks, not the payload's), and
    an offset inside a chunk (a download the server sent in pieces, resumed from the piece
    the edge holds) starts with that chunk's tail as a chunk of its own."""
    if offset > encoded.total_bytes:
        raise ValueError(f"offset {offset} is past the payload's {encoded.total_bytes} bytes")
    for kind, views, position in _chunks(encoded, chunk_bytes, offset):
        size = sum(len(v) for v in views)
        skip = max(0, offset - position)  # inside the chunk ``offset`` falls in: its tail
        yield kind, (span(views, skip, size) if skip else views), size - skip


def span(views: list[memoryview], start: int, stop: int) -> list[memoryview]:
    """Bytes ``start`` to ``stop`` of the views taken end to end, as views."""
    out = []
    for view in views:
        if start < len(view) and stop > 0:
            out.append(view[max(start, 0) : min(stop, len(view))])
        start, stop = start - len(view), stop - len(view)
    return out


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


# ---- chunking ------------------------------------------------------------------------
def chunk_views(encoded: EncodedPayload, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                ) -> Iterator[tuple[Kind, list[memoryview]]]:
    """Each data chunk as the views of tensor memory it spans (at most ``chunk_bytes``,
    inside one section), so a sender copies the bytes once, into its frame."""
    for kind, views, _ in _chunks(encoded, chunk_bytes, 0):
        yield kind, views


def _chunks(encoded: EncodedPayload, chunk_bytes: int, start: int
            ) -> Iterator[tuple[Kind, list[memoryview], int]]:
    """(kind, views, data byte the chunk starts at) for the chunks that end after data
    byte ``start``: each section is cut every ``chunk_bytes`` from its own start, so the
    chunk holding ``start`` is found by arithmetic, and the sections and tensors before it
    are stepped over without building their chunks."""
    if chunk_bytes < 1:  # 0 would yield empty chunks forever
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    position = 0  # the data byte the current section starts at
    for kind, views in zip(encoded.section_kinds, encoded.section_views, strict=True):
        length = sum(len(view) for view in views)
        if position + length <= start:
            position += length
            continue
        skip = max(0, start - position)
        skip -= skip % chunk_bytes  # the section's bytes before its first chunk to build
        at = position + skip
        pending: list[memoryview] = []
        size = 0
        for view in views:
            if skip >= len(view):
                skip -= len(view)
                continue
            offset, skip = skip, 0
            while offset < len(view):
                take = min(chunk_bytes - size, len(view) - offset)
                pending.append(view[offset : offset + take])
                size += take
                offset += take
                if size == chunk_bytes:
                    yield kind, pending, at
                    pending, at, size = [], at + size, 0
        if size:
            yield kind, pending, at
        position += length


def payload_chunks(encoded: EncodedPayload, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                   ) -> Iterator[tuple[Kind, bytes]]:
    """Data chunks of at most ``chunk_bytes``, each inside one section."""
    for kind, views in chunk_views(encoded, chunk_bytes):
        yield kind, b"".join(views)


class BufferPool:
    """Receive buffers kept for reuse. A fresh buffer of tens of MB costs a page fault per
    4 KiB on first touch, for every upload; a server reuses a few instead. Not thread-safe:
    use it from one thread (the server's event loop)."""

    def __init__(self, keep: int):
        self.keep = keep
        self._free: dict[int, list[bytearray]] = {}

    def take(self, size: int) -> bytearray:
        free = self._free.get(size)
        return free.pop() if free else bytearray(size)

    def give(self, buffer: bytearray) -> None:
        free = self._free.setdefault(len(buffer), [])
        if len(free) < self.keep:
            free.append(buffer)

    def clear(self) -> None:
        """Lets every kept buffer go (a model-sized bytearray is its own memory map:
        freed, it leaves the process at once)."""
        self._free = {}


class Spool:
    """One payload's bytes in an unlinked file in ``directory``, written as they arrive
    (``pwrite``: the kernel's page cache holds them, which it can write back and drop,
    not the process's heap) and mapped only once complete, privately (a write into the
    map, such as the norm bound's scaling, changes the process's copy of that page, never
    the file). A server receiving many uploads at once then holds none of their bodies
    while they stream in: a receive buffer is a model's bytes for the whole of a slow
    upload. The file has no name from the start, so nothing is left behind by a crash;
    its disk space goes back once it is closed and nothing views the map."""

    def __init__(self, directory: Path, size: int):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            self.fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except (AttributeError, OSError):  # no O_TMPFILE here: named for an instant
            self.fd, name = tempfile.mkstemp(dir=directory, prefix="receiving-")
            os.unlink(name)
        self.size = size
        self._map: mmap.mmap | None = None
        try:
            os.ftruncate(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise

    def __len__(self) -> int:
        return self.size

    def write(self, offset: int, chunk) -> None:
        """Writes ``chunk`` at ``offset`` (releases the GIL: a worker thread's)."""
        view = memoryview(chunk).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset`` (``pread``: a resumed upload's held prefix, read
        back to MAC it under the new header; releases the GIL)."""
        return os.pread(self.fd, size, offset)

    def mapped(self) -> mmap.mmap | bytearray:
        """The bytes, as a private writable map of the file (an empty bytearray when
        there are none)."""
        if not self.size:
            return bytearray()
        if self._map is None:
            self._map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_COPY)
        return self._map

    def holds(self, views: list[memoryview]) -> bool:
        """Whether ``views`` are, end to end, the whole file's bytes as the map shows them
        and the file still holds: views of the map from its first byte to its last, and
        none of its pages written since it was mapped (a write, such as the norm bound's
        scaling, makes the process its own copy of the page: its page-map entry no longer
        says "file page"). Reads 8 bytes of ``/proc/self/pagemap`` per page; False
        wherever that cannot be read."""
        if self._map is None or not views or self.fd < 0:
            return False
        start = torch.frombuffer(self._map, dtype=torch.uint8).data_ptr()
        position = start
        for view in views:
            if not view.nbytes:
                continue
            if np.frombuffer(view, dtype=np.uint8).ctypes.data != position:
                return False
            position += view.nbytes
        if position != start + self.size:
            return False
        page = mmap.PAGESIZE
        first, count = start // page, (start + self.size + page - 1) // page - start // page
        try:
            with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
                entries = np.frombuffer(os.pread(pagemap.fileno(), 8 * count, 8 * first),
                                        dtype=np.uint64)
        except OSError:
            return False
        if len(entries) != count:
            return False
        present, swapped, file = (np.uint64(1) << np.uint64(bit) for bit in (63, 62, 61))
        written = ((entries & present) != 0) & ((entries & file) == 0)
        return not bool(np.any(written | ((entries & swapped) != 0)))

    def link(self, path: Path) -> bool:
        """Gives the file the name ``path`` (same filesystem; nothing is copied): True, or
        False where it cannot be (no O_TMPFILE: the file was unlinked by name)."""
        try:  # a directory fd makes CPython call linkat(AT_SYMLINK_FOLLOW), not link()
            folder = os.open(Path(path).parent, os.O_RDONLY)
            try:
                os.link(f"/proc/self/fd/{self.fd}", path, src_dir_fd=folder,
                        follow_symlinks=True)
            finally:
                os.close(folder)
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Closes the file; the map goes with the last tensor viewing it (each holds a
        reference to it). Never ``mmap.close``: torch's views hold no buffer export, so
        the map would be unmapped under them."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._map = None


#: Exponent bits of each floating dtype, as an unsigned integer of its width: a value is
#: NaN or Inf exactly when all of them are set.
_EXPONENT = {torch.float16: (np.uint16, 0x7C00), torch.bfloat16: (np.uint16, 0x7F80),
             torch.float32: (np.uint32, 0x7F800000),
             torch.float64: (np.uint64, 0x7FF0000000000000)}


class FiniteScan:
    """Finds the floating tensors of a payload that hold NaN or Inf as its chunks arrive,
    in order, a chunk at a time (on a worker thread: numpy releases the GIL), so that the
    body need not be read again once complete. A chunk may end inside a value: its bytes
    wait for the next chunk. ``bad`` names the tensors as ``payload.nonfinite_tensors``
    does (section/tensor)."""

    def __init__(self, manifest: pb.PayloadManifest):
        self.spans: list[tuple[int, int, np.dtype, int, str]] = []  # start, end, uint, mask, name
        offset = 0
        for meta in manifest.sections:
            layout = section_layout(meta)
            label = Kind(meta.kind).label
            for name, dtype, count in zip(layout.names, layout.dtypes, layout.counts,
                                          strict=True):
                size = count * dtype.itemsize
                if dtype in _EXPONENT and size:
                    uint, mask = _EXPONENT[dtype]
                    self.spans.append((offset, offset + size, uint, mask,
                                       f"{label}:{meta.name}/{name}" if meta.name
                                       else f"{label}/{name}"))
                offset += size
        self.bad: list[str] = []
        # One compiled loop per chunk instead of three NumPy passes, for a large payload
        # (``kernels``): the same verdicts.
        self._loops = compiled(offset // 4)
        self._next = 0  # the first span not yet wholly scanned
        self._carry = b""  # the bytes of a value cut by the last chunk's end

    def feed(self, offset: int, chunk) -> None:
        """Scans the chunk at ``offset`` (chunks in order, each once)."""
        end = offset + len(chunk)
        data = memoryview(chunk).cast("B")
        while self._next < len(self.spans):
            start, stop, uint, mask, name = self.spans[self._next]
            if start >= end:
                return
            lo, hi = max(start, offset), min(stop, end)
            part = bytes(self._carry) + data[lo - offset : hi - offset] if self._carry \
                else data[lo - offset : hi - offset]
            width = np.dtype(uint).itemsize
            whole = len(part) - len(part) % width
            if whole and name not in self.bad:
                values = np.frombuffer(part[:whole], dtype=uint)
                if (self._loops.any_exponent_full(values, uint(mask)) if self._loops
                        else np.any(np.bitwise_and(values, uint(mask)) == uint(mask))):
                    self.bad.append(name)
            self._carry = bytes(part[whole:])
            if hi < stop:
                return  # the span goes on in the next chunk
            self._next += 1
            self._carry = b""


class PayloadAssembler:
    """Receives one payload chunk by chunk, refusing anything off the declared layout."""

    def __init__(self, manifest: pb.PayloadManifest, max_bytes: int, max_chunk_bytes: int,
                 pool: BufferPool | None = None, sizes: list[int] | None = None,
                 checksum: bool = True, spool: Path | None = None):
        """``sizes``: each section's byte length, when the caller has already checked the
        manifest's shapes against a schema (walking a large manifest again costs ~1 ms).
        ``checksum=False`` skips the CRC-32: for uploads, checked by their body MAC.
        ``spool``: the bytes go to an unlinked file in that folder (``Spool``) instead of
        a buffer in memory (``pool``'s, or a new one)."""
        seen_sections = set()
        for section in manifest.sections:
            if section.kind not in Kind._value2member_map_:
                raise WireError(f"section {section.name!r}: unknown kind {section.kind}")
            if (section.kind, section.name) in seen_sections:
                raise WireError(f"section {Kind(section.kind).label}:{section.name!r} appears twice")
            seen_sections.add((section.kind, section.name))
        # Sizing validates each section's tensor entries (unique names, known dtypes).
        self.sizes = section_sizes(manifest) if sizes is None else sizes
        declared = sum(self.sizes)
        if declared != manifest.total_bytes:
            raise WireError(
                f"manifest total_bytes {manifest.total_bytes} != {declared} implied by shapes"
            )
        if declared > max_bytes:
            raise WireError(f"payload of {declared} bytes exceeds the cap of {max_bytes}")
        self.manifest = manifest
        self.max_chunk_bytes = max_chunk_bytes
        self.buffer: bytearray | Spool
        if spool is not None:
            self.buffer = Spool(spool, declared)
            self._bytes = None
        else:
            self.buffer = pool.take(declared) if pool is not None else bytearray(declared)
            self._bytes = np.frombuffer(self.buffer, dtype=np.uint8)
        self.received = 0  # bytes booked by ``reserve``
        self.written = 0  # bytes copied in by ``write``
        self.checksum = checksum
        self.crc = 0
        self._section = 0
        self._section_end = self.sizes[0] if self.sizes else 0
        self._skip_empty_sections()

    def _skip_empty_sections(self) -> None:
        while self._section < len(self.sizes) and self.received == self._section_end:
            self._section += 1
            if self._section < len(self.sizes):
                self._section_end += self.sizes[self._section]

    def current_kind(self) -> Kind:
        if self._section >= len(self.sizes):
            raise WireError("data chunk after the declared payload ended")
        return Kind(self.manifest.sections[self._section].kind)

    def add(self, chunk: bytes) -> Kind:
        """Append one chunk; returns the kind of the section it belongs to."""
        kind, offset = self.reserve(chunk)
        self.write(offset, chunk)
        return kind

    def section_left(self) -> int:
        """Bytes still to come in the current section (0 once complete): the largest the
        next chunk can be, since chunks never span two sections."""
        return self._section_end - self.received if self._section < len(self.sizes) else 0

    def reserve(self, chunk: bytes) -> tuple[Kind, int]:
        """Checks one chunk against the declared layout and books its place: returns the
        kind of its section and its offset. Its bytes go in with ``write``."""
        kind = self.current_kind()
        if len(chunk) == 0:
            raise WireError("empty data chunk")
        if len(chunk) > self.max_chunk_bytes:
            raise WireError(f"chunk of {len(chunk)} bytes exceeds {self.max_chunk_bytes}")
        end = self.received + len(chunk)
        if end > self._section_end:
            raise WireError(
                f"chunk crosses the end of section {self._section} "
                f"({self.manifest.sections[self._section].name!r})"
            )
        offset = self.received
        self.received = end
        self._skip_empty_sections()
        return kind, offset

    def write(self, offset: int, chunk: bytes) -> None:
        """Copies a reserved chunk into place and folds it into the CRC-32, in the order
        the chunks were reserved. The copy (numpy's) and the CRC (zlib-ng's) release the
        GIL, so a server runs this on a worker thread while its event loop goes on."""
        if offset != self.written:
            raise WireError(f"chunk written at {offset}, expected {self.written}")
        end = offset + len(chunk)
        if self._bytes is None:
            self.buffer.write(offset, chunk)
        else:
            self._bytes[offset:end] = np.frombuffer(chunk, dtype=np.uint8)
        if self.checksum:
            self.crc = crc32(chunk, self.crc)
        self.written = end

    @property
    def complete(self) -> bool:
        """Every declared byte has been reserved."""
        return self.received == len(self.buffer)

    def finish(self) -> Payload:
        if not self.complete or self.written != len(self.buffer):
            raise WireError(f"payload truncated: {self.written} of {len(self.buffer)} bytes")
        if self.checksum and self.crc != self.manifest.crc32:
            raise WireError(f"payload CRC-32 mismatch ({self.crc:#010x} != {self.manifest.crc32:#010x})")
        data = self.buffer.mapped() if isinstance(self.buffer, Spool) else self.buffer
        return decode(self.manifest, data)

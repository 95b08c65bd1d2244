"""The upload the edge has not yet seen accepted, on disk (``STATE_DIR/upload.pending``),
so that a restarted edge process resumes it instead of training again: the server holds a
cut upload, and keeps its task, for ``transfer_resume_expiry`` seconds (see
docs/architecture.md, "Resumable uploads").

What is kept is the result's header as the server must see it again (round, phase, task
id and nonce, weight, evaluation, metrics, manifest; never a session, IV or signature:
those are the next session's), the encoded body's bytes exactly as they travel, and the
codecs its sections travel under (for the byte accounting), and the body's CRC-32: a body
the disk damaged is refused here, not signed and sent as this edge's result. Written atomically (temp file
+ fsync + rename, mode 0600) before the upload leaves; once the server answered it or no
longer holds it, moved aside (``upload.pending.spare``) for the next upload to overwrite
in place. The upload waits for that write: for a ResNet-18 upload it took 58 ms a round
into a fresh file, 47 ms over the old one's blocks (``bench/edge_files.py``; the process's
own CPU was not lower, 26 against 35 ms: the kernel's writeback allocates a fresh file's
blocks). The bytes are what the server sees anyway, never private state.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import DecodeError

from fedattn_shared.schema import Kind
from fedattn_shared.state import StateError, atomic_write
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.serialize import EncodedPayload, crc32, section_sizes

PENDING_FILE = "upload.pending"
SPARE_FILE = "upload.pending.spare"  # the last answered upload's file, overwritten next
MAGIC = b"fedattn-pending-upload/2\n"
_LENGTH = struct.Struct("<I")


@dataclass
class PendingUpload:
    """A result not yet accepted: its header (unsigned), encoded body and codecs."""

    header: pb.SubmitHeader
    encoded: EncodedPayload
    coded: dict[str, tuple[str, int]]


def pending_path(state_dir: Path) -> Path:
    """Where an edge keeps its pending upload."""
    return Path(state_dir) / PENDING_FILE


def spare_path(path: Path) -> Path:
    """Where the file of an answered upload waits for the next one (beside ``path``)."""
    return path.with_name(SPARE_FILE)


def save_pending(path: Path, pending: PendingUpload) -> None:
    """Writes ``pending`` atomically (the body straight from tensor memory)."""
    head = pending.header.SerializeToString(deterministic=True)
    coded = json.dumps({k: list(v) for k, v in pending.coded.items()}).encode()
    crc = 0
    for views in pending.encoded.section_views:
        for view in views:
            crc = crc32(view, crc)
    parts: list = [MAGIC, _LENGTH.pack(len(head)), head, _LENGTH.pack(len(coded)), coded,
                   _LENGTH.pack(crc)]
    for views in pending.encoded.section_views:
        parts.extend(views)
    atomic_write(path, parts, recycle=spare_path(path))


def load_pending(path: Path) -> PendingUpload | None:
    """The pending upload at ``path``; None when there is none. ``StateError`` for a file
    that is not one (the caller lets it go)."""
    try:
        raw = memoryview(path.read_bytes())
    except FileNotFoundError:
        return None
    try:
        if bytes(raw[: len(MAGIC)]) != MAGIC:
            raise ValueError("not a pending upload")
        pos = len(MAGIC)
        (size,) = _LENGTH.unpack_from(raw, pos)
        header = pb.SubmitHeader.FromString(bytes(raw[pos + 4 : pos + 4 + size]))
        pos += 4 + size
        (size,) = _LENGTH.unpack_from(raw, pos)
        coded = {k: (v[0], int(v[1])) for k, v in
                 json.loads(bytes(raw[pos + 4 : pos + 4 + size])).items()}
        pos += 4 + size
        (crc,) = _LENGTH.unpack_from(raw, pos)
        pos += 4
        sizes = section_sizes(header.payload)
        if pos + sum(sizes) != len(raw) or sum(sizes) != header.payload.total_bytes:
            raise ValueError(f"{len(raw) - pos} body bytes, the manifest declares {sum(sizes)}")
        if crc32(raw[pos:]) != crc:
            raise ValueError("the body does not match its CRC-32 (damaged on disk)")
        views = []
        for size in sizes:
            views.append([raw[pos : pos + size]])
            pos += size
        kinds = [Kind(section.kind) for section in header.payload.sections]
    except (ValueError, struct.error, KeyError, IndexError, TypeError, DecodeError) as err:
        raise StateError(f"{path}: {err}") from None
    return PendingUpload(header, EncodedPayload(header.payload, kinds, views), coded)


def clear_pending(path: Path) -> None:
    """Forgets the pending upload (answered, or no longer held by the server): its file
    becomes the spare the next ``save_pending`` overwrites."""
    try:
        os.replace(path, spare_path(path))
    except FileNotFoundError:
        pass


__all__ = ["PENDING_FILE", "SPARE_FILE", "PendingUpload", "clear_pending", "load_pending",
           "pending_path", "save_pending", "spare_path"]

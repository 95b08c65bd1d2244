"""A task download kept on disk as it arrives (``STATE_DIR/download.partial``), so that an
edge process restarted in the middle of it (a reboot, a supervisor's restart, a kill)
goes on from the chunks it held, as a broken upload does from ``upload.pending``: the
server keeps the task of an edge that went mid-download for ``transfer_resume_expiry``
seconds after its last byte (docs/architecture.md, "Task downloads").

Only a download that spans more than one window (``--download-window``, 4 MiB by default:
MobileNetV3-Small, ResNet-18) is kept: one that fits a single call is over before a
restart could cost much, and writing every model the edge receives would cost a Jetson's
flash one more write of the model per round. Each chunk is appended as it arrives, with
no fsync: the file is a cache, and a chunk the page cache lost is fetched again. A record
is one ``writev`` of its prefix and the chunk's own buffer, its CRC-32 zlib-ng's (the same
values as zlib's): the record joined into a new 1 MiB buffer and zlib's CRC-32 cost an
edge ~115 ms of CPU per ResNet-18 download, the same file written this way ~25 ms.

Format: ``MAGIC``, then records (u32 length, u32 CRC-32, the bytes): the task header, the
cached common id the download was asked with, then the chunks in order. A record cut short
or failing its CRC ends the file there (a kill in the middle of a write). Whatever is
loaded goes through the session's receivers (its downlink cap) and each chunk through
``PayloadAssembler.add`` (the declared layout), and the whole payload through its digest
and signature checks at the end, as a download from the network does. The file is
removed once the download is whole, given up, or replaced by another task's.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

from google.protobuf.message import DecodeError

from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.serialize import crc32
from fedattn_shared.wire.transport import PayloadAssembler

log = logging.getLogger("fl_edge")

PARTIAL_FILE = "download.partial"
MAGIC = b"fedattn-partial-download/1\n"
_RECORD = struct.Struct("<II")  # length, CRC-32

#: A partial download, as the transport continues it: the header, the receivers holding
#: the chunks so far, and the cached common id it was asked with.
Partial = tuple[pb.TaskHeader, list[PayloadAssembler], str]


class DownloadSpool:
    """The one partial download of an edge's state dir (see the module docstring)."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / PARTIAL_FILE
        self.file = None  # open for appending while a kept download runs

    def begin(self, header: pb.TaskHeader, cached: str, window: int) -> None:
        """A new task download: kept from here when it spans more than ``window`` data
        bytes; whatever an earlier one left goes either way."""
        self.forget()
        size = (0 if header.common_cached else header.common.total_bytes) + \
            header.personal.total_bytes
        if size <= window:
            return
        try:
            self.file = open(self.path, "wb", buffering=0)  # noqa: SIM115 (held open)
            self.path.chmod(0o600)
            self.file.write(MAGIC)
            self._record(header.SerializeToString(deterministic=True))
            self._record(cached.encode())
        except OSError as err:
            log.warning("the task download is not kept on disk (%s): a restart fetches it "
                        "again from byte 0", err)
            self.forget()

    def took(self, chunk) -> None:
        """One more chunk went into the receivers: appended when the download is kept."""
        if self.file is None:
            return
        try:
            self._record(chunk)
        except OSError as err:
            log.warning("the task download is no longer kept on disk (%s)", err)
            self.forget()

    def _record(self, data) -> None:
        # One write per record: a kill leaves it whole or cut short, never interleaved.
        view = memoryview(data).cast("B")
        prefix = _RECORD.pack(len(view), crc32(view))
        fd, total = self.file.fileno(), len(prefix) + len(view)
        written = os.writev(fd, [prefix, view])
        while written < total:  # a short write: the rest, in order
            if written < len(prefix):
                written += os.writev(fd, [prefix[written:], view])
            else:
                written += os.write(fd, view[written - len(prefix):])

    def forget(self) -> None:
        """The download is whole, given up or replaced: the file goes."""
        if self.file is not None:
            self.file.close()
            self.file = None
        self.path.unlink(missing_ok=True)

    def load(self, receivers: Callable[[pb.TaskHeader], list[PayloadAssembler]]
             ) -> Partial | None:
        """What an earlier process of this edge kept, in fresh receivers; the file stays
        open for the rest of the download's chunks. None (the file gone) when there is
        nothing usable: no file, another format, a header the receivers refuse, chunks off
        its layout."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            log.warning("the kept task download cannot be read (%s): fetched again", err)
            self.forget()
            return None
        records, end = _records(data)
        try:
            if len(records) < 2:
                raise WireError("no task header")
            header = pb.TaskHeader.FromString(records[0])
            cached = records[1].decode()
            assemblers = receivers(header)
            for chunk in records[2:]:
                target = next((a for a in assemblers if not a.complete), None)
                if target is None:
                    raise WireError("data past the payload")
                target.add(chunk)
        except (WireError, DecodeError, UnicodeDecodeError, ValueError) as err:
            log.warning("the kept task download is let go: %s", err)
            self.forget()
            return None
        try:  # the rest goes on after the last whole record
            self.file = open(self.path, "r+b", buffering=0)  # noqa: SIM115 (held open)
            self.file.truncate(end)
            self.file.seek(end)
        except OSError as err:
            log.warning("the kept task download cannot be continued on disk (%s)", err)
            self.file = None
        return header, assemblers, cached


def _records(data: bytes) -> tuple[list[bytes], int]:
    """The whole, CRC-valid records after ``MAGIC``, and where the last one ends."""
    if not data.startswith(MAGIC):
        return [], 0
    records, position = [], len(MAGIC)
    while position + _RECORD.size <= len(data):
        length, crc = _RECORD.unpack_from(data, position)
        start = position + _RECORD.size
        if start + length > len(data) or crc32(data[start:start + length]) != crc:
            break
        records.append(data[start:start + length])
        position = start + length
    return records, position


__all__ = ["PARTIAL_FILE", "DownloadSpool", "Partial"]

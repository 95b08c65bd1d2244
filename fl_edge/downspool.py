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
values as zlib's). A download that is whole, given up or replaced leaves its file as the
next one's (``SPARE_FILE``), overwritten in place: a fresh file per download, each record
joined into a new 1 MiB buffer and zlib's CRC-32 cost an edge 37-115 ms of CPU per
ResNet-18 download, this 10-12 ms (``bench/edge_files.py``).

Format: ``MAGIC``, then records (u32 length, u32 CRC-32, the bytes): the task header, the
cached common id the download was asked with, then the chunks in order. Each record's
CRC-32 goes on from the one before it (the first from 0), so the records an earlier
download left beyond the new ones, in the same recycled file, end what is loaded like a
damaged record: they continue another chain. A record cut short or failing its CRC ends
the file there (a kill in the middle of a write). The spare's ``MAGIC`` is zeroed before
it is set aside and written last when it is taken again, after the new header's records:
a kill in between leaves a file that is not a partial download, never the old one.
Whatever is loaded goes through the session's receivers (its downlink cap) and each chunk
through ``PayloadAssembler.add`` (the declared layout), and the whole payload through its
digest and signature checks at the end, as a download from the network does. The file is
set aside once the download is whole, given up, or replaced by another task's.
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
SPARE_FILE = "download.partial.spare"  # the last download's file, overwritten next
MAGIC = b"fedattn-partial-download/2\n"
_RECORD = struct.Struct("<II")  # length, CRC-32

#: A partial download, as the transport continues it: the header, the receivers holding
#: the chunks so far, and the cached common id it was asked with.
Partial = tuple[pb.TaskHeader, list[PayloadAssembler], str]


class DownloadSpool:
    """The one partial download of an edge's state dir (see the module docstring)."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / PARTIAL_FILE
        self.spare = Path(state_dir) / SPARE_FILE
        self.file = None  # open for appending while a kept download runs
        self.crc = 0  # the chain's last CRC-32: the next record's starts from it

    def begin(self, header: pb.TaskHeader, cached: str, window: int) -> None:
        """A new task download: kept from here when it spans more than ``window`` data
        bytes; whatever an earlier one left goes either way."""
        self.forget()
        size = (0 if header.common_cached else header.common.total_bytes) + \
            header.personal.total_bytes
        if size <= window:
            return
        try:
            try:  # the last download's file, its MAGIC zeroed (``forget``)
                os.replace(self.spare, self.path)
            except FileNotFoundError:
                pass
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            self.file = open(fd, "r+b", buffering=0)  # noqa: SIM115 (held open)
            self.file.seek(len(MAGIC))
            self.crc = 0
            self._record(header.SerializeToString(deterministic=True))
            self._record(cached.encode())
            os.pwrite(fd, MAGIC, 0)  # last: until here, not a partial download
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
        crc = crc32(view, self.crc)
        prefix = _RECORD.pack(len(view), crc)
        fd, total = self.file.fileno(), len(prefix) + len(view)
        written = os.writev(fd, [prefix, view])
        while written < total:  # a short write: the rest, in order
            if written < len(prefix):
                written += os.writev(fd, [prefix[written:], view])
            else:
                written += os.write(fd, view[written - len(prefix):])
        self.crc = crc

    def forget(self) -> None:
        """The download is whole, given up or replaced: the file, its MAGIC zeroed, is
        set aside for the next one (removed when that cannot be done)."""
        if self.file is not None:
            self.file.close()
            self.file = None
        try:
            fd = os.open(self.path, os.O_WRONLY)
        except FileNotFoundError:
            return
        except OSError:
            self.path.unlink(missing_ok=True)
            return
        try:
            try:
                os.pwrite(fd, bytes(len(MAGIC)), 0)
            finally:
                os.close(fd)
            os.replace(self.path, self.spare)
        except OSError:
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
        records, end, crc = _records(data)
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
            self.crc = crc
        except OSError as err:
            log.warning("the kept task download cannot be continued on disk (%s)", err)
            self.file = None
        return header, assemblers, cached


def _records(data: bytes) -> tuple[list[bytes], int, int]:
    """The whole records after ``MAGIC`` whose CRC-32s continue the chain, where the last
    one ends, and its CRC-32 (the next record's start)."""
    if not data.startswith(MAGIC):
        return [], 0, 0
    records, position, chain = [], len(MAGIC), 0
    while position + _RECORD.size <= len(data):
        length, crc = _RECORD.unpack_from(data, position)
        start = position + _RECORD.size
        if start + length > len(data) or crc32(data[start:start + length], chain) != crc:
            break
        records.append(data[start:start + length])
        position, chain = start + length, crc
    return records, position, chain


__all__ = ["PARTIAL_FILE", "SPARE_FILE", "DownloadSpool", "Partial"]

"""Uploads a collect-then-learn aggregator keeps, on disk instead of in RAM.

``CollectThenLearn`` must hold every upload of a round until it closes (a median needs
all of them at once). Held as clones, the server's memory grows by one model per
uploader: 64 ResNet-18 uploads are 2.9 GB. With a spill, each upload is written to one
safetensors file in ``<checkpoint dir>/uploads`` and read back as tensors over a
private (copy-on-write) memory map of that file: its pages are the page cache's, which
the kernel can drop and re-read, not the process's heap. The bytes are the very bytes
received, so whatever ``learn`` computes is bit for bit what it computed from clones.

Files are removed when their round closes or aborts (``begin_round`` clears the round),
and those left by a server that crashed are removed when the next one starts. The disk
they may take is bounded (``server.max_spill_bytes``): an upload beyond it is refused by
name, and costs its edge the task, never the server its state.

A streaming mean needs no upload at once, only their sum; spilled (``write_raw``), it
keeps no model-sized float64 sum through the round either: each upload's sections go to
a raw file (their bytes, in the round's layout), and the close sums them a slice of
coordinates at a time, read with ``pread`` into one reused buffer (``read_into``), so
the page cache holds the uploads, never the heap.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from pathlib import Path

import torch

from ..schema import Kind, Payload, Section
from ..state import save_tensors

SUFFIX = ".safetensors"
RAW_SUFFIX = ".raw"  # a streaming mean's upload: its sections' bytes, nothing else
META_KEY = "fedattn.sections"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def default_spill_bytes(directory: Path) -> int:
    """Half of the free space of the filesystem that holds ``directory`` (or its nearest
    existing parent): what a server takes when no bound is configured."""
    path = directory
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free // 2


class UploadSpill:
    """One round's uploads as memory-mapped safetensors files in ``directory``, at most
    ``max_bytes`` of them on disk at once. Not thread-safe: the aggregator calls it under
    its lock."""

    def __init__(self, directory: Path, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"server.max_spill_bytes must be >= 1, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.files: dict[str, tuple[Path, int]] = {}  # edge id -> (file, bytes)
        # The file the upload being accepted arrived in (``transport.Spool``), offered by
        # the server for the time of one ``accept``: ``write_raw`` links it instead of
        # writing the same bytes again when the views are that file's unchanged bytes.
        self.offered = None
        # (address, length, map, file) of every file ``load`` mapped this round
        self.maps: list[tuple[int, int, mmap.mmap, Path]] = []
        self.directory.mkdir(parents=True, exist_ok=True)
        for suffix in (SUFFIX, RAW_SUFFIX):  # a crashed server's round
            for stale in self.directory.glob(f"*{suffix}"):
                stale.unlink(missing_ok=True)

    @property
    def used(self) -> int:
        """Bytes the round's files take on disk."""
        return sum(size for _, size in self.files.values())

    def keep(self, round_number: int, edge_id: str, upload: Payload) -> Payload:
        """Writes ``upload`` to disk and returns it read back over a memory map; raises
        ValueError naming ``server.max_spill_bytes`` when the round's files would exceed
        it (nothing is written then). ``edge_id`` is a checked id (letters, digits, . _ -),
        so it is a safe file name."""
        size = sum(s.raw_bytes for s in upload.sections)
        self._check_bound(edge_id, edge_id, size)
        tensors, layout = {}, []
        for index, section in enumerate(upload.sections):
            layout.append([int(section.kind), section.name, list(section.tensors)])
            for name, tensor in section.tensors.items():
                tensors[f"{index}:{name}"] = tensor
        path = self.directory / f"r{round_number:06d}-{edge_id}{SUFFIX}"
        # Not fsync'd: a crash loses the round anyway, and its files are removed at start.
        try:
            save_tensors(path, tensors, {META_KEY: json.dumps(layout)}, durable=False)
        except OSError as err:  # a full disk costs this upload, never the server
            raise ValueError(f"edge {edge_id}: its upload could not be kept on disk in "
                             f"{self.directory} (server.spill_uploads): {err}") from None
        self.files[edge_id] = (path, size)
        return self.load(path)

    def _check_bound(self, key: str, edge_id: str, size: int) -> None:
        """Raises ValueError naming ``server.max_spill_bytes`` when a file of ``size``
        bytes under ``key`` (replacing the one there) would take the round beyond it."""
        previous = self.files.get(key, (None, 0))[1]
        if self.used - previous + size > self.max_bytes:
            raise ValueError(
                f"edge {edge_id}: keeping its upload of {size} bytes on disk would take the "
                f"round's spilled uploads to {self.used - previous + size} bytes, beyond "
                f"server.max_spill_bytes={self.max_bytes}")

    def write_raw(self, round_number: int, key: str, edge_id: str,
                  views: list[memoryview]) -> Path:
        """Writes ``views`` back to back into the round's file ``key`` (letters, digits,
        . _ -) and returns its path; nothing is mapped. Raises ValueError naming
        ``server.max_spill_bytes`` or ``server.spill_uploads`` (nothing is left then)."""
        size = sum(view.nbytes for view in views)
        self._check_bound(key, edge_id, size)
        path = self.directory / f"r{round_number:06d}-{key}{RAW_SUFFIX}"
        source = self.offered
        if source is not None and source.holds(views) and source.link(path):
            self.files[key] = (path, size)  # the received file itself: nothing copied
            return path
        try:  # not fsync'd, as ``keep``: a crash loses the round anyway
            with open(path, "wb", buffering=0) as f:
                for view in views:
                    done = 0
                    while done < view.nbytes:
                        done += f.write(view[done:])
        except OSError as err:
            path.unlink(missing_ok=True)
            raise ValueError(f"edge {edge_id}: its upload could not be kept on disk in "
                             f"{self.directory} (server.spill_uploads): {err}") from None
        self.files[key] = (path, size)
        return path

    @staticmethod
    def read_into(fd: int, offset: int, buffer: memoryview) -> None:
        """Fills ``buffer`` from the open file ``fd`` at ``offset`` (a short file is an
        OSError: the round cannot close, and is undone)."""
        done = 0
        while done < buffer.nbytes:
            got = os.preadv(fd, [buffer[done:]], offset + done)
            if got == 0:
                raise OSError(f"a spilled upload ended {buffer.nbytes - done} bytes early")
            done += got

    def load(self, path: Path) -> Payload:
        """The payload of a spilled file, its tensors views of a private memory map (a
        write into one changes the process's copy of that page, never the file)."""
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) \
                if os.fstat(f.fileno()).st_size else None
        if mapped is None:
            raise ValueError(f"{path}: empty spill file")
        self.maps.append((torch.frombuffer(mapped, dtype=torch.uint8).data_ptr(), len(mapped),
                          mapped, path))
        length = int.from_bytes(mapped[:8], "little")
        header = json.loads(mapped[8 : 8 + length])
        start = 8 + length
        layout = json.loads(header.pop("__metadata__")[META_KEY])
        # Reading the header mapped the page-cache folio around it (2 MiB here, a large
        # folio): per upload, that would stay in RSS through the round. Nothing was
        # written into the map, so its pages can go; ``learn`` maps what it reads.
        mapped.madvise(mmap.MADV_DONTNEED, 0, len(mapped))
        sections = []
        for index, (kind, name, names) in enumerate(layout):
            tensors = {}
            for tensor_name in names:
                entry = header[f"{index}:{tensor_name}"]
                dtype = _DTYPES[entry["dtype"]]
                begin, end = entry["data_offsets"]
                shape = tuple(entry["shape"])
                if end > begin:
                    flat = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin,
                                            offset=start + begin)
                    tensors[tensor_name] = flat.view(dtype).view(shape)
                else:
                    tensors[tensor_name] = torch.empty(shape, dtype=dtype)
            sections.append(Section(Kind(kind), name, tensors))
        return Payload(sections)

    def evict(self, tensor: torch.Tensor) -> None:
        """Gives back the pages of a mapped tensor that were read: a page of a file map
        counts in the process's RSS once touched, so a ``learn`` that reads every upload
        would otherwise end holding all of them. The pages stay in the page cache (the
        kernel's to drop) and a later read maps them again. Only for tensors nothing
        wrote into (a written page of a private map would be lost)."""
        address, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for base, length, mapped, _ in self.maps:
            if base <= address < base + length:
                start = (address - base) // mmap.PAGESIZE * mmap.PAGESIZE
                end = min(length, address - base + size)
                if end > start:
                    mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
                return

    def read(self, tensor: torch.Tensor, out: torch.Tensor) -> bool:
        """Copies ``tensor``, a contiguous view of a mapped spilled file, into ``out`` (as
        many bytes, contiguous) with a read of the file instead of through the map: a
        page read through a map counts in the process's RSS, and the kernel maps the
        whole page-cache folio around it (up to 2 MiB), so a ``learn`` reading a slice of
        64 uploads at a time held 64 folios; read, the pages stay the page cache's. One
        descriptor at a time, whatever the number of uploads. False (nothing copied) for
        a tensor no spilled file holds."""
        address, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if not tensor.is_contiguous() or out.numel() * out.element_size() != size:
            return False
        for base, length, _, path in self.maps:
            if base <= address < base + length:
                fd = os.open(path, os.O_RDONLY)
                try:
                    self.read_into(fd, address - base,
                                   memoryview(out.view(torch.uint8).numpy()).cast("B"))
                finally:
                    os.close(fd)
                return True
        return False

    def clear(self) -> None:
        """Removes the round's files (its close or abort). Mapped tensors still referenced
        stay readable: an unlinked file lives until its last map goes."""
        for path, _ in self.files.values():
            path.unlink(missing_ok=True)
        self.files, self.maps = {}, []


__all__ = ["UploadSpill", "default_spill_bytes"]

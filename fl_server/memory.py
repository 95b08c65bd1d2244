"""What uploads and downloads may make the server hold: ``server.max_upload_memory``,
``server.max_download_memory`` and the spill.

Two things grow with the number of edges uploading at once. fedattn's own receive
buffers (one upload's bytes each) are bounded by the upload slots; here the slots come
from the memory budget, so ``max_concurrent_uploads`` is a ceiling, not a promise. And
grpcio's stream buffers: an upload stream waiting for a slot keeps receiving until its
HTTP/2 flow-control window is full, and grpc's BDP probe grows that window towards the
link's bandwidth-delay product (megabytes per stream on loopback), so each waiting
uploader parked megabytes in the server. Here the probe is off and every stream's
window is a fixed share of what the budget leaves after the receive buffers, spread
over every call the registered edges may have open (``CALLS_PER_EDGE`` x ``max_edges``,
which is also grpc core's backlog of calls not yet picked up, where an upload's data
waits too): the total cannot exceed the budget however many edges upload at once.

A task download holds the message it is sending in gRPC until the edge takes it: with
thousands of edges downloading at once (an evaluation opens for all of them), or edges
that stop reading, that is a message each. ``download_room`` is what they may hold
together (``streams.DownloadRoom``): a hard bound, or by default a shared room plus a
small reserve per downloading edge, the chunks cut to a fair share of it.

A collect-then-learn aggregator keeps every upload of a round; ``attach_spill`` puts
them on disk (``fedattn_shared.methods.spill``) when ``server.spill_uploads`` is on. A
streaming mean keeps a float64 sum and its compensation (4 float32 models); with
``server.spill_sums`` its uploads go to disk too, summed a slice at a time at the close.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from fedattn_shared.config import ServerConfig
from fedattn_shared.methods.aggregators import (
    Aggregator,
    CollectThenLearn,
    StreamingMean,
    flatten_sections,
)
from fedattn_shared.methods.spill import UploadSpill, default_spill_bytes
from fedattn_shared.wire.transport import CALLS_PER_EDGE

from .streams import PIECE_RESERVE, DownloadRoom

log = logging.getLogger("fl_server")

# The default budget: this share of the memory available when the server starts.
DEFAULT_SHARE = 4
# Downloads, by default: the room they share in gRPC (a fair share of it is a whole 1 MiB
# chunk for up to 16 downloads at once; at 64, 256 KiB pieces: ResNet-18's 64 downloads
# at a phase's open held 1.5 models of frames in 1 MiB chunks); each downloading edge
# also has ``streams.PIECE_RESERVE`` of its own.
DOWNLOAD_SHARED = 32 << 20
# A stream's window: grpc's own default lookahead (64 KiB) at least, so a budget spread
# over many edges never stalls the link; 4 MiB at most (beyond, loopback gains nothing).
MIN_WINDOW = 64 << 10
MAX_WINDOW = 4 << 20
SPILL_DIR = "uploads"
# Whether malloc_trim exists: platform.libc_ver() scans the interpreter's binary, so once.
GLIBC = platform.libc_ver()[0] == "glibc"


def available_memory() -> int:
    """MemAvailable of /proc/meminfo (bytes), or physical memory where there is none;
    under a cgroup v2 memory limit (a container's), at most what the limit leaves."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available


@dataclass(frozen=True)
class UploadMemory:
    """The budget and what it gives: receive slots and each stream's gRPC window."""

    budget: int
    upload_bytes: int
    slots: int
    window: int

    def grpc_options(self) -> list[tuple[str, int]]:
        """Server channel arguments: BDP probing off, every stream's window fixed."""
        return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", self.window)]


def plan_upload_memory(cfg: ServerConfig, upload_bytes: int) -> UploadMemory:
    """Slots and windows from ``cfg.max_upload_memory`` (0: a quarter of the memory
    available now) for uploads of ``upload_bytes`` (one model's); raises ValueError
    naming the key when the budget cannot hold a single upload."""
    budget = cfg.max_upload_memory or available_memory() // DEFAULT_SHARE
    upload_bytes = max(upload_bytes, 1)
    if budget < upload_bytes:
        raise ValueError(f"server.max_upload_memory={budget} bytes cannot hold one upload "
                         f"of this model ({upload_bytes} bytes)")
    slots = min(cfg.max_concurrent_uploads, budget // upload_bytes)
    window = (budget - slots * upload_bytes) // (CALLS_PER_EDGE * cfg.max_edges)
    window = max(MIN_WINDOW, min(MAX_WINDOW, window))
    plan = UploadMemory(budget, upload_bytes, slots, window)
    log.info("upload memory: %d bytes (%s): %d upload slot(s) of %d bytes, %d-byte gRPC "
             "stream windows", budget, "server.max_upload_memory" if cfg.max_upload_memory
             else f"1/{DEFAULT_SHARE} of the memory available", slots, upload_bytes, window)
    return plan


def download_room(cfg: ServerConfig) -> DownloadRoom:
    """The room the task downloads under way share in gRPC (``streams.DownloadRoom``):
    ``cfg.max_download_memory`` as a hard bound in whole chunks, or by default
    ``DOWNLOAD_SHARED`` bytes shared plus ``PIECE_RESERVE`` of each downloading edge's
    own, the chunks cut to a fair share when many download at once."""
    if cfg.max_download_memory:
        log.info("download memory: at most %d bytes (server.max_download_memory)",
                 cfg.max_download_memory)
        return DownloadRoom(cfg.max_download_memory)
    log.info("download memory: %d bytes shared and %d per downloading edge, chunks cut to "
             "a fair share", DOWNLOAD_SHARED, PIECE_RESERVE)
    return DownloadRoom(DOWNLOAD_SHARED, PIECE_RESERVE)


def attach_spill(aggregator: Aggregator, cfg: ServerConfig) -> None:
    """Keeps a collect-then-learn aggregator's uploads (``server.spill_uploads``) or a
    streaming mean's (``server.spill_sums``; server optimizers included) on disk under the
    checkpoint dir, at most ``server.max_spill_bytes`` (0: half the free disk)."""
    if not ((cfg.spill_uploads and isinstance(aggregator, CollectThenLearn))
            or (cfg.spill_sums and isinstance(aggregator, StreamingMean))):
        return
    directory = Path(cfg.checkpoint_dir) / SPILL_DIR
    limit = cfg.max_spill_bytes or default_spill_bytes(directory)
    aggregator.spill = UploadSpill(directory, limit)
    log.info("uploads kept on disk in %s (at most %d bytes)", directory, limit)


def trim_heap() -> None:
    """Gives the free pages in the middle of glibc's heaps back to the kernel
    (``malloc_trim(0)``). The downloads' frames (1 MiB chunks, one built per send) and
    the upload chunks gRPC delivers are freed into the heap between live allocations,
    where glibc keeps them; trimmed when a phase closes, they stop adding to the next
    peak (the close and the next download). A few ms of CPU; nothing off glibc."""
    if GLIBC:
        ctypes.CDLL(None).malloc_trim(0)


def log_memory(stage: str, *args: object) -> None:
    """At DEBUG, the process's resident and peak memory (VmRSS, VmHWM) at a stage of a
    round: where a server's memory grows with its uploaders (bench/wire.py --breakdown
    reads these lines). One read of /proc/self/status, and only when DEBUG is on."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    fields = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        return
    log.debug("memory at %s: rss %d KiB, peak %d KiB", stage % args, fields.get("VmRSS", 0),
              fields.get("VmHWM", 0))


def global_bytes(aggregator: Aggregator) -> int:
    """Bytes of the global model state: what one upload of the model weighs."""
    return sum(t.numel() * t.element_size() for t in flatten_sections(aggregator.state).values())


__all__ = ["UploadMemory", "attach_spill", "available_memory", "download_room", "global_bytes",
           "log_memory", "plan_upload_memory", "trim_heap"]

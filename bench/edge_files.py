"""What an edge's per-round files cost: the kept upload (``upload.pending``) and the kept
task download (``download.partial``) of a ResNet-18-sized payload, as the edge writes them
now and as it wrote them before (measured in the same run, on the same disk).

- upload: ``save_pending`` into the last answered upload's file, in place, fsynced
  (``clear_pending`` sets it aside), against ``atomic_write`` into a fresh temp file,
  fsynced, the former answered file unlinked;
- download: ``DownloadSpool`` (one ``writev`` per record, zlib-ng's CRC-32, the last
  download's file written over in place), against the former writer (each record joined
  into a new buffer, zlib's CRC-32, a fresh file unlinked when whole).

Prints the median CPU (user + system, this process; the kernel's writeback threads are
not counted) and wall milliseconds per round of each, called in turn, and the ratio
now / before. Figures depend on the filesystem (ext4 here) and load.

    .venv/bin/python bench/edge_files.py [--mb 44.7] [--rounds 16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.state import atomic_write
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.serialize import crc32, encode
from fedattn_shared.wire.transport import chunk_views
from fl_edge.downspool import DownloadSpool
from fl_edge.pending import PendingUpload, clear_pending, pending_path, save_pending

CHUNK = 1 << 20


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(before: Callable[[], None], now: Callable[[], None], rounds: int
          ) -> list[tuple[float, float]]:
    """Median CPU and wall milliseconds per call of ``before`` and of ``now``, called in
    turn ``rounds`` times each (the disk's writeback falls on both alike), after one
    call of each (the first has no file to reuse)."""
    before()
    now()
    figures: list[tuple[list[float], list[float]]] = [([], []), ([], [])]
    for _ in range(rounds):
        for step, (cpus, walls) in zip((before, now), figures, strict=True):
            c, w = cpu(), time.perf_counter()
            step()
            walls.append(time.perf_counter() - w)
            cpus.append(cpu() - c)
    return [(statistics.median(c) * 1e3, statistics.median(w) * 1e3) for c, w in figures]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=44.7, help="payload size (ResNet-18: 44.7)")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--dir", type=Path, help="the state dir's filesystem (default: /tmp)")
    args = parser.parse_args()
    values = torch.randn(int(args.mb * 1e6) // 4, generator=torch.Generator().manual_seed(0))
    encoded = encode(Payload([Section(Kind.SHARED_TENSORS, "", {"w": values})]), checksum=False)
    header = pb.SubmitHeader(round=1, task_id=1, phase="train", task_nonce=b"n" * 16,
                             num_examples=5, payload=encoded.manifest)
    pending = PendingUpload(header, encoded, {})
    chunks = [b"".join(bytes(v) for v in views) for _, views in chunk_views(encoded, CHUNK)]
    task = pb.TaskHeader(status=pb.TaskHeader.TASK, task_id=1, common=encoded.manifest)
    record = struct.Struct("<II")

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        now_dir, before_dir = Path(tmp) / "now", Path(tmp) / "before"
        path, old_path = pending_path(now_dir), pending_path(before_dir)
        before_dir.mkdir(parents=True)

        def upload_now() -> None:
            save_pending(path, pending)
            clear_pending(path)

        def upload_before() -> None:
            # save_pending before the spare: its CRC-32 and parts, into a fresh temp file
            crc = 0
            for views in encoded.section_views:
                for view in views:
                    crc = crc32(view, crc)
            head = header.SerializeToString(deterministic=True)
            parts = [head, crc.to_bytes(4, "little")]
            parts += [v for views in encoded.section_views for v in views]
            atomic_write(old_path, parts)
            old_path.unlink()

        spool = DownloadSpool(now_dir)

        def download_now() -> None:
            spool.begin(task, "", CHUNK)
            for chunk in chunks:
                spool.took(chunk)
            spool.forget()

        partial = before_dir / "download.partial"

        def download_before() -> None:
            with open(partial, "wb", buffering=0) as file:
                for chunk in chunks:
                    file.write(record.pack(len(chunk), zlib.crc32(chunk)) + bytes(chunk))
            partial.unlink()

        print(f"the edge's per-round files, {args.mb:.1f} MB payload, {args.rounds} rounds, "
              f"in {tmp} (median per round; CPU is this process's user + system)")
        for name, now, before in (("upload.pending", upload_now, upload_before),
                                  ("download.partial", download_now, download_before)):
            (b_cpu, b_wall), (n_cpu, n_wall) = timed(before, now, args.rounds)
            print(f"  {name:17s} before {b_cpu:6.1f} ms CPU {b_wall:6.1f} ms wall | now "
                  f"{n_cpu:6.1f} ms CPU {n_wall:6.1f} ms wall | now / before: CPU "
                  f"{n_cpu / b_cpu:.2f}x, wall {n_wall / b_wall:.2f}x", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

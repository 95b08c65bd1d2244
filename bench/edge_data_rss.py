"""The edge's resident memory for its training data: uint8 kept and decoded per batch (what
fl-edge does) against decoded to float32 up front (what it did before, and what tools get).

Writes ``--images`` random uint8 RGB images of ``--size`` px as a ``data.npz`` (NHWC, the
layout cameras and ``fl-partition`` write) or an image-folder tree (``--format folder``, PNGs
in class folders) in a temporary directory, then loads it the edge's way in a fresh process
per mode (``fedattn_shared.data.load_edge_data``, with the seeded train/test split) and
prints the process's resident memory after loading (VmRSS: what stays while training) and
its peak (VmHWM), beside a bare interpreter with torch imported (the baseline, measured in
the same run). Nothing is asserted; the figures go to docs/benchmarks.md.

    .venv/bin/python bench/edge_data_rss.py --images 10000 --size 224 --modes uint8
    .venv/bin/python bench/edge_data_rss.py --images 2000 --size 224      # both modes
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHILD = """
import sys, torch
from fedattn_shared.config import TrainConfig
from fedattn_shared.data import load_edge_data

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return [int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")]

root, size, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "baseline":
    print(*status())
    raise SystemExit
data = load_edge_data(root, TrainConfig(image_size=size, in_channels=3), keep_uint8=mode == "uint8")
print(*status(), len(data.train), len(data.test), data.train.x.dtype)
"""


def write(root: Path, images: int, size: int, fmt: str) -> None:
    """Random images, written in chunks (the writer never holds more than 1,000)."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, images)
    if fmt == "npz":
        x = np.lib.format.open_memmap(root / "x.npy", mode="w+", dtype=np.uint8,
                                      shape=(images, size, size, 3))
        for start in range(0, images, 1000):
            end = min(start + 1000, images)
            x[start:end] = rng.integers(0, 256, (end - start, size, size, 3), dtype=np.uint8)
        x.flush()
        np.savez(root / "data.npz", x=x, y=y)
        del x
        (root / "x.npy").unlink()
        return
    from PIL import Image

    for i, label in enumerate(y):
        folder = root / str(label)
        folder.mkdir(exist_ok=True)
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.png", compress_level=0)


def measure(root: Path, size: int, mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), str(size), mode],
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=10000)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--format", choices=["npz", "folder"], default="npz")
    p.add_argument("--modes", nargs="+", choices=["uint8", "float32"], default=["uint8", "float32"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="edge-rss-") as tmp:
        root = Path(tmp)
        write(root, args.images, args.size, args.format)
        raw = args.images * args.size * args.size * 3
        print(f"{args.images} images {args.size}x{args.size}x3 uint8 ({raw / 2**30:.2f} GiB of "
              f"pixels) as {args.format}")
        base_rss, _ = (int(v) for v in measure(root, args.size, "baseline"))
        print(f"{'mode':<9} {'RSS after load':>15} {'peak RSS':>10} {'RSS - baseline':>15}")
        print(f"{'baseline':<9} {base_rss / 2**30:>13.2f} G {'':>10}")
        for mode in args.modes:
            rss, peak, *_ = measure(root, args.size, mode)
            rss, peak = int(rss), int(peak)
            print(f"{mode:<9} {rss / 2**30:>13.2f} G {peak / 2**30:>8.2f} G "
                  f"{(rss - base_rss) / 2**30:>13.2f} G")


if __name__ == "__main__":
    main()

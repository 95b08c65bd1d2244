"""IDX (MNIST-style) edge data, gzip'ed or not: the layout of MNIST and Fashion-MNIST.

Files: ``train-images-idx3-ubyte`` + ``train-labels-idx1-ubyte`` (train) and, optionally,
``t10k-images-idx3-ubyte`` + ``t10k-labels-idx1-ubyte`` (test; without them a seeded stratified
split makes the test set). Each may end in ``.gz``, and ``train-images.idx3-ubyte`` (a dot
before ``idx``, as some unpackers write it) is accepted too. Whether a file is gzip'ed is read
from its first bytes, not its name (browsers sometimes unpack a download but keep ``.gz``).

The header is parsed here: a big-endian magic (2051 for uint8 images of 3 dimensions, 2049 for
uint8 labels of 1), then one big-endian uint32 per dimension, then exactly that many bytes.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from ..config import TrainConfig
from .npz import DataError, Split, _to_images, check_labels

MAGIC_IMAGES = 2051
MAGIC_LABELS = 2049
_CHUNK = 1 << 24


def _names(prefix: str, kind: str, ndim: int) -> list[str]:
    bases = [f"{prefix}-{kind}-idx{ndim}-ubyte", f"{prefix}-{kind}.idx{ndim}-ubyte"]
    return [base + suffix for base in bases for suffix in ("", ".gz")]


FILES = {
    "train": (_names("train", "images", 3), _names("train", "labels", 1)),
    "test": (_names("t10k", "images", 3), _names("t10k", "labels", 1)),
}


def _find(root: Path, names: list[str]) -> Path | None:
    return next((root / name for name in names if (root / name).is_file()), None)


def detect(root: Path) -> bool:
    return any(_find(root, names) for pair in FILES.values() for names in pair)


def _open(path: Path) -> BinaryIO:
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def _read_up_to(stream: BinaryIO, n: int) -> bytearray:
    """At most n bytes, read in chunks so that a lying header cannot allocate n up front."""
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(min(_CHUNK, n - len(buf)))
        if not chunk:
            break
        buf += chunk
    return buf


def read_idx(path: Path, magic: int) -> np.ndarray:
    """The uint8 array of one IDX file whose magic must be ``magic``."""
    what = "images" if magic == MAGIC_IMAGES else "labels"
    try:
        with _open(path) as stream:
            head = stream.read(4)
            if len(head) < 4:
                raise DataError(f"{path}: truncated: {len(head)} bytes, shorter than an IDX header")
            (found,) = struct.unpack(">I", head)
            if found != magic:
                raise DataError(f"{path}: magic number {found}, expected {magic} (IDX uint8 {what}); "
                                f"not an IDX {what} file")
            ndim = magic & 0xFF
            raw = stream.read(4 * ndim)
            if len(raw) < 4 * ndim:
                raise DataError(f"{path}: truncated IDX header")
            dims = struct.unpack(f">{ndim}I", raw)
            total = math.prod(dims)
            data = _read_up_to(stream, total)
            if len(data) < total:
                raise DataError(f"{path}: truncated: the header promises {'x'.join(map(str, dims))} = "
                                f"{total} bytes of data, the file holds {len(data)}")
            if stream.read(1):
                raise DataError(f"{path}: more data than the header's {'x'.join(map(str, dims))} "
                                f"({total} bytes)")
    except DataError:
        raise
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{path}: cannot read ({type(err).__name__}: {err})") from None
    return np.frombuffer(data, np.uint8).reshape(dims)


def read_pair(root: Path, role: str, cfg: TrainConfig) -> Split | None:
    """The images and labels of ``role`` ("train" or "test"), None when neither file is there."""
    image_names, label_names = FILES[role]
    images, labels = _find(root, image_names), _find(root, label_names)
    if images is None and labels is None:
        return None
    if images is None:
        raise DataError(f"{labels}: no images file beside it ({image_names[0]} or "
                        f"{image_names[1]} in {root})")
    if labels is None:
        raise DataError(f"{images}: no labels file beside it ({label_names[0]} or "
                        f"{label_names[1]} in {root})")
    x = read_idx(images, MAGIC_IMAGES)
    y = read_idx(labels, MAGIC_LABELS)
    check_labels(y, labels, cfg, num_images=len(x), images_path=images)
    return Split(_to_images(x, images, cfg), torch.from_numpy(y.astype(np.int64)))


def read_parts(root: Path, cfg: TrainConfig) -> dict[str, Split]:
    parts = {role: read_pair(root, role, cfg) for role in FILES}
    return {role: split for role, split in parts.items() if split is not None}

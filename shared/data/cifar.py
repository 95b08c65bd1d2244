"""CIFAR-10 edge data, in either official version.

Binary version (``cifar-10-batches-bin``): ``data_batch_*.bin`` are the training set and
``test_batch*.bin`` (``test_batch.bin``, or a part such as ``test_batch_first1000.bin``) the
test set. Each file is a run of 3073-byte records without a header: one label byte, then
1024 red, 1024 green and 1024 blue bytes (a 32x32 image, row-major).

Python version (``cifar-10-batches-py``): pickles ``data_batch_1`` ... and ``test_batch`` (no
extension), each a dict ``{b"data": uint8 (N, 3072) array, b"labels": [int, ...]}``. They are
read by an unpickler that resolves no global except the four numpy arrays need
(``_reconstruct``, ``ndarray``, ``dtype``); anything else is refused before it can run. Files
in the same folder that are neither (``batches.meta``, ``readme.html``) are ignored.

Training files are read in numeric order (``data_batch_2`` before ``data_batch_10``).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import torch

from ..config import TrainConfig
from .npz import DataError, Split, _to_images, check_labels

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct

RECORD = 3073
PIXELS = 3072

_BIN = {"train": re.compile(r"data_batch_(\d+)\.bin"), "test": re.compile(r"test_batch.*\.bin")}
_PICKLE = {"train": re.compile(r"data_batch_(\d+)"), "test": re.compile(r"test_batch")}

# The only globals a pickled numpy uint8 array (protocol 2, as the official files use) needs,
# under numpy 1 and numpy 2 module names.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


def _natural(path: Path) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name))


def _files(root: Path, patterns: dict[str, re.Pattern]) -> dict[str, list[Path]]:
    names = sorted((p for p in root.iterdir() if p.is_file()), key=_natural)
    found = {role: [p for p in names if pattern.fullmatch(p.name)] for role, pattern in patterns.items()}
    return {role: paths for role, paths in found.items() if paths}


def detect_bin(root: Path) -> bool:
    return bool(_files(root, _BIN))


def detect_pickle(root: Path) -> bool:
    return bool(_files(root, _PICKLE))


def _read_bin(path: Path, cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    try:
        size = path.stat().st_size
        if size == 0:
            raise DataError(f"{path}: empty file, no CIFAR-10 records")
        if size % RECORD:
            hint = " (CIFAR-100's 3074-byte records are not supported)" if size % 3074 == 0 else ""
            raise DataError(f"{path}: {size} bytes is not a whole number of {RECORD}-byte CIFAR-10 "
                            f"records (1 label byte + {PIXELS} pixel bytes): a partial or foreign "
                            f"file{hint}")
        raw = np.fromfile(path, np.uint8)
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err})") from None
    if raw.size != size:
        raise DataError(f"{path}: read {raw.size} of {size} bytes (the file changed while reading)")
    raw = raw.reshape(-1, RECORD)
    y = raw[:, 0].astype(np.int64)
    check_labels(y, path, cfg)
    return raw[:, 1:].reshape(-1, 3, 32, 32), y


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise DataError(f"{self.path}: refused to unpickle global {module}.{name} (a CIFAR-10 "
                            f"python batch holds only numpy arrays, lists and numbers)") from None


def _get(batch: dict, key: str):
    return batch.get(key.encode(), batch.get(key))


def _read_pickle(path: Path, cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = _RestrictedUnpickler(f, path).load()
    except DataError:
        raise
    except Exception as err:  # malformed pickles raise many types; none of them ran code
        raise DataError(f"{path}: not a readable CIFAR-10 python batch "
                        f"({type(err).__name__}: {err})") from None
    if not isinstance(batch, dict):
        raise DataError(f"{path}: expected a dict with b'data' and b'labels', got {type(batch).__name__}")
    data, labels = _get(batch, "data"), _get(batch, "labels")
    if data is None or labels is None:
        keys = ", ".join(repr(k) for k in list(batch)[:10])
        raise DataError(f"{path}: expected keys b'data' and b'labels', has {keys}")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != PIXELS:
        what = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: b'data' must be a uint8 array of shape (N, {PIXELS}), got {what}")
    try:
        y = np.asarray(labels)
    except ValueError as err:
        raise DataError(f"{path}: b'labels' is not a list of integers ({err})") from None
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: b'labels' must be a list of integers, got {y.dtype} {y.shape}")
    check_labels(y, path, cfg, num_images=len(data))
    return data.reshape(-1, 3, 32, 32), y.astype(np.int64)


def _read_all(paths: list[Path], read, cfg: TrainConfig) -> Split:
    parts = [read(path, cfg) for path in paths]
    x = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    return Split(_to_images(x, paths[0], cfg), torch.from_numpy(y))


def read_parts_bin(root: Path, cfg: TrainConfig) -> dict[str, Split]:
    return {role: _read_all(paths, _read_bin, cfg) for role, paths in _files(root, _BIN).items()}


def read_parts_pickle(root: Path, cfg: TrainConfig) -> dict[str, Split]:
    return {role: _read_all(paths, _read_pickle, cfg) for role, paths in _files(root, _PICKLE).items()}

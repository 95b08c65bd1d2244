"""Raw whole-dataset loaders for ``fl-partition``: uint8 images and integer labels.

These read a *source* dataset (the thing ``fl-partition`` cuts into edge folders), not
an edge's ``--data-dir`` (that is :mod:`.npz` and the edge readers). Supported layouts of
a source directory, tried in this order:

* npz: ``train.npz`` (+ optional ``test.npz``) or ``data.npz``, arrays ``x`` (uint8,
  (N,H,W), (N,H,W,C) or (N,C,H,W) with C in {1, 3}) and ``y`` (integers >= 0);
* IDX (MNIST style): ``train-images-idx3-ubyte`` and ``train-labels-idx1-ubyte`` (also
  spelled ``train-images.idx3-ubyte``), each optionally ``.gz``, plus optional ``t10k-*``;
* CIFAR-10 binary: ``data_batch_*.bin`` and optional ``test_batch*.bin`` (3,073-byte
  records: one label byte, then 1,024 R, G and B bytes); a directory holding a
  ``cifar-10-batches-bin`` sub-folder is accepted as well.

* a table (``tables.py``): a Hugging Face ``datasets`` folder written by ``save_to_disk``,
  ``*.parquet`` files, or ``train.csv``/``data.csv`` (path,label), with an image and a
  label column (``--image-column``, ``--label-column``); every image the first one's size
  and mode. Integer labels are classes; text labels become classes in sorted order, and
  the source's class names.

The special source name ``sklearn-digits`` loads scikit-learn's bundled 8x8 digits.
Images come back as uint8 (N,H,W) for one channel and (N,H,W,C) otherwise.
"""

from __future__ import annotations

import gzip
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .npz import DataError
from .tables import Columns, layout, read_table

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck"]
_CIFAR_RECORD = 1 + 3 * 32 * 32


class SourceError(ValueError):
    """An unusable source dataset; the message names the path."""


@dataclass
class RawDataset:
    kind: str  # "npz", "idx", "cifar10-bin", "sklearn-digits", "datasets", "parquet", "csv"
    path: str
    train_x: np.ndarray  # uint8 (N,H,W) or (N,H,W,C)
    train_y: np.ndarray  # int64 (N,)
    test_x: np.ndarray | None = None
    test_y: np.ndarray | None = None
    class_names: list[str] | None = None  # the source's own names, when it has them

    @property
    def has_test(self) -> bool:
        return self.test_y is not None and len(self.test_y) > 0


def _check_xy(x: np.ndarray, y: np.ndarray, where: Path) -> tuple[np.ndarray, np.ndarray]:
    if x.dtype != np.uint8:
        raise SourceError(f"{where}: x must be uint8 images, got {x.dtype}")
    if x.ndim == 4 and x.shape[1] in (1, 3) and x.shape[-1] not in (1, 3):
        x = x.transpose(0, 2, 3, 1)
    if x.ndim == 4 and x.shape[-1] == 1:
        x = x[..., 0]
    if x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[-1] != 3):
        raise SourceError(f"{where}: x must be (N,H,W) or (N,H,W,C) with C in (1, 3); got {x.shape}")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise SourceError(f"{where}: y must be a 1-D integer array, got {y.dtype} {y.shape}")
    if len(x) != len(y):
        raise SourceError(f"{where}: {len(x)} images but {len(y)} labels")
    if len(y) and int(y.min()) < 0:
        raise SourceError(f"{where}: negative label {int(y.min())}")
    return np.ascontiguousarray(x), y.astype(np.int64)


def _read_npz(path: Path, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not {"x", "y"} <= set(archive.files):
                raise SourceError(f"{path}: needs arrays x and y (has {archive.files})")
            x, y = archive["x"], archive["y"]
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        if isinstance(err, SourceError):
            raise
        raise SourceError(f"{path}: not a readable .npz file ({err})") from None
    if limit is not None:
        x, y = x[:limit], y[:limit]
    return _check_xy(x, y, path)


def _find(root: Path, names: list[str]) -> Path | None:
    for name in names:
        for candidate in (root / name, root / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _read_idx(path: Path, want_dims: int, limit: int | None) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            header = f.read(4)
            if len(header) != 4 or header[:2] != b"\0\0" or header[2] != 0x08 or header[3] != want_dims:
                raise SourceError(f"{path}: not a uint8 IDX file with {want_dims} dimension(s)")
            dims = np.frombuffer(f.read(4 * want_dims), dtype=">u4").astype(np.int64)
            if len(dims) != want_dims:
                raise SourceError(f"{path}: truncated IDX header")
            count = int(dims[0]) if limit is None else min(int(dims[0]), limit)
            item = int(np.prod(dims[1:]))
            data = f.read(count * item)
    except (OSError, EOFError) as err:
        raise SourceError(f"{path}: unreadable ({err})") from None
    if len(data) != count * item:
        raise SourceError(f"{path}: truncated: expected {count * item} data bytes, got {len(data)}")
    return np.frombuffer(data, dtype=np.uint8).reshape(count, *dims[1:])


def _load_idx_split(root: Path, prefix: str, limit: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    images = _find(root, [f"{prefix}-images-idx3-ubyte", f"{prefix}-images.idx3-ubyte"])
    labels = _find(root, [f"{prefix}-labels-idx1-ubyte", f"{prefix}-labels.idx1-ubyte"])
    if images is None and labels is None:
        return None
    if images is None or labels is None:
        raise SourceError(f"{root}: found {(images or labels).name} but not its "
                          f"{'images' if images is None else 'labels'} file")
    x = _read_idx(images, 3, limit)
    y = _read_idx(labels, 1, limit)
    return _check_xy(x, y, images)


def _read_cifar(paths: list[Path], limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    chunks = []
    remaining = limit
    for path in paths:
        if remaining is not None and remaining <= 0:
            break
        size = path.stat().st_size
        if size % _CIFAR_RECORD:
            raise SourceError(f"{path}: {size} bytes is not a multiple of the "
                              f"{_CIFAR_RECORD}-byte CIFAR-10 record")
        count = size // _CIFAR_RECORD if remaining is None else min(size // _CIFAR_RECORD, remaining)
        raw = np.fromfile(path, dtype=np.uint8, count=count * _CIFAR_RECORD).reshape(count, _CIFAR_RECORD)
        chunks.append(raw)
        if remaining is not None:
            remaining -= count
    records = np.concatenate(chunks) if chunks else np.zeros((0, _CIFAR_RECORD), np.uint8)
    y = records[:, 0].astype(np.int64)
    if len(y) and int(y.max()) > 9:
        raise SourceError(f"{paths[0].parent}: label byte {int(y.max())} > 9; not CIFAR-10 binary")
    x = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(x), y


def _batch_number(path: Path) -> tuple[int, str]:
    match = re.search(r"(\d+)", path.stem)
    return (int(match.group(1)) if match else 0, path.name)


def _load_sklearn_digits() -> RawDataset:
    try:
        from sklearn.datasets import load_digits  # type: ignore[import-not-found]
    except ImportError:
        raise SourceError("sklearn-digits: scikit-learn is not installed in this environment "
                          "(pip install scikit-learn), or pass a directory to --source") from None
    digits = load_digits()
    x = np.clip(np.round(digits.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    return RawDataset("sklearn-digits", "sklearn-digits", x, digits.target.astype(np.int64))


def _load_table(root: Path, parts: dict[str, list[Path]], columns: Columns,
                limit: int | None) -> RawDataset:
    try:
        read = {part: read_table(files, columns) for part, files in parts.items()}
        first = next(iter(read.values())).x
        if any(t.x.shape[1:] != first.shape[1:] for t in read.values()):
            raise SourceError(f"{root}: the parts' images differ in size or mode")
    except DataError as err:
        raise SourceError(str(err)) from None
    labels = [label for table in read.values() for label in table.labels]
    names = None
    if all(isinstance(v, str) and not v.strip().isdigit() for v in labels):
        names = sorted(set(labels))
        index = {name: i for i, name in enumerate(names)}
        as_int = {p: np.array([index[v] for v in t.labels], np.int64) for p, t in read.items()}
    else:
        try:
            as_int = {p: np.array([int(v) for v in t.labels], np.int64) for p, t in read.items()}
        except (TypeError, ValueError) as err:
            raise SourceError(f"{root}: labels must be all integers or all class names ({err})") from None
        if any((y < 0).any() for y in as_int.values()):
            raise SourceError(f"{root}: negative labels")
    train = "train" if "train" in read else "all"
    tx, ty = read[train].x, as_int[train]
    if limit is not None:
        tx, ty = tx[:limit], ty[:limit]
    test = (read["test"].x, as_int["test"]) if "test" in read else (None, None)
    kind = "datasets" if (root / "state.json").exists() or (root / "dataset_dict.json").exists() else (
        "parquet" if parts[train][0].suffix == ".parquet" else "csv")
    return RawDataset(kind, str(root), tx, ty, *test, class_names=names)


def load_source(source: str | Path, limit: int | None = None,
                columns: Columns | None = None) -> RawDataset:
    """Load a source dataset; ``limit`` keeps only the first ``limit`` training samples;
    ``columns``: a table source's image and label columns (default image, label)."""
    if str(source) == "sklearn-digits":
        data = _load_sklearn_digits()
        if limit is not None:
            data.train_x, data.train_y = data.train_x[:limit], data.train_y[:limit]
        return data
    root = Path(source)
    if not root.exists():
        raise SourceError(f"{root}: no such directory")
    if not root.is_dir():
        raise SourceError(f"{root}: not a directory")
    if (root / "train.npz").is_file():
        tx, ty = _read_npz(root / "train.npz", limit)
        test = _read_npz(root / "test.npz", None) if (root / "test.npz").is_file() else (None, None)
        return RawDataset("npz", str(root), tx, ty, *test)
    if (root / "data.npz").is_file():
        tx, ty = _read_npz(root / "data.npz", limit)
        return RawDataset("npz", str(root), tx, ty)
    train = _load_idx_split(root, "train", limit)
    if train is not None:
        test = _load_idx_split(root, "t10k", None) or (None, None)
        return RawDataset("idx", str(root), *train, *test)
    if not list(root.glob("data_batch_*.bin")) and (root / "cifar-10-batches-bin").is_dir():
        root = root / "cifar-10-batches-bin"
    batches = sorted(root.glob("data_batch_*.bin"), key=_batch_number)
    if batches:
        tx, ty = _read_cifar(batches, limit)
        full_test = root / "test_batch.bin"
        tests = [full_test] if full_test.is_file() else sorted(root.glob("test_batch*.bin"))
        test = _read_cifar(tests, None) if tests else (None, None)
        return RawDataset("cifar10-bin", str(root), tx, ty, *test, class_names=list(CIFAR10_CLASSES))
    try:
        parts = layout(root)
    except DataError as err:
        raise SourceError(str(err)) from None
    if parts is not None:
        return _load_table(root, parts, columns or Columns(), limit)
    raise SourceError(f"{root}: no recognised dataset (expected train.npz or data.npz, MNIST-style "
                      f"train-images-idx3-ubyte[.gz] + train-labels-idx1-ubyte[.gz], CIFAR-10 "
                      f"data_batch_*.bin, a datasets folder, *.parquet or train.csv/data.csv)")

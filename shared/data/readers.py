"""An edge's ``--data-dir``: which format it holds, and loading it into ``EdgeData``.

The format is detected from the folder's contents, in this order; the first that matches is
used (any other that also matches is logged and ignored):

1. npz (``npz.py``): ``train.npz`` [+ ``test.npz``], or ``data.npz``.
2. IDX, MNIST-style (``idx.py``): ``train-images-idx3-ubyte`` + ``train-labels-idx1-ubyte``
   [+ ``t10k-images-idx3-ubyte`` + ``t10k-labels-idx1-ubyte``], each optionally ``.gz``.
   MNIST and Fashion-MNIST use these names.
3. CIFAR-10 binary (``cifar.py``): ``data_batch_*.bin`` [+ ``test_batch*.bin``].
4. CIFAR-10 python pickles (``cifar.py``): ``data_batch_1`` ... [+ ``test_batch``], read by
   an unpickler that allows numpy arrays and nothing else.
5. Tables (``tables.py``): a Hugging Face ``datasets`` folder (``state.json`` or
   ``dataset_dict.json``), ``*.parquet`` or ``train.csv``/``data.csv`` files, with the
   columns ``train.image_column`` and ``train.label_column``.
6. Image folders (``images.py``): ``train/<class>/*.png|jpg|jpeg|bmp`` [+ ``test/<class>/``],
   or class folders directly in the data dir. Last, because any sub-folder matches it.

Without a test part (``test.npz``, ``t10k-*``, ``test_batch*``, ``test/``) the training data is
split by the seeded stratified split (``train.test_fraction``, ``train.seed``).

Optionally a global test set, the same on every edge: ``global_test.npz``, or a folder
``global_test/`` holding any of the formats above (detected the same way). Everything in that
folder, train and test parts alike, is the global test set. Both at once is an error.

Whatever the format, images come out as float32 (N, C, H, W) (uint8 pixels mapped to [-1, 1]),
labels as int64 indices into the server's class list (``TrainConfig.classes``); a grey image
may feed a 3-channel run, any other mismatch of channels or size is an error naming the file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import TrainConfig
from . import cifar, idx, images, tables
from .encoded import materialized
from .npz import DataError, EdgeData, Split, read_npz, stratified_split

log = logging.getLogger(__name__)


def _detect_npz(root: Path) -> bool:
    return any((root / name).exists() for name in ("train.npz", "data.npz", "test.npz"))


def _read_npz_parts(root: Path, cfg: TrainConfig) -> dict[str, Split]:
    if (root / "train.npz").exists():
        parts = {"train": read_npz(root / "train.npz", cfg, keep_uint8=True)}
        if (root / "test.npz").exists():
            parts["test"] = read_npz(root / "test.npz", cfg, keep_uint8=True)
        return parts
    if (root / "data.npz").exists():
        return {"all": read_npz(root / "data.npz", cfg, keep_uint8=True)}
    return {"test": read_npz(root / "test.npz", cfg, keep_uint8=True)}


def _folder_hint(folder: Path) -> str:
    """For a data dir's sub-folder that is not a class: does it hold data of another format?"""
    for fmt in FORMATS[:-1]:
        if fmt.detect(folder):
            return f"; it holds {fmt.name} data: point --data-dir at {folder}"
    return ""


def _read_image_parts(root: Path, cfg: TrainConfig) -> dict[str, Split]:
    return images.read_parts(root, cfg, hint=_folder_hint)


@dataclass(frozen=True)
class Format:
    name: str
    detect: Callable[[Path], bool]
    read_parts: Callable[[Path, TrainConfig], dict[str, Split]]  # "train" / "test" / "all"
    expects: str


FORMATS = (
    Format("npz", _detect_npz, _read_npz_parts, "train.npz or data.npz"),
    Format("IDX (MNIST-style)", idx.detect, idx.read_parts,
           "train-images-idx3-ubyte[.gz] + train-labels-idx1-ubyte[.gz]"),
    Format("CIFAR-10 binary", cifar.detect_bin, cifar.read_parts_bin, "data_batch_*.bin"),
    Format("CIFAR-10 python", cifar.detect_pickle, cifar.read_parts_pickle, "data_batch_1, ..."),
    Format("table", tables.detect, tables.read_parts,
           "a datasets folder (save_to_disk), *.parquet or train.csv/data.csv"),
    Format("image-folder", images.detect, _read_image_parts, "train/<class>/ or <class>/ image folders"),
)


def detect_format(folder: Path) -> Format:
    found = [fmt for fmt in FORMATS if fmt.detect(folder)]
    if not found:
        raise DataError(f"data dir {folder}: no train.npz or data.npz found, nor another known layout "
                        f"({'; '.join(fmt.expects for fmt in FORMATS[1:])})")
    if len(found) > 1:
        log.warning("data dir %s: reading it as %s; it also looks like %s, which is ignored", folder,
                    found[0].name, ", ".join(fmt.name for fmt in found[1:]))
    return found[0]


def _concat(splits: list[Split]) -> Split:
    if len(splits) == 1:
        return splits[0]
    splits = [Split(materialized(s.x), s.y) for s in splits]  # encoded images decoded
    if len({s.x.dtype for s in splits}) > 1:  # kept uint8 beside float: all as floats
        splits = [s.decoded() for s in splits]
    return Split(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]))


def _load_global_test(root: Path, cfg: TrainConfig) -> Split | None:
    as_file, as_folder = root / "global_test.npz", root / "global_test"
    if as_file.exists() and as_folder.is_dir():
        raise DataError(f"data dir {root}: both global_test.npz and global_test/ exist; keep one")
    if as_file.exists():
        return read_npz(as_file, cfg, keep_uint8=True)
    if not as_folder.is_dir():
        return None
    fmt = detect_format(as_folder)
    parts = fmt.read_parts(as_folder, cfg)
    if not parts:
        raise DataError(f"{as_folder}: no samples found ({fmt.name})")
    return _concat(list(parts.values()))


def load_edge_data(data_dir: str | Path, cfg: TrainConfig, keep_uint8: bool = False) -> EdgeData:
    """The edge's splits. Every reader keeps uint8 images as uint8; they are decoded to
    float32 here, unless ``keep_uint8`` (fl-edge: decoded per batch, 4x less memory)."""
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"data dir {root} does not exist or is not a directory")
    fmt = detect_format(root)
    parts = fmt.read_parts(root, cfg)
    if "train" in parts:
        train = parts["train"]
        if "test" in parts:
            test = parts["test"]
        else:
            train, test = stratified_split(train, cfg.test_fraction, cfg.seed)
    elif "all" in parts:
        train, test = stratified_split(parts["all"], cfg.test_fraction, cfg.seed)
    else:
        raise DataError(f"data dir {root}: {fmt.name} test data but no training data "
                        f"(expected {fmt.expects})")
    if len(test) == 0:
        raise DataError(f"data dir {root}: the test split is empty (too few samples per class)")
    global_test = _load_global_test(root, cfg)
    log.info("data dir %s: %s format", root, fmt.name)
    data = EdgeData(train, test, global_test)
    return data if keep_uint8 else data.decoded()

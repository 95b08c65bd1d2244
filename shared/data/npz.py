"""``.npz`` edge data (arrays ``x`` and ``y``), read without pickle.

Layout of a data dir: ``train.npz`` and ``test.npz``, or a single ``data.npz`` that is
split into train/test with a seeded stratified split; optionally ``global_test.npz``
(the same balanced set on every edge). Images are uint8 (N,H,W), (N,H,W,C) or float
(N,C,H,W); labels are integers in [0, num_classes) of the server's class list.

uint8 images are kept as uint8 by the readers and decoded to float32 in [-1, 1] by
``decode_images``: up front for tools (``load_edge_data``'s default), per batch on the
edge (``keep_uint8``), where 10,000 images at 224 px are 1.5 GB instead of 6 GB. The
decoding is elementwise, so a batch decoded alone is bit for bit the same rows decoded
with all the others.

This module also holds the types and checks the other readers share; which reader a data dir
uses is decided in ``readers.py``.
"""

from __future__ import annotations

import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import TrainConfig

#: numpy parses each array's header with ``ast.literal_eval``, and CPython 3.11 before
#: 3.11.8 can fail two threads parsing at once with "SystemError: AST constructor recursion
#: depth mismatch" (https://github.com/python/cpython/issues/106905). fl-sim hosts edges
#: as threads that load their data at the same moment; one edge thread died of it at
#: start. Arrays are read one archive at a time instead (a lock, not state).
NPZ_READ_LOCK = threading.Lock()


class DataError(ValueError):
    """Unusable edge data; the message names the file."""


def decode_images(x: torch.Tensor) -> torch.Tensor:
    """uint8 images as the model takes them: float32 in [-1, 1] ((v / 255 - 0.5) / 0.5,
    the readers' one normalisation); float images as they are."""
    if not isinstance(x, torch.Tensor):  # images still encoded (encoded.py)
        x = x.decoded()
    if x.dtype != torch.uint8:
        return x
    return x.contiguous().float().div_(255.0).sub_(0.5).div_(0.5)


@dataclass
class Split:
    # float32 (N, C, H, W), normalised to [-1, 1] for uint8 input; or the uint8 images
    # themselves (N, C, H, W) where the reader was asked to keep them (decode_images)
    x: torch.Tensor
    y: torch.Tensor  # int64 (N,)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def to(self, device: torch.device) -> Split:
        return Split(self.x.to(device), self.y.to(device))

    def decoded(self) -> Split:
        """The split with float images (kept uint8 images decoded)."""
        return Split(decode_images(self.x), self.y)


@dataclass
class EdgeData:
    train: Split
    test: Split
    global_test: Split | None

    def to(self, device: torch.device) -> EdgeData:
        """Every split in ``device``'s memory (fl-edge --data-on-device)."""
        return EdgeData(self.train.to(device), self.test.to(device),
                        self.global_test.to(device) if self.global_test else None)

    def decoded(self) -> EdgeData:
        """Every split with float images (``Split.decoded``)."""
        return EdgeData(self.train.decoded(), self.test.decoded(),
                        self.global_test.decoded() if self.global_test else None)


def _to_images(x: np.ndarray, path: Path, cfg: TrainConfig) -> torch.Tensor:
    """(N, C, H, W) images checked against the run: uint8 kept as uint8 (decoded later,
    ``decode_images``), floats as float32."""
    if x.ndim == 3:
        x = x[:, None, :, :]
    elif x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    elif x.ndim != 4:
        raise DataError(f"{path}: x must be (N,H,W), (N,H,W,C) or (N,C,H,W); got shape {x.shape}")
    if x.dtype == np.uint8:
        # NHWC files stay as read, seen through a permuted (N, C, H, W) view: no copy of
        # the whole set; each decoded batch is made contiguous (decode_images)
        images = torch.from_numpy(x if x.flags.writeable else x.copy())
    elif np.issubdtype(x.dtype, np.floating):
        images = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        if not bool(torch.isfinite(images).all()):
            raise DataError(f"{path}: x holds NaN or Inf")
    else:
        raise DataError(f"{path}: x must be uint8 or floating point, got {x.dtype}")
    channels, height, width = images.shape[1:]
    if channels != cfg.in_channels:
        if channels == 1 and cfg.in_channels == 3:
            images = images.expand(-1, 3, -1, -1).contiguous()
        else:
            raise DataError(f"{path}: images have {channels} channels, the run expects "
                            f"{cfg.in_channels}")
    if (height, width) != (cfg.image_size, cfg.image_size):
        raise DataError(f"{path}: images are {height}x{width}, the run expects "
                        f"{cfg.image_size}x{cfg.image_size}")
    return images


def read_npz(path: Path, cfg: TrainConfig, keep_uint8: bool = False) -> Split:
    """The images and labels of one .npz file; uint8 images decoded unless ``keep_uint8``."""
    try:
        with NPZ_READ_LOCK, np.load(path, allow_pickle=False) as archive:
            missing = {"x", "y"} - set(archive.files)
            if missing:
                raise DataError(f"{path}: missing array(s) {sorted(missing)} (has {archive.files})")
            x, y = archive["x"], archive["y"]
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{path}: not a readable .npz file ({err})") from None
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: y must be a 1-D integer array, got {y.dtype} {y.shape}")
    check_labels(y, path, cfg, num_images=len(x))
    split = Split(_to_images(x, path, cfg), torch.from_numpy(y.astype(np.int64)))
    return split if keep_uint8 else split.decoded()


def check_labels(y: np.ndarray, path: Path, cfg: TrainConfig, num_images: int | None = None,
                 images_path: Path | None = None) -> None:
    """Labels pair one-to-one with the images, there is at least one, and every label
    indexes the server's class list. ``images_path``: images kept in another file."""
    if num_images is not None and num_images != len(y):
        raise DataError(f"{images_path}: {num_images} images but {path} holds {len(y)} labels"
                        if images_path else f"{path}: {num_images} images but {len(y)} labels")
    if len(y) == 0:
        raise DataError(f"{images_path or path}: no samples")
    bad = np.flatnonzero((y < 0) | (y >= cfg.num_classes))
    if bad.size:
        raise DataError(f"{path}: label {int(y[bad[0]])} at index {int(bad[0])} is outside "
                        f"[0, {cfg.num_classes})")


def stratified_split(split: Split, test_fraction: float, seed: int) -> tuple[Split, Split]:
    """Per class, a seeded shuffle puts round(test_fraction * n_c) samples (at least one
    when the class has two or more) into the test split."""
    rng = np.random.default_rng(seed)
    labels = split.y.numpy()
    train_idx, test_idx = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(test_fraction * len(idx)))
        if len(idx) >= 2:
            n_test = min(max(n_test, 1), len(idx) - 1)
        else:
            n_test = 0
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    tr = torch.from_numpy(np.sort(np.concatenate(train_idx)))
    te = torch.from_numpy(np.sort(np.concatenate(test_idx)))
    if not isinstance(split.x, torch.Tensor):  # images still encoded: the halves stay so
        return (Split(split.x.subset(tr), split.y[tr]), Split(split.x.subset(te), split.y[te]))
    return Split(split.x[tr], split.y[tr]), Split(split.x[te], split.y[te])

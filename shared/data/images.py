"""Image-folder edge data: one folder per class, images read with Pillow.

Layouts (``<class>`` is a name from the server's class list, ``TrainConfig.classes``)::

    train/<class>/*.png|jpg|jpeg|bmp   test/<class>/...   global_test/<class>/...
    <class>/*.png ...                  (no train/: a seeded stratified split makes the test set)

Folder names map to label indices through the server's class list, never by sorting the local
folders: an edge under label skew holds only some classes, and ``3/`` must still be label 3.
A folder that is not a class is an error, as is an image outside a class folder; ``train``,
``test`` and ``global_test`` are layout names, never classes. Images may sit
in sub-folders of a class folder; other files (and hidden ones) are ignored. Images are
converted to ``L`` when the run has one input channel and to ``RGB`` otherwise, and must
already be ``image_size`` x ``image_size``: nothing is resized.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..config import TrainConfig
from .npz import DataError, Split, _to_images

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
RESERVED = ("train", "test", "global_test")
_JUNK_DIRS = ("__MACOSX",)


def _subdirs(folder: Path, skip: tuple[str, ...] = ()) -> list[Path]:
    return sorted(p for p in folder.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and p.name not in _JUNK_DIRS + skip)


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".") and path.is_file()


def detect(root: Path) -> bool:
    return bool(_subdirs(root, ("global_test",)))


def _known(classes: list[str]) -> str:
    shown = ", ".join(classes[:30])
    return shown + (f", ... ({len(classes)} in all)" if len(classes) > 30 else "")


def _read_image(path: Path, mode: str, size: int) -> np.ndarray:
    try:
        with Image.open(path) as image:
            if image.size != (size, size):
                width, height = image.size
                raise DataError(f"{path}: image is {width}x{height} pixels, the run expects "
                                f"{size}x{size} (images are not resized: resize them beforehand)")
            return np.asarray(image.convert(mode), dtype=np.uint8)
    except DataError:
        raise
    except Exception as err:  # Pillow's decoders raise many types on corrupt input
        raise DataError(f"{path}: not a readable image ({type(err).__name__}: {err})") from None


def read_class_folders(folder: Path, cfg: TrainConfig, skip: tuple[str, ...] = (),
                       hint: Callable[[Path], str] | None = None) -> Split:
    """All images under ``folder/<class>/`` (folders named in ``skip`` left out)."""
    index = {name: i for i, name in enumerate(cfg.classes)}
    files: list[Path] = []
    labels: list[int] = []
    for class_dir in _subdirs(folder, skip):
        if class_dir.name not in index:
            extra = hint(class_dir) if hint else ""
            raise DataError(f"{class_dir}: folder {class_dir.name!r} is not one of the server's classes "
                            f"({_known(cfg.classes)}){extra}")
        found = sorted(p for p in class_dir.rglob("*")
                       if _is_image(p) and not any(part.startswith(".")
                                                   for part in p.relative_to(class_dir).parts))
        files += found
        labels += [index[class_dir.name]] * len(found)
    stray = sorted(p for p in folder.iterdir() if _is_image(p))
    if stray:
        raise DataError(f"{stray[0]}: image outside a class folder (images go in {folder}/<class>/)")
    if not files:
        raise DataError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in class folders")
    mode, size = ("L" if cfg.in_channels == 1 else "RGB"), cfg.image_size
    x = np.empty((len(files), size, size) if mode == "L" else (len(files), size, size, 3), np.uint8)
    for i, path in enumerate(files):
        x[i] = _read_image(path, mode, size)
    if mode == "RGB":
        x = x.transpose(0, 3, 1, 2)  # explicit CHW: _to_images need not guess for tiny sizes
    return Split(_to_images(x, folder, cfg), torch.tensor(labels, dtype=torch.int64))


def read_parts(root: Path, cfg: TrainConfig, hint: Callable[[Path], str] | None = None) -> dict[str, Split]:
    """``{"train", "test"}`` from ``train/`` and ``test/``, or ``{"all"}`` from class folders
    directly in ``root``. ``global_test/`` is left to the caller. ``hint(folder)`` may add to
    the error for a folder directly in ``root`` that is not a class."""
    flat = _subdirs(root, RESERVED)
    parts: dict[str, Split] = {}
    if (root / "train").is_dir():
        if flat:
            raise DataError(f"{flat[0]}: unexpected folder beside train/ (with a train/ folder, class "
                            f"folders go in train/<class>/, test/<class>/ and global_test/<class>/)")
        parts["train"] = read_class_folders(root / "train", cfg)
    elif flat:
        if (root / "test").is_dir():
            raise DataError(f"{root}: class folders beside test/ but no train/ folder: put the "
                            f"training class folders in train/")
        parts["all"] = read_class_folders(root, cfg, skip=RESERVED, hint=hint)
    if (root / "test").is_dir():
        parts["test"] = read_class_folders(root / "test", cfg)
    return parts

"""The MNIST subset that ships inside the package (``fl-demo``, ``fl-sim``, the load bench
and the tests use it): found wherever fedattn is installed, with no download."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# A source checkout that was not installed: the folder next to this file.
_CHECKOUT = Path(__file__).resolve().parent / "bundled" / "mnist"


def bundled_mnist() -> Path:
    """The bundled MNIST subset's folder (``train.npz``, ``test.npz``)."""
    path = Path(str(files("fedattn_shared.data") / "bundled" / "mnist"))
    return path if (path / "train.npz").exists() else _CHECKOUT

"""Images kept encoded until a batch needs them: the table formats' ``Split.x``.

A Parquet file or a ``datasets`` folder stores each image compressed (PNG, JPEG); decoding
them all at load would hold every pixel in memory for the whole run (an ImageNet-sized
224 px colour set is 150 kB a sample raw, ~10x its JPEG). ``EncodedImages`` holds the
encoded bytes (or the path, for a CSV) and decodes only the rows a batch indexes, so an
edge's resident data stays at its on-disk size. It answers what the edge's loops ask of a
uint8 (N, C, H, W) tensor: ``shape``, ``dtype``, ``device``, ``size(0)``, ``len``, and
indexing by an int, a slice or an index tensor (which returns a real uint8 tensor).
Anything that wants the whole set as one tensor (``to(device)`` for --data-on-device,
float decoding on the server's side) decodes it all then.

Each image's header (format, size, mode) was checked when the table was read, so a
refusal there names the file and row before any training; a body that is corrupt past its
header is refused here, naming the same file and row, when its batch is drawn.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .npz import DataError


class EncodedImages:
    """uint8 (N, C, H, W) images as ``blobs`` (encoded bytes or a path each), decoded to
    ``mode`` ("L" or "RGB") per index; ``channels`` 3 with mode "L" repeats grey (as the
    readers do for a grey image in a colour run). ``where[i]`` names row i's file and row."""

    dtype = torch.uint8
    device = torch.device("cpu")
    ndim = 4

    def __init__(self, blobs: Sequence[bytes | Path], mode: str, size: int, channels: int,
                 where: Sequence[str]):
        self.blobs, self.mode, self.side, self.channels, self.where = blobs, mode, size, channels, where

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.blobs), self.channels, self.side, self.side))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return len(self.blobs)

    def subset(self, index: torch.Tensor | Sequence[int]) -> EncodedImages:
        """The rows ``index`` still encoded (a stratified split's halves)."""
        rows = [int(i) for i in index]
        return EncodedImages([self.blobs[i] for i in rows], self.mode, self.side, self.channels,
                             [self.where[i] for i in rows])

    def _decode(self, i: int) -> np.ndarray:
        from PIL import Image

        blob = self.blobs[i]
        try:
            with Image.open(io.BytesIO(blob) if isinstance(blob, bytes) else blob) as image:
                pixels = np.asarray(image.convert(self.mode), dtype=np.uint8)
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise DataError(f"{self.where[i]}: not a readable image ({type(err).__name__}: "
                            f"{err})") from None
        if pixels.shape[:2] != (self.side, self.side):
            raise DataError(f"{self.where[i]}: image is {pixels.shape[1]}x{pixels.shape[0]} pixels, "
                            f"the run expects {self.side}x{self.side}")
        return pixels

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, int):
            return self[[key]][0]
        if isinstance(key, slice):
            rows = range(*key.indices(len(self)))
        else:
            rows = [int(i) for i in (key.tolist() if isinstance(key, torch.Tensor) else key)]
        out = np.empty((len(rows), self.side, self.side, *(() if self.mode == "L" else (3,))),
                       np.uint8)
        for k, i in enumerate(rows):
            out[k] = self._decode(i)
        images = torch.from_numpy(out)
        images = images[:, None] if self.mode == "L" else images.permute(0, 3, 1, 2)
        return images.expand(-1, self.channels, -1, -1).contiguous()

    def decoded(self) -> torch.Tensor:
        """Every image, as one uint8 tensor."""
        return self[:]

    def to(self, device: torch.device | str) -> torch.Tensor:
        return self.decoded().to(device)


def materialized(x) -> torch.Tensor:
    """``x`` as a tensor: encoded images decoded, a tensor as it is."""
    return x.decoded() if isinstance(x, EncodedImages) else x

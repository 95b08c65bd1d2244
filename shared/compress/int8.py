"""``int8[:BLOCK]``: one signed byte per value in [-127, 127] and one float32 scale per
block of BLOCK values (default 256: 0.254x the float32 bytes), stochastically rounded, so
unbiased (see blockquant). -128 is never produced: the levels are symmetric, so a byte of
-128 is a peer's, and refused."""

from __future__ import annotations

import torch

from ..wire.payload import WireError
from .blockquant import BlockQuantizer, blocks_of, dequantize, quantize
from .codec import Layout, Parts


class Int8(BlockQuantizer):
    name = "int8"
    integer_bits = 8
    levels = 127

    def layout(self, n: int) -> Layout:
        return {"q": (torch.int8, (n,)), "scale": (torch.float32, (blocks_of(n, self.block),))}

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        q, scale = quantize(x, self.block, self.levels, generator)
        return {"q": q, "scale": scale}

    def decode(self, parts: Parts, n: int) -> torch.Tensor:
        q, scale = self.check_parts(parts, n, (n,))
        if n and bool((q == -128).any()):
            raise WireError("int8 q: value -128 outside [-127, 127]")
        return dequantize(q, scale, self.block, self.levels, "int8")

"""``int4[:BLOCK]``: 4 bits per value in [-7, 7], two per byte (the first value in the low
nibble), one float32 scale per block of BLOCK values (default 256: 0.129x the float32
bytes), stochastically rounded, so unbiased (see blockquant). A nibble is the value's
two's complement: 8..15 are -8..-1, and -8 (never produced: the levels are symmetric) is
refused, as is a non-zero padding nibble after an odd count."""

from __future__ import annotations

import torch

from ..wire.payload import WireError
from .blockquant import BlockQuantizer, blocks_of, dequantize, quantize
from .codec import Layout, Parts


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] -> uint8 bytes, two per byte (low nibble first), an odd
    count padded with a 0 nibble."""
    bits = q.view(torch.uint8)
    if bits.numel() % 2:
        bits = torch.cat([bits, bits.new_zeros(1)])
    pairs = bits.view(-1, 2)
    low = pairs[:, 0] & 0x0F
    return low.bitwise_or_((pairs[:, 1] & 0x0F) << 4)


class Int4(BlockQuantizer):
    name = "int4"
    integer_bits = 4
    levels = 7

    def layout(self, n: int) -> Layout:
        return {"q": (torch.uint8, ((n + 1) // 2,)),
                "scale": (torch.float32, (blocks_of(n, self.block),))}

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        q, scale = quantize(x, self.block, self.levels, generator)
        return {"q": pack_nibbles(q), "scale": scale}

    def decode(self, parts: Parts, n: int) -> torch.Tensor:
        packed, scale = self.check_parts(parts, n, ((n + 1) // 2,))
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)
        if n % 2 and int(nibbles[-1]) != 0:
            raise WireError("int4 q: padding nibble after an odd count is not 0")
        nibbles = nibbles[:n]
        if n and bool((nibbles == 8).any()):
            raise WireError("int4 q: nibble -8 outside [-7, 7]")
        # two's complement of 4 bits: (b ^ 8) - 8 maps 0..7 -> 0..7 and 8..15 -> -8..-1
        q = (nibbles ^ 8).view(torch.int8).sub_(8)
        return dequantize(q, scale, self.block, self.levels, "int4")

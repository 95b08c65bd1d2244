"""A fedattn codec outside fedattn: ``round6[:BLOCK]``, 6-bit block quantization rounded to
the nearest level (31 levels each side of zero, one float32 absmax scale per block of BLOCK
values, default 256), deterministic where int8/int4 round stochastically.

It is registered the way a third party would register it: the distribution
``fedattn_example_plugin`` (its ``.dist-info`` folder beside this module) declares the
entry point ``round6`` in the ``fedattn.codecs`` group, so ``--compress up=round6`` works
wherever this folder is on the path. Because it implements the integer-codec interface
(``IntegerCodec``: width, levels, block and its rounding), it also works under
``--secagg``, masked at 6 bits with its own rounding, without a line of fedattn changed
(tests/test_codec_plugin.py runs it end to end)."""

from __future__ import annotations

import numpy as np
import torch

from fedattn_shared.compress.blockquant import blocks_of, check_scale, dequantize, parse_block
from fedattn_shared.compress.codec import Layout, Parts, check_layout
from fedattn_shared.compress.integer import IntegerCodec
from fedattn_shared.wire.payload import WireError


class Round6(IntegerCodec):
    """q in [-31, 31] as one int8 per value, scale per block; the value is q x scale / 31."""

    name = "round6"
    integer_bits = 6
    levels = 31

    def __init__(self, arg: str | None = None):
        self.block = parse_block(self.name, arg)

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.block}"

    def layout(self, n: int) -> Layout:
        return {"q": (torch.int8, (n,)), "scale": (torch.float32, (blocks_of(n, self.block),))}

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Each block's absmax is its scale; values rounded to the nearest level."""
        n, blocks = x.numel(), blocks_of(x.numel(), self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32)
        padded[:n] = x
        grid = padded.view(blocks, self.block)
        scale = grid.abs().amax(dim=1)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"{self.name}: input holds non-finite values")
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = grid.div(safe[:, None]).mul_(self.levels).round_().clamp_(-self.levels, self.levels)
        return {"q": q.to(torch.int8).view(-1)[:n].clone(), "scale": scale}

    def decode(self, parts: Parts, n: int) -> torch.Tensor:
        check_layout(self, parts, n)
        q, scale = parts["q"], parts["scale"]
        check_scale(f"{self.name} scale", scale)
        if n and bool(((q < -self.levels) | (q > self.levels)).any()):
            raise WireError(f"{self.name} q: value outside [-{self.levels}, {self.levels}]")
        return dequantize(q, scale, self.block, self.levels, self.name)

    def round_levels(self, t: np.ndarray, generator: torch.Generator) -> np.ndarray:
        """Round to the nearest level: what SecAgg+ masks, no random draw."""
        return np.rint(t)

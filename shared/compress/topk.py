"""``topk:FRACTION``: the k = max(1, ceil(FRACTION * n)) largest-magnitude values and
where they are; the rest decode as 0.

k depends only on n, so the layout is fixed before any value is seen. The positions travel
compactly: the vector is cut into blocks of 65536 values; ``counts`` (int32, one per block)
says how many kept values fall in each block, ``index`` their positions within the block,
as little-endian uint16 in two bytes (the wire has no 16-bit integer type), ascending, and
``values`` the kept values as float32 (so ``topk:1.0`` is exact and no value is out of a
smaller type's range). 6 bytes per kept value: at 1% the payload is 0.015x the float32
bytes (float16 values would make it 0.010x, at the price of range and exactness).

Top-k is biased (what it drops is lost), so it is meant to run with error feedback
(``topk:0.01+ef``), which carries the dropped part into the next round.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

import torch

from ..wire.payload import WireError
from .codec import Codec, Layout, Parts, check_finite

BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS
DECIMAL = re.compile(r"[0-9]+(\.[0-9]+)?", re.ASCII)


def parse_fraction(arg: str | None) -> Fraction:
    """``0.01`` -> Fraction(1, 100), exactly (so k is the same on every machine);
    ValueError unless 0 < FRACTION <= 1."""
    if arg is None:
        raise ValueError("codec 'topk' needs the kept fraction, e.g. topk:0.01")
    # plain decimals only: an exponent (1e99999999) would make Fraction build a huge integer
    if len(arg) > 24 or DECIMAL.fullmatch(arg) is None:
        raise ValueError(f"codec 'topk': fraction {arg[:24]!r} is not a decimal like 0.01")
    fraction = Fraction(arg)
    if not 0 < fraction <= 1:
        raise ValueError(f"codec 'topk': fraction {arg} outside (0, 1]")
    return fraction


class TopK(Codec):
    name = "topk"
    biased = True

    def __init__(self, arg: str | None = None):
        self.fraction = parse_fraction(arg)
        # the text as given: it passed the spec grammar, so the edges parse the same k
        self._text = arg

    @property
    def spec(self) -> str:
        return f"{self.name}:{self._text}"

    def kept(self, n: int) -> int:
        """k for a vector of n values."""
        return min(n, max(1, math.ceil(self.fraction * n)))

    def layout(self, n: int) -> Layout:
        k = self.kept(n)
        return {"counts": (torch.int32, (-(-n // BLOCK),)),
                "index": (torch.uint8, (k, 2)),
                "values": (torch.float32, (k,))}

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        if x.dim() != 1 or x.dtype != torch.float32:
            raise ValueError(f"topk: expected a 1-D float32 vector, got {x.dtype} {tuple(x.shape)}")
        n = x.numel()
        k = self.kept(n)
        magnitude = x.abs()
        if n and not bool(torch.isfinite(magnitude.max())):
            raise ValueError("topk: input holds non-finite values")
        if k == n:
            index = torch.arange(n)
        else:
            index = torch.topk(magnitude, k, sorted=False).indices.sort().values
        counts = torch.bincount(index >> BLOCK_BITS, minlength=-(-n // BLOCK)).to(torch.int32)
        local = index & (BLOCK - 1)
        pairs = torch.stack([local & 0xFF, local >> 8], dim=1).to(torch.uint8)
        return {"counts": counts, "index": pairs, "values": x[index]}

    def decode(self, parts: Parts, n: int) -> torch.Tensor:
        k = self.kept(n)
        for part, (dtype, shape) in self.layout(n).items():
            if parts[part].dtype != dtype or tuple(parts[part].shape) != shape:
                raise WireError(f"topk {part}: {parts[part].dtype} {tuple(parts[part].shape)}, "
                                f"expected {dtype} {shape}")
        counts = parts["counts"].to(torch.int64)
        if counts.numel() and int(counts.min()) < 0:
            raise WireError("topk counts: negative count")
        total = int(counts.sum())
        if total != k:
            raise WireError(f"topk counts: sum {total}, expected k = {k}")
        pairs = parts["index"].to(torch.int64)
        block = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        index = (block << BLOCK_BITS) | pairs[:, 0] | (pairs[:, 1] << 8)
        if k and int(index.max()) >= n:
            raise WireError("topk index: an index is outside its block")
        step = index.diff()
        if step.numel() and int(step.min()) <= 0:
            if bool((step == 0).any()):
                raise WireError("topk index: a repeated index within a block")
            raise WireError("topk index: indices within a block not ascending")
        values = parts["values"]
        check_finite("topk values", values)
        out = torch.zeros(n, dtype=torch.float32)
        out[index] = values
        return out

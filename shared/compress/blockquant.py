"""Block quantization with stochastic rounding: what ``int8`` and ``int4`` share.

The vector is cut into blocks of ``block`` values (the last one shorter); each block
travels as its absmax ``scale`` (float32) and one integer per value in ``[-L, L]``, the
value being ``q * scale / L``. Rounding is stochastic, ``q = floor(x * L / scale + u)``
with ``u`` uniform in [0, 1), so ``E[decode(encode(x))] = x``: the quantizer is unbiased
and FedAvg's mean of quantized updates converges to the mean of the updates without error
feedback. The error of one value is below one step, ``scale / L``.

Why float32 scales: a block of tiny changes (absmax 1e-6, late in training) is below
float16's normal range, where a float16 scale keeps only a few bits; four bytes per block
of 256 values cost 1.6% of the int8 payload.

The random draws come from the caller's generator, one per value in order, so a seeded
edge sends the same bytes twice. Without one, a fresh generator seeded from the OS is
used (never torch's global generator, which training code also draws from).
"""

from __future__ import annotations

import numpy as np
import torch

from ..wire.payload import WireError
from .codec import Parts, check_finite, check_layout
from .integer import MAX_BLOCK, MIN_BLOCK, IntegerCodec

DEFAULT_BLOCK = 256


def fresh_generator() -> torch.Generator:
    """A generator seeded from the OS: for callers that did not ask for determinism."""
    generator = torch.Generator()
    generator.seed()
    return generator


def parse_block(name: str, arg: str | None) -> int:
    """The block size of ``int8:128``: ValueError naming the codec unless it is an integer
    in [MIN_BLOCK, MAX_BLOCK]."""
    if arg is None:
        return DEFAULT_BLOCK
    if not (arg.isascii() and arg.isdigit() and len(arg) <= 6):
        raise ValueError(f"codec {name!r}: block size {arg!r} is not an integer")
    block = int(arg)
    if not MIN_BLOCK <= block <= MAX_BLOCK:
        raise ValueError(f"codec {name!r}: block size {block} outside [{MIN_BLOCK}, {MAX_BLOCK}]")
    return block


def blocks_of(n: int, block: int) -> int:
    return -(-n // block)


def _split(t: torch.Tensor, block: int) -> list[torch.Tensor]:
    """``t`` (1-D) as 2-D views: its full blocks, then the shorter last block if any."""
    full = (t.numel() // block) * block
    views = [t[:full].view(-1, block)] if full else []
    if full < t.numel():
        views.append(t[full:].view(1, -1))
    return views


def quantize(x: torch.Tensor, block: int, levels: int, generator: torch.Generator | None,
             label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: q int8 ``(n,)`` in ``[-levels, levels]``, scale float32 per block.
    ValueError naming ``label`` when ``x`` holds a non-finite value."""
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"{label}: expected a 1-D float32 vector, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    n = x.numel()
    q = torch.empty(n, dtype=torch.int8)
    noise = torch.rand(n, generator=fresh_generator() if generator is None else generator)
    scales = []
    # two passes at most (the full blocks as one 2-D view, then the short last block)
    for xs, us, qs in zip(_split(x, block), _split(noise, block), _split(q, block), strict=True):
        scale = xs.abs().amax(dim=1)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"{label}: input holds non-finite values")
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a zero block stays 0
        # x / scale is exactly 1 at the absmax, so |y| <= levels; the clamp only catches
        # y + u rounding up to levels + 1 in float32.
        y = torch.div(xs, safe[:, None]).mul_(levels).add_(us).floor_().clamp_(-levels, levels)
        qs.copy_(y)
        scales.append(scale)
    scale = torch.cat(scales) if scales else torch.empty(0)
    return q, scale


def check_scale(label: str, scale: torch.Tensor) -> None:
    """A scale is an absmax: finite and >= 0 (WireError naming ``label``)."""
    check_finite(label, scale)
    if scale.numel() and bool((scale < 0).any()):
        raise WireError(f"{label}: negative value")


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int, levels: int,
               label: str) -> torch.Tensor:
    """The float32 vector of ``q * scale / levels`` (q already range-checked)."""
    q = q.contiguous()
    out = torch.empty(q.numel(), dtype=torch.float32)
    step = scale / levels
    start = 0
    for qs, os_ in zip(_split(q, block), _split(out, block), strict=True):
        torch.mul(qs, step[start:start + qs.shape[0], None], out=os_)
        start += qs.shape[0]
    check_finite(f"{label} decoded", out)
    return out


class BlockQuantizer(IntegerCodec):
    """A block quantizer to ``levels`` levels each side of zero; its one argument is the
    block size (``int8:128``). Under SecAgg+ its values are masked at ``integer_bits``
    on the public grid, rounded stochastically as here (``round_levels``)."""

    levels = 0

    def __init__(self, arg: str | None = None):
        self.block = parse_block(self.name, arg)

    def round_levels(self, t: np.ndarray, generator: torch.Generator) -> np.ndarray:
        """Stochastic rounding, floor(t + u) with u uniform in [0, 1) (float64, one draw
        per value in order), so unbiased; held to [-levels, levels] as ``quantize`` holds
        it (t + u can round up to levels + 1 in floating point)."""
        noise = torch.rand(t.size, generator=generator, dtype=torch.float64).numpy()
        return np.clip(np.floor(t + noise), -self.levels, self.levels)

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.block}"

    def check_parts(self, parts: Parts, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts' q and scale, their layout checked, the scale's values checked."""
        check_layout(self, parts, n)
        q, scale = parts["q"], parts["scale"]
        check_scale(f"{self.name} scale", scale)
        return q, scale

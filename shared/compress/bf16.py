"""``bf16``: each value as bfloat16 (2 bytes; float32's exponent, 8 bits of mantissa).

Round to nearest even, so values bfloat16 represents travel exactly. Unlike fp16 it has
float32's range, so large weights never overflow; it pays with 3 fewer mantissa bits. A
non-finite input is refused on the sending side (it would poison every sum it enters), and
so is a finite value that rounds to Inf (within half an ulp of float32's maximum).
"""

from __future__ import annotations

import torch

from ..wire.payload import WireError
from .codec import Codec, Layout, Parts, check_finite


class BFloat16(Codec):
    name = "bf16"

    def layout(self, n: int) -> Layout:
        return {"values": (torch.bfloat16, (n,))}

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        values = x.to(torch.bfloat16)  # round to nearest even (c10::BFloat16)
        if values.numel() and not bool(torch.isfinite(values.sum(dtype=torch.float32))):
            if not bool(torch.isfinite(x).all()):
                raise ValueError("bf16: input holds non-finite values")
            if not bool(torch.isfinite(values).all()):
                raise ValueError("bf16: a value rounds beyond bfloat16's range")
        return {"values": values}

    def decode(self, parts: Parts, n: int) -> torch.Tensor:
        values = parts["values"]
        if values.shape != (n,):
            raise WireError(f"bf16 values: shape {tuple(values.shape)}, expected ({n},)")
        check_finite("bf16 values", values)
        return values.to(torch.float32)

"""``fp16``: each value as IEEE half precision (2 bytes). Values beyond fp16's range
(65504) are refused on the sending side rather than sent as Inf; round to nearest even,
so values fp16 represents travel exactly."""

from __future__ import annotations

import torch

from .codec import Codec, Layout, Parts, check_finite, check_layout

FP16_MAX = 65504.0


class Float16(Codec):
    name = "fp16"

    def layout(self, n: int) -> Layout:
        return {"values": (torch.float16, (n,))}

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        peak = float(x.abs().max()) if x.numel() else 0.0
        if not peak <= FP16_MAX:  # also catches NaN
            raise ValueError(f"fp16: |value| {peak:.4g} is beyond fp16's range ({FP16_MAX:g})")
        return {"values": x.to(torch.float16)}

    def decode(self, parts: Parts, n: int) -> torch.Tensor:
        check_layout(self, parts, n)
        values = parts["values"]
        check_finite("fp16 values", values)
        return values.to(torch.float32)

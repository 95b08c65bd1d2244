"""Efficient channel attention (Wang et al., 2020) as a pFedLA local attention layer."""

from __future__ import annotations

import math

import torch
from timm.layers import EcaModule


def eca_kernel_size(channels: int, gamma: float = 2.0, b: float = 1.0, min_kernel: int = 3) -> int:
    """k = |log2(C) / gamma + b / gamma| made odd (the ECA paper's eq. 12, as its code and
    timm compute it), then at least ``min_kernel``: timm forces 3, which is what
    reproduces pFedLA's hybrid LeNet count; the ECA paper's own code allows 1."""
    t = int(abs(math.log2(channels) + b) / gamma)
    return max(t if t % 2 else t + 1, min_kernel)


class ECA(EcaModule):
    """timm's ``EcaModule``: a bias-free 1-D convolution across the pooled channels."""

    is_attention = True

    def __init__(self, channels: int, gamma: float = 2.0, b: float = 1.0, min_kernel: int = 3):
        super().__init__(channels=None, kernel_size=eca_kernel_size(channels, gamma, b, min_kernel))

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x.mean((2, 3)).view(x.shape[0], 1, -1))
        return self.gate(y).view(x.shape[0], -1, 1, 1)

"""Squeeze-and-excitation (Hu et al., 2018) as a pFedLA local attention layer."""

from __future__ import annotations

import torch
from timm.layers import SEModule


class SE(SEModule):
    """timm's ``SEModule`` with hidden width max(1, C // reduction) and no biases: pFedLA's
    parameter counts pin that down (the paper's Tables 2 and 4: +140 on LeNet means reduction 4,
    +39,936 on AlexNet means reduction 16). ``mask`` is the excitation a in (0, 1)^C."""

    is_attention = True

    def __init__(self, channels: int, reduction: int = 4, bias: bool = False):
        super().__init__(channels, rd_channels=max(1, channels // reduction), bias=bias)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        squeeze = x.mean((2, 3), keepdim=True)
        return self.gate(self.fc2(self.act(self.bn(self.fc1(squeeze)))))

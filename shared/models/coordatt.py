"""Coordinate attention (Hou et al., 2021) as a pFedLA local attention layer."""

from __future__ import annotations

import torch
from timm.layers.coord_attn import CoordAttn
from torch import nn


class CoordAtt(CoordAttn):
    """The official form (github houqb/CoordAttention, coordatt.py): pool along H and along
    W, a shared 1x1 reduction to mip = max(min_mip, C // reduction) channels *with bias*,
    BatchNorm, h-swish, then 1x1 convolutions *with bias* back to C for each direction and a
    sigmoid. Built on timm's ``CoordAttn`` with those settings (timm's defaults are
    bias-free and would give 560 instead of 620 parameters on LeNet). The BatchNorm
    statistics belong to the attention layer."""

    is_attention = True

    def __init__(self, channels: int, reduction: int = 32, min_mip: int = 8):
        super().__init__(channels, rd_channels=max(min_mip, channels // reduction), bias=True,
                         act_layer=nn.Hardswish, norm_layer=nn.BatchNorm2d)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """a_h * a_w, broadcast to (N, C, H, W)."""
        height, width = x.shape[2], x.shape[3]
        y = torch.cat([x.mean(3, keepdim=True), x.mean(2, keepdim=True).transpose(-1, -2)], dim=2)
        y = self.act(self.bn1(self.conv1(y)))
        y_h, y_w = torch.split(y, [height, width], dim=2)
        return self.gate(self.conv_h(y_h)) * self.gate(self.conv_w(y_w.transpose(-1, -2)))

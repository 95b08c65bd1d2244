"""CBAM (Woo et al., 2018): channel then spatial attention, as a local attention layer."""

from __future__ import annotations

import torch
from timm.layers.cbam import CbamModule


class CBAM(CbamModule):
    """timm's ``CbamModule`` (the original form: shared bias-free MLP over average- and
    max-pooled channels, reduction 16; a 7x7 convolution with BatchNorm over the channel
    mean and max). Its BatchNorm statistics belong to the attention layer."""

    is_attention = True

    def __init__(self, channels: int, reduction: int = 16, spatial_kernel: int = 7):
        super().__init__(channels, rd_ratio=1.0 / reduction, spatial_kernel_size=spatial_kernel)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """The overall mask Mc(x) * Ms(x * Mc(x)), so that ``forward(x) = x * mask(x)``."""
        c = self.channel

        def mlp(pooled: torch.Tensor) -> torch.Tensor:
            return c.fc2(c.act(c.fc1(pooled)))

        m_c = c.gate(mlp(x.mean((2, 3), keepdim=True)) + mlp(x.amax((2, 3), keepdim=True)))
        refined = x * m_c
        s = self.spatial
        pooled = torch.cat([refined.mean(dim=1, keepdim=True), refined.amax(dim=1, keepdim=True)], 1)
        return m_c * s.gate(s.conv(pooled))

"""pFedLA's personalized hybrid attention layer (pFedLA_h, the paper's eqs. 7-8)."""

from __future__ import annotations

import torch
from torch import nn

from .coordatt import CoordAtt
from .eca import ECA
from .se import SE


class HybridAttention(nn.Module):
    """h_hat = (sum_k softmax(u)_k a_k) * h over the SE, ECA and CoordAtt masks a_k, with
    learnable logits u (one per mechanism, this layer's own), initialised equal so every
    weight starts at 1/3."""

    is_attention = True
    mechanisms = ("se", "eca", "ca")

    def __init__(self, channels: int, se_reduction: int = 4, eca_min_kernel: int = 3,
                 ca_reduction: int = 32):
        super().__init__()
        self.se = SE(channels, se_reduction)
        self.eca = ECA(channels, min_kernel=eca_min_kernel)
        self.ca = CoordAtt(channels, ca_reduction)
        self.logits = nn.Parameter(torch.zeros(len(self.mechanisms)))

    def weights(self) -> torch.Tensor:
        return self.logits.softmax(dim=0)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights()
        return w[0] * self.se.mask(x) + w[1] * self.eca.mask(x) + w[2] * self.ca.mask(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask(x)

    def private_figures(self) -> dict[str, float]:
        """The normalised weights per mechanism: private, recorded on the edge only."""
        weights = self.weights().detach().double().tolist()
        return dict(zip(self.mechanisms, weights, strict=True))

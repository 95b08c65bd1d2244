"""The FedSTAR authors' compact MobileNetV3-style encoder
(https://arxiv.org/abs/2511.18841, docs/methods/fedstar.md).

The paper says "MobileNetV3"; the authors' code builds a much smaller network: a 3x3
stride-2 stem (8 channels, hard-swish), nine inverted-residual blocks without squeeze-
excitation (expansion t, output channels c * width, n repeats, first stride s, from
[[1, 8, 1, 1], [4, 16, 2, 2], [4, 24, 2, 2], [4, 40, 2, 2], [4, 64, 2, 1]] at width 0.5),
a 1x1 convolution to d = 128 channels (hard-swish), global average pooling, dropout 0.1
and a linear classifier ``fc`` (d -> classes). The pooled, dropped-out 128-vector is the
feature h that FedSTAR's prototypes are made of. Written from that description with
torchvision's building blocks; nothing of the authors' code is used.
"""

from __future__ import annotations

import torch
from torch import nn

# (expansion, output channels before the width multiplier, repeats, first stride)
BLOCKS = ((1, 8, 1, 1), (4, 16, 2, 2), (4, 24, 2, 2), (4, 40, 2, 2), (4, 64, 2, 1))


class InvertedResidual(nn.Module):
    """1x1 expansion (ReLU, skipped at expansion 1) -> 3x3 depthwise (ReLU) -> 1x1
    projection (BN, no activation); a residual connection when the shape is kept."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int):
        super().__init__()
        from torchvision.ops.misc import Conv2dNormActivation  # lazily: see models/secnn.py

        hidden = in_channels * expansion
        layers: list[nn.Module] = []
        if expansion != 1:
            layers.append(Conv2dNormActivation(in_channels, hidden, kernel_size=1))
        layers += [
            Conv2dNormActivation(hidden, hidden, kernel_size=3, stride=stride, groups=hidden),
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return x + out if self.residual else out


class MobileNetV3Compact(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32,
                 width: float = 0.5, feature_dim: int = 128, dropout: float = 0.1):
        super().__init__()
        if image_size < 16:
            raise ValueError(f"mobilenet-v3-compact downsamples 16x: image_size must be >= 16, "
                             f"got {image_size}")
        from torchvision.ops.misc import Conv2dNormActivation  # lazily: see models/secnn.py

        channels = 8
        layers: list[nn.Module] = [Conv2dNormActivation(in_channels, channels, kernel_size=3,
                                                        stride=2, activation_layer=nn.Hardswish)]
        for expansion, c, repeats, stride in BLOCKS:
            out = int(c * width)
            for i in range(repeats):
                layers.append(InvertedResidual(channels, out, stride if i == 0 else 1, expansion))
                channels = out
        layers.append(Conv2dNormActivation(channels, feature_dim, kernel_size=1,
                                           activation_layer=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(torch.flatten(self.pool(self.features(x)), 1)))

"""A small CNN with squeeze-excitation blocks: Fed-SAP's split and GSR on a model that
trains in seconds on a CPU (tests, the demo). The SE modules are torchvision's
``SqueezeExcitation`` (the class MobileNetV3 uses), so every SE rule and hook treats both
models alike."""

from __future__ import annotations

import torch
from torch import nn
from torchvision.ops.misc import SqueezeExcitation


def _block(in_channels: int, out_channels: int, squeeze: int) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True),
            SqueezeExcitation(out_channels, squeeze)]


class SECNN(nn.Module):
    """conv 16 + SE(8) -> pool -> conv 32 + SE(8) -> pool -> conv 64 + SE(16) -> GAP -> FC.

    Three SE modules with 16, 32 and 64 channels (112 statistic floats per upload)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28):
        super().__init__()
        if image_size < 4:
            raise ValueError(f"se-cnn needs image_size >= 4, got {image_size}")
        self.features = nn.Sequential(
            *_block(in_channels, 16, 8), nn.MaxPool2d(2),
            *_block(16, 32, 8), nn.MaxPool2d(2),
            *_block(32, 64, 16),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))

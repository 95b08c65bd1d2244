"""A small CNN with squeeze-excitation blocks: Fed-SAP's split and GSR on a model that
trains in seconds on a CPU (tests, the demo). The SE modules are torchvision's
``SqueezeExcitation`` (the class MobileNetV3 uses), so every SE rule and hook treats both
models alike.

``tail=True`` (registry name ``se-cnn-tail``) adds one plain conv block (conv 64, BN,
ReLU) after the last SE module. Without it the last SE module sits directly before the
pooled linear classifier: its excitation is a per-channel scale of the pooled features,
so under Fed-SAP's split (excitation private) it acts as a private head, and Fed-SAP
cannot be told apart from FedPer (issue #24). With the tail, every SE module is followed
by shared convolutions, as in MobileNetV3-small, whose last SE sits in the last inverted
residual block, before the 1x1 conv to 576 channels and the two-layer classifier."""

from __future__ import annotations

import torch
from torch import nn


def _block(in_channels: int, out_channels: int, squeeze: int) -> list[nn.Module]:
    # Imported here: torchvision's import pulls in torch._dynamo (~1 s per process), which
    # every fl-server and fl-edge would pay at start-up for a model most runs never build.
    from torchvision.ops.misc import SqueezeExcitation

    return [nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True),
            SqueezeExcitation(out_channels, squeeze)]


class SECNN(nn.Module):
    """conv 16 + SE(8) -> pool -> conv 32 + SE(8) -> pool -> conv 64 + SE(16)
    [-> conv 64, with ``tail``] -> GAP -> FC.

    Three SE modules with 16, 32 and 64 channels (112 statistic floats per upload)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28,
                 tail: bool = False):
        super().__init__()
        if image_size < 4:
            raise ValueError(f"se-cnn needs image_size >= 4, got {image_size}")
        tail_block: list[nn.Module] = [nn.Conv2d(64, 64, 3, padding=1, bias=False),
                                       nn.BatchNorm2d(64), nn.ReLU(inplace=True)] if tail else []
        self.features = nn.Sequential(
            *_block(in_channels, 16, 8), nn.MaxPool2d(2),
            *_block(16, 32, 8), nn.MaxPool2d(2),
            *_block(32, 64, 16),
            *tail_block,
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def se_cnn_tail(num_classes: int, in_channels: int, image_size: int) -> SECNN:
    """``se-cnn`` with a conv block after its last SE module (see the module docstring)."""
    return SECNN(num_classes, in_channels, image_size, tail=True)

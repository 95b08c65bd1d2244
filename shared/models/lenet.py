"""The digits LeNet of pFedLA's Table 7 (and FedBN): two 5x5 convs, three FC layers, BN."""

from __future__ import annotations

import torch
from torch import nn


class LeNetBN(nn.Module):
    """conv(C,6,5) BN ReLU pool -> conv(6,16,5) BN ReLU pool -> FC 120 -> FC 84 -> FC classes.

    Padding 0, so a 28x28 input flattens to 16*4*4 = 256 as the paper's FC(256) needs.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.BatchNorm2d(6), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"lenet-bn needs image_size >= 16, got {image_size}")
        self.classifier = nn.Sequential(
            nn.Linear(16 * side * side, 120), nn.BatchNorm1d(120), nn.ReLU(inplace=True),
            nn.Linear(120, 84), nn.BatchNorm1d(84), nn.ReLU(inplace=True),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def lenet_attention_sites(model: nn.Module) -> list[tuple[str, int]]:
    """After each conv block (pFedLA Table 7): the two max-pools, 6 and 16 channels."""
    return [("features.3", 6), ("features.7", 16)]

"""FedBN's AlexNet with BatchNorm (pFedLA's Table 8), for Office-style 224x224 images."""

from __future__ import annotations

import torch
from torch import nn


class AlexNetBN(nn.Module):
    """conv 64/11/4 -> 192/5 -> 384/3 -> 256/3 -> 256/3, each with BN and ReLU (max-pools
    after the first, second and fifth), adaptive average pool 6x6, FC 4096 BN ReLU, FC 4096
    BN ReLU, FC classes. 57,149,535 parameters with 31 classes (the paper's 57.14 M)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 224):
        super().__init__()
        if image_size < 63:
            raise ValueError(f"alexnet-bn needs image_size >= 63, got {image_size}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 11, 4, 2), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, 1, 2), nn.BatchNorm2d(192), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, 1, 1), nn.BatchNorm2d(384), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, 1, 1), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, 1, 1), nn.BatchNorm2d(256), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Linear(256 * 6 * 6, 4096), nn.BatchNorm1d(4096), nn.ReLU(inplace=True),
            nn.Linear(4096, 4096), nn.BatchNorm1d(4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def alexnet_attention_sites(model: nn.Module) -> list[tuple[str, int]]:
    """After each of the five conv blocks (pFedLA Table 8 / Table 5's five layers)."""
    return [("features.3", 64), ("features.7", 192), ("features.10", 384),
            ("features.13", 256), ("features.17", 256)]

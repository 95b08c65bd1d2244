"""NIID-Bench's simple CNN: the model of the published table the system is calibrated on.

Li, Diao, Chen and He, "Federated Learning on Non-IID Data Silos: An Experimental Study"
(ICDE 2022, https://arxiv.org/abs/2102.02079), Section V, and Flower's reproduction of it,
whose table bench/calibrate.py compares against:
https://github.com/adap/flower/blob/main/baselines/niid_bench/niid_bench/models.py (class
``CNN``: input_dim 400, hidden_dims [120, 84]). Why its own model and not ``lenet-bn``: the
calibration must train exactly the published network, and that one has no BatchNorm, 3
input channels and padding 0 at 32x32 (16 x 5 x 5 = 400 features), 62,006 parameters
for 10 classes.
"""

from __future__ import annotations

import torch
from torch import nn


class NiidBenchCNN(nn.Module):
    """conv(C,6,5) ReLU pool -> conv(6,16,5) ReLU pool -> FC 120 ReLU -> FC 84 ReLU -> FC classes.

    The same layers, in the same order and with PyTorch's default initialisation, as the
    reproduction's ``CNN``; the flattened width follows ``image_size`` (400 at 32x32) so
    that the model also builds for the MNIST form (256 at 28x28, its ``CNNMnist``)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32):
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"niid-cnn needs image_size >= 16, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

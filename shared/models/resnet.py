"""ResNet-18 for 32x32 images: torchvision's network with the usual CIFAR stem."""

from __future__ import annotations

from torch import nn


def cifar_resnet18(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> nn.Module:
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model

"""ResNets for 32x32 images with the usual CIFAR stem (3x3 stride-1 conv, no max-pool):
torchvision's ResNet-18, and a compact ResNet-10 built from torchvision's ``BasicBlock``
for CPU runs. Both keep torchvision's attribute names (conv1, bn1, relu, maxpool,
layer1-4, avgpool, fc), so ``resnet_tokens`` reads the last stage of either as tokens."""

from __future__ import annotations

import torch
from torch import nn


def cifar_resnet18(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> nn.Module:
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class CompactCifarResNet(nn.Module):
    """One ``BasicBlock`` per stage, widths 16-32-64-128, strides 1-2-2-2: a 32x32 input
    leaves 4x4 = 16 tokens of width 128 (as ResNet-18's 16 x 512) at about 1/36 of its
    compute."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32,
                 widths: tuple[int, ...] = (16, 32, 64, 128)):
        from torchvision.models.resnet import BasicBlock

        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, widths[0], kernel_size=3, stride=1, padding=1,
                               bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
        inplanes = widths[0]
        for index, width in enumerate(widths, start=1):
            stride = 1 if index == 1 else 2
            downsample = None
            if stride != 1 or inplanes != width:
                downsample = nn.Sequential(
                    nn.Conv2d(inplanes, width, kernel_size=1, stride=stride, bias=False),
                    nn.BatchNorm2d(width))
            setattr(self, f"layer{index}",
                    nn.Sequential(BasicBlock(inplanes, width, stride, downsample)))
            inplanes = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):  # torchvision's ResNet initialisation
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(_last_stage(self, x)), 1))


def compact_cifar_resnet(num_classes: int = 10, in_channels: int = 3,
                         image_size: int = 32) -> nn.Module:
    return CompactCifarResNet(num_classes, in_channels, image_size)


def _last_stage(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
    return model.layer4(model.layer3(model.layer2(model.layer1(x))))


def resnet_tokens(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The last stage's feature map (B, d, h, w) as h*w tokens: (B, h*w, d). The model's
    own forward is its head (``fc``) on the mean of these tokens."""
    return _last_stage(model, x).flatten(2).transpose(1, 2)

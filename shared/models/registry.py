"""Model registry: name -> builder, with the head (classifier) each split rule needs.

Every builder takes (num_classes, in_channels, image_size) from the run config and
builds with random initialisation only: nothing is ever downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .lenet import LeNetBN
from .resnet import cifar_resnet18, compact_cifar_resnet, resnet_tokens
from .secnn import SECNN


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[int, int, int], nn.Module]
    head: str  # state-dict prefix of the final classifier layer
    description: str
    # (model, x) -> (B, N, d) last-stage feature tokens, for methods that attend over
    # them (pFedKA); the model's forward is then its head on the tokens' mean.
    tokens: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None


def _mobilenet_v3_small(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    from torchvision.models import mobilenet_v3_small

    model = mobilenet_v3_small(weights=None, num_classes=num_classes)
    if in_channels != 3:
        stem = model.features[0][0]
        model.features[0][0] = nn.Conv2d(in_channels, stem.out_channels, stem.kernel_size,
                                         stem.stride, stem.padding, bias=False)
    return model


def _timm(name: str) -> Callable[[int, int, int], nn.Module]:
    def build(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
        import timm  # imported lazily: it is heavy and only some models need it

        return timm.create_model(name, pretrained=False, num_classes=num_classes,
                                 in_chans=in_channels)

    return build


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("lenet-bn", LeNetBN, "classifier.6",
                  "pFedLA's LeNet with BatchNorm (METHODS.md 4.3), padding 0"),
        ModelSpec("se-cnn", SECNN, "classifier",
                  "a small 3-block CNN with 3 SE modules, for tests and the demo"),
        ModelSpec("mobilenet-v3-small", _mobilenet_v3_small, "classifier.3",
                  "torchvision mobilenet_v3_small, 9 SE modules (the Fed-SAP backbone)"),
        ModelSpec("resnet18-cifar", cifar_resnet18, "fc",
                  "ResNet-18 with a 3x3 stride-1 stem and no max-pool, for 32x32 inputs",
                  resnet_tokens),
        ModelSpec("resnet10-cifar-compact", compact_cifar_resnet, "fc",
                  "CIFAR-stem ResNet-10 (one BasicBlock per stage, widths 16-32-64-128), "
                  "for CPU runs", resnet_tokens),
        ModelSpec("nf-resnet26", _timm("nf_resnet26"), "head.fc",
                  "timm normalization-free ResNet-26 (random init)"),
    )
}


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r} (known: {known})") from None


def build_model(name: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return model_spec(name).build(num_classes, in_channels, image_size)

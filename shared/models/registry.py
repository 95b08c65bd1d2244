"""Model registry: name -> builder, with the head (classifier) each split rule needs.

Every builder takes (num_classes, in_channels, image_size) from the run config and
builds with random initialisation only: nothing is ever downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .alexnet import AlexNetBN, alexnet_attention_sites
from .lenet import LeNetBN, lenet_attention_sites
from .resnet import cifar_resnet18
from .secnn import SECNN

AttentionSites = Callable[[nn.Module], list[tuple[str, int]]]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[int, int, int], nn.Module]
    head: str  # state-dict prefix of the final classifier layer
    description: str
    # Where local attention layers go (pFedLA): (module path, channels) of parameter-free
    # modules after which one is inserted; None for backbones without such sites.
    attention_sites: AttentionSites | None = None
    se_reduction: int = 4  # the SE reduction pFedLA's parameter counts pin for this backbone


def _mobilenet_v3_small(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    from torchvision.models import mobilenet_v3_small

    model = mobilenet_v3_small(weights=None, num_classes=num_classes)
    if in_channels != 3:
        stem = model.features[0][0]
        model.features[0][0] = nn.Conv2d(in_channels, stem.out_channels, stem.kernel_size,
                                         stem.stride, stem.padding, bias=False)
    return model


def _mobilenet_v2(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    from torchvision.models import mobilenet_v2

    model = mobilenet_v2(weights=None, num_classes=num_classes)
    if in_channels != 3:
        stem = model.features[0][0]
        model.features[0][0] = nn.Conv2d(in_channels, stem.out_channels, stem.kernel_size,
                                         stem.stride, stem.padding, bias=False)
    return model


def _mobilenet_v2_attention_sites(model: nn.Module) -> list[tuple[str, int]]:
    """Inside every inverted-residual bottleneck, after the depthwise 3x3 block's ReLU6 and
    before the linear 1x1 projection (pFedLA Table 10)."""
    from torchvision.models.mobilenetv2 import InvertedResidual

    sites = []
    for name, block in model.named_modules():
        if isinstance(block, InvertedResidual):
            index = len(block.conv) - 3  # [expand,] depthwise, project conv, project BN
            depthwise = block.conv[index]
            sites.append((f"{name}.conv.{index}.2", depthwise[0].out_channels))
    return sites


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
                  "pFedLA's LeNet with BatchNorm (METHODS.md 4.3), padding 0",
                  lenet_attention_sites, se_reduction=4),
        ModelSpec("alexnet-bn", AlexNetBN, "classifier.6",
                  "FedBN's AlexNet with BatchNorm (pFedLA Table 8), for 224x224 images",
                  alexnet_attention_sites, se_reduction=16),
        ModelSpec("mobilenet-v2", _mobilenet_v2, "classifier.1",
                  "torchvision mobilenet_v2 (random init); pFedLA's detection backbone",
                  _mobilenet_v2_attention_sites, se_reduction=4),
        ModelSpec("se-cnn", SECNN, "classifier",
                  "a small 3-block CNN with 3 SE modules, for tests and the demo"),
        ModelSpec("mobilenet-v3-small", _mobilenet_v3_small, "classifier.3",
                  "torchvision mobilenet_v3_small, 9 SE modules (the Fed-SAP backbone)"),
        ModelSpec("resnet18-cifar", cifar_resnet18, "fc",
                  "ResNet-18 with a 3x3 stride-1 stem and no max-pool, for 32x32 inputs"),
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

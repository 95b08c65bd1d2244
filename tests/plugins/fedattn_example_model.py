"""A model outside fedattn, as a user's package would hold one: a two-block CNN with
squeeze-excitation, in two forms.

``tiny_se_net`` is a bare builder, named ``fedattn_example_model:tiny_se_net``: fedattn finds
its head by inspection (the last Linear whose outputs are the classes) and knows nothing
else of it, so pFedLA (attention sites) and pFedKA (encoder tokens) refuse it naming what to
declare. ``TINY_SE`` is the same network declared in full (head, attention sites, token
reader) as a ``ModelSpec``; the distribution beside this module registers it as the
``fedattn.models`` entry point ``example-tiny-se``, so every method can use it.

The SE modules are torchvision's ``SqueezeExcitation``: the split rules Fed-SAP uses
(``se-e``) find them without a declaration."""

from __future__ import annotations

import torch
from torch import nn
from torchvision.ops.misc import SqueezeExcitation

from fedattn_shared.models import ModelSpec


class TinySENet(nn.Module):
    """conv 8 + BN + SE -> pool -> conv 16 + BN + SE -> GAP -> Linear."""

    def __init__(self, num_classes: int, in_channels: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            SqueezeExcitation(8, 4), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            SqueezeExcitation(16, 4))
        self.classifier = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean(dim=(2, 3)))


def tiny_se_net(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """A two-block CNN with squeeze-excitation (tests/plugins)."""
    return TinySENet(num_classes, in_channels)


def attention_sites(model: nn.Module) -> list[tuple[str, int]]:
    """pFedLA's sites: after each block's ReLU, before its SE (module path, channels)."""
    return [("features.2", 8), ("features.7", 16)]


def tokens(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, H*W, 16): the last block's positions, whose mean the classifier reads."""
    return model.features(x).flatten(2).transpose(1, 2)


TINY_SE = ModelSpec("example-tiny-se", tiny_se_net, "classifier",
                    "a two-block CNN with squeeze-excitation, declared in full",
                    attention_sites=attention_sites, tokens=tokens)

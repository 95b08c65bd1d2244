"""Local attention layers by name, and their insertion into a backbone.

A backbone names its attention sites (``ModelSpec.attention_sites``): parameter-free
modules (an activation or a pooling) after whose output an attention layer goes. Insertion
replaces each site by ``Sequential(site, attention)``, so every existing state-dict key
stays as it was and the attention tensors are ``<site>.1.*``. Every attention layer sets
``is_attention``, which the split rule ``attention`` keeps on the edge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .cbam import CBAM
from .coordatt import CoordAtt
from .eca import ECA
from .hybrid import HybridAttention
from .se import SE

KINDS = ("se", "eca", "ca", "cbam", "hybrid")


@dataclass(frozen=True)
class AttentionSpec:
    kind: str
    se_reduction: int = 4      # SE hidden width C // r (pFedLA: 4 on LeNet, 16 on AlexNet)
    eca_min_kernel: int = 3    # timm's floor on the ECA kernel; 1 is the ECA paper's own
    ca_reduction: int = 32     # CoordAtt mip = max(8, C // r)
    cbam_reduction: int = 16

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"attention {self.kind!r} is not one of {', '.join(KINDS)}")
        for name in ("se_reduction", "eca_min_kernel", "ca_reduction", "cbam_reduction"):
            if getattr(self, name) < 1:
                raise ValueError(f"attention {name} must be >= 1, got {getattr(self, name)}")

    def build(self, channels: int) -> nn.Module:
        if self.kind == "se":
            return SE(channels, self.se_reduction)
        if self.kind == "eca":
            return ECA(channels, min_kernel=self.eca_min_kernel)
        if self.kind == "ca":
            return CoordAtt(channels, self.ca_reduction)
        if self.kind == "cbam":
            return CBAM(channels, self.cbam_reduction)
        return HybridAttention(channels, self.se_reduction, self.eca_min_kernel, self.ca_reduction)


def insert_attention(model: nn.Module, sites: list[tuple[str, int]],
                     build: Callable[[int], nn.Module]) -> list[str]:
    """Puts ``build(channels)`` after each site ``(module path, channels)``; returns the
    attention layers' module paths, in site order."""
    paths = []
    for path, channels in sites:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        site = getattr(parent, name)
        if any(True for _ in site.parameters()) or any(True for _ in site.buffers()):
            raise ValueError(f"attention site {path} holds tensors; sites must be "
                             "parameter-free (an activation or a pooling)")
        setattr(parent, name, nn.Sequential(site, build(channels)))
        paths.append(f"{path}.1")
    return paths


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level attention layers (not the mechanisms inside a hybrid), in forward order
    for the backbones here (registration order)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if getattr(module, "is_attention", False) and not any(
                name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found

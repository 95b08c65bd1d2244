"""ANFR (adaptive normalization-free feature recalibration) and the paper's baselines.

Source: the ANFR paper (https://arxiv.org/abs/2410.02006); docs/methods/anfr.md. ANFR is timm's
NF-ResNet (pre-activation bottleneck, ScaledStdConv2d weight standardisation, residual
scale alpha = 0.2) with a channel-attention module after conv3, multiplied by
attn_gain = 2.0: timm registers it as ``nf_seresnet*`` and ``nf_ecaresnet*``; CBAM is
``nf_resnet50(attn_layer='cbam')``. The paper's baselines are BN-ResNet (``resnet50``),
GN-ResNet (the same with GroupNorm), SE-ResNet (``seresnet50``) and NF-ResNet
(``nf_resnet50``).

Depths:
  * ``-50`` / ``-26``: the paper's models, exactly timm's (Table 6 parameter counts);
  * ``-compact``: the same blocks at one bottleneck per stage and a quarter of the width
    (7x7 stem of 64 channels, bottleneck widths 16-32-64-128, stage outputs 64-128-256-512),
    for CPU runs on 32x32 images. The BN/GN/SE baselines at compact depth use timm's ResNet with the
    same stem, stage widths and depths, so every family differs only in normalisation and
    attention.

timm's CBAM spatial branch is ``ConvNormAct(2, 1, 7, apply_act=False)``: a BatchNorm2d(1)
in every block, so ``anfr-cbam-*`` is not strictly BN-free (and Opacus' validator, which
matches exact types, does not notice: ``privacy.dp_model.batchnorm_layers`` does). The ``-gn`` variants
replace each of those one-channel BatchNorms by GroupNorm(1, 1) (what Opacus'
``ModuleValidator.fix`` would do), a DP-clean form: a per-sample standardisation of the
spatial-attention logits, degenerate on a 1x1 map (the compact model's last stage at
32 px), fine at the paper's 224 px.

Everything is built with random initialisation: pretrained weights come in through
``fl-server --init-weights``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

COMPACT_DEPTHS = (1, 1, 1, 1)
COMPACT_STEM = 64                          # timm ResNet's 7x7 stem is always 64 wide
COMPACT_CHANNELS = (64, 128, 256, 512)     # stage outputs; bottleneck width is a quarter
COMPACT_GROUPS = 8                         # GroupNorm groups at compact width (16 channels min)
RESNET50_GROUPS = 32                       # the usual GN-ResNet-50
# timm's attention settings for nf_seresnet*/nf_ecaresnet* (as the ANFR paper uses them).
ATTENTION_KWARGS: dict[str, dict] = {"se": {"rd_ratio": 1 / 16}, "eca": {}, "cbam": {}}

Builder = Callable[[int, int, int], nn.Module]


def opacus_groups(channels: int) -> int:
    """GroupNorm groups for a replaced BatchNorm of ``channels``: gcd(32, C), as Opacus'
    ``ModuleValidator.fix`` chooses."""
    return math.gcd(32, channels)


def batchnorm_to_groupnorm(model: nn.Module, groups: Callable[[int], int] = lambda c: 1) -> nn.Module:
    """Replace every BatchNorm (subclasses included) by GroupNorm(groups(C), C) in place.
    timm's ``BatchNormAct2d`` becomes a ``GroupNormAct`` that keeps its dropout and
    activation modules, so the block computes norm -> drop -> act as before and the
    parameter names stay. Default one group: ANFR(CBAM)'s one-channel spatial norm."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, _BatchNorm):
                continue
            channels = child.num_features
            act, drop = getattr(child, "act", None), getattr(child, "drop", None)
            if isinstance(act, nn.Module) and isinstance(drop, nn.Module):
                from timm.layers import GroupNormAct

                norm = GroupNormAct(channels, groups(channels), eps=child.eps, affine=child.affine)
                norm.act, norm.drop = act, drop
            else:
                norm = nn.GroupNorm(groups(channels), channels, eps=child.eps, affine=child.affine)
            setattr(module, child_name, norm)
    return model


def timm_model(name: str, dp_clean: bool = False, gn_groups: int = 0, **kwargs) -> Builder:
    """A timm-registered model by name, random init, ``kwargs`` overlaid on its config
    (``attn_layer``); ``gn_groups`` > 0 builds it with GroupNorm of that many groups."""

    def build(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
        import timm  # imported lazily: it is heavy and only some models need it

        extra = dict(kwargs)
        if gn_groups:
            extra["norm_layer"] = functools.partial(timm.layers.GroupNorm, num_groups=gn_groups)
        model = timm.create_model(name, pretrained=False, num_classes=num_classes,
                                  in_chans=in_channels, **extra)
        return batchnorm_to_groupnorm(model) if dp_clean else model

    return build


def compact_nf(attention: str | None, dp_clean: bool = False, skipinit: bool = False) -> Builder:
    """The compact NF-ResNet (``attention`` None) or ANFR: timm's NormFreeNet with the
    ``_nfres_cfg`` settings of nf_resnet50 (7x7 stem + max-pool, ReLU, bottle ratio 0.25)
    at compact depth and width.

    ``skipinit``: timm's ``NfCfg(skipinit=True)`` (SkipInit, De & Smith 2020): conv3's gain
    starts at 1 and a scalar ``skipinit_gain`` starting at 0 scales the whole residual
    branch. Why: in the default form conv3's per-channel gain starts at 0, so the attention
    module pools an all-zero input, gets no gradient, and its gates stay at 0.5 for as long
    as the gains stay small (docs/methods/anfr.md); under SkipInit it sees O(1)
    standardised features from the first step, while the block still starts as the
    identity map."""

    def build(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
        from timm.models.nfnet import NfCfg, NormFreeNet

        cfg = NfCfg(depths=COMPACT_DEPTHS, channels=COMPACT_CHANNELS, stem_type="7x7_pool",
                    stem_chs=COMPACT_STEM, bottle_ratio=0.25, act_layer="relu",
                    attn_layer=attention, attn_kwargs=dict(ATTENTION_KWARGS.get(attention, {})),
                    skipinit=skipinit)
        model = NormFreeNet(cfg, num_classes=num_classes, in_chans=in_channels)
        return batchnorm_to_groupnorm(model) if dp_clean else model

    return build


def compact_resnet(norm: str, attention: str | None = None) -> Builder:
    """timm's ResNet (post-activation bottleneck, 7x7 stem + max-pool) at compact depth and
    width, with BatchNorm (``norm='bn'``) or GroupNorm (``'gn'``), optionally SE."""

    def build(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
        from timm.layers import GroupNorm
        from timm.models.resnet import Bottleneck, ResNet

        norm_layer = (nn.BatchNorm2d if norm == "bn"
                      else functools.partial(GroupNorm, num_groups=COMPACT_GROUPS))
        block_args = {"attn_layer": attention} if attention else {}
        return ResNet(Bottleneck, list(COMPACT_DEPTHS), num_classes=num_classes,
                      in_chans=in_channels, stem_width=COMPACT_STEM,
                      channels=tuple(c // Bottleneck.expansion for c in COMPACT_CHANNELS),
                      norm_layer=norm_layer, block_args=block_args)

    return build

"""Model registry: name -> builder, with the head (classifier) each split rule needs.

Every builder takes (num_classes, in_channels, image_size) from the run config and
builds with random initialisation only: nothing is ever downloaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from . import reference
from .alexnet import AlexNetBN, alexnet_attention_sites
from .anfr import (
    COMPACT_GROUPS,
    RESNET50_GROUPS,
    batchnorm_to_groupnorm,
    compact_nf,
    compact_resnet,
    opacus_groups,
    timm_model,
)
from .lenet import LeNetBN, lenet_attention_sites
from .mobilenet_compact import MobileNetV3Compact
from .niid_cnn import NiidBenchCNN
from .reference import parse_reference, resolve_reference
from .resnet import cifar_resnet18, compact_cifar_resnet, resnet_tokens
from .secnn import SECNN, se_cnn_tail

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
                  "pFedLA's LeNet with BatchNorm, padding 0",
                  lenet_attention_sites, se_reduction=4),
        ModelSpec("niid-cnn", NiidBenchCNN, "fc3",
                  "NIID-Bench's simple CNN (Li et al., ICDE'22): conv 6 and 16 ch 5x5, "
                  "FC 120-84-classes, no BatchNorm; bench/calibrate.py's model"),
        ModelSpec("alexnet-bn", AlexNetBN, "classifier.6",
                  "FedBN's AlexNet with BatchNorm (pFedLA Table 8), for 224x224 images",
                  alexnet_attention_sites, se_reduction=16),
        ModelSpec("mobilenet-v2", _mobilenet_v2, "classifier.1",
                  "torchvision mobilenet_v2 (random init); pFedLA's detection backbone",
                  _mobilenet_v2_attention_sites, se_reduction=4),
        ModelSpec("se-cnn", SECNN, "classifier",
                  "a small 3-block CNN with 3 SE modules, for tests and the demo"),
        ModelSpec("se-cnn-tail", se_cnn_tail, "classifier",
                  "se-cnn with a conv block after the last SE module: no SE directly "
                  "before the head (Fed-SAP's CPU bench)"),
        ModelSpec("mobilenet-v3-small", _mobilenet_v3_small, "classifier.3",
                  "torchvision mobilenet_v3_small, 9 SE modules (the Fed-SAP backbone)"),
        ModelSpec("mobilenet-v3-compact", MobileNetV3Compact, "fc",
                  "the FedSTAR authors' compact MobileNetV3-style encoder, d = 128"),
        ModelSpec("resnet18-cifar", cifar_resnet18, "fc",
                  "ResNet-18 with a 3x3 stride-1 stem and no max-pool, for 32x32 inputs",
                  tokens=resnet_tokens),
        ModelSpec("resnet10-cifar-compact", compact_cifar_resnet, "fc",
                  "CIFAR-stem ResNet-10 (one BasicBlock per stage, widths 16-32-64-128), "
                  "for CPU runs", tokens=resnet_tokens),
        ModelSpec("nf-resnet26", _timm("nf_resnet26"), "head.fc",
                  "timm normalization-free ResNet-26 (random init)"),
        # ANFR (https://arxiv.org/abs/2410.02006) and the paper's baselines: models/anfr.py.
        ModelSpec("anfr-se-26", timm_model("nf_seresnet26"), "head.fc",
                  "ANFR(SE), timm nf_seresnet26: NF-ResNet-26 + 8 SE modules"),
        ModelSpec("anfr-se-50", timm_model("nf_seresnet50"), "head.fc",
                  "ANFR(SE), timm nf_seresnet50 (28.09 M parameters, 16 SE)"),
        ModelSpec("anfr-eca-26", timm_model("nf_ecaresnet26"), "head.fc",
                  "ANFR(ECA), timm nf_ecaresnet26"),
        ModelSpec("anfr-eca-50", timm_model("nf_ecaresnet50"), "head.fc",
                  "ANFR(ECA), timm nf_ecaresnet50 (25.56 M, 16 ECA)"),
        ModelSpec("anfr-cbam-50", timm_model("nf_resnet50", attn_layer="cbam"), "head.fc",
                  "ANFR(CBAM), timm nf_resnet50 + CBAM (28.07 M; one BatchNorm2d(1) per block)"),
        ModelSpec("anfr-cbam-50-gn", timm_model("nf_resnet50", dp_clean=True, attn_layer="cbam"),
                  "head.fc", "ANFR(CBAM) with CBAM's BatchNorm2d(1) as GroupNorm(1, 1): DP-clean"),
        ModelSpec("bn-resnet-50", timm_model("resnet50"), "fc", "BN-ResNet-50, timm resnet50"),
        ModelSpec("gn-resnet-50", timm_model("resnet50", gn_groups=RESNET50_GROUPS), "fc",
                  f"GN-ResNet-50: timm resnet50 with GroupNorm({RESNET50_GROUPS})"),
        ModelSpec("se-resnet-50", timm_model("seresnet50"), "fc",
                  "SE-ResNet-50 (BN + SE), timm seresnet50"),
        ModelSpec("nf-resnet-50", timm_model("nf_resnet50"), "head.fc",
                  "NF-ResNet-50, timm nf_resnet50"),
        ModelSpec("anfr-se-compact", compact_nf("se"), "head.fc",
                  "ANFR(SE) at compact depth/width for CPU runs (1 block per stage, 1/4 width)"),
        ModelSpec("anfr-eca-compact", compact_nf("eca"), "head.fc", "ANFR(ECA), compact"),
        ModelSpec("anfr-cbam-compact", compact_nf("cbam"), "head.fc",
                  "ANFR(CBAM), compact (one BatchNorm2d(1) per block)"),
        ModelSpec("anfr-cbam-compact-gn", compact_nf("cbam", dp_clean=True), "head.fc",
                  "ANFR(CBAM), compact, CBAM's BatchNorm2d(1) as GroupNorm(1, 1): DP-clean"),
        ModelSpec("nf-resnet-compact", compact_nf(None), "head.fc", "NF-ResNet, compact"),
        # SkipInit forms (timm NfCfg skipinit=True): conv3 gain 1, a zero branch scale, so
        # the attention sees live features from the first step; the pair differs only in it.
        ModelSpec("anfr-se-compact-skipinit", compact_nf("se", skipinit=True), "head.fc",
                  "ANFR(SE), compact, SkipInit (conv3 gain 1, branch scale skipinit_gain 0)"),
        ModelSpec("nf-resnet-compact-skipinit", compact_nf(None, skipinit=True), "head.fc",
                  "NF-ResNet, compact, SkipInit (conv3 gain 1, branch scale skipinit_gain 0)"),
        ModelSpec("bn-resnet-compact", compact_resnet("bn"), "fc", "BN-ResNet, compact"),
        ModelSpec("gn-resnet-compact", compact_resnet("gn"), "fc",
                  f"GN-ResNet, compact, GroupNorm({COMPACT_GROUPS})"),
        ModelSpec("se-resnet-compact", compact_resnet("bn", "se"), "fc",
                  "SE-ResNet (BN + SE), compact"),
    )
}


# ``<model>+gn``: the model with every BatchNorm (subclasses included) replaced by
# GroupNorm(gcd(32, C), C) plus its activation, so that DP-SGD's per-sample gradients are
# not mixed by batch statistics (``--dp-fix-model`` resolves the model name to this).
GROUPNORM_SUFFIX = "+gn"


def _with_groupnorm(build: Callable[[int, int, int], nn.Module]) -> Callable[[int, int, int], nn.Module]:
    def fixed(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
        return batchnorm_to_groupnorm(build(num_classes, in_channels, image_size), opacus_groups)

    return fixed


def model_spec(name: str) -> ModelSpec:
    """The spec of a model name: a built-in (``MODELS``) or a reference (``timm:NAME``,
    ``torchvision:NAME``, a ``fedattn.models`` entry point, ``package.module:callable``:
    models/reference.py), each also as ``<name>+gn``. A ``module:callable`` is imported
    here: an edge checks its server's name first (``check_model_allowed``)."""
    base = name.removesuffix(GROUPNORM_SUFFIX) if isinstance(name, str) else name
    ref = parse_reference(base, MODELS)
    if ref.is_reference:
        spec = resolve_reference(base, ref, ModelSpec)
    elif base in MODELS:
        spec = MODELS[base]
    else:  # pragma: no cover - parse_reference returns builtin for MODELS names only
        raise ValueError(f"unknown model {name!r}")
    if base == name:
        return spec
    return dataclasses.replace(spec, name=name, build=_with_groupnorm(spec.build),
                               description=f"{spec.description}; BatchNorm -> GroupNorm")


def check_model_allowed(name: str, allowed_specs: Collection[str] = ()) -> None:
    """The edge's check of a model its server names (models/reference.py), ``+gn`` aside."""
    reference.check_model_allowed(name.removesuffix(GROUPNORM_SUFFIX) if isinstance(name, str)
                                  else name, MODELS, allowed_specs)


def own_model_allowance(name: str | None) -> list[str]:
    """``--allow-model SPEC`` for a tool's own edges when the model it chose (not a remote
    server) is a module:callable; [] otherwise (fl-demo, fl-sim)."""
    if not name:
        return []
    base = name.removesuffix(GROUPNORM_SUFFIX)
    return ["--allow-model", base] if parse_reference(base, MODELS).kind == "module" else []


def build_model(name: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return model_spec(name).build(num_classes, in_channels, image_size)


def model_error(err: Exception) -> str:
    """A library's or a user's model failure in one line for a refusal: its type and the
    first line of its message (a traceback's worth of shapes would bury the advice)."""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first}"


def check_model_input(name: str, num_classes: int, in_channels: int, size: int) -> None:
    """Refuse (ValueError naming ``train.input_size``) a referenced model that cannot take the
    run's inputs, at start: a library model may need a minimum side (ConvNeXt's 4x4 stem and
    2x2 downsamplers leave nothing of 28 px) or a fixed one (a ViT's position embeddings),
    and an edge would otherwise learn it only in its first training step. One sample goes
    through on the meta device (shapes only, no memory); a model whose forward reads values,
    which meta tensors lack, is tried again on the CPU, so only what a real input does to it
    refuses it. Built-ins are left alone: their sizes are the registry's own."""
    if not parse_reference(name.removesuffix(GROUPNORM_SUFFIX), MODELS).is_reference:
        return
    build = model_spec(name).build
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # the run's seeded draws untouched
        try:
            with torch.device("meta"):
                build(num_classes, in_channels, size).eval()(torch.empty(1, in_channels, size, size))
            return
        except Exception:  # noqa: BLE001 - judged below on real values, where it counts
            pass
        try:
            build(num_classes, in_channels, size).eval()(torch.zeros(1, in_channels, size, size))
        except Exception as err:  # noqa: BLE001 - the user's or a library's model: any failure
            raise ValueError(f"model {name!r} cannot take {in_channels}x{size}x{size} inputs "
                             f"({model_error(err)}); set train.input_size to a side it "
                             "takes (--set train.input_size=N: every edge resizes its images to "
                             "it)") from None

"""The local attention layers: shapes, mask ranges, parameter counts against pFedLA's Tables
2 and 4 (METHODS.md 4.2), the ECA kernel table, the hybrid's weights, and insertion into
the backbones."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedattn_shared.methods.split import private_names
from fedattn_shared.models import build_model, model_spec
from fedattn_shared.models.attention import KINDS, AttentionSpec, attention_modules, insert_attention
from fedattn_shared.models.cbam import CBAM
from fedattn_shared.models.coordatt import CoordAtt
from fedattn_shared.models.eca import ECA, eca_kernel_size
from fedattn_shared.models.hybrid import HybridAttention
from fedattn_shared.models.se import SE


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("channels", [6, 16, 64])
def test_shape_mask_range_and_forward_is_the_mask(kind, channels):
    torch.manual_seed(0)
    layer = AttentionSpec(kind).build(channels).train()
    assert layer.is_attention
    x = torch.randn(3, channels, 9, 7)
    out = layer(x)
    assert out.shape == x.shape
    mask = layer.mask(x)
    assert mask.dim() == 4 and mask.shape[:2] in {(3, channels), (3, 1)}
    assert bool(((mask > 0) & (mask < 1)).all())
    # timm's forward (or the hybrid's eq. 8) equals the mask applied to the input.
    assert torch.allclose(out, x * mask, atol=1e-6)


@pytest.mark.parametrize("channels,official,timm", [
    (6, 1, 3), (16, 3, 3), (64, 3, 3), (192, 5, 5), (256, 5, 5), (384, 5, 5)])
def test_eca_kernel_table(channels, official, timm):
    assert eca_kernel_size(channels, min_kernel=1) == official
    assert eca_kernel_size(channels) == timm
    assert ECA(channels).conv.kernel_size == (timm,)
    assert count(ECA(channels, min_kernel=1)) == official


def test_module_parameter_counts():
    assert count(SE(6)) == 2 * 6 * 1 and count(SE(16)) == 2 * 16 * 4  # bias-free, C // 4
    assert all(m.bias is None for m in (SE(16).fc1, SE(16).fc2))
    assert count(SE(64, reduction=16)) == 2 * 64 * 4
    ca = CoordAtt(6)  # mip = max(8, 6 // 32) = 8, every 1x1 convolution with bias
    assert count(ca) == (6 * 8 + 8) + 2 * 8 + 2 * (8 * 6 + 6) == 180
    assert isinstance(ca.act, nn.Hardswish) and isinstance(ca.bn1, nn.BatchNorm2d)
    assert count(CoordAtt(16)) == 440 and CoordAtt(1024).conv1.out_channels == 32
    assert count(CBAM(64)) == 2 * 64 * 4 + 2 * 7 * 7 + 2  # MLP + spatial conv + its BN


def lenet(kind: str | None) -> nn.Module:
    model = build_model("lenet-bn", 10, 3, 28)
    if kind:
        insert_attention(model, model_spec("lenet-bn").attention_sites(model),
                         AttentionSpec(kind).build)
    return model


def truncated(n: int, unit: float) -> float:
    """The papers' tables truncate: 45,178 -> 45.17 K."""
    return math.floor(n / unit * 100) / 100


def test_lenet_counts_reproduce_table_2():
    base = count(lenet(None))
    assert base == 45_178 and truncated(base, 1e3) == 45.17
    counts = {kind: count(lenet(kind)) for kind in ("se", "eca", "ca", "hybrid")}
    assert counts == {"se": 45_318, "eca": 45_184, "ca": 45_798, "hybrid": 45_950}
    assert truncated(counts["se"], 1e3) == 45.31
    assert truncated(counts["eca"], 1e3) == 45.18
    assert truncated(counts["hybrid"], 1e3) == 45.95  # exact: 140 + 6 + 620 + 6 logits
    # Table 2's CA row (45.54 K) matches no CoordAtt setting: a typo (METHODS.md 4.2).
    assert all((n - base) / base < 0.02 for n in counts.values())  # "less than 2 %"


def test_alexnet_counts_reproduce_table_4():
    sites = model_spec("alexnet-bn").attention_sites
    with torch.device("meta"):  # shapes only: 57 M parameters, no memory
        def alexnet(kind: str | None) -> int:
            model = build_model("alexnet-bn", 31, 3, 224)  # Office-31
            if kind:
                insert_attention(model, sites(model), AttentionSpec(kind, se_reduction=16).build)
            return count(model)

        base = alexnet(None)
        counts = {kind: alexnet(kind) for kind in ("se", "eca", "ca", "hybrid")}
    assert base == 57_149_535 and truncated(base, 1e6) == 57.14
    assert counts["se"] - base == 39_936  # 2 C^2 / 16 over C = 64, 192, 384, 256, 256
    assert {k: truncated(n, 1e6) for k, n in counts.items()} == {
        "se": 57.18, "eca": 57.14, "ca": 57.18, "hybrid": 57.22}
    assert all((n - base) / base < 0.01 for n in counts.values())  # "less than 1 %"


def test_hybrid_weights_start_equal_sum_to_one_and_learn():
    torch.manual_seed(1)
    layer = HybridAttention(16).train()
    w = layer.weights()
    assert torch.allclose(w, torch.full((3,), 1 / 3)) and torch.isclose(w.sum(), torch.tensor(1.0))
    x = torch.randn(4, 16, 6, 6)
    mean_mask = (layer.se.mask(x) + layer.eca.mask(x) + layer.ca.mask(x)) / 3
    assert torch.allclose(layer.mask(x), mean_mask, atol=1e-6)
    layer(x).square().mean().backward()
    assert layer.logits.grad is not None and bool(layer.logits.grad.abs().sum() > 0)
    for part in (layer.se.fc1.weight, layer.eca.conv.weight, layer.ca.conv1.weight):
        assert part.grad is not None and bool(part.grad.abs().sum() > 0)
    with torch.no_grad():
        layer.logits.copy_(torch.tensor([2.0, 0.0, -1.0]))
    figures = layer.private_figures()
    assert list(figures) == ["se", "eca", "ca"] and math.isclose(sum(figures.values()), 1.0, rel_tol=1e-6)
    assert figures["se"] > figures["eca"] > figures["ca"]


def test_insertion_keeps_the_backbone_keys_and_the_split_rule_finds_the_layers():
    plain = lenet(None).state_dict()
    model = lenet("hybrid")
    keys = set(model.state_dict())
    assert set(plain) <= keys
    assert [name for name, _ in attention_modules(model)] == ["features.3.1", "features.7.1"]
    attention = keys - set(plain)
    assert all(k.startswith(("features.3.1.", "features.7.1.")) for k in attention)
    assert {"features.3.1.logits", "features.7.1.ca.bn1.running_mean"} <= attention
    assert private_names(model, ("attention",), "classifier.6") == attention
    with pytest.raises(ValueError, match="parameter-free"):
        insert_attention(model, [("features.0", 6)], SE)


def test_mobilenet_v2_attention_between_depthwise_and_projection():
    model = build_model("mobilenet-v2", 10, 3, 32)
    sites = model_spec("mobilenet-v2").attention_sites(model)
    assert len(sites) == 17  # one per inverted-residual bottleneck
    paths = insert_attention(model, sites, AttentionSpec("eca").build)
    first = model.features[1].conv  # t = 1: depthwise, [attention], projection, BN
    assert isinstance(first[0][2][1], ECA) and isinstance(first[1], nn.Conv2d)
    expanded = model.features[2].conv  # expand, depthwise, [attention], projection, BN
    assert isinstance(expanded[1][2][1], ECA) and expanded[1][0].groups == 96
    assert paths[1] == "features.2.conv.1.2.1"
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_attention_spec_refuses_bad_settings():
    with pytest.raises(ValueError, match="not one of"):
        AttentionSpec("transformer")
    with pytest.raises(ValueError, match="se_reduction"):
        AttentionSpec("se", se_reduction=0)

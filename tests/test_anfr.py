"""ANFR (METHODS.md 5): the timm models against the paper's Table 6, the compact family,
split rules on timm's attention modules, the refusals (FedBN without BN, a non-ANFR model
under --method anfr), ImageNet-style --init-weights, Opacus readiness, and the compact ANFR
under every aggregator end to end over gRPC."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_method_matrix import run_federation
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedattn_shared.config import ConfigError
from fedattn_shared.methods import split
from fedattn_shared.models import build_model, model_spec
from fedattn_shared.privacy.dp_model import batchnorm_layers, disable_inplace_activations
from fedattn_shared.schema import Kind
from fedattn_shared.state import StateError
from fl_server.cli import build_parser, main, resolve
from fl_server.initial import load_initial_weights

SHARED = (Kind.SHARED_TENSORS, "")


def meta_model(name: str, classes: int = 1000) -> nn.Module:
    with torch.device("meta"):  # shapes and types only: the -50 models cost nothing
        return build_model(name, classes, 3, 224)


def count(model: nn.Module, kind: type | tuple[type, ...]) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


# ---- the models -------------------------------------------------------------------------


@pytest.mark.parametrize("name, params, paper_millions", [
    ("bn-resnet-50", 25_557_032, 25.56), ("gn-resnet-50", 25_557_032, 25.56),
    ("se-resnet-50", 28_088_024, 28.09), ("nf-resnet-50", 25_557_032, 25.56),
    ("anfr-se-50", 28_088_024, 28.09), ("anfr-eca-50", 25_557_118, 25.56),
    ("anfr-cbam-50", 28_073_576, 28.07), ("anfr-cbam-50-gn", 28_073_576, 28.07),
])
def test_paper_models_match_table_6(name, params, paper_millions):
    model = meta_model(name)
    total = sum(p.numel() for p in model.parameters())
    assert total == params
    assert round(total / 1e6, 2) == paper_millions


def test_normalisation_and_attention_layout_of_the_50_layer_models():
    from timm.layers import EcaModule, GroupNorm, ScaledStdConv2d, SEModule
    from timm.layers.cbam import CbamModule

    assert count(meta_model("bn-resnet-50"), _BatchNorm) == 53
    gn = meta_model("gn-resnet-50")
    assert count(gn, _BatchNorm) == 0 and count(gn, GroupNorm) == 53
    assert count(meta_model("se-resnet-50"), _BatchNorm) == 53
    assert count(meta_model("se-resnet-50"), SEModule) == 16
    for name, attention in (("anfr-se-50", SEModule), ("anfr-eca-50", EcaModule),
                            ("anfr-cbam-50", CbamModule), ("nf-resnet-50", ())):
        model = meta_model(name)
        assert count(model, attention) == (16 if attention else 0), name
        assert count(model, ScaledStdConv2d) > 50
    # timm's CBAM spatial branch carries a BatchNorm2d(1) per block (METHODS.md 5.1);
    # the -gn form swaps each for GroupNorm(1, 1) and nothing else.
    cbam, clean = meta_model("anfr-cbam-50"), meta_model("anfr-cbam-50-gn")
    assert [m.num_features for m in cbam.modules() if isinstance(m, _BatchNorm)] == [1] * 16
    assert count(clean, _BatchNorm) == 0
    assert [(m.num_groups, m.num_channels) for m in clean.modules()
            if isinstance(m, nn.GroupNorm)] == [(1, 1)] * 16
    assert count(meta_model("anfr-se-26"), SEModule) == 8


COMPACT = ["bn-resnet-compact", "gn-resnet-compact", "se-resnet-compact", "nf-resnet-compact",
           "anfr-se-compact", "anfr-eca-compact", "anfr-cbam-compact", "anfr-cbam-compact-gn",
           "nf-resnet-compact-skipinit", "anfr-se-compact-skipinit"]


def test_compact_family_differs_only_in_normalisation_and_attention():
    from timm.layers import ScaledStdConv2d

    x = torch.randn(2, 3, 32, 32)
    stage_outputs = {}
    for name in COMPACT:
        torch.manual_seed(0)
        model = build_model(name, 10, 3, 32).eval()
        stage_outputs[name] = [f["num_chs"] for f in model.feature_info]
        assert model(x).shape == (2, 10)
        nf = name.startswith(("nf-", "anfr-"))
        assert (count(model, ScaledStdConv2d) > 0) == nf
        assert (count(model, _BatchNorm) > 0) == (name.startswith(("bn-", "se-"))
                                                  or name == "anfr-cbam-compact")
        assert (count(model, split.attention_types()) == 4) == (
            name.startswith(("se-", "anfr-"))), name
        assert model_spec(name).head in ("fc", "head.fc")
        assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 0.6e6
    assert {tuple(v) for v in stage_outputs.values()} == {(64, 64, 128, 256, 512)}


def se_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    """The SE modules' gradient norm at each of ``steps`` SGD steps on one batch."""
    from timm.layers import SEModule

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        norms.append(sum(float(p.grad.norm()) for m in model.modules() if isinstance(m, SEModule)
                         for p in m.parameters()))
        opt.step()
    return norms


def test_skipinit_form_starts_with_live_attention():
    """timm's default NF block starts conv3's gain at 0, so its SE module pools zeros, every
    gate is sigmoid(bias) for every image and the SE gradients are exactly 0; the SkipInit
    form starts conv3's gain at 1 and scales the branch by a scalar starting at 0: the same
    function at init (the identity branch), but the gates already depend on the image and,
    once that scalar has taken one step, the SE modules get gradients an order of magnitude
    larger than the default form's. The pair differs only in the attention."""
    from timm.layers import SEModule

    from fedattn_shared.methods.anfr import attention_gates

    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32), torch.arange(8) % 10
    models = {}
    for name in ("anfr-se-compact", "anfr-se-compact-skipinit", "nf-resnet-compact-skipinit"):
        torch.manual_seed(0)
        models[name] = build_model(name, 10, 3, 32)
    default, skip = models["anfr-se-compact"], models["anfr-se-compact-skipinit"]
    blocks = [b for b in skip.stages.modules() if hasattr(b, "skipinit_gain")]
    assert len(blocks) == 4
    for block in blocks:
        assert torch.all(block.conv3.gain == 1) and block.skipinit_gain.item() == 0.0
    for block in (b for b in default.stages.modules() if hasattr(b, "conv3")):
        assert torch.all(block.conv3.gain == 0) and block.skipinit_gain is None
    with torch.no_grad():  # the same function at init: the branches add nothing yet
        assert torch.equal(default(x), skip(x))
    assert ({k for k in skip.state_dict() if "attn" not in k}
            == set(models["nf-resnet-compact-skipinit"].state_dict()))

    def gates(model):
        seen = []
        handles = [g.register_forward_hook(lambda _m, _i, out: seen.append(out.flatten(1)))
                   for _, g in attention_gates(model)]
        with torch.no_grad():
            model(x)
        for h in handles:
            h.remove()
        return seen

    assert all(float(g.std(0).max()) == 0.0 for g in gates(default))  # one gate for all
    assert all(float(g.std(0).max()) > 1e-3 for g in gates(skip))
    assert count(skip, SEModule) == 4
    # At the first step both forms' SE gradients are exactly 0 (default: zero input; skipinit:
    # zero branch scale). After one step the default form's come only from conv3's gain
    # having left 0 by one step; the SkipInit form's from O(1) features: ten times larger.
    default_grads, skip_grads = se_gradients(default, x, y, 2), se_gradients(skip, x, y, 2)
    assert default_grads[0] == 0.0 and skip_grads[0] == 0.0
    assert skip_grads[1] > 5 * default_grads[1] > 0


# ---- split rules on timm modules ---------------------------------------------------------


def test_attention_and_se_rules_recognise_timm_modules():
    se = build_model("anfr-se-compact", 10, 3, 32)
    names = [name for name, _ in split.squeeze_excitation_modules(se)]
    assert names == [f"stages.{i}.0.attn_last" for i in range(4)]
    excitation = split.private_names(se, ("se-e",), "head.fc")
    assert excitation == {f"{n}.{fc}.{k}" for n in names for fc in ("fc1", "fc2")
                          for k in ("weight", "bias")}
    assert split.private_names(se, ("attention",), "head.fc") == excitation

    eca = build_model("anfr-eca-compact", 10, 3, 32)
    assert split.private_names(eca, ("attention",), "head.fc") == {
        f"stages.{i}.0.attn_last.conv.weight" for i in range(4)}
    cbam = build_model("anfr-cbam-compact", 10, 3, 32)
    private = split.private_names(cbam, ("attention",), "head.fc")
    assert {k for k in cbam.state_dict() if ".attn_last." in k} == private
    assert "stages.0.0.attn_last.spatial.conv.bn.running_mean" in private


def test_fedbn_and_private_bn_refused_on_bn_free_models(capsys):
    for argv in (["--method", "fedbn", "--model", "anfr-se-compact"],
                 ["--method", "fedavg", "--model", "nf-resnet-compact", "--private", "bn"]):
        with pytest.raises(ConfigError, match="split rule 'bn' selects nothing in model .* "
                                              "no BatchNorm layers"):
            resolve(build_parser().parse_args(["--insecure", *argv]))
    assert main(["--insecure", "--method", "fedbn", "--model", "anfr-eca-compact"]) == 2
    assert "fedbn" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="split rule 'attention' selects nothing"):
        resolve(build_parser().parse_args(["--model", "bn-resnet-compact", "--private",
                                           "attention"]))
    # Models with BatchNorm still run FedBN: the baselines, and timm's CBAM (its 1-channel BN).
    for model in ("bn-resnet-compact", "se-resnet-compact", "anfr-cbam-compact"):
        _, _, method = resolve(build_parser().parse_args(["--method", "fedbn", "--model", model]))
        assert method.split_rules() == {"model": ("bn",)}


def test_method_anfr_is_fedavg_over_an_anfr_model():
    _, train, method = resolve(build_parser().parse_args(["--method", "anfr"]))
    assert train.model == "anfr-se-compact" and method.private_rules == ()
    _, train, _ = resolve(build_parser().parse_args(["--method", "anfr", "--model", "anfr-eca-50"]))
    assert train.model == "anfr-eca-50"
    _, train, _ = resolve(build_parser().parse_args(["--method", "fedavg"]))
    assert train.model == "lenet-bn"  # other methods keep the config default
    for model in ("se-resnet-compact", "nf-resnet-compact"):
        with pytest.raises(ConfigError, match="not an ANFR network"):
            resolve(build_parser().parse_args(["--method", "anfr", "--model", model]))


# ---- pretrained weights --------------------------------------------------------------------


def test_imagenet_weights_with_a_1000_class_head(tmp_path):
    """A timm state dict as the user supplies it (timm's own keys, a 1000-class head) loads
    into a 10-class ANFR with --init-skip-head; without it the head is refused, naming the
    flag."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(1)
    pretrained = timm.create_model("nf_seresnet26", pretrained=False, num_classes=1000).state_dict()
    save_file(pretrained, tmp_path / "model.safetensors")
    torch.manual_seed(2)
    models = {"model": build_model("anfr-se-26", 10, 3, 224)}
    fresh_head = models["model"].head.fc.weight.detach().clone()
    with pytest.raises(StateError, match=r"head.fc.weight has shape \[1000, 2048\].*--init-skip-head"):
        load_initial_weights(models, tmp_path / "model.safetensors", "head.fc")
    load_initial_weights(models, tmp_path / "model.safetensors", "head.fc", skip_head=True)
    state = models["model"].state_dict()
    assert torch.equal(state["head.fc.weight"], fresh_head)
    for key, value in pretrained.items():
        if not key.startswith("head.fc."):
            assert torch.equal(state[key], value), key
    server, _, _ = resolve(build_parser().parse_args(
        ["--init-weights", "w.safetensors", "--init-skip-head"]))
    assert server.init_skip_head


# ---- differential privacy readiness ------------------------------------------------------


def test_opacus_accepts_se_eca_and_the_clean_cbam():
    from opacus.validators import ModuleValidator

    for name in ("anfr-se-compact", "anfr-eca-compact", "anfr-cbam-compact-gn", "anfr-se-50",
                 "anfr-eca-50", "anfr-cbam-50-gn", "gn-resnet-compact"):
        model = meta_model(name)
        assert ModuleValidator.validate(model, strict=False) == [], name
        assert batchnorm_layers(model) == [], name
    errors = ModuleValidator.validate(meta_model("se-resnet-compact"), strict=False)
    assert len(errors) == 16 and all("BatchNorm" in str(e) for e in errors)


def test_timm_cbam_batchnorm_slips_past_opacus_but_not_batchnorm_layers():
    """timm's CBAM norm is BatchNormAct2d, a BatchNorm2d subclass that Opacus' exact-type
    validator lets through: the reason for the -gn form and for ``batchnorm_layers``."""
    from opacus.validators import ModuleValidator

    for name in ("anfr-cbam-compact", "anfr-cbam-50"):
        model = meta_model(name)
        assert ModuleValidator.validate(model, strict=False) == []
        found = batchnorm_layers(model)
        assert len(found) == (4 if "compact" in name else 16)
        assert all(n.endswith(".attn_last.spatial.conv.bn") for n in found)


@pytest.mark.parametrize("name", ["anfr-se-compact", "anfr-cbam-compact-gn"])
def test_opacus_per_sample_gradients_of_anfr(name):
    """Per-sample gradients (what DP-SGD clips) for every parameter, ScaledStdConv2d's gain
    included: each equals the gradient of that sample alone. In-place activations must be off
    for Opacus' backward hooks (timm's NF blocks use them). 64 px: at 32 px the last stage
    is 1x1 and CBAM's GroupNorm(1, 1) would normalise a single value."""
    from opacus import GradSampleModule

    torch.manual_seed(0)
    model = disable_inplace_activations(build_model(name, 10, 3, 64).double())
    x, y = torch.randn(3, 3, 64, 64, dtype=torch.double), torch.tensor([0, 4, 9])
    alone = torch.autograd.grad(nn.functional.cross_entropy(model(x[1:2]), y[1:2]),
                                list(model.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns about its functorch fallback
        sampled = GradSampleModule(model, loss_reduction="sum")
        nn.functional.cross_entropy(sampled(x), y, reduction="sum").backward()
    for (key, p), grad in zip(model.named_parameters(), alone, strict=True):
        assert p.grad_sample is not None, key
        assert torch.allclose(p.grad_sample[1], grad, atol=1e-9), key


# ---- the gates' class-to-class spread (a training figure) --------------------------------


def hand_made_se(gain: float) -> nn.Module:
    """A timm SE module on 2 channels whose gate is sigmoid(gain * relu(channel mean))."""
    from timm.layers import SEModule

    se = SEModule(2, rd_channels=2)
    with torch.no_grad():
        se.fc1.weight.copy_(torch.eye(2).view(2, 2, 1, 1))
        se.fc2.weight.copy_(gain * torch.eye(2).view(2, 2, 1, 1))
        se.fc1.bias.zero_()
        se.fc2.bias.zero_()
    return se


def test_gate_spread_on_a_hand_made_case():
    """Two SE modules, the second inert (gate 0.5 always). Class 0's images are 0 (gate
    0.5), class 1's are ln 3 (gate sigmoid(ln 3) = 0.75) in the first module. Per-class mean
    gates [0.5, 0.5] and [0.75, 0.75]: sample std over the 2 classes 0.25 / sqrt(2) on
    each channel, 0 in the inert module, so the figure is 0.25 / sqrt(2) / 2; the mean gate
    is (0.625 + 0.5) / 2. Class 1 arrives in two batches of different sizes and 8 absent
    classes do not count; a forward pass without labels (evaluation) adds nothing."""
    from fedattn_shared.methods.anfr import GateSpread

    model = nn.Sequential(hand_made_se(1.0), hand_made_se(0.0))
    spread = GateSpread(model, num_classes=10)
    ln3 = torch.log(torch.tensor(3.0))
    batches = [(torch.zeros(3, 2, 4, 4), torch.zeros(3, dtype=torch.long)),
               (torch.full((1, 2, 4, 4), ln3), torch.ones(1, dtype=torch.long)),
               (torch.cat([torch.zeros(1, 2, 4, 4), torch.full((2, 2, 4, 4), ln3)]),
                torch.tensor([0, 1, 1]))]
    for x, y in batches:
        spread.count(y)
        spread.labels = y
        model(x)
        spread.labels = None
    model(torch.full((5, 2, 4, 4), 9.0))  # no labels set: not counted
    figures = spread.figures()
    assert figures["gate_class_std"] == pytest.approx(0.25 / 2 ** 0.5 / 2, abs=1e-7)
    assert figures["gate_mean"] == pytest.approx((0.625 + 0.5) / 2, abs=1e-7)
    spread.reset()
    spread.count(torch.zeros(2, dtype=torch.long))
    spread.labels = torch.zeros(2, dtype=torch.long)
    model(torch.zeros(2, 2, 4, 4))
    assert spread.figures() == {}  # one class: no spread to speak of


# ---- every aggregator over gRPC ----------------------------------------------------------


def compact_names(predicate=lambda key: True) -> set[str]:
    state = build_model("anfr-se-compact", 10, 1, 28).state_dict()
    return {f"model/{k}" for k, v in state.items() if v.is_floating_point() and predicate(k)}


@pytest.mark.slow
@pytest.mark.parametrize("method_name, expected", [
    ("anfr", compact_names()),
    ("fedprox", compact_names()),
    ("fedadam", compact_names()),
    ("scaffold", compact_names()),
    ("fedper", compact_names(lambda k: not k.startswith("head.fc."))),
    ("ditto", {n.replace("model/", "global/") for n in compact_names()}),
])
def test_compact_anfr_trains_under_every_aggregator(tmp_path, method_name, expected):
    received, engine = run_federation(tmp_path, method_name, model="anfr-se-compact", rounds=1,
                                      sizes=[48, 48], lr=0.01)
    assert len(received) == 2
    for _, sections in received:
        assert set(sections[SHARED]) == expected
    assert engine.train.model == "anfr-se-compact"
    fresh = engine.method.build_models()
    moved = [name for name, value in engine.aggregator.state[SHARED].items()
             if not torch.equal(value, fresh[name.split("/")[0]].state_dict()[name.split("/", 1)[1]])]
    assert len(moved) > len(expected) // 2  # the global model trained
    if method_name == "anfr":  # the gate-spread figure reaches the server's history
        figures = engine.history["rounds"][-1]["train"]["edge_metrics"]
        assert set(figures) == {"e0", "e1"}
        for edge in figures.values():
            assert 0 <= edge["gate_class_std"] < 0.05  # from scratch: gates near 0.5
            assert edge["gate_mean"] == pytest.approx(0.5, abs=0.05)


@pytest.mark.slow
def test_fedsap_on_anfr_keeps_the_timm_se_excitation_home(tmp_path):
    received, engine = run_federation(tmp_path, "fedsap", model="anfr-se-compact", rounds=1,
                                      sizes=[48, 48], lr=0.01)
    excitation = compact_names(lambda k: ".attn_last.fc" in k)
    assert len(excitation) == 16
    for _, sections in received:
        assert set(sections[SHARED]) == compact_names() - excitation
        assert sections[(Kind.STAT_VECTORS, "gsr")] == [f"stages.{i}.0.attn_last" for i in range(4)]
    stats = engine.aggregator.state[(Kind.STAT_VECTORS, "gsr")]
    assert [stats[f"stages.{i}.0.attn_last"].shape[0] for i in range(4)] == [64, 128, 256, 512]
    assert any(float(v.abs().sum()) > 0 for v in stats.values())

"""Backbones (sizes from METHODS.md 3.1 and 4.2-4.3) and the split rules over them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.ops.misc import SqueezeExcitation

from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import MethodContext, load_method, split
from fedattn_shared.methods.base import NoParams
from fedattn_shared.models import MODELS, build_model, model_spec

# METHODS.md 3.1: (module name, C_l, squeeze width) of mobilenet_v3_small's 9 SE modules.
SE_TABLE = [
    ("features.1.block.1", 16, 8),
    ("features.4.block.2", 96, 24),
    ("features.5.block.2", 240, 64),
    ("features.6.block.2", 240, 64),
    ("features.7.block.2", 120, 32),
    ("features.8.block.2", 144, 40),
    ("features.9.block.2", 288, 72),
    ("features.10.block.2", 576, 144),
    ("features.11.block.2", 576, 144),
]

LENET_BN = ["features.1", "features.5", "classifier.1", "classifier.4"]
BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def n_params(model: nn.Module, names=None) -> int:
    state = model.state_dict()
    params = dict(model.named_parameters())
    keys = params if names is None else names
    return sum(state[k].numel() for k in keys if k in params)


@pytest.fixture(scope="module")
def lenet():
    torch.manual_seed(0)
    return build_model("lenet-bn", 10, 3, 28)


@pytest.fixture(scope="module")
def mobilenet():
    torch.manual_seed(0)
    return build_model("mobilenet-v3-small", 10, 3, 32)


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return build_model("resnet18-cifar", 10, 3, 32)


def method(name: str, **train) -> object:
    cls = load_method(name)
    return cls(MethodContext(TrainConfig(**train), cls.Params()))


# ---- models ---------------------------------------------------------------------------


def test_lenet_bn_size_and_fc_input(lenet):
    # conv 3*6*25+6, BN 2*6, conv 6*16*25+16, BN 2*16, FC 256*120+120, BN 2*120,
    # FC 120*84+84, BN 2*84, FC 84*10+10.
    expected = 456 + 12 + 2416 + 32 + 30840 + 240 + 10164 + 168 + 850
    assert expected == 45_178
    assert n_params(lenet) == 45_178
    assert lenet.classifier[0].in_features == 256
    assert all(c.padding == (0, 0) for c in lenet.features if isinstance(c, nn.Conv2d))
    lenet.eval()
    with torch.no_grad():
        assert lenet(torch.zeros(2, 3, 28, 28)).shape == (2, 10)


def test_lenet_bn_other_shapes():
    gray = build_model("lenet-bn", 10, 1, 28)
    assert n_params(gray) == 45_178 - 2 * 6 * 25  # conv1 loses two input channels
    big = build_model("lenet-bn", 5, 3, 32)
    assert big.classifier[0].in_features == 16 * 5 * 5
    assert big.classifier[6].out_features == 5
    with pytest.raises(ValueError, match="image_size >= 16"):
        build_model("lenet-bn", 10, 1, 15)


def test_mobilenet_v3_small_se_modules(mobilenet):
    se = [(name, m) for name, m in mobilenet.named_modules() if isinstance(m, SqueezeExcitation)]
    assert len(se) == 9
    assert [name for name, _ in se] == [name for name, _, _ in SE_TABLE]
    for (name, module), (_, channels, squeeze) in zip(se, SE_TABLE, strict=True):
        assert (module.fc1.in_channels, module.fc1.out_channels) == (channels, squeeze), name
        assert (module.fc2.in_channels, module.fc2.out_channels) == (squeeze, channels), name
        assert module.fc1.bias is not None and module.fc2.bias is not None
        assert isinstance(module.scale_activation, nn.Hardsigmoid)
    assert sum(c for _, c, _ in SE_TABLE) == 2_296  # GSR statistics length (METHODS.md 3.1)
    assert n_params(mobilenet) == 1_528_106
    assert model_spec("mobilenet-v3-small").head == "classifier.3"
    assert mobilenet.classifier[3].out_features == 10


def test_mobilenet_in_channels_replaces_the_stem():
    gray = build_model("mobilenet-v3-small", 10, 1, 32)
    stem = gray.features[0][0]
    assert (stem.in_channels, stem.out_channels, stem.kernel_size, stem.stride) == (1, 16, (3, 3),
                                                                                    (2, 2))
    assert stem.bias is None
    assert n_params(gray) == 1_528_106 - 2 * 16 * 9


def test_resnet18_cifar_stem(resnet):
    conv1 = resnet.conv1
    assert conv1.kernel_size == (3, 3) and conv1.stride == (1, 1) and conv1.padding == (1, 1)
    assert conv1.in_channels == 3 and conv1.out_channels == 64 and conv1.bias is None
    assert isinstance(resnet.maxpool, nn.Identity)
    assert model_spec("resnet18-cifar").head == "fc"
    resnet.eval()
    with torch.no_grad():
        stem = resnet.maxpool(resnet.relu(resnet.bn1(resnet.conv1(torch.zeros(1, 3, 32, 32)))))
        assert stem.shape == (1, 64, 32, 32)  # no downsampling before layer1
        assert resnet(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        build_model("vgg", 10, 3, 32)
    assert {"lenet-bn", "mobilenet-v3-small", "resnet18-cifar", "nf-resnet26"} <= set(MODELS)


# ---- split rules ----------------------------------------------------------------------


def test_se_e_rule_is_exactly_the_excitation_fcs(mobilenet):
    private = split.private_names(mobilenet, ("se-e",), "classifier.3")
    expected = {f"{name}.{fc}.{k}" for name, _, _ in SE_TABLE
                for fc in ("fc1", "fc2") for k in ("weight", "bias")}
    assert private == expected
    assert len(private) == 36
    # Hand count from the table: fc1 C*s + s, fc2 s*C + C (1x1 convs with bias).
    assert sum(2 * c * s + c + s for _, c, s in SE_TABLE) == 461_640
    assert n_params(mobilenet, private) == 461_640
    shared = split.shared_names(mobilenet, ("se-e",), "classifier.3")
    assert not set(shared) & private
    assert n_params(mobilenet, shared) == 1_528_106 - 461_640
    # attention == se-e on this backbone: SE's only tensors are fc1/fc2.
    assert split.private_names(mobilenet, ("attention",), "classifier.3") == expected


def test_se_e_through_a_method(mobilenet):
    fedavg = method("fedavg", model="mobilenet-v3-small", private=["se-e"])
    specs = fedavg.shared_specs({"model": mobilenet})
    assert "model/features.4.block.2.fc1.weight" not in specs
    assert "model/features.4.block.2.fc1.weight" in method(
        "fedavg", model="mobilenet-v3-small").shared_specs({"model": mobilenet})
    trainable = sum(torch.Size(s.shape).numel() for s in specs.values() if not s.is_buffer)
    assert trainable == 1_528_106 - 461_640
    assert "model/features.4.block.0.1.running_mean" in specs  # BN stays shared in Fed-SAP


def test_bn_rule_on_lenet(lenet):
    private = split.private_names(lenet, ("bn",), "classifier.6")
    assert private == {f"{m}.{k}" for m in LENET_BN for k in BN_KEYS}
    shared = split.shared_names(lenet, ("bn",), "classifier.6")
    assert shared == ["features.0.weight", "features.0.bias", "features.4.weight",
                      "features.4.bias", "classifier.0.weight", "classifier.0.bias",
                      "classifier.3.weight", "classifier.3.bias", "classifier.6.weight",
                      "classifier.6.bias"]


def test_bn_rule_on_mobilenet(mobilenet):
    private = split.private_names(mobilenet, ("bn",), "classifier.3")
    state = mobilenet.state_dict()
    stats = {k for k in state if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    assert stats <= private
    bn_modules = [n for n, m in mobilenet.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bn_modules) > 30
    assert len(private) == 5 * len(bn_modules)
    assert {f"{m}.{k}" for m in bn_modules for k in BN_KEYS} == private
    assert not any(".fc1." in k or "classifier" in k for k in private)


@pytest.mark.parametrize("model_fixture, head, expected", [
    ("lenet", "classifier.6", {"classifier.6.weight", "classifier.6.bias"}),
    ("resnet", "fc", {"fc.weight", "fc.bias"}),
    ("mobilenet", "classifier.3", {"classifier.3.weight", "classifier.3.bias"}),
])
def test_head_rule(request, model_fixture, head, expected):
    model = request.getfixturevalue(model_fixture)
    assert split.private_names(model, ("head",), head) == expected


def test_head_rule_matches_whole_module_names_only():
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(2, 2))
    model.add_module("fc2", nn.Linear(2, 2))
    assert split.private_names(model, ("head",), "fc") == {"fc.weight", "fc.bias"}


def test_num_batches_tracked_never_shared(lenet, mobilenet):
    for model, head in ((lenet, "classifier.6"), (mobilenet, "classifier.3")):
        for rules in ((), ("head",), ("se-e",)):
            shared = split.shared_names(model, rules, head)
            assert not any(k.endswith("num_batches_tracked") for k in shared)
    shared = split.shared_names(lenet, (), "classifier.6")
    state = lenet.state_dict()
    assert shared == [k for k in state if not k.endswith("num_batches_tracked")]
    assert len(shared) == len(state) - 4
    specs = method("fedavg", in_channels=3).shared_specs({"model": lenet})
    assert specs["model/features.1.running_mean"].is_buffer
    assert not specs["model/features.1.weight"].is_buffer
    assert specs["model/features.1.running_var"].dtype == torch.float32


def test_all_rule_shares_nothing(lenet):
    assert split.shared_names(lenet, ("all",), "classifier.6") == []
    assert split.private_names(lenet, ("all",), "classifier.6") == set(lenet.state_dict())


def test_attention_rule_picks_flagged_modules():
    class Gate(nn.Module):
        is_attention = True

        def __init__(self):
            super().__init__()
            self.mix = nn.Parameter(torch.zeros(3))

    model = nn.Sequential(nn.Linear(2, 2), Gate())
    assert split.private_names(model, ("attention",), "0") == {"1.mix"}


def test_rules_compose(lenet):
    models = {"model": lenet}
    fedbn = method("fedbn", in_channels=3)
    prox_bn = method("fedprox", in_channels=3, private=["bn"])
    assert prox_bn.split_rules() == {"model": ("bn",)}
    assert list(prox_bn.shared_specs(models)) == list(fedbn.shared_specs(models))
    assert prox_bn.shared_specs(models) == fedbn.shared_specs(models)
    # Method rules first, user rules after, duplicates dropped.
    assert method("fedbn", private=["bn", "head"]).split_rules() == {"model": ("bn", "head")}
    both = method("fedper", in_channels=3, private=["bn"]).shared_specs(models)
    assert set(both) == {f"model/{k}" for k in ("features.0.weight", "features.0.bias",
                                                "features.4.weight", "features.4.bias",
                                                "classifier.0.weight", "classifier.0.bias",
                                                "classifier.3.weight", "classifier.3.bias")}


def test_unknown_rule_refused():
    with pytest.raises(ValueError, match="unknown split rule 'bogus'"):
        split.check_rules(["bn", "bogus"])
    with pytest.raises(ValueError, match="train.private: unknown split rule 'heads'"):
        load_method("fedavg")(MethodContext(TrainConfig(private=["heads"]), NoParams()))
    split.check_rules(list(split.PRIVATE_RULES))

"""Models by reference (shared/models/reference.py): the one parse of a model name and the
edge's one allowlist check of it, spoken as an attacker would (a server sending names the
edge did not allow), inspection of timm/torchvision/plug-in models, DP's validator on them,
and, between real processes, a server-named model module an edge never imports unless its
operator allowed it (tests/marker_model.py)."""

from __future__ import annotations

import json
import re
import sys
import uuid
from pathlib import Path

import pytest
import torch
from conftest import edge_data

from fedattn_shared.config import DPConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.models import MODELS, build_model, check_model_allowed, model_spec
from fedattn_shared.models.reference import parse_reference
from fedattn_shared.privacy.dp import check_dp
from fl_edge.daemon import EdgeDaemon, EdgeExit, EdgeOptions

PLUGINS = Path(__file__).resolve().parent / "plugins"


@pytest.fixture
def probe_model(tmp_path, monkeypatch):
    """A model module on sys.path that leaves a marker file when imported: (spec, marker)."""
    name = f"model_probe_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
        "from fedattn_shared.models.lenet import LeNetBN\n\n\n"
        "def build(num_classes, in_channels, image_size):\n"
        "    return LeNetBN(num_classes, in_channels, image_size)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{name}:build", marker
    sys.modules.pop(name, None)


# ---- the parse and the allowlist, as an attacker speaks ------------------------------------


def test_a_module_model_is_refused_before_import_unless_allowed(probe_model):
    spec, marker = probe_model
    for allowed in ((), ("other.module:build",), (spec + "x",), (spec.upper(),)):
        with pytest.raises(ValueError, match="a module:callable outside the installed models; "
                                             "this edge imports no module a server names unless "
                                             f"started with --allow-model '{spec}'"):
            check_model_allowed(spec, allowed)
        with pytest.raises(ValueError, match="--allow-model"):  # +gn changes nothing
            check_model_allowed(spec + "+gn", allowed)
    assert spec.partition(":")[0] not in sys.modules and not marker.exists()
    check_model_allowed(spec, (spec,))
    assert model_spec(spec).head == "classifier.6" and marker.exists()  # the probe does work


@pytest.mark.parametrize("name, message", [
    (42, "model must be a string, got int"),
    (None, "model must be a string, got NoneType"),
    ("os:system", "a module:callable outside the installed models"),
    ("os.path:join", "a module:callable outside the installed models"),
    ("subprocess:Popen+gn", "a module:callable outside the installed models"),
    ("timm:../../etc/passwd", "timm:NAME takes a timm model name"),
    ("timm:resnet18;import os", "timm:NAME takes a timm model name"),
    ("torchvision:", "torchvision:NAME takes a torchvision model name"),
    ("a:b:c", "expected a built-in name, timm:NAME, torchvision:NAME"),
    ("os :system", "expected a built-in name"),
    ("__import__('os'):x", "expected a built-in name"),
    ("évil:x", "expected a built-in name"),
    ("no-such-model", "unknown model 'no-such-model'"),
    ("", "unknown model ''"),
    ("x" * 100_000 + ":y", "x" * 120 + "'..."),
])
def test_hostile_model_names_are_refused_without_importing(name, message):
    before = set(sys.modules)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_model_allowed(name)
    assert set(sys.modules) - before == set()  # nothing was imported to decide


def test_builtin_library_and_installed_names_pass(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    for name in (*MODELS, "lenet-bn+gn", "timm:resnet18", "timm:resnet18.a1_in1k",
                 "torchvision:mobilenet_v3_small", "example-tiny-se"):
        check_model_allowed(name)
    assert parse_reference("timm:resnet18", MODELS).kind == "timm"
    assert parse_reference("lenet-bn", MODELS).kind == "builtin"


# ---- inspection ------------------------------------------------------------------------------


def test_referenced_models_build_with_the_runs_classes_and_channels_and_find_their_head():
    """Random init only, the run's classes and channels; the head by timm's config or the
    last Linear; timm's forward_features as pFedKA's tokens."""
    for name, head in [("timm:test_resnet", "fc"), ("timm:test_convnext", "head.fc"),
                       ("torchvision:resnet18", "fc"),
                       ("torchvision:mobilenet_v3_small", "classifier.3")]:
        spec = model_spec(name)
        assert spec.head == head, name
        with torch.device("meta"):
            model = build_model(name, 5, 1, 32)
        assert model.get_submodule(head).out_features == 5
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
        assert first.in_channels == 1, name
    assert model_spec("timm:test_resnet").tokens is not None
    assert model_spec("torchvision:resnet18").tokens is None  # declared, or pFedKA refuses
    torch.manual_seed(0)
    a = build_model("timm:test_resnet", 3, 1, 32).state_dict()
    torch.manual_seed(0)
    b = build_model("timm:test_resnet", 3, 1, 32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # seeded: identical on every party
    with pytest.raises(ValueError, match="timm has no model 'resnet_nope'"):
        model_spec("timm:resnet_nope")
    with pytest.raises(ValueError, match="torchvision has no classification model 'nope'"):
        model_spec("torchvision:nope")


def test_a_builder_that_is_not_one_is_refused_by_name(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    with pytest.raises(ValueError, match="'fedattn_example_model:TinySENet_nope'.*has no attribute"):
        model_spec("fedattn_example_model:TinySENet_nope")
    with pytest.raises(ValueError, match="is a str, not a ModelSpec or a callable"):
        model_spec("fedattn_example_model:__doc__")


def test_dp_runs_opacus_validator_on_a_referenced_model():
    """DP-SGD refuses a timm model with BatchNorm before any edge trains, naming the fix;
    its +gn form (--dp-fix-model) passes Opacus' validator."""
    dp = DPConfig(enabled=True, target_epsilon=8.0, planned_rounds=2)
    fedavg = load_method("fedavg")

    def method(model):
        return fedavg(MethodContext(TrainConfig(model=model, image_size=32), fedavg.Params(), dp=dp))

    with pytest.raises(ValueError, match="model 'timm:test_resnet' .* BatchNorm layer"):
        check_dp(method("timm:test_resnet"))
    check_dp(method("timm:test_resnet+gn"))


# ---- at start: the run's input size, DP's validator --------------------------------------------


def server_run(*flags: str):
    """fl-server's resolution of a run (what it does before serving anything)."""
    from fl_server.cli import build_parser, resolve

    return resolve(build_parser().parse_args(list(flags)))


@pytest.mark.parametrize("model, reason", [
    ("timm:test_convnext", "Kernel size can't be greater than actual input size"),
    ("timm:test_vit", "should be divisible by patch size (16)"),
])
def test_a_referenced_model_that_cannot_take_the_runs_inputs_is_refused_at_start(model, reason):
    """A library model the run's side is too small for (ConvNeXt's stem and downsamplers)
    or wrong for (a ViT's patches): fl-server refuses it before serving, naming the size, the
    model's own reason and train.input_size; at a side it takes the same run resolves."""
    from fedattn_shared.config import ConfigError

    with pytest.raises(ConfigError) as err:
        server_run("--method", "fedavg", "--model", model)
    assert f"model {model!r} cannot take 1x28x28 inputs" in str(err.value)
    assert reason in str(err.value) and "set train.input_size" in str(err.value)
    _, train, _ = server_run("--method", "fedavg", "--model", model, "--set", "train.input_size=64")
    assert train.model_size == 64


def test_the_input_check_refuses_only_what_a_real_input_fails(tmp_path, monkeypatch):
    """A plug-in whose forward reads values (which meta tensors lack) passes, judged on the
    CPU; one that fails on a real input is refused with its own words. The check leaves the
    run's seeded random stream where it was."""
    from fedattn_shared.models.registry import check_model_input

    name = f"value_reading_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from torch import nn\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes, in_channels, side):\n"
        "        super().__init__()\n"
        "        self.fc, self.side = nn.Linear(in_channels, num_classes), side\n\n"
        "    def forward(self, x):\n"
        "        if not bool(x.abs().sum() >= 0):  # reads a value: no meta tensor can\n"
        "            raise AssertionError('unreachable')\n"
        "        if x.shape[-1] != self.side:\n"
        "            raise ValueError(f'this net takes {self.side} px only')\n"
        "        return self.fc(x.mean(dim=(2, 3)))\n\n\n"
        "def build(num_classes, in_channels, image_size):\n"
        "    return Net(num_classes, in_channels, 28)\n\n\n"
        "def build_32(num_classes, in_channels, image_size):\n"
        "    return Net(num_classes, in_channels, 32)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        torch.manual_seed(3)
        expected = torch.rand(4)
        torch.manual_seed(3)
        check_model_input(f"{name}:build", 10, 1, 28)
        assert torch.equal(torch.rand(4), expected)
        with pytest.raises(ValueError, match=re.escape(
                f"model '{name}:build_32' cannot take 1x28x28 inputs (ValueError: this net takes "
                "32 px only); set train.input_size")):
            check_model_input(f"{name}:build_32", 10, 1, 28)
    finally:
        sys.modules.pop(name, None)


def test_pfedka_refuses_a_model_its_token_probe_cannot_run_at_the_size():
    """pFedKA reads a timm model's tokens at the run's side: where the model cannot take it,
    the method refuses naming the side and train.input_size, rather than crashing."""
    pfedka = load_method("pfedka")
    with pytest.raises(ValueError, match=r"pfedka: timm:test_convnext yields no tokens at 28x28 "
                                         r"\(RuntimeError: .*\); use a larger train.input_size"):
        pfedka(MethodContext(TrainConfig(model="timm:test_convnext"), pfedka.Params()))


def test_server_runs_opacus_validator_on_a_referenced_model_before_serving():
    """fl-server --dp runs Opacus' ModuleValidator on the built model while it resolves the
    run, before it serves (so before any edge trains): torchvision's ViT has no BatchNorm,
    which fedattn's own check would refuse first, but nn.MultiheadAttention, for which Opacus
    computes no per-sample gradients; the refusal is Opacus' own."""
    from fedattn_shared.config import ConfigError

    with pytest.raises(ConfigError, match=r"--dp: Opacus cannot train model 'torchvision:vit_b_16' "
                                          r"\(model\): We do not support nn.MultiheadAttention"):
        server_run("--method", "fedavg", "--model", "torchvision:vit_b_16", "--image-size", "224",
                   "--dp", "--dp-epsilon", "8")


# ---- the edge's setup, and real processes ------------------------------------------------------


def test_the_edge_setup_refuses_a_server_named_model_module_before_importing_it(tmp_path,
                                                                                 probe_model):
    spec, marker = probe_model
    data = edge_data(tmp_path / "data")
    config = {"method": "fedavg", "train": {**TrainConfig(model=spec).__dict__}, "params": {}}
    daemon = EdgeDaemon(EdgeOptions(server="127.0.0.1:1", data_dir=data,
                                    state_dir=tmp_path / "state", name="unit", progress=False))
    with pytest.raises(EdgeExit) as err:
        daemon._setup(json.dumps(config), "0" * 16)
    assert err.value.code == 2 and f"--allow-model '{spec}'" in str(err.value)
    assert "refused the server's model" in err.value.tell_server
    assert spec.partition(":")[0] not in sys.modules and not marker.exists()


def test_a_server_named_model_module_is_never_imported_by_an_edge_without_the_allow_flag(
        cluster, tmp_path):
    """The server builds ``tests.marker_model:build`` (importing it itself, without the
    marker variable). An edge without --allow-model exits 2 and its marker file never
    appears; an edge with it imports the module (its marker names its pid) and trains."""
    data = edge_data(tmp_path / "data")
    spec = "tests.marker_model:build"
    cluster.server("--method", "fedavg", "--model", spec, "--batch-size", "20", "--rounds",
                   "1", "--min-edges", "1", "--round-timeout", "60")
    refused_marker, allowed_marker = tmp_path / "marker-refused", tmp_path / "marker-allowed"
    refusing = cluster.edge(data, "x", env={"FEDATTN_IMPORT_MARKER": str(refused_marker)})
    assert refusing.wait(90) == 2
    assert (f"model '{spec}': a module:callable outside the installed models; this edge "
            f"imports no module a server names unless started with --allow-model '{spec}'"
            in refusing.log())
    assert not refused_marker.exists()
    allowed = cluster.edge(data, "y", "--allow-model", spec,
                           env={"FEDATTN_IMPORT_MARKER": str(allowed_marker)})
    assert allowed.wait(150) == 0
    assert allowed_marker.read_text().split() == [str(allowed.popen.pid)]
    assert "round 1: trained" in allowed.log()


# ---- pretrained starts (--init-weights) ----------------------------------------------------


def test_init_weights_take_timm_and_torchvision_files_and_name_every_mismatch(tmp_path):
    """A referenced model starts from its library's own weight files as they lie on disk
    (timm's pytorch_model.bin, torchvision's .pth without BatchNorm counters), read with
    weights_only; keys and shapes are checked before any tensor changes, each mismatch
    named."""
    import timm
    import torchvision

    from fedattn_shared.state import StateError
    from fl_server.initial import load_initial_weights

    torch.manual_seed(1)
    imagenet = timm.create_model("test_resnet", pretrained=False, num_classes=1000).state_dict()
    torch.save(imagenet, tmp_path / "pytorch_model.bin")
    model = build_model("timm:test_resnet", 10, 3, 32)
    head = model_spec("timm:test_resnet").head
    with pytest.raises(StateError, match=r"fc.weight has shape \[1000, .*--init-skip-head"):
        load_initial_weights({"model": model}, tmp_path / "pytorch_model.bin", head)
    load_initial_weights({"model": model}, tmp_path / "pytorch_model.bin", head, skip_head=True)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in imagenet.items() if not k.startswith("fc."))

    vision = torchvision.models.resnet18(weights=None).state_dict()
    torch.save({k: v for k, v in vision.items() if not k.endswith("num_batches_tracked")},
               tmp_path / "resnet18-f37072fd.pth")
    rgb = {"model": build_model("torchvision:resnet18", 1000, 3, 32)}
    load_initial_weights(rgb, tmp_path / "resnet18-f37072fd.pth", "fc")
    assert torch.equal(rgb["model"].state_dict()["conv1.weight"], vision["conv1.weight"])
    grey = {"model": build_model("torchvision:resnet18", 1000, 1, 32)}
    before = grey["model"].state_dict()["layer1.0.conv1.weight"].clone()
    with pytest.raises(StateError, match=r"conv1.weight has shape \[64, 3, 7, 7\], the model "
                                         r"needs \[64, 1, 7, 7\]"):
        load_initial_weights(grey, tmp_path / "resnet18-f37072fd.pth", "fc")
    assert torch.equal(grey["model"].state_dict()["layer1.0.conv1.weight"], before)  # untouched

    renamed = {("backbone." + k): v for k, v in list(vision.items())[:8]}
    torch.save({"state_dict": renamed}, tmp_path / "checkpoint.ckpt")
    with pytest.raises(StateError) as err:
        load_initial_weights(rgb, tmp_path / "checkpoint.ckpt", "fc")
    assert "no tensor for: ['model/conv1.weight', 'model/bn1.weight'" in str(err.value)
    assert "tensors the model does not have: ['backbone.bn1.bias'" in str(err.value)


class Payload:
    """Anything but tensors: what a hostile weights file would unpickle."""

    def __reduce__(self):
        return (print, ("a weights file ran code",))


def test_a_weights_file_that_would_run_code_is_refused(tmp_path, capsys):
    from fedattn_shared.state import StateError
    from fl_server.initial import load_initial_weights

    torch.save({"conv1.weight": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(StateError, match="evil.pth: not a torch state dict readable with "
                                         "weights_only=True"):
        load_initial_weights({"model": build_model("lenet-bn", 10, 1, 28)}, tmp_path / "evil.pth")
    assert "ran code" not in capsys.readouterr().out


def test_a_tool_allows_its_own_edges_the_module_model_it_chose():
    """fl-demo and fl-sim start their own edges: a module:callable the user named is theirs
    to import (the spec without +gn, as the edge's check reads it); nothing else is added."""
    from fedattn_shared.models import own_model_allowance

    assert own_model_allowance("tests.marker_model:build+gn") == ["--allow-model",
                                                                  "tests.marker_model:build"]
    for name in (None, "", "lenet-bn", "timm:resnet18", "torchvision:resnet18", "example-tiny-se"):
        assert own_model_allowance(name) == []
    spec = own_model_allowance("tests.marker_model:build+gn")[1]
    check_model_allowed("tests.marker_model:build+gn", (spec,))


def test_an_edge_refuses_a_model_over_its_size_cap_before_allocating_it(tmp_path):
    """A server naming a large library model: the edge counts its state on the meta device
    and refuses it over --max-model-mb, naming the size and the cap (the server hears it);
    under the cap the same name goes on to the fingerprint check."""
    data = edge_data(tmp_path / "data")
    config = {"method": "fedavg", "params": {},
              "train": {**TrainConfig(model="timm:resnet18", image_size=32).__dict__}}

    def setup(**options):
        daemon = EdgeDaemon(EdgeOptions(server="127.0.0.1:1", data_dir=data, name="unit",
                                        state_dir=tmp_path / "state", progress=False, **options))
        with pytest.raises(EdgeExit) as err:
            daemon._setup(json.dumps(config), "0" * 16)
        return err.value

    refused = setup(max_model_mb=10)
    assert refused.code == 2
    assert ("model 'timm:resnet18' holds 43 MiB of state over the method's 1 model(s); this "
            "edge builds at most 10 MiB" in refused.tell_server)
    assert "(--max-model-mb)" in str(refused)
    assert "fingerprint" in str(setup())  # the default cap takes it: the next check speaks

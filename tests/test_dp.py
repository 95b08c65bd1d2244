"""DP-SGD (``--dp``): configuration and refusals, BatchNorm detection and the +gn fix,
the accounting against Opacus' own accountant, every loss and post-processing term under
DP, the statistics noise, and, with real processes, the ledger across a SIGKILL and a
spent budget."""

from __future__ import annotations

import json
import math
import signal
import warnings

import pytest
import torch
from conftest import edge_data, make_images, wait_for
from opacus.accountants import RDPAccountant
from opacus.validators import ModuleValidator
from test_method_matrix import run_federation

from fedattn_shared.config import ConfigError, DPConfig, TrainConfig
from fedattn_shared.data.npz import Split
from fedattn_shared.methods import Method, MethodContext, available_methods, load_method
from fedattn_shared.models import build_model
from fedattn_shared.models.anfr import batchnorm_to_groupnorm, opacus_groups
from fedattn_shared.privacy.dp import BudgetSpent, PrivateTraining, check_dp, epsilon
from fedattn_shared.privacy.dp_model import batchnorm_layers, disable_inplace_activations
from fedattn_shared.privacy.per_sample import OutputHookGradSampleModule
from fedattn_shared.schema import TRAIN, Kind, Payload, Section
from fl_edge.trainer import train_local
from fl_server.cli import build_parser, main, resolve

CPU = torch.device("cpu")


def dp_config(**values) -> DPConfig:
    return DPConfig(**{"enabled": True, "noise_multiplier": 1.0, "planned_rounds": 1, **values})


def make_method(name: str, model: str = "lenet-bn+gn", params: dict | None = None,
                dp: DPConfig | None = None, **train_values) -> Method:
    train = TrainConfig(model=model, **train_values)
    cls = load_method(name)
    return cls(MethodContext(train, cls.Params(**(params or {})), dp=dp or dp_config()))


def split(n: int, channels: int = 1, size: int = 28, seed: int = 0) -> Split:
    x, y = make_images(n, size=size, channels=channels, seed=seed)
    x = torch.from_numpy(x).float().div(255)
    x = x.unsqueeze(1) if channels == 1 else x.permute(0, 3, 1, 2)
    return Split(x.contiguous(), torch.from_numpy(y))


# ---- configuration and refusals ----------------------------------------------------------


def test_flags_reach_the_dp_section_and_the_fix_renames_the_model():
    server, train, method = resolve(build_parser().parse_args(
        ["--dp", "--dp-epsilon", "4", "--dp-fix-model", "--rounds", "7", "--method", "fedprox"]))
    assert train.model == "lenet-bn+gn"
    assert method.dp == DPConfig(enabled=True, target_epsilon=4.0, planned_rounds=7,
                                 fix_model=True)
    assert batchnorm_layers(method.build_models()["model"]) == []


@pytest.mark.parametrize("argv, message", [
    (["--dp"], "needs dp.target_epsilon"),
    (["--dp-epsilon", "3"], "dp.target_epsilon is set but DP is off"),
    (["--dp", "--dp-epsilon", "3", "--dp-accountant", "rdp", "--set", "dp.max_grad_norm=0"],
     "dp.max_grad_norm must be > 0"),
    (["--dp", "--dp-epsilon", "3"], "has 4 BatchNorm layer(s)"),  # lenet-bn without the fix
    (["--dp", "--dp-epsilon", "3", "--method", "fedsap", "--model", "se-cnn", "--dp-fix-model"],
     "GSR (eq. 6) penalises the batch-mean squeeze"),
    (["--dp", "--dp-epsilon", "3", "--method", "fedsap", "--model", "se-cnn", "--dp-fix-model",
      "--set", "fedsap.gsr_form='per-sample'"], "uploads STAT_VECTORS:'gsr'"),
    (["--dp", "--dp-epsilon", "3", "--method", "fedproto", "--dp-fix-model"],
     "fedproto: the prototype term"),
    (["--dp", "--dp-epsilon", "3", "--method", "fedstar", "--model", "mobilenet-v3-compact",
      "--dp-fix-model"], "fedstar: L_shared and L_pull"),
    (["--dp", "--dp-epsilon", "3", "--method", "pfedla", "--dp-fix-model"],
     "BatchNorm"),  # CoordAtt's BatchNorm inside pFedLA's hybrid attention, inserted later
])
def test_refusals_exit_2_with_the_reason(argv, message, capsys):
    assert main(["--insecure", *argv]) == 2
    assert message in capsys.readouterr().err


def test_refusal_names_the_fix():
    with pytest.raises(ValueError, match="--dp-fix-model .* ANFR model"):
        check_dp(make_method("fedavg", model="mobilenet-v3-small", in_channels=3, image_size=32))


def test_a_plugin_without_a_dp_declaration_is_refused():
    class Undeclared(Method):
        name = "undeclared"

    method = Undeclared(MethodContext(TrainConfig(model="lenet-bn+gn"), Undeclared.Params(),
                                      dp=dp_config()))
    with pytest.raises(ValueError, match="does not declare DP-SGD support"):
        check_dp(method)


def test_statistics_in_the_clear_only_on_request():
    params = {"gsr_form": "per-sample"}
    check_dp(make_method("fedsap", "se-cnn+gn", params, dp_config(stats_sigma=0.5)))
    check_dp(make_method("fedsap", "se-cnn+gn", params, dp_config(stats_in_clear=True)))
    with pytest.raises(ConfigError, match="dp.stats_sigma must be"):
        dp_config(stats_sigma=-1).validate()


# ---- BatchNorm: detection past Opacus' validator, and the fix ------------------------------


def test_timm_batchnorm_act_slips_past_opacus_but_not_our_check():
    import timm

    with torch.device("meta"):
        model = timm.create_model("mobilenetv3_small_100", pretrained=False, num_classes=10)
    assert ModuleValidator.validate(model, strict=True) == []  # Opacus sees nothing wrong
    assert len(batchnorm_layers(model)) == 34
    fixed = ModuleValidator.fix(model)
    assert len(batchnorm_layers(fixed)) == 34  # and its fix leaves every one in place


@pytest.mark.parametrize("name, count", [
    ("mobilenet-v3-small", 34), ("bn-resnet-compact", 16), ("anfr-cbam-compact", 4),
    ("lenet-bn", 4), ("resnet10-cifar-compact", 12)])
def test_the_fix_replaces_every_batchnorm(name, count):
    """timm (bn-resnet-compact, ANFR(CBAM)'s BatchNormAct2d) and torchvision
    (mobilenet_v3_small) models: every BatchNorm found, then replaced by GroupNorm of
    gcd(32, C) groups; timm's norm-act keeps its activation; the model still runs."""
    model = build_model(name, 10, 3, 32)
    assert len(batchnorm_layers(model)) == count
    fixed = build_model(f"{name}+gn", 10, 3, 32)
    assert batchnorm_layers(fixed) == []
    assert ModuleValidator.validate(fixed, strict=True) == []
    norms = [m for m in fixed.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert len(norms) >= count
    assert all(m.num_groups == math.gcd(32, m.num_channels) for m in norms)
    assert fixed(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_the_fix_keeps_timm_norm_act_activations():
    from timm.layers import BatchNormAct2d, GroupNormAct

    model = torch.nn.Sequential(BatchNormAct2d(16, act_layer=torch.nn.Hardswish))
    batchnorm_to_groupnorm(model, opacus_groups)
    assert isinstance(model[0], GroupNormAct) and isinstance(model[0].act, torch.nn.Hardswish)
    assert model[0].num_groups == 16
    x = torch.randn(2, 16, 4, 4)
    expected = torch.nn.functional.hardswish(torch.nn.functional.group_norm(x, 16))
    assert torch.allclose(model(x), expected, atol=1e-6)


# ---- accounting ------------------------------------------------------------------------------


def private_edge(method: Method, data: Split, batch_size: int, ledger: dict | None = None):
    algo = method.edge(method.build_models(), CPU)
    state = method.initial_state(algo.models)
    # pFedKA's per-edge downlink (the population figures for its KD weight); others ignore it.
    personal = Payload([Section(Kind.SCALAR_SUMMARY, "", {"n_mean": torch.tensor(40.0),
                                                          "edges": torch.tensor(2.0)})])
    algo.receive(TRAIN, Payload([Section(k, n, t) for (k, n), t in state.items()]), personal)
    return algo, PrivateTraining(algo, method.dp, len(data), batch_size, ledger)


def test_epsilon_matches_opacus_accountant_for_a_known_schedule():
    """100 samples, batch 10 (q = 0.1), 2 local epochs: 20 Poisson batches per round at
    sigma 1.1; after 3 rounds the ledger's epsilon is Opacus' RDP accountant stepped 60
    times, at delta 0.1 / 100 (the ANFR paper's)."""
    data = split(100)
    method = make_method("fedavg", dp=dp_config(noise_multiplier=1.1, planned_rounds=3),
                         local_epochs=2, batch_size=10)
    algo, privacy = private_edge(method, data, 10)
    assert privacy.delta == pytest.approx(0.001) and privacy.batches_per_round == 20
    for round_number in (1, 2, 3):
        result = train_local(algo, data, 2, 10, round_number, CPU, progress=False,
                             privacy=privacy)
        assert result.steps == 20
        figures = privacy.end_round(round_number)
    reference = RDPAccountant()
    for _ in range(60):
        reference.step(noise_multiplier=1.1, sample_rate=0.1)
    assert figures["dp_epsilon"] == pytest.approx(reference.get_epsilon(delta=0.001), rel=1e-9)
    assert privacy.ledger()["history"] == [[1.1, 0.1, 60]]


def test_calibration_spends_the_budget_over_the_planned_rounds_then_refuses():
    data = split(80)
    dp = dp_config(noise_multiplier=0.0, target_epsilon=2.0, planned_rounds=3)
    method = make_method("fedavg", dp=dp, batch_size=16)
    algo, privacy = private_edge(method, data, 16)
    for round_number in (1, 2, 3):
        privacy.check_budget()
        train_local(algo, data, 1, 16, round_number, CPU, progress=False, privacy=privacy)
        spent = privacy.end_round(round_number)["dp_epsilon"]
    assert 1.95 <= spent <= 2.0  # Opacus' calibration tolerance is 0.01
    with pytest.raises(BudgetSpent, match="privacy budget spent: epsilon"):
        privacy.check_budget()
    # A fresh start from the saved ledger (what a restarted edge does) is just as spent,
    # whatever sigma it runs with now.
    again_method = make_method("fedavg", dp=dp_config(noise_multiplier=5.0, target_epsilon=2.0),
                               batch_size=16)
    _, again = private_edge(again_method, data, 16, json.loads(json.dumps(privacy.ledger())))
    assert again.spent() == pytest.approx(spent)
    with pytest.raises(BudgetSpent):
        again.check_budget()


def test_k_steps_on_one_batch_are_accounted_as_one_gaussian_of_sigma_over_sqrt_k():
    """pFedMe's 4 inner steps per Poisson batch: 4 x 5 optimizer steps in a round, booked
    as 5 sampled releases of sigma / 2."""
    data = split(50)
    method = make_method("pfedme", params={"inner_steps": 4}, dp=dp_config(noise_multiplier=2.0),
                         batch_size=10)
    algo, privacy = private_edge(method, data, 10)
    result = train_local(algo, data, 1, 10, 0, CPU, progress=False, privacy=privacy)
    assert result.steps == 20
    privacy.end_round(1)
    assert privacy.ledger()["history"] == [[1.0, 0.2, 5]]


def test_wrapping_keeps_state_dict_names_and_memory_bounded_batches_step_once():
    data = split(64)
    method = make_method("fedavg", dp=dp_config(max_physical_batch=4), batch_size=16)
    algo = method.edge(method.build_models(), CPU)
    names = list(algo.models["model"].state_dict())
    fingerprint = method.fingerprint(algo.models)
    privacy = PrivateTraining(algo, method.dp, len(data), 16)
    assert list(algo.models["model"].state_dict()) == names
    assert method.fingerprint(algo.models) == fingerprint
    result = train_local(algo, data, 1, 16, 0, CPU, progress=False, privacy=privacy)
    assert result.steps == 4  # int(1/q) logical batches, each split into physical ones
    assert privacy.end_round(1)["dp_steps"] == 4


# ---- every term under DP -----------------------------------------------------------------------


def dp_update(name: str, params: dict, model: str = "lenet-bn+gn", clip: float = 1e-3,
              prepare=None, channels: int = 1, size: int = 28) -> torch.Tensor:
    """One DP-SGD epoch from the same start, with the same Poisson batches and the same
    noise draws: the flattened change of every model tensor."""
    torch.manual_seed(0)
    method = make_method(name, model, params, dp_config(max_grad_norm=clip, noise_multiplier=0.5),
                         lr=0.1, batch_size=8, in_channels=channels, image_size=size)
    data = split(32, channels, size)
    algo, privacy = private_edge(method, data, 8)
    if prepare:
        prepare(algo)
    before = torch.cat([t.detach().flatten().clone() for m in algo.models.values()
                        for t in m.state_dict().values() if t.is_floating_point()])
    torch.manual_seed(1)
    train_local(algo, data, 1, 8, 5, CPU, progress=False, privacy=privacy)
    after = torch.cat([t.detach().flatten() for m in algo.models.values()
                       for t in m.state_dict().values() if t.is_floating_point()])
    return after - before


def shift_reference(algo) -> None:
    algo.global_tensors = {k: v + 0.5 for k, v in algo.global_tensors.items()}


def shift_personal(algo) -> None:
    with torch.no_grad():
        for p in algo.models["personal"].parameters():
            p.add_(0.5)


def scaffold_controls(algo) -> None:
    algo.c_global = {k: torch.full_like(v, 0.5) for k, v in algo.c_global.items()}


@pytest.mark.parametrize("name, on, off, prepare", [
    ("fedprox", {"mu": 1.0}, {"mu": 0.0}, shift_reference),
    ("ditto", {"lam": 1.0}, {"lam": 0.0}, shift_personal),
    ("scaffold", {}, {}, scaffold_controls),
])
def test_parameter_only_terms_are_applied_after_clipping(name, on, off, prepare):
    """Per-sample clipping to C = 1e-3 bounds what the loss can move (4 steps x lr 0.1 x
    (C + noise)); the proximal pull / control-variate correction moves the weights far
    more, because it is added after clipping and noise, not clipped with the loss."""
    with_term = dp_update(name, on, prepare=prepare)
    without = dp_update(name, off, prepare=(None if name == "scaffold" else prepare))
    difference = (with_term - without).norm()
    assert difference > 0.5


@pytest.mark.parametrize("name, on, off, model, channels, size", [
    ("pfedme", {"lam": 15.0}, {"lam": 1.0}, "lenet-bn+gn", 1, 28),
    ("fedsap", {"gsr_form": "per-sample", "lam": 2.0, "target": "l2"},
     {"gsr_form": "per-sample", "lam": 0.0, "target": "l2"}, "se-cnn+gn", 1, 28),
    ("pfedka", {"kd": True}, {"kd": False}, "resnet10-cifar-compact+gn", 3, 32),
    ("fedrep", {"head_epochs": 1}, {"head_epochs": 0}, "lenet-bn+gn", 1, 28),
])
def test_every_loss_term_still_changes_the_update(name, on, off, model, channels, size):
    a = dp_update(name, on, model, clip=1.0, channels=channels, size=size)
    b = dp_update(name, off, model, clip=1.0, channels=channels, size=size)
    assert not torch.allclose(a, b, atol=1e-6)


# Per method: the model and parameters it runs under DP in the matrix below.
DP_SETUPS = {
    "fedsap": ("se-cnn+gn", {"gsr_form": "per-sample"}, 1, 28),
    "pfedka": ("resnet10-cifar-compact+gn", {}, 3, 32),
    "pfedla": ("lenet-bn+gn", {"attention": "se"}, 1, 28),
    "anfr": ("anfr-se-compact", {}, 3, 32),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(available_methods()) - {"fedproto", "fedstar"}))
def test_every_declared_method_trains_under_dp(name):
    """Each method that declares DP-SGD support passes the start checks and takes DP
    steps in the one loop: finite weights that moved, the model's own tensor names."""
    model, params, channels, size = DP_SETUPS.get(name, ("lenet-bn+gn", {}, 1, 28))
    try:
        method = make_method(name, model, params, dp_config(stats_in_clear=True),
                             in_channels=channels, image_size=size, batch_size=8)
    except ValueError as err:  # FedBN's rule selects nothing once BatchNorm is gone
        assert name == "fedbn" and "select" in str(err)
        return
    check_dp(method)
    names = {n: list(m.state_dict()) for n, m in method.build_models().items()}
    delta = dp_update(name, params, model, clip=1.0, channels=channels, size=size)
    assert torch.isfinite(delta).all() and delta.abs().sum() > 0
    assert names == {n: list(m.state_dict()) for n, m in method.build_models().items()}


# ---- statistics noise ----------------------------------------------------------------------


def test_statistics_are_clipped_noised_and_accounted_apart():
    method = make_method("pfedka", "resnet10-cifar-compact+gn",
                         dp=dp_config(stats_sigma=2.0, stats_clip=0.5), in_channels=3,
                         image_size=32)
    _, privacy = private_edge(method, split(40, 3, 32), 8)
    big = torch.full((1000,), 3.0)
    upload = Payload([Section(Kind.SCALAR_SUMMARY, "", {"n": torch.tensor(40.0),
                                                         "ce": torch.tensor(2.5)}),
                      Section(Kind.STAT_VECTORS, "s", {"v": big}),
                      Section(Kind.SHARED_TENSORS, "", {"w": big})])
    torch.manual_seed(0)
    out = privacy.privatize_upload(TRAIN, upload)
    assert float(out.tensors(Kind.SCALAR_SUMMARY)["n"]) == 40.0  # public: the header's n_k
    assert out.tensors(Kind.SHARED_TENSORS)["w"] is big          # covered by DP-SGD
    noise = out.tensors(Kind.STAT_VECTORS, "s")["v"] - big / big.norm() * 0.5
    assert float(noise.std()) == pytest.approx(2 * 0.5 * 2.0, rel=0.1)
    assert torch.equal(big, torch.full((1000,), 3.0))  # the method's own copy untouched
    figures = privacy.end_round(1)
    assert figures["dp_stats_epsilon"] == pytest.approx(epsilon([(2.0, 1.0, 2)], privacy.delta))
    assert figures["dp_epsilon"] == 0.0  # no DP-SGD step was taken


@pytest.mark.slow
def test_fedsap_per_sample_gsr_over_grpc_with_noised_statistics(tmp_path):
    dp = dp_config(noise_multiplier=0.8, planned_rounds=2, stats_sigma=1.0)
    received, engine = run_federation(tmp_path, "fedsap", model="se-cnn+gn", dp=dp,
                                      params={"gsr_form": "per-sample"}, sizes=[60, 60])
    for _, sections in received:
        assert set(sections) == {(Kind.SHARED_TENSORS, ""), (Kind.STAT_VECTORS, "gsr")}
    config = json.loads(engine.config_json)["dp"]
    assert config["stats_sigma"] == 1.0 and config["noise_multiplier"] == 0.8
    metrics = engine.history["rounds"][-1]["train"]["edge_metrics"]
    for figures in metrics.values():
        assert figures["dp_epsilon"] > 0 and figures["dp_stats_epsilon"] > 0
        assert not {"train_loss", "last_epoch_loss", "gsr_loss"} & set(figures)  # data stats
        assert figures["dp_total_epsilon_rdp"] > figures["dp_stats_epsilon"]
    ledger = json.loads((tmp_path / "state-0" / "privacy-ledger.json").read_text())
    assert len(ledger["rounds"]) == 2
    assert ledger["rounds"][-1]["dp_epsilon"] == pytest.approx(metrics["e0"]["dp_epsilon"])
    exported = {sample.labels["edge"]: sample.value
                for family in engine.metrics.dp_epsilon.collect() for sample in family.samples}
    assert exported == pytest.approx({e: m["dp_epsilon"] for e, m in metrics.items()})


# ---- real processes: the ledger survives SIGKILL; a spent budget stops the edge ---------------


def ledger_of(tmp_path, name: str = "a") -> dict:
    path = tmp_path / f"state-{name}" / "privacy-ledger.json"
    return json.loads(path.read_text()) if path.exists() else {"rounds": []}


DP_RUN = ["--dp", "--dp-fix-model", "--dp-noise-multiplier", "1.0", "--batch-size", "20",
          "--min-edges", "1", "--round-timeout", "60"]


@pytest.mark.slow
def test_ledger_survives_sigkill_and_the_spent_budget_stops_training(cluster, tmp_path):
    """The budget allows two trained rounds. The edge is SIGKILLed once round 1 is in its
    ledger; the restarted edge continues the ledger (not from 0), trains once more and
    then refuses: it leaves with the reason, which the server records, and exits 3. Had
    the restart reset the ledger it would have trained on. (Four rounds: the round the
    kill interrupts may pass without the edge; the server then waits for edges again.)"""
    data = edge_data(tmp_path / "data")
    two, three = (epsilon([(1.0, 0.2, 5 * r)], 0.001) for r in (2, 3))  # q = 20/100
    cluster.server(*DP_RUN, "--rounds", "4", "--dp-epsilon", f"{(two + three) / 2:.6f}")
    first = cluster.edge(data, "a")
    wait_for(lambda: len(ledger_of(tmp_path)["rounds"]) >= 1, 120, "round 1 in the ledger")
    first.kill(signal.SIGKILL)
    after_kill = ledger_of(tmp_path)
    second = cluster.edge(data, "a")
    second.wait_log(f"epsilon spent so far {after_kill['rounds'][-1]['dp_epsilon']:.4g} of", 60)
    assert second.wait(240) == 3
    assert "privacy budget spent: epsilon" in second.log()
    ledger = ledger_of(tmp_path)
    assert ledger["rounds"][: len(after_kill["rounds"])] == after_kill["rounds"]
    assert len(ledger["rounds"]) == 2 and ledger["history"] == [[1.0, 0.2, 10]]
    assert ledger["rounds"][-1]["dp_epsilon"] == pytest.approx(two)

    def refusal_recorded():
        path = tmp_path / "server-state" / "history.json"
        history = json.loads(path.read_text()) if path.exists() else {"rounds": []}
        reasons = [r["train"]["dropped"].get("a", "") for r in history["rounds"]]
        return history if any(r.startswith("left: privacy budget spent: epsilon")
                              for r in reasons) else None

    history = wait_for(refusal_recorded, 60, "the refusal in the server's history")
    spent = [r["train"]["edge_metrics"]["a"]["dp_epsilon"] for r in history["rounds"]
             if "a" in r["train"]["edge_metrics"]]
    assert spent[-1] == pytest.approx(two)
    assert history["manifest"]["dp"]["noise_multiplier"] == 1.0


@pytest.mark.parametrize("name", ["mobilenet-v3-small+gn", "gn-resnet-compact",
                                  "resnet10-cifar-compact+gn", "anfr-se-compact"])
def test_per_sample_gradients_through_in_place_residuals(name):
    """Each sample's gradient, as the DP wrapping computes it, equals the gradient of that
    sample alone: no layer mixes samples (the +gn fix), and the residual additions done in
    place (timm's and torchvision's blocks) neither break the hooks nor skew the result."""
    torch.manual_seed(0)
    model = disable_inplace_activations(build_model(name, 10, 3, 32).double())
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # the two forward passes must draw the same (no) dropout
    x, y = torch.randn(3, 3, 32, 32, dtype=torch.double), torch.tensor([0, 4, 9])
    alone = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x[1:2]), y[1:2]),
                                list(model.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        OutputHookGradSampleModule(model, loss_reduction="sum")
    torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    for (key, p), grad in zip(model.named_parameters(), alone, strict=True):
        assert torch.allclose(p.grad_sample[1], grad, atol=1e-9), key

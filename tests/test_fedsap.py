"""Fed-SAP: the split, GSR's value and gradients, the statistics round trip, the ablation
flags, and the method end to end over gRPC (nothing private on the wire)."""

from __future__ import annotations

import math

import pytest
import torch
from test_method_matrix import run_federation
from torch import nn
from torchvision.ops.misc import SqueezeExcitation

from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.methods.aggregators import PairwiseCosine
from fedattn_shared.methods.fedsap import (
    STATS,
    SqueezeRecorder,
    excitation_tensors,
    gsr_loss,
    mean_excitation,
    swapped_excitation,
)
from fedattn_shared.methods.split import squeeze_excitation_modules
from fedattn_shared.schema import Kind, Payload, Section
from fl_edge.store import PrivateStore, private_tensors
from fl_edge.trainer import train_local

STATS_KEY = (Kind.STAT_VECTORS, STATS)
SHARED = (Kind.SHARED_TENSORS, "")


def fedsap(model: str = "se-cnn", **params):
    channels, size = (3, 32) if model == "mobilenet-v3-small" else (1, 28)
    cls = load_method("fedsap")
    train = TrainConfig(model=model, in_channels=channels, image_size=size, lr=0.05)
    method = cls(MethodContext(train, cls.Params(**params)))
    models = method.build_models()
    return method, models


def se_excitation_names(model: nn.Module) -> set[str]:
    return {f"model/{name}.{fc}.{k}" for name, m in squeeze_excitation_modules(model)
            for fc in ("fc1", "fc2") for k in ("weight", "bias")}


def float_names(model: nn.Module) -> set[str]:
    return {f"model/{k}" for k, v in model.state_dict().items() if v.is_floating_point()}


def test_mobilenet_v3_small_layout_matches_methods_md():
    """METHODS.md 3.1: 9 SE modules, 461,640 private parameters, 2,296 statistic floats."""
    method, models = fedsap("mobilenet-v3-small")
    model = models["model"]
    se = squeeze_excitation_modules(model)
    assert [name for name, _ in se] == ["features.1.block.1"] + [
        f"features.{i}.block.2" for i in range(4, 12)]
    assert [m.fc1.in_channels for _, m in se] == [16, 96, 240, 240, 120, 144, 288, 576, 576]
    assert [m.fc1.out_channels for _, m in se] == [8, 24, 64, 64, 32, 40, 72, 144, 144]
    shared = method.shared_specs(models)
    private = float_names(model) - set(shared)
    assert private == se_excitation_names(model)
    state = model.state_dict()
    assert sum(state[n.removeprefix("model/")].numel() for n in private) == 461_640
    stats = method.uplink_schema("train", models)[1]
    assert stats.kind == Kind.STAT_VECTORS
    assert sum(math.prod(t.shape) for t in stats.tensors.values()) == 2_296


def toy_two_se_net() -> nn.Sequential:
    """Two SE modules on 2 channels with zero excitation weights: each gate is
    sigmoid(0) = 0.5, so the second squeeze is half the first."""
    net = nn.Sequential(SqueezeExcitation(2, 1), SqueezeExcitation(2, 1))
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    return net


def test_gsr_value_hand_computed():
    net = toy_two_se_net()
    recorder = SqueezeRecorder(net)
    # Two samples, 2 channels, 1x2 pixels. Squeezes (spatial means): sample 0 -> [2, 2],
    # sample 1 -> [6, 2]; batch mean s1 = [4, 2], and s2 = 0.5 * s1 = [2, 1].
    x = torch.tensor([[[[1.0, 3.0]], [[2.0, 2.0]]], [[[5.0, 7.0]], [[0.0, 4.0]]]])
    _, squeezes = recorder.forward(net, x)
    target = {"0": torch.tensor([1.0, 2.0]), "1": torch.tensor([0.0, 0.0])}
    # ||[4,2]-[1,2]||^2 + ||[2,1]-[0,0]||^2 = 9 + 5
    assert float(gsr_loss(squeezes, target).detach()) == pytest.approx(14.0)
    assert recorder.squeezes is None  # hooks record only inside recorder.forward
    net(x)
    assert recorder.squeezes is None


def test_gsr_gradient_reaches_shared_convs_not_the_last_excitation():
    method, models = fedsap(lam=2.0)
    edge = method.edge(models, torch.device("cpu"))
    model = edge.models["model"]
    x = torch.randn(8, 1, 28, 28)
    edge.target = {k: torch.full_like(v, 0.3) for k, v in edge.target.items()}
    edge.train_mode()
    _, squeezes = edge.recorder.forward(model, x)
    gsr_loss(squeezes, edge.target).backward()
    grads = {f"model/{n}": p.grad for n, p in model.named_parameters()}
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)
             and ".fc" not in n]
    assert all(grads[f"model/{n}.weight"].abs().sum() > 0 for n in convs)
    se = [name for name, _ in squeeze_excitation_modules(model)]
    last = se[-1]
    for fc in ("fc1", "fc2"):
        for k in ("weight", "bias"):
            g = grads[f"model/{last}.{fc}.{k}"]
            assert g is None or torch.equal(g, torch.zeros_like(g))
    # Earlier SE modules scale what later squeezes see: their excitation gets gradient.
    assert grads[f"model/{se[0]}.fc2.weight"].abs().sum() > 0
    assert grads["model/classifier.weight"] is None  # after every squeeze
    assert not any(t.requires_grad for t in edge.target.values())


def test_training_loss_is_ce_plus_lambda_gsr():
    torch.manual_seed(0)
    x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
    losses = {}
    for target, lam in (("global", 2.0), ("global", 0.5), ("off", 2.0), ("l2", 2.0)):
        method, models = fedsap(target=target, lam=lam)
        edge = method.edge(models, torch.device("cpu"))
        edge.eval_mode()  # deterministic BN for comparing losses across instances
        if target == "global":
            edge.target = {k: torch.full_like(v, 0.1) for k, v in edge.target.items()}
        losses[(target, lam)] = float(edge.training_step((x, y)).detach())
        logits, squeezes = edge.recorder.forward(models["model"], x)
        ce = float(nn.functional.cross_entropy(logits, y).detach())
        zeros = {k: torch.zeros_like(v) for k, v in edge.target.items()}
        if target == "off":
            assert losses[(target, lam)] == pytest.approx(ce)
        elif target == "l2":
            assert losses[(target, lam)] == pytest.approx(
                ce + lam * float(gsr_loss(squeezes, zeros, "mean").detach()), rel=1e-5)
        else:
            assert losses[(target, lam)] == pytest.approx(
                ce + lam * float(gsr_loss(squeezes, edge.target, "mean").detach()), rel=1e-5)
    gsr_2 = losses[("global", 2.0)] - losses[("off", 2.0)]
    gsr_half = losses[("global", 0.5)] - losses[("off", 2.0)]
    assert gsr_2 == pytest.approx(4 * gsr_half, rel=1e-4)


def test_wait_for_stats_skips_gsr_until_the_first_statistics():
    method, models = fedsap(wait_for_stats=True)
    edge = method.edge(models, torch.device("cpu"))
    assert not edge.gsr_active()  # S_G^0 = 0: no target yet
    common = Payload([Section(Kind.STAT_VECTORS, STATS,
                              {k: torch.full_like(v, 0.2) for k, v in edge.target.items()})])
    edge.receive("train", common, Payload())
    assert edge.gsr_active()
    faithful, models = fedsap()
    assert faithful.edge(models, torch.device("cpu")).gsr_active()  # round 1 pulls toward 0


@pytest.mark.parametrize("stats_mode", ["train", "eval", "eval-upload"])
def test_statistics_are_the_mean_squeeze_over_the_training_set(stats_mode):
    method, models = fedsap(stats_mode=stats_mode)
    edge = method.edge(models, torch.device("cpu"))
    model = edge.models["model"]
    x = torch.randn(10, 1, 28, 28)
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    edge.end_train([(x[:4], None), (x[4:], None)])
    assert model.training  # the pass leaves the model in the mode it found
    # Train mode normalises each batch by its own statistics, yet BN's running
    # statistics are as before the pass.
    assert all(torch.equal(b, buffers[k]) for k, b in model.named_buffers())
    expected = {}
    for name, module in squeeze_excitation_modules(model):
        seen = []
        handle = module.register_forward_pre_hook(lambda m, i, seen=seen: seen.append(i[0]))
        model.train(stats_mode == "train")
        with torch.no_grad():
            for batch in (x[:4], x[4:]):
                model(batch)
        handle.remove()
        expected[name] = torch.cat(seen).mean(dim=(0, 2, 3))
    assert edge.own_stats.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(edge.own_stats[name], expected[name], atol=1e-6)
    upload = edge.after_train(1)
    assert upload.tensors(*STATS_KEY).keys() == expected.keys()
    if stats_mode == "train":  # batch statistics differ from running ones
        model.eval()
        assert not torch.allclose(edge.own_stats[name], model.features[:-1](x).mean(dim=(0, 2, 3)))


def test_server_statistics_and_weights_are_the_weighted_mean():
    method, models = fedsap()
    agg = method.server(models)
    zeros = agg.state[STATS_KEY]
    assert all(torch.equal(v, torch.zeros_like(v)) for v in zeros.values())  # S_G^0 = 0
    agg.begin_round(1, ["a", "b"], 2)
    stats = [{k: torch.full_like(v, float(i + 1)) for k, v in zeros.items()} for i in range(2)]
    shared = [{k: torch.full(s.shape, float(10 * (i + 1))) for k, s in agg.specs.items()}
              for i in range(2)]
    for i, weight in enumerate((10.0, 30.0)):
        agg.accept("ab"[i], Payload([Section(Kind.SHARED_TENSORS, "", shared[i]),
                                     Section(Kind.STAT_VECTORS, STATS, stats[i])]), weight)
    agg.finish()
    for v in agg.state[STATS_KEY].values():
        assert torch.allclose(v, torch.full_like(v, (1 * 10 + 2 * 30) / 40))  # 1.75
    for name, v in agg.state[SHARED].items():
        if v.is_floating_point():
            assert torch.allclose(v, torch.full_like(v, (10 * 10 + 20 * 30) / 40)), name


def test_pairwise_cosine_hand_computed():
    cosine = PairwiseCosine({"g": ["w"]})
    for vector in ([1.0, 0.0], [1.0, 1.0], [0.0, 2.0]):
        cosine.add({"w": torch.tensor(vector)})
    # pairs: 1/sqrt(2), 0, 1/sqrt(2)
    assert cosine.result()["g"] == pytest.approx(2 / math.sqrt(2) / 3)
    cosine.reset()
    cosine.add({"w": torch.tensor([1.0, 0.0])})
    assert cosine.result() == {}  # one upload has no pairs


@pytest.mark.parametrize("personalization,private", [
    ("pse", "se-e"), ("fedavg", "none"), ("local", "all"), ("agg-se-e", "all-but-se-e")])
def test_personalization_flag_changes_exactly_the_split(personalization, private):
    method, models = fedsap(personalization=personalization)
    model = models["model"]
    everything = float_names(model)
    se_e = se_excitation_names(model)
    expected_private = {"se-e": se_e, "none": set(), "all": everything,
                        "all-but-se-e": everything - se_e}[private]
    assert float_names(model) - set(method.shared_specs(models)) == expected_private
    schema = {(s.kind, s.name) for s in method.uplink_schema("train", models)}
    assert STATS_KEY in schema  # the default target (global) always uploads statistics
    assert (SHARED in schema) == (private != "all")


@pytest.mark.parametrize("target,uploads,broadcasts", [
    ("global", True, True), ("local-align", False, False), ("l2", False, False),
    ("off", False, False)])
def test_target_flag_changes_what_travels(target, uploads, broadcasts):
    method, models = fedsap(target=target)
    schema = {(s.kind, s.name) for s in method.uplink_schema("train", models)}
    assert (STATS_KEY in schema) == uploads
    assert (STATS_KEY in method.initial_state(models)) == broadcasts
    assert SHARED in schema  # pSE: the shared part always travels
    assert set(method.shared_specs(models)) == float_names(models["model"]) - \
        se_excitation_names(models["model"])


def test_local_align_pulls_toward_the_edges_own_previous_statistics(tmp_path):
    method, models = fedsap(target="local-align")
    edge = method.edge(models, torch.device("cpu"))
    x, y = torch.randn(12, 1, 28, 28), torch.randint(0, 10, (12,))
    from fedattn_shared.data.npz import Split

    data = Split(x, y)
    train_local(edge, data, 1, 4, seed=0, device=torch.device("cpu"), progress=False)
    first = {k: v.clone() for k, v in edge.own_stats.items()}
    assert first and all(v.abs().sum() > 0 for v in first.values())
    edge.begin_train()
    assert all(torch.equal(edge.target[k], first[k]) for k in first)
    # The statistics are private state: saved and restored with the edge.
    store = PrivateStore(tmp_path)
    fingerprint = method.fingerprint(models)
    store.save(edge, fingerprint, 1, "train")
    method2, models2 = fedsap(target="local-align")
    fresh = method2.edge(models2, torch.device("cpu"))
    store.load(fresh, fingerprint)
    assert all(torch.equal(fresh.own_stats[k], first[k]) for k in first)


def test_bad_parameters_and_models_are_refused_by_name():
    with pytest.raises(ValueError, match="fedsap.personalization"):
        fedsap(personalization="fedbn")
    with pytest.raises(ValueError, match="fedsap.target"):
        fedsap(target="global-ish")
    with pytest.raises(ValueError, match="fedsap.lam"):
        fedsap(lam=-1.0)
    with pytest.raises(ValueError, match="no squeeze-excitation modules"):
        fedsap(model="lenet-bn")


def test_fedsap_over_grpc_keeps_se_excitation_home_and_reloads_it(tmp_path):
    from fl_edge import export as tools

    received, engine = run_federation(tmp_path, "fedsap", model="se-cnn", rounds=2)
    method, models = fedsap()
    se_e = se_excitation_names(models["model"])
    assert len(received) == 4
    for _, sections in received:
        assert set(sections) == {SHARED, STATS_KEY}
        assert not se_e & set(sections[SHARED])
        assert set(sections[SHARED]) == float_names(models["model"]) - se_e
    # S_G moved off zero: the round's statistics were averaged into it. (Pulled toward
    # S_G^0 = 0 in round 1, the toy model's last block may fall silent entirely.)
    stats = engine.aggregator.state[STATS_KEY]
    assert float(stats["features.3"].abs().sum()) > 0
    assert all(torch.isfinite(v).all() and (v >= 0).all() for v in stats.values())  # post-ReLU
    record = engine.history["rounds"][-1]
    assert set(record["aggregate"]["cosine_similarity"]) == {"conv"}  # SE-E is not uploaded
    assert record["bytes"]["up"]["stat_vectors"]["raw"] == 2 * 112 * 4
    # The round's GSR figures travel as monitoring scalars into the history.
    metrics = record["train"]["edge_metrics"]
    assert len(metrics) == 2
    assert all(m["gsr_loss"] >= 0 and math.isfinite(m["stats_drift"]) for m in metrics.values())
    # Each edge's SE-E layers are in its private state, and they are its own.
    first = private_tensors(tools.from_state_dir(tmp_path / "state-0").algo)
    second = private_tensors(tools.from_state_dir(tmp_path / "state-1").algo)
    assert se_e <= set(first) and se_e <= set(second)
    assert all(not torch.equal(first[n], second[n]) for n in se_e if n.endswith("weight"))


def test_restarted_edge_reloads_its_se_excitation_bit_exactly(tmp_path):
    from fedattn_shared.data.npz import Split

    method, models = fedsap()
    edge = method.edge(models, torch.device("cpu"))
    data = Split(torch.randn(12, 1, 28, 28), torch.randint(0, 10, (12,)))
    train_local(edge, data, 1, 4, seed=0, device=torch.device("cpu"), progress=False)
    fingerprint = method.fingerprint(models)
    PrivateStore(tmp_path).save(edge, fingerprint, 1, "train")
    trained = private_tensors(edge)

    method2, models2 = fedsap()
    fresh = method2.edge(models2, torch.device("cpu"))
    se_e = se_excitation_names(models2["model"])
    assert not all(torch.equal(private_tensors(fresh)[n], trained[n]) for n in se_e)
    PrivateStore(tmp_path).load(fresh, fingerprint)
    reloaded = private_tensors(fresh)
    assert se_e <= set(reloaded)
    assert all(torch.equal(reloaded[n], trained[n]) for n in se_e)


def test_fedavg_personalization_records_conv_and_se_similarity(tmp_path):
    _, engine = run_federation(tmp_path, "fedsap", model="se-cnn", rounds=1,
                               params={"personalization": "fedavg", "target": "off"})
    similarity = engine.history["rounds"][-1]["aggregate"]["cosine_similarity"]
    assert set(similarity) == {"conv", "se-e"}
    assert all(0.5 < v <= 1.0 for v in similarity.values())


def test_mean_reduction_averages_each_modules_channels():
    net = toy_two_se_net()
    x = torch.tensor([[[[1.0, 3.0]], [[2.0, 2.0]]], [[[5.0, 7.0]], [[0.0, 4.0]]]])
    _, squeezes = SqueezeRecorder(net).forward(net, x)
    target = {"0": torch.tensor([1.0, 2.0]), "1": torch.tensor([0.0, 0.0])}
    # (9 + 0) / 2 + (4 + 1) / 2
    assert float(gsr_loss(squeezes, target, "mean").detach()) == pytest.approx(7.0)
    with pytest.raises(ValueError, match="fedsap.reduction"):
        fedsap(reduction="max")


def test_reduction_flag_switches_the_training_loss_to_eq6_as_printed():
    torch.manual_seed(0)
    x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
    method, models = fedsap(reduction="sum")
    edge = method.edge(models, torch.device("cpu"))
    edge.eval_mode()
    loss = float(edge.training_step((x, y)).detach())
    logits, squeezes = edge.recorder.forward(models["model"], x)
    ce = float(nn.functional.cross_entropy(logits, y).detach())
    summed = float(gsr_loss(squeezes, edge.target, "sum").detach())
    assert loss == pytest.approx(ce + 2.0 * summed, rel=1e-5)
    assert summed > float(gsr_loss(squeezes, edge.target, "mean").detach())


def test_eval_stats_mode_takes_gsr_under_running_statistics():
    """stats_mode = "eval": CE from the training forward (batch statistics), GSR from a
    second forward under BN's running statistics; the running statistics move once per
    step, as without GSR, and every module's mode is restored."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 1, 28, 28) * 2 + 1, torch.randint(0, 10, (6,))
    method, models = fedsap(stats_mode="eval", lam=2.0)
    edge = method.edge(models, torch.device("cpu"))
    model = edge.models["model"]
    edge.target = {k: torch.full_like(v, 0.1) for k, v in edge.target.items()}
    edge.train_mode()
    before = {k: b.clone() for k, b in model.named_buffers()}
    loss = edge.training_step((x, y))
    assert model.training and all(m.training for m in model.modules())
    after = {k: b.clone() for k, b in model.named_buffers()}

    with torch.no_grad():
        for k, b in model.named_buffers():
            b.copy_(before[k])
    logits = model(x)  # one training-mode forward moves the running statistics like this
    assert all(torch.equal(b, after[k]) for k, b in model.named_buffers())
    ce = nn.functional.cross_entropy(logits, y)
    model.eval()
    _, squeezes = edge.recorder.forward(model, x)
    expected = ce + 2.0 * gsr_loss(squeezes, edge.target, "mean")
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    model.train()
    _, train_squeezes = edge.recorder.forward(model, x)
    assert not torch.allclose(train_squeezes["features.3"].mean(0), squeezes["features.3"].mean(0))


def test_training_metrics_report_the_mean_gsr_term_and_the_drift():
    from fedattn_shared.data.npz import Split
    from fedattn_shared.methods.fedsap import statistics_drift

    # Drift, hand-computed: module a: ||[3,4]-[0,0]||... skipped (zero target);
    # b: ||[1,1]-[1,0]|| / ||[1,0]|| = 1; c: ||[2,0]-[4,0]|| / 4 = 0.5 -> mean 0.75.
    stats = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, 1.0]), "c": torch.tensor([2.0, 0.0])}
    target = {"a": torch.zeros(2), "b": torch.tensor([1.0, 0.0]), "c": torch.tensor([4.0, 0.0])}
    assert statistics_drift(stats, target) == pytest.approx(0.75)

    method, models = fedsap(lam=2.0)
    edge = method.edge(models, torch.device("cpu"))
    edge.receive("train", Payload([Section(Kind.STAT_VECTORS, STATS, {
        k: torch.full_like(v, 0.2) for k, v in edge.target.items()})]), Payload())
    seen = []
    step = edge.training_step
    edge.training_step = lambda batch: seen.append(
        float(gsr_loss(edge.recorder.forward(edge.models["model"], batch[0])[1], edge.target,
                       "mean").detach())) or step(batch)
    data = Split(torch.randn(12, 1, 28, 28), torch.randint(0, 10, (12,)))
    train_local(edge, data, 1, 4, seed=0, device=torch.device("cpu"), progress=False)
    metrics = edge.training_metrics()
    assert len(seen) == 3 and metrics["gsr_loss"] > 0
    assert metrics["stats_drift"] == pytest.approx(statistics_drift(edge.own_stats, edge.target))
    off, models = fedsap(target="off")
    assert off.edge(models, torch.device("cpu")).training_metrics() == {}


def test_parameter_dependent_rules_are_checked_like_declared_ones(monkeypatch):
    """Fed-SAP's split depends on ``personalization``; the base checks the chosen rules on
    the run's model once the method is built, as it checks declared ones: a rule that
    selects nothing is refused (here 'bn' on the BatchNorm-free anfr-se-compact)."""
    from fedattn_shared.methods import fedsap

    cls = load_method("fedsap")
    train = TrainConfig(model="anfr-se-compact", in_channels=3, image_size=32, num_classes=10)
    method = cls(MethodContext(train, cls.Params()))  # pse: the SE excitation, which it has
    assert method.split_rules()["model"] == ("se-e",)
    monkeypatch.setitem(fedsap.PERSONALIZATION, "pse", ("bn",))
    with pytest.raises(ValueError, match="split rule 'bn' selects nothing in model "
                                          "'anfr-se-compact'"):
        cls(MethodContext(train, cls.Params()))
    with pytest.raises(AttributeError, match="part of the method's declaration"):
        method.private_rules = ("bn",)  # declarations are fixed once the class is built


def test_se_cnn_tail_puts_a_shared_conv_block_between_the_last_se_and_the_head():
    """se-cnn's last SE module feeds the pooled classifier directly (a private head under
    pSE); se-cnn-tail puts a shared conv block after it, and splits like se-cnn otherwise."""
    plain, tail = fedsap("se-cnn"), fedsap("se-cnn-tail")
    for method, models in (plain, tail):
        model = models["model"]
        assert [m.fc1.in_channels for _, m in squeeze_excitation_modules(model)] == [16, 32, 64]
        assert float_names(model) - set(method.shared_specs(models)) == se_excitation_names(model)
        assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    after_last_se = [type(m) for m in list(tail[1]["model"].features)[-3:]]
    assert after_last_se == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU]
    assert isinstance(list(plain[1]["model"].features)[-1], SqueezeExcitation)
    fedper = load_method("fedper")
    train = TrainConfig(model="se-cnn-tail", in_channels=1, image_size=28)
    method = fedper(MethodContext(train, fedper.Params()))
    models = method.build_models()
    private = float_names(models["model"]) - set(method.shared_specs(models))
    assert private == {"model/classifier.weight", "model/classifier.bias"}


def test_swapped_excitation_is_the_weighted_mean_of_one_module_and_is_undone():
    """The per-module swap diagnostic's mechanics, hand-computed: module m's excitation
    becomes sum_k w_k e_k / sum_k w_k on a model, the other modules keep their own, the
    output changes only inside the block, and the model is bit-identical afterwards."""
    torch.manual_seed(0)
    nets = [fedsap()[1]["model"].eval() for _ in range(2)]
    names = [name for name, _ in squeeze_excitation_modules(nets[0])]
    target = names[1]
    with torch.no_grad():  # edge 1's gates on this module differ clearly from edge 0's
        dict(squeeze_excitation_modules(nets[1]))[target].fc2.bias.add_(3.0)
    mean = mean_excitation(nets, [1.0, 3.0], target)
    own = [excitation_tensors(n, target) for n in nets]
    for key, value in mean.items():
        torch.testing.assert_close(value, 0.25 * own[0][key] + 0.75 * own[1][key])
    x = torch.randn(4, 1, 28, 28)
    before = {k: v.clone() for k, v in nets[0].state_dict().items()}
    out_before = nets[0](x)
    with swapped_excitation(nets[0], target, mean):
        swapped = excitation_tensors(nets[0], target)
        assert all(torch.equal(swapped[k], mean[k]) for k in mean)
        for other in (names[0], names[2]):
            assert all(torch.equal(v, before[f"{other}.{k}"])
                       for k, v in excitation_tensors(nets[0], other).items())
        assert not torch.allclose(nets[0](x), out_before)
    assert all(torch.equal(v, before[k]) for k, v in nets[0].state_dict().items())
    assert torch.equal(nets[0](x), out_before)
    # The mean of identical excitations (FedAvg's shared SE) swaps in nothing new.
    same = mean_excitation([nets[0], nets[0]], [2.0, 5.0], target)
    with swapped_excitation(nets[0], target, same):
        torch.testing.assert_close(nets[0](x), out_before)
    with pytest.raises(ValueError, match="fc1.weight"):
        with swapped_excitation(nets[0], target, {"fc1.weight": mean["fc1.weight"]}):
            pass

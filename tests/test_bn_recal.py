"""The BN-recalibrated evaluation diagnostic (``train.bn_recalibrated_eval``): each edge
scores its model again after recomputing the BatchNorm running statistics on its own train
split, weights unchanged, and its state afterwards is what it was before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedattn_shared.config import TrainConfig
from fedattn_shared.data.npz import Split
from fedattn_shared.methods import MethodContext, load_method
from fl_edge.trainer import evaluate, recalibrated_bn

CPU = torch.device("cpu")


class OffsetDomain(nn.Module):
    """A hand-made model whose answer depends only on BN's running mean: one feature,
    normalised (no affine), then class 1 iff it is above the running mean. With the
    statistics of another domain (mean 0) every sample of this domain (around 10) reads as
    class 1; with its own they split exactly."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(1, affine=False)
        self.head = nn.Linear(1, 2)
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor([[-1.0], [1.0]]))
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(x.flatten(1)[:, :1]))


def edge_with(model: nn.Module):
    cls = load_method("fedavg")
    method = cls(MethodContext(TrainConfig(num_classes=2), cls.Params()))
    return method.edge({"model": model}, CPU)


def domain(n: int, offset: float = 10.0) -> Split:
    """n samples, alternating class 0 at offset - 1 and class 1 at offset + 1."""
    y = torch.arange(n) % 2
    return Split((offset + 2.0 * y - 1.0).reshape(n, 1, 1, 1), y)


def snapshot(algo) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in algo.models["model"].state_dict().items()}


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_recalibration_fixes_foreign_statistics_and_leaves_the_state_as_it_was():
    algo = edge_with(OffsetDomain())  # fresh BN statistics: mean 0, var 1, as a foreign domain's
    bn = algo.models["model"].bn
    train, test = domain(70), domain(40)
    before = snapshot(algo)
    plain = evaluate(algo, test, "test", 2, 16, CPU)
    assert plain.accuracy == 0.5  # every sample reads as class 1
    with recalibrated_bn(algo, train, 32, CPU) as recalibrated:
        assert recalibrated
        # Batches of 32, 32 and 6 (in order); momentum None: each batch's mean weighs the same.
        means = [float(train.x[a:b].mean()) for a, b in ((0, 32), (32, 64), (64, 70))]
        assert float(bn.running_mean) == pytest.approx(sum(means) / 3, abs=1e-5)
        assert int(bn.num_batches_tracked) == 3
        assert not bn.training  # scored in eval mode
        fixed = evaluate(algo, test, "test", 2, 16, CPU)
    assert fixed.accuracy == 1.0 and fixed.loss_sum < plain.loss_sum
    assert bn.momentum == 0.1
    assert_bit_identical(snapshot(algo), before)
    again = evaluate(algo, test, "test", 2, 16, CPU)
    assert (again.confusion == plain.confusion).all() and again.loss_sum == plain.loss_sum


def test_the_state_is_restored_when_scoring_fails():
    algo = edge_with(OffsetDomain())
    algo.models["model"].bn.running_var.fill_(3.0)
    before = snapshot(algo)
    with pytest.raises(RuntimeError, match="scoring failed"):
        with recalibrated_bn(algo, domain(20), 8, CPU):
            assert not torch.equal(algo.models["model"].bn.running_var, before["bn.running_var"])
            raise RuntimeError("scoring failed")
    assert_bit_identical(snapshot(algo), before)
    assert algo.models["model"].bn.momentum == 0.1


def test_recalibrated_scores_are_bit_identical_on_repeat_and_dropout_stays_off():
    """lenet-bn (four BN layers; a Dropout(0.9) put before its classifier, which would
    scramble the statistics if it were on) behind a real edge, recalibrated on a shifted
    domain: the figures change, twice the same to the bit, and the state is untouched."""
    def run_once():
        cls = load_method("fedavg")
        method = cls(MethodContext(TrainConfig(model="lenet-bn", seed=3), cls.Params()))
        models = method.build_models()
        models["model"].classifier.insert(0, nn.Dropout(0.9))
        algo = method.edge(models, CPU)
        g = torch.Generator().manual_seed(0)
        train = Split(torch.randn(50, 1, 28, 28, generator=g) * 2 + 1,
                      torch.randint(0, 10, (50,), generator=g))
        test = Split(torch.randn(30, 1, 28, 28, generator=g) * 2 + 1,
                     torch.randint(0, 10, (30,), generator=g))
        before = snapshot(algo)
        plain = evaluate(algo, test, "test", 10, 16, CPU)
        with recalibrated_bn(algo, train, 16, CPU):
            recal = evaluate(algo, test, "test", 10, 16, CPU)
        assert_bit_identical(snapshot(algo), before)
        return plain, recal

    (plain1, recal1), (plain2, recal2) = run_once(), run_once()
    assert plain1.loss_sum == plain2.loss_sum
    assert recal1.loss_sum != plain1.loss_sum  # the statistics changed the figures
    assert recal1.loss_sum == recal2.loss_sum and recal1.brier_sum == recal2.brier_sum
    assert (recal1.confusion == recal2.confusion).all()


def test_models_without_batchnorm_give_no_figure_and_are_not_touched():
    model = nn.Sequential(nn.Flatten(), nn.Linear(1, 2))
    algo = edge_with(model)
    before = snapshot(algo)
    with recalibrated_bn(algo, domain(10), 4, CPU) as recalibrated:
        assert not recalibrated
    assert_bit_identical(snapshot(algo), before)


def test_evaluation_splits_follow_the_switch():
    assert TrainConfig().evaluation_splits == ("test", "global_test")
    assert TrainConfig(bn_recalibrated_eval=True).evaluation_splits == (
        "test", "global_test", "test_bnrecal", "global_test_bnrecal")


def test_real_edges_report_the_recalibrated_splits(cluster, tmp_path):
    """fl-server sends the switch in [train]; real fl-edge processes score both splits
    twice and the server records the recalibrated ones beside the plain ones."""
    import numpy as np
    from conftest import make_images, read_history, write_edge_dirs

    dirs = write_edge_dirs(tmp_path, 2, per_edge=60)
    x, y = make_images(40, seed=7)
    for d in dirs:
        np.savez(d / "global_test.npz", x=x, y=y)
    server = cluster.server("--method", "fedavg", "--rounds", "1", "--min-edges", "2",
                            "--set", "train.bn_recalibrated_eval=true")
    edges = [cluster.edge(d, f"b{i}") for i, d in enumerate(dirs)]
    assert [e.wait() for e in edges] == [0, 0]
    assert server.wait() == 0
    (record,) = read_history(tmp_path / "server-state")["rounds"]
    evaluation = record["evaluation"]
    for figures in evaluation["per_edge"].values():
        assert figures["test_bnrecal"]["n"] == figures["test"]["n"] > 0
        assert figures["global_test_bnrecal"]["n"] == figures["global_test"]["n"] == 40
    assert evaluation["summary"]["test_bnrecal"]["edges"] == 2
    assert evaluation["summary"]["global_test_bnrecal"]["edges"] == 2

"""bench/pfedka.py --global-every: the global model of a past round is scored from that
round's checkpoint, not the latest one, and rounds whose checkpoint was pruned are left
out (issue #24: how far the teacher got, per round). A hand-made run: round r's model
answers class r on every image (its head's bias), so each round scores the share of its
class in the labels: 25 % (round 1), 75 % (round 3), 0 % (round 4)."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import bench_script

from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fl_server.checkpoint import CheckpointStore


@pytest.fixture(scope="module")
def bench():
    with bench_script("pfedka") as module:
        yield module


def answering(train: TrainConfig, label: int) -> tuple[str, torch.nn.Module]:
    """A FedAvg model whose head's bias makes it answer ``label`` whatever the image."""
    cls = load_method("fedavg")
    method = cls(MethodContext(train, cls.Params()))
    name = method.model_names()[0]
    model = method.build_models()[name].eval()
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        head.bias[label] += 1e4
    return name, model


def test_global_curve_scores_each_kept_round_from_its_own_checkpoint(tmp_path, bench):
    train = TrainConfig(model="lenet-bn", in_channels=1, image_size=28)
    images = np.random.default_rng(0).integers(0, 256, (40, 28, 28), dtype=np.uint8)
    (tmp_path / "data").mkdir()
    np.savez(tmp_path / "data" / "global_test.npz", x=images,
             y=np.array([1] * 10 + [3] * 30, dtype=np.int64))
    models = {r: answering(train, r) for r in (1, 2, 3, 4)}

    run_dir = tmp_path / "run"
    store = CheckpointStore(run_dir / "server", keep=10)
    for number, (name, model) in models.items():
        tensors = {f"global:shared_tensors::{name}/{k}": v for k, v in model.state_dict().items()}
        store.save(number, tensors, {})
    (run_dir / "server" / "history.json").write_text(json.dumps({"manifest": {
        "method": "fedavg", "train": dataclasses.asdict(train),
        "params": dataclasses.asdict(load_method("fedavg").Params())}}))
    pruned = store.rounds_dir() / "000002"
    for file in pruned.iterdir():
        file.unlink()
    pruned.rmdir()

    args = SimpleNamespace(out=tmp_path, global_every=1)
    curve = bench.global_curve(run_dir, args, rounds=4, pfedka=False)
    assert [(r, g) for r, g, _ in curve] == [(1, 25.0), (3, 75.0), (4, 0.0)]
    assert all(math.isnan(ca) for _, _, ca in curve)  # not pFedKA: no CA path to score
    args.global_every = 3  # every 3rd round and the last
    assert [r for r, _, _ in bench.global_curve(run_dir, args, 4, False)] == [3, 4]
    # the latest checkpoint is what a call without a round scores
    assert bench.global_accuracy(run_dir, args) == 0.0
    assert bench.global_accuracy(run_dir, args, round_number=1) == 25.0

"""bench/calibrate.py (issue #44, item 1): the published model, the published protocol's
settings, and a tiny run of the protocol through the bench's own entry point (real fl-sim)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, SHARED_DATA, bench_script

from fedattn_shared.models import build_model, model_spec

CIFAR10 = SHARED_DATA / "cifar-10" / "cifar-10-batches-bin"

# Flower's baselines/niid_bench/niid_bench/models.py, class CNN(input_dim=400,
# hidden_dims=[120, 84], num_classes=10): parameter shapes in state-dict order.
PUBLISHED_SHAPES = [(6, 3, 5, 5), (6,), (16, 6, 5, 5), (16,), (120, 400), (120,), (84, 120), (84,),
                    (10, 84), (10,)]


@pytest.fixture(scope="module")
def bench():
    with bench_script("calibrate") as module:
        yield module


def test_niid_cnn_is_the_published_network():
    model = build_model("niid-cnn", 10, 3, 32)
    shapes = [tuple(t.shape) for t in model.state_dict().values()]
    assert shapes == PUBLISHED_SHAPES
    # 456 + 2,416 + 48,120 + 10,164 + 850: the 10-class CIFAR LeNet-style CNN
    assert sum(p.numel() for p in model.parameters()) == 62_006
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    head = model_spec("niid-cnn").head
    assert {f"{head}.weight", f"{head}.bias"} <= set(model.state_dict())
    # The MNIST form (the reproduction's CNNMnist): 16 x 4 x 4 = 256 features at 28x28.
    assert build_model("niid-cnn", 10, 1, 28).fc1.in_features == 256


def test_the_rows_and_settings_are_the_reproductions(bench):
    assert {r.name: r.published[0] for r in bench.ROWS.values()} == {
        "fedavg-dir": 62.47, "fedprox-dir": 65.63, "scaffold-dir": 68.08,
        "fedavg-iid": 71.32, "fedprox-iid": 71.26, "scaffold-iid": 71.66}
    args = bench.argparse.Namespace(lr=0.01, batch_size=64, momentum=0.9, weight_decay=1e-5,
                                    epochs=10, augment="crop-flip", round_timeout=60.0, mu=0.01,
                                    optimizer_state="reset", scaffold_form="paper",
                                    input_range="symmetric")
    fedprox = bench.train_sets(args, "fedprox")
    assert (fedprox["train.model"], fedprox["train.momentum"], fedprox["train.weight_decay"],
            fedprox["fedprox.mu"], fedprox["train.lr_schedule"],
            fedprox["train.optimizer_state"]) == ("niid-cnn", 0.9, 1e-5, 0.01, "constant", "reset")
    # The system's SCAFFOLD refuses momentum: the stated difference, not a silent one.
    scaffold = bench.train_sets(args, "scaffold")
    assert (scaffold["train.momentum"], scaffold["train.weight_decay"]) == (0.0, 0.0)
    assert "scaffold.correction" not in scaffold
    # The reproduction's form, the test of that difference: its optimiser and means.
    args.scaffold_form = "niid-bench"
    niid = bench.train_sets(args, "scaffold")
    assert (niid["train.momentum"], niid["train.weight_decay"], niid["scaffold.correction"],
            niid["scaffold.weighting"]) == (0.9, 1e-5, "step", "examples")
    assert "fedprox.mu" not in bench.train_sets(args, "fedavg")
    # The reproduction's input pipeline ([0, 1] pixels, mirrored padding), the test of the
    # common level: sent to the edges, and its runs kept apart from the system's.
    args.augment, args.input_range = "crop-flip-reflect", "unit"
    unit = bench.train_sets(args, "fedavg")
    assert (unit["train.augment"], unit["train.input_range"]) == ("crop-flip-reflect", "unit")
    args.out, args.rounds, args.limit = Path("/o"), 50, 0
    assert bench.run_dir(args, bench.ROWS["fedavg-dir"], 0).name == \
        "fedavg-dir-crop-flip-reflect-unit-s0"
    args.augment, args.input_range = "crop-flip", "symmetric"
    assert bench.run_dir(args, bench.ROWS["fedavg-dir"], 0).name == "fedavg-dir-s0"


def test_the_report_puts_the_plateau_beside_the_best_round(bench):
    """The best of many noisy reads sits above the plateau: the table prints the mean of
    the last 5 rounds beside the best, both from the recorded per-round figures."""
    args = bench.argparse.Namespace(edges=10, limit=0, rounds=8, epochs=10, batch_size=64,
                                    lr=0.01, momentum=0.9, weight_decay=1e-5, mu=0.01,
                                    optimizer_state="reset", augment="crop-flip", alpha=0.5,
                                    scaffold_form="paper", input_range="symmetric",
                                    test_per_class=86, seeds=[0])
    accs = [10.0, 40.0, 60.0, 66.0, 61.0, 62.0, 60.0, 61.0]
    text = bench.report(args, [bench.ROWS["fedavg-dir"]], {("fedavg-dir", 0): accs})
    row = next(line for line in text.splitlines() if line.startswith("| fedavg-dir | 0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert (cells[3], cells[4], cells[6], cells[7]) == ("66.00 (4)", "61.00", "+3.53", "62.00")
    assert "optimizer state reset" in text


def test_a_run_is_compared_with_the_reference_round_by_round(bench, tmp_path):
    """--reference reads the reproduction's own per-round figures (its results file, header
    and all) and prints this run minus it over the rounds both recorded."""
    results = tmp_path / "reference.txt"
    results.write_text("# header\nrounds done 12/50\n\nround\tacc_860\tacc_1000\tseconds\n"
                       + "".join(f"{r}\t{50 + r:.2f}\t{50 + r:.2f}\t180.0\n" for r in range(1, 13)))
    reference = bench.read_reference(results)
    assert reference == [51.0 + r for r in range(12)]
    accs = [51.0 + r + (2.0 if r < 10 else -1.0) for r in range(14)]  # two rounds more
    text = bench.compare("fedavg-dir seed 42", accs, reference)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()}
    assert "rounds 1-12" in text.splitlines()[0]
    assert rows["1-10"][3:] == ["+2.00 (+2.0 .. +2.0)", "10/10"]
    assert rows["11-12"][1:] == ["60.50", "61.50", "-1.00 (-1.0 .. -1.0)", "0/2"]
    assert rows["8-12 (last 5)"][3:] == ["+0.80 (-1.0 .. +2.0)", "3/5"]
    (tmp_path / "gap.tsv").write_text("round\tacc_860\n1\t10\n3\t12\n")
    with pytest.raises(ValueError, match="not 1..N"):
        bench.read_reference(tmp_path / "gap.tsv")


@pytest.mark.skipif(not CIFAR10.exists(), reason=f"needs CIFAR-10 at {CIFAR10} (../shared/data)")
def test_a_tiny_protocol_runs_through_the_bench(tmp_path):
    """2 clients, 1 round of 1 epoch on 400 images, via bench/calibrate.py and real fl-sim:
    the results file holds the row beside its published figure, the partition is NIID-Bench's
    capped Dirichlet over every image with the official test images as each client's test
    split, and the server ran the protocol's settings."""
    results = tmp_path / "calibrate.txt"
    cmd = [sys.executable, str(REPO / "bench" / "calibrate.py"), "--rows", "fedavg-dir",
           "--seeds", "0", "--rounds", "1", "--epochs", "1", "--limit", "400", "--edges", "2",
           "--out", str(tmp_path / "out"), "--results", str(results)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    text = results.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| fedavg-dir | 0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "1/1" and cells[5] == "62.47 ± 0.43"
    accuracy = float(cells[4])
    assert 0 <= accuracy <= 100 and cells[6] == f"{float(cells[3].split()[0]) - 62.47:+.2f}"
    assert cells[7] == cells[4]  # the mean of the last (one) round
    assert "fedavg-dir seed 0: " in text

    (data,) = (tmp_path / "out" / "data").iterdir()
    manifest = json.loads((data / "partition.json").read_text())
    assert manifest["dirichlet_cap"] is True and manifest["alpha"] == 0.5
    assert manifest["global_test"]["size"] == 860 and manifest["global_test"]["from_test_split"] == 860
    assert sum(r["n_train"] for r in manifest["histogram"]) == 400  # no image held out
    for edge in sorted(data.glob("edge_*")):
        with np.load(edge / "test.npz") as test, np.load(edge / "global_test.npz") as gt:
            assert np.array_equal(test["x"], gt["x"]) and np.array_equal(test["y"], gt["y"])

    (run,) = (tmp_path / "out" / "runs").iterdir()
    train = json.loads((run / "server" / "history.json").read_text())["manifest"]["train"]
    assert (train["model"], train["batch_size"], train["lr"], train["momentum"],
            train["weight_decay"], train["augment"]) == ("niid-cnn", 64, 0.01, 0.9, 1e-5, "crop-flip")


def test_the_test_set_check_scores_the_calibration_images_against_held_out_training_ones():
    """bench/calibrate_testset.py: the 860 images are fl-partition's global test (the first
    86 of each class of the test split), the held-out images are data_batch_1 and never in
    the training slice, and one model's accuracy is read on both the same way."""
    if not CIFAR10.exists():
        pytest.skip(f"{CIFAR10} is missing")
    with bench_script("calibrate_testset") as check:
        (x, y), (hx, hy), (tx, ty) = check.load(CIFAR10, 86)
        assert x.shape == (40_000, 3, 32, 32) and hx.shape == (10_000, 3, 32, 32)
        assert tx.shape == (860, 3, 32, 32) and x.dtype == tx.dtype == torch.uint8
        assert np.bincount(ty.numpy(), minlength=10).tolist() == [86] * 10
        raw = np.fromfile(CIFAR10 / "data_batch_1.bin", np.uint8).reshape(-1, 3073)
        assert torch.equal(hy, torch.from_numpy(raw[:, 0].astype(np.int64)))
        assert torch.equal(hx[0], torch.from_numpy(raw[0, 1:].reshape(3, 32, 32)))
        from fedattn_shared.augment import InputPipeline

        torch.manual_seed(0)
        model = build_model("niid-cnn", 10, 3, 32)
        acc = check.accuracy(model, tx, ty, InputPipeline())
        assert 0 <= acc <= 100 and acc == check.accuracy(model, tx, ty, InputPipeline())


def test_the_reference_harness_reads_cifar_as_torchvision_and_averages_as_flower():
    """bench/niid_bench_reference.py's two own pieces: the CIFAR-10 stand-in gives
    torchvision's layout (HWC uint8 images, labels a list) of the records fl-partition
    reads, PIL images through a transform; the aggregate is Flower's FedAvg weighted mean."""
    with bench_script("niid_bench_reference") as ref:
        weights = [([np.full((2, 3), 1.0, np.float32), np.array([4.0], np.float32)], 1),
                   ([np.full((2, 3), 4.0, np.float32), np.array([-2.0], np.float32)], 3)]
        mean = ref.aggregate(weights)
        assert np.array_equal(mean[0], np.full((2, 3), 3.25, np.float32))
        assert np.array_equal(mean[1], np.array([-0.5], np.float32))
        assert mean[0].dtype == np.float32
        if not CIFAR10.exists():
            pytest.skip(f"{CIFAR10} is missing")
        cls = ref.cifar10_class(CIFAR10, limit=300)
        test = cls(root="data", train=False, download=True, transform=np.asarray)
        train = cls(root="data", train=True, download=True, transform=np.asarray)
        assert test.data.shape == (1000, 32, 32, 3) and test.data.dtype == np.uint8
        assert len(train) == 300 and isinstance(train.targets, list)
        # torchvision's layout of the binary records: label byte, then C x H x W pixels.
        for dataset, name, index in ((test, "test_batch_first1000.bin", 7),
                                     (train, "data_batch_1.bin", 299)):
            raw = np.fromfile(CIFAR10 / name, np.uint8).reshape(-1, 3073)
            assert dataset.targets == raw[: len(dataset), 0].astype(int).tolist()
            image, label = dataset[index]
            assert np.array_equal(image, raw[index, 1:].reshape(3, 32, 32).transpose(1, 2, 0))
            assert label == int(raw[index, 0])


def test_the_reference_harness_resumes_bit_identical(tmp_path):
    """A tiny run of the reproduction's own code (3 rounds of 1 epoch on 600 images)
    stopped after round 2 and resumed ends with the global of a run never stopped. Needs a
    Flower checkout's baselines/niid_bench ($FLOWER_NIID_BENCH), which CI does not have."""
    import os

    niid = Path(os.environ.get("FLOWER_NIID_BENCH", "/nonexistent"))
    if not (niid / "niid_bench" / "models.py").exists():
        pytest.skip("no Flower niid_bench checkout ($FLOWER_NIID_BENCH)")
    if not CIFAR10.exists():
        pytest.skip(f"{CIFAR10} is missing")

    def run(out: Path, rounds: int) -> None:
        cmd = [sys.executable, str(REPO / "bench" / "niid_bench_reference.py"), "--niid-bench",
               str(niid), "--out", str(out), "--limit", "600", "--epochs", "1", "--rounds",
               str(rounds)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert done.returncode == 0, done.stdout + done.stderr

    run(tmp_path / "a", 2)
    run(tmp_path / "a", 3)
    run(tmp_path / "b", 3)
    a, b = (torch.load(tmp_path / d / "state.pt", weights_only=False) for d in "ab")
    assert a["round"] == b["round"] == 3
    assert all(np.array_equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    rows = [(tmp_path / d / "rounds.tsv").read_text().splitlines() for d in "ab"]
    assert [r.split("\t")[:3] for r in rows[0]] == [r.split("\t")[:3] for r in rows[1]]

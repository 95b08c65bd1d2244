"""fl-partition --scheme digits: one digit domain per edge (real MNIST and USPS, MNIST-M- and
SynthDigits-style stand-ins), 28x28 RGB, reproducible, readable by an edge."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA  # $FEDATTN_DATA

from fedattn_shared.data.digits import load_usps, mnistm_style, synthdigits_style
from fedattn_shared.data.partition import main

USPS = SHARED_DATA / "usps" / "usps.t.bz2"
needs_data = pytest.mark.skipif(
    not all((SHARED_DATA / d).is_dir() for d in ("mnist", "usps", "cifar-10")),
    reason=f"no mnist/usps/cifar-10 under {SHARED_DATA} (set FEDATTN_DATA)")


@pytest.mark.skipif(not USPS.is_file(), reason=f"no USPS at {USPS} (set FEDATTN_DATA)")
def test_usps_is_the_official_test_split():
    x, y = load_usps(USPS)
    assert x.shape == (2007, 16, 16) and x.dtype == np.uint8
    # The canonical USPS test class counts (shared/data/README.md).
    assert np.bincount(y).tolist() == [359, 264, 198, 166, 200, 160, 170, 147, 166, 177]


def test_mnistm_style_is_the_difference_blend():
    rng = np.random.default_rng(0)
    digit = np.zeros((1, 28, 28), np.uint8)
    digit[0, 10:18, 12:16] = 255
    photo = np.full((1, 28, 28, 3), 40, np.uint8)
    photo[0, ..., 1] = 200
    out = mnistm_style(digit, photo, rng)[0]
    assert out[0, 0].tolist() == [40, 200, 40]       # background: the patch
    assert out[12, 13].tolist() == [215, 55, 215]    # stroke: |patch - 255|


def test_synthdigits_style_renders_varied_colour_images():
    images = synthdigits_style(np.arange(10), np.random.default_rng(1))
    assert images.shape == (10, 28, 28, 3) and images.dtype == np.uint8
    assert all(img.reshape(-1, 3).std(axis=0).max() > 10 for img in images)  # a digit is drawn
    backgrounds = {tuple(img[0, 0]) for img in images}
    assert len(backgrounds) > 5


@needs_data
@pytest.mark.slow
def test_digits_scheme_one_domain_per_edge_reproducibly(tmp_path):
    from fedattn_shared.config import TrainConfig
    from fedattn_shared.data import load_edge_data

    def partition(out: Path, seed: int) -> dict:
        assert main(["--scheme", "digits", "--source", str(SHARED_DATA), "--edges", "4",
                     "--out", str(out), "--limit", "40", "--domain-test", "15",
                     "--seed", str(seed)]) == 0
        return json.loads((out / "partition.json").read_text())

    manifest = partition(tmp_path / "a", 0)
    assert [row["domain"] for row in manifest["histogram"]] == [
        "mnist", "usps", "mnistm-style", "synthdigits-style"]
    assert set(manifest["stand_ins"]) == {"mnistm-style", "synthdigits-style"}
    for i, row in enumerate(manifest["histogram"]):
        assert (row["n_train"], row["n_test"]) == (40, 15)
        with np.load(tmp_path / "a" / f"edge_0{i}" / "train.npz") as data:
            assert data["x"].shape == (40, 28, 28, 3) and data["x"].dtype == np.uint8
        assert not (tmp_path / "a" / f"edge_0{i}" / "global_test.npz").exists()
    again = partition(tmp_path / "b", 0)
    assert [r["train_sha256"] for r in again["histogram"]] == [
        r["train_sha256"] for r in manifest["histogram"]]
    data = load_edge_data(tmp_path / "a" / "edge_02", TrainConfig(in_channels=3))
    assert tuple(data.train.x.shape) == (40, 3, 28, 28) and len(data.test) == 15


def test_digits_scheme_flag_errors(tmp_path, capsys):
    assert main(["--scheme", "digits", "--source", str(SHARED_DATA), "--edges", "3",
                 "--out", str(tmp_path / "x")]) == 2
    assert "one edge per domain" in capsys.readouterr().err
    assert main(["--scheme", "digits", "--source", str(SHARED_DATA), "--edges", "1",
                 "--domains", "svhn", "--out", str(tmp_path / "y")]) == 2
    assert "--domains must list" in capsys.readouterr().err

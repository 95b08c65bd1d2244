"""fl-partition: sources, schemes, the shared global test set, output formats and flag checks."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA  # $FEDATTN_DATA
from PIL import Image

from fedattn_shared.data.partition import DOMAINS, arrays_sha256, main

MNIST = SHARED_DATA / "mnist"
CIFAR = SHARED_DATA / "cifar-10" / "cifar-10-batches-bin"


def images(n: int, seed: int, size: int = 8, channels: int = 1) -> np.ndarray:
    """Random uint8 images; distinct from each other with overwhelming probability."""
    shape = (n, size, size) if channels == 1 else (n, size, size, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def labels(n: int, num_classes: int = 10) -> np.ndarray:
    return (np.arange(n) % num_classes).astype(np.int64)


def npz_source(root: Path, n: int = 1000, n_test: int = 0, channels: int = 1) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if n_test:
        np.savez(root / "train.npz", x=images(n, 1, channels=channels), y=labels(n))
        np.savez(root / "test.npz", x=images(n_test, 2, channels=channels), y=labels(n_test))
    else:
        np.savez(root / "data.npz", x=images(n, 1, channels=channels), y=labels(n))
    return root


def partition(src: Path | str, out: Path, *extra: str | int | float) -> dict:
    argv = ["--source", str(src), "--out", str(out), *map(str, extra)]
    assert main(argv) == 0, argv
    return json.loads((out / "partition.json").read_text())


def load(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return z["x"], z["y"]


def edge_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir())


def keys(x: np.ndarray) -> list[bytes]:
    return [row.tobytes() for row in np.ascontiguousarray(x).reshape(len(x), -1)]


def edge_arrays(edge: Path) -> tuple[np.ndarray, np.ndarray]:
    """An edge's train + local test data together."""
    (tx, ty), (sx, sy) = load(edge / "train.npz"), load(edge / "test.npz")
    return np.concatenate([tx, sx]), np.concatenate([ty, sy])


def file_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards", "domains"])
def test_same_arguments_give_identical_bytes_and_another_seed_differs(tmp_path, scheme):
    src = npz_source(tmp_path / "src")
    args = ["--edges", 5, "--scheme", scheme, "--global-test-per-class", 5]
    partition(src, tmp_path / "a", *args, "--seed", 3)
    partition(src, tmp_path / "b", *args, "--seed", 3)
    partition(src, tmp_path / "c", *args, "--seed", 4)
    first = file_bytes(tmp_path / "a")
    assert first == file_bytes(tmp_path / "b")
    assert any(name.endswith("train.npz") for name in first)
    other = file_bytes(tmp_path / "c")
    assert any(first[name] != other[name] for name in first if name.endswith("train.npz"))


def test_dirichlet_puts_every_sample_of_a_class_on_exactly_one_edge(tmp_path, capsys):
    src = npz_source(tmp_path / "src", n=1500)
    manifest = partition(src, tmp_path / "out", "--edges", 6, "--scheme", "dirichlet", "--alpha", 0.3,
                         "--global-test-per-class", 10)
    x_all, _ = load(src / "data.npz")
    gx, _ = load(tmp_path / "out" / "edge_00" / "global_test.npz")
    held = set(keys(gx))
    expected = sorted(k for k in keys(x_all) if k not in held)
    got = []
    for i, edge in enumerate(edge_dirs(tmp_path / "out")):
        x, y = edge_arrays(edge)
        got += keys(x)
        row = manifest["histogram"][i]
        assert np.bincount(y, minlength=10).tolist() == [
            a + b for a, b in zip(row["train_per_class"], row["test_per_class"], strict=True)]
    assert sorted(got) == expected  # each remaining sample on exactly one edge, none lost
    assert manifest["global_test"]["held_out_from_train"] == 100
    table = capsys.readouterr().out
    assert "edge_05" in table and "n_train" in table and "global_test" in table


def test_dirichlet_alpha_extremes(tmp_path):
    src = npz_source(tmp_path / "src", n=2000)
    common = ["--edges", 4, "--scheme", "dirichlet", "--global-test-per-class", 0, "--min-per-edge", 0]
    partition(src, tmp_path / "flat", *common, "--alpha", 1e5)
    counts = np.array([np.bincount(edge_arrays(e)[1], minlength=10) for e in edge_dirs(tmp_path / "flat")])
    assert np.abs(counts - 50).max() <= 2  # 200 per class over 4 edges: near uniform

    partition(src, tmp_path / "skew", *common, "--alpha", 0.01)
    counts = np.array([np.bincount(edge_arrays(e)[1], minlength=10) for e in edge_dirs(tmp_path / "skew")])
    top_share = counts.max(axis=0) / counts.sum(axis=0)
    assert (top_share >= 0.95).sum() >= 8, top_share


def test_dirichlet_cap_deals_no_class_to_an_edge_already_at_its_share(tmp_path):
    """--dirichlet-cap (NIID-Bench's rule): classes are dealt in label order, and once an
    edge holds 1/N of the samples it gets nothing of the classes after; without the cap a
    skewed draw leaves edges far above their share."""
    src = npz_source(tmp_path / "src", n=4000)
    common = ["--edges", 8, "--scheme", "dirichlet", "--alpha", 0.1, "--global-test-per-class", 0,
              "--test-fraction", 0, "--min-per-edge", 0]
    capped = partition(src, tmp_path / "cap", *common, "--dirichlet-cap")
    share = 4000 / 8
    over_after = 0
    for row in capped["histogram"]:
        held = np.cumsum(row["train_per_class"])
        full = np.flatnonzero(held >= share)
        if len(full):  # full after class full[0]: no later class reaches it
            assert sum(row["train_per_class"][full[0] + 1:]) == 0, row
            over_after += 1
    assert over_after >= 1  # alpha 0.1 fills some edge before the last class
    assert capped["dirichlet_cap"] is True and sum(r["n_train"] for r in capped["histogram"]) == 4000
    plain = partition(src, tmp_path / "plain", *common)
    spread = [max(r["n_train"] for r in m["histogram"]) for m in (capped, plain)]
    assert spread[0] < spread[1], spread


def test_dirichlet_min_per_edge_gives_up_with_a_clear_error(tmp_path, capsys):
    src = npz_source(tmp_path / "src", n=300)
    argv = ["--source", str(src), "--out", str(tmp_path / "out"), "--edges", 20, "--scheme", "dirichlet",
            "--alpha", 0.01, "--min-per-edge", 10, "--global-test-per-class", 0]
    assert main(list(map(str, argv))) == 2
    err = capsys.readouterr().err
    assert "--min-per-edge" in err and "100 tries" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edges,k", [(10, 2), (5, 4), (3, 10), (20, 1)])
def test_shards_give_each_edge_exactly_k_classes(tmp_path, edges, k):
    src = npz_source(tmp_path / "src", n=2000)
    manifest = partition(src, tmp_path / "out", "--edges", edges, "--scheme", "shards",
                         "--shards-per-edge", k, "--global-test-per-class", 0)
    total = 0
    for edge in edge_dirs(tmp_path / "out"):
        _, y = edge_arrays(edge)
        assert len(np.unique(y)) == k
        total += len(y)
    assert total == 2000
    assert manifest["shards_per_edge"] == k


def test_iid_sizes_within_one(tmp_path):
    src = npz_source(tmp_path / "src", n=1003)
    partition(src, tmp_path / "out", "--edges", 7, "--global-test-per-class", 0)
    sizes = [len(edge_arrays(e)[1]) for e in edge_dirs(tmp_path / "out")]
    assert sum(sizes) == 1003 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards", "domains"])
def test_global_test_is_shared_balanced_and_disjoint(tmp_path, scheme):
    src = tmp_path / "src"
    src.mkdir()
    x, y = images(1200, 1), labels(1200)
    tx, ty = images(100, 2), labels(100)  # 10 per class in the test split
    x[7] = tx[0]  # a training image equal to a test image must not reach an edge
    np.savez(src / "train.npz", x=x, y=y)
    np.savez(src / "test.npz", x=tx, y=ty)
    manifest = partition(src, tmp_path / "out", "--edges", 5, "--scheme", scheme,
                         "--global-test-per-class", 15)
    gt = manifest["global_test"]
    assert (gt["size"], gt["from_test_split"], gt["held_out_from_train"]) == (150, 100, 50)
    assert gt["per_class"] == [15] * 10 and gt["train_duplicates_removed"] == 1
    edges = edge_dirs(tmp_path / "out")
    blobs = {(e / "global_test.npz").read_bytes() for e in edges}
    assert len(blobs) == 1
    gx, gy = load(edges[0] / "global_test.npz")
    assert np.bincount(gy).tolist() == [15] * 10
    assert set(keys(tx)) <= set(keys(gx))  # the whole test split is in it
    global_keys = set(keys(gx))
    for edge in edges:
        for split in ("train", "test"):
            ex, _ = load(edge / f"{split}.npz")
            assert not global_keys & set(keys(ex)), (edge, split)


def test_global_test_held_out_with_seed_zero_whatever_the_seed(tmp_path):
    src = npz_source(tmp_path / "src", n=1000)
    partition(src, tmp_path / "a", "--edges", 3, "--seed", 1, "--global-test-per-class", 10)
    partition(src, tmp_path / "b", "--edges", 4, "--seed", 2, "--scheme", "dirichlet",
              "--global-test-per-class", 10)
    assert ((tmp_path / "a" / "edge_00" / "global_test.npz").read_bytes()
            == (tmp_path / "b" / "edge_03" / "global_test.npz").read_bytes())


def test_domains_transform_edges_but_not_global_test(tmp_path):
    src = npz_source(tmp_path / "src", n=1400)
    manifest = partition(src, tmp_path / "out", "--edges", 7, "--scheme", "domains",
                         "--global-test-per-class", 5)
    source_keys = set(keys(load(src / "data.npz")[0]))
    edges = edge_dirs(tmp_path / "out")
    assert [row["domain"] for row in manifest["histogram"]] == [DOMAINS[i % len(DOMAINS)] for i in range(7)]
    assert DOMAINS[0] == "original" and DOMAINS[3] == "invert" and DOMAINS[6 % len(DOMAINS)] == "original"
    x0, _ = edge_arrays(edges[0])
    assert set(keys(x0)) <= source_keys
    x3, _ = edge_arrays(edges[3])
    assert set(keys(255 - x3)) <= source_keys
    for i in (1, 2, 4, 5):
        xi, _ = edge_arrays(edges[i])
        assert not set(keys(xi)) & source_keys, DOMAINS[i]
    for edge in edges:
        assert set(keys(load(edge / "global_test.npz")[0])) <= source_keys


def read_png_split(root: Path, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    found = []
    for label, name in enumerate(names):
        for png in (root / name).glob("*.png") if (root / name).is_dir() else []:
            with Image.open(png) as im:
                found.append((int(png.stem), np.asarray(im), label))
    found.sort(key=lambda t: t[0])
    assert [t[0] for t in found] == list(range(len(found)))
    return np.stack([t[1] for t in found]), np.array([t[2] for t in found])


@pytest.mark.parametrize("channels", [1, 3])
def test_folders_format_writes_readable_pngs_equal_to_the_npz_arrays(tmp_path, channels):
    src = npz_source(tmp_path / "src", n=300, channels=channels)
    names = "zero,one,two,three,four,five,six,seven,eight,nine"
    args = ["--edges", 2, "--scheme", "dirichlet", "--global-test-per-class", 3, "--class-names", names]
    manifest = partition(src, tmp_path / "png", *args, "--format", "folders")
    partition(src, tmp_path / "npz", *args)
    assert manifest["class_names"] == names.split(",")
    for edge in ("edge_00", "edge_01"):
        assert not list((tmp_path / "png" / edge).glob("*.npz"))
        for split in ("train", "test", "global_test"):
            px, py = read_png_split(tmp_path / "png" / edge / split, names.split(","))
            nx, ny = load(tmp_path / "npz" / edge / f"{split}.npz")
            np.testing.assert_array_equal(px, nx)
            np.testing.assert_array_equal(py, ny)


def test_partition_json_records_settings_histogram_and_train_hashes(tmp_path):
    src = npz_source(tmp_path / "src", n=600, n_test=50)
    manifest = partition(src, tmp_path / "out", "--edges", 3, "--scheme", "dirichlet", "--alpha", 2.0,
                         "--seed", 9, "--global-test-per-class", 5)
    from fedattn_shared.data.partition import _fedattn_version

    assert manifest["source"]["path"] == str(src) and manifest["source"]["kind"] == "npz"
    settings = (manifest["scheme"], manifest["alpha"], manifest["seed"], manifest["edges"])
    assert settings == ("dirichlet", 2.0, 9, 3)
    assert manifest["global_test"]["size"] == 50
    assert manifest["fedattn_version"] == _fedattn_version() != ""
    for row, edge in zip(manifest["histogram"], edge_dirs(tmp_path / "out"), strict=True):
        x, y = load(edge / "train.npz")
        assert row["edge"] == edge.name and row["n_train"] == len(y)
        assert row["train_per_class"] == np.bincount(y, minlength=10).tolist()
        assert row["train_sha256"] == arrays_sha256(x, y)
        assert row["n_test"] == len(load(edge / "test.npz")[1])


def write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def test_generated_idx_source(tmp_path):
    src = tmp_path / "idx"
    src.mkdir()
    x, y, tx, ty = images(500, 1), labels(500), images(60, 2), labels(60)
    write_idx(src / "train-images-idx3-ubyte.gz", x)
    write_idx(src / "train-labels-idx1-ubyte.gz", y)
    write_idx(src / "t10k-images-idx3-ubyte.gz", tx)
    write_idx(src / "t10k-labels-idx1-ubyte.gz", ty)
    manifest = partition(src, tmp_path / "out", "--edges", 2, "--global-test-per-class", 4, "--limit", 300)
    assert manifest["source"]["kind"] == "idx" and manifest["source"]["n_train"] == 300
    gx, gy = load(tmp_path / "out" / "edge_00" / "global_test.npz")
    np.testing.assert_array_equal(gx, np.concatenate([tx[ty == c][:4] for c in range(10)]))
    total = sum(len(edge_arrays(e)[1]) for e in edge_dirs(tmp_path / "out"))
    assert total == 300


def test_generated_cifar_binary_source(tmp_path):
    src = tmp_path / "cifar"
    src.mkdir()
    x = images(250, 3, size=32, channels=3)
    y = labels(250)

    def records(xs: np.ndarray, ys: np.ndarray) -> bytes:
        planar = xs.transpose(0, 3, 1, 2).reshape(len(xs), -1)
        return np.concatenate([ys[:, None].astype(np.uint8), planar], axis=1).tobytes()

    (src / "data_batch_1.bin").write_bytes(records(x[:100], y[:100]))
    (src / "data_batch_2.bin").write_bytes(records(x[100:200], y[100:200]))
    (src / "test_batch.bin").write_bytes(records(x[200:], y[200:]))
    manifest = partition(src, tmp_path / "out", "--edges", 2, "--global-test-per-class", 5,
                         "--class-names", "source")
    assert manifest["source"]["kind"] == "cifar10-bin" and manifest["class_names"][0] == "airplane"
    gx, _ = load(tmp_path / "out" / "edge_01" / "global_test.npz")
    assert set(keys(gx)) == set(keys(x[200:]))  # 5 per class, all from the test batch
    ex, _ = edge_arrays(tmp_path / "out" / "edge_00")
    assert ex.shape[1:] == (32, 32, 3) and set(keys(ex)) <= set(keys(x[:200]))


@pytest.mark.skipif(not (MNIST / "train-images-idx3-ubyte.gz").is_file(),
                    reason=f"no MNIST at {MNIST} (set FEDATTN_DATA)")
def test_real_mnist(tmp_path):
    manifest = partition(MNIST, tmp_path / "out", "--edges", 4, "--scheme", "dirichlet", "--limit", 1200,
                         "--global-test-per-class", 20)
    with gzip.open(MNIST / "t10k-images-idx3-ubyte.gz") as f:
        tx = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(MNIST / "t10k-labels-idx1-ubyte.gz") as f:
        ty = np.frombuffer(f.read(), np.uint8, offset=8)
    gx, gy = load(tmp_path / "out" / "edge_00" / "global_test.npz")
    np.testing.assert_array_equal(gx, np.concatenate([tx[ty == c][:20] for c in range(10)]))
    assert manifest["source"]["n_train"] == 1200 and manifest["global_test"]["held_out_from_train"] == 0
    assert sum(row["n_train"] + row["n_test"] for row in manifest["histogram"]) == 1200


@pytest.mark.skipif(not (CIFAR / "test_batch_first1000.bin").is_file(),
                    reason=f"no CIFAR-10 at {CIFAR} (set FEDATTN_DATA)")
def test_real_cifar_keeps_the_1000_official_test_images(tmp_path):
    manifest = partition(CIFAR.parent, tmp_path / "out", "--edges", 3, "--limit", 3000,
                         "--global-test-per-class", 112, "--class-names", "source")
    official = np.fromfile(CIFAR / "test_batch_first1000.bin", np.uint8).reshape(-1, 3073)
    official_x = official[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    gt = manifest["global_test"]
    assert (gt["size"], gt["from_test_split"], gt["held_out_from_train"]) == (1120, 1000, 120)
    edges = edge_dirs(tmp_path / "out")
    assert len({(e / "global_test.npz").read_bytes() for e in edges}) == 1
    gx, gy = load(edges[0] / "global_test.npz")
    assert set(keys(official_x)) <= set(keys(gx))
    assert np.bincount(gy).tolist() == [112] * 10
    global_keys = set(keys(gx))
    for edge in edges:
        assert not global_keys & set(keys(edge_arrays(edge)[0]))
    assert sum(row["n_train"] + row["n_test"] for row in manifest["histogram"]) == 3000 - 120


@pytest.mark.parametrize("extra,flag", [
    (["--edges", "0"], "--edges"),
    (["--edges", "many"], "--edges"),
    (["--edges", "5000"], "--edges"),
    (["--alpha", "0", "--scheme", "dirichlet"], "--alpha"),
    (["--alpha", "-1"], "--alpha"),
    (["--scheme", "shards", "--shards-per-edge", "3"], "--shards-per-edge"),
    (["--scheme", "shards", "--shards-per-edge", "0"], "--shards-per-edge"),
    (["--scheme", "shards", "--edges", "20", "--shards-per-edge", "11"], "--shards-per-edge"),
    (["--scheme", "bogus"], "--scheme"),
    (["--format", "zip"], "--format"),
    (["--test-fraction", "1"], "--test-fraction"),
    (["--test-fraction", "-0.1"], "--test-fraction"),
    (["--global-test-per-class", "-1"], "--global-test-per-class"),
    (["--global-test-per-class", "60"], "--global-test-per-class"),
    (["--limit", "0"], "--limit"),
    (["--min-per-edge", "-1"], "--min-per-edge"),
    (["--scheme", "dirichlet", "--min-per-edge", "500"], "--min-per-edge"),
    (["--seed", "-3"], "--seed"),
    (["--class-names", "a,b,c"], "--class-names"),
    (["--class-names", "source"], "--class-names"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, extra, flag):
    src = npz_source(tmp_path / "src", n=1000)
    argv = ["--source", str(src), "--out", str(tmp_path / "out"), "--edges", "4",
            "--global-test-per-class", "5", *extra]
    assert main(argv) == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_or_unknown_source_exits_2_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["--source", str(missing), "--edges", "2", "--out", str(tmp_path / "o1")]) == 2
    assert str(missing) in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no data here")
    assert main(["--source", str(empty), "--edges", "2", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "no recognised dataset" in err
    assert main(["--edges", "2", "--out", str(tmp_path / "o3")]) == 2
    assert "--source" in capsys.readouterr().err


def test_non_empty_out_needs_force_and_force_replaces_only_edge_folders(tmp_path, capsys):
    src = npz_source(tmp_path / "src", n=500)
    out = tmp_path / "out"
    partition(src, out, "--edges", 5, "--global-test-per-class", 5)
    (out / "keep.txt").write_text("mine")
    assert main(["--source", str(src), "--out", str(out), "--edges", "3"]) == 2
    assert "--out" in capsys.readouterr().err
    assert len(edge_dirs(out)) == 5
    partition(src, out, "--edges", 3, "--global-test-per-class", 5, "--force")
    assert [p.name for p in edge_dirs(out)] == ["edge_00", "edge_01", "edge_02"]
    assert (out / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    assert main(["--source", str(src), "--out", str(tmp_path / "file"), "--edges", "3", "--force"]) == 2
    assert "--out" in capsys.readouterr().err


def test_help_and_module_entry_point(tmp_path, capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "global test set" in text and "NOT transformed" in text and "seed-0" in text
    src = npz_source(tmp_path / "src", n=200)
    proc = subprocess.run([sys.executable, "-m", "fedattn_shared.data.partition", "--source", str(src),
                           "--edges", "2", "--out", str(tmp_path / "out"), "--global-test-per-class", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "edge_01" in proc.stdout and (tmp_path / "out" / "edge_01" / "train.npz").is_file()


def test_edge_reader_loads_every_edge_folder(tmp_path):
    from fedattn_shared.config import TrainConfig
    from fedattn_shared.data import load_edge_data

    src = npz_source(tmp_path / "src", n=600, channels=3)
    manifest = partition(src, tmp_path / "out", "--edges", 3, "--scheme", "dirichlet",
                         "--global-test-per-class", 5)
    cfg = TrainConfig(in_channels=3, image_size=8)
    for row in manifest["histogram"]:
        data = load_edge_data(tmp_path / "out" / row["edge"], cfg)
        assert (len(data.train), len(data.test), len(data.global_test)) == (row["n_train"], row["n_test"], 50)


def test_test_fraction_zero_writes_no_local_test_split(tmp_path):
    src = npz_source(tmp_path / "src", n=300)
    manifest = partition(src, tmp_path / "out", "--edges", 2, "--test-fraction", 0,
                         "--global-test-per-class", 2)
    assert all(row["n_test"] == 0 for row in manifest["histogram"])
    written = sorted(p.name for p in (tmp_path / "out" / "edge_00").iterdir())
    assert written == ["global_test.npz", "train.npz"]

"""The edge's --data-dir readers: npz, image folders, IDX, CIFAR-10 binary and python batches.

Every corrupt case must raise DataError naming the file or folder at fault; the real MNIST and
CIFAR-10 files in $FEDATTN_DATA (default ../shared/data) are read when they are there.
"""

from __future__ import annotations

import gzip
import logging
import os
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA  # $FEDATTN_DATA
from PIL import Image

from fedattn_shared.config import TrainConfig
from fedattn_shared.data import DataError, EdgeData, load_edge_data

DIGITS = [str(i) for i in range(10)]


def cfg(**kwargs) -> TrainConfig:
    return TrainConfig(**{"image_size": 8, **kwargs})


def pixels(value: int, size: int = 8, channels: int = 1) -> np.ndarray:
    shape = (size, size) if channels == 1 else (size, size, channels)
    return np.full(shape, value, np.uint8)


def write_image(path: Path, array: np.ndarray, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format=fmt)
    return path


def write_class_images(folder: Path, counts: dict[str, int], size: int = 8, suffix: str = ".png"):
    for name, n in counts.items():
        for i in range(n):
            write_image(folder / name / f"img{i:03d}{suffix}", pixels(10 * i % 256, size))


def match(path: Path) -> str:
    return re.escape(str(path))


# ---- npz (unchanged) --------------------------------------------------------------------

def test_npz_layout_still_reads_train_test_and_global_test(tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("train", 30), ("test", 10), ("global_test", 20)):
        np.savez(tmp_path / f"{name}.npz", x=rng.integers(0, 256, (n, 8, 8), dtype=np.uint8),
                 y=np.arange(n) % 10)
    data = load_edge_data(tmp_path, cfg())
    assert isinstance(data, EdgeData)
    assert (len(data.train), len(data.test), len(data.global_test)) == (30, 10, 20)
    assert data.train.x.dtype == torch.float32 and data.train.y.dtype == torch.int64
    assert data.train.x.shape == (30, 1, 8, 8)
    assert float(data.train.x.min()) >= -1 and float(data.train.x.max()) <= 1


def test_empty_dir_names_the_expected_files(tmp_path):
    with pytest.raises(DataError, match="no train.npz or data.npz.*train-images-idx3-ubyte"):
        load_edge_data(tmp_path, cfg())
    with pytest.raises(DataError, match="does not exist"):
        load_edge_data(tmp_path / "nope", cfg())


def test_npz_wins_over_other_layouts_and_the_rest_is_logged(tmp_path, caplog):
    np.savez(tmp_path / "data.npz", x=np.zeros((20, 8, 8), np.uint8), y=np.arange(20) % 2)
    write_class_images(tmp_path / "train", {"5": 3})
    with caplog.at_level(logging.WARNING, logger="fedattn_shared.data"):
        data = load_edge_data(tmp_path, cfg())
    assert set(data.train.y.tolist()) == {0, 1}
    assert "reading it as npz" in caplog.text and "image-folder" in caplog.text


# ---- image folders ----------------------------------------------------------------------

def test_image_tree_maps_folders_through_the_servers_class_list(tmp_path):
    write_class_images(tmp_path / "train", {"3": 4, "7": 5})
    write_class_images(tmp_path / "test", {"7": 2})
    write_class_images(tmp_path / "global_test", {c: 1 for c in DIGITS})
    data = load_edge_data(tmp_path, cfg(class_names=DIGITS))
    assert sorted(data.train.y.tolist()) == [3] * 4 + [7] * 5
    assert data.test.y.tolist() == [7, 7]
    assert sorted(data.global_test.y.tolist()) == list(range(10))
    assert data.train.x.shape == (9, 1, 8, 8)
    # uint8 normalisation as for npz: 0 -> -1, 10 -> 10/255*2-1
    first = data.train.x[0]
    assert torch.allclose(first, torch.full_like(first, -1.0))
    assert torch.allclose(data.train.x[1], torch.full((1, 8, 8), 10 / 255 * 2 - 1))


def test_flat_class_folders_with_named_classes_are_split_stratified(tmp_path):
    write_class_images(tmp_path, {"dog": 10, "frog": 5})
    names = ["cat", "dog", "frog"]
    a = load_edge_data(tmp_path, cfg(num_classes=3, class_names=names, seed=3))
    b = load_edge_data(tmp_path, cfg(num_classes=3, class_names=names, seed=3))
    assert torch.equal(a.test.y, b.test.y) and torch.equal(a.train.x, b.train.x)
    assert sorted(a.test.y.tolist()) == [1, 1, 2] and len(a.train) == 12
    assert set(a.train.y.tolist()) == {1, 2} and a.global_test is None


def test_rgb_jpeg_bmp_and_grey_to_three_channels(tmp_path):
    red = np.zeros((8, 8, 3), np.uint8)
    red[..., 0] = 255
    write_image(tmp_path / "train" / "cat" / "a.png", red)
    write_image(tmp_path / "train" / "cat" / "b.BMP", red, fmt="BMP")
    write_image(tmp_path / "train" / "dog" / "c.jpg", red, fmt="JPEG")
    write_image(tmp_path / "train" / "dog" / "sub" / "d.jpeg", red, fmt="JPEG")
    write_image(tmp_path / "train" / "dog" / "grey.png", pixels(255))  # 'L' image in an RGB run
    (tmp_path / "train" / "dog" / "notes.txt").write_text("ignored")
    (tmp_path / "train" / "dog" / "._c.jpg").write_bytes(b"macOS resource fork, ignored")
    write_image(tmp_path / "test" / "cat" / "e.png", red)
    data = load_edge_data(tmp_path, cfg(num_classes=2, class_names=["cat", "dog"], in_channels=3))
    assert data.train.x.shape == (5, 3, 8, 8) and data.train.y.tolist() == [0, 0, 1, 1, 1]
    png = data.train.x[0]
    assert torch.allclose(png[0], torch.ones(8, 8)) and torch.allclose(png[1:], -torch.ones(2, 8, 8))
    assert float(data.train.x[2, 0].mean()) > 0.9  # jpeg: lossy, still red
    grey = data.train.x[3]  # order: cat/a.png, cat/b.BMP, dog/c.jpg, dog/grey.png, dog/sub/d.jpeg
    assert torch.allclose(grey, torch.ones(3, 8, 8))
    # A one-channel run converts colour images to 'L'.
    one = load_edge_data(tmp_path, cfg(num_classes=2, class_names=["cat", "dog"]))
    assert one.train.x.shape == (5, 1, 8, 8)


def test_folder_not_in_the_class_list_is_named_with_the_known_classes(tmp_path):
    write_class_images(tmp_path / "train", {"3": 2, "horse": 2})
    with pytest.raises(DataError, match=match(tmp_path / "train" / "horse") + r".*'horse'.*0, 1, 2"):
        load_edge_data(tmp_path, cfg())
    flat = tmp_path / "flat"
    write_class_images(flat, {"cat": 3})
    (flat / "mnist").mkdir()
    np.savez(flat / "mnist" / "data.npz", x=np.zeros((2, 8, 8), np.uint8), y=np.zeros(2, int))
    with pytest.raises(DataError, match=match(flat / "mnist") + ".*cat, dog.*point --data-dir at"):
        load_edge_data(flat, cfg(num_classes=2, class_names=["cat", "dog"]))


def test_corrupt_and_wrong_size_images_name_the_file(tmp_path):
    write_class_images(tmp_path / "train", {"1": 3})
    bad = tmp_path / "train" / "1" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(DataError, match=match(bad) + ".*not a readable image"):
        load_edge_data(tmp_path, cfg())
    good = (tmp_path / "train" / "1" / "img000.png").read_bytes()
    bad.write_bytes(good[: len(good) // 2])  # truncated PNG
    with pytest.raises(DataError, match=match(bad)):
        load_edge_data(tmp_path, cfg())
    bad.unlink()
    big = write_image(tmp_path / "train" / "1" / "big.png", pixels(0, size=9))
    with pytest.raises(DataError, match=match(big) + ".*9x9 pixels, the run expects 8x8"):
        load_edge_data(tmp_path, cfg())


def test_empty_splits_and_misplaced_things_are_errors(tmp_path):
    (tmp_path / "train" / "3").mkdir(parents=True)
    with pytest.raises(DataError, match=match(tmp_path / "train") + ": no images"):
        load_edge_data(tmp_path, cfg())
    write_class_images(tmp_path / "train", {"3": 4})
    (tmp_path / "test" / "3").mkdir(parents=True)
    with pytest.raises(DataError, match=match(tmp_path / "test") + ": no images"):
        load_edge_data(tmp_path, cfg())
    (tmp_path / "test" / "3").rmdir()
    (tmp_path / "test").rmdir()
    write_class_images(tmp_path, {"val": 1})
    with pytest.raises(DataError, match=match(tmp_path / "val") + ": unexpected folder beside train/"):
        load_edge_data(tmp_path, cfg())
    flat = tmp_path / "flat"
    write_class_images(flat, {"2": 3})
    stray = write_image(flat / "loose.png", pixels(0))
    with pytest.raises(DataError, match=match(stray) + ": image outside a class folder"):
        load_edge_data(flat, cfg())
    stray.unlink()
    write_class_images(flat / "test", {"2": 1})
    with pytest.raises(DataError, match="class folders beside test/ but no train/"):
        load_edge_data(flat, cfg())


# ---- IDX ------------------------------------------------------------------------------

def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    return struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_idx(folder: Path, prefix: str, x: np.ndarray, y: np.ndarray, gz: bool = True,
              dotted: bool = False) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    sep = "." if dotted else "-"
    paths = []
    for kind, ndim, arr, magic in (("images", 3, x, 2051), ("labels", 1, y, 2049)):
        path = folder / f"{prefix}-{kind}{sep}idx{ndim}-ubyte{'.gz' if gz else ''}"
        data = idx_bytes(arr, magic)
        path.write_bytes(gzip.compress(data) if gz else data)
        paths.append(path)
    return paths[0], paths[1]


def digits(n: int, size: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, size, size), dtype=np.uint8), (np.arange(n) % 10).astype(np.uint8)


def test_idx_gzip_and_plain_train_and_t10k(tmp_path):
    x, y = digits(30)
    xt, yt = digits(10, seed=1)
    write_idx(tmp_path, "train", x, y, gz=True)
    write_idx(tmp_path, "t10k", xt, yt, gz=False, dotted=True)
    data = load_edge_data(tmp_path, cfg())
    assert data.train.x.shape == (30, 1, 8, 8) and data.test.x.shape == (10, 1, 8, 8)
    assert data.train.y.tolist() == y.tolist() and data.test.y.tolist() == yt.tolist()
    expected = torch.from_numpy(x).float().div(255).sub(0.5).div(0.5)
    assert torch.allclose(data.train.x[:, 0], expected)
    three = load_edge_data(tmp_path, cfg(in_channels=3))
    assert three.train.x.shape == (30, 3, 8, 8)


def test_idx_without_t10k_is_split_and_a_gz_name_may_hold_plain_bytes(tmp_path):
    x, y = digits(50)
    images, labels = write_idx(tmp_path, "train", x, y, gz=False)
    images.rename(images.with_name(images.name + ".gz"))  # as browsers that unpack leave it
    data = load_edge_data(tmp_path, cfg(seed=4))
    assert len(data.train) == 40 and len(data.test) == 10
    assert sorted(data.test.y.tolist()) == list(range(10))


def test_idx_corrupt_files_are_named(tmp_path):
    x, y = digits(20)
    images, labels = write_idx(tmp_path, "train", x, y, gz=False)
    swapped = idx_bytes(y, 2049)
    images.write_bytes(swapped)
    with pytest.raises(DataError, match=match(images) + ": magic number 2049, expected 2051"):
        load_edge_data(tmp_path, cfg())
    full = idx_bytes(x, 2051)
    images.write_bytes(full[:-5])
    with pytest.raises(DataError, match=match(images) + ": truncated.*20x8x8 = 1280 bytes"):
        load_edge_data(tmp_path, cfg())
    images.write_bytes(full[:6])
    with pytest.raises(DataError, match=match(images) + ": truncated IDX header"):
        load_edge_data(tmp_path, cfg())
    images.write_bytes(full + b"\0")
    with pytest.raises(DataError, match=match(images) + ": more data than"):
        load_edge_data(tmp_path, cfg())
    images.write_bytes(full)
    labels.write_bytes(idx_bytes(y[:19], 2049))
    with pytest.raises(DataError, match=match(images) + ": 20 images but .*holds 19 labels"):
        load_edge_data(tmp_path, cfg())
    bad_y = y.copy()
    bad_y[4] = 10
    labels.write_bytes(idx_bytes(bad_y, 2049))
    with pytest.raises(DataError, match=match(labels) + ": label 10 at index 4"):
        load_edge_data(tmp_path, cfg())
    labels.write_bytes(idx_bytes(y, 2049))
    with pytest.raises(DataError, match=match(images) + ": images are 8x8, the run expects 28x28"):
        load_edge_data(tmp_path, TrainConfig())
    gz = tmp_path / "gz"
    gz_images, _ = write_idx(gz, "train", x, y, gz=True)
    gz_images.write_bytes(gz_images.read_bytes()[:-30])
    with pytest.raises(DataError, match=match(gz_images) + ": cannot read"):
        load_edge_data(gz, cfg())
    labels.unlink()
    with pytest.raises(DataError, match=match(images) + ": no labels file beside it"):
        load_edge_data(tmp_path, cfg())


# ---- CIFAR-10 binary ----------------------------------------------------------------------

def cifar_records(n: int, seed: int = 0,
                  labels: np.ndarray | None = None) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    y = (np.arange(n) % 10).astype(np.uint8) if labels is None else labels.astype(np.uint8)
    records = np.concatenate([y[:, None], x.reshape(n, -1)], axis=1)
    return records.tobytes(), x, y


CIFAR_CFG = {"in_channels": 3, "image_size": 32}


def test_cifar_binary_batches_in_numeric_order(tmp_path):
    names = ["data_batch_2.bin", "data_batch_10.bin"]
    parts = {name: cifar_records(10, seed=i) for i, name in enumerate(names)}
    for name, (raw, _, _) in parts.items():
        (tmp_path / name).write_bytes(raw)
    test_raw, test_x, test_y = cifar_records(10, seed=9)
    (tmp_path / "test_batch.bin").write_bytes(test_raw)
    data = load_edge_data(tmp_path, TrainConfig(**CIFAR_CFG))
    assert data.train.x.shape == (20, 3, 32, 32) and data.test.x.shape == (10, 3, 32, 32)
    first = torch.from_numpy(parts["data_batch_2.bin"][1][0]).float().div(255).sub(0.5).div(0.5)
    assert torch.allclose(data.train.x[0], first)  # data_batch_2 before data_batch_10
    assert data.test.y.tolist() == test_y.tolist()


def test_cifar_binary_partial_file_bad_label_and_channel_mismatch(tmp_path):
    raw, _, _ = cifar_records(5)
    batch = tmp_path / "data_batch_1.bin"
    batch.write_bytes(raw[:-100])
    with pytest.raises(DataError, match=match(batch) + ": 15265 bytes is not a whole number of 3073"):
        load_edge_data(tmp_path, TrainConfig(**CIFAR_CFG))
    bad, _, _ = cifar_records(5, labels=np.array([0, 1, 2, 12, 4]))
    batch.write_bytes(bad)
    with pytest.raises(DataError, match=match(batch) + ": label 12 at index 3"):
        load_edge_data(tmp_path, TrainConfig(**CIFAR_CFG))
    batch.write_bytes(raw)
    with pytest.raises(DataError, match=match(batch) + ": images have 3 channels, the run expects 1"):
        load_edge_data(tmp_path, TrainConfig(image_size=32))
    with pytest.raises(DataError, match=match(batch) + ": images are 32x32, the run expects 28x28"):
        load_edge_data(tmp_path, TrainConfig(in_channels=3))


# ---- CIFAR-10 python pickles ---------------------------------------------------------------

class _Py2Pickler(pickle._Pickler):
    """Writes str and bytes as Python 2 ``str`` (BINSTRING), as the official batches hold them."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj):
        data = obj.encode("latin-1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[str] = _save_py2_str
    dispatch[bytes] = _save_py2_str


def py2_pickle(obj) -> bytes:
    import io
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    # numpy 1 names, as in the official files (numpy 2 writes numpy._core).
    return buf.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def cifar_dict(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {b"batch_label": b"training batch 1 of 5",
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in np.arange(n) % 10]}


def test_cifar_python_batches_py2_and_py3_pickles(tmp_path):
    train = cifar_dict(12)
    assert b"numpy.core.multiarray\n_reconstruct" in py2_pickle(train)
    (tmp_path / "data_batch_1").write_bytes(py2_pickle(train))
    (tmp_path / "data_batch_2").write_bytes(pickle.dumps(cifar_dict(8, seed=1), protocol=4))
    test = cifar_dict(5, seed=2)
    (tmp_path / "test_batch").write_bytes(py2_pickle(test))
    (tmp_path / "batches.meta").write_bytes(b"ignored")
    data = load_edge_data(tmp_path, TrainConfig(**CIFAR_CFG))
    assert data.train.x.shape == (20, 3, 32, 32) and data.test.x.shape == (5, 3, 32, 32)
    assert data.train.y[:12].tolist() == train[b"labels"]
    expected = torch.from_numpy(train[b"data"][0].reshape(3, 32, 32)).float().div(255).sub(0.5).div(0.5)
    assert torch.allclose(data.train.x[0], expected)
    assert data.test.y.tolist() == test[b"labels"]


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def test_cifar_python_refuses_code_in_pickles_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    batch = tmp_path / "data_batch_1"
    batch.write_bytes(pickle.dumps(_Evil(marker), protocol=2))
    with pytest.raises(DataError, match=match(batch) + r": refused to unpickle global (posix|nt|os)\.system"):
        load_edge_data(tmp_path, TrainConfig(**CIFAR_CFG))
    nested = cifar_dict(4)
    nested[b"labels"] = [0, 1, _Evil(marker), 3]
    batch.write_bytes(pickle.dumps(nested, protocol=4))
    with pytest.raises(DataError, match=match(batch) + r": refused to unpickle global (posix|nt|os)\.system"):
        load_edge_data(tmp_path, TrainConfig(**CIFAR_CFG))
    batch.write_bytes(b"cbuiltins\neval\n(S'1+1'\ntR.")
    with pytest.raises(DataError, match=match(batch) + r": refused to unpickle global builtins\.eval"):
        load_edge_data(tmp_path, TrainConfig(**CIFAR_CFG))
    assert not marker.exists()


def test_cifar_python_malformed_batches_are_named(tmp_path):
    batch = tmp_path / "data_batch_1"
    cases = [
        (b"\x80\x02garbage", "not a readable CIFAR-10 python batch"),
        (pickle.dumps([1, 2, 3], protocol=2), "expected a dict"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8)}, protocol=4), "expected keys"),
        (pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, protocol=4),
         r"uint8 array of shape \(N, 3072\)"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, protocol=4),
         "2 images but 1 labels"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, protocol=4),
         "label 10 at index 1"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": ["a", "b"]}, protocol=4),
         "list of integers"),
        # numpy 2 pickles through numpy._core, numpy 1 through numpy.core
        (pickle.dumps(np.zeros(3), protocol=5), r"refused to unpickle global numpy\._?core\.numeric"),
    ]
    for content, message in cases:
        batch.write_bytes(content)
        with pytest.raises(DataError, match=match(batch) + ": .*" + message):
            load_edge_data(tmp_path, TrainConfig(**CIFAR_CFG))


# ---- global_test ----------------------------------------------------------------------------

def test_global_test_folder_in_any_format(tmp_path):
    x, y = digits(30)
    write_idx(tmp_path, "train", x, y)
    gx, gy = digits(10, seed=5)
    write_idx(tmp_path / "global_test", "t10k", gx, gy)
    data = load_edge_data(tmp_path, cfg())
    assert data.global_test.y.tolist() == gy.tolist()

    images = tmp_path / "images"
    write_class_images(images, {"4": 5})
    write_class_images(images / "global_test", {c: 1 for c in DIGITS})
    data = load_edge_data(images, cfg())
    assert set(data.train.y.tolist()) == {4} and sorted(data.global_test.y.tolist()) == list(range(10))

    cifar = tmp_path / "cifar"
    (cifar / "global_test").mkdir(parents=True)
    (cifar / "data_batch_1.bin").write_bytes(cifar_records(20)[0])
    (cifar / "global_test" / "test_batch.bin").write_bytes(cifar_records(7)[0])
    (cifar / "global_test" / "data_batch_1.bin").write_bytes(cifar_records(3)[0])
    data = load_edge_data(cifar, TrainConfig(**CIFAR_CFG))
    assert len(data.global_test) == 10  # every part of the folder

    np.savez(cifar / "global_test.npz", x=np.zeros((2, 32, 32, 3), np.uint8), y=np.zeros(2, int))
    with pytest.raises(DataError, match="both global_test.npz and global_test/"):
        load_edge_data(cifar, TrainConfig(**CIFAR_CFG))
    for p in (cifar / "global_test").iterdir():
        p.unlink()
    (cifar / "global_test").rmdir()
    assert len(load_edge_data(cifar, TrainConfig(**CIFAR_CFG)).global_test) == 2

    (images / "global_test" / "0" / "img000.png").write_bytes(b"junk")
    with pytest.raises(DataError, match=match(images / "global_test" / "0" / "img000.png")):
        load_edge_data(images, cfg())
    empty = tmp_path / "empty"
    write_class_images(empty, {"1": 3})
    (empty / "global_test").mkdir()
    with pytest.raises(DataError, match=match(empty / "global_test") + ": no train.npz"):
        load_edge_data(empty, cfg())


def test_test_only_data_is_not_enough(tmp_path):
    x, y = digits(10)
    write_idx(tmp_path, "t10k", x, y)
    with pytest.raises(DataError, match="IDX .*test data but no training data"):
        load_edge_data(tmp_path, cfg())


# ---- real datasets in ../shared/data ---------------------------------------------------------

def real(*parts: str) -> Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is not there (set FEDATTN_DATA to the real datasets' folder)")
    return path


def test_real_mnist_idx_gz(tmp_path):
    mnist = real("mnist")
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (tmp_path / name).symlink_to(mnist / name)
    data = load_edge_data(tmp_path, TrainConfig())
    assert data.train.x.shape == (60000, 1, 28, 28) and data.test.x.shape == (10000, 1, 28, 28)
    assert data.train.y[:5].tolist() == [5, 0, 4, 1, 9] and data.test.y[:5].tolist() == [7, 2, 1, 0, 4]
    assert torch.bincount(data.train.y).tolist()[:2] == [5923, 6742]
    assert int(data.test.y.min()) == 0 and int(data.test.y.max()) == 9
    assert float(data.train.x.min()) == -1.0 and float(data.train.x.max()) == 1.0


def test_real_cifar10_binary(tmp_path):
    bins = real("cifar-10", "cifar-10-batches-bin")
    (tmp_path / "data_batch_1.bin").symlink_to(bins / "data_batch_1.bin")
    (tmp_path / "test_batch.bin").symlink_to(bins / "test_batch_first1000.bin")
    data = load_edge_data(tmp_path, TrainConfig(**CIFAR_CFG))
    assert data.train.x.shape == (10000, 3, 32, 32) and data.test.x.shape == (1000, 3, 32, 32)
    assert data.test.y[:10].tolist() == [3, 8, 8, 0, 6, 6, 1, 6, 3, 1]
    assert torch.bincount(data.train.y, minlength=10).min() > 900 and int(data.train.y.max()) == 9


def test_real_fashion_mnist_labels_without_images_name_the_missing_file(tmp_path):
    labels = real("fashion-mnist", "train-labels-idx1-ubyte.gz")
    (tmp_path / labels.name).symlink_to(labels)
    with pytest.raises(DataError, match=match(tmp_path / labels.name) + ": no images file beside it"):
        load_edge_data(tmp_path, TrainConfig())


# ---- uint8 kept, decoded per batch (fl-edge) ------------------------------------------------


@pytest.mark.parametrize("channels,in_channels", [(3, 3), (1, 3)])
def test_uint8_kept_and_decoded_per_batch_trains_bit_for_bit_as_the_float_data(
        tmp_path, channels, in_channels):
    """fl-edge keeps uint8 images as read (a quarter of float32's memory) and decodes each
    batch: the same elementwise maths as decoding all of them up front, so training, the
    statistics pass and evaluation give the same bits (here an image folder of RGB or grey
    PNGs and an npz holding NHWC uint8)."""
    from conftest import make_images

    from fedattn_shared.methods import MethodContext, load_method
    from fl_edge.trainer import evaluate, train_local

    x, y = make_images(48, size=16, channels=channels, seed=3)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    for i, (image, label) in enumerate(zip(x[:20], y[:20], strict=True)):
        write_image(tmp_path / "global_test" / str(label) / f"{i}.png", image)
    config = cfg(in_channels=in_channels, model="lenet-bn", image_size=16)
    kept = load_edge_data(tmp_path, config, keep_uint8=True)
    floats = load_edge_data(tmp_path, config)
    for name in ("train", "test", "global_test"):
        a, b = getattr(kept, name), getattr(floats, name)
        assert a.x.dtype == torch.uint8 and b.x.dtype == torch.float32
        assert a.x.shape == b.x.shape == (len(b), in_channels, 16, 16)
        assert torch.equal(a.decoded().x, b.x) and torch.equal(a.y, b.y)
    results = []
    for data in (kept, floats):
        cls = load_method("fedavg")
        method = cls(MethodContext(config, cls.Params()))
        torch.manual_seed(0)
        algo = method.edge(method.build_models(), torch.device("cpu"))
        train_local(algo, data.train, 2, 8, seed=1, device=torch.device("cpu"), progress=False)
        counts = evaluate(algo, data.global_test, "global_test", 10, 16, torch.device("cpu"))
        results.append((algo.models["model"].state_dict(), counts))
    (wa, ca), (wb, cb) = results
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    assert np.array_equal(ca.confusion, cb.confusion) and ca.loss_sum == cb.loss_sum

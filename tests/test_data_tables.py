"""Table datasets (shared/data/tables.py) as an edge's --data-dir and as fl-partition's
source: a Hugging Face ``datasets`` folder written by the real ``save_to_disk``, Parquet
with configurable columns, a CSV of (path, label); every refusal names the file and row."""

from __future__ import annotations

import csv
import io

import numpy as np
import pytest
import torch
from PIL import Image

from fedattn_shared.config import TrainConfig
from fedattn_shared.data import DataError, load_edge_data
from fedattn_shared.data.partition import main as partition

datasets = pytest.importorskip("datasets")  # the test extra; an edge needs pyarrow only
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")


def image(value: int, size: int = 8, mode: str = "L") -> Image.Image:
    """A flat image whose pixels say which sample it is."""
    shape = (size, size) if mode == "L" else (size, size, 3)
    return Image.fromarray(np.full(shape, value, np.uint8), mode)


def png(value: int, size: int = 8, mode: str = "L") -> bytes:
    out = io.BytesIO()
    image(value, size, mode).save(out, "PNG")
    return out.getvalue()


def cfg(**kwargs) -> TrainConfig:
    return TrainConfig(**{"num_classes": 3, "image_size": 8, **kwargs})


def hf_dataset(n: int, mode: str = "L"):
    return datasets.Dataset.from_dict(
        {"image": [image(i, mode=mode) for i in range(n)], "label": [i % 3 for i in range(n)]},
        features=datasets.Features({"image": datasets.Image(),
                                    "label": datasets.ClassLabel(names=["a", "b", "c"])}))


def test_a_datasets_folder_from_save_to_disk_is_an_edge_data_dir(tmp_path):
    hf_dataset(30).save_to_disk(str(tmp_path / "one"))
    data = load_edge_data(tmp_path / "one", cfg(), keep_uint8=True)
    assert (len(data.train), len(data.test)) == (24, 6)  # the seeded stratified split
    assert data.train.x.dtype == torch.uint8 and data.train.x.shape[1:] == (1, 8, 8)
    for x, y in zip(data.train.x[:], data.train.y, strict=True):  # pixel value i, label i % 3
        assert int(x[0, 0, 0]) % 3 == int(y)

    datasets.DatasetDict({"train": hf_dataset(12, "RGB"), "test": hf_dataset(6, "RGB")}
                         ).save_to_disk(str(tmp_path / "dict"))
    data = load_edge_data(tmp_path / "dict", cfg(in_channels=3), keep_uint8=True)
    assert (len(data.train), len(data.test)) == (12, 6) and data.test.x.shape[1:] == (3, 8, 8)
    assert data.train.x[5][:, 0, 0].tolist() == [5, 5, 5]


def test_parquet_with_named_columns_and_class_names(tmp_path):
    """Columns named by train.image_column/label_column, labels by class name, images as
    datasets.Image structs and as plain bytes, in train/test files."""
    names = ["cat", "dog", "owl"]
    structs = [{"bytes": png(i), "path": None} for i in range(12)]
    pq.write_table(pa.table({"img": structs, "kind": [names[i % 3] for i in range(12)]}),
                   tmp_path / "train-00000.parquet", row_group_size=5)
    pq.write_table(pa.table({"img": [png(100 + i) for i in range(3)], "kind": names}),
                   tmp_path / "test.parquet")
    run = cfg(class_names=names, image_column="img", label_column="kind")
    data = load_edge_data(tmp_path, run, keep_uint8=True)
    assert (len(data.train), len(data.test)) == (12, 3)
    assert data.train.y.tolist() == [i % 3 for i in range(12)]
    assert data.test.x[:][:, 0, 0, 0].tolist() == [100, 101, 102]
    with pytest.raises(DataError, match=r"train-00000.parquet: no column 'image' \(columns: img, "
                                        r"kind\); name it with --set train.image_column=NAME"):
        load_edge_data(tmp_path, cfg(class_names=names))


def test_a_csv_of_paths_and_labels(tmp_path):
    (tmp_path / "pics").mkdir()
    with (tmp_path / "data.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label"])
        for i in range(15):
            image(i).save(tmp_path / "pics" / f"{i}.png")
            writer.writerow([f"pics/{i}.png", i % 3])
    data = load_edge_data(tmp_path, cfg(), keep_uint8=True)
    assert len(data.train) + len(data.test) == 15


@pytest.mark.parametrize("damage, message", [
    ("corrupt", r"data.parquet: row 4: not a readable image"),
    ("label", r"data.parquet: row 4: label 7 is not a class index 0..2 nor one of the server's"),
    ("size", r"data.parquet: row 4: image is 9x9 pixels, the run expects 8x8"),
    ("empty", r"data.parquet: row 4: not a readable image \(ValueError: no image in the cell"),
    ("nolabel", r"data.parquet: row 4: no label in column 'label'"),
])
def test_a_bad_row_is_refused_naming_the_file_and_row(tmp_path, damage, message):
    images, labels = [png(i) for i in range(9)], [i % 3 for i in range(9)]
    images[4] = {"corrupt": b"\x89PNG not really", "size": png(4, size=9), "empty": None}.get(
        damage, images[4])
    labels[4] = {"label": 7, "nolabel": None}.get(damage, labels[4])
    pq.write_table(pa.table({"image": images, "label": labels}), tmp_path / "data.parquet",
                   row_group_size=3)
    with pytest.raises(DataError, match=message):
        load_edge_data(tmp_path, cfg())


def test_a_csv_row_pointing_at_a_missing_file_is_named(tmp_path):
    (tmp_path / "train.csv").write_text("path,label\nmissing.png,0\n")
    with pytest.raises(DataError, match=r"train.csv: row 0: not a readable image \("
                                        r"FileNotFoundError"):
        load_edge_data(tmp_path, cfg())


def test_fl_partition_cuts_a_parquet_source_into_edge_folders(tmp_path):
    rows = [png(i) for i in range(90)]  # distinct: fl-partition drops duplicate images
    pq.write_table(pa.table({"picture": rows, "animal": [["cat", "dog", "owl"][i % 3]
                                                         for i in range(90)]}),
                   tmp_path / "data.parquet")
    out = tmp_path / "edges"
    assert partition(["--source", str(tmp_path), "--edges", "3", "--out", str(out),
                      "--image-column", "picture", "--label-column", "animal",
                      "--class-names", "source", "--global-test-per-class", "5"]) == 0
    run = cfg(class_names=["cat", "dog", "owl"])
    sizes = [len(load_edge_data(out / f"edge_{i:02d}", run).train) for i in range(3)]
    assert sum(sizes) + sum(len(load_edge_data(out / f"edge_{i:02d}", run).test)
                            for i in range(3)) == 90 - 15


def test_fl_partition_writes_parquet_edges_that_read_back_bit_identical(tmp_path):
    """--format parquet: every edge's train/test files and global_test/ read back to the
    very arrays the npz format writes (PNG is lossless)."""
    pq.write_table(pa.table({"image": [png(i) for i in range(60)],
                             "label": [i % 3 for i in range(60)]}), tmp_path / "data.parquet")
    runs = {}
    for fmt in ("npz", "parquet"):
        assert partition(["--source", str(tmp_path), "--edges", "2", "--out",
                          str(tmp_path / fmt), "--format", fmt,
                          "--global-test-per-class", "3"]) == 0
        runs[fmt] = load_edge_data(tmp_path / fmt / "edge_01", cfg(), keep_uint8=True)
    for split in ("train", "test", "global_test"):
        a, b = getattr(runs["npz"], split), getattr(runs["parquet"], split)
        assert torch.equal(a.x, b.x[:]) and torch.equal(a.y, b.y)


def test_images_stay_encoded_until_a_batch_draws_them(tmp_path):
    """Only headers are read at load: the edge holds the encoded bytes (not the pixels),
    a batch decodes exactly its rows, the real trainer trains on them, and a body corrupt
    past its header is refused when its batch is drawn, naming the file and the row."""
    from fedattn_shared.data.encoded import EncodedImages
    from fedattn_shared.methods import MethodContext, load_method
    from fl_edge.trainer import train_local

    rows = [png(i, size=28) for i in range(40)]
    noise = io.BytesIO()
    Image.fromarray(np.random.default_rng(7).integers(0, 256, (28, 28), dtype=np.uint8)).save(
        noise, "PNG")
    broken = bytearray(noise.getvalue())
    broken[60:-20] = bytes(len(broken) - 80)  # the header intact, the pixel data garbage
    rows[7] = bytes(broken)
    pq.write_table(pa.table({"image": rows, "label": [i % 3 for i in range(40)]}),
                   tmp_path / "train.parquet")
    pq.write_table(pa.table({"image": rows[:6], "label": [0, 1, 2, 0, 1, 2]}),
                   tmp_path / "test.parquet")
    run = cfg(image_size=28, batch_size=8)
    data = load_edge_data(tmp_path, run, keep_uint8=True)  # the header of row 7 passes
    assert isinstance(data.train.x, EncodedImages)
    assert sum(len(b) for b in data.train.x.blobs) == sum(len(r) for r in rows)
    batch = data.train.x[torch.tensor([3, 1])]
    assert batch.dtype == torch.uint8 and batch[:, 0, 0, 0].tolist() == [3, 1]
    with pytest.raises(DataError, match=r"train.parquet: row 7: not a readable image"):
        data.train.x[7]
    fedavg = load_method("fedavg")
    method = fedavg(MethodContext(TrainConfig(num_classes=3, image_size=28, batch_size=8),
                                  fedavg.Params()))
    algo = method.edge(method.build_models(), torch.device("cpu"))
    from fedattn_shared.data.npz import Split

    healthy = Split(data.train.x.subset([i for i in range(40) if i != 7]),
                    torch.cat([data.train.y[:7], data.train.y[8:]]))
    assert train_local(algo, healthy, 1, 8, 0, torch.device("cpu"), progress=False).steps == 5
    with pytest.raises(DataError, match=r"train.parquet: row 7"):
        train_local(algo, data.train, 1, 8, 0, torch.device("cpu"), progress=False)

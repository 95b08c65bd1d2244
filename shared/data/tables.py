"""Image datasets kept as tables: a Hugging Face ``datasets`` folder (``save_to_disk``),
Parquet files with an image and a label column, and a CSV of (path, label).

Layouts of an edge's ``--data-dir`` (and of an ``fl-partition --source``)::

    state.json + data-*.arrow            one Dataset (save_to_disk): all samples
    dataset_dict.json + train/ [test/]   a DatasetDict: its train and test splits
    train*.parquet [test*.parquet]       or data*.parquet / any other *.parquet: all samples
    train.csv [test.csv]  or data.csv    columns path,label; paths relative to the CSV

The columns are ``train.image_column`` and ``train.label_column`` ("image", "label"; a CSV
may call its image column "path"). An image cell is encoded bytes (PNG, JPEG, ...), a
``datasets.Image`` struct (bytes or path), or a path; a label is the class index, or a class
name from the server's class list (``train.class_names``), as image folders use.

Reading is lazy: a file is opened memory-mapped (Arrow) or read by row groups (Parquet,
pyarrow), ``ROWS`` rows at a time, and only each image's header is read at load (format
and size checked, naming file and row); the pixels are decoded when a batch draws the row
(``encoded.py``), so an edge holds its images as compressed as they are on disk.
fl-partition decodes its source once, to cut it.
Every refusal names the file and the row. pyarrow is the one
library this needs (the ``data`` extra); a CSV needs none.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import TrainConfig
from .npz import DataError, Split

ROWS = 256  # rows decoded per step
CSV_PATH_COLUMN = "path"


@dataclass(frozen=True)
class Columns:
    image: str = "image"
    label: str = "label"


@dataclass
class Table:
    """One part's rows: uint8 images (N, H, W) or (N, H, W, 3), labels as read (int or
    str); read without decoding, ``blobs`` (encoded bytes or paths) and each row's ``where``
    instead of ``x``, with the ``mode`` and ``size`` they decode to."""

    x: np.ndarray
    labels: list
    blobs: list = field(default_factory=list)
    where: list = field(default_factory=list)
    mode: str = "L"
    size: int = 0


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401 - the submodule the Parquet reader uses
    except ImportError:
        raise DataError("Parquet and datasets folders need pyarrow: pip install "
                        "'fedattn[data]' (or pyarrow) on this device") from None
    return pyarrow


def _check_columns(path: Path, names: list[str], columns: Columns) -> None:
    for column, key in ((columns.image, "image_column"), (columns.label, "label_column")):
        if column not in names:
            raise DataError(f"{path}: no column {column!r} (columns: {', '.join(names)}); name "
                            f"it with --set train.{key}=NAME (fl-partition --{key.replace('_', '-')})")


def _arrow_rows(path: Path, columns: Columns) -> Iterator[tuple[list, list]]:
    """A ``save_to_disk`` shard: an Arrow IPC stream, memory-mapped."""
    pa = _pyarrow()
    try:
        with pa.memory_map(str(path), "r") as source:
            reader = pa.ipc.open_stream(source)
            _check_columns(path, reader.schema.names, columns)
            for batch in reader:
                for start in range(0, batch.num_rows, ROWS):
                    part = batch.slice(start, ROWS)
                    yield (part.column(columns.image).to_pylist(),
                           part.column(columns.label).to_pylist())
    except DataError:
        raise
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: not a readable Arrow stream ({err})") from None


def _parquet_rows(path: Path, columns: Columns) -> Iterator[tuple[list, list]]:
    pa = _pyarrow()
    try:
        table = pa.parquet.ParquetFile(path)
        _check_columns(path, table.schema_arrow.names, columns)
        for batch in table.iter_batches(batch_size=ROWS, columns=[columns.image, columns.label]):
            yield batch.column(0).to_pylist(), batch.column(1).to_pylist()
    except DataError:
        raise
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: not a readable Parquet file ({err})") from None


def _csv_rows(path: Path, columns: Columns) -> Iterator[tuple[list, list]]:
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            names = list(reader.fieldnames or [])
            image = columns.image if columns.image in names else CSV_PATH_COLUMN
            _check_columns(path, names, Columns(image, columns.label))
            images, labels = [], []
            for row in reader:
                images.append(row[image])
                labels.append(row[columns.label])
                if len(images) == ROWS:
                    yield images, labels
                    images, labels = [], []
            if images:
                yield images, labels
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"{path}: not a readable CSV file ({err})") from None


READERS: dict[str, Callable[[Path, Columns], Iterator[tuple[list, list]]]] = {
    ".arrow": _arrow_rows, ".parquet": _parquet_rows, ".csv": _csv_rows}


def _blob(cell: object, folder: Path) -> bytes | Path:
    """What a cell holds of its image: encoded bytes, or a file's path."""
    if isinstance(cell, dict):  # datasets.Image: {"bytes": ..., "path": ...}
        cell = cell.get("bytes") or cell.get("path")
    if isinstance(cell, (bytes, bytearray, memoryview)):
        return bytes(cell)
    if isinstance(cell, str) and cell:
        return folder / cell
    raise ValueError(f"no image in the cell ({type(cell).__name__})")


def read_table(files: list[Path], columns: Columns, mode: str | None = None,
               size: int | None = None, label_of: Callable[[object], object] | None = None,
               decode: bool = True) -> Table:
    """Every row of ``files`` (one part). ``mode`` ("L", "RGB") and ``size`` (side in
    pixels) are the run's; None takes them from the first image (fl-partition), and every
    other image must then match it. ``label_of`` maps a label as read to its class index
    (ValueError: refused naming the row); None keeps labels as read. ``decode`` False reads
    each image's header only (format and size checked) and keeps it encoded
    (``Table.blobs``, decoded per batch: encoded.py)."""
    from PIL import Image

    chunks: list[np.ndarray] = []
    labels: list = []
    blobs: list[bytes | Path] = []
    where_rows: list[str] = []
    for path in files:
        row = 0
        for cells, row_labels in READERS[path.suffix](path, columns):
            chunk = None
            for i, (cell, label) in enumerate(zip(cells, row_labels, strict=True)):
                where = f"{path}: row {row + i}"
                if label is None or label == "":
                    raise DataError(f"{where}: no label in column {columns.label!r}")
                if label_of is not None:
                    try:
                        row_labels[i] = label_of(label)
                    except ValueError as err:
                        raise DataError(f"{where}: {err}") from None
                try:
                    blob = _blob(cell, path.parent)
                    with Image.open(io.BytesIO(blob) if isinstance(blob, bytes) else blob) as image:
                        if mode is None:
                            mode = "L" if image.mode in ("1", "L", "LA", "I", "I;16", "F") else "RGB"
                        if size is None:
                            size = image.size[0]
                        if image.size != (size, size):
                            raise DataError(f"{where}: image is {image.size[0]}x{image.size[1]} "
                                            f"pixels, the run expects {size}x{size} (images are "
                                            "not resized: resize them beforehand)")
                        pixels = np.asarray(image.convert(mode), dtype=np.uint8) if decode else None
                except DataError:
                    raise
                except (OSError, ValueError, Image.DecompressionBombError) as err:
                    raise DataError(f"{where}: not a readable image ({type(err).__name__}: "
                                    f"{err})") from None
                if not decode:
                    blobs.append(blob)
                    where_rows.append(where)
                    continue
                if chunk is None:
                    chunk = np.empty((len(cells), *pixels.shape), np.uint8)
                chunk[i] = pixels
            if chunk is not None:
                chunks.append(chunk)
            labels += row_labels
            row += len(cells)
    if not labels:
        raise DataError(f"{', '.join(map(str, files))}: no rows")
    x = np.concatenate(chunks) if chunks else np.empty((0,), np.uint8)
    return Table(x, labels, blobs, where_rows, mode or "L", size or 0)


def class_index(classes: list[str]) -> Callable[[object], int]:
    """A ``label_of`` for a run's classes: an integer in [0, classes), or a class name
    (a CSV's labels are text: digits are indices)."""
    index = {name: i for i, name in enumerate(classes)}

    def label_of(label: object) -> int:
        if isinstance(label, str) and label in index:
            return index[label]
        if isinstance(label, str) and label.strip().isdigit():
            label = int(label)
        if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(classes):
            return label
        raise ValueError(f"label {label!r} is not a class index 0..{len(classes) - 1} nor one "
                         f"of the server's classes ({', '.join(classes[:30])})")

    return label_of


# ---- layouts ------------------------------------------------------------------------------


def _dataset_files(folder: Path) -> list[Path]:
    """The shards a ``save_to_disk`` Dataset folder lists in its state.json."""
    state = folder / "state.json"
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{state}: not a datasets state.json ({type(err).__name__}: {err})") from None
    if not names or not all(isinstance(n, str) and Path(n).name == n and n.endswith(".arrow")
                            for n in names):
        raise DataError(f"{state}: _data_files must name .arrow files in {folder}, got {names}")
    return [folder / name for name in names]


def layout(root: Path) -> dict[str, list[Path]] | None:
    """The table files of ``root`` by part ("train", "test", "all"), or None when it holds
    no table layout."""
    if (root / "dataset_dict.json").is_file():
        try:
            splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(f"{root / 'dataset_dict.json'}: not a datasets dataset_dict.json "
                            f"({type(err).__name__}: {err})") from None
        parts = {s: _dataset_files(root / s) for s in ("train", "test") if s in splits}
        if "train" not in parts:
            raise DataError(f"{root}: a DatasetDict without a train split (splits: {splits})")
        return parts
    if (root / "state.json").is_file():
        return {"all": _dataset_files(root)}
    for suffix in (".parquet", ".csv"):
        files = sorted(p for p in root.glob(f"*{suffix}") if not p.name.startswith("."))
        if not files:
            continue
        train = [p for p in files if p.name.startswith("train")]
        test = [p for p in files if p.name.startswith("test")]
        rest = [p for p in files if p not in train and p not in test]
        if train and rest:
            raise DataError(f"{rest[0]}: beside train*{suffix} files, only test*{suffix} ones "
                            "are read; rename or move it")
        if not train and not rest:
            raise DataError(f"{root}: test{suffix} data but no training data (train{suffix})")
        parts = {"train": train} if train else {"all": rest}
        return {**parts, "test": test} if test else parts
    return None


def detect(root: Path) -> bool:
    return ((root / "dataset_dict.json").is_file() or (root / "state.json").is_file()
            or any(root.glob("*.parquet")) or any(root.glob("*.csv")))


def format_name(root: Path) -> str:
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
        return "datasets folder"
    return "Parquet" if any(root.glob("*.parquet")) else "CSV"


def read_parts(root: Path, cfg: TrainConfig) -> dict[str, Split]:
    """An edge's parts from a table layout, checked against the run's classes, channels
    and image size; the images stay encoded until a batch draws them (encoded.py)."""
    from .encoded import EncodedImages

    columns = Columns(cfg.image_column, cfg.label_column)
    mode = "L" if cfg.in_channels == 1 else "RGB"
    parts = {}
    for part, files in (layout(root) or {}).items():
        table = read_table(files, columns, mode, cfg.image_size, class_index(cfg.classes),
                           decode=False)
        images = EncodedImages(table.blobs, mode, cfg.image_size, cfg.in_channels, table.where)
        parts[part] = Split(images, torch.tensor(table.labels, dtype=torch.int64))
    return parts


def write_parquet(path: Path, x: np.ndarray, y: np.ndarray, columns: Columns = Columns()) -> None:
    """uint8 images (N, H, W[, 3]) and labels as a Parquet file of PNG bytes and class
    indices, the layout this module reads (fl-partition --format parquet)."""
    from PIL import Image

    pa = _pyarrow()
    encoded = []
    for img in x:
        out = io.BytesIO()
        Image.fromarray(img).save(out, format="PNG")
        encoded.append(out.getvalue())
    table = pa.table({columns.image: pa.array(encoded, pa.binary()),
                      columns.label: pa.array(y.astype(np.int64), pa.int64())})
    pa.parquet.write_table(table, path)

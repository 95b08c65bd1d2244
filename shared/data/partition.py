"""fl-partition: cut one dataset into N edge data folders for federated experiments.

Source (``--source``): a directory holding ``train.npz`` [+ ``test.npz``] or ``data.npz``
(arrays ``x`` uint8 images, ``y`` integer labels), MNIST-style IDX files
(``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``, optional ``t10k-*``),
or CIFAR-10 binary batches (``data_batch_*.bin``, optional ``test_batch*.bin``); or the
name ``sklearn-digits`` (scikit-learn's bundled 8x8 digits, when scikit-learn is
installed). See :mod:`.sources`. ``--limit N`` keeps only the first N training samples.

Global test set. One balanced set, ``global_test.npz`` (``global_test/<class>/`` for
``--format folders``), is written unchanged into EVERY edge folder, so all edges are
scored on the same images. With ``--global-test-per-class M``:

* if the source has a test split, the first (in file order) up to M images of each
  class are taken from it; where the test split has fewer than M images of a class, the
  rest is held out from the training set (a seed-0 draw, whatever ``--seed`` is). For the
  CIFAR-10 copy here (only the first 1,000 official test images, 86..112 per class)
  ``M >= 112`` keeps all 1,000 official test images and tops each class up to M from the
  training data;
* otherwise M images per class are held out from the training set (seed 0).

Held-out images, and any training image whose pixels equal a global-test image, are
removed from the data that is partitioned, so the global test set is disjoint from
every edge's train and test data. A hold-out may take at most half of a class's
training samples. ``M = 0`` writes no global test set.

Schemes (``--scheme``), all driven by ``--seed``:

* ``iid``: a shuffled split into N parts whose sizes differ by at most one;
* ``dirichlet``: per class (Hsu et al. 2019): for each class c a draw
  p_c ~ Dir(alpha * 1_N) and the class's shuffled samples are cut at the rounded
  cumulative proportions. The whole partition is redrawn (same RNG stream) until every
  edge has at least ``--min-per-edge`` samples, at most 100 times. ``--dirichlet-cap``
  adds NIID-Bench's size cap (Li et al. 2022, https://github.com/Xtra-Computing/NIID-Bench,
  ``partition_data`` 'noniid-labeldir'): an edge that already holds at least
  (samples to partition) / N gets no share of the classes still to deal (its p_c entry is
  set to 0 and p_c renormalised), which keeps edge sizes near equal; the published tables
  that bench/calibrate.py compares against were cut this way;
* ``shards``: label shards after McMahan et al. 2017: samples are sorted by label and
  cut into N*K shards (K = ``--shards-per-edge``), each edge is dealt K shards. Shards are
  cut inside classes (N*K must be a multiple of the number of classes), and dealt so
  that every edge holds exactly K distinct classes;
* ``domains``: feature shift: an IID split, and edge i applies ``DOMAINS[i % 6]`` to all
  its images (train and local test): original, rotate +15 deg, rotate +30 deg, invert
  (255 - x), dim (x * 0.5), gaussian noise (sigma 32, seeded by (seed, edge)). The
  global test set is NOT transformed.
* ``digits``: the FedBN / pFedLA digits setting, one digit *dataset* per edge (feature
  shift between real domains), 28x28 RGB: ``--source`` is a data root with ``mnist/``,
  ``usps/`` and ``cifar-10/`` and ``--domains`` lists the edges' domains (default mnist, usps,
  mnistm-style, synthdigits-style; the last two are stand-ins built the way MNIST-M and
  SynthDigits were made, see :mod:`.digits`). Edge i gets ``--limit`` training images
  (default 1,000) and ``--domain-test`` test images of domain i; no global test set.

Each edge's share is split into local train/test per class (``--test-fraction``, at least
one test sample for a class with two or more samples; 0 writes no test split, and the
edge then splits its data itself). Output: ``<out>/edge_00 ...`` with ``train.npz``,
``test.npz``, ``global_test.npz`` (or ``train/<class>/NNNNN.png`` etc. with
``--format folders``; class folders are named by ``--class-names``, by default the class
index), and ``<out>/partition.json`` with the settings, the per-edge class histogram
and the sha256 of each edge's train arrays. The same arguments give byte-identical
output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .digits import DIGIT_DOMAINS, STAND_INS, build_domains
from .sources import RawDataset, SourceError, load_source
from .tables import Columns, write_parquet

SCHEMES = ("iid", "dirichlet", "shards", "domains", "digits")
FORMATS = ("npz", "folders", "parquet")
DOMAINS = ("original", "rotate+15", "rotate+30", "invert", "dim-0.5", "noise-32")
MAX_TRIES = 100
GLOBAL_TEST_SEED = 0
_EDGE_DIR = re.compile(r"edge_\d+")


class UsageError(ValueError):
    """A bad argument; the message names the flag."""


@dataclass
class PartitionConfig:
    source: str
    out: Path
    edges: int
    seed: int = 0
    scheme: str = "iid"
    alpha: float = 0.5
    shards_per_edge: int = 2
    format: str = "npz"
    test_fraction: float = 0.2
    global_test_per_class: int = 100
    limit: int | None = None
    min_per_edge: int = 10
    dirichlet_cap: bool = False  # NIID-Bench's rule: a full edge gets no more classes
    class_names: str | None = None
    force: bool = False
    # a table source (datasets folder, Parquet, CSV): its image and label columns
    image_column: str = "image"
    label_column: str = "label"
    domains: list[str] = field(default_factory=lambda: list(DIGIT_DOMAINS))  # digits only
    domain_test: int = 500  # digits: test images per domain


@dataclass
class EdgeShare:
    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    domain: str | None = None


@dataclass
class GlobalTest:
    x: np.ndarray
    y: np.ndarray
    from_test: int = 0
    from_train: int = 0
    holdout: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # train indices


def _fedattn_version() -> str:
    try:
        from importlib.metadata import version

        return version("fedattn")
    except Exception:  # not installed as a distribution
        return "unknown"


def validate(cfg: PartitionConfig) -> None:
    """Checks that need no data; raise :class:`UsageError` naming the flag."""
    if cfg.edges < 1:
        raise UsageError(f"--edges must be >= 1 (got {cfg.edges})")
    if cfg.seed < 0:
        raise UsageError(f"--seed must be >= 0 (got {cfg.seed})")
    if cfg.scheme not in SCHEMES:
        raise UsageError(f"--scheme must be one of {', '.join(SCHEMES)} (got {cfg.scheme!r})")
    if cfg.format not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)} (got {cfg.format!r})")
    if not cfg.alpha > 0 or not np.isfinite(cfg.alpha):
        raise UsageError(f"--alpha must be a finite number > 0 (got {cfg.alpha})")
    if cfg.shards_per_edge < 1:
        raise UsageError(f"--shards-per-edge must be >= 1 (got {cfg.shards_per_edge})")
    if not 0 <= cfg.test_fraction < 1:
        raise UsageError(f"--test-fraction must be in [0, 1) (got {cfg.test_fraction})")
    if cfg.global_test_per_class < 0:
        raise UsageError(f"--global-test-per-class must be >= 0 (got {cfg.global_test_per_class})")
    if cfg.limit is not None and cfg.limit < 1:
        raise UsageError(f"--limit must be >= 1 (got {cfg.limit})")
    if cfg.min_per_edge < 0:
        raise UsageError(f"--min-per-edge must be >= 0 (got {cfg.min_per_edge})")
    if cfg.scheme == "digits":
        unknown = [d for d in cfg.domains if d not in DIGIT_DOMAINS]
        if unknown or not cfg.domains:
            raise UsageError(f"--domains must list some of {', '.join(DIGIT_DOMAINS)} "
                             f"(got {','.join(cfg.domains)!r})")
        if cfg.edges != len(cfg.domains):
            raise UsageError(f"--edges {cfg.edges}: the digits scheme has one edge per domain "
                             f"({len(cfg.domains)} domains)")
        if cfg.domain_test < 1:
            raise UsageError(f"--domain-test must be >= 1 (got {cfg.domain_test})")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not cfg.force:
        raise UsageError(f"--out {out}: directory is not empty (pass --force to replace its edge_* "
                         f"folders and partition.json)")


def resolve_class_names(cfg: PartitionConfig, data: RawDataset) -> list[str]:
    labels_max = int(data.train_y.max())
    if data.has_test:
        labels_max = max(labels_max, int(data.test_y.max()))
    if cfg.class_names is None:
        return [str(i) for i in range(labels_max + 1)]
    if cfg.class_names == "source":
        if not data.class_names:
            raise UsageError(f"--class-names source: {data.path} has no class names of its own")
        names = list(data.class_names)
    else:
        names = [n.strip() for n in cfg.class_names.split(",")]
    if len(names) <= labels_max:
        raise UsageError(f"--class-names gives {len(names)} names but the data has label {labels_max}")
    if len(set(names)) != len(names) or any(n in ("", ".", "..") or "/" in n or "\\" in n for n in names):
        raise UsageError("--class-names: names must be unique, non-empty and usable as folder names")
    return names


def _image_keys(x: np.ndarray) -> list[bytes]:
    flat = np.ascontiguousarray(x).reshape(len(x), -1)
    return [row.tobytes() for row in flat]


def select_global_test(data: RawDataset, per_class: int, num_classes: int) -> GlobalTest:
    """The balanced global test set; see the module docstring."""
    shape = data.train_x.shape[1:]
    if per_class == 0:
        return GlobalTest(np.zeros((0, *shape), np.uint8), np.zeros(0, np.int64))
    rng = np.random.default_rng(GLOBAL_TEST_SEED)
    xs, ys, holdout = [], [], []
    from_test = from_train = 0
    for c in range(num_classes):
        test_idx = np.flatnonzero(data.test_y == c)[:per_class] if data.has_test else np.zeros(0, np.int64)
        train_idx = np.flatnonzero(data.train_y == c)
        if len(test_idx) == 0 and len(train_idx) == 0:
            continue  # class absent from this (limited) source
        need = per_class - len(test_idx)
        if need > len(train_idx) // 2:
            have = f"{len(train_idx)} training" + (f" and {len(test_idx)} test" if data.has_test else "")
            raise UsageError(f"--global-test-per-class {per_class}: class {c} has only {have} samples; "
                             f"holding out {need} would take more than half of its training data "
                             f"(lower --global-test-per-class or raise --limit)")
        taken = np.sort(rng.choice(train_idx, size=need, replace=False)) if need > 0 else train_idx[:0]
        if len(test_idx):
            xs.append(data.test_x[test_idx])
        xs.append(data.train_x[taken])
        ys.append(np.full(len(test_idx) + len(taken), c, np.int64))
        holdout.append(taken)
        from_test += len(test_idx)
        from_train += len(taken)
    return GlobalTest(np.concatenate(xs), np.concatenate(ys), from_test, from_train,
                      np.concatenate(holdout).astype(np.int64))


def _iid(pool: np.ndarray, edges: int, rng: np.random.Generator) -> list[np.ndarray]:
    return np.array_split(rng.permutation(pool), edges)


def _dirichlet(pool: np.ndarray, labels: np.ndarray, cfg: PartitionConfig,
               rng: np.random.Generator) -> tuple[list[np.ndarray], int]:
    n = cfg.edges
    if cfg.min_per_edge * n > len(pool):
        raise UsageError(f"--min-per-edge {cfg.min_per_edge} x --edges {n} exceeds the "
                         f"{len(pool)} training samples to partition")
    classes = np.unique(labels[pool])
    for attempt in range(1, MAX_TRIES + 1):
        parts: list[list[np.ndarray]] = [[] for _ in range(n)]
        for c in classes:
            idx = rng.permutation(pool[labels[pool] == c])
            p = rng.dirichlet(np.full(n, cfg.alpha))
            if cfg.dirichlet_cap:
                held = np.array([sum(len(chunk) for chunk in part) for part in parts])
                p = p * (held < len(pool) / n)
                p = p / p.sum()  # some edge is below the mean until every sample is dealt
            cuts = np.round(np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            for e, chunk in enumerate(np.split(idx, cuts)):
                parts[e].append(chunk)
        merged = [np.concatenate(p) for p in parts]
        if min(len(m) for m in merged) >= cfg.min_per_edge:
            return merged, attempt
    raise UsageError(f"--min-per-edge {cfg.min_per_edge}: no Dirichlet draw with --alpha {cfg.alpha} "
                     f"gave every one of the {n} edges that many samples in {MAX_TRIES} tries "
                     f"(raise --alpha, lower --min-per-edge or use fewer --edges)")


def _shards(pool: np.ndarray, labels: np.ndarray, cfg: PartitionConfig,
            rng: np.random.Generator) -> list[np.ndarray]:
    n, k = cfg.edges, cfg.shards_per_edge
    classes = np.unique(labels[pool])
    if k > len(classes):
        raise UsageError(f"--shards-per-edge {k} exceeds the {len(classes)} classes in the data")
    if (n * k) % len(classes):
        raise UsageError(f"--shards-per-edge {k}: --edges {n} x {k} = {n * k} shards is not divisible "
                         f"by the {len(classes)} classes (each shard holds one class)")
    per_class = n * k // len(classes)
    # Deal each class's shards to per_class distinct edges, always among the edges with the
    # most free slots (random tie-break). This greedy (Gale-Ryser) construction never gets
    # stuck, so every edge ends with exactly K shards of K distinct classes.
    free = np.full(n, k)
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for c in rng.permutation(classes):
        idx = rng.permutation(pool[labels[pool] == c])
        if len(idx) < per_class:
            raise UsageError(f"--shards-per-edge {k}: class {c} has {len(idx)} samples, fewer than its "
                             f"{per_class} shards")
        chosen = np.lexsort((rng.random(n), -free))[:per_class]
        free[chosen] -= 1
        for e, shard in zip(chosen, np.array_split(idx, per_class), strict=True):
            parts[e].append(shard)
    assert not free.any()
    return [np.concatenate(p) for p in parts]


def local_split(y: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Stratified: per class round(fraction * n_c) test samples, at least one when n_c >= 2."""
    train_idx, test_idx = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = 0
        if fraction > 0 and len(idx) >= 2:
            n_test = min(max(int(round(fraction * len(idx))), 1), len(idx) - 1)
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    return np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(test_idx))


def apply_domain(x: np.ndarray, domain: str, rng: np.random.Generator) -> np.ndarray:
    if domain == "original":
        return x
    if domain.startswith("rotate"):
        from PIL import Image

        angle = float(domain[len("rotate"):])
        fill = 0 if x.ndim == 3 else (0, 0, 0)
        out = np.empty_like(x)
        for i, img in enumerate(x):
            out[i] = np.asarray(Image.fromarray(img).rotate(angle, resample=Image.BILINEAR, fillcolor=fill))
        return out
    if domain == "invert":
        return 255 - x
    if domain.startswith("dim-"):
        return np.round(x.astype(np.float32) * float(domain[4:])).astype(np.uint8)
    if domain.startswith("noise-"):
        noisy = x.astype(np.float32) + rng.normal(0.0, float(domain[6:]), x.shape).astype(np.float32)
        return np.clip(np.round(noisy), 0, 255).astype(np.uint8)
    raise ValueError(f"unknown domain {domain!r}")


def arrays_sha256(x: np.ndarray, y: np.ndarray) -> str:
    """sha256 of x's bytes (uint8, C order) followed by y as little-endian int64."""
    digest = hashlib.sha256(np.ascontiguousarray(x).tobytes())
    digest.update(np.ascontiguousarray(y, dtype="<i8").tobytes())
    return digest.hexdigest()


def build_digits(cfg: PartitionConfig) -> tuple[list[EdgeShare], GlobalTest, dict]:
    """One digit domain per edge (the ``digits`` scheme); nothing is written."""
    n_train = cfg.limit or 1000
    built = build_domains(Path(cfg.source), cfg.domains, n_train, cfg.domain_test, cfg.seed)
    width = max(2, len(str(cfg.edges - 1)))
    shares = [EdgeShare(f"edge_{e:0{width}d}", xtr, ytr, xte, yte, domain)
              for e, (domain, xtr, ytr, xte, yte) in enumerate(built)]
    names = [str(c) for c in range(10)]
    gt = GlobalTest(np.zeros((0, 28, 28, 3), np.uint8), np.zeros(0, np.int64))
    histogram = [{"edge": share.name, "domain": share.domain, "n_train": len(share.train_y),
                  "n_test": len(share.test_y),
                  "train_per_class": np.bincount(share.train_y, minlength=10).tolist(),
                  "test_per_class": np.bincount(share.test_y, minlength=10).tolist(),
                  "train_sha256": arrays_sha256(share.train_x, share.train_y)}
                 for share in shares]
    manifest = {
        "tool": "fl-partition", "fedattn_version": _fedattn_version(),
        "source": {"path": str(cfg.source), "kind": "digit domains", "limit": cfg.limit},
        "scheme": "digits", "domains": list(cfg.domains),
        "stand_ins": {d: f"{STAND_INS[d]}-style stand-in (see fedattn_shared.data.digits)"
                      for d in cfg.domains if d in STAND_INS},
        "seed": cfg.seed, "edges": cfg.edges, "format": cfg.format,
        "test_fraction": None, "domain_test": cfg.domain_test, "image_shape": [28, 28, 3],
        "num_classes": 10, "class_names": names,
        "global_test": {"size": 0, "per_class": [0] * 10, "from_test_split": 0,
                        "held_out_from_train": 0, "holdout_seed": GLOBAL_TEST_SEED},
        "train_sha256_of": "sha256(x bytes, uint8 C order || y as little-endian int64)",
        "histogram": histogram,
    }
    return shares, gt, manifest


def build(cfg: PartitionConfig) -> tuple[list[EdgeShare], GlobalTest, dict]:
    """Load, hold out the global test set and partition; nothing is written."""
    validate(cfg)
    if cfg.scheme == "digits":
        return build_digits(cfg)
    data = load_source(cfg.source, cfg.limit, Columns(cfg.image_column, cfg.label_column))
    if len(data.train_y) == 0:
        raise SourceError(f"{data.path}: no training samples")
    if data.has_test and data.test_x.shape[1:] != data.train_x.shape[1:]:
        raise SourceError(f"{data.path}: test images are {data.test_x.shape[1:]}, train images "
                          f"{data.train_x.shape[1:]}")
    names = resolve_class_names(cfg, data)
    gt = select_global_test(data, cfg.global_test_per_class, len(names))

    keep = np.ones(len(data.train_y), bool)
    keep[gt.holdout] = False
    duplicates = 0
    if len(gt.y):
        global_keys = set(_image_keys(gt.x))
        remaining = np.flatnonzero(keep)
        dup = [i for i, key in zip(remaining, _image_keys(data.train_x[remaining]), strict=True)
               if key in global_keys]
        keep[dup] = False
        duplicates = len(dup)
    pool = np.flatnonzero(keep)
    if len(pool) < cfg.edges:
        raise UsageError(f"--edges {cfg.edges}: only {len(pool)} training samples are left to partition")

    rng = np.random.default_rng(cfg.seed)
    tries = 1
    if cfg.scheme in ("iid", "domains"):
        parts = _iid(pool, cfg.edges, rng)
    elif cfg.scheme == "dirichlet":
        parts, tries = _dirichlet(pool, data.train_y, cfg, rng)
    else:
        parts = _shards(pool, data.train_y, cfg, rng)

    width = max(2, len(str(cfg.edges - 1)))
    shares = []
    for e, part in enumerate(parts):
        idx = np.sort(part)
        x, y = data.train_x[idx], data.train_y[idx]
        domain = None
        if cfg.scheme == "domains":
            domain = DOMAINS[e % len(DOMAINS)]
            x = apply_domain(x, domain, np.random.default_rng([cfg.seed, e, 2]))
        tr, te = local_split(y, cfg.test_fraction, np.random.default_rng([cfg.seed, e, 1]))
        shares.append(EdgeShare(f"edge_{e:0{width}d}", x[tr], y[tr], x[te], y[te], domain))

    histogram = []
    for share in shares:
        row = {"edge": share.name, "n_train": len(share.train_y), "n_test": len(share.test_y),
               "train_per_class": np.bincount(share.train_y, minlength=len(names)).tolist(),
               "test_per_class": np.bincount(share.test_y, minlength=len(names)).tolist(),
               "train_sha256": arrays_sha256(share.train_x, share.train_y)}
        if share.domain is not None:
            row["domain"] = share.domain
        histogram.append(row)
    manifest = {
        "tool": "fl-partition",
        "fedattn_version": _fedattn_version(),
        "source": {"path": data.path, "kind": data.kind, "n_train": len(data.train_y),
                   "n_test": len(data.test_y) if data.has_test else 0, "limit": cfg.limit},
        "scheme": cfg.scheme,
        "alpha": cfg.alpha if cfg.scheme == "dirichlet" else None,
        "min_per_edge": cfg.min_per_edge if cfg.scheme == "dirichlet" else None,
        "dirichlet_cap": cfg.dirichlet_cap if cfg.scheme == "dirichlet" else None,
        "dirichlet_tries": tries if cfg.scheme == "dirichlet" else None,
        "shards_per_edge": cfg.shards_per_edge if cfg.scheme == "shards" else None,
        "domains": list(DOMAINS) if cfg.scheme == "domains" else None,
        "seed": cfg.seed,
        "edges": cfg.edges,
        "format": cfg.format,
        "test_fraction": cfg.test_fraction,
        "image_shape": list(data.train_x.shape[1:]),
        "num_classes": len(names),
        "class_names": names,
        "global_test": {"size": len(gt.y), "per_class_requested": cfg.global_test_per_class,
                        "per_class": np.bincount(gt.y, minlength=len(names)).tolist(),
                        "from_test_split": gt.from_test, "held_out_from_train": gt.from_train,
                        "holdout_seed": GLOBAL_TEST_SEED, "transformed": False,
                        "train_duplicates_removed": duplicates,
                        "sha256": arrays_sha256(gt.x, gt.y)},
        "partitioned_train_samples": int(len(pool)),
        "train_sha256_of": "sha256(x bytes, uint8 C order || y as little-endian int64)",
        "histogram": histogram,
    }
    return shares, gt, manifest


def _write_pngs(root: Path, x: np.ndarray, y: np.ndarray, names: list[str]) -> None:
    from PIL import Image

    width = max(5, len(str(len(y) - 1)))
    for name in sorted({names[c] for c in y.tolist()}):
        (root / name).mkdir(parents=True, exist_ok=True)
    for k, (img, label) in enumerate(zip(x, y.tolist(), strict=True)):
        Image.fromarray(img).save(root / names[label] / f"{k:0{width}d}.png", format="PNG")


def _write_split(edge_dir: Path, split: str, x: np.ndarray, y: np.ndarray, fmt: str,
                 names: list[str]) -> None:
    if fmt == "npz":
        # np.savez stores zip entries with a fixed 1980-01-01 date: same arrays, same bytes.
        np.savez(edge_dir / f"{split}.npz", x=x, y=y.astype(np.int64))
    elif fmt == "parquet":  # global_test/ holds its file: a folder of any format is one
        path = edge_dir / f"{split}.parquet"
        if split == "global_test":
            (edge_dir / split).mkdir()
            path = edge_dir / split / "data.parquet"
        write_parquet(path, x, y)
    else:
        _write_pngs(edge_dir / split, x, y, names)


def write(cfg: PartitionConfig, shares: list[EdgeShare], gt: GlobalTest, manifest: dict) -> None:
    out = Path(cfg.out)
    if out.is_dir() and cfg.force:
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink() and _EDGE_DIR.fullmatch(child.name):
                shutil.rmtree(child)
        (out / "partition.json").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    names = manifest["class_names"]
    for share in shares:
        edge_dir = out / share.name
        edge_dir.mkdir()
        _write_split(edge_dir, "train", share.train_x, share.train_y, cfg.format, names)
        if cfg.test_fraction > 0 or cfg.scheme == "digits":
            _write_split(edge_dir, "test", share.test_x, share.test_y, cfg.format, names)
        if len(gt.y):
            _write_split(edge_dir, "global_test", gt.x, gt.y, cfg.format, names)
    (out / "partition.json").write_text(json.dumps(manifest, indent=2) + "\n")


def format_table(manifest: dict) -> str:
    num_classes = manifest["num_classes"]
    has_domain = manifest["scheme"] in ("domains", "digits")
    head = ["edge"] + (["domain"] if has_domain else []) + ["n_train", "n_test"]
    head += [str(c) for c in range(num_classes)]
    rows = [head]
    for row in manifest["histogram"]:
        rows.append([row["edge"]] + ([row["domain"]] if has_domain else [])
                    + [str(row["n_train"]), str(row["n_test"])] + [str(v) for v in row["train_per_class"]])
    gt = manifest["global_test"]
    rows.append(["global_test"] + (["(none)"] if has_domain else []) + [str(gt["size"]), "-"]
                + [str(v) for v in gt["per_class"]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i < len(head) - num_classes else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    names = manifest["class_names"]
    legend = [f"per-class columns: train counts (global_test row: its counts); {manifest['edges']} edges, "
              f"scheme {manifest['scheme']}, seed {manifest['seed']}"]
    if names != [str(i) for i in range(num_classes)]:
        legend.append("classes: " + ", ".join(f"{i}={n}" for i, n in enumerate(names)))
    legend.append(f"global_test: {gt['size']} images ({gt['from_test_split']} from the source's test split, "
                  f"{gt['held_out_from_train']} held out from train with seed {gt['holdout_seed']}), "
                  f"the same file in every edge folder, never transformed")
    return "\n".join(lines + legend)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fl-partition",
        description="Cut one dataset into N edge data folders (IID, Dirichlet label skew, label shards "
                    "or feature-shift domains), each with the same balanced global test set.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
global test set:
  global_test.npz (or global_test/<class>/ with --format folders) is the SAME file in
  every edge folder, balanced at M = --global-test-per-class images per class, and is
  excluded from the partitioned training data (as is any training image equal to one
  of its images). If the source has a test split, the first up-to-M images of each class
  come from it and a class the test split has fewer than M of is topped up by a
  seed-0 hold-out from the training set (independent of --seed); without a test split,
  M per class are held out from the training set (seed 0). For the CIFAR-10 copy with
  the first 1,000 official test images, M >= 112 keeps all of them. M = 0: none.

domains (--scheme domains), cycled over edges (edge i gets number i mod 6):
  0 original, 1 rotate +15 deg, 2 rotate +30 deg, 3 invert (255 - x), 4 dim (x * 0.5),
  5 gaussian noise (sigma 32). Applied to the edge's train and test images; the global
  test set is NOT transformed.

digits (--scheme digits): --source is a data root with mnist/, usps/ and cifar-10/;
  one edge per --domains entry (mnist, usps, mnistm-style,
  synthdigits-style; the -style ones are stand-ins built the way MNIST-M and SynthDigits
  were made), --limit training images (default 1000) and --domain-test test images per
  domain, all 28x28 RGB; no global test set.

output: OUT/edge_00, edge_01, ... each with train.npz, test.npz, global_test.npz
  (or train/<class>/NNNNN.png, test/..., global_test/... with --format folders), plus
  OUT/partition.json (settings, per-edge class histogram, sha256 of each edge's train
  arrays). The same arguments give byte-identical output.""")
    parser.add_argument("--source", required=True, metavar="DIR",
                        help="dataset directory (npz, MNIST-style IDX, CIFAR-10 binary, a "
                             "datasets folder, Parquet or CSV), or 'sklearn-digits'")
    parser.add_argument("--image-column", default="image", metavar="NAME",
                        help="a table source's image column (default image; a CSV's may be path)")
    parser.add_argument("--label-column", default="label", metavar="NAME",
                        help="a table source's label column (default label)")
    parser.add_argument("--edges", type=int, required=True, metavar="N", help="number of edge folders")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="partition seed (default 0)")
    parser.add_argument("--scheme", choices=SCHEMES, default="iid", help="partition scheme (default iid)")
    parser.add_argument("--alpha", type=float, default=0.5,
                        help="Dirichlet concentration, > 0; smaller is more skewed (default 0.5)")
    parser.add_argument("--min-per-edge", type=int, default=10, metavar="N",
                        help="dirichlet: redraw until every edge has at least N samples, at most "
                             f"{MAX_TRIES} tries (default 10)")
    parser.add_argument("--dirichlet-cap", action="store_true",
                        help="dirichlet: NIID-Bench's size cap, an edge already holding at least "
                             "1/N of the samples gets none of the classes still to deal")
    parser.add_argument("--shards-per-edge", type=int, default=2, metavar="K",
                        help="shards: classes (one shard each) per edge; edges*K must be a multiple of "
                             "the number of classes (default 2)")
    parser.add_argument("--format", choices=FORMATS, default="npz",
                        help="npz arrays, PNG class folders, or Parquet files of PNG bytes "
                             "and labels (pyarrow; default npz)")
    parser.add_argument("--test-fraction", type=float, default=0.2,
                        help="per-edge stratified local test split, in [0, 1); 0 writes no test split "
                             "(default 0.2)")
    parser.add_argument("--global-test-per-class", type=int, default=100, metavar="M",
                        help="images per class in the shared global test set (default 100; see below)")
    parser.add_argument("--limit", type=int, metavar="N",
                        help="use only the first N training samples (small demos); digits: "
                             "training images per domain (default 1000)")
    parser.add_argument("--class-names", metavar="LIST",
                        help="comma-separated class names for folder names and partition.json, or "
                             "'source' for the dataset's own (CIFAR-10); default: class indices")
    parser.add_argument("--domains", default=",".join(DIGIT_DOMAINS), metavar="LIST",
                        help="digits: comma-separated domains, one per edge (default "
                             f"{','.join(DIGIT_DOMAINS)})")
    parser.add_argument("--domain-test", type=int, default=500, metavar="N",
                        help="digits: test images per domain (default 500)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty --out, replacing its edge_* folders and "
                             "partition.json (other files are left alone)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, or an argparse error (exit 2, message on stderr)
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
    cfg = PartitionConfig(
        source=args.source, out=args.out, edges=args.edges, seed=args.seed, scheme=args.scheme,
        alpha=args.alpha, shards_per_edge=args.shards_per_edge, format=args.format,
        test_fraction=args.test_fraction, global_test_per_class=args.global_test_per_class,
        limit=args.limit, min_per_edge=args.min_per_edge,
        dirichlet_cap=args.dirichlet_cap, class_names=args.class_names, force=args.force,
        image_column=args.image_column, label_column=args.label_column,
        domains=[d.strip() for d in args.domains.split(",") if d.strip()], domain_test=args.domain_test)
    try:
        shares, gt, manifest = build(cfg)
        write(cfg, shares, gt, manifest)
    except (UsageError, SourceError) as err:
        prefix = "--source: " if isinstance(err, SourceError) else ""
        print(f"fl-partition: error: {prefix}{err}", file=sys.stderr)
        return 2
    print(format_table(manifest))
    print(f"wrote {len(shares)} edge folders and partition.json to {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

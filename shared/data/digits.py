"""The digits feature-shift setting of FedBN / pFedLA: one digit domain per edge, 28x28 RGB.

Domains (``fl-partition --scheme digits --domains ...``), built from a data root laid out
with ``mnist/``, ``usps/`` and ``cifar-10/`` folders:

* ``mnist``: real MNIST (IDX), grey replicated to RGB;
* ``usps``: real USPS, the official LIBSVM test file ``usps/usps.t.bz2`` (2,007 images;
  the official training file is not available), 16x16 resized to 28x28, split into
  disjoint train and test draws;
* ``mnistm-style``: a stand-in for MNIST-M, made as MNIST-M was (Ganin & Lempitsky 2015:
  MNIST digits blended over random colour-photo patches; BSDS500 is not here): a random
  28x28 crop of a CIFAR-10 image, out = |patch - digit| per channel. MNIST digits disjoint
  from the ``mnist`` domain's; patches from CIFAR-10 batches 1-4 for train, 5 for test;
* ``synthdigits-style``: a stand-in for SynthDigits (Ganin & Lempitsky: digits rendered
  from fonts with random text, position, orientation, background and stroke colours and
  blur): one to three digits drawn with matplotlib's bundled TrueType fonts (DejaVu,
  STIX, Computer Modern: present wherever matplotlib is), the label the centre one, random
  colours with a minimum contrast, random size, offset, rotation and Gaussian blur.

SVHN and the original SynthDigits / MNIST-M are not available on these machines. Every
draw is seeded by (seed, domain), so the same arguments give the same arrays.
"""

from __future__ import annotations

import bz2
from pathlib import Path

import numpy as np

from .sources import SourceError, load_source

DIGIT_DOMAINS = ("mnist", "usps", "mnistm-style", "synthdigits-style")
STAND_INS = {"mnistm-style": "MNIST-M", "synthdigits-style": "SynthDigits"}
SIZE = 28
_FONT_FILES = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf",
               "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf",
               "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "STIXGeneral.ttf",
               "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "cmr10.ttf", "cmss10.ttf",
               "cmtt10.ttf")


def _rgb(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[..., None], 3, axis=-1)


def _resize(x: np.ndarray, size: int = SIZE) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(img).resize((size, size), Image.BILINEAR))
                     for img in x])


def load_usps(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The LIBSVM-format USPS file: ``label 1:v ... 256:v``, values in [-1, 1], labels 1-10."""
    try:
        lines = bz2.open(path, "rt").read().splitlines()
    except OSError as err:
        raise SourceError(f"{path}: cannot read USPS ({err})") from None
    x = np.zeros((len(lines), 256), np.float32)
    y = np.zeros(len(lines), np.int64)
    for i, line in enumerate(lines):
        fields = line.split()
        y[i] = int(float(fields[0])) - 1
        for item in fields[1:]:
            index, value = item.split(":")
            x[i, int(index) - 1] = float(value)
    if len(y) == 0 or y.min() < 0 or y.max() > 9:
        raise SourceError(f"{path}: not a USPS LIBSVM file")
    images = np.round((x.reshape(-1, 16, 16) + 1) * 127.5).clip(0, 255).astype(np.uint8)
    return images, y


def _take(n: int, pool: int, rng: np.random.Generator, what: str) -> np.ndarray:
    if n > pool:
        raise SourceError(f"{what}: {n} images requested, {pool} available")
    return rng.permutation(pool)[:n]


def mnistm_style(digits: np.ndarray, photos: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """|patch - digit| per channel, each digit over a random 28x28 crop of a random photo."""
    out = np.empty((len(digits), SIZE, SIZE, 3), np.uint8)
    h, w = photos.shape[1:3]
    for i, digit in enumerate(digits):
        photo = photos[rng.integers(len(photos))]
        top, left = rng.integers(h - SIZE + 1), rng.integers(w - SIZE + 1)
        patch = photo[top:top + SIZE, left:left + SIZE].astype(np.int16)
        out[i] = np.abs(patch - digit[..., None].astype(np.int16)).astype(np.uint8)
    return out


def _fonts() -> list[Path]:
    import matplotlib

    root = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    fonts = [root / name for name in _FONT_FILES if (root / name).exists()]
    if not fonts:
        raise SourceError(f"{root}: no TrueType fonts to render synthetic digits")
    return fonts


def synthdigits_style(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One rendered digit string per label (the label is the centre digit)."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    fonts = _fonts()
    out = np.empty((len(labels), SIZE, SIZE, 3), np.uint8)
    canvas = 3 * SIZE
    for i, label in enumerate(labels):
        background = rng.integers(0, 256, 3)
        stroke = rng.integers(0, 256, 3)
        while np.abs(stroke.astype(int) - background.astype(int)).sum() < 200:
            stroke = rng.integers(0, 256, 3)
        font = ImageFont.truetype(str(fonts[rng.integers(len(fonts))]), int(rng.integers(18, 27)))
        flank = int(rng.integers(0, 3))  # 0, 1 or 2 neighbours, as in multi-digit numbers
        text = str(label)
        if flank >= 1:
            text = str(rng.integers(10)) + text
        if flank == 2:
            text += str(rng.integers(10))
        image = Image.new("RGB", (canvas, canvas), tuple(int(c) for c in background))
        draw = ImageDraw.Draw(image)
        # Centre the label digit itself, whatever its neighbours.
        prefix = text[: text.index(str(label))] if flank >= 1 else ""
        left = draw.textlength(prefix, font=font)
        box = draw.textbbox((0, 0), str(label), font=font)
        x = canvas / 2 - left - (box[0] + box[2]) / 2 + rng.uniform(-2.5, 2.5)
        y = canvas / 2 - (box[1] + box[3]) / 2 + rng.uniform(-2.5, 2.5)
        draw.text((x, y), text, font=font, fill=tuple(int(c) for c in stroke))
        image = image.rotate(float(rng.uniform(-15, 15)), resample=Image.BILINEAR)
        image = image.crop((SIZE, SIZE, 2 * SIZE, 2 * SIZE))
        image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.0, 1.2))))
        out[i] = np.asarray(image)
    return out


def build_domains(root: Path, domains: list[str], n_train: int, n_test: int,
                  seed: int) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(domain, train x, train y, test x, test y) per domain, x uint8 (N, 28, 28, 3)."""
    unknown = [d for d in domains if d not in DIGIT_DOMAINS]
    if unknown:
        raise SourceError(f"unknown digit domain(s) {', '.join(unknown)} "
                          f"(known: {', '.join(DIGIT_DOMAINS)})")
    mnist = load_source(root / "mnist") if {"mnist", "mnistm-style"} & set(domains) else None
    if mnist is not None and not mnist.has_test:
        raise SourceError(f"{root / 'mnist'}: needs the t10k test files")
    # MNIST digits are split once, so the mnist and mnistm-style domains never share one.
    digit_rng = np.random.default_rng([seed, 0])
    train_order = digit_rng.permutation(len(mnist.train_y)) if mnist is not None else None
    test_order = digit_rng.permutation(len(mnist.test_y)) if mnist is not None else None
    out = []
    for domain in domains:
        rng = np.random.default_rng([seed, 1 + DIGIT_DOMAINS.index(domain)])
        if domain in ("mnist", "mnistm-style"):
            half = 0 if domain == "mnist" else 1
            tr = train_order[half::2][:n_train]
            te = test_order[half::2][:n_test]
            if len(tr) < n_train or len(te) < n_test:
                raise SourceError(f"{root / 'mnist'}: not enough images for {domain}")
            xtr, ytr = mnist.train_x[tr], mnist.train_y[tr]
            xte, yte = mnist.test_x[te], mnist.test_y[te]
            if domain == "mnist":
                xtr, xte = _rgb(xtr), _rgb(xte)
            else:
                cifar = root / "cifar-10" / "cifar-10-batches-bin"
                photos_train = load_source(cifar).train_x  # batches 1-5, 10,000 each
                xtr = mnistm_style(xtr, photos_train[:40_000], rng)
                xte = mnistm_style(xte, photos_train[40_000:], rng)
        elif domain == "usps":
            x, y = load_usps(root / "usps" / "usps.t.bz2")
            order = _take(n_train + n_test, len(y), rng, f"{root / 'usps'} (train + test)")
            x = _rgb(_resize(x))
            xtr, ytr = x[order[:n_train]], y[order[:n_train]]
            xte, yte = x[order[n_train:]], y[order[n_train:]]
        else:
            ytr = rng.integers(0, 10, n_train)
            yte = rng.integers(0, 10, n_test)
            xtr, xte = synthdigits_style(ytr, rng), synthdigits_style(yte, rng)
        out.append((domain, xtr, ytr.astype(np.int64), xte, yte.astype(np.int64)))
    return out

"""Training-time data augmentation and input resizing, on batched tensors on the edge.

Why batched tensor ops and not per-sample PIL transforms: an edge's data is already a
normalised tensor (``Split``), the DataLoader has no workers (gRPC is not fork-safe), and a
batch on the device is augmented in a few kernels. Every random choice is drawn from a CPU
``torch.Generator`` passed in by the caller (a few scalars per sample), then applied on
the batch's device: the same generator state gives the same augmented batch on any device,
and augmentation never touches the global RNG. The trainer derives that generator from
``loader_seed(seed, round, edge_id)``, so each edge and round draws its own stream.

Recipes (``train.augment``):

* ``none``: inputs as they are.
* ``crop-flip``: the CIFAR recipe of He et al. (https://arxiv.org/abs/1512.03385): pad 4
  pixels of zeros (the normalised zero) on every side, crop back to the original size at a
  uniform random offset, flip horizontally with probability 1/2.
* ``crop-flip-reflect``: the same with the padding mirrored from the image's border (no
  new pixel values), as NIID-Bench's CIFAR-10 pipeline pads
  (https://github.com/Xtra-Computing/NIID-Bench, ``utils.get_dataloader``).
* ``resized-crop``: Inception-style random-resized crop (https://arxiv.org/abs/1409.4842,
  as torchvision's ``RandomResizedCrop``: area in [0.08, 1] of the image, aspect ratio in
  [3/4, 4/3], up to 10 tries then a centre crop), resized to the model's input size, plus
  a horizontal flip with probability 1/2.

Augmentation is for training batches only; ``InputPipeline.eval_batch`` never augments.

Input range (``train.input_range``): the readers give uint8 images as floats in [-1, 1]
(``(v / 255 - 0.5) / 0.5``, ``symmetric``, the default). ``unit`` maps every batch the
model sees, training and evaluation alike, to [0, 1] (``v / 255``, torchvision's
``ToTensor`` without ``Normalize``), the range NIID-Bench and its reproductions train in: a
small CNN's optimisation depends on it, so a published table is matched in its own range.
``imagenet`` standardises each RGB channel by ImageNet's mean and std (torchvision's and
timm's pretrained weights expect it: ``Normalize(IMAGENET_MEAN, IMAGENET_STD)`` after
``ToTensor``). The map is the pipeline's last step (after augmentation and resize), so zero
padding is the grey 0.5 of the unit range in every range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

Augment = Literal["none", "crop-flip", "crop-flip-reflect", "resized-crop"]
AUGMENTS: tuple[str, ...] = get_args(Augment)
InputRange = Literal["symmetric", "unit", "imagenet"]
INPUT_RANGES: tuple[str, ...] = get_args(InputRange)
CROP_PADDING = 4
#: torchvision's ImageNet statistics (``torchvision.transforms._presets``, timm's
#: ``IMAGENET_DEFAULT_MEAN`` / ``_STD``), for ``input_range = "imagenet"``.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RESIZED_CROP_SCALE = (0.08, 1.0)
RESIZED_CROP_RATIO = (3 / 4, 4 / 3)


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, C, size, size), bilinear with antialiasing (so downsizing does
    not alias); unchanged when ``size`` is 0 or already the batch's size."""
    if size <= 0 or tuple(x.shape[-2:]) == (size, size):
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


def horizontal_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Flip each sample left-right with probability 1/2."""
    flip = torch.rand(x.shape[0], generator=generator) < 0.5
    return torch.where(flip.to(x.device).view(-1, 1, 1, 1), x.flip(-1), x)


def random_crop(x: torch.Tensor, padding: int, generator: torch.Generator,
                mode: str = "constant") -> torch.Tensor:
    """Pad ``padding`` pixels on every side (``constant``: zeros; ``reflect``: mirrored
    from the border, as ``F.pad`` reflects), then crop each sample back to H x W at its own
    uniform offset in [0, 2 * padding] (both axes). Pixels only move or become 0 (constant)
    or copies of border pixels (reflect)."""
    n, _, h, w = x.shape
    if padding <= 0 or n == 0:
        return x
    padded = F.pad(x, (padding, padding, padding, padding), mode=mode)
    top = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
    left = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
    rows = (top[:, None] + torch.arange(h, device=x.device))[:, :, None]      # (N, H, 1)
    cols = (left[:, None] + torch.arange(w, device=x.device))[:, None, :]     # (N, 1, W)
    batch = torch.arange(n, device=x.device)[:, None, None]
    # Advanced indexing on dims 0, 2, 3 puts them first: (N, H, W, C).
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2).contiguous()


def resized_crop_boxes(n: int, height: int, width: int,
                       generator: torch.Generator) -> list[tuple[int, int, int, int]]:
    """(top, left, h, w) per sample, as torchvision's ``RandomResizedCrop.get_params``
    draws them, but from ``generator``."""
    area = height * width
    log_ratio = (math.log(RESIZED_CROP_RATIO[0]), math.log(RESIZED_CROP_RATIO[1]))
    boxes = []
    for _ in range(n):
        for _ in range(10):
            target = area * float(torch.empty(1).uniform_(*RESIZED_CROP_SCALE, generator=generator))
            ratio = math.exp(float(torch.empty(1).uniform_(*log_ratio, generator=generator)))
            w = int(round(math.sqrt(target * ratio)))
            h = int(round(math.sqrt(target / ratio)))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
                left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
                boxes.append((top, left, h, w))
                break
        else:  # centre crop at the nearest allowed aspect ratio
            ratio = width / height
            if ratio < RESIZED_CROP_RATIO[0]:
                w, h = width, int(round(width / RESIZED_CROP_RATIO[0]))
            elif ratio > RESIZED_CROP_RATIO[1]:
                h, w = height, int(round(height * RESIZED_CROP_RATIO[1]))
            else:
                h, w = height, width
            boxes.append(((height - h) // 2, (width - w) // 2, h, w))
    return boxes


def random_resized_crop(x: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """A random box per sample (``resized_crop_boxes``) resized to ``size`` x ``size``
    (0: the batch's own size), bilinear with antialiasing."""
    n, _, height, width = x.shape
    size = size or height
    if n == 0:
        return resize(x, size)
    boxes = resized_crop_boxes(n, height, width, generator)
    return torch.cat([resize(x[i : i + 1, :, top : top + h, left : left + w], size)
                      for i, (top, left, h, w) in enumerate(boxes)])


def augment_batch(x: torch.Tensor, augment: str, generator: torch.Generator, size: int = 0) -> torch.Tensor:
    """One training batch through the named recipe. ``size`` is the model's input size
    (``resized-crop`` produces it directly; other recipes keep the stored size)."""
    if augment == "none":
        return x
    if augment == "crop-flip":
        return horizontal_flip(random_crop(x, CROP_PADDING, generator), generator)
    if augment == "crop-flip-reflect":
        return horizontal_flip(random_crop(x, CROP_PADDING, generator, "reflect"), generator)
    if augment == "resized-crop":
        return horizontal_flip(random_resized_crop(x, size, generator), generator)
    raise ValueError(f"unknown augmentation {augment!r} (known: {', '.join(AUGMENTS)})")


@dataclass(frozen=True)
class InputPipeline:
    """What the model sees of a batch: on training batches the run's augmentation then
    the resize to ``input_size``; on everything else (evaluation, statistics passes,
    prediction) the resize alone; then, on both, the map to ``input_range``.
    ``input_size`` 0 keeps the data's stored size."""

    augment: str = "none"
    input_size: int = 0
    input_range: str = "symmetric"

    @classmethod
    def of(cls, train) -> InputPipeline:
        """The run's pipeline from its ``TrainConfig`` (augment, input_size, input_range):
        every place a model sees data builds it here, so no path misses a step."""
        return cls(train.augment, train.input_size, train.input_range)

    def train_batch(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return to_range(resize(augment_batch(x, self.augment, generator, self.input_size),
                               self.input_size), self.input_range)

    def eval_batch(self, x: torch.Tensor) -> torch.Tensor:
        return to_range(resize(x, self.input_size), self.input_range)

    @property
    def identity(self) -> bool:
        return self.augment == "none" and self.input_size == 0 and self.input_range == "symmetric"


def to_range(x: torch.Tensor, input_range: str) -> torch.Tensor:
    """A batch of [-1, 1] images in ``input_range``: unchanged for ``symmetric``, ``x / 2 +
    0.5`` (so ``v / 255`` up to float rounding) for ``unit``, and that standardised per
    channel by ``IMAGENET_MEAN`` / ``IMAGENET_STD`` for ``imagenet`` (3 channels)."""
    if input_range == "symmetric":
        return x
    if input_range == "unit":
        return x * 0.5 + 0.5
    if input_range == "imagenet":
        if x.shape[1] != 3:
            raise ValueError(f"input range imagenet needs 3 channels, got {x.shape[1]}")
        mean = torch.tensor(IMAGENET_MEAN, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        return (x * 0.5 + 0.5 - mean) / std
    raise ValueError(f"unknown input range {input_range!r} (known: {', '.join(INPUT_RANGES)})")

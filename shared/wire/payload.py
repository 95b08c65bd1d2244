"""A received payload's shape on the wire side of the data model (``schema.py``): the
error every malformed payload raises, a section's validated layout, the lazy views a
decoded section's tensors are, and the checks a whole payload takes. Nothing here knows
how a payload is serialized (``serialize``) or cut into frames (``transport``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from ..schema import Payload


class WireError(ValueError):
    """A payload or message that does not match what was declared or expected."""


@dataclass(frozen=True)
class SectionLayout:
    """A section's tensors as its manifest declares them, validated: names unique, dtypes
    known, shapes of at most MAX_TENSOR_DIMS non-negative dimensions."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]  # elements per tensor
    nbytes: int

    @property
    def single_dtype(self) -> torch.dtype | None:
        """The dtype of every tensor, when they share one that can be viewed in place
        (bool travels as bytes and is converted)."""
        if self.dtypes and self.dtypes[0] != torch.bool and len(set(self.dtypes)) == 1:
            return self.dtypes[0]
        return None


class TensorViews(Mapping[str, torch.Tensor]):
    """A decoded section's tensors: views of its flat vector, made on first use. A model's
    hundreds of views cost ~1 ms of Python per payload, and a server that sums whole
    sections, or an edge that loads them whole, never needs them. Names (iteration,
    ``len``) come from the layout without making any."""

    __slots__ = ("flat", "layout", "_views")

    def __init__(self, flat: torch.Tensor, layout: SectionLayout):
        self.flat = flat
        self.layout = layout
        self._views: dict[str, torch.Tensor] | None = None

    def _made(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            # One split, not a slice per tensor (~10 us of Python each).
            self._views = {
                name: piece.view(shape) for name, shape, piece in zip(
                    self.layout.names, self.layout.shapes,
                    self.flat.split_with_sizes(self.layout.counts), strict=True)}
        return self._views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._made()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.names)

    def __contains__(self, name: object) -> bool:
        return name in self._made()

    def items(self):
        return self._made().items()

    def values(self):
        return self._made().values()

    def to(self, device: torch.device) -> TensorViews:
        """The same views on ``device``: one copy of the flat vector, not one per tensor."""
        return self if self.flat.device == device else TensorViews(self.flat.to(device),
                                                                    self.layout)

    def __repr__(self) -> str:
        return f"TensorViews({len(self)} tensors, {self.flat.dtype}, {self.flat.numel()} elements)"


def tensor_entries(tensors: Mapping[str, torch.Tensor]
                   ) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    """(name, dtype, shape) of each tensor, in order: for a decoded section, from its
    layout, without making its views."""
    if isinstance(tensors, TensorViews):
        layout = tensors.layout
        return tuple(zip(layout.names, layout.dtypes, layout.shapes, strict=True))
    return tuple((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())


def nonfinite_tensors(payload: Payload) -> list[str]:
    """Names (section/tensor) of floating tensors holding NaN or Inf."""
    bad = []
    for section in payload.sections:
        flat = section.flat
        # NaN and Inf survive a sum, and a sum allocates nothing: a finite section sum
        # proves every element finite. A non-finite sum may still be an overflow of finite
        # values, so only then is each tensor checked element by element.
        if flat is not None and flat.is_floating_point() and bool(torch.isfinite(flat.sum())):
            continue
        for name, tensor in section.tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad.append(f"{section.kind.label}:{section.name}/{name}" if section.name
                           else f"{section.kind.label}/{name}")
    return bad

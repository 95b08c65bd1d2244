"""The codec interface: a float32 vector <-> named tensors of a layout fixed by its length.

Why a fixed layout: the server checks an upload's manifest against the phase's schema
before it allocates or reads a byte of the body. A codec whose encoded size depended on the
values (entropy coding, a variable top-k) would let the sender choose how much the server
holds; here ``layout(n)`` is the exact schema of an encoded vector of ``n`` values, and
``decode`` refuses, naming the part, anything a layout cannot express (an index out of
range or repeated, a scale that is not finite, a decoded value that is not finite).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..wire.payload import WireError

#: An encoded vector: part name -> tensor (e.g. int8's ``q`` and ``scale``).
Parts = Mapping[str, torch.Tensor]
#: The layout of an encoded vector: part name -> (dtype, shape).
Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


class Codec(abc.ABC):
    """One way to encode a float32 vector. Subclasses set ``name`` (the registered name,
    also the bounded value of the Prometheus ``codec`` label) and parse their one optional
    argument (``int8:128`` -> block size 128; ``topk:0.01`` -> the kept fraction) in
    ``__init__``, raising ValueError with the reason."""

    name: ClassVar[str] = ""
    #: A biased codec (top-k) needs error feedback (``+ef``) to converge; the spec parser
    #: warns without it. Quantizers with stochastic rounding are unbiased.
    biased: ClassVar[bool] = False
    #: The width of the integers an integer codec quantizes to (int8: 8): SecAgg+ masks
    #: these in a ring sized for them. None: the codec's output cannot be summed masked.
    integer_bits: ClassVar[int | None] = None

    def __init__(self, arg: str | None = None):
        if arg is not None:
            raise ValueError(f"codec {self.name!r} takes no argument (got {arg!r})")

    @property
    def spec(self) -> str:
        """The canonical spec string (``int8:256``): what the run config carries."""
        return self.name

    @abc.abstractmethod
    def layout(self, n: int) -> Layout:
        """The exact parts of an encoded vector of ``n`` values (dtypes and shapes)."""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Encodes a 1-D float32 CPU tensor. ``generator`` drives any randomness
        (stochastic rounding), so a seeded run is bit-identical."""

    @abc.abstractmethod
    def decode(self, parts: Parts, n: int) -> torch.Tensor:
        """The float32 vector of ``n`` values. ``parts`` match ``layout(n)`` (the caller
        checked names, dtypes and shapes); the values are the peer's and are checked here:
        WireError naming the part for anything no encoder of this codec produces."""

    def encoded_bytes(self, n: int) -> int:
        """Bytes of an encoded vector of ``n`` values (what the wire carries for it)."""
        total = 0
        for dtype, shape in self.layout(n).values():
            count = 1
            for dim in shape:
                count *= dim
            total += count * dtype.itemsize
        return total

    def __repr__(self) -> str:
        return f"<codec {self.spec}>"


@dataclass(frozen=True)
class CodecChoice:
    """A codec as a run uses it: the codec, and whether error feedback carries what it
    dropped into the next round (``+ef``: the residual is private edge state)."""

    codec: Codec
    feedback: bool = False

    @property
    def spec(self) -> str:
        return self.codec.spec + ("+ef" if self.feedback else "")

    @property
    def label(self) -> str:
        """The Prometheus ``codec`` label value: the registered name (bounded), + ``+ef``."""
        return self.codec.name + ("+ef" if self.feedback else "")


def check_layout(codec: Codec, parts: Parts, n: int) -> None:
    """WireError naming the part that is missing, extra, or not of ``codec.layout(n)``'s
    dtype and shape. Every decode starts with it: the caller checks the schema too, but a
    decode that indexes a part must not trust that it did."""
    layout = codec.layout(n)
    for part in parts:
        if part not in layout:
            raise WireError(f"{codec.name} {part}: not a part of this codec")
    for part, (dtype, shape) in layout.items():
        tensor = parts.get(part)
        if tensor is None:
            raise WireError(f"{codec.name} {part}: missing")
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise WireError(f"{codec.name} {part}: {tensor.dtype} {tuple(tensor.shape)}, "
                            f"expected {dtype} {tuple(shape)}")


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """WireError naming ``name`` when ``tensor`` holds NaN or Inf (a sum allocates nothing
    and keeps NaN/Inf: only a non-finite sum is looked at element by element)."""
    if tensor.numel() and not bool(torch.isfinite(tensor.sum(dtype=torch.float64))):
        if not bool(torch.isfinite(tensor).all()):
            raise WireError(f"{name}: non-finite values")

"""The contract's values: what an upload is and what a method declares about it.

Everything here is data -- the payload model (``Kind``, ``Section``, ``Payload``), a
phase's upload schema (``SectionSpec`` of ``TensorSpec``), the per-kind compression rules,
a phase's privacy traits (``PhasePrivacy``) and the phase names -- plus ``UploadContract``,
the few questions the layers below the methods ask of one. The method contract
(``methods/base.py``), the codecs (``compress/``), the privacy layers (``privacy/``), the
wire and both daemons import this module; it imports nothing of theirs, so the arrows run
one way: a codec or a privacy layer takes these values and never the ``Method``.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from .wire import fedattn_pb2 as pb

if TYPE_CHECKING:
    from torch import nn

# ---- phase names -------------------------------------------------------------------------
# Every method has these two. A round runs a method's phases in order; ``train`` and
# ``evaluate`` are handled by the daemons' generic loops, any other phase a method
# declares is its own (its edge half builds the upload, its aggregator takes it).
TRAIN = "train"
EVALUATE = "evaluate"


# ---- the payload model -------------------------------------------------------------------
# A payload is an ordered list of sections; each section has one kind and an ordered set of
# named tensors. Nothing here knows how a payload is serialized (``wire/serialize.py``) or
# cut into frames (``wire/transport.py``).

class Kind(enum.IntEnum):
    SHARED_TENSORS = pb.SHARED_TENSORS
    STAT_VECTORS = pb.STAT_VECTORS
    SCALAR_SUMMARY = pb.SCALAR_SUMMARY
    PROTOTYPES = pb.PROTOTYPES
    CONTROL = pb.CONTROL
    SECAGG = pb.SECAGG

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass
class Section:
    kind: Kind
    name: str = ""
    # A dict, or for a decoded section the lazily made views of ``flat`` (TensorViews).
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # Set by ``decode`` when every tensor of the section has one dtype: a 1-D view of all
    # of them in order, so whole-section checks and sums take one operation, not one per
    # tensor.
    flat: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def raw_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class Payload:
    sections: list[Section] = field(default_factory=list)

    def get(self, kind: Kind, name: str = "") -> Section | None:
        for section in self.sections:
            if section.kind == kind and section.name == name:
                return section
        return None

    def tensors(self, kind: Kind, name: str = "") -> dict[str, torch.Tensor]:
        section = self.get(kind, name)
        return section.tensors if section is not None else {}

    @property
    def raw_bytes(self) -> int:
        return sum(s.raw_bytes for s in self.sections)


# ---- upload schema and compression rules ---------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    is_buffer: bool = False  # float buffers (BN running statistics) are averaged, not stepped
    # An optional tensor may be left out of an upload (FedSTAR's prototypes: one per class
    # the edge has); every tensor that is sent still has to match its spec exactly.
    optional: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class SectionSpec:
    """One upload section: its kind, name and tensors. By default an upload carries exactly
    these tensors; tensors marked ``optional`` may be absent (a per-class subset)."""

    kind: Kind
    name: str
    tensors: dict[str, TensorSpec]

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of the full section (every tensor, optional ones included)."""
        return sum(t.nbytes for t in self.tensors.values())

    @functools.cached_property
    def full_layout(self) -> tuple[tuple[str, ...], tuple[torch.dtype, ...],
                                   tuple[tuple[int, ...], ...]]:
        """Names, dtypes and shapes of an upload carrying every tensor, in order."""
        return (tuple(self.tensors), tuple(t.dtype for t in self.tensors.values()),
                tuple(tuple(t.shape) for t in self.tensors.values()))

    @functools.cached_property
    def required(self) -> frozenset[str]:
        return frozenset(name for name, t in self.tensors.items() if not t.optional)

    def nbytes_of(self, names: Iterable[str]) -> int:
        """Bytes of an upload of this section carrying ``names`` (all in the spec)."""
        if len(self.required) == len(self.tensors):
            return self.nbytes  # every tensor is required, so an accepted upload has them all
        return sum(self.tensors[name].nbytes for name in names)


#: ``MethodSpec.compression``'s rules and the defaults every method starts from: model
#: tensors as deltas, everything else as values, scalars and SecAgg's material exact (a
#: masked vector is integers in a ring: rounding it would break the unmasking).
COMPRESSION_RULES = ("delta", "values", "exact")
COMPRESSION: dict[Kind, str] = {
    Kind.SHARED_TENSORS: "delta", Kind.CONTROL: "values", Kind.PROTOTYPES: "values",
    Kind.STAT_VECTORS: "values", Kind.SCALAR_SUMMARY: "exact", Kind.SECAGG: "exact",
}


# ---- privacy traits ----------------------------------------------------------------------
@dataclass(frozen=True)
class PhasePrivacy:
    """What the privacy layers may do with one phase's uploads, in one declaration.

    ``summable``: sections the server only ever needs as their weighted sum over the
    round's edges, so secure aggregation may mask them (the server unmasks only the sum).
    ``clear``: sections a SecAgg-compatible method sends in the clear on purpose although
    they are not summable (pFedKA's scalars, from which the server computes each edge's
    weight before any tensor is masked); SecAgg refuses any other non-summable section.
    ``dp_public``: (kind, section, tensor) of statistics uploads that only repeat what the
    submission header already carries in the clear (n_k): ``--dp-stats-sigma`` sends
    them as they are."""

    summable: frozenset[tuple[Kind, str]] = frozenset()
    clear: frozenset[tuple[Kind, str]] = frozenset()
    dp_public: frozenset[tuple[Kind, str, str]] = frozenset()


# ---- what the layers below the methods ask of one ----------------------------------------
class UploadContract(Protocol):
    """A method as the codecs and the privacy layers see it: its name and phases, its
    per-kind compression rules, each phase's upload schema and privacy traits.
    ``fedattn_shared.methods.Method`` is one; nothing here imports it."""

    @property
    def name(self) -> str: ...

    @property
    def phases(self) -> tuple[str, ...]: ...

    @property
    def compression(self) -> tuple[tuple[Kind, str], ...]: ...

    def uplink_schema(self, phase: str, models: dict[str, nn.Module]) -> list[SectionSpec]: ...

    def privacy(self, phase: str, models: dict[str, nn.Module]) -> PhasePrivacy: ...

"""A codec applied to one payload section.

A section's floating tensors travel as one vector (in the schema's order, as float32):
one codec call per section, top-k chosen over the whole section, one scale per block
whatever the tensor boundaries. Where the receiver holds a base for a tensor (the global it
sent, as the sender decoded it), the vector is the change against that base, which is
small and compresses far better than the weights. Non-floating tensors (BatchNorm's
``num_batches_tracked``) travel as they are, under their own names, before the codec's
parts, which are named ``codec:PART`` (no model tensor name holds a colon).

A section with optional tensors (a per-class subset of prototypes) is not compressed: its
vector's length would depend on what the sender chose to include.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..schema import Section, SectionSpec, TensorSpec
from ..wire.payload import WireError
from .codec import Codec, check_finite

PART_PREFIX = "codec:"


def compressible(spec: SectionSpec) -> bool:
    """Whether a section of this spec can be compressed: it has floating tensors and no
    optional ones."""
    return (not any(t.optional for t in spec.tensors.values())
            and any(t.dtype.is_floating_point for t in spec.tensors.values()))


def vector_length(spec: SectionSpec) -> int:
    """Values in the section's floating vector."""
    total = 0
    for tensor in spec.tensors.values():
        if tensor.dtype.is_floating_point:
            count = 1
            for dim in tensor.shape:
                count *= dim
            total += count
    return total


def encoded_spec(spec: SectionSpec, codec: Codec) -> SectionSpec:
    """The schema of the section encoded with ``codec``: its non-floating tensors, then
    the codec's parts for its floating vector. A section that is not ``compressible``
    keeps its spec."""
    if not compressible(spec):
        return spec
    tensors = {name: t for name, t in spec.tensors.items() if not t.dtype.is_floating_point}
    for name in spec.tensors:
        if name.startswith(PART_PREFIX):
            raise ValueError(f"section {spec.name!r}: tensor {name!r} clashes with the codec's "
                             f"part names ({PART_PREFIX}...)")
    for part, (dtype, shape) in codec.layout(vector_length(spec)).items():
        tensors[PART_PREFIX + part] = TensorSpec(dtype, tuple(shape))
    return SectionSpec(spec.kind, spec.name, tensors)


def _matching(base: Mapping[str, torch.Tensor] | None, name: str,
              tensor: TensorSpec) -> torch.Tensor | None:
    if base is None:
        return None
    ref = base.get(name)
    if ref is None or tuple(ref.shape) != tuple(tensor.shape) or not ref.is_floating_point():
        return None
    return ref


def flatten(section: Section, spec: SectionSpec,
            base: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The section's floating vector (float32), minus ``base`` where it holds a tensor of
    the same name and shape."""
    pieces = []
    for name, tensor in spec.tensors.items():
        if not tensor.dtype.is_floating_point:
            continue
        value = section.tensors[name].detach().reshape(-1).to(torch.float32)
        ref = _matching(base, name, tensor)
        if ref is not None:
            value = value - ref.detach().reshape(-1).to(torch.float32)
        pieces.append(value)
    return torch.cat(pieces) if pieces else torch.empty(0)


def encode_section(section: Section, spec: SectionSpec, codec: Codec,
                   base: Mapping[str, torch.Tensor] | None = None,
                   generator: torch.Generator | None = None,
                   residual: torch.Tensor | None = None) -> tuple[Section, torch.Tensor | None]:
    """The section encoded (its layout ``encoded_spec(spec, codec)``), and, with error
    feedback (``residual`` given: the previous round's, zeros at first), the new residual:
    what this encoding dropped, added to the next round's vector."""
    if not compressible(spec):
        return section, residual
    x = flatten(section, spec, base)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"section {spec.name!r}: error-feedback residual of "
                             f"{residual.numel()} values for a vector of {x.numel()}")
        x = x + residual
    parts = codec.encode(x, generator)
    new_residual = x - codec.decode(parts, x.numel()) if residual is not None else None
    tensors = {name: section.tensors[name] for name, t in spec.tensors.items()
               if not t.dtype.is_floating_point}
    tensors.update({PART_PREFIX + part: value for part, value in parts.items()})
    return Section(section.kind, section.name, tensors), new_residual


def decode_section(section: Section, spec: SectionSpec, codec: Codec,
                   base: Mapping[str, torch.Tensor] | None = None) -> Section:
    """The section as the sender's tensors (``spec``'s names, dtypes and shapes), from a
    section whose layout already matched ``encoded_spec(spec, codec)``. WireError names
    the part or tensor whose values no honest encoder produces."""
    if not compressible(spec):
        return section
    n = vector_length(spec)
    parts = {part: section.tensors[PART_PREFIX + part] for part in codec.layout(n)}
    x = codec.decode(parts, n)
    if x.shape != (n,):
        raise WireError(f"codec {codec.spec} decoded {x.numel()} values, expected {n}")
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for name, tensor in spec.tensors.items():
        if not tensor.dtype.is_floating_point:
            tensors[name] = section.tensors[name]
            continue
        count = 1
        for dim in tensor.shape:
            count *= dim
        value = x[offset:offset + count].view(tensor.shape)
        offset += count
        ref = _matching(base, name, tensor)
        if ref is not None:
            value = value + ref.to(torch.float32)
        value = value.to(tensor.dtype)
        check_finite(f"{section.kind.label}/{name}", value)
        tensors[name] = value
    return Section(section.kind, section.name, tensors)

"""Which uploads secure aggregation masks, and their layout as one vector: an upload's
sections flattened in schema order (the quantizer appends the weight), the global each
value is the change against, and the summed vector back as a payload. Kept apart from
the protocol (``secagg.py``) and its arithmetic (``secagg_ring.py``), which know only
vectors.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..schema import EVALUATE, Kind, Payload, Section, SectionSpec, UploadContract
from .secagg_ring import SecAggError

if TYPE_CHECKING:
    from torch import nn


# ---- which uploads are masked, and their layout as one vector ----------------------------
def masked_phases(method: UploadContract, models: dict[str, nn.Module]) -> dict[str, list[SectionSpec]]:
    """The phases whose uploads secure aggregation masks, each with its sections (all of
    that phase's uploads, summed in schema order). A section the aggregator needs edge by
    edge is refused, naming it -- unless the method sends it in the clear on purpose
    (``PhasePrivacy.clear`` of ``Method.privacy``)."""
    out: dict[str, list[SectionSpec]] = {}
    for phase in method.phases:
        if phase == EVALUATE:
            continue
        schema = method.uplink_schema(phase, models)
        traits = method.privacy(phase, models)
        summable, clear = traits.summable, traits.clear
        masked = []
        for spec in schema:
            key = (spec.kind, spec.name)
            label = f"{spec.kind.name}:{spec.name!r}"
            if key in clear:
                continue
            if key not in summable:
                raise ValueError(f"--secagg: method {method.name!r} uploads section {label} in "
                                 f"phase {phase!r}, which its aggregator needs edge by edge (not "
                                 "a weighted sum); secure aggregation cannot hide it")
            if spec.required != set(spec.tensors):
                raise ValueError(f"--secagg: section {label} of method {method.name!r} has "
                                 "optional tensors; a masked vector needs a fixed layout")
            masked.append(spec)
        if masked and len(masked) != len(schema):
            raise ValueError(f"--secagg: phase {phase!r} of method {method.name!r} mixes masked "
                             "and clear sections; a masked phase must be all summable")
        if masked:
            out[phase] = masked
    if not out:
        raise ValueError(f"--secagg: method {method.name!r} uploads nothing that is summed; "
                         "secure aggregation has nothing to protect")
    return out


def vector_length(specs: list[SectionSpec]) -> int:
    """Words of a masked vector: every value of the sections, then the weight."""
    return sum(math.prod(t.shape) for s in specs for t in s.tensors.values()) + 1


def flatten_upload(specs: list[SectionSpec], upload: Payload) -> np.ndarray:
    parts = []
    for spec in specs:
        section = upload.get(spec.kind, spec.name)
        if section is None:
            raise SecAggError(f"the upload lacks section {spec.kind.name}:{spec.name!r}")
        for name, tensor_spec in spec.tensors.items():
            tensor = section.tensors[name]
            if tuple(tensor.shape) != tensor_spec.shape:
                raise SecAggError(f"{name}: shape {list(tensor.shape)}, expected "
                                  f"{list(tensor_spec.shape)}")
            parts.append(tensor.detach().reshape(-1).to("cpu", torch.float64).numpy())
    return np.concatenate(parts) if parts else np.zeros(0)


def base_vector(specs: list[SectionSpec], common: Payload) -> np.ndarray:
    """The global each value of a masked vector is the change against (zeros after the
    weight-less layout of ``flatten_upload``): a floating tensor of a SHARED_TENSORS section
    whose same-named section of ``common`` (the phase's common downlink, as the edge holds
    it) has a floating tensor of that name and shape -- ``compress.section.flatten``'s rule.
    Other values are masked as they are."""
    parts = [ref if ref is not None else np.zeros(n) for n, ref in _references(specs, common)]
    return np.concatenate(parts) if parts else np.zeros(0)


def model_mask(specs: list[SectionSpec], common: Payload) -> np.ndarray:
    """True for the values of a masked vector that ``base_vector`` takes from the global
    (the model): the values whose change one round may make is bounded."""
    parts = [np.full(n, ref is not None) for n, ref in _references(specs, common)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def _references(specs: list[SectionSpec], common: Payload) -> list[tuple[int, np.ndarray | None]]:
    """Per tensor of the layout: its size and its global values (float64), or None."""
    out = []
    for spec in specs:
        held = common.get(spec.kind, spec.name) if spec.kind == Kind.SHARED_TENSORS else None
        for name, tensor_spec in spec.tensors.items():
            n = math.prod(tensor_spec.shape)
            ref = held.tensors.get(name) if held is not None else None
            if (ref is not None and tensor_spec.dtype.is_floating_point
                    and ref.is_floating_point() and tuple(ref.shape) == tensor_spec.shape):
                out.append((n, ref.detach().reshape(-1).to("cpu", torch.float64).numpy()))
            else:
                out.append((n, None))
    return out


def unflatten_sum(specs: list[SectionSpec], values: np.ndarray) -> Payload:
    sections, start = [], 0
    flat = torch.from_numpy(values.astype(np.float32))
    for spec in specs:
        tensors = {}
        for name, tensor_spec in spec.tensors.items():
            n = math.prod(tensor_spec.shape)
            tensors[name] = flat[start:start + n].view(tensor_spec.shape)
            start += n
        sections.append(Section(spec.kind, spec.name, tensors))
    return Payload(sections)

"""Server-side aggregators, one class per kind.

* ``StreamingMean`` -- streaming weighted sum: each upload is added into a running sum as
  it arrives (O(model) memory, compatible with secure aggregation); the round's mean
  replaces the global sections. The sum is float64 whatever the tensors' dtype: float32
  overflows at 3.4e38, which one edge with a large weight and finite values reaches, and
  float64 keeps the mean of any weights up to ``server.max_weight`` exact to float32.
  The sum is compensated (``add_scaled``: a float64 pair, TwoSum), so it does not depend
  on the order uploads arrive in: a fixed seed gives the same global bit for bit.
* ``ServerOptimizer`` -- the same streamed mean, then an optimizer step on the server
  (FedAdam's moments, SCAFFOLD's control variate) whose state lives in the checkpoint.
* ``CollectThenLearn`` -- keeps every upload of the round and learns from all of them
  at once (robust statistics, learned aggregators); never combinable with secure
  aggregation for those sections.

Global state is a dict of sections: (kind, name) -> {tensor name: tensor}. Everything in
it is broadcast to the edges; ``state_tensors``/``load_state`` cover it plus any
optimizer state for the checkpoint.

Closing a phase *replaces* the tensors of the global state (and of a server optimizer's
state) with new ones and never writes into them: the engine keeps references to the
previous ones (``snapshot_round``) and puts them back (``restore_round``) when a close
raises or leaves a non-finite value (``unusable_tensors``), so a failed round costs no
copy of the model. State that is updated in place (a learned aggregator's own network)
is small and is copied.

Robust aggregation against poisoned uploads: ``fedmedian`` (the coordinate-wise median)
bounds what a minority of edges can do to each coordinate of the global, where a mean
follows any single upload; ``--clip-update-norm`` bounds each upload's distance from the
global before it reaches any aggregator.
"""

from __future__ import annotations

import abc
import copy
import enum
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..schema import TRAIN, Kind, Payload, Section, TensorSpec
from ..wire.payload import tensor_entries
from .exact_sum import Spilled, add_scaled, finish_sum, spilled_mean
from .spill import UploadSpill

SectionKey = tuple[Kind, str]


class AggregatedMethod(Protocol):
    """What the base aggregators read of their method: the shared tensors' specs, the
    starting global, and the tensor groups whose similarity is recorded. ``Method`` is
    one; an aggregator of a method module may read more of its own method. Typed here so
    that this module never imports ``base`` (which names the aggregators)."""

    def shared_specs(self, models: dict[str, nn.Module]) -> dict[str, TensorSpec]: ...

    def initial_state(self, models: dict[str, nn.Module]
                      ) -> dict[SectionKey, dict[str, torch.Tensor]]: ...

    def similarity_groups(self, models: dict[str, nn.Module]) -> dict[str, list[str]]: ...


class AggregatorKind(str, enum.Enum):
    STREAMING_SUM = "streaming_weighted_sum"        # O(model) running sum; SecAgg-compatible
    SERVER_OPTIMIZER = "server_optimizer"           # an optimizer step over the streamed mean
    COLLECT = "collect_then_learn"                  # needs the individual uploads

FLOAT32_MAX = torch.finfo(torch.float32).max


def out_of_range(tensor: torch.Tensor) -> bool:
    """Whether a floating tensor holds NaN, an infinity or a value beyond float32's range
    (what an edge could not load into a float32 model). One pass, nothing allocated."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return False
    low, high = torch.aminmax(tensor.detach())
    # NaN propagates into both and fails both comparisons.
    return not (bool(low >= -FLOAT32_MAX) and bool(high <= FLOAT32_MAX))


@dataclass
class RoundSnapshot:
    """The aggregator's state before a round aggregated anything: the global sections'
    (and replace-only optimizer) tensors by reference, everything written in place copied.
    ``restore_round`` returns to it exactly."""

    state: dict[SectionKey, dict[str, torch.Tensor]]
    tensors: dict[str, torch.Tensor]  # state_tensors(): references or copies
    kept: frozenset[str]  # keys of ``tensors`` held by reference (unchanged while identical)
    meta: dict[str, Any]
    round: int
    selected: list[str]
    known_edges: int


def _flat_key(section: SectionKey, name: str) -> str:
    kind, section_name = section
    return f"{kind.label}:{section_name}:{name}"


def _split_key(key: str) -> tuple[SectionKey, str]:
    kind_label, section_name, name = key.split(":", 2)
    return (Kind[kind_label.upper()], section_name), name


def flatten_sections(sections: dict[SectionKey, dict[str, torch.Tensor]],
                     prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + _flat_key(sec, name): t for sec, ts in sections.items() for name, t in ts.items()}


def unflatten_sections(flat: dict[str, torch.Tensor],
                       prefix: str = "") -> dict[SectionKey, dict[str, torch.Tensor]]:
    out: dict[SectionKey, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        if key.startswith(prefix):
            section, name = _split_key(key[len(prefix):])
            out.setdefault(section, {})[name] = tensor
    return out


class Aggregator(abc.ABC):
    kind: AggregatorKind

    def __init__(self, method: AggregatedMethod, models: dict[str, nn.Module]):
        self.method = method
        self.specs = method.shared_specs(models)
        self.state: dict[SectionKey, dict[str, torch.Tensor]] = method.initial_state(models)
        self.round = 0
        self.selected: list[str] = []
        self.known_edges = 0

    # ---- downlink -----------------------------------------------------------------
    def broadcast(self, phase: str) -> Payload:
        """The common downlink of a phase: every global section."""
        return Payload([Section(kind, name, dict(tensors))
                        for (kind, name), tensors in self.state.items()])

    def personal(self, edge_id: str, phase: str) -> Payload:
        """Sections for one edge only (none by default)."""
        return Payload()

    # ---- uplink -------------------------------------------------------------------
    def begin_round(self, round_number: int, selected: list[str], known_edges: int) -> None:
        self.round = round_number
        self.selected = list(selected)
        self.known_edges = known_edges

    @abc.abstractmethod
    def accept(self, edge_id: str, upload: Payload, weight: float) -> None:
        """Take one validated upload into the round's aggregate. The upload's tensors view
        a receive buffer that is reused once this returns: copy whatever you keep. Values
        the method cannot use raise ValueError before any state changes: the server
        refuses the upload with that message and drops the edge from the phase."""

    @abc.abstractmethod
    def finish(self) -> dict[str, Any]:
        """Close the round: update the global state; returns figures for the history."""

    def accept_sum(self, phase: str, sums: Payload, total_weight: float, count: int) -> None:
        """Take the weighted sum over ``count`` edges of ``phase``'s uploads, sum_k w_k x_k
        with total weight sum_k w_k, as secure aggregation delivers it (no single upload is
        ever seen). Only aggregators that need nothing but that sum implement it."""
        raise ValueError(f"{type(self).__name__} needs individual uploads, not their sum")

    def public_weight(self, phase: str, edge_id: str, weight: float) -> float:
        """The weight an edge's masked upload of ``phase`` must carry under secure
        aggregation: ``weight``, the method's weight of the header's num_examples (capped
        at the edge's join declaration), unless this aggregator sets the weights itself
        (pFedKA's alpha_k). The edge masks ``EdgeAlgorithm.upload_weight``, its twin."""
        return weight

    # ---- phases beyond train (methods that declare them override these) -----------------
    def accept_phase(self, phase: str, edge_id: str, upload: Payload, weight: float) -> None:
        if phase != TRAIN:
            raise ValueError(f"{type(self).__name__} takes no uploads in phase {phase!r}")
        self.accept(edge_id, upload, weight)

    def close_phase(self, phase: str) -> dict[str, Any]:
        return self.finish() if phase == TRAIN else {}

    # ---- checkpoint ---------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return flatten_sections(self.state, "global:")

    def state_meta(self) -> dict[str, Any]:
        return {"round": self.round}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.state = unflatten_sections(tensors, "global:")
        self.round = int(meta.get("round", 0))

    # ---- a round that cannot close --------------------------------------------------
    def replaced_tensors(self) -> dict[str, torch.Tensor]:
        """The ``state_tensors`` that closing a phase replaces and never writes into (the
        global sections): a snapshot holds them by reference, not by copy. A subclass
        whose close writes into one of these tensors must leave it out here."""
        return flatten_sections(self.state, "global:")

    def snapshot_round(self) -> RoundSnapshot:
        """What ``restore_round`` needs to undo the round: called after ``begin_round``,
        before the round's first upload."""
        replaced = self.replaced_tensors()
        tensors, kept = {}, set()
        for key, tensor in self.state_tensors().items():
            if replaced.get(key) is tensor:
                tensors[key] = tensor
                kept.add(key)
            else:
                tensors[key] = tensor.detach().clone()
        return RoundSnapshot({section: dict(values) for section, values in self.state.items()},
                             tensors, frozenset(kept), copy.deepcopy(self.state_meta()),
                             self.round, list(self.selected), self.known_edges)

    def restore_round(self, snapshot: RoundSnapshot) -> None:
        """Back to ``snapshot``: the global and all server state as before the round, and
        the round's sums or collected uploads dropped (``begin_round`` again), so the next
        round starts as if this one had aggregated nothing."""
        self.load_state(dict(snapshot.tensors), copy.deepcopy(snapshot.meta))
        self.state = {section: dict(values) for section, values in snapshot.state.items()}
        self.begin_round(snapshot.round, snapshot.selected, snapshot.known_edges)

    def unusable_tensors(self, snapshot: RoundSnapshot) -> list[str]:
        """Checkpoint names of the state's tensors that changed since ``snapshot`` and hold
        a non-finite or beyond-float32 value: such a state is never published."""
        return [key for key, tensor in self.state_tensors().items()
                if not (key in snapshot.kept and snapshot.tensors.get(key) is tensor)
                and out_of_range(tensor)]


class PairwiseCosine:
    """Mean pairwise cosine similarity of the round's uploads, per group of tensors, in
    O(model) memory: with u_i the unit vector of edge i's group, the mean over pairs
    i < j of u_i . u_j is (||sum_i u_i||^2 - n) / (n (n - 1))."""

    def __init__(self, groups: dict[str, list[str]]):
        self.groups = {g: names for g, names in groups.items() if names}
        self.reset()

    def reset(self) -> None:
        self._sum: dict[str, torch.Tensor] = {}
        self._count: dict[str, int] = {}

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for group, names in self.groups.items():
            vector = torch.cat([tensors[n].reshape(-1).to(torch.float64) for n in names])
            norm = vector.norm()
            if not norm > 0:
                continue  # an all-zero upload has no direction
            if group in self._sum:
                self._sum[group].add_(vector, alpha=1 / float(norm))
            else:
                self._sum[group] = vector / norm
            self._count[group] = self._count.get(group, 0) + 1

    def result(self) -> dict[str, float]:
        out = {}
        for group, total in self._sum.items():
            n = self._count[group]
            if n >= 2:
                out[group] = (float(total.dot(total)) - n) / (n * (n - 1))
        return out


def _entries(section: Section) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return list(tensor_entries(section.tensors))


class StreamingMean(Aggregator):
    """Weighted mean of every uploaded section, kept as a float64 running sum: one vector
    per section (twice the section's float32 size), whatever the tensors' dtypes; the
    mean is cast back to each tensor's dtype when the phase closes.

    With ``spill`` set (the server sets it: ``server.spill_sums``), no sum is kept
    through the round: each upload's sections go to disk as they arrive, and the close
    runs the same compensated sum over them a slice of coordinates at a time, in
    arrival order (``exact_sum.spilled_mean``). Every operation of the sum is per coordinate, so
    the mean is bit for bit the in-memory one, and the server holds a slice's buffers
    where it held four float32 models' worth of float64 pair (ResNet-18: 6 MB a summing
    thread, not 179)."""

    kind = AggregatorKind.STREAMING_SUM

    def __init__(self, method: AggregatedMethod, models: dict[str, nn.Module]):
        super().__init__(method, models)
        self._sum: dict[SectionKey, torch.Tensor] = {}
        self._compensation: dict[SectionKey, torch.Tensor] = {}
        self._layout: dict[SectionKey, list[tuple[str, torch.dtype, tuple[int, ...]]]] = {}
        self._names: dict[SectionKey, tuple[str, ...]] = {}
        self._weight = 0.0
        self._count = 0
        self.spill: UploadSpill | None = None
        self._spilled: Spilled = []  # the round's spilled uploads, in arrival order
        groups = method.similarity_groups(models)
        self._cosine = PairwiseCosine(
            {g: [n for n in names if n in self.specs] for g, names in groups.items()})

    def begin_round(self, round_number: int, selected: list[str], known_edges: int) -> None:
        super().begin_round(round_number, selected, known_edges)
        self._sum, self._layout, self._names, self._weight, self._count = {}, {}, {}, 0.0, 0
        self._compensation = {}
        self._drop_spilled()
        self._cosine.reset()

    def _drop_spilled(self) -> None:
        self._spilled = []
        if self.spill is not None:
            self.spill.clear()

    def accept(self, edge_id: str, upload: Payload, weight: float) -> None:
        """Each section is added into its float64 sum as one flat vector when the upload
        has one (one pass per section), else tensor by tensor; the layout of names, dtypes
        and shapes comes from the first upload, and a later upload must match it."""
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"edge {edge_id}: aggregation weight must be > 0 and finite, "
                             f"got {weight}")
        for section in upload.sections:  # checked before anything is added
            key = (section.kind, section.name)
            if key in self._layout and set(section.tensors) != set(self._names[key]):
                raise ValueError(f"edge {edge_id}: section {section.kind.label}:"
                                 f"{section.name!r} carries other tensors than this round's "
                                 "first upload")
        if self.spill is not None:
            self._spill_upload(edge_id, upload, weight)  # raises before any state changes
        for section in upload.sections:
            key = (section.kind, section.name)
            layout = self._layout.get(key)
            if layout is None:
                layout = self._layout[key] = _entries(section)
                self._names[key] = tuple(name for name, _, _ in layout)
            if self.spill is None:
                self._add_section(section, key, layout, weight)
            if section.kind == Kind.SHARED_TENSORS and self._cosine.groups:
                self._cosine.add(section.tensors)
        self._weight += weight
        self._count += 1

    def _add_section(self, section: Section, key: SectionKey,
                     layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                     weight: float) -> None:
        """Adds one section into its float64 sum (created at the first upload)."""
        total = self._sum.get(key)
        if total is None:
            size = sum(math.prod(shape) for _, _, shape in layout)
            total = self._sum[key] = torch.zeros(size, dtype=torch.float64)
            self._compensation[key] = torch.zeros(size, dtype=torch.float64)
        comp = self._compensation[key]
        if section.flat is not None and tuple(section.tensors) == self._names[key]:
            add_scaled(total, section.flat, weight, comp)
        else:
            start = 0
            for name, _, shape in layout:
                n = math.prod(shape)
                add_scaled(total[start : start + n], section.tensors[name].reshape(-1), weight,
                           comp[start : start + n])
                start += n

    def _spill_upload(self, edge_id: str, upload: Payload, weight: float) -> None:
        """Writes the upload's sections to one file, each tensor in the round's layout
        order (the first upload's), and records where each section starts; ValueError
        when a tensor's size is not its layout's or the spill refuses (by name)."""
        views, sections, offset = [], {}, 0
        for section in upload.sections:
            key = (section.kind, section.name)
            layout = self._layout.get(key) or _entries(section)
            names = tuple(name for name, _, _ in layout)
            # Sizes and dtypes from the section's layout: a decoded section's views of its
            # flat vector (~1 ms of Python per model) are never made when it is written
            # whole.
            entries = {name: (dtype, shape) for name, dtype, shape in _entries(section)}
            for name, _, shape in layout:
                if math.prod(entries[name][1]) != math.prod(shape):
                    raise ValueError(f"edge {edge_id}: tensor {name!r} of section "
                                     f"{section.kind.label}:{section.name!r} has "
                                     f"{math.prod(entries[name][1])} values, this round's "
                                     f"first upload {math.prod(shape)}")
            if section.flat is not None and tuple(section.tensors) == names:
                parts = [section.flat]
            else:
                parts = [section.tensors[name] for name in names]
            sections[key] = (offset, [entries[name][0] for name in names])
            for part in parts:
                if part.numel():
                    flat = part.detach().contiguous().reshape(-1).view(torch.uint8)
                    views.append(memoryview(flat.numpy()))
                    offset += views[-1].nbytes
        path = self.spill.write_raw(self.round, f"{edge_id}-{len(self._spilled)}", edge_id,
                                    views)
        self._spilled.append((path, weight, sections))

    def accept_sum(self, phase: str, sums: Payload, total_weight: float, count: int) -> None:
        if not (total_weight > 0 and math.isfinite(total_weight)):
            raise ValueError(f"the summed aggregation weight must be > 0 and finite, got "
                             f"{total_weight}")
        for section in sums.sections:
            key = (section.kind, section.name)
            self._layout[key] = _entries(section)
            self._names[key] = tuple(section.tensors)
            self._compensation.pop(key, None)  # the fixed-point sum is exact already
            for _, _, sections in self._spilled:  # the sum replaces what was added, as in RAM
                sections.pop(key, None)
            self._sum[key] = torch.cat([t.reshape(-1).to(torch.float64)
                                        for t in section.tensors.values()])
        self._weight += total_weight
        self._count += count

    def means(self) -> dict[SectionKey, dict[str, torch.Tensor]]:
        """The round's mean of each section, each tensor in its uploaded dtype. A section of
        one dtype becomes one vector of that dtype, its tensors views of it."""
        out = {}
        for key, layout in self._layout.items():
            if key not in self._sum:  # its uploads are on disk
                out[key] = spilled_mean(self._spilled, key, layout, self._weight)
                continue
            total = self._sum[key]
            # In place: the sum is spent once the mean exists (finish drops it).
            mean = finish_sum(total, self._compensation.get(key)).div_(self._weight)
            layout = self._layout[key]
            dtypes = {dtype for _, dtype, _ in layout}
            if len(dtypes) == 1:
                mean = mean.to(dtypes.pop())
            tensors, start = {}, 0
            for name, dtype, shape in layout:
                n = math.prod(shape)
                tensors[name] = mean[start : start + n].to(dtype).view(shape)
                start += n
            out[key] = tensors
        return out

    def apply(self, means: dict[SectionKey, dict[str, torch.Tensor]]) -> None:
        """Replace each global section by the round's mean (in the stored dtype)."""
        for section, tensors in means.items():
            current = self.state.get(section, {})
            self.state[section] = {
                name: value.to(current[name].dtype) if name in current else value
                for name, value in tensors.items()
            }

    def finish(self) -> dict[str, Any]:
        figures: dict[str, Any] = {"aggregated": self._count, "total_weight": self._weight}
        similarity = self._cosine.result()
        if similarity:
            figures["cosine_similarity"] = similarity
        if self._count:
            self.apply(self.means())
        self._sum, self._compensation = {}, {}
        self._drop_spilled()
        self._cosine.reset()
        return figures


class ServerOptimizer(StreamingMean):
    """A streamed mean followed by a server-side step implemented in ``apply``, which
    replaces the tensors of ``optimizer_state`` (as of the global), never writes into them."""

    kind = AggregatorKind.SERVER_OPTIMIZER

    def __init__(self, method: AggregatedMethod, models: dict[str, nn.Module]):
        super().__init__(method, models)
        self.optimizer_state: dict[str, torch.Tensor] = {}

    def replaced_tensors(self) -> dict[str, torch.Tensor]:
        out = super().replaced_tensors()
        out.update({f"opt:{k}": v for k, v in self.optimizer_state.items()})
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = super().state_tensors()
        out.update({f"opt:{k}": v for k, v in self.optimizer_state.items()})
        return out

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        super().load_state(tensors, meta)
        self.optimizer_state = {k[4:]: v for k, v in tensors.items() if k.startswith("opt:")}


class CollectThenLearn(Aggregator):
    """Keeps the round's uploads individually; ``learn`` turns them into new global state.
    With ``spill`` set (the server sets it: ``server.spill_uploads``), the uploads are
    kept on disk, memory-mapped, instead of as clones in RAM (``spill.UploadSpill``)."""

    kind = AggregatorKind.COLLECT

    def __init__(self, method: AggregatedMethod, models: dict[str, nn.Module]):
        super().__init__(method, models)
        self.uploads: dict[str, tuple[Payload, float]] = {}
        self.spill: UploadSpill | None = None

    def begin_round(self, round_number: int, selected: list[str], known_edges: int) -> None:
        super().begin_round(round_number, selected, known_edges)
        self._drop_uploads()

    def _drop_uploads(self) -> None:
        self.uploads = {}
        if self.spill is not None:
            self.spill.clear()

    def accept(self, edge_id: str, upload: Payload, weight: float) -> None:
        if self.spill is not None:
            kept = self.spill.keep(self.round, edge_id, upload)
        else:
            kept = Payload([Section(s.kind, s.name, {k: v.clone() for k, v in s.tensors.items()})
                            for s in upload.sections])
        self.uploads[edge_id] = (kept, weight)

    def read(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """``out[:] = tensor`` for a view of an upload: from the spilled file with a read
        when there is one (``UploadSpill.read``: the pages never enter the process's
        memory), else a copy."""
        if self.spill is None or not self.spill.read(tensor, out):
            out.copy_(tensor)

    def evict(self, tensors: list[torch.Tensor]) -> None:
        """``learn`` is done reading these views of its uploads (and wrote nothing into
        them): spilled, their pages leave the process's memory (``UploadSpill.evict``)."""
        if self.spill is not None:
            for tensor in tensors:
                self.spill.evict(tensor)

    @abc.abstractmethod
    def learn(self, uploads: dict[str, tuple[Payload, float]]) -> dict[str, Any]:
        """Update ``self.state`` from all uploads of the round."""

    def finish(self) -> dict[str, Any]:
        figures: dict[str, Any] = {"aggregated": len(self.uploads)}
        if self.uploads:
            # In edge-id order, not arrival order: whatever ``learn`` sums or iterates
            # over gives the same bits on every run.
            figures.update(self.learn(dict(sorted(self.uploads.items()))))
        self._drop_uploads()  # a close that raises is undone by restore_round (begin_round)
        return figures

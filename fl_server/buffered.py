"""Buffered asynchronous aggregation (FedBuff), ``fl-server --mode async``: its buffer, its
training driver and what a method must be to run it. The schedule (task hand-out,
versions, evaluations) is ``schedules/buffered.py``.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022,
https://arxiv.org/abs/2106.06639. In synchronous rounds a round waits for its quorum or its
deadline and a slow edge's work past it is thrown away. Here every free, connected edge
gets work at once, on the newest global; each result carries the version it started from
(the task's round is that version + 1) and joins a buffer as its change Delta_k (the edge
uploads trained - received: ``fl_edge.middleware.UploadChanges``), weighted by n_k and
scaled by s(tau) (``fedattn_shared.staleness``), tau being how many versions the global
moved since the edge's download. When the buffer holds ``--buffer`` K results, the server
applies

    x_{t+1} = x_t + eta * sum_k n_k s(tau_k) Delta_k / sum_k n_k        (eta: --server-lr)

through the method's own aggregator (``Aggregator.accept_sum`` of the sum
sum_k n_k (x_t + eta s(tau_k) Delta_k), then its close: FedAdam's server step runs on
it as on a round's mean), bumps the version, writes the checkpoint and hands the next
tasks the new global. A result more than ``--max-staleness`` versions old is refused by
name. The buffer is one float64 compensated sum: O(model) memory, as a round's.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from fedattn_shared.methods.aggregators import AggregatorKind
from fedattn_shared.methods.base import Method
from fedattn_shared.methods.exact_sum import add_scaled, finish_sum
from fedattn_shared.schema import EVALUATE, TRAIN, Kind, Payload, Section, SectionSpec, TensorSpec

from .drivers import DriverWrapper, PhaseDriver, Traits

SectionKey = tuple[Kind, str]


def async_refusal(method: Method, models: dict, state: dict) -> str:
    """Why ``method`` cannot run buffered ('' when it can): it must train in one phase
    whose every upload section is a model section (compression rule "delta") of the
    global, summed by a streaming aggregator. Phases in lock-step (pFedKA), statistics or
    prototypes (Fed-SAP, FedSTAR), control variates (SCAFFOLD) and aggregators that keep
    each upload (FedMedian) need a round."""
    name = method.name
    phases = [p for p in method.phases if p != EVALUATE]
    if phases != [TRAIN]:
        return (f"method {name!r} runs phases {phases} in lock-step: every edge of a round "
                "must finish one before the next starts")
    if method.aggregator_kind == AggregatorKind.COLLECT:
        return (f"method {name!r} aggregates with {method.aggregator_kind.value}: it needs "
                "every upload of a round together, not a stream of changes")
    summable = method.privacy(TRAIN, models).summable
    rules = dict(method.compression)
    schema = method.uplink_schema(TRAIN, models)
    if not schema:
        return f"method {name!r} uploads nothing: there is no change to buffer"
    for spec in schema:
        label = f"{spec.kind.label}:{spec.name!r}"
        if (spec.kind, spec.name) not in summable:
            return f"method {name!r} needs its {label} uploads edge by edge, not as a sum"
        if rules.get(spec.kind) != "delta":
            return (f"method {name!r} uploads {label}, which is not a model section (its "
                    "values are not a change of the global that a stale result could add to)")
        if spec.required != set(spec.tensors):
            return f"method {name!r} uploads {label} with optional tensors"
        current = state.get((spec.kind, spec.name), {})
        missing = [t for t in spec.tensors if t not in current]
        if missing:
            return f"the global holds no {missing[0]!r} of {label} to apply a change to"
    return ""


def stepped(spec: TensorSpec) -> bool:
    """Whether a tensor travels as a change (a floating parameter) or as its value (a
    buffer, BatchNorm's running statistics, or a counter): a stale change of a running
    variance, added to a later global, could turn it negative."""
    return spec.dtype.is_floating_point and not spec.is_buffer


class ChangeBuffer:
    """The buffer: sum_k n_k s(tau_k) Delta_k per section as a float64 compensated sum
    (order-independent, see ``add_scaled``), values (buffers, counters) as sum_k n_k v_k,
    and the record of each contributor."""

    def __init__(self, specs: list[SectionSpec]):
        self.specs = {(s.kind, s.name): s for s in specs}
        self.clear()

    def clear(self) -> None:
        """Empty (after each applied version)."""
        self.sums: dict[SectionKey, tuple[torch.Tensor, torch.Tensor]] = {}
        self.weight = 0.0
        self.entries: list[dict[str, Any]] = []
        self.tainted = ""

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, upload: Payload, weight: float, scale: float) -> None:
        """Adds one checked upload (the gate matched its layout to the schema)."""
        keys = {(s.kind, s.name) for s in upload.sections}
        if keys != set(self.specs):
            raise ValueError("the upload's sections are not the training schema's")
        try:
            for section in upload.sections:
                spec = self.specs[(section.kind, section.name)]
                total, comp = self._vectors(spec)
                start = 0
                for name, tensor in spec.tensors.items():
                    n = math.prod(tensor.shape)
                    value = section.tensors[name].reshape(-1)
                    factor = weight * scale if stepped(tensor) else weight
                    add_scaled(total[start:start + n], value, factor, comp[start:start + n])
                    start += n
        except Exception as err:  # part of the upload may be in the sums
            self.tainted = (f"the buffer failed part way through an upload ({type(err).__name__}: "
                            f"{err}); its sums may hold part of it")
            raise
        self.weight += weight

    def _vectors(self, spec: SectionSpec) -> tuple[torch.Tensor, torch.Tensor]:
        key = (spec.kind, spec.name)
        if key not in self.sums:
            size = sum(math.prod(t.shape) for t in spec.tensors.values())
            self.sums[key] = (torch.zeros(size, dtype=torch.float64),
                              torch.zeros(size, dtype=torch.float64))
        return self.sums[key]

    def weighted_sum(self, state: dict, lr: float) -> Payload:
        """sum_k n_k (x_t + lr s(tau_k) Delta_k) = W x_t + lr S for parameters, the
        weighted sum of values for the others: what ``Aggregator.accept_sum`` takes."""
        sections = []
        for key, spec in self.specs.items():
            total, comp = self.sums[key]
            total = finish_sum(total, comp)
            tensors, start = {}, 0
            for name, tensor in spec.tensors.items():
                n = math.prod(tensor.shape)
                piece = total[start:start + n]
                if stepped(tensor):
                    base = state[key][name].reshape(-1).to(torch.float64)
                    piece = base.mul(self.weight).add_(piece, alpha=lr)
                tensors[name] = piece.view(tensor.shape)
                start += n
            sections.append(Section(key[0], key[1], tensors))
        return Payload(sections)


class BufferedSchedule(Protocol):
    """What a ``BufferedTrain`` needs of its schedule (``schedules.buffered.Buffered``):
    the buffer its uploads go to and the run's settings (its size K, ``cfg.buffer``). A
    protocol, so this module never imports the schedule."""

    cfg: Any

    def add(self, driver: BufferedTrain, edge: str, upload: Payload, weight: float) -> None:
        """One checked result into the buffer (ValueError: too stale)."""


class BufferedTrain(DriverWrapper):
    """The training phase of one version: tasks handed to free edges on the global of
    ``version``; each upload goes to the schedule's buffer. Everything else (schema,
    downlinks, decode, the method's check) is the plan's train driver's."""

    def __init__(self, inner: PhaseDriver, schedule: BufferedSchedule, version: int):
        # Uploads are changes (the gate's norm bound measures them as they are).
        super().__init__(inner, traits=Traits(weighted=True, training=True, changes=True))
        self.schedule, self.version = schedule, version

    def quorum(self, participants: int) -> int:
        """Nothing waits for a version's tasks: K results from any versions apply."""
        return self.schedule.cfg.buffer

    def accept(self, edge: str, upload: Payload, weight: float) -> None:
        """Into the buffer, scaled by its staleness (ValueError: too stale)."""
        self.schedule.add(self, edge, upload, weight)

    def close(self) -> dict[str, Any]:
        """Nothing: a version closes through the buffer (``BufferedSchedule.apply``), never
        through its phase, which the schedule retires."""
        return {}

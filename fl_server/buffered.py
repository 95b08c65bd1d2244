"""Buffered asynchronous aggregation (FedBuff): ``fl-server --mode async``.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022,
https://arxiv.org/abs/2106.06639. In synchronous rounds a round waits for its quorum or its
deadline and a slow edge's work past it is thrown away. Here every free, connected edge
gets work at once, on the newest global; each result carries the version it started from
(the task's round is that version + 1) and joins a buffer as its change Delta_k (the edge
uploads trained - received: ``fl_edge.middleware.UploadChanges``), weighted by n_k and
scaled by s(tau) (``fedattn_shared.staleness``), tau being how many versions the global
moved since the edge's download. When the buffer holds ``--buffer`` K results, the server
applies

    x_{t+1} = x_t + eta * sum_k n_k s(tau_k) Delta_k / sum_k n_k        (eta: --async-lr)

through the method's own aggregator (``Aggregator.accept_sum`` of the sum
sum_k n_k (x_t + eta s(tau_k) Delta_k), then its close: FedAdam's server step runs on
it as on a round's mean), bumps the version, writes the checkpoint and hands the next
tasks the new global. A result more than ``--max-staleness`` versions old is refused by
name. The buffer is one float64 compensated sum: O(model) memory, as a round's.

Evaluation runs every ``--eval-every`` versions: every connected edge gets an evaluate
task for that version's global, before its next training task; training goes on
meanwhile, and the scores join that version's history record when they are in.

What is not kept: the buffer is not in the checkpoint. A server killed mid-buffer resumes
from the last version with an empty buffer; the lost results were never applied, so none
is counted twice, and their edges, which rejoin, get new tasks (their work is redone).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from fedattn_shared.methods.aggregators import AggregatorKind
from fedattn_shared.methods.base import Method
from fedattn_shared.methods.exact_sum import add_scaled, finish_sum
from fedattn_shared.schema import EVALUATE, TRAIN, Kind, Payload, Section, SectionSpec, TensorSpec
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.serialize import encode

from .drivers import DriverWrapper, PhaseDriver, Traits
from .evaluation import summarize
from .phase import Phase, Refused, RoundAborted, Task, close_checked, open_phase

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("fl_server")

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


class BufferedSchedule:
    """The async run: task hand-out, the buffer, versions and evaluations (module doc).
    Held by the engine; reached from the servicer through ``Engine.task_for`` /
    ``phase_for`` / ``lose`` and from the gate's ``on_taken``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.cfg = engine.cfg
        refusal = async_refusal(engine.method, engine.models, engine.aggregator.state)
        if refusal:
            raise ValueError(f"--mode async: {refusal}; use --mode sync")
        self.weigh = self.cfg.staleness
        self.train = next(d for d in engine.plan if d.name == TRAIN)
        self.evaluator = next((d for d in engine.plan if d.traits.evaluates), None)
        self.buffer = ChangeBuffer(engine.method.uplink_schema(TRAIN, engine.models))
        self.phases: dict[tuple[str, int], Phase] = {}
        self.current: Phase | None = None  # the training phase of the newest version
        self.records: dict[int, dict] = {}  # versions whose evaluation may still arrive
        self.evaluations: set[asyncio.Task] = set()
        self.trained = asyncio.Event()
        self.failure: Exception | None = None
        self.started = time.monotonic()
        engine.gate.on_taken = self.taken

    @property
    def version(self) -> int:
        """The version of the current global (applied buffers since the start)."""
        return self.engine.round

    # ---- the run --------------------------------------------------------------------
    async def run(self) -> None:
        """Hands out work until ``--rounds`` versions are applied, then waits for the last
        evaluation."""
        engine = self.engine
        # K distinct edges fill a buffer (``may_train``): start with at least that many.
        await engine.edges.wait_for(max(self.cfg.min_edges, self.cfg.buffer))
        self.started = time.monotonic()
        if self.version < self.cfg.rounds:
            async with engine.agg_lock:
                await self.open_training()
            await self.trained.wait()
        if self.failure is not None:
            raise self.failure
        while self.evaluations:
            await asyncio.gather(*self.evaluations)
        async with engine.agg_lock:
            await engine.runlog.write_history()

    async def open_training(self) -> None:
        """The training phase of the current version (under ``agg_lock``): its common
        downlink encoded once; tasks are added as edges ask."""
        engine = self.engine
        driver = BufferedTrain(self.train, self, self.version)
        phase = await open_phase(driver, self.version + 1, self.cfg, {},
                                 lambda edge: Payload(),
                                 f"{engine.instance}-v{engine.state_version}")
        phase.growing = True
        if self.current is not None:
            self.current.retire()
        self.current = self.phases[(TRAIN, phase.round)] = phase
        for edge in engine.edges.connected_ids():
            engine.edges.records[edge].wake()

    # ---- tasks ----------------------------------------------------------------------
    def task_for(self, edge: str) -> tuple[Phase, Task] | None:
        """The edge's task: one it holds in the current version or an evaluation (sent
        again: a download that broke), else a new training task on the newest global. A
        training task of an older version it asks past is given up ("superseded")."""
        record = self.engine.edges.records.get(edge)
        if record is None or not record.connected:
            return None
        for phase in list(self.phases.values()):
            task = phase.tasks.get(edge)
            if task is None or not phase.is_pending(edge):
                continue
            if phase is self.current or phase.driver.traits.evaluates:
                return phase, task
            self.engine.drop(phase, edge, "superseded: the edge asked for new work")
        phase = self.current
        if phase is None or phase.closed or not self.may_train(phase, edge):
            return None
        return phase, self.new_task(phase, edge)

    def task_of(self, edge: str, task_id: int) -> tuple[Phase, Task] | None:
        """The edge's pending task ``task_id`` in the current version or an evaluation
        (a download's continuation); None once it is gone or its phase retired."""
        for phase in self.phases.values():
            task = phase.tasks.get(edge)
            if (task is not None and task.task_id == task_id and phase.is_pending(edge)
                    and (phase is self.current or phase.driver.traits.evaluates)):
                return phase, task
        return None

    def has_work(self, edge: str) -> bool:
        """Whether ``task_for`` would hand the edge a task now, without handing it: the
        presence stream's ``task_ready`` hint asks this for every event, and must neither
        create a task nor give up the one the edge is training (``superseded``)."""
        record = self.engine.edges.records.get(edge)
        if record is None or not record.connected:
            return False
        if any(phase.is_pending(edge) and (phase is self.current or phase.driver.traits.evaluates)
               for phase in self.phases.values() if edge in phase.tasks):
            return True
        phase = self.current
        return phase is not None and not phase.closed and self.may_train(phase, edge)

    def may_train(self, phase: Phase, edge: str) -> bool:
        """Whether the edge may have new work now. An edge whose result is in the buffer
        waits for the buffer to apply (no edge holds more than one result of a version: a
        fast or lying edge cannot fill a buffer alone), and so does one whose task of this
        version was dropped for what it sent or pulled (a bad upload, the re-delivery
        limit): it cannot turn refusals into endless downloads."""
        if any(entry["edge"] == edge for entry in self.buffer.entries):
            return False
        why = phase.dropped.get(edge, "")
        return not why.startswith(("bad upload", "re-delivery limit"))

    def new_task(self, phase: Phase, edge: str) -> Task:
        """A training task in ``phase`` (an edge may take several per version: one that
        lost its task, or whose result was applied, gets another)."""
        engine = self.engine
        phase.received.pop(edge, None)
        phase.dropped.pop(edge, None)
        engine.task_counter += 1
        personal = engine.edges.first_downlink(edge, phase.driver.personal(edge),
                                               engine.init_payload)
        phase.personal[edge] = encode(personal)
        task = phase.tasks[edge] = Task(engine.task_counter, edge)
        engine.metrics.selected.labels(TRAIN).inc()
        return task

    def phase_for(self, header: pb.SubmitHeader) -> Phase | None:
        """The open phase a result names (its phase and round), or None; a training result
        too old to apply is refused here, by name."""
        phase = self.phases.get((header.phase, header.round))
        if phase is None and header.phase == TRAIN and 0 < header.round <= self.version:
            raise Refused(self.stale_reason(header.round - 1))
        return phase

    def stale_reason(self, started: int) -> str:
        """Why a result that started from version ``started`` is refused."""
        if self.version - started > self.cfg.max_staleness:
            return (f"too stale: the result started from version {started} and the global "
                    f"is at version {self.version}, more than --max-staleness "
                    f"{self.cfg.max_staleness} versions later")
        if self.trained.is_set():
            return f"run over: the last version ({self.version}) is applied"
        return f"no training phase of version {started} is open"

    def lose(self, edge: str, reason: str) -> None:
        """The edge's session ended: its pending tasks are dropped."""
        for phase in list(self.phases.values()):
            if not phase.closed and phase.is_pending(edge):
                self.engine.drop(phase, edge, reason)

    # ---- the buffer -----------------------------------------------------------------
    def add(self, driver: BufferedTrain, edge: str, upload: Payload, weight: float) -> None:
        """One checked result into the buffer (a worker thread, under ``agg_lock``)."""
        tau = self.version - driver.version
        if tau > self.cfg.max_staleness:
            raise ValueError(self.stale_reason(driver.version))
        scale = self.weigh(tau)
        self.buffer.add(upload, weight, scale)
        self.buffer.entries.append({"edge": edge, "from_version": driver.version,
                                    "staleness": tau, "weight": weight, "scale": scale})

    async def taken(self, phase: Phase) -> None:
        """After every accepted upload (under ``agg_lock``): a full buffer is applied."""
        if phase.driver.traits.evaluates or not self.buffer.entries:
            return
        entry = self.buffer.entries[-1]  # this upload's: added under the same lock
        entry["metrics"] = phase.received.get(entry["edge"], {}).get("metrics", {})
        if len(self.buffer) >= self.cfg.buffer:
            try:
                await self.apply()
            except Exception as err:  # the run cannot go on: stop it (a checkpoint exists)
                log.error("version %d could not be opened: %s", self.version + 1, err,
                          exc_info=err)
                self.failure = err
                self.trained.set()

    def _close(self) -> dict[str, Any]:
        """The buffer through the method's aggregator (a worker thread, under agg_lock)."""
        if self.buffer.tainted:
            raise RoundAborted(self.buffer.tainted)
        aggregator = self.engine.aggregator
        sums = self.buffer.weighted_sum(aggregator.state, self.cfg.async_lr)
        aggregator.accept_sum(TRAIN, sums, self.buffer.weight, len(self.buffer))
        return aggregator.close_phase(TRAIN)

    async def apply(self) -> None:
        """Applies the buffer as the next version, records and checkpoints it, opens its
        training and, when due, its evaluation."""
        engine, buffer = self.engine, self.buffer
        version = self.version + 1
        entries = list(buffer.entries)
        aggregator = engine.aggregator
        aggregator.begin_round(version, [e["edge"] for e in entries], len(engine.edges.records))
        snapshot = aggregator.snapshot_round()
        closing = time.monotonic()
        figures, failure = await asyncio.to_thread(close_checked, self._close, "", aggregator,
                                                   snapshot)
        engine.metrics.aggregation_seconds.labels(TRAIN, "close").observe(
            time.monotonic() - closing)
        buffer.clear()
        record = self.record(version, entries, figures, failure)
        engine.round = version
        engine.runlog.data["rounds"].append(record)
        engine.runlog.start_checkpoint(engine.snapshot(), record, len(entries), len(entries))
        self.retire_stale()
        last = version >= self.cfg.rounds
        if last:
            for phase in [p for p in self.phases.values() if not p.driver.traits.evaluates]:
                self.close(phase, f"run over: the last version ({version}) is applied")
            self.current = None
        else:
            await self.open_training()
        every = self.cfg.eval_every
        if self.evaluator is not None and every and (version % every == 0 or last):
            await self.open_evaluation(version, record)
        if last:  # after the evaluation is open: the run waits for it
            self.trained.set()

    def record(self, version: int, entries: list[dict], figures: dict,
               failure: Exception | None) -> dict[str, Any]:
        """The version's history record (``round`` is the version, for the tools)."""
        engine = self.engine
        now = time.monotonic()
        staleness = Counter(e["staleness"] for e in entries)
        record: dict[str, Any] = {
            # As a round's: when the version began (the last one applied) and how long
            # its buffer took to fill; the global exists from started + seconds.
            "round": version, "version": version,
            "started": time.time() - (now - self.started), "seconds": now - self.started,
            "aggregate": figures,
            TRAIN: {"contributors": entries, "received": [e["edge"] for e in entries],
                    "staleness": {str(t): n for t, n in sorted(staleness.items())},
                    "in_flight": sum(len(p.pending()) for p in self.phases.values()
                                     if not p.driver.traits.evaluates)},
            "bytes": engine.meter.take_round()}
        self.started = now
        for entry in entries:
            engine.metrics.staleness.observe(entry["staleness"])
        if failure is not None:
            reason = str(failure) if isinstance(failure, RoundAborted) else (
                f"{type(failure).__name__}: {failure}")
            record["aborted"] = f"{TRAIN}: {reason}"
            record["aggregate"] = {}
            engine.metrics.rounds_aborted.inc()
            log.error("version %d: not applied, the global stays as it was: %s", version,
                      reason)
        elif figures.get("aggregated"):
            engine.state_version += 1
        log.info("version %d: %d results, staleness %s", version, len(entries),
                 dict(sorted(staleness.items())))
        return record

    def retire_stale(self) -> None:
        """Closes the training phases whose results are now too stale to apply."""
        for (name, round_number), phase in list(self.phases.items()):
            if name == TRAIN and self.version - (round_number - 1) > self.cfg.max_staleness:
                self.close(phase, self.stale_reason(round_number - 1))

    def close(self, phase: Phase, why: str) -> None:
        """Closes a phase to results (uploads in flight stop); its pending tasks drop."""
        for edge in phase.pending():
            self.engine.drop(phase, edge, why)
        phase.closed, phase.closed_why = True, why
        phase.closing.set()
        phase.retire()
        self.phases.pop((phase.name, phase.round), None)

    # ---- evaluation -----------------------------------------------------------------
    async def open_evaluation(self, version: int, record: dict) -> None:
        """An evaluate task for every connected edge on version ``version``'s global,
        taken before its next training task; the scores join ``record`` when in."""
        engine = self.engine
        # One evaluation open at a time (each holds its version's global): the older one
        # ends with the scores it has, its pending tasks superseded by this one.
        for (name, _), phase in list(self.phases.items()):
            if name == EVALUATE:
                for edge in phase.pending():
                    engine.drop(phase, edge, f"superseded: version {version} is evaluated")
        edges = engine.edges.connected_ids()
        ids = range(engine.task_counter + 1, engine.task_counter + 1 + len(edges))
        try:
            phase = await open_phase(
                self.evaluator, version, self.cfg, dict(zip(edges, ids, strict=True)),
                lambda edge: engine.edges.first_downlink(edge, self.evaluator.personal(edge),
                                                         engine.init_payload),
                f"{engine.instance}-v{engine.state_version}")
        except RoundAborted as err:
            record["evaluation_skipped"] = str(err)
            log.error("version %d: no evaluation: %s", version, err)
            return
        engine.task_counter += len(edges)
        engine.metrics.selected.labels(EVALUATE).inc(len(edges))
        self.phases[(EVALUATE, version)] = phase
        phase.maybe_close()
        for edge in edges:
            engine.edges.records[edge].wake()
        task = asyncio.create_task(self.evaluation(phase, record))
        self.evaluations.add(task)
        task.add_done_callback(self.evaluations.discard)

    async def evaluation(self, phase: Phase, record: dict) -> None:
        """Waits for the scores (or ``--round-timeout``), then records them."""
        engine = self.engine
        try:
            await asyncio.wait_for(phase.done.wait(), timeout=self.cfg.round_timeout)
        except asyncio.TimeoutError:
            engine.metrics.phase_timeouts.labels(EVALUATE).inc()
        async with engine.agg_lock:  # no upload, version or checkpoint meanwhile
            self.close(phase, "deadline")
            record[EVALUATE] = phase.summary()
            per_edge = {e: r["evaluation"] for e, r in phase.received.items()}
            record["evaluation"] = {"per_edge": per_edge, "summary": summarize(per_edge)}
            engine.metrics.publish_evaluation(per_edge, record["evaluation"]["summary"])
            engine.metrics.phase_seconds.labels(EVALUATE).observe(
                time.monotonic() - phase.started)
            engine.runlog.evaluated(record)
            engine.runlog.record_changed()
            await engine.runlog.write_history()

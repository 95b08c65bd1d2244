"""Buffered asynchronous aggregation (FedBuff, ``--mode async``): the schedule.

Every free, connected edge gets work at once, on the newest global; each result joins a
buffer (``fl_server.buffered``: the change buffer, its math and the training driver), and
each ``--buffer`` results are applied as the next version, recorded and checkpointed, with
the next tasks on the new global. A result more than ``--max-staleness`` versions old is
refused by name. Evaluation runs every ``--eval-every`` versions: every connected edge gets
an evaluate task for that version's global, before its next training task; training goes
on meanwhile, and the scores join that version's history record when they are in.

What is not kept: the buffer is not in the checkpoint. A server killed mid-buffer resumes
from the last version with an empty buffer; the lost results were never applied, so none
is counted twice, and their edges, which rejoin, get new tasks (their work is redone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from fedattn_shared.schema import EVALUATE, TRAIN, Payload
from fedattn_shared.wire import fedattn_pb2 as pb

from ..buffered import BufferedTrain, ChangeBuffer, async_refusal
from ..phase import Phase, Refused, RoundAborted, Task
from .base import Schedule
from .context import RunContext

log = logging.getLogger("fl_server")

#: Seconds an edge that declined work ("not now") is offered none, unless a new version
#: comes first: a declining edge costs one answer per this period, never a loop, and one
#: whose budget renewed is offered work again even if no version is applied meanwhile
#: (when every edge declined, none would be).
DECLINE_BACKOFF = 60.0


class Buffered(Schedule):
    """The async run: task hand-out, the buffer, versions and evaluations (module doc).
    Its training phases are growing ones, one per version still within
    ``--max-staleness``; at most one evaluation is open."""

    def __init__(self, run: RunContext):
        super().__init__(run)
        self.cfg = run.cfg
        refusal = async_refusal(run.method, run.models, run.aggregator.state)
        if refusal:
            raise ValueError(f"--mode async: {refusal}; use --mode sync")
        self.weigh = self.cfg.staleness
        self.train = next(d for d in run.plan if d.name == TRAIN)
        self.evaluator = next((d for d in run.plan if d.traits.evaluates), None)
        self.buffer = ChangeBuffer(run.method.uplink_schema(TRAIN, run.models))
        self.phases: dict[tuple[str, int], Phase] = {}
        self.current: Phase | None = None  # the training phase of the newest version
        self.evaluations: set[asyncio.Task] = set()
        self.trained = asyncio.Event()
        self.failure: Exception | None = None
        self.started = time.monotonic()
        # edge -> (version, monotonic time) of its last decline: one entry per known edge
        self.declined: dict[str, tuple[int, float]] = {}

    @property
    def version(self) -> int:
        """The version of the current global (applied buffers since the start)."""
        return self.ctx.round

    # ---- the run --------------------------------------------------------------------
    async def run(self) -> None:
        """Hands out work until ``--rounds`` versions are applied, then waits for the last
        evaluation."""
        ctx = self.ctx
        # K distinct edges fill a buffer (``may_train``): start with at least that many.
        await ctx.edges.wait_for(max(self.cfg.min_edges, self.cfg.buffer))
        self.started = time.monotonic()
        if self.version < self.cfg.rounds:
            async with ctx.agg_lock:
                await self.open_training()
            await self.trained.wait()
        if self.failure is not None:
            raise self.failure
        while self.evaluations:
            await asyncio.gather(*self.evaluations)
        async with ctx.agg_lock:
            await ctx.runlog.write_history()

    async def open_training(self) -> None:
        """The training phase of the current version (under ``agg_lock``): its common
        downlink encoded once; tasks are added as edges ask."""
        phase = await self.ctx.open(BufferedTrain(self.train, self, self.version),
                                    self.version + 1, [], growing=True)
        if self.current is not None:
            self.current.retire()
        self.current = self.phases[(TRAIN, phase.round)] = phase
        self.declined.clear()  # a new version is offered to every edge
        self.ctx.wake(self.ctx.edges.connected_ids())

    # ---- tasks ----------------------------------------------------------------------
    def task_for(self, edge: str) -> tuple[Phase, Task] | None:
        """The edge's task: one it holds in the current version or an evaluation (sent
        again: a download that broke), else a new training task on the newest global. A
        training task of an older version it asks past is given up ("superseded")."""
        record = self.ctx.edges.records.get(edge)
        if record is None or not record.connected:
            return None
        for phase in list(self.phases.values()):
            task = phase.tasks.get(edge)
            if task is None or not phase.is_pending(edge):
                continue
            if phase is self.current or phase.driver.traits.evaluates:
                return phase, task
            self.ctx.drop(phase, edge, "superseded: the edge asked for new work")
        phase = self.current
        if phase is None or phase.closed or not self.may_train(phase, edge):
            return None
        return phase, self.ctx.hand_out(phase, edge)

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
        record = self.ctx.edges.records.get(edge)
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
        declined = self.declined.get(edge)
        if (declined is not None and declined[0] == self.version
                and time.monotonic() - declined[1] < DECLINE_BACKOFF):
            return False
        why = phase.dropped.get(edge, "")
        return not why.startswith(("bad upload", "re-delivery limit"))

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
                self.ctx.drop(phase, edge, reason)

    def decline(self, edge: str, reason: str) -> None:
        """The edge declines work: its pending tasks drop, and it is offered none until
        the next version or ``DECLINE_BACKOFF`` seconds."""
        self.lose(edge, reason)
        self.declined[edge] = (self.version, time.monotonic())

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
        if not phase.driver.traits.changes or not self.buffer.entries:
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
        aggregator = self.ctx.aggregator
        sums = self.buffer.weighted_sum(aggregator.state, self.cfg.async_lr)
        aggregator.accept_sum(TRAIN, sums, self.buffer.weight, len(self.buffer))
        return aggregator.close_phase(TRAIN)

    async def apply(self) -> None:
        """Applies the buffer as the next version, records and checkpoints it, opens its
        training and, when due, its evaluation."""
        ctx, buffer = self.ctx, self.buffer
        version = self.version + 1
        entries = list(buffer.entries)
        aggregator = ctx.aggregator
        aggregator.begin_round(version, [e["edge"] for e in entries], len(ctx.edges.records))
        snapshot = aggregator.snapshot_round()
        figures, failure = await ctx.close_aggregate(TRAIN, self._close, "", snapshot)
        buffer.clear()
        record = self.record(version, entries, figures, failure)
        ctx.commit(version, record, len(entries), len(entries))
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
        ctx = self.ctx
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
            "bytes": ctx.meter.take_round()}
        self.started = now
        for entry in entries:
            ctx.metrics.staleness.observe(entry["staleness"])
        if failure is not None:
            reason = str(failure) if isinstance(failure, RoundAborted) else (
                f"{type(failure).__name__}: {failure}")
            record["aborted"] = f"{TRAIN}: {reason}"
            record["aggregate"] = {}
            ctx.metrics.rounds_aborted.inc()
            log.error("version %d: not applied, the global stays as it was: %s", version,
                      reason)
        log.info("version %d: %d results, staleness %s", version, len(entries),
                 dict(sorted(staleness.items())))
        return record

    def retire_stale(self) -> None:
        """Closes the training phases whose results are now too stale to apply."""
        for (name, round_number), phase in list(self.phases.items()):
            if name == TRAIN and self.version - (round_number - 1) > self.cfg.max_staleness:
                self.close(phase, self.stale_reason(round_number - 1))

    def close(self, phase: Phase, why: str) -> None:
        """Closes a phase for ``why`` (its pending tasks drop) and lets its downlinks go."""
        self.ctx.close(phase, why)
        phase.retire()
        self.phases.pop((phase.name, phase.round), None)

    # ---- evaluation -----------------------------------------------------------------
    async def open_evaluation(self, version: int, record: dict) -> None:
        """An evaluate task for every connected edge on version ``version``'s global,
        taken before its next training task; the scores join ``record`` when in."""
        ctx = self.ctx
        # One evaluation open at a time (each holds its version's global): the older one
        # ends with the scores it has, its pending tasks superseded by this one.
        for (name, _), phase in list(self.phases.items()):
            if name == EVALUATE:
                for edge in phase.pending():
                    ctx.drop(phase, edge, f"superseded: version {version} is evaluated")
        edges = ctx.edges.connected_ids()
        try:
            phase = await ctx.open(self.evaluator, version, edges)
        except RoundAborted as err:
            record["evaluation_skipped"] = str(err)
            log.error("version %d: no evaluation: %s", version, err)
            return
        self.phases[(EVALUATE, version)] = phase
        phase.maybe_close()
        ctx.wake(edges)
        task = asyncio.create_task(self.evaluation(phase, record))
        self.evaluations.add(task)
        task.add_done_callback(self.evaluations.discard)

    async def evaluation(self, phase: Phase, record: dict) -> None:
        """Waits for the scores (or ``--round-timeout``), then records them."""
        ctx = self.ctx
        try:
            await asyncio.wait_for(phase.done.wait(), timeout=self.cfg.round_timeout)
        except asyncio.TimeoutError:
            ctx.metrics.phase_timeouts.labels(EVALUATE).inc()
        async with ctx.agg_lock:  # no upload, version or checkpoint meanwhile
            self.close(phase, "deadline")
            ctx.record_evaluation(record, phase)
            ctx.metrics.phase_seconds.labels(EVALUATE).observe(
                time.monotonic() - phase.started)
            ctx.runlog.evaluated(record)
            ctx.runlog.record_changed()
            await ctx.runlog.write_history()

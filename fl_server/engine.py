"""The round engine: a round is a plan of phase drivers run in order (``drivers.py``);
each phase sends tasks, waits for a quorum of results or its deadline, and closes.

Everything runs on one asyncio loop; aggregation and checkpoint writes run in worker
threads under ``agg_lock`` so the running sum is never touched by two uploads at once
and never after its phase has closed.

Nothing an edge sends and nothing a method raises ends the process. An upload the method
or the aggregator cannot take is refused (``gate.py``) and costs its edge the task. A
phase that cannot close (its driver raises, or the new state holds a non-finite or
beyond-float32 value) aborts its round: the aggregator returns to its state before the
round (nothing of the round is applied), the history records ``"aborted"`` with the
reason, and the next round runs.

The engine runs drivers without knowing what they are: secure aggregation is a wrapper
that expanded the plan. The servicer's interface is ``front.py``, history and
checkpoints are ``history.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods.base import Method
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import ByteMeter

from .buffered import BufferedSchedule
from .drivers import PhaseDriver, SecAggPlus, round_plan
from .edges import EdgeBook
from .evaluation import summarize
from .gate import UploadGate
from .history import RunHistory, Snapshot, run_config, tensors_digest
from .initial import initial_payload
from .memory import log_memory, trim_heap
from .metrics import ServerMetrics, drop_reason_label, routine
from .phase import (
    Phase,
    RoundAborted,
    RoundState,
    Task,
    close_checked,
    open_phase,
    select_edges,
)
from .secagg import SecAggDriver

log = logging.getLogger("fl_server")


class Engine:
    """Runs the rounds: the plan of drivers, the open phase, the aggregator and the run's
    history. The servicer reaches it through ``front.EdgeFront``."""

    def __init__(self, server: ServerConfig, train: TrainConfig, method: Method,
                 meter: ByteMeter, metrics: ServerMetrics):
        self.cfg, self.train, self.method = server, train, method
        self.meter, self.metrics = meter, metrics
        self.log_every = 10.0  # seconds between "k/n results in" lines (fl-server --log-every)
        self.models = method.build_models()
        self.fingerprint = method.fingerprint(self.models)
        # Pretrained weights: the global starts from them, and edges without private state
        # get the whole initial models once, so their private parts start there too.
        self.init_payload = initial_payload(self.models, server.init_weights, method.head,
                                            server.init_skip_head)
        self.aggregator = method.server(self.models)
        self.edges = EdgeBook(server.max_edges)
        # Secure aggregation: refuses (ValueError, exit 2) a method it cannot serve.
        self.secagg = (SecAggDriver(server, method, self.models, self.aggregator)
                       if server.secagg else None)
        self.plan: list[PhaseDriver] = round_plan(
            method, self.models, self.aggregator, server,
            SecAggPlus(self.secagg) if self.secagg is not None else None)
        self.runlog = RunHistory(server, train, method, metrics)
        self.agg_lock = asyncio.Lock()
        self.gate = UploadGate(server, train, method, self.edges, self.aggregator, metrics,
                               self.agg_lock, self.runlog.durable)
        self.round = self.task_counter = self.state_version = 0
        self.instance = secrets.token_hex(4)
        self.phase: Phase | None = None
        self.finished = False
        self.stopping = False  # the server is shutting down: waiting calls end now
        self.config_json = run_config(server, train, method,
                                      self.secagg.policy if self.secagg is not None else None)
        # --mode async: the run is versions of a buffer, not rounds of a plan (ValueError,
        # exit 2, names a method that needs rounds).
        self.buffered = BufferedSchedule(self) if server.mode == "async" else None

    # ---- state ------------------------------------------------------------------------
    def resume(self) -> None:
        """Continues the run from its latest checkpoint (``--resume``)."""
        round_number, tensors, state = self.runlog.load(self.fingerprint,
                                                        json.loads(self.config_json))
        self.aggregator.load_state(tensors, state["aggregator"])
        self.edges.load_json(state["registry"])
        self.round = round_number
        self.task_counter = int(state["task_counter"])
        log.info("resumed from round %d (state digest %s)", round_number,
                 tensors_digest(self.aggregator.state_tensors()))

    @property
    def history(self) -> dict[str, Any]:
        """history.json's content (manifest and round records)."""
        return self.runlog.data

    def snapshot(self) -> Snapshot:
        """Everything a checkpoint holds, taken between rounds."""
        state = {
            "round": self.round, "fingerprint": self.fingerprint,
            "config": json.loads(self.config_json), "aggregator": self.aggregator.state_meta(),
            "registry": self.edges.to_json(), "task_counter": self.task_counter,
        }
        tensors = self.aggregator.state_tensors()  # live: nothing aggregates until written
        return self.runlog.snapshot(self.round, tensors, state)

    async def durable(self) -> None:
        """Waits until the last round's checkpoint is on disk; re-raises its failure."""
        await self.runlog.durable()

    def drop(self, phase: Phase, edge_id: str, reason: str) -> None:
        """Takes an edge's task away (counted and logged by reason)."""
        phase.dropped[edge_id] = reason
        self.metrics.dropped.labels(phase.name, drop_reason_label(reason)).inc()
        log.log(logging.INFO if routine(reason) else logging.WARNING,
                "round %d %s: dropped %s (%s)", phase.round, phase.name, edge_id, reason)
        phase.maybe_close()

    # ---- what the servicer asks (``front.EdgeFront``) ------------------------------------
    def task_for(self, edge: str) -> tuple[Phase, Task] | None:
        """The edge's pending task: in the open phase, or (``--mode async``) the one the
        buffered schedule hands it."""
        if self.buffered is not None:
            return self.buffered.task_for(edge)
        phase = self.phase
        if phase is None or phase.closed or not phase.is_pending(edge):
            return None
        return phase, phase.tasks[edge]

    def task_of(self, edge: str, task_id: int) -> tuple[Phase, Task] | None:
        """The edge's pending task ``task_id``, if it still is (a download's continuation);
        no side effect."""
        if self.buffered is not None:
            return self.buffered.task_of(edge, task_id)
        found = self.task_for(edge)
        return found if found is not None and found[1].task_id == task_id else None

    def has_work(self, edge: str) -> bool:
        """Whether ``task_for`` would hand the edge a task now; no side effect (async's
        ``task_for`` creates tasks and supersedes old ones)."""
        if self.buffered is not None:
            return self.buffered.has_work(edge)
        return self.task_for(edge) is not None

    def phase_for(self, header: pb.SubmitHeader) -> Phase | None:
        """The phase a result is for: the open one, or (async) the one it names."""
        return self.buffered.phase_for(header) if self.buffered is not None else self.phase

    def lose(self, edge: str, reason: str) -> None:
        """The edge's session ended: its pending task (async: tasks) is dropped."""
        if self.buffered is not None:
            self.buffered.lose(edge, reason)
            return
        phase = self.phase
        if phase is not None and not phase.closed and phase.is_pending(edge):
            self.drop(phase, edge, reason)

    # ---- rounds -------------------------------------------------------------------------
    async def run(self) -> None:
        """Runs rounds until ``--rounds``; every round starts with at least --min-edges
        connected (as Flower's min_available_clients)."""
        self.metrics.rounds_planned.set(self.cfg.rounds)
        self.metrics.init_phases([driver.name for driver in self.plan])
        if self.method.dp is not None and self.method.dp.target_epsilon:
            self.metrics.export_dp_budget(self.method.dp.target_epsilon)
        self.metrics.round.set(self.round)
        if self.buffered is not None:
            await self.buffered.run()
        while self.round < self.cfg.rounds:
            await self.edges.wait_for(self.cfg.min_edges)
            await self.run_round(self.round + 1)
        await self.durable()
        self.finished = True
        self.phase = None
        self.edges.wake_all()
        log.info("run finished after %d rounds", self.round)

    async def run_round(self, round_number: int) -> None:
        """Runs the plan's drivers in order. Non-evaluation phases go to the selected
        edges (minus those an earlier phase of the round lost); evaluation goes to every
        connected edge, every --eval-every rounds and after the last. A phase that cannot
        close aborts the round: the aggregator goes back to its state at the round's start,
        the later aggregating phases are skipped, and evaluation (when due) scores the kept
        global."""
        started = time.monotonic()
        selected = select_edges(self.edges.connected_ids(), self.cfg.fraction,
                                self.train.seed, round_number)
        # Wall-clock start: consecutive starts give the full round period, checkpoint included.
        state = RoundState(round_number, {"round": round_number, "started": time.time(),
                                          "aggregate": {}}, list(selected))
        try:
            self.aggregator.begin_round(round_number, selected, len(self.edges.records))
            for driver in self.plan:
                driver.begin_round(round_number, self.edges)
            # References to the global (no copy); taken before the checkpoint write ends,
            # which only reads the state.
            state.snapshot = self.aggregator.snapshot_round()
        except Exception as err:
            state.abort("begin", err, self.metrics)
        every = self.cfg.eval_every
        eval_due = bool(every) and (round_number % every == 0 or round_number == self.cfg.rounds)
        for index, driver in enumerate(self.plan):
            if driver.traits.evaluates:
                if all(later.traits.evaluates for later in self.plan[index + 1:]):
                    state.snapshot = None  # nothing left to undo: let the previous global go
                if eval_due:
                    await self.evaluate(driver, state)
            elif not state.aborted and not driver.skipped():
                await self.aggregate(driver, state)
        record = state.record
        record["seconds"] = time.monotonic() - started
        record["bytes"] = self.meter.take_round()
        await self.durable()  # a round that aggregated nothing did not wait for the last one
        self.round = round_number
        self.runlog.data["rounds"].append(record)
        self.runlog.start_checkpoint(self.snapshot(), record, len(state.participants),
                                     len(selected))

    async def evaluate(self, driver: PhaseDriver, state: RoundState) -> None:
        """Every connected edge scores the global; a phase that cannot run loses only the
        scores (``evaluation_skipped``), never the global."""
        edges = self.edges.connected_ids()
        try:
            phase = await self.run_phase(driver, state.number, edges)
        except RoundAborted as err:
            state.record["evaluation_skipped"] = str(err)
            log.error("round %d: no evaluation: %s", state.number, err, exc_info=err)
            return
        state.record[driver.name] = phase.summary()
        per_edge = {e: r["evaluation"] for e, r in phase.received.items()}
        state.record["evaluation"] = {"per_edge": per_edge, "summary": summarize(per_edge)}
        self.metrics.publish_evaluation(per_edge, state.record["evaluation"]["summary"])

    async def aggregate(self, driver: PhaseDriver, state: RoundState) -> None:
        """Runs one aggregating phase and closes it; the round's later phases go to the
        edges whose results it took."""
        try:
            phase = await self.run_phase(driver, state.number, state.participants)
        except RoundAborted as err:
            if state.snapshot is not None:  # an earlier phase may have changed the state
                async with self.agg_lock:
                    await asyncio.to_thread(self.aggregator.restore_round, state.snapshot)
            state.abort(driver.name, err, self.metrics)
            return
        async with self.agg_lock:
            log_memory("round %d %s closing", state.number, driver.name)
            closing = time.monotonic()
            figures, failure = await asyncio.to_thread(close_checked, driver.close,
                                                       phase.tainted, self.aggregator,
                                                       state.snapshot)
            self.metrics.aggregation_seconds.labels(driver.name, "close").observe(
                time.monotonic() - closing)
            if figures.get("aggregated"):
                self.state_version += 1
            log_memory("round %d %s closed", state.number, driver.name)
        state.record[driver.name] = phase.summary()
        if failure is not None:
            state.abort(driver.name, failure, self.metrics)
            return
        state.record["aggregate"].update(figures)
        state.participants = [e for e in state.participants if e in phase.received]

    async def _log_progress(self, phase: Phase, round_number: int) -> None:
        """A line every ``log_every`` seconds while ``phase`` is open ("k/n results in"):
        a server's log is otherwise silent from the phase's start to its end."""
        if self.log_every <= 0:
            return
        while True:
            await asyncio.sleep(self.log_every)
            log.info("round %d %s: %d/%d results in, %d dropped, quorum %d, open %.0fs",
                     round_number, phase.name, len(phase.received), len(phase.tasks),
                     len(phase.dropped), phase.quorum, time.monotonic() - phase.started)

    async def run_phase(self, driver: PhaseDriver, round_number: int, edges: list[str]) -> Phase:
        """Sends the phase's tasks and waits for its quorum or deadline; then closes it to
        uploads (those still streaming stop) and counts the edges that did not answer."""
        ids = range(self.task_counter + 1, self.task_counter + 1 + len(edges))
        phase = self.phase = await open_phase(
            driver, round_number, self.cfg, dict(zip(edges, ids, strict=True)),
            lambda edge: self.edges.first_downlink(edge, driver.personal(edge),
                                                  self.init_payload),
            f"{self.instance}-v{self.state_version}")
        self.task_counter += len(edges)  # only once the downlinks could be built
        log_memory("round %d %s open", round_number, driver.name)
        name = phase.name
        self.metrics.selected.labels(name).inc(len(phase.tasks))
        log.info("round %d %s: %d task(s), quorum %d", round_number, name, len(phase.tasks),
                 phase.quorum)
        for edge in edges:
            self.edges.records[edge].wake()
        # While the edges download, the last round's checkpoint finishes (or its failure
        # stops the server here, before anything of this round is aggregated).
        await self.durable()
        phase.maybe_close()
        progress = asyncio.create_task(self._log_progress(phase, round_number))
        try:
            await asyncio.wait_for(phase.done.wait(),
                                   timeout=driver.deadline() or self.cfg.round_timeout)
        except asyncio.TimeoutError:
            self.metrics.phase_timeouts.labels(name).inc()
            for edge in phase.pending():
                self.drop(phase, edge, "deadline")
        finally:
            progress.cancel()
        async with self.agg_lock:
            phase.closed = True
            phase.closing.set()
        for edge in phase.pending():
            phase.dropped[edge] = "phase closed at quorum"
            self.metrics.dropped.labels(name, drop_reason_label("phase closed at quorum")).inc()
        # Edges still streaming hold their own reference; the phase no longer needs a copy.
        phase.common_frames = []
        trim_heap()
        self.metrics.participants.labels(name).set(len(phase.received))
        self.metrics.phase_seconds.labels(name).observe(time.monotonic() - phase.started)
        return phase

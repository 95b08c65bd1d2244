"""What a schedule may use of the server: the run's parts and the steps every schedule
takes the same way, each written once.

A schedule (``base.Schedule``) decides when phases open and close and who gets a task; it
never reaches into the engine. This context is its whole view: the configs, the plan of
drivers, the aggregator, the edge book, metrics, byte meter and history, the lock uploads
and closes share, and the run's counters (rounds or versions applied, task ids handed out,
state version). The steps below are the ones the synchronous rounds and the buffered mode
used to write twice: opening a phase (task numbering), dropping a task, closing a phase,
closing an aggregate, recording an evaluation and committing a round to the history and
its checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods.aggregators import Aggregator, RoundSnapshot
from fedattn_shared.methods.base import Method
from fedattn_shared.schema import Payload
from fedattn_shared.wire.accounting import ByteMeter
from fedattn_shared.wire.serialize import encode

from ..drivers import PhaseDriver
from ..edges import EdgeBook
from ..evaluation import summarize
from ..history import RunHistory, Snapshot
from ..memory import trim_heap
from ..metrics import ServerMetrics, drop_reason_label, routine
from ..phase import Phase, Task, close_checked, open_phase

log = logging.getLogger("fl_server")

#: Why a pending task of a phase closed at its quorum or deadline is dropped.
CLOSED_AT_QUORUM = "phase closed at quorum"


@dataclass
class RunContext:
    """The server as a schedule sees it (module doc). ``round`` is the number of the last
    round (version) applied, ``task_counter`` the last task id handed out,
    ``state_version`` how often the global changed: the three counters a checkpoint keeps
    (``snapshot``) and the schedules advance."""

    cfg: ServerConfig
    train: TrainConfig
    method: Method
    models: dict
    plan: list[PhaseDriver]
    aggregator: Aggregator
    edges: EdgeBook
    metrics: ServerMetrics
    meter: ByteMeter
    runlog: RunHistory
    agg_lock: asyncio.Lock
    init_payload: Payload | None
    instance: str
    snapshot: Callable[[], Snapshot]  # the checkpoint of the state between rounds
    round: int = 0
    task_counter: int = 0
    state_version: int = 0
    log_every: float = 10.0  # seconds between "k/n results in" lines (fl-server --log-every)

    async def durable(self) -> None:
        """Waits until the last round's checkpoint is on disk; re-raises its failure."""
        await self.runlog.durable()

    # ---- tasks ----------------------------------------------------------------------
    async def open(self, driver: PhaseDriver, round_number: int, edges: list[str],
                   growing: bool = False) -> Phase:
        """A new phase of ``driver`` with a task for each of ``edges``, numbered after the
        last task handed out (only once the downlinks could be built: ``RoundAborted``
        otherwise), each edge's personal downlink after its initial models (once). A
        ``growing`` phase takes more tasks as edges ask (``hand_out``)."""
        ids = range(self.task_counter + 1, self.task_counter + 1 + len(edges))
        phase = await open_phase(
            driver, round_number, self.cfg, dict(zip(edges, ids, strict=True)),
            lambda edge: self.edges.first_downlink(edge, driver.personal(edge),
                                                   self.init_payload),
            f"{self.instance}-v{self.state_version}", growing)
        self.task_counter += len(edges)
        self.metrics.selected.labels(driver.name).inc(len(edges))
        return phase

    def hand_out(self, phase: Phase, edge: str) -> Task:
        """One more task in a growing phase, numbered after the last one handed out."""
        personal = self.edges.first_downlink(edge, phase.driver.personal(edge),
                                             self.init_payload)
        self.task_counter += 1
        task = phase.hand_out(edge, self.task_counter, encode(personal))
        self.metrics.selected.labels(phase.name).inc()
        return task

    def drop(self, phase: Phase, edge: str, reason: str) -> None:
        """Takes an edge's task away, counted and logged by reason."""
        phase.drop(edge, reason)
        self._dropped(phase, edge, reason, announce=True)

    def close(self, phase: Phase, why: str = "") -> None:
        """Closes ``phase`` to results (uploads in flight stop). Its pending tasks are
        dropped: for ``why`` (a schedule's reason, which later uploads are refused with;
        logged as any drop), or, when the phase closed at its quorum or deadline (no
        ``why``), as closed at quorum, counted without a line each."""
        reason = why or CLOSED_AT_QUORUM
        for edge in phase.close(why, reason):
            self._dropped(phase, edge, reason, announce=bool(why))

    def _dropped(self, phase: Phase, edge: str, reason: str, announce: bool) -> None:
        self.metrics.dropped.labels(phase.name, drop_reason_label(reason)).inc()
        if announce:
            log.log(logging.INFO if routine(reason) else logging.WARNING,
                    "round %d %s: dropped %s (%s)", phase.round, phase.name, edge, reason)

    def wake(self, edges: list[str]) -> None:
        """Ends the task long-polls of ``edges``: work waits for them."""
        for edge in edges:
            self.edges.records[edge].wake()

    # ---- results --------------------------------------------------------------------
    async def close_aggregate(self, name: str, close: Callable[[], dict[str, Any]],
                              tainted: str, snapshot: RoundSnapshot | None
                              ) -> tuple[dict[str, Any], Exception | None]:
        """Closes an aggregate (``phase.close_checked``, in a worker thread; the caller
        holds ``agg_lock``), timed; a close that aggregated changes the state version."""
        closing = time.monotonic()

        def close_and_trim() -> tuple[dict[str, Any], Exception | None]:
            try:
                return close_checked(close, tainted, self.aggregator, snapshot)
            finally:  # the close's temporaries (its slice buffers and reads) off the heap
                trim_heap()

        figures, failure = await asyncio.to_thread(close_and_trim)
        self.metrics.aggregation_seconds.labels(name, "close").observe(
            time.monotonic() - closing)
        if figures.get("aggregated"):
            self.state_version += 1
        return figures, failure

    def record_evaluation(self, record: dict[str, Any], phase: Phase) -> None:
        """An evaluation phase's scores into its round's history record and metrics."""
        record[phase.name] = phase.summary()
        per_edge = {e: r["evaluation"] for e, r in phase.received.items()}
        record["evaluation"] = {"per_edge": per_edge, "summary": summarize(per_edge)}
        self.metrics.publish_evaluation(per_edge, record["evaluation"]["summary"])

    def commit(self, number: int, record: dict[str, Any], participants: int,
               selected: int) -> None:
        """Round (version) ``number`` is applied: its record joins the history and its
        checkpoint starts (``durable`` waits for it)."""
        self.round = number
        self.runlog.data["rounds"].append(record)
        self.runlog.start_checkpoint(self.snapshot(), record, participants, selected)

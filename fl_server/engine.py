"""The engine: the run's parts (method, models, aggregator, plan of phase drivers, edge
book, upload gate, history) and the schedule that runs them, picked by ``--mode`` from
``schedules.SCHEDULES``. The engine never asks which schedule it holds: the rounds, their
phases and their tasks are the schedule's (``schedules/``), a phase's state is its own
(``phase.py``), and the schedule sees the server only through a ``RunContext``.

Everything runs on one asyncio loop; aggregation and checkpoint writes run in worker
threads under ``agg_lock`` so the running sum is never touched by two uploads at once
and never after its phase has closed. The transfer pipelines (``sessions.py``,
``uploads.py``, ``downloads.py``) reach it through the questions below; history and
checkpoints are ``history.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from typing import Any

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods.base import Method
from fedattn_shared.wire.accounting import ByteMeter

from .drivers import PhaseDriver, SecAggPlus, round_plan
from .edges import EdgeBook
from .gate import UploadGate
from .history import RunHistory, Snapshot, run_config, tensors_digest
from .initial import initial_payload
from .metrics import ServerMetrics
from .phase import Phase
from .schedules import RunContext, Schedule, schedule_for
from .secagg import SecAggDriver

log = logging.getLogger("fl_server")


class Engine:
    """Holds the run's parts and its schedule. The transfer pipelines reach it through
    the questions below, which are the schedule's."""

    def __init__(self, server: ServerConfig, train: TrainConfig, method: Method,
                 meter: ByteMeter, metrics: ServerMetrics):
        self.cfg, self.train, self.method = server, train, method
        self.meter, self.metrics = meter, metrics
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
        self.finished = False
        self.stopping = False  # the server is shutting down: waiting calls end now
        self.config_json = run_config(server, train, method,
                                      self.secagg.policy if self.secagg is not None else None)
        self.context = RunContext(
            cfg=server, train=train, method=method, models=self.models, plan=self.plan,
            aggregator=self.aggregator, edges=self.edges, metrics=metrics, meter=meter,
            runlog=self.runlog, agg_lock=self.agg_lock, init_payload=self.init_payload,
            instance=secrets.token_hex(4), snapshot=self.snapshot)
        # ValueError (exit 2): a mode the method cannot run (async: one that needs rounds).
        self.schedule: Schedule = schedule_for(server.mode, self.context)
        self.gate = UploadGate(server, train, method, self.edges, self.aggregator, metrics,
                               self.agg_lock, self.runlog.durable, self.schedule.taken)

    @property
    def log_every(self) -> float:
        """Seconds between "k/n results in" lines (fl-server --log-every)."""
        return self.context.log_every

    @log_every.setter
    def log_every(self, seconds: float) -> None:
        """Set by ``fl-server --log-every``; the schedule reads it."""
        self.context.log_every = seconds

    @property
    def round(self) -> int:
        """The last round (``--mode async``: version) applied."""
        return self.context.round

    @property
    def state_version(self) -> int:
        """How often the global changed (the common downlink's id carries it)."""
        return self.context.state_version

    @property
    def phase(self) -> Phase | None:
        """The phase every edge's results go to, when the schedule has one."""
        return self.schedule.phase

    # ---- state ------------------------------------------------------------------------
    def resume(self) -> None:
        """Continues the run from its latest checkpoint (``--resume``)."""
        round_number, tensors, state = self.runlog.load(self.fingerprint,
                                                        json.loads(self.config_json))
        self.aggregator.load_state(tensors, state["aggregator"])
        self.edges.load_json(state["registry"])
        self.context.round = round_number
        self.context.task_counter = int(state["task_counter"])
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
            "registry": self.edges.to_json(), "task_counter": self.context.task_counter,
        }
        tensors = self.aggregator.state_tensors()  # live: nothing aggregates until written
        return self.runlog.snapshot(self.context.round, tensors, state)

    async def durable(self) -> None:
        """Waits until the last round's checkpoint is on disk; re-raises its failure."""
        await self.runlog.durable()

    # The pipelines ask the schedule (``schedule.task_for``, ``task_of``, ``has_work``,
    # ``phase_for``, ``lose``) and drop through ``context.drop``: no forwards here.

    # ---- the run ------------------------------------------------------------------------
    async def run(self) -> None:
        """Runs the schedule until ``--rounds`` are applied and their checkpoint is on
        disk; then every waiting edge hears that the run is over."""
        self.metrics.rounds_planned.set(self.cfg.rounds)
        self.metrics.init_phases([driver.name for driver in self.plan])
        if self.method.dp is not None and self.method.dp.target_epsilon:
            self.metrics.export_dp_budget(self.method.dp.target_epsilon)
        self.metrics.round.set(self.round)
        await self.schedule.run()
        await self.durable()
        self.finished = True
        self.edges.wake_all()
        log.info("run finished after %d rounds", self.round)

"""Synchronous rounds (``--mode sync``): a round is the plan of phase drivers run in order
(``drivers.py``); each phase sends tasks to the round's edges, waits for a quorum of
results or its deadline, and closes.

Nothing an edge sends and nothing a method raises ends the process. A phase that cannot
close (its driver raises, or the new state holds a non-finite or beyond-float32 value)
aborts its round: the aggregator returns to its state before the round (nothing of the
round is applied), the history records ``"aborted"`` with the reason, and the next round
runs. The rounds run drivers without knowing what they are: secure aggregation is a
wrapper that expanded the plan.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..drivers import PhaseDriver
from ..memory import log_memory, trim_heap
from ..phase import Phase, RoundAborted, RoundState, select_edges
from .base import OnePhase

log = logging.getLogger("fl_server")


class Rounds(OnePhase):
    """Rounds of the plan, one phase open at a time (``self.phase``), every round started
    with at least --min-edges connected (as Flower's min_available_clients)."""

    # ---- rounds -------------------------------------------------------------------------
    async def run(self) -> None:
        """Rounds until ``--rounds``."""
        ctx = self.ctx
        while ctx.round < ctx.cfg.rounds:
            await ctx.edges.wait_for(ctx.cfg.min_edges)
            await self.run_round(ctx.round + 1)
        self.phase = None

    async def run_round(self, round_number: int) -> None:
        """Runs the plan's drivers in order. Non-evaluation phases go to the selected
        edges (minus those an earlier phase of the round lost); evaluation goes to every
        connected edge, every --eval-every rounds and after the last. A phase that cannot
        close aborts the round: the aggregator goes back to its state at the round's start,
        the later aggregating phases are skipped, and evaluation (when due) scores the kept
        global."""
        ctx, plan = self.ctx, self.ctx.plan
        started = time.monotonic()
        selected = select_edges(ctx.edges.connected_ids(), ctx.cfg.fraction,
                                ctx.train.seed, round_number)
        # Wall-clock start: consecutive starts give the full round period, checkpoint included.
        state = RoundState(round_number, {"round": round_number, "started": time.time(),
                                          "aggregate": {}}, list(selected))
        try:
            ctx.aggregator.begin_round(round_number, selected, len(ctx.edges.records))
            for driver in plan:
                driver.begin_round(round_number, ctx.edges)
            # References to the global (no copy); taken before the checkpoint write ends,
            # which only reads the state.
            state.snapshot = ctx.aggregator.snapshot_round()
        except Exception as err:
            state.abort("begin", err, ctx.metrics)
        every = ctx.cfg.eval_every
        eval_due = bool(every) and (round_number % every == 0 or round_number == ctx.cfg.rounds)
        for index, driver in enumerate(plan):
            if driver.traits.evaluates:
                if all(later.traits.evaluates for later in plan[index + 1:]):
                    state.snapshot = None  # nothing left to undo: let the previous global go
                if eval_due:
                    await self.evaluate(driver, state)
            elif not state.aborted and not driver.skipped():
                await self.aggregate(driver, state)
        record = state.record
        record["seconds"] = time.monotonic() - started
        record["bytes"] = ctx.meter.take_round()
        await ctx.durable()  # a round that aggregated nothing did not wait for the last one
        ctx.commit(round_number, record, len(state.participants), len(selected))

    async def evaluate(self, driver: PhaseDriver, state: RoundState) -> None:
        """Every connected edge scores the global; a phase that cannot run loses only the
        scores (``evaluation_skipped``), never the global."""
        try:
            phase = await self.run_phase(driver, state.number, self.ctx.edges.connected_ids())
        except RoundAborted as err:
            state.record["evaluation_skipped"] = str(err)
            log.error("round %d: no evaluation: %s", state.number, err, exc_info=err)
            return
        self.ctx.record_evaluation(state.record, phase)

    async def aggregate(self, driver: PhaseDriver, state: RoundState) -> None:
        """Runs one aggregating phase and closes it; the round's later phases go to the
        edges whose results it took."""
        ctx = self.ctx
        try:
            phase = await self.run_phase(driver, state.number, state.participants)
        except RoundAborted as err:
            if state.snapshot is not None:  # an earlier phase may have changed the state
                async with ctx.agg_lock:
                    await asyncio.to_thread(ctx.aggregator.restore_round, state.snapshot)
            state.abort(driver.name, err, ctx.metrics)
            return
        async with ctx.agg_lock:
            log_memory("round %d %s closing", state.number, driver.name)
            figures, failure = await ctx.close_aggregate(driver.name, driver.close,
                                                         phase.tainted, state.snapshot)
            log_memory("round %d %s closed", state.number, driver.name)
        state.record[driver.name] = phase.summary()
        if failure is not None:
            state.abort(driver.name, failure, ctx.metrics)
            return
        state.record["aggregate"].update(figures)
        state.participants = [e for e in state.participants if e in phase.received]

    async def _log_progress(self, phase: Phase, round_number: int) -> None:
        """A line every ``log_every`` seconds while ``phase`` is open ("k/n results in"):
        a server's log is otherwise silent from the phase's start to its end."""
        if self.ctx.log_every <= 0:
            return
        while True:
            await asyncio.sleep(self.ctx.log_every)
            log.info("round %d %s: %d/%d results in, %d dropped, quorum %d, open %.0fs",
                     round_number, phase.name, len(phase.received), len(phase.tasks),
                     len(phase.dropped), phase.quorum, time.monotonic() - phase.started)

    async def run_phase(self, driver: PhaseDriver, round_number: int, edges: list[str]) -> Phase:
        """Sends the phase's tasks and waits for its quorum or deadline; then closes it to
        uploads (those still streaming stop) and counts the edges that did not answer."""
        ctx = self.ctx
        phase = self.phase = await ctx.open(driver, round_number, edges)
        log_memory("round %d %s open", round_number, driver.name)
        name = phase.name
        log.info("round %d %s: %d task(s), quorum %d", round_number, name, len(phase.tasks),
                 phase.quorum)
        ctx.wake(edges)
        # While the edges download, the last round's checkpoint finishes (or its failure
        # stops the server here, before anything of this round is aggregated).
        await ctx.durable()
        phase.maybe_close()
        progress = asyncio.create_task(self._log_progress(phase, round_number))
        try:
            await asyncio.wait_for(phase.done.wait(),
                                   timeout=driver.deadline() or ctx.cfg.round_timeout)
        except asyncio.TimeoutError:
            ctx.metrics.phase_timeouts.labels(name).inc()
            for edge in phase.pending():
                ctx.drop(phase, edge, "deadline")
        finally:
            progress.cancel()
        async with ctx.agg_lock:
            ctx.close(phase)
        trim_heap()  # the common frames went with the close
        ctx.metrics.participants.labels(name).set(len(phase.received))
        ctx.metrics.phase_seconds.labels(name).observe(time.monotonic() - phase.started)
        return phase

"""A new mode is one file and one name in a table: a third schedule, written against
``fl_server.schedules.base.Schedule`` and its ``RunContext`` alone, registered in
``SCHEDULES`` and picked by ``--mode``, runs a real server that real gRPC edges talk to.

The schedule here scores the initial global once on every connected edge (a fleet's
baseline before any training): one evaluation phase, recorded as round 1 and
checkpointed, then the run ends. It writes only ``run``: the servicer's questions
(``task_for``, ``task_of``, ``has_work``, ``phase_for``, ``lose``) are those of any
schedule with one phase open at a time (``OnePhase``), and the steps are the context's
(open, drop, close, record the evaluation, commit); it touches nothing of the engine,
which never learns which schedule it holds.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import read_history, serving, wait_for
from rawedge import RawEdge

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fl_server import schedules
from fl_server.app import ServerApp
from fl_server.schedules.base import OnePhase


class EvaluateOnce(OnePhase):
    """Every edge connected once --min-edges are scores the initial global; that is the
    run (one record, ``round`` 1)."""

    async def run(self) -> None:
        ctx = self.ctx
        await ctx.edges.wait_for(ctx.cfg.min_edges)
        started = time.monotonic()
        evaluator = next(driver for driver in ctx.plan if driver.traits.evaluates)
        edges = ctx.edges.connected_ids()
        phase = self.phase = await ctx.open(evaluator, 1, edges)
        ctx.wake(edges)
        phase.maybe_close()
        try:
            await asyncio.wait_for(phase.done.wait(), timeout=ctx.cfg.round_timeout)
        except asyncio.TimeoutError:
            pass
        async with ctx.agg_lock:
            ctx.close(phase)
        record = {"round": 1, "started": time.time(), "aggregate": {},
                  "seconds": time.monotonic() - started}
        ctx.record_evaluation(record, phase)
        record["bytes"] = ctx.meter.take_round()
        ctx.commit(1, record, len(phase.received), len(edges))


@pytest.fixture
def app(tmp_path, monkeypatch):
    monkeypatch.setitem(schedules.SCHEDULES, "evaluate-once", EvaluateOnce)
    train = TrainConfig(model="lenet-bn")
    method = load_method("fedavg")(MethodContext(train, load_method("fedavg").Params()))
    return ServerApp(ServerConfig(method="fedavg", mode="evaluate-once", rounds=1, min_edges=2,
                                  eval_every=1, host="127.0.0.1", port=0, round_timeout=60,
                                  checkpoint_dir=str(tmp_path / "server")), train, method)


def test_a_schedule_registered_by_name_runs_a_real_server_end_to_end(app, tmp_path):
    assert isinstance(app.engine.schedule, EvaluateOnce)
    with serving(app) as port:
        scorer, leaver = RawEdge(port, "scorer"), RawEdge(port, "leaver")
        try:
            scorer.connect()
            leaver.connect()
            tasks = {edge: edge.next_task() for edge in (scorer, leaver)}
            for task in tasks.values():
                assert (task.header.phase, task.header.round) == ("evaluate", 1)
            assert tasks[scorer].globals  # the initial global, to score
            assert scorer.submit(scorer.evaluation(tasks[scorer])).accepted
            leaver.leave()  # its task is the schedule's to drop (``lose``): the phase ends
            wait_for(lambda: app.engine.finished, 60, "the run's end")
        finally:
            scorer.close()
            leaver.close()
    (record,) = read_history(tmp_path / "server")["rounds"]
    assert record["round"] == 1
    assert record["evaluate"]["received"] == [scorer.edge_id]
    assert record["evaluate"]["dropped"] == {leaver.edge_id: "left: bad-input suite"}
    assert list(record["evaluation"]["per_edge"]) == [scorer.edge_id]
    assert record["evaluation"]["summary"]["test"]["pooled_accuracy"] == pytest.approx(0.5)
    assert (tmp_path / "server" / "manifest.json").exists()  # committed: checkpointed


def test_an_unknown_mode_is_refused_by_name(tmp_path):
    train = TrainConfig(model="lenet-bn")
    method = load_method("fedavg")(MethodContext(train, load_method("fedavg").Params()))
    with pytest.raises(ValueError, match="--mode 'nope': not one of sync, async"):
        ServerApp(ServerConfig(method="fedavg", mode="nope", checkpoint_dir=str(tmp_path)),
                  train, method)

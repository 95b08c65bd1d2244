"""Task hints: an idle edge holds its presence stream only, not a NextTask long-poll beside
it (each held call costs the server ~22 KB at 10,000 edges). The server says in its
JoinReply that it sends hints, marks a presence event ``task_ready`` when a task waits or
the run is over, and sends one at once when that may have changed; ``no_wait`` asks once.

The server runs in this process (``serving``) with its periodic presence event pushed out
of the test's reach, so every ``task_ready`` the raw edge hears came from a hint, with no
race against the ten-second repeat."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import serving, wait_for
from rawedge import RawEdge, train_messages

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.wire import fedattn_pb2 as pb
from fl_server.app import ServerApp
from fl_server.edges import Signal

POLL_TIMEOUT = 60.0  # a long-poll would wait this long: a no_wait answer must not


@pytest.fixture
def app(tmp_path):
    train = TrainConfig(model="lenet-bn")
    method = load_method("fedavg")(MethodContext(train, load_method("fedavg").Params()))
    return ServerApp(ServerConfig(method="fedavg", rounds=1, min_edges=2, eval_every=0,
                                  host="127.0.0.1", port=0, poll_timeout=POLL_TIMEOUT,
                                  presence_interval=3600.0, presence_lifetime=0,
                                  checkpoint_dir=str(tmp_path / "server")), train, method)


def test_an_idle_edge_holding_presence_only_hears_of_its_task_and_of_the_run_end(app):
    with serving(app) as port:
        first, second = RawEdge(port, "hint"), RawEdge(port, "hint")
        try:
            first.connect()
            assert first.hints
            # Nothing waits yet (one edge of --min-edges 2): the first event says so, and a
            # no_wait question is answered at once, not after the poll timeout.
            assert [e.task_ready for e in first.presence_events] == [False]
            started = time.monotonic()
            assert first.next_task(no_wait=True).header.status == pb.TaskHeader.WAIT
            assert time.monotonic() - started < POLL_TIMEOUT / 2

            second.connect()  # the round opens: both hear it on their presence streams
            tasks = {}
            for edge in (first, second):
                wait_for(edge.task_ready.is_set, 30, f"a task_ready hint to {edge.edge_id}")
                tasks[edge] = edge.next_task(no_wait=True)
                assert tasks[edge].header.status == pb.TaskHeader.TASK and tasks[edge].globals

            first.task_ready.clear()
            for edge, task in tasks.items():
                assert edge.submit(train_messages(edge, task, task.globals)).accepted
            # The run is over (one round): the edges are told on the stream, and asked
            # once, NextTask says DONE.
            wait_for(first.task_ready.is_set, 30, "the run-over hint")
            request = pb.TaskRequest(edge_id=first.edge_id, session=first.session, no_wait=True)
            (message,) = list(first.stub.NextTask(request, timeout=30))
            assert message.header.status == pb.TaskHeader.DONE
        finally:
            first.close()
            second.close()


def test_signal_wakes_its_waiter_returns_at_once_when_set_and_times_out():
    async def scenario() -> list:
        signal = Signal()
        seen = [await signal.wait(0.01)]  # nothing set: the timeout, False
        signal.set()
        seen.append(await signal.wait(3600))  # already set: at once
        signal.clear()
        waiting = asyncio.ensure_future(signal.wait(3600))
        await asyncio.sleep(0)
        assert not waiting.done()
        signal.set()  # wakes the waiter
        seen.append(await asyncio.wait_for(waiting, 30))
        # A second waiter takes the turn; the first then ends at its own timeout.
        signal.clear()
        first = asyncio.ensure_future(signal.wait(0.05))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(signal.wait(3600))
        await asyncio.sleep(0)
        seen.append(await asyncio.wait_for(first, 30))
        signal.set()
        seen.append(await asyncio.wait_for(second, 30))
        # A cancelled wait leaves nothing behind.
        signal.clear()
        cancelled = asyncio.ensure_future(signal.wait(3600))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        seen.append(signal._waiter is None)
        return seen

    assert asyncio.run(scenario()) == [False, True, True, False, True, True]

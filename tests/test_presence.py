"""The presence stream's life, spoken by hand against a real server (``serving``: gRPC in
this process, so the test can look at the edge book): its heartbeat, its lifetime (the
server ends it with OK, the edge stays present until its new stream opens or the grace is
over) and its grace after a cut, and the bound on what an edge that opens and ends streams
as fast as it can makes the server hold (one grace timer, not one per stream)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings

import grpc
import pytest
from conftest import serving, wait_for
from rawedge import RawEdge

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.transport import DownloadTerms
from fl_edge.transport import PRESENCE_INTERVAL, presence_interval_of
from fl_server.app import ServerApp
from fl_server.sessions import Lapsed


def _app(tmp_path, **presence) -> ServerApp:
    train = TrainConfig(model="lenet-bn")
    method = load_method("fedavg")(MethodContext(train, load_method("fedavg").Params()))
    # min_edges 2 and one edge: no round opens, the stream only says "nothing yet".
    return ServerApp(ServerConfig(method="fedavg", rounds=1, min_edges=2, eval_every=0,
                                  host="127.0.0.1", port=0,
                                  checkpoint_dir=str(tmp_path / "server"), **presence),
                     train, method)


def _connected(app: ServerApp, edge: RawEdge) -> bool:
    return app.engine.edges.records[edge.edge_id].connected


def _grace_timers() -> list[asyncio.TimerHandle]:
    """The grace timers the server's event loop holds (a cancelled one has let go of its
    callback and waits only to be swept from the loop's heap)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on some of torch's objects warns
        warnings.simplefilter("ignore")
        return [h for h in gc.get_objects() if isinstance(h, asyncio.TimerHandle)
                and not h.cancelled() and "lapse" in getattr(h._callback, "__qualname__", "")]


def _stream(edge: RawEdge):
    return edge.stub.Presence(pb.PresenceRequest(edge_id=edge.edge_id, session=edge.session))


def test_heartbeat_lifetime_and_the_edge_present_until_the_grace_is_over(tmp_path):
    app = _app(tmp_path, presence_interval=0.5, presence_lifetime=2.0, presence_grace=0.0)
    with serving(app) as port:
        edge = RawEdge(port, "life")
        try:
            reply = edge.join()
            edge.session = reply.session
            assert reply.presence_interval == 0.5  # the edge learns it at join
            started = time.monotonic()
            events = list(_stream(edge))  # ends by itself, status OK
            lived = time.monotonic() - started
            assert 1.9 <= lived < 10, lived
            assert len(events) >= 4, events  # a heartbeat each interval, idle or not
            # Its lifetime ended it: the edge is still present (at least an interval,
            # though presence_grace is 0), and absent once that is over unreopened.
            assert _connected(app, edge)
            wait_for(lambda: not _connected(app, edge), 15, "absent after the interval")
            # A new stream makes it present again.
            call = _stream(edge)
            next(call)
            assert _connected(app, edge)
            call.cancel()
            # presence_grace 0: a cut stream is absent at once, as before.
            wait_for(lambda: not _connected(app, edge), 15, "absent at once after a cut")
        finally:
            edge.channel.close()


def test_a_cut_stream_reopened_within_the_grace_keeps_the_edge_present(tmp_path):
    app = _app(tmp_path, presence_interval=0.5, presence_lifetime=0.0, presence_grace=3.0)
    with serving(app) as port:
        edge = RawEdge(port, "cut")
        try:
            edge.session = edge.join().session
            first = _stream(edge)
            next(first)
            first.cancel()  # what a proxy's cut looks like from the server
            time.sleep(1.0)  # within the grace: still present (bounded by the 3 s grace)
            assert _connected(app, edge)
            second = _stream(edge)
            next(second)
            time.sleep(3.5)  # past the first stream's grace: its timer must not fire
            assert _connected(app, edge)
            second.cancel()
            wait_for(lambda: not _connected(app, edge), 15, "absent once the grace is over")
        finally:
            edge.channel.close()


def test_the_lifetime_waits_while_the_edge_has_a_transfer_open(tmp_path):
    # A 1 s lifetime, but the edge holds a NextTask long poll (4 s) open: the stream ends
    # only after the poll answered (on a slow link its new request would queue behind the
    # transfer's bytes and outlast the grace).
    app = _app(tmp_path, presence_interval=0.3, presence_lifetime=1.0, presence_grace=0.0,
               poll_timeout=4.0)
    with serving(app) as port:
        edge = RawEdge(port, "busy")
        try:
            reply = edge.join()
            edge.session = reply.session
            terms = DownloadTerms.of(reply)
            call = _stream(edge)
            next(call)
            polled = {}

            def poll() -> None:
                request = pb.TaskRequest(edge_id=edge.edge_id, session=edge.session)
                polled["answer"] = list(edge.stub.NextTask(request, timeout=terms.deadline(False)))
                polled["at"] = time.monotonic()

            poller = threading.Thread(target=poll)
            poller.start()
            list(call)  # to the stream's end (status OK)
            ended = time.monotonic()
            poller.join(timeout=30)
            assert polled["answer"][0].header.status == pb.TaskHeader.WAIT
            assert ended >= polled["at"] - 0.05, (ended, polled["at"])
        finally:
            edge.channel.close()


@pytest.mark.timeout(120)
def test_streams_opened_and_ended_in_a_storm_hold_one_grace_timer(tmp_path):
    # An attacker with a valid session opens a presence stream and ends it, 300 times as
    # fast as it can, under a long grace: each end lapses the edge, each open replaces
    # the lapse. The server holds one grace timer for it (the markers of the others are
    # gone), the edge counts once, and no stream outlives its cancel.
    app = _app(tmp_path, presence_interval=0.5, presence_lifetime=0.0, presence_grace=600.0)
    with serving(app) as port:
        edge = RawEdge(port, "storm")
        try:
            edge.session = edge.join().session
            for _ in range(300):
                call = _stream(edge)
                next(call)
                call.cancel()
            record = app.engine.edges.records[edge.edge_id]
            wait_for(lambda: isinstance(record.presence, Lapsed), 15, "the last stream's end")
            assert len(_grace_timers()) == 1
            assert app.engine.edges.connected_count() == 1
            marker = record.presence
            again = _stream(edge)  # the edge is back: the marker and its timer go
            next(again)
            assert record.presence is not None and not isinstance(record.presence, Lapsed)
            assert marker.timer is None and not _grace_timers()
            again.cancel()
        finally:
            edge.channel.close()


def test_a_presence_request_for_an_ended_session_is_refused(tmp_path):
    app = _app(tmp_path, presence_interval=0.5, presence_lifetime=0.0, presence_grace=600.0)
    with serving(app) as port:
        edge = RawEdge(port, "gone")
        try:
            edge.session = edge.join().session
            edge.join()  # a new session: the old one is over
            with pytest.raises(grpc.RpcError) as err:
                next(_stream(edge))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            edge.channel.close()


def test_the_edge_holds_a_hostile_presence_interval_to_sane_bounds():
    # A server's JoinReply is network input: an interval that would spin the edge's
    # watchdog (0, negative, NaN) or make it deaf (inf, a year) is held in bounds.
    cases = {0.0: PRESENCE_INTERVAL, -5.0: PRESENCE_INTERVAL, float("nan"): PRESENCE_INTERVAL,
             float("inf"): PRESENCE_INTERVAL, 1e-9: 0.1, 3.15e7: 3600.0, 2.5: 2.5}
    for sent, held in cases.items():
        assert presence_interval_of(pb.JoinReply(presence_interval=sent)) == held, sent

"""Task downloads across a lost link, on a real fl-server spoken to as an attacker would
(``RawEdge``): an edge that went in the middle of its task download keeps its task for
``--transfer-resume-expiry`` seconds after the last byte it was sent, comes back in a new
session and goes on from the byte it holds (no byte sent twice); one that never comes back
is dropped at the expiry, not held past it. What one identity can make the server hold
this way: its one task (a download is one per edge), for the expiry at most.

The hold used to end at the download idle timeout (30 s): a link dark for longer than the
server's keepalive ping took (closing the connection) and a reconnect cost the edge its
task (measured over a link cut for 20 s: ``bench/links.py --variants cuts``).
"""

from __future__ import annotations

import time

from rawedge import RawEdge
from test_adversarial import raw_fleet
from test_resume_daemons import raw_down

from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.transport import MAX_MESSAGE_BYTES, PayloadAssembler

CHUNK = 16384  # --chunk-bytes and --download-window: one chunk per NextTask call
EXPIRY = 10.0  # --transfer-resume-expiry
IDLE = 1.0  # --download-idle-timeout (what bounded the hold before)
CAP = 64 << 20  # the largest downlink the raw edges take


def first_window(edge: RawEdge) -> tuple[pb.TaskHeader, list[PayloadAssembler]]:
    """The task's header and its first window (one chunk), as a first NextTask call."""
    request = pb.TaskRequest(edge_id=edge.edge_id, session=edge.session)
    header, assemblers = None, []
    for message in edge.stub.NextTask(request, timeout=edge.terms.deadline(False)):
        if message.HasField("header"):
            header = message.header
            assert header.status == pb.TaskHeader.TASK, header
            assemblers = [PayloadAssembler(m, CAP, MAX_MESSAGE_BYTES)
                          for m in (header.common, header.personal)]
            continue
        next(a for a in assemblers if not a.complete).add(message.data)
    assert header is not None and sum(a.received for a in assemblers) == CHUNK
    return header, assemblers


def test_an_edge_gone_mid_download_keeps_its_task_until_the_expiry(tmp_path):
    with raw_fleet(tmp_path, ("back", "gone"), "--min-edges", "2", "--rounds", "2",
                   "--round-timeout", "120", "--chunk-bytes", str(CHUNK),
                   "--download-window", str(CHUNK), "--download-idle-timeout", str(IDLE),
                   "--transfer-resume-expiry", str(EXPIRY)) as (cluster, (back, gone)):
        server = cluster.procs[0]
        mark = server.mark()
        windows = {edge.edge_id: first_window(edge) for edge in (back, gone)}
        for edge in (back, gone):  # the link goes: the presence stream and the channel
            edge.close()
        left = time.monotonic()
        for edge in (back, gone):
            server.logged(mark, f"edge {edge.edge_id} disconnected: its task stands")
        # Past the idle timeout and its recheck (where the hold ended before): both stand.
        time.sleep(IDLE + 3)
        assert "dropped" not in server.log()[mark:], server.log()[mark:]
        back.reconnect()  # a new connection and a new session
        header, assemblers = windows[back.edge_id]
        back.rest(header, assemblers)
        for assembler in assemblers:
            assembler.finish()
        total = sum(len(a.buffer) for a in assemblers)
        assert raw_down(server.metrics_port, back.edge_id) == total  # none twice
        # The one that never came back goes at the expiry: not before, not held past it.
        line = server.logged(mark, f"dropped {gone.edge_id}", "disconnected",
                             timeout=EXPIRY + 30)
        assert time.monotonic() - left >= EXPIRY - 1, line
        assert f"dropped {back.edge_id}" not in server.log()[mark:]


def test_the_hold_counts_from_the_calls_end_not_the_last_chunk_handed_out(tmp_path):
    # On a slow link a chunk handed to gRPC takes its size over the rate to leave (128 s
    # for 1 MiB at 64 kbit/s): the edge's call is open all that while. Here the edge
    # takes the header and one chunk and then reads nothing for longer than the expiry,
    # its call open, before the link goes. Its task must stand for the expiry after the
    # call ended (measured over a real 64 kbit/s link: a cut there cost the task).
    # ResNet-18 (44.7 MB) in one window, more than the client's buffers take unread: the
    # server's sends wait for the edge, as a chunk's does on a slow link.
    with raw_fleet(tmp_path, ("slow", "other"), "--min-edges", "2", "--rounds", "2",
                   "--model", "resnet18-cifar", "--round-timeout", "120",
                   "--download-window", str(64 << 20),
                   "--download-idle-timeout", "30",
                   "--transfer-resume-expiry", "6") as (cluster, (slow, other)):
        server = cluster.procs[0]
        mark = server.mark()
        request = pb.TaskRequest(edge_id=slow.edge_id, session=slow.session)
        call = slow.stub.NextTask(request, timeout=slow.terms.deadline(False))
        header = next(call).header
        assert header.status == pb.TaskHeader.TASK
        assemblers = [PayloadAssembler(m, CAP, MAX_MESSAGE_BYTES)
                      for m in (header.common, header.personal)]
        assemblers[0].add(next(call).data)
        time.sleep(9)  # longer than the expiry since the server handed out its chunks
        call.cancel()
        slow.close()  # the link goes
        server.logged(mark, f"edge {slow.edge_id} disconnected: its task stands")
        time.sleep(1)
        slow.reconnect()
        slow.rest(header, assemblers)  # the task is still the edge's: it goes on
        assert f"dropped {slow.edge_id}" not in server.log()[mark:], server.log()[mark:]

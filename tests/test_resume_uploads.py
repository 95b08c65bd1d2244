"""Resumable uploads on a real fl-server, spoken to as an attacker would (``RawEdge``): an
upload cut short is held (its spool file and positions) and resumed from the byte held,
the signature binding the whole body end to end; and what one identity can make the
server hold with it is bounded: one partial per identity, none of another edge's, no
offset the server does not hold, none kept past its expiry.
"""

from __future__ import annotations

import os
import re
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import wait_for
from rawedge import UPLOAD_CHUNK, RawEdge, Task, raw_layout, shifted, stream
from test_adversarial import raw_fleet
from test_bad_input import assert_single_upload_mean

from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.signing import BodyMac, sign_submission

EXPIRY = 3.0  # --transfer-resume-expiry of the expiry test


def offset_of(edge: RawEdge, task: Task, edge_id: str | None = None) -> pb.UploadOffsetReply:
    """The server's UploadOffset answer for ``task`` (as ``edge``, naming ``edge_id``)."""
    header = task.header
    return edge.stub.UploadOffset(pb.UploadOffsetRequest(
        edge_id=edge_id or edge.edge_id, session=edge.session, round=header.round,
        phase=header.phase, task_id=header.task_id), timeout=10)


def cut(edge: RawEdge, header: pb.SubmitHeader, chunks: list[bytes], sent: int,
        task: Task, metrics_port: int) -> int:
    """Sends the header and ``sent`` chunks of a signed upload, then cancels the stream
    (the link broke); returns the bytes the server says it holds once it holds them."""
    messages = stream(header, chunks)
    edge.sign(messages)
    release = threading.Event()
    before = raw_up_bytes(metrics_port, edge.edge_id)

    def messages_then_silence():
        yield from messages[: 1 + sent]
        release.wait(60)

    call = edge.stub.Submit.future(messages_then_silence(), timeout=60)
    try:
        wait_for(lambda: raw_up_bytes(metrics_port, edge.edge_id) >= before + sent * UPLOAD_CHUNK,
                 15, "the chunks sent at the server")
    finally:
        call.cancel()
        release.set()
    wait_for(lambda: offset_of(edge, task).held, 15, "the cut upload held")
    return offset_of(edge, task).offset


def resumed(edge: RawEdge, task: Task, chunks: list[bytes], offset: int,
            manifest: pb.PayloadManifest, claim: int | None = None) -> list[pb.SubmitMessage]:
    """A fresh header (new IV) saying ``resume_offset`` (``claim``, else ``offset``),
    MACed and signed over the whole body, then the chunks from ``offset`` only."""
    header = edge.header(task, manifest, resume_offset=offset if claim is None else claim,
                         body_mac_iv=BodyMac.new_iv())
    body = BodyMac(edge.upload_mac_key, header.body_mac_iv)
    for chunk in chunks:
        body.update(chunk)
    header.signature = sign_submission(edge.signing_key, header, body.tag())
    return [pb.SubmitMessage(header=header),
            *(pb.SubmitMessage(data=c) for c in chunks[offset // UPLOAD_CHUNK:])]


def raw_up_bytes(metrics_port: int, edge_id: str) -> int:
    """The data bytes the server counted from ``edge_id`` (every kind, direction up)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    total = 0.0
    for line in text.decode().splitlines():
        if (line.startswith("fedattn_raw_tensor_bytes_total{") and 'direction="up"' in line
                and f'edge="{edge_id}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def spool_files(pid: int, checkpoint: Path) -> int:
    """Files the server process holds open in its upload spool folder (unlinked files:
    one per upload being received or held)."""
    folder = str(checkpoint / "uploads")
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(folder + "/"):
            count += 1
    return count


def server_pid(cluster) -> int:
    return cluster.procs[0].popen.pid


def test_a_cut_upload_resumes_from_the_bytes_held_and_the_mean_is_the_uploads(tmp_path):
    with raw_fleet(tmp_path, ("cut",), "--min-edges", "1", "--rounds", "3",
                   "--round-timeout", "120") as (cluster, (edge,)):
        task = edge.next_task()
        upload = shifted(task.globals, 1.5)
        header, chunks = raw_layout(edge, task, upload)
        assert len(chunks) > 3
        assert not offset_of(edge, task).held  # nothing cut yet
        held = cut(edge, header, chunks, 2, task, cluster.procs[0].metrics_port)
        assert held == 2 * UPLOAD_CHUNK
        reply = offset_of(edge, task)
        assert reply.total_bytes == header.payload.total_bytes
        mark = cluster.procs[0].mark()
        answer = edge.stub.Submit(iter(resumed(edge, task, chunks, held, header.payload)),
                                  timeout=30)
        assert answer.accepted, answer.reason
        cluster.procs[0].logged(mark, f"{edge.edge_id} resumes its upload at byte {held}")
        # Every byte counted once: the bytes held were not sent again.
        assert raw_up_bytes(cluster.procs[0].metrics_port, edge.edge_id) == \
            header.payload.total_bytes
        after = edge.next_task()
        assert after.header.round == task.header.round + 1
        assert_single_upload_mean(after.globals, upload)


def test_a_resume_is_refused_unless_it_continues_the_very_bytes_held(tmp_path):
    # Offsets the server does not hold, another manifest, another edge's partial: each
    # refused by name, the partial kept for the honest resume that follows.
    with raw_fleet(tmp_path, ("owner", "other"), "--min-edges", "2", "--rounds", "3",
                   "--round-timeout", "120") as (cluster, (owner, other)):
        task, other_task = owner.next_task(), other.next_task()
        upload = shifted(task.globals, 0.5)
        header, chunks = raw_layout(owner, task, upload)
        held = cut(owner, header, chunks, 3, task, cluster.procs[0].metrics_port)
        for claim in (held + UPLOAD_CHUNK, held - UPLOAD_CHUNK, held + 1):
            reply = owner.stub.Submit(iter(resumed(owner, task, chunks, held, header.payload,
                                                   claim=claim)), timeout=30)
            assert not reply.accepted
            assert f"the server holds {held} bytes of this upload" in reply.reason, reply.reason
        # Another manifest at the held offset (one that passes the gate's schema check:
        # it differs only in a field an upload leaves unused).
        other_manifest = pb.PayloadManifest()
        other_manifest.CopyFrom(header.payload)
        other_manifest.crc32 = 7
        reply = owner.stub.Submit(iter(resumed(owner, task, chunks, held, other_manifest)),
                                  timeout=30)
        assert not reply.accepted and "not the held upload's" in reply.reason, reply.reason
        # Another identity: it sees nothing of the owner's partial, and cannot name it.
        assert not offset_of(other, task).held
        with pytest.raises(grpc.RpcError) as err:
            offset_of(other, task, edge_id=owner.edge_id)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = other.stub.Submit(iter(resumed(other, other_task, chunks, held,
                                               header.payload)), timeout=30)
        assert not reply.accepted and "holds no cut upload" in reply.reason, reply.reason
        # The owner's partial is untouched by all of it: the honest resume completes.
        assert offset_of(owner, task).offset == held
        reply = owner.stub.Submit(iter(resumed(owner, task, chunks, held, header.payload)),
                                  timeout=30)
        assert reply.accepted, reply.reason


def test_one_identity_holds_at_most_one_partial(tmp_path):
    # An edge that cuts upload after upload (each from byte 0) must not pile up spool
    # files: a new upload lets the partial it held go.
    with raw_fleet(tmp_path, ("piler",), "--min-edges", "1", "--rounds", "3",
                   "--round-timeout", "120") as (cluster, (edge,)):
        task = edge.next_task()
        header, chunks = raw_layout(edge, task, shifted(task.globals, 1.0))
        pid, checkpoint = server_pid(cluster), tmp_path / "server-state"
        assert spool_files(pid, checkpoint) == 0
        for attempt in range(4):
            fresh = edge.header(task, header.payload)  # from byte 0, a fresh IV each time
            cut(edge, fresh, chunks, 1 + attempt % 2, task, cluster.procs[0].metrics_port)
            assert spool_files(pid, checkpoint) == 1, f"attempt {attempt}"
        reply = edge.stub.Submit(iter(resumed(edge, task, chunks, offset_of(edge, task).offset,
                                              header.payload)), timeout=30)
        assert reply.accepted, reply.reason
        wait_for(lambda: spool_files(pid, checkpoint) == 0, 15, "the spool file let go")


def test_a_partial_expires_with_its_task(tmp_path):
    # Cutting its upload keeps an edge's task only until the expiry: then the partial
    # goes (its spool file closed), the task is dropped, and a resume is refused.
    with raw_fleet(tmp_path, ("lingerer", "honest"), "--min-edges", "2", "--rounds", "3",
                   "--round-timeout", "120", "--transfer-resume-expiry", str(EXPIRY)
                   ) as (cluster, (edge, honest)):
        task, honest_task = edge.next_task(), honest.next_task()
        header, chunks = raw_layout(edge, task, shifted(task.globals, 1.0))
        pid, checkpoint = server_pid(cluster), tmp_path / "server-state"
        mark = cluster.procs[0].mark()
        held = cut(edge, header, chunks, 1, task, cluster.procs[0].metrics_port)
        cluster.procs[0].logged(mark, f"dropped {edge.edge_id}",
                                f"its cut upload was not resumed within {EXPIRY:g}s",
                                timeout=EXPIRY + 30)
        assert not offset_of(edge, task).held
        assert spool_files(pid, checkpoint) == 0
        reply = edge.stub.Submit(iter(resumed(edge, task, chunks, held, header.payload)),
                                 timeout=30)
        assert not reply.accepted
        assert re.search(r"dropped|holds no cut upload|stale|not .*task", reply.reason), \
            reply.reason
        upload = shifted(honest_task.globals, 2.0)
        honest_header, honest_chunks = raw_layout(honest, honest_task, upload)
        messages = stream(honest_header, honest_chunks)
        assert honest.submit(messages).accepted
        after = honest.next_task()
        assert_single_upload_mean(after.globals, upload)


def test_a_partial_goes_when_its_phase_closes(tmp_path):
    # A cut upload is held only while its phase is open: the phase closing at its quorum
    # lets the spool file go at once, not at the expiry.
    with raw_fleet(tmp_path, ("cut", "fast"), "--min-edges", "2", "--quorum", "1",
                   "--rounds", "3", "--round-timeout", "120") as (cluster, (edge, fast)):
        task, fast_task = edge.next_task(), fast.next_task()
        header, chunks = raw_layout(edge, task, shifted(task.globals, 1.0))
        pid, checkpoint = server_pid(cluster), tmp_path / "server-state"
        cut(edge, header, chunks, 2, task, cluster.procs[0].metrics_port)
        assert spool_files(pid, checkpoint) == 1
        upload = shifted(fast_task.globals, 2.0)
        fast_header, fast_chunks = raw_layout(fast, fast_task, upload)
        assert fast.submit(stream(fast_header, fast_chunks)).accepted
        wait_for(lambda: spool_files(pid, checkpoint) == 0, 15, "the partial let go")
        assert not offset_of(edge, task).held

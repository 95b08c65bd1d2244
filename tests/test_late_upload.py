"""Train now, upload later (``--mode async``, issue #42): a real fl-edge loses its link to
a real fl-server between training and upload (a TCP relay the test cuts, ``cutproxy.py``),
keeps its result on disk (``fl_edge.pending``), and sends it when the link is back. While
its version is within ``--max-staleness`` the server takes it back (the task it had
dropped as disconnected) into the buffer; beyond, the server refuses it naming why and
the edge logs that. The other edge is a raw one the test drives, so that exactly two
versions pass while the link is down.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import torch
from conftest import Cluster, read_history, wait_for, write_edge_dirs
from cutproxy import CutProxy
from rawedge import RawEdge, train_messages
from test_async import _change

from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.state import StateError
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.serialize import encode
from fl_edge.pending import PendingUpload, clear_pending, load_pending, pending_path, save_pending, spare_path


@pytest.mark.parametrize("staleness, taken", [(5, True), (1, False)])
def test_a_result_the_link_lost_goes_up_when_the_edge_is_back(tmp_path, staleness, taken):
    data = write_edge_dirs(tmp_path, 1, per_edge=60)[0]
    cluster = Cluster(tmp_path)
    raw: RawEdge | None = None
    relay: CutProxy | None = None
    try:
        server = cluster.server("--method", "fedavg", "--mode", "async", "--eval-every", "0",
                                "--local-epochs", "1", "--rounds", "3", "--min-edges", "2",
                                "--buffer", "1", "--max-staleness", str(staleness))
        raw = RawEdge(cluster.port, "fast")
        raw.connect()
        relay = CutProxy(cluster.port)
        # --throttle: the task takes 6x its time, all of it in the "training" state
        # (/healthz) and before the upload: the link is cut then.
        late = cluster.edge(data, "late", "--throttle", "6", "--metrics-port", "0",
                            port=relay.port)
        first = raw.next_task()
        assert first.header.round == 1
        late.wait_log("metrics on :")
        port = re.search(r"metrics on :(\d+)", late.log()).group(1)
        health = f"http://127.0.0.1:{port}/healthz"
        wait_for(lambda: json.loads(urllib.request.urlopen(health).read())["state"] == "training",
                 120, "the late edge training", interval=0.02)
        relay.cut()
        server.wait_log("edge late disconnected")
        # Two versions pass while the edge is away.
        reply = raw.submit(train_messages(raw, first, _change(first, 0.01), num_examples=5))
        assert reply.accepted, reply.reason
        second = raw.next_task()  # on version 1
        assert second.header.round == 2
        reply = raw.submit(train_messages(raw, second, _change(second, 0.01), num_examples=5))
        assert reply.accepted, reply.reason
        late.wait_log("the result is kept in", timeout=300)
        assert (tmp_path / "state-late" / "upload.pending").exists()
        relay.restore()
        if taken:
            late.wait_log("the kept result was accepted", timeout=120)
        else:
            late.wait_log("the kept result was dropped by the server: too stale", timeout=120)
        # The kept result is gone (the edge may already keep its next task's upload
        # there: it trains again at once).
        kept = load_pending(pending_path(tmp_path / "state-late"))
        assert kept is None or kept.header.round > 1, kept.header
        assert late.wait(timeout=300) == 0
        assert server.wait(timeout=60) == 0
    finally:
        for closable in (raw, relay):
            if closable is not None:
                closable.close()
        cluster.close()
    rounds = read_history(tmp_path / "server-state")["rounds"]
    contributors = [record["train"]["contributors"] for record in rounds]
    assert [c[0]["edge"] for c in contributors[:2]] == [raw.edge_id, raw.edge_id]
    (last,) = contributors[2]
    if taken:  # trained on version 0, applied as version 3: two versions stale
        assert (last["edge"], last["from_version"], last["staleness"]) == ("late", 0, 2)
        assert "back with the result of task" in server.log()
    else:  # refused by name; the edge then trained again on version 2
        assert (last["edge"], last["from_version"]) == ("late", 2)
        assert "too stale: the result started from version 0" in server.log()


def test_the_kept_upload_loads_exactly_what_the_upload_carries(tmp_path):
    """A kept result loads bit for bit (body, header fields, sums, labels); a body the disk
    damaged is refused naming the file, never signed and sent."""
    upload = Payload([Section(Kind.SHARED_TENSORS, "", {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "n": torch.tensor([7], dtype=torch.int64)})])
    encoded = encode(upload, checksum=False)
    evaluation = [pb.EvaluationResult(split="test", num_classes=2, correct=3, total=5)]
    header = pb.SubmitHeader(round=4, task_id=17, phase="train", task_nonce=b"n" * 16,
                             num_examples=31, payload=encoded.manifest, evaluation=evaluation,
                             metrics={"train_loss": 0.5})
    path = pending_path(tmp_path)
    save_pending(path, PendingUpload(header, encoded, {"shared_tensors": ("int8", 48)}))
    kept = load_pending(path)
    assert kept.header == header and kept.coded == {"shared_tensors": ("int8", 48)}
    body = b"".join(bytes(v) for views in kept.encoded.section_views for v in views)
    assert body == b"".join(bytes(v) for views in encoded.section_views for v in views)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    with pytest.raises(StateError, match="CRC-32"):
        load_pending(path)


def test_an_answered_upload_leaves_its_file_for_the_next_to_overwrite_in_place(tmp_path):
    """Answered, the kept upload's file becomes the spare, and the next upload is written
    over its blocks (the same inode), cut to its own length, loading bit for bit; a
    fresh file per upload cost an edge up to 135 ms of CPU a round (pending.py)."""
    def upload(n: int) -> PendingUpload:
        tensors = {"w": torch.arange(n, dtype=torch.float32)}
        encoded = encode(Payload([Section(Kind.SHARED_TENSORS, "", tensors)]), checksum=False)
        header = pb.SubmitHeader(round=n, task_id=n, phase="train", task_nonce=b"n" * 16,
                                 num_examples=3, payload=encoded.manifest)
        return PendingUpload(header, encoded, {})

    path = pending_path(tmp_path)
    save_pending(path, upload(4096))
    first = path.stat().st_ino
    clear_pending(path)
    assert not path.exists() and spare_path(path).stat().st_ino == first
    save_pending(path, upload(100))  # shorter: the old bytes beyond it are cut
    assert path.stat().st_ino == first and not spare_path(path).exists()
    assert path.stat().st_mode & 0o777 == 0o600
    kept = load_pending(path)
    assert kept.header.round == 100
    body = b"".join(bytes(v) for views in kept.encoded.section_views for v in views)
    assert body == torch.arange(100, dtype=torch.float32).numpy().tobytes()
    clear_pending(path)
    clear_pending(path)  # nothing pending: nothing to do
    assert load_pending(path) is None and spare_path(path).exists()


def test_only_a_task_lost_with_the_link_comes_back_and_only_once(tmp_path):
    """As an attacker speaks it: a task dropped because its session went (a rejoin) takes
    its result back once, a second copy is a duplicate; a task the edge declined, or
    any drop other than a lost link, stays dropped."""
    cluster = Cluster(tmp_path)
    edges: list[RawEdge] = []
    try:
        cluster.server("--method", "fedavg", "--mode", "async", "--eval-every", "0",
                       "--rounds", "2", "--min-edges", "2", "--buffer", "2")
        back, decliner = edges = [RawEdge(cluster.port, p) for p in ("back", "decliner")]
        for edge in edges:
            edge.connect()
        for edge in edges:  # the phase is open (asked before it was, a no_wait call says WAIT)
            wait_for(edge.task_ready.is_set, 30, f"a task_ready hint to {edge.edge_id}")
        # no_wait calls only: after a long poll on the same channel, the next call's
        # 188 s deadline was seen by the server as 194 s (grpcio 1.85) and refused.
        lost, declined = back.next_task(no_wait=True), decliner.next_task(no_wait=True)
        assert lost.header.status == declined.header.status == pb.TaskHeader.TASK
        back.session = back.join().session  # a new session: the task is dropped, "rejoined"
        request = pb.TaskRequest(edge_id=decliner.edge_id, session=decliner.session,
                                 no_wait=True, decline=pb.DECLINE_DATA_BUDGET)
        # The task waits for the decliner (has_work), so the decline gives it up.
        (answer,) = decliner.stub.NextTask(request, timeout=decliner.terms.deadline(True))
        assert answer.header.status == pb.TaskHeader.WAIT
        reply = back.submit(train_messages(back, lost, _change(lost, 0.01), num_examples=5))
        assert reply.accepted, reply.reason
        again = back.submit(train_messages(back, lost, _change(lost, 0.01), num_examples=5))
        assert not again.accepted and "duplicate" in again.reason
        refused = decliner.submit(train_messages(decliner, declined, _change(declined, 0.01),
                                                 num_examples=5))
        assert not refused.accepted
        assert "already dropped (declined: data budget)" in refused.reason
    finally:
        for edge in edges:
            edge.close()
        cluster.close()

"""What one edge, or a stranger, can try on a real fl-server, tried as an attacker would:
a hand-written client (``RawEdge``, which speaks the wire protocol directly) sends what a
daemon never would. Each test asserts that the attack is refused by name or harmless, that
the server still runs, and that an honest edge in the same round is served.

Attacks on the aggregate (lying weights, huge values, update norms) are in
test_adversarial_aggregate.py, on secure aggregation in test_adversarial_secagg.py, and
a hostile server against the edge's privacy in test_edge_policy.py.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import threading
import time
import urllib.request
from contextlib import contextmanager

import grpc
import pytest
from conftest import Cluster, wait_for
from rawedge import RawEdge, Task, raw_layout, shifted, stream, train_messages
from test_bad_input import assert_single_upload_mean

from fedattn_shared.tls import edge_credentials
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire import fedattn_pb2_grpc as pb_grpc
from fedattn_shared.wire.transport import channel_options
from fl_server.cli import main as server_main

IDLE = 8.0  # --upload-idle-timeout: long enough that an honest upload is in well before it
MAX_EDGES = 6
MAX_DELIVERIES = 3
RESUME_EXPIRY = 2.0  # --transfer-resume-expiry: a stalled upload is held this long, then dropped


class Fleet:
    """One server, one attacker and one honest edge; every round trains both (quorum: all)."""

    def __init__(self, cluster: Cluster, server, attacker: RawEdge, honest: RawEdge):
        self.cluster = cluster
        self.server = server
        self.attacker = attacker
        self.honest = honest

    def round(self) -> tuple[Task, Task]:
        attack, honest = self.attacker.next_task(), self.honest.next_task()
        assert attack.header.round == honest.header.round
        return attack, honest

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()

    def log_mark(self) -> int:
        return self.server.mark()

    def logged(self, mark: int, *needles: str) -> str:
        return self.server.logged(mark, *needles, timeout=15)

    def honest_round(self, task: Task, delta: float = 2.0, **overrides) -> dict:
        """The honest edge's upload of global + delta, accepted; returns its tensors."""
        upload = shifted(task.globals, delta)
        reply = self.honest.submit(train_messages(self.honest, task, upload, **overrides))
        assert reply.accepted, reply.reason
        return upload


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("adversarial"))
    edges: list[RawEdge] = []
    try:
        server = cluster.server(
            "--method", "fedavg", "--model", "lenet-bn", "--rounds", "100", "--min-edges", "2",
            "--quorum", "0", "--round-timeout", "60", "--eval-every", "0",
            "--upload-idle-timeout", str(IDLE), "--max-concurrent-uploads", "2",
            "--transfer-resume-expiry", str(RESUME_EXPIRY),
            "--max-task-deliveries", str(MAX_DELIVERIES), "--max-edges", str(MAX_EDGES),
            "--metrics-port", "0")
        edges = [RawEdge(cluster.port, "attacker"), RawEdge(cluster.port, "honest")]
        for edge in edges:
            edge.connect()
        yield Fleet(cluster, server, *edges)
    finally:
        for edge in edges:
            edge.close()
        cluster.close()


def chunk_received(metrics_port: int, edge_id: str) -> bool:
    """Whether the server has counted upload data from ``edge_id`` (its raw byte series)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    return any(line.startswith("fedattn_raw_tensor_bytes_total{") and 'direction="up"' in line
               and f'edge="{edge_id}"' in line for line in text.decode().splitlines())


def stalling(messages: list[pb.SubmitMessage], release: threading.Event):
    """A request stream that sends ``messages`` and then neither sends nor closes."""
    yield from messages
    release.wait(120)


def test_stalled_streams_cannot_hold_the_upload_slots(fleet):
    # Item 3: two Submit streams for the attacker's own task, each a header and one chunk
    # and then silence, used to hold both upload slots for good.
    attack, honest = fleet.round()
    header, chunks = raw_layout(fleet.attacker, attack, shifted(attack.globals, 1.0))
    messages = stream(header, chunks)
    fleet.attacker.sign(messages)
    release = threading.Event()
    replies: dict[str, pb.SubmitReply] = {}

    def submit(key: str) -> None:
        replies[key] = fleet.attacker.stub.Submit(stalling(messages[:2], release), timeout=120)

    first = threading.Thread(target=submit, args=("first",))
    try:
        mark = fleet.log_mark()
        first.start()
        wait_for(lambda: chunk_received(fleet.server.metrics_port, fleet.attacker.edge_id), 15,
                 "the first stream's chunk at the server")
        second = threading.Thread(target=submit, args=("second",))
        second.start()
        second.join(timeout=30)
        assert not replies["second"].accepted
        assert "already in progress" in replies["second"].reason
        # The honest upload goes through while the attacker's first stream still stalls.
        upload = fleet.honest_round(honest)
        assert "first" not in replies, "the honest upload waited for the stalled stream's cut"
        first.join(timeout=IDLE + 30)
        assert not replies["first"].accepted
        assert re.search(r"no data for [\d.]+s \(stalled after", replies["first"].reason)
        # Cut, it was held for resuming (no slot: the honest upload above went through),
        # and not resumed: the partial expired with the task.
        fleet.logged(mark, f"dropped {fleet.attacker.edge_id} (upload not resumed")
    finally:
        release.set()
    # The round closed with the honest upload alone: it is the next global.
    attack, honest = fleet.round()
    assert_single_upload_mean(honest.globals, upload)
    fleet.honest_round(honest)
    reply = fleet.attacker.submit(train_messages(fleet.attacker, attack, attack.globals))
    assert reply.accepted, reply.reason


@contextmanager
def raw_fleet(tmp_path, names: tuple[str, ...], *server_args: str):
    """A real fl-server with ``server_args`` and one connected raw edge per name; yields
    (cluster, edges), and closes them all afterwards."""
    cluster = Cluster(tmp_path)
    edges: list[RawEdge] = []
    try:
        cluster.server("--method", "fedavg", "--model", "lenet-bn", "--eval-every", "0",
                       "--metrics-port", "0", *server_args)
        edges = [RawEdge(cluster.port, name) for name in names]
        for edge in edges:
            edge.connect()
        yield cluster, edges
    finally:
        for edge in edges:
            edge.close()
        cluster.close()


def test_a_receive_is_cut_when_its_phase_closes(tmp_path):
    # A phase that closed at its quorum aggregates nothing more: a stream still sending
    # for it gives its slot back at once instead of at its idle deadline.
    release = threading.Event()
    with raw_fleet(tmp_path, ("slow", "fast"), "--min-edges", "2", "--quorum", "1",
                   "--upload-idle-timeout", "120") as (cluster, (slow, fast)):
        try:
            slow_task, fast_task = slow.next_task(), fast.next_task()
            header, chunks = raw_layout(slow, slow_task, shifted(slow_task.globals, 1.0))
            messages = stream(header, chunks)
            slow.sign(messages)
            replies: list[pb.SubmitReply] = []
            receiving = threading.Thread(target=lambda: replies.append(
                slow.stub.Submit(stalling(messages[:2], release), timeout=120)))
            receiving.start()
            wait_for(lambda: chunk_received(cluster.procs[0].metrics_port, slow.edge_id), 15,
                     "the slow stream's first chunk at the server")
            reply = fast.submit(train_messages(fast, fast_task, shifted(fast_task.globals, 1.0)))
            assert reply.accepted, reply.reason
            receiving.join(timeout=60)
            assert replies and not replies[0].accepted
            assert "the phase closed before the upload completed" in replies[0].reason
        finally:
            release.set()


def test_a_call_that_gives_up_waiting_for_a_slot_leaves_none_held(tmp_path):
    # One slot, held by a stalled stream; a second edge's upload waits for it and its
    # client gives up. The slot it was waiting for must not be granted to the ended call,
    # or the third edge's upload would wait forever once the stall is cut.
    release = threading.Event()
    with raw_fleet(tmp_path, ("staller", "quitter", "honest"), "--min-edges", "3",
                   "--upload-idle-timeout", "4", "--max-concurrent-uploads", "1",
                   "--round-timeout", "120") as (cluster, edges):
        try:
            staller, quitter, honest = edges
            tasks = [edge.next_task() for edge in edges]
            header, chunks = raw_layout(staller, tasks[0], shifted(tasks[0].globals, 1.0))
            messages = stream(header, chunks)
            staller.sign(messages)
            stalled = threading.Thread(target=lambda: staller.stub.Submit(
                stalling(messages[:2], release), timeout=120))
            stalled.start()
            wait_for(lambda: chunk_received(cluster.procs[0].metrics_port, staller.edge_id), 15,
                     "the stalled stream's chunk at the server")
            waiting = train_messages(quitter, tasks[1], tasks[1].globals)
            quitter.sign(waiting)
            with pytest.raises(grpc.RpcError) as err:  # waits for the slot, then gives up
                quitter.stub.Submit(iter(waiting), timeout=1.0)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            reply = honest.submit(train_messages(honest, tasks[2], tasks[2].globals))
            assert reply.accepted, reply.reason
            stalled.join(timeout=60)
        finally:
            release.set()


def gauge(metrics_port: int, name: str) -> float:
    """The value of an unlabelled series on the server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not on /metrics")


def test_a_download_the_edge_stops_reading_is_cut(tmp_path):
    # A NextTask stream whose client takes the header and then reads nothing: gRPC's send
    # waits for flow control for ever, holding a frame of the model. The server stops
    # sending at its idle deadline, naming why; the call's deadline (which the server
    # requires and bounds) ends it on the wire and lets the frame go. While it stalls it
    # holds its room under --max-download-memory (here one frame's worth), so another
    # edge's download waits for that room instead of adding a frame more (and, past an
    # idle deadline, is told to come back: the server's queue, not the edge's pace). The
    # task is not lost: the edge may ask for it again (--max-task-deliveries bounds how
    # often). Stalls from many identities: test_adversarial_downloads.py.
    with raw_fleet(tmp_path, ("stalled", "reader"), "--model", "resnet18-cifar",
                   "--min-edges", "2", "--download-idle-timeout", "3",
                   "--download-min-rate", str(10**7), "--download-window", str(64 << 20),
                   "--max-download-memory", str(1 << 20)) as (cluster, (edge, reader)):
        server = cluster.procs[0]
        assert gauge(server.metrics_port, "fedattn_download_limit_bytes") == 1 << 20
        mark = server.mark()
        request = pb.TaskRequest(edge_id=edge.edge_id, session=edge.session, cached_common="")
        call = edge.stub.NextTask(request, timeout=15)
        header = next(call).header  # then nothing is read: 44.7 MB cannot sit in buffers
        assert header.status == pb.TaskHeader.TASK and header.common.total_bytes > 40 << 20
        tasks: list[Task] = []
        errors: list[grpc.RpcError] = []

        def read() -> None:
            while not tasks:
                try:
                    tasks.append(reader.next_task())
                except grpc.RpcError as err:  # no room within an idle deadline: ask again
                    errors.append(err)

        reading = threading.Thread(target=read)
        reading.start()
        try:
            wait_for(lambda: gauge(server.metrics_port, "fedattn_downloads_waiting") >= 1, 30,
                     "the reader's download waiting for the stalled one's room")
            assert gauge(server.metrics_port, "fedattn_download_held_bytes") <= 1 << 20
            server.logged(mark, f"{edge.edge_id}'s task download cut: message",
                          "not taken within 3.1s", timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:  # what the buffers held, then the call's end
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            reading.join(timeout=90)
        assert tasks and tasks[0].globals  # the room it was given back let it through
        assert all(e.code() == grpc.StatusCode.UNAVAILABLE and "no room" in e.details()
                   for e in errors)
        task = edge.next_task()  # asked again, read at once: delivered whole
        assert task.header.task_id == header.task_id and task.globals
        assert gauge(server.metrics_port, "fedattn_download_held_bytes") == 0


def test_a_silent_stream_without_a_header_is_cut(fleet):
    attack, honest = fleet.round()
    release = threading.Event()
    try:
        started = time.monotonic()
        reply = fleet.attacker.stub.Submit(stalling([], release), timeout=IDLE + 60)
        assert not reply.accepted and f"no header within {IDLE:g}s" in reply.reason
        assert time.monotonic() - started >= IDLE - 0.5
    finally:
        release.set()
    fleet.honest_round(honest)
    reply = fleet.attacker.submit(train_messages(fleet.attacker, attack, attack.globals))
    assert reply.accepted, reply.reason


def pull(edge: RawEdge) -> list[pb.TaskMessage]:
    request = pb.TaskRequest(edge_id=edge.edge_id, session=edge.session, cached_common="")
    return list(edge.stub.NextTask(request, timeout=30))


def test_a_task_is_delivered_a_bounded_number_of_times(fleet):
    # Item 10: the same session pulling its pending task (the whole model) again and again.
    attack, honest = fleet.round()  # the first delivery
    mark = fleet.log_mark()
    for _ in range(MAX_DELIVERIES - 1):
        messages = pull(fleet.attacker)
        assert messages[0].header.status == pb.TaskHeader.TASK
        assert messages[0].header.task_id == attack.header.task_id
    refused = pull(fleet.attacker)
    assert [m.header.status for m in refused] == [pb.TaskHeader.WAIT]
    fleet.logged(mark, f"dropped {fleet.attacker.edge_id} (re-delivery limit")
    reply = fleet.attacker.submit(train_messages(fleet.attacker, attack, attack.globals))
    assert not reply.accepted and "already dropped" in reply.reason
    upload = fleet.honest_round(honest)
    attack, honest = fleet.round()
    assert_single_upload_mean(honest.globals, upload)
    fleet.honest_round(honest)
    fleet.attacker.submit(train_messages(fleet.attacker, attack, attack.globals))


def test_metric_names_are_the_methods_and_bounded(fleet):
    # Item 6: an accepted upload with any number of made-up metric names used to grow
    # /metrics and history.json without bound.
    attack, honest = fleet.round()
    flood = {f"made_up_{i}": float(i) for i in range(60_000)}
    reply = fleet.attacker.submit(train_messages(fleet.attacker, attack, attack.globals,
                                                 metrics=flood))
    assert not reply.accepted and "60000 metrics, at most" in reply.reason
    mark = fleet.log_mark()
    fleet.honest_round(honest, metrics={"train_seconds": 1.5, "made_up_x": 7.0})
    fleet.logged(mark, fleet.honest.edge_id, "made_up_x", "does not declare")
    text = fleet.metrics()
    assert "made_up" not in text
    assert f'edge="{fleet.honest.edge_id}",name="train_seconds"' in text
    attack, honest = fleet.round()  # the round is over: its record is in the history
    history = fleet.cluster.tmp / "server-state" / "history.json"
    record = wait_for(lambda: next((r for r in json.loads(history.read_text())["rounds"]
                                    if r["round"] == honest.header.round - 1), None),
                      30, "the round's history record")
    assert record["train"]["edge_metrics"][fleet.honest.edge_id] == {"train_seconds": 1.5}
    fleet.honest_round(honest)
    fleet.attacker.submit(train_messages(fleet.attacker, attack, attack.globals))


def stranger(fleet: Fleet, edge_id: str, **overrides) -> grpc.RpcError | pb.JoinReply:
    edge = RawEdge(fleet.cluster.port)
    edge.edge_id = edge_id
    try:
        return edge.join(**overrides)
    except grpc.RpcError as err:
        return err
    finally:
        edge.close()


def test_ids_are_checked_before_they_reach_logs_labels_or_the_registry(fleet):
    # Item 5: the raw id of a refused Join became a metric label (1 MiB ids grew RSS by
    # ~1.2 MB each); item 7: a newline in an id or join info forged server log lines.
    before = len(fleet.metrics())
    mark = fleet.log_mark()
    forged = "2026-01-01T00:00:00.000Z INFO fl_server round 99 done"
    for edge_id in ("x" * (1 << 20), f"evil\n{forged}", "trailing\n", "", "-dash"):
        err = stranger(fleet, edge_id)
        assert isinstance(err, grpc.RpcError)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not valid" in err.details() and len(err.details()) < 300
    reply = stranger(fleet, f"info-{secrets.token_hex(3)}", info={"hostname": f"h\n{forged}"})
    assert isinstance(reply, pb.JoinReply) and reply.session
    fleet.logged(mark, "joined (hostname='h\\n2026-01-01")
    text = fleet.metrics()
    assert "xxxxxxxx" not in text and "evil" not in text and "trailing" not in text
    assert len(text) - before < 20_000
    assert 'edge="(unregistered)"' in text
    lines = fleet.server.log()[mark:].splitlines()
    assert not any(line.startswith(forged[:20]) for line in lines), "a forged log line"
    err = stranger(fleet, f"info-{secrets.token_hex(3)}", info={"k": "v" * 1000})
    assert isinstance(err, grpc.RpcError) and "info entry 'k'" in err.details()


def test_registrations_are_capped(fleet):
    refused = None
    for _ in range(MAX_EDGES + 1):
        reply = stranger(fleet, f"sybil-{secrets.token_hex(4)}")
        if isinstance(reply, grpc.RpcError):
            refused = reply
            break
    assert refused is not None, f"{MAX_EDGES + 1} ids registered past --max-edges"
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"--max-edges {MAX_EDGES}" in refused.details()
    # The fleet's own edges are still served.
    attack, honest = fleet.round()
    fleet.honest_round(honest)
    fleet.attacker.submit(train_messages(fleet.attacker, attack, attack.globals))


def test_garbage_requests_are_invalid_arguments_without_a_traceback(fleet):
    mark = fleet.log_mark()
    for method in ("Join", "Leave"):
        call = fleet.attacker.channel.unary_unary(f"/fedattn.v1.FederatedLearning/{method}")
        with pytest.raises(grpc.RpcError) as err:
            call(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request" in err.value.details()
    call = fleet.attacker.channel.unary_stream("/fedattn.v1.FederatedLearning/NextTask")
    with pytest.raises(grpc.RpcError) as err:
        list(call(b"\xff" * 12, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    submit = fleet.attacker.channel.stream_unary("/fedattn.v1.FederatedLearning/Submit",
                                                 response_deserializer=pb.SubmitReply.FromString)
    reply = submit(iter([b"\x0a\xff\xff\xff\xff\x0f"]), timeout=10)
    assert not reply.accepted and "malformed request" in reply.reason
    fleet.logged(mark, "malformed request")
    assert "Traceback" not in fleet.server.log()[mark:]
    attack, honest = fleet.round()
    fleet.honest_round(honest)
    fleet.attacker.submit(train_messages(fleet.attacker, attack, attack.globals))


# ---- certificates, not names ---------------------------------------------------------------


class TlsEdge(RawEdge):
    """A raw edge over mutual TLS with the certificate, key and token in ``tls_dir``."""

    def __init__(self, port: int, tls_dir):
        super().__init__(port)
        credentials, self.token, self.edge_id = edge_credentials(tls_dir)
        self.channel.close()
        self.channel = grpc.secure_channel(f"localhost:{port}", credentials,
                                           options=channel_options())
        self.stub = pb_grpc.FederatedLearningStub(self.channel)

    def join(self, **overrides) -> pb.JoinReply:
        return super().join(**{"join_token": self.token, **overrides})


def test_revocation_is_by_certificate_and_ends_the_session(tmp_path):
    # Item 4: `certs revoke X` then `certs issue X` for a replacement device: the new
    # device could not join ("bound to a different secret") while the revoked one, with
    # its old certificate and session, kept getting tasks.
    ca = tmp_path / "ca"
    assert server_main(["certs", "init", str(ca), "--hosts", "localhost,127.0.0.1"]) == 0
    assert server_main(["certs", "issue", str(ca), "cam"]) == 0
    cluster = Cluster(tmp_path)
    old = new = None
    try:
        server = cluster.server("--method", "fedavg", "--model", "lenet-bn", "--min-edges", "3",
                                tls_dir=ca)
        old = TlsEdge(cluster.port, ca / "edges" / "cam")
        old.connect()
        mark = len(server.log())
        assert server_main(["certs", "revoke", str(ca), "cam"]) == 0
        # The open presence stream closes without waiting for the device's next call.
        wait_for(lambda: not old._presence_thread.is_alive(), 15, "the presence stream to close")
        server.wait_log("edge cam: session ended: edge cam is revoked", 15)
        with pytest.raises(grpc.RpcError) as err:
            pull(old)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "revoked" in err.value.details()
        # A replacement device: a new certificate, secret and signing key for the same id.
        assert server_main(["certs", "issue", str(ca), "cam"]) == 0
        new = TlsEdge(cluster.port, ca / "edges" / "cam")
        new.connect()
        # The old certificate is refused whatever it presents: the new token, or the new
        # device's live session.
        with pytest.raises(grpc.RpcError) as err:
            old.join(join_token=new.token)
        assert "is not the one enrolled for this id" in err.value.details()
        old.session = new.session
        with pytest.raises(grpc.RpcError) as err:
            pull(old)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "is not the one enrolled for this id" in err.value.details()
        assert new.present.is_set() and new._presence_thread.is_alive()
        assert "Traceback" not in server.log()[mark:]
    finally:
        for edge in (old, new):
            if edge is not None:
                edge.close()
        cluster.close()


# ---- shutdown ------------------------------------------------------------------------------


def test_sigterm_shuts_down_cleanly_with_streams_open(tmp_path):
    cluster = Cluster(tmp_path)
    edge = None
    try:
        server = cluster.server("--method", "fedavg", "--model", "lenet-bn", "--min-edges", "2",
                                "--metrics-port", "0")
        edge = RawEdge(cluster.port)
        edge.connect()
        polling = threading.Thread(target=lambda: _ignore_rpc_errors(pull, edge), daemon=True)
        polling.start()
        # Both streams are open at the server: the presence stream and a task long-poll
        # (its request is the edge's third message up, after the join and the presence's).
        def polling_at_server() -> bool:
            url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
                if (line.startswith("fedattn_messages_total{") and 'direction="up"' in line
                        and f'edge="{edge.edge_id}"' in line and 'kind="meta"' in line):
                    return float(line.rsplit(" ", 1)[1]) >= 3
            return False

        wait_for(polling_at_server, 15, "the task long-poll at the server")
        server.popen.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        log = server.log()
        assert "stopping on request" in log
        assert not re.search(r"Traceback|CancelledError|Exception", log), log[-3000:]
    finally:
        if edge is not None:
            edge.close()
        cluster.close()


def _ignore_rpc_errors(fn, *args) -> None:
    try:
        fn(*args)
    except grpc.RpcError:
        pass


"""The edge's health endpoint with a real fl-edge and a real fl-server: ``/healthz`` on
--metrics-port says what the edge does and answers 503 while a task makes no progress,
whatever ``/metrics`` answers; and an edge started with the recommended small-device flags
(--amp --grad-accum) trains under the server's DP-SGD instead of exiting with status 2."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request

from conftest import free_port, wait_for, write_edge_dirs
from test_dp import DP_RUN

from fl_edge.health import EdgeHealth


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except (urllib.error.URLError, ConnectionError):
        return 0, b""  # the edge has closed its port (run over)


def test_health_report_by_hand():
    health = EdgeHealth(stall_seconds=10)
    assert health.report()[0] == 200 and health.report()[1]["state"] == "starting"
    health.set("idle")
    assert health.report(now=health.last_progress_at + 1e6)[0] == 200  # waiting is not stuck
    health.set("training")
    started = health.last_task_at
    assert started is not None
    assert health.report(now=started + 9)[0] == 200
    status, body = health.report(now=started + 11)
    assert status == 503 and body["state"] == "training" and body["stuck_for"] >= 11
    health.progress()
    assert health.report(now=health.last_progress_at + 9)[0] == 200
    health.error("x" * 900)
    assert len(health.report()[1]["last_error"]) == 500


def test_healthz_reflects_progress_and_a_stall_of_a_real_edge(cluster, tmp_path):
    """--throttle makes the edge sleep inside its task after training (a device that
    stopped moving); with --health-stall-seconds 0.5 the sleep is a stall: /healthz answers
    503 while /metrics still answers 200, and 200 again once the edge moves on."""
    (data,) = write_edge_dirs(tmp_path, 1, per_edge=200)
    # The edge starts before its server, so the states before a task (waiting for the
    # server) are seen for certain, not only when the poller happens to be quick enough.
    server_port = free_port()
    edge = cluster.edge(data, "h", "--metrics-port", "0", "--throttle", "20",
                        "--health-stall-seconds", "0.5", "--progress", "off", port=server_port)
    port = int(wait_for(lambda: re.search(r"metrics on :(\d+)", edge.log()), 60,
                        "the edge's metrics port").group(1))
    seen: list[tuple[int, dict, int]] = []
    done = threading.Event()

    def poll():
        while not done.is_set() and edge.popen.poll() is None:
            status, body = get(port, "/healthz")
            if status:
                seen.append((status, json.loads(body), get(port, "/metrics")[0]))
            done.wait(0.1)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        wait_for(lambda: any(s == 200 and b["state"] == "reconnecting" for s, b, _ in seen), 60,
                 "a healthy answer while the edge waits for its server")
        server = cluster.server("--method", "fedavg", "--rounds", "1", "--min-edges", "1",
                                "--batch-size", "16", port=server_port)
        assert edge.wait(300) == 0 and server.wait(120) == 0
    finally:
        done.set()
        poller.join(30)
    stuck = [(s, b, m) for s, b, m in seen if s == 503]
    assert stuck, seen[-5:]
    status, body, metrics_status = stuck[0]
    assert body["state"] in ("training", "evaluating") and body["stuck_for"] >= 0.5
    assert metrics_status == 200  # /metrics answers while the edge is stuck: it is not health
    # The last error is history (the server that was not there yet), not the state.
    assert body["last_task_at"] is not None and "UNAVAILABLE" in body["last_error"]
    assert {"state", "last_task_at", "last_progress_at", "last_error"} <= set(body)
    after = seen[seen.index(stuck[0]):]
    assert any(s == 200 and b["state"] in ("uploading", "idle", "done") for s, b, _ in after)
    before = seen[:seen.index(stuck[0])]
    assert all(s == 200 for s, _, _ in before)  # waiting for a server or a task is not stuck


def test_small_device_flags_train_under_dp_sgd_with_one_warning(cluster, tmp_path):
    (data,) = write_edge_dirs(tmp_path, 1, per_edge=120)
    server = cluster.server(*DP_RUN, "--method", "fedavg", "--rounds", "1")
    edge = cluster.edge(data, "jetson", "--amp", "--grad-accum", "2", "--progress", "off")
    assert edge.wait(300) == 0, edge.log()[-3000:]
    assert server.wait(120) == 0
    warnings = [line for line in edge.log().splitlines() if "the server runs DP-SGD:" in line]
    assert len(warnings) == 1, warnings
    assert "--grad-accum 2 becomes physical batches of at most 10" in warnings[0]
    assert "--amp is set aside" in warnings[0]


def test_the_health_server_answers_only_two_paths_and_drops_silent_clients():
    """What a stranger on the network can do to --metrics-port: other paths are 404, other
    methods 501, a garbage request line 400, a body is never read, and a connection that
    sends nothing is closed by the server (its thread is not held for ever)."""
    import socket
    import time

    from prometheus_client import CollectorRegistry

    from fl_edge.health import serve

    server = serve(0, CollectorRegistry(), EdgeHealth(), host="127.0.0.1")
    port = server.server_port
    try:
        assert get(port, "/healthz")[0] == 200 and get(port, "/metrics")[0] == 200
        assert get(port, "/../etc/passwd")[0] == 404 and get(port, "/healthz/x")[0] == 404
        request = urllib.request.Request(f"http://127.0.0.1:{port}/healthz", data=b"x" * 10,
                                         method="POST")
        try:
            urllib.request.urlopen(request, timeout=10)
            raise AssertionError("POST answered")
        except urllib.error.HTTPError as err:
            assert err.code == 501
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            raw.sendall(b"\x00\xff garbage\r\n\r\n")
            answer = b"".join(iter(lambda: raw.recv(4096), b""))
            assert b"Error code: 400" in answer
        with socket.create_connection(("127.0.0.1", port), timeout=30) as silent:
            start = time.monotonic()
            assert silent.recv(100) == b""  # closed by the server, having sent nothing
            assert time.monotonic() - start < 25
    finally:
        server.shutdown()
        server.server_close()

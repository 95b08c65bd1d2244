"""The daemons on a host they share and without a terminal: torch threads
(``fl-edge --threads``), progress lines at a steady interval (``--log-every``), the
byte counters both daemons keep, which an operator compares (docs/operations.md), and the
lines an operator reads: one "joined" per edge, a "left" for an edge that gives up, the
run's mode in the start line, and an edge's /metrics outliving the run as the server's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

from conftest import REPO, free_port, read_history, wait_for, write_edge_dirs
from prometheus_client import generate_latest

from fl_edge.daemon import EdgeDaemon, EdgeOptions


def edge(tmp_path, *args: str, omp: str | None = None) -> subprocess.CompletedProcess:
    """fl-edge against a port nobody serves, giving up after a second: what it logs
    before its first connection."""
    (data,) = write_edge_dirs(tmp_path / "data", 1, per_edge=20)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return subprocess.run([sys.executable, "-m", "fl_edge", "--insecure", "--server",
                           "127.0.0.1:1", "--data-dir", str(data), "--state-dir",
                           str(tmp_path / "state"), "--retry-for", "1", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def test_threads_default_to_one_or_omp_and_warn_past_the_cores(tmp_path):
    cores = len(os.sched_getaffinity(0))
    alone = edge(tmp_path / "a")
    assert f"training with 1 torch thread(s) of {cores} core(s)" in alone.stderr, alone.stderr
    assert alone.returncode == 1  # the server is unreachable: the threads were set before
    omp = edge(tmp_path / "b", omp="2")
    assert "training with 2 torch thread(s)" in omp.stderr or cores < 2, omp.stderr
    over = edge(tmp_path / "c", "--threads", str(cores + 1))
    assert f"--threads {cores + 1} exceeds the {cores} core(s)" in over.stderr, over.stderr
    bad = edge(tmp_path / "d", "--threads", "0")
    assert bad.returncode == 2 and "--threads must be >= 1" in bad.stderr


def test_progress_lines_without_a_terminal(cluster, tmp_path):
    """Both daemons log progress at --log-every while a phase is open: the edge its steps,
    samples/s and ETA, the server "k/n results in"."""
    (data,) = write_edge_dirs(tmp_path, 1, per_edge=3000)
    server = cluster.server("--method", "fedavg", "--rounds", "1", "--min-edges", "1",
                            "--local-epochs", "2", "--batch-size", "16", "--log-every", "0.05")
    edge = cluster.edge(data, "slow", "--progress", "off", "--log-every", "0.05")
    assert edge.wait() == 0 and server.wait() == 0
    assert re.search(r"epoch \d/2: batch \d+/\d+, \d+ steps, [\d.]+ samples/s, ETA \d+s",
                     edge.log()), edge.log()[-2000:]
    assert re.search(r"round 1 train: 0/1 results in, 0 dropped, quorum 1, open \d+s",
                     server.log()), server.log()[-2000:]
    assert read_history(tmp_path / "server-state")["rounds"][0]["train"]["received"] == ["slow"]


def test_an_edge_s_metrics_linger_and_the_logs_say_who_joined_and_left(cluster, tmp_path):
    """One real edge trains a round with --metrics-port; its /metrics still answers after
    the run ended (--metrics-linger, as fl-server's) until SIGTERM. A second edge whose
    images do not fit the run stops at its setup: the server logs it "left" (it used to
    vanish). Each edge is "joined" once, though an edge without the run's configuration
    joins twice (to read it, then to declare its training split)."""
    (data,) = write_edge_dirs(tmp_path / "good", 1, per_edge=40)
    (small,) = write_edge_dirs(tmp_path / "small", 1, per_edge=40, size=16)
    server = cluster.server("--method", "fedavg", "--rounds", "1", "--min-edges", "1",
                            "--mode", "sync", "--compress", "up=fp16")
    server.wait_log("mode sync, compress up=fp16")
    misfit = cluster.edge(small, "misfit")
    assert misfit.wait() == 2
    server.wait_log("edge misfit left ('the edge stopped with status 2; its log says why')")
    edge = cluster.edge(data, "keeper", "--metrics-port", "0", "--metrics-linger", "120")
    edge.wait_log("(--metrics-linger)", timeout=120)
    port = re.search(r"metrics on :(\d+)", edge.log()).group(1)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "fedattn_edge_last_success_round 1.0" in text
    edge.popen.send_signal(signal.SIGTERM)
    assert edge.wait(timeout=30) == 0
    log = server.log()
    assert log.count("edge keeper joined") == 1 and log.count("edge misfit joined") == 1, log
    assert "edge keeper declared its training split: " in log


def _series(text: str) -> dict[tuple[str, str, str, str, str], float]:
    """(metric, edge, direction, kind, codec) -> value of the byte and message counters."""
    return {(m["metric"], m["edge"], m["direction"], m["kind"], m["codec"]): float(m["value"])
            for m in re.finditer(r'^fedattn_(?P<metric>wire_bytes|messages)_total\{codec='
                                 r'"(?P<codec>[^"]*)",direction="(?P<direction>\w+)",'
                                 r'edge="(?P<edge>[^"]*)",kind="(?P<kind>\w+)"'
                                 r'\} (?P<value>\S+)$', text, re.M)}


def test_edge_and_server_count_the_same_bytes_per_edge(cluster, tmp_path):
    """A real federation whose edges start before the server (so they retry joins against
    nobody): every edge's own counters, labelled with its id, equal the server's for that
    edge in every kind and direction, meta included (presence, leave, polls; a join that
    found no server is counted by neither side). Edges run as fl-sim hosts them, so their
    registries can be read after they exit."""
    port = free_port()
    dirs = write_edge_dirs(tmp_path, 2, per_edge=60)
    daemons = [EdgeDaemon(EdgeOptions(server=f"127.0.0.1:{port}", data_dir=d,
                                      state_dir=tmp_path / f"state-{i}", name=f"e{i}",
                                      device="cpu", progress=False, retry_for=60,
                                      max_backoff=0.5))
               for i, d in enumerate(dirs)]
    codes: dict[str, int] = {}
    threads = [threading.Thread(target=lambda d=d: codes.update({d.identity.edge_id: d.run()}))
               for d in daemons]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: all(generate_latest(d.registry).count(b"fedattn_edge_rpc_retries_total{")
                             for d in daemons), 30, "both edges to retry an absent server")
        server = cluster.server("--method", "fedavg", "--rounds", "2", "--min-edges", "2",
                                "--local-epochs", "1", "--metrics-port", "0",
                                "--metrics-linger", "30", port=port)
    finally:
        for thread in threads:
            thread.join(timeout=120)
    assert codes == {"e0": 0, "e1": 0}
    server.wait_log("(--metrics-linger)")
    served = _series(urllib.request.urlopen(
        f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode())
    for daemon in daemons:
        edge_id = daemon.identity.edge_id
        own = _series(generate_latest(daemon.registry).decode())
        assert {key[1] for key in own} == {edge_id}  # never edge=""
        assert own[("wire_bytes", edge_id, "up", "meta", "none")] > 0
        assert own[("messages", edge_id, "down", "meta", "none")] >= 6  # join x2, presence, polls, leave
        assert own == {key: value for key, value in served.items() if key[1] == edge_id}
    server.popen.send_signal(signal.SIGTERM)
    assert server.wait(timeout=10) == 0

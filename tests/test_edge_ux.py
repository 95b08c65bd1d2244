"""The daemons on a host they share and without a terminal: torch threads
(``fl-edge --threads``), progress lines at a steady interval (``--log-every``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO, read_history, write_edge_dirs


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

"""fl-edge under a supervisor: SIGTERM as a container's PID 1 (a real PID namespace, a real
fl-server on loopback), stop signals never cutting a state write, and systemd's
notification protocol spoken over a real unix datagram socket."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import Proc, wait_for, write_edge_dirs
from prometheus_client import CollectorRegistry

from fedattn_shared.state import load_tensors
from fl_edge.metrics import EdgeMetrics
from fl_edge.sdnotify import Watchdog, notify, watchdog_interval
from fl_edge.store import PrivateStore
from fl_edge.supervision import Stopped, StopSignals
from fl_edge.writer import StateWriter


# ---- stop signals and state writes ---------------------------------------------------------
def test_a_stop_signal_outside_a_write_raises_at_once():
    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals().install()
    try:
        with pytest.raises(Stopped, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for(lambda: False, 10, "the signal handler")  # interrupted by Stopped
        assert signals.received == signal.SIGTERM
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) == before  # restored


def test_a_stop_signal_during_a_state_write_waits_for_the_write(tmp_path):
    """A real StateWriter write during which SIGTERM (then SIGINT) arrives: the file is
    written whole and renamed into place, and Stopped comes after, once."""
    writer = StateWriter(PrivateStore(tmp_path), tmp_path, EdgeMetrics(CollectorRegistry()))
    signals = StopSignals().install()
    writer.critical = signals.deferred
    target = tmp_path / "state.bin"
    steps = []

    def save(data: bytes) -> None:
        partial = target.with_suffix(".tmp")
        with open(partial, "wb") as f:
            f.write(data[:10])
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)  # a second signal changes nothing
            steps.append("signalled")
            f.write(data[10:])
        os.replace(partial, target)
        steps.append("renamed")

    try:
        with pytest.raises(Stopped, match="SIGTERM"):
            writer.write(save, bytes(range(100)))
        assert steps == ["signalled", "renamed"]
        assert target.read_bytes() == bytes(range(100))
        # Writes behind the upload run on the writer's thread; flush waits for them.
        writer.write_behind(save, b"x" * 50)
        writer.flush()
        assert target.read_bytes() == b"x" * 50
    finally:
        signals.restore()


# ---- systemd notifications ----------------------------------------------------------------
@pytest.fixture
def notify_socket(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.settimeout(30)
    yield sock, str(path)
    sock.close()


def test_notify_speaks_the_datagram_protocol(notify_socket):
    sock, path = notify_socket
    assert notify("READY=1", {"NOTIFY_SOCKET": path})
    assert sock.recv(4096) == b"READY=1"
    assert not notify("READY=1", {})  # not under systemd: nothing sent, no error
    # Linux's abstract socket namespace: "@name" in $NOTIFY_SOCKET.
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"fedattn-test-{os.getpid()}"
    abstract.bind("\0" + name)
    abstract.settimeout(30)
    try:
        assert notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name})
        assert abstract.recv(4096) == b"STOPPING=1"
    finally:
        abstract.close()


def test_notify_never_blocks_on_a_listener_that_stopped_reading(notify_socket):
    """A unix datagram queue holds a few messages (net.unix.max_dgram_qlen); past them a
    blocking send would stall the edge's watchdog thread and its shutdown."""
    sock, path = notify_socket
    sent = [notify("WATCHDOG=1", {"NOTIFY_SOCKET": path}) for _ in range(1000)]
    assert sent[0] and not all(sent)  # the queue filled, and the sends after it returned
    assert sock.recv(64) == b"WATCHDOG=1"


def test_watchdog_pings_only_while_healthy(notify_socket):
    sock, path = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(env) == 0.1
    assert watchdog_interval({**env, "WATCHDOG_PID": "1"}) is None  # another process's
    assert watchdog_interval({}) is None
    healthy = [True]
    dog = Watchdog(0.1, lambda: healthy[0], env).start()
    try:
        assert [sock.recv(64) for _ in range(3)] == [b"WATCHDOG=1"] * 3
        healthy[0] = False
        sock.settimeout(1.0)  # ten intervals: pings sent in them would arrive
        drained = []
        with pytest.raises(TimeoutError):
            for _ in range(3):
                drained.append(sock.recv(64))
        assert len(drained) <= 1  # at most one ping, sent before the flag turned
        healthy[0] = True
        sock.settimeout(30)
        assert sock.recv(64) == b"WATCHDOG=1"
    finally:
        dog.stop()


def test_no_watchdog_ping_follows_stop(notify_socket):
    """A health check in progress when the edge stops does not ping after ``stop()``:
    fl-edge sends STOPPING=1 right after it, and a ping behind that reads as alive again
    (a loaded machine once delivered one: the PID 1 test below saw it last)."""
    sock, path = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": str(os.getpid())}
    entered, release = threading.Event(), threading.Event()

    def slow_healthz() -> bool:
        entered.set()
        release.wait(10)
        return True

    dog = Watchdog(0.05, slow_healthz, env).start()
    assert entered.wait(10)  # the first check is in progress: nothing sent yet
    stopping = threading.Thread(target=dog.stop)
    stopping.start()
    wait_for(dog.stopped.is_set, 10, "stop() under way")
    release.set()  # the check returns healthy after stop() began
    stopping.join(10)
    assert not stopping.is_alive() and not dog.thread.is_alive()
    sock.settimeout(0.5)
    with pytest.raises(TimeoutError):
        sock.recv(64)


# ---- SIGTERM as PID 1 ---------------------------------------------------------------------
def _pid_namespace_works() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return None if done.returncode == 0 else f"no PID namespace here: {done.stderr.decode().strip()}"


def _child(pid: int) -> int | None:
    """The first child of ``pid`` (unshare --fork's: the namespace's PID 1)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def collect(sock: socket.socket) -> list[bytes]:
    """Every datagram the socket receives from now on, read by a thread as systemd would
    (a listener that stops reading makes the sender drop its notifications)."""
    received: list[bytes] = []

    def read() -> None:
        try:
            while True:
                received.append(sock.recv(64))
        except OSError:  # closed by the fixture, or a timeout after the run
            pass

    threading.Thread(target=read, daemon=True).start()
    return received


@pytest.mark.slow
def test_sigterm_to_fl_edge_as_pid_1_leaves_and_keeps_its_state(cluster, tmp_path, notify_socket):
    """fl-edge is PID 1 of its own PID namespace (as in a container); SIGTERM from outside
    mid-run: it sends Leave (the server logs why), finishes its state writes and exits 0.
    systemd's messages arrive on the way (READY=1, watchdog pings, STOPPING=1). A second
    edge process on the same state dir then resumes and finishes the run."""
    why = _pid_namespace_works()
    if why:
        pytest.skip(why)
    sock, path = notify_socket
    (data,) = write_edge_dirs(tmp_path, 1, per_edge=300)
    server = cluster.server("--method", "fedavg", "--rounds", "4", "--min-edges", "1",
                            "--local-epochs", "3")
    state = tmp_path / "state-cam0"
    edge = Proc(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "fl_edge",
                 "--insecure", "--server", f"127.0.0.1:{cluster.port}", "--data-dir", str(data),
                 "--state-dir", str(state), "--name", "cam0", "--metrics-port", "0"],
                tmp_path / "cam0.log",
                env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
    cluster.procs.append(edge)
    pid1 = wait_for(lambda: _child(edge.popen.pid), 30, "unshare's child")
    nspid = next(line for line in Path(f"/proc/{pid1}/status").read_text().splitlines()
                 if line.startswith("NSpid:")).split()[1:]
    assert nspid == [str(pid1), "1"]  # PID 1 inside its namespace
    messages = collect(sock)
    wait_for(lambda: b"WATCHDOG=1" in messages, 60, "a watchdog ping")
    assert messages[0] == b"READY=1"  # then pings: /healthz answers 200 (or the port is not up yet)

    edge.wait_log("round 1: trained", timeout=120)
    mark = server.mark()
    os.kill(pid1, signal.SIGTERM)
    assert edge.wait(timeout=60) == 0, edge.log()[-3000:]
    assert "left the run (stopped by SIGTERM)" in edge.log()
    server.logged(mark, "edge cam0 left", "stopped by SIGTERM")
    wait_for(lambda: messages and messages[-1] == b"STOPPING=1", 10, "STOPPING=1, last")

    # The state dir is whole: no half-written file, the private state loads.
    leftovers = [p.name for p in state.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]
    assert not leftovers, leftovers
    _, meta = load_tensors(state / "private.safetensors")
    assert int(meta["round"]) >= 1
    # ... and a restarted edge resumes from it and finishes the run.
    again = cluster.edge(data, "cam0")
    assert again.wait(timeout=240) == 0, again.log()[-3000:]
    assert server.wait(timeout=60) == 0

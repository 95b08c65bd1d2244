"""Shared test helpers: generated edge data, and real fl-server / fl-edge processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def bench_script(name: str) -> Iterator:
    """A bench script (bench/NAME.py) imported as a module, for tests of its pieces; bench/
    is on sys.path only meanwhile (its scripts import each other as top-level modules)."""
    import importlib

    sys.path.insert(0, str(REPO / "bench"))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))
#: The real datasets (MNIST, CIFAR-10, USPS, ...) some tests read: $FEDATTN_DATA, else the
#: team's folder beside the repository. Tests that need one skip, naming the path.
SHARED_DATA = Path(os.environ.get("FEDATTN_DATA") or REPO.parent / "shared" / "data")


def make_images(n: int, num_classes: int = 10, size: int = 28, channels: int = 1,
                seed: int = 0, classes: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Learnable generated images: a fixed random template per class plus noise."""
    templates = np.random.default_rng(1234).integers(0, 256, (num_classes, size, size, channels))
    rng = np.random.default_rng(seed)
    y = rng.choice(classes if classes is not None else num_classes, size=n).astype(np.int64)
    noise = rng.normal(0, 40, (n, size, size, channels))
    x = np.clip(templates[y] + noise, 0, 255).astype(np.uint8)
    if channels == 1:
        x = x[..., 0]
    return x, y


def write_edge_dirs(root: Path, count: int, per_edge: int | list[int] = 120,
                    **kwargs) -> list[Path]:
    sizes = per_edge if isinstance(per_edge, list) else [per_edge] * count
    dirs = []
    for i in range(count):
        d = root / f"data-{i}"
        d.mkdir(parents=True, exist_ok=True)
        x, y = make_images(sizes[i], seed=100 + i, **kwargs)
        np.savez(d / "data.npz", x=x, y=y)
        dirs.append(d)
    return dirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Proc:
    """A daemon in its own process group, logging to a file."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.log_path = log
        self.args = args
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(log, "ab")
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                      env=full_env, start_new_session=True, cwd=REPO)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 60) -> None:
        wait_for(lambda: text in self.log() or self.popen.poll() is not None, timeout,
                 f"{text!r} in {self.log_path.name}")
        if text not in self.log():
            raise AssertionError(f"{self.log_path.name} exited ({self.popen.returncode}) before "
                                 f"{text!r}:\n{self.log()[-3000:]}")

    def mark(self) -> int:
        """Where the log ends now: ``logged`` looks only at what comes after it."""
        return len(self.log())

    def logged(self, mark: int, *needles: str, timeout: float = 15) -> str:
        """The first log line after ``mark`` holding every needle, waited for."""
        def line():
            for text in self.log()[mark:].splitlines():
                if all(n in text for n in needles):
                    return text
            return None

        return wait_for(line, timeout, f"a log line of {self.log_path.name} with {needles}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
        self.popen.wait(timeout=30)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.log_path.name} still running:\n{self.log()[-3000:]}") from None

    def close(self) -> None:
        if self.popen.poll() is None:
            self.kill()
        self._log.close()


class Cluster:
    """Starts fl-server / fl-edge processes for one test and kills them afterwards."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.port = 0

    def server(self, *args: str, port: int = 0, checkpoint: str = "server-state",
               name: str = "server", tls_dir: Path | None = None) -> Proc:
        ready = self.tmp / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        transport = ["--tls-dir", str(tls_dir)] if tls_dir is not None else ["--insecure"]
        proc = Proc([sys.executable, "-m", "fl_server", *transport, "--port", str(port),
                     "--checkpoint-dir", str(self.tmp / checkpoint), "--ready-file", str(ready),
                     "--poll-timeout", "5", *args], self.tmp / f"{name}.log")
        self.procs.append(proc)
        wait_for(lambda: ready.exists() or proc.popen.poll() is not None, 60, "server ready")
        if not ready.exists():
            raise AssertionError(f"server exited ({proc.popen.returncode}):\n{proc.log()}")
        info = json.loads(ready.read_text())
        self.port = info["port"]
        proc.metrics_port = info["metrics_port"]
        return proc

    def edge(self, data_dir: Path, name: str, *args: str, port: int | None = None,
             env: dict | None = None) -> Proc:
        proc = Proc([sys.executable, "-m", "fl_edge", "--insecure",
                     "--server", f"127.0.0.1:{port or self.port}", "--data-dir", str(data_dir),
                     "--state-dir", str(self.tmp / f"state-{name}"), "--name", name,
                     "--retry-for", "60", *args], self.tmp / f"{name}.log", env=env)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            proc.close()


@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def read_history(checkpoint_dir: Path) -> dict:
    return json.loads((checkpoint_dir / "history.json").read_text())


@contextmanager
def serving(app) -> Iterator[int]:
    """A real ``ServerApp`` (fl_server.app) serving gRPC from a thread of this process, for
    tests that look at or alter the engine while real edges talk to it; yields its port
    and stops it afterwards."""
    loop = asyncio.new_event_loop()
    port = loop.run_until_complete(app.start())
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(app.run(stop),))
    thread.start()
    try:
        yield port
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)
        loop.close()


def edge_data(root: Path, n_train: int = 100) -> Path:
    """An edge folder whose train split holds exactly ``n_train`` samples (n_k)."""
    root.mkdir(parents=True)
    x, y = make_images(n_train, seed=7)
    np.savez(root / "train.npz", x=x, y=y)
    x, y = make_images(40, seed=8)
    np.savez(root / "test.npz", x=x, y=y)
    return root

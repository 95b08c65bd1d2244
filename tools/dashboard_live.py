"""The data for ``python -m fl_tools.dashboard --live``: a short real federation scraped
by a real Prometheus, both on loopback, for as long as the picture's time range.

Apart from the renderer because it starts processes (fl-server, fl-edges, ``prometheus``)
and the renderer only reads an HTTP API. The federation runs fedavg on the bundled MNIST
subset with more rounds than the scrape needs, so every target is still up when the
panels are queried (a target that has gone turns its series stale).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class DashboardError(Exception):
    """Bad input or a live run that could not be made (the dashboard file, Prometheus
    unreachable, a process that exited); the message names it. Defined here, below the
    renderer, so that neither module imports the other."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prometheus_config(root: Path, server: int, edges: list[int]) -> Path:
    """deploy/prometheus.yml's jobs and rules, pointed at loopback, scraping every second."""
    import yaml

    config = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(REPO / "deploy" / rule) for rule in config["rule_files"]]
    targets = {"fl-server": [f"127.0.0.1:{server}"],
               "fl-edge": [f"127.0.0.1:{port}" for port in edges]}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    path = root / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _wait(predicate, seconds: float, what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if any(p.poll() is not None for p in procs):
            raise DashboardError(f"a process exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise DashboardError(f"timed out after {seconds:g}s waiting for {what}")
        time.sleep(0.5)


@contextmanager
def live_prometheus(edges: int, seconds: float) -> Iterator[str]:
    """Yields the URL of a Prometheus that has scraped a running federation for
    ``seconds``; stops everything afterwards."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise DashboardError("--live needs Prometheus on PATH (Debian: apt-get install "
                             "prometheus)")
    from fedattn_shared.data.partition import main as partition
    from fedattn_shared.data.shipped import bundled_mnist

    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="fedattn-dashboard-") as tmp:
        root = Path(tmp)
        logs = open(root / "processes.log", "wb")
        try:
            if partition(["--source", str(bundled_mnist()), "--edges", str(edges), "--scheme",
                          "dirichlet", "--alpha", "0.5", "--seed", "0", "--limit",
                          str(300 * edges), "--out", str(root / "data")]) != 0:
                raise DashboardError("could not partition the bundled MNIST subset")
            ports = [_free_port() for _ in range(edges + 1)]
            ready = root / "ready.json"

            def spawn(*argv: str) -> None:
                procs.append(subprocess.Popen(argv, stdout=logs, stderr=subprocess.STDOUT,
                                              cwd=REPO))

            spawn(sys.executable, "-m", "fl_server", "--insecure", "--port", "0", "--ready-file",
                  str(ready), "--checkpoint-dir", str(root / "server"), "--method", "fedavg",
                  "--rounds", str(max(1000, int(4 * seconds))), "--min-edges", str(edges),
                  "--local-epochs", "1", "--metrics-port", str(ports[0]), "--poll-timeout", "5")
            _wait(ready.exists, 120, "fl-server", procs)
            grpc_port = json.loads(ready.read_text())["port"]
            for i, data in enumerate(sorted(p for p in (root / "data").iterdir() if p.is_dir())):
                spawn(sys.executable, "-m", "fl_edge", "--insecure", "--server",
                      f"127.0.0.1:{grpc_port}", "--data-dir", str(data), "--state-dir",
                      str(root / "state" / data.name), "--name", data.name, "--progress", "off",
                      "--metrics-port", str(ports[1 + i]))
            web = _free_port()
            spawn(binary, f"--config.file={_prometheus_config(root, ports[0], ports[1:])}",
                  f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}")
            url = f"http://127.0.0.1:{web}"

            def up() -> bool:
                try:
                    with urllib.request.urlopen(f"{url}/api/v1/query?query=sum(up)", timeout=5) as r:
                        result = json.loads(r.read())["data"]["result"]
                    return bool(result) and float(result[0]["value"][1]) == edges + 1
                except (OSError, ValueError, KeyError):
                    return False

            _wait(up, 120, "every target scraped", procs)
            time.sleep(seconds + 3)  # the range drawn, and its last scrapes finished
            if any(p.poll() is not None for p in procs):
                raise DashboardError(f"a process exited during the run; see {root}")
            yield url
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            logs.close()

"""The README's promise, "any method: ``fl-demo --method M``", for every registered method.

Each case is the real command line (``python -m fl_tools.demo``), with its real
``fl-server`` and two real ``fl-edge`` processes over gRPC on loopback, one round. What
costs time is starting three torch processes per method, not training, so the demos
run a few at a time (``WORKERS``) and the cases read their results: a case selected
alone (``-k pfedka``) runs only its own demo. The data is cut to a few hundred images
(``--limit``) and the report is skipped (``tests/test_tools.py`` covers it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO

from fedattn_shared.methods import available_methods

METHODS = available_methods()
WORKERS = 2  # concurrent demos (each mostly starts torch in 3 processes): one per core


def demo(method: str, out: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "fl_tools.demo", "--method", method, "--edges", "2",
         "--rounds", "1", "--local-epochs", "1", "--limit", "300", "--no-report",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    return result, time.monotonic() - start


@pytest.fixture(scope="module")
def demos(request, tmp_path_factory):
    """Runs the demos of the selected cases, ``WORKERS`` at a time; method -> (result,
    seconds, run folder)."""
    selected = sorted({item.callspec.params["method"] for item in request.session.items
                       if item.originalname == "test_fl_demo_runs_every_method"
                       and hasattr(item, "callspec")})
    root = tmp_path_factory.mktemp("demos")
    with ThreadPoolExecutor(WORKERS) as pool:
        runs = dict(zip(selected, pool.map(lambda m: demo(m, root / m), selected),
                        strict=True))
    return {m: (*runs[m], root / m) for m in selected}


@pytest.mark.parametrize("method", METHODS)
def test_fl_demo_runs_every_method(demos, method):
    result, seconds, out = demos[method]
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}"
                   for p in sorted((out / "logs").glob("*.log"))) if (out / "logs").exists() else ""
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:] + logs
    history = json.loads((out / "server" / "history.json").read_text())
    assert history["manifest"]["method"] == method
    (record,) = history["rounds"]
    assert sorted(record["train"]["received"]) == ["edge_00", "edge_01"]
    assert record["evaluation"]["summary"]["global_test"]["edges"] == 2
    print(f"{method}: {seconds:.1f}s")

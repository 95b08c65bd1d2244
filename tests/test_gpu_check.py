"""bench/gpu_check.sh, the one prepared command for a lent GPU: it parses, and every step
it runs works end to end on the CPU at smoke sizes (so a GPU's short loan is not lost to a
typo), resumes by skipping the steps whose result file exists, and its steps' figures have
the fields docs/benchmarks.md is written from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

SCRIPT = REPO / "bench" / "gpu_check.sh"


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.slow
def test_every_step_runs_on_the_cpu_and_a_second_run_resumes(tmp_path):
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_SMOKE": "1", "PYTHON": sys.executable}
    first = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
                           timeout=900, env=env, cwd=REPO)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    names = ["01-test_cuda.txt", "02-throughput.json", "03-throughput-deterministic.json",
             "04-throughput-amp.json", "05-dp-memory.json", "06-same-seed.json",
             "07-same-seed-warn-only.json"]
    assert all((tmp_path / name).is_file() for name in names), sorted(os.listdir(tmp_path))
    assert not list(tmp_path.glob("*.part"))
    rows = json.loads((tmp_path / "03-throughput-deterministic.json").read_text())
    assert rows[0]["deterministic"] and rows[0]["speed_ratio"] > 0 and rows[0]["cpu_ratio"] > 0
    assert json.loads((tmp_path / "04-throughput-amp.json").read_text())[0]["amp"]
    memory = json.loads((tmp_path / "05-dp-memory.json").read_text())
    assert memory[0]["steps"] >= 1 and memory[0]["peak_bytes"] >= 0
    for name in ("06-same-seed.json", "07-same-seed-warn-only.json"):
        assert all(row["bit_identical"] for row in json.loads((tmp_path / name).read_text()))
    again = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
                           timeout=300, env=env, cwd=REPO)
    assert again.returncode == 0 and again.stdout.count("done before") == len(names)

"""The user's daily tools end to end: fl-demo and fl-sim with real processes.

Each tool runs as a user starts it (its own interpreter, a bare PATH). The real runs start
two at a time in ``runs`` (each is mostly torch starting in its processes, which
overlap) and the cases read their results."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import REPO

from fl_server.checkpoint import CheckpointStore


def run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={
                              "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                              # the code under test, where PYTHONPATH names a checkout
                              **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}})


# The first case waits for all six runs in ``runs`` (pytest-timeout counts the setup).
pytestmark = pytest.mark.timeout(900)


def run_args(root: Path) -> dict[str, list[str]]:
    """The module's real runs: name -> the tool's arguments (outputs under ``root``)."""
    return {
        "demo": ["fl_tools.demo", "--method", "fedprox", "--model", "lenet-bn", "--edges", "2",
                 "--rounds", "2", "--out", str(root / "demo"), "--set", "fedprox.mu=0.1"],
        "privacy": ["fl_tools.demo", "--method", "fedavg", "--edges", "2", "--rounds", "1",
                    "--local-epochs", "1", "--limit", "400", "--no-report", "--out",
                    str(root / "privacy"), "--dp", "--secagg", "--tls-dir", str(root / "ca")],
        "refused": ["fl_tools.demo", "--method", "fedstar", "--edges", "2", "--rounds", "1",
                    "--limit", "400", "--no-report", "--out", str(root / "refused"), "--dp"],
        "sim": ["fl_tools.sim", "--method", "fedavg", "--edges", "6", "--procs", "2",
                "--fraction", "0.5", "--rounds", "2", "--out", str(root / "sim")],
        "sim-tls": ["fl_tools.sim", "--method", "fedavg", "--edges", "4", "--procs", "2",
                    "--fraction", "1", "--rounds", "1", "--out", str(root / "sim-tls"),
                    "--tls-dir", str(root / "sim-ca")],
        # A learning rate that makes every edge's loss non-finite at its first step.
        "diverge": ["fl_tools.sim", "--method", "fedavg", "--edges", "3", "--procs", "2",
                    "--fraction", "1", "--rounds", "3", "--out", str(root / "diverge"),
                    "--set", "train.lr=1e30"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    root = tmp_path_factory.mktemp("tools")
    todo = run_args(root)
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(todo, pool.map(lambda args: run(*args), todo.values()), strict=True))
    return root, done


def test_fl_demo_trains_on_bundled_mnist(runs):
    root, results = runs
    out, result = root / "demo", results["demo"]
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    history = json.loads((out / "server" / "history.json").read_text())
    assert history["manifest"]["params"] == {"mu": 0.1}
    final = history["rounds"][-1]["evaluation"]["summary"]
    assert final["test"]["edges"] == 2 and final["global_test"]["edges"] == 2
    assert final["global_test"]["mean_accuracy"] > 0.6  # real digits, 2 rounds
    assert (out / "report" / "accuracy.png").exists()
    lines = [line for line in result.stdout.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert len(lines) == 2 and "shared_tensors" in lines[0]
    again = run("fl_tools.demo", "--out", str(out))
    assert again.returncode == 2 and "--force" in again.stderr and "--out" in again.stderr
    # What the demo sets over fl-server's defaults, it says (the user's --model is theirs).
    assert "fl-demo sets, over fl-server's defaults: --momentum 0.9 (default 0.0), " \
           "--local-epochs 2 (default 1)" in result.stdout, result.stdout


def test_fl_demo_passes_privacy_options_to_the_server(runs):
    """--dp alone picks the demo budget (epsilon 8) and says so; --secagg and --tls-dir
    reach the server (a CA made for 127.0.0.1, a certificate per edge); a method that
    cannot run under DP is refused by name, with status 2."""
    root, results = runs
    out, ca, result = root / "privacy", root / "ca", results["privacy"]
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "epsilon=8" in result.stdout and "secure aggregation" in result.stdout
    assert "not DP's utility" in result.stdout  # said before a table near chance
    history = json.loads((out / "server" / "history.json").read_text())
    manifest = history["manifest"]
    assert manifest["dp"]["enabled"] and manifest["dp"]["target_epsilon"] == 8.0
    assert manifest["server"]["secagg"] and manifest["server"]["tls_dir"] == str(ca)
    assert "secagg-unmask:train" in history["rounds"][0]
    assert sorted(json.loads((ca / "enrolled.json").read_text())) == ["edge_00", "edge_01"]
    refused = results["refused"]
    assert refused.returncode == 2 and "fedstar" in refused.stderr, refused.stderr[-2000:]
    assert "--dp" in refused.stderr


def test_fl_demo_trains_with_the_server_s_defaults_and_says_what_it_adds():
    """One place for the training defaults (TrainConfig): fl-demo passes no learning rate
    of its own, and names each setting it adds over fl-server's defaults."""
    from fedattn_shared.config import TrainConfig
    from fl_tools.demo import build_parser, server_settings

    flags, notes = server_settings(build_parser().parse_args(["--method", "fedavg"]))
    assert "--lr" not in flags and TrainConfig().lr == 0.05
    assert notes[0] == ("fl-demo sets, over fl-server's defaults: --model se-cnn (fl-server's "
                        "default: lenet-bn), --momentum 0.9 (default 0.0), --local-epochs 2 "
                        "(default 1)")
    flags, notes = server_settings(build_parser().parse_args(
        ["--method", "fedsap", "--momentum", "0.5", "--local-epochs", "1"]))
    assert flags[flags.index("--momentum") + 1] == "0.5"
    assert not any(n.startswith("fl-demo sets") for n in notes)  # fedsap declares se-cnn


@pytest.mark.parametrize("argv, folder", [
    ([], "demo-fedsap"), (["--secagg"], "demo-fedsap-secagg"), (["--dp"], "demo-fedsap-dp"),
    (["--dp-epsilon", "4", "--secagg", "--compress", "up=int8"], "demo-fedsap-dp-secagg-compress"),
    (["--method", "pfedka", "--tls-dir", "ca"], "demo-pfedka-tls"),
    (["--method", "plugin_methods:CensusAvg"], "demo-plugin_methods-CensusAvg")])
def test_fl_demo_runs_that_differ_get_folders_of_their_own(argv, folder):
    """`fl-demo --secagg` then `fl-demo --dp` wrote the same runs/demo-fedsap, and the
    second refused to start."""
    from fl_tools.demo import build_parser, default_out

    assert default_out(build_parser().parse_args(argv)) == Path("runs") / folder


def test_fl_sim_runs_many_edges_in_few_processes(runs):
    root, results = runs
    out, result = root / "sim", results["sim"]
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    history = json.loads((out / "server" / "history.json").read_text())
    for record in history["rounds"]:
        assert len(record["train"]["selected"]) == 3  # 50 % of 6
        assert len(record["evaluate"]["received"]) == 6  # evaluation reaches every edge
    identities = {json.loads((out / "state" / d / "identity.json").read_text())["edge_id"]
                  for d in [p.name for p in (out / "state").iterdir()]}
    assert len(identities) == 6


def test_fl_sim_over_mutual_tls_issues_a_certificate_per_edge(runs, tmp_path):
    root, results = runs
    out, ca, result = root / "sim-tls", root / "sim-ca", results["sim-tls"]
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    enrolled = json.loads((ca / "enrolled.json").read_text())
    names = sorted(p.name for p in (out / "state").iterdir())
    assert sorted(enrolled) == names and len(names) == 4
    history = json.loads((out / "server" / "history.json").read_text())
    assert sorted(history["rounds"][0]["train"]["received"]) == names
    assert "serving on" in (out / "logs" / "server.log").read_text()
    # Against a running server, the folder must already hold its CA.
    refused = run("fl_tools.sim", "--edges", "4", "--data-root", str(out / "data"),
                  "--server", "127.0.0.1:1", "--out", str(tmp_path / "other"),
                  "--tls-dir", str(tmp_path / "empty"))
    assert refused.returncode == 2 and "holds no CA" in refused.stderr


def test_fl_sim_stops_when_an_edge_fails_instead_of_waiting_for_it(runs):
    """A diverged edge used to die in its thread while its worker's other edges lived on,
    and fl-sim's server (which waits for every edge) waited for ever. The edge now leaves,
    saying why, and fl-sim stops the run and says which edges failed."""
    root, results = runs
    out, result = root / "diverge", results["diverge"]
    assert result.returncode == 1, result.stderr[-3000:] + result.stdout[-3000:]
    assert "fl-sim: edges failed; stopping the run" in result.stderr
    assert re.search(r"training diverged in round 1: training loss became (nan|inf)",
                     result.stderr), result.stderr[-3000:]
    server_log = (out / "logs" / "server.log").read_text()
    assert "left ('training diverged in round 1" in server_log  # the server heard why
    assert "stopping on request" in server_log  # stopped by fl-sim, not by a timeout
    assert "(deadline)" not in server_log  # no edge was waited for until a deadline


def test_fl_sim_resumes_a_killed_run_to_the_same_global(runs, tmp_path):
    """A federation longer than one command (a GPU lease's 10-minute call): fl-sim and all
    its processes are killed after round 1's checkpoint, and ``--resume`` finishes the run
    from there. The edges train slowly (``--throttle``, which changes no upload) so that the
    kill usually lands inside round 2; wherever it lands, the resumed run must end with the
    global of the "sim" run, which was never stopped, bit for bit."""
    root, results = runs
    assert results["sim"].returncode == 0
    args = run_args(root)["sim"][1:-2] + ["--out", str(tmp_path / "killed")]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}
    first = subprocess.Popen([sys.executable, "-m", "fl_tools.sim", *args, "--throttle", "1:4"],
                             cwd=REPO, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = CheckpointStore(tmp_path / "killed" / "server")
    try:
        deadline = time.monotonic() + 240
        while store.latest() is None and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.latest() is not None, "no checkpoint before the kill"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # fl-sim, its server and its workers at once
        first.wait(timeout=30)
    resumed = run("fl_tools.sim", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:] + resumed.stdout[-3000:]
    assert "resumed from round" in (tmp_path / "killed" / "logs" / "server.log").read_text()
    done, never_stopped = store.load(), CheckpointStore(root / "sim" / "server").load()
    assert done[0] == never_stopped[0] == 2
    assert done[1].keys() == never_stopped[1].keys()
    assert all(torch.equal(done[1][k], never_stopped[1][k]) for k in done[1])

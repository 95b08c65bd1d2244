"""bench/_harness.py (issue #44, item 4): every figure over seeds printed with each seed's
own, and the time budget that lets a paper-scale row span 10-minute GPU commands — the
bench kills its federation at the budget and the same command resumes it from the last
round checkpoint, ending where a run that was never stopped ends."""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, bench_script

from fedattn_shared.state import load_tensors
from fl_server.checkpoint import CheckpointStore


@pytest.fixture(scope="module")
def harness():
    with bench_script("_harness") as module:
        yield module


def test_pm_seeds_prints_every_seed_beside_the_mean(harness):
    assert harness.pm_seeds([51.9, 54.0, 53.9], [0, 1, 2]) == \
        "53.3 ± 1.2 (s0 51.9, s1 54.0, s2 53.9)"
    # one seed is named as one seed, never read as a mean
    assert harness.pm_seeds([41.6], [0]) == "41.6 (s0)"
    assert harness.pm_seeds([0.8301, 0.7362], [3, 7], 4) == "0.7832 ± 0.0664 (s3 0.8301, s7 0.7362)"
    # a seed without a figure is shown as such and left out of the mean
    assert harness.pm_seeds([50.0, math.nan, 52.0], [0, 1, 2]) == "51.0 ± 1.4 (s0 50.0, s1 -, s2 52.0)"
    assert harness.pm_seeds([], []) == "-"
    with pytest.raises(ValueError):
        harness.pm_seeds([1.0, 2.0], [0])


def test_run_kills_the_whole_command_at_the_deadline(harness, tmp_path):
    """The command and the process it started are gone when BudgetSpent is raised (an
    fl-sim leaves a server and workers behind otherwise); past the deadline nothing starts."""
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(600)")
    log = tmp_path / "run.log"
    started = time.monotonic()
    with pytest.raises(harness.BudgetSpent):
        harness.run([sys.executable, "-c", script], log, until=time.monotonic() + 5)
    assert time.monotonic() - started < 60
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the command's child {child} outlived the budget")
    assert "stopped at the time budget" in log.read_text()

    marker = tmp_path / "started"
    with pytest.raises(harness.BudgetSpent):
        harness.run([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], log,
                    until=time.monotonic() - 1)
    assert not marker.exists()


@pytest.mark.timeout(900)  # three federations on the shared machine
def test_a_budget_killed_personalized_run_resumes_bit_identical(harness, tmp_path):
    """Fed-SAP (private SE excitation on every edge, a server-side S_G) on the bundled MNIST,
    3 rounds: one run never stopped, one killed by the harness's budget once round 1 is
    checkpointed (slowed edges: the kill lands in round 2 or 3) and resumed with the same
    command plus --resume. The server's last checkpoint and every edge's private state
    must be the same, bit for bit."""
    common = [sys.executable, "-m", "fl_tools.sim", "--method", "fedsap", "--edges", "2",
              "--procs", "1", "--fraction", "1", "--rounds", "3", "--seed", "0",
              "--set", "train.batch_size=64", "--set", "server.eval_every=3"]
    never = tmp_path / "never"
    harness.run([*common, "--out", str(never)], tmp_path / "never.log")

    killed = tmp_path / "killed"
    first = subprocess.Popen([*common, "--out", str(killed), "--throttle", "1:3"], cwd=REPO,
                             start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    store = CheckpointStore(killed / "server")
    try:
        deadline = time.monotonic() + 300
        while store.latest() is None and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.latest() is not None, "no checkpoint before the kill"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # what run() does at the budget
        first.wait(timeout=30)
    assert harness.resumable(killed)
    harness.run([*common, "--out", str(killed), "--resume"], tmp_path / "resumed.log")
    assert "resumed from round 1" in (killed / "logs" / "server.log").read_text()

    done, reference = store.load(), CheckpointStore(never / "server").load()
    assert done[0] == reference[0] == 3
    assert done[1].keys() == reference[1].keys()
    assert all(torch.equal(done[1][k], reference[1][k]) for k in done[1])
    edges = sorted(p.name for p in (never / "state").iterdir() if p.is_dir())
    assert len(edges) == 2 and edges == sorted(p.name for p in (killed / "state").iterdir()
                                               if p.is_dir())
    for edge in edges:
        mine, _ = load_tensors(killed / "state" / edge / "private.safetensors")
        theirs, _ = load_tensors(never / "state" / edge / "private.safetensors")
        assert mine.keys() == theirs.keys()
        differ = [k for k in mine if not torch.equal(mine[k], theirs[k])]
        assert not differ, f"{edge}: private state differs after the resume: {differ[:5]}"


def test_a_carried_optimizer_run_is_never_read_back_as_a_reset_one(tmp_path):
    """Every bench that trains takes ``--optimizer-state`` (issue #44 item 2: the results
    files say which behaviour they used); since ``--out`` doubles as a cache, a run with
    the optimizer carried across rounds has its own folder in each, and a reset run (the
    default) keeps the folder it had."""
    def folders(state: str) -> list[str]:
        args = argparse.Namespace(
            out=tmp_path, optimizer_state=state, device="cpu", dataset="cifar10",
            model="m", limit=0, batch_size=32, rounds=50, epochs=10, scaffold_form="paper",
            clip_grad_norm=0.0, augment="none", skipinit=False, pretrained=0,
            input_range="symmetric")
        with bench_script("pfedka") as pfedka, bench_script("fedsap") as fedsap, \
                bench_script("fedstar") as fedstar, bench_script("anfr") as anfr, \
                bench_script("calibrate") as calibrate:
            config = pfedka.BASELINES[0]
            return [str(pfedka.run_path(args, config, "0.1", 0)),
                    fedsap.run_protocol(args, "0.5"),
                    str(fedstar.run_dir(args, "mnist", "fedstar", 0)),
                    str(anfr.run_dir(args, "dirichlet", "ANFR", "fedavg", 0)),
                    str(calibrate.run_dir(args, calibrate.ROWS["fedavg-dir"], 0))]

    reset, carry = folders("reset"), folders("carry")
    assert not any("carry" in f for f in reset)
    assert all(c != r and "-carry" in c for c, r in zip(carry, reset, strict=True))
    with bench_script("_harness") as harness:
        assert harness.optimizer_state_words(argparse.Namespace(optimizer_state="carry")) == \
            "local optimizer state carried across rounds"


def test_two_runs_partitioning_one_folder_together_both_finish_with_one_partition(harness,
                                                                                   tmp_path):
    # Two calibration rows on one partition, started together: fl-partition refuses a
    # folder that exists, so the second used to fail. Each now writes beside the folder
    # and renames; the first rename wins, the other's copy goes, both runs go on. A folder
    # a crash left without its partition.json is replaced.
    import threading

    import numpy as np

    source = tmp_path / "source"
    source.mkdir()
    rng = np.random.default_rng(0)
    np.savez(source / "data.npz", x=rng.integers(0, 256, (400, 8, 8), dtype=np.uint8),
             y=np.arange(400) % 10)
    out = tmp_path / "data" / "iid-e4"
    flags = ["--source", str(source), "--edges", "4", "--seed", "0", "--scheme", "iid",
             "--global-test-per-class", "5"]
    made, errors = [], []

    def one(log: str) -> None:
        try:
            made.append(harness.fl_partition(out, tmp_path / log, flags))
        except BaseException as err:  # noqa: BLE001 - a failed command exits (SystemExit)
            errors.append(err)

    for log in ("a", "b"):
        (tmp_path / log).mkdir()
    threads = [threading.Thread(target=one, args=(log,)) for log in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and sorted(made) in ([False, True], [True, True])
    assert (out / "partition.json").exists() and len(list(out.glob("edge_*"))) == 4
    assert [p.name for p in out.parent.iterdir()] == ["iid-e4"]  # no copy left beside it
    (out / "partition.json").unlink()  # a crash's half-written partition
    assert harness.fl_partition(out, tmp_path / "a", flags)
    assert (out / "partition.json").exists()

"""Simulated slow and flaky edges (issue #27): fl-edge --throttle / --disconnect and
fl-sim's seeded choice of which edges get them. Real processes over real gRPC wherever a
server is involved."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, Cluster, read_history, write_edge_dirs
from test_determinism import _final_global, _identical
from test_tools import run as run_tool

from fedattn_shared.schema import Payload
from fedattn_shared.wire import fedattn_pb2 as pb
from fl_edge.cli import main as edge_main
from fl_edge.heterogeneity import Disconnected, Dropout, Throttle, parse_disconnect
from fl_edge.tasks import Result, Task
from fl_tools.sim import choose_edges
from fl_tools.sim import main as sim_main


def _task(round: int = 1, phase: str = "train") -> Task:
    return Task(pb.TaskHeader(round=round, phase=phase), Payload(), Payload(), 0, "e0",
                lambda r, n: 0.1)


class FakeClock:
    """A clock only the test moves: the work advances it, the sleep is recorded."""

    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_throttle_sleeps_factor_minus_one_times_the_work_and_keeps_the_result():
    clock = FakeClock()
    upload = Payload()
    result = Result(upload, 7, metrics={"train_seconds": 2.0})

    def work(task: Task) -> Result:
        clock.now += 2.5
        return result

    out = Throttle(5.0, clock=clock, sleep=clock.sleep)(_task(), work)
    assert clock.slept == [10.0]  # (5 - 1) x 2.5 s of work
    assert out.upload is upload and out.num_examples == 7
    assert out.metrics == {"train_seconds": 2.0, "throttle_seconds": 10.0}
    # Factor 1 sleeps nothing and adds no figure.
    clock.slept.clear()
    assert Throttle(1.0, clock=clock, sleep=clock.sleep)(_task(), work) is result
    assert clock.slept == []
    with pytest.raises(ValueError, match="--throttle"):
        Throttle(0.5)


def test_dropout_is_seeded_per_edge_and_loses_the_result():
    def pattern(edge: str, seed: int, p: float = 0.3) -> list[bool]:
        dropout = Dropout(p, 1.0, edge, seed)
        return [dropout.draws() for _ in range(200)]

    assert pattern("e1", 0) == pattern("e1", 0)
    assert pattern("e1", 0) != pattern("e2", 0) and pattern("e1", 0) != pattern("e1", 1)
    assert 30 < sum(pattern("e1", 0)) < 90  # about 30 % of 200
    assert all(pattern("e1", 0, p=1.0)) and not any(pattern("e1", 0, p=0.0))
    worked = []
    dropout = Dropout(1.0, 2.5, "e1")
    with pytest.raises(Disconnected) as lost:
        dropout(_task(3, "evaluate"), lambda task: worked.append(task) or Result())
    assert worked and lost.value.offline == 2.5 and "round 3 evaluate" in str(lost.value)
    assert parse_disconnect("0.2") == (0.2, 10.0) and parse_disconnect("1:0") == (1.0, 0.0)


@pytest.mark.parametrize("flag, value, message", [
    ("--throttle", "0.5", "--throttle 0.5"), ("--throttle", "inf", "--throttle inf"),
    ("--disconnect", "1.5", "--disconnect '1.5'"), ("--disconnect", "0.1:nan", "--disconnect"),
    ("--disconnect", "often", "--disconnect 'often'")])
def test_edge_refuses_bad_simulation_flags_by_name(tmp_path, capsys, flag, value, message):
    """The command line's checks, before anything reaches for the network."""
    argv = ["--insecure", "--server", "127.0.0.1:1", "--data-dir", str(tmp_path), flag, value]
    assert edge_main(argv) == 2
    assert message in capsys.readouterr().err


def test_edge_process_exits_2_on_a_bad_throttle(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fl_edge", "--insecure", "--server",
                             "127.0.0.1:1", "--data-dir", str(tmp_path), "--throttle", "0"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2 and "--throttle 0.0" in result.stderr, result.stderr[-2000:]


def _one_edge_run(root, data_dir, *edge_args: str) -> tuple[dict, dict]:
    cluster = Cluster(root)
    root.mkdir(parents=True, exist_ok=True)
    try:
        server = cluster.server("--method", "fedavg", "--rounds", "2", "--min-edges", "1",
                                "--local-epochs", "1", "--eval-every", "0", "--seed", "5")
        edge = cluster.edge(data_dir, "e0", *edge_args)
        assert edge.wait() == 0, edge.log()[-3000:]
        assert server.wait() == 0
    finally:
        cluster.close()
    return _final_global(root / "server-state"), read_history(root / "server-state")


def test_throttled_edge_uploads_bit_identical_results_and_reports_its_sleep(tmp_path):
    data = write_edge_dirs(tmp_path, 1, per_edge=200)[0]
    plain, plain_history = _one_edge_run(tmp_path / "plain", data)
    slow, slow_history = _one_edge_run(tmp_path / "slow", data, "--throttle", "3")
    assert plain and _identical(plain, slow) == []
    for plain_round, slow_round in zip(plain_history["rounds"], slow_history["rounds"],
                                       strict=True):
        assert "throttle_seconds" not in plain_round["train"]["edge_metrics"]["e0"]
        figures = slow_round["train"]["edge_metrics"]["e0"]
        # The sleep covers the whole task (training and every middleware): at least
        # (3 - 1) x the training loop's own time.
        assert figures["throttle_seconds"] >= 2 * figures["train_seconds"] > 0


def _seed_losing_only_task(lost: int, p: float, tasks: int) -> int:
    """A --disconnect-seed whose draws for edge "flaky" lose its task number ``lost``
    (from 0), no other."""
    want = [i == lost for i in range(tasks)]
    for seed in range(100_000):
        dropout = Dropout(p, 0, "flaky", seed)
        if [dropout.draws() for _ in range(tasks)] == want:
            return seed
    raise AssertionError("no such seed")


def test_disconnecting_edge_loses_its_task_and_rejoins_from_its_saved_state(cluster, tmp_path):
    dirs = write_edge_dirs(tmp_path, 2, per_edge=100)
    # Training tasks only (--eval-every 0): the second is round 2's.
    seed = _seed_losing_only_task(1, 0.2, 20)
    # Every result closes a phase (no --quorum): the lost one is dropped, not waited for.
    server = cluster.server("--method", "fedbn", "--rounds", "3", "--min-edges", "2",
                            "--local-epochs", "1", "--eval-every", "0")
    steady = cluster.edge(dirs[0], "steady")
    flaky = cluster.edge(dirs[1], "flaky", "--disconnect", "0.2:1",
                         "--disconnect-seed", str(seed))
    server.wait_log("round 2 train: dropped flaky (disconnected)")
    assert [steady.wait(), flaky.wait()] == [0, 0]  # a simulated disconnect is no error
    assert server.wait() == 0
    rounds = read_history(tmp_path / "server-state")["rounds"]
    assert [r["train"]["received"] for r in rounds] == [
        ["flaky", "steady"], ["steady"], ["flaky", "steady"]]
    assert rounds[1]["train"]["dropped"] == {"flaky": "disconnected"}
    log = flaky.log()
    assert log.count("simulated disconnect") == 1 and "round 2 train: simulated" in log
    # Back as a rebooted device, from the state round 1 wrote: round 2's work, done and
    # lost with the connection, wrote nothing.
    assert "(round 1, phase train" in log.split("simulated disconnect")[1]


def test_fl_sim_chooses_slow_and_flaky_edges_by_seed_and_runs_them(tmp_path):
    names = [f"edge_{i:02d}" for i in range(20)]
    slow = choose_edges(names, 0.25, 7, "throttle")
    assert len(slow) == 5 and slow == choose_edges(names, 0.25, 7, "throttle")
    assert slow != choose_edges(names, 0.25, 8, "throttle")
    assert len(choose_edges(names, 0.1, 7, "disconnect")) == 2
    out, data = tmp_path / "sim", tmp_path / "data"
    edges = [d.name for d in write_edge_dirs(data, 4, per_edge=60)]
    # The flaky edge loses every task and is away 60 s: the run ends without it, and
    # fl-sim, whose server ended the run, does not wait for it (nor call it a failure).
    result = run_tool("fl_tools.sim", "--method", "fedavg", "--edges", "4", "--procs", "2",
                      "--fraction", "1", "--rounds", "1", "--out", str(out), "--seed", "3",
                      "--data-root", str(data), "--throttle", "0.5:3",
                      "--disconnect", "0.25:1:60", "--set", "server.eval_every=0")
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    plan = json.loads((out / "sim.json").read_text())
    assert plan["slow"] == choose_edges(edges, 0.5, 3, "throttle") and plan["throttle"] == 3
    assert plan["flaky"] == choose_edges(edges, 0.25, 3, "disconnect")
    assert plan["disconnect"] == 1 and plan["offline_seconds"] == 60
    assert plan["disconnect_seed"] == 3
    assert ", ".join(plan["slow"]) in result.stdout and plan["flaky"][0] in result.stdout
    train = read_history(out / "server")["rounds"][0]["train"]
    # The worker gave each edge its own options: the flaky one dropped out, only the
    # slow ones slept.
    assert train["dropped"] == {plan["flaky"][0]: "disconnected"}
    assert sorted(n for n, f in train["edge_metrics"].items() if "throttle_seconds" in f) \
        == sorted(set(plan["slow"]) - set(plan["flaky"]))


@pytest.mark.parametrize("flag, value", [("--throttle", "0.5"), ("--throttle", "0.5:0.9"),
                                         ("--disconnect", "2:0.1"), ("--disconnect", "0.1:2")])
def test_fl_sim_refuses_bad_heterogeneity_flags_by_name(tmp_path, capsys, flag, value):
    """Before a byte of data is partitioned or a process started."""
    assert sim_main(["--edges", "4", "--out", str(tmp_path / "sim"), flag, value]) == 2
    assert f"{flag} '{value}'" in capsys.readouterr().err
    assert not (tmp_path / "sim" / "data").exists()

"""Poisoned and oversized uploads against a real fl-server process, sent by raw edges
(``rawedge.RawEdge``: the wire protocol by hand, so each upload is exactly the bytes an
adversary would send). What one edge uploads within the schema must neither replace the
global nor destroy it, and nothing it sends may stop the server:

* a weight of 2**64 - 1 on a zero model is refused by name; the honest edge's upload is
  the next global, bit for bit;
* finite uploads of 3e38 (float32's range ends at 3.4e38) average to 3e38, not Inf, and
  the next round takes honest uploads again;
* with --clip-update-norm, an upload far from the global is refused by name while an
  honest edge in the same round is accepted;
* a FedAdam step that would leave an infinite moment aborts its round: the global stays
  bit-identical, the history says why, the next round runs;
* a real fl-edge declares its training-set size at join, the cap its weights meet.

Every wait is for a task, a log line or a history record, with a generous timeout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import Cluster, Proc, wait_for, write_edge_dirs
from rawedge import RawEdge, Task, shifted, train_messages

ROUNDS = 50           # more than any scenario uses: the run must still be going at the end
ROUND_TIMEOUT = "30"  # a scenario never waits for it: every selected edge submits
BIAS = "model/classifier.6.bias"
DECLARED = 40         # what the adversary declares at join: its weight cap


@dataclass
class Fleet:
    """One server and its raw edges; tasks already fetched wait in ``pending``."""

    cluster: Cluster
    server: Proc
    edges: dict[str, RawEdge]
    pending: dict[str, Task] = field(default_factory=dict)

    def task(self, name: str) -> Task:
        """The edge's next task (a training task: evaluation is off)."""
        task = self.pending.pop(name, None) or self.edges[name].next_task()
        assert task.header.phase == "train", task.header
        return task

    def round_tasks(self) -> dict[str, Task]:
        tasks = {name: self.task(name) for name in self.edges}
        assert len({t.header.round for t in tasks.values()}) == 1, "edges in different rounds"
        return tasks

    def next_global(self, after: Task) -> dict[str, torch.Tensor]:
        """The global the round after ``after`` starts from (every edge gets it)."""
        name = next(iter(self.edges))
        task = self.edges[name].next_task()
        assert task.header.round == after.header.round + 1, task.header
        self.pending[name] = task
        return task.globals

    def mark(self) -> int:
        return len(self.server.log())

    def logged(self, mark: int, *needles: str) -> str:
        def line():
            return next((text for text in self.server.log()[mark:].splitlines()
                         if all(n in text for n in needles)), None)

        return wait_for(line, 30, f"a server log line with {needles}")

    def record(self, round_number: int) -> dict:
        """The round's history record, once its checkpoint is written."""
        path = self.cluster.tmp / "server-state" / "history.json"

        def find():
            if not path.exists():
                return None
            rounds = json.loads(path.read_text())["rounds"]
            return next((r for r in rounds if r["round"] == round_number), None)

        return wait_for(find, 30, f"round {round_number} in history.json")

    def assert_serving(self) -> None:
        assert self.server.popen.poll() is None, self.server.log()[-3000:]


def fleet(tmp: Path, names: dict[str, dict], *args: str) -> Fleet:
    cluster = Cluster(tmp)
    edges: dict[str, RawEdge] = {}
    try:
        server = cluster.server("--model", "lenet-bn", "--rounds", str(ROUNDS), "--eval-every",
                                "0", "--min-edges", str(len(names)), "--round-timeout",
                                ROUND_TIMEOUT, *args)
        for name, info in names.items():
            edges[name] = RawEdge(cluster.port, prefix=name)
            edges[name].connect(info={"hostname": "adversarial-suite", **info})
        return Fleet(cluster, server, edges)
    except BaseException:
        close(Fleet(cluster, None, edges))  # type: ignore[arg-type]
        raise


def close(f: Fleet) -> None:
    for edge in f.edges.values():
        edge.close()
    f.cluster.close()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    f = fleet(tmp_path_factory.mktemp("plain"),
              {"honest": {}, "mallory": {"num_examples": str(DECLARED)}}, "--method", "fedavg")
    yield f
    close(f)


def assert_bits(after: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(after) == sorted(expected)
    for name, value in expected.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name


def test_a_zero_model_weighted_2_to_the_64_is_refused_by_name(plain):
    tasks = plain.round_tasks()
    honest, mallory = plain.edges["honest"], plain.edges["mallory"]
    zeros = {k: torch.zeros_like(v) for k, v in tasks["mallory"].globals.items()}
    mark = plain.mark()
    reply = mallory.submit(train_messages(mallory, tasks["mallory"], zeros,
                                          num_examples=2**64 - 1))
    assert not reply.accepted
    assert f"num_examples {2**64 - 1} exceeds the weight cap {DECLARED}" in reply.reason
    plain.logged(mark, f"submission from {mallory.edge_id} refused", "weight cap")
    upload = shifted(tasks["honest"].globals, 0.5)
    reply = honest.submit(train_messages(honest, tasks["honest"], upload))
    assert reply.accepted, reply.reason
    # The one accepted upload is the mean, bit for bit (the float64 sum is exact).
    assert_bits(plain.next_global(tasks["honest"]), upload)
    record = plain.record(tasks["honest"].header.round)
    assert record["train"]["received"] == [honest.edge_id]
    assert record["train"]["dropped"][mallory.edge_id].startswith("bad upload")
    assert record["aggregate"]["total_weight"] == 5
    plain.assert_serving()


def test_finite_uploads_near_float32_max_do_not_make_the_global_infinite(plain):
    tasks = plain.round_tasks()
    huge = {k: torch.full_like(v, 3e38) for k, v in tasks["honest"].globals.items()}
    for name, edge in plain.edges.items():  # weight 5 each: 1.5e39 in a float32 sum
        reply = edge.submit(train_messages(edge, tasks[name], huge))
        assert reply.accepted, reply.reason
    after = plain.next_global(tasks["honest"])
    assert all(bool(torch.isfinite(v).all()) for v in after.values())
    assert_bits(after, huge)
    # The run goes on: the next round takes honest uploads and they are the next global.
    tasks = plain.round_tasks()
    honest = {k: torch.full_like(v, 0.25) for k, v in tasks["honest"].globals.items()}
    for name, edge in plain.edges.items():
        reply = edge.submit(train_messages(edge, tasks[name], honest))
        assert reply.accepted, reply.reason
    assert_bits(plain.next_global(tasks["honest"]), honest)
    plain.assert_serving()
    assert "Traceback" not in plain.server.log()


@pytest.fixture(scope="module")
def clipped(tmp_path_factory):
    f = fleet(tmp_path_factory.mktemp("clipped"), {"honest": {}, "mallory": {}},
              "--method", "fedavg", "--clip-update-norm", "5")
    yield f
    close(f)


def test_an_update_over_the_norm_bound_is_refused_and_the_honest_one_kept(clipped):
    tasks = clipped.round_tasks()
    honest, mallory = clipped.edges["honest"], clipped.edges["mallory"]
    mark = clipped.mark()
    # global + 1 everywhere: norm sqrt(44k parameters and statistics), about 210.
    reply = mallory.submit(train_messages(mallory, tasks["mallory"],
                                          shifted(tasks["mallory"].globals, 1.0)))
    assert not reply.accepted
    found = re.search(r"update norm ([0-9.e+]+) exceeds --clip-update-norm 5", reply.reason)
    assert found and 200 < float(found.group(1)) < 220, reply.reason
    clipped.logged(mark, f"submission from {mallory.edge_id} refused", "update norm")
    upload = {k: v.clone() for k, v in tasks["honest"].globals.items()}
    upload[BIAS] += 0.5  # ten coordinates: norm sqrt(10) / 2, under the bound
    reply = honest.submit(train_messages(honest, tasks["honest"], upload))
    assert reply.accepted, reply.reason
    assert_bits(clipped.next_global(tasks["honest"]), upload)
    record = clipped.record(tasks["honest"].header.round)
    assert record["train"]["received"] == [honest.edge_id]
    assert list(record["train"]["update_norm"]) == [honest.edge_id]
    assert abs(record["train"]["update_norm"][honest.edge_id] - 10**0.5 / 2) < 1e-5
    clipped.assert_serving()


@pytest.fixture(scope="module")
def adam(tmp_path_factory):
    f = fleet(tmp_path_factory.mktemp("adam"), {"mallory": {}}, "--method", "fedadam")
    yield f
    close(f)


def test_a_round_whose_aggregate_is_not_finite_aborts_and_the_next_runs(adam):
    # Delta = -3e38 is finite, Delta**2 is not: FedAdam's second moment would be Inf.
    mallory = adam.edges["mallory"]
    task = adam.task("mallory")
    before = task.globals
    poisoned = dict(before, **{BIAS: torch.full_like(before[BIAS], -3e38)})
    mark = adam.mark()
    reply = mallory.submit(train_messages(mallory, task, poisoned))
    assert reply.accepted, reply.reason
    adam.logged(mark, f"round {task.header.round} train: round aborted, the global stays as it was")
    assert_bits(adam.next_global(task), before)
    record = adam.record(task.header.round)
    assert "not finite within float32 range" in record["aborted"]
    assert f"opt:v:{BIAS}" in record["aborted"]
    honest = adam.task("mallory")  # the next round runs and aggregates an honest upload
    reply = mallory.submit(train_messages(mallory, honest, shifted(honest.globals, 0.01)))
    assert reply.accepted, reply.reason
    adam.next_global(honest)
    record = adam.record(honest.header.round)
    assert "aborted" not in record and record["aggregate"]["aggregated"] == 1
    adam.assert_serving()
    assert "Traceback" not in adam.server.log()  # a value problem, not an internal error


def test_a_real_edge_declares_its_training_set_size_at_join(tmp_path):
    # A fresh fl-edge learns the data split from the server's configuration, then joins
    # again to declare its training-set size; its uploads' weight is exactly that.
    cluster = Cluster(tmp_path)
    try:
        server = cluster.server("--method", "fedavg", "--model", "lenet-bn", "--rounds", "1",
                                "--eval-every", "0", "--min-edges", "1", "--local-epochs", "1")
        (data,) = write_edge_dirs(tmp_path, 1, per_edge=60)
        edge = cluster.edge(data, "cam0")
        assert edge.wait() == 0, edge.log()[-3000:]
        assert server.wait() == 0, server.log()[-3000:]
        declared = [int(n) for n in re.findall(
            r"edge cam0 declared its training split: (\d+) examples", server.log())]
        assert len(declared) == 1 and 0 < declared[0] < 60, server.log()[-3000:]
        history = json.loads((tmp_path / "server-state" / "history.json").read_text())
        assert history["rounds"][0]["train"]["num_examples"] == {"cam0": declared[0]}
    finally:
        cluster.close()

"""What an evaluation reveals (issue #38, item 6): by default an edge's evaluation result
carries only sums (correct, total, loss, Brier) per split, never per-class counts, whose
row sums are the edge's label histogram; the per-class matrix travels only when the
operator asks (``--eval-detail``), never under DP.

Checked from the server's side of the wire: real fl-edge processes talk to a real
fl-server through a recording proxy (``wiretap.WireTap``), so the test reads the
evaluation messages exactly as the server received them, and history.json as the server
wrote it. A raw client (``rawedge``) sends what a hostile edge would: counts that disagree
with the sums to a server that asked for them (per-class counts sent to a server that did
not ask are refused in test_bad_input.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import Cluster, edge_data, read_history, serving, wait_for, write_edge_dirs
from rawedge import RawEdge, train_messages
from wiretap import WireTap

from fedattn_shared.config import DPConfig, ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.wire import fedattn_pb2 as pb
from fl_server.app import ServerApp
from fl_server.cli import main as server_main
from fl_tools.report import main as report_main

NUM_CLASSES = 10


def evaluations(tap: WireTap) -> list[tuple[str, pb.EvaluationResult]]:
    """(edge, split result) of every evaluation the server received."""
    return [(h.edge_id, result) for h in tap.submit_headers() if h.phase == "evaluate"
            for result in h.evaluation]


@pytest.mark.parametrize("detail", [False, True], ids=["default", "eval-detail"])
def test_what_an_evaluation_carries_on_the_wire_and_into_history(cluster, tmp_path, detail):
    """Two real edges, one round, evaluation through the recording proxy. Default: no
    evaluation message holds a per-class count, history.json holds no confusion, and the
    server's figures are the received sums'. With --eval-detail: each message holds the
    10x10 matrix, consistent with its sums, and fl-report computes F1 from it."""
    dirs = write_edge_dirs(tmp_path, 2, per_edge=150)
    server = cluster.server("--method", "fedavg", "--rounds", "1", "--min-edges", "2",
                            "--local-epochs", "1", *(["--eval-detail"] if detail else []))
    with WireTap(cluster.port) as tap:
        edges = [cluster.edge(d, f"e{i}", port=tap.port) for i, d in enumerate(dirs)]
        assert [e.wait() for e in edges] == [0, 0], [e.log()[-2000:] for e in edges]
        assert server.wait() == 0
    seen = evaluations(tap)
    assert sorted(edge for edge, _ in seen) == ["e0", "e1"]
    history_text = (tmp_path / "server-state" / "history.json").read_text()
    record = read_history(tmp_path / "server-state")["rounds"][-1]["evaluation"]
    for edge, result in seen:
        assert result.split == "test" and result.num_classes == NUM_CLASSES
        if detail:
            assert len(result.counts) == NUM_CLASSES ** 2
            matrix = np.array(result.counts).reshape(NUM_CLASSES, NUM_CLASSES)
            assert (matrix.sum(), np.trace(matrix)) == (result.total, result.correct)
        else:
            # What today's fedattn sent: 100 counts whose row sums are the label histogram.
            assert list(result.counts) == [], f"{edge} sent per-class counts unasked"
        assert 0 < result.correct <= result.total and 20 <= result.total <= 40  # ~20 % of 150
        figures = record["per_edge"][edge]["test"]
        assert (figures["n"], figures["correct"]) == (result.total, result.correct)
        assert figures["loss"] == pytest.approx(result.loss_sum / result.total)
        assert figures["brier"] == pytest.approx(result.brier_sum / result.total)
        assert ("confusion" in figures) is detail
    assert ("confusion" in history_text) is detail
    pooled = sum(r.correct for _, r in seen) / sum(r.total for _, r in seen)
    assert record["summary"]["test"]["pooled_accuracy"] == pytest.approx(pooled)

    out = tmp_path / "report"
    assert report_main([str(tmp_path / "server-state"), "--out", str(out)]) == 0
    final = json.loads((out / "summary.json").read_text())["runs"][0]["final"]
    assert final["pooled_accuracy"] == pytest.approx(pooled)
    assert (final["macro_f1"] is not None) is detail


def test_eval_detail_with_dp_is_refused_at_start(tmp_path, capsys):
    """Per-class counts are outside DP-SGD's guarantee: fl-server will not ask for them
    under --dp, and says why."""
    code = server_main(["--insecure", "--port", "0", "--checkpoint-dir", str(tmp_path / "s"),
                        "--dp", "--dp-epsilon", "8", "--dp-fix-model", "--eval-detail"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--eval-detail" in err and "does not combine with --dp" in err
    assert "label histogram" in err


def test_an_edge_under_dp_refuses_a_server_that_asks_for_per_class_counts(cluster, tmp_path):
    """A server built past fl-server's own check (a hostile operator's) asks for per-class
    counts in a DP run: the real edge exits 2 before any training, and the server hears
    why."""
    cls = load_method("fedavg")
    dp = DPConfig(enabled=True, target_epsilon=8.0, planned_rounds=1)
    method = cls(MethodContext(TrainConfig(model="lenet-bn+gn", batch_size=20), cls.Params(), dp=dp))
    cfg = ServerConfig(rounds=1, min_edges=1, host="127.0.0.1", port=0, insecure=True,
                       checkpoint_dir=str(tmp_path / "hostile"), poll_timeout=2.0, round_timeout=60)
    app = ServerApp(cfg, method.train, method)
    app.engine.config_json = json.dumps({**json.loads(app.engine.config_json), "eval_detail": True},
                                        sort_keys=True)
    with serving(app) as port:
        edge = cluster.edge(edge_data(tmp_path / "data"), "d", port=port)
        assert edge.wait(90) == 2
    assert ("refusing the server's configuration: server.eval_detail (--eval-detail) does not "
            "combine with --dp") in edge.log()
    assert "trained" not in edge.log()
    assert not (tmp_path / "state-d" / "privacy-ledger.json").exists()


def test_an_edge_with_refuse_eval_detail_leaves_a_server_that_asks(cluster, tmp_path):
    """The edge owns its label histogram: with --refuse-eval-detail it exits 2 before
    training when the run config asks for per-class counts and tells the server why; an
    edge without the flag takes part."""
    refusing_data, data = edge_data(tmp_path / "a"), edge_data(tmp_path / "b")
    server = cluster.server("--method", "fedavg", "--rounds", "1", "--min-edges", "1",
                            "--local-epochs", "1", "--eval-detail")
    refusing = cluster.edge(refusing_data, "r", "--refuse-eval-detail")
    assert refusing.wait(90) == 2
    assert ("refusing the server's configuration: eval_detail: the server asks for per-class "
            "evaluation counts (--eval-detail)") in refusing.log()
    assert "trained" not in refusing.log()
    server.logged(0, "edge r left", "refused the server's configuration: eval_detail")
    taking_part = cluster.edge(data, "t")
    assert taking_part.wait(90) == 0 and server.wait() == 0
    (record,) = read_history(tmp_path / "server-state")["rounds"]
    assert list(record["evaluation"]["per_edge"]) == ["t"]


# ---- a raw client against an --eval-detail server --------------------------------------------


@pytest.fixture(scope="module")
def detail_server(tmp_path_factory):
    """One --eval-detail server for the module's raw scenarios, one round each."""
    cluster = Cluster(tmp_path_factory.mktemp("eval-detail"))
    edge = None
    try:
        server = cluster.server("--method", "fedavg", "--model", "lenet-bn", "--rounds", "50",
                                "--min-edges", "1", "--quorum", "1", "--round-timeout", "15",
                                "--eval-detail")
        edge = RawEdge(cluster.port)
        edge.connect()
        yield cluster, server, edge
    finally:
        if edge is not None:
            edge.close()
        cluster.close()


def evaluation_task(edge: RawEdge):
    """The next evaluation task; a training task on the way gets the global back."""
    for _ in range(5):
        task = edge.next_task()
        if task.header.phase == "evaluate":
            return task
        reply = edge.submit(train_messages(edge, task, task.globals))
        assert reply.accepted, reply.reason
    raise AssertionError("no evaluation task in 5 tasks")


def counts_off_total(result: pb.EvaluationResult) -> None:
    result.counts[1] += 1  # a sample more than total


def trace_off_correct(result: pb.EvaluationResult) -> None:
    result.counts[0] -= 1  # one right answer less on the diagonal than correct says
    result.counts[1] += 1


def wrapping_counts(result: pb.EvaluationResult) -> None:
    # Two counts of 2**62 add 2**64 to the sum: nothing in int64 arithmetic, 180 in Python's.
    result.counts[1] += 2 ** 62
    result.counts[2] += 2 ** 62 - 1
    result.counts[3] += 2 ** 62
    result.counts[4] += 2 ** 62 + 1


def no_counts(result: pb.EvaluationResult) -> None:
    del result.counts[:]


def short_counts(result: pb.EvaluationResult) -> None:
    del result.counts[-1]


def negative_count(result: pb.EvaluationResult) -> None:
    result.counts[3] = -1


SPOILED = [
    ("counts-sum-not-total", counts_off_total, "the counts sum to 181 with 90 on the diagonal, "
                                                "not total 180 and correct 90"),
    ("trace-not-correct", trace_off_correct, "sum to 180 with 89 on the diagonal"),
    ("counts-wrapping-int64", wrapping_counts, f"the counts sum to {180 + 2 ** 64} with 90"),
    ("sums-only-when-asked", no_counts, "expected 10x10 counts (--eval-detail)"),
    ("99-counts", short_counts, "expected 10x10 counts"),
    ("negative-count", negative_count, "negative counts"),
]


@pytest.mark.parametrize("spoil, reason", [pytest.param(f, r, id=i) for i, f, r in SPOILED])
def test_per_class_counts_that_disagree_with_the_sums_are_refused(detail_server, spoil, reason):
    _, server, edge = detail_server
    task = evaluation_task(edge)
    messages = edge.evaluation(task, detail=True)
    spoil(messages[0].header.evaluation[0])
    mark = server.mark()
    reply = edge.submit(messages)
    assert not reply.accepted and reason in reply.reason, reply.reason
    server.logged(mark, f"submission from {edge.edge_id} refused", reason)


def test_consistent_per_class_counts_are_recorded_when_asked(detail_server):
    cluster, _, edge = detail_server
    task = evaluation_task(edge)
    reply = edge.submit(edge.evaluation(task, detail=True))
    assert reply.accepted, reply.reason
    evaluation_task(edge)  # the next round is under way: this round's record is written
    path: Path = cluster.tmp / "server-state" / "history.json"
    record = wait_for(lambda: next((r for r in json.loads(path.read_text())["rounds"]
                                    if r["round"] == task.header.round), None), 30, "the record")
    figures = record["evaluation"]["per_edge"][edge.edge_id]["test"]
    assert (figures["n"], figures["correct"]) == (180, 90)
    assert figures["confusion"] == [[9 if i == j else 1 for j in range(10)] for i in range(10)]

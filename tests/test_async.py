"""Buffered asynchronous aggregation (``fl-server --mode async``, issue #27).

- the staleness functions against hand-computed values, and their parse errors;
- the buffer: K results apply x + eta sum n_k s(tau_k) Delta_k / sum n_k through the
  method's own aggregator (hand case, in process);
- over real gRPC, raw edges speaking the protocol by hand: the same hand case with a stale
  result scaled by s(tau), a result past --max-staleness refused by name, and a server
  killed mid-buffer resuming with the buffer's lost result counted nowhere (none twice);
- real fl-edge processes with compression: versions complete while a throttled edge's
  result is still far off; evaluations land in their version's record;
- refused methods and combinations exit 2 naming why.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import Cluster, read_history, wait_for, write_edge_dirs
from rawedge import RawEdge, train_messages

from fedattn_shared.config import ConfigError, ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.schema import TRAIN, Kind, Payload, Section
from fedattn_shared.staleness import StalenessWeight
from fedattn_shared.wire import fedattn_pb2 as pb
from fl_edge.middleware import UploadChanges
from fl_edge.tasks import Result, Task
from fl_server.buffered import ChangeBuffer
from fl_server.cli import main
from fl_tools.report import analyze_run
from fl_tools.report import main as report_main


# ---- staleness weights -------------------------------------------------------------------
@pytest.mark.parametrize("spec, tau, expected", [
    ("constant", 0, 1.0), ("constant", 7, 1.0),
    ("poly:0.5", 0, 1.0), ("poly:0.5", 3, 0.5), ("poly:1", 1, 0.5), ("poly:2", 4, 1 / 25),
    ("hinge:0.5,2", 2, 1.0), ("hinge:0.5,2", 4, 0.5), ("hinge:1,0", 3, 0.25),
])
def test_staleness_weights_are_the_papers_functions(spec, tau, expected):
    assert StalenessWeight.parse(spec)(tau) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("spec", ["poly", "poly:x", "poly:-1", "hinge:1", "linear:1",
                                  "constant:1", "poly:inf"])
def test_bad_staleness_weights_are_refused_by_name(spec):
    with pytest.raises(ConfigError, match="server.staleness_weight"):
        ServerConfig(mode="async", staleness_weight=spec).validate()


# ---- the buffer, in process --------------------------------------------------------------
def _fedavg(method: str = "fedavg"):
    cls = load_method(method)
    m = cls(MethodContext(TrainConfig(model="lenet-bn"), cls.Params()))
    models = m.build_models()
    return m, models, m.server(models)


def test_a_full_buffer_applies_the_weighted_mean_change_with_the_server_lr():
    method, models, aggregator = _fedavg()
    (spec,) = method.uplink_schema(TRAIN, models)
    x = {n: t.clone() for n, t in aggregator.state[(spec.kind, spec.name)].items()}
    buffer = ChangeBuffer(method.uplink_schema(TRAIN, models))
    generator = torch.Generator().manual_seed(0)
    changes, weights, scales = [], [5.0, 15.0, 10.0], [1.0, 0.5, 1 / 3]
    for weight, scale in zip(weights, scales, strict=True):
        # parameters travel as changes; buffers (BN statistics) and counters as values
        change = {n: (torch.randn(t.shape, generator=generator) if t.is_floating_point()
                      else t.clone()) for n, t in x.items()}
        changes.append(change)
        buffer.add(Payload([Section(spec.kind, spec.name, change)]), weight, scale)
    lr = 0.7
    aggregator.begin_round(1, ["a", "b", "c"], 3)
    aggregator.accept_sum(TRAIN, buffer.weighted_sum(aggregator.state, lr), buffer.weight, 3)
    aggregator.close_phase(TRAIN)
    after = aggregator.state[(spec.kind, spec.name)]
    total = sum(weights)
    buffers = {n for n, t in spec.tensors.items() if t.is_buffer}
    assert buffers and buffers != set(x)  # lenet-bn has both kinds
    for name, value in x.items():
        if not value.is_floating_point():
            assert torch.equal(after[name], value)  # counters: the weighted mean of values
            continue
        if name in buffers:  # the weighted mean of the values, no staleness, no lr
            mean = sum(w * c[name].double() for w, c in zip(weights, changes, strict=True))
            torch.testing.assert_close(after[name], (mean / total).float(), rtol=1e-6,
                                       atol=1e-7)
            continue
        step = sum(w * s * c[name].double() for w, s, c in zip(weights, scales, changes,
                                                               strict=True)) / total
        torch.testing.assert_close(after[name], (value.double() + lr * step).float(),
                                   rtol=1e-6, atol=1e-7)


# ---- over gRPC, raw edges ------------------------------------------------------------------
ASYNC = ["--method", "fedavg", "--mode", "async", "--eval-every", "0", "--local-epochs", "1"]


def _parameters() -> set[str]:
    """The tensors an async upload carries as changes: fedavg's floating parameters
    (buffers, BN's running statistics, and counters travel as values)."""
    method, models, _ = _fedavg()
    (spec,) = method.uplink_schema(TRAIN, models)
    return {n for n, t in spec.tensors.items() if t.dtype.is_floating_point and not t.is_buffer}


def _change(task, value: float) -> dict[str, torch.Tensor]:
    """A change of ``value`` on every parameter; buffers as the global holds them."""
    stepped = _parameters()
    return {n: torch.full_like(t, value) if n in stepped else t.clone()
            for n, t in task.globals.items()}


def _moved(before: dict, after: dict, step: float) -> None:
    """Parameters moved by ``step``; the buffers' mean of unchanged values is unchanged."""
    stepped = _parameters()
    for name, value in before.items():
        expected = (value.double() + step).float() if name in stepped else value
        torch.testing.assert_close(after[name], expected, rtol=1e-6, atol=1e-6)


def _submit(edge: RawEdge, task, value: float, n: int):
    return edge.submit(train_messages(edge, task, _change(task, value), num_examples=n))


def _versions(root, count: int) -> dict:
    path = root / "server-state" / "history.json"
    wait_for(lambda: path.exists() and len(read_history(root / "server-state")["rounds"]) >= count,
             30, f"{count} versions in history.json")
    return read_history(root / "server-state")


def test_stale_results_are_scaled_and_too_stale_ones_refused_over_grpc(tmp_path):
    cluster = Cluster(tmp_path)
    edges: list[RawEdge] = []
    try:
        cluster.server(*ASYNC, "--rounds", "5", "--min-edges", "4", "--buffer", "2",
                       "--server-lr", "0.5", "--staleness-weight", "poly:1",
                       "--max-staleness", "1")
        a, b, c, d = edges = [RawEdge(cluster.port, p) for p in "abcd"]
        for edge in edges:
            edge.connect()
        ta, tb, tc, td = (edge.next_task() for edge in edges)
        assert {t.header.round for t in (ta, tb, tc, td)} == {1}  # all start from version 0
        x0 = ta.globals
        assert _submit(a, ta, 0.1, 5).accepted
        assert _submit(b, tb, 0.3, 15).accepted
        ta2 = a.next_task()  # version 1 = x0 + 0.5 (5 * 0.1 + 15 * 0.3) / 20
        assert ta2.header.round == 2
        _moved(x0, ta2.globals, 0.5 * 0.25)
        # c started from version 0 (tau 1: scaled by 1/2), a from version 1 (tau 0).
        assert _submit(c, tc, -0.2, 10).accepted
        assert _submit(a, ta2, 0.4, 5).accepted
        tb2 = b.next_task()
        assert tb2.header.round == 3
        _moved(ta2.globals, tb2.globals, 0.5 * (10 * 0.5 * -0.2 + 5 * 1.0 * 0.4) / 15)
        # d's task started from version 0; the global is at 2: more than 1 version later.
        reply = _submit(d, td, 0.1, 5)
        assert not reply.accepted
        assert "too stale" in reply.reason and "--max-staleness 1" in reply.reason
        history = _versions(tmp_path, 2)
        first, second = history["rounds"][:2]
        assert [e["edge"] for e in first["train"]["contributors"]] == [a.edge_id, b.edge_id]
        assert second["train"]["staleness"] == {"0": 1, "1": 1}
        assert [(e["edge"], e["staleness"], e["scale"]) for e in
                second["train"]["contributors"]] == [(c.edge_id, 1, 0.5), (a.edge_id, 0, 1.0)]
        assert history["manifest"]["mode"] == "async"
    finally:
        for edge in edges:
            edge.close()
        cluster.close()


def test_no_new_work_while_a_result_waits_in_the_buffer_or_after_a_bad_upload(tmp_path):
    """One result per edge per buffer (a fast or lying edge cannot fill one alone), and a
    refused upload does not buy its sender a fresh download until the next version."""
    cluster = Cluster(tmp_path)
    edges: list[RawEdge] = []
    try:
        cluster.server(*ASYNC, "--rounds", "3", "--min-edges", "3", "--buffer", "2")
        a, b, c = edges = [RawEdge(cluster.port, p) for p in "abc"]
        for edge in edges:
            edge.connect()
        ta, tb, tc = (edge.next_task() for edge in edges)
        poisoned = _change(tc, 0.1)
        name = next(n for n, t in poisoned.items() if t.is_floating_point())
        poisoned[name].view(-1)[0] = float("nan")
        reply = c.submit(train_messages(c, tc, poisoned, num_examples=5))
        assert not reply.accepted and "non-finite" in reply.reason
        assert _submit(a, ta, 0.1, 5).accepted
        with ThreadPoolExecutor(2) as pool:  # both ask for work before the buffer applies
            asked = [pool.submit(edge.next_task) for edge in (a, c)]
            # Give the polls time to reach the server (without the rule they would get
            # version 0's work at once; with it they pass whatever the timing).
            time.sleep(1.0)
            assert _submit(b, tb, 0.3, 5).accepted  # the buffer applies: version 1
            assert [f.result().header.round for f in asked] == [2, 2]
    finally:
        for edge in edges:
            edge.close()
        cluster.close()


def test_a_refused_evaluation_costs_its_task_at_once(tmp_path):
    """A result refused at its header (here a non-finite loss) drops its task in the
    phase it named: the edge is not sent the same evaluation again and again."""
    cluster = Cluster(tmp_path)
    edges: list[RawEdge] = []
    try:
        server = cluster.server(*ASYNC[:-4], "--eval-every", "1", "--rounds", "3",
                                "--min-edges", "2", "--buffer", "2")
        a, b = edges = [RawEdge(cluster.port, p) for p in "ab"]
        for edge in edges:
            edge.connect()
        ta, tb = a.next_task(), b.next_task()
        mark = server.mark()
        assert _submit(a, ta, 0.1, 5).accepted and _submit(b, tb, 0.1, 5).accepted
        evaluation = a.next_task()
        assert (evaluation.header.phase, evaluation.header.round) == ("evaluate", 1)
        messages = a.evaluation(evaluation)
        messages[0].header.evaluation[0].loss_sum = float("inf")
        reply = a.submit(messages)
        assert not reply.accepted and "non-finite loss" in reply.reason
        server.logged(mark, f"dropped {a.edge_id} (bad upload")
        after = a.next_task()
        assert (after.header.phase, after.header.round) == ("train", 2)
    finally:
        for edge in edges:
            edge.close()
        cluster.close()


def test_one_evaluation_is_open_at_a_time(tmp_path):
    """Each evaluation holds its version's global: when the next one opens, the older one
    ends with the scores it has (an edge that never answered is superseded)."""
    cluster = Cluster(tmp_path)
    edges: list[RawEdge] = []
    try:
        cluster.server(*ASYNC[:-4], "--eval-every", "1", "--rounds", "4", "--min-edges", "3",
                       "--buffer", "2")
        a, b, c = edges = [RawEdge(cluster.port, p) for p in "abc"]
        for edge in edges:
            edge.connect()
        ta, tb, _ = (edge.next_task() for edge in edges)  # c keeps its task and is silent
        for edge, task in ((a, ta), (b, tb)):
            assert _submit(edge, task, 0.1, 5).accepted
        for edge in (a, b):  # version 1's evaluation, then version 2's training
            evaluation = edge.next_task()
            assert evaluation.header.phase == "evaluate"
            assert edge.submit(edge.evaluation(evaluation)).accepted
            assert _submit(edge, edge.next_task(), 0.1, 5).accepted
        history = _versions(tmp_path, 2)
        wait_for(lambda: "evaluation" in read_history(tmp_path / "server-state")["rounds"][0],
                 30, "version 1's scores")
        first = read_history(tmp_path / "server-state")["rounds"][0]
        assert sorted(first["evaluation"]["per_edge"]) == sorted([a.edge_id, b.edge_id])
        assert first["evaluate"]["dropped"] == {c.edge_id: "superseded: version 2 is evaluated"}
        assert history["rounds"][1]["round"] == 2
    finally:
        for edge in edges:
            edge.close()
        cluster.close()


def test_a_server_killed_mid_buffer_resumes_counting_nothing_twice(tmp_path):
    cluster = Cluster(tmp_path)
    edges: list[RawEdge] = []
    run = [*ASYNC, "--rounds", "5", "--min-edges", "2", "--buffer", "2"]
    try:
        server = cluster.server(*run)
        port = cluster.port
        a, b = edges = [RawEdge(port, "a"), RawEdge(port, "b")]
        for edge in edges:
            edge.connect()
        ta, tb = a.next_task(), b.next_task()
        assert _submit(a, ta, 0.1, 5).accepted and _submit(b, tb, 0.1, 5).accepted
        x1 = a.next_task()
        _versions(tmp_path, 1)
        assert _submit(a, x1, 1.0, 5).accepted  # in the buffer, never applied
        server.kill()
        for edge in edges:
            edge.close()
        cluster.server(*run, "--resume", port=port, name="resumed")
        a, b = edges = [RawEdge(port, "a2"), RawEdge(port, "b2")]
        for edge in edges:
            edge.connect()
        ta, tb = a.next_task(), b.next_task()
        assert ta.header.round == tb.header.round == 2  # version 1 again, buffer empty
        for name, value in x1.globals.items():
            assert torch.equal(ta.globals[name], value)
        assert _submit(a, ta, 0.2, 5).accepted and _submit(b, tb, 0.4, 15).accepted
        after = a.next_task()
        _moved(x1.globals, after.globals, (5 * 0.2 + 15 * 0.4) / 20)  # a's 1.0 is nowhere
        history = _versions(tmp_path, 2)
        assert [r["round"] for r in history["rounds"]] == [1, 2]
        assert [e["edge"] for e in history["rounds"][1]["train"]["contributors"]] == [
            a.edge_id, b.edge_id]
    finally:
        for edge in edges:
            edge.close()
        cluster.close()


# ---- real edges --------------------------------------------------------------------------
def test_versions_complete_without_waiting_for_a_throttled_edge(tmp_path):
    """Two edges and one throttled 1000x (its first result would arrive some 30 s in):
    the run's four versions complete without it, its task is dropped as too stale (or
    by the run's end), and its evaluation runs out at --round-timeout."""
    cluster = Cluster(tmp_path)
    try:
        dirs = write_edge_dirs(tmp_path, 3, per_edge=100)
        server = cluster.server(*ASYNC, "--rounds", "4", "--min-edges", "3", "--buffer", "2",
                                "--max-staleness", "1", "--eval-every", "2",
                                "--round-timeout", "4", "--compress", "up=int8,down=int8")
        slow = cluster.edge(dirs[2], "slow", "--throttle", "1000")
        edges = [cluster.edge(d, f"e{i}") for i, d in enumerate(dirs[:2])]
        assert [e.wait() for e in edges] == [0, 0], [e.log()[-2000:] for e in edges]
        slow.kill()  # still asleep; the server waits for connected edges to hear the end
        assert server.wait() == 0
        history = read_history(tmp_path / "server-state")
        rounds = history["rounds"]
        assert [r["round"] for r in rounds] == [1, 2, 3, 4]
        for record in rounds:
            assert "aborted" not in record
            assert len(record["train"]["contributors"]) == 2
            assert {e["edge"] for e in record["train"]["contributors"]} <= {"e0", "e1"}
            assert record["bytes"]["up"]["shared_tensors"]["codecs"].keys() == {"int8"}
        for record in (rounds[1], rounds[3]):  # evaluated versions, scores in their record
            assert set(record["evaluation"]["per_edge"]) >= {"e0", "e1"}
            assert 0 <= record["evaluation"]["summary"]["test"]["mean_accuracy"] <= 1
        assert "evaluation" not in rounds[0] and "evaluation" not in rounds[2]
        server_log = (tmp_path / "server.log").read_text()
        assert re.search(r"train: dropped slow \((too stale|run over)", server_log), server_log
        # The log says what the history says: each evaluated version's accuracy once its
        # scores are in (a version's own line comes before them and claims none), and a
        # healthy run's normal events (superseded, run over, late) are no WARNING.
        for record in (rounds[1], rounds[3]):
            figure = record["evaluation"]["summary"]["test"]["mean_accuracy"]
            assert f"version {record['round']} evaluated: mean test accuracy {figure:.4f}" \
                in server_log, server_log
        assert "n/a" not in server_log
        routine = [line for line in server_log.splitlines() if " WARNING " in line and any(
            why in line for why in ("superseded", "run over", "no phase is open"))]
        assert not routine, routine
        # Per version, coded upload bytes pair each upload's wire bytes with its own raw
        # ones: every version's wire / raw is the codec's ratio (one model, one codec).
        ratios = {r["round"]: r["bytes"]["up"]["shared_tensors"]["wire"]
                  / r["bytes"]["up"]["shared_tensors"]["raw"] for r in rounds}
        assert max(ratios.values()) - min(ratios.values()) < 1e-9, ratios
        assert 0.25 < min(ratios.values()) < 0.3, ratios  # int8: a quarter, plus scales
        assert rounds[3]["evaluate"]["dropped"] == {"slow": "deadline"}
        # fl-report reads the run per version.
        state = tmp_path / "server-state"
        assert report_main([str(state), "--out", str(tmp_path / "report")]) == 0
        analyzed = analyze_run(state / "history.json", history, "test")
        assert analyzed["unit"] == "version" and analyzed["final_round"] == 4
        assert [p["received"] for p in analyzed["participation"]] == [2, 2, 2, 2]
    finally:
        cluster.close()


# ---- refusals ----------------------------------------------------------------------------
@pytest.mark.parametrize("method, needle", [
    ("pfedka", "lock-step"), ("fedsap", "not a model section"), ("scaffold", "control"),
    ("fedmedian", "collect_then_learn"), ("local", "uploads nothing"),
])
def test_methods_that_need_rounds_are_refused_at_start(tmp_path, capsys, method, needle):
    code = main(["--insecure", "--port", "0", "--checkpoint-dir", str(tmp_path / "s"),
                 "--mode", "async", "--method", method])
    assert code == 2
    err = capsys.readouterr().err
    assert "--mode async" in err and needle in err and "--mode sync" in err


@pytest.mark.parametrize("flags, needle", [
    (["--secagg"], "--secagg"), (["--quorum", "2"], "server.quorum"),
    (["--fraction", "0.5"], "server.fraction"), (["--buffer", "0"], "server.buffer"),
    (["--max-staleness", "-1"], "server.max_staleness"), (["--async-lr", "0"], "server.async_lr"),
])
def test_combinations_async_cannot_serve_exit_2(tmp_path, capsys, flags, needle):
    code = main(["--insecure", "--port", "0", "--checkpoint-dir", str(tmp_path / "s"),
                 "--mode", "async", *flags])
    assert code == 2
    assert needle in capsys.readouterr().err


def test_an_async_edge_uploads_trained_minus_received():
    """The change an async edge uploads is trained - received for each parameter, exactly
    what the server adds to a later global (``UploadChanges``, over the method's delta
    rule); BN's running statistics and counters go as their values."""
    method, models, aggregator = _fedavg()
    (spec,) = method.uplink_schema(TRAIN, models)
    received = {n: t.clone() for n, t in aggregator.state[(spec.kind, spec.name)].items()}
    trained = {n: t + 0.25 if t.is_floating_point() else t + 3 for n, t in received.items()}
    buffers = {n for n, t in spec.tensors.items() if t.is_buffer}
    task = Task(pb.TaskHeader(round=1, phase=TRAIN),
                Payload([Section(Kind.SHARED_TENSORS, "", received)]), Payload(), 0, "e",
                lambda r, n: 0.1)
    result = UploadChanges(method, models)(task, lambda t: Result(
        Payload([Section(Kind.SHARED_TENSORS, "", trained)]), 5))
    sent = result.upload.sections[0].tensors
    assert buffers
    for name, value in received.items():
        if value.is_floating_point() and name not in buffers:
            torch.testing.assert_close(sent[name], torch.full_like(value, 0.25))
        else:  # BN statistics and counters travel as values
            assert torch.equal(sent[name], trained[name])
    assert result.num_examples == 5

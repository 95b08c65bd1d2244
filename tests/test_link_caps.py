"""The link limits a device owns (``fl_edge.caps``, issue #42): ``--max-rate`` and the data
budget (``--max-bytes-per-day`` / ``--max-bytes-per-month``), and the "not now" answer an
edge past its budget gives (``TaskRequest.decline``).

- the token bucket's waits and the budget's UTC periods, on given clocks (exact values);
- the budget kept across a restart of the edge (its file), renewed at the period's end;
- real fl-server and fl-edge processes: an edge whose budget is spent declines every
  round, the rounds go on with the other edge, both sides count the declines; the same in
  --mode async; an edge's --max-rate measured from the server's byte counts over the
  round's wall time;
- a raw edge declining as an attacker would: the server gives its task up once, never
  offers it again in the round (sync) or before the backoff or next version (async), and
  holds nothing for it.
"""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request
from datetime import datetime, timezone

import pytest
from conftest import Cluster, read_history, wait_for, write_edge_dirs
from rawedge import RawEdge

from fedattn_shared.state import StateError
from fedattn_shared.wire import fedattn_pb2 as pb
from fl_edge.caps import BUDGET_FILE, DataBudget, TokenBucket, period_end, period_key


class Clock:
    """A clock the test moves (the bucket sleeps by moving it)."""

    def __init__(self, now: float = 1000.0):
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _utc(*args: int) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


# ---- the token bucket ------------------------------------------------------------------
def test_the_bucket_waits_exactly_for_the_bytes_past_its_burst():
    clock = Clock()
    bucket = TokenBucket(1000, clock=clock, sleep=clock.sleep)  # burst: one second's 1000
    bucket.take(600)
    bucket.take(400)
    assert clock.slept == []  # within the burst
    bucket.take(500)  # 500 past it: half a second, in one sleep
    assert clock.slept == [0.5]
    bucket.take(3000)  # a message larger than the burst is never split: it waits 3 s
    assert clock.slept == [0.5, 3.0]
    clock.now += 10  # idle: the bucket refills to its burst, not beyond
    bucket.take(1000)
    bucket.take(1000)
    assert clock.slept == [0.5, 3.0, 1.0]
    # Over the whole stretch: bytes moved <= rate x seconds + burst.
    assert 600 + 400 + 500 + 3000 + 2000 <= 1000 * (clock.now - 1000.0) + 1000
    with pytest.raises(ValueError):
        TokenBucket(0)


# ---- the data budget -------------------------------------------------------------------
def test_periods_are_utc_calendar_days_and_months():
    t = _utc(2026, 12, 31, 23, 59, 59)
    assert period_key("day", t) == "2026-12-31" and period_key("month", t) == "2026-12"
    assert period_end("day", t) == datetime(2027, 1, 1, tzinfo=timezone.utc)
    assert period_end("month", t) == datetime(2027, 1, 1, tzinfo=timezone.utc)
    assert period_end("month", _utc(2026, 2, 10)) == datetime(2026, 3, 1, tzinfo=timezone.utc)


def test_the_budget_survives_a_restart_and_renews_at_the_period_boundary(tmp_path):
    clock = Clock(_utc(2026, 11, 28, 22, 0))
    path = tmp_path / BUDGET_FILE
    budget = DataBudget(path, {"day": 10_000, "month": 50_000}, clock=clock)
    budget.spend(4_000)
    budget.task_done(4_000)  # the next task is expected to move as many
    assert budget.spent() is None  # 6,000 left of the day: 4,000 fit
    budget.spend(3_000)
    assert budget.spent().period == "day"  # 3,000 left: the next task would not fit
    budget.save()

    # A restart (a new process reads the file): the count is not reset.
    again = DataBudget(path, {"day": 10_000, "month": 50_000}, clock=clock)
    assert again.allowances["day"].used == 7_000 and again.last_task == 4_000
    assert again.spent().period == "day"

    clock.now = _utc(2026, 11, 29, 0, 0, 1)  # past midnight UTC: the day renews
    assert again.spent() is None
    assert again.allowances["day"].used == 0 and again.allowances["month"].used == 7_000
    for _ in range(11):
        again.spend(4_000)
    clock.now = _utc(2026, 11, 30, 12, 0)  # a new day, the month's 51,000 of 50,000 spent
    assert again.spent().period == "month" and again.allowances["day"].used == 0
    clock.now = _utc(2026, 12, 1, 0, 0, 1)
    assert again.spent() is None

    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(StateError, match="not a fedattn link budget"):
        DataBudget(path, {"day": 1}, clock=clock)


# ---- real daemons ----------------------------------------------------------------------
def _samples(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_edge_past_its_budget_declines_and_the_run_goes_on_without_it(tmp_path, mode):
    """The budget (1 KB a day) is spent by the join and the first presence events: the
    edge declines every task, the server gives each up as "declined" (no fault: the edge
    stays selected and connected), and the run completes on the other edge's results."""
    data = write_edge_dirs(tmp_path, 2, per_edge=60)
    cluster = Cluster(tmp_path)
    try:
        args = ["--method", "fedavg", "--min-edges", "2", "--eval-every", "0",
                "--local-epochs", "1", "--metrics-port", "0", "--metrics-linger", "60"]
        if mode == "async":
            args += ["--mode", "async", "--buffer", "1", "--rounds", "3"]
        else:
            args += ["--rounds", "2"]
        server = cluster.server(*args)
        good = cluster.edge(data[0], "good")
        capped = cluster.edge(data[1], "capped", "--max-bytes-per-day", "1000",
                              "--metrics-port", "0", "--metrics-linger", "60")
        assert good.wait(timeout=300) == 0
        server.wait_log("for 60s more (--metrics-linger)", timeout=120)
        server_figures = _samples(f"http://127.0.0.1:{server.metrics_port}/metrics")
        port = re.search(r"metrics on :(\d+)", capped.log()).group(1)
        edge_figures = _samples(f"http://127.0.0.1:{port}/metrics")
        capped.wait_log("for 60s more (--metrics-linger)")  # it heard "run over" too
        for proc in (capped, server):
            proc.popen.send_signal(signal.SIGTERM)  # ends the linger at once
            assert proc.wait(timeout=30) == 0
    finally:
        cluster.close()
    history = read_history(tmp_path / "server-state")
    rounds = history["rounds"]
    assert len(rounds) == (3 if mode == "async" else 2)
    for record in rounds:
        assert record["train"]["received"] == ["good"], record["train"]
        assert "aborted" not in record
    if mode == "sync":  # selected each round, given up each round as declined
        for record in rounds:
            assert record["train"]["selected"] == ["capped", "good"]
            assert record["train"]["dropped"] == {"capped": "declined: data budget"}
    declines = server_figures['fedattn_declines_total{reason="data_budget"}']
    assert declines >= (2 if mode == "sync" else 1)
    assert server_figures['fedattn_edges_dropped_total{phase="train",reason="declined"}'] >= (
        2 if mode == "sync" else 0)
    assert server_figures['fedattn_edges_reported_total{phase="train"}'] == len(rounds)
    assert edge_figures['fedattn_edge_declines_total{reason="data_budget"}'] >= declines
    assert edge_figures['fedattn_edge_budget_bytes{period="day"}'] == 1000
    assert edge_figures['fedattn_edge_budget_used_bytes{period="day"}'] > 1000
    assert "declining work until" in capped.log()
    assert "trained" not in capped.log()  # it never downloaded or trained anything
    kept = json.loads((tmp_path / "state-capped" / BUDGET_FILE).read_text())
    assert kept["day"]["used"] > 1000 and kept["day"]["key"] == period_key("day", time.time())


def test_max_rate_holds_an_edges_transfers_to_its_rate(tmp_path):
    """One round of lenet-bn (about 180 KB each way) through an edge capped at 16 KiB/s:
    the bytes the server counted for the round, over the round's wall time, stay within
    the rate plus one burst a direction (the directions never overlap); and the transfers
    are what the round's time is spent on (not a cap far below the one asked)."""
    rate = 16384
    data = write_edge_dirs(tmp_path, 1, per_edge=40)
    cluster = Cluster(tmp_path)
    try:
        server = cluster.server("--method", "fedavg", "--rounds", "1", "--min-edges", "1",
                                "--eval-every", "0", "--local-epochs", "1",
                                "--chunk-bytes", "32768", "--download-min-rate", "4096",
                                "--upload-min-rate", "4096")
        edge = cluster.edge(data[0], "slow", "--max-rate", str(rate))
        assert edge.wait(timeout=300) == 0
        assert server.wait(timeout=60) == 0
    finally:
        cluster.close()
    (record,) = read_history(tmp_path / "server-state")["rounds"]
    moved = sum(figures["wire"] for direction in ("up", "down")
                for figures in record["bytes"][direction].values())
    seconds = record["seconds"]
    assert moved > 300_000, record["bytes"]  # a transfer worth measuring: ~22 s at the rate
    print(f"--max-rate {rate}: {moved} bytes in {seconds:.1f}s = {moved / seconds:.0f} B/s")
    assert moved - 2 * rate <= rate * seconds * 1.02, (moved, seconds)
    assert moved / seconds >= rate / 3, (moved, seconds)


# ---- an attacker's declines --------------------------------------------------------------
def _decline(edge: RawEdge, no_wait: bool = True) -> pb.TaskHeader:
    request = pb.TaskRequest(edge_id=edge.edge_id, session=edge.session, no_wait=no_wait,
                             decline=pb.DECLINE_DATA_BUDGET)
    (message,) = list(edge.stub.NextTask(request, timeout=edge.terms.deadline(no_wait)))
    return message.header


def _ask(edge: RawEdge) -> pb.TaskHeader:
    """One no_wait task request: only its header (a task's data is not read)."""
    request = pb.TaskRequest(edge_id=edge.edge_id, session=edge.session, no_wait=True)
    call = edge.stub.NextTask(request, timeout=edge.terms.deadline(True))
    header = next(iter(call)).header
    call.cancel()
    return header


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_declines_in_a_loop_cost_the_server_one_drop_and_no_offer(tmp_path, mode):
    """A raw edge declines 50 times in a row, then asks for work: its task is given up
    once (counted once), every later decline is a WAIT with nothing counted, and the work
    it declined is not offered to it again (sync: the round's task is gone; async: no new
    task before the next version); presence hints say no work for it. The honest edge's
    round goes on."""
    args = ["--method", "fedavg", "--min-edges", "2", "--eval-every", "0",
            "--metrics-port", "0", "--rounds", "2", "--round-timeout", "120"]
    if mode == "async":
        args += ["--mode", "async", "--buffer", "2"]
    cluster = Cluster(tmp_path)
    edges: list[RawEdge] = []
    try:
        server = cluster.server(*args)
        attacker, honest = edges = [RawEdge(cluster.port, p) for p in ("decliner", "honest")]
        for edge in edges:
            edge.connect()
        wait_for(attacker.task_ready.is_set, 30, "a presence hint that work waits")
        headers = [_decline(attacker) for _ in range(50)]
        assert {h.status for h in headers} == {pb.TaskHeader.WAIT}
        after = _ask(attacker)
        assert after.status == pb.TaskHeader.WAIT, after  # not offered the work again
        figures = _samples(f"http://127.0.0.1:{server.metrics_port}/metrics")
        assert figures['fedattn_declines_total{reason="data_budget"}'] == 1
        dropped = figures['fedattn_edges_dropped_total{phase="train",reason="declined"}']
        assert dropped == (1 if mode == "sync" else 0)  # async: nothing was handed out
        attacker.task_ready.clear()
        time.sleep(12)  # a presence event comes every 10 s: none says work waits for it
        assert not attacker.task_ready.is_set()
        assert honest.next_task(no_wait=True).header.status == pb.TaskHeader.TASK
        # A reason this server does not know is a decline all the same (counted "other").
        request = pb.TaskRequest(edge_id=attacker.edge_id, session=attacker.session,
                                 no_wait=True, decline=77)
        (message,) = attacker.stub.NextTask(request, timeout=attacker.terms.deadline(True))
        assert message.header.status == pb.TaskHeader.WAIT
    finally:
        for edge in edges:
            edge.close()
        cluster.close()

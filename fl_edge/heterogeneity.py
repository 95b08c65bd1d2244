"""Simulated heterogeneity (issue #27): a slow edge and a flaky one, for tests and benches
that mix them with fast, reliable edges on one machine (``fl-edge --throttle``,
``--disconnect``; ``fl-sim`` assigns them to a seeded share of its edges). A real device
is slow or flaky by itself: neither option belongs in a deployment.

Neither changes what the edge computes. ``Throttle`` sleeps after the work, so a
throttled edge's upload is bit-identical to an unthrottled one's; ``Dropout`` discards a
task's result as a device that lost its connection would, before the state writes the
task owed are made (the private state on disk is the state before the task, as after a
crash; only a DP ledger, written before anything may leave, keeps the lost round booked,
which errs on the safe side), and the daemon reconnects and rejoins from that state.
Both sit outside every other middleware (``EdgeDaemon._setup``): the throttle's clock
covers the whole of the edge's own work on a task, and a dropped task has cost its full
(throttled) time before the edge goes away.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import replace

from .tasks import Handler, Result, Task

log = logging.getLogger("fl_edge")

#: How long a disconnected edge stays away when ``--disconnect`` names no time.
DEFAULT_OFFLINE_SECONDS = 10.0


def check_throttle(factor: float) -> float:
    """``--throttle FACTOR``: a finite number >= 1 (1: not throttled); ValueError names the
    flag."""
    if not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"--throttle {factor}: expected a finite factor >= 1 (1: full speed)")
    return factor


def parse_disconnect(text: str) -> tuple[float, float]:
    """``--disconnect P[:SECONDS]``: the probability per task (0 to 1) and the seconds
    offline (finite, >= 0; default ``DEFAULT_OFFLINE_SECONDS``). ValueError names the flag."""
    probability, _, seconds = text.partition(":")
    try:
        p = float(probability)
        offline = float(seconds) if seconds else DEFAULT_OFFLINE_SECONDS
    except ValueError:
        raise ValueError(f"--disconnect {text!r}: expected P[:SECONDS], e.g. 0.1:10") from None
    if not (math.isfinite(p) and 0 <= p <= 1):
        raise ValueError(f"--disconnect {text!r}: the probability must be in [0, 1]")
    if not (math.isfinite(offline) and offline >= 0):
        raise ValueError(f"--disconnect {text!r}: the seconds offline must be finite and >= 0")
    return p, offline


class Throttle:
    """``--throttle FACTOR``: after the edge's own work on a task, sleeps (FACTOR - 1) x the
    work's wall time, so the task takes FACTOR x as long and its result is unchanged. The
    sleep is reported as ``throttle_seconds`` (a figure of the simulation, not of the
    data). ``clock`` and ``sleep`` are injectable so a test can check the arithmetic
    without racing a real clock."""

    def __init__(self, factor: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.factor = check_throttle(factor)
        self.clock, self.sleep = clock, sleep

    def __call__(self, task: Task, next: Handler) -> Result:
        started = self.clock()
        result = next(task)
        pause = (self.factor - 1) * max(self.clock() - started, 0.0)
        if pause <= 0:
            return result
        self.sleep(pause)
        return replace(result, metrics={**result.metrics, "throttle_seconds": pause})


class Disconnected(Exception):
    """The simulated loss of the connection (``Dropout``): the daemon closes its session
    and stays away ``offline`` seconds before it rejoins from the state on disk."""

    def __init__(self, round: int, phase: str, offline: float):
        super().__init__(f"round {round} {phase}: simulated disconnect (--disconnect); "
                         f"offline for {offline:g}s")
        self.offline = offline


class Dropout:
    """``--disconnect P:SECONDS``: with probability P per task the edge does the work and
    then loses its connection instead of submitting (``Disconnected``). The draws come
    from a generator seeded by ``seed`` and the edge's id, once per task, so a rerun
    of the same edges repeats the pattern (the edge knows no run seed before it joins)."""

    def __init__(self, probability: float, offline: float, edge_id: str, seed: int = 0):
        self.probability, self.offline = probability, offline
        # random.Random seeds a str through SHA-512: the same sequence in every process.
        self.generator = random.Random(f"fedattn-disconnect:{seed}:{edge_id}")

    def draws(self) -> bool:
        """Whether the next task is lost (one draw per task, whatever P is)."""
        return self.generator.random() < self.probability

    def __call__(self, task: Task, next: Handler) -> Result:
        lost = self.draws()
        result = next(task)
        if lost:
            raise Disconnected(task.round, task.phase, self.offline)
        return result

"""Limits the device owns on its link: a rate (``--max-rate``) and a data budget
(``--max-bytes-per-day``, ``--max-bytes-per-month``), whatever the server asks.

Why on the edge: a cellular edge pays per byte and shares its modem with the device's own
traffic; only the device knows its tariff. Both limits apply where the edge's bytes move,
its transport (``fl_edge.transport``), which tells ``LinkCaps`` of every message it sends
or receives, with the bytes the byte accounting counts for it (the server counts the same).

- The rate is a token bucket per direction on a monotonic clock: a message is never split,
  it takes its bytes from the bucket (which may go negative) and the sender waits, in one
  sleep, until the bucket is back to zero. So over any stretch the bytes moved are at most
  ``rate x seconds + burst`` and the waits depend only on the sizes and the clock: no
  polling. A sent chunk waits before it leaves; a received one waits before the next is
  read, so gRPC's flow control slows the server down to the edge's rate.
- The budget counts every byte both ways in calendar periods of UTC (a day from 00:00, a
  month from the 1st) and is kept in the state dir (``link-budget.json``, written
  atomically at most every ``SAVE_EVERY`` seconds and at each task's end), so a restart
  does not reset it. A new period starts at zero. The edge declines work ("not now",
  ``TaskRequest.decline``) while the bytes of its last task would not fit in what is left
  (before its first task: once nothing is left), until the period renews.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from fedattn_shared.state import StateError, atomic_write_json, read_json

log = logging.getLogger("fl_edge")

BUDGET_FORMAT = "fedattn-link-budget/1"
BUDGET_FILE = "link-budget.json"
#: Seconds between budget writes while bytes move (a crash forgets at most this much).
SAVE_EVERY = 5.0
#: The burst a bucket holds: this many seconds of the rate (at least one 1 MiB chunk can
#: go without waiting twice).
BURST_SECONDS = 1.0
PERIODS = ("day", "month")


class TokenBucket:
    """A rate in bytes/s with a burst; ``take(n)`` returns once ``n`` bytes may move (see
    the module doc). ``clock`` and ``sleep`` are the process's monotonic ones."""

    def __init__(self, rate: float, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if not rate > 0:
            raise ValueError(f"a rate must be > 0 bytes/s, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else rate * BURST_SECONDS)
        self.clock, self.sleep = clock, sleep
        self.tokens = self.burst
        self.stamp = clock()
        self.lock = threading.Lock()
        self.waited = 0.0  # seconds spent waiting, in all

    def reserve(self, size: int) -> float:
        """Takes ``size`` bytes now; returns the seconds to wait before they move."""
        with self.lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= size
            return -self.tokens / self.rate if self.tokens < 0 else 0.0

    def take(self, size: int) -> None:
        """Waits (one sleep) until ``size`` bytes may move."""
        wait = self.reserve(size)
        if wait > 0:
            self.waited += wait
            self.sleep(wait)


def period_key(period: str, now: float) -> str:
    """The UTC calendar period holding unix time ``now``: '2026-11-28' or '2026-11'."""
    day = datetime.fromtimestamp(now, tz=timezone.utc)
    return day.strftime("%Y-%m-%d" if period == "day" else "%Y-%m")


def period_end(period: str, now: float) -> datetime:
    """When the period holding ``now`` renews (UTC midnight, or the next month's 1st)."""
    day = datetime.fromtimestamp(now, tz=timezone.utc).replace(hour=0, minute=0, second=0,
                                                                microsecond=0)
    if period == "day":
        return datetime.fromtimestamp(day.timestamp() + 86400, tz=timezone.utc)
    return day.replace(year=day.year + (day.month == 12), month=day.month % 12 + 1, day=1)


@dataclass
class Allowance:
    """One period's budget: its limit, and the bytes used in the period named ``key``."""

    period: str
    limit: int
    key: str = ""
    used: int = 0

    def renew(self, now: float) -> bool:
        """Starts a new period at zero when ``now`` is past this one; True when it did."""
        key = period_key(self.period, now)
        if key == self.key:
            return False
        renewed = bool(self.key)
        self.key, self.used = key, 0
        return renewed


@dataclass
class DataBudget:
    """The edge's data budgets (module doc), kept in ``path``. ``clock``: unix time (the
    periods are calendar ones)."""

    path: Path
    limits: dict[str, int]
    clock: Callable[[], float] = time.time
    allowances: dict[str, Allowance] = field(default_factory=dict)
    last_task: int = 0  # bytes the last task moved (what the next is expected to)
    saved_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        stored = self._read()
        now = self.clock()
        for period, limit in self.limits.items():
            if period not in PERIODS or limit < 1:
                raise ValueError(f"a {period!r} budget of {limit} bytes")
            entry = stored.get(period, {})
            allowance = Allowance(period, limit, str(entry.get("key", "")),
                                  int(entry.get("used", 0)))
            allowance.renew(now)
            self.allowances[period] = allowance
        self.last_task = int(stored.get("last_task", 0))

    def _read(self) -> dict:
        if not self.path.exists():
            return {}
        data = read_json(self.path)
        if not isinstance(data, dict) or data.get("format") != BUDGET_FORMAT:
            raise StateError(f"{self.path}: not a fedattn link budget (move it away to "
                             "start the count afresh)")
        return data

    def spend(self, size: int) -> None:
        """``size`` bytes moved (either way); written behind, at most every ``SAVE_EVERY``."""
        now = self.clock()
        with self.lock:
            for allowance in self.allowances.values():
                allowance.renew(now)
                allowance.used += size
            due = now - self.saved_at >= SAVE_EVERY
        if due:
            self.save()

    def save(self) -> None:
        """Writes the counts now (atomically: a crash keeps the last written ones)."""
        with self.lock:
            self.saved_at = self.clock()
            data = {"format": BUDGET_FORMAT, "last_task": self.last_task,
                    **{p: {"key": a.key, "used": a.used, "limit": a.limit}
                       for p, a in self.allowances.items()}}
        atomic_write_json(self.path, data)

    def task_done(self, size: int) -> None:
        """A task moved ``size`` bytes in all: the next one is expected to move as many."""
        with self.lock:
            self.last_task = size
        self.save()

    def spent(self) -> Allowance | None:
        """The allowance the next task would overrun (its period renews first), or None
        when it fits."""
        now = self.clock()
        with self.lock:
            for allowance in self.allowances.values():
                allowance.renew(now)
                left = allowance.limit - allowance.used
                if left <= 0 or self.last_task > left:
                    return allowance
        return None


class LinkCaps:
    """The rate and the budget, as the transport asks them (``moved``) and the daemon
    (``declining``); their figures on the edge's /metrics."""

    def __init__(self, registry: CollectorRegistry, state_dir: Path, max_rate: float = 0.0,
                 limits: dict[str, int] | None = None):
        self.buckets = ({d: TokenBucket(max_rate) for d in ("up", "down")}
                        if max_rate > 0 else {})
        self.budget = DataBudget(state_dir / BUDGET_FILE, limits) if limits else None
        self.task_bytes = 0  # bytes moved since the last task ended
        self.declining: Allowance | None = None
        self.declines = Counter("fedattn_edge_declines", "Task requests this edge declined "
                                "(\"not now\"), by reason", ["reason"], registry=registry)
        if max_rate > 0:
            Gauge("fedattn_edge_max_rate_bytes", "--max-rate: bytes/s each direction",
                  registry=registry).set(max_rate)
            self.rate_wait = Gauge("fedattn_edge_rate_wait_seconds",
                                   "Seconds the edge's transfers waited for --max-rate",
                                   ["direction"], registry=registry)
            for direction, bucket in self.buckets.items():
                self.rate_wait.labels(direction).set_function(lambda b=bucket: b.waited)
        if self.budget is not None:
            self.declines.labels("data_budget")
            used = Gauge("fedattn_edge_budget_used_bytes", "Bytes moved (both ways) in the "
                         "current period of the data budget", ["period"], registry=registry)
            limit = Gauge("fedattn_edge_budget_bytes", "The data budget per period "
                          "(--max-bytes-per-day, --max-bytes-per-month)", ["period"],
                          registry=registry)
            for period, allowance in self.budget.allowances.items():
                used.labels(period).set_function(lambda a=allowance: a.used)
                limit.labels(period).set(allowance.limit)

    @property
    def active(self) -> bool:
        """Whether a rate or a budget is set (else the transport need not call ``moved``)."""
        return bool(self.buckets) or self.budget is not None

    def moved(self, direction: str, size: int) -> None:
        """``size`` bytes of one message go (``up``: before it leaves) or came (``down``):
        the rate may make the caller wait; the budget counts them."""
        bucket = self.buckets.get(direction)
        if bucket is not None:
            bucket.take(size)
        if self.budget is not None:
            self.task_bytes += size
            self.budget.spend(size)

    def task_done(self) -> None:
        """A task's result went up (or it was given up): its bytes are the next one's
        estimate, and the counts are written."""
        if self.budget is not None:
            self.budget.task_done(self.task_bytes)
        self.task_bytes = 0

    def decline(self) -> Allowance | None:
        """The allowance that makes the edge decline work now (None: it takes work);
        logged once as it starts and once as it ends."""
        if self.budget is None:
            return None
        spent = self.budget.spent()
        if spent is not None and self.declining is None:
            log.warning("data budget of the %s spent (%d of %d bytes, the last task moved %d): "
                        "declining work until %s UTC", spent.period, spent.used, spent.limit,
                        self.budget.last_task,
                        period_end(spent.period, self.budget.clock()).isoformat(timespec="minutes"))
        elif spent is None and self.declining is not None:
            log.info("data budget renewed: taking work again")
        self.declining = spent
        if spent is not None:
            self.declines.labels("data_budget").inc()
        return spent

    def save(self) -> None:
        """The budget's counts to disk now (the session ends)."""
        if self.budget is not None:
            self.budget.save()


__all__ = ["Allowance", "DataBudget", "LinkCaps", "TokenBucket", "period_end", "period_key"]

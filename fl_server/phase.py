"""What one phase of a round is while it runs, and the two ways a step of it can fail.

``Phase`` and ``Task`` are the state the schedule, the upload gate and the gRPC servicer
share about an open phase: which edges hold a task, which answered, which were dropped
and why. They live apart from the schedules so that the servicer and the gate can name
them without importing a round loop. A ``Phase`` changes only through its own methods
(``hand_out``, ``drop``, ``receive``, ``taint``, ``delivered``, ``close``, ``retire``):
every other module reads it, none writes a field (``tests/test_phase_owner.py`` checks),
so "who closes a phase, who may drop a task" is answered by the callers of two methods.
The phase is the unit of work deliveries and drops are counted in, per edge.
``Refused`` is every refusal an edge can get (its ``drop`` says whether it costs the
task), ``RoundAborted`` a phase that cannot complete.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedattn_shared.config import ServerConfig
from fedattn_shared.methods.aggregators import RoundSnapshot
from fedattn_shared.schema import Payload
from fedattn_shared.wire.serialize import EncodedPayload, encode

if TYPE_CHECKING:  # annotations only: the drivers and metrics import this module's types
    from fedattn_shared.methods.aggregators import Aggregator

    from .metrics import ServerMetrics

log = logging.getLogger("fl_server")

#: Drops that say only that the edge's link or session went (``Sessions``: its presence
#: stream ended, a new session replaced the one its task was handed out in). In a phase
#: that ``keeps_lost`` (--mode async's training), such a task's result is still taken.
LINK_LOST = frozenset({"disconnected", "rejoined"})


@dataclass
class Task:
    """One edge's task in the open phase: the id and nonce its upload must echo (a
    replayed or stale upload names another), and whether its download was completed."""

    task_id: int
    edge_id: str
    delivered: bool = False
    nonce: bytes = field(default_factory=lambda: secrets.token_bytes(16))


@dataclass
class Phase:
    """The open phase: its tasks, downlinks (encoded once, shared by every stream) and
    the results and drops so far; ``done`` fires at quorum or when nobody is pending."""

    name: str
    round: int
    tasks: dict[str, Task]
    quorum: int
    common_id: str
    common: EncodedPayload
    personal: dict[str, EncodedPayload]
    spec_json: str
    started: float = field(default_factory=time.monotonic)
    received: dict[str, dict] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    closed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set with ``closed``: uploads still receiving for this phase stop at once and give
    # their slot back instead of streaming bytes nobody will aggregate.
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    # Why the phase's aggregate cannot be trusted: the aggregator failed part way through
    # an upload, so its sums may hold part of it. The phase then aborts its round.
    tainted: str = ""
    # What runs the phase (``drivers.PhaseDriver``) and the upload schema it had when the
    # phase opened (SecAgg steps' schemas depend on the earlier steps).
    driver: Any = None
    schema: list = field(default_factory=list)
    # --compress down=: the common downlink as a delta to the one of ``delta_base``, for
    # edges that hold that one (``common`` is then the edges' reference R, whole).
    delta_base: str = ""
    delta: EncodedPayload | None = None
    # Kinds that travel coded, for the byte accounting: kind label -> (codec label,
    # decoded bytes of its coded sections), of an upload and of the delta.
    coded_up: dict = field(default_factory=dict)
    coded_delta: dict = field(default_factory=dict)
    # --mode async: the phase takes new tasks while it is the newest version's (its common
    # frames stay built); ``closed_why`` is the refusal a closed phase's results get.
    growing: bool = False
    closed_why: str = ""
    # --mode async's training ("train now, upload later"): a task dropped because the
    # edge's link was lost (``LINK_LOST``) is taken back when the edge, back, sends its
    # result for it while the phase is open (``revive``); the phase closes when too stale.
    keeps_lost: bool = False
    # Task downloads started (headers sent) and data bytes sent to each edge, over all its
    # tasks in this phase: what --max-task-deliveries bounds, across rejoins and reconnects.
    starts: dict[str, int] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)

    # ---- transitions: the only writers of the fields above ---------------------------
    def hand_out(self, edge: str, task_id: int, personal: EncodedPayload) -> Task:
        """A new task for ``edge`` in this (growing) phase: whatever it answered or was
        dropped for before in this phase is forgotten, its downlink replaced."""
        self.received.pop(edge, None)
        self.dropped.pop(edge, None)
        self.personal[edge] = personal
        task = self.tasks[edge] = Task(task_id, edge)
        return task

    def drop(self, edge: str, reason: str) -> None:
        """Takes the edge's task away (``reason`` is what its history and a refused upload
        say); the wait ends when nobody is left to answer."""
        self.dropped[edge] = reason
        self.maybe_close()

    def revive(self, edge: str) -> bool:
        """The edge, back after its link was lost, sends the result of the task it was
        dropped from: in a phase that ``keeps_lost``, while open, the task is pending
        again (True; the upload then passes every check as any other). False otherwise."""
        if not self.keeps_lost or self.closed or self.dropped.get(edge) not in LINK_LOST:
            return False
        del self.dropped[edge]
        return True

    def receive(self, edge: str, result: dict) -> None:
        """The edge's result is in (the gate took its upload)."""
        self.received[edge] = result
        self.maybe_close()

    def taint(self, reason: str) -> None:
        """The aggregate cannot be trusted (the first reason is kept): the phase aborts."""
        self.tainted = self.tainted or reason

    def delivered(self, task: Task) -> bool:
        """The task's download completed. True when that was the last one a fixed phase
        waited for (the caller may trim the heap the downloads' frames were freed into)."""
        task.delivered = True
        return not self.growing and all(t.delivered for t in self.tasks.values())

    def close(self, why: str, reason: str) -> list[str]:
        """Closes the phase to results: uploads still streaming stop (``closing``), later
        ones are refused with ``why`` when given, and every pending task is dropped for
        ``reason``. Lets the downlinks go (``retire``: downloads still streaming hold
        their own references), so the global they view is freed when the close replaces
        it, not only when the next phase opens: held through that opening, it sat under
        the new global and the downloads' frames (a model more at the peak, 64
        uploaders). Returns the edges dropped."""
        left = self.pending()
        for edge in left:
            self.dropped[edge] = reason
        self.closed, self.closed_why = True, why
        self.closing.set()
        self.done.set()
        self.retire()
        return left

    def serve(self, edge: str, start: bool, size: int, max_starts: int, max_bytes: int
              ) -> bool:
        """Counts a download's start or ``size`` more data bytes sent to ``edge``; False
        (nothing counted) when that would pass ``max_starts`` or ``max_bytes``."""
        if start:
            starts = self.starts.get(edge, 0) + 1
            if starts > max_starts:
                return False
            self.starts[edge] = starts
            return True
        sent = self.served.get(edge, 0) + size
        if sent > max_bytes:
            return False
        self.served[edge] = sent
        return True

    def refund(self, edge: str, start: bool, size: int) -> None:
        """Takes back what ``serve`` counted for a message that never went out because
        the server had no room for it: its queue is never counted against the edge."""
        if start:
            self.starts[edge] -= 1
        else:
            self.served[edge] -= size

    def retire(self) -> None:
        """Takes no new tasks and lets its downlinks go (a model's memory each): results
        of tasks already out are still taken until the phase closes."""
        self.growing = False
        self.common = encode(Payload())
        self.delta = None
        self.personal = {}

    def pending(self) -> list[str]:
        """Edges that hold a task and have neither answered nor been dropped."""
        return [e for e in self.tasks if self.is_pending(e)]

    def is_pending(self, edge: str) -> bool:
        """``edge in pending()`` without listing every task: each poll and upload asks,
        and an evaluation of 10,000 edges made that quadratic."""
        return edge in self.tasks and edge not in self.received and edge not in self.dropped

    def maybe_close(self) -> None:
        """Ends the wait once the quorum answered or nobody is left to answer."""
        if len(self.received) >= self.quorum or not any(map(self.is_pending, self.tasks)):
            self.done.set()

    def summary(self) -> dict:
        """The phase's entry in the round's history record."""
        record = {
            "selected": sorted(self.tasks), "received": sorted(self.received),
            "dropped": dict(sorted(self.dropped.items())), "quorum": self.quorum,
            "seconds": time.monotonic() - self.started,
            "edge_metrics": {e: r["metrics"] for e, r in sorted(self.received.items())
                             if r["metrics"]},
            "num_examples": {e: r["num_examples"] for e, r in sorted(self.received.items())},
        }
        # --clip-update-norm: each accepted upload's distance from the global (before any
        # scaling), what an operator chooses C from.
        norms = {e: r["update_norm"] for e, r in sorted(self.received.items())
                 if "update_norm" in r}
        if norms:
            record["update_norm"] = norms
        return record


@dataclass
class RoundState:
    """What the phases of one round hand on to the next: its history record, the
    edges still taking part, the aggregator's state at its start (to undo it) and
    whether it aborted."""

    number: int
    record: dict[str, Any]
    participants: list[str]
    snapshot: RoundSnapshot | None = None
    aborted: bool = False

    def abort(self, phase: str, err: Exception, metrics: ServerMetrics) -> None:
        """Records why the round aborted (history and metrics) and logs it: with the
        traceback when the cause is an error in the server or the method, without when it
        is the aggregate's values."""
        self.aborted = True
        reason = str(err) if isinstance(err, RoundAborted) else f"{type(err).__name__}: {err}"
        self.record["aborted"] = f"{phase}: {reason}"
        self.record["aggregate"] = {}
        metrics.rounds_aborted.inc()
        internal = not isinstance(err, RoundAborted) or err.__cause__ is not None
        log.error("round %d %s: round aborted, the global stays as it was: %s",
                  self.number, phase, reason, exc_info=err if internal else None)


class Refused(Exception):
    """A submission or request refused; ``drop`` says whether it costs the edge its task,
    ``code`` the gRPC status a refused unary call answers (None: PERMISSION_DENIED)."""

    def __init__(self, reason: str, drop: bool = False, code: Any = None):
        super().__init__(reason)
        self.drop = drop
        self.code = code
        self.phase: Phase | None = None  # the phase the refused header named, when found


class RoundAborted(Exception):
    """A phase of the round cannot complete; the round ends with the global as it was."""


def select_edges(connected: list[str], fraction: float, seed: int, round_number: int) -> list[str]:
    """The round's participants: all connected edges, or a seeded sample of
    ``fraction`` of them (the same seed and round pick the same edges on a resume)."""
    if fraction >= 1.0:
        return list(connected)
    count = max(1, math.ceil(fraction * len(connected)))
    return sorted(random.Random(seed * 100_003 + round_number).sample(connected, count))


async def open_phase(driver: Any, round_number: int, cfg: ServerConfig, task_ids: dict[str, int],
                     personal: Callable[[str], Payload], version: str, growing: bool = False
                     ) -> Phase:
    """A new phase of ``driver``: its schema, its common downlink encoded once
    (off the event loop), every edge's personal downlink and a task per edge. A downlink
    that cannot be built aborts the round (``RoundAborted``). ``version`` names the
    server instance and state version the common payload's id starts with; a ``growing``
    phase takes new tasks as edges ask (``hand_out``)."""
    name = driver.name
    try:
        schema = driver.schema()
        # Off the event loop: under --compress down= the common payload is coded here.
        common = await asyncio.to_thread(lambda: encode(driver.common()))
        delta = driver.common_delta()
        delta_encoded = await asyncio.to_thread(encode, delta[1]) if delta else None
        encoded = {e: encode(personal(e)) for e in task_ids}
    except Exception as err:
        raise RoundAborted(f"the {name} downlink could not be built "
                           f"({type(err).__name__}: {err})") from err
    # The id changes when the bytes differ (the manifest carries their CRC-32) and, to
    # rule out a CRC collision on the usual path, whenever a phase aggregated uploads;
    # so an edge's cached copy is reused exactly when it is current.
    layout = hashlib.sha256(common.manifest.SerializeToString(deterministic=True)).hexdigest()
    common_id = f"{version}-{layout[:16]}"
    driver.published(common_id)
    return Phase(
        name=name, round=round_number,
        tasks={edge: Task(task_id, edge) for edge, task_id in task_ids.items()},
        quorum=driver.quorum(len(task_ids)), common_id=common_id,
        common=common, personal=encoded,
        spec_json=json.dumps({"round": round_number, "rounds": cfg.rounds, "phase": name}),
        driver=driver, schema=schema,
        delta_base=delta[0] if delta_encoded is not None and delta[0] != common_id else "",
        delta=delta_encoded if delta_encoded is not None and delta[0] != common_id else None,
        coded_up=_labels(driver.coded_uploads()),
        coded_delta=_labels(driver.coded_delta()) if delta_encoded is not None else {},
        growing=growing, keeps_lost=growing)


def _labels(coded: dict) -> dict[str, tuple[str, int]]:
    """(Kind, name) -> Encoded as kind label -> (codec label, decoded bytes of that kind's
    coded sections): chunks never span two sections, but carry only their kind."""
    out: dict[str, tuple[str, int]] = {}
    for (kind, _), encoded in coded.items():
        label, total = out.get(kind.label, (encoded.label, 0))
        out[kind.label] = (label, total + encoded.raw_bytes)
    return out


def close_checked(close: Callable[[], dict[str, Any]], tainted: str, aggregator: Aggregator,
                  snapshot: RoundSnapshot | None) -> tuple[dict[str, Any], Exception | None]:
    """Closes a phase (``close``: a driver's; a worker thread, under ``agg_lock``) and
    checks the state it leaves before anything publishes it (the next broadcast, the
    checkpoint). Returns (figures, None), or ({}, the reason) after putting the
    aggregator back to ``snapshot`` when the close raised, the phase was ``tainted`` or
    the new state holds a non-finite or beyond-float32 value."""
    try:
        if tainted:
            raise RoundAborted(tainted)
        figures = close()
        bad = aggregator.unusable_tensors(snapshot) if snapshot is not None else []
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise RoundAborted(f"the aggregate is not finite within float32 range in "
                               f"{', '.join(bad[:3])}{more}; it was not applied")
        return figures, None
    except Exception as err:
        if snapshot is not None:
            # A failure here leaves the state unknown: it propagates and stops the
            # server, which resumes from the last checkpoint.
            aggregator.restore_round(snapshot)
        return {}, err

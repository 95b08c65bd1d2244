"""What the gRPC servicer may ask of the server: join, presence, next task, submit, leave.

The servicer (``service.py``) deals in bytes, streams, deadlines and certificates; this
narrow interface deals in edges, sessions, tasks and uploads, so that the servicer
never reaches into the engine's edge book or open phase, and the engine never sees a
gRPC context.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fedattn_shared.schema import Payload
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.transport import PayloadAssembler

from .edges import AuthError, EdgeRecord
from .engine import Engine
from .gate import Admission
from .metrics import routine
from .phase import Phase, Refused, Task

log = logging.getLogger("fl_server")


async def run_to_end(coro: Awaitable[None]) -> None:
    """Awaits ``coro`` to its end even when the caller is cancelled, then re-raises the
    cancellation. Taking an upload must not stop half way: a client that cancels its
    Submit once the body is in would otherwise stop it between adding to the sums and
    recording the result (or, under --mode async, in the middle of applying a buffer),
    and the receive buffer its tensors view would go back to the pool while a worker
    thread still reads it."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                break
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


class EdgeFront:
    """The engine as the servicer sees it (one per server)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.metrics = engine.metrics

    # ---- what an edge learns at join ----------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """The model/method fingerprint an edge's saved state must match."""
        return self.engine.fingerprint

    @property
    def config_json(self) -> str:
        """The run configuration every edge builds its method from."""
        return self.engine.config_json

    @property
    def finished(self) -> bool:
        """True once the last round ended: task polls answer DONE."""
        return self.engine.finished

    @property
    def stopping(self) -> bool:
        """True while the server shuts down: presence streams and long polls end."""
        return self.engine.stopping

    @property
    def round(self) -> int:
        """The last completed round."""
        return self.engine.round

    # ---- sessions -----------------------------------------------------------------------
    def join(self, request: pb.JoinRequest, cert_serial: str,
             mac_key: Callable[[EdgeRecord], bytes]) -> EdgeRecord:
        """Registers the edge (or checks it against its binding) and starts its session;
        a new session replaces any older one, and its outstanding task is gone with it."""
        # An edge without the run's configuration joins twice: to read it, then again to
        # declare its training split's size (num_examples): one "joined" in the log.
        previous = self.engine.edges.records.get(request.edge_id)
        declaring = ("num_examples" in request.info and previous is not None
                     and previous.session and "num_examples" not in previous.info)
        try:
            record = self.engine.edges.join(request.edge_id, request.edge_secret,
                                            dict(request.info), request.signing_key,
                                            cert_serial=cert_serial)
        except AuthError as err:
            raise Refused(str(err)) from None
        record.upload_mac_key = mac_key(record)
        record.needs_init = not request.state_fingerprint
        self.metrics.joins.inc()
        self.edge_lost(record.edge_id, "rejoined")
        if declaring:
            log.info("edge %s declared its training split: %s examples", record.edge_id,
                     record.info["num_examples"])
        else:
            log.info("edge %s joined (%s)", record.edge_id,
                     ", ".join(f"{k}={v!r}" for k, v in sorted(record.info.items())))
        return record

    def session(self, edge_id: str, session: str) -> EdgeRecord:
        """The record of a call in a live session (AuthError otherwise)."""
        return self.engine.edges.check(edge_id, session)

    def live_sessions(self) -> list[EdgeRecord]:
        """Every edge record, for the enrolment watch to re-check."""
        return list(self.engine.edges.records.values())

    def present(self, record: EdgeRecord) -> None:
        """The edge's presence stream opened: rounds may select it."""
        record.connected = True
        self._count_connected()

    def absent(self, record: EdgeRecord, session: str) -> None:
        """Its presence stream ended: when still its session, its task is dropped."""
        if record.session == session:
            record.connected = False
            self.edge_lost(record.edge_id, "disconnected")
            log.info("edge %s disconnected", record.edge_id)
        self._count_connected()

    def end_session(self, record: EdgeRecord, reason: str) -> None:
        """Ends an edge's session from the server's side (a leave or a revocation)."""
        record.end_session()
        self.edge_lost(record.edge_id, reason)
        self._count_connected()

    def _count_connected(self) -> None:
        self.metrics.connected.set(self.engine.edges.connected_count())

    def edge_lost(self, edge_id: str, reason: str) -> None:
        """An edge's session ended: its pending task is dropped."""
        self.engine.lose(edge_id, reason)

    # ---- tasks --------------------------------------------------------------------------
    def next_task(self, edge: str) -> tuple[Phase, Task] | None:
        """The edge's pending task, if any (async: new work when it is free)."""
        return self.engine.task_for(edge)

    def has_work(self, edge: str) -> bool:
        """Whether a task (or the run's end) waits for the edge: its presence hint. Asks,
        never hands out: a task is handed out only to the edge's own NextTask."""
        return self.finished or self.engine.has_work(edge)

    def task_of(self, edge: str, task_id: int) -> tuple[Phase, Task] | None:
        """The edge's pending task ``task_id`` (a download's continuation), if it still is;
        never hands out or gives up work."""
        return self.engine.task_of(edge, task_id)

    def serve(self, phase: Phase, task: Task, start: bool, size: int, whole: int,
              limit: int) -> bool:
        """Counts one more message of the edge's task download in ``phase``: a download's
        ``start`` (its header) or ``size`` data bytes of the ``whole``. Past ``limit``
        starts, or ``limit`` times the whole's bytes, the task is dropped and False
        returned. Counted per edge and phase, not per task, so a rejoin or a reconnect
        (which give the edge a new task under --mode async) does not start it over: a
        session pulling the model over and over costs the server bytes and CPU."""
        if phase.serve(task.edge_id, start, size, limit, whole * limit):
            return True
        if phase.is_pending(task.edge_id):
            self.engine.drop(phase, task.edge_id,
                             f"re-delivery limit: task {task.task_id} was sent {limit} times")
        return False

    # ---- uploads ------------------------------------------------------------------------
    def identify(self, header: pb.SubmitHeader) -> EdgeRecord:
        """Gate step 1: who sends (id, protocol, session)."""
        return self.engine.gate.identify(header)

    def admit(self, header: pb.SubmitHeader, record: EdgeRecord,
              certificate: Callable[[], str]) -> Admission:
        """Gate step 2: the header, against the open phase."""
        phase = self.engine.phase_for(header)
        try:
            return self.engine.gate.admit(header, record, certificate, phase)
        except Refused as err:
            err.phase = phase  # a header refusal that costs the task drops it there
            raise

    async def submit(self, admission: Admission, header: pb.SubmitHeader, body_mac: bytes,
                     assembler: PayloadAssembler) -> None:
        """Gate steps 4 to 6: the body's signature and values, the method's check, and
        into the phase."""
        gate = self.engine.gate
        payload: Payload = await gate.verify(admission, header, body_mac, assembler)
        gate.check_values(admission.phase, header.edge_id, payload)
        await run_to_end(gate.take(admission.phase, header, payload))

    def refused(self, edge: str, label: str, err: Refused | WireError,
                phase: Phase | None) -> str:
        """Counts a refused upload and, when the refusal costs the edge its task, drops
        it. Returns the reason the reply carries."""
        drop = isinstance(err, WireError) or err.drop
        # The reply's reason is what follows "refused" in both daemons' logs ("result
        # refused: stale or wrong task ..."), so a refusal carries no prefix of its own; a
        # wire error names its kind.
        reason = f"{type(err).__name__}: {err}" if isinstance(err, WireError) else str(err)
        log.log(logging.INFO if routine(reason) else logging.WARNING,
                "submission from %s refused: %s", edge or "?", reason)
        self.metrics.refused.labels(label).inc()
        if drop and phase is None:  # refused at the header: the phase it named
            phase = (err.phase if isinstance(err, Refused) and err.phase is not None
                     else self.engine.phase)
        if drop and phase is not None and phase.is_pending(edge) and not phase.closed:
            self.engine.drop(phase, edge, f"bad upload: {err}")
        return reason

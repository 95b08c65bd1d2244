"""The download pipeline: an edge's task, from its long poll to the last byte, free of any
transport. ``Downloads.serve`` answers one task call (``DownloadStream``: what a transport
adapter such as ``calls.Call`` gives it): it waits for the edge's task (or answers WAIT /
DONE), then sends one window of it, the header first on the first call; the edge fetches
the rest with continuation calls addressed by (task id, offset) (``uploads.Transfer``).

What one edge can make it hold: one call at a time per session (a newer session's call
supersedes an older one's), a deadline the call must carry and that is bounded
(``transport.DownloadTerms``: it ends a stalled call on the wire), one message in the
transport at a time (``streams.DownloadRoom``), each taken within an idle deadline plus
its size at the minimum rate (``Download``), and ``max_task_deliveries`` times a task's
bytes per phase, across rejoins (``Phase.serve``). Refusals that end the call are
``Refused`` with a status name; every data frame is counted here, by section kind and
codec (a coded kind's raw bytes once, decoded, when its download starts).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Protocol

from fedattn_shared.config import ServerConfig
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import DOWN, GRPC_FRAME_PREFIX, NO_CODEC, ByteMeter, count_coded
from fedattn_shared.wire.transport import DownloadTerms, chunk_views_from, data_frame, span

from .edges import EdgeRecord
from .engine import Engine
from .memory import download_room, trim_heap
from .metrics import DECLINES
from .phase import Phase, Refused, Task
from .streams import DownloadRoom, StreamEnded
from .uploads import Transfer

log = logging.getLogger("fl_server")

# A task call's deadline may exceed its bound by DEADLINE_SLACK seconds (the time it took
# to arrive) and by the factor DEADLINE_ENCODING, which is how gRPC's core writes a timeout
# on the wire (src/core/lib/transport/timeout_encoding.cc, chttp2's hpack_encoder.cc):
# rounded up to its unit, at most 1 % (a 1084 s deadline arrives as 1090 s), and then, on
# a connection that sent a timeout before, that earlier one instead whenever it is less
# than 3 % longer (the HPACK table's entry is reused: a 188 s continuation call after a
# 193 s long poll arrives as 194 s).
DEADLINE_SLACK = 2.0
DEADLINE_ENCODING = 1.01 / 0.97
# Seconds between two heap trims after cut downloads.
TRIM_EVERY = 1.0


class DownloadStream(Protocol):
    """What the pipeline needs of a transport's task call."""

    async def write(self, message) -> None:
        """Sends one message (a protobuf message, or a data frame built for it: bytes);
        ``StreamEnded`` once the call is over."""

    def seconds_left(self) -> float | None:
        """The call's deadline, in seconds from now (None: it carries none)."""


def download_bytes(header: pb.TaskHeader) -> int:
    """The data bytes a task's download carries (what its total deadline is sized from)."""
    common = 0 if header.common_cached else header.common.total_bytes
    return common + header.personal.total_bytes


class Download:
    """Writes a task's messages to its stream, each taken by the edge within ``idle``
    seconds plus its size at ``min_rate`` (a 1 MiB frame takes 33 s at 256 kbit/s: the
    idle deadline alone cut every slow link) and all before the call's deadline. An edge
    that stops reading makes gRPC's send wait for flow control for ever, holding the frame
    it sends; gRPC (aio) has no way to end such a call from the server (an abort waits
    behind the unsent data), but the call's deadline, which the server requires and
    bounds, ends it on the wire. So the first send past the idle deadline gives up
    (``stalled`` says why), and ``settle`` waits for the transport to let that send go:
    the edge took it after all, or the deadline ended the call. Each send takes room for
    its message in ``room`` and gives it back only when the transport is done with it,
    so the room holds what the process holds. A send that waits for room longer than
    ``idle`` gives up too (``busy``): that is the server's queue, never counted against
    the edge."""

    def __init__(self, stream: DownloadStream, room: DownloadRoom, idle: float,
                 min_rate: float, holder: str):
        self.stream, self.room, self.idle, self.holder = stream, room, idle, holder
        self.min_rate = min_rate
        self.sent = 0
        self.stalled = ""
        self.busy = False
        self.pending: asyncio.Future | None = None

    async def send(self, message: pb.TaskMessage | bytes) -> bool:
        """Sends one message; False (``stalled`` says why) when it did not go in time. A
        data frame (bytes) is built for its send, and the process holds it beside gRPC's
        copy until the send is done, so it takes room twice."""
        size = len(message) if isinstance(message, bytes) else message.ByteSize()
        held = 2 * size if isinstance(message, bytes) else size
        try:
            taken = await asyncio.wait_for(self.room.take(held, self.holder), self.idle)
        except asyncio.TimeoutError:
            self.busy = True
            self.stalled = f"no room in the server's download memory within {self.idle:g}s"
            return False
        write = asyncio.ensure_future(self.stream.write(message))
        write.add_done_callback(lambda done: self._written(done, taken))
        allowed = self.idle + size / self.min_rate
        finished, _ = await asyncio.wait({write}, timeout=allowed)
        if not finished:
            self.pending = write
            self.stalled = f"message {self.sent + 1} not taken within {allowed:.3g}s"
            return False
        write.result()  # a failed send: the call is over (the edge went, or its deadline)
        self.sent += 1
        return True

    def _written(self, write: asyncio.Future, taken: int) -> None:
        """The transport is done with a message (sent, or its call ended): its room goes
        back."""
        self.room.give(taken, self.holder)
        if not write.cancelled():
            write.exception()  # retrieved: a call that ended is not an unhandled error

    async def settle(self) -> bool:
        """After a stall: waits until the transport lets the stalled send go. True when
        the edge took it after all (the call is still open); False when the call ended."""
        if self.pending is None:
            return True
        await asyncio.wait({self.pending})
        return not self.pending.cancelled() and self.pending.exception() is None


class Downloads:
    """The server's download pipeline (see the module docstring); one per server."""

    def __init__(self, engine: Engine, meter: ByteMeter, cfg: ServerConfig):
        self.engine, self.meter, self.cfg = engine, meter, cfg
        self.room = download_room(cfg)
        self.terms = DownloadTerms(cfg.download_idle_timeout, cfg.download_min_rate,
                                   cfg.download_window, cfg.poll_timeout)
        self.tasking: dict[str, str] = {}  # edge -> the session whose task call is open
        # edge -> (task id, when its last byte went to the transport) of a task download
        # not yet wholly handed to the transport: one per edge identity, gone at its
        # expiry (``holds``). (What gRPC buffered when a link broke is lost with it too,
        # but a hold past the last byte would keep the task of every edge that crashed
        # while training.)
        self.partial: dict[str, tuple[int, float]] = {}
        self.trim_due = False  # a heap trim after cut downloads is scheduled

    def holds(self, edge: str) -> bool:
        """Whether ``edge`` is in the middle of downloading its task: part of it went to
        the transport, not all, and a call of it is still open or ended within
        ``transfer_resume_expiry`` seconds (counted from the call's end, not the last
        chunk handed to gRPC: on a slow link a chunk takes its size over the rate to
        leave, 128 s for 1 MiB at 64 kbit/s, and a link cut then cost the task).
        A disconnect or a rejoin then leaves the task standing, for the edge to continue
        the download from the byte it holds (``TaskRequest.task_id``, ``offset``) once it
        is back: a link dark for longer than a keepalive ping's wait (the server closes
        the connection) costs the bytes in flight, not the task. The bound is the one an
        upload's partial has: an edge that went in the middle of its download keeps its
        task that long at most; one that crashed while training (its download whole) is
        dropped at once, as before."""
        held = self.partial.get(edge)
        expiry = self.cfg.transfer_resume_expiry
        if held is None or expiry <= 0:
            return False
        task_id, since = held
        if edge not in self.tasking and time.monotonic() - since > expiry:
            del self.partial[edge]
            return False
        return self.engine.schedule.task_of(edge, task_id) is not None

    async def serve(self, record: EdgeRecord, request: pb.TaskRequest,
                    stream: DownloadStream) -> None:
        """One task call of an identified edge: a long poll and a first window, or
        (``task_id``) the window at ``offset`` of a download it started."""
        edge, session = request.edge_id, request.session
        if self.tasking.get(edge) == session:
            raise Refused(f"edge {edge}: a NextTask call of this session is in progress",
                          code="RESOURCE_EXHAUSTED")
        bound = self.terms.deadline(request.no_wait or bool(request.task_id))
        remaining = stream.seconds_left()
        if remaining is None or remaining > bound * DEADLINE_ENCODING + DEADLINE_SLACK:
            raise Refused(f"a NextTask call must carry a deadline of at most {bound:.1f}s "
                          f"(it has {'none' if remaining is None else f'{remaining:.1f}s'})",
                          code="FAILED_PRECONDITION")
        self.tasking[edge] = session
        try:
            if request.task_id:
                await self._continue(record, request, stream)
            else:
                await self._poll(record, request, stream)
        except asyncio.CancelledError:
            return  # the transport ends the call (its deadline, the edge went, a stop)
        finally:
            if self.tasking.get(edge) == session:
                del self.tasking[edge]

    async def _answer(self, stream: DownloadStream, status, round_number: int = 0) -> None:
        await stream.write(pb.TaskMessage(header=pb.TaskHeader(status=status,
                                                               round=round_number)))

    async def _poll(self, record: EdgeRecord, request: pb.TaskRequest,
                    stream: DownloadStream) -> None:
        """Waits for the edge's task (or answers WAIT / DONE), then its first window. A
        request that declines (``decline``) waits the same way for work the edge would
        get, then gives it up (``_decline``) and answers WAIT: nothing is handed out."""
        edge, engine = request.edge_id, self.engine
        deadline = time.monotonic() + (0.0 if request.no_wait else self.cfg.poll_timeout)
        while True:
            if engine.stopping or record.session != request.session:
                # The server shuts down, or a newer session took over: ask again later.
                await self._answer(stream, pb.TaskHeader.WAIT)
                return
            if engine.finished:
                record.heard_run_over = True
                await self._answer(stream, pb.TaskHeader.DONE, engine.round)
                return
            if request.decline:
                if engine.schedule.has_work(edge):
                    self._decline(edge, request.decline)
                    await self._answer(stream, pb.TaskHeader.WAIT)
                    return
                found = None
            else:
                found = engine.schedule.task_for(edge)
            if found is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                await self._answer(stream, pb.TaskHeader.WAIT)
                return
            # Whatever gives this edge a task (a phase opening, the run ending) sets
            # its wakeup, so an idle poll sleeps until then or its deadline: waking
            # every second, 10,000 idle edges cost the server 10,000 wakeups a second.
            record.wakeup.clear()
            await record.wakeup.wait(remaining)
        phase, task = found
        header, delta = self._task_header(phase, task, edge, request.cached_common)
        await self._window(phase, task, stream, header, delta,
                           Transfer(f"{edge}/{task.task_id}", 0))

    def _decline(self, edge: str, value: int) -> None:
        """The edge says "not now" (``pb.Decline``): its work is given up as a drop that
        is no fault of the edge, and counted by reason (an unknown value: "other")."""
        name = pb.Decline.Name(value) if value in pb.Decline.values() else ""
        label = name.removeprefix("DECLINE_").lower() or "other"
        label = label if label in DECLINES else "other"
        self.engine.metrics.declines.labels(label).inc()
        log.info("edge %s declines work now (%s)", edge, label)
        self.engine.schedule.decline(edge, f"declined: {label.replace('_', ' ')}")

    async def _continue(self, record: EdgeRecord, request: pb.TaskRequest,
                        stream: DownloadStream) -> None:
        """The next window of a download the edge started: its task must still be the
        edge's (else WAIT: the edge asks afresh); the layout is the first call's."""
        edge = request.edge_id
        found = self.engine.schedule.task_of(edge, request.task_id)
        if found is None or record.session != request.session:
            await self._answer(stream, pb.TaskHeader.WAIT)
            return
        phase, task = found
        header, delta = self._task_header(phase, task, edge, request.cached_common)
        if request.offset > download_bytes(header.header):
            raise Refused(f"offset {request.offset} is past the task's "
                          f"{download_bytes(header.header)} bytes", code="OUT_OF_RANGE")
        await self._window(phase, task, stream, header, delta,
                           Transfer(f"{edge}/{task.task_id}", request.offset), first=False)

    async def _window(self, phase: Phase, task: Task, stream: DownloadStream,
                      header: pb.TaskMessage, delta: bool, transfer: Transfer,
                      first: bool = True) -> None:
        """Sends one window of the task's download from ``transfer.offset`` (the header
        first on its ``first`` call), within the edge's budget of deliveries; a send the
        edge stops taking cuts it."""
        edge = task.edge_id
        total = download_bytes(header.header)
        download = Download(stream, self.room, self.cfg.download_idle_timeout,
                            self.cfg.download_min_rate, edge)
        frames = self._frames(phase, edge, header.header, delta, transfer.offset)
        messages = itertools.chain(((header, None, 0),), frames) if first else frames
        if first and delta:
            count_coded(self.meter, DOWN, phase.coded_delta, edge)
        end, went = transfer.offset, False
        try:
            with self.room.downloading(edge):
                for message, count, raw in messages:
                    if not self._deliver(phase, task, count is None, raw, total):
                        if not went:  # nothing of this call went out: say so
                            await self._answer(stream, pb.TaskHeader.WAIT)
                        return
                    if count is not None:
                        self.meter.count(*count)
                    if not await download.send(message):
                        if download.busy:
                            phase.refund(edge, count is None, raw)
                        message = None
                        frames.close()  # the frames built for this call go now
                        await self._cut(phase, edge, download)
                        return
                    end, went = end + raw, True
                    self.partial[edge] = (task.task_id, time.monotonic())
        except StreamEnded as err:  # a send failed: the call is over
            log.info("round %d %s: %s's task download ended: %s", phase.round, phase.name,
                     edge, err)
            return
        finally:  # the hold counts from the call's end (``holds``)
            if self.partial.get(edge, (None,))[0] == task.task_id:
                self.partial[edge] = (task.task_id, time.monotonic())
        if end >= total:
            self.partial.pop(edge, None)
            if phase.delivered(task):
                trim_heap()  # the frames' memory back before the uploads come in

    def _deliver(self, phase: Phase, task: Task, start: bool, size: int, whole: int) -> bool:
        """Counts one more message of the edge's task download in ``phase``: a download's
        ``start`` (its header) or ``size`` data bytes of the ``whole``. Past
        ``max_task_deliveries`` starts, or that many times the whole's bytes, the task is
        dropped and False returned. Counted per edge and phase, not per task, so a rejoin
        or a reconnect (which give the edge a new task under --mode async) does not start
        it over: a session pulling the model over and over costs the server bytes and CPU."""
        limit = self.cfg.max_task_deliveries
        if phase.serve(task.edge_id, start, size, limit, whole * limit):
            return True
        if phase.is_pending(task.edge_id):
            self.engine.context.drop(phase, task.edge_id,
                             f"re-delivery limit: task {task.task_id} was sent {limit} times")
        return False

    def _frames(self, phase: Phase, edge: str, header: pb.TaskHeader, delta: bool,
                offset: int):
        """(frame, meter entry, data bytes) for the data of one call: whole chunks from
        ``offset``, at most ``download_window`` bytes (at least one chunk), common part then
        personal; a coded kind's raw bytes are counted once, at the start. The phase's
        downlinks are taken now, with the header: a phase that closes while the header
        is sent lets them go (``Phase.retire``), and this call still sends what its
        header announced."""
        parts = [(phase.personal[edge], {})]
        if not header.common_cached:
            parts.insert(0, (phase.delta, phase.coded_delta) if delta else (phase.common, {}))
        return self._frames_of(parts, edge, offset)

    def _frames_of(self, parts: list, edge: str, offset: int):
        """``_frames``' generator over the downlinks ``parts`` it took: (frame, meter entry,
        data bytes). Each frame is built for its send, from the downlink's tensor memory
        (the one copy a chunk costs before gRPC takes its own): frames built once per
        phase and kept until every task was out held a model more through the phase's
        opening, when the downloads overlap the first uploads (the server's peak at 64
        uploaders), for one copy per chunk and edge less. A chunk larger than the room
        gives this download now (``DownloadRoom.piece``: its fair share when many download
        at once) goes in pieces, each sized when it is its turn and built from the
        tensor memory, never from a frame of the whole chunk (64 downloads would each hold
        one, a model and a half, beside what the room counts)."""
        budget = self.cfg.download_window
        for encoded, coded in parts:
            size = encoded.manifest.total_bytes
            if offset >= size:
                offset -= size
                continue
            for kind, views, raw in chunk_views_from(encoded, self.cfg.chunk_bytes, offset):
                label, codec = kind.label, coded.get(kind.label, (NO_CODEC, 0))[0]
                at, length = 0, self.room.piece(raw)
                while at < raw:
                    length = min(length, raw - at)
                    if budget < length:
                        return
                    budget -= length
                    piece = data_frame(*(views if length == raw else
                                         span(views, at, at + length)))
                    yield piece, (DOWN, label, len(piece) + GRPC_FRAME_PREFIX,
                                  0 if label in coded else length, edge, codec), length
                    at += length
                    length = self.room.piece(raw - at)
            offset = 0

    async def _cut(self, phase: Phase, edge: str, download: Download) -> None:
        """A download the edge stopped taking (or one that found no room): the call ends
        once the transport lets its last send go, by the edge's deadline at the latest."""
        log.log(logging.INFO if download.busy else logging.WARNING,
                "round %d %s: %s's task download cut: %s", phase.round, phase.name, edge,
                download.stalled)
        taken = await download.settle()
        self._trim_soon()
        if taken:  # taken after all: the status can go out now
            raise Refused(f"task download stalled: {download.stalled}",
                          code="UNAVAILABLE" if download.busy else "DEADLINE_EXCEEDED")

    def _trim_soon(self) -> None:
        """A cut download's frame (the server's copy and gRPC's), freed into the heap once
        the call unwinds, goes back to the system: one heap trim ``TRIM_EVERY`` seconds
        from now, for every cut until then (a trim is a few ms of the event loop, so
        however many identities stall, at most one a period)."""
        if self.trim_due:
            return
        self.trim_due = True

        def trim() -> None:
            self.trim_due = False
            trim_heap()

        asyncio.get_running_loop().call_later(TRIM_EVERY, trim)

    def _task_header(self, phase: Phase, task: Task, edge: str, cached_common: str
                     ) -> tuple[pb.TaskMessage, bool]:
        """The task's header, and whether its common part goes as the delta to the copy
        the edge holds (``--compress down=``)."""
        personal = phase.personal[edge]
        cached = bool(cached_common) and cached_common == phase.common_id
        delta = not cached and phase.delta is not None and cached_common == phase.delta_base
        header = pb.TaskHeader(
            status=pb.TaskHeader.TASK, round=phase.round, task_id=task.task_id, phase=phase.name,
            spec_json=phase.spec_json, common_id=phase.common_id, common_cached=cached,
            common=(phase.delta if delta else phase.common).manifest,
            common_base_id=phase.delta_base if delta else "",
            personal=personal.manifest, task_nonce=task.nonce)
        return pb.TaskMessage(header=header), delta


__all__ = ["Download", "DownloadStream", "Downloads", "download_bytes"]

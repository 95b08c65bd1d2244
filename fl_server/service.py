"""The gRPC service: joins, presence, task long-polls and streamed submissions.

Every incoming message is checked (protocol version, identity, session, round and task,
schema, sizes, checksum, finite values) before it can touch the aggregate; a bad message
costs the sender its task, never the server its state. Everything a caller can make the
server hold is bounded: ids and join info (checked before they reach a log line or a metric
label), registered ids (``max_edges``), upload streams (one per task, an idle and a total
deadline, cut when their phase closes), task re-deliveries, and the presence stream of a
session that ended.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from dataclasses import dataclass

import grpc
from grpc._cython import cygrpc  # ExecuteBatchError: a send on a call that ended

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.config import ServerConfig
from fedattn_shared.schema import SectionSpec
from fedattn_shared.tls import Enrollment, edge_id_refusal
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire import fedattn_pb2_grpc as pb_grpc
from fedattn_shared.wire.accounting import (
    DOWN,
    GRPC_FRAME_PREFIX,
    META,
    NO_CODEC,
    UP,
    ByteMeter,
    CodedUpload,
    count_coded,
)
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.signing import (
    BodyMac,
    answer_key_share,
    upload_mac_key,
    verify_key_share,
)
from fedattn_shared.wire.transport import (
    MAX_MESSAGE_BYTES,
    BufferPool,
    DownloadTerms,
    PayloadAssembler,
    data_frames_from,
    deserializer,
    serialize,
)

from .edges import AuthError, EdgeRecord
from .front import EdgeFront
from .gate import Admission
from .memory import download_memory, log_memory, trim_heap
from .phase import Phase, Refused
from .streams import BodyReader, Download, DownloadRoom, download_bytes

log = logging.getLogger("fl_server")

PRESENCE_INTERVAL = 10.0
ENROLLMENT_POLL = 1.0  # how often a changed enrolment list (a revocation) is looked for
# The ``edge`` label of bytes and refusals from callers that are not (yet) a registered
# edge: one bounded series, and no valid edge id can be spelled like it.
UNREGISTERED = "(unregistered)"
MAX_LEAVE_REASON = 200
# A NextTask call's deadline may exceed its bound by this much (the time it took to arrive).
DEADLINE_SLACK = 2.0


@dataclass(frozen=True)
class Malformed:
    """A request that does not parse as its message type: the handler refuses it with
    INVALID_ARGUMENT (gRPC would answer UNKNOWN and log a traceback)."""

    reason: str
    size: int


def lenient(parse):
    """``parse`` that returns ``Malformed`` instead of raising on bytes that are not the
    message."""

    def parse_or_refuse(raw: bytes):
        try:
            return parse(raw)
        except Exception as err:  # noqa: BLE001 - any parser failure is the sender's fault
            return Malformed(f"malformed request: {type(err).__name__}: {str(err)[:200]}",
                             len(raw))

    return parse_or_refuse


class FederatedLearningService(pb_grpc.FederatedLearningServicer):
    """The gRPC servicer: bytes, streams, deadlines and certificates. What it may ask of
    the server goes through ``front.EdgeFront``; every upload check is ``gate.UploadGate``."""
    def __init__(self, front: EdgeFront, meter: ByteMeter, cfg: ServerConfig,
                 enrollment: Enrollment | None = None, upload_slots: int | None = None):
        """``upload_slots``: uploads received at once (``memory.plan_upload_memory``);
        default ``cfg.max_concurrent_uploads``. What the downloads under way may hold in
        gRPC is ``memory.download_memory``."""
        self.front = front  # the narrow interface to the engine: edges, tasks, uploads
        self.meter = meter
        self.cfg = cfg
        slots = upload_slots or cfg.max_concurrent_uploads
        self.upload_slots = asyncio.Semaphore(slots)
        self.buffers = BufferPool(keep=slots)
        self.download_room = DownloadRoom(download_memory(cfg))
        self.enrollment = enrollment  # mutual TLS: the enrolled edges
        self.receiving: set[str] = set()  # edges with an upload stream in flight
        self.tasking: dict[str, str] = {}  # edge -> the session whose NextTask call is open
        self.terms = DownloadTerms(cfg.download_idle_timeout, cfg.download_min_rate,
                                   cfg.download_window, cfg.poll_timeout)

    # ---- identity ---------------------------------------------------------------------
    def _identity_refusal(self, edge_id: str, context, token: str | None = None) -> str:
        """Under mutual TLS: '' when the peer's certificate names ``edge_id``, is the very
        certificate enrolled for it (its serial) and the edge is enrolled (with ``token``,
        when given) and not revoked; else the reason."""
        if self.enrollment is None:
            return ""
        auth = context.auth_context()
        certified = (auth.get("x509_common_name") or [b""])[0].decode(errors="replace")
        if certified != edge_id:
            return f"the client certificate is for {certified!r}, not edge {edge_id!r}"
        pem = (auth.get("x509_pem_cert") or [b""])[0]
        if not pem:
            return f"edge {edge_id}: no client certificate"
        return self.enrollment.check(edge_id, token, serial=self.enrollment.peer_serial(pem))

    async def _refuse_malformed(self, request, context) -> None:
        if isinstance(request, Malformed):
            self.meter.count(UP, META, request.size + GRPC_FRAME_PREFIX, 0, UNREGISTERED)
            log.warning("refused a malformed request from %s: %s", context.peer(), request.reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)

    async def _auth(self, request, context) -> EdgeRecord:
        """A call of an edge's session: a well-formed request, a valid and registered id,
        its certificate and its live session; refused by name otherwise. Returns the
        edge's record."""
        await self._refuse_malformed(request, context)
        edge_id = request.edge_id
        refusal = edge_id_refusal(edge_id) or self._identity_refusal(edge_id, context)
        if refusal:
            self.meter.count_message(UP, request, edge=UNREGISTERED)
            log.warning("refused %s from %s: %s", edge_id[:64], context.peer(), refusal)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        try:
            record = self.front.session(edge_id, request.session)
        except AuthError as err:
            self.meter.count_message(UP, request, edge=UNREGISTERED)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(err))
        self.meter.count_message(UP, request, edge=edge_id)
        return record

    async def watch_enrollment(self) -> None:
        """Ends the session of every edge whose enrolment no longer holds (revoked, or its
        id re-issued to another certificate) as soon as the list changes: its presence
        stream closes and its task is dropped, without waiting for its next call."""
        if self.enrollment is None:
            return
        while True:
            await asyncio.sleep(ENROLLMENT_POLL)
            try:
                if not self.enrollment.changed():
                    continue
            except (OSError, ValueError) as err:
                log.error("cannot read the enrolment list: %s", err)
                continue
            for record in self.front.live_sessions():
                edge = record.edge_id
                refusal = record.session and self.enrollment.check(
                    edge, serial=record.cert_serial or None)
                if refusal:
                    self.front.end_session(record, "revoked")
                    log.warning("edge %s: session ended: %s", edge, refusal)

    # ---- Join -------------------------------------------------------------------------
    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        """Registers an edge and starts its session, or refuses it with the status and
        reason of the first check it fails."""
        await self._refuse_malformed(request, context)
        edge_id = request.edge_id
        refusal = edge_id_refusal(edge_id)
        if refusal:
            self.meter.count_message(UP, request, edge=UNREGISTERED)
            log.warning("join refused from %s: %s", context.peer(), refusal)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        try:
            reply = await self._join(request, context)
        except Refused as err:
            self.meter.count_message(UP, request, edge=UNREGISTERED)
            code = err.code or grpc.StatusCode.PERMISSION_DENIED
            log.warning("join refused for %r from %s: %s", edge_id, context.peer(), err)
            await context.abort(code, str(err))
        self.meter.count_message(UP, request, edge=edge_id)
        self.meter.count_message(DOWN, reply, edge=edge_id)
        return reply

    async def _join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        """Checks a join in order and registers the edge; raises ``Refused`` (with the
        status code to answer) naming what failed."""
        edge_id = request.edge_id
        if request.protocol_version != PROTOCOL_VERSION:
            raise Refused(f"protocol version {request.protocol_version} is not supported "
                          f"(server speaks {PROTOCOL_VERSION})",
                          code=grpc.StatusCode.FAILED_PRECONDITION)
        refusal = self._identity_refusal(edge_id, context, token=request.join_token)
        if refusal:
            raise Refused(refusal)
        if (self.cfg.join_token and self.enrollment is None
                and not hmac.compare_digest(request.join_token, self.cfg.join_token)):
            raise Refused("bad join token")
        fingerprint = self.front.fingerprint
        if request.state_fingerprint and request.state_fingerprint != fingerprint:
            raise Refused(f"edge {edge_id}: its private state was made for model/method "
                          f"fingerprint {request.state_fingerprint[:80]!r}, this run is "
                          f"{fingerprint}", code=grpc.StatusCode.FAILED_PRECONDITION)
        # Checked before the registry replaces the edge's session: a join that cannot
        # prove its key share must not end the session the edge already has.
        if not verify_key_share(request.signing_key, edge_id, request.upload_key_share,
                                request.upload_key_proof):
            raise Refused(f"edge {edge_id}: upload_key_share is missing or not signed by "
                          "signing_key (an unproven upload key share)")
        try:
            shared, server_share = answer_key_share(request.upload_key_share)
        except ValueError as err:  # signed, yet a low-order point
            raise Refused(f"edge {edge_id}: unusable upload_key_share: {err}",
                          code=grpc.StatusCode.INVALID_ARGUMENT) from None
        serial = self.enrollment.serial(edge_id) if self.enrollment is not None else ""
        record = self.front.join(request, serial,
                                 lambda record: upload_mac_key(shared, record.edge_id,
                                                               record.session))
        return pb.JoinReply(protocol_version=PROTOCOL_VERSION, session=record.session,
                            config_json=self.front.config_json, fingerprint=fingerprint,
                            chunk_bytes=self.cfg.chunk_bytes, upload_key_share=server_share,
                            task_hints=True, download_idle_timeout=self.terms.idle_timeout,
                            download_min_rate=self.terms.min_rate,
                            download_window=self.terms.window,
                            poll_timeout=self.terms.poll_timeout)

    # ---- Presence ---------------------------------------------------------------------
    async def Presence(self, request: pb.PresenceRequest, context):
        """Streams keep-alive events while the session lives: while open, the edge counts as
        connected (rounds select it); when it ends, its task is dropped. Each event says
        whether a task waits for the edge (``task_ready``), and one is sent at once when
        that may have changed (``EdgeRecord.wake``): an idle edge then holds this stream
        only, not a NextTask long-poll beside it (each held call costs the server ~22 KB)."""
        record = await self._auth(request, context)
        # One presence stream per session: a new one replaces the old, which ends now
        # (each held stream costs the server ~23 KB; a session could open thousands).
        stream = record.presence = object()
        stirred = record.stirred
        stirred.set()  # the replaced stream, if any, wakes and sees it is no longer current
        self.front.present(record)
        edge = request.edge_id
        try:
            while (record.session == request.session and record.presence is stream
                   and not self.front.stopping):
                stirred.clear()
                ready = self.front.has_work(edge)
                event = pb.PresenceEvent(server_time=time.time(), task_ready=ready)
                self.meter.count_message(DOWN, event, edge=edge)
                yield event
                # Wakes at once when the session ends or the edge's work may have changed.
                await stirred.wait(PRESENCE_INTERVAL)
        except asyncio.CancelledError:
            return  # the stream ended (the edge went, or the server is shutting down)
        finally:
            if record.presence is stream:
                record.presence = None
                self.front.absent(record, request.session)

    # ---- NextTask ---------------------------------------------------------------------
    async def NextTask(self, request: pb.TaskRequest, context) -> None:
        """Long-polls for this edge's task and streams it: the header, then the common
        payload (unless the edge's cached copy is current) and its personal one, at most
        ``download_window`` data bytes per call; the edge fetches the rest with
        continuation calls (``task_id``, ``offset``). ``no_wait``: answers at once (the edge
        waits for its presence stream's ``task_ready`` hint instead of holding this call).

        What one edge can make this hold: one call at a time per session (a newer
        session's call supersedes an older one's), a deadline the call must carry and that
        is bounded (``streams.call_seconds``: it ends a stalled call on the wire), one
        message in gRPC at a time (``DownloadRoom``), and ``max_task_deliveries`` times a
        task's bytes per phase, across rejoins."""
        record = await self._auth(request, context)
        edge, session = request.edge_id, request.session
        if self.tasking.get(edge) == session:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"edge {edge}: a NextTask call of this session is in progress")
        bound = self._call_bound(request)
        remaining = context.time_remaining()
        if remaining is None or remaining > bound + DEADLINE_SLACK:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"a NextTask call must carry a deadline of at most {bound:.1f}s "
                                f"(it has {'none' if remaining is None else f'{remaining:.1f}s'})")
        self.tasking[edge] = session
        try:
            if request.task_id:
                await self._continue_download(record, request, context)
            else:
                await self._poll_and_download(record, request, context)
        except asyncio.CancelledError:
            return  # gRPC ends the call (its deadline, the edge went, the server stops)
        finally:
            if self.tasking.get(edge) == session:
                del self.tasking[edge]

    def _call_bound(self, request: pb.TaskRequest) -> float:
        return self.terms.deadline(request.no_wait or bool(request.task_id))

    async def _answer(self, edge: str, context, status, round_number: int = 0) -> None:
        await context.write(self._meta(edge, pb.TaskMessage(header=pb.TaskHeader(
            status=status, round=round_number))))

    async def _poll_and_download(self, record: EdgeRecord, request: pb.TaskRequest,
                                 context) -> None:
        """Waits for the edge's task (or answers WAIT / DONE), then its first window."""
        edge = request.edge_id
        deadline = time.monotonic() + (0.0 if request.no_wait else self.cfg.poll_timeout)
        while True:
            if self.front.stopping or record.session != request.session:
                # The server shuts down, or a newer session took over: ask again later.
                await self._answer(edge, context, pb.TaskHeader.WAIT)
                return
            if self.front.finished:
                record.heard_run_over = True
                await self._answer(edge, context, pb.TaskHeader.DONE, self.front.round)
                return
            found = self.front.next_task(edge)
            if found is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                await self._answer(edge, context, pb.TaskHeader.WAIT)
                return
            # Whatever gives this edge a task (a phase opening, the run ending) sets
            # its wakeup, so an idle poll sleeps until then or its deadline: waking
            # every second, 10,000 idle edges cost the server 10,000 wakeups a second.
            record.wakeup.clear()
            await record.wakeup.wait(remaining)
        phase, task = found
        header, delta = self._task_header(phase, task, edge, request.cached_common)
        await self._download(phase, task, request, context, header, delta, 0, first=True)

    async def _continue_download(self, record: EdgeRecord, request: pb.TaskRequest,
                                 context) -> None:
        """The next window of a download the edge started: its task must still be the
        edge's (else WAIT: the edge asks afresh); the layout is the first call's."""
        edge = request.edge_id
        found = self.front.task_of(edge, request.task_id)
        if found is None or record.session != request.session:
            await self._answer(edge, context, pb.TaskHeader.WAIT)
            return
        phase, task = found
        header, delta = self._task_header(phase, task, edge, request.cached_common)
        if request.offset > download_bytes(header.header):
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                f"offset {request.offset} is past the task's "
                                f"{download_bytes(header.header)} bytes")
        await self._download(phase, task, request, context, header, delta, request.offset,
                             first=False)

    async def _download(self, phase: Phase, task, request: pb.TaskRequest, context,
                        header: pb.TaskMessage, delta: bool, offset: int, first: bool) -> None:
        """Sends one window of the task's download (the header first on its ``first``
        call), within the edge's budget of deliveries; a send the edge stops taking cuts it."""
        edge = request.edge_id
        total = download_bytes(header.header)
        limit = self.cfg.max_task_deliveries
        download = Download(context, self.download_room, self.cfg.download_idle_timeout,
                            self.cfg.download_min_rate, edge)
        messages = self._window(phase, edge, header.header, delta, offset)
        if first:
            messages = itertools.chain(((header, None, 0),), messages)
            if delta:
                count_coded(self.meter, DOWN, phase.coded_delta, edge)
        end, went = offset, False
        try:
            for message, count, raw in messages:
                if not self.front.serve(phase, task, count is None, raw, total, limit):
                    if not went:  # nothing of this call went out: say so
                        await self._answer(edge, context, pb.TaskHeader.WAIT)
                    return
                if count is None:
                    self._meta(edge, message)
                else:
                    self.meter.count(*count)
                if not await download.send(message):
                    if download.busy:
                        phase.refund(edge, count is None, raw)
                    await self._cut(phase, edge, download, context)
                    return
                end, went = end + raw, True
        except cygrpc.ExecuteBatchError as err:  # a send failed: the call is over
            log.info("round %d %s: %s's task download ended: %s", phase.round, phase.name,
                     edge, type(err).__name__)
            return
        if end >= total:
            if phase.delivered(task):
                trim_heap()  # the frames' memory back before the uploads come in

    def _window(self, phase: Phase, edge: str, header: pb.TaskHeader, delta: bool,
                offset: int):
        """(frame, meter entry, data bytes) for the data of one call: whole chunks from ``offset``,
        at most ``download_window`` bytes (at least one chunk), common part then personal;
        each counted as it goes (a coded kind's raw bytes once, decoded, at the start)."""
        parts = [(phase.personal[edge], None, {})]
        if not header.common_cached:
            parts.insert(0, (phase.delta, None, phase.coded_delta) if delta
                         else (phase.common, phase.common_frames, {}))
        budget = self.cfg.download_window
        for encoded, built, coded in parts:
            size = encoded.manifest.total_bytes
            if offset >= size:
                offset -= size
                continue
            for kind, frame, raw in data_frames_from(encoded, self.cfg.chunk_bytes, offset,
                                                     built):
                if budget < raw:
                    return
                budget -= raw
                codec = coded.get(kind.label, (NO_CODEC, 0))[0]
                yield frame, (DOWN, kind.label, len(frame) + GRPC_FRAME_PREFIX,
                              0 if kind.label in coded else raw, edge, codec), raw
            offset = 0

    async def _cut(self, phase: Phase, edge: str, download: Download, context) -> None:
        """A download the edge stopped taking (or one that found no room): the call ends
        once gRPC lets its last send go, by the edge's deadline at the latest."""
        log.log(logging.INFO if download.busy else logging.WARNING,
                "round %d %s: %s's task download cut: %s", phase.round, phase.name, edge,
                download.stalled)
        if await download.settle():  # taken after all: the status can go out now
            await context.abort(grpc.StatusCode.UNAVAILABLE if download.busy
                                else grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"task download stalled: {download.stalled}")

    def _task_header(self, phase: Phase, task, edge: str, cached_common: str
                     ) -> tuple[pb.TaskMessage, bool]:
        """The task's header (counted when sent), and whether its common part goes as
        the delta to the copy the edge holds (``--compress down=``)."""
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

    def _meta(self, edge: str, message):
        self.meter.count_message(DOWN, message, edge=edge)
        return message

    # ---- Submit -----------------------------------------------------------------------
    async def Submit(self, request_iterator, context) -> pb.SubmitReply:
        """Receives one upload: its header through the upload gate, its body under an
        upload slot, then into the phase; any refusal is answered by name."""
        edge, label, phase = "", UNREGISTERED, None
        try:
            try:
                first = await asyncio.wait_for(context.read(), self.cfg.upload_idle_timeout)
            except asyncio.TimeoutError:
                raise Refused(f"no header within {self.cfg.upload_idle_timeout:g}s") from None
            except Exception:  # noqa: BLE001 - a client that vanished mid-call
                return pb.SubmitReply(accepted=False, reason="no header")
            if isinstance(first, Malformed):
                self.meter.count(UP, META, first.size + GRPC_FRAME_PREFIX, 0, UNREGISTERED)
                raise Refused(first.reason)
            if (first is grpc.aio.EOF or isinstance(first, memoryview)
                    or not first.HasField("header")):
                raise Refused(f"the first message must be a header (peer {context.peer()})")
            header = first.header
            refusal = edge_id_refusal(header.edge_id)
            if refusal:
                self.meter.count_message(UP, first, edge=UNREGISTERED)
                raise Refused(refusal)
            edge = header.edge_id
            try:  # the upload gate, step 1: who sends
                record = self.front.identify(header)
            except Refused:
                self.meter.count_message(UP, first, edge=UNREGISTERED)
                raise
            self.meter.count_message(UP, first, edge=edge)
            # Step 2: the header, before a byte of the body is read.
            admission = self.front.admit(header, record,
                                         lambda: self._identity_refusal(edge, context))
            phase = admission.phase
            label = edge
            if edge in self.receiving:
                raise Refused(f"an upload for task {header.task_id} is already in progress "
                              "on another stream")
            self.receiving.add(edge)
            try:
                await self._receive_and_submit(admission, header, context)
            finally:
                self.receiving.discard(edge)
        except (Refused, WireError) as err:
            reply = pb.SubmitReply(accepted=False,
                                   reason=self.front.refused(edge, label, err, phase))
            self.meter.count_message(DOWN, reply, edge=label)
            return reply
        reply = pb.SubmitReply(accepted=True)
        self.meter.count_message(DOWN, reply, edge=label)
        return reply

    async def _receive_and_submit(self, admission: Admission, header: pb.SubmitHeader,
                                  context) -> None:
        """Receives the body into a pooled buffer under an upload slot, then hands it to
        the gate's body checks and the phase (``EdgeFront.submit``)."""
        # A slot covers an upload's buffer from the first byte until it is aggregated,
        # so at most max_concurrent_uploads buffers exist and the pool reuses them all.
        # Released after the receive, slots let uploads pile up behind the aggregation
        # lock, each in a fresh buffer: a zeroed allocation of the model's size per
        # upload and RSS growing with the number of edges. No stream holds one longer
        # than its deadlines or past its phase's close.
        phase, record = admission.phase, admission.record
        await self._acquire_slot(phase)
        try:
            assembler, body_mac = await self._receive(
                phase, header, phase.schema, context, header.edge_id,
                BodyMac(record.upload_mac_key, header.body_mac_iv))
            log_memory("round %d %s: %s's upload received", phase.round, phase.name,
                       header.edge_id)
            try:
                await self.front.submit(admission, header, body_mac, assembler)
            finally:
                # The aggregate holds copies; the buffer serves the next upload. Once the
                # phase has its results, the pool goes: its buffers (one model each) would
                # sit through the close and the next download, where memory peaks.
                self.buffers.give(assembler.buffer)
                if phase.done.is_set() or phase.closed:
                    self.buffers.clear()
        finally:
            self.upload_slots.release()

    async def _acquire_slot(self, phase: Phase) -> None:
        """Waits for an upload slot, or refuses once the phase closes while waiting."""
        acquire = asyncio.ensure_future(self.upload_slots.acquire())
        closing = asyncio.ensure_future(phase.closing.wait())
        try:
            await asyncio.wait({acquire, closing}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the call ended while waiting: never leak the slot
            await self._give_up_slot(acquire)
            raise
        finally:
            closing.cancel()
        if acquire.done() and not acquire.cancelled():
            return
        await self._give_up_slot(acquire)
        raise Refused("the phase closed before the upload could start")

    async def _give_up_slot(self, acquire: asyncio.Future) -> None:
        """Withdraws a pending slot request; a slot granted meanwhile goes back."""
        acquire.cancel()
        try:
            await acquire  # raises CancelledError unless the slot was granted first
        except asyncio.CancelledError:
            return
        self.upload_slots.release()

    async def _receive(self, phase: Phase, header: pb.SubmitHeader, schema: list[SectionSpec],
                       context, edge: str, body: BodyMac) -> tuple[PayloadAssembler, bytes]:
        """Reads an upload's chunks into a pooled buffer, MACing them on a worker thread;
        returns the assembler and the body's MAC tag. The stream is cut by its idle and
        total deadlines and by its phase closing."""
        # The upload gate matched the manifest to the schema, so the sizes come from it.
        specs = {(int(spec.kind), spec.name): spec for spec in schema}
        sizes = [specs[(s.kind, s.name)].nbytes_of(t.name for t in s.tensors)
                 for s in header.payload.sections]
        loop = asyncio.get_running_loop()

        def ingest(offset: int, chunk: memoryview) -> None:
            assembler.write(offset, chunk)
            body.update(chunk)

        assembler = PayloadAssembler(header.payload, max_bytes=sum(sizes),
                                     max_chunk_bytes=MAX_MESSAGE_BYTES, pool=self.buffers,
                                     sizes=sizes, checksum=False)
        # The signed body MAC binds every byte, so an upload carries no CRC-32. Each chunk's
        # copy and MAC run on a worker thread (both release the GIL) while the event loop
        # reads the next chunk and serves the other edges: on the loop they would
        # serialize every upload on one core. One chunk at a time per upload keeps the MAC
        # in order.
        writing: asyncio.Future | None = None
        counted = CodedUpload(self.meter, UP, phase.coded_up, edge)
        closing = asyncio.ensure_future(phase.closing.wait())
        # Deadlines: no chunk for the idle timeout (plus a chunk at the min rate), or the
        # whole upload slower than upload_min_rate, and the stream is cut (its slot is what
        # honest edges wait for).
        read = BodyReader(context, closing, assembler, self.cfg).read

        try:
            while not assembler.complete:
                message = await read()
                if message is grpc.aio.EOF:
                    raise WireError(f"upload ended after {assembler.received} of "
                                    f"{len(assembler.buffer)} bytes")
                if not isinstance(message, memoryview):
                    raise WireError(message.reason if isinstance(message, Malformed)
                                    else "a second header inside one upload")
                kind, offset = assembler.reserve(message)
                counted.chunk(kind.label, len(message))
                if writing is not None:
                    await writing
                writing = loop.run_in_executor(None, ingest, offset, message)
            if writing is not None:
                await writing
            if await read() is not grpc.aio.EOF:
                raise WireError("data beyond the declared payload")
            counted.complete()
        except BaseException:
            counted.abandon()
            if writing is not None and not writing.done():
                # Never let the buffer go back to the pool while a worker writes to it.
                await asyncio.wait([writing])
            self.buffers.give(assembler.buffer)
            raise
        finally:
            closing.cancel()
        return assembler, body.tag()

    # ---- Leave ------------------------------------------------------------------------
    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveReply:
        """Ends the edge's session at its request; its task, if any, is dropped."""
        record = await self._auth(request, context)
        reason = request.reason[:MAX_LEAVE_REASON]
        self.front.end_session(record, f"left: {reason}" if reason else "left")
        log.info("edge %s left (%s)", request.edge_id, repr(reason) if reason else "no reason given")
        reply = pb.LeaveReply()
        self.meter.count_message(DOWN, reply, edge=request.edge_id)
        return reply


def service_handler(service: FederatedLearningService) -> grpc.GenericRpcHandler:
    """The service's methods with fedattn's (de)serializers: data chunks travel as
    pre-built frames and arrive as views (see ``transport.data_frame``); every other
    message is plain protobuf, so any client built from the .proto interoperates. Bytes
    that do not parse reach the handler as ``Malformed`` and are refused by name."""
    unary = grpc.unary_unary_rpc_method_handler
    return grpc.method_handlers_generic_handler("fedattn.v1.FederatedLearning", {
        "Join": unary(service.Join, lenient(pb.JoinRequest.FromString), serialize),
        "Presence": grpc.unary_stream_rpc_method_handler(
            service.Presence, lenient(pb.PresenceRequest.FromString), serialize),
        "NextTask": grpc.unary_stream_rpc_method_handler(
            service.NextTask, lenient(pb.TaskRequest.FromString), serialize),
        "Submit": grpc.stream_unary_rpc_method_handler(
            service.Submit, lenient(deserializer(pb.SubmitMessage)), serialize),
        "Leave": unary(service.Leave, lenient(pb.LeaveRequest.FromString), serialize),
    })


__all__ = ["FederatedLearningService", "service_handler"]

"""The gRPC service: joins, presence, task long-polls and streamed submissions.

Every incoming message is checked (protocol version, identity, session, round and task,
schema, sizes, checksum, finite values) before it can touch the aggregate; a bad message
costs the sender its task, never the server its state.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time

import grpc

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.methods.base import SectionSpec
from fedattn_shared.tls import Enrollment
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire import fedattn_pb2_grpc as pb_grpc
from fedattn_shared.wire.accounting import DOWN, GRPC_FRAME_PREFIX, UP, ByteMeter, data_message_wire_bytes
from fedattn_shared.wire.codec import (
    BufferPool,
    Payload,
    PayloadAssembler,
    WireError,
    nonfinite_tensors,
)
from fedattn_shared.wire.signing import (
    BODY_MAC_IV_BYTES,
    BodyMac,
    answer_key_share,
    upload_mac_key,
    verify_key_share,
    verify_submission,
)
from fedattn_shared.wire.transport import MAX_MESSAGE_BYTES, data_frames, deserializer, serialize

from .engine import Engine, Refused
from .registry import AuthError

log = logging.getLogger("fl_server")

PRESENCE_INTERVAL = 10.0


class FederatedLearningService(pb_grpc.FederatedLearningServicer):
    def __init__(self, engine: Engine, meter: ByteMeter, join_token: str, chunk_bytes: int,
                 poll_timeout: float, max_concurrent_uploads: int,
                 enrollment: Enrollment | None = None):
        self.engine = engine
        self.meter = meter
        self.join_token = join_token
        self.chunk_bytes = chunk_bytes
        self.poll_timeout = poll_timeout
        self.upload_slots = asyncio.Semaphore(max_concurrent_uploads)
        self.buffers = BufferPool(keep=max_concurrent_uploads)
        self.enrollment = enrollment  # mutual TLS: the enrolled edges

    def _identity_refusal(self, edge_id: str, context, token: str | None = None) -> str:
        """Under mutual TLS: '' when the peer's certificate names ``edge_id`` and the edge is
        enrolled (with ``token``, when given) and not revoked; else the reason."""
        if self.enrollment is None:
            return ""
        names = context.auth_context().get("x509_common_name") or [b""]
        certified = names[0].decode(errors="replace")
        if certified != edge_id:
            return f"the client certificate is for {certified!r}, not edge {edge_id!r}"
        return self.enrollment.check(edge_id, token)

    async def _auth(self, edge_id: str, session: str, context) -> None:
        refusal = self._identity_refusal(edge_id, context)
        if refusal:
            log.warning("refused %s from %s: %s", edge_id, context.peer(), refusal)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        try:
            self.engine.registry.check(edge_id, session)
        except AuthError as err:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(err))

    # ---- Join -------------------------------------------------------------------------
    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        self.meter.count_message(UP, request, edge=request.edge_id)
        if request.protocol_version != PROTOCOL_VERSION:
            log.warning("join refused for %r: protocol version %d", request.edge_id,
                        request.protocol_version)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"protocol version {request.protocol_version} is not supported "
                                f"(server speaks {PROTOCOL_VERSION})")
        refusal = self._identity_refusal(request.edge_id, context, token=request.join_token)
        if refusal:
            log.warning("join refused for %r from %s: %s", request.edge_id, context.peer(),
                        refusal)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        if (self.join_token and self.enrollment is None
                and not hmac.compare_digest(request.join_token, self.join_token)):
            log.warning("join refused for %r: bad join token", request.edge_id)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "bad join token")
        fingerprint = self.engine.fingerprint
        if request.state_fingerprint and request.state_fingerprint != fingerprint:
            log.warning("join refused for %s: stored state fingerprint %s != run %s",
                        request.edge_id, request.state_fingerprint, fingerprint)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"edge {request.edge_id}: its private state was made for model/method "
                f"fingerprint {request.state_fingerprint}, this run is {fingerprint}")
        # Checked before the registry replaces the edge's session: a join that cannot
        # prove its key share must not end the session the edge already has.
        if not verify_key_share(request.signing_key, request.edge_id, request.upload_key_share,
                                request.upload_key_proof):
            log.warning("join refused for %r: upload key share not signed by its signing key",
                        request.edge_id)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"edge {request.edge_id}: upload_key_share is missing or not "
                                "signed by signing_key")
        try:
            shared, server_share = answer_key_share(request.upload_key_share)
        except ValueError as err:  # signed, yet a low-order point
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"edge {request.edge_id}: unusable upload_key_share: {err}")
        try:
            record = self.engine.registry.join(request.edge_id, request.edge_secret,
                                               dict(request.info), request.signing_key)
        except AuthError as err:
            log.warning("join refused: %s", err)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        record.upload_mac_key = upload_mac_key(shared, record.edge_id, record.session)
        record.needs_init = not request.state_fingerprint
        self.engine.metrics.joins.inc()
        # A new session replaces any older one: its outstanding task is gone with it.
        self.engine.edge_lost(record.edge_id, "rejoined")
        log.info("edge %s joined (%s)", record.edge_id,
                 ", ".join(f"{k}={v}" for k, v in sorted(record.info.items())))
        reply = pb.JoinReply(protocol_version=PROTOCOL_VERSION, session=record.session,
                             config_json=self.engine.config_json, fingerprint=fingerprint,
                             chunk_bytes=self.chunk_bytes,
                             upload_key_share=server_share)
        self.meter.count_message(DOWN, reply, edge=record.edge_id)
        return reply

    # ---- Presence ---------------------------------------------------------------------
    async def Presence(self, request: pb.PresenceRequest, context):
        await self._auth(request.edge_id, request.session, context)
        self.meter.count_message(UP, request, edge=request.edge_id)
        record = self.engine.registry.records[request.edge_id]
        record.connected = True
        self.engine.metrics.connected.set(len(self.engine.registry.connected_ids()))
        try:
            while record.session == request.session:
                event = pb.PresenceEvent(server_time=time.time())
                self.meter.count_message(DOWN, event, edge=request.edge_id)
                yield event
                await asyncio.sleep(PRESENCE_INTERVAL)
        finally:
            if record.session == request.session:
                record.connected = False
                self.engine.edge_lost(request.edge_id, "disconnected")
                log.info("edge %s disconnected", request.edge_id)
            self.engine.metrics.connected.set(len(self.engine.registry.connected_ids()))

    # ---- NextTask ---------------------------------------------------------------------
    async def NextTask(self, request: pb.TaskRequest, context):
        await self._auth(request.edge_id, request.session, context)
        edge = request.edge_id
        self.meter.count_message(UP, request, edge=edge)
        record = self.engine.registry.records[edge]
        deadline = time.monotonic() + self.poll_timeout
        while True:
            if self.engine.finished:
                record.heard_run_over = True
                yield self._meta(edge, pb.TaskMessage(header=pb.TaskHeader(
                    status=pb.TaskHeader.DONE, round=self.engine.round)))
                return
            found = self.engine.task_for(edge)
            if found is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                yield self._meta(edge, pb.TaskMessage(header=pb.TaskHeader(
                    status=pb.TaskHeader.WAIT)))
                return
            record.wakeup.clear()
            try:
                await asyncio.wait_for(record.wakeup.wait(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass
        phase, task = found
        personal = phase.personal[edge]
        cached = bool(request.cached_common) and request.cached_common == phase.common_id
        header = pb.TaskHeader(
            status=pb.TaskHeader.TASK, round=phase.round, task_id=task.task_id, phase=phase.name,
            spec_json=phase.spec_json, common_id=phase.common_id, common_cached=cached,
            common=phase.common.manifest, personal=personal.manifest, task_nonce=task.nonce)
        yield self._meta(edge, pb.TaskMessage(header=header))
        # Once every task of the phase went out, the shared frames are dropped (one model's
        # worth of memory through the uploads); a task sent again, to an edge that
        # restarted, builds its frames from the encoded tensors as it streams.
        common = [] if cached else (phase.common_frames
                                    or data_frames(phase.common, self.chunk_bytes))
        for kind, frame, size in itertools.chain(common, data_frames(personal, self.chunk_bytes)):
            self.meter.count(DOWN, kind.label, len(frame) + GRPC_FRAME_PREFIX, size, edge)
            yield frame
        task.delivered = True
        if all(t.delivered for t in phase.tasks.values()):
            phase.common_frames = []

    def _meta(self, edge: str, message):
        self.meter.count_message(DOWN, message, edge=edge)
        return message

    # ---- Submit -----------------------------------------------------------------------
    async def Submit(self, request_iterator, context) -> pb.SubmitReply:
        try:
            first = await context.read()
        except Exception:  # noqa: BLE001 - a client that vanished mid-call
            return pb.SubmitReply(accepted=False, reason="no header")
        if first is grpc.aio.EOF or isinstance(first, memoryview) or not first.HasField("header"):
            log.warning("submission refused: the first message is not a header (peer %s)",
                        context.peer())
            return pb.SubmitReply(accepted=False, reason="the first message must be a header")
        header = first.header
        edge = header.edge_id
        self.meter.count_message(UP, first, edge=edge)
        phase = None
        try:
            if header.protocol_version != PROTOCOL_VERSION:
                raise Refused(f"protocol version {header.protocol_version} unsupported")
            try:
                record = self.engine.registry.check(edge, header.session)
            except AuthError as err:
                raise Refused(str(err)) from None
            refusal = self._identity_refusal(edge, context)
            if refusal:
                raise Refused(refusal)
            if len(header.body_mac_iv) != BODY_MAC_IV_BYTES:
                raise Refused(f"body_mac_iv must be {BODY_MAC_IV_BYTES} bytes, "
                              f"got {len(header.body_mac_iv)}")
            try:
                phase, schema = self.engine.check_submission(header)
            except Refused as err:
                if err.drop and self.engine.phase is not None:
                    phase = self.engine.phase
                raise
            # A slot covers an upload's buffer from the first byte until it is aggregated,
            # so at most max_concurrent_uploads buffers exist and the pool reuses them all.
            # Released after the receive, slots let uploads pile up behind the aggregation
            # lock, each in a fresh buffer: a zeroed allocation of the model's size per
            # upload and RSS growing with the number of edges.
            async with self.upload_slots:
                assembler, body_mac = await self._receive(
                    header, schema, context, edge,
                    BodyMac(record.upload_mac_key, header.body_mac_iv))
                try:
                    if not verify_submission(bytes.fromhex(record.signing_key), header,
                                             body_mac):
                        raise Refused("the signature does not verify over this header and "
                                      "body with the edge's signing key", drop=True)
                    payload, bad = await asyncio.to_thread(_decode_checked, assembler)
                    if bad:
                        raise Refused(f"non-finite values in {bad[:3]}", drop=True)
                    await self.engine.accept(phase, header, payload)
                finally:
                    # The aggregate holds copies; the buffer serves the next upload.
                    self.buffers.give(assembler.buffer)
        except (Refused, WireError) as err:
            drop = isinstance(err, WireError) or err.drop
            reason = f"{type(err).__name__ if isinstance(err, WireError) else 'refused'}: {err}"
            log.warning("submission from %s refused: %s", edge or "?", reason)
            self.engine.metrics.refused.labels(edge if edge in self.engine.registry.records
                                               else "unknown").inc()
            if drop and phase is not None and edge in phase.pending() and not phase.closed:
                self.engine.drop(phase, edge, f"bad upload: {err}")
            reply = pb.SubmitReply(accepted=False, reason=reason)
            self.meter.count_message(DOWN, reply, edge=edge)
            return reply
        reply = pb.SubmitReply(accepted=True)
        self.meter.count_message(DOWN, reply, edge=edge)
        return reply

    async def _receive(self, header: pb.SubmitHeader, schema: list[SectionSpec], context,
                       edge: str, body: BodyMac) -> tuple[PayloadAssembler, bytes]:
        # check_submission matched the manifest to the schema, so the sizes come from it.
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
        try:
            while not assembler.complete:
                message = await context.read()
                if message is grpc.aio.EOF:
                    raise WireError(f"upload ended after {assembler.received} of "
                                    f"{len(assembler.buffer)} bytes")
                if not isinstance(message, memoryview):
                    raise WireError("a second header inside one upload")
                kind, offset = assembler.reserve(message)
                size = len(message)
                self.meter.count(UP, kind.label, data_message_wire_bytes(size), size, edge)
                if writing is not None:
                    await writing
                writing = loop.run_in_executor(None, ingest, offset, message)
            if writing is not None:
                await writing
            if await context.read() is not grpc.aio.EOF:
                raise WireError("data beyond the declared payload")
        except BaseException:
            if writing is not None and not writing.done():
                # Never let the buffer go back to the pool while a worker writes to it.
                await asyncio.wait([writing])
            self.buffers.give(assembler.buffer)
            raise
        return assembler, body.tag()

    # ---- Leave ------------------------------------------------------------------------
    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveReply:
        await self._auth(request.edge_id, request.session, context)
        self.meter.count_message(UP, request, edge=request.edge_id)
        record = self.engine.registry.records[request.edge_id]
        record.session = ""
        record.connected = False
        self.engine.edge_lost(request.edge_id,
                              f"left: {request.reason}" if request.reason else "left")
        log.info("edge %s left (%s)", request.edge_id, request.reason or "no reason given")
        reply = pb.LeaveReply()
        self.meter.count_message(DOWN, reply, edge=request.edge_id)
        return reply


def _decode_checked(assembler: PayloadAssembler) -> tuple[Payload, list[str]]:
    """Decode and finiteness scan: off the event loop (torch drops the GIL)."""
    payload = assembler.finish()
    return payload, nonfinite_tensors(payload)


def service_handler(service: FederatedLearningService) -> grpc.GenericRpcHandler:
    """The service's methods with fedattn's (de)serializers: data chunks travel as
    pre-built frames and arrive as views (see ``transport.data_frame``); every other
    message is plain protobuf, so any client built from the .proto interoperates."""
    unary = grpc.unary_unary_rpc_method_handler
    return grpc.method_handlers_generic_handler("fedattn.v1.FederatedLearning", {
        "Join": unary(service.Join, pb.JoinRequest.FromString, serialize),
        "Presence": grpc.unary_stream_rpc_method_handler(
            service.Presence, pb.PresenceRequest.FromString, serialize),
        "NextTask": grpc.unary_stream_rpc_method_handler(
            service.NextTask, pb.TaskRequest.FromString, serialize),
        "Submit": grpc.stream_unary_rpc_method_handler(
            service.Submit, deserializer(pb.SubmitMessage), serialize),
        "Leave": unary(service.Leave, pb.LeaveRequest.FromString, serialize),
    })


__all__ = ["FederatedLearningService", "service_handler"]

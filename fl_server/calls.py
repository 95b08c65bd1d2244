"""The gRPC call layer, around every handler of the service: who is calling (identity) and
what each message costs (byte accounting), so that the servicer and the transfer
pipelines never count a protobuf message or read a certificate themselves.

``Call`` is a handler's view of one gRPC call (it wraps gRPC's context): it counts every
protobuf message that goes out under the call's edge label, and the request once the
caller is known (``received``); data frames are counted by the pipelines, which know each
chunk's section kind and codec. ``Identity`` checks a caller once per call: a valid edge
id, under mutual TLS the very certificate enrolled for it, and (a session call) its live
session. ``handlers`` wraps each servicer method so that a ``Refused`` with a status code
ends the call with that status and a request that does not parse is refused by name
(``INVALID_ARGUMENT``) instead of gRPC's UNKNOWN and a traceback.

The label of bytes from a caller that is not (yet) a registered edge is ``UNREGISTERED``:
one bounded series, and no valid edge id can be spelled like it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import grpc
from grpc._cython import cygrpc  # ExecuteBatchError: a send on a call that ended

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.tls import Enrollment, edge_id_refusal
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import DOWN, GRPC_FRAME_PREFIX, META, UP, ByteMeter
from fedattn_shared.wire.transport import deserializer, serialize

from .edges import AuthError, EdgeBook, EdgeRecord
from .phase import Refused
from .streams import END, Malformed, StreamEnded

log = logging.getLogger("fl_server")

UNREGISTERED = "(unregistered)"
SERVICE = "fedattn.v1.FederatedLearning"


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


class Call:
    """One gRPC call as a handler sees it: gRPC's context (anything not defined here is
    its), the caller's label and record once known, and the call's byte accounting."""

    def __init__(self, context, meter: ByteMeter, identity: Identity):
        self.context, self.meter, self.identity = context, meter, identity
        self.edge = UNREGISTERED  # the label of what goes out (replies, events, headers)
        self.record: EdgeRecord | None = None
        self.caller = ""  # the edge id an upload claims, once it is a valid one

    def __getattr__(self, name: str):
        return getattr(self.context, name)

    # ---- accounting -------------------------------------------------------------------
    def received(self, message, edge: str = UNREGISTERED) -> None:
        """Counts one request message (a meta message) under ``edge``."""
        if isinstance(message, Malformed):
            self.meter.count(UP, META, message.size + GRPC_FRAME_PREFIX, 0, UNREGISTERED)
        else:
            self.meter.count_message(UP, message, edge=edge)

    def sent(self, message):
        """Counts one reply message under the call's label; returns it."""
        self.meter.count_message(DOWN, message, edge=self.edge)
        return message

    async def write(self, message) -> None:
        """Sends one stream message: a protobuf message is counted here; a data frame
        (bytes, built without protobuf) by the pipeline that built it. ``StreamEnded``
        when the call is over."""
        if not isinstance(message, bytes):
            self.sent(message)
        try:
            await self.context.write(message)
        except cygrpc.ExecuteBatchError as err:
            raise StreamEnded(type(err).__name__) from None

    async def read(self):
        """The next request message of a client stream (``END`` once it closed)."""
        message = await self.context.read()
        return END if message is grpc.aio.EOF else message

    def seconds_left(self) -> float | None:
        """The call's deadline, in seconds from now (None: it carries none)."""
        return self.context.time_remaining()

    # ---- identity ---------------------------------------------------------------------
    def certificate_refusal(self, edge_id: str, token: str | None = None) -> str:
        """Under mutual TLS, '' when the peer's certificate is ``edge_id``'s; else why."""
        return self.identity.certificate_refusal(edge_id, self.context, token)

    def identify_upload(self, first: pb.SubmitMessage) -> EdgeRecord:
        """An upload's sender (``first``: its header message), checked once: a valid id,
        our protocol, a live session (the header is counted under the edge from here on,
        not before), then its certificate. Raises ``Refused`` (never dropping a task: a
        stranger cannot cost an edge its)."""
        header = first.header
        refusal = edge_id_refusal(header.edge_id)
        self.caller = "" if refusal else header.edge_id
        if not refusal and header.protocol_version != PROTOCOL_VERSION:
            refusal = f"protocol version {header.protocol_version} unsupported"
        record = None
        if not refusal:
            try:
                record = self.identity.edges.check(header.edge_id, header.session)
            except AuthError as err:
                refusal = str(err)
        if refusal:
            self.received(first)
            raise Refused(refusal)
        self.received(first, edge=header.edge_id)
        refusal = self.certificate_refusal(header.edge_id)
        if refusal:
            raise Refused(refusal)
        return record


class Identity:
    """Who may call: the edge book's sessions and, under mutual TLS, the enrolment list."""

    def __init__(self, edges: EdgeBook, enrollment: Enrollment | None):
        self.edges, self.enrollment = edges, enrollment

    def certificate_refusal(self, edge_id: str, context, token: str | None = None) -> str:
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

    async def session_call(self, request, call: Call) -> None:
        """A call of an edge's session (presence, task, leave): a valid and registered id,
        its certificate and its live session; the call ends with the status that names
        the first that fails. Sets the call's label and record; counts the request."""
        edge_id = request.edge_id
        refusal = edge_id_refusal(edge_id) or call.certificate_refusal(edge_id)
        if refusal:
            call.received(request)
            log.warning("refused %s from %s: %s", edge_id[:64], call.peer(), refusal)
            await call.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        try:
            call.record = self.edges.check(edge_id, request.session)
        except AuthError as err:
            call.received(request)
            await call.abort(grpc.StatusCode.UNAUTHENTICATED, str(err))
        call.received(request, edge=edge_id)
        call.edge = edge_id


async def refuse_malformed(request, call: Call) -> None:
    """A request that did not parse ends its call (INVALID_ARGUMENT), counted."""
    if isinstance(request, Malformed):
        call.received(request)
        log.warning("refused a malformed request from %s: %s", call.peer(), request.reason)
        await call.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)


async def abort_refused(call: Call, err: Refused) -> None:
    """A refusal that ends the call: with its status (PERMISSION_DENIED unless named)."""
    code = grpc.StatusCode[err.code] if err.code else grpc.StatusCode.PERMISSION_DENIED
    await call.abort(code, str(err))


async def headers_now(context) -> None:
    """Sends the call's response headers before anything else, for a call that may be
    silent a while (a long poll, an upload waiting for its slot or its checks). nginx
    (``grpc_pass``) gives a call's reply headers ``grpc_read_timeout`` in all, whatever
    comes over the connection meanwhile, but once they are out any frame restarts that
    clock, the server's HTTP/2 PINGs (``--keepalive-interval``) included, since nginx
    opens one upstream connection per call. A call that already ended is left to fail
    where it reads or writes next."""
    try:
        await context.send_initial_metadata(())
    except cygrpc.ExecuteBatchError:
        return


def parse(message_type: type) -> Callable[[bytes], object]:
    """A request's deserializer: protobuf, and a message that does not parse is kept as
    ``Malformed`` for the handler to refuse (counted), never an exception in grpc."""
    return lenient(message_type.FromString)


def handlers(service, meter: ByteMeter, identity: Identity) -> grpc.GenericRpcHandler:
    """The service's methods with fedattn's (de)serializers and the call layer around each:
    a ``Call`` for its context, the session check before Presence, NextTask and Leave,
    the reply of a unary call counted. Data chunks travel as hand-built frames and arrive
    as views (``transport.data_frame``); every other message is plain protobuf, so any
    client built from the .proto interoperates."""

    def unary(method: Callable, session: bool):
        async def handle(request, context):
            call = Call(context, meter, identity)
            await refuse_malformed(request, call)
            if session:
                await identity.session_call(request, call)
            return call.sent(await method(request, call))
        return handle

    def server_stream(method: Callable):
        async def start(request, context) -> Call:
            call = Call(context, meter, identity)
            await refuse_malformed(request, call)
            await identity.session_call(request, call)
            return call

        if inspect.isasyncgenfunction(method):  # yields its messages (Presence)
            async def events(request, context):
                call = await start(request, context)
                stream = method(request, call)
                try:
                    async for message in stream:
                        yield call.sent(message)
                finally:  # its own ``finally`` (an edge gone absent) runs now, not at GC
                    await stream.aclose()
            return events

        async def writes(request, context):  # writes its messages itself (``Call.write``)
            call = await start(request, context)
            await headers_now(context)  # a long poll is silent until its answer
            await method(request, call)
        return writes

    async def upload(request_iterator, context):
        # The reply is counted by the servicer: none for a caller that vanished.
        await headers_now(context)  # a slot's wait and the checks are silent
        return await service.Submit(request_iterator, Call(context, meter, identity))

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Join": grpc.unary_unary_rpc_method_handler(
            unary(service.Join, session=False), parse(pb.JoinRequest), serialize),
        "Presence": grpc.unary_stream_rpc_method_handler(
            server_stream(service.Presence), parse(pb.PresenceRequest), serialize),
        "NextTask": grpc.unary_stream_rpc_method_handler(
            server_stream(service.NextTask), parse(pb.TaskRequest), serialize),
        "Submit": grpc.stream_unary_rpc_method_handler(
            upload, lenient(deserializer(pb.SubmitMessage)), serialize),
        "UploadOffset": grpc.unary_unary_rpc_method_handler(
            unary(service.UploadOffset, session=True), parse(pb.UploadOffsetRequest), serialize),
        "Leave": grpc.unary_unary_rpc_method_handler(
            unary(service.Leave, session=True), parse(pb.LeaveRequest), serialize),
    })


__all__ = ["UNREGISTERED", "Call", "Identity", "abort_refused", "handlers", "lenient",
           "refuse_malformed"]

"""How the edge's messages travel: ``EdgeTransport`` is what the edge's ``Session`` (the
round logic: requests, keys, the downlink cache and cap, signing) asks of a transport,
and ``GrpcTransport`` is the one there is. A transport owns the channel, the calls'
deadlines (from the server's ``DownloadTerms``), a task's windows (continuation calls
from the byte the edge holds, a broken window asked for again from there), the chunking
of an upload, and the byte accounting of every message.

Bytes are counted as the server counts them, so the two sides' ``kind="meta"`` series
agree per edge (docs/operations.md, "What each side counts"): every message of every call,
presence included, under the edge's own id; a request only once the server answered (a
reply, or a status of its own: a call that found no server, ``UNAVAILABLE``, carried
nothing the server could count), a reply or stream message when it arrives.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import grpc

from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire import fedattn_pb2_grpc as pb_grpc
from fedattn_shared.wire.accounting import (
    DOWN,
    GRPC_FRAME_PREFIX,
    META,
    NO_CODEC,
    UP,
    ByteMeter,
    count_coded,
    data_message_wire_bytes,
)
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.serialize import EncodedPayload
from fedattn_shared.wire.transport import (
    DownloadTerms,
    PayloadAssembler,
    channel_options,
    data_frames_from,
    deserializer,
    serialize,
)

from .options import EdgeOptions

log = logging.getLogger("fl_edge")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}
JOIN_REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
# A continuation window that broke this way is asked for again from the byte the edge holds.
RESUMABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
WINDOW_RETRIES = 3
UPLOAD_SECONDS = 600
OFFSET_WAIT = 10.0  # seconds an UploadOffset after a broken upload waits for the channel

#: Receivers for the downlinks a task header declares (the session's cap and cache).
Receivers = Callable[[pb.TaskHeader], list[PayloadAssembler]]


class Rejoin(Exception):
    """The server no longer knows this session (it restarted): join again at once."""


class UploadCut(Exception):
    """An upload's stream broke (``error``: the transport's own): the server may hold
    what arrived, for the edge to resume (``EdgeTransport.upload_offset``)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class JoinRefused(Exception):
    """The server refused a join by name (``code``: its status name)."""

    def __init__(self, code: str, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class EdgeTransport(Protocol):
    """What the edge's session asks of a transport (errors other than ``Rejoin`` and
    ``JoinRefused`` are the transport's own, retried by the daemon)."""

    def connect(self) -> contextmanager:
        """One connection for one stretch of reachability, closed on the way out."""

    def join(self, request: pb.JoinRequest) -> pb.JoinReply:
        """A join's reply (its terms apply to this transport's later calls)."""

    def presence(self, request: pb.PresenceRequest,
                 on_event: Callable[[pb.PresenceEvent | None], None]) -> contextmanager:
        """Holds the presence stream while the body runs; ``on_event`` hears each event
        and None once the stream ended."""

    def leave(self, request: pb.LeaveRequest) -> None:
        """Says the edge is gone (best effort)."""

    def download(self, request: pb.TaskRequest, receivers: Receivers
                 ) -> tuple[pb.TaskHeader, list[PayloadAssembler]]:
        """A task, whole: its header and its downlinks received into ``receivers``; or
        the header the server answered instead (WAIT, DONE, or a task no longer the
        edge's) with no receivers."""

    def upload(self, header: pb.SubmitMessage, encoded: EncodedPayload,
               coded: dict[str, tuple[str, int]], offset: int = 0) -> pb.SubmitReply:
        """Sends a result (its header, then its body from data byte ``offset``, a chunk
        boundary) and returns the server's answer; ``coded``: kind label -> (codec label,
        decoded bytes) of sections sent coded. ``UploadCut`` when the stream broke."""

    def upload_offset(self, request: pb.UploadOffsetRequest) -> pb.UploadOffsetReply | None:
        """Where the server stands on a cut upload of a task (None: it cannot resume
        uploads)."""


class GrpcTransport:
    """The edge's gRPC transport (see the module docstring)."""

    def __init__(self, opts: EdgeOptions, credentials, meter: ByteMeter, edge_id: str):
        self.opts, self.credentials, self.meter, self.edge_id = opts, credentials, meter, edge_id
        self.stub = None
        self.chunk_bytes = 1 << 20
        self.terms = DownloadTerms()
        # A task download a broken connection interrupted: (header, receivers, the cached
        # common id it was asked with). The next ``download`` continues it from the bytes
        # held, in whatever session, while the server still has the task for this edge.
        self.partial: tuple[pb.TaskHeader, list[PayloadAssembler], str] | None = None

    # ---- byte accounting ------------------------------------------------------------------
    def _count(self, direction: str, message, kind: str = META) -> None:
        """One protobuf message, under this edge's id (the server's label for it)."""
        self.meter.count_message(direction, message, edge=self.edge_id, kind=kind)

    def _count_sent(self, request, err: grpc.RpcError | None = None) -> None:
        """A request the server received: answered, or failed with a status other than
        ``UNAVAILABLE`` (no server reached: a retry against a server that is down must not
        count bytes that never left, as the server never counts them)."""
        if err is None or err.code() != grpc.StatusCode.UNAVAILABLE:
            self._count(UP, request)

    # ---- the channel ----------------------------------------------------------------------
    @contextmanager
    def connect(self) -> Iterator[None]:
        """One channel, closed on the way out (whatever ends the stretch)."""
        if self.credentials is not None:
            override = ([("grpc.ssl_target_name_override", self.opts.tls_server_name)]
                        if self.opts.tls_server_name else [])
            channel = grpc.secure_channel(self.opts.server, self.credentials,
                                          options=channel_options() + override)
        else:
            channel = grpc.insecure_channel(self.opts.server, options=channel_options())
        with channel:
            stub = pb_grpc.FederatedLearningStub(channel)
            # Data chunks travel as pre-built frames and arrive as views (transport.py).
            stub.NextTask = channel.unary_stream(
                "/fedattn.v1.FederatedLearning/NextTask", request_serializer=serialize,
                response_deserializer=deserializer(pb.TaskMessage))
            stub.Submit = channel.stream_unary(
                "/fedattn.v1.FederatedLearning/Submit", request_serializer=serialize,
                response_deserializer=pb.SubmitReply.FromString)
            self.stub = stub
            try:
                yield
            finally:
                self.stub = None

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise Rejoin() from None
            raise

    # ---- join / presence / leave ----------------------------------------------------------
    def join(self, request: pb.JoinRequest) -> pb.JoinReply:
        """A join, its refusal by name as ``JoinRefused``; the reply's terms (chunk size,
        the download deadlines) apply from here on."""
        try:
            reply = self.stub.Join(request, timeout=30)
        except grpc.RpcError as err:
            self._count_sent(request, err)
            if err.code() in JOIN_REFUSED:
                raise JoinRefused(err.code().name, err.details() or "") from None
            raise
        self._count_sent(request)
        self._count(DOWN, reply)
        self.chunk_bytes = reply.chunk_bytes or self.chunk_bytes
        self.terms = DownloadTerms.of(reply)
        return reply

    @contextmanager
    def presence(self, request: pb.PresenceRequest,
                 on_event: Callable[[pb.PresenceEvent | None], None]) -> Iterator[None]:
        """The presence stream, read on a thread while the body runs."""
        stop = threading.Event()
        call = self.stub.Presence(request)

        def hold() -> None:
            sent = False
            try:
                for event in call:
                    if not sent:  # the server counts the request as the stream opens
                        self._count_sent(request)
                        sent = True
                    self._count(DOWN, event)
                    on_event(event)
                    if stop.is_set():
                        break
            except grpc.RpcError as err:
                if not sent:
                    self._count_sent(request, err)
                # else: the main loop notices a lost server on its own calls
            finally:
                on_event(None)

        thread = threading.Thread(target=hold, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            # Cancelled and its thread joined before the channel closes: a stream still
            # running through the channel's close can abort the process at exit.
            call.cancel()
            thread.join(timeout=10)

    def leave(self, request: pb.LeaveRequest) -> None:
        """Best effort: the server may be gone too."""
        try:
            reply = self.stub.Leave(request, timeout=10)
        except grpc.RpcError as err:
            self._count_sent(request, err)
            return
        self._count_sent(request)
        self._count(DOWN, reply)

    # ---- downloads ------------------------------------------------------------------------
    def download(self, request: pb.TaskRequest, receivers: Receivers
                 ) -> tuple[pb.TaskHeader, list[PayloadAssembler]]:
        """The first call brings the header and the first window, each continuation call
        the next from the byte the edge holds (a broken window is asked for again from
        there, up to ``WINDOW_RETRIES`` times; one the connection's end interrupted goes
        on from there at the next call, after the reconnect). Every call carries the
        deadline the server's terms allow for it."""
        resumed = self._resume(request)
        if resumed is not None:
            return resumed
        header, assemblers = self._first_window(request, receivers)
        if header.status != pb.TaskHeader.TASK:
            return header, []
        return self._rest(request, header, assemblers)

    def _resume(self, request: pb.TaskRequest
                ) -> tuple[pb.TaskHeader, list[PayloadAssembler]] | None:
        """The interrupted download, whole, when the server still has its task for this
        edge; None (ask afresh) otherwise."""
        if self.partial is None:
            return None
        header, assemblers, cached = self.partial
        self.partial = None
        if cached != request.cached_common:
            return None
        log.info("task %d download goes on at byte %d of %d after the reconnect",
                 header.task_id, sum(a.received for a in assemblers),
                 sum(len(a.buffer) for a in assemblers))
        header, assemblers = self._rest(request, header, assemblers)
        return (header, assemblers) if assemblers else None

    def _rest(self, request: pb.TaskRequest, header: pb.TaskHeader,
              assemblers: list[PayloadAssembler]
              ) -> tuple[pb.TaskHeader, list[PayloadAssembler]]:
        """The windows after the first, each from the bytes held."""
        retries = 0
        while not all(a.complete for a in assemblers):
            offset = sum(a.received for a in assemblers)
            more = pb.TaskRequest(edge_id=request.edge_id, session=request.session,
                                  cached_common=request.cached_common, no_wait=True,
                                  task_id=header.task_id, offset=offset)
            try:
                gone = self._window(more, assemblers)
            except grpc.RpcError as err:
                if err.code() not in RESUMABLE or retries >= WINDOW_RETRIES:
                    if err.code() in RETRYABLE:  # the daemon reconnects: go on from here
                        self.partial = (header, assemblers, request.cached_common)
                    raise
                retries += 1
                log.info("task %d download broke at byte %d (%s): asking again from there",
                         header.task_id, offset, err.code().name)
                continue
            if gone is not None:  # the task is no longer this edge's: ask afresh
                return gone, []
            if sum(a.received for a in assemblers) == offset:
                raise WireError(f"the server sent nothing of task {header.task_id} from "
                                f"byte {offset}")
        return header, assemblers

    def _first_window(self, request: pb.TaskRequest, receivers: Receivers
                      ) -> tuple[pb.TaskHeader, list[PayloadAssembler]]:
        """The first call of a download: the header and the first window."""
        stream = self._call(self.stub.NextTask, request,
                            timeout=self.terms.deadline(request.no_wait))
        header = None
        assemblers: list[PayloadAssembler] = []
        try:
            for message in stream:
                if not isinstance(message, memoryview):
                    if header is None:  # the server counted the request before answering
                        self._count_sent(request)
                    header = message.header
                    self._count(DOWN, message)
                    if header.status != pb.TaskHeader.TASK:
                        break
                    assemblers = receivers(header)
                    continue
                if header is None:
                    raise WireError("data before the task header")
                self._take(message, assemblers)
        except grpc.RpcError as err:
            if header is None:
                self._count_sent(request, err)
            elif header.status == pb.TaskHeader.TASK and err.code() in RETRYABLE:
                self.partial = (header, assemblers, request.cached_common)
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise Rejoin() from None
            raise
        if header is None:
            raise WireError("task stream ended without a header")
        return header, assemblers

    def _window(self, request: pb.TaskRequest, assemblers: list[PayloadAssembler]
                ) -> pb.TaskHeader | None:
        """A continuation call: its chunks into ``assemblers``; the header the server
        answers instead when the task is gone (None otherwise)."""
        stream = self._call(self.stub.NextTask, request, timeout=self.terms.deadline(True))
        first = True
        try:
            for message in stream:
                if first:
                    self._count_sent(request)
                    first = False
                if not isinstance(message, memoryview):
                    self._count(DOWN, message)
                    return message.header
                self._take(message, assemblers)
        except grpc.RpcError as err:
            if first:
                self._count_sent(request, err)
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise Rejoin() from None
            raise
        if first:
            self._count_sent(request)
        return None

    def _take(self, chunk: memoryview, assemblers: list[PayloadAssembler]) -> None:
        target = next((a for a in assemblers if not a.complete), None)
        if target is None:
            raise WireError("data past the payload")
        kind = target.add(chunk)
        self.meter.count(DOWN, kind.label, data_message_wire_bytes(len(chunk)), len(chunk),
                         self.edge_id)

    # ---- uploads --------------------------------------------------------------------------
    def upload(self, header: pb.SubmitMessage, encoded: EncodedPayload,
               coded: dict[str, tuple[str, int]], offset: int = 0) -> pb.SubmitReply:
        """The header, then the body from data byte ``offset`` in pre-built frames of the
        server's chunk size; a coded kind's chunks counted with their wire bytes, its
        decoded bytes once at the end. A stream that broke is an ``UploadCut``."""

        def messages():
            self._count(UP, header)
            yield header
            for kind, frame, size in data_frames_from(encoded, self.chunk_bytes, offset):
                codec = coded.get(kind.label)
                self.meter.count(UP, kind.label, len(frame) + GRPC_FRAME_PREFIX,
                                 0 if codec else size, self.edge_id,
                                 codec=codec[0] if codec else NO_CODEC)
                yield frame
            count_coded(self.meter, UP, coded, self.edge_id)

        try:
            reply = self._call(self.stub.Submit, messages(), timeout=UPLOAD_SECONDS)
        except grpc.RpcError as err:
            if err.code() in RETRYABLE:
                raise UploadCut(err) from None
            raise
        self._count(DOWN, reply)
        return reply

    def upload_offset(self, request: pb.UploadOffsetRequest) -> pb.UploadOffsetReply | None:
        """UploadOffset, once the channel is back (it waits ``OFFSET_WAIT`` seconds for
        the connection a cut broke to come back; a server away longer is the daemon's
        retry loop's, which resumes the pending upload after its next join); None from a
        server without it."""
        try:
            reply = self._call(self.stub.UploadOffset, request, wait_for_ready=True,
                               timeout=OFFSET_WAIT)
        except grpc.RpcError as err:
            self._count_sent(request, err)
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise
        self._count_sent(request)
        self._count(DOWN, reply)
        return reply


__all__ = ["RETRYABLE", "EdgeTransport", "GrpcTransport", "JoinRefused", "Receivers", "Rejoin",
           "UploadCut"]

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

The device's own caps (``fl_edge.caps``: ``--max-rate``, the data budget) hear of every
message counted, with the same bytes: a chunk to send waits for the rate before it
leaves, one received before the next is read.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
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
    message_wire_bytes,
)
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.serialize import EncodedPayload
from fedattn_shared.wire.transport import (
    DownloadTerms,
    PayloadAssembler,
    UploadTerms,
    channel_options,
    data_frames_from,
    deserializer,
    serialize,
)

from .caps import LinkCaps
from .downspool import DownloadSpool
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
#: Seconds an upload's deadline allows beyond its body's own time at the server's terms
#: (``UploadTerms``): the server's wait for an upload slot (until its phase closes at the
#: latest) and its checks after the body.
UPLOAD_WAIT = 600.0
#: Seconds between presence events before a join says otherwise (the server's default).
PRESENCE_INTERVAL = 10.0
#: A presence stream silent for this many of the server's intervals has stalled (a proxy or
#: NAT dropped it without a word): it is cancelled and opened again.
PRESENCE_STALL_INTERVALS = 3
#: A presence stream that ended within this many seconds of opening is opened again after a
#: pause that doubles from 0.5 s up to ``PRESENCE_MAX_PAUSE`` (at most one stream a second);
#: one that lived longer, at once.
PRESENCE_QUICK_END = 1.0
PRESENCE_MAX_PAUSE = 4.0

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
        and None once the stream ended for good (one that its lifetime, a proxy or a
        stall ended is opened again)."""

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


def presence_interval_of(reply: pb.JoinReply) -> float:
    """The server's presence interval, held to [0.1 s, 1 h] (a hostile or broken server's
    0, negative or NaN would spin the watchdog; none given: the default)."""
    value = reply.presence_interval
    if not math.isfinite(value) or value <= 0:
        return PRESENCE_INTERVAL
    return min(max(value, 0.1), 3600.0)


def _transfer(method):
    """A download or upload, counted in ``transfers`` while it runs: on a slow link its
    bytes queue ahead of the presence stream's events (one connection), so the stream's
    silence then says nothing of its health (``PresenceHolder``)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        self.transfers += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            self.transfers -= 1

    return run


class GrpcTransport:
    """The edge's gRPC transport (see the module docstring)."""

    def __init__(self, opts: EdgeOptions, credentials, meter: ByteMeter, edge_id: str,
                 caps: LinkCaps | None = None):
        self.opts, self.credentials, self.meter, self.edge_id = opts, credentials, meter, edge_id
        self.caps = caps
        self.stub = None
        self.chunk_bytes = 1 << 20
        self.terms = DownloadTerms()
        self.upload_terms = UploadTerms()
        self.presence_interval = PRESENCE_INTERVAL  # the server's, once joined
        self.transfers = 0  # downloads and uploads running (``_transfer``)
        # A task download a broken connection interrupted: (header, receivers, the cached
        # common id it was asked with). The next ``download`` continues it from the bytes
        # held, in whatever session, while the server still has the task for this edge.
        self.partial: tuple[pb.TaskHeader, list[PayloadAssembler], str] | None = None
        # The same kept on disk as it arrives, for a restarted process (a download that
        # spans more than one window: ``fl_edge.downspool``).
        self.spool = DownloadSpool(opts.state_dir)

    # ---- byte accounting ------------------------------------------------------------------
    def _count(self, direction: str, message, kind: str = META) -> None:
        """One protobuf message, under this edge's id (the server's label for it)."""
        self.meter.count_message(direction, message, edge=self.edge_id, kind=kind)
        if self.caps is not None:
            self.caps.moved(direction, message_wire_bytes(message))

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
        self.upload_terms = UploadTerms.of(reply)
        self.presence_interval = presence_interval_of(reply)
        return reply

    @contextmanager
    def presence(self, request: pb.PresenceRequest,
                 on_event: Callable[[pb.PresenceEvent | None], None]) -> Iterator[None]:
        """The presence stream, read on a thread while the body runs (``PresenceHolder``:
        reopened at once when the server's lifetime or a proxy ends it)."""
        holder = PresenceHolder(self, request, on_event)
        thread = threading.Thread(target=holder.hold, daemon=True)
        thread.start()
        try:
            yield
        finally:
            # Cancelled and its thread joined before the channel closes: a stream still
            # running through the channel's close can abort the process at exit.
            holder.close()
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
    @_transfer
    def download(self, request: pb.TaskRequest, receivers: Receivers
                 ) -> tuple[pb.TaskHeader, list[PayloadAssembler]]:
        """The first call brings the header and the first window, each continuation call
        the next from the byte the edge holds (a broken window is asked for again from
        there, up to ``WINDOW_RETRIES`` times; one the connection's end interrupted goes
        on from there at the next call, after the reconnect). Every call carries the
        deadline the server's terms allow for it."""
        resumed = self._resume(request, receivers)
        if resumed is not None:
            return resumed
        header, assemblers = self._first_window(request, receivers)
        if header.status != pb.TaskHeader.TASK:
            return header, []
        header, assemblers = self._rest(request, header, assemblers)
        self.spool.forget()  # whole, or the task is gone
        return header, assemblers

    def _resume(self, request: pb.TaskRequest, receivers: Receivers
                ) -> tuple[pb.TaskHeader, list[PayloadAssembler]] | None:
        """The interrupted download (this process's, or what an earlier process of the
        edge kept on disk), whole, when the server still has its task for this edge;
        None (ask afresh) otherwise."""
        after = "after the reconnect"
        if self.partial is None:
            self.partial = self.spool.load(receivers)
            after = "from what an earlier run of this edge kept on disk"
        if self.partial is None:
            return None
        header, assemblers, cached = self.partial
        self.partial = None
        if cached != request.cached_common:
            self.spool.forget()
            return None
        log.info("task %d download goes on at byte %d of %d %s", header.task_id,
                 sum(a.received for a in assemblers), sum(len(a.buffer) for a in assemblers),
                 after)
        header, assemblers = self._rest(request, header, assemblers)
        self.spool.forget()
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
                    self.spool.begin(header, request.cached_common, self.terms.window)
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
        self.spool.took(chunk)
        wire = data_message_wire_bytes(len(chunk))
        self.meter.count(DOWN, kind.label, wire, len(chunk), self.edge_id)
        if self.caps is not None:
            self.caps.moved(DOWN, wire)

    # ---- uploads --------------------------------------------------------------------------
    @_transfer
    def upload(self, header: pb.SubmitMessage, encoded: EncodedPayload,
               coded: dict[str, tuple[str, int]], offset: int = 0) -> pb.SubmitReply:
        """The header, then the body from data byte ``offset`` in pre-built frames of the
        server's chunk size; a coded kind's chunks counted with their wire bytes, its
        decoded bytes once at the end. A stream that broke is an ``UploadCut``. The call's
        deadline is sized from the bytes it sends at the server's terms, plus
        ``UPLOAD_WAIT``: a link that moves at the rate the server accepts finishes (a
        fixed 600 s cut ResNet-18's 45 MB below 600 kbit/s), one that does not is cut
        by the server first, and resumed."""

        def messages():
            self._count(UP, header)
            yield header
            for kind, frame, size in data_frames_from(encoded, self.chunk_bytes, offset):
                codec = coded.get(kind.label)
                self.meter.count(UP, kind.label, len(frame) + GRPC_FRAME_PREFIX,
                                 0 if codec else size, self.edge_id,
                                 codec=codec[0] if codec else NO_CODEC)
                if self.caps is not None:
                    self.caps.moved(UP, len(frame) + GRPC_FRAME_PREFIX)
                yield frame
            count_coded(self.meter, UP, coded, self.edge_id)

        try:
            body = encoded.manifest.total_bytes - offset
            reply = self._call(self.stub.Submit, messages(),
                               timeout=UPLOAD_WAIT + self.upload_terms.chunk_seconds(body))
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


class PresenceHolder:
    """Holds one session's presence stream for as long as the daemon wants it, across the
    ends that are no one's failure: the server ends it when its lifetime is over (status
    OK), an L7 proxy cuts it (nginx answers RST_STREAM: INTERNAL, or a 502/504:
    UNAVAILABLE), or it falls silent (a NAT forgot the flow, a proxy stopped relaying):
    no event for ``PRESENCE_STALL_INTERVALS`` of the server's intervals while no transfer
    runs on the connection, and it is cancelled. Each is opened again at once, logged as
    what it is (not a failure); the server keeps the edge present meanwhile
    (``presence_grace``). ``on_event(None)`` is
    said once, when the stream is over for good: the session is gone (UNAUTHENTICATED,
    a refusal), or a new stream got no event at all (the server is unreachable: the
    daemon's next call finds that out and reconnects with its backoff, rather than this
    thread retrying on its own)."""

    def __init__(self, transport: GrpcTransport, request: pb.PresenceRequest,
                 on_event: Callable[[pb.PresenceEvent | None], None]):
        self.transport, self.request, self.on_event = transport, request, on_event
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.call = None
        self.heard = 0.0  # monotonic time of the last event (or of the stream's opening)
        self.reopened = 0  # streams opened again (for the log and tests)

    def close(self) -> None:
        """Ends the stream for good (the session ends): no reopening after this."""
        self.stop.set()
        with self.lock:
            if self.call is not None:
                self.call.cancel()

    def _watch(self) -> None:
        """Cancels the current stream once it has been silent too long (its reader then
        opens a new one)."""
        while not self.stop.wait(self.transport.presence_interval):
            limit = PRESENCE_STALL_INTERVALS * self.transport.presence_interval
            if self.transport.transfers:
                # A transfer's bytes go first on a slow link (measured: a 32 kbit/s link's
                # model download held the events back 40 s): silence counts from its end.
                self.heard = time.monotonic()
                continue
            with self.lock:
                if self.call is not None and time.monotonic() - self.heard > limit:
                    log.info("presence stream silent for %.0fs: opening it again", limit)
                    self.call.cancel()

    def hold(self) -> None:
        """Holds a presence stream open until ``close``: one that ends (the server's
        lifetime, a proxy's cut, the watchdog's cancel after silence) is opened again
        without a rejoin, so the server's grace keeps the edge's task."""
        watchdog = threading.Thread(target=self._watch, daemon=True)
        watchdog.start()
        try:
            pause = 0.0
            while not self.stop.is_set():
                opened = time.monotonic()
                why = self._one_stream()
                if why is None or self.stop.is_set():
                    return
                self.reopened += 1
                # A stream cut as soon as it opens (a proxy's tiny maximum age) is opened
                # again at a growing pace, never in a tight loop; one that lived goes at once
                # (a proxy's idle cut, its lifetime): the server's grace is short.
                lived = time.monotonic() - opened >= PRESENCE_QUICK_END
                pause = 0.0 if lived else min(max(2 * pause, 0.5), PRESENCE_MAX_PAUSE)
                log.info("presence stream ended (%s): opening it again%s", why,
                         f" in {pause:.1f}s" if pause else "")
                if pause and self.stop.wait(pause):
                    return
        finally:
            self.on_event(None)

    def _one_stream(self) -> str | None:
        """One stream, read to its end: why it ended when it is to be opened again, None
        when it is over for good."""
        transport, request = self.transport, self.request
        with self.lock:
            if self.stop.is_set():
                return None
            call = self.call = transport.stub.Presence(request)
            self.heard = time.monotonic()
        events = 0
        try:
            for event in call:
                if not events:  # the server counts the request as the stream opens
                    transport._count_sent(request)
                events += 1
                self.heard = time.monotonic()
                transport._count(DOWN, event)
                self.on_event(event)
                if self.stop.is_set():
                    return None
        except grpc.RpcError as err:
            if not events:
                transport._count_sent(request, err)
            code = err.code()
            if self.stop.is_set() or code not in RETRYABLE:
                return None  # UNAUTHENTICATED: the daemon's next call rejoins
            if not events and code != grpc.StatusCode.CANCELLED:
                return None  # no server behind: the daemon's calls find out and back off
            return f"{code.name}: {(err.details() or '')[:80]}"
        finally:
            with self.lock:
                self.call = None
        if not events:
            transport._count_sent(request)
        return "the server ended it: its lifetime, or the server stops"


__all__ = ["RETRYABLE", "EdgeTransport", "GrpcTransport", "JoinRefused", "PresenceHolder",
           "Receivers", "Rejoin", "UploadCut", "presence_interval_of"]

"""The edge's side of the wire: one ``Session`` holds the gRPC channel, the session id and
upload key agreed at join, the chunk size, the cached common downlink and the downlink
cap, and makes the five calls (join, presence, next task, submit, leave).

Apart from the daemon so that what travels (and how many bytes it costs, ``ByteMeter``)
is one readable unit, and the task runner and middleware never see a stub. The Session
outlives reconnects (the cache and chunk size carry over; a rejoin replaces the session id
and key); ``connect`` opens one channel for one stretch of reachability.

Bytes are counted as the server counts them, so the two sides' ``kind="meta"`` series
agree per edge (docs/operations.md, "What each side counts"): every message of every call,
presence included, under the edge's own id; a request only once the server answered (a
reply, or a status of its own: a call that found no server, ``UNAVAILABLE``, carried
nothing the server could count), a reply or stream message when it arrives.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.schema import Payload
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
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.signing import (
    BodyMac,
    exchange,
    new_key_share,
    sign_submission,
    upload_mac_key,
)
from fedattn_shared.wire.transport import (
    MAX_MESSAGE_BYTES,
    BufferPool,
    DownloadTerms,
    PayloadAssembler,
    channel_options,
    data_frames,
    deserializer,
    serialize,
)

from .metrics import EdgeMetrics
from .options import EdgeExit, EdgeOptions
from .store import Identity

log = logging.getLogger("fl_edge")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}
JOIN_REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)

# The downlink cap before the run's models are known: a bound for any model fedattn ships.
# A continuation window that broke this way is asked for again from the byte the edge holds.
RESUMABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
WINDOW_RETRIES = 3
DOWNLINK_CAP_BEFORE_SETUP = 1 << 30
BEFORE_SETUP = "the bound before the run's models are known"


class Rejoin(Exception):
    """The server no longer knows this session (it restarted): join again at once."""


@dataclass
class Received:
    """One task as it arrived: the header and the two downlinks (views of the receive
    buffers; nothing writes to them)."""

    header: pb.TaskHeader
    common: Payload
    personal: Payload


class Session:
    """The edge's connection to its server, across reconnects (see the module doc).
    ``keep_common(manifest, buffer)`` is told of every newly received common downlink
    (the daemon writes it behind, for export)."""

    def __init__(self, opts: EdgeOptions, credentials, device: torch.device, identity: Identity,
                 signing_key: Ed25519PrivateKey, meter: ByteMeter, metrics: EdgeMetrics,
                 keep_common: Callable[[pb.PayloadManifest, bytearray], None]):
        self.opts = opts
        self.credentials = credentials
        self.device = device
        self.identity = identity
        self.signing_key = signing_key
        self.meter = meter
        self.metrics = metrics
        self.keep_common = keep_common
        self.stub = None
        self.session = ""
        self.upload_mac_key = b""  # agreed with the server at join, for this session only
        self.chunk_bytes = 1 << 20
        self.downlink_cap = DOWNLINK_CAP_BEFORE_SETUP
        self.downlink_why = BEFORE_SETUP
        self.cached_common: tuple[str, Payload, bytearray] | None = None
        self.buffers = BufferPool(keep=1)
        # The server sends task_ready hints on the presence stream (JoinReply.task_hints):
        # the daemon then asks NextTask without waiting and, idle, waits for task_ready.
        self.task_hints = False
        self.task_ready = threading.Event()
        self.download_terms = DownloadTerms()

    # ---- byte accounting ------------------------------------------------------------------
    def _count(self, direction: str, message, kind: str = META) -> None:
        """One protobuf message, under this edge's id (the server's label for it)."""
        self.meter.count_message(direction, message, edge=self.identity.edge_id, kind=kind)

    def _count_sent(self, request, err: grpc.RpcError | None = None) -> None:
        """A request the server received: answered, or failed with a status other than
        ``UNAVAILABLE`` (no server reached: a retry against a server that is down must not
        count bytes that never left, as the server never counts them)."""
        if err is None or err.code() != grpc.StatusCode.UNAVAILABLE:
            self._count(UP, request)

    def limit_downlinks(self, cap: int, why: str) -> None:
        """The run's cap replaces the bound before setup; the cache belongs to the old run."""
        self.downlink_cap, self.downlink_why = cap, why
        self.cached_common = None

    # ---- the channel ----------------------------------------------------------------------
    @contextmanager
    def connect(self) -> Iterator[Session]:
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
                yield self
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
    def _stale_state_hint(self, err: grpc.RpcError, state_fingerprint: str) -> str:
        """The folder and the fix when the server refused the private state this edge
        holds (made for another model or method): only the edge knows where it lives."""
        if (state_fingerprint and err.code() == grpc.StatusCode.FAILED_PRECONDITION
                and "fingerprint" in (err.details() or "")):
            return (f". The private state in --state-dir {self.opts.state_dir} belongs to "
                    "another run: start this edge with a fresh --state-dir (or move that "
                    "folder away)")
        return ""

    def join(self, state_fingerprint: str, num_examples: int | None) -> pb.JoinReply:
        """A new session: the edge's identity and keys, what it holds of the private state
        and (once known) its training split's size, which the server caps its aggregation
        weight at. Agrees the upload MAC key; a refusal ends the edge (status 2)."""
        key_private, key_share, key_proof = new_key_share(self.signing_key,
                                                          self.identity.edge_id)
        info = {"hostname": socket.gethostname(), "device": str(self.device),
                "torch": torch.__version__}
        if num_examples is not None:
            info["num_examples"] = str(num_examples)
        request = pb.JoinRequest(
            protocol_version=PROTOCOL_VERSION, edge_id=self.identity.edge_id,
            edge_secret=self.identity.secret, join_token=self.opts.join_token,
            info=info,
            state_fingerprint=state_fingerprint,
            signing_key=self.signing_key.public_key().public_bytes_raw(),
            upload_key_share=key_share, upload_key_proof=key_proof,
        )
        try:
            reply = self.stub.Join(request, timeout=30)
        except grpc.RpcError as err:
            self._count_sent(request, err)
            if err.code() in JOIN_REFUSED:
                raise EdgeExit(2, f"join refused by {self.opts.server}: {err.details()}"
                                  f"{self._stale_state_hint(err, state_fingerprint)}") from None
            raise
        self._count_sent(request)
        self._count(DOWN, reply)
        try:
            self.upload_mac_key = upload_mac_key(exchange(key_private, reply.upload_key_share),
                                                 self.identity.edge_id, reply.session)
        except ValueError:
            raise EdgeExit(2, f"{self.opts.server} sent no valid upload key share "
                              "(fedattn versions differ?)") from None
        self.session = reply.session
        self.chunk_bytes = reply.chunk_bytes or self.chunk_bytes
        self.task_hints = reply.task_hints
        self.download_terms = DownloadTerms.of(reply)
        return reply

    @contextmanager
    def presence(self) -> Iterator[None]:
        """Holds the presence stream open (the server selects connected edges only and
        drops the task of one whose stream closes) while the body runs; its events set
        ``task_ready`` when the server says a task waits, and so does its end (the
        daemon's next call then finds out what happened to the server)."""
        stop = threading.Event()
        request = pb.PresenceRequest(edge_id=self.identity.edge_id, session=self.session)
        self.task_ready.clear()
        call = self.stub.Presence(request)

        def hold() -> None:
            sent = False
            try:
                for event in call:
                    if not sent:  # the server counts the request as the stream opens
                        self._count_sent(request)
                        sent = True
                    self._count(DOWN, event)
                    if event.task_ready:
                        self.task_ready.set()
                    if stop.is_set():
                        break
            except grpc.RpcError as err:
                if not sent:
                    self._count_sent(request, err)
                # else: the main loop notices a lost server on its own calls
            finally:
                self.task_ready.set()

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

    def leave(self, reason: str) -> None:
        """Tells the server this edge is gone and why (best effort: it may be gone too)."""
        request = pb.LeaveRequest(edge_id=self.identity.edge_id, session=self.session,
                                  reason=reason)
        try:
            reply = self.stub.Leave(request, timeout=10)
        except grpc.RpcError as err:
            self._count_sent(request, err)
            return
        self._count_sent(request)
        self._count(DOWN, reply)

    # ---- tasks ----------------------------------------------------------------------------
    def next_task(self, no_wait: bool = False) -> Received:
        """Long-polls (``no_wait``: asks once) for the next task and receives it,
        streaming, in the server's windows: the first call brings the header and the first
        window, each continuation call the next from the byte the edge holds (a broken
        window is asked for again from there, up to ``WINDOW_RETRIES`` times). Every call
        carries the deadline the server's terms allow for it. Every declared downlink is
        held to the cap before a byte of it is allocated; a common downlink the edge
        already holds is not sent again."""
        cached_id = self.cached_common[0] if self.cached_common else ""
        request = pb.TaskRequest(edge_id=self.identity.edge_id, session=self.session,
                                 cached_common=cached_id, no_wait=no_wait)
        header, assemblers = self._first_window(request)
        if header.status != pb.TaskHeader.TASK:
            return Received(header, Payload(), Payload())
        retries = 0
        while not all(a.complete for a in assemblers):
            offset = sum(a.received for a in assemblers)
            more = pb.TaskRequest(edge_id=self.identity.edge_id, session=self.session,
                                  cached_common=cached_id, no_wait=True,
                                  task_id=header.task_id, offset=offset)
            try:
                gone = self._window(more, assemblers)
            except grpc.RpcError as err:
                if err.code() not in RESUMABLE or retries >= WINDOW_RETRIES:
                    raise
                retries += 1
                log.info("task %d download broke at byte %d (%s): asking again from there",
                         header.task_id, offset, err.code().name)
                continue
            if gone is not None:  # the task is no longer this edge's: ask afresh
                return Received(gone, Payload(), Payload())
            if sum(a.received for a in assemblers) == offset:
                raise WireError(f"the server sent nothing of task {header.task_id} from "
                                f"byte {offset}")
        return self._received(header, assemblers)

    def _first_window(self, request: pb.TaskRequest
                      ) -> tuple[pb.TaskHeader, list[PayloadAssembler]]:
        """The first call of a download: the header and the first window."""
        stream = self._call(self.stub.NextTask, request,
                            timeout=self.download_terms.deadline(request.no_wait))
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
                    assemblers = self._assemblers(header)
                    continue
                if header is None:
                    raise WireError("data before the task header")
                self._take(message, assemblers)
        except grpc.RpcError as err:
            if header is None:
                self._count_sent(request, err)
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
        stream = self._call(self.stub.NextTask, request,
                            timeout=self.download_terms.deadline(True))
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
                         self.identity.edge_id)

    def _assemblers(self, header: pb.TaskHeader) -> list[PayloadAssembler]:
        """Receivers for the downlinks a task header declares, each checked against the cap
        first (a hostile header must not make the edge allocate)."""
        cap = self.downlink_cap
        for part, manifest in (("common", header.common), ("personal", header.personal)):
            if part == "common" and header.common_cached:
                continue
            if manifest.total_bytes > cap:  # before a byte is allocated
                raise WireError(
                    f"its round {header.round} {header.phase[:40]!r} task declares a "
                    f"{part} downlink of {manifest.total_bytes} bytes, over this "
                    f"edge's cap of {cap} bytes ({self.downlink_why})")
        assemblers = []
        if not header.common_cached:
            assemblers.append(PayloadAssembler(header.common, cap, MAX_MESSAGE_BYTES,
                                               pool=self.buffers))
        assemblers.append(PayloadAssembler(header.personal, cap, MAX_MESSAGE_BYTES))
        return assemblers

    def _received(self, header: pb.TaskHeader, assemblers: list[PayloadAssembler]) -> Received:
        """The task, its common downlink from the cache or newly cached."""
        if header.common_cached:
            if not self.cached_common or self.cached_common[0] != header.common_id:
                raise WireError("server referred to a cached downlink this edge does not hold")
            return Received(header, self.cached_common[1], assemblers[0].finish())
        common = assemblers[0].finish()
        personal = assemblers[1].finish()
        if self.cached_common is not None:
            # Nothing views the previous global any more (the model copied it, the
            # compression layer holds its own copy, and the next receive replaces the
            # method's references), so its buffer serves the next download instead of a
            # fresh one that page-faults on every 4 KiB.
            self.buffers.give(self.cached_common[2])
        # Cached under the id of what the edge holds once it is applied: the common id
        # (a delta, ``common_base_id``, is applied by the compression layer, which then
        # keeps the whole global it leads to: what arrived is only the change).
        self.cached_common = (header.common_id, common, assemblers[0].buffer)
        if not header.common_base_id:
            self.keep_common(header.common, assemblers[0].buffer)
        return Received(header, common, personal)

    def submit(self, task: pb.TaskHeader, upload: Payload, num_examples: int,
               evaluation: list, metrics: dict[str, float], coded: dict | None = None) -> None:
        """Streams a result up, signed: the header carries the signature over itself and
        the body's MAC (keyed per session), the body goes in pre-built frames. The server's
        answer is counted and logged, never retried (the task is over either way).
        ``coded``: the sections that travel compressed, (Kind, name) -> ``Encoded``
        (counted under their codec, raw bytes as decoded)."""
        by_kind: dict[str, tuple[str, int]] = {}
        for (kind, _), encoded in (coded or {}).items():
            label, raw = by_kind.get(kind.label, (encoded.label, 0))
            by_kind[kind.label] = (label, raw + encoded.raw_bytes)
        encoded = encode(upload, checksum=False)  # the signed body MAC covers the bytes
        header = pb.SubmitMessage(header=pb.SubmitHeader(
            protocol_version=PROTOCOL_VERSION, edge_id=self.identity.edge_id,
            session=self.session, round=task.round, task_id=task.task_id, phase=task.phase,
            num_examples=num_examples, payload=encoded.manifest, evaluation=evaluation,
            metrics=metrics, task_nonce=task.task_nonce, body_mac_iv=BodyMac.new_iv()))
        header.header.signature = sign_submission(
            self.signing_key, header.header,
            encoded.body_mac(self.upload_mac_key, header.header.body_mac_iv))

        def messages():
            self._count(UP, header)
            yield header
            for kind, frame, size in data_frames(encoded, self.chunk_bytes):
                codec = by_kind.get(kind.label)
                self.meter.count(UP, kind.label, len(frame) + GRPC_FRAME_PREFIX,
                                 0 if codec else size, self.identity.edge_id,
                                 codec=codec[0] if codec else NO_CODEC)
                yield frame
            count_coded(self.meter, UP, by_kind, self.identity.edge_id)

        reply = self._call(self.stub.Submit, messages(), timeout=600)
        self._count(DOWN, reply)
        self.metrics.submissions.labels(task.phase, "accepted" if reply.accepted else "refused").inc()
        if reply.accepted:
            self.metrics.last_success_round.set(task.round)
            self.metrics.last_success_time.set_to_current_time()
        elif reply.reason.endswith("bad or expired session"):  # fl_server.edges' words
            log.warning("round %d %s result not taken: the server no longer knows this "
                        "session (it restarted, or ended the session)",
                        task.round, task.phase)
        else:
            log.warning("round %d %s result refused: %s", task.round, task.phase, reply.reason)

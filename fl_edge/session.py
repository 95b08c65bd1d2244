"""The edge's side of the protocol: one ``Session`` holds the session id and upload key
agreed at join, the cached common downlink and the downlink cap, and makes the five calls
(join, presence, next task, submit, leave) through an ``EdgeTransport`` (``transport.py``:
the channel, deadlines, a task's windows, chunking and the byte accounting of every
message; gRPC's is the only one).

Apart from the daemon so that what travels is one readable unit, and the task runner and
middleware never see a stub. The Session outlives reconnects (the cache carries over; a
rejoin replaces the session id and key); ``connect`` opens one connection for one stretch
of reachability.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.schema import Payload
from fedattn_shared.state import StateError
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import ByteMeter
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.serialize import EncodedPayload, encode
from fedattn_shared.wire.signing import (
    BodyMac,
    exchange,
    new_key_share,
    sign_submission,
    upload_mac_key,
)
from fedattn_shared.wire.transport import MAX_MESSAGE_BYTES, BufferPool, PayloadAssembler

from .caps import LinkCaps
from .metrics import EdgeMetrics
from .options import EdgeExit, EdgeOptions
from .pending import PendingUpload, clear_pending, load_pending, pending_path, save_pending
from .store import Identity
from .transport import RETRYABLE, EdgeTransport, GrpcTransport, JoinRefused, Rejoin, UploadCut

log = logging.getLogger("fl_edge")

# The downlink cap before the run's models are known: a bound for any model fedattn ships.
DOWNLINK_CAP_BEFORE_SETUP = 1 << 30
BEFORE_SETUP = "the bound before the run's models are known"
# Times one upload is resumed after its stream broke, each from the bytes the server holds.
UPLOAD_RESUMES = 8


@dataclass
class Received:
    """One task as it arrived: the header and the two downlinks (views of the receive
    buffers; nothing writes to them)."""

    header: pb.TaskHeader
    common: Payload
    personal: Payload


class Session:
    """The edge's session with its server, across reconnects (see the module doc).
    ``keep_common(manifest, buffer)`` is told of every newly received common downlink
    (the daemon writes it behind, for export). ``transport``: how the messages travel
    (default: gRPC to ``opts.server``); ``caps``: the device's rate and data budget, which
    the default transport applies to every message."""

    def __init__(self, opts: EdgeOptions, credentials, device: torch.device, identity: Identity,
                 signing_key: Ed25519PrivateKey, meter: ByteMeter, metrics: EdgeMetrics,
                 keep_common: Callable[[pb.PayloadManifest, bytearray], None],
                 transport: EdgeTransport | None = None, caps: LinkCaps | None = None,
                 critical: Callable[[], AbstractContextManager] = nullcontext):
        self.opts = opts
        self.device = device
        self.identity = identity
        self.signing_key = signing_key
        self.metrics = metrics
        self.keep_common = keep_common
        self.transport = transport or GrpcTransport(opts, credentials, meter, identity.edge_id,
                                                    caps)
        self.critical = critical  # a section a stop signal waits for (the pending write)
        self.session = ""
        self.upload_mac_key = b""  # agreed with the server at join, for this session only
        self.downlink_cap = DOWNLINK_CAP_BEFORE_SETUP
        self.downlink_why = BEFORE_SETUP
        self.cached_common: tuple[str, Payload, bytearray] | None = None
        self.buffers = BufferPool(keep=1)
        # The server sends task_ready hints on the presence stream (JoinReply.task_hints):
        # the daemon then asks NextTask without waiting and, idle, waits for task_ready.
        self.task_hints = False
        self.task_ready = threading.Event()

    def limit_downlinks(self, cap: int, why: str) -> None:
        """The run's cap replaces the bound before setup; the cache belongs to the old run."""
        self.downlink_cap, self.downlink_why = cap, why
        self.cached_common = None

    @contextmanager
    def connect(self) -> Iterator[Session]:
        """One connection, closed on the way out (whatever ends the stretch)."""
        with self.transport.connect():
            yield self

    # ---- join / presence / leave ----------------------------------------------------------
    def _stale_state_hint(self, err: JoinRefused, state_fingerprint: str) -> str:
        """The folder and the fix when the server refused the private state this edge
        holds (made for another model or method): only the edge knows where it lives."""
        if (state_fingerprint and err.code == "FAILED_PRECONDITION"
                and "fingerprint" in err.details):
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
            reply = self.transport.join(request)
        except JoinRefused as err:
            raise EdgeExit(2, f"join refused by {self.opts.server}: {err.details}"
                              f"{self._stale_state_hint(err, state_fingerprint)}") from None
        try:
            self.upload_mac_key = upload_mac_key(exchange(key_private, reply.upload_key_share),
                                                 self.identity.edge_id, reply.session)
        except ValueError:
            raise EdgeExit(2, f"{self.opts.server} sent no valid upload key share "
                              "(fedattn versions differ?)") from None
        self.session = reply.session
        self.task_hints = reply.task_hints
        return reply

    @contextmanager
    def presence(self) -> Iterator[None]:
        """Holds the presence stream open (the server selects connected edges only and
        drops the task of one whose stream closes) while the body runs; its events set
        ``task_ready`` when the server says a task waits, and so does its end (the
        daemon's next call then finds out what happened to the server)."""
        request = pb.PresenceRequest(edge_id=self.identity.edge_id, session=self.session)
        self.task_ready.clear()

        def heard(event: pb.PresenceEvent | None) -> None:
            if event is None or event.task_ready:
                self.task_ready.set()

        with self.transport.presence(request, heard):
            yield

    def leave(self, reason: str) -> None:
        """Tells the server this edge is gone and why (best effort: it may be gone too)."""
        self.transport.leave(pb.LeaveRequest(edge_id=self.identity.edge_id,
                                             session=self.session, reason=reason))

    # ---- tasks ----------------------------------------------------------------------------
    def next_task(self, no_wait: bool = False, decline: int = 0) -> Received:
        """Long-polls (``no_wait``: asks once) for the next task and receives it whole
        (the transport's windows). Every declared downlink is held to the cap before a
        byte of it is allocated; a common downlink the edge already holds is not sent
        again. ``decline`` (a ``pb.Decline``): "not now", the server gives up the task
        that waits and answers WAIT."""
        cached_id = self.cached_common[0] if self.cached_common else ""
        request = pb.TaskRequest(edge_id=self.identity.edge_id, session=self.session,
                                 cached_common=cached_id, no_wait=no_wait, decline=decline)
        header, assemblers = self.transport.download(request, self._assemblers)
        if header.status != pb.TaskHeader.TASK or not assemblers:
            return Received(header, Payload(), Payload())
        return self._received(header, assemblers)

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
               evaluation: list, metrics: dict[str, float], coded: dict | None = None
               ) -> pb.SubmitReply:
        """Streams a result up, signed: the header carries the signature over itself and
        the body's MAC (keyed per session), the body goes in pre-built frames. The server's
        answer is counted, logged and returned, never retried (the task is over either
        way). ``coded``: the sections that travel compressed, (Kind, name) -> ``Encoded``
        (counted under their codec, raw bytes as decoded)."""
        return self.send_result(task, upload, num_examples, evaluation, metrics,
                                coded_labels(coded))

    def send_result(self, task: pb.TaskHeader, upload: Payload, num_examples: int,
                    evaluation: list, metrics: dict[str, float],
                    by_kind: dict[str, tuple[str, int]]) -> pb.SubmitReply:
        """``submit`` with the coded sections as kind label -> (codec label, decoded
        bytes): the result is kept on disk before it leaves (``resume_pending``)."""
        encoded = encode(upload, checksum=False)  # the signed body MAC covers the bytes
        result = pb.SubmitHeader(
            protocol_version=PROTOCOL_VERSION, edge_id=self.identity.edge_id,
            round=task.round, task_id=task.task_id, phase=task.phase,
            num_examples=num_examples, payload=encoded.manifest, evaluation=evaluation,
            metrics=metrics, task_nonce=task.task_nonce)
        self._keep(PendingUpload(result, encoded, by_kind))
        reply = self.send(result, encoded, by_kind)
        self._answered(result, reply)
        return reply

    def _keep(self, pending: PendingUpload) -> None:
        """Writes the upload to the state dir before it leaves, so that a restarted
        process resumes it (``resume_pending``); a disk that refuses costs only that."""
        try:
            with self.critical():
                save_pending(pending_path(self.opts.state_dir), pending)
        except OSError as err:
            log.warning("round %d %s: the upload could not be kept on disk (%s): a restart "
                        "before it is accepted loses it", pending.header.round,
                        pending.header.phase, err)

    def resume_pending(self, asynchronous: bool = False) -> pb.SubmitHeader | None:
        """After a join: the upload a previous connection or process of this edge left
        unanswered (``pending.py``: it is written before every upload leaves). Sent on from
        the bytes the server holds when it holds them (its task then still stands); else,
        under --mode async, sent whole, signed under this session: a result stays useful
        for ``--max-staleness`` versions and the server takes back a task it dropped for a
        lost link (``Phase.revive``) or refuses it naming why ("too stale: ..."), logged
        here (train now, upload later); else forgotten (a synchronous round did not wait:
        the server hands out what it wants next). Offered once either way. Returns the
        header of the result it sent, if any."""
        path = pending_path(self.opts.state_dir)
        try:
            pending = load_pending(path)
        except StateError as err:
            log.warning("a pending upload that cannot be read is let go: %s", err)
            clear_pending(path)
            return None
        if pending is None:
            return None
        result = pending.header
        held = self.transport.upload_offset(pb.UploadOffsetRequest(
            edge_id=self.identity.edge_id, session=self.session, round=result.round,
            phase=result.phase, task_id=result.task_id))
        if held is not None and held.held:
            log.info("round %d %s: resuming the upload a previous run of this edge left, at "
                     "byte %d of %d", result.round, result.phase, held.offset, held.total_bytes)
            self.metrics.upload_resumes.inc()
            self._answered(result, self.send(result, pending.encoded, pending.coded,
                                             held.offset))
            return result
        if not asynchronous:
            log.info("round %d %s: the server holds nothing of the upload this edge left "
                     "(its task is gone): not sent again", result.round, result.phase)
            clear_pending(path)
            return None
        log.info("round %d %s: sending the result kept when the link went", result.round,
                 result.phase)
        reply = self.send(result, pending.encoded, pending.coded)
        self._answered(result, reply)
        if reply.accepted:
            log.info("round %d %s: the kept result was accepted", result.round, result.phase)
        else:
            log.warning("round %d %s: the kept result was dropped by the server: %s",
                        result.round, result.phase, reply.reason)
        return result

    def _answered(self, result: pb.SubmitHeader, reply: pb.SubmitReply) -> None:
        """The server's answer to a result: counted and logged, the pending copy gone."""
        clear_pending(pending_path(self.opts.state_dir))
        self.metrics.submissions.labels(result.phase,
                                        "accepted" if reply.accepted else "refused").inc()
        if reply.accepted:
            self.metrics.last_success_round.set(result.round)
            self.metrics.last_success_time.set_to_current_time()
        elif reply.reason.endswith("bad or expired session"):  # fl_server.edges' words
            log.warning("round %d %s result not taken: the server no longer knows this "
                        "session (it restarted, or ended the session)",
                        result.round, result.phase)
        else:
            log.warning("round %d %s result refused: %s", result.round, result.phase,
                        reply.reason)

    def _signed(self, result: pb.SubmitHeader, encoded: EncodedPayload, offset: int
                ) -> pb.SubmitMessage:
        """``result``'s header for this session, sending from ``offset``: a fresh IV, the
        body MAC over the whole body (whatever part of it travels) and the signature."""
        header = pb.SubmitMessage(header=result)
        header.header.session = self.session
        header.header.resume_offset = offset
        header.header.body_mac_iv = BodyMac.new_iv()
        header.header.signature = sign_submission(
            self.signing_key, header.header,
            encoded.body_mac(self.upload_mac_key, header.header.body_mac_iv))
        return header

    def send(self, result: pb.SubmitHeader, encoded: EncodedPayload,
             coded: dict[str, tuple[str, int]], offset: int = 0) -> pb.SubmitReply:
        """Sends a result from data byte ``offset``; a stream that breaks (or an answer
        that is not an acceptance) is followed by UploadOffset, and an upload the server
        holds goes on from the bytes it holds (at most the chunk in flight at the cut
        travels twice), up to ``UPLOAD_RESUMES`` times. Raises the transport's error when
        the stream broke and nothing is held."""
        for attempt in range(UPLOAD_RESUMES + 1):
            cut: UploadCut | None = None
            try:
                reply = self.transport.upload(self._signed(result, encoded, offset), encoded,
                                              coded, offset)
            except UploadCut as err:
                cut, reply = err, None
            if reply is not None and reply.accepted:
                return reply
            held = self.transport.upload_offset(pb.UploadOffsetRequest(
                edge_id=self.identity.edge_id, session=self.session, round=result.round,
                phase=result.phase, task_id=result.task_id))
            if held is None or not held.held or attempt == UPLOAD_RESUMES:
                if cut is not None:
                    raise cut.error
                return reply
            offset = held.offset
            self.metrics.upload_resumes.inc()
            log.info("round %d %s upload %s at byte %d of %d: resuming from there",
                     result.round, result.phase, "broke" if cut else "was cut", offset,
                     held.total_bytes)
        raise AssertionError("unreachable")


def coded_labels(coded: dict | None) -> dict[str, tuple[str, int]]:
    """(Kind, name) -> ``Encoded`` as kind label -> (codec label, decoded bytes): what
    the byte accounting counts per kind."""
    by_kind: dict[str, tuple[str, int]] = {}
    for (kind, _), encoded in (coded or {}).items():
        label, raw = by_kind.get(kind.label, (encoded.label, 0))
        by_kind[kind.label] = (label, raw + encoded.raw_bytes)
    return by_kind


__all__ = ["DOWNLINK_CAP_BEFORE_SETUP", "RETRYABLE", "Received", "Rejoin", "Session",
           "coded_labels"]

"""The gRPC servicer: a thin adapter from the five calls of ``fedattn.proto`` to what the
server does, free of transport: joins, presence and leaves (``sessions.Sessions``), task
downloads (``downloads.Downloads``) and uploads (``uploads.Uploads``).

Who calls and what each message costs are the call layer's (``calls.py``: each handler
gets a ``calls.Call``, the session checked before Presence, NextTask and Leave, every
protobuf message counted); what the pipelines refuse with a status ends the call with it.
A second transport is another adapter over the same three objects.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.config import ServerConfig
from fedattn_shared.tls import edge_id_refusal
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import ByteMeter

from .calls import Call, Identity, abort_refused, handlers
from .downloads import Downloads
from .engine import Engine
from .phase import Refused
from .sessions import Lapsed, Sessions
from .streams import StreamEnded
from .uploads import Uploads

log = logging.getLogger("fl_server")

MAX_LEAVE_REASON = 200


class FederatedLearningService:
    """The servicer (see the module docstring): each method gets the call's request (or
    stream) and its ``calls.Call``."""

    def __init__(self, engine: Engine, sessions: Sessions, uploads: Uploads,
                 downloads: Downloads, cfg: ServerConfig):
        self.engine, self.sessions, self.cfg = engine, sessions, cfg
        self.uploads, self.downloads = uploads, downloads

    # ---- Join -------------------------------------------------------------------------
    async def Join(self, request: pb.JoinRequest, call: Call) -> pb.JoinReply:
        """Registers an edge and starts its session, or refuses it with the status and
        reason of the first check it fails."""
        edge_id = request.edge_id
        refusal = edge_id_refusal(edge_id)
        if refusal:
            call.received(request)
            log.warning("join refused from %s: %s", call.peer(), refusal)
            await call.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        try:
            record, server_share = self.sessions.join(
                request, lambda token: call.certificate_refusal(edge_id, token))
        except Refused as err:
            call.received(request)
            log.warning("join refused for %r from %s: %s", edge_id, call.peer(), err)
            await abort_refused(call, err)
        call.received(request, edge=edge_id)
        call.edge = edge_id
        terms = self.downloads.terms
        return pb.JoinReply(protocol_version=PROTOCOL_VERSION, session=record.session,
                            config_json=self.engine.config_json,
                            fingerprint=self.engine.fingerprint,
                            chunk_bytes=self.cfg.chunk_bytes, upload_key_share=server_share,
                            task_hints=True, download_idle_timeout=terms.idle_timeout,
                            download_min_rate=terms.min_rate, download_window=terms.window,
                            poll_timeout=terms.poll_timeout,
                            presence_interval=self.cfg.presence_interval,
                            upload_idle_timeout=self.cfg.upload_idle_timeout,
                            upload_min_rate=self.cfg.upload_min_rate)

    # ---- Presence ---------------------------------------------------------------------
    async def Presence(self, request: pb.PresenceRequest, call: Call):
        """Streams keep-alive events while the session lives: while open, the edge counts as
        connected (rounds select it); when it ends, its task is dropped. Each event says
        whether a task waits for the edge (``task_ready``), and one is sent at once when
        that may have changed (``EdgeRecord.wake``): an idle edge then holds this stream
        only, not a NextTask long-poll beside it (each held call costs the server ~22 KB).

        Behind an L7 proxy: an event goes out every ``presence_interval`` seconds whatever
        happens, since a proxy such as nginx cuts a stream that carries no data for its idle
        timeout (HTTP/2 PINGs are the connection's, not the stream's); the stream ends by
        itself (status OK) after ``presence_lifetime`` seconds, under a proxy's maximum
        stream age (off by default; put off while the edge has a transfer open), and the
        edge opens it again at once, present meanwhile (at least an interval). Any other
        end (the edge went, or a proxy cut the stream: the server cannot tell them apart)
        leaves it present for ``presence_grace`` seconds (default 0: absent at once, its
        task dropped; ``sessions.lapse``), so that behind a proxy that cuts streams a
        reopened one keeps its task and the cut costs no round."""
        record = call.record
        # One presence stream per session: a new one replaces the old, which ends now
        # (each held stream costs the server ~23 KB; a session could open thousands).
        Lapsed.replaced(record.presence)  # an ended stream's grace: this one is its end
        stream = record.presence = object()
        stirred = record.stirred
        stirred.set()  # the replaced stream, if any, wakes and sees it is no longer current
        self.sessions.present(record)
        engine, cfg = self.engine, self.cfg
        ends = (time.monotonic() + cfg.presence_lifetime) if cfg.presence_lifetime else None
        grace = cfg.presence_grace
        try:
            while (record.session == request.session and record.presence is stream
                   and not engine.stopping):
                stirred.clear()
                # Asks, never hands out: a task goes only to the edge's own NextTask.
                ready = engine.finished or engine.schedule.has_work(request.edge_id)
                yield pb.PresenceEvent(server_time=time.time(), task_ready=ready)
                wait = cfg.presence_interval
                if ends is not None:
                    wait = min(wait, ends - time.monotonic())
                    if wait <= 0 and self._transferring(request.edge_id):
                        # Not now: on a slow link the new stream's request would wait behind
                        # the transfer's bytes (measured: over 10 s behind a 256 kbit/s upload).
                        wait = cfg.presence_interval
                    elif wait <= 0:
                        # Its lifetime is over: the edge opens a new one at once, and until
                        # then stays present (at least an interval, whatever the grace).
                        grace = max(grace, cfg.presence_interval)
                        return
                # Wakes at once when the session ends or the edge's work may have changed.
                await stirred.wait(wait)
        except asyncio.CancelledError:
            return  # the stream ended (the edge went, a proxy cut it, the server stops)
        finally:
            if record.presence is stream:
                if engine.stopping or record.session != request.session:
                    record.presence = None
                    self.sessions.absent(record, request.session)
                else:
                    self.sessions.lapse(record, request.session, grace)

    def _transferring(self, edge: str) -> bool:
        """The edge has a task call or an upload open."""
        return edge in self.downloads.tasking or edge in self.uploads.receiving

    # ---- NextTask ---------------------------------------------------------------------
    async def NextTask(self, request: pb.TaskRequest, call: Call) -> None:
        """Long-polls for this edge's task and streams a window of it
        (``downloads.Downloads``); a refusal ends the call with its status."""
        try:
            await self.downloads.serve(call.record, request, call)
        except Refused as err:
            await abort_refused(call, err)
        except StreamEnded:
            return  # the call is over: nobody to tell

    # ---- Submit -----------------------------------------------------------------------
    async def Submit(self, request_iterator, call: Call) -> pb.SubmitReply:
        """Receives one upload (``uploads.Uploads``) and answers whether it was taken or,
        by name, why not."""
        outcome = await self.uploads.receive(call)
        if outcome is None:  # the caller vanished before its header
            return pb.SubmitReply(accepted=False, reason="no header")
        accepted, reason = outcome
        return call.sent(pb.SubmitReply(accepted=accepted, reason=reason))

    # ---- UploadOffset -----------------------------------------------------------------
    async def UploadOffset(self, request: pb.UploadOffsetRequest, call: Call
                           ) -> pb.UploadOffsetReply:
        """Where the caller's cut upload of a task stands (``Uploads.offset``); the call
        layer checked the caller's session, so an edge sees only its own."""
        return self.uploads.offset(call.record.edge_id, request)

    # ---- Leave ------------------------------------------------------------------------
    async def Leave(self, request: pb.LeaveRequest, call: Call) -> pb.LeaveReply:
        """Ends the edge's session at its request; its task, if any, is dropped."""
        reason = request.reason[:MAX_LEAVE_REASON]
        self.sessions.end(call.record, f"left: {reason}" if reason else "left")
        log.info("edge %s left (%s)", request.edge_id, repr(reason) if reason else "no reason given")
        return pb.LeaveReply()


def service_handler(service: FederatedLearningService, meter: ByteMeter, identity: Identity
                    ) -> grpc.GenericRpcHandler:
    """The servicer's methods behind the call layer (``calls.handlers``)."""
    return handlers(service, meter, identity)


__all__ = ["FederatedLearningService", "service_handler"]

"""Edges' sessions, free of any transport: a join checked in order and registered, the
presence that makes an edge selectable, a leave, and the enrolment watch that ends the
session of a revoked edge. The gRPC servicer (``service.py``) only translates calls into
these; a refusal is a ``Refused`` naming its status (``code``: a gRPC status name)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.config import ServerConfig
from fedattn_shared.tls import Enrollment
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.signing import answer_key_share, upload_mac_key, verify_key_share

from .edges import AuthError, EdgeRecord
from .engine import Engine
from .phase import Refused

log = logging.getLogger("fl_server")

ENROLLMENT_POLL = 1.0  # how often a changed enrolment list (a revocation) is looked for


class Lapsed:
    """The marker of a presence stream that ended and may be reopened (``Sessions.lapse``),
    with its grace's timer: cancelled when a new stream replaces the marker, so an edge
    that opens and ends streams as fast as it can holds one timer in the server, not one
    per stream."""

    __slots__ = ("timer",)

    def __init__(self) -> None:
        self.timer: asyncio.TimerHandle | None = None

    @staticmethod
    def replaced(marker: object | None) -> None:
        """A new stream takes the place of ``marker``: its timer, if any, goes."""
        if isinstance(marker, Lapsed) and marker.timer is not None:
            marker.timer.cancel()
            marker.timer = None


class Sessions:
    """Joins, presence and leaves of the edges of one server."""

    def __init__(self, engine: Engine, cfg: ServerConfig, enrollment: Enrollment | None,
                 holds: Callable[[str], bool] = lambda edge: False):
        """``holds(edge)``: whether an upload of the edge's is in flight or held for
        resuming (``Uploads.holds``): its task then outlives a disconnect or a rejoin, for
        the edge to resume the upload; the partial's expiry bounds that."""
        self.engine, self.cfg, self.enrollment = engine, cfg, enrollment
        self.holds = holds
        self.edges = engine.edges
        self.metrics = engine.metrics

    # ---- join ---------------------------------------------------------------------------
    def join(self, request: pb.JoinRequest, certificate: Callable[[str], str]
             ) -> tuple[EdgeRecord, bytes]:
        """Checks a join in order (protocol, ``certificate(token)``'s refusal, the join
        token, the state fingerprint, the upload key share), registers the edge and starts
        its session (a new session replaces any older one, and its outstanding task is
        gone with it, unless a transfer of it is held for resuming: ``holds``). Returns
        the record and the server's key share; raises ``Refused`` (with the status to
        answer) naming what failed."""
        edge_id = request.edge_id
        if request.protocol_version != PROTOCOL_VERSION:
            raise Refused(f"protocol version {request.protocol_version} is not supported "
                          f"(server speaks {PROTOCOL_VERSION})", code="FAILED_PRECONDITION")
        refusal = certificate(request.join_token)
        if refusal:
            raise Refused(refusal)
        if (self.cfg.join_token and self.enrollment is None
                and not hmac.compare_digest(request.join_token, self.cfg.join_token)):
            raise Refused("bad join token")
        fingerprint = self.engine.fingerprint
        if request.state_fingerprint and request.state_fingerprint != fingerprint:
            raise Refused(f"edge {edge_id}: its private state was made for model/method "
                          f"fingerprint {request.state_fingerprint[:80]!r}, this run is "
                          f"{fingerprint}", code="FAILED_PRECONDITION")
        # Checked before the book replaces the edge's session: a join that cannot prove
        # its key share must not end the session the edge already has.
        if not verify_key_share(request.signing_key, edge_id, request.upload_key_share,
                                request.upload_key_proof):
            raise Refused(f"edge {edge_id}: upload_key_share is missing or not signed by "
                          "signing_key (an unproven upload key share)")
        try:
            shared, server_share = answer_key_share(request.upload_key_share)
        except ValueError as err:  # signed, yet a low-order point
            raise Refused(f"edge {edge_id}: unusable upload_key_share: {err}",
                          code="INVALID_ARGUMENT") from None
        serial = self.enrollment.serial(edge_id) if self.enrollment is not None else ""
        # An edge without the run's configuration joins twice: to read it, then again to
        # declare its training split's size (num_examples): one "joined" in the log.
        previous = self.edges.records.get(edge_id)
        declaring = ("num_examples" in request.info and previous is not None
                     and previous.session and "num_examples" not in previous.info)
        try:
            record = self.edges.join(edge_id, request.edge_secret, dict(request.info),
                                     request.signing_key, cert_serial=serial)
        except AuthError as err:
            raise Refused(str(err)) from None
        record.upload_mac_key = upload_mac_key(shared, record.edge_id, record.session)
        record.needs_init = not request.state_fingerprint
        self.metrics.joins.inc()
        self._lose(edge_id, "rejoined")
        if declaring:
            log.info("edge %s declared its training split: %s examples", edge_id,
                     record.info["num_examples"])
        else:
            log.info("edge %s joined (%s)", edge_id,
                     ", ".join(f"{k}={v!r}" for k, v in sorted(record.info.items())))
        return record, server_share

    # ---- presence and leaving -----------------------------------------------------------
    def present(self, record: EdgeRecord) -> None:
        """The edge's presence stream opened: rounds may select it."""
        record.connected = True
        self._count_connected()

    def absent(self, record: EdgeRecord, session: str) -> None:
        """Its presence stream ended: when still its session, its task is dropped."""
        if record.session == session:
            record.connected = False
            self._lose(record.edge_id, "disconnected")
            log.info("edge %s disconnected", record.edge_id)
        self._count_connected()

    def lapse(self, record: EdgeRecord, session: str, grace: float) -> None:
        """Its presence stream ended while its session lives (the edge went, or a proxy or
        the stream's lifetime ended it and the edge is opening a new one): it stays
        present, its task kept, for ``grace`` seconds; absent then unless a new stream of
        the session opened meanwhile (0: absent at once). A marker in ``record.presence``
        tells the new stream's arrival apart."""
        lapsed = record.presence = Lapsed()
        if grace <= 0:
            record.presence = None
            self.absent(record, session)
            return

        def expire() -> None:
            if record.presence is lapsed:
                lapsed.timer = None
                record.presence = None
                self.absent(record, session)

        lapsed.timer = asyncio.get_running_loop().call_later(grace, expire)

    def _lose(self, edge: str, reason: str) -> None:
        """The edge's task goes with its session, unless one of its transfers is held for
        resuming; then it is looked at again once that may have lapsed, and goes if the
        edge did not come back (an upload's partial drops its task itself at its expiry)."""
        if self.holds(edge):
            log.info("edge %s %s: its task stands, its transfer held for resuming", edge,
                     reason)
            # Both holds lapse at the expiry (an upload's partial drops its task itself):
            # looked at again then.
            again = self.cfg.transfer_resume_expiry + 1
            asyncio.get_running_loop().call_later(again, self._recheck, edge, reason)
            return
        self.engine.schedule.lose(edge, reason)

    def _recheck(self, edge: str, reason: str) -> None:
        """A held task of an edge that went: it goes now, unless the edge is back or its
        transfer is still held."""
        record = self.edges.records.get(edge)
        if record is not None and not record.connected:
            self._lose(edge, reason)

    def end(self, record: EdgeRecord, reason: str) -> None:
        """Ends an edge's session from the server's side (a leave or a revocation)."""
        record.end_session()
        self.engine.schedule.lose(record.edge_id, reason)
        self._count_connected()

    def _count_connected(self) -> None:
        self.metrics.connected.set(self.edges.connected_count())

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
            for record in list(self.edges.records.values()):
                edge = record.edge_id
                refusal = record.session and self.enrollment.check(
                    edge, serial=record.cert_serial or None)
                if refusal:
                    self.end(record, "revoked")
                    log.warning("edge %s: session ended: %s", edge, refusal)


__all__ = ["Lapsed", "Sessions"]

"""Edges the server knows: identity (id bound to a secret), session, presence.

Called ``EdgeBook`` (it was ``EdgeRegistry``): "registry" already means the Prometheus
collector registry, the method registry and the model registry.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field

from fedattn_shared.schema import Payload
from fedattn_shared.tls import edge_id_refusal

log = logging.getLogger("fl_server")

# What a Join may say about the device (hostname, versions): bounded, so that a stranger's
# join cannot grow the edge book, the log or the checkpoint.
MAX_INFO_ENTRIES = 32
MAX_INFO_KEY = 64
MAX_INFO_VALUE = 256


class Signal:
    """An ``asyncio.Event`` for one waiter at a time, with the timeout built in: each
    connected edge holds two (its long-poll's and its presence stream's), and at 10,000
    edges an Event's waiter deque (~0.6 KB each, empty) and ``wait_for``'s task around
    every wait were a few KB of the server's memory per idle edge. A second concurrent
    waiter (a client opening two streams for one session) takes the turn: the first
    then wakes at its timeout, as if nothing happened."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future | None = None

    def set(self) -> None:
        """Sets it and wakes the waiter, if any."""
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        """Unsets it (a waiter from now on waits)."""
        self._set = False

    def is_set(self) -> bool:
        """Whether it is set."""
        return self._set

    async def wait(self, timeout: float) -> bool:
        """Returns once set (True), or after ``timeout`` seconds (whether set then)."""
        if self._set:
            return True
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _release, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            if self._waiter is waiter:
                self._waiter = None
        return self._set


def _release(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class AuthError(Exception):
    """Refused identity or session; ``permanent`` distinguishes a bad identity from a
    stale session (which a rejoin fixes)."""

    def __init__(self, message: str, permanent: bool):
        super().__init__(message)
        self.permanent = permanent


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass
class EdgeRecord:
    """One edge id: what binds it (secret hash, signing key, certificate serial, kept in
    checkpoints) and its live session (keys and events, never written to disk)."""

    edge_id: str
    secret_hash: str
    first_seen: float
    session: str = ""
    info: dict[str, str] = field(default_factory=dict)
    wakeup: Signal = field(default_factory=Signal)  # ends a NextTask long-poll's wait
    needs_init: bool = False  # joined without private state: send the initial models once
    heard_run_over: bool = False  # has been told the run is over (the server waits for it)
    signing_key: str = ""  # hex Ed25519 public key, bound to the id at the first join
    upload_mac_key: bytes = b""  # this session's, agreed at join; never written to disk
    cert_serial: str = ""  # under mutual TLS: the certificate the id is bound to (hex)
    # The presence stream of this session waits on it. Set when the session ends (a rejoin,
    # a leave, a revocation: a revoked device's stream closes at once) and by ``wake`` (its
    # next event tells the edge whether a task waits, so an idle edge need not long-poll).
    stirred: Signal = field(default_factory=Signal)
    # The session's one open presence stream (a marker): a newer stream replaces it.
    presence: object | None = field(default=None, repr=False, compare=False)
    # The book's set of connected ids, shared by all its records: counting the connected
    # edges is then O(1), not a scan of every record, which made each of 10,000 joins
    # (a presence stream opening counts the fleet) pay for the whole fleet.
    present: set[str] = field(default_factory=set, repr=False, compare=False)

    @property
    def connected(self) -> bool:
        """A presence stream of the live session is open: rounds may select the edge."""
        return self.edge_id in self.present

    @connected.setter
    def connected(self, value: bool) -> None:
        """Opens or closes the edge's presence in the book's set (its count is O(1))."""
        if value:
            self.present.add(self.edge_id)
        else:
            self.present.discard(self.edge_id)

    def new_session(self) -> None:
        """A join: the previous session ends (its presence stream closes) first."""
        self.end_session()
        self.session = secrets.token_hex(16)
        self.stirred = Signal()

    def end_session(self) -> None:
        """A leave, rejoin or revocation: wakes whatever waits on the old session."""
        self.session = ""
        self.connected = False
        self.stirred.set()

    def wake(self) -> None:
        """Something this edge may fetch changed (a task for it, the run's end): its
        long-poll stops waiting and its presence stream sends a ``task_ready`` hint."""
        self.wakeup.set()
        self.stirred.set()


def info_refusal(info: dict[str, str]) -> str:
    """'' when a Join's ``info`` map is within bounds, else the reason."""
    if len(info) > MAX_INFO_ENTRIES:
        return f"info has {len(info)} entries, at most {MAX_INFO_ENTRIES}"
    for key, value in info.items():
        if not key or len(key) > MAX_INFO_KEY or len(value) > MAX_INFO_VALUE:
            return (f"info entry {key[:MAX_INFO_KEY]!r}: keys are 1-{MAX_INFO_KEY} and values at "
                    f"most {MAX_INFO_VALUE} characters")
    return ""


class EdgeBook:
    """The edges this server knows. ``max_edges`` bounds how many ids may ever register:
    without a join token or mutual TLS anyone can invent ids, and each one is a record, a
    set of metric series and a line in every checkpoint."""

    def __init__(self, max_edges: int = 10_000) -> None:
        self.records: dict[str, EdgeRecord] = {}
        self.max_edges = max_edges
        self.present: set[str] = set()  # connected ids, kept by the records themselves

    def join(self, edge_id: str, secret: str, info: dict[str, str],
             signing_key: bytes = b"", cert_serial: str = "") -> EdgeRecord:
        """Registers ``edge_id`` (first join) or checks it against its binding, and starts
        a new session. Under mutual TLS, ``cert_serial`` is the serial of the certificate
        the enrolment list names for the id: a different serial than the one the id is
        bound to means the id was revoked and re-issued to a new device, whose secret and
        signing key then replace the old device's (and the old session ends)."""
        refusal = edge_id_refusal(edge_id) or info_refusal(info)
        if refusal:
            raise AuthError(refusal, permanent=True)
        if len(secret) < 16:
            raise AuthError(f"edge {edge_id}: edge_secret too short", permanent=True)
        if len(signing_key) != 32:
            raise AuthError(f"edge {edge_id}: signing_key must be a 32-byte Ed25519 public key",
                            permanent=True)
        record = self.records.get(edge_id)
        if record is None:
            if len(self.records) >= self.max_edges:
                raise AuthError(f"edge {edge_id}: this server already has {len(self.records)} "
                                f"registered edges (--max-edges {self.max_edges})", permanent=True)
            record = EdgeRecord(edge_id, _hash(secret), time.time(), cert_serial=cert_serial,
                                present=self.present)
            self.records[edge_id] = record
        elif cert_serial and record.cert_serial != cert_serial:
            # Re-issued (or bound before serials were recorded): the new certificate's
            # device takes the id over; nothing of the old binding survives.
            record.end_session()
            record.secret_hash, record.signing_key = _hash(secret), ""
            record.cert_serial, record.first_seen = cert_serial, time.time()
        elif not hmac.compare_digest(record.secret_hash, _hash(secret)):
            raise AuthError(f"edge id {edge_id} is bound to a different secret", permanent=True)
        if record.signing_key and record.signing_key != signing_key.hex():
            raise AuthError(f"edge id {edge_id} is bound to a different signing key",
                            permanent=True)
        record.signing_key = signing_key.hex()
        record.new_session()
        record.info = dict(info)
        return record

    def check(self, edge_id: str, session: str) -> EdgeRecord:
        """The record of a call that names a live session; AuthError otherwise."""
        record = self.records.get(edge_id)
        if record is None:
            raise AuthError(f"unknown edge {edge_id!r}", permanent=False)
        if not session or not hmac.compare_digest(record.session, session):
            raise AuthError(f"edge {edge_id}: bad or expired session", permanent=False)
        return record

    def connected_ids(self) -> list[str]:
        """Edges with a presence stream open: those a round can select."""
        return sorted(self.present)

    def connected_count(self) -> int:
        """How many edges are connected, without listing them (every presence change asks)."""
        return len(self.present)

    async def wait_for(self, count: int) -> None:
        """Returns once ``count`` edges are connected: every round starts with at least
        --min-edges (as Flower's min_available_clients); stragglers inside a round are
        what --quorum tolerates."""
        announced = False
        while self.connected_count() < count:
            if not announced:
                log.info("waiting for %d connected edge(s) (have %d)", count,
                         self.connected_count())
                announced = True
            await asyncio.sleep(0.1)

    def first_downlink(self, edge_id: str, payload: Payload, init: Payload | None) -> Payload:
        """``payload`` after the initial models (``--init-weights``) for an edge that
        joined without private state, once: its private parts start there too."""
        record = self.records[edge_id]
        if record.needs_init and init is not None:
            record.needs_init = False
            return Payload(init.sections + payload.sections)
        return payload

    def wake_all(self) -> None:
        """Ends every task long-poll's wait (a new phase, or the run is over)."""
        for record in self.records.values():
            record.wake()

    def to_json(self) -> dict:
        """The bindings a checkpoint keeps (no session: a resumed server makes edges rejoin)."""
        return {e: {"secret_sha256": r.secret_hash, "first_seen": r.first_seen,
                    **({"signing_key": r.signing_key} if r.signing_key else {}),
                    **({"cert_serial": r.cert_serial} if r.cert_serial else {})}
                for e, r in sorted(self.records.items())}

    @classmethod
    def from_json(cls, data: dict, max_edges: int = 10_000) -> EdgeBook:
        """The book a checkpoint kept, every edge disconnected until it rejoins."""
        book = cls(max_edges)
        book.load_json(data)
        return book

    def load_json(self, data: dict) -> None:
        """Replaces the records with those a checkpoint kept (a resume): the book itself
        stays, so whatever holds it (the upload gate) sees the resumed edges."""
        self.present.clear()
        self.records = {
            edge_id: EdgeRecord(edge_id, entry["secret_sha256"], entry["first_seen"],
                                signing_key=entry.get("signing_key", ""),
                                cert_serial=entry.get("cert_serial", ""), present=self.present)
            for edge_id, entry in data.items()}

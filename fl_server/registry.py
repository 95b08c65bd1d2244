"""Edges the server knows: identity (id bound to a secret), session, presence."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass, field

EDGE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


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
    edge_id: str
    secret_hash: str
    first_seen: float
    session: str = ""
    connected: bool = False
    info: dict[str, str] = field(default_factory=dict)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    needs_init: bool = False  # joined without private state: send the initial models once
    heard_run_over: bool = False  # has been told the run is over (the server waits for it)
    signing_key: str = ""  # hex Ed25519 public key, bound to the id at the first join
    upload_mac_key: bytes = b""  # this session's, agreed at join; never written to disk


class EdgeRegistry:
    def __init__(self) -> None:
        self.records: dict[str, EdgeRecord] = {}

    def join(self, edge_id: str, secret: str, info: dict[str, str],
             signing_key: bytes = b"") -> EdgeRecord:
        if not EDGE_ID.match(edge_id):
            raise AuthError(f"edge id {edge_id!r} is not valid (letters, digits, . _ -; "
                            "at most 64)", permanent=True)
        if len(secret) < 16:
            raise AuthError(f"edge {edge_id}: edge_secret too short", permanent=True)
        if len(signing_key) != 32:
            raise AuthError(f"edge {edge_id}: signing_key must be a 32-byte Ed25519 public key",
                            permanent=True)
        record = self.records.get(edge_id)
        if record is None:
            record = EdgeRecord(edge_id, _hash(secret), time.time())
            self.records[edge_id] = record
        elif not hmac.compare_digest(record.secret_hash, _hash(secret)):
            raise AuthError(f"edge id {edge_id} is bound to a different secret", permanent=True)
        if record.signing_key and record.signing_key != signing_key.hex():
            raise AuthError(f"edge id {edge_id} is bound to a different signing key",
                            permanent=True)
        record.signing_key = signing_key.hex()
        record.session = secrets.token_hex(16)
        record.info = dict(info)
        return record

    def check(self, edge_id: str, session: str) -> EdgeRecord:
        record = self.records.get(edge_id)
        if record is None:
            raise AuthError(f"unknown edge {edge_id!r}", permanent=False)
        if not session or not hmac.compare_digest(record.session, session):
            raise AuthError(f"edge {edge_id}: bad or expired session", permanent=False)
        return record

    def connected_ids(self) -> list[str]:
        return sorted(e for e, r in self.records.items() if r.connected)

    def wake_all(self) -> None:
        for record in self.records.values():
            record.wakeup.set()

    def to_json(self) -> dict:
        return {e: {"secret_sha256": r.secret_hash, "first_seen": r.first_seen,
                    **({"signing_key": r.signing_key} if r.signing_key else {})}
                for e, r in sorted(self.records.items())}

    @classmethod
    def from_json(cls, data: dict) -> EdgeRegistry:
        registry = cls()
        for edge_id, entry in data.items():
            registry.records[edge_id] = EdgeRecord(edge_id, entry["secret_sha256"],
                                                   entry["first_seen"],
                                                   signing_key=entry.get("signing_key", ""))
        return registry

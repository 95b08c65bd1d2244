"""Train now, upload later (``--mode async``): a result whose upload failed because the
link went is kept in the state dir and sent when the edge is back.

Why: under --mode async a result stays useful for ``--max-staleness`` versions, and a
cellular or Wi-Fi edge often loses its link for minutes; training again costs the
device's energy and time. The server takes such a result back while its version's phase
is open (``fl_server.phase.Phase.revive``) and otherwise refuses it naming why ("too
stale: ..."), which the edge logs. A synchronous round does not wait for a lost edge, so
a sync result is not kept.

What is kept is what the upload would have carried, unsigned: the task's header fields
(round, task id, phase, nonce), the weight, evaluation sums, metrics, the coded sections'
byte labels and the encoded body, for one task (the latest). The signature and body MAC
are made again when it is sent, under the new session's key. ``pending-result.bin`` holds
the body and is written first; ``pending-result.json`` names its size and SHA-256 and is
written last (atomically), so a crash in between leaves no result half-kept. Both are
removed once the server answered (accepted or refused): a result is offered once.
"""

from __future__ import annotations

import base64
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import DecodeError

from fedattn_shared.schema import Payload
from fedattn_shared.state import StateError, atomic_write, atomic_write_json, read_json
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.serialize import decode, encode

OUTBOX_FORMAT = "fedattn-pending-result/1"


@dataclass
class Kept:
    """A kept result, as ``Session.send`` takes it."""

    task: pb.TaskHeader  # round, task_id, phase, task_nonce
    upload: Payload
    num_examples: int
    evaluation: list[pb.EvaluationResult]
    metrics: dict[str, float]
    coded: dict[str, tuple[str, int]]  # kind label -> (codec label, decoded bytes)
    kept_at: float  # unix time


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Outbox:
    """The state dir's one pending result (module doc)."""

    def __init__(self, state_dir: Path):
        self.meta_path = state_dir / "pending-result.json"
        self.body_path = state_dir / "pending-result.bin"

    def keep(self, fingerprint: str, task: pb.TaskHeader, upload: Payload, num_examples: int,
             evaluation: list, metrics: dict[str, float],
             coded: dict[str, tuple[str, int]]) -> None:
        """Keeps one result (replacing any older one) for the run of ``fingerprint``."""
        encoded = encode(upload, checksum=False)
        body = b"".join(bytes(view) for views in encoded.section_views for view in views)
        atomic_write(self.body_path, [body])
        header = pb.TaskHeader(round=task.round, task_id=task.task_id, phase=task.phase,
                               task_nonce=task.task_nonce)
        atomic_write_json(self.meta_path, {
            "format": OUTBOX_FORMAT, "fingerprint": fingerprint,
            "task": _b64(header.SerializeToString()),
            "manifest": _b64(encoded.manifest.SerializeToString()),
            "body_bytes": len(body), "body_sha256": hashlib.sha256(body).hexdigest(),
            "num_examples": int(num_examples),
            "evaluation": [_b64(e.SerializeToString()) for e in evaluation],
            "metrics": {k: float(v) for k, v in metrics.items()},
            "coded": {k: [label, int(raw)] for k, (label, raw) in coded.items()},
            "kept_at": time.time()})

    def load(self, fingerprint: str) -> Kept | None:
        """The kept result of this run (None: none, or one of another run, which is
        removed); a damaged one is a ``StateError`` naming the file."""
        if not self.meta_path.exists():
            return None
        meta = read_json(self.meta_path)
        if not isinstance(meta, dict) or meta.get("format") != OUTBOX_FORMAT:
            raise StateError(f"{self.meta_path}: not a fedattn pending result")
        if meta.get("fingerprint") != fingerprint:
            self.clear()
            return None
        try:
            body = bytearray(self.body_path.read_bytes())
            if (len(body) != meta["body_bytes"]
                    or hashlib.sha256(body).hexdigest() != meta["body_sha256"]):
                raise StateError(f"{self.body_path}: does not match {self.meta_path.name}")
            manifest = pb.PayloadManifest.FromString(base64.b64decode(meta["manifest"]))
            return Kept(
                task=pb.TaskHeader.FromString(base64.b64decode(meta["task"])),
                upload=decode(manifest, body), num_examples=int(meta["num_examples"]),
                evaluation=[pb.EvaluationResult.FromString(base64.b64decode(e))
                            for e in meta["evaluation"]],
                metrics={k: float(v) for k, v in meta["metrics"].items()},
                coded={k: (str(v[0]), int(v[1])) for k, v in meta["coded"].items()},
                kept_at=float(meta["kept_at"]))
        except (OSError, KeyError, TypeError, ValueError, WireError, DecodeError) as err:
            raise StateError(f"{self.meta_path}: unreadable pending result ({err})") from None

    def clear(self) -> None:
        """The server answered: nothing is pending."""
        self.meta_path.unlink(missing_ok=True)
        self.body_path.unlink(missing_ok=True)


__all__ = ["Kept", "Outbox"]

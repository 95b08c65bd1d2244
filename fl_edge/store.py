"""The edge's own disk: its identity and its private state.

``identity.json`` holds a stable edge id and the secret that binds the id to this edge
(created on first start). ``private.safetensors`` holds every model tensor, optimizer
state and method state, with a manifest in the file's metadata: format, model/method
fingerprint, last round and phase. A mismatched fingerprint or corrupt file is refused
with its path; it is never silently loaded or overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from fedattn_shared.methods.base import EdgeAlgorithm
from fedattn_shared.schema import Payload
from fedattn_shared.state import (
    StateError,
    atomic_write,
    atomic_write_json,
    load_tensors,
    read_json,
    save_tensors,
)
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.serialize import crc32, decode

STATE_FORMAT = "fedattn-edge-state/1"
FEEDBACK_FORMAT = "fedattn-error-feedback/1"
PRIVATE_HISTORY_FORMAT = "fedattn-private-history/1"


@dataclass
class Identity:
    """The edge's id and join secret (``identity.json``): the server knows an edge by them."""
    edge_id: str
    secret: str


def load_or_create_identity(state_dir: Path, name: str | None = None) -> Identity:
    """The state dir's identity, created on first start (0700 dir); a state dir never
    changes hands: another ``--name`` is refused."""
    path = state_dir / "identity.json"
    if path.exists():
        data = read_json(path)
        if not isinstance(data, dict) or not data.get("edge_id") or not data.get("secret"):
            raise StateError(f"{path}: missing edge_id or secret")
        if name and data["edge_id"] != name:
            raise StateError(f"{path}: this state dir belongs to edge {data['edge_id']!r}, "
                             f"not {name!r}")
        return Identity(data["edge_id"], data["secret"])
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir, 0o700)
    except OSError as err:
        raise StateError(f"{state_dir}: cannot create the state dir ({err})") from None
    identity = Identity(name or f"edge-{uuid.uuid4().hex[:12]}", secrets.token_hex(32))
    atomic_write_json(path, {"edge_id": identity.edge_id, "secret": identity.secret})
    return identity


def load_or_create_signing_key(state_dir: Path) -> Ed25519PrivateKey:
    """The edge's Ed25519 signing key (``signing.key``, 0600): it signs every submission
    and the SecAgg adverts; the server binds its public half to the edge id at first join."""
    path = state_dir / "signing.key"
    if path.exists():
        try:
            return Ed25519PrivateKey.from_private_bytes(path.read_bytes())
        except ValueError as err:
            raise StateError(f"{path}: not an Ed25519 private key ({err})") from None
    key = Ed25519PrivateKey.generate()
    atomic_write(path, key.private_bytes(serialization.Encoding.Raw,
                                         serialization.PrivateFormat.Raw,
                                         serialization.NoEncryption()), mode=0o600)
    return key


def _optimizer_tensors(algo: EdgeAlgorithm) -> tuple[dict[str, torch.Tensor], list]:
    tensors: dict[str, torch.Tensor] = {}
    described = []
    for i, opt in enumerate(algo.optimizers()):
        state = opt.state_dict()
        for pid, entries in state["state"].items():
            for key, value in entries.items():
                if value is None:
                    continue
                value = value if torch.is_tensor(value) else torch.tensor(value)
                tensors[f"opt/{i}/{pid}/{key}"] = value
        described.append(state["param_groups"])
    return tensors, described


def _load_optimizers(algo: EdgeAlgorithm, tensors: dict[str, torch.Tensor], groups: list) -> None:
    for i, opt in enumerate(algo.optimizers()):
        state: dict[int, dict[str, torch.Tensor]] = {}
        prefix = f"opt/{i}/"
        for name, value in tensors.items():
            if name.startswith(prefix):
                pid, key = name[len(prefix):].split("/", 1)
                state.setdefault(int(pid), {})[key] = value
        opt.load_state_dict({"state": state, "param_groups": groups[i]})


def private_tensors(algo: EdgeAlgorithm) -> dict[str, torch.Tensor]:
    """Every model tensor that never travels (qualified ``model/key``), in name order."""
    return {name: algo.live_tensor(name).detach() for name in algo.private_names()}


def private_digest(algo: EdgeAlgorithm) -> str:
    """SHA-256 over every private (non-shared) model tensor, in name order."""
    digest = hashlib.sha256()
    for name, tensor in private_tensors(algo).items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class PrivateStore:
    """The files of an edge's state dir and their formats (run config, last global,
    private state, private history, privacy ledger), each written atomically."""
    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.path = state_dir / "private.safetensors"
        self.global_manifest_path = state_dir / "global.manifest"
        self.global_slot_paths = (state_dir / "global-0.bin", state_dir / "global-1.bin")
        self._last_global_slot: int | None = None
        self.config_path = state_dir / "run-config.json"
        self.private_history_path = state_dir / "private-history.json"
        self.ledger_path = state_dir / "privacy-ledger.json"
        self.feedback_path = state_dir / "feedback.safetensors"

    def save_run_config(self, config_json: str, fingerprint: str) -> None:
        """The server's configuration, so the model can be rebuilt offline (export)."""
        atomic_write_json(self.config_path, {"config": json.loads(config_json),
                                             "fingerprint": fingerprint})

    def load_run_config(self) -> tuple[str, str]:
        """The run config and fingerprint the edge last ran with (for export and predict)."""
        if not self.config_path.exists():
            raise StateError(f"{self.config_path}: missing; this edge never joined a run")
        data = read_json(self.config_path)
        try:
            return json.dumps(data["config"], sort_keys=True), data["fingerprint"]
        except (KeyError, TypeError):
            raise StateError(f"{self.config_path}: missing config or fingerprint") from None

    def save_global(self, manifest: pb.PayloadManifest, data: bytes | bytearray) -> None:
        """The last global downlink exactly as received: with the private state it is the
        personalized model. Two slot files take turns: the bytes overwrite the slot that
        ``global.manifest`` does not name, in place (rewriting a file of the same size
        reuses its blocks, where a fresh 45 MB file costs the filesystem five times the
        CPU, every round), then the small manifest, naming the slot, is replaced
        atomically. A crash mid-write leaves the manifest naming the intact slot. A cache
        of the server's data, not private state: no fsync per round."""
        slot = 1 - self._global_slot()
        fd = os.open(self.global_slot_paths[slot], os.O_RDWR | os.O_CREAT, 0o600)
        try:
            view = memoryview(data).cast("B")
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], written)
            os.ftruncate(fd, len(view))
        finally:
            os.close(fd)
        atomic_write(self.global_manifest_path, [bytes((slot,)), manifest.SerializeToString()],
                     durable=False)
        self._last_global_slot = slot

    def _global_slot(self) -> int:
        """The slot the manifest names (1 when there is none, so slot 0 is written first)."""
        if self._last_global_slot is None:
            try:
                named = self.global_manifest_path.read_bytes()[:1]
            except FileNotFoundError:
                named = b"\x01"
            self._last_global_slot = 1 if named == b"\x01" else 0
        return self._last_global_slot

    def load_global(self) -> Payload:
        """The last common downlink the edge received, as the method reads it."""
        if not self.global_manifest_path.exists():
            return Payload()
        blob = self.global_manifest_path.read_bytes()
        try:
            if not blob or blob[0] not in (0, 1):
                raise WireError("no slot number")
            manifest = pb.PayloadManifest.FromString(blob[1:])
            path = self.global_slot_paths[blob[0]]
            data = bytearray(path.read_bytes()) if path.exists() else bytearray()
            if len(data) != manifest.total_bytes:
                raise WireError(f"{path.name} holds {len(data)} bytes, the manifest says "
                                f"{manifest.total_bytes}")
            if crc32(data) != manifest.crc32:
                raise WireError(f"{path.name}: CRC-32 mismatch")
            return decode(manifest, data)
        except (DecodeError, WireError, ValueError) as err:
            raise StateError(f"{self.global_manifest_path}: corrupt global downlink cache "
                             f"({err})") from None

    def record_private(self, round_number: int, figures: dict) -> None:
        """Adds a round's private figures (``EdgeAlgorithm.private_figures``) to
        ``private-history.json``: on this disk only, rewritten atomically, one entry per
        round (a round repeated after a restart replaces its entry)."""
        history = self.load_private_history()
        rounds = [r for r in history["rounds"] if r["round"] != round_number]
        rounds.append({"round": round_number, "figures": figures})
        history["rounds"] = sorted(rounds, key=lambda r: r["round"])
        atomic_write_json(self.private_history_path, history)

    def load_private_history(self) -> dict:
        """The figures ``record_private`` kept per round (they never leave the edge)."""
        if not self.private_history_path.exists():
            return {"format": PRIVATE_HISTORY_FORMAT, "rounds": []}
        data = read_json(self.private_history_path)
        if not isinstance(data, dict) or data.get("format") != PRIVATE_HISTORY_FORMAT \
                or not isinstance(data.get("rounds"), list):
            raise StateError(f"{self.private_history_path}: not a fedattn private history")
        return data

    def save_ledger(self, ledger: dict) -> None:
        """The privacy ledger (accountant history, epsilon per round): written durably
        before the round's upload leaves, never reset by a restart."""
        atomic_write_json(self.ledger_path, ledger)

    def load_ledger(self) -> dict | None:
        """The privacy ledger, None before the first DP-SGD run; unreadable is an error, never
        a reset."""
        if not self.ledger_path.exists():
            return None
        data = read_json(self.ledger_path)
        if not isinstance(data, dict):
            raise StateError(f"{self.ledger_path}: not a privacy ledger")
        return data

    def save_feedback(self, residuals: dict[str, torch.Tensor], fingerprint: str,
                      round_number: int) -> None:
        """The error-feedback residuals (``+ef``: what the up codec dropped, keyed
        ``phase/kind/section``), atomically, stamped like the private state: private
        state too (they are the edge's update minus what it sent)."""
        save_tensors(self.feedback_path, residuals,
                     {"format": FEEDBACK_FORMAT, "fingerprint": fingerprint,
                      "round": str(round_number)})

    def load_feedback(self, fingerprint: str) -> dict[str, torch.Tensor]:
        """The residuals ``save_feedback`` wrote for this run ({} when none); a file of
        another run or format is refused with its path, never silently reset."""
        if not self.feedback_path.exists():
            return {}
        tensors, meta = load_tensors(self.feedback_path)
        if meta.get("format") != FEEDBACK_FORMAT or meta.get("fingerprint") != fingerprint:
            raise StateError(f"{self.feedback_path}: error-feedback residuals of another run "
                             f"(format {meta.get('format')!r}, fingerprint "
                             f"{meta.get('fingerprint')!r}); move it away to start afresh")
        return {name: t.to(torch.float32) for name, t in tensors.items()}

    def exists(self) -> bool:
        """Whether the edge has trained before (its private state is on disk)."""
        return self.path.exists()

    def stored_fingerprint(self) -> str | None:
        """The model fingerprint the private state was written for, told to the server at
        join (None: no state, the server sends initial weights)."""
        if not self.path.exists():
            return None
        _, meta = load_tensors(self.path)
        return meta.get("fingerprint")

    def save(self, algo: EdgeAlgorithm, fingerprint: str, round_number: int, phase: str) -> None:
        """Writes the private tensors and optimizer state atomically, stamped with the
        fingerprint, round and phase, so a restart resumes exactly here."""
        # Shared tensors are not saved: the server's next downlink replaces them anyway.
        tensors = {f"model/{name}": value for name, value in private_tensors(algo).items()}
        opt_tensors, groups = _optimizer_tensors(algo)
        tensors.update(opt_tensors)
        tensors.update({f"method/{k}": v for k, v in algo.extra_state().items()})
        meta = {
            "format": STATE_FORMAT,
            "fingerprint": fingerprint,
            "round": str(round_number),
            "phase": phase,
            "optimizer_groups": json.dumps(groups),
        }
        save_tensors(self.path, tensors, meta)

    def load(self, algo: EdgeAlgorithm, fingerprint: str) -> dict[str, str]:
        """Loads the private state into ``algo``; refused when written for another model."""
        tensors, meta = load_tensors(self.path)
        if meta.get("format") != STATE_FORMAT:
            raise StateError(f"{self.path}: not a fedattn edge state file "
                             f"(format {meta.get('format')!r})")
        if meta.get("fingerprint") != fingerprint:
            raise StateError(
                f"{self.path}: stored for a different model/method (fingerprint "
                f"{meta.get('fingerprint')}, the server's run is {fingerprint}); use a fresh "
                f"--state-dir or move this one away")
        try:
            with torch.no_grad():
                for name in private_tensors(algo):
                    algo.live_tensor(name).copy_(tensors[f"model/{name}"])
            _load_optimizers(algo, tensors, json.loads(meta["optimizer_groups"]))
            algo.load_extra_state({k[len("method/"):]: v for k, v in tensors.items()
                                   if k.startswith("method/")})
        except (KeyError, RuntimeError, ValueError) as err:
            raise StateError(f"{self.path}: does not fit the model ({err})") from None
        return meta

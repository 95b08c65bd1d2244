"""Secure aggregation on the edge: the SecAgg+ client steps and its secrets on disk.

The round's secrets (two X25519 private keys, the self-mask seed, the shares held for
neighbours) live in ``secagg-round.json`` in the state dir, mode 0600, written atomically
after every step and before the step's upload: a restart inside a round neither loses
them (a later step loads them) nor makes the edge mask twice (the step is recorded). The
file is deleted once the unmask step is answered; the next round's advertise replaces
any leftover. The adverts are signed with the edge's signing key (``signing.key``, bound
to the edge id by the server at the edge's first join).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedattn_shared.privacy.secagg import (
    ADVERTISE,
    SHARE,
    UNMASK,
    ClientRound,
    Quantizer,
    SecAggError,
    as_bytes,
    as_tensor,
    flatten_upload,
    masked_phases,
    protocol_step,
)
from fedattn_shared.state import StateError, atomic_write_json, read_json
from fedattn_shared.wire.codec import Kind, Payload, Section

log = logging.getLogger("fl_edge")

ROUND_FILE = "secagg-round.json"


def is_secagg_phase(name: str) -> bool:
    return protocol_step(name) is not None


def strip_secagg(payload: Payload) -> Payload:
    """The personal downlink without the protocol's sections (what the method reads)."""
    return Payload([s for s in payload.sections if s.kind != Kind.SECAGG])


def _request(personal: Payload) -> tuple[dict, dict[str, bytes]]:
    section = personal.get(Kind.SECAGG, "request")
    if section is None:
        raise SecAggError("the task carries no secure-aggregation request")
    tensors = {k: as_bytes(t) for k, t in section.tensors.items()}
    return json.loads(tensors.pop("info")), tensors


class EdgeSecAgg:
    def __init__(self, state_dir: Path, edge_id: str, signing_key: Ed25519PrivateKey):
        self.edge_id = edge_id
        self.signing_key = signing_key
        self.path = state_dir / ROUND_FILE

    def _load(self, round_number: int, phase: str) -> ClientRound:
        if not self.path.exists():
            raise SecAggError(f"no secure-aggregation secrets on disk for round {round_number} "
                              f"{phase} (advertise step missed)")
        try:
            state = ClientRound.from_json(read_json(self.path))
        except (StateError, KeyError, ValueError, TypeError) as err:
            raise SecAggError(f"{self.path}: unreadable ({err})") from None
        if (state.round, state.phase, state.edge) != (round_number, phase, self.edge_id):
            raise SecAggError(f"{self.path} holds round {state.round} {state.phase}, not "
                              f"round {round_number} {phase}")
        return state

    def _save(self, state: ClientRound) -> None:
        atomic_write_json(self.path, state.to_json(), mode=0o600)

    # ---- the protocol steps (their own phases) ---------------------------------------
    def step(self, name: str, round_number: int, personal: Payload) -> Payload:
        step, phase = protocol_step(name)
        if step == ADVERTISE:
            state = ClientRound.fresh(round_number, phase, self.edge_id)
            advert = state.advertise(self.signing_key)
            self._save(state)
            return Payload([Section(Kind.SECAGG, "advert",
                                    {k: as_tensor(v) for k, v in advert.items()})])
        state = self._load(round_number, phase)
        info, tensors = _request(personal)
        if step == SHARE:
            adverts: dict[str, dict[str, bytes]] = {}
            for key, blob in tensors.items():
                edge, _, field = key.partition("/")
                adverts.setdefault(edge, {})[field] = blob
            signing = {e: a.pop("sign_pk", b"") for e, a in adverts.items()}
            shares = state.share(int(info["threshold"]), {k: int(v) for k, v in
                                                          info["index"].items()},
                                 adverts, signing)
            self._save(state)
            return Payload([Section(Kind.SECAGG, "shares",
                                    {k: as_tensor(v) for k, v in shares.items()})])
        if step == UNMASK:
            revealed = state.unmask(info["alive"], info["dropped"], int(info["survivors"]))
            self.path.unlink(missing_ok=True)
            return Payload([Section(Kind.SECAGG, "reveal",
                                    {k: as_tensor(v) for k, v in revealed.items()})])
        raise SecAggError(f"unknown secure-aggregation step {step!r}")

    # ---- the masked phase ------------------------------------------------------------
    def mask(self, round_number: int, phase: str, personal: Payload, upload: Payload,
             weight: float, method, models) -> Payload:
        """Replace the method's upload by its masked vector (one SECAGG section)."""
        state = self._load(round_number, phase)
        info, ciphertexts = _request(personal)
        specs = masked_phases(method, models)[phase]
        quantizer = Quantizer(float(info["clip"]), float(info["max_weight"]),
                              int(info["parties"]))
        values = flatten_upload(specs, upload)
        y = state.mask(list(info["survivors"]), ciphertexts, values, weight, quantizer)
        self._save(state)  # records "masked": this edge never masks this round again
        return Payload([Section(Kind.SECAGG, "masked",
                                {"y": torch.from_numpy(y.view("<i4").copy())})])

"""Secure aggregation on the edge: the SecAgg+ client steps and its secrets on disk.

The round's secrets (two X25519 private keys, the self-mask seed, the shares held for
neighbours, the survivor list it signed) live in ``secagg-round.json`` in the state dir,
mode 0600, written atomically after every step and before the step's upload: a restart
inside a round neither loses them (a later step loads them) nor makes the edge mask twice
or sign a second survivor list (the step is recorded). The file is deleted once the unmask
step is answered; the next round's advertise replaces any leftover. The adverts and the
survivor list are signed with the edge's signing key (``signing.key``, bound to the edge id
by the server at the edge's first join).

Every request is the server's word; the edge holds it to the run config's secure-aggregation
parameters (``SecAggPolicy``, from the config the server sent at join), not to the
threshold or fixed point a round's request states. Under integer compression that includes
the width and block size; the public scales are checked (finite, > 0, one per block) and
signed with the survivor list. With ``+ef`` what the edge did not send is kept in
``secagg-residual.safetensors`` (0600, atomic) for the next round. Before masking, the edge
clips its change of the global it holds to the run's ``max_update`` (the server refuses a
mean that moves the global further) and, at 32 bits, holds its model values to the clip
box rather than sitting out (``secagg_bound``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedattn_shared.compress import CodecChoice
from fedattn_shared.compress.integer import integer_codec
from fedattn_shared.privacy.secagg import (
    ADVERTISE,
    CONFIRM,
    RECEIVE,
    SHARE,
    UNMASK,
    ClientRound,
    Quantizer,
    SecAggError,
    SecAggPolicy,
    as_bytes,
    as_tensor,
    protocol_step,
)
from fedattn_shared.privacy.secagg_bound import clip_change, saturate
from fedattn_shared.privacy.secagg_layout import (
    base_vector,
    flatten_upload,
    masked_phases,
    model_mask,
)
from fedattn_shared.privacy.secagg_ring import (
    IntegerQuantizer,
    pack_bits,
)
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.state import (
    StateError,
    atomic_write_json,
    load_tensors,
    read_json,
    save_tensors,
)

log = logging.getLogger("fl_edge")

ROUND_FILE = "secagg-round.json"
RESIDUAL_FILE = "secagg-residual.safetensors"  # +ef: what each masked phase did not send


def is_secagg_phase(name: str) -> bool:
    """A SecAgg+ protocol step (answered by the SecAgg middleware), not a method phase."""
    return protocol_step(name) is not None


def strip_secagg(payload: Payload) -> Payload:
    """The personal downlink without the protocol's sections (what the method reads)."""
    return Payload([s for s in payload.sections if s.kind != Kind.SECAGG])


def _request(personal: Payload) -> tuple[dict, dict[str, bytes]]:
    section = personal.get(Kind.SECAGG, "request")
    if section is None:
        raise SecAggError("the task carries no secure-aggregation request")
    tensors = {k: as_bytes(t) for k, t in section.tensors.items()}
    try:
        info = json.loads(tensors.pop("info"))
    except (KeyError, ValueError):
        raise SecAggError("the secure-aggregation request carries no readable info") from None
    if not isinstance(info, dict):
        raise SecAggError("the secure-aggregation request's info is not an object")
    return info, tensors


def _marked(tensors: dict[str, bytes], prefix: str) -> dict[str, bytes]:
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


class EdgeSecAgg:
    """The edge's SecAgg+ client across rounds: answers each protocol step from the
    round's secrets on disk and masks the method's upload; holds every request to the
    run's ``policy``."""
    def __init__(self, state_dir: Path, edge_id: str, signing_key: Ed25519PrivateKey,
                 policy: SecAggPolicy | None = None):
        self.edge_id = edge_id
        self.signing_key = signing_key
        self.path = state_dir / ROUND_FILE
        self.residual_path = state_dir / RESIDUAL_FILE
        # From the run config at join (the daemon sets it); None: the run has no secure
        # aggregation, and every step is refused.
        self.policy = policy

    def _policy(self) -> SecAggPolicy:
        if self.policy is None:
            raise SecAggError("the server's run config does not enable secure aggregation, yet "
                              "it asks for a step of it")
        return self.policy

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
        """One step's upload; SecAggError (naming what is wrong) for a request this edge
        refuses -- the daemon then sits the step out."""
        try:
            return self._step(name, round_number, personal)
        except (KeyError, TypeError, AttributeError) as err:  # a malformed request
            raise SecAggError(f"{name}: malformed request ({type(err).__name__}: {err})") from None

    def _step(self, name: str, round_number: int, personal: Payload) -> Payload:
        step, phase = protocol_step(name)
        policy = self._policy()
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
            index = info["index"]
            if not isinstance(index, dict):
                raise SecAggError("the server's share indices are not an object")
            shares = state.share(int(info["threshold"]), dict(index), adverts, signing,
                                 int(info["parties"]), policy)
            self._save(state)
            return Payload([Section(Kind.SECAGG, "shares",
                                    {k: as_tensor(v) for k, v in shares.items()})])
        if step == RECEIVE:
            reported = state.receive(tensors)
            self._save(state)
            for sender in reported:
                log.warning("round %d %s: the shares from edge %s failed authentication; "
                            "reporting it", round_number, phase, sender)
            return Payload([Section(Kind.SECAGG, "receive",
                                    {f"bad:{u}": as_tensor(b"\x01") for u in reported})])
        if step == CONFIRM:
            signature = state.confirm(info["survivors"], self.signing_key)
            self._save(state)  # records the list: this edge signs no other this round
            return Payload([Section(Kind.SECAGG, "confirm", {"sig": as_tensor(signature)})])
        if step == UNMASK:
            revealed = state.unmask(info["survivors"], _marked(tensors, "sig:"))
            self.path.unlink(missing_ok=True)
            return Payload([Section(Kind.SECAGG, "reveal",
                                    {k: as_tensor(v) for k, v in revealed.items()})])
        raise SecAggError(f"unknown secure-aggregation step {step!r}")

    # ---- the masked phase ------------------------------------------------------------
    def mask(self, round_number: int, phase: str, personal: Payload, upload: Payload,
             weight: float, method, models, common: Payload | None = None,
             seed: int = 0, codec: CodecChoice | None = None) -> Payload:
        """Replace the method's upload by its masked vector (one SECAGG section). The fixed
        point is the run config's, for the parties the share step named. Under integer
        compression (``policy.bits``) the masked quantity is the change against ``common``
        (the global this edge received), rounded onto the request's public scales by the
        run's integer up ``codec`` (its ``round_levels``; ``seed``, the task's, drives any
        randomness); the request's public scales pick the integer path, their absence the
        32-bit one (a round with no earlier sum to scale by). The change against ``common``
        is clipped to ``policy.max_update`` (L2, over the values the global holds) in
        either path."""
        policy = self._policy()
        state = self._load(round_number, phase)
        info, tensors = _request(personal)
        self._check_fixed_point(info, policy, state.parties)
        specs = masked_phases(method, models)[phase]
        integer_asked = "scales" in tensors or "bits" in info
        if integer_asked and not policy.bits:
            raise SecAggError("the masking request states an integer fixed point (bits, "
                              "scales); the run config has no integer compression")
        values, residual = self._values(round_number, phase, specs, upload, common, policy)
        if not integer_asked:  # 32 bits: all is sent but the rounding
            y = state.mask(info.get("survivors"), values, weight,
                           Quantizer(policy.clip, policy.max_weight, state.parties))
            self._save(state)  # records "masked": this edge never masks this round again
            if residual is not None:
                self._keep_residual(phase, np.zeros_like(values))
            return Payload([Section(Kind.SECAGG, "masked",
                                    {"y": torch.from_numpy(y.view("<i4").copy())})])
        integer = integer_request(info, tensors, policy, state.parties, values.size, codec)
        generator = torch.Generator().manual_seed(rounding_seed(seed, phase))
        words, error = integer.quantize(values, weight, generator)
        y = state.mask_words(info.get("survivors"), words, integer.ring, integer.digest)
        self._save(state)
        if residual is not None:
            self._keep_residual(phase, error)
        return Payload([Section(Kind.SECAGG, "masked", {
            "y": torch.from_numpy(pack_bits(y[:-1], integer.ring)),
            "weight": torch.from_numpy(y[-1:].view("<i4").copy())})])

    @staticmethod
    def _check_fixed_point(info: dict, policy, parties: int) -> None:
        """The masking request's fixed point must be the run config's."""
        try:
            stated = (float(info["clip"]), float(info["max_weight"]), int(info["parties"]))
        except (KeyError, TypeError, ValueError):
            raise SecAggError("malformed masking request") from None
        if stated != (policy.clip, policy.max_weight, parties):
            raise SecAggError(f"the masking request's fixed point (clip, max weight, parties) "
                              f"{stated} differs from the run config's "
                              f"{(policy.clip, policy.max_weight, parties)}")

    def _values(self, round_number: int, phase: str, specs, upload: Payload,
                common: Payload | None, policy) -> tuple[np.ndarray, np.ndarray | None]:
        """What is masked, and the error-feedback residual it includes (None without
        feedback). The change of the global this edge holds is clipped to the run's bound
        (the server refuses a mean beyond it): under integer compression that change is
        what is masked; at 32 bits the model, held to the box the server checks."""
        values = flatten_upload(specs, upload)
        held = common or Payload()
        base, model = base_vector(specs, held), model_mask(specs, held)
        change = values - base
        residual = None
        if policy.bits:
            residual = self._residual(phase, values.size) if policy.feedback else None
            change = change if residual is None else change + residual
        clipped, norm = clip_change(change, model, policy.max_update)
        was_clipped = clipped is not change
        if was_clipped:
            log.info("round %d %s: change of the global clipped from L2 norm %.4g to %g "
                     "(server.secagg_max_update)", round_number, phase, norm,
                     policy.max_update)
        if policy.bits:
            return clipped, residual
        values, moved = saturate(base + clipped if was_clipped else values, model, policy.clip)
        if moved:
            log.warning("round %d %s: %d model value(s) beyond the clip range %g held to "
                        "it (server.secagg_clip): the global sits at the range's edge",
                        round_number, phase, moved, policy.clip)
        return values, residual

    def _residual(self, phase: str, n: int) -> np.ndarray:
        """The error-feedback residual of ``phase`` (zeros at first, or when the vector's
        length changed)."""
        try:
            tensors, _ = load_tensors(self.residual_path)
        except FileNotFoundError:
            return np.zeros(n)
        except StateError as err:
            log.warning("%s; starting the residual afresh", err)
            return np.zeros(n)
        held = tensors.get(phase)
        if held is None or held.numel() != n:
            return np.zeros(n)
        return held.to(torch.float64).numpy()

    def _keep_residual(self, phase: str, residual: np.ndarray) -> None:
        """Private edge state, written atomically (0600) before the masked upload leaves."""
        try:
            tensors, _ = load_tensors(self.residual_path)
        except (FileNotFoundError, StateError):
            tensors = {}
        tensors[phase] = torch.from_numpy(residual.astype(np.float32))
        save_tensors(self.residual_path, tensors)


def rounding_seed(task_seed: int, phase: str) -> int:
    """The stochastic rounding's generator seed: the task's (per edge and round), for
    this phase's masked upload only."""
    digest = hashlib.sha256(f"fedattn-secagg/rounding|{task_seed}|{phase}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def integer_request(info: dict, tensors: dict[str, bytes], policy: SecAggPolicy, parties: int,
                    n: int, choice: CodecChoice | None) -> IntegerQuantizer:
    """The integer fixed point of a masking request, held to the run config: the width and
    block size the config states (those of its up codec ``choice``, whose rounding the
    upload takes), a reference weight in (0, max_weight], one finite positive float32
    scale per block. SecAggError names the field."""
    if choice is None:
        raise SecAggError("the masking request states an integer fixed point; the run "
                          "config has no up codec to quantize with")
    try:
        codec = integer_codec(choice)
    except ValueError as err:
        raise SecAggError(str(err)) from None
    if (codec.integer_bits, codec.block) != (policy.bits, policy.block):
        raise SecAggError(f"the run config's secure-aggregation bits/block ({policy.bits}, "
                          f"{policy.block}) are not its up codec's ({codec.integer_bits}, "
                          f"{codec.block}, {codec.spec})")
    if info.get("bits") != policy.bits or info.get("block") != policy.block:
        raise SecAggError(f"the masking request's bits/block ({info.get('bits')!r}, "
                          f"{info.get('block')!r}) differ from the run config's "
                          f"({policy.bits}, {policy.block})")
    weight_ref = info.get("weight_ref")
    if not (isinstance(weight_ref, float | int) and not isinstance(weight_ref, bool)
            and math.isfinite(weight_ref) and 0 < weight_ref <= policy.max_weight):
        raise SecAggError(f"the masking request's weight_ref {weight_ref!r} is not in (0, "
                          f"{policy.max_weight}] (server.secagg_max_weight)")
    blocks = -(-n // policy.block)
    data = tensors.get("scales", b"")
    if len(data) != 4 * blocks:
        raise SecAggError(f"the masking request's scales: {len(data)} bytes, expected "
                          f"{4 * blocks} (one float32 per block of {policy.block}, {blocks} "
                          "blocks)")
    scales = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.all(np.isfinite(scales)):
        raise SecAggError("the masking request's scales hold non-finite values")
    if not np.all(scales > 0):
        raise SecAggError("the masking request's scales hold values <= 0")
    return IntegerQuantizer(codec, parties, policy.max_weight, scales, float(weight_ref))

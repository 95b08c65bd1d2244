"""Secure aggregation on the server: SecAgg+ as transport-layer phases of a round.

Each phase whose uploads are summed ("masked phase", e.g. ``train``) becomes six:
``secagg-advertise:P``, ``secagg-share:P``, ``secagg-receive:P`` (the edges check the
shares addressed to them and report senders whose shares fail), ``P`` itself (the edges
upload masked vectors), ``secagg-confirm:P`` (each signs the survivor list) and
``secagg-unmask:P``, each with its own deadline. The engine asks this driver for the
phases' schemas, personal downlinks and what to do with an upload; the method's
aggregator receives only the unmasked weighted sum (``Aggregator.accept_sum``), and only
once it passed the bounds every honest edge obeys. Every protocol byte travels in SECAGG
sections. Anything an edge sends that the protocol cannot use ends that edge's part in the
step or, when too little is left, the round's secure aggregation -- never the server.

Under an integer up codec (``--compress up=int8|int4``, or a plug-in
``compress.integer.IntegerCodec``) the masked upload is the edges' change against the
phase's common downlink, quantized by the codec's rounding onto public per-block scales
that this driver derives from the previous round's unmasked mean (``integer``) and packed
at R bits a value; the first round (no mean yet) masks at 32 bits. The global times the
summed weight is added back before the aggregator sees the sum.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from fedattn_shared.compress.integer import IntegerCodec, integer_codec
from fedattn_shared.methods.aggregators import Aggregator
from fedattn_shared.methods.base import Method
from fedattn_shared.privacy.secagg import (
    ADVERTISE,
    CONFIRM,
    RECEIVE,
    SHARE,
    UNMASK,
    Quantizer,
    SecAggError,
    SecAggPolicy,
    ServerRound,
    as_bytes,
    as_tensor,
    protocol_step,
)
from fedattn_shared.privacy.secagg_bound import bound_scales, check_update, rounding_norm
from fedattn_shared.privacy.secagg_crypto import CIPHERTEXT_BYTES, SHARE_BYTES, SIGNATURE_BYTES
from fedattn_shared.privacy.secagg_layout import (
    base_vector,
    masked_phases,
    model_mask,
    unflatten_sum,
    vector_length,
)
from fedattn_shared.privacy.secagg_ring import (
    IntegerQuantizer,
    packed_length,
    public_scales,
    unpack_bits,
)
from fedattn_shared.schema import Kind, Payload, Section, SectionSpec, TensorSpec

from .edges import EdgeBook
from .settings import ServerSettings

log = logging.getLogger("fl_server")

ADVERT_FIELDS = {"c_pk": 32, "s_pk": 32, "commit": 32, "sig": 64, "sign_pk": 32}


def json_tensor(obj: Any) -> torch.Tensor:
    """JSON as a uint8 tensor: protocol requests travel in SECAGG sections."""
    return as_tensor(json.dumps(obj, sort_keys=True).encode())


def request(info: dict[str, Any], tensors: dict[str, bytes] | None = None) -> Payload:
    """A protocol request to one edge: its JSON info and byte blobs in one SECAGG section."""
    body = {"info": json_tensor(info), **{k: as_tensor(v) for k, v in (tensors or {}).items()}}
    return Payload([Section(Kind.SECAGG, "request", body)])


def _bytes_spec(size: int, optional: bool = False) -> TensorSpec:
    return TensorSpec(torch.uint8, (size,), optional=optional)


def run_codec(cfg: ServerSettings) -> IntegerCodec | None:
    """The run's integer up codec (``--compress up=int8``, or a plug-in ``IntegerCodec``),
    whose width, levels, block and rounding the masked path uses; None without one.
    ValueError names a codec that states an integer width without the interface."""
    up = cfg.compression.up
    if up is None or up.codec.integer_bits is None:
        return None
    return integer_codec(up)


def run_policy(cfg: ServerSettings) -> SecAggPolicy:
    """The parameters the run config carries to every edge (``Engine.config_json``), which
    the edges hold each round's requests to; with an integer up codec (``--compress
    up=int8``) its width, block size and error feedback."""
    codec = run_codec(cfg)
    extra = ({"bits": codec.integer_bits, "block": codec.block,
              "feedback": cfg.compression.up.feedback} if codec is not None else {})
    return SecAggPolicy(threshold=cfg.secagg_threshold, graph=cfg.secagg_graph,
                        degree=cfg.secagg_degree, clip=cfg.secagg_clip,
                        max_weight=cfg.secagg_max_weight,
                        max_update=cfg.secagg_update_bound(), **extra)


class SecAggDriver:
    """The server's SecAgg+ state for a run: which method phases are masked, and each
    round's protocol state per masked phase (``drivers.SecAggStep`` drives it step by step)."""
    def __init__(self, cfg: ServerSettings, method: Method, models: dict[str, nn.Module],
                 aggregator: Aggregator):
        self.cfg = cfg
        self.codec = run_codec(cfg)  # the integer up codec: its grid and rounding are masked
        self.policy = run_policy(cfg)
        self.aggregator = aggregator
        self.masked = masked_phases(method, models)  # ValueError names a refused section
        self.lengths = {p: vector_length(specs) for p, specs in self.masked.items()}
        self.rounds: dict[str, ServerRound] = {}
        self.quantizers: dict[str, Quantizer] = {}
        # Integer compression: per masked phase, the last unmasked weighted mean of the
        # masked quantity and mean weight (public: what the server learns anyway), which
        # set the next round's public scales; the round's integer fixed point once known.
        self.reference: dict[str, tuple[np.ndarray, float]] = {}
        self.integers: dict[str, IntegerQuantizer | None] = {}
        # The public scales last sent per masked phase: the next ones grow from them by at
        # most server.secagg_scale_growth.
        self.last_scales: dict[str, np.ndarray] = {}
        # The round's stated weights per masked phase: edge -> the weight its masked
        # upload's header stated (capped at its join declaration by the gate), which the
        # unmasked total weight must equal.
        self.weights: dict[str, dict[str, float]] = {}

    # ---- the round's phases ----------------------------------------------------------
    def expand(self, phases: tuple[str, ...]) -> list[str]:
        """The phase names with every masked phase replaced by its six protocol steps."""
        out = []
        for phase in phases:
            if phase in self.masked:
                out += [f"{step}:{phase}" for step in (ADVERTISE, SHARE, RECEIVE)]
                out += [phase, *(f"{step}:{phase}" for step in (CONFIRM, UNMASK))]
            else:
                out.append(phase)
        return out

    def owns(self, name: str) -> bool:
        """Whether secure aggregation handles this phase's uploads (not the method)."""
        return name in self.masked or protocol_step(name) is not None

    def base_phase(self, name: str) -> str:
        """The phase whose common downlink (the global model) a protocol phase carries:
        the same bytes, so the edges' cached copy serves and nothing is sent twice."""
        step = protocol_step(name)
        return step[1] if step else name

    def deadline(self, name: str, default: float) -> float:
        """Protocol steps wait --secagg-timeout; the masked upload itself the default."""
        return self.cfg.secagg_timeout if protocol_step(name) else default

    def begin_round(self, round_number: int, edges: EdgeBook) -> None:
        """Fresh protocol state for each masked phase, over the signing keys the edges are
        bound to (a key bound mid-round takes part from the next round)."""
        keys = {e: bytes.fromhex(r.signing_key) for e, r in edges.records.items()
                if r.signing_key}
        self.rounds = {}
        for phase in self.masked:
            full = self.cfg.secagg_graph == "full"
            self.rounds[phase] = ServerRound(round_number, phase, self.lengths[phase],
                                             -1 if full else self.cfg.secagg_degree,
                                             self.cfg.secagg_threshold, dict(keys))
        self.quantizers = {}
        self.integers = {}
        self.weights = {phase: {} for phase in self.masked}

    def _round(self, name: str) -> tuple[str, ServerRound]:
        step = protocol_step(name)
        phase = step[1] if step else name
        return (step[0] if step else "masked"), self.rounds[phase]

    def skip(self, name: str) -> bool:
        """A round whose protocol aborted runs none of its remaining phases."""
        return bool(self._round(name)[1].abort_reason)

    # ---- schemas and downlinks --------------------------------------------------------
    def schema(self, name: str) -> list[SectionSpec]:
        """The SECAGG section a step's upload must hold (it depends on earlier steps)."""
        step, state = self._round(name)
        if step == ADVERTISE:
            return [SectionSpec(Kind.SECAGG, "advert",
                                {k: _bytes_spec(n) for k, n in ADVERT_FIELDS.items()})]
        if step == SHARE:
            return [SectionSpec(Kind.SECAGG, "shares", {
                e: _bytes_spec(CIPHERTEXT_BYTES, optional=True) for e in state.adverts})]
        if step == RECEIVE:  # one (empty) marker per sender whose shares failed
            return [SectionSpec(Kind.SECAGG, "receive", {
                f"bad:{e}": _bytes_spec(1, optional=True) for e in state.sharers})]
        if step == CONFIRM:
            return [SectionSpec(Kind.SECAGG, "confirm", {"sig": _bytes_spec(SIGNATURE_BYTES)})]
        if step == UNMASK:
            return [SectionSpec(Kind.SECAGG, "reveal", {
                f"{kind}:{e}": _bytes_spec(SHARE_BYTES, optional=True)
                for e in state.survivors for kind in "bs"})]
        integer = self.integer(name)
        if integer is not None:  # values packed at R bits, the weight its own 32-bit word
            return [SectionSpec(Kind.SECAGG, "masked", {
                "y": TensorSpec(torch.uint8, (packed_length(state.length - 1, integer.ring),)),
                "weight": TensorSpec(torch.int32, (1,))})]
        return [SectionSpec(Kind.SECAGG, "masked",
                            {"y": TensorSpec(torch.int32, (state.length,))})]

    def personal(self, edge: str, name: str) -> Payload:
        """The step's request to one edge (adverts, shares, survivors, ...)."""
        step, state = self._round(name)
        if step == ADVERTISE:
            return Payload()
        if step == SHARE:
            info, adverts = state.share_request(edge)
            return request(info, {f"{v}/{k}": blob for v, advert in adverts.items()
                                  for k, blob in advert.items()})
        if step == RECEIVE:
            return request({}, state.receive_request(edge))
        if step == CONFIRM:
            return request(state.confirm_request(edge))
        if step == UNMASK:
            info, signatures = state.unmask_request(edge)
            return request(info, {f"sig:{v}": sig for v, sig in signatures.items()})
        quantizer = self.quantizer(name)
        info = {"survivors": state.mask_request(edge), "parties": quantizer.parties,
                "clip": quantizer.clip, "max_weight": quantizer.max_weight}
        integer = self.integer(name)
        if integer is None:
            return request(info)
        info.update(bits=integer.bits, block=integer.block, weight_ref=integer.weight_ref)
        return request(info, {"scales": integer.scales.astype("<f4").tobytes()})

    def quantizer(self, phase: str) -> Quantizer:
        """The round's quantizer of a masked phase (fixed once the parties are known)."""
        if phase not in self.quantizers:
            self.quantizers[phase] = Quantizer(self.cfg.secagg_clip, self.cfg.secagg_max_weight,
                                               max(len(self.rounds[phase].adverts), 1))
        return self.quantizers[phase]

    def integer(self, phase: str) -> IntegerQuantizer | None:
        """The round's integer fixed point of a masked phase: None without integer
        compression, and in a round with no earlier unmasked mean to scale by (the first,
        or the first after a restart), which masks at 32 bits as without compression."""
        if phase not in self.integers:
            reference = self.reference.get(phase)
            integer = None
            if self.policy.bits and reference is not None:
                if self.codec is None:
                    raise SecAggError("the SecAgg policy states an integer width, the run "
                                      "has no integer up codec")
                mean, weight_ref = reference
                scales = bound_scales(public_scales(mean, self.codec.block,
                                                    self.cfg.secagg_margin),
                                      self.last_scales.get(phase),
                                      self.cfg.secagg_scale_ceiling(),
                                      self.cfg.secagg_scale_growth)
                integer = IntegerQuantizer(self.codec, self.quantizer(phase).parties,
                                           self.policy.max_weight, scales, weight_ref)
                self.rounds[phase].fixed_point = integer.digest
                self.last_scales[phase] = scales
            self.integers[phase] = integer
        return self.integers[phase]

    # ---- uploads ----------------------------------------------------------------------
    def state_weight(self, name: str, edge: str, weight: float) -> None:
        """The weight ``edge``'s masked upload of phase ``name`` stated in its header (the
        gate capped it at the edge's join declaration): the one its masked weight must
        carry, as the aggregator takes it (``Aggregator.public_weight``)."""
        self.weights[name][edge] = self.aggregator.public_weight(name, edge, weight)

    def accept(self, name: str, edge: str, upload: Payload) -> None:
        """Raises ValueError (SecAggError) for a bad protocol message: the engine refuses
        it and drops the edge from the phase."""
        step, state = self._round(name)
        if len(upload.sections) != 1:  # the engine checked the schema; this holds regardless
            raise SecAggError(f"{name}: expected one SECAGG section, got {len(upload.sections)}")
        section = upload.sections[0]
        blobs = {k: as_bytes(t) for k, t in section.tensors.items()} if step != "masked" else {}
        try:
            if step == ADVERTISE:
                state.accept_advert(edge, blobs)
            elif step == SHARE:
                state.accept_shares(edge, blobs)
            elif step == RECEIVE:
                state.accept_receive(edge, [k.removeprefix("bad:") for k in blobs])
            elif step == CONFIRM:
                state.accept_confirm(edge, blobs["sig"])
            elif step == UNMASK:
                state.accept_reveal(edge, blobs)
            else:
                state.accept_masked(edge, self._words(name, section))
        except KeyError as err:
            raise SecAggError(f"{name}: the upload lacks {err}") from None

    def _words(self, phase: str, section: Section) -> np.ndarray:
        """A masked upload as 32-bit words: packed values (their length checked against the
        schema before a byte was read) unpacked, then the weight word."""
        integer = self.integer(phase)
        if integer is None:
            return section.tensors["y"].numpy().view(np.uint32)
        values = unpack_bits(section.tensors["y"].numpy(), integer.ring,
                             self.rounds[phase].length - 1)
        return np.concatenate([values, section.tensors["weight"].numpy().view(np.uint32)])

    def close(self, name: str, base: Callable[[], Payload] | None = None) -> dict[str, Any]:
        """After each phase. Closing the unmask step unmasks the sum and hands it to the
        aggregator, then closes the masked phase in the aggregator (a round whose protocol
        aborted closes it with nothing: the global state stays as it was). ``base``: the
        masked phase's common downlink (the global the edges' changes are against, under
        integer compression)."""
        step, state = self._round(name)
        phase = self.base_phase(name)
        aggregator = self.aggregator
        if step == ADVERTISE:
            state.close_advertise()
            figures = {"parties": len(state.adverts), "threshold": state.threshold,
                       "degree": min((len(n) for n in state.graph.values()), default=0)}
        elif step == SHARE:
            state.close_share()
            figures = {"shared": len(state.sharers)}
        elif step == RECEIVE:
            state.close_receive()
            reported = state.reported()
            for sender, holders in reported.items():
                log.warning("round %d %s: the shares of edge %s failed authentication at %s: "
                            "it is dropped before masking", state.round, phase, sender,
                            ", ".join(holders))
            figures = {"survivors": len(state.survivors), "reported": reported}
        elif step == "masked":
            state.close_masked()
            figures = {"masked": len(state.masked)}
        elif step == CONFIRM:
            state.close_confirm()
            figures = {"confirmed": len(state.confirmations)}
        else:
            figures = self._unmask(phase, state, aggregator, base or Payload)
            figures.update(aggregator.close_phase(phase))
            return figures
        out = {f"secagg-{step.removeprefix('secagg-')}": figures}
        if state.abort_reason:
            log.warning("round %d %s: secure aggregation aborted: %s", state.round, phase,
                        state.abort_reason)
            out["secagg-aborted"] = state.abort_reason
            out.update(aggregator.close_phase(phase))
        return out

    def _unmask(self, phase: str, state: ServerRound, aggregator: Aggregator,
                base: Callable[[], Payload]) -> dict[str, Any]:
        """Unmask, check the sum against the bounds every honest edge obeys, and hand it to
        the aggregator; any failure aborts the phase's secure aggregation by name (the
        aggregator closes with nothing, the global state stays as it was)."""
        started = time.perf_counter()
        bounds: dict[str, float] = {}
        try:
            values, weight = self._sum(phase, state.unmask(), len(state.masked),
                                       self._stated(phase, state))
            common = base()
            specs = self.masked[phase]
            global_ = base_vector(specs, common)
            bounds = self._bound(phase, values, weight, len(state.masked), global_,
                                 model_mask(specs, common))
            if self.policy.bits:  # the edges masked their change against the global
                reference = (values / weight, weight / len(state.masked))
                values = values + global_ * weight
            aggregator.accept_sum(phase, unflatten_sum(specs, values), weight,
                                  len(state.masked))
            if self.policy.bits:  # only a sum the aggregator took sets the next scales
                self.reference[phase] = reference
        except ValueError as err:  # SecAggError, or the aggregator refusing the sum
            log.warning("round %d %s: secure aggregation aborted: %s", state.round, phase, err)
            figures: dict[str, Any] = {"secagg-aborted": str(err)}
        else:
            seconds = time.perf_counter() - started
            log.info("round %d %s: unmasked the sum of %d edges (%d dropped after masking "
                     "began) in %.3fs", state.round, phase, len(state.masked),
                     len(state.survivors - state.masked), seconds)
            figures = {"secagg-unmask": {"unmasked": len(state.masked),
                                         "recovered_dropouts": len(state.survivors - state.masked),
                                         "unmask_seconds": seconds, **bounds}}
        integer = self.integer(phase)
        if integer is not None and "secagg-unmask" in figures:
            figures["secagg-unmask"].update(ring_bits=integer.ring, bits=integer.bits,
                                            scale_max=float(integer.scales.max(initial=0.0)))
        if state.inconsistent:
            log.warning("round %d %s: revealed shares of %s do not fit the others; set aside",
                        state.round, phase, ", ".join(sorted(state.inconsistent)))
            figures.setdefault("secagg-unmask", {})["inconsistent_reveals"] = sorted(
                state.inconsistent)
        return figures

    def _stated(self, phase: str, state: ServerRound) -> float:
        """The total weight the masked edges stated (each capped at its join declaration)."""
        stated = self.weights.get(phase, {})
        missing = sorted(state.masked - set(stated))
        if missing:  # the gate hands every masked upload's weight over first
            raise SecAggError(f"no stated weight for the masked uploads of {missing[:5]}")
        return math.fsum(stated[e] for e in state.masked)

    def _sum(self, phase: str, total: np.ndarray, count: int,
             stated: float) -> tuple[np.ndarray, float]:
        """(sum_u w_u x_u, sum_u w_u) of an unmasked ring sum, checked against the bounds
        of the round's fixed point and the weights the edges stated in the clear: the
        unmasked weight must be their sum, up to its rounding (SecAggError: nothing is
        aggregated). The weight returned is the stated one."""
        integer = self.integer(phase)
        quantizer = integer.weight_quantizer() if integer is not None else self.quantizer(phase)
        # The weight word is the last in both layouts; checked first, as the most specific.
        masked = float(total[-1:].view(np.int32)[0]) / quantizer.weight_scale
        if abs(masked - stated) > count / quantizer.weight_scale + 1e-9 * stated:
            raise SecAggError(f"the unmasked total weight {masked:.6g} differs from the "
                              f"{stated:.6g} the edges stated in the clear (each capped at its "
                              "join declaration): an edge masked a weight other than the one it "
                              "stated; nothing is aggregated")
        if integer is not None:
            values, _ = integer.dequantize(total, count)
        else:
            values, _ = quantizer.dequantize(total)
            quantizer.check_sum(values, stated, count)
        return values, stated

    def _bound(self, phase: str, values: np.ndarray, weight: float, count: int,
               global_: np.ndarray, model: np.ndarray) -> dict[str, float]:
        """The unmasked mean's change of the global, checked against
        server.secagg_max_update plus the fixed point's rounding (``check_update``:
        SecAggError beyond it). Returns the change's norm and its bound (history)."""
        mean = values / weight
        # Under integer compression the edges masked their change (the mean is the change)
        change = mean if self.policy.bits else mean - global_
        integer = self.integer(phase)
        if integer is not None:  # stochastic rounding: under one level per edge
            per_value = (count * integer.weight_ref / (integer.levels * weight)
                         * np.repeat(integer.scales.astype(np.float64), integer.block)[:mean.size])
        else:  # round to nearest: half a step per edge
            per_value = count / (2 * self.quantizer(phase).scale * weight)
        bound = self.cfg.secagg_update_bound()
        rounding = rounding_norm(per_value, model)
        norm = check_update(change, model, bound, rounding)
        return {"update_norm": norm, "update_bound": bound + rounding}

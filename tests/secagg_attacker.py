"""A real fl-edge process that attacks secure aggregation on chosen rounds.

    python tests/secagg_attacker.py --plan 1:weight,2:garbage,3:tamper -- FL-EDGE ARGS...

It is the real edge daemon (real join, real gRPC, real SecAgg+ client) with its SecAgg
client swapped for a subclass (the daemon builds the client as ``daemon.EdgeSecAgg`` and
hands it to the SecAgg middleware, which answers the protocol steps and masks uploads
through it) that, on the planned rounds, alters what the honest client produced before it
is uploaded:

- ``weight``: adds 2^31 to the weight word of its masked vector (the summed weight
  wraps negative: what crashed the server before the unmask bounds check);
- ``garbage``: uploads random bytes as every encrypted share pair;
- ``tamper``: flips a bit of every share it reveals in the unmask step;
- ``takeover``: adds to its masked value words what makes the unmasked mean ~12 in every
  coordinate (under ``secagg_clip`` 16: the sum check passes), the honest edges' share of
  the sum estimated from its own upload;
- ``claim``: adds to its masked weight word what makes its weight 65,536 (whatever it
  stated), and under integer compression adds L / 2 to every value word (beyond the
  per-edge level L wherever its own passes L / 2; within the sum check, which sees only
  the sum, where the honest levels leave room);
- ``overstate``: masks its upload with weight 65,536 and states the same in its header's
  num_examples (consistently: the middleware's result is altered too);
- ``grow``: adds the global itself to the mean change (the global doubles), shortened to
  0.8 x the run's bound on one round's change where the run config states one: at 32 bits
  ``parties x weight x global`` in fixed point, under integer compression the levels that
  give it at the round's public scales, clamped to L / 2 so the sum check passes even
  where the honest edges' levels saturate.

Every other round it behaves. Each attack is logged as ``ATTACK round N: ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
from pathlib import Path

# Run as a file, like ``python -m fl_edge`` from the repository root: that root first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedattn_shared.privacy.secagg import SHARE, UNMASK, protocol_step  # noqa: E402
from fedattn_shared.privacy.secagg_crypto import CIPHERTEXT_BYTES  # noqa: E402
from fedattn_shared.privacy.secagg_layout import (  # noqa: E402
    base_vector,
    flatten_upload,
    masked_phases,
)
from fedattn_shared.privacy.secagg_ring import (  # noqa: E402
    Quantizer,
    levels,
    pack_bits,
    ring_bits,
    unpack_bits,
)
from fedattn_shared.schema import Kind, Payload, Section  # noqa: E402
from fl_edge import cli, daemon, middleware  # noqa: E402
from fl_edge.secagg import EdgeSecAgg, _request  # noqa: E402

log = logging.getLogger("fl_edge")
ATTACKS = ("weight", "garbage", "tamper", "takeover", "claim", "overstate", "grow")
TAKEOVER_MEAN = 12.0    # under the default secagg_clip 16
CLAIMED_WEIGHT = 65536.0


def bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class AttackingSecAgg(EdgeSecAgg):
    def __init__(self, *args, plan: dict[int, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan  # round -> attack

    def step(self, name: str, round_number: int, personal: Payload) -> Payload:
        upload = super().step(name, round_number, personal)
        attack = self.plan.get(round_number)
        step = protocol_step(name)[0]
        section = upload.sections[0] if upload.sections else None
        if attack == "garbage" and step == SHARE and section is not None:
            log.warning("ATTACK round %d: garbage for all %d encrypted share pairs",
                        round_number, len(section.tensors))
            return Payload([Section(Kind.SECAGG, section.name, {
                k: bytes_tensor(os.urandom(CIPHERTEXT_BYTES)) for k in section.tensors})])
        if attack == "tamper" and step == UNMASK and section is not None:
            log.warning("ATTACK round %d: tampering with all %d revealed shares", round_number,
                        len(section.tensors))
            tampered = {}
            for k, t in section.tensors.items():
                share = t.clone()
                share[-1] ^= 1
                tampered[k] = share
            return Payload([Section(Kind.SECAGG, section.name, tampered)])
        return upload

    def mask(self, round_number, phase, personal, upload, weight, method, models,
             **kwargs) -> Payload:
        if self.plan.get(round_number) == "overstate":
            log.warning("ATTACK round %d: masking with weight %g (stated too)", round_number,
                        CLAIMED_WEIGHT)
            weight = CLAIMED_WEIGHT
        masked = super().mask(round_number, phase, personal, upload, weight, method, models,
                              **kwargs)
        if self.plan.get(round_number) == "weight":
            y = masked.sections[0].tensors["y"].clone()
            y[-1] = (int(y[-1]) + 2**31 + 2**31) % 2**32 - 2**31  # + 2^31 in the ring, as int32
            log.warning("ATTACK round %d: added 2^31 to the masked weight", round_number)
            return Payload([Section(Kind.SECAGG, "masked", {"y": y})])
        attack = self.plan.get(round_number)
        if attack in ("takeover", "claim", "grow"):
            return self.cheat(attack, round_number, phase, personal, upload, weight, method,
                              models, masked, kwargs.get("common"))
        return masked

    def cheat(self, attack, round_number, phase, personal, upload, weight, method, models,
              masked, common) -> Payload:
        """Adds to the masked words (mod the ring) what moves the unmasked mean as the
        attack wants; the masks cancel as before, so the server unmasks the cheat."""
        info, tensors = _request(personal)
        parties = int(info["parties"])
        fixed = Quantizer(float(info["clip"]), float(info["max_weight"]), parties)
        specs = masked_phases(method, models)[phase]
        values = flatten_upload(specs, upload)
        base = base_vector(specs, common) if common is not None else np.zeros(values.size)
        # grow: the change it adds is the global, shortened to 0.8 x the run's bound on one
        # round's change when there is one (staying under every check the server has)
        limit = 0.8 * float(getattr(self.policy, "max_update", 0.0) or 0.0)
        norm = float(np.linalg.norm(base))
        target = base * (limit / norm) if limit and norm > limit else base
        section = masked.sections[0]
        integer = "weight" in section.tensors
        weight_word = 0
        if attack == "claim":
            weight_word = round((CLAIMED_WEIGHT - weight) * fixed.weight_scale)
        if not integer:  # 32 bits: values then the weight, two's complement int32
            words = section.tensors["y"].numpy().view(np.uint32).astype(np.int64)
            if attack == "takeover":  # mean ~ (parties w x + parties w (T - x)) / (parties w)
                words[:-1] += np.rint(fixed.scale * weight * parties
                                      * (TAKEOVER_MEAN - values)).astype(np.int64)
            elif attack == "grow":
                words[:-1] += np.rint(fixed.scale * weight * parties * target).astype(np.int64)
            words[-1] += weight_word
            y = torch.from_numpy((words % 2**32).astype(np.uint32).view("<i4").copy())
            log.warning("ATTACK round %d: %s on the 32-bit masked words", round_number, attack)
            return Payload([Section(Kind.SECAGG, "masked", {"y": y})])
        bits, block = int(info["bits"]), int(info["block"])
        ring, top = ring_bits(bits, parties), levels(bits)
        words = unpack_bits(section.tensors["y"].numpy(), ring, values.size).astype(np.int64)
        if attack == "claim":
            words += top // 2
        elif attack == "grow":
            scales = np.repeat(np.frombuffer(tensors["scales"], "<f4").astype(np.float64),
                               block)[:values.size]
            extra = target * top * parties * weight / (float(info["weight_ref"]) * scales)
            bound = top // 2  # room under the sum check even where honest edges saturate
            words += np.rint(np.clip(extra, -bound, bound)).astype(np.int64)
        packed = pack_bits((words % 2**ring).astype(np.uint32), ring)
        w = section.tensors["weight"].numpy().view(np.uint32).astype(np.int64) + weight_word
        log.warning("ATTACK round %d: %s on the int%d masked words", round_number, attack, bits)
        return Payload([Section(Kind.SECAGG, "masked", {
            "y": torch.from_numpy(packed),
            "weight": torch.from_numpy((w % 2**32).astype(np.uint32).view("<i4").copy())})])


def overstating(plan: dict[int, str]):
    """The SecAgg middleware's ``__call__``, stating CLAIMED_WEIGHT as the masked upload's
    num_examples on the rounds planned ``overstate``."""
    original = middleware.SecureAggregation.__call__

    def call(self, task, next):
        result = original(self, task, next)
        if plan.get(task.round) == "overstate" and result.upload.get(Kind.SECAGG, "masked"):
            return dataclasses.replace(result, num_examples=int(CLAIMED_WEIGHT))
        return result
    return call


def parse_plan(text: str) -> dict[int, str]:
    plan = {}
    for item in filter(None, text.split(",")):
        number, _, attack = item.partition(":")
        if attack not in ATTACKS:
            raise SystemExit(f"secagg_attacker: unknown attack {attack!r} (one of {ATTACKS})")
        plan[int(number)] = attack
    return plan


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="ROUND:ATTACK,... (" + ", ".join(ATTACKS) + ")")
    args, edge_args = parser.parse_known_args(argv)
    plan = parse_plan(args.plan)
    daemon.EdgeSecAgg = functools.partial(AttackingSecAgg, plan=plan)
    middleware.SecureAggregation.__call__ = overstating(plan)
    return cli.main([a for a in edge_args if a != "--"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

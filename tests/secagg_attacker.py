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
- ``tamper``: flips a bit of every share it reveals in the unmask step.

Every other round it behaves. Each attack is logged as ``ATTACK round N: ...``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from pathlib import Path

# Run as a file, like ``python -m fl_edge`` from the repository root: that root first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from fedattn_shared.privacy.secagg import SHARE, UNMASK, protocol_step  # noqa: E402
from fedattn_shared.privacy.secagg_crypto import CIPHERTEXT_BYTES  # noqa: E402
from fedattn_shared.wire.payload import Kind, Payload, Section  # noqa: E402
from fl_edge import cli, daemon  # noqa: E402
from fl_edge.secagg import EdgeSecAgg  # noqa: E402

log = logging.getLogger("fl_edge")
ATTACKS = ("weight", "garbage", "tamper")


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
        masked = super().mask(round_number, phase, personal, upload, weight, method, models,
                              **kwargs)
        if self.plan.get(round_number) == "weight":
            y = masked.sections[0].tensors["y"].clone()
            y[-1] = (int(y[-1]) + 2**31 + 2**31) % 2**32 - 2**31  # + 2^31 in the ring, as int32
            log.warning("ATTACK round %d: added 2^31 to the masked weight", round_number)
            return Payload([Section(Kind.SECAGG, "masked", {"y": y})])
        return masked


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
    parser.add_argument("--plan", required=True, help="ROUND:ATTACK,... (weight, garbage, tamper)")
    args, edge_args = parser.parse_known_args(argv)
    daemon.EdgeSecAgg = functools.partial(AttackingSecAgg, plan=parse_plan(args.plan))
    return cli.main([a for a in edge_args if a != "--"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

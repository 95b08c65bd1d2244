"""Staleness weights for buffered asynchronous aggregation (``fl-server --mode async``).

A result that started from model version ``v`` and reaches a server at version ``t`` has
staleness ``tau = t - v``: the server has applied ``tau`` buffers since the edge downloaded
its model. Its change is scaled by ``s(tau)`` before it joins the buffer. The functions
are those of FedAsync (Xie, Koyejo, Gupta, 2019, https://arxiv.org/abs/1903.03934,
Section 5.2) that FedBuff (Nguyen et al., AISTATS 2022, https://arxiv.org/abs/2106.06639)
uses with ``poly:0.5``:

- ``constant``: s(tau) = 1;
- ``poly:a``: s(tau) = (1 + tau) ** -a, a >= 0;
- ``hinge:a,b``: s(tau) = 1 for tau <= b, else 1 / (a (tau - b) + 1), a >= 0, b >= 0.

Parsed once at configuration time, so a typo is refused (exit 2) before a server starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessWeight:
    """s(tau) of the module doc; ``text`` is the spec it was parsed from."""

    kind: str
    a: float = 0.0
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> StalenessWeight:
        """``constant``, ``poly:A`` or ``hinge:A,B``; ValueError names what is wrong."""
        name, _, args = text.strip().partition(":")
        values = [v.strip() for v in args.split(",")] if args else []
        try:
            numbers = [float(v) for v in values]
        except ValueError:
            raise ValueError(f"staleness weight {text!r}: {args!r} is not a number list") from None
        if any(not (math.isfinite(x) and x >= 0) for x in numbers):
            raise ValueError(f"staleness weight {text!r}: parameters must be finite and >= 0")
        if name == "constant" and not numbers:
            return cls("constant")
        if name == "poly" and len(numbers) == 1:
            return cls("poly", numbers[0])
        if name == "hinge" and len(numbers) == 2:
            return cls("hinge", numbers[0], numbers[1])
        raise ValueError(f"staleness weight {text!r}: expected constant, poly:A or hinge:A,B")

    @property
    def text(self) -> str:
        """The spec as parsed (``poly:0.5``)."""
        if self.kind == "poly":
            return f"poly:{self.a:g}"
        if self.kind == "hinge":
            return f"hinge:{self.a:g},{self.b:g}"
        return "constant"

    def __call__(self, tau: int) -> float:
        """s(tau) for a staleness of ``tau`` >= 0 versions."""
        if tau < 0:
            raise ValueError(f"staleness {tau} < 0")
        if self.kind == "poly":
            return (1.0 + tau) ** -self.a
        if self.kind == "hinge":
            return 1.0 if tau <= self.b else 1.0 / (self.a * (tau - self.b) + 1.0)
        return 1.0

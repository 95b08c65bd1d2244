"""Error-feedback residuals an edge keeps between rounds, one per compressed section.

With ``+ef`` the edge adds last round's residual (what its codec dropped) to this round's
vector before encoding, and keeps ``x + r - decode(encode(x + r))`` for the next round
(``section.encode_section`` computes it). Nothing dropped is lost, only delayed, which is
what makes a biased codec (top-k) converge. The residual is private edge state: it never
travels, and is saved and restored with the edge's other state so a restarted edge does
not forget it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..schema import Kind


def section_key(kind: Kind, name: str) -> str:
    """The key of a section's residual: ``shared_tensors/`` or ``shared_tensors/head``."""
    return f"{kind.label}/{name}"


@dataclass
class Residuals:
    """Section key -> float32 residual vector. A residual whose length no longer matches
    the section's vector (the model changed) is dropped rather than misapplied."""

    vectors: dict[str, torch.Tensor] = field(default_factory=dict)

    def take(self, key: str, n: int) -> torch.Tensor:
        """The residual to add to a vector of ``n`` values: the kept one, or zeros."""
        kept = self.vectors.get(key)
        if kept is None or kept.shape != (n,):
            return torch.zeros(n, dtype=torch.float32)
        return kept

    def keep(self, key: str, residual: torch.Tensor | None) -> None:
        """Keeps what an encoding dropped (``encode_section``'s second result)."""
        if residual is not None:
            self.vectors[key] = residual.detach().to(torch.float32).reshape(-1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals to save (``torch.save``-able; restored by ``from_state``)."""
        return dict(self.vectors)

    @classmethod
    def from_state(cls, state: Mapping[str, object]) -> Residuals:
        """Residuals from a saved ``state_dict``. ValueError naming the key of anything a
        ``state_dict`` does not hold (the file is the edge's own, but may be damaged)."""
        vectors: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if not isinstance(key, str):
                raise ValueError(f"residual key {key!r} is not a string")
            if not (isinstance(value, torch.Tensor) and value.dtype == torch.float32
                    and value.dim() == 1):
                raise ValueError(f"residual {key!r}: not a 1-D float32 tensor")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"residual {key!r}: non-finite values")
            vectors[key] = value
        return cls(vectors)

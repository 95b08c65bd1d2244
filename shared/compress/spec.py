"""``--compress up=CODEC,down=CODEC``: the run's codec for each direction."""

from __future__ import annotations

from dataclasses import dataclass

from .codec import CodecChoice
from .registry import load_codec

DIRECTIONS = ("up", "down")


@dataclass(frozen=True)
class CompressSpec:
    """The codec of each direction, or None (the tensors travel as they are). ``up``
    compresses what edges upload; ``down`` what the server broadcasts."""

    up: CodecChoice | None = None
    down: CodecChoice | None = None

    @classmethod
    def parse(cls, text: str) -> CompressSpec:
        """``""`` or ``none``: no compression. ValueError names the bad part."""
        text = (text or "").strip()
        if text in ("", "none"):
            return cls()
        choices: dict[str, CodecChoice | None] = {}
        for item in text.split(","):
            key, sep, value = item.strip().partition("=")
            if not sep or key not in DIRECTIONS:
                raise ValueError(f"{item.strip()!r} is not up=CODEC or down=CODEC "
                                 "(e.g. up=int8,down=fp16)")
            if key in choices:
                raise ValueError(f"{key}= given twice")
            choices[key] = None if value == "none" else load_codec(value)
        down = choices.get("down")
        if down is not None and down.feedback:
            raise ValueError("down= takes no +ef: the downlink already codes the "
                             "change against what each edge holds, which carries the residual")
        return cls(up=choices.get("up"), down=down)

    @property
    def text(self) -> str:
        """The canonical form (what the run config sends to the edges): ``""`` for none."""
        return ",".join(f"{key}={choice.spec}" for key, choice in
                        (("up", self.up), ("down", self.down)) if choice is not None)

    def __bool__(self) -> bool:
        return self.up is not None or self.down is not None

"""The schedules, by the ``--mode`` name that picks one: a new mode is one file here and
one name in ``SCHEDULES`` (the engine never asks which it holds; ``base.Schedule`` is the
interface, ``context.RunContext`` all a schedule sees of the server)."""

from __future__ import annotations

from .base import Schedule
from .buffered import Buffered
from .context import RunContext
from .rounds import Rounds

SCHEDULES: dict[str, type[Schedule]] = {
    "sync": Rounds,      # rounds of the plan, a quorum or deadline per phase
    "async": Buffered,   # FedBuff: versions of a buffer of --buffer results
}


def schedule_for(mode: str, run: RunContext) -> Schedule:
    """The schedule ``mode`` names, on ``run`` (ValueError: no such mode, or one the
    method cannot run, naming why)."""
    if mode not in SCHEDULES:
        raise ValueError(f"--mode {mode!r}: not one of {', '.join(SCHEDULES)}")
    return SCHEDULES[mode](run)


__all__ = ["SCHEDULES", "RunContext", "Schedule", "schedule_for"]

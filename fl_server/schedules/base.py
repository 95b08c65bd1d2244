"""The schedule interface: what decides when phases open and close and which edge gets
which task. The engine holds one and never asks which (``schedules.SCHEDULES`` picks it
by ``--mode``); the servicer reaches it through the engine.

A schedule sees the server only through its ``RunContext``. It is the only thing that
opens and closes phases (``RunContext.open`` / ``close``); a task is dropped by its
schedule (``lose``, a deadline, a superseded task) or, through ``RunContext.drop``, by the
servicer for what the edge sent or pulled (a bad upload, the re-delivery limit).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from fedattn_shared.wire import fedattn_pb2 as pb

from ..phase import Phase, Task
from .context import RunContext


class Schedule(ABC):
    """One way of running the rounds (module doc). ``phase`` is the phase every edge's
    results go to while one is open (the synchronous round's; None when each task names
    its own, as the buffered mode's): a refusal that names no phase costs the edge its
    task there."""

    def __init__(self, run: RunContext):
        self.ctx = run
        self.phase: Phase | None = None

    @abstractmethod
    async def run(self) -> None:
        """Runs until ``--rounds`` rounds (versions) are applied and recorded."""

    @abstractmethod
    def task_for(self, edge: str) -> tuple[Phase, Task] | None:
        """The edge's task now, if any (its NextTask): may hand out new work."""

    @abstractmethod
    def task_of(self, edge: str, task_id: int) -> tuple[Phase, Task] | None:
        """The edge's pending task ``task_id``, if it still is (a download's
        continuation); no side effect."""

    @abstractmethod
    def has_work(self, edge: str) -> bool:
        """Whether ``task_for`` would hand the edge a task now; no side effect (the
        presence stream's hint asks for every event)."""

    @abstractmethod
    def phase_for(self, header: pb.SubmitHeader) -> Phase | None:
        """The open phase an upload's header names, or None (``Refused``: by name)."""

    @abstractmethod
    def lose(self, edge: str, reason: str) -> None:
        """The edge's session ended: its pending tasks are dropped for ``reason``."""

    def decline(self, edge: str, reason: str) -> None:
        """The edge declines work now ("not now", ``TaskRequest.decline``; the servicer
        asks only when ``has_work``): its pending tasks are dropped for ``reason``, no fault
        of the edge. After it ``has_work`` must stay False until something new is offered
        (a later phase or round), so an edge is never offered the same work in a loop."""
        self.lose(edge, reason)

    async def taken(self, phase: Phase) -> None:
        """After each upload the gate took into ``phase``, still under ``agg_lock``;
        nothing by default."""
        return None


class OnePhase(Schedule):
    """The servicer's answers for a schedule with at most one phase open at a time
    (``self.phase``, which the subclass's ``run`` opens and closes): a task is the edge's
    pending one there, and an upload is for it."""

    def task_for(self, edge: str) -> tuple[Phase, Task] | None:
        """The edge's pending task in the open phase."""
        phase = self.phase
        if phase is None or phase.closed or not phase.is_pending(edge):
            return None
        return phase, phase.tasks[edge]

    def task_of(self, edge: str, task_id: int) -> tuple[Phase, Task] | None:
        """The edge's pending task, when it is ``task_id``."""
        found = self.task_for(edge)
        return found if found is not None and found[1].task_id == task_id else None

    def has_work(self, edge: str) -> bool:
        """``task_for`` has no side effect here."""
        return self.task_for(edge) is not None

    def phase_for(self, header: pb.SubmitHeader) -> Phase | None:
        """The open phase, whatever the header names (the gate checks the name)."""
        return self.phase

    def lose(self, edge: str, reason: str) -> None:
        """The edge's task in the open phase, if pending, is dropped."""
        phase = self.phase
        if phase is not None and not phase.closed and phase.is_pending(edge):
            self.ctx.drop(phase, edge, reason)

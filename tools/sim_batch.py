"""``fl-sim --batch-edges N``: the edges one worker hosts meet here to train together.

Each hosted edge is still a full ``EdgeDaemon`` thread; its ``TaskRunner`` calls
``EdgeSlot.train`` instead of ``train_local``. An edge whose method and options allow a
batched step (``fl_tools.sim_batched.batch_refusal``) waits here for the round's other edges
of the same kind (``group_key``): a group starts once every slot is taken or no edge has
joined it for ``window`` seconds, and one vmapped computation (``train_batched``) trains
it. Any other edge, and a group whose batched run fails, trains through ``train_local``,
the reason logged once per reason.

Each edge has a fixed slot (its index among the worker's edges, modulo the width): an
edge's rounding depends on its slot and the width only, never on which other edges
shared its group or when they arrived, so a run is bit-identical to a rerun with the same
``--batch-edges`` and ``--procs`` (``fl_tools.sim_batched``). Two edges of one slot never share
a group: the later one waits for the next.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from fedattn_shared.augment import InputPipeline
from fl_edge.trainer import TrainResult, train_local
from fl_tools.sim_batched import EdgeJob, batch_refusal, group_key, train_batched

log = logging.getLogger("fl_sim")


@dataclass
class _Waiting:
    job: EdgeJob
    key: tuple
    taken: bool = False  # in a group that a thread trains
    outcome: TrainResult | str | None = None  # the result, or why to train sequentially


class EdgeBatcher:
    """The rendezvous of one process's edges (one per fl-sim worker)."""

    def __init__(self, width: int, window: float = 0.5):
        if width < 1:
            raise ValueError(f"--batch-edges must be >= 1, got {width}")
        self.width, self.window = width, window
        self._lock = threading.Condition()
        self._queue: list[_Waiting] = []
        self._arrived = 0.0
        self._told: set[str] = set()

    def slot(self, index: int) -> EdgeSlot:
        """What the edge at ``index`` among the worker's edges is given (``EdgeOptions.batcher``)."""
        return EdgeSlot(self, index % self.width)

    def tell(self, reason: str) -> None:
        """Logs why an edge trained sequentially, once per reason."""
        with self._lock:
            if reason in self._told:
                return
            self._told.add(reason)
        log.warning("--batch-edges: trained sequentially: %s", reason)

    def run(self, job: EdgeJob, device: torch.device, amp: bool) -> TrainResult | str:
        """The job's result from a batched group, or why it must train sequentially."""
        me = _Waiting(job, (str(device), amp, *group_key(job)))
        with self._lock:
            self._queue.append(me)
            self._arrived = time.monotonic()
            self._lock.notify_all()
            while not me.taken:
                group = self._group(me)
                quiet = time.monotonic() - self._arrived
                if len(group) == self.width or quiet >= self.window:
                    for entry in group:  # this thread trains them: the others wait below
                        entry.taken = True
                        self._queue.remove(entry)
                    break
                self._lock.wait(self.window - quiet)
            else:
                while me.outcome is None:
                    self._lock.wait()
                return me.outcome
        try:
            results: list[TrainResult | str] = list(
                train_batched([w.job for w in group], self.width, device, amp))
        except Exception as err:  # noqa: BLE001 - vmap refused an op, a loss diverged, ...:
            # nothing was written, so every edge of the group trains sequentially, where an
            # edge that fails fails by itself, as without the option
            results = [f"the batched run failed ({type(err).__name__}: {err})"] * len(group)
        with self._lock:
            for entry, outcome in zip(group, results, strict=True):
                entry.outcome = outcome
            self._lock.notify_all()
        return me.outcome

    def _group(self, me: _Waiting) -> list[_Waiting]:
        """``me`` and the earliest waiting edges of its kind, one per slot."""
        group, taken = [me], {me.job.slot}
        for entry in self._queue:
            if entry is not me and entry.key == me.key and entry.job.slot not in taken:
                group.append(entry)
                taken.add(entry.job.slot)
        return group


class EdgeSlot:
    """One edge's way into its process's ``EdgeBatcher``, with ``train_local``'s signature."""

    def __init__(self, batcher: EdgeBatcher, slot: int):
        self.batcher, self.slot = batcher, slot

    def train(self, algo: Any, data: Any, epochs: int, batch_size: int, seed: int,
              device: torch.device, progress: bool | None = None, lr: float | None = None,
              amp: bool = False, grad_accum: int = 1, privacy: Any = None,
              clip_grad_norm: float = 0.0, **rest: Any) -> TrainResult:
        """``train_local``, batched with other edges where ``batch_refusal`` allows."""
        sequential = dict(progress=progress, lr=lr, amp=amp, grad_accum=grad_accum,
                          privacy=privacy, clip_grad_norm=clip_grad_norm, **rest)
        reason = batch_refusal(algo, amp, grad_accum, privacy, clip_grad_norm, device)
        if reason is None:
            job = EdgeJob(algo, data, epochs, batch_size, seed, lr, rest.get("inputs") or InputPipeline(),
                          rest.get("on_step"), self.slot, rest.get("augment_rng"))
            outcome = self.batcher.run(job, device, amp)
            if isinstance(outcome, TrainResult):
                return outcome
            reason = outcome
        self.batcher.tell(reason)
        return train_local(algo, data, epochs, batch_size, seed, device, **sequential)

"""The edge's state writes: atomic, failing loudly, and some of them behind the upload.

Apart from the store (which owns the file formats) because the policy is the daemon's:
a write that fails ends the edge with the state dir named (the old files stay intact),
and a write may overlap the upload as long as it is finished before the next task.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from fedattn_shared.state import StateError

from .metrics import EdgeMetrics
from .options import EdgeExit
from .store import PrivateStore


class StateWriter:
    """Writes the edge's state files through ``store``. Synchronous writes (the ledger, the
    run config) happen before anything that depends on them leaves the edge; writes behind
    (the private state, the global) overlap the upload and are flushed before the next
    task and before the session ends."""

    def __init__(self, store: PrivateStore, state_dir: Path, metrics: EdgeMetrics):
        self.store = store
        self.state_dir = state_dir
        self.metrics = metrics
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")
        self.pending: list[Future] = []
        #: Wraps each write and flush: fl-edge sets it to its stop signals' ``deferred``
        #: (fl_edge.supervision), so that SIGTERM waits for a write instead of cutting it.
        self.critical: Callable[[], AbstractContextManager] = nullcontext

    def write(self, save: Callable, *args) -> None:
        """State writes are atomic: on a read-only or full disk the old files stay intact
        and the edge stops with the path named rather than training on without a record."""
        try:
            with self.critical():
                save(*args)
        except (OSError, StateError) as err:
            raise EdgeExit(2, f"cannot write state under {self.state_dir}: {err} "
                              "(the previous state files are intact)") from None
        if save == self.store.save:
            self.metrics.private_state_bytes.set(self.store.path.stat().st_size)

    def write_behind(self, save: Callable, *args) -> None:
        """A state write that overlaps the upload. What it saves stays untouched until
        ``flush``, which runs before the next task and before the session ends."""
        self.pending.append(self.pool.submit(self.write, save, *args))

    def flush(self) -> None:
        """Waits for the writes behind; re-raises the first one's ``EdgeExit``."""
        with self.critical():
            writes, self.pending = self.pending, []
            for write in writes:
                write.result()

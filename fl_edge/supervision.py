"""Stopping on a supervisor's signal: SIGTERM (docker stop, systemd, Kubernetes) and SIGINT
end the edge cleanly, never in the middle of a state write.

As a container's first process (PID 1) the edge gets no default action for SIGTERM: the
kernel drops a signal that PID 1 has no handler for, so without this the edge ignores
``docker stop`` until it is killed, mid-write, without telling the server. With it, the
signal raises ``Stopped`` in the main thread wherever it runs (a long poll, training,
a backoff sleep) so the daemon can wait for its state writes and send Leave; inside a
``deferred()`` section (a state write, waiting for the writes behind the upload) the
signal is held and raised as the section ends, so a save is never cut halfway.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("fl_edge")

#: The signals that stop the edge.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """A stop signal arrived. A BaseException, like KeyboardInterrupt, so that no handler
    of ordinary errors on the way up takes it for a failure of the task."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class StopSignals:
    """The handler of the stop signals for one process (installed from the main thread).
    ``Stopped`` is raised once; a second signal while stopping is logged and ignored (the
    supervisor's kill timeout is the bound)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._depth = 0          # nesting of deferred() sections in the main thread
        self._raised = False
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        """Installs the handlers; from a thread other than the main one (an fl-edge run
        inside a test or a tool) there is nothing to install: signals go to the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        """Puts the handlers back as they were (a caller in the same process, a test)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame) -> None:
        if self.received is not None:
            log.warning("%s while stopping: still finishing the state writes and the Leave",
                        signal.Signals(signum).name)
            return
        self.received = signum
        log.info("%s: stopping after the state writes in progress", signal.Signals(signum).name)
        if self._depth == 0:
            self._raise()

    def _raise(self) -> None:
        if self.received is not None and not self._raised:
            self._raised = True
            raise Stopped(self.received)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A section a stop signal must not cut: it is raised as the section ends. Only
        the main thread is concerned (signal handlers run there); elsewhere a no-op."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0:
            self._raise()

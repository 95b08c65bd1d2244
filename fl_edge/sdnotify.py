"""systemd's service notifications (``Type=notify``, ``WatchdogSec=``), spoken directly:
one datagram per message on the unix socket named by ``$NOTIFY_SOCKET`` (sd_notify(3)),
so no dependency. Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op.

The watchdog pings only while the edge's own health endpoint says it makes progress
(``GET /healthz`` on its ``--metrics-port`` answers 200; 503 means stuck): systemd then
restarts an edge whose training or connection hangs, not just one whose process died.
Without a metrics endpoint it pings while the process runs.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

log = logging.getLogger("fl_edge")


def notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Sends ``message`` (e.g. ``READY=1``, ``WATCHDOG=1``, ``STOPPING=1``) to systemd;
    False when not under systemd or when the socket refuses it."""
    env = os.environ if env is None else env
    address = env.get("NOTIFY_SOCKET", "")
    if not address or address[0] not in "/@":
        return False
    if address[0] == "@":  # an abstract socket: its name starts with a NUL byte
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # Never blocks: a listener that stops reading (its queue holds a few datagrams)
            # must not stall the edge's shutdown or its watchdog thread.
            sock.sendto(message.encode(), socket.MSG_DONTWAIT, address)
        return True
    except BlockingIOError:
        log.debug("systemd notification %r dropped: the listener's queue is full", message)
        return False
    except OSError as err:
        log.warning("systemd notification %r not sent: %s", message, err)
        return False


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between pings: half the unit's ``WatchdogSec`` (``$WATCHDOG_USEC``), as
    sd_watchdog_enabled(3) advises; None when systemd asks for no watchdog (or asks it of
    another process: ``$WATCHDOG_PID``)."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2e6


def healthz_ok(port: int, timeout: float = 5.0) -> bool:
    """The edge's health endpoint answers 200 (making progress)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=timeout) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Watchdog:
    """A daemon thread that sends ``WATCHDOG=1`` every ``interval`` seconds while
    ``healthy()`` holds, and stops pinging (so that systemd restarts the edge) when not."""

    def __init__(self, interval: float, healthy: Callable[[], bool],
                 env: Mapping[str, str] | None = None):
        self.interval, self.healthy, self.env = interval, healthy, env
        self.stopped = threading.Event()
        # Held across "stopped?" and the ping: once stop() has set ``stopped`` under it, no
        # ping can follow (a health check in progress when the edge stops would otherwise
        # ping after its STOPPING=1, which a supervisor reads as alive again).
        self._pinging = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)

    def start(self) -> Watchdog:
        """Starts pinging (the first ping at once: systemd counts from READY=1)."""
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stops pinging: no ping is sent after this returns. Waits for a health check in
        progress to return."""
        with self._pinging:
            self.stopped.set()
        self.thread.join(timeout=self.interval + 10)

    def _run(self) -> None:
        warned = False
        while not self.stopped.is_set():
            if self.healthy():
                with self._pinging:
                    if self.stopped.is_set():
                        return
                    notify("WATCHDOG=1", self.env)
                warned = False
            elif not warned:
                log.warning("health check failing: not pinging the systemd watchdog")
                warned = True
            self.stopped.wait(self.interval)


def edge_health(metrics_port: Callable[[], int | None]) -> Callable[[], bool]:
    """The watchdog's test for an edge: its /healthz once the metrics endpoint is up (the
    port is known), alive until then."""
    def healthy() -> bool:
        port = metrics_port()
        return True if port is None else healthz_ok(port)
    return healthy

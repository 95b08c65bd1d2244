"""The edge's health as a supervisor reads it: ``GET /healthz`` beside ``/metrics`` on
``--metrics-port``.

Why not ``/metrics``: it answers as long as the HTTP thread runs, also while training
hangs on a wedged GPU or a dead NFS mount. ``/healthz`` answers 200 with what the edge
is doing and when it last moved, and 503 once a task has made no progress for
``--health-stall-seconds`` (sized generously by default: a slow board's slowest step,
not a round). Progress is what the edge does between states: a training batch, an
upload, a new state. Waiting for the server (``idle``) is not a stall: a quiet server is
the server's business, and its own health check says so.

The JSON (the contract the Dockerfiles, the systemd watchdog and the Helm probes use)::

    {"state": "joining|idle|declining|training|evaluating|<phase>|uploading|reconnecting|done",
     "last_task_at": unix time or null, "last_progress_at": unix time or null,
     "last_error": text or null, "stall_seconds": the bound}
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

#: States in which a task is in progress: only there does a lack of progress mean stuck.
BUSY = frozenset({"training", "evaluating", "uploading", "working"})


class EdgeHealth:
    """What the edge is doing and when it last made progress. Written by the daemon's
    thread (states) and the training loop (``progress`` after every batch: one clock read
    and one attribute store, no lock), read by the HTTP thread."""

    def __init__(self, stall_seconds: float = 1800.0):
        if not stall_seconds > 0:
            raise ValueError(f"--health-stall-seconds must be > 0, got {stall_seconds}")
        self.stall_seconds = stall_seconds
        self.state = "starting"
        self.last_task_at: float | None = None
        self.last_progress_at: float | None = time.time()
        self.last_error: str | None = None

    def set(self, state: str) -> None:
        """A new state is progress; a task's first state stamps ``last_task_at``."""
        now = time.time()
        if state in BUSY and self.state not in BUSY:
            self.last_task_at = now
        self.state, self.last_progress_at = state, now

    def progress(self) -> None:
        """The current task moved (a training batch finished)."""
        self.last_progress_at = time.time()

    def error(self, message: str) -> None:
        """The last error the edge met (kept, cut to 500 characters, until the next)."""
        self.last_error = message[:500]

    def report(self, now: float | None = None) -> tuple[int, dict]:
        """(HTTP status, JSON body): 503 while a task has not moved for the bound."""
        now = time.time() if now is None else now
        state, progress = self.state, self.last_progress_at
        stuck = state in BUSY and progress is not None and now - progress > self.stall_seconds
        body = {"state": state, "last_task_at": self.last_task_at, "last_progress_at": progress,
                "last_error": self.last_error, "stall_seconds": self.stall_seconds}
        if stuck:
            body["stuck_for"] = round(now - progress, 1)
        return (503 if stuck else 200), body


def serve(port: int, registry: CollectorRegistry, health: EdgeHealth,
          host: str = "") -> ThreadingHTTPServer:
    """``/metrics`` (Prometheus text) and ``/healthz`` on ``port`` (0: any free one), from
    a daemon thread. Requests are GETs of two fixed paths; nothing is read from a body."""

    class Handler(BaseHTTPRequestHandler):
        # A client that opens a connection and sends nothing holds its thread 10 s at most.
        timeout = 10

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                status, body, kind = 200, generate_latest(registry), CONTENT_TYPE_LATEST
            elif path == "/healthz":
                status, report = health.report()
                body, kind = json.dumps(report).encode(), "application/json"
            else:
                status, body, kind = 404, b"not found: /metrics or /healthz\n", "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002
            """Scrapes are not logged (one every few seconds)."""

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="edge-metrics", daemon=True).start()
    return server

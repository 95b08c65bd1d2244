"""The edge daemon: join, keep presence, long-poll for tasks, run them, stream results
back; reconnect with backoff whenever the server is away.

This module is the wiring and the retry loop only. The parts, each in its own module:
``session`` (the gRPC channel and the five calls, the downlink cap and cache), ``run``
(the method, data and DP-SGD built once from the server's configuration, after holding it
to the edge's own rules: a refusal ends the edge with status 2, naming the setting),
``tasks`` (a handler per phase returning one ``Result``), ``middleware`` (initial
weights, SecAgg+, DP-SGD around every task), ``writer`` (atomic state writes, some behind
the upload), ``metrics``. The model stays resident across rounds; private state is written
atomically after every local training, before the next task.
"""

from __future__ import annotations

import logging
import random
import tempfile
import time

import grpc
import torch
from prometheus_client import CollectorRegistry

from fedattn_shared.state import StateError
from fedattn_shared.tls import edge_credentials
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import ByteMeter
from fedattn_shared.wire.payload import WireError

from .caps import LinkCaps
from .health import EdgeHealth, serve
from .heterogeneity import Disconnected, Dropout, Throttle
from .memory import DeviceMemoryError
from .metrics import EdgeMetrics
from .middleware import edge_middleware
from .options import EdgeExit, EdgeOptions
from .run import RUN_CAP_WHY, EdgeRun, build_run
from .secagg import EdgeSecAgg
from .session import RETRYABLE, Received, Rejoin, Session
from .store import PrivateStore, load_or_create_identity, load_or_create_signing_key
from .supervision import Stopped
from .tasks import TaskRunner
from .telemetry import DeviceTelemetry
from .writer import StateWriter

__all__ = ["EdgeDaemon", "EdgeExit", "EdgeOptions", "pick_device"]

log = logging.getLogger("fl_edge")

#: Seconds an idle edge waits for a task_ready hint before it asks anyway: the presence
#: stream repeats the answer every ten seconds, so this only covers a stream that stalls
#: without ending (its end wakes the wait at once).
HINT_FALLBACK_POLL = 60.0

#: torch's error for an op without a deterministic kernel under strict determinism.
NONDETERMINISTIC = "does not have a deterministic implementation"


def pick_device(name: str) -> torch.device:
    """``--device``: auto takes CUDA when there is one; an absent CUDA is refused at start."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise EdgeExit(2, "--device cuda: no CUDA device is available")
    return torch.device(name)


class EdgeDaemon:
    """One edge process (or one fl-sim thread): its identity and state dir, its session
    with the server, and the run the server configured. ``run()`` returns 0 when the
    server ends the run and raises ``EdgeExit`` for everything else."""

    def __init__(self, options: EdgeOptions):
        self.opts = options
        self.device = pick_device(options.device)
        self.credentials = self._tls(options)
        try:
            self.identity = load_or_create_identity(options.state_dir, options.name)
            self.signing_key = load_or_create_signing_key(options.state_dir)
            # Fail at start, not after the first round of training, if state cannot be saved.
            with tempfile.NamedTemporaryFile(dir=options.state_dir, prefix=".write-check-"):
                pass
        except (StateError, OSError) as err:
            raise EdgeExit(2, f"state dir {options.state_dir}: {err}") from None
        self.store = PrivateStore(options.state_dir)
        self.secagg = EdgeSecAgg(options.state_dir, self.identity.edge_id, self.signing_key)
        self.registry = CollectorRegistry()
        self.meter = ByteMeter(self.registry)
        self.metrics = EdgeMetrics(self.registry)
        self.metrics.info.labels(self.identity.edge_id, str(self.device)).set(1)
        self.health = EdgeHealth(options.health_stall_seconds)
        self.telemetry = DeviceTelemetry(self.registry, self.device)
        if self.device.type == "cuda" and options.gpu_memory_fraction is not None:
            # The device's share of its GPU (a Jetson shares its memory with the OS):
            # beyond it the allocator raises out-of-memory, which training backs off from.
            torch.cuda.set_per_process_memory_fraction(options.gpu_memory_fraction, self.device)
        self.writer = StateWriter(self.store, options.state_dir, self.metrics)
        try:  # the device's --max-rate and data budget (its counts survive a restart)
            self.caps = LinkCaps(self.registry, options.state_dir, options.max_rate,
                                 options.budgets)
        except (StateError, ValueError) as err:
            raise EdgeExit(2, f"link caps: {err}") from None
        self.session = Session(options, self.credentials, self.device, self.identity,
                               self.signing_key, self.meter, self.metrics, self._keep_common,
                               # the transport's hot path is untouched without a cap
                               caps=self.caps if self.caps.active else None,
                               critical=lambda: self.writer.critical())
        self.run_state: EdgeRun | None = None
        self.runner: TaskRunner | None = None
        self.metrics_port: int | None = None
        self.idle = False  # the server's last answer was WAIT: wait for a hint before asking
        # When the server stopped answering (the first failed call of an outage; None while
        # it answers): --retry-for counts from it, and the next join says the server is back.
        self.unreachable_since: float | None = None
        self.ever_joined = False
        # One generator for the process's life: reconnects continue its pattern.
        self.dropout = (Dropout(options.disconnect, options.offline_seconds,
                                self.identity.edge_id, options.disconnect_seed)
                        if options.disconnect > 0 else None)

    @staticmethod
    def _tls(options: EdgeOptions):
        """Mutual TLS credentials; the certificate names the edge and carries its token."""
        if options.tls_dir is None:
            return None
        try:
            credentials, token, certified = edge_credentials(options.tls_dir)
        except StateError as err:
            raise EdgeExit(2, str(err)) from None
        if options.name and options.name != certified:
            raise EdgeExit(2, f"--name {options.name}: the certificate in "
                              f"{options.tls_dir} is for edge {certified}")
        options.name = certified
        options.join_token = token  # under mutual TLS the join carries the enrollment token
        return credentials

    def _keep_common(self, manifest: pb.PayloadManifest, buffer: bytearray) -> None:
        self.writer.write_behind(self.store.save_global, manifest, buffer)

    # ---- lifecycle --------------------------------------------------------------------
    def run(self) -> int:
        """Sessions until the server ends the run; a lost server is retried with jittered
        exponential backoff (for ``retry_for`` seconds at most), a refusal is not."""
        if self.opts.metrics_port >= 0:
            server = serve(self.opts.metrics_port, self.registry, self.health)
            self.metrics_port = server.server_port
            log.info("metrics on :%d (health on /healthz)", self.metrics_port)
        backoff = 0.5
        while True:
            try:
                self._session()
                return 0
            except Rejoin:
                log.warning("the server no longer knows this edge's session (it restarted, "
                            "or ended the session); joining again")
                continue
            except Disconnected as drop:
                self._reboot(drop)
                continue
            except WireError as err:
                raise EdgeExit(2, f"server {self.opts.server} sent a task this edge refuses: "
                                  f"{err}") from None
            except grpc.RpcError as err:
                self.health.set("reconnecting")
                self.health.error(f"server call failed: {err.code() if hasattr(err, 'code') else err}")
                if self.unreachable_since is None:  # a new outage: back off from the start
                    self.unreachable_since, backoff = time.monotonic(), 0.5
                time.sleep(self._retry_delay(err, backoff, self.unreachable_since))
                backoff = min(backoff * 2, self.opts.max_backoff)
                continue
            finally:
                self.metrics.connected.set(0)

    def _reboot(self, drop: Disconnected) -> None:
        """After a simulated disconnect (``--disconnect``): offline for its seconds, then
        back as a rebooted device, everything of the run rebuilt from the state on disk
        (the lost task's writes were never made) at the next join."""
        log.warning("%s", drop)
        self.metrics.connected.set(0)
        time.sleep(drop.offline)
        self.run_state, self.runner = None, None
        self.secagg = EdgeSecAgg(self.opts.state_dir, self.identity.edge_id, self.signing_key)

    def _retry_delay(self, err: grpc.RpcError, backoff: float, since: float) -> float:
        """How long to wait before the next attempt, or the EdgeExit that ends the tries."""
        code = err.code() if hasattr(err, "code") else None
        if code not in RETRYABLE:
            raise EdgeExit(2, f"server refused: {code.name if code else ''} "
                              f"{err.details() if hasattr(err, 'details') else err}") from None
        now = time.monotonic()
        if self.opts.retry_for and now - since > self.opts.retry_for:
            raise EdgeExit(1, f"server {self.opts.server} unreachable for "
                              f"{now - since:.0f}s; giving up") from None
        delay = backoff * (0.5 + random.random())
        log.warning("server %s unavailable (%s); retrying in %.1fs", self.opts.server,
                    code.name if code else err, delay)
        self.metrics.connected.set(0)
        self.metrics.retries.labels(code.name if code else "UNKNOWN").inc()
        return delay

    def _session(self) -> None:
        """One connection: join, then tasks until the server says the run is over."""
        with self.session.connect():
            self.health.set("joining")
            self._join()
            self.idle = False
            try:
                with self.session.presence():
                    self.health.set("uploading")
                    # What a previous connection or process left: on from the bytes the
                    # server holds, or whole when only an async version can still take it.
                    run = self.run_state
                    if self.session.resume_pending(run is not None and run.asynchronous):
                        self.caps.task_done()
                    while True:
                        received = self._next_task()
                        status = received.header.status
                        if status == pb.TaskHeader.DONE:
                            self.health.set("done")
                            log.info("server says the run is over")
                            self.session.leave("run finished")
                            return
                        if status == pb.TaskHeader.TASK:
                            self._handle(received)
            except Stopped as stop:
                # A supervisor's SIGTERM: the state writes finish (an accepted upload's
                # private state included), then the server hears that the edge is gone.
                self.writer.flush()
                self.session.leave(str(stop))
                log.info("left the run (%s)", stop)
                raise
            finally:
                self.writer.flush()
                self.caps.save()

    def _join(self, state_fingerprint: str | None = None) -> None:
        """Joins (a new session); a new configuration builds the run. ``state_fingerprint``:
        what the join says of the private state, when it repeats an earlier join of this
        session's start."""
        run = self.run_state
        if state_fingerprint is None:
            state_fingerprint = run.fingerprint if run else (self.store.stored_fingerprint() or "")
        reply = self.session.join(state_fingerprint, len(run.data.train) if run else None)
        if reply.config_json != (run.config_json if run else None):
            try:
                self._setup(reply.config_json, reply.fingerprint)
            except EdgeExit as err:
                # The server hears why (its history records it) rather than a silent drop;
                # a reason it should not hear (local paths, data) is left to the edge's log.
                self.session.leave((err.tell_server or f"the edge stopped with status "
                                    f"{err.code}; its log says why")[:500])
                raise
            if run is None:
                # The training split depends on the server's configuration, known only now:
                # join again to declare its size (the new session replaces this one), saying
                # the same of the private state (none: the server sends initial weights).
                self._join(state_fingerprint)
                return
        self.metrics.connected.set(1)
        if self.ever_joined and self.unreachable_since is not None:
            log.info("joined %s again as %s after %.0fs without it (the server restarted, or "
                     "the network was down)", self.opts.server, self.identity.edge_id,
                     time.monotonic() - self.unreachable_since)
        else:
            log.info("joined %s as %s (method %s)", self.opts.server, self.identity.edge_id,
                     self.run_state.method.name)
        self.ever_joined, self.unreachable_since = True, None

    def _setup(self, config_json: str, fingerprint: str) -> None:
        """The run the server's configuration describes (``fl_edge.run``), and the task
        runner with its middleware for it."""
        run = build_run(config_json, fingerprint, self.opts, self.device, self.store,
                        self.writer, self.metrics)
        self.secagg.policy = run.secagg
        self.session.limit_downlinks(run.downlink_cap, RUN_CAP_WHY)
        layers = edge_middleware(run, self.secagg, self.store, self.writer, self.metrics,
                                 self.session.leave)
        # Simulated heterogeneity around all of it (fl_edge.heterogeneity).
        if self.opts.throttle > 1:
            layers.insert(0, Throttle(self.opts.throttle))
        if self.dropout is not None:
            layers.insert(0, self.dropout)
        self.runner = TaskRunner(run, self.opts, self.device, self.identity.edge_id,
                                 self.metrics, self.store, self.writer, layers, self.health,
                                 self.telemetry)
        self.run_state = run

    def _next_task(self) -> Received:
        """The next task, once the last one's state writes are on disk. With the server's
        task hints, an edge that was told to wait holds no call: it waits for its presence
        stream's ``task_ready`` (or ``HINT_FALLBACK_POLL`` seconds, should a hint be lost),
        then asks once; otherwise it long-polls."""
        self.writer.flush()
        self.health.set("idle")
        if not self.session.task_hints:
            return self.session.next_task(decline=self._decline())
        if self.idle:
            self.session.task_ready.wait(HINT_FALLBACK_POLL)
        # Cleared before asking: a hint that arrives from here on is about a state the
        # question may not have seen, and makes the next wait return at once.
        self.session.task_ready.clear()
        received = self.session.next_task(no_wait=True, decline=self._decline())
        self.idle = received.header.status == pb.TaskHeader.WAIT
        return received

    def _decline(self) -> int:
        """The "not now" the next task request carries (``pb.Decline``; 0: none): while
        the data budget cannot take another task, the server gives the task up without
        holding it against the edge (``fl_edge.caps``)."""
        if self.caps.decline() is None:
            return pb.DECLINE_UNSPECIFIED
        self.health.set("declining")
        return pb.DECLINE_DATA_BUDGET

    def _handle(self, received: Received) -> None:
        """Runs a task and submits its result. Training that diverges (a non-finite loss)
        ends the edge: it leaves first, so the server drops the task at once, records why
        and stops counting the edge, instead of waiting for it until the round times out
        (or, with every edge required, for ever). Nothing of the failed task was written:
        a restarted edge resumes from its state before it."""
        phase = received.header.phase
        self.health.set({"train": "training", "evaluate": "evaluating"}.get(phase, "working"))
        try:
            result = self.runner(received.header, received.common, received.personal)
        except FloatingPointError as err:
            reason = f"training diverged in round {received.header.round}: {err}"
            self.health.error(reason)
            self.session.leave(reason)  # the server keeps its first 200 characters
            raise EdgeExit(1, reason) from None
        except (DeviceMemoryError, RuntimeError) as err:
            # Status 2: a supervisor must not restart into the same error. The model does
            # not fit with one sample per pass (fl_edge.memory halved down to it), or
            # train.deterministic on CUDA met an op without a deterministic kernel.
            if not isinstance(err, DeviceMemoryError) and NONDETERMINISTIC not in str(err):
                raise
            reason = f"round {received.header.round}: {str(err)[:300]}"
            if NONDETERMINISTIC in str(err):
                reason += (" (train.deterministic on CUDA: the server may set "
                           "train.deterministic=false, or this edge accept it with "
                           "--cuda-nondeterministic-ok)")
            self.health.error(reason)
            self.session.leave(reason)
            raise EdgeExit(2, reason) from None
        self.health.set("uploading")
        try:
            self.session.submit(received.header, result.upload, result.num_examples,
                                result.evaluation, result.metrics, result.coded)
        except (grpc.RpcError, Rejoin) as err:
            # The upload stays on disk (``fl_edge.pending``): after the next join it goes
            # on from the bytes the server holds, or whole under --mode async.
            log.warning("round %d %s: the upload failed (%s); the result is kept in %s and "
                        "goes up when the server is back", received.header.round,
                        received.header.phase,
                        err.code().name if hasattr(err, "code") else "the server restarted",
                        self.opts.state_dir)
            raise
        self.caps.task_done()

"""The server's wiring: one running fl-server is the gRPC service over the round engine,
the health service, the Prometheus endpoint and the enrollment watch, started and stopped
together. ``fl-server`` (``cli.py``) runs one until the run ends or a signal arrives;
tests and benches hold one in-process to look at the engine while real gRPC edges talk
to it."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from fedattn_shared import kernels
from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods.base import Method
from fedattn_shared.tls import ENROLLED, Enrollment, server_credentials
from fedattn_shared.wire.accounting import ByteMeter
from fedattn_shared.wire.transport import server_options

from .calls import Identity
from .downloads import Downloads
from .engine import Engine
from .memory import attach_spill, global_bytes, plan_upload_memory
from .metrics import ServerMetrics
from .service import FederatedLearningService, service_handler
from .sessions import Sessions
from .settings import resolve_settings
from .uploads import Uploads

log = logging.getLogger("fl_server")

# How long a finished server waits for connected edges to hear that the run is over.
RUN_OVER_LINGER = 30.0


class UsageError(Exception):
    """A setting the server cannot start with (exit status 2, the message names it)."""


class ServerApp:
    """A running fl-server: gRPC service, health, metrics and the round engine.

    ``fl-server`` runs one until the run ends or a signal arrives; tests hold one
    in-process to look at the engine while real gRPC edges talk to it.
    """

    def __init__(self, server_cfg: ServerConfig, train: TrainConfig, method: Method,
                 metrics_linger: float = 0.0, log_every: float = 10.0):
        self.cfg = server_cfg = resolve_settings(server_cfg)  # ConfigError names a bad spec
        self.registry = CollectorRegistry()
        self.meter = ByteMeter(self.registry)
        self.engine = Engine(server_cfg, train, method, self.meter, ServerMetrics(self.registry))
        self.engine.log_every = log_every  # seconds between "k/n results in" lines
        self.port = 0
        self.metrics_port: int | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._http = None
        self._watch: asyncio.Task | None = None
        #: Seconds /metrics stays up after the run finished (``--metrics-linger``), so that a
        #: scrape every few seconds still sees the last round; SIGTERM/SIGINT end it early.
        self.metrics_linger = metrics_linger

    async def start(self) -> int:
        """Resumes or refuses a used checkpoint directory, then starts gRPC, health and
        metrics; returns the gRPC port (the one chosen when --port is 0)."""
        cfg, engine = self.cfg, self.engine
        if cfg.resume:
            engine.resume()
        elif engine.runlog.store.latest() is not None:
            raise UsageError(f"{cfg.checkpoint_dir} already holds a checkpoint; pass --resume to "
                             "continue it or choose an empty --checkpoint-dir")
        Path(cfg.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        attach_spill(engine.aggregator, cfg)
        model_bytes = global_bytes(engine.aggregator)
        memory = plan_upload_memory(cfg, model_bytes)
        large_passes = kernels.warm(model_bytes // 4)  # ~values
        self._grpc = grpc.aio.server(
            options=server_options(max_edges=cfg.max_edges,
                                   keepalive_ms=int(cfg.keepalive_interval * 1000))
            + memory.grpc_options())
        enrollment = Enrollment(Path(cfg.tls_dir) / ENROLLED) if cfg.tls_dir else None
        uploads = Uploads(engine, self.meter, cfg, memory.slots)
        downloads = Downloads(engine, self.meter, cfg)
        sessions = Sessions(engine, cfg, enrollment,
                            holds=lambda edge: uploads.holds(edge) or downloads.holds(edge))
        service = FederatedLearningService(engine, sessions, uploads, downloads, cfg)
        self.engine.metrics.watch_downloads(downloads.room)
        self._watch = asyncio.create_task(sessions.watch_enrollment())
        self._grpc.add_generic_rpc_handlers(
            (service_handler(service, self.meter, Identity(engine.edges, enrollment)),))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        address = f"{cfg.host}:{cfg.port}"
        self.port = (self._grpc.add_secure_port(address, server_credentials(Path(cfg.tls_dir)))
                     if cfg.tls_dir else self._grpc.add_insecure_port(address))
        if self.port == 0:
            raise UsageError(f"cannot listen on {cfg.host}:{cfg.port}")
        await self._grpc.start()
        for name in ("", "fedattn.v1.FederatedLearning"):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if cfg.metrics_port >= 0:
            self._http, _ = start_http_server(cfg.metrics_port, registry=self.registry)
            self.metrics_port = self._http.server_port
        log.info("serving on %s:%d (metrics %s), method %s, model %s, mode %s, compress %s, "
                 "fingerprint %s, large passes %s", cfg.host, self.port,
                 self.metrics_port or "off", engine.method.name, engine.train.model,
                 f"async (buffer {cfg.buffer})" if cfg.mode == "async" else cfg.mode,
                 cfg.compress or "off", engine.fingerprint, large_passes)
        if not cfg.tls_dir and not cfg.join_token:
            log.warning("plaintext gRPC without a join token: anyone who reaches this port can "
                        "register edge ids (up to --max-edges %d) and submit results; for a "
                        "closed lab network only", cfg.max_edges)
        return self.port

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Run rounds until the run ends (or ``stop`` is set), then shut down."""
        stop = stop or asyncio.Event()
        run_task = asyncio.create_task(self.engine.run())
        stop_task = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        try:
            if run_task in done:
                run_task.result()
                await self._tell_edges_run_over()
                await self._linger_for_metrics(stop)
            else:
                log.info("stopping on request; the last completed round stays checkpointed")
                run_task.cancel()
                await asyncio.gather(run_task, return_exceptions=True)
                # A round's checkpoint being written goes to disk first (its thread would
                # finish the write anyway; the loop must not close under its task).
                try:
                    await self.engine.durable()
                except Exception as err:  # noqa: BLE001 (logged: the stop goes on)
                    log.error("the last round's checkpoint could not be written: %s", err)
        finally:
            stop_task.cancel()
            await self.stop()

    async def _linger_for_metrics(self, stop: asyncio.Event) -> None:
        """Keeps serving /metrics ``metrics_linger`` seconds after the run finished (or
        until ``stop``): the process exits seconds after the last round, and with it the
        endpoint a Prometheus scrape would have read the last round from."""
        if self._http is None or self.metrics_linger <= 0:
            return
        log.info("serving /metrics on :%s for %gs more (--metrics-linger)", self.metrics_port,
                 self.metrics_linger)
        try:
            await asyncio.wait_for(stop.wait(), self.metrics_linger)
        except asyncio.TimeoutError:
            pass

    async def _tell_edges_run_over(self) -> None:
        """Keep the port open until every connected edge has been told that the run is
        over (an edge still uploading a late result asks for its next task only after the
        upload), at most RUN_OVER_LINGER seconds: an edge that misses it would retry until
        its --retry-for and exit with an error."""
        deadline = time.monotonic() + RUN_OVER_LINGER
        records = self.engine.edges.records.values()
        while time.monotonic() < deadline:
            if all(r.heard_run_over for r in records if r.connected):
                return
            await asyncio.sleep(0.1)
        log.info("exiting without telling every connected edge that the run is over")

    async def stop(self) -> None:
        """Stops the enrolment watch, the held calls, health, gRPC (2 s grace for calls in
        flight) and the metrics endpoint."""
        if self._watch is not None:
            self._watch.cancel()
        # Held calls (presence streams, long polls) end on their own within the grace, so
        # none is cancelled mid-await by the stop (grpc then logs a CancelledError).
        self.engine.stopping = True
        self.engine.edges.wake_all()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._grpc is not None:
            await self._grpc.stop(grace=2)
        if self._http is not None:
            self._http.shutdown()
            self._http = None

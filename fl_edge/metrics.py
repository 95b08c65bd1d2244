"""The edge's Prometheus metrics (``--metrics-port``).

Apart from the daemon so that the session (submissions, connection), the task runner
(training throughput, evaluation) and the privacy middleware (epsilon spent) each update
the figures they know without reaching through the daemon.
"""

from __future__ import annotations

import logging
import math
import resource
import signal
import threading

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("fl_edge")

#: Seconds /metrics outlives the run by default (``--metrics-linger``): fl-server's two 5 s
#: scrape intervals, so a scrape sees the edge's last round as it sees the server's.
METRICS_LINGER = 10.0


def linger_for_metrics(port: int, seconds: float) -> None:
    """Keeps the process (and its /metrics thread) alive ``seconds`` after the run ended,
    or until SIGTERM: the daemon exits the moment the server says the run is over, and
    with it the endpoint a Prometheus scrape would read the last round from. Called from
    the main thread (it sets a signal handler)."""
    if seconds <= 0:
        return
    ended = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: ended.set())
    try:
        log.info("serving /metrics on :%d for %gs more (--metrics-linger)", port, seconds)
        ended.wait(seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)


class EdgeMetrics:
    """The edge's Prometheus figures, on a registry of its own (fl-sim hosts many edges in
    one process, so no global registry). One object so every part of the edge updates the
    same gauges, and ``--metrics-port`` serves them all."""

    def __init__(self, registry: CollectorRegistry):
        self.round = Gauge("fedattn_edge_round", "Last round this edge worked on", registry=registry)
        self.connected = Gauge("fedattn_edge_connected", "1 while joined to the server",
                               registry=registry)
        self.train_seconds = Gauge("fedattn_edge_local_train_seconds", "Last local training time",
                                   registry=registry)
        self.samples_per_second = Gauge("fedattn_edge_samples_per_second",
                                        "Last local training throughput", registry=registry)
        self.accuracy = Gauge("fedattn_edge_accuracy", "Last evaluation accuracy", ["split"],
                              registry=registry)
        self.loss = Gauge("fedattn_edge_loss", "Last evaluation mean loss", ["split"],
                          registry=registry)
        self.info = Gauge("fedattn_edge_info", "1, labelled with this edge's id and device",
                          ["edge", "device"], registry=registry)
        self.trained_samples = Counter("fedattn_edge_trained_samples",
                                       "Samples seen in local training", registry=registry)
        self.last_success_round = Gauge("fedattn_edge_last_success_round",
                                        "Last round whose result the server accepted",
                                        registry=registry)
        self.last_success_time = Gauge("fedattn_edge_last_success_timestamp_seconds",
                                       "Unix time of the last accepted result", registry=registry)
        self.submissions = Counter("fedattn_edge_submissions", "Results sent, by the server's answer",
                                   ["phase", "result"], registry=registry)
        self.retries = Counter("fedattn_edge_rpc_retries", "Server calls failed and retried",
                               ["code"], registry=registry)
        self.upload_resumes = Counter("fedattn_edge_upload_resumes",
                                      "Uploads resumed from the bytes the server held after "
                                      "their stream broke", registry=registry)
        self.private_state_bytes = Gauge("fedattn_edge_private_state_bytes",
                                         "Size of the private state file", registry=registry)
        self.peak_rss_bytes = Gauge("fedattn_edge_peak_rss_bytes",
                                    "Peak resident memory of the edge process", registry=registry)
        self.gpu_peak_bytes = Gauge("fedattn_edge_gpu_memory_peak_bytes",
                                    "Peak CUDA memory allocated by the last local training",
                                    ["device"], registry=registry)
        self.gpu_reserved_bytes = Gauge("fedattn_edge_gpu_memory_reserved_bytes",
                                        "CUDA memory held by the caching allocator", ["device"],
                                        registry=registry)
        self._registry = registry
        self.dp_epsilon: Gauge | None = None

    def track_privacy(self, spent: float, budget: float) -> None:
        """Exports the DP-SGD spend, from the moment DP-SGD runs: an edge without it has no
        epsilon at all (a 0 would read as perfect privacy)."""
        if self.dp_epsilon is None:
            self.dp_epsilon = Gauge("fedattn_edge_dp_epsilon",
                                    "Privacy spent by DP-SGD so far (epsilon at the ledger's "
                                    "delta)", registry=self._registry)
            if math.isfinite(budget):
                Gauge("fedattn_edge_dp_epsilon_budget",
                      "The epsilon this edge's DP-SGD may spend in all (--dp-epsilon)",
                      registry=self._registry).set(budget)
        self.dp_epsilon.set(spent)

    def observe_training(self, result, device: torch.device) -> None:
        """Throughput and memory after a local training (the caller resets CUDA's peak)."""
        self.train_seconds.set(result.seconds)
        self.samples_per_second.set(result.samples_per_second)
        self.trained_samples.inc(result.examples)
        self.peak_rss_bytes.set(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if device.type == "cuda":
            self.gpu_peak_bytes.labels(str(device)).set(torch.cuda.max_memory_allocated(device))
            self.gpu_reserved_bytes.labels(str(device)).set(torch.cuda.memory_reserved(device))

"""Prometheus metrics of the server (bytes are in ``ByteMeter``).

Conventions (https://prometheus.io/docs/practices/naming/): counters end in ``_total``
(prometheus_client appends it), sizes are ``_bytes``, durations ``_seconds``; labels have
bounded values: ``edge`` (one per enrolled edge), ``phase`` (the method's phase names),
``split``, ``reason`` (the fixed set in ``DROP_REASONS``). The round number is never a
label: it is the value of ``fedattn_round``.

Privacy: ``fedattn_dp_epsilon{edge}`` is the epsilon each edge's DP-SGD ledger has spent
(reported with its training result); secure aggregation's steps are phases of their own
(``secagg-advertise:P``, ``secagg-share:P``, ``secagg-receive:P``, ``secagg-confirm:P``,
``secagg-unmask:P``), so their timings are
``fedattn_phase_seconds{phase=~"secagg-.*"}`` and their timeouts and drops the per-phase
series, and ``fedattn_wire_bytes_total{kind="secagg"}`` their traffic. The dashboard's
Privacy row shows both.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class DownloadRoomGauges(Protocol):
    """What the download gauges read at each scrape (``streams.DownloadRoom`` is one;
    typed here so that the metrics, which the phase and the streams record into, import
    neither)."""

    @property
    def held(self) -> int:
        """Bytes of task messages in gRPC now."""

    @property
    def limit(self) -> int:
        """The bound (--max-download-memory)."""

    @property
    def waiting(self) -> int:
        """Task messages waiting for room."""

# Round and phase times span a loopback test (tenths of a second) to a Jetson federation
# (tens of minutes).
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# Aggregation and checkpoint writes: milliseconds for a small model, seconds for a large one.
FAST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# Every reason the engine drops a task for, as a bounded label value.
DROP_REASONS = {
    "deadline": "deadline",
    "disconnected": "disconnected",
    "rejoined": "rejoined",
    "left": "left",
    "revoked": "revoked",
    "re-delivery limit": "redelivery_limit",
    "bad upload": "bad_upload",
    "upload not resumed": "upload_not_resumed",  # its cut upload expired (resumable uploads)
    "phase closed at quorum": "closed_at_quorum",
    "too stale": "too_stale",          # --mode async: past --max-staleness
    "superseded": "superseded",        # --mode async: the edge asked for newer work
    "run over": "run_over",            # --mode async: the last version is applied
    "declined": "declined",            # the edge said "not now" (TaskRequest.decline)
}


#: Why edges decline work (``pb.Decline``'s names, lower case without the prefix), as the
#: bounded label of ``fedattn_declines_total``; a value this server does not know: "other".
DECLINES = ("data_budget", "other")

#: Reasons that are a healthy run's normal course (``--mode async``: an edge asked for newer
#: work, the last version is applied, a result came after its phase closed; an edge declined
#: work): logged at INFO.
#: Every other drop or refusal is a WARNING.
ROUTINE_REASONS = frozenset({"superseded", "run over", "no phase is open", "declined"})


def routine(reason: str) -> bool:
    """Whether a drop or refusal reason is a normal event, not a fault (``ROUTINE_REASONS``)."""
    return reason.split(":")[0].strip() in ROUTINE_REASONS


def drop_reason_label(reason: str) -> str:
    """The label value for a free-text drop reason ("bad upload: <details>" -> bad_upload)."""
    return DROP_REASONS.get(reason.split(":")[0].strip(), "other")


class ServerMetrics:
    """The server's Prometheus series, in one place so that their names (what dashboards
    and alerts query) are declared once: rounds, participation, aggregate safety,
    evaluation and privacy."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry
        self._rounds()
        self._participation()
        self._evaluation()

    def _counter(self, name: str, doc: str, labels=()) -> Counter:
        return Counter(name, doc, labels, registry=self._registry)

    def _gauge(self, name: str, doc: str, labels=()) -> Gauge:
        return Gauge(name, doc, labels, registry=self._registry)

    def _histogram(self, name: str, doc: str, labels=(), buckets=DURATION_BUCKETS) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self._registry)

    def _rounds(self) -> None:
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        self.round = gauge("fedattn_round", "Last completed round")
        self.rounds_planned = gauge("fedattn_rounds_planned", "Rounds this run is configured for")
        self.rounds_completed = counter("fedattn_rounds_completed",
                                        "Rounds completed by this process (checkpoint written)")
        self.round_seconds = histogram("fedattn_round_seconds",
                                       "Round wall time, task hand-out to checkpoint")
        self.phase_seconds = histogram("fedattn_phase_seconds",
                                       "Phase wall time, task hand-out to close", ["phase"])
        self.phase_timeouts = counter("fedattn_phase_timeouts",
                                      "Phases closed by their deadline rather than a quorum",
                                      ["phase"])
        self.aggregation_seconds = histogram(
            "fedattn_aggregation_seconds",
            "Server aggregation time per call: stage=accept folds one upload in, stage=close "
            "finishes the phase", ["phase", "stage"], buckets=FAST_BUCKETS)
        self.checkpoint_seconds = histogram("fedattn_checkpoint_seconds",
                                            "Checkpoint write time (history + state)",
                                            buckets=FAST_BUCKETS)
        self.staleness = histogram(
            "fedattn_result_staleness_versions",
            "--mode async: versions the global moved between a result's download and its "
            "arrival in the buffer", buckets=(0, 1, 2, 3, 5, 8, 13, 20, 50, 100))
        self.checkpoint_round = gauge("fedattn_checkpoint_round", "Round of the last checkpoint")
        self.checkpoint_timestamp = gauge("fedattn_checkpoint_timestamp_seconds",
                                          "Unix time of the last checkpoint write")

    def _participation(self) -> None:
        counter, gauge = self._counter, self._gauge
        self.connected = gauge("fedattn_connected_edges", "Edges with an open session")
        self.joins = counter("fedattn_edges_joined", "Accepted joins (first joins and rejoins)")
        self.selected = counter("fedattn_edges_selected", "Tasks handed out", ["phase"])
        self.reported = counter("fedattn_edges_reported", "Results accepted", ["phase"])
        self.dropped = counter("fedattn_edges_dropped", "Tasks dropped, by reason",
                               ["phase", "reason"])
        self.participants = gauge("fedattn_round_participants",
                                  "Edges whose results were used in the last round's phase",
                                  ["phase"])
        self.refused = counter("fedattn_refused_submissions", "Submissions refused", ["edge"])
        self.declines = counter("fedattn_declines", "Task requests edges declined "
                                "(\"not now\": TaskRequest.decline), by their reason", ["reason"])
        for reason in DECLINES:
            self.declines.labels(reason)
        # aggregate safety (engine: rounds that could not close, updates scaled to the bound)
        self.rounds_aborted = counter("fedattn_rounds_aborted",
                                      "Rounds aborted with the global kept: a phase could not "
                                      "close or its aggregate was not finite")
        self.updates_scaled = counter("fedattn_updates_scaled",
                                      "Uploads scaled down to --clip-update-norm")
        self.edge_last_round = gauge("fedattn_edge_last_reported_round",
                                     "Last round in which the edge's result was accepted",
                                     ["edge"])
        self.edge_result = gauge("fedattn_edge_result",
                                 "Last value of each figure an edge reported with its result "
                                 "(train_loss, train_seconds, samples_per_second, method figures)",
                                 ["edge", "name"])

    def _evaluation(self) -> None:
        gauge = self._gauge
        self.accuracy = gauge("fedattn_eval_accuracy", "Last evaluation accuracy per edge",
                              ["edge", "split"])
        self.mean_accuracy = gauge("fedattn_eval_accuracy_mean",
                                   "Mean over edges of the last evaluation accuracy", ["split"])
        self.pooled_accuracy = gauge("fedattn_eval_accuracy_pooled",
                                     "Accuracy over all edges' samples of the last evaluation",
                                     ["split"])
        self.loss = gauge("fedattn_eval_loss", "Last evaluation mean loss per edge",
                          ["edge", "split"])
        self.mean_loss = gauge("fedattn_eval_loss_mean",
                               "Mean over edges of the last evaluation mean loss", ["split"])
        # privacy
        self.dp_epsilon = gauge("fedattn_dp_epsilon",
                                "Privacy an edge's DP-SGD has spent so far (its ledger's epsilon)",
                                ["edge"])

    def watch_downloads(self, room: DownloadRoomGauges) -> None:
        """Series read from the download room (``streams.DownloadRoom``) at each scrape:
        what the task downloads under way hold in gRPC, its bound, and how many sends wait
        for room (a number that stays up says the bound, or stalled edges, slow downloads)."""
        gauge = self._gauge
        gauge("fedattn_download_held_bytes", "Bytes of task messages the downloads under way "
              "hold (a data chunk twice: its frame and gRPC's copy)").set_function(lambda: room.held)
        gauge("fedattn_download_limit_bytes", "Bound on those bytes (--max-download-memory), "
              "or the room the downloads share (each downloading edge has 128 KiB more)"
              ).set_function(lambda: room.limit)
        gauge("fedattn_downloads_waiting", "Task messages waiting for room under "
              "--max-download-memory").set_function(lambda: room.waiting)

    def export_dp_budget(self, epsilon: float) -> None:
        """The run's --dp-epsilon, exported only when there is one (a 0 or a missing budget
        must not read as one)."""
        Gauge("fedattn_dp_epsilon_budget", "The epsilon each edge's DP-SGD may spend in all",
              registry=self._registry).set(epsilon)

    def init_phases(self, phases: list[str]) -> None:
        """Exports every per-phase series at 0 from the start, so a rate or an alert over
        them is defined before the first task, timeout or drop (Prometheus' advice for
        labels whose values are known)."""
        for phase in phases:
            for metric in (self.selected, self.reported, self.phase_timeouts):
                metric.labels(phase)
            for reason in sorted(set(DROP_REASONS.values()) | {"other"}):
                self.dropped.labels(phase, reason)

    def publish_evaluation(self, per_edge: dict, summary: dict) -> None:
        """A round's evaluation as gauges: each edge's and the fleet's accuracy and loss
        per split (what a dashboard plots while the run goes on)."""
        for edge, splits in per_edge.items():
            for split, figures in splits.items():
                self.accuracy.labels(edge, split).set(figures["accuracy"])
                self.loss.labels(edge, split).set(figures["loss"])
        for split, figures in summary.items():
            self.mean_accuracy.labels(split).set(figures["mean_accuracy"])
            self.pooled_accuracy.labels(split).set(figures["pooled_accuracy"])
            self.mean_loss.labels(split).set(figures["mean_loss"])

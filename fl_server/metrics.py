"""Prometheus metrics of the server (bytes are in ``ByteMeter``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.round = Gauge("fedattn_round", "Last completed round", registry=registry)
        self.connected = Gauge("fedattn_connected_edges", "Edges with an open session",
                               registry=registry)
        self.participants = Gauge("fedattn_round_participants",
                                  "Edges whose results were used in the last round's phase",
                                  ["phase"], registry=registry)
        self.dropouts = Counter("fedattn_dropouts", "Tasks dropped, by reason", ["reason"],
                                registry=registry)
        self.refused = Counter("fedattn_refused_submissions", "Submissions refused", ["edge"],
                               registry=registry)
        self.round_seconds = Histogram(
            "fedattn_round_seconds", "Round wall time",
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800), registry=registry)
        self.phase_seconds = Gauge("fedattn_phase_seconds", "Last phase wall time", ["phase"],
                                   registry=registry)
        self.accuracy = Gauge("fedattn_eval_accuracy", "Last evaluation accuracy per edge",
                              ["edge", "split"], registry=registry)
        self.mean_accuracy = Gauge("fedattn_eval_accuracy_mean",
                                   "Mean over edges of the last evaluation accuracy", ["split"],
                                   registry=registry)
        self.loss = Gauge("fedattn_eval_loss", "Last evaluation mean loss per edge",
                          ["edge", "split"], registry=registry)
        self.train_seconds = Gauge("fedattn_edge_train_seconds", "Last local training time",
                                   ["edge"], registry=registry)
        self.dp_epsilon = Gauge("fedattn_dp_epsilon",
                                "Privacy an edge's DP-SGD has spent so far (its ledger's epsilon)",
                                ["edge"], registry=registry)

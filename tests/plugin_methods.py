"""A method defined outside fedattn, loaded as ``plugin_methods:CensusAvg``: FedAvg with a
"census" phase before training. Edges report in; the server then sends every edge its
own share n_k / sum(n) as a per-edge section of the train task, and each edge echoes the
share back with its model, which the aggregator records."""

from __future__ import annotations

import torch

from fedattn_shared.methods.aggregators import StreamingMean
from fedattn_shared.methods.base import EdgeAlgorithm, Method
from fedattn_shared.schema import EVALUATE, TRAIN, Kind, Payload, Section, SectionSpec, TensorSpec

SCALARS = (Kind.SCALAR_SUMMARY, "")


class CensusEdge(EdgeAlgorithm):
    share = 0.0

    def receive(self, phase, common, personal):
        super().receive(phase, common, personal)
        if phase == TRAIN:
            self.share = float(personal.tensors(*SCALARS)["share"])

    def phase_upload(self, phase):
        if phase != "census":
            return super().phase_upload(phase)
        return Payload([Section(Kind.SCALAR_SUMMARY, "", {"present": torch.tensor(1.0)})])

    def after_train(self, steps):
        upload = super().after_train(steps)
        upload.sections.append(Section(Kind.SCALAR_SUMMARY, "", {"echo": torch.tensor(self.share)}))
        return upload


class CensusAggregator(StreamingMean):
    def __init__(self, method, models):
        super().__init__(method, models)
        self.census: dict[str, float] = {}
        self.echoes: list[dict[str, float]] = []
        self._echo: dict[str, float] = {}

    def begin_round(self, round_number, selected, known_edges):
        super().begin_round(round_number, selected, known_edges)
        self.census, self._echo = {}, {}

    def accept_phase(self, phase, edge_id, upload, weight):
        if phase == "census":
            self.census[edge_id] = weight
            return
        echo = upload.get(*SCALARS)
        self._echo[edge_id] = round(float(echo.tensors["echo"]), 6)
        upload = Payload([s for s in upload.sections if s is not echo])
        super().accept_phase(phase, edge_id, upload, weight)

    def close_phase(self, phase):
        if phase == TRAIN:
            self.echoes.append(dict(sorted(self._echo.items())))
        return super().close_phase(phase)

    def personal(self, edge_id, phase):
        if phase != TRAIN or edge_id not in self.census:
            return Payload()
        share = self.census[edge_id] / sum(self.census.values())
        return Payload([Section(Kind.SCALAR_SUMMARY, "", {"share": torch.tensor(share)})])


class CensusAvg(Method):
    name = "census-avg"
    phases = ("census", TRAIN, EVALUATE)

    def uplink_schema(self, phase, models):
        scalars = {"present": TensorSpec(torch.float32, ())} if phase == "census" else {
            "echo": TensorSpec(torch.float32, ())}
        if phase == "census":
            return [SectionSpec(Kind.SCALAR_SUMMARY, "", scalars)]
        schema = super().uplink_schema(phase, models)
        return schema + [SectionSpec(Kind.SCALAR_SUMMARY, "", scalars)] if phase == TRAIN else schema

    def edge(self, models, device):
        return CensusEdge(self, models, device)

    def server(self, models):
        return CensusAggregator(self, models)

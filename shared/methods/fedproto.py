"""FedProto (Tan et al., AAAI 2022): prototypes instead of weights, averaged per class.

* Edge: the whole model is private. Loss = CE(head(h), y) + lam * MSE(h, p_global_y) over
  the samples whose class has a global prototype (before a class has one, its samples
  train with CE alone). After training, the mean h of each local class (as FedSTAR's
  shared prototype, ``prototypes.py``) and the number of training samples of that class.
* Wire: the PROTOTYPES section plus a SCALAR_SUMMARY section ``class_counts`` with one
  count per uploaded class. The counts are FedProto's aggregation weights, and they are
  the edge's label histogram in the clear: FedProto reveals it, FedSTAR does not send it.
* Server: for each class uploaded this round, p_global_c = sum_k n_k,c p_k,c / sum_k n_k,c.
  Classes no edge uploaded this round keep their previous global prototype. It needs the
  individual uploads (collect-then-learn), so none of its sections is summable under
  secure aggregation as built.
* ``predict``: the head on h (the same evaluation as FedSTAR's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..schema import TRAIN, Kind, Payload, Section, SectionSpec, TensorSpec
from .aggregators import CollectThenLearn
from .prototypes import (
    GLOBAL,
    LOCAL,
    ProtoNorm,
    PrototypeEdge,
    PrototypeMethod,
    alignment,
    class_keys,
    upload_norm,
)

COUNTS = (Kind.SCALAR_SUMMARY, "class_counts")


@dataclass
class FedProtoParams:
    lam: float = 1.0           # weight of the prototype regulariser (FedProto's lambda)
    proto_norm: ProtoNorm = "none"  # "layernorm": standardise each h before the class mean


class FedProtoEdge(PrototypeEdge):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        h, logits = self.features(x)
        self.observe_features(h)
        loss = F.cross_entropy(logits, y)
        known = self.has_global[y]
        if self.method.params.lam and bool(known.any()):
            loss = loss + self.method.params.lam * F.mse_loss(h[known], self.global_table[y[known]])
        return loss

    def after_train(self, steps: int) -> Payload:
        upload = super().after_train(steps)
        counts = {k: torch.tensor(float(n)) for k, n in self.local_counts.items()}
        upload.sections.append(Section(*COUNTS, counts))
        return upload


class FedProtoAggregator(CollectThenLearn):
    def learn(self, uploads):
        sums: dict[str, torch.Tensor] = {}
        totals: dict[str, float] = {}
        for payload, _ in uploads.values():
            counts = payload.tensors(*COUNTS)
            for key, prototype in payload.tensors(*LOCAL).items():
                n = float(counts[key])
                sums[key] = sums.get(key, 0) + n * prototype.double()
                totals[key] = totals.get(key, 0.0) + n
        current = dict(self.state.get(GLOBAL, {}))
        for key, total in sums.items():
            current[key] = (total / totals[key]).float()
        self.state[GLOBAL] = dict(sorted(current.items(), key=lambda kv: int(kv[0])))
        local = [payload.tensors(*LOCAL) for payload, _ in uploads.values()]
        cosine, norm = alignment(current, local), upload_norm(local)
        return {"classes": len(sums), **({} if cosine is None else {"proto_cosine": cosine}),
                **({} if norm is None else {"upload_norm": norm})}


class FedProto(PrototypeMethod):
    name = "fedproto"
    Params = FedProtoParams
    aggregator = FedProtoAggregator

    def __init__(self, context):
        super().__init__(context)
        if not 0 <= self.params.lam < math.inf:
            raise ValueError(f"fedproto.lam must be a finite number >= 0, got {self.params.lam}")

    def dp_refusal(self) -> str | None:
        return ("fedproto: the prototype term is a mean over the batch's samples of classes "
                "with a global prototype, so each sample's gradient is scaled by how many "
                "such samples the rest of the batch holds (per-sample clipping does not bound "
                "one sample's influence), and class_counts (the label histogram) are exact "
                "counts that noise would break")

    def uplink_schema(self, phase, models):
        schema = super().uplink_schema(phase, models)
        if phase == TRAIN:
            schema.append(SectionSpec(*COUNTS, {key: TensorSpec(torch.float32, (), optional=True)
                                                for key in class_keys(self.train.num_classes)}))
        return schema

    def check_upload(self, phase: str, upload: Payload) -> None:
        if phase != TRAIN:
            return
        prototypes, counts = upload.tensors(*LOCAL), upload.tensors(*COUNTS)
        if set(prototypes) != set(counts):
            raise ValueError("fedproto: class_counts must name exactly the uploaded prototypes' "
                             f"classes (prototypes {sorted(prototypes)}, counts {sorted(counts)})")
        for key, n in counts.items():
            value = float(n)
            if value < 1 or value != int(value):
                raise ValueError(f"fedproto: class_counts[{key}] = {value} is not a count >= 1")

    def edge(self, models, device):
        return FedProtoEdge(self, models, device)

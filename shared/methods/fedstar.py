"""FedSTAR: style-aware Transformer aggregation of prototypes (Jeon & Huh).

Source: the FedSTAR paper (https://arxiv.org/abs/2511.18841), section 4 and Algorithm 1,
and the authors' code; where the code departs from the paper, docs/methods/fedstar.md says
which we follow.

Edge (everything private: the encoder and head, u_k,c, StyleFiLM, the gate G):
  * h = the encoder's feature (the head's input, ``prototypes.py``).
  * L_shared (eqs. 2-3): CE over the prototype logits l_c = 2 h.p_c - |h|^2 - |p_c|^2 of
    the classes that have a global prototype, on the raw h; samples of classes without
    one are left out of it.
  * Content/style (eqs. 4-5), once per round after the downlink: p_content = (u.g) /
    (|g|^2 + eps) g and s = (u - p_content) / (|u - p_content| + eps), eps = 1e-6, for
    every class with a global prototype g; other classes (never seen by anyone yet) have
    style 0. Kept (detached) in the ``style`` buffer of the personal module.
  * StyleFiLM (eq. 6): FiLM(h) = h * (1 + gamma(s_y)) + beta(s_y), gamma, beta = tanh of a
    Linear(d, d) (the authors' "small MLPs"), s_y the style of the sample's label.
  * Gate (eqs. 12-13): a = sigmoid(G([g, u, |g - u|, g * u])), G = Linear(4d, d/4) ->
    GELU -> Linear(d/4, 1); p_personal = a g + (1 - a) u, applied once (the authors' code
    mixes twice).
  * Pull (eq. 7): 1 - cos(FiLM(h), p_personal_y) for samples whose class has a global
    prototype. Total (eq. 14): CE(head(FiLM(h)), y) + lambda_pull L_pull + lambda_shared
    L_shared. Before any global prototype exists (round 1) the loss is the CE alone.
  * Upload: the PROTOTYPES section with m_k,c = the mean h (eval mode) of each class the
    edge has training samples of, and nothing else: no counts (they would reveal the
    label histogram), no u (the authors' code returned it; the server ignored it).
  * Classes the edge has never seen: u_k,c exists for every class but gets no gradient
    from classes without local samples (the pull only uses the samples' own labels); they
    act as negatives in L_shared once they have a global prototype; nothing is uploaded
    for them; the head sees them only as negatives of the CE.
  * ``predict`` (evaluation and export) never uses the true label: by default the head on
    h without FiLM (the authors' paper-matching code); ``predicted-style`` applies FiLM
    with the style of the class the plain head predicts.

Server (collect-then-learn, eqs. 8-11, 15): X_k,c = LN(p_k,c + e_client_k + e_class_c);
Z = TransformerEncoder(X) (1 layer, 8 heads, ff 4d, GELU, dropout 0.05, as the authors'
code); the server trains it one SGD step per round on L_server = mean over the uploaded
(k, c) of 1 - cos(mean_k Z_k,c, p_k,c) (eq. 15); alpha_k,c = softmax over the round's
clients of Z_k,c . e_class_c / sqrt(d) (eq. 10) and p_global_c = sum_k alpha_k,c Z_k,c
(eq. 11), with the pre-step Z and, as the code does, the class embeddings renormalised to
unit length after the step. (k, c) pairs an edge did not upload are masked out of the
attention, the softmax and the loss (the authors' code fills them with zero vectors).
Classes nobody uploaded this round keep their previous global prototype. A client
embedding row is allocated when an edge id first uploads: N(0, embed_std^2) drawn from a
generator seeded by (train seed, edge id), so the value never depends on arrival order.
The Transformer, class and client embeddings, the id -> row map and the optimizer are in
the server checkpoint. The server needs each edge's prototypes and identity, so nothing
FedSTAR uploads is summable under secure aggregation.

Variants: ``variant = "ablation"`` is the paper's attention-only ablation: no u, FiLM,
gate or pull; the same Transformer aggregation. Its local loss (not in the paper) is by
default the authors' ``clientablation.py``: CE + lambda_mse * MSE(h, p_global_y), i.e.
FedProto's loss, so against ``fedproto`` only the aggregation differs;
``ablation_loss = "shared"`` uses CE + lambda_shared L_shared (FedSTAR minus
personalization).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from ..models import build_model
from .aggregators import CollectThenLearn
from .base import MethodContext
from .prototypes import (
    GLOBAL,
    LOCAL,
    ProtoNorm,
    PrototypeEdge,
    PrototypeMethod,
    alignment,
    prototype_logits,
    upload_norm,
)

Variant = Literal["full", "ablation"]
CeInput = Literal["film", "raw"]
Predict = Literal["head", "predicted-style"]
AblationLoss = Literal["mse", "shared"]
AttentionAxis = Literal["classes", "clients"]
VARIANTS, CE_INPUTS, PREDICTS, ABLATION_LOSSES, ATTENTION_AXES = (
    get_args(t) for t in (Variant, CeInput, Predict, AblationLoss, AttentionAxis))
EPS = 1e-6


@dataclass
class FedSTARParams:
    variant: Variant = "full"           # "ablation": attention aggregation only
    lambda_shared: float = 1.0       # the paper
    lambda_pull: float = 0.7         # the paper (0.6 on DomainNet)
    # Edge choices the paper leaves open ([reconstructed]; docs/methods/fedstar.md).
    # u_k,c is "learnable" but no loss in the paper's code trains it: here it learns
    # through L_pull (p_personal depends on u) at lr x u_lr_scale, as later author code.
    train_u: bool = True
    u_lr_scale: float = 10.0
    train_film: bool = True          # the paper-matching code never trains gamma/beta ...
    train_gate: bool = True          # ... nor G (both are outside its optimizer)
    detach_pull_target: bool = False  # the code detaches p_personal: u and G then get no gradient
    ce_input: CeInput = "film"         # CE on head(FiLM(h)) (code) or on head(h) ("raw")
    predict: Predict = "head"          # see the module docstring; never the true label
    proto_norm: ProtoNorm = "none"       # paper: plain mean of h; "layernorm": the code's
    ablation_loss: AblationLoss = "mse"
    lambda_mse: float = 1.0
    # Server (the authors' serverstar.py unless noted).
    attn_axis: AttentionAxis = "classes"     # the code attends across one client's classes
    layers: int = 1
    heads: int = 8
    dropout: float = 0.05
    server_lr: float = 0.005         # one SGD step per round (the code: the client lr)
    server_momentum: float = 0.0
    # New client rows are N(0, embed_std^2): 1.0 is nn.Embedding's N(0, 1), the paper's code.
    # Below 1 scales the client embedding down (a deviation, issue #24: at 1.0 with d = 128
    # the rows carry most of the LayerNorm input's energy and swamp the prototypes).
    embed_std: float = 1.0
    normalize_class_embed: bool = True


def content_style(u: torch.Tensor, g: torch.Tensor, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. 4-5, row-wise: the projection of u on g and the unit-norm residual."""
    content = (u * g).sum(-1, keepdim=True) / (g.square().sum(-1, keepdim=True) + eps) * g
    residual = u - content
    return content, residual / (residual.norm(dim=-1, keepdim=True) + eps)


class StylePersonalization(nn.Module):
    """The private personalization of one edge: u_k,c, StyleFiLM and the gate G, plus the
    round's style vectors (a buffer, so evaluation and export see the same ones)."""

    def __init__(self, num_classes: int, feature_dim: int):
        super().__init__()
        d = feature_dim
        self.u = nn.Parameter(torch.zeros(num_classes, d))
        self.gamma = nn.Linear(d, d)
        self.beta = nn.Linear(d, d)
        self.gate = nn.Sequential(nn.Linear(4 * d, d // 4), nn.GELU(), nn.Linear(d // 4, 1))
        self.register_buffer("style", torch.zeros(num_classes, d))

    def film(self, h: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        """Eq. 6."""
        return h * (1 + torch.tanh(self.gamma(style))) + torch.tanh(self.beta(style))

    def personal_prototypes(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eqs. 12-13 for every class: (p_personal (classes, d), gate a (classes, 1))."""
        u = self.u
        a = torch.sigmoid(self.gate(torch.cat([g, u, (g - u).abs(), g * u], dim=1)))
        return a * g + (1 - a) * u, a

    @torch.no_grad()
    def set_styles(self, g: torch.Tensor, has_global: torch.Tensor) -> None:
        _, style = content_style(self.u, g)
        self.style.copy_(style * has_global.unsqueeze(1))


class FedSTAREdge(PrototypeEdge):
    method: FedSTAR

    def __init__(self, method: FedSTAR, models: dict[str, nn.Module], device: torch.device):
        super().__init__(method, models, device)
        p = method.params
        self.personal: StylePersonalization | None = self.models.get("personal")
        if self.personal is not None:
            self.personal.u.requires_grad_(p.train_u)
            for module, trained in ((self.personal.gamma, p.train_film),
                                    (self.personal.beta, p.train_film),
                                    (self.personal.gate, p.train_gate)):
                module.requires_grad_(trained)

    def parameter_groups(self) -> list[dict]:
        trainable = [p for name in self.models for _, p in self.named_trainable(name)]
        if self.personal is None or not self.personal.u.requires_grad:
            return [{"params": trainable}]
        scale = self.method.params.u_lr_scale
        return [{"params": [p for p in trainable if p is not self.personal.u]},
                {"params": [self.personal.u], "lr": self.method.train.lr * scale,
                 "lr_scale": scale}]

    def begin_train(self) -> None:
        super().begin_train()
        if self.personal is not None:
            self.personal.set_styles(self.global_table, self.has_global)

    def shared_loss(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Eqs. 2-3 over the classes with a global prototype (``h``, ``y``: samples of
        such classes only)."""
        classes = self.has_global.nonzero().flatten()
        position = torch.full((self.num_classes,), -1, dtype=torch.long, device=self.device)
        position[classes] = torch.arange(len(classes), device=self.device)
        return F.cross_entropy(prototype_logits(h, self.global_table[classes]), position[y])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        p = self.method.params
        h, logits = self.features(x)
        self.observe_features(h)
        known = self.has_global[y]
        any_known = bool(known.any())
        if self.personal is None:  # the ablation variant
            loss = F.cross_entropy(logits, y)
            if any_known and p.ablation_loss == "mse":
                return loss + p.lambda_mse * F.mse_loss(h[known], self.global_table[y[known]])
            if any_known:
                return loss + p.lambda_shared * self.shared_loss(h[known], y[known])
            return loss
        h_personal = self.personal.film(h, self.personal.style[y])
        if p.ce_input == "film":
            logits = self.head(h_personal)
        loss = F.cross_entropy(logits, y)
        if not any_known:
            return loss
        if p.lambda_shared:
            loss = loss + p.lambda_shared * self.shared_loss(h[known], y[known])
        if p.lambda_pull:
            personal, _ = self.personal.personal_prototypes(self.global_table)
            target = personal[y[known]]
            if p.detach_pull_target:
                target = target.detach()
            pull = 1 - F.cosine_similarity(h_personal[known], target, dim=1)
            loss = loss + p.lambda_pull * pull.mean()
        return loss

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        h, logits = self.features(x)
        if self.method.params.predict == "head" or self.personal is None:
            return logits
        style = self.personal.style[logits.argmax(dim=1)]
        return self.head(self.personal.film(h, style))


class PrototypeTransformer(nn.Module):
    """Eqs. 8-9: LN(p + e_client + e_class), then a Transformer encoder. The client
    embeddings are held by the aggregator (rows appear as edges do)."""

    def __init__(self, feature_dim: int, num_classes: int, layers: int, heads: int,
                 dropout: float):
        super().__init__()
        self.class_embed = nn.Embedding(num_classes, feature_dim)
        self.norm = nn.LayerNorm(feature_dim)
        layer = nn.TransformerEncoderLayer(feature_dim, heads, 4 * feature_dim, dropout,
                                           activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, prototypes: torch.Tensor, client: torch.Tensor, classes: torch.Tensor,
                mask: torch.Tensor, axis: str) -> torch.Tensor:
        """``prototypes`` (M clients, C classes, d), ``client`` (M, d), ``classes`` (C,),
        ``mask`` (M, C): which (k, c) were uploaded. Returns Z (M, C, d), zero where masked."""
        x = self.norm(prototypes + client[:, None] + self.class_embed(classes)[None])
        if axis == "classes":  # each client's classes attend to each other (the code)
            z = self.encoder(x, src_key_padding_mask=~mask)
        else:                  # each class's clients attend to each other
            z = self.encoder(x.transpose(0, 1), src_key_padding_mask=~mask.T).transpose(0, 1)
        return z.masked_fill(~mask[..., None], 0.0)


def server_loss(z: torch.Tensor, prototypes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 15: mean over uploaded (k, c) of 1 - cos(mean_k Z_k,c, p_k,c); the class mean
    runs over the clients that uploaded the class."""
    weight = mask.unsqueeze(-1).to(z.dtype)
    mean = (z * weight).sum(0) / weight.sum(0).clamp_min(1)
    cosine = F.cosine_similarity(mean.unsqueeze(0).expand_as(prototypes), prototypes, dim=-1)
    return (1 - cosine)[mask].mean()


def attention_aggregate(z: torch.Tensor, class_embed: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. 10-11: alpha_k,c = softmax over clients of Z_k,c . e_c / sqrt(d) (clients
    that did not upload c get 0) and p_global_c = sum_k alpha_k,c Z_k,c.
    Returns (p_global (C, d), alpha (M, C))."""
    scores = (z * class_embed.unsqueeze(0)).sum(-1) / math.sqrt(z.shape[-1])
    alpha = scores.masked_fill(~mask, float("-inf")).softmax(dim=0)
    return (alpha.unsqueeze(-1) * z).sum(0), alpha


def input_energy(prototypes: torch.Tensor, client: torch.Tensor, class_embed: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, float]:
    """Where the energy entering the server's LayerNorm comes from (eq. 8's
    p_k,c + e_client_k + e_class_c), over the uploaded (k, c): each term's share of
    sum |p|^2 + |e_client|^2 + |e_class|^2 after removing each vector's mean over its d
    coordinates (the part LayerNorm removes anyway). ``proto_energy`` near 1: the
    Transformer sees the edges' prototypes; near 0: it sees mostly the N(0, embed_std^2)
    client rows, and what it returns says little about the classes' content.
    ``prototypes`` (M, C, d), ``client`` (M, d), ``class_embed`` (C, d), ``mask`` (M, C)."""
    def energy(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        return (x - x.mean(-1, keepdim=True)).square().sum(-1)

    weight = mask.double()
    parts = {"proto_energy": (energy(prototypes) * weight).sum(),
             "client_energy": (energy(client)[:, None] * weight).sum(),
             "class_energy": (energy(class_embed)[None, :] * weight).sum()}
    total = sum(parts.values())
    return {name: float(part / total) if total > 0 else 0.0 for name, part in parts.items()}


def client_seed(seed: int, edge_id: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(edge_id.encode())) % (2**63)


class FedSTARAggregator(CollectThenLearn):
    def __init__(self, method: FedSTAR, models: dict[str, nn.Module]):
        super().__init__(method, models)
        p = method.params
        self.params = p
        self.seed = method.train.seed
        self.feature_dim = method.feature_dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(method.train.seed)
            self.net = PrototypeTransformer(method.feature_dim, method.train.num_classes,
                                            p.layers, p.heads, p.dropout)
        self._reset_clients()

    def _reset_clients(self) -> None:
        self.client_rows: dict[str, int] = {}
        self.client_embed = nn.ParameterList()
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=self.params.server_lr,
                                         momentum=self.params.server_momentum)

    def _add_row(self, edge_id: str, value: torch.Tensor) -> int:
        parameter = nn.Parameter(value)
        self.client_embed.append(parameter)
        self.optimizer.add_param_group({"params": [parameter]})
        self.client_rows[edge_id] = len(self.client_embed) - 1
        return self.client_rows[edge_id]

    def row(self, edge_id: str) -> int:
        """The edge's client-embedding row, allocated when the id is first seen."""
        if edge_id not in self.client_rows:
            generator = torch.Generator().manual_seed(client_seed(self.seed, edge_id))
            value = torch.randn(self.feature_dim, generator=generator) * self.params.embed_std
            self._add_row(edge_id, value)
        return self.client_rows[edge_id]

    def learn(self, uploads):
        tensors = {e: payload.tensors(*LOCAL) for e, (payload, _) in uploads.items()}
        edges = sorted(e for e, t in tensors.items() if t)
        if not edges:
            return {}
        classes = sorted({int(k) for e in edges for k in tensors[e]})
        column = {c: i for i, c in enumerate(classes)}
        prototypes = torch.zeros(len(edges), len(classes), self.feature_dim)
        mask = torch.zeros(len(edges), len(classes), dtype=torch.bool)
        for i, edge in enumerate(edges):
            for key, value in tensors[edge].items():
                prototypes[i, column[int(key)]] = value.float()
                mask[i, column[int(key)]] = True
        client = torch.stack([self.client_embed[self.row(e)] for e in edges])
        class_ids = torch.tensor(classes)
        with torch.no_grad():
            energy = input_energy(prototypes, client, self.net.class_embed(class_ids), mask)

        self.net.train()
        # Dropout draws from a generator of (seed, round), not the process's global one,
        # which no checkpoint holds: a resumed server learns what an uninterrupted one would.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + self.round)
            z = self.net(prototypes, client, class_ids, mask, self.params.attn_axis)
        loss = server_loss(z, prototypes, mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            table = self.net.class_embed.weight
            if self.params.normalize_class_embed:
                table.copy_(F.normalize(table, dim=1))
            merged, alpha = attention_aggregate(z.detach(), table[class_ids], mask)
        current = dict(self.state.get(GLOBAL, {}))
        for c, value in zip(classes, merged, strict=True):
            current[str(c)] = value.clone()
        self.state[GLOBAL] = dict(sorted(current.items(), key=lambda kv: int(kv[0])))
        cosine, norm = alignment(current, tensors.values()), upload_norm(tensors.values())
        return {"server_loss": float(loss.detach()), "classes": len(classes),
                "attention_max": float(alpha.max(dim=0).values.mean()),
                "clients_known": len(self.client_rows), **energy,
                **({} if cosine is None else {"proto_cosine": cosine}),
                **({} if norm is None else {"upload_norm": norm})}

    # ---- checkpoint -------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = super().state_tensors()
        out.update({f"net:{k}": v.detach() for k, v in self.net.state_dict().items()})
        out.update({f"client:{row}": p.detach() for row, p in enumerate(self.client_embed)})
        for index, entries in self.optimizer.state_dict()["state"].items():
            for key, value in entries.items():
                if torch.is_tensor(value):
                    out[f"opt:{index}:{key}"] = value.detach()
        return out

    def state_meta(self) -> dict[str, Any]:
        groups = self.optimizer.state_dict()["param_groups"]
        return {**super().state_meta(), "client_rows": dict(self.client_rows),
                "optimizer_groups": groups}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        super().load_state(tensors, meta)
        self.net.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("net:")})
        self._reset_clients()
        for edge_id, row in sorted(meta.get("client_rows", {}).items(), key=lambda kv: kv[1]):
            self._add_row(edge_id, tensors[f"client:{row}"].clone().float())
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("opt:"):
                _, index, name = key.split(":", 2)
                state.setdefault(int(index), {})[name] = value.clone()
        if "optimizer_groups" in meta:
            self.optimizer.load_state_dict({"state": state, "param_groups": meta["optimizer_groups"]})


class FedSTAR(PrototypeMethod):
    name = "fedstar"
    Params = FedSTARParams
    default_model = "mobilenet-v3-compact"  # the authors' encoder, d = 128 (8 heads divide it)
    aggregator = FedSTARAggregator

    def dp_refusal(self) -> str | None:
        return ("fedstar: L_shared and L_pull average over the batch's samples of classes with "
                "a global prototype (a denominator set by the other samples), so per-sample "
                "clipping does not bound one sample's influence on the update")

    def __init__(self, context: MethodContext):
        super().__init__(context)
        p: FedSTARParams = self.params
        for name in ("lambda_shared", "lambda_pull", "lambda_mse", "u_lr_scale",
                     "server_momentum", "embed_std"):
            value = getattr(p, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"fedstar.{name} must be a finite number >= 0, got {value}")
        if not 0 < p.server_lr < math.inf:
            raise ValueError(f"fedstar.server_lr must be a finite number > 0, got {p.server_lr}")
        if not 0 <= p.dropout < 1:
            raise ValueError(f"fedstar.dropout must be in [0, 1), got {p.dropout}")
        if p.layers < 1 or p.heads < 1:
            raise ValueError(f"fedstar.layers and fedstar.heads must be >= 1, got {p.layers}, "
                             f"{p.heads}")
        d = self.feature_dim
        if d % p.heads:
            divisors = [h for h in range(1, d + 1) if d % h == 0 and h <= 16]
            raise ValueError(f"fedstar.heads: {p.heads} does not divide the feature dimension "
                             f"{d} of model {self.train.model!r}: use the method's default "
                             f"model ({self.default_model}, d = 128) or another whose width "
                             f"{p.heads} divides, or --set fedstar.heads=H with H in {divisors}")
        if d < 4:
            raise ValueError(f"fedstar: model {self.train.model!r} has a {d}-dim feature; the "
                             "gate needs d >= 4")
        if p.variant == "ablation" and p.predict != "head":
            raise ValueError("fedstar.predict: the ablation variant has no FiLM; use "
                             "predict = \"head\"")

    @property
    def personalized(self) -> bool:
        return self.params.variant == "full"

    def model_names(self) -> tuple[str, ...]:
        return ("model", "personal") if self.personalized else ("model",)

    def build_models(self) -> dict[str, nn.Module]:
        torch.manual_seed(self.train.seed)
        t = self.train
        models: dict[str, nn.Module] = {
            "model": build_model(t.model, t.num_classes, t.in_channels, t.model_size)}
        if self.personalized:
            models["personal"] = StylePersonalization(t.num_classes, self.feature_dim)
        return models

    def edge(self, models, device):
        return FedSTAREdge(self, models, device)

"""Fed-SAP: personalized squeeze-excitation (pSE) + Global Statistics Regularization (GSR).

Source: the Fed-SAP paper, section II; what we reconstructed and measured is on
docs/methods/fedsap.md.

* pSE: the excitation FCs (fc1 and fc2, weights and biases) of every SE module stay on
  the edge (split rule ``se-e``); convolutions, BatchNorm and the classifier are shared
  and averaged with weights n_k / N (eq. 3).
* GSR: the server keeps S_G, one C_l-vector per SE module, zeros at first, broadcast in a
  STAT_VECTORS section. Each batch's loss is CE + lambda * sum_l ||s_batch,l - S_G,l||^2
  (eqs. 5-6), s_batch,l the batch mean of the l-th squeeze (the global average pool of
  the SE module's input, taken by a forward pre-hook, with autograd) and S_G a constant.
* After local training, one no-grad pass over the edge's training data gives s_up,k
  (eq. 7); the server's weighted mean of the uploads is the next S_G (eq. 8), in the same
  streaming weighted sum as the weights.
* Which BatchNorm statistics the squeezes are taken under is not stated in the paper
  (``stats_mode``). With BN directly before every SE module (MobileNetV3, se-cnn) and BN
  in training mode, each channel's batch mean before the activation is exactly BN's
  shared beta, so the batch-mean squeezes of different edges barely differ (measured on
  se-cnn, digits 0-2 vs 7-9: 1-3 % apart in training mode, up to 38 % under the running
  statistics) and GSR has almost nothing to align. ``"eval"`` takes both s_batch and s_up
  under the running statistics, where the local bias the paper describes shows.

The paper's ablations are parameters: ``personalization`` (Table I), ``target``
(Table III) and ``lam`` (Table II). The server records the mean pairwise cosine
similarity of the uploaded conv and SE-E weights per round (the paper's Fig. 1; both are
uploaded under ``personalization = "fedavg"``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from ..schema import TRAIN, Kind, Payload, Section, SectionSpec, TensorSpec
from .base import EdgeAlgorithm, Method, MethodContext, qualified
from .split import squeeze_excitation_modules

# Which tensors stay on the edge under each personalization strategy (Table I).
PERSONALIZATION = {
    "pse": ("se-e",),             # Fed-SAP: SE excitation private, everything else shared
    "fedavg": (),                 # everything aggregated
    "local": ("all",),            # nothing aggregated
    "agg-se-e": ("all-but-se-e",),  # only the SE excitation aggregated
}
# What s_batch is pulled toward (Table III).
TARGETS = {
    "global": "the server's S_G (Fed-SAP)",
    "local-align": "the edge's own statistics of the previous round",
    "l2": "zero (an L2 penalty on the squeeze outputs)",
    "off": "no regularization (pSE alone)",
}
STATS = "gsr"  # name of the STAT_VECTORS section
StatsMode = Literal["train", "eval", "eval-upload"]
STATS_MODES: tuple[str, ...] = get_args(StatsMode)
Personalization = Literal["pse", "fedavg", "local", "agg-se-e"]
Target = Literal["global", "local-align", "l2", "off"]
GsrForm = Literal["batch", "per-sample"]
assert get_args(Personalization) == tuple(PERSONALIZATION) and get_args(Target) == tuple(TARGETS)


@dataclass
class FedSAPParams:
    lam: float = 2.0                 # lambda, Table II's best
    personalization: Personalization = "pse"  # what is aggregated (Table I): pSE keeps SE-E local
    target: Target = "global"  # GSR's target (Table III): S_G, own last round, zero, or no GSR
    # S_G^0 is all zeros, so round 1's GSR pulls the statistics toward zero (faithful to
    # the paper). True skips GSR until a first target exists.
    wait_for_stats: bool = False
    # BatchNorm statistics the squeezes are taken under (the paper does not say):
    #   "train"       batch statistics for s_batch (the training forward) and for s_up
    #                 (the pass after training; running statistics restored afterwards);
    #   "eval"        running statistics for both: GSR's s_batch comes from a second
    #                 forward per batch with BN normalising by its running statistics
    #                 (about 1.5x the step cost), s_up from an eval-mode pass;
    #   "eval-upload" s_batch from the training forward, s_up in eval mode (mixes the two).
    stats_mode: StatsMode = "train"
    # Eq. 6 as printed sums the squared deviations over channels ("sum"). With lambda = 2
    # that term outweighs the cross-entropy by 10-20x (2,296 channels on MobileNetV3-small)
    # and, pulled toward S_G^0 = 0, every squeeze collapses to zero and accuracy to chance
    # (measured: docs/methods/fedsap.md). "mean" (an MSE per module, summed over modules)
    # matches the paper's mild lambda sensitivity (Table II) and trains: the default.
    reduction: Literal["sum", "mean"] = "mean"
    # [reconstructed, for DP-SGD] "batch" is eq. 6: the squared distance of the batch-mean
    # squeeze. It is not a sum of per-sample losses (each sample's gradient depends on the
    # whole batch's mean), so per-sample clipping does not bound one sample's influence and
    # --dp refuses it. "per-sample" pulls each sample's squeeze instead: the batch mean of
    # ||s_i - target||^2 (= eq. 6's term plus the batch's squeeze variance; same target).
    gsr_form: GsrForm = "batch"


GSR_FORMS: tuple[str, ...] = get_args(GsrForm)


def gsr_loss(squeezes: dict[str, torch.Tensor], target: dict[str, torch.Tensor],
             reduction: str = "sum", form: str = "batch") -> torch.Tensor:
    """sum_l ||mean over the batch of s_l - target_l||^2 (eq. 6); ``squeezes[l]`` is
    (batch, C_l). ``reduction="mean"`` averages over each module's channels instead of
    summing them (an MSE per module, still summed over modules). ``form="per-sample"``
    takes the batch mean of each sample's squared distance instead (DP-SGD compatible)."""
    terms = []
    for name, s in squeezes.items():
        if form == "batch":
            squared = (s.float().mean(dim=0) - target[name]) ** 2
            terms.append(squared.sum() if reduction == "sum" else squared.mean())
        else:
            squared = (s.float() - target[name]) ** 2
            terms.append((squared.sum(dim=1) if reduction == "sum" else squared.mean(dim=1)).mean())
    return torch.stack(terms).sum()


@contextlib.contextmanager
def running_statistics(model: nn.Module) -> Iterator[None]:
    """Evaluation mode inside the block (BN normalises by its running statistics and leaves
    them alone); every module's own mode is restored afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def statistics_drift(stats: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> float:
    """Mean over modules of ||stats_l - target_l|| / ||target_l|| (modules whose target is
    all zero are skipped)."""
    ratios = [float((stats[name] - t).norm() / t.norm()) for name, t in target.items()
              if name in stats and t.norm() > 0]
    return sum(ratios) / len(ratios) if ratios else float("nan")


def excitation_tensors(model: nn.Module, module: str) -> dict[str, torch.Tensor]:
    """The private part of SE module ``module`` under the pSE split: its excitation FCs'
    weights and biases, keyed as in the module's state dict (``fc1.weight``, ...)."""
    se = dict(squeeze_excitation_modules(model))[module]
    return {f"{fc}.{k}": v for fc in ("fc1", "fc2") for k, v in getattr(se, fc).state_dict().items()}


def mean_excitation(models: list[nn.Module], weights: list[float],
                    module: str) -> dict[str, torch.Tensor]:
    """The ``weights``-weighted mean over ``models`` of SE module ``module``'s excitation:
    what FedAvg's rule would have made of the edges' private copies."""
    total = float(sum(weights))
    states = [excitation_tensors(m, module) for m in models]
    return {k: sum(w / total * s[k].double() for w, s in zip(weights, states, strict=True))
            .to(states[0][k].dtype) for k in states[0]}


@contextlib.contextmanager
def swapped_excitation(model: nn.Module, module: str,
                       tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, SE module ``module`` excites with ``tensors`` (e.g. the edges'
    mean) instead of the model's own; restored afterwards. The per-module swap diagnostic
    (issue #24): if replacing one module's private excitation by the mean costs the edge
    its accuracy gain, that module carries the personalisation."""
    se = dict(squeeze_excitation_modules(model))[module]
    own = {k: v.clone() for k, v in excitation_tensors(model, module).items()}
    if set(tensors) != set(own):
        raise ValueError(f"swapped_excitation: {module} has {sorted(own)}, got {sorted(tensors)}")
    se.load_state_dict(tensors, strict=False)
    try:
        yield
    finally:
        se.load_state_dict(own, strict=False)


class SqueezeRecorder:
    """Forward pre-hooks on the SE modules that record each one's squeeze (the global
    average pool of its input, per sample) while ``recording`` is set."""

    def __init__(self, model: nn.Module):
        self.modules = squeeze_excitation_modules(model)
        self.squeezes: dict[str, torch.Tensor] | None = None
        for name, module in self.modules:
            module.register_forward_pre_hook(functools.partial(self._capture, name))

    def _capture(self, name: str, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if self.squeezes is not None:
            self.squeezes[name] = inputs[0].mean(dim=(2, 3))

    def channels(self) -> dict[str, int]:
        return {name: module.fc1.in_channels for name, module in self.modules}

    def forward(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.squeezes = {}
        try:
            out = model(x)
            return out, self.squeezes
        finally:
            self.squeezes = None


class FedSAPEdge(EdgeAlgorithm):
    def __init__(self, method: FedSAP, models: dict[str, nn.Module], device: torch.device):
        super().__init__(method, models, device)
        self.recorder = SqueezeRecorder(self.models["model"])
        zeros = {name: torch.zeros(c, device=device) for name, c in self.recorder.channels().items()}
        self.target = zeros               # S_G, own previous statistics, or zeros (l2)
        self.has_target = False           # False while the target is still the all-zero start
        self.own_stats: dict[str, torch.Tensor] = {}  # s_up of the last training round
        self._gsr_total = torch.zeros((), device=device)  # GSR terms summed over the round
        self._gsr_batches = 0
        self._drift: float | None = None

    @property
    def params(self) -> FedSAPParams:
        return self.method.params

    def receive(self, phase: str, common: Payload, personal: Payload) -> None:
        super().receive(phase, common, personal)
        if self.params.target == "global":
            received = common.tensors(Kind.STAT_VECTORS, STATS)
            if received:
                self.target = {k: v.to(self.device, torch.float32) for k, v in received.items()}
                self.has_target = any(bool(v.any()) for v in self.target.values())

    def begin_train(self) -> None:
        if self.params.target == "local-align" and self.own_stats:
            self.target, self.has_target = dict(self.own_stats), True
        self._gsr_total.zero_()
        self._gsr_batches = 0
        self._drift = None

    def gsr_active(self) -> bool:
        p = self.params
        if p.target == "off" or p.lam == 0:
            return False
        return p.target == "l2" or self.has_target or not p.wait_for_stats

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        model = self.models["model"]
        if not self.gsr_active():
            return F.cross_entropy(model(x), y)
        if self.params.stats_mode == "eval":
            logits = model(x)
            with running_statistics(model):
                _, squeezes = self.recorder.forward(model, x)
        else:
            logits, squeezes = self.recorder.forward(model, x)
        gsr = gsr_loss(squeezes, self.target, self.params.reduction, self.params.gsr_form)
        self._gsr_total += gsr.detach()
        self._gsr_batches += 1
        return F.cross_entropy(logits, y) + self.params.lam * gsr

    @torch.no_grad()
    def end_train(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """s_up,k (eq. 7): the mean squeeze over the whole training set, updated model."""
        if self.params.target not in ("global", "local-align"):
            return
        model = self.models["model"]
        train_mode = self.params.stats_mode == "train"
        training = [(module, module.training) for module in model.modules()]
        buffers = {k: b.clone() for k, b in model.named_buffers()} if train_mode else {}
        model.train(train_mode)
        sums = {name: torch.zeros(c, dtype=torch.float64, device=self.device)
                for name, c in self.recorder.channels().items()}
        count = 0
        for x, _ in batches:
            model.train(train_mode and x.shape[0] > 1)  # BN cannot batch-normalise one sample
            _, squeezes = self.recorder.forward(model, x)
            for name, s in squeezes.items():
                sums[name] += s.sum(dim=0, dtype=torch.float64)
            count += x.shape[0]
        for name, buffer in model.named_buffers():
            if name in buffers:  # the pass must not move BN's running statistics
                buffer.copy_(buffers[name])
        for module, mode in training:
            module.training = mode
        if count:
            self.own_stats = {name: (total / count).float() for name, total in sums.items()}
            if self.has_target:
                self._drift = statistics_drift(self.own_stats, self.target)

    def training_metrics(self) -> dict[str, float]:
        """The mean GSR term of the round's batches (before lambda), and how far this
        edge's statistics ended from the target (mean over modules of ||s_up - target|| /
        ||target||)."""
        metrics = {}
        if self._gsr_batches:
            metrics["gsr_loss"] = float(self._gsr_total) / self._gsr_batches
        if self._drift is not None:
            metrics["stats_drift"] = self._drift
        return metrics

    def after_train(self, steps: int) -> Payload:
        upload = super().after_train(steps)
        if self.params.target == "global":
            upload.sections.append(Section(Kind.STAT_VECTORS, STATS, dict(self.own_stats)))
        return upload

    # The previous round's statistics are local-align's next target: private state.
    def extra_state(self) -> dict[str, torch.Tensor]:
        return {f"stats/{k}": v for k, v in self.own_stats.items()}

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.own_stats = {k[len("stats/"):]: v.to(self.device) for k, v in tensors.items()
                          if k.startswith("stats/")}


class FedSAP(Method):
    name = "fedsap"
    Params = FedSAPParams
    default_model = "se-cnn"  # 3 SE modules, small enough for a CPU demo (the paper: mobilenet-v3-small)
    # SGD momentum, which that model needs to learn in a few rounds: 5 rounds of 1 epoch over
    # 5 edges of the bundled MNIST (Dirichlet 0.3) reach a mean accuracy of 0.75 with it,
    # 0.15 with plain SGD at the same lr (the server's default). A user's value still wins.
    train_settings = {"momentum": 0.9}
    dp_params = {"gsr_form": "per-sample"}  # batch-mean GSR mixes samples (dp_refusal)
    extra_metrics = ("gsr_loss", "stats_drift")  # FedSAPEdge.training_metrics

    def __init__(self, context: MethodContext):
        super().__init__(context)
        p: FedSAPParams = self.params
        if not 0 <= p.lam < float("inf"):
            raise ValueError(f"fedsap.lam must be a finite number >= 0, got {p.lam}")
        if not squeeze_excitation_modules(self.probe_model()):
            raise ValueError(f"fedsap: model {self.train.model!r} has no squeeze-excitation "
                             "modules (use mobilenet-v3-small, se-cnn, anfr-se-*, se-resnet-*, a "
                             "timm SE model such as timm:seresnet18, or a model of your own "
                             "built with torchvision's SqueezeExcitation or timm's SEModule)")

    def method_rules(self) -> tuple[str, ...]:
        """Table I's strategy decides what stays on the edge."""
        return PERSONALIZATION[self.params.personalization]

    def dp_refusal(self) -> str | None:
        p: FedSAPParams = self.params
        gsr = p.target != "off" and p.lam != 0
        if gsr and p.gsr_form == "batch":
            return ("fedsap: GSR (eq. 6) penalises the batch-mean squeeze, which is not a sum "
                    "of per-sample losses: every sample's gradient depends on the whole batch, "
                    "so DP-SGD's per-sample clipping does not bound one sample's influence. "
                    "Use --set fedsap.gsr_form='per-sample' (each sample's squeeze pulled "
                    "toward the target) or fedsap.target='off'")
        if gsr and p.stats_mode == "eval":
            return ("fedsap: stats_mode 'eval' takes GSR's squeezes from a second forward pass "
                    "per batch, which Opacus' per-sample gradients do not follow; under DP "
                    "there is no BatchNorm whose running statistics it would use: use 'train'")
        return None

    @property
    def uploads_stats(self) -> bool:
        return self.params.target == "global"

    def stat_specs(self, models: dict[str, nn.Module]) -> dict[str, TensorSpec]:
        return {name: TensorSpec(torch.float32, (module.fc1.in_channels,))
                for name, module in squeeze_excitation_modules(models["model"])}

    def initial_state(self, models):
        state = super().initial_state(models)
        if self.uploads_stats:
            state[(Kind.STAT_VECTORS, STATS)] = {  # S_G^0 = 0 (the paper)
                name: torch.zeros(spec.shape) for name, spec in self.stat_specs(models).items()}
        return state

    def uplink_schema(self, phase: str, models: dict[str, nn.Module]) -> list[SectionSpec]:
        schema = super().uplink_schema(phase, models)
        if phase == TRAIN and self.uploads_stats:
            schema.append(SectionSpec(Kind.STAT_VECTORS, STATS, self.stat_specs(models)))
        return schema

    def similarity_groups(self, models: dict[str, nn.Module]) -> dict[str, list[str]]:
        """Fig. 1's groups: conv weights outside SE modules, and the SE excitation FCs."""
        model = models["model"]
        se = squeeze_excitation_modules(model)
        se_prefixes = tuple(f"{name}." for name, _ in se)
        conv = [qualified("model", f"{name}.weight") for name, m in model.named_modules()
                if isinstance(m, nn.Conv2d) and not name.startswith(se_prefixes)]
        excitation = [qualified("model", f"{name}.{fc}.{k}") for name, m in se
                      for fc in ("fc1", "fc2") for k in getattr(m, fc).state_dict()]
        return {"conv": conv, "se-e": excitation}

    def edge(self, models, device):
        return FedSAPEdge(self, models, device)

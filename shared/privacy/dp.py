"""Sample-level DP-SGD on the edge (Opacus): the start-time checks, the calibration, the
one wrapping per run, and the privacy ledger.

* What it protects: every update the edge's training takes is Opacus' DP-SGD step: each
  sample's gradient (over every trained parameter of every model, at once) is clipped to
  ``max_grad_norm``, the sum gets Gaussian noise of std ``sigma * max_grad_norm`` and is
  divided by the expected batch size; batches are drawn by Poisson sampling (rate q =
  B / |D_k|), which is what the accountant's amplification by subsampling assumes.
  Everything computed from the trained weights afterwards (the upload, the private
  state) is post-processing. Parameter-only terms (proximal pulls, SCAFFOLD's correction)
  are applied after clipping and noising, through ``EdgeAlgorithm.post_backward``.
* Calibration: sigma for the whole run (``planned_rounds`` x the method's local epochs x
  int(1/q) steps per epoch), per edge from its own |D_k| (delta 0.1 / |D_k| unless
  given). A method that takes K optimizer steps on one batch (pFedMe's inner solve)
  releases K Gaussian sums of the same sample: they compose to one Gaussian with
  sigma / sqrt(K) per sampled batch, which is how they are accounted; sigma is scaled up
  by sqrt(K) so that the run's budget holds.
* The ledger (``privacy-ledger.json`` in the edge's state dir) holds the accountant's
  history and one entry per trained round; the edge writes it before the round's upload
  leaves, and loads it at start, so a restart never resets the budget. When the next
  round would take the spend past ``target_epsilon`` the edge refuses to train.
* The edge's privacy policy: the server proposes ``[dp]``, the edge decides. Its owner's
  limits (``PrivacyPolicy``: ``fl-edge --dp-max-epsilon``, ``--require-dp``) and, from the
  first DP-SGD run on a state dir, the ledger's pin (``PinnedPolicy``: that run's epsilon,
  delta, noise per sampled batch and accountant) bound every later run: a server asking
  for more epsilon or delta, less noise, another accountant or no DP at all is refused
  (``PolicyRefusal``, naming the field, the server's value and the edge's limit) before
  any training. Delta is refused at >= 0.5 everywhere and, on the edge, at >= 1/|D_k|.
* Statistics uploads (STAT_VECTORS, PROTOTYPES, SCALAR_SUMMARY) are computed from the
  data, not from the noised gradients: DP-SGD does not cover them. ``stats_sigma`` > 0
  clips each such tensor to L2 norm ``stats_clip`` and adds N(0, (2 stats_clip
  stats_sigma)^2) per coordinate: whatever one sample does, the clipped tensor moves by
  at most 2 stats_clip, so each release is a Gaussian mechanism of noise multiplier
  stats_sigma, accounted in its own RDP accountant (sampling rate 1).
"""

from __future__ import annotations

import math
import secrets
import warnings
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..config import MAX_DELTA, DPConfig, TrainConfig
from ..data.npz import Split
from ..schema import EVALUATE, TRAIN, Kind, Payload, Section, UploadContract
from ..state import StateError
from .dp_model import batchnorm_layers, disable_inplace_activations

LEDGER_FORMAT = "fedattn-privacy-ledger/1"
# Moves dp.seeded_noise's seed off the stream the round's data order and dropout use.
NOISE_STREAM = 0x2545F4914F6CDD1D
STATS_KINDS = (Kind.STAT_VECTORS, Kind.PROTOTYPES, Kind.SCALAR_SUMMARY)
History = list[tuple[float, float, int]]  # (noise multiplier, sample rate, steps)

if TYPE_CHECKING:
    from opacus.optimizers import DPOptimizer

# Opacus is imported where it is used: a run without --dp never loads it (it adds seconds
# to every process start on a small device).


class DPMethod(UploadContract, Protocol):
    """What the DP checks read of a method: its upload contract, the run's ``[dp]`` and
    ``[train]``, its own refusal and fresh models. ``fedattn_shared.methods.Method`` is
    one; this module never imports it."""

    dp: DPConfig | None
    train: TrainConfig

    def dp_refusal(self) -> str | None: ...

    def build_models(self) -> dict[str, nn.Module]: ...


class DPLoop(Protocol):
    """The training loop's shape as DP-SGD's calibration needs it (``LoopSchedule``)."""

    steps_per_batch: int

    def epochs(self, configured: int) -> int: ...


class DPEdge(Protocol):
    """What DP-SGD wraps and calibrates of a method's edge half (``EdgeAlgorithm``): its
    models, its one optimizer, the loop's shape, and its method."""

    method: DPMethod
    models: dict[str, nn.Module]
    schedule: DPLoop

    def optimizers(self) -> list[torch.optim.Optimizer]: ...


def statistics_sections(method: UploadContract, models: dict[str, nn.Module]) -> list[str]:
    """The upload sections DP-SGD does not cover: statistics of the data (kinds in
    ``STATS_KINDS``) with at least one tensor that is not public metadata."""
    found = []
    for phase in method.phases:
        if phase == EVALUATE:
            continue
        public = method.privacy(phase, models).dp_public
        for spec in method.uplink_schema(phase, models):
            if spec.kind in STATS_KINDS and any((spec.kind, spec.name, t) not in public
                                                for t in spec.tensors):
                found.append(f"{spec.kind.name}:{spec.name!r}")
    return found


def check_dp(method: DPMethod) -> None:
    """Refuse (ValueError naming the fix) a run that DP-SGD cannot honestly cover: a method
    that does not declare support, BatchNorm anywhere in its models (subclasses included:
    Opacus' validator matches exact types and passes timm's BatchNormAct2d), a module
    Opacus cannot compute per-sample gradients for, or statistics uploads with neither
    noise nor the user's explicit consent."""
    dp = method.dp
    if dp is None:
        return
    from opacus.validators import ModuleValidator

    refusal = method.dp_refusal()
    if refusal:
        raise ValueError(f"--dp: {refusal}")
    with torch.device("meta"):  # shapes and module types only
        models = method.build_models()
    for model_name, model in models.items():
        found = batchnorm_layers(model)
        if found:
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            raise ValueError(
                f"--dp: model {method.train.model!r} ({model_name}) has {len(found)} BatchNorm "
                f"layer(s) ({', '.join(found[:3])}{more}); their batch statistics mix samples, "
                "which per-sample clipping does not bound. Pass --dp-fix-model (every "
                "BatchNorm becomes GroupNorm + its activation), or use a GroupNorm or ANFR "
                "model (gn-resnet-compact, anfr-se-compact, ...)")
        errors = ModuleValidator.validate(model, strict=False)
        if errors:
            raise ValueError(f"--dp: Opacus cannot train model {method.train.model!r} "
                             f"({model_name}): {errors[0]}")
    uncovered = statistics_sections(method, models)
    if uncovered and dp.stats_sigma == 0 and not dp.stats_in_clear:
        raise ValueError(
            f"--dp: method {method.name!r} uploads {', '.join(uncovered)}, statistics of the "
            "edge's data that DP-SGD does not cover. Pass --dp-stats-sigma S (clipped, "
            "Gaussian-noised, with its own accounting) or --set dp.stats_in_clear=true to "
            "send them without noise knowingly")


def _merge(history: History, entry: tuple[float, float, int]) -> None:
    if history and history[-1][:2] == entry[:2]:
        sigma, rate, steps = history.pop()
        entry = (sigma, rate, steps + entry[2])
    history.append(entry)


def epsilon(history: History, delta: float, accountant: str = "rdp") -> float:
    """The epsilon a history of (sigma, q, steps) spends at ``delta``."""
    from opacus.accountants import create_accountant

    if not history:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    return float(acc.get_epsilon(delta=delta))


class BudgetSpent(Exception):
    """The next round would spend past the edge's privacy budget."""


class PolicyRefusal(ValueError):
    """A server's ``[dp]`` weaker than what the edge agreed to: the message names the field,
    the server's value and the edge's limit (and where the limit comes from). ``pinned``:
    the limit is the ledger's pin (so the caller can name the ledger's path)."""

    def __init__(self, message: str, pinned: bool = False):
        super().__init__(message)
        self.pinned = pinned


def _eps(value: float) -> str:
    return "unbounded" if math.isinf(value) else f"{value:g}"


@dataclass(frozen=True)
class PinnedPolicy:
    """What an edge agreed to the first time it ran DP-SGD on a state dir, kept in that
    dir's privacy ledger (``"policy"``): the privacy of the data behind the state dir is
    the edge's, so a later server may ask for less spend, never for more. A server that
    could rewrite the budget or turn DP off would make every earlier guarantee moot."""

    epsilon: float           # the budget's ceiling; math.inf: the first run set none
    delta: float             # the resolved delta (0.1 / |D_k| when the server sent 0)
    noise_multiplier: float  # per sampled batch (sigma / sqrt(K) for K steps per batch)
    accountant: str          # one ledger, one way of turning its history into epsilon

    def to_json(self) -> dict:
        return {"epsilon": None if math.isinf(self.epsilon) else self.epsilon,
                "delta": self.delta, "noise_multiplier": self.noise_multiplier,
                "accountant": self.accountant}

    @classmethod
    def from_ledger(cls, ledger: dict) -> PinnedPolicy:
        """The pin of a ledger. A ledger from before pins existed pins what it recorded
        last (budget, delta, accountant); its noise floor is set by the next calibration
        (``noise_multiplier`` 0 here)."""
        try:
            pinned = ledger.get("policy")
            if pinned is None:
                budget = ledger["budget"]
                return cls(math.inf if budget is None else float(budget), float(ledger["delta"]),
                           0.0, str(ledger["accountant"]))
            epsilon_value = pinned["epsilon"]
            policy = cls(math.inf if epsilon_value is None else float(epsilon_value),
                         float(pinned["delta"]), float(pinned["noise_multiplier"]),
                         str(pinned["accountant"]))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise StateError(f"privacy ledger's pinned policy unreadable ({err!r}); it is "
                             "never reset silently: restore it or move the state dir away") from None
        if not (policy.epsilon > 0 and 0 < policy.delta < MAX_DELTA
                and math.isfinite(policy.noise_multiplier) and policy.noise_multiplier >= 0):
            raise StateError(f"privacy ledger's pinned policy is out of range ({pinned}); "
                             "restore it or move the state dir away")
        return policy


@dataclass(frozen=True)
class PrivacyPolicy:
    """The edge's own limits on the DP-SGD a server may run on its data (``fl-edge
    --dp-max-epsilon``, ``--require-dp``), checked with the ledger's pin before any
    training: the server proposes, the edge's owner disposes."""

    max_epsilon: float | None = None  # the largest budget this edge accepts; implies DP
    require_dp: bool = False
    allow_seeded_noise: bool = False  # accept dp.seeded_noise (reproductions, not deployment)

    def __post_init__(self) -> None:
        if self.max_epsilon is not None and not (math.isfinite(self.max_epsilon)
                                                 and self.max_epsilon > 0):
            raise ValueError(f"--dp-max-epsilon must be a finite number > 0, got {self.max_epsilon}")

    @property
    def requires_dp(self) -> bool:
        return self.require_dp or self.max_epsilon is not None

    def check(self, dp: DPConfig | None, pinned: PinnedPolicy | None) -> None:
        """Refuse (PolicyRefusal) a server ``[dp]`` weaker than this policy or the pin, on
        what the server's section says alone (no data needed: it runs before the method
        is loaded). ``check_calibrated`` follows once |D_k| and sigma are known."""
        if dp is None:
            if pinned is not None:
                raise PolicyRefusal(
                    f"dp: the server runs without DP-SGD, but this state dir's privacy ledger "
                    f"is pinned to DP-SGD (epsilon {_eps(pinned.epsilon)}, delta "
                    f"{pinned.delta:.3g}) since its first DP-SGD run", pinned=True)
            if self.max_epsilon is not None:
                raise PolicyRefusal(
                    f"dp: the server runs without DP-SGD (epsilon unbounded); this edge allows "
                    f"at most epsilon {self.max_epsilon:g} (--dp-max-epsilon)")
            if self.require_dp:
                raise PolicyRefusal("dp: the server runs without DP-SGD; this edge trains only "
                                    "under DP-SGD (--require-dp)")
            return
        if dp.seeded_noise and not self.allow_seeded_noise:
            raise PolicyRefusal("dp.seeded_noise: the server asks for DP noise drawn from the "
                                "run seed, which it knows and can subtract; this edge refuses "
                                "(--allow-seeded-dp-noise accepts it, for reproductions only)")
        if not 0 <= dp.delta < MAX_DELTA:
            raise PolicyRefusal(f"dp.delta: the server sends {dp.delta:g}; this edge refuses "
                                f"any delta >= {MAX_DELTA}")
        # Comparisons are written so that a NaN (a [dp] that skipped validate()) is refused.
        asked = dp.target_epsilon or math.inf
        if not asked > 0:
            raise PolicyRefusal(f"dp.target_epsilon: the server sends {dp.target_epsilon}; this "
                                "edge accepts a finite number > 0, or 0 for none")
        limits = []
        if self.max_epsilon is not None:
            limits.append((self.max_epsilon, "--dp-max-epsilon", False))
        if pinned is not None:
            limits.append((pinned.epsilon, "pinned in this state dir's privacy ledger by its "
                                           "first DP-SGD run", True))
        for limit, source, from_pin in limits:
            if not asked <= limit * (1 + 1e-12):
                what = ("sets no budget (a fixed noise multiplier, unbounded spend)"
                        if math.isinf(asked) else f"asks for {asked:g}")
                raise PolicyRefusal(f"dp.target_epsilon: the server {what}; this edge allows "
                                    f"at most {_eps(limit)} ({source})", pinned=from_pin)
        if pinned is not None:
            if dp.delta and not dp.delta <= pinned.delta:
                raise PolicyRefusal(f"dp.delta: the server sends {dp.delta:.3g}; this edge "
                                    f"allows at most {pinned.delta:.3g} (pinned in this state "
                                    "dir's privacy ledger)", pinned=True)
            if dp.accountant != pinned.accountant:
                raise PolicyRefusal(f"dp.accountant: the server uses {dp.accountant!r}; this "
                                    f"state dir's privacy ledger is kept with "
                                    f"{pinned.accountant!r} (pinned by its first DP-SGD run)",
                                    pinned=True)

    @staticmethod
    def check_calibrated(delta: float, num_examples: int, noise_multiplier: float | None,
                         pinned: PinnedPolicy | None) -> None:
        """The checks that need this edge's data: the resolved delta against 1/|D_k| (a
        delta of 1/n lets a mechanism publish one of the n samples outright and still
        claim it) and the pin, and the calibrated noise (per sampled batch) against the
        pin's floor (None: not calibrated yet)."""
        if not delta < 1 / num_examples:
            raise PolicyRefusal(f"dp.delta: the server's delta {delta:.3g} is not below 1/n_k = "
                                f"{1 / num_examples:.3g} for this edge's {num_examples} training "
                                "samples")
        if pinned is None:
            return
        if not delta <= pinned.delta * (1 + 1e-12):
            raise PolicyRefusal(f"dp.delta: the server's run resolves to delta {delta:.3g} on "
                                f"this edge; it allows at most {pinned.delta:.3g} (pinned in "
                                "this state dir's privacy ledger)", pinned=True)
        if noise_multiplier is not None and not noise_multiplier >= pinned.noise_multiplier * (1 - 1e-9):
            raise PolicyRefusal(
                f"dp.noise_multiplier: the server's run gives sigma {noise_multiplier:.4g} per "
                f"sampled batch on this edge; it allows no less than {pinned.noise_multiplier:.4g} "
                "(calibrated by this state dir's first DP-SGD run, pinned in its privacy ledger)",
                pinned=True)


class PrivateTraining:
    """DP-SGD for one edge and the whole run: the models are wrapped for per-sample
    gradients and the method's optimizer becomes a DPOptimizer, once (wrapping again each
    round would stack Opacus' hooks). The models themselves stay what the method holds,
    so state-dict names (split rules, fingerprints, state files) never see Opacus'
    ``_module.`` prefix; Opacus' hooks sit on their layers."""

    def __init__(self, algo: DPEdge, dp: DPConfig, num_examples: int, batch_size: int,
                 ledger: dict | None = None, policy: PrivacyPolicy | None = None,
                 max_physical_batch: int = 0):
        """``ledger``: the state dir's privacy ledger (None: its first DP-SGD run, which
        pins this run's epsilon, delta, noise and accountant as the dir's limits);
        ``policy``: the edge's own limits. A server ``[dp]`` weaker than either raises
        PolicyRefusal before the models are touched. ``max_physical_batch``: the device's
        own bound (``fl-edge --max-physical-batch``; 0: none), which wins over
        ``dp.max_physical_batch`` where it is stricter; the logical batch, and so the
        privacy accounting, is the same either way."""
        if num_examples < 1:
            raise ValueError("--dp: the edge has no training samples")
        policy = policy or PrivacyPolicy()
        pinned = PinnedPolicy.from_ledger(ledger) if ledger is not None else None
        policy.check(dp, pinned)
        self.algo, self.dp = algo, dp
        self.sample_rate = min(1.0, batch_size / num_examples)
        self.expected_batch = min(batch_size, num_examples)
        self.delta = dp.delta or 0.1 / num_examples
        policy.check_calibrated(self.delta, num_examples, None, pinned)
        self.repeats = algo.schedule.steps_per_batch
        limits = [b for b in (dp.max_physical_batch, max_physical_batch) if b > 0]
        self.physical_batch = min(limits) if limits else 0
        if self.repeats > 1 and self.physical_batch:
            raise ValueError(f"--dp: method {algo.method.name!r} takes {self.repeats} steps on "
                             "each batch; that does not combine with dp.max_physical_batch")
        epochs = algo.schedule.epochs(algo.method.train.local_epochs)
        self.batches_per_round = epochs * int(1 / self.sample_rate)
        if dp.noise_multiplier > 0:
            self.noise_multiplier = dp.noise_multiplier
        else:
            from opacus.accountants.utils import get_noise_multiplier

            planned = max(dp.planned_rounds * self.batches_per_round, 1)
            per_batch = get_noise_multiplier(
                target_epsilon=dp.target_epsilon, target_delta=self.delta,
                sample_rate=self.sample_rate, steps=planned, accountant=dp.accountant)
            self.noise_multiplier = per_batch * math.sqrt(self.repeats)
        # K noisy steps on one sampled batch compose to one Gaussian of sigma / sqrt(K).
        self.batch_sigma = self.noise_multiplier / math.sqrt(self.repeats)
        policy.check_calibrated(self.delta, num_examples, self.batch_sigma, pinned)
        # The budget is the strictest of the server's, the edge's and the pin (the checks
        # above refused a larger one; this keeps the ledger's ceiling if they ever change).
        self.budget = min(dp.target_epsilon or math.inf, policy.max_epsilon or math.inf,
                          pinned.epsilon if pinned is not None else math.inf)
        if pinned is None or pinned.noise_multiplier == 0:
            pinned = PinnedPolicy(pinned.epsilon if pinned is not None else self.budget,
                                  pinned.delta if pinned is not None else self.delta,
                                  self.batch_sigma, dp.accountant)
        self.pinned = pinned
        self.history: History = []
        self.stats_history: History = []
        self.rounds: list[dict] = []
        if ledger is not None:
            self._load(ledger)
        self.noise: torch.Generator | None = None  # made by _wrap, on the models' device
        self.optimizer = self._wrap()
        self._public: dict[str, frozenset[tuple[Kind, str, str]]] = {}
        self._steps = 0
        self._stats_released = 0

    def _wrap(self) -> DPOptimizer:
        from opacus.optimizers import DPOptimizer

        from .per_sample import OutputHookGradSampleModule

        optimizers = self.algo.optimizers()
        if len(optimizers) != 1:
            raise ValueError(f"--dp: method {self.algo.method.name!r} uses {len(optimizers)} "
                             "optimizers; DP-SGD clips each sample's gradient over every "
                             "trained parameter at once and needs exactly one")
        optimizer = optimizers[0]
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.wrapped = []
        for model in self.algo.models.values():
            if any(id(p) in trained for p in model.parameters()):
                # Opacus' backward hooks cannot follow activations applied in place.
                disable_inplace_activations(model)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # its notes on the functorch fallback
                    self.wrapped.append(OutputHookGradSampleModule(
                        model, batch_first=True, loss_reduction="mean", strict=True))
        # Opacus draws from torch's global RNG unless given a generator, and that RNG is
        # seeded from the run seed (the models' init, the round's forked RNG): the noise
        # would be known to the server. Its own generator, seeded from the OS's entropy.
        device = next(p.device for g in optimizer.param_groups for p in g["params"])
        self.noise = torch.Generator(device=device)
        self.noise.manual_seed(secrets.randbits(63))
        return DPOptimizer(optimizer, noise_multiplier=self.noise_multiplier,
                           max_grad_norm=self.dp.max_grad_norm,
                           expected_batch_size=self.expected_batch, loss_reduction="mean",
                           generator=self.noise)

    def begin_phase(self, seed: int, phase: str) -> None:
        """With ``dp.seeded_noise`` (reproductions only), the phase's noise restarts from
        ``seed`` (the round's ``loader_seed``) and the phase's name; otherwise nothing
        changes: the noise goes on from the OS-seeded generator."""
        if self.dp.seeded_noise:
            self.noise.manual_seed((seed ^ NOISE_STREAM ^ zlib.crc32(phase.encode())) % 2**63)

    # ---- the training loop's side ------------------------------------------------------
    # The loop (``fl_edge.trainer``) calls these on whatever supplies its steps: this class
    # under DP-SGD, its plain counterpart otherwise; it has no branch of its own for DP.
    def check_options(self, amp: bool, grad_accum: int, clip_grad_norm: float) -> None:
        """What DP-SGD does not combine with, refused before the first batch (the edge sets
        them aside before, ``fl_edge.run.dp_loop_options``): AMP, since Opacus' optimizer
        does not unscale per-sample gradients and its grad samplers expect float32;
        accumulation over micro-batches, since DP-SGD's logical batch is the Poisson draw
        itself (a device bounds its memory with physical batches instead)."""
        if amp or grad_accum > 1:
            raise ValueError("DP-SGD does not combine with amp or grad_accum > 1 (bound memory "
                             "with dp.max_physical_batch or fl-edge --max-physical-batch)")
        if clip_grad_norm:
            raise ValueError("train.clip_grad_norm does not combine with DP-SGD: its per-sample "
                             "clipping (dp.max_grad_norm) already bounds every step")

    def loader(self, data: Split, batch_size: int, generator: torch.Generator) -> Iterable:
        """Poisson-sampled batches (int(1/q) per epoch, sizes vary, possibly empty), split
        into physical batches of at most ``physical_batch`` when set (the stricter of the
        server's dp.max_physical_batch and the device's). ``batch_size``
        is the expected size the sample rate was calibrated for, not used again."""
        from opacus.data_loader import DPDataLoader
        from opacus.utils.batch_memory_manager import wrap_data_loader

        loader = DPDataLoader(TensorDataset(data.x, data.y), sample_rate=self.sample_rate,
                              generator=generator)
        if self.physical_batch:
            loader = wrap_data_loader(data_loader=loader, max_batch_size=self.physical_batch,
                                      optimizer=self.optimizer)
        return loader

    def begin(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Nothing: the method's one optimizer was wrapped once, at construction."""

    def backward(self, loss: torch.Tensor, share: float = 1.0) -> None:
        """Per-sample gradients come from Opacus' hooks on an ordinary backward pass. A part
        of a split batch is not weighed by its ``share``: with ``loss_reduction="mean"``
        Opacus rescales each part's per-sample gradients by the part's own size."""
        loss.backward()

    def partial(self) -> None:
        """A part of a physical batch split for memory (``fl_edge.memory``): its per-sample
        gradients are clipped into the logical batch's sum now, as Opacus does for each
        physical batch but the last, and freed."""
        self.optimizer.clip_and_accumulate()
        self._drop_pass()

    def discard(self) -> bool:
        """After an out-of-memory error: the failed pass's per-sample gradients and
        captured activations are dropped; what earlier parts clipped into the sum stays."""
        self._drop_pass()
        for model in self.wrapped:
            for module in model.modules():
                if hasattr(module, "activations"):
                    module.activations = []
            # A pass cut short leaves Opacus' per-parameter bookkeeping mid-way: forwards
            # counted without their backward, a per-sample gradient not yet promoted.
            for param in model.parameters():
                if hasattr(param, "_forward_counter"):
                    param._forward_counter = 0
                if hasattr(param, "_current_grad_sample"):
                    del param._current_grad_sample
        return False

    def _drop_pass(self) -> None:
        for p in self.optimizer.params:
            p.grad_sample = None
            p.grad = None

    def empty_batch(self) -> None:
        """Poisson sampling drew no sample: the step still releases the noise alone."""
        for p in self.optimizer.params:
            p.grad_sample = torch.zeros((0, *p.shape), device=p.device, dtype=p.dtype)

    def step(self, post_backward: Callable[[], None]) -> bool:
        """Clip and noise, then the method's gradient post-processing, then the optimizer
        step. False for a physical batch that only accumulated (the logical batch goes on)."""
        stepped = bool(self.optimizer.pre_step())
        if stepped:
            post_backward()
            self.optimizer.original_optimizer.step()
            self._steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return stepped

    def clip_figures(self) -> tuple[float, int]:
        """No train.clip_grad_norm figures: DP-SGD's per-sample clipping is the only one."""
        return 0.0, 0

    # ---- accounting ----------------------------------------------------------------------
    def spent(self) -> float:
        return epsilon(self.history, self.delta, self.dp.accountant)

    def check_budget(self) -> None:
        """Raise BudgetSpent when one more round would take the spend past the budget."""
        projected = list(self.history)
        _merge(projected, (self.batch_sigma, self.sample_rate, self.batches_per_round))
        after = epsilon(projected, self.delta, self.dp.accountant)
        if after > self.budget * (1 + 1e-9):
            raise BudgetSpent(
                f"privacy budget spent: epsilon {self.spent():.4g} of {self.budget:g} "
                f"(delta {self.delta:.3g}) after {len(self.rounds)} trained round(s); one more "
                f"round would reach {after:.4g}, so this edge trains no more")

    def privatize_upload(self, phase: str, upload: Payload) -> Payload:
        """The upload with its statistics tensors clipped and noised (``stats_sigma`` > 0);
        every other section as it is."""
        sigma = self.dp.stats_sigma
        if sigma == 0:
            return upload
        if phase not in self._public:  # the method's declaration: fixed for the run
            self._public[phase] = self.algo.method.privacy(phase, self.algo.models).dp_public
        public = self._public[phase]
        clip = self.dp.stats_clip
        sections = []
        for section in upload.sections:
            if section.kind not in STATS_KINDS:
                sections.append(section)
                continue
            tensors = {}
            for name, tensor in section.tensors.items():
                if (section.kind, section.name, name) in public:
                    tensors[name] = tensor
                    continue
                value = tensor.detach().float()
                value = value * min(1.0, clip / (float(value.norm()) + 1e-12))
                draw = torch.randn(value.shape, generator=self.noise, dtype=value.dtype,
                                   device=self.noise.device).to(value.device)
                noisy = value + draw * (2 * clip * sigma)
                tensors[name] = noisy.to(tensor.dtype)
                self._stats_released += 1
            sections.append(Section(section.kind, section.name, tensors))
        return Payload(sections)

    def end_round(self, round_number: int, phase: str = TRAIN) -> dict[str, float]:
        """Book the phase's DP-SGD steps and statistics releases; the figures it returns
        go to the server with the result (and into its history)."""
        batches = self._steps // self.repeats
        if batches:
            _merge(self.history, (self.batch_sigma, self.sample_rate, batches))
        if self._stats_released:
            _merge(self.stats_history, (self.dp.stats_sigma, 1.0, self._stats_released))
        figures = {"dp_epsilon": self.spent(), "dp_delta": self.delta,
                   "dp_noise_multiplier": self.noise_multiplier, "dp_steps": float(batches)}
        if self.stats_history:
            figures["dp_stats_epsilon"] = epsilon(self.stats_history, self.delta)
            figures["dp_total_epsilon_rdp"] = epsilon(self.history + self.stats_history, self.delta)
        self.rounds.append({"round": round_number, "phase": phase, **figures})
        self._steps = self._stats_released = 0
        return figures

    # ---- the ledger ------------------------------------------------------------------------
    def ledger(self) -> dict:
        return {
            "format": LEDGER_FORMAT, "accountant": self.dp.accountant, "delta": self.delta,
            "budget": None if math.isinf(self.budget) else self.budget,
            "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
            "max_grad_norm": self.dp.max_grad_norm, "history": [list(h) for h in self.history],
            "stats_history": [list(h) for h in self.stats_history], "rounds": self.rounds,
            "policy": self.pinned.to_json(),
        }

    def _load(self, ledger: dict) -> None:
        """The accountant state of earlier runs and rounds: (sigma, q, steps) entries,
        which any of Opacus' accountants evaluates, so the spend carries over even when
        the configuration changed."""
        try:
            if ledger["format"] != LEDGER_FORMAT:
                raise ValueError(f"format {ledger['format']!r}")
            self.history = [(float(s), float(q), int(n)) for s, q, n in ledger["history"]]
            self.stats_history = [(float(s), float(q), int(n))
                                  for s, q, n in ledger["stats_history"]]
            self.rounds = list(ledger["rounds"])
        except (KeyError, TypeError, ValueError) as err:
            raise StateError(f"privacy ledger unreadable ({err}); it is never reset silently: "
                             "restore it or move the state dir away") from None


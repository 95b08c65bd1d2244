"""The Method abstraction: everything a federated method declares, in one place.

A method module declares
  * its declaration, ``MethodSpec``: name, ``Params`` dataclass, aggregator class, split
    rules, phases, default model and the training settings its math needs, DP-SGD
    support, personal copy, extra metric names. Written as constants of the class body
    (``name = "fedbn"``, ``private_rules = ("bn",)``, ``aggregator = MedianAggregator``)
    -- the plug-in style every method already used --
    and folded by ``Method.__init_subclass__`` into one frozen ``cls.spec``, validated
    when the class is built. The names stay readable on the class and on instances
    (``Method.name``, ``method.phases``), but no instance can assign them: what depends
    on the parameters is a hook the base calls (``method_rules`` for Fed-SAP's and
    pFedKA's split), checked once, after ``__init__``, exactly like declared rules;
  * its models (named: one for most methods, two for Ditto, ...) and a split rule per
    model (which tensors are shared, which stay private);
  * the server side: an aggregator class of one of three kinds (``aggregators.py``); the
    kind is the aggregator class's own ``kind``, so ``method.aggregator_kind`` is derived,
    never declared twice;
  * the edge side: hooks into the one generic training loop (``EdgeAlgorithm``); the few
    methods that reshape the loop (pFedMe's K steps per batch, FedRep's extra epochs)
    set one ``LoopSchedule`` instead of a hook each;
  * its payload schema: the sections each phase uploads, checked on the server before
    any byte of an upload touches the aggregate, and their privacy traits in one
    ``PhasePrivacy`` per phase (what SecAgg may mask, what it sends in the clear, which
    statistics DP leaves as they are).

Hyperparameter choices are ``Literal[...]`` types on the ``Params`` dataclass: the config
loader and ``Method.__init__`` check them with one message. Plumbing that is not a
method's math -- packing the shared tensors into one vector so a download is one copy --
lives in ``fedattn_shared.tensors`` (``PackedTensors``): the base owns the plumbing, the
subclass the math, as ``torch.optim.Optimizer`` does. A method that runs another on
changed models (pFedLA) is a subclass of that method built per host (``PFedLA[host]``),
so every host hook is inherited rather than forwarded.

The daemons only ever talk to this interface; none of them branches on a method name.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DPConfig, TrainConfig, check_choices
from ..models import build_model, model_spec
from ..rng import GLOBAL_RNG_LOCK
from ..schema import (
    COMPRESSION,
    COMPRESSION_RULES,
    EVALUATE,
    TRAIN,
    Kind,
    Payload,
    PhasePrivacy,
    Section,
    SectionSpec,
    TensorSpec,
)
from ..tensors import PackedTensors
from ..wire.payload import TensorViews
from . import split
from .aggregators import Aggregator, AggregatorKind, StreamingMean

#: The monitoring figures every edge may report with a result (the training loop's, the
#: fine-tuning before evaluation, and the DP ledger's). The server keeps only these plus
#: a method's ``extra_metrics``: each name becomes a metric series and a history entry.
STANDARD_METRICS = frozenset({
    "train_seconds", "steps", "samples_per_second", "lr", "train_loss", "last_epoch_loss",
    "finetune_loss", "finetune_seconds", "dp_epsilon", "dp_delta", "dp_noise_multiplier",
    "dp_steps", "dp_stats_epsilon", "dp_total_epsilon_rdp",
    "grad_norm", "clipped_fraction",  # train.clip_grad_norm: mean norm before the clip, share clipped
    "compress_seconds",  # --compress: the edge's CPU seconds decoding the downlink and coding the upload
    "throttle_seconds",  # fl-edge --throttle (simulations only): the seconds the edge slept
    # device telemetry (fl_edge.telemetry), only from edges that have it: the training
    # task's energy (J), mean power (W) and mean GPU utilisation (0..1)
    "energy_joules", "device_power_watts", "gpu_utilization",
})


@dataclass
class NoParams:
    """A method without hyperparameters of its own."""


@dataclass
class MethodContext:
    """What a method instance is built from: the run's training config and its own params.
    ``probe`` builds the model the method will really hold, for the split-rule checks,
    when that is not the registry's model (a wrapping method inserts layers)."""

    train: TrainConfig
    params: Any
    probe: Callable[[], nn.Module] | None = None
    dp: DPConfig | None = None  # the run's [dp] section when DP-SGD is on


def qualified(model_name: str, key: str) -> str:
    return f"{model_name}/{key}"


def unqualify(name: str) -> tuple[str, str]:
    model_name, _, key = name.partition("/")
    return model_name, key


def _same(configured: int) -> int:
    return configured


def _nothing(*_: Any) -> None:
    return None


def _sorted_pairs(value: Any, keys: set[str], refusal: str) -> tuple[tuple[str, Any], ...]:
    """A declared {key: value} as sorted (key, value) pairs (hashable, for the frozen
    spec), every key one of ``keys``; TypeError ``refusal`` otherwise."""
    pairs = tuple(sorted(value.items())) if isinstance(value, Mapping) else value
    if not (isinstance(pairs, tuple) and all(
            isinstance(pair, tuple) and len(pair) == 2 and pair[0] in keys for pair in pairs)):
        raise TypeError(f"{refusal}, got {value!r}")
    return pairs


@dataclass(frozen=True)
class MethodSpec:
    """What a method declares once, for the class: validated when the class is built and
    frozen from then on (a method instance never reassigns any of it).

    A method declares it as constants of its class body (``name = "fedbn"``,
    ``private_rules = ("bn",)``, ``aggregator = MedianAggregator``, ...), as plug-ins
    always have; ``Method.__init_subclass__`` folds them into ``cls.spec``, on top of the
    parent's, and the names stay readable on the class and its instances."""

    name: str = ""
    #: The hyperparameter dataclass (``[<name>]`` in a config, ``--set <name>.key=``).
    Params: type = NoParams
    #: The server half; its class declares the aggregator kind (``Aggregator.kind``).
    aggregator: type[Aggregator] = StreamingMean
    #: Split rules of the method itself; rules that depend on the parameters come from
    #: ``Method.method_rules`` instead (validated the same way, once per instance).
    private_rules: tuple[str, ...] = ()
    phases: tuple[str, ...] = (TRAIN, EVALUATE)
    #: The model a run of this method uses when no source (file, flag, --set) names one.
    default_model: str | None = None
    #: Training settings (``[train]`` keys) the method's math needs, applied like
    #: ``default_model`` where no source sets them: SCAFFOLD's control variates assume
    #: plain SGD (``{"momentum": 0.0, "weight_decay": 0.0}``); Fed-SAP's default model
    #: needs momentum to learn in a few rounds. fl-demo's own preferences
    #: (momentum for a short demo) give way to them; an explicit user setting does not
    #: (the method then refuses it by name). Declared as a dict, kept as sorted pairs.
    train_settings: Any = ()
    #: DP-SGD support (``--dp``): True when every loss term ``training_step`` returns is a
    #: batch mean of per-sample terms, each depending on its own sample only (what
    #: per-sample clipping bounds), and parameter-only terms are ``post_backward`` (applied
    #: after clipping and noise). A method that does not declare it is refused under --dp;
    #: one whose support depends on its parameters overrides ``Method.dp_refusal``.
    dp_support: bool = False
    #: Parameter values (``Params`` fields) under which DP-SGD can cover the loss, for a
    #: method whose default cannot be (``dp_refusal`` names them): Fed-SAP's per-sample GSR.
    #: Tools that turn DP on for a user (fl-demo --dp) apply them where the user set none;
    #: the server never does (a run's parameters are the user's). Kept as sorted pairs.
    dp_params: Any = ()
    #: (shared model, private model): a second model per edge that starts as a copy of the
    #: shared one and never leaves the edge (Ditto's and pFedMe's personal model, FedAvg-FT's
    #: fine-tuned one). None: the models of ``model_names`` as they are split.
    personal_copy: tuple[str, str] | None = None
    #: Names of the figures ``EdgeAlgorithm.training_metrics`` reports, beyond
    #: ``STANDARD_METRICS``; the server ignores any other name an edge sends.
    extra_metrics: tuple[str, ...] = ()
    #: How ``--compress up=`` treats each kind of upload section, over the defaults
    #: (``COMPRESSION``): "delta" codes the change against the common downlink the edge
    #: received (model weights: small changes compress well), "values" codes the values
    #: themselves (statistics, prototypes, control variates: the edge holds no base for
    #: them), "exact" sends the section as it is (what a method must not have rounded).
    #: Declared as a dict {Kind: rule}, kept as sorted (Kind, rule) pairs, defaults filled.
    compression: Any = ()

    def __post_init__(self) -> None:
        where = f"method {self.name or '(unnamed)'!r}"
        if not isinstance(self.name, str):
            raise TypeError(f"{where}: name must be a string")
        if not (isinstance(self.Params, type) and dataclasses.is_dataclass(self.Params)):
            raise TypeError(f"{where}: Params must be a dataclass, got {self.Params!r}")
        if not (isinstance(self.aggregator, type) and issubclass(self.aggregator, Aggregator)
                and isinstance(getattr(self.aggregator, "kind", None), AggregatorKind)):
            raise TypeError(f"{where}: aggregator must be an Aggregator class declaring its "
                            f"kind, got {self.aggregator!r}")
        for key, dataclass_, what in (("train_settings", TrainConfig, "[train] keys"),
                                      ("dp_params", self.Params, "Params fields")):
            object.__setattr__(self, key, _sorted_pairs(
                getattr(self, key), {f.name for f in dataclasses.fields(dataclass_)},
                f"{where}: {key} must map {what} to values"))
        for key in ("private_rules", "phases", "extra_metrics"):
            value = getattr(self, key)
            if not (isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
                raise TypeError(f"{where}: {key} must be a tuple of strings, got {value!r}")
        split.check_rules(self.private_rules, where=f"{where} private_rules")
        if (TRAIN not in self.phases or EVALUATE not in self.phases
                or len(set(self.phases)) != len(self.phases)):
            raise TypeError(f"{where}: phases {self.phases!r} must name {TRAIN!r} and "
                            f"{EVALUATE!r}, each phase once")
        if self.personal_copy is not None and not (
                isinstance(self.personal_copy, tuple) and len(self.personal_copy) == 2
                and len(set(self.personal_copy)) == 2):
            raise TypeError(f"{where}: personal_copy must be (shared, private), two names")
        rules = self.compression
        rules = dict(rules.items() if isinstance(rules, Mapping) else rules)
        if not all(isinstance(k, Kind) and v in COMPRESSION_RULES for k, v in rules.items()):
            raise TypeError(f"{where}: compression must map a Kind to one of "
                            f"{COMPRESSION_RULES}, got {self.compression!r}")
        object.__setattr__(self, "compression",
                           tuple(sorted({**COMPRESSION, **rules}.items())))
        overlap = STANDARD_METRICS & set(self.extra_metrics)
        if overlap:
            raise TypeError(f"{where}: extra_metrics repeat standard ones: {sorted(overlap)}")

    @property
    def aggregator_kind(self) -> AggregatorKind:
        return self.aggregator.kind


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(MethodSpec))


class _Declared:
    """A name of the spec, read on the class or an instance, never assigned: a method
    whose declaration depends on its parameters overrides the hook that reads it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name

    def __get__(self, obj: Any, owner: type) -> Any:
        return getattr(owner.spec, self.field)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{self.field} is part of the method's declaration "
                             f"({type(obj).__name__}.spec), fixed when the class was built")


def fingerprint_of(name: str, train: TrainConfig, split_rules: dict[str, tuple[str, ...]],
                   models: dict[str, nn.Module]) -> str:
    """The fingerprint of method ``name`` on ``models`` split by ``split_rules``."""
    description = {
        "method": name,
        "model": train.model,
        "num_classes": train.num_classes,
        "in_channels": train.in_channels,
        "image_size": train.model_size,  # the size the models are built for
        "split": split_rules,
        "tensors": [
            [model_name, key, list(t.shape), str(t.dtype)]
            for model_name, model in sorted(models.items())
            for key, t in model.state_dict().items()
        ],
    }
    blob = json.dumps(description, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


class _MethodType(type):
    """Builds a method in two steps: ``__init__`` (the subclass checks its parameters and
    derives what it needs), then ``_validate`` once, on the finished instance -- so split
    rules that depend on the parameters are checked exactly like declared ones."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        method = super().__call__(*args, **kwargs)
        method._validate()
        return method


class Method(metaclass=_MethodType):
    """Base class of every method: a declaration (``spec``) and the hooks it overrides.

    Lifecycle: the class body's constants become ``cls.spec`` (validated when the class is
    built); an instance is built from a ``MethodContext`` (its ``__init__`` checks its
    parameters; ``Literal`` choices are checked here first), then its split rules, the
    declared and the parameter-dependent ones (``method_rules``) and the user's
    ``train.private``, are checked against the run's model once.
    """

    spec: MethodSpec = MethodSpec()
    name = _Declared()
    Params = _Declared()
    aggregator = _Declared()
    private_rules = _Declared()
    phases = _Declared()
    default_model = _Declared()
    train_settings = _Declared()
    dp_support = _Declared()
    dp_params = _Declared()
    personal_copy = _Declared()
    extra_metrics = _Declared()
    compression = _Declared()
    aggregator_kind = _Declared()

    def __init_subclass__(cls, **declared: Any) -> None:
        super().__init_subclass__()
        # Declarations as class-body constants (the plug-in style) or class keywords.
        for key in _SPEC_FIELDS:
            value = cls.__dict__.get(key)
            if key in cls.__dict__ and not isinstance(value, _Declared):
                declared.setdefault(key, value)
                delattr(cls, key)
        if "aggregator_kind" in cls.__dict__:
            raise TypeError(f"{cls.__name__}: the aggregator kind comes from the aggregator "
                            "class (declare aggregator = <Aggregator subclass>)")
        unknown = set(declared) - set(_SPEC_FIELDS)
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown declaration(s) {sorted(unknown)}")
        cls.spec = dataclasses.replace(cls.spec, **declared)

    def __init__(self, context: MethodContext):
        self.train = context.train
        self.params = context.params
        self.dp = context.dp
        self._probe = context.probe
        split.check_rules(self.train.private)
        check_choices(self.params, self.name)
        self.head = model_spec(self.train.model).head

    def _validate(self) -> None:
        """Once, after ``__init__``: every split rule must select something in the run's
        model (the metaclass calls it)."""
        self.check_rules_apply(self.method_rules(), where=f"method {self.name!r}")
        self.check_rules_apply(tuple(self.train.private), where="train.private")

    def method_rules(self) -> tuple[str, ...]:
        """The method's own split rules: the declared ``private_rules``, or, for a method
        whose split depends on its parameters (Fed-SAP's personalization), an override."""
        return self.private_rules

    def probe_model(self) -> nn.Module:
        """The run's model on the meta device: shapes and module types only, no memory and
        no draw from the RNG."""
        t = self.train
        with torch.device("meta"):
            if self._probe is not None:
                return self._probe()
            return build_model(t.model, t.num_classes, t.in_channels, t.model_size)

    def check_rules_apply(self, rules: tuple[str, ...], where: str) -> None:
        """Refuse (ValueError, so fl-server exits 2) split rules that select nothing in the
        run's model, e.g. FedBN or ``--private bn`` on a BatchNorm-free model."""
        if rules:
            split.check_rules_apply(self.probe_model(), rules, self.head, self.train.model, where)

    # ---- declarations -------------------------------------------------------------
    def metric_names(self) -> frozenset[str]:
        """Every figure name an edge of this method may report with a result."""
        return STANDARD_METRICS | frozenset(self.extra_metrics)

    def model_names(self) -> tuple[str, ...]:
        return self.personal_copy or ("model",)

    def build_models(self) -> dict[str, nn.Module]:
        """Fresh models, identical on every edge and the server for the same seed (alone on
        the global RNG: edges that share a process build theirs in turn)."""
        t = self.train
        with GLOBAL_RNG_LOCK:
            torch.manual_seed(t.seed)
            models = {name: build_model(t.model, t.num_classes, t.in_channels, t.model_size)
                      for name in self.model_names()}
        if self.personal_copy:
            shared, personal = self.personal_copy
            models[personal] = copy.deepcopy(models[shared])
        return models

    def split_rules(self) -> dict[str, tuple[str, ...]]:
        """Private rules per model: the method's own plus the user's ``train.private``."""
        rules = tuple(dict.fromkeys(self.method_rules() + tuple(self.train.private)))
        split_rules = {name: rules for name in self.model_names()}
        if self.personal_copy:
            split_rules[self.personal_copy[1]] = ("all",)
        return split_rules

    def shared_specs(self, models: dict[str, nn.Module]) -> dict[str, TensorSpec]:
        specs: dict[str, TensorSpec] = {}
        rules = self.split_rules()
        for model_name, model in models.items():
            params = dict(model.named_parameters())
            state = model.state_dict()
            for key in split.shared_names(model, rules[model_name], self.head):
                tensor = state[key]
                specs[qualified(model_name, key)] = TensorSpec(
                    tensor.dtype, tuple(tensor.shape), is_buffer=key not in params)
        return specs

    def initial_state(self, models: dict[str, nn.Module]) -> dict[tuple[Kind, str], dict[str, torch.Tensor]]:
        """The server's starting global sections (shared tensors of fresh models)."""
        shared = self.shared_specs(models)
        if not shared:
            return {}
        tensors = {}
        for name in shared:
            model_name, key = unqualify(name)
            tensors[name] = models[model_name].state_dict()[key].detach().clone()
        return {(Kind.SHARED_TENSORS, ""): tensors}

    def uplink_schema(self, phase: str, models: dict[str, nn.Module]) -> list[SectionSpec]:
        """Sections an edge uploads in ``phase``; the server refuses anything else."""
        if phase != TRAIN:
            return []
        shared = self.shared_specs(models)
        return [SectionSpec(Kind.SHARED_TENSORS, "", shared)] if shared else []

    def check_upload(self, phase: str, upload: Payload) -> None:
        """Checks the schema cannot express (consistency between sections, value ranges),
        on a decoded upload that matched the schema, before it reaches the aggregator.
        Raise ValueError with the reason: the server refuses the upload and drops the task."""

    def privacy(self, phase: str, models: dict[str, nn.Module]) -> PhasePrivacy:
        """The privacy traits of ``phase``'s uploads (see ``PhasePrivacy``). Default: every
        section summable for the streaming-sum and server-optimizer aggregators, none for
        collect-then-learn (it needs each upload); nothing in the clear, nothing public.
        A method mixing both declares the exact sets."""
        if self.aggregator_kind == AggregatorKind.COLLECT:
            return PhasePrivacy()
        return PhasePrivacy(summable=frozenset(
            (spec.kind, spec.name) for spec in self.uplink_schema(phase, models)))

    def similarity_groups(self, models: dict[str, nn.Module]) -> dict[str, list[str]]:
        """Groups of shared tensors (qualified names) whose mean pairwise cosine similarity
        across the round's uploads the server records per round (none by default)."""
        return {}

    def aggregation_weight(self, num_examples: int) -> float:
        return float(num_examples)

    def fingerprint(self, models: dict[str, nn.Module]) -> str:
        """Identifies the method, model and split: stored private state must match it."""
        return fingerprint_of(self.name, self.train, self.split_rules(), models)

    def dp_refusal(self) -> str | None:
        """Why this configuration cannot train under DP-SGD, or None when it can."""
        if self.dp_support:
            return None
        return (f"method {self.name!r} does not declare DP-SGD support (Method.dp_support): "
                "its loss is not known to be a mean of per-sample terms")

    def describe_params(self) -> dict[str, Any]:
        return dataclasses.asdict(self.params)

    # ---- the two halves -----------------------------------------------------------
    def edge(self, models: dict[str, nn.Module], device: torch.device) -> EdgeAlgorithm:
        return EdgeAlgorithm(self, models, device)

    def server(self, models: dict[str, nn.Module]) -> Aggregator:
        return self.aggregator(self, models)


def _set_mode(model: nn.Module, modules: list[nn.Module], training: bool) -> None:
    """``model.train(training)``, skipped when every module is already in that mode (the
    call walks every module through ``__setattr__``: ~1.5 ms a round for a small CNN)."""
    if any(m.training != training for m in modules):
        model.train(training)


@dataclass(frozen=True)
class LoopSchedule:
    """The shape of the training loop, for the few methods that change it (an edge's
    ``schedule``; the default leaves the loop as configured).

    ``steps_per_batch``: optimizer steps on each batch before ``after_batch`` (pFedMe's K
    inner steps); more than 1 does not combine with gradient accumulation (the edge
    refuses it at start). ``epochs(E)``: how many epochs a round runs given the configured
    E (FedRep adds its head epochs). ``begin_epoch(epoch)``: before each epoch, 0-based
    (FedRep switches between head and body; pFedKA keeps figures of the last epoch only).
    ``after_batch()``: after the steps on one batch (pFedMe's update of the local model
    toward the personalized solution)."""

    steps_per_batch: int = 1
    epochs: Callable[[int], int] = _same
    begin_epoch: Callable[[int], None] = _nothing
    after_batch: Callable[[], None] = _nothing


class EdgeAlgorithm:
    """Edge-side hooks around the generic training loop in ``fl_edge.trainer``.

    The loop calls, per round: ``receive`` (the downlink), ``begin_train``, then for each
    of ``schedule.epochs(E)`` epochs ``schedule.begin_epoch`` and for every batch,
    ``schedule.steps_per_batch`` times, ``training_step`` -> backward -> ``post_backward``
    (parameter-only terms as gradient post-processing, so they also survive DP-SGD's
    clipping) -> optimizer steps, then ``schedule.after_batch``; after the last epoch
    ``end_train`` (one pass over the data, if the method wants it) and ``after_train`` for
    the upload; ``training_metrics`` adds
    monitoring scalars to the result. ``predict`` is the personalized model used for
    evaluation and export; ``before_evaluate`` may name another algorithm (a fine-tuned
    copy) for evaluation to train first and score.
    ``num_examples`` is the size of the training split of the current training phase (the
    loop sets it before ``begin_train``).
    """

    #: The loop's shape (see ``LoopSchedule``); a method that changes it sets its own.
    schedule: LoopSchedule = LoopSchedule()

    #: Loop hooks this class overrides that ``fl_tools.sim_batched`` (fl-sim --batch-edges:
    #: several edges' steps as one vmapped computation) still reproduces: today only
    #: ``post_backward``, declared by an edge whose ``post_backward`` is exactly the pull
    #: of ``proximal_term`` (FedProx). An override not declared here keeps the edge on the
    #: sequential loop (``fl_tools.sim_batched.batch_refusal`` says why).
    batched_hooks: ClassVar[tuple[str, ...]] = ()

    #: Hooks of earlier versions and where they live now: a subclass defining one would
    #: otherwise be silently ignored.
    _MOVED: ClassVar[dict[str, str]] = {
        "steps_per_batch": "schedule = LoopSchedule(steps_per_batch=...)",
        "local_epochs": "schedule = LoopSchedule(epochs=...)",
        "begin_epoch": "schedule = LoopSchedule(begin_epoch=...)",
        "after_batch": "schedule = LoopSchedule(after_batch=...)",
        "state_tensors": "extra_state", "load_state_tensors": "load_extra_state",
        "state_tensor": "live_tensor",
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in EdgeAlgorithm._MOVED.items():
            if old in cls.__dict__:
                raise TypeError(f"{cls.__name__}.{old}: this hook is now {new}")

    def __init__(self, method: Method, models: dict[str, nn.Module], device: torch.device):
        self.method = method
        self.models = {name: model.to(device) for name, model in models.items()}
        self.device = device
        self.shared_specs = method.shared_specs(self.models)
        self.global_tensors: Mapping[str, torch.Tensor] = {}
        self._optimizers: list[torch.optim.Optimizer] | None = None
        self._live_tensors: dict[str, torch.Tensor] | None = None
        self._private_names: list[str] | None = None
        # The shared tensors, packed into one vector where they can be (the plumbing that
        # makes a download one copy and an upload one read).
        self.shared_tensors = PackedTensors(
            {name: self.live_tensor(name) for name in self.shared_specs})
        # The module lists, for the per-round mode switch and figures (naming a model's
        # modules again every round costs ~1 ms of Python).
        self._modules = {name: list(model.modules()) for name, model in self.models.items()}
        self.num_examples = 0

    # ---- tensors --------------------------------------------------------------------
    def live_tensor(self, name: str) -> torch.Tensor:
        """The live parameter or buffer ``model/key`` (updated in place by training)."""
        if self._live_tensors is None:
            self._live_tensors = {
                qualified(model_name, key): tensor
                for model_name, model in self.models.items()
                for key, tensor in model.state_dict(keep_vars=True).items()}
        return self._live_tensors[name]

    def private_names(self) -> list[str]:
        """Every model tensor that never travels (``model/key``), by model then key. Named
        once: ``state_dict()`` walks every module, ~3 ms a round for a small CNN; the
        tensors themselves come from ``live_tensor``, the live objects, as loads use."""
        if self._private_names is None:
            self._private_names = [
                qualified(model_name, key) for model_name in sorted(self.models)
                for key in sorted(self.models[model_name].state_dict(keep_vars=True))
                if qualified(model_name, key) not in self.shared_specs]
        return self._private_names

    def load_shared(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy received values into the live tensors they name: the whole shared section
        as one vector when it arrives so (``PackedTensors.load_vector``), else by name."""
        if isinstance(tensors, TensorViews) and self.shared_tensors.load_vector(
                tensors.layout.names, tensors.layout.shapes, tensors.flat):
            return
        with torch.no_grad():
            for name, value in tensors.items():
                self.live_tensor(name).copy_(value)

    def shared_values(self) -> dict[str, torch.Tensor]:
        return self.shared_tensors.clone()

    def named_trainable(self, model_name: str) -> Iterable[tuple[str, nn.Parameter]]:
        return ((qualified(model_name, k), p) for k, p in self.models[model_name].named_parameters()
                if p.requires_grad)

    # ---- hooks ----------------------------------------------------------------------
    def receive(self, phase: str, common: Payload, personal: Payload) -> None:
        shared = common.tensors(Kind.SHARED_TENSORS)
        # Received tensors are never written to (on CPU they view the receive buffer).
        if isinstance(shared, TensorViews):
            self.global_tensors = shared.to(self.device)
        else:
            self.global_tensors = (dict(shared) if self.device.type == "cpu"
                                   else {k: v.to(self.device) for k, v in shared.items()})
        self.load_shared(self.global_tensors)

    def parameter_groups(self) -> list[dict]:
        """Optimizer parameter groups. A group may carry ``lr_scale``: its learning rate is
        the round's learning rate times that factor."""
        return [{"params": [p for name in self.models for _, p in self.named_trainable(name)]}]

    def optimizers(self) -> list[torch.optim.Optimizer]:
        if self._optimizers is None:
            t = self.method.train
            groups = self.parameter_groups()
            if t.optimizer == "adam":
                opt = torch.optim.Adam(groups, lr=t.lr, weight_decay=t.weight_decay)
            else:
                opt = torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum,
                                      weight_decay=t.weight_decay)
            self._optimizers = [opt]
        return self._optimizers

    def train_mode(self) -> None:
        for name, model in self.models.items():
            _set_mode(model, self._modules[name], True)

    def eval_mode(self) -> None:
        for name, model in self.models.items():
            _set_mode(model, self._modules[name], False)

    def begin_train(self) -> None:
        """Called after ``receive`` and before the first batch of a training phase."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.models["model"](x), y)

    def post_backward(self) -> None:
        """Gradient post-processing for parameter-only terms (proximal pulls, corrections)."""

    def proximal_term(self) -> tuple[Mapping[str, torch.Tensor], float] | None:
        """(reference tensors, mu) when ``post_backward`` adds mu (w - reference) to each
        gradient and nothing else (FedProx): the declaration the batched path reads to
        apply that pull to stacked parameters. None: no such term."""
        return None

    def after_train(self, steps: int) -> Payload:
        """The training upload: by default the shared tensors, as views of the live model
        (nothing changes them while the upload streams; the next receive overwrites them)."""
        if not self.shared_specs:
            return Payload()
        return Payload([Section(Kind.SHARED_TENSORS, "", self.shared_tensors.views())])

    def end_train(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After the last epoch: ``batches`` walks the edge's training data once, in order,
        on the device (a method that needs a pass over it, as Fed-SAP's statistics, takes
        it; nothing is loaded unless iterated)."""

    def training_metrics(self) -> dict[str, float]:
        """Monitoring scalars of the round's training (e.g. a regularizer's mean value),
        sent with the result beside the training loss and recorded per edge in the
        server's history. Only figures that are safe to share belong here."""
        return {}

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.models["model"](x)

    def before_evaluate(self) -> tuple[EdgeAlgorithm, int]:
        """Called after ``receive`` in an evaluation phase: the algorithm whose ``predict``
        evaluation scores, and how many epochs the one training loop first trains it on
        the edge's training data (0: score as it is). FedAvg-FT returns a fine-tuner of a
        private copy of the global model. What it trains must be private (a model whose
        split rule is ``all``): the edge saves its private state after the fine-tuning, and
        the next upload must be exactly what it would have been without it."""
        return self, 0

    def upload_weight(self, phase: str, num_examples: int) -> float:
        """The weight the server gives this edge's upload of ``phase`` in its weighted sum.
        Secure aggregation multiplies the upload by it on the edge (the server only sees
        the sum); a method whose server computes the weight tells the edge (pFedKA's
        alpha_k) and returns it here."""
        return self.method.aggregation_weight(num_examples)

    def phase_upload(self, phase: str) -> Payload:
        """The upload of a phase the method declares besides train and evaluate."""
        raise ValueError(f"method {self.method.name!r} declares no phase {phase!r}")

    def private_figures(self) -> dict[str, Any]:
        """Figures the edge records after each training phase in its own history file in
        its state dir; they never leave the edge. By default: every module of the models
        that has a ``private_figures()`` method (pFedLA's hybrid attention: its mixing
        weights), keyed ``model/module``."""
        figures: dict[str, Any] = {}
        for model_name, model in self.models.items():
            # Naming every module costs ~1 ms a round for a small CNN; most models have
            # no module that reports.
            if not any(callable(getattr(type(m), "private_figures", None))
                       for m in self._modules[model_name]):
                continue
            for module_name, module in model.named_modules():
                report = getattr(module, "private_figures", None)
                if callable(report):
                    figures[qualified(model_name, module_name)] = report()
        return figures

    # ---- private method state (besides model tensors and optimizer state) -------------
    def extra_state(self) -> dict[str, torch.Tensor]:
        """Private tensors of the method beyond its models and optimizer state (SCAFFOLD's
        c_i, Fed-SAP's own statistics), saved in the edge's state dir."""
        return {}

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what ``extra_state`` returned."""

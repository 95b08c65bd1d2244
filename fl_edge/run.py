"""The edge's run: everything it builds once from the server's configuration, after
holding it to its own rules.

The edge takes no method flag: the server's join reply carries the method, model and
hyperparameters, parsed once into a ``RunConfig`` (``fedattn_shared.runconfig``: every
key and type, and the contract's version). ``build_run`` checks them before using any of
it: only an installed method, or a module:Class the edge was started with
``--allow-method`` for; only a built-in, timm:/torchvision: or installed model, or a
module:callable it was started with ``--allow-model`` for (both refused before any
import, ``fedattn_shared.allowlist``); DP-SGD within the edge's privacy
policy and its ledger's pin (refused before any training, ``fedattn_shared.privacy.dp``);
a model whose fingerprint matches the server's; only installed codecs
(``server.compress``). A refusal is an ``EdgeExit``
with status 2 naming the setting (``tell_server`` for the ones the server should hear).
The result, ``EdgeRun``, is a plain value the task runner and middleware read;
a server with a new configuration gets a new one.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from fedattn_shared.compress import CompressSpec
from fedattn_shared.config import EVAL_DETAIL_WITH_DP, ConfigError, DPConfig, TrainConfig, apply_values
from fedattn_shared.data import DataError, EdgeData, load_edge_data
from fedattn_shared.methods import check_method_allowed, load_method
from fedattn_shared.methods.base import EdgeAlgorithm, Method, MethodContext
from fedattn_shared.models import check_model_allowed
from fedattn_shared.privacy.dp import PinnedPolicy, PolicyRefusal, PrivateTraining, check_dp
from fedattn_shared.privacy.secagg import SecAggPolicy
from fedattn_shared.runconfig import RunConfig, RunConfigError
from fedattn_shared.state import StateError

from .memory import MemoryBackoff
from .metrics import EdgeMetrics
from .options import EdgeExit, EdgeOptions
from .store import PrivateStore, private_digest
from .trainer import configure_determinism
from .writer import StateWriter

log = logging.getLogger("fl_edge")

# The downlink cap (bytes per payload, the common and the personal part each) once the
# run's models are known: DOWNLINK_FACTOR x the bytes of the models' state plus
# DOWNLINK_SLACK (see ``downlink_cap``); before, the session's DOWNLINK_CAP_BEFORE_SETUP.
DOWNLINK_FACTOR = 4
DOWNLINK_SLACK = 64 << 20
RUN_CAP_WHY = f"{DOWNLINK_FACTOR} x the run's model state + {DOWNLINK_SLACK >> 20} MiB"


def downlink_cap(models: dict[str, torch.nn.Module]) -> int:
    """The most bytes one downlink payload of a run may declare. What a method sends an
    edge is made of its models' tensors: the global (at most every state tensor, in a
    dtype no wider than float64), SCAFFOLD's control variates beside it, the initial
    models once; hence a small multiple of the models' state. The slack covers what does
    not grow with the model (SecAgg+'s keys and shares, prototypes, scalars). A server
    that declares more is refused before the edge allocates a byte for it."""
    state = sum(t.numel() * t.element_size() for model in models.values()
                for t in model.state_dict().values())
    return DOWNLINK_FACTOR * state + DOWNLINK_SLACK


def policy_exit(err: PolicyRefusal, ledger_path) -> EdgeExit:
    """Exit 2 for a server [dp] the edge's policy refuses; the ledger's path is named
    locally when the limit came from it, and the server hears the refusal alone."""
    where = f" ({ledger_path})" if err.pinned else ""
    return EdgeExit(2, f"refusing the server's privacy settings: {err}{where}",
                    tell_server=f"refused the server's privacy settings: {err}")


@dataclass
class EdgeRun:
    """The run as this edge holds it: built once per server configuration (the models are
    resident across rounds; DP-SGD wraps them for good), read by every task."""

    config_json: str
    fingerprint: str
    method: Method
    algo: EdgeAlgorithm
    data: EdgeData
    train: TrainConfig
    batch_size: int           # --batch-size on this device, else the server's
    privacy: PrivateTraining | None
    secagg: SecAggPolicy | None  # what this edge holds every SecAgg round to
    downlink_cap: int
    compress: CompressSpec = field(default_factory=CompressSpec)  # server.compress
    # server.mode = "async": training uploads carry the model's change, not the model
    asynchronous: bool = False
    # server.eval_detail: evaluations carry per-class counts (never under DP: refused at
    # join); otherwise only correct/total/loss/Brier sums leave this edge
    eval_detail: bool = False
    # --amp and --grad-accum as this run uses them (DP-SGD sets them aside: dp_loop_options)
    amp: bool = False
    grad_accum: int = 1
    # the device's samples per pass, halved on out-of-memory errors for the rest of the run
    memory: MemoryBackoff = field(default_factory=MemoryBackoff)


def build_run(config_json: str, fingerprint: str, opts: EdgeOptions, device: torch.device,
              store: PrivateStore, writer: StateWriter, metrics: EdgeMetrics) -> EdgeRun:
    """The server's run configuration, checked against this edge's own rules before
    anything of it is used (see the module doc), then built: method, models (resumed
    from the private state), data, DP-SGD. The run config is written to the state dir."""
    config = read_config(config_json, opts)
    configure_determinism(config.train.deterministic, config.train.threads,
                          strict=opts.device_is_cuda and not opts.cuda_nondeterministic_ok)
    ledger = _check_privacy_policy(opts, store, config.dp)
    method = _load_method(config)
    _check_model_size(method, opts)
    models = method.build_models()
    local_fingerprint = method.fingerprint(models)
    if local_fingerprint != fingerprint:
        raise EdgeExit(2, f"this edge builds model fingerprint {local_fingerprint} but the "
                          f"server's is {fingerprint}: fedattn versions differ")
    algo = method.edge(models, device)
    if algo.schedule.steps_per_batch > 1 and opts.grad_accum > 1:
        raise EdgeExit(2, f"method {method.name!r} takes {algo.schedule.steps_per_batch} optimizer "
                          "steps per batch and does not combine with --grad-accum")
    data = _load_data_and_state(opts, store, algo, config.train, fingerprint)
    if opts.data_on_device and device.type != "cpu":
        data = data.to(device)
    batch_size = opts.batch_size or config.train.batch_size
    amp, grad_accum, physical = dp_loop_options(method.dp is not None, opts, batch_size)
    privacy = private_training(method, algo, len(data.train), batch_size, ledger, opts, store,
                               writer, metrics, physical)
    writer.write(store.save_run_config, config_json, fingerprint)
    log.info("data: %d train, %d test, %s global-test samples", len(data.train),
             len(data.test), len(data.global_test) if data.global_test else "no")
    # DP-SGD bounds its passes with physical batches; the loop's limit then only backs off
    memory = MemoryBackoff(None if privacy is not None else opts.max_physical_batch or None)
    return EdgeRun(config_json, fingerprint, method, algo, data, config.train, batch_size,
                   privacy, config.secagg, downlink_cap(models), config.compress,
                   config.mode == "async", config.eval_detail, amp, grad_accum, memory)


def dp_loop_options(dp: bool, opts: EdgeOptions, batch_size: int) -> tuple[bool, int, int]:
    """(amp, grad_accum, device's physical batch) for the run. Without DP-SGD: the edge's
    options as given. Under DP-SGD, what Opacus allows: accumulation becomes physical
    batches of at most ceil(batch / grad_accum) samples (the memory the flag was for; the
    logical Poisson batch, and so the privacy accounting, stays the server's); AMP is set
    aside (Opacus' DPOptimizer does not unscale per-sample gradients). One warning names
    both, and the run goes on: a device's memory flags never refuse a server's DP-SGD."""
    physical = opts.max_physical_batch or 0
    if not dp:
        return opts.amp, opts.grad_accum, physical
    changes = []
    if opts.grad_accum > 1:
        accum_bound = math.ceil(batch_size / opts.grad_accum)
        physical = min(physical, accum_bound) if physical else accum_bound
        changes.append(f"--grad-accum {opts.grad_accum} becomes physical batches of at most "
                       f"{physical} samples (same logical batch)")
    if opts.amp:
        changes.append("--amp is set aside (Opacus' per-sample gradients are float32)")
    if changes:
        log.warning("the server runs DP-SGD: %s", "; ".join(changes))
    return False, 1, physical


def read_config(config_json: str, opts: EdgeOptions) -> RunConfig:
    """The server's run config, parsed once (``RunConfig.from_json``: every key and type
    checked, an unknown contract version refused by number), then held to this edge's
    own rules: the method and model names against the allowlist, before anything could
    import them;
    no per-class counts under DP or with --refuse-eval-detail."""
    try:
        config = RunConfig.from_json(config_json)
    except RunConfigError as err:
        raise _refusal(err) from None
    try:
        check_method_allowed(config.method, opts.allow_methods)
    except ValueError as err:
        raise EdgeExit(2, f"refusing the server's method: {err}",
                       tell_server=f"refused the server's method: {err}") from None
    try:
        check_model_allowed(config.train.model, opts.allow_models)
    except ValueError as err:
        raise EdgeExit(2, f"refusing the server's model: {err}",
                       tell_server=f"refused the server's model: {err}") from None
    if config.eval_detail and config.dp is not None and config.dp.enabled:
        # The edge decides what it sends: per-class counts (its label histogram) never
        # leave it under DP, whatever a server asks.
        raise EdgeExit(2, f"refusing the server's configuration: {EVAL_DETAIL_WITH_DP}",
                       tell_server=f"refused the server's configuration: {EVAL_DETAIL_WITH_DP}")
    if config.eval_detail and opts.refuse_eval_detail:
        why = ("eval_detail: the server asks for per-class evaluation counts (--eval-detail), "
               "which reveal this edge's label histogram")
        raise EdgeExit(2, f"refusing the server's configuration: {why}; this edge sends "
                          "none (--refuse-eval-detail)",
                       tell_server=f"refused the server's configuration: {why}")
    return config


def _refusal(err: RunConfigError) -> EdgeExit:
    """Exit 2 for a run config the edge cannot use. A contract version or a codec this
    edge does not have is the server's to hear (another release, an uninstalled plug-in);
    a garbled config is named in the edge's log."""
    if err.key == "version":
        return EdgeExit(2, f"refusing the server's run configuration: {err}",
                        tell_server=f"refused the server's run configuration: {err}")
    if err.key == "compress":
        return EdgeExit(2, f"refusing the server's compress setting: {err}",
                        tell_server=f"refused the server's compress setting: {err}")
    return EdgeExit(2, f"cannot use the server's configuration: {err}")


def _check_privacy_policy(opts: EdgeOptions, store: PrivateStore,
                          dp: DPConfig | None) -> dict | None:
    """The server's [dp] against the edge's policy and its ledger's pin; returns the ledger."""
    try:
        ledger = store.load_ledger()
        pinned = PinnedPolicy.from_ledger(ledger) if ledger is not None else None
    except StateError as err:
        raise EdgeExit(2, f"{err} ({store.ledger_path})") from None
    try:
        opts.privacy.check(dp, pinned)
    except PolicyRefusal as err:
        raise policy_exit(err, store.ledger_path) from None
    return ledger


def _load_method(config: RunConfig) -> Method:
    """The method with the server's parameters (an allowed name, checked before)."""
    try:
        method_cls = load_method(config.method)
        params = method_cls.Params()
        apply_values(params, config.method, dict(config.params), "server config")
        return method_cls(MethodContext(config.train, params, dp=config.dp))
    except (ConfigError, ValueError, TypeError, AttributeError) as err:
        raise EdgeExit(2, f"cannot use the server's configuration: {err}") from None


def _check_model_size(method: Method, opts: EdgeOptions) -> None:
    """Refuse models holding more state than ``--max-model-mb``, counted on the meta device
    (shapes only: nothing allocated): a model name is the server's choice, and a timm or
    torchvision name may mean billions of parameters, which would take the device down
    building them."""
    with torch.device("meta"):
        models = method.build_models()
    mib = sum(t.numel() * t.element_size() for model in models.values()
              for t in model.state_dict().values()) / (1 << 20)
    if mib > opts.max_model_mb:
        why = (f"model {method.train.model!r} holds {mib:.0f} MiB of state over the method's "
               f"{len(models)} model(s); this edge builds at most {opts.max_model_mb:g} MiB")
        raise EdgeExit(2, f"refusing the server's model: {why} (--max-model-mb)",
                       tell_server=f"refused the server's model: {why}")


def _load_data_and_state(opts: EdgeOptions, store: PrivateStore, algo: EdgeAlgorithm,
                         train: TrainConfig, fingerprint: str) -> EdgeData:
    """The edge's data split by the run's settings, and its private state if it has one."""
    try:
        data = load_edge_data(opts.data_dir, train, keep_uint8=True)  # decoded per batch
    except DataError as err:
        raise EdgeExit(2, str(err)) from None
    if store.exists():
        try:
            meta = store.load(algo, fingerprint)
        except StateError as err:
            raise EdgeExit(2, str(err)) from None
        log.info("resumed private state from %s (round %s, phase %s, digest %s)",
                 store.path, meta.get("round"), meta.get("phase"), private_digest(algo))
    return data


def private_training(method: Method, algo: EdgeAlgorithm, num_examples: int, batch_size: int,
                     ledger: dict | None, opts: EdgeOptions, store: PrivateStore,
                     writer: StateWriter, metrics: EdgeMetrics,
                     physical_batch: int = 0) -> PrivateTraining | None:
    """DP-SGD for the run (once: the models are wrapped for good), calibrated to this
    edge's data, continuing the ledger on disk, within the edge's policy and the
    ledger's pin. The ledger is written at once, so the first run's pin holds from
    before its first step. ``physical_batch``: the device's bound on a physical batch
    (``dp_loop_options``; 0: none)."""
    if method.dp is None:
        return None
    try:
        check_dp(method)
        privacy = PrivateTraining(algo, method.dp, num_examples, batch_size, ledger,
                                  policy=opts.privacy, max_physical_batch=physical_batch)
    except PolicyRefusal as err:
        raise policy_exit(err, store.ledger_path) from None
    except (ValueError, StateError) as err:
        raise EdgeExit(2, f"{err} ({store.ledger_path})") from None
    writer.write(store.save_ledger, privacy.ledger())
    metrics.track_privacy(privacy.spent(), privacy.budget)
    log.info("DP-SGD: sigma %.4g, q %.4g, delta %.3g, C %g, %d steps per round, epsilon "
             "spent so far %.4g of %s", privacy.noise_multiplier, privacy.sample_rate,
             privacy.delta, method.dp.max_grad_norm, privacy.batches_per_round,
             privacy.spent(), f"{privacy.budget:g}")
    return privacy

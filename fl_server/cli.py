"""``fl-server``: coordinate federated rounds over gRPC.

Configuration precedence: defaults < ``--config FILE`` (TOML) < flags < ``--set k=v``.
Bad flags or configuration exit with status 2 and a message naming the offending item.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import logging
import os
import platform
import signal
import sys
from pathlib import Path

from fedattn_shared.augment import AUGMENTS, INPUT_RANGES
from fedattn_shared.config import (
    CLIP_WITH_DP,
    EVAL_DETAIL_WITH_DP,
    ConfigError,
    DPConfig,
    ServerConfig,
    TrainConfig,
    apply_values,
    load_toml,
    merge_sources,
    parse_set,
)
from fedattn_shared.logs import setup_logging
from fedattn_shared.methods import available_methods, load_method
from fedattn_shared.methods.base import Method, MethodContext
from fedattn_shared.models import MODELS, model_spec
from fedattn_shared.models.registry import GROUPNORM_SUFFIX, check_model_input
from fedattn_shared.privacy.dp import check_dp
from fedattn_shared.state import StateError, atomic_write_json
from fedattn_shared.tls import init_ca, issue_edge, revoke_edge

from .app import ServerApp, UsageError
from .settings import ServerSettings, resolve_settings

log = logging.getLogger("fl_server")

# --x/--no-x flags: None when not given, so False is a choice (a store_true's False is not).
NEGATABLE = {"spill_uploads", "spill_sums"}
# flag dest -> (config section, key)
FLAG_TARGETS = {
    "method": ("server", "method"), "rounds": ("server", "rounds"),
    "min_edges": ("server", "min_edges"), "quorum": ("server", "quorum"),
    "fraction": ("server", "fraction"), "round_timeout": ("server", "round_timeout"),
    "eval_every": ("server", "eval_every"), "eval_detail": ("server", "eval_detail"),
    "host": ("server", "host"),
    "port": ("server", "port"), "metrics_port": ("server", "metrics_port"),
    "checkpoint_dir": ("server", "checkpoint_dir"), "resume": ("server", "resume"),
    "insecure": ("server", "insecure"), "token": ("server", "join_token"),
    "tls_dir": ("server", "tls_dir"),
    "chunk_bytes": ("server", "chunk_bytes"), "poll_timeout": ("server", "poll_timeout"),
    "presence_interval": ("server", "presence_interval"),
    "presence_lifetime": ("server", "presence_lifetime"),
    "presence_grace": ("server", "presence_grace"),
    "keepalive_interval": ("server", "keepalive_interval"),
    "max_concurrent_uploads": ("server", "max_concurrent_uploads"),
    "max_upload_memory": ("server", "max_upload_memory"),
    "max_download_memory": ("server", "max_download_memory"),
    "spill_uploads": ("server", "spill_uploads"), "spill_sums": ("server", "spill_sums"),
    "max_spill_bytes": ("server", "max_spill_bytes"),
    "max_edges": ("server", "max_edges"),
    "upload_idle_timeout": ("server", "upload_idle_timeout"),
    "upload_min_rate": ("server", "upload_min_rate"),
    "transfer_resume_expiry": ("server", "transfer_resume_expiry"),
    "download_idle_timeout": ("server", "download_idle_timeout"),
    "download_min_rate": ("server", "download_min_rate"),
    "download_window": ("server", "download_window"),
    "max_task_deliveries": ("server", "max_task_deliveries"),
    "init_weights": ("server", "init_weights"), "init_skip_head": ("server", "init_skip_head"),
    "secagg": ("server", "secagg"), "secagg_graph": ("server", "secagg_graph"),
    "max_weight": ("server", "max_weight"), "clip_update_norm": ("server", "clip_update_norm"),
    "clip_update_mode": ("server", "clip_update_mode"), "compress": ("server", "compress"),
    "mode": ("server", "mode"), "buffer": ("server", "buffer"),
    "max_staleness": ("server", "max_staleness"),
    "staleness_weight": ("server", "staleness_weight"), "async_lr": ("server", "async_lr"),
    "server_lr": ("server", "server_lr"),  # the old name of async_lr (see legacy_server_lr)
    "model": ("train", "model"), "num_classes": ("train", "num_classes"),
    "in_channels": ("train", "in_channels"), "image_size": ("train", "image_size"),
    "local_epochs": ("train", "local_epochs"), "batch_size": ("train", "batch_size"),
    "optimizer": ("train", "optimizer"), "lr": ("train", "lr"), "momentum": ("train", "momentum"),
    "weight_decay": ("train", "weight_decay"),
    "optimizer_state": ("train", "optimizer_state"), "seed": ("train", "seed"),
    "private": ("train", "private"), "clip_grad_norm": ("train", "clip_grad_norm"),
    "augment": ("train", "augment"), "input_size": ("train", "input_size"),
    "input_range": ("train", "input_range"),
    "dp": ("dp", "enabled"), "dp_epsilon": ("dp", "target_epsilon"),
    "dp_noise_multiplier": ("dp", "noise_multiplier"), "dp_delta": ("dp", "delta"),
    "dp_max_grad_norm": ("dp", "max_grad_norm"), "dp_accountant": ("dp", "accountant"),
    "dp_fix_model": ("dp", "fix_model"), "dp_stats_sigma": ("dp", "stats_sigma"),
    "dp_max_physical_batch": ("dp", "max_physical_batch"),
}


#: Seconds /metrics outlives the run by default: two scrape intervals of 5 s.
METRICS_LINGER = 10.0


def build_parser() -> argparse.ArgumentParser:
    """fl-server's flags, in groups (run, untrusted edges, network, training, DP); every
    flag defaults to None so that ``resolve`` can tell a given flag from the config
    file's value."""
    p = argparse.ArgumentParser(
        prog="fl-server",
        description="fedattn server: runs federated rounds for fl-edge daemons over gRPC.",
        argument_default=None)
    for add in (_run_flags, _robust_flags, _network_flags, _link_flags, _train_flags, _dp_flags):
        add(p)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-every", type=float, default=10.0, metavar="SECONDS",
                   help="while a phase is open, log 'k/n results in' every this many seconds "
                        "(default %(default)g; 0: off)")
    return p


def _run_flags(p: argparse.ArgumentParser) -> None:
    """The run flags."""
    run = p.add_argument_group("run")
    run.add_argument("--config", type=Path, help="TOML file ([server], [train], [<method>])")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config value, e.g. --set fedprox.mu=0.1 (repeatable)")
    run.add_argument("--method", help="federated method (see --list-methods)")
    run.add_argument("--list-methods", action="store_true", help="list methods and exit")
    run.add_argument("--rounds", type=int)
    run.add_argument("--min-edges", type=int, help="connected edges needed before round 1")
    run.add_argument("--quorum", type=int, help="results that close a training phase (0: all)")
    run.add_argument("--fraction", type=float, help="share of edges selected per round")
    run.add_argument("--round-timeout", type=float, help="deadline of each phase, seconds")
    run.add_argument("--eval-every", type=int, help="evaluate every N rounds (0: never)")
    run.add_argument("--eval-detail", action="store_true",
                     help="evaluation results carry each edge's per-class confusion counts "
                          "(per-class figures such as F1 in fl-report), which reveal every "
                          "edge's label histogram; default: only correct/total/loss/Brier "
                          "sums. Not with --dp")
    run.add_argument("--checkpoint-dir", help="round checkpoints and history.json")
    run.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    run.add_argument("--init-weights", help="start from pretrained weights: a safetensors file "
                                            "or a torch state dict (.pth/.pt/.bin, e.g. "
                                            "torchvision's or timm's own, read weights_only); "
                                            "keys as in the model's state dict")
    run.add_argument("--init-skip-head", action="store_true",
                     help="with --init-weights: keep the model's fresh classifier head and "
                          "ignore the file's (e.g. ImageNet weights, 1000 classes)")
    run.add_argument("--secagg", action="store_true",
                     help="secure aggregation (SecAgg+): the server sees only the sum; "
                          "tune with --set server.secagg_degree/threshold/clip/max_weight/timeout/"
                          "margin/max_update/max_scale/scale_growth")
    run.add_argument("--compress", metavar="up=CODEC,down=CODEC",
                     help="update compression: up= what edges upload, down= what the server "
                          "broadcasts; codecs fp16, bf16, int8[:BLOCK], int4[:BLOCK], "
                          "topk:FRACTION, +ef for error feedback (e.g. up=int8,down=fp16)")
    run.add_argument("--secagg-graph", choices=["sparse", "full"],
                     help="SecAgg+ neighbour graph: sparse k-regular (default) or full")
    _async_flags(p)


def _async_flags(p: argparse.ArgumentParser) -> None:
    """Buffered asynchronous aggregation (FedBuff) flags."""
    run = p.add_argument_group(
        "asynchronous rounds", "--mode async: every free edge gets work at once; the server "
        "applies the mean change of each --buffer results (FedBuff) and --rounds counts "
        "those versions")
    run.add_argument("--mode", choices=["sync", "async"],
                     help="sync: rounds wait for their quorum (default); async: buffered "
                          "asynchronous aggregation")
    run.add_argument("--buffer", type=int, metavar="K",
                     help="results per applied update in --mode async (default 10)")
    run.add_argument("--max-staleness", type=int, metavar="VERSIONS",
                     help="refuse a result whose model is more than this many versions "
                          "older than the current global (default 20)")
    run.add_argument("--staleness-weight", metavar="FUNCTION",
                     help="scale of a result tau versions old: constant, poly:A = "
                          "(1+tau)^-A (default poly:0.5), hinge:A,B")
    run.add_argument("--async-lr", type=float, metavar="ETA",
                     help="step of the buffered mean change in --mode async (default 1)")
    # The old name of --async-lr, out of --help: see legacy_server_lr.
    run.add_argument("--server-lr", type=float, help=argparse.SUPPRESS)


def _robust_flags(p: argparse.ArgumentParser) -> None:
    """The untrusted edges: bounds on one upload flags."""
    robust = p.add_argument_group(
        "untrusted edges", "bounds on what one edge's upload can do to the global; uploads "
        "over them are refused by name. The robust aggregates: --method fedmedian (the "
        "coordinate-wise median; with --set fedmedian.trim_fraction=0.1 the trimmed mean).")
    robust.add_argument("--max-weight", type=int,
                        help="bound on any edge's num_examples, its aggregation weight "
                             "(default 1000000); each edge is further capped at the "
                             "training-set size it declared at join")
    robust.add_argument("--clip-update-norm", type=float, metavar="C",
                        help="bound on the L2 norm of an upload's model delta (upload minus "
                             "the global, over the shared model tensors; statistics and "
                             "prototypes are not bounded); 0: none (default)")
    robust.add_argument("--clip-update-mode", choices=["refuse", "scale"],
                        help="an upload over --clip-update-norm: refuse it by name (default) "
                             "or scale its delta down to C")


def _network_flags(p: argparse.ArgumentParser) -> None:
    """The network flags."""
    net = p.add_argument_group("network")
    net.add_argument("--host")
    net.add_argument("--port", type=int, help="gRPC port (0: any free port)")
    net.add_argument("--metrics-port", type=int, help="Prometheus port (0: any free port)")
    net.add_argument("--metrics-linger", type=float, default=METRICS_LINGER, metavar="SECONDS",
                     help="keep serving /metrics this long after the run finished, so a "
                          "scrape sees the last round (default %(default)g: two 5 s scrape "
                          "intervals; 0: exit at once; SIGTERM ends it early)")
    net.add_argument("--insecure", action="store_true",
                     help="plaintext gRPC (only when asked for: the default is mutual TLS)")
    net.add_argument("--tls-dir", help="mutual TLS with the CA, server certificate and "
                                       "enrollment list `fl-server certs init` wrote here")
    net.add_argument("--token", help="cluster join token edges must present "
                                     "(default: $FEDATTN_TOKEN)")
    net.add_argument("--chunk-bytes", type=int, help="data chunk size on the wire")
    net.add_argument("--poll-timeout", type=float, help="long-poll timeout, seconds")
    net.add_argument("--max-concurrent-uploads", type=int,
                     help="uploads received or aggregated at once, at most (default 2)")
    net.add_argument("--max-upload-memory", type=int, metavar="BYTES",
                     help="bytes concurrent uploads may hold in receive buffers and gRPC "
                          "stream windows (default 0: a quarter of the available memory)")
    net.add_argument("--max-download-memory", type=int, metavar="BYTES",
                     help="bytes of task messages the downloads under way may hold at once "
                          "(a data chunk counts twice: its frame and gRPC's copy), in whole "
                          "chunks; a download waits for room (default 0: "
                          "32 MiB shared and 128 KiB per downloading edge, chunks cut to a "
                          "fair share; none waits)")
    net.add_argument("--spill-uploads", action=argparse.BooleanOptionalAction,
                     help="collect-then-learn methods keep uploads memory-mapped on disk in "
                          "CHECKPOINT_DIR/uploads, not in RAM (default on)")
    net.add_argument("--spill-sums", action=argparse.BooleanOptionalAction,
                     help="streaming-mean methods write each upload to CHECKPOINT_DIR/uploads "
                          "and sum them a slice at a time at the round's close, instead of a "
                          "float64 sum in RAM (same bits; default on)")
    net.add_argument("--max-spill-bytes", type=int, metavar="BYTES",
                     help="disk the spilled uploads may take (default 0: half the free disk)")
    net.add_argument("--max-edges", type=int,
                     help="edge ids that may register (default 10000); with --insecure and "
                          "no --token anyone may register ids, up to this many")
    _transfer_flags(net)
    net.add_argument("--ready-file", type=Path,
                     help="write {port, metrics_port} as JSON here once serving")


def _transfer_flags(net) -> None:
    """The network flags of the transfers: deadlines, resuming, delivery limits."""
    net.add_argument("--upload-idle-timeout", type=float,
                     help="cut an upload that sends nothing for this many seconds (30)")
    net.add_argument("--upload-min-rate", type=float,
                     help="bytes/s an upload must average: its deadline is the idle timeout "
                          "+ its size / this rate (32768)")
    net.add_argument("--transfer-resume-expiry", type=float,
                     help="hold an upload cut short for this many seconds, for the edge to "
                          "resume from the bytes held; the task of an edge that went "
                          "mid-download stands as long after its last byte (120; 0: a cut "
                          "transfer costs the edge its task)")
    net.add_argument("--download-idle-timeout", type=float,
                     help="cut a task download the edge takes nothing of for this many "
                          "seconds (30)")
    net.add_argument("--download-min-rate", type=float,
                     help="bytes/s a task download must average: its deadline is the idle "
                          "timeout + its size / this rate (32768)")
    net.add_argument("--download-window", type=int, metavar="BYTES",
                     help="data bytes one NextTask call carries (whole chunks; 4 MiB): each "
                          "call's deadline, which the edge sets and the server bounds, is "
                          "2 x the idle timeout + this / the min rate")
    net.add_argument("--max-task-deliveries", type=int,
                     help="times a task's bytes may be sent to one edge in one phase, "
                          "across rejoins (a broken download retries; 3)")


def _link_flags(p: argparse.ArgumentParser) -> None:
    """The flags for edges behind proxies, NAT and links that break."""
    links = p.add_argument_group("proxies, NAT and broken links")
    links.add_argument("--presence-interval", type=float,
                     help="seconds between presence heartbeats; keep it under a proxy's idle "
                          "timeout (10)")
    links.add_argument("--presence-lifetime", type=float,
                     help="end a presence stream after this many seconds (once no transfer "
                          "of the edge's is open), the edge opens it again at once; set it "
                          "under a proxy's maximum stream age (default 0: never)")
    links.add_argument("--keepalive-interval", type=float,
                     help="seconds between the server's HTTP/2 pings on each connection; "
                          "nginx counts them for a call whose headers went out (30)")
    links.add_argument("--presence-grace", type=float,
                     help="seconds an edge whose presence stream broke (a proxy's cut, or the "
                          "edge gone) stays selectable, its task kept, for the stream to "
                          "reopen (0: dropped at once)")


def _train_flags(p: argparse.ArgumentParser) -> None:
    """The training (sent to every edge) flags."""
    train = p.add_argument_group("training (sent to every edge)")
    train.add_argument("--model", help=f"one of: {', '.join(sorted(MODELS))}; or timm:NAME, "
                       "torchvision:NAME (random init), an installed fedattn.models name, "
                       "package.module:callable (docs/your-model-and-data.md)")
    train.add_argument("--num-classes", type=int)
    train.add_argument("--in-channels", type=int)
    train.add_argument("--image-size", type=int)
    train.add_argument("--local-epochs", type=int)
    train.add_argument("--batch-size", type=int)
    train.add_argument("--optimizer", choices=["sgd", "adam"])
    train.add_argument("--lr", type=float)
    train.add_argument("--momentum", type=float)
    train.add_argument("--weight-decay", type=float)
    train.add_argument("--optimizer-state", choices=["reset", "carry"],
                       help="the edges' optimizer state (momentum buffers) at each round's "
                            "start: reset (the default: a fresh optimizer, as the papers) or "
                            "carry (the last round's, kept in the edge's private state)")
    train.add_argument("--seed", type=int)
    train.add_argument("--private", type=lambda s: [r for r in s.split(",") if r],
                       help="extra private split rules, comma-separated: bn,head,se-e,attention")
    train.add_argument("--clip-grad-norm", type=float, metavar="C",
                       help="clip the L2 norm of each optimizer step's gradient to C on every "
                            "edge (0: off, the default; not with --dp, which clips per sample)")
    train.add_argument("--augment", choices=list(AUGMENTS),
                       help="training-batch augmentation on the edges, seeded per edge and "
                            "round: none (default), crop-flip (4-px zero pad, random crop, "
                            "h-flip), crop-flip-reflect (the same, padding mirrored from the "
                            "border), resized-crop (random-resized crop + h-flip); never "
                            "applied to evaluation")
    train.add_argument("--input-range", choices=list(INPUT_RANGES),
                       help="the pixel range the model sees, in training and evaluation: "
                            "symmetric ([-1, 1], the default), unit ([0, 1], v/255 as "
                            "torchvision's ToTensor) or imagenet ([0, 1] standardised by "
                            "ImageNet's channel mean and std, as pretrained weights expect)")
    train.add_argument("--input-size", type=int,
                       help="resize inputs (bilinear, antialiased) to this side before the "
                            "model, in training and evaluation; models are built for it "
                            "(0: the data's own --image-size)")


def _dp_flags(p: argparse.ArgumentParser) -> None:
    """The differential privacy flags."""
    dp = p.add_argument_group("differential privacy ([dp], sent to every edge)")
    dp.add_argument("--dp", action="store_true",
                    help="sample-level DP-SGD (Opacus) on every edge, with a privacy ledger")
    dp.add_argument("--dp-epsilon", type=float,
                    help="privacy budget epsilon for the whole run (sigma is calibrated to it "
                         "unless --dp-noise-multiplier is given)")
    dp.add_argument("--dp-noise-multiplier", type=float, help="a fixed noise multiplier sigma")
    dp.add_argument("--dp-delta", type=float, help="delta (default 0.1/|D_k| on each edge)")
    dp.add_argument("--dp-max-grad-norm", type=float, help="per-sample clipping bound (1.0)")
    dp.add_argument("--dp-accountant", choices=["rdp", "prv", "gdp"], help="default rdp")
    dp.add_argument("--dp-fix-model", action="store_true",
                    help="replace every BatchNorm by GroupNorm (+ activation): model <name>+gn")
    dp.add_argument("--dp-stats-sigma", type=float,
                    help="noise multiplier for STAT_VECTORS / PROTOTYPES / SCALAR_SUMMARY uploads")
    dp.add_argument("--dp-max-physical-batch", type=int,
                    help="split Poisson batches into physical batches of at most this size")


def resolve(args: argparse.Namespace) -> tuple[ServerSettings, TrainConfig, Method]:
    """Defaults < TOML < flags < --set, all validated, the specs resolved (``settings``)."""
    file_values = load_toml(args.config) if args.config else {}
    flag_values: dict[str, dict] = {}
    for dest, (section, key) in FLAG_TARGETS.items():
        value = getattr(args, dest, None)
        if value is not None and (value is not False or dest in NEGATABLE):
            flag_values.setdefault(section, {})[key] = value
    if "join_token" not in flag_values.get("server", {}) and os.environ.get("FEDATTN_TOKEN"):
        flag_values.setdefault("server", {})["join_token"] = os.environ["FEDATTN_TOKEN"]
    merged = merge_sources((str(args.config), file_values), ("flags", flag_values),
                           ("--set", parse_set(args.set)))
    server, train, dp = ServerConfig(), TrainConfig(), DPConfig()
    sources = {section: merged.pop(section, ("defaults", {}))
               for section in ("server", "train", "dp")}
    sources["server"] = (sources["server"][0], legacy_server_lr(*sources["server"]))
    for section, obj in (("server", server), ("train", train), ("dp", dp)):
        apply_values(obj, section, sources[section][1], sources[section][0])
    try:
        method_cls = load_method(server.method)
    except ValueError as err:
        raise ConfigError(f"--method: {err}") from None
    # What the method declares it needs, where no source (file, flag, --set) says otherwise.
    given = sources["train"][1]
    if method_cls.default_model and "model" not in given:
        train.model = method_cls.default_model
    for key, value in method_cls.train_settings:
        if key not in given:
            setattr(train, key, value)
    server.validate()
    train.validate()
    dp.validate()
    if dp.enabled and train.clip_grad_norm:
        raise ConfigError(CLIP_WITH_DP)
    if dp.enabled and server.eval_detail:
        raise ConfigError(EVAL_DETAIL_WITH_DP)
    if dp.enabled:
        dp.planned_rounds = dp.planned_rounds or server.rounds
        if dp.fix_model and not train.model.endswith(GROUPNORM_SUFFIX):
            train.model += GROUPNORM_SUFFIX
    params = method_cls.Params()
    source, values = merged.pop(method_cls.name or server.method, ("defaults", {}))
    apply_values(params, method_cls.name or server.method, values, source)
    if merged:
        raise ConfigError(f"{', '.join(f'[{s}] ({src})' for s, (src, _) in merged.items())}: "
                          f"not a section this run uses (server, train, dp, {method_cls.name})")
    try:
        model_spec(train.model)
    except ValueError as err:
        raise ConfigError(f"train.model: {err}") from None
    try:
        method = method_cls(MethodContext(train, params, dp=dp if dp.enabled else None))
        # After the method's own refusals (what no input size mends), before DP's checks.
        check_model_input(train.model, train.num_classes, train.in_channels, train.model_size)
        if dp.enabled:
            check_dp(method)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return resolve_settings(server), train, method


def legacy_server_lr(source: str, values: dict) -> dict:
    """``server.server_lr`` (``--server-lr``) was renamed ``server.async_lr``
    (``--async-lr``): a method's server optimiser has a ``server_lr`` of its own
    (``fedadam.server_lr``), a different setting. The old key is taken where it was
    unambiguous, in ``--mode async`` (the only mode that ever read it), with a warning
    naming the new one; in ``--mode sync`` it never did anything, and a user who set it
    more likely meant the method's step, so it is refused naming both."""
    if "server_lr" not in values:
        return values
    values = dict(values)
    old = values.pop("server_lr")
    if "async_lr" in values:
        raise ConfigError(f"{source}: server.server_lr (--server-lr) is the old name of "
                          "server.async_lr (--async-lr) and both are set: keep async_lr")
    if values.get("mode", ServerConfig.mode) != "async":
        raise ConfigError(
            f"{source}: server.server_lr (--server-lr) was the step of --mode async's buffered "
            "update, now server.async_lr (--async-lr), and --mode sync never read it; a "
            "method's server optimiser step is the method's own parameter, e.g. --set "
            "fedadam.server_lr=0.01")
    log.warning("%s: server.server_lr (--server-lr) is now server.async_lr (--async-lr), the "
                "step of --mode async's buffered update; read as async_lr = %s", source, old)
    values["async_lr"] = old
    return values


async def serve(server_cfg: ServerConfig, train: TrainConfig, method: Method,
                ready_file: Path | None, metrics_linger: float = METRICS_LINGER,
                log_every: float = 10.0) -> int:
    """Runs one server until the run ends or SIGINT/SIGTERM; writes ``ready_file`` once
    serving (how scripts and tests learn a port chosen by the system)."""
    app = ServerApp(server_cfg, train, method, metrics_linger, log_every)
    await app.start()
    if ready_file:
        atomic_write_json(ready_file, {"port": app.port, "metrics_port": app.metrics_port,
                                       "pid": os.getpid()}, mode=0o644)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await app.run(stop)
    return 0


def certs_main(argv: list[str]) -> int:
    """``fl-server certs init DIR [--hosts ...] | issue DIR EDGE | revoke DIR EDGE``."""
    parser = argparse.ArgumentParser(prog="fl-server certs",
                                     description="the CA for mutual TLS and edge enrollment")
    sub = parser.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="create the CA and the server certificate")
    init.add_argument("dir", type=Path)
    init.add_argument("--hosts", type=lambda s: [h for h in s.split(",") if h],
                      help="server names/addresses for its certificate "
                           "(default: localhost,127.0.0.1,this host's name)")
    issue = sub.add_parser("issue", help="enroll an edge: certificate, key and token")
    issue.add_argument("dir", type=Path)
    issue.add_argument("edge")
    revoke = sub.add_parser("revoke", help="refuse an enrolled edge from now on")
    revoke.add_argument("dir", type=Path)
    revoke.add_argument("edge")
    args = parser.parse_args(argv)
    try:
        if args.action == "init":
            init_ca(args.dir, args.hosts)
            print(f"CA and server certificate in {args.dir}; serve with --tls-dir {args.dir}")
        elif args.action == "issue":
            out = issue_edge(args.dir, args.edge)
            print(f"edge {args.edge}: copy {out} to the device and run "
                  f"fl-edge --tls-dir <that folder> --name {args.edge}")
        else:
            revoke_edge(args.dir, args.edge)
            print(f"edge {args.edge} revoked")
    except StateError as err:
        print(f"fl-server certs: error: {err}", file=sys.stderr)
        return 2
    return 0


def limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives threads that allocate concurrently arenas of their own (up to 8 per core),
    and the upload chunks gRPC's threads receive then fragment over all of them: the
    server's RSS climbs for several rounds before it levels off. Two arenas, as
    MALLOC_ARENA_MAX=2 would set, lower that plateau by about a third (bench/wire.py).
    Left alone where the user set MALLOC_ARENA_MAX and off glibc."""
    if "MALLOC_ARENA_MAX" in os.environ or platform.libc_ver()[0] != "glibc":
        return
    m_arena_max = -8  # from glibc's malloc.h
    ctypes.CDLL(None).mallopt(m_arena_max, arenas)


def main(argv: list[str] | None = None) -> int:
    """``fl-server``: ``certs ...`` or a run; returns the exit status (2: bad settings)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["certs"]:
        return certs_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if args.list_methods:
        for name in available_methods():
            cls = load_method(name)
            defaults = dataclasses.asdict(cls.Params())  # default_factory fields included
            fields = ", ".join(f"{k}={v}" for k, v in defaults.items())
            print(f"{name:12s} {cls.aggregator_kind.value:24s} {fields}")
        return 0
    try:
        server_cfg, train, method = resolve(args)
        if server_cfg.insecure == bool(server_cfg.tls_dir):
            raise ConfigError("pass --tls-dir DIR for mutual TLS (make DIR with `fl-server "
                              "certs init DIR`) or --insecure for plaintext gRPC, not both")
        for flag, value in (("--metrics-linger", args.metrics_linger),
                            ("--log-every", args.log_every)):
            if value < 0:
                raise ConfigError(f"{flag} must be >= 0")
        limit_malloc_arenas()
        return asyncio.run(serve(server_cfg, train, method, args.ready_file,
                                 args.metrics_linger, args.log_every))
    except (ConfigError, UsageError, StateError, ValueError) as err:
        print(f"fl-server: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

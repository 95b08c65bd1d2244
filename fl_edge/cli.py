"""``fl-edge``: run an edge that trains on its own --data-dir for a fl-server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from fedattn_shared.logs import setup_logging
from fedattn_shared.methods.registry import MODULE_SPEC
from fedattn_shared.privacy.dp import PrivacyPolicy

from .daemon import EdgeDaemon, EdgeExit, EdgeOptions
from .device_check import startup_device
from .heterogeneity import DEFAULT_OFFLINE_SECONDS, check_throttle, parse_disconnect
from .metrics import METRICS_LINGER, linger_for_metrics
from .sdnotify import Watchdog, edge_health, notify, watchdog_interval
from .supervision import Stopped, StopSignals

log = logging.getLogger("fl_edge")


def build_parser() -> argparse.ArgumentParser:
    """The daemon's command line; the policy options in their own group (``_add_policy``)."""
    parser = argparse.ArgumentParser(
        prog="fl-edge",
        description="fedattn edge daemon: joins a fl-server, trains on local data, keeps "
                    "private state on local disk. The server chooses the method and model, "
                    "within the edge's own rules (see below). "
                    "Offline tools: `fl-edge export ...`, `fl-edge predict ...`.")
    parser.add_argument("--server", required=True, help="HOST:PORT of the fl-server")
    parser.add_argument("--data-dir", required=True, type=Path,
                        help="this device's data: .npz (train/test or data), an image-folder "
                             "tree, MNIST-style IDX files or CIFAR-10 batches; optional "
                             "global_test/ or global_test.npz")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="private state and identity (default: DATA_DIR/../<name>.fedattn-state)")
    parser.add_argument("--name", default=None,
                        help="edge id to create on first start (default: a random id)")
    parser.add_argument("--token", default=os.environ.get("FEDATTN_TOKEN", ""),
                        help="cluster join token (default: $FEDATTN_TOKEN)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--metrics-port", type=int, default=-1,
                        help="Prometheus port (0: any free port; default: off)")
    parser.add_argument("--metrics-linger", type=float, default=METRICS_LINGER, metavar="SECONDS",
                        help="keep serving /metrics this long after the run finished, as "
                             "fl-server does, so a scrape sees the last round (default "
                             "%(default)g; 0: exit at once; SIGTERM ends it early)")
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext gRPC (required until TLS is configured)")
    parser.add_argument("--tls-dir", type=Path, default=None,
                        help="mutual TLS: the folder `fl-server certs issue` wrote for this edge "
                             "(ca.pem, edge.pem, edge.key, token)")
    parser.add_argument("--tls-server-name", default="",
                        help="the name in the server's certificate, when --server uses another")
    parser.add_argument("--retry-for", type=float, default=0.0,
                        help="give up after this many seconds without the server (0: never)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads for training (default: $OMP_NUM_THREADS, "
                             "else 1, so that several edges on one host do not oversubscribe "
                             "its cores; an edge alone on a multi-core device may raise it to "
                             "its core count)")
    _add_small_devices(parser)
    _add_device_limits(parser)
    _add_policy(parser)
    _add_simulation(parser)
    parser.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                        help="progress bars (auto: when a terminal is attached)")
    parser.add_argument("--log-every", type=float, default=10.0, metavar="SECONDS",
                        help="without progress bars, log training progress (steps, "
                             "samples/s, ETA) every this many seconds (default 10; 0: off)")
    parser.add_argument("--log-level", default="INFO")
    return parser


def _add_small_devices(parser: argparse.ArgumentParser) -> None:
    """How this device trains: its batch, accumulation, precision, where the data sits."""
    small = parser.add_argument_group("small devices")
    small.add_argument("--batch-size", type=int, default=None,
                       help="local batch size on this device (default: the server's)")
    small.add_argument("--grad-accum", type=int, default=1,
                       help="micro-batches per optimizer step (default 1)")
    small.add_argument("--amp", action="store_true",
                       help="half-precision forward pass (fp16 on CUDA, bf16 on CPU)")
    small.add_argument("--data-on-device", action="store_true",
                       help="keep the data splits in the GPU's memory: batches are gathered "
                            "there instead of copied from the host every step (the splits "
                            "must fit; no effect on a CPU)")


def _add_device_limits(parser: argparse.ArgumentParser) -> None:
    """What the device decides for itself, whatever the server sends (one help group)."""
    device = parser.add_argument_group(
        "device limits",
        "The device's own memory, speed and supervision settings; where the server sets the "
        "same thing (dp.max_physical_batch) the stricter value wins.")
    device.add_argument("--max-physical-batch", type=int, default=None, metavar="N",
                        help="at most N samples per forward/backward pass: a larger batch is "
                             "split into parts whose gradients sum to the same mean gradient "
                             "(DP-SGD: physical batches of the same logical batch). On an "
                             "out-of-memory error the edge halves it and retries the step "
                             "(default: whole batches, halved only on out-of-memory)")
    device.add_argument("--gpu-memory-fraction", type=float, default=None, metavar="F",
                        help="the share (0 < F <= 1) of the GPU's memory this process may "
                             "allocate (torch.cuda.set_per_process_memory_fraction; a Jetson "
                             "shares its memory with the OS); no effect on a CPU")
    device.add_argument("--cuda-nondeterministic-ok", action="store_true",
                        help="with train.deterministic on CUDA, an op without a deterministic "
                             "kernel warns instead of failing the round (the run is then not "
                             "bit-identical; see docs/architecture.md, determinism)")
    device.add_argument("--no-channels-last", dest="channels_last", action="store_false",
                        help="on a GPU, pass images in PyTorch's default NCHW layout instead "
                             "of channels-last")
    device.add_argument("--health-stall-seconds", type=float, default=1800.0, metavar="S",
                        help="GET /healthz on --metrics-port answers 503 once a task has "
                             "made no progress for S seconds (default 1800)")
    device.add_argument("--max-rate", type=float, default=0.0, metavar="BYTES_PER_S",
                        help="the edge sends and receives at most this many bytes/s each way "
                             "(a token bucket holding one second of it); keep it above the "
                             "server's --download-min-rate and --upload-min-rate, or its "
                             "transfers are cut as stalled (default 0: no cap)")
    device.add_argument("--max-bytes-per-day", type=int, default=0, metavar="BYTES",
                        help="a data budget per UTC day, both ways, kept in the state dir "
                             "(a restart does not reset it): once the next task would not "
                             "fit (the last task's bytes), the edge declines work until "
                             "00:00 UTC (default 0: none)")
    device.add_argument("--max-bytes-per-month", type=int, default=0, metavar="BYTES",
                        help="the same per calendar month (UTC); with both, both apply "
                             "(default 0: none)")


def _add_policy(parser: argparse.ArgumentParser) -> None:
    """The edge's own rules for what a server may ask of it, in one help group."""
    policy = parser.add_argument_group(
        "what the server may ask of this edge",
        "The server chooses the method, model and DP-SGD settings; the edge refuses (exit "
        "status 2, naming the setting) any that its own rules do not allow, before training.")
    policy.add_argument("--dp-max-epsilon", type=float, default=None, metavar="E",
                        help="train only under DP-SGD with a privacy budget of at most E: a "
                             "server without DP-SGD, without a budget (--dp-epsilon) or with a "
                             "larger one is refused. Implies --require-dp. Independently, the "
                             "first DP-SGD run on a state dir pins its epsilon, delta, noise "
                             "and accountant in the privacy ledger as that state dir's limits")
    policy.add_argument("--require-dp", action="store_true",
                        help="refuse a server that runs without DP-SGD (a state dir whose "
                             "privacy ledger exists requires it anyway)")
    policy.add_argument("--refuse-eval-detail", action="store_true",
                        help="refuse a server that asks for per-class evaluation counts "
                             "(fl-server --eval-detail): their row sums are this edge's label "
                             "histogram. Without it, they are sent when asked, except under DP")
    policy.add_argument("--allow-seeded-dp-noise", action="store_true",
                        help="accept a server's dp.seeded_noise: DP noise drawn from the run "
                             "seed, so that a run can be reproduced bit for bit. Whoever knows "
                             "the seed can remove the noise: for reproductions on your own "
                             "data, never deployment")
    policy.add_argument("--allow-method", action="append", default=[], metavar="MODULE:CLASS",
                        help="accept this method spec from the server, importing MODULE on "
                             "this device (repeatable; the exact spec only). Without it the "
                             "edge runs only methods installed under the fedattn.methods entry "
                             "points, and refuses any module:Class a server names before "
                             "importing anything")
    policy.add_argument("--max-model-mb", type=float, default=1024.0, metavar="MIB",
                        help="refuse a server whose run's models hold more state than this, "
                             "counted before anything is allocated (a timm or torchvision name "
                             "can mean billions of parameters; default 1024)")
    policy.add_argument("--allow-model", action="append", default=[], metavar="MODULE:CALLABLE",
                        help="accept this model spec from the server, importing MODULE on this "
                             "device (repeatable; the exact spec only). Without it the edge "
                             "builds only built-in models, timm:NAME, torchvision:NAME and "
                             "fedattn.models entry points installed here, and refuses any "
                             "module:callable a server names before importing anything")


def _add_simulation(parser: argparse.ArgumentParser) -> None:
    """Slow and flaky edges on one machine (fl_edge.heterogeneity), in one help group."""
    sim = parser.add_argument_group(
        "simulated heterogeneity (tests and benchmarks only)",
        "Make this edge slower or flaky without changing what it computes, so that fast and "
        "slow edges can be mixed on one machine (fl-sim sets these per edge).")
    sim.add_argument("--throttle", type=float, default=1.0, metavar="FACTOR",
                     help="after its own work on each task, sleep (FACTOR - 1) x that work's "
                          "wall time before submitting: every task takes FACTOR x as long, "
                          "the result is bit-identical (default 1: full speed)")
    sim.add_argument("--disconnect", default=None, metavar="P[:SECONDS]",
                     help="with probability P per task, do the work, then drop the connection "
                          "instead of submitting (the server drops the task), stay offline "
                          "SECONDS (default 10) and rejoin from the state on disk, as a "
                          "rebooted device would")
    sim.add_argument("--disconnect-seed", type=int, default=0, metavar="N",
                     help="seeds the --disconnect draws with the edge's id: the same seed "
                          "repeats the pattern (default 0)")


def build_tools_parser() -> argparse.ArgumentParser:
    """The offline tools' command line: they read a state dir, never the network."""
    parser = argparse.ArgumentParser(prog="fl-edge", description="offline tools of the edge")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="write the personalized model to a safetensors file")
    export.add_argument("--state-dir", required=True, type=Path)
    export.add_argument("--out", required=True, type=Path)
    predict = sub.add_parser("predict", help="classify images with the personalized model")
    source = predict.add_mutually_exclusive_group(required=True)
    source.add_argument("--state-dir", type=Path)
    source.add_argument("--model", type=Path, help="a file written by `fl-edge export`")
    predict.add_argument("images", nargs="+", type=Path, help="image files or folders")
    return parser


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp"}


def run_tool(argv: list[str]) -> int:
    """``fl-edge export`` / ``predict``: status 2 and one line on a bad state dir or input."""
    from fedattn_shared.state import StateError

    from . import export as tools

    args = build_tools_parser().parse_args(argv)
    try:
        if args.command == "export":
            model = tools.export(args.state_dir, args.out)
            print(f"wrote {args.out} ({model.method.name}, {model.train.model}, "
                  f"fingerprint {model.fingerprint})")
            return 0
        model = (tools.from_export(args.model) if args.model
                 else tools.from_state_dir(args.state_dir))
        files = []
        for path in args.images:
            if path.is_dir():
                files += sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
            elif path.exists():
                files.append(path)
            else:
                raise StateError(f"{path}: no such file or folder")
        probs = tools.predict(model, tools.load_images(files, model.train))
        classes = model.train.classes
        print("file,class,probability")
        for path, row in zip(files, probs, strict=True):
            best = int(row.argmax())
            print(f"{path},{classes[best]},{float(row[best]):.4f}")
        return 0
    except (StateError, FileNotFoundError, KeyError, ValueError) as err:
        print(f"fl-edge: error: {err}", file=sys.stderr)
        return 2


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threads(requested: int | None) -> int | None:
    """Sets torch's intra-op threads (``--threads``, else $OMP_NUM_THREADS, else 1) and
    returns the number, or None when ``requested`` is below 1. torch's own default is one
    thread per core in every process: five edges on a 2-core host then ran 10 threads per
    core and trained 10x slower than with one each. Warns when the threads exceed the
    cores."""
    import torch

    if requested is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        requested = int(env) if env.isdigit() and int(env) > 0 else 1
    if requested < 1:
        return None
    torch.set_num_threads(requested)
    cores = available_cores()
    if requested > cores:
        log.warning("--threads %d exceeds the %d core(s) this edge may use: training will "
                    "be oversubscribed (use at most %d, divided by the edges on this host)",
                    requested, cores, cores)
    else:
        log.info("training with %d torch thread(s) of %d core(s)", requested, cores)
    return requested


def _refusal(args: argparse.Namespace) -> str:
    """Why the options cannot run ('' when they can): what argparse does not check."""
    if args.insecure == bool(args.tls_dir):
        return ("pass --tls-dir DIR (the folder `fl-server certs issue` wrote) for mutual "
                "TLS or --insecure for plaintext gRPC, not both")
    if not args.data_dir.is_dir():
        return f"--data-dir {args.data_dir} is not a directory"
    if (args.batch_size is not None and args.batch_size < 1) or args.grad_accum < 1 or (
            args.max_physical_batch is not None and args.max_physical_batch < 1):
        return "--batch-size, --grad-accum and --max-physical-batch must be >= 1"
    if args.gpu_memory_fraction is not None and not 0 < args.gpu_memory_fraction <= 1:
        return "--gpu-memory-fraction must be in (0, 1]"
    if not args.health_stall_seconds > 0:
        return "--health-stall-seconds must be > 0"
    if not args.max_rate >= 0 or args.max_bytes_per_day < 0 or args.max_bytes_per_month < 0:
        return "--max-rate, --max-bytes-per-day and --max-bytes-per-month must be >= 0"
    if cpu_threads(args.threads) is None:
        return "--threads must be >= 1"
    bad_specs = [spec for spec in args.allow_method if not MODULE_SPEC.fullmatch(spec)]
    if bad_specs:
        return f"--allow-method {bad_specs[0]!r}: expected package.module:Class"
    if not args.max_model_mb > 0:
        return "--max-model-mb must be > 0"
    bad_specs = [spec for spec in args.allow_model if not MODULE_SPEC.fullmatch(spec)]
    if bad_specs:
        return f"--allow-model {bad_specs[0]!r}: expected package.module:callable"
    return ""


def edge_options(args: argparse.Namespace) -> EdgeOptions:
    """The daemon's options from the command line; ValueError (one line) when they cannot
    run."""
    refusal = _refusal(args)
    if refusal:
        raise ValueError(refusal)
    throttle = check_throttle(args.throttle)
    disconnect, offline = (parse_disconnect(args.disconnect) if args.disconnect
                           else (0.0, DEFAULT_OFFLINE_SECONDS))
    privacy = PrivacyPolicy(max_epsilon=args.dp_max_epsilon, require_dp=args.require_dp,
                            allow_seeded_noise=args.allow_seeded_dp_noise)
    state_dir = args.state_dir or args.data_dir.resolve().parent / (
        f"{args.data_dir.resolve().name}.fedattn-state")
    return EdgeOptions(
        server=args.server, data_dir=args.data_dir, state_dir=state_dir, join_token=args.token,
        name=args.name, device=args.device, metrics_port=args.metrics_port,
        progress={"auto": None, "on": True, "off": False}[args.progress],
        log_every=args.log_every, retry_for=args.retry_for, batch_size=args.batch_size,
        amp=args.amp, data_on_device=args.data_on_device,
        grad_accum=args.grad_accum, tls_dir=args.tls_dir, tls_server_name=args.tls_server_name,
        privacy=privacy, refuse_eval_detail=args.refuse_eval_detail,
        allow_methods=tuple(args.allow_method), allow_models=tuple(args.allow_model),
        max_model_mb=args.max_model_mb, throttle=throttle,
        disconnect=disconnect, offline_seconds=offline, disconnect_seed=args.disconnect_seed,
        max_physical_batch=args.max_physical_batch, gpu_memory_fraction=args.gpu_memory_fraction,
        cuda_nondeterministic_ok=args.cuda_nondeterministic_ok, channels_last=args.channels_last,
        health_stall_seconds=args.health_stall_seconds, max_rate=args.max_rate,
        max_bytes_per_day=args.max_bytes_per_day, max_bytes_per_month=args.max_bytes_per_month)


def main(argv: list[str] | None = None) -> int:
    """The ``fl-edge`` entry point: checks the options a daemon cannot (status 2, one
    line), then runs the daemon; its ``EdgeExit`` becomes the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("export", "predict"):
        return run_tool(argv)
    if argv and argv[0] == "run":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        options = edge_options(args)
    except ValueError as err:
        print(f"fl-edge: error: {err}", file=sys.stderr)
        return 2
    try:
        options.device = startup_device(options.device)
        return run_supervised(options, args.metrics_linger)
    except EdgeExit as err:
        print(f"fl-edge: error: {err}", file=sys.stderr)
        return err.code


def run_supervised(options: EdgeOptions, linger: float = 0.0) -> int:
    """The daemon under a supervisor: SIGTERM/SIGINT leave the run cleanly (state writes
    finished, Leave sent; exit 0, also as a container's PID 1), systemd hears READY=1 and
    the watchdog's pings while /healthz answers 200 (fl_edge.supervision, fl_edge.sdnotify).
    A run that ended keeps serving /metrics ``linger`` seconds more (or until SIGTERM)."""
    signals = StopSignals().install()
    watchdog = None
    try:
        daemon = EdgeDaemon(options)
        daemon.writer.critical = signals.deferred
        notify("READY=1")
        interval = watchdog_interval()
        if interval is not None:
            watchdog = Watchdog(interval, edge_health(lambda: daemon.metrics_port)).start()
        try:
            code = daemon.run()
        except Stopped as stop:
            daemon.writer.flush()  # a stop outside a session: its writes are still finished
            log.info("fl-edge stopped (%s)", stop)
            return 0
    except Stopped as stop:  # before the daemon existed: nothing to save or tell
        log.info("fl-edge stopped (%s)", stop)
        return 0
    finally:
        if watchdog is not None:  # first: STOPPING=1 is the last message the supervisor reads
            watchdog.stop()
        notify("STOPPING=1")
        signals.restore()
    if code == 0 and daemon.metrics_port is not None:
        linger_for_metrics(daemon.metrics_port, linger)
    return code


if __name__ == "__main__":
    sys.exit(main())

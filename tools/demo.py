"""``fl-demo``: a whole federation on this machine, on real data that ships with fedattn.

It partitions the bundled MNIST subset (Dirichlet per class) into one folder per edge,
starts a real ``fl-server`` and one real ``fl-edge`` process per edge on loopback, prints
a line per round as the server's history grows, and writes history, manifest, logs and a
report (plots and summary) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fedattn_shared.config import TrainConfig
from fedattn_shared.data.shipped import bundled_mnist
from fedattn_shared.state import StateError

#: The demo's training on top of fl-server's defaults (``TrainConfig``, the one place they
#: are set): momentum and a second local epoch learn faster in a few rounds on a few
#: thousand images. A method's declared ``train_settings`` win over them, the user's flags
#: over both; the demo prints what it sets.
DEMO_TRAIN = {"momentum": 0.9}
DEMO_LOCAL_EPOCHS = 2
#: The model for methods that declare none (3 SE modules: every method that needs no
#: special architecture runs on it, Fed-SAP included).
DEMO_MODEL = "se-cnn"
#: ``--dp`` without ``--dp-epsilon``: a budget that still learns in a few demo rounds.
DEMO_EPSILON = 8.0
#: ``--dp`` on a method whose uploads carry statistics of the edge's data, which DP-SGD
#: does not cover (Fed-SAP's squeeze vectors, pFedKA's cross-entropy): the noise
#: multiplier of those releases (``fl-server --dp-stats-sigma``). Each such tensor is
#: clipped to L2 norm 1 and gets N(0, 4^2) per coordinate, a Gaussian mechanism accounted
#: apart: 15 releases (Fed-SAP on se-cnn, 3 a round, the demo's 5 rounds) spend epsilon
#: ~9.3 at delta 1e-4, about the demo's DP-SGD budget. Such noise drowns the statistics'
#: signal (the demo shows the machinery, not their utility); override with
#: ``--dp-stats-sigma``.
DEMO_STATS_SIGMA = 2.0
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fl-demo", description=__doc__.splitlines()[0])
    p.add_argument("--method", default="fedsap")
    p.add_argument("--model", default=None,
                   help=f"default: the method's declared default model, else {DEMO_MODEL}")
    p.add_argument("--edges", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration per class")
    p.add_argument("--local-epochs", type=int, default=None,
                   help=f"default {DEMO_LOCAL_EPOCHS} (fl-server's: {TrainConfig.local_epochs})")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="train on the first N images of the bundled subset only (quick "
                        "checks; default: all 4,000)")
    p.add_argument("--source", type=Path, default=None, metavar="DIR",
                   help="partition this dataset instead (any fl-partition --source: npz, IDX, "
                        "CIFAR-10, a datasets folder, Parquet, CSV); set its train.num_classes, "
                        "in_channels, image_size with --set")
    p.add_argument("--image-column", default="image", help="a table --source's image column")
    p.add_argument("--label-column", default="label", help="a table --source's label column")
    p.add_argument("--data-format", choices=("npz", "folders", "parquet"), default="npz",
                   help="what the edges' data folders hold (fl-partition --format; default npz)")
    p.add_argument("--no-report", action="store_true",
                   help="skip fl-report's plots and summary (the history is still written)")
    p.add_argument("--lr", type=float, default=None,
                   help="default: fl-server's (train.lr), or what the method declares")
    p.add_argument("--momentum", type=float, default=None,
                   help=f"default {DEMO_TRAIN['momentum']}, or what the method declares "
                        "(SCAFFOLD: 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="run folder (default runs/demo-METHOD, plus -dp, -secagg, -tls, "
                        "-compress for those options: runs that differ do not share one)")
    p.add_argument("--force", action="store_true", help="replace an existing --out folder")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="passed to fl-server (e.g. --set fedprox.mu=0.1)")
    p.add_argument("--compress", default=None, metavar="up=CODEC,down=CODEC",
                   help="update compression, passed to fl-server --compress (e.g. "
                        "up=int8,down=fp16); compare runs with fl-report's bytes_vs_accuracy.png")
    privacy = p.add_argument_group("privacy (passed to fl-server)")
    privacy.add_argument("--dp", action="store_true",
                         help=f"DP-SGD on every edge (budget --dp-epsilon, default "
                              f"{DEMO_EPSILON:g} for the whole run; BatchNorm becomes "
                              "GroupNorm: fl-server --dp-fix-model)")
    privacy.add_argument("--dp-epsilon", type=float, default=None,
                         help="privacy budget for the whole run (implies --dp)")
    privacy.add_argument("--dp-stats-sigma", type=float, default=None,
                         help="noise multiplier of the statistics a method uploads beside its "
                              f"model (Fed-SAP, pFedKA; default {DEMO_STATS_SIGMA:g} for such a "
                              "method under --dp; implies --dp)")
    privacy.add_argument("--secagg", action="store_true",
                         help="secure aggregation: the server sees only the sum of the uploads")
    privacy.add_argument("--tls-dir", type=Path, default=None,
                         help="mutual TLS with the CA in DIR (created for 127.0.0.1 when DIR "
                              "holds none); each edge's certificate is issued under DIR/edges")
    return p


def server_settings(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The fl-server flags for the run, and the lines that tell the user what the demo
    chose for them: the method's declared model and training settings win over the
    demo's preferences, the user's flags over both. Raises ValueError for an unknown
    method (the message lists the known ones)."""
    from fedattn_shared.methods import load_method

    method = load_method(args.method)
    declared = dict(method.train_settings)
    defaults = TrainConfig()
    model = args.model or method.default_model or DEMO_MODEL
    train = {k: v for k, v in DEMO_TRAIN.items() if k not in declared}
    train.update((k, v) for k, v in (("lr", args.lr), ("momentum", args.momentum))
                 if v is not None)
    flags = ["--model", model]
    for key, value in train.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    # What the demo itself sets over fl-server's defaults (not what the user asked for).
    chosen = []
    if args.model is None and not method.default_model:
        chosen.append(f"--model {model} (fl-server's default: {defaults.model})")
    chosen += [f"--{key} {value} (default {getattr(defaults, key)})"
               for key, value in DEMO_TRAIN.items()
               if key not in declared and getattr(args, key) is None
               and value != getattr(defaults, key)]
    if args.local_epochs is None:
        chosen.append(f"--local-epochs {DEMO_LOCAL_EPOCHS} (default {defaults.local_epochs})")
    notes = []
    if chosen:
        notes.append("fl-demo sets, over fl-server's defaults: " + ", ".join(chosen))
    if declared and (args.lr is None or args.momentum is None):
        notes.append(f"{args.method} declares " + ", ".join(
            f"train.{k}={v}" for k, v in declared.items()))
    if args.dp or args.dp_epsilon is not None or args.dp_stats_sigma is not None:
        epsilon = DEMO_EPSILON if args.dp_epsilon is None else args.dp_epsilon
        flags += ["--dp", "--dp-epsilon", str(epsilon), "--dp-fix-model"]
        notes.append(f"DP-SGD with a budget of epsilon={epsilon:g} for the whole run"
                     + (" (the demo's default; set it with --dp-epsilon)"
                        if args.dp_epsilon is None else "")
                     + "; BatchNorm layers become GroupNorm")
        notes.append(DP_UTILITY.format(epsilon=epsilon))
        dp_flags, dp_notes = dp_method_settings(args, flags, method.name or args.method)
        flags += dp_flags
        notes += dp_notes
    else:
        # One machine's generated or public data: no label mix to hide, and the report's F1
        # needs the per-class counts. Never under DP (fl-server refuses the pair).
        flags.append("--eval-detail")
        notes.append("evaluations send per-class counts (--eval-detail, for the report's F1; "
                     "they reveal each edge's label histogram, so not with --dp)")
    if args.compress:
        flags += ["--compress", args.compress]
        notes.append(f"update compression {args.compress}")
    if args.secagg:
        flags.append("--secagg")
        notes.append("secure aggregation: the server sees only the sum of the uploads")
    return flags, notes


def run_flags(args: argparse.Namespace, settings: list[str], edges: int) -> list[str]:
    """The fl-server flags that say what the demo runs (``settings`` from
    ``server_settings``); the rest (address, TLS, paths) is the process's."""
    epochs = DEMO_LOCAL_EPOCHS if args.local_epochs is None else args.local_epochs
    return ["--method", args.method, "--rounds", str(args.rounds), "--min-edges", str(edges),
            *settings, "--local-epochs", str(epochs), "--seed", str(args.seed),
            "--poll-timeout", "5", *[f"--set={s}" for s in args.set]]


def dp_method_settings(args: argparse.Namespace, flags: list[str],
                       method_name: str) -> tuple[list[str], list[str]]:
    """Under ``--dp``: the method parameters DP-SGD needs (its declared ``dp_params``,
    unless the user set them) and, when the method uploads statistics DP-SGD does not cover, their
    noise (``--dp-stats-sigma``). Which sections are statistics is the server's own check
    (``statistics_sections``), run on the settings the server will get; settings the
    server refuses for another reason are left for it to name."""
    from fedattn_shared.config import ConfigError
    from fedattn_shared.methods import load_method
    from fedattn_shared.privacy.dp import statistics_sections
    from fl_server.cli import build_parser as server_parser
    from fl_server.cli import resolve

    user_keys = {s.partition("=")[0].strip() for s in args.set}
    sets = [f"{method_name}.{key}={json.dumps(value)}"
            for key, value in load_method(args.method).dp_params
            if f"{method_name}.{key}" not in user_keys]
    out = [f"--set={s}" for s in sets]
    notes = [f"{args.method} under DP-SGD: --set {', '.join(sets)}"] if sets else []
    if args.dp_stats_sigma is not None:
        return out + ["--dp-stats-sigma", str(args.dp_stats_sigma)], notes
    if "dp.stats_in_clear=true" in {s.replace(" ", "").lower() for s in args.set}:
        return out, notes
    probe = ["--insecure", "--method", args.method, "--rounds", str(args.rounds), *flags, *out,
             *[f"--set={s}" for s in args.set], "--set=dp.stats_in_clear=true"]
    try:
        _, _, method = resolve(server_parser().parse_args(probe))
        import torch

        with torch.device("meta"):
            uploaded = statistics_sections(method, method.build_models())
    except (ConfigError, ValueError):
        return out, notes  # fl-server refuses it, by name
    if uploaded:
        out += ["--dp-stats-sigma", str(DEMO_STATS_SIGMA)]
        notes.append(f"{args.method} uploads statistics DP-SGD does not cover "
                     f"({', '.join(uploaded)}): clipped and noised with --dp-stats-sigma "
                     f"{DEMO_STATS_SIGMA:g} (the demo's default), accounted apart "
                     "(dp_stats_epsilon in the history)")
    return out, notes


def default_out(args: argparse.Namespace) -> Path:
    """The run folder when ``--out`` is not given: named after the method and the options
    that make runs differ, so that ``fl-demo --secagg`` and then ``fl-demo --dp`` keep
    both runs (``runs/demo-fedsap-secagg``, ``runs/demo-fedsap-dp``)."""
    dp = args.dp or args.dp_epsilon is not None or args.dp_stats_sigma is not None
    options = [name for name, on in (("dp", dp), ("secagg", args.secagg),
                                      ("tls", args.tls_dir is not None),
                                      ("compress", bool(args.compress))) if on]
    return Path("runs") / "-".join(["demo", args.method.replace(":", "-"), *options])


def kilobytes(n: float) -> str:
    return f"{n / 1e6:.2f}MB" if n >= 1e6 else f"{n / 1e3:.1f}kB"


def bytes_line(direction: dict) -> str:
    parts = [f"{kind} {kilobytes(v['wire'])}" for kind, v in sorted(direction.items())]
    return ", ".join(parts) or "-"


def round_line(record: dict) -> str:
    evaluation = record.get("evaluation", {})
    summary = evaluation.get("summary", {})
    per_edge = evaluation.get("per_edge", {})
    local = summary.get("test", {}).get("mean_accuracy")
    pooled_global = summary.get("global_test", {}).get("mean_accuracy")
    edges = " ".join(f"{figures['test']['accuracy']:.3f}" for _, figures in sorted(per_edge.items()))
    return (f"{record['round']:>5}  {local if local is not None else float('nan'):>8.4f}  "
            f"{pooled_global if pooled_global is not None else float('nan'):>10.4f}  "
            f"{edges:<{6 * max(len(per_edge), 1)}}  {record['seconds']:>6.2f}s  "
            f"up: {bytes_line(record['bytes'].get('up', {}))}  "
            f"down: {bytes_line(record['bytes'].get('down', {}))}")


def privacy_line(history: dict) -> str | None:
    """What the edges spent, as they reported it (the largest over the edges): DP-SGD's
    epsilon and, where statistics were noised, theirs; None without DP figures."""
    spent: dict[str, float] = {}
    for record in history.get("rounds", []):
        for phase in record.values():
            if not isinstance(phase, dict):
                continue
            for figures in phase.get("edge_metrics", {}).values():
                for key in ("dp_epsilon", "dp_stats_epsilon"):
                    if key in figures:
                        spent[key] = max(spent.get(key, 0.0), figures[key])
    if not spent:
        return None
    line = f"privacy spent (largest over the edges): DP-SGD epsilon {spent.get('dp_epsilon', 0):.3g}"
    if "dp_stats_epsilon" in spent:
        line += f", noised statistics epsilon {spent['dp_stats_epsilon']:.3g} (accounted apart)"
    return line


#: What a DP-SGD demo can and cannot show, said before its rounds: measured with the demo's
#: own settings (fl-demo --dp, Fed-SAP and FedAvg: final mean accuracy 0.10 and 0.17).
DP_UTILITY = ("DP-SGD at this scale: each edge holds a few hundred images, and the noise that "
              "buys epsilon={epsilon:g} over the whole run is larger than the clipped "
              "gradient of a batch, so accuracy stays near chance (0.10 for 10 classes). The "
              "demo shows the machinery (per-sample clipping, noise, each edge's privacy "
              "ledger), not DP's utility, which needs thousands of images per edge or a "
              "pretrained model (docs/benchmarks.md, DP-SGD cost)")


def chance_line(history: dict) -> str | None:
    """A plain line when the run ended near chance (under twice guessing), so that a flat
    table is not read as a bug: None otherwise."""
    rounds = history.get("rounds") or [{}]
    test = rounds[-1].get("evaluation", {}).get("summary", {}).get("test", {})
    classes = history.get("manifest", {}).get("train", {}).get("num_classes", 10)
    if "mean_accuracy" not in test or test["mean_accuracy"] >= 2 / classes:
        return None
    why = (" under DP-SGD's noise (see the note before the rounds)"
           if (history["manifest"].get("dp") or {}).get("enabled") else "")
    return (f"the run ended near chance (mean accuracy {test['mean_accuracy']:.2f}, guessing: "
            f"{1 / classes:.2f}){why}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or default_out(args)
    if args.edges < 1 or args.rounds < 1 or args.alpha <= 0:
        print("fl-demo: error: --edges and --rounds must be >= 1 and --alpha > 0", file=sys.stderr)
        return 2
    try:
        settings, notes = server_settings(args)
    except ValueError as err:
        print(f"fl-demo: error: --method: {err}", file=sys.stderr)
        return 2
    if out.exists() and any(out.iterdir()):
        if not args.force:
            print(f"fl-demo: error: {out} is not empty (use --force to replace it, or --out "
                  "DIR for a run of its own)", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    logs = out / "logs"
    logs.mkdir(parents=True)

    from fedattn_shared.data.partition import main as partition

    source = args.source or bundled_mnist()
    print(f"partitioning {args.source or 'the bundled MNIST subset'} over {args.edges} edges "
          f"(Dirichlet alpha={args.alpha}, {args.data_format})")
    rc = partition(["--source", str(source), "--edges", str(args.edges), "--format", args.data_format,
                    "--image-column", args.image_column, "--label-column", args.label_column,
                    "--scheme", "dirichlet", "--alpha", str(args.alpha), "--seed", str(args.seed),
                    "--out", str(out / "data"), "--global-test-per-class", "50",
                    *(["--limit", str(args.limit)] if args.limit else [])])
    if rc != 0:
        return rc
    edge_dirs = sorted(p for p in (out / "data").iterdir() if p.is_dir())
    for note in notes:
        print(note)
    security = ["--insecure"]
    edge_tls: Path | None = None
    if args.tls_dir:
        from .sim import prepare_tls

        try:
            edge_tls = prepare_tls(args.tls_dir, [d.name for d in edge_dirs], own_server=True)
        except StateError as err:
            print(f"fl-demo: error: {err}", file=sys.stderr)
            return 2
        security = ["--tls-dir", str(args.tls_dir)]
        print(f"mutual TLS with the CA in {args.tls_dir}")

    procs: list[subprocess.Popen] = []
    handles = []

    def spawn(args_: list[str], log_name: str) -> subprocess.Popen:
        handle = open(logs / log_name, "wb")
        handles.append(handle)
        proc = subprocess.Popen([sys.executable, *args_], stdout=handle, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    ready = out / "server.ready.json"
    checkpoint = out / "server"
    server = spawn(["-m", "fl_server", *security, "--host", "127.0.0.1", "--port", "0",
                    "--ready-file", str(ready), "--checkpoint-dir", str(checkpoint),
                    *run_flags(args, settings, len(edge_dirs))], "server.log")
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if server.poll() == 2:  # refused its settings (a method that cannot run
                # under --dp, ...): its one-line reason is the demo's
                errors = [line for line in (logs / "server.log").read_text().splitlines()
                          if line.startswith("fl-server: error:")]
                print("fl-demo: " + (errors[-1] if errors else "fl-server refused its settings")
                      .removeprefix("fl-server: "), file=sys.stderr)
                return 2
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"fl-demo: the server did not start; see {logs / 'server.log'}:\n"
                      + (logs / "server.log").read_text()[-2000:], file=sys.stderr)
                return 1
            time.sleep(0.1)
        port = json.loads(ready.read_text())["port"]
        print(f"fl-server ({args.method}) on 127.0.0.1:{port}; starting {len(edge_dirs)} edges")
        from fedattn_shared.models import own_model_allowance

        edges = [spawn(["-m", "fl_edge", "--server", f"127.0.0.1:{port}",
                        *(["--tls-dir", str(edge_tls / d.name)] if edge_tls else ["--insecure"]),
                        "--data-dir", str(d), "--state-dir", str(out / "state" / d.name),
                        "--name", d.name, "--progress", "off", "--retry-for", "60",
                        # A module:Class method is this user's choice: its edges opt in.
                        *(["--allow-method", args.method] if ":" in args.method else []),
                        *own_model_allowance(args.model)],
                       f"{d.name}.log") for d in edge_dirs]
        print(f"{'round':>5}  {'mean acc':>8}  {'global acc':>10}  {'per-edge acc':<{6 * len(edges)}}"
              f"  {'time':>7}  bytes on the wire")
        shown = 0
        history_path = checkpoint / "history.json"
        while True:
            done = server.poll() is not None
            if history_path.exists():
                try:
                    rounds = json.loads(history_path.read_text())["rounds"]
                except json.JSONDecodeError:
                    rounds = []
                for record in rounds[shown:]:
                    print(round_line(record), flush=True)
                shown = max(shown, len(rounds))
            if done:
                break
            if any(e.poll() not in (None, 0) for e in edges):
                print("fl-demo: an edge failed; see the logs in " + str(logs), file=sys.stderr)
                return 1
            time.sleep(0.5)
        history = json.loads(history_path.read_text()) if history_path.exists() else {}
        for line in (privacy_line(history), chance_line(history)):
            if line:
                print(line)
        codes = [e.wait(timeout=60) for e in edges]
        if server.returncode != 0 or any(codes):
            print(f"fl-demo: server exited {server.returncode}, edges {codes}; see {logs}",
                  file=sys.stderr)
            return 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for handle in handles:
            handle.close()

    if args.no_report:
        print(f"\nhistory: {checkpoint / 'history.json'}  logs: {logs}")
        return 0
    from .report import main as report

    report([str(checkpoint), "--out", str(out / "report")])
    print(f"\nhistory: {checkpoint / 'history.json'}  report: {out / 'report'}  logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

from fedattn_shared.data.shipped import bundled_mnist


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fl-demo", description=__doc__.splitlines()[0])
    p.add_argument("--method", default="fedsap")
    p.add_argument("--model", default="se-cnn",
                   help="se-cnn (3 SE modules: every method runs on it, Fed-SAP included) "
                        "or lenet-bn")
    p.add_argument("--edges", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration per class")
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="run folder (default runs/demo-METHOD)")
    p.add_argument("--force", action="store_true", help="replace an existing --out folder")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="passed to fl-server (e.g. --set fedprox.mu=0.1)")
    return p


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or Path("runs") / f"demo-{args.method}"
    if args.edges < 1 or args.rounds < 1 or args.alpha <= 0:
        print("fl-demo: error: --edges and --rounds must be >= 1 and --alpha > 0", file=sys.stderr)
        return 2
    if out.exists() and any(out.iterdir()):
        if not args.force:
            print(f"fl-demo: error: {out} is not empty (use --force to replace it)",
                  file=sys.stderr)
            return 2
        shutil.rmtree(out)
    logs = out / "logs"
    logs.mkdir(parents=True)

    from fedattn_shared.data.partition import main as partition

    print(f"partitioning the bundled MNIST subset over {args.edges} edges "
          f"(Dirichlet alpha={args.alpha})")
    rc = partition(["--source", str(bundled_mnist()), "--edges", str(args.edges),
                    "--scheme", "dirichlet", "--alpha", str(args.alpha), "--seed", str(args.seed),
                    "--out", str(out / "data"), "--global-test-per-class", "50"])
    if rc != 0:
        return rc
    edge_dirs = sorted(p for p in (out / "data").iterdir() if p.is_dir())

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
    server = spawn(["-m", "fl_server", "--insecure", "--host", "127.0.0.1", "--port", "0",
                    "--ready-file", str(ready), "--checkpoint-dir", str(checkpoint),
                    "--method", args.method, "--rounds", str(args.rounds),
                    "--min-edges", str(len(edge_dirs)), "--model", args.model,
                    "--local-epochs", str(args.local_epochs), "--lr", str(args.lr),
                    "--momentum", str(args.momentum),
                    "--seed", str(args.seed), "--poll-timeout", "5",
                    *[f"--set={s}" for s in args.set]], "server.log")
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"fl-demo: the server did not start; see {logs / 'server.log'}:\n"
                      + (logs / "server.log").read_text()[-2000:], file=sys.stderr)
                return 1
            time.sleep(0.1)
        port = json.loads(ready.read_text())["port"]
        print(f"fl-server ({args.method}) on 127.0.0.1:{port}; starting {len(edge_dirs)} edges")
        edges = [spawn(["-m", "fl_edge", "--insecure", "--server", f"127.0.0.1:{port}",
                        "--data-dir", str(d), "--state-dir", str(out / "state" / d.name),
                        "--name", d.name, "--progress", "off", "--retry-for", "60"],
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

    from .report import main as report

    report([str(checkpoint), "--out", str(out / "report")])
    print(f"\nhistory: {checkpoint / 'history.json'}  report: {out / 'report'}  logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``fl-sim``: many edges inside a few processes, against a real fl-server.

Each simulated edge is a full ``EdgeDaemon`` with its own gRPC channel, identity and state
dir; a worker process hosts several of them as threads (one torch thread each). This is
how the papers' 100-client settings run on one machine. Without ``--server``, fl-sim
starts its own fl-server process; without ``--data-root``, it partitions the bundled
MNIST subset (Dirichlet) into ``--edges`` folders.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fedattn_shared.state import StateError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fl-sim", description=__doc__.splitlines()[0])
    p.add_argument("--method", default="fedavg",
                   help="a registered method, or package.module:Class (the simulated edges "
                        "are then allowed to import it: you chose it, not a remote server)")
    p.add_argument("--model", help="fl-server --model: a built-in, timm:NAME, torchvision:NAME, "
                                    "an installed fedattn.models name or package.module:callable "
                                    "(the simulated edges may then import it; default: the "
                                    "method's or fl-server's)")
    p.add_argument("--edges", type=int, default=100)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--procs", type=int, default=2, help="worker processes hosting the edges")
    p.add_argument("--data-root", type=Path, help="one sub-folder per edge (fl-partition output)")
    p.add_argument("--server", help="HOST:PORT of a running fl-server (default: start one)")
    p.add_argument("--out", type=Path, default=None, help="run folder (default runs/sim-METHOD)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                   help="where the simulated edges train (all share it)")
    p.add_argument("--data-on-device", action="store_true",
                   help="each edge keeps its data in the GPU's memory (fl-edge "
                        "--data-on-device)")
    p.add_argument("--batch-edges", type=int, default=0, metavar="N",
                   help="each worker trains up to N of its edges at once, as one batched "
                        "computation (torch.func.vmap over stacked models), where the "
                        "method's local step allows it (plain SGD: FedAvg, FedProx, ...; "
                        "others train one by one, the reason logged); results agree with "
                        "the sequential path within rounding, bit-identical between runs "
                        "with the same N and --procs. 0: off")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="passed to the fl-server it starts")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its server's last checkpoint, after "
                        "fl-sim was stopped or killed (a GPU lease's time limit): its server "
                        "resumes, the edges keep their state dirs; give the first run's flags")
    p.add_argument("--allow-seeded-dp-noise", action="store_true",
                   help="the edges accept dp.seeded_noise (bit-identical DP runs; whoever "
                        "knows the seed can remove the noise: reproductions only)")
    p.add_argument("--throttle", default=None, metavar="FRACTION:FACTOR",
                   help="simulated slow devices: round(FRACTION x edges) edges, a seeded "
                        "choice (--seed), run with fl-edge --throttle FACTOR (e.g. 0.25:5)")
    p.add_argument("--disconnect", default=None, metavar="FRACTION:P[:SECONDS]",
                   help="simulated flaky devices: round(FRACTION x edges) edges, a seeded "
                        "choice (--seed), run with fl-edge --disconnect P:SECONDS and "
                        "--disconnect-seed SEED (e.g. 0.1:0.2:10)")
    p.add_argument("--tls-dir", type=Path,
                   help="mutual TLS with the CA folder of `fl-server certs init`: each edge "
                        "uses DIR/edges/NAME, issued here when missing; without --server a CA "
                        "for 127.0.0.1 (and --server-host) is created when DIR has none")
    p.add_argument("--state-root", type=Path,
                   help="the edges' state dirs, one folder per edge (default RUN/state; with "
                        "--ray, a folder in each node's temp dir: give a path every node shares "
                        "for an edge to keep its identity wherever Ray places it)")
    p.add_argument("--server-host", default=None,
                   help="where fl-sim's own server listens and the edges dial it (default "
                        "127.0.0.1; with --ray, this machine's address as the Ray cluster "
                        "knows it, so that the other nodes reach it)")
    ray = p.add_argument_group("Ray cluster (the `ray` extra: pip install 'fedattn[ray]' on "
                               "every node)")
    ray.add_argument("--ray", metavar="ADDRESS",
                     help="host the edges as Ray actors placed across the Ray cluster at "
                          "ADDRESS (auto or HOST:PORT of its head, fl-sim running on a node; "
                          "or ray://HOST:PORT, Ray Client: the ray[client] extra and a "
                          "--server-host the nodes reach), instead of --procs local processes")
    ray.add_argument("--edges-per-actor", type=int, default=10,
                     help="edges one actor hosts, as threads of one process")
    ray.add_argument("--actor-cpus", type=float, default=1.0,
                     help="CPUs Ray reserves for each actor")
    ray.add_argument("--actor-gpus", type=float, default=0.0,
                     help="GPUs Ray reserves for each actor (a fraction shares one; with "
                          "--device cuda)")
    ray.add_argument("--ship-data", action="store_true",
                     help="put the edges' partitions into Ray's object store, each actor "
                          "writing its edges' to its node's temp dir (implied without "
                          "--data-root, whose partitions are on this machine only); else "
                          "--data-root must be a path every node sees")
    return p


@dataclass
class Heterogeneity:
    """Which simulated edges are slow (``--throttle``) and which flaky (``--disconnect``),
    as fl-sim writes it to ``RUN/sim.json`` for a bench to read."""

    throttle: float = 1.0
    slow: list[str] = field(default_factory=list)
    disconnect: float = 0.0
    offline_seconds: float = 10.0
    disconnect_seed: int = 0
    flaky: list[str] = field(default_factory=list)

    def worker_args(self) -> list[str]:
        """What a worker needs to give its edges their options."""
        return [f"--throttle={self.throttle}", *[f"--slow={n}" for n in self.slow],
                f"--disconnect={self.disconnect}:{self.offline_seconds}",
                f"--disconnect-seed={self.disconnect_seed}",
                *[f"--flaky={n}" for n in self.flaky]]


def choose_edges(names: list[str], fraction: float, seed: int, what: str) -> list[str]:
    """round(fraction x edges) of ``names``, a choice seeded by ``seed`` and ``what`` (the
    slow and the flaky edges are drawn independently), in the order of ``names``."""
    count = round(fraction * len(names))
    chosen = set(random.Random(f"fl-sim {what}:{seed}").sample(names, count))
    return [name for name in names if name in chosen]


def _fraction(text: str, flag: str) -> tuple[float, str]:
    """FRACTION:REST, the fraction in [0, 1]; ValueError names the flag."""
    head, _, rest = text.partition(":")
    try:
        fraction = float(head)
    except ValueError:
        fraction = -1.0
    if not rest or not 0 <= fraction <= 1:
        raise ValueError(f"{flag} {text!r}: expected a FRACTION in [0, 1], then ':' and the "
                         "edge's setting")
    return fraction, rest


def heterogeneity(args: argparse.Namespace, names: list[str]) -> Heterogeneity:
    """The slow and flaky edges ``--throttle`` and ``--disconnect`` ask for (ValueError,
    naming the flag, on a bad value)."""
    from fl_edge.heterogeneity import check_throttle, parse_disconnect

    plan = Heterogeneity(disconnect_seed=args.seed)
    if args.throttle:
        fraction, factor = _fraction(args.throttle, "--throttle")
        try:
            plan.throttle = check_throttle(float(factor))
        except ValueError:
            raise ValueError(f"--throttle {args.throttle!r}: expected FRACTION:FACTOR, the "
                             "factor a finite number >= 1") from None
        plan.slow = choose_edges(names, fraction, args.seed, "throttle")
    if args.disconnect:
        fraction, rest = _fraction(args.disconnect, "--disconnect")
        try:
            plan.disconnect, plan.offline_seconds = parse_disconnect(rest)
        except ValueError as err:
            raise ValueError(f"--disconnect {args.disconnect!r}: expected "
                             f"FRACTION:P[:SECONDS] (fl-edge says: {err})") from None
        plan.flaky = choose_edges(names, fraction, args.seed, "disconnect")
    return plan


def wait_for_workers(workers: list[subprocess.Popen], server: subprocess.Popen | None,
                     logs: Path | None = None) -> list[int]:
    """The workers' exit statuses. Once fl-sim's own server has exited (the run over, every
    connected edge told), each worker still running is told so (SIGUSR1) and stops
    waiting for its flaky edges that are away (``worker``). A worker that fails while the
    run is on (one of its edges failed: ``worker`` exits at once) ends the run: fl-sim's
    server waits for every edge (``--min-edges``), so it would wait for ever; the server
    is stopped (SIGTERM: it saves and exits) and so are the other workers."""
    if server is None:
        return [w.wait() for w in workers]
    while (server.poll() is None and any(w.poll() is None for w in workers)
           and not any(w.poll() for w in workers)):
        time.sleep(0.2)
    if server.poll() is None and any(w.poll() for w in workers):
        print("fl-sim: edges failed; stopping the run", file=sys.stderr)
        for i, worker_proc in enumerate(workers):  # what each failed edge said
            log = logs / f"worker-{i}.log" if logs else None
            if worker_proc.poll() and log and log.exists():
                for line in log.read_text(errors="replace").splitlines():
                    if " ERROR fl_sim " in line:
                        print(f"  worker-{i}: {line.split(' ERROR fl_sim ', 1)[1]}",
                              file=sys.stderr)
        server.terminate()
        for worker_proc in workers:
            if worker_proc.poll() is None:
                worker_proc.terminate()
    for worker_proc in workers:
        if worker_proc.poll() is None:
            worker_proc.send_signal(signal.SIGUSR1)
    return [w.wait() for w in workers]


def prepare_tls(ca_dir: Path, names: list[str], own_server: bool,
                host: str = "127.0.0.1") -> Path:
    """The per-edge certificate folders under ``ca_dir/edges``, issued where missing; a CA
    made here is for 127.0.0.1 and ``host``, where fl-sim's own server listens."""
    from fedattn_shared.tls import CA_KEY, EDGE_CERT, init_ca, issue_edge

    if not (ca_dir / CA_KEY).exists():
        if not own_server:
            raise StateError(f"--tls-dir {ca_dir} holds no CA: pass the folder the server's "
                             "`fl-server certs init` made")
        init_ca(ca_dir, list(dict.fromkeys(["127.0.0.1", "localhost", host])))
    for name in names:
        if not (ca_dir / "edges" / name / EDGE_CERT).exists():
            issue_edge(ca_dir, name)
    return ca_dir / "edges"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        from fl_tools.sim_worker import worker

        return worker(argv[1:])
    args = build_parser().parse_args(argv)
    if (args.edges < 1 or args.procs < 1 or args.edges_per_actor < 1 or args.batch_edges < 0
            or not 0 < args.fraction <= 1 or args.actor_cpus < 0 or args.actor_gpus < 0):
        print("fl-sim: error: --edges, --procs and --edges-per-actor must be >= 1, --batch-edges "
              ">= 0, --fraction "
              "in (0, 1], --actor-cpus and --actor-gpus >= 0", file=sys.stderr)
        return 2
    try:
        heterogeneity(args, [])  # the flags' syntax, before any data is partitioned
    except ValueError as err:
        print(f"fl-sim: error: {err}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not args.ray:  # on Ray, each edge checks its own node
        import torch

        if not torch.cuda.is_available():
            print("fl-sim: error: --device cuda: no CUDA device is available", file=sys.stderr)
            return 2
    out = args.out or Path("runs") / f"sim-{args.method}"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if args.resume and args.server is None:
        from fl_server.checkpoint import CheckpointStore

        if CheckpointStore(out / "server").latest() is None:  # stopped before round 1 closed
            print(f"fl-sim: --resume: {out / 'server'} holds no checkpoint yet; the run starts "
                  "from round 1")
            args.resume = False
    if args.data_root:
        if not args.data_root.is_dir():
            print(f"fl-sim: error: --data-root {args.data_root} is not a folder", file=sys.stderr)
            return 2
        data_dirs = sorted(p for p in args.data_root.iterdir() if p.is_dir())
    else:
        from fedattn_shared.data.partition import main as partition
        from fedattn_shared.data.shipped import bundled_mnist

        data_root = out / "data"
        if not data_root.exists():
            rc = partition(["--source", str(bundled_mnist()), "--edges", str(args.edges),
                            "--scheme", "dirichlet", "--alpha", str(args.alpha), "--seed",
                            str(args.seed), "--out", str(data_root), "--min-per-edge", "10",
                            "--global-test-per-class", "20"])
            if rc != 0:
                return rc
        data_dirs = sorted(p for p in data_root.iterdir() if p.is_dir())
    if len(data_dirs) < args.edges:
        print(f"fl-sim: error: {len(data_dirs)} edge folders for --edges {args.edges}",
              file=sys.stderr)
        return 2
    data_dirs = data_dirs[: args.edges]
    try:
        plan = heterogeneity(args, [d.name for d in data_dirs])
    except ValueError as err:
        print(f"fl-sim: error: {err}", file=sys.stderr)
        return 2
    (out / "sim.json").write_text(json.dumps(asdict(plan), indent=1) + "\n")
    if plan.slow:
        print(f"fl-sim: {len(plan.slow)} slow edges (--throttle {plan.throttle:g}): "
              + ", ".join(plan.slow))
    if plan.flaky:
        print(f"fl-sim: {len(plan.flaky)} flaky edges (--disconnect "
              f"{plan.disconnect:g}:{plan.offline_seconds:g}): " + ", ".join(plan.flaky))
    host = args.server_host or "127.0.0.1"
    if args.ray:
        try:
            host = args.server_host or join_ray(args.ray)
        except RuntimeError as err:
            print(f"fl-sim: error: --ray {args.ray}: {err}", file=sys.stderr)
            return 2
    tls_root = None
    if args.tls_dir:
        try:
            tls_root = prepare_tls(args.tls_dir, [d.name for d in data_dirs],
                                   own_server=args.server is None, host=host)
        except StateError as err:
            print(f"fl-sim: error: {err}", file=sys.stderr)
            return 2

    procs: list[subprocess.Popen] = []
    logs = []

    def spawn(cmd: list[str], name: str) -> subprocess.Popen:
        handle = open(out / "logs" / name, "ab" if args.resume else "wb")
        logs.append(handle)
        proc = subprocess.Popen([sys.executable, *cmd], stdout=handle, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    server = None
    try:
        address = args.server
        if address is None:
            ready = out / "server.ready.json"
            ready.unlink(missing_ok=True)
            security = ["--tls-dir", str(args.tls_dir)] if args.tls_dir else ["--insecure"]
            server = spawn(["-m", "fl_server", *security, "--host", host, "--port", "0",
                            "--ready-file", str(ready), "--checkpoint-dir", str(out / "server"),
                            "--method", args.method, "--rounds", str(args.rounds),
                            *(["--model", args.model] if args.model else []),
                            "--fraction", str(args.fraction), "--min-edges", str(args.edges),
                            "--seed", str(args.seed), *(["--resume"] * args.resume),
                            *[f"--set={s}" for s in args.set]],
                           "server.log")
            while not ready.exists():
                if server.poll() is not None:
                    print("fl-sim: the server did not start:\n"
                          + (out / "logs" / "server.log").read_text()[-2000:], file=sys.stderr)
                    return 1
                time.sleep(0.1)
            address = f"{host}:{json.loads(ready.read_text())['port']}"
        from fedattn_shared.models import own_model_allowance

        allow = ["--allow-method", args.method] if ":" in args.method else []
        allow += own_model_allowance(args.model)
        if args.allow_seeded_dp_noise:
            allow.append("--allow-seeded-dp-noise")
        options = ["--server", address, "--device", args.device, *allow, *plan.worker_args()]
        if args.data_on_device:
            options.append("--data-on-device")
        if args.batch_edges:
            options.append(f"--batch-edges={args.batch_edges}")
        if args.ray:
            from fl_tools.sim_ray import RayError, run_actors

            print(f"fl-sim: {args.edges} edges in Ray actors of {args.edges_per_actor} "
                  f"against {address}")
            try:
                codes = run_actors(args, data_dirs, options, tls_root, out, server)
            except RayError as err:
                print(f"fl-sim: error: {err}", file=sys.stderr)
                return 1
        else:
            tls = ["--tls-root", str(tls_root)] if tls_root else []
            state = args.state_root or out / "state"
            groups = [data_dirs[i :: args.procs] for i in range(args.procs)]
            workers = [spawn(["-m", "fl_tools.sim", "worker", "--state-root", str(state),
                              *options, *tls, *map(str, group)], f"worker-{i}.log")
                       for i, group in enumerate(groups) if group]
            print(f"fl-sim: {args.edges} edges in {len(workers)} processes against {address}")
            codes = wait_for_workers(workers, server, out / "logs")
        if server is not None:
            server.wait(timeout=60)
            saved = out / "server" / "history.json"  # none when stopped before a round
            history = json.loads(saved.read_text()) if saved.exists() else {"rounds": []}
            for record in history["rounds"]:
                test = record.get("evaluation", {}).get("summary", {}).get("test", {})
                print(f"round {record['round']:>4}: {len(record['train']['received'])} trained, "
                      f"mean accuracy {test.get('mean_accuracy', float('nan')):.4f} over "
                      f"{test.get('edges', 0)} edges, {record['seconds']:.1f}s")
        return 1 if any(codes) or (server is not None and server.returncode) else 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for handle in logs:
            handle.close()
        if args.ray:
            from fl_tools.sim_ray import disconnect

            disconnect()


def join_ray(address: str) -> str:
    """Joins the Ray cluster at ``address``; this machine's address as the cluster knows it.
    RuntimeError says why not (no Ray installed, no cluster there)."""
    from fl_tools.sim_ray import connect

    try:
        return connect(address)
    except ImportError as err:
        raise RuntimeError(f"Ray is not installed ({err}): pip install 'fedattn[ray]'") from None
    except (ConnectionError, ValueError, RuntimeError) as err:  # RuntimeError: Ray's own
        raise RuntimeError(f"no Ray cluster to join: {err}") from None


if __name__ == "__main__":
    sys.exit(main())

"""Load and soak on loopback: one real fl-server, many real edges (fl-sim: every edge a full
EdgeDaemon with its own identity, gRPC channel and state dir), a tiny model.

Load (--edges, default 100 300; --full adds 1000): FedAvg with lenet-bn on MNIST cut IID
into N edge folders (../shared/data/mnist when present, else the bundled 4,000-image
subset), --fraction of the edges trained per round, evaluation on every edge in the last
round only. Printed per N: time until all N edges joined, train-round time (median over
the rounds without evaluation), the last round (train + evaluation on all N), server CPU
seconds per round and peak RSS (from wait4 on the server process), failed RPCs (edge calls
that failed and were retried, from the fl-sim logs; submissions the server refused; tasks
dropped), and the machine's load average before and after.

Aio load (--aio; sizes 1000 3000, --full adds 10000): the edges are bench/_aioedges.py
processes (--procs of them), thousands of edges on one grpc.aio event loop each, speaking
the real protocol with real ids, keys and signatures but a trivial training, so the
figures are the server's. Per (N, fraction in --fractions): the server waits for N + 1
edges; once the N are connected (the fleet's join time), --idle seconds measure the idle
fleet (server CPU per second: presence streams and long-polls; presence events per second;
server RSS per idle edge over the server's RSS before the first join, and the slope of RSS
against connected edges while they join), then one more edge joins and --rounds rounds run
(round times, server CPU per round, peak RSS from wait4, failed RPCs by method and code).

Soak (--soak): --soak-edges edges in worker processes of --soak-edges-per-worker each
(fl-sim's worker), --soak-rounds rounds. Every few seconds a random worker is SIGKILLed
(all its edges die mid-whatever) and restarted a moment later from the same state dirs;
once, a third of the way in, the server is SIGKILLed and restarted with --resume on the
same port. Printed: rounds completed, kills, tasks dropped by reason, and the checks that
no checkpoint was lost (history holds every round once, in order; the manifest names the
last round; the checkpoint loads) and that every edge's private state file still loads.

    .venv/bin/python bench/load.py                      # 100 and 300 edges, then the soak
    .venv/bin/python bench/load.py --full               # adds 1000 edges
    .venv/bin/python bench/load.py --edges 50 --no-soak # a quick look
    .venv/bin/python bench/load.py --aio --full         # 1000, 3000, 10000 aio edges

Figures are printed, never asserted; bounded in time (--deadline per run), loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import SHARED_DATA

PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def mnist_source() -> Path:
    shared = SHARED_DATA / "mnist"
    if (shared / "train-images-idx3-ubyte.gz").exists():
        return shared
    from fedattn_shared.data.shipped import bundled_mnist

    return bundled_mnist()


def partition(edges: int, out: Path, seed: int = 0) -> None:
    subprocess.run([PY, "-m", "fedattn_shared.data.partition", "--source", str(mnist_source()),
                    "--edges", str(edges), "--scheme", "iid", "--seed", str(seed),
                    "--global-test-per-class", "0", "--out", str(out)],
                   check=True, env=ENV, stdout=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(work: Path, args: list[str], port: int, resume: bool = False) -> subprocess.Popen:
    ready = work / "server.ready.json"
    ready.unlink(missing_ok=True)
    log = open(work / "server.log", "ab")
    proc = subprocess.Popen(
        [PY, "-m", "fl_server", "--insecure", "--host", "127.0.0.1", "--port", str(port),
         "--ready-file", str(ready), "--checkpoint-dir", str(work / "server"),
         "--method", "fedavg", "--model", "lenet-bn", "--local-epochs", "1",
         *(["--resume"] if resume else []), *args],
        stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("fl-server did not start:\n" + (work / "server.log").read_text()[-2000:])
        time.sleep(0.1)
    return proc


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_rusage(proc: subprocess.Popen, timeout: float) -> tuple[int, resource.struct_rusage]:
    """wait4 on the server: its own CPU time and peak RSS, nobody else's."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = -9
            return -9, usage
        time.sleep(0.2)


def count_failed_rpcs(log_dir: Path) -> dict[str, int]:
    """Edge-side failures in fl-sim's worker logs (they log at WARNING and above)."""
    counts = {"retried": 0, "refused": 0, "edge errors": 0}
    for log in log_dir.glob("worker-*.log"):
        text = log.read_text(errors="replace")
        counts["retried"] += len(re.findall(r"unavailable \(\w+\); retrying", text))
        counts["refused"] += text.count("result refused")
        counts["edge errors"] += len(re.findall(r" ERROR ", text))
    return counts


def dropped_by_reason(history: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for record in history["rounds"]:
        for phase in ("train", "evaluate"):
            for reason in record.get(phase, {}).get("dropped", {}).values():
                key = reason.split(":")[0]
                out[key] = out.get(key, 0) + 1
    return out


def load_run(edges: int, args, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    started = time.monotonic()
    partition(edges, data, args.seed)
    partition_seconds = time.monotonic() - started
    load_before = os.getloadavg()[0]
    port = free_port()
    t0 = time.time()
    server = start_server(work, ["--rounds", str(args.rounds), "--fraction", str(args.fraction),
                                 "--min-edges", str(edges), "--eval-every", str(args.rounds),
                                 "--round-timeout", str(args.round_timeout),
                                 "--seed", str(args.seed)], port)
    startup_cpu = cpu_seconds(server.pid)  # imports and model build, before any edge
    sim = subprocess.Popen([PY, "-m", "fl_tools.sim", "--server", f"127.0.0.1:{port}",
                            "--data-root", str(data), "--edges", str(edges), "--procs",
                            str(args.procs), "--out", str(work / "sim")],
                           env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                           start_new_session=True)
    code, usage = wait_rusage(server, args.deadline)
    try:
        sim_code = sim.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(sim.pid, signal.SIGKILL)
        sim_code = sim.wait()
    load_after = os.getloadavg()[0]
    history = json.loads((work / "server" / "history.json").read_text())
    rounds = history["rounds"]
    train_rounds = [r["seconds"] for r in rounds if "evaluation" not in r]
    eval_rounds = [r for r in rounds if "evaluation" in r]
    cpu = usage.ru_utime + usage.ru_stime
    return {
        "edges": edges, "server_rc": code, "sim_rc": sim_code,
        "partition_s": partition_seconds,
        "join_s": rounds[0]["started"] - t0 if rounds else float("nan"),
        "rounds": len(rounds),
        "train_round_s": statistics.median(train_rounds) if train_rounds else float("nan"),
        "eval_round_s": eval_rounds[-1]["seconds"] if eval_rounds else float("nan"),
        "trained_per_round": statistics.mean(len(r["train"]["received"]) for r in rounds)
        if rounds else 0,
        "evaluated": len(eval_rounds[-1]["evaluate"]["received"]) if eval_rounds else 0,
        "server_cpu_s": cpu, "server_startup_cpu_s": startup_cpu,
        "server_cpu_per_round_s": (cpu - startup_cpu) / max(len(rounds), 1),
        "server_peak_rss_mib": usage.ru_maxrss / 1024,
        "rpc": count_failed_rpcs(work / "sim" / "logs"),
        "dropped": dropped_by_reason(history),
        "load_before": load_before, "load_after": load_after,
        "mean_accuracy": (eval_rounds[-1]["evaluation"]["summary"].get("test", {})
                          .get("mean_accuracy", float("nan")) if eval_rounds else float("nan")),
    }


def rss_bytes(pid: int) -> int:
    """The live process's resident set (VmRSS), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def fleet_status(files: list[Path]) -> dict:
    """The aio client processes' status files, added up."""
    total: dict = {"connected": 0, "counts": {}, "failed": {}, "join_seconds": [], "final": True}
    for path in files:
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            total["final"] = False
            continue
        total["connected"] += status["connected"]
        total["final"] &= status["final"]
        total["join_seconds"] += status["join_seconds"]
        for key in ("counts", "failed"):
            for name, value in status[key].items():
                total[key][name] = total[key].get(name, 0) + value
    return total


def slope_per_1000(points: list[tuple[int, int]]) -> float:
    """Least-squares bytes per 1,000 connected edges over (connected, rss) samples."""
    if len(points) < 2 or len({c for c, _ in points}) < 2:
        return float("nan")
    xs, ys = [c for c, _ in points], [r for _, r in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)


def aio_run(edges: int, fraction: float, args, work: Path, poll: str = "hints") -> dict:
    """One server, ``edges`` aio edges in --procs processes. The server waits for one more
    edge than the fleet (--min-edges N+1), so the fleet's joins and an idle window of
    --idle seconds (all connected, no round: presence streams and long-polls only) are
    measured before a last edge joins and the rounds start."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = start_server(work, ["--rounds", str(args.rounds), "--fraction", str(fraction),
                                 "--min-edges", str(edges + 1), "--max-edges", str(edges + 10),
                                 "--eval-every", str(args.eval_every),
                                 "--round-timeout", str(args.round_timeout),
                                 "--seed", str(args.seed)], port)
    started = time.monotonic()
    deadline = started + args.deadline
    base_rss, base_cpu = rss_bytes(server.pid), cpu_seconds(server.pid)
    per_proc = -(-edges // args.procs)
    files, clients = [], []

    def client(count: int, prefix: str, first: int) -> subprocess.Popen:
        files.append(work / f"status-{prefix}.json")
        log = open(work / f"client-{prefix}.log", "ab")
        return subprocess.Popen([PY, str(Path(__file__).parent / "_aioedges.py"), "--server",
                                 f"127.0.0.1:{port}", "--edges", str(count), "--prefix", prefix,
                                 "--first-index", str(first), "--seed", str(args.seed),
                                 "--deadline", str(args.deadline), "--status", str(files[-1]),
                                 *(["--long-poll"] if poll == "long-poll" else [])],
                                env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    t0 = time.time()
    for i in range(args.procs):
        count = min(per_proc, edges - i * per_proc)
        if count > 0:
            clients.append(client(count, f"p{i}", i * per_proc))
    ramp: list[tuple[int, int]] = []
    joined_at = idle = None
    while server.poll() is None and time.monotonic() < deadline:
        connected = fleet_status(files)["connected"]
        ramp.append((connected, rss_bytes(server.pid)))
        if connected >= edges:
            joined_at = time.monotonic() - started
            break
        time.sleep(0.5)
    if joined_at is not None:
        cpu0, t_idle = cpu_seconds(server.pid), time.monotonic()
        events0 = fleet_status(files)["counts"].get("presence events", 0)
        time.sleep(args.idle)
        seconds = time.monotonic() - t_idle
        idle = {"seconds": seconds, "cpu_per_s": (cpu_seconds(server.pid) - cpu0) / seconds,
                "rss": rss_bytes(server.pid),
                "presence_events_per_s": (fleet_status(files)["counts"].get("presence events", 0)
                                          - events0) / seconds}
        clients.append(client(1, "last", edges))
    rounds_cpu = None
    cpu_start = cpu_seconds(server.pid) if idle else 0.0
    manifest = work / "server" / "manifest.json"
    while server.poll() is None and time.monotonic() < deadline:
        if manifest.exists() and json.loads(manifest.read_text())["round"] >= args.rounds:
            rounds_cpu = cpu_seconds(server.pid) - cpu_start
            break
        time.sleep(0.2)
    code, usage = wait_rusage(server, max(deadline - time.monotonic(), 60))
    for proc in clients:  # the run is over: edges that missed its end stop calling
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in clients:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    fleet = fleet_status(files)
    history_file = work / "server" / "history.json"
    rounds = json.loads(history_file.read_text())["rounds"] if history_file.exists() else []
    train = [r["seconds"] for r in rounds if "evaluation" not in r]
    evaluated = [r for r in rounds if "evaluation" in r]
    joins = sorted(fleet["join_seconds"])
    return {
        "edges": edges, "fraction": fraction, "poll": poll, "server_rc": code,
        "rounds": len(rounds),
        "join_s": joined_at if joined_at is not None else float("nan"),
        "join_wall_s": (rounds[0]["started"] - t0) if rounds else float("nan"),
        "edge_join_p50_s": joins[len(joins) // 2] if joins else float("nan"),
        "edge_join_max_s": joins[-1] if joins else float("nan"),
        "train_round_s": statistics.median(train) if train else float("nan"),
        "eval_round_s": evaluated[-1]["seconds"] if evaluated else float("nan"),
        "trained_per_round": statistics.mean(len(r["train"]["received"]) for r in rounds)
        if rounds else 0,
        "evaluated": len(evaluated[-1]["evaluate"]["received"]) if evaluated else 0,
        "server_cpu_per_round_s": rounds_cpu / len(rounds) if rounds_cpu and rounds else float("nan"),
        "server_base_rss_mib": base_rss / 2**20, "server_base_cpu_s": base_cpu,
        "server_peak_rss_mib": usage.ru_maxrss / 1024,
        "rss_per_1000_connected_mib": slope_per_1000(ramp) / 2**20,
        "idle_rss_per_edge_kib": (idle["rss"] - base_rss) / edges / 1024 if idle else float("nan"),
        "idle_cpu_per_s": idle["cpu_per_s"] if idle else float("nan"),
        "presence_events_per_s": idle["presence_events_per_s"] if idle else float("nan"),
        "failed_rpcs": sum(fleet["failed"].values()), "failed": fleet["failed"],
        "edge_counts": fleet["counts"], "dropped": dropped_by_reason({"rounds": rounds}),
    }


def soak(args, work: Path, say) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    partition(args.soak_edges, data, args.seed)
    dirs = sorted(p for p in data.iterdir() if p.is_dir())
    groups = [dirs[i:i + args.soak_edges_per_worker]
              for i in range(0, len(dirs), args.soak_edges_per_worker)]
    (work / "logs").mkdir(exist_ok=True)
    port = free_port()
    server_args = ["--rounds", str(args.soak_rounds), "--fraction", "0.5",
                   "--min-edges", str(max(2, args.soak_edges // 2)), "--eval-every", "5",
                   "--round-timeout", "30", "--seed", str(args.seed)]
    rng = random.Random(args.seed)

    def start_worker(i: int) -> subprocess.Popen:
        log = open(work / "logs" / f"worker-{i}.log", "ab")
        return subprocess.Popen([PY, "-m", "fl_tools.sim", "worker", "--server", f"127.0.0.1:{port}",
                                 "--state-root", str(work / "state"), *map(str, groups[i])],
                                stdout=log, stderr=subprocess.STDOUT, env=ENV,
                                start_new_session=True)

    def rounds_done() -> int:
        manifest = work / "server" / "manifest.json"
        return json.loads(manifest.read_text())["round"] if manifest.exists() else 0

    server = start_server(work, server_args, port)
    workers = [start_worker(i) for i in range(len(groups))]
    kills = {"worker": 0, "server": 0}
    server_killed_at = None
    started = time.monotonic()
    next_kill = started + rng.uniform(3, 8)
    try:
        while server.poll() is None or server_killed_at is not None:
            now = time.monotonic()
            if now - started > args.deadline:
                say(f"soak: deadline of {args.deadline:.0f}s reached")
                break
            done = rounds_done()
            if server_killed_at is None and kills["server"] == 0 and done >= args.soak_rounds // 3:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
                kills["server"] += 1
                server_killed_at = now
                say(f"soak: SIGKILL fl-server after round {done}")
            if server_killed_at is not None and now - server_killed_at > 3:
                server = start_server(work, server_args, port, resume=True)
                server_killed_at = None
                say(f"soak: fl-server restarted with --resume (checkpoint round {rounds_done()})")
            if now >= next_kill:
                i = rng.randrange(len(workers))
                if workers[i].poll() is None:
                    os.killpg(workers[i].pid, signal.SIGKILL)
                    workers[i].wait()
                    kills["worker"] += 1
                    time.sleep(rng.uniform(0.5, 3))
                    workers[i] = start_worker(i)
                next_kill = time.monotonic() + rng.uniform(3, 8)
            time.sleep(0.2)
        server_rc = server.wait(timeout=60) if server.poll() is None else server.returncode
        # Edges hear "run over" on their next poll; one restarted after the server's last
        # answer keeps retrying (fl-sim: for 120 s), so the workers get a short grace only.
        grace = time.monotonic() + 20
        while time.monotonic() < grace and any(w.poll() is None for w in workers):
            time.sleep(0.5)
        worker_rcs = [w.poll() for w in workers]
    finally:
        for proc in [server, *workers]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    elapsed = time.monotonic() - started

    from fedattn_shared.state import load_tensors
    from fl_server.checkpoint import CheckpointStore

    history = json.loads((work / "server" / "history.json").read_text())
    numbers = [r["round"] for r in history["rounds"]]
    checkpoint_round, tensors, _ = CheckpointStore(work / "server", 2).load()
    states = sorted((work / "state").glob("*/private.safetensors"))
    unreadable = []
    for path in states:
        try:
            load_tensors(path)
        except Exception as err:  # noqa: BLE001 - reported, not raised
            unreadable.append(f"{path}: {err}")
    return {
        "elapsed_s": elapsed, "server_rc": server_rc,
        "workers_exited_0": sum(rc == 0 for rc in worker_rcs), "workers": len(worker_rcs),
        "rounds_completed": len(numbers), "rounds_planned": args.soak_rounds, "kills": kills,
        "history_contiguous": numbers == list(range(1, len(numbers) + 1)),
        "checkpoint_round": checkpoint_round, "checkpoint_tensors": len(tensors),
        "dropped": dropped_by_reason(history),
        "edge_states": len(states), "edge_states_unreadable": unreadable,
        "rpc": count_failed_rpcs(work / "logs"),
    }


def aio_table(sizes: list[int], args, work: Path, say) -> None:
    """Every (size, fraction) run with the aio fleet, then the table of figures."""
    results = []
    for edges in sizes:
        for fraction in args.fractions:
            for poll in args.polls:
                say(f"\n-- {edges} aio edges in {args.procs} processes, {args.rounds} rounds, "
                    f"fraction {fraction}, idle window {args.idle:g} s, idle edges: {poll}")
                r = aio_run(edges, fraction, args, work / f"aio-{edges}-{fraction}-{poll}", poll)
                results.append(r)
                say(json.dumps(r, sort_keys=True))
    say("\n| connected edges | idle edges | selected per round | fleet joined after "
        "| train round (median) "
        "| last round (train + eval on all) | server CPU per round | server idle CPU (presence "
        "+ long-polls) | server peak RSS | RSS per 1,000 connected | per idle edge | failed RPCs |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        say(f"| {r['edges']} | {r['poll']} | {r['trained_per_round']:.0f} ({r['fraction']:.0%}) | "
            f"{r['join_s']:.1f} s | {r['train_round_s']:.2f} s | {r['eval_round_s']:.2f} s "
            f"({r['evaluated']} evaluated) | {r['server_cpu_per_round_s']:.2f} s | "
            f"{r['idle_cpu_per_s']:.2f} s/s ({r['presence_events_per_s']:.0f} presence events/s) | "
            f"{r['server_peak_rss_mib']:.0f} MiB | {r['rss_per_1000_connected_mib']:.1f} MiB | "
            f"{r['idle_rss_per_edge_kib']:.1f} KiB | {r['failed_rpcs']} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--edges", type=int, nargs="+", default=None,
                   help="fleet sizes (default 100 300; with --aio 1000 3000)")
    p.add_argument("--full", action="store_true", help="also 1000 edges (with --aio: 10000)")
    p.add_argument("--aio", action="store_true",
                   help="edges from _aioedges.py (one grpc.aio loop per process, trivial "
                        "training) instead of fl-sim; no soak")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.1],
                   help="--aio: the fractions selected per round, one run each")
    p.add_argument("--polls", nargs="+", choices=["hints", "long-poll"], default=["hints"],
                   help="--aio: what an idle edge holds, one run each: its presence stream "
                        "only, waiting for the server's task_ready hint (fl-edge's way), or a "
                        "NextTask long-poll beside it (the protocol before hints)")
    p.add_argument("--idle", type=float, default=20.0,
                   help="--aio: seconds all edges stay connected and idle before the rounds")
    p.add_argument("--eval-every", type=int, default=None,
                   help="--aio: the server's --eval-every (default: the last round only)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--procs", type=int, default=2, help="fl-sim worker processes")
    p.add_argument("--round-timeout", type=float, default=600)
    p.add_argument("--deadline", type=float, default=1800, help="seconds per run at most")
    p.add_argument("--no-soak", dest="soak", action="store_false")
    p.add_argument("--soak-only", action="store_true")
    p.add_argument("--soak-edges", type=int, default=12)
    p.add_argument("--soak-edges-per-worker", type=int, default=3)
    p.add_argument("--soak-rounds", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="results file (default: print only)")
    p.add_argument("--work", type=Path, default=None, help="keep runs here (default: a temp dir)")
    args = p.parse_args(argv)
    if args.eval_every is None:
        args.eval_every = args.rounds
    if args.edges is None:
        args.edges = [1000, 3000] if args.aio else [100, 300]
    sizes = [] if args.soak_only else sorted(set(args.edges + (
        [10000 if args.aio else 1000] if args.full else [])))
    if args.aio:
        args.soak = args.soak_only = False
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"$ {' '.join(['bench/load.py', *(argv if argv is not None else sys.argv[1:])])}")
    say(f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}, data {mnist_source()}")
    with tempfile.TemporaryDirectory(prefix="fedattn-load-") as tmp:
        work = args.work or Path(tmp)
        if args.aio:
            aio_table(sizes, args, work, say)
            sizes = []
        results = []
        for edges in sizes:
            say(f"\n-- {edges} edges, {args.rounds} rounds, fraction {args.fraction}, "
                f"{args.procs} fl-sim processes")
            r = load_run(edges, args, work / f"load-{edges}")
            results.append(r)
            say(json.dumps(r, sort_keys=True))
        if results:
            say("\n| edges | all joined after | train round (median) | last round (train + eval "
                "on all) | server CPU per round (joins included) | server peak RSS | edge RPCs "
                "retried / results refused | tasks dropped | load avg before → after |")
            say("|---|---|---|---|---|---|---|---|---|")
            for r in results:
                dropped = ", ".join(f"{k} {v}" for k, v in sorted(r["dropped"].items())) or "0"
                say(f"| {r['edges']} | {r['join_s']:.1f} s | {r['train_round_s']:.2f} s "
                    f"({r['trained_per_round']:.0f} trained) | {r['eval_round_s']:.2f} s "
                    f"({r['evaluated']} evaluated) | {r['server_cpu_per_round_s']:.2f} s | "
                    f"{r['server_peak_rss_mib']:.0f} MiB | {r['rpc']['retried']} / "
                    f"{r['rpc']['refused']} | {dropped} | {r['load_before']:.1f} → "
                    f"{r['load_after']:.1f} |")
        if args.soak or args.soak_only:
            say(f"\n-- soak: {args.soak_edges} edges in workers of {args.soak_edges_per_worker}, "
                f"{args.soak_rounds} rounds, random worker SIGKILLs, one server SIGKILL + --resume")
            s = soak(args, work / "soak", say)
            say(json.dumps(s, sort_keys=True))
            lost = not (s["history_contiguous"] and s["checkpoint_round"] == s["rounds_completed"])
            say(f"soak: {s['rounds_completed']}/{s['rounds_planned']} rounds in {s['elapsed_s']:.0f} s, "
                f"{s['kills']['worker']} worker kills ({args.soak_edges_per_worker} edges each), "
                f"{s['kills']['server']} server kill; tasks dropped {s['dropped']}; "
                f"checkpoint lost: {'YES' if lost else 'no'} (history rounds contiguous: "
                f"{s['history_contiguous']}, manifest round {s['checkpoint_round']}); edge private "
                f"states readable: {s['edge_states'] - len(s['edge_states_unreadable'])}/{s['edge_states']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

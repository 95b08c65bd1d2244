"""Wire benchmark: what one fedattn round costs against the physical limits of the transport.

For each model size it runs, on loopback, with 8 edges and trivial local training:
  * fedattn: a real fl-server and 8 fl-edge processes (FedAvg, evaluation off), with the
    server's default of 2 uploads received at once and with all 8 at once;
  * bare grpcio: 8 client processes pull the same bytes in 1 MiB chunks over a
    server-streaming call and push them back over a client-streaming call, with raw-bytes
    (de)serializers: no protobuf, no method code;
  * plain sockets: 8 client processes receive the same bytes and send them back.
It prints wire bytes / raw tensor bytes, loopback socket bytes per round (from
/proc/net/dev) / raw bytes, round times and their ratios to both bounds, and the server's
peak RSS growth over its idle RSS in model sizes, next to the bare grpcio server's (the
transport's own buffers). Figures are printed, never asserted.

    .venv/bin/python bench/wire.py [--edges 8] [--rounds 8] [--models mobilenet-v3-small resnet18-cifar]

``--stacks`` runs only the bare round, its server on gRPC's sync stack and on its asyncio
stack (fl-server's), interleaved: what the stack alone costs.

Server memory against the number of uploaders (issue #28): ``--uploaders 8 64`` runs
only that: a real fl-server and N light uploaders (bench/uploaders.py) uploading
ResNet-18 at once, the server's peak RSS growth in models and its CPU seconds for the
rounds; ``--before CHECKOUT`` adds the same figures with the server run from another
checkout.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np

CHUNK = 1 << 20
MODEL_INPUT = {"lenet-bn": (1, 28), "mobilenet-v3-small": (3, 32), "resnet18-cifar": (3, 32)}


def loopback_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            fields = rest.split()
            return int(fields[0])  # received bytes; every loopback byte is received once
    return 0


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of each live thread of a process: thread id -> (name, seconds);
    the main thread (fl-server's event loop) is told apart from the other Python threads
    (its workers), which all share the interpreter's name."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        if int(task.name) == pid:
            name = "main (the event loop)"
        elif name == "python":
            name = "python (workers)"
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12]))
                               / os.sysconf("SC_CLK_TCK"))
    return out


def model_params(name: str) -> int:
    from fedattn_shared.models import build_model

    channels, size = MODEL_INPUT[name]
    return sum(p.numel() for p in build_model(name, 10, channels, size).state_dict().values()
               if p.is_floating_point())


# ---- fedattn ------------------------------------------------------------------------------
def checkout_path(checkout: Path, workdir: Path) -> str:
    """A PYTHONPATH that imports fedattn's packages from ``checkout``: its folders under
    their installed names, as symbolic links in ``workdir``."""
    links = workdir / "pypath"
    links.mkdir()
    for name, folder in (("fedattn_shared", "shared"), ("fl_server", "fl_server"),
                         ("fl_edge", "fl_edge"), ("fl_tools", "tools")):
        (links / name).symlink_to(Path(checkout).resolve() / folder)
    return str(links)


def fedattn_round(model: str, edges: int, rounds: int, workdir: Path, local_epochs: int,
                  server_env: dict[str, str] | None = None,
                  server_args: tuple[str, ...] = (), code: Path | None = None,
                  profile: Path | None = None) -> dict:
    """One fedattn run: round time, CPU, bytes and memory figures. ``code``: another
    checkout to run the server and the edges from (the figure before a change);
    ``profile``: py-spy samples the server's stacks into this file (collapsed stacks)."""
    channels, size = MODEL_INPUT[model]
    rng = np.random.default_rng(0)
    for i in range(edges):
        d = workdir / f"edge-{i}"
        d.mkdir(parents=True)
        for split in ("train", "test"):  # one optimizer step on two images: trivial training
            np.savez(d / f"{split}.npz",
                     x=rng.integers(0, 255, (2, size, size, channels), dtype=np.uint8),
                     y=np.arange(2))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if code is not None:
        env["PYTHONPATH"] = checkout_path(code, workdir)
    ready = workdir / "ready.json"
    server = subprocess.Popen(
        [sys.executable, "-m", "fl_server", "--insecure", "--host", "127.0.0.1", "--port", "0",
         "--ready-file", str(ready), "--checkpoint-dir", str(workdir / "server"), "--method",
         "fedavg", "--model", model, "--in-channels", str(channels), "--image-size", str(size),
         "--rounds", str(rounds), "--min-edges", str(edges), "--eval-every", "0",
         "--batch-size", "2", "--local-epochs", str(local_epochs), "--log-level", "WARNING",
         *server_args],
        env={**env, **(server_env or {})}, stdout=subprocess.DEVNULL,
        stderr=(workdir / "server.log").open("wb"),
        cwd=workdir)  # not the repository: `python -m` would import its packages first
    while not ready.exists():
        if server.poll() is not None:
            tail = (workdir / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the server exited ({server.returncode}):\n{tail}")
        time.sleep(0.05)
    time.sleep(1.0)
    idle_rss = rss_kib(server.pid, "VmRSS")
    port = json.loads(ready.read_text())["port"]
    spy = None if profile is None else subprocess.Popen(
        # py-spy beside this interpreter when it is not on PATH (a venv not activated)
        [shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")), "record",
         "--pid", str(server.pid), "--rate", "250", "--format", "raw", "--nonblocking",
         "--output", str(profile)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lo_before = loopback_bytes()
    clients = [subprocess.Popen(
        [sys.executable, "-m", "fl_edge", "--insecure", "--server", f"127.0.0.1:{port}",
         "--data-dir", str(workdir / f"edge-{i}"), "--state-dir", str(workdir / f"state-{i}"),
         "--name", f"edge-{i}", "--device", "cpu", "--log-level", "WARNING"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir)
        for i in range(edges)]
    # The high-water mark once the last round's checkpoint is on disk: the rounds' peak,
    # not the interpreter's teardown at exit (which briefly adds about 100 MB).
    def checkpoint_of(round_number: int) -> Path:
        return workdir / "server" / "rounds" / f"{round_number:06d}" / "state.json"

    # CPU seconds per steady round (after the first two, whose page faults and pool
    # fills are start-up costs), for the server and all edges together.
    steady_from = min(2, rounds - 1)
    peak, cpu_start, cpu_end = idle_rss, None, None
    while server.poll() is None and not checkpoint_of(rounds).exists():
        peak = max(peak, rss_kib(server.pid, "VmHWM"))
        if cpu_start is None and checkpoint_of(steady_from).exists():
            cpu_start = [cpu_seconds(p.pid) for p in [server, *clients]]
            threads_start = thread_cpu(server.pid)
        time.sleep(0.02)
    if cpu_start is not None and server.poll() is None:
        cpu_end = [cpu_seconds(p.pid) for p in [server, *clients]]
        if profile is not None:  # the server's CPU per steady round, by thread name
            by_name: dict[str, float] = {}
            for tid, (name, seconds) in thread_cpu(server.pid).items():
                spent = seconds - threads_start.get(tid, (name, 0.0))[1]
                by_name[name] = by_name.get(name, 0.0) + spent / (rounds - steady_from)
            # Threads that came and went (the close's slice workers) are in the process's
            # CPU but no longer in /proc.
            by_name["threads that ended"] = ((cpu_end[0] - cpu_start[0]) / (rounds - steady_from)
                                             - sum(by_name.values()))
            profile.with_suffix(".threads.json").write_text(json.dumps(by_name, indent=1))
    server.wait(timeout=120)
    if spy is not None:
        spy.wait(timeout=120)
    lo_total = loopback_bytes() - lo_before
    for c in clients:
        c.wait(timeout=120)
    history = json.loads((workdir / "server" / "history.json").read_text())
    steady = history["rounds"][steady_from:] or history["rounds"]
    wire = raw = 0
    for record in steady:
        for direction in record["bytes"].values():
            for v in direction.values():
                wire += v["wire"]
                raw += v["raw"]
    per_round_raw = raw / len(steady)
    starts = [r["started"] for r in history["rounds"]][steady_from:]
    counted = rounds - steady_from
    cpu = ([(b - a) / counted for a, b in zip(cpu_start, cpu_end, strict=True)]
           if cpu_start and cpu_end else [math.nan] * (edges + 1))
    return {
        # start to start: the round as edges live it, checkpoint and task hand-out included
        "round_s": statistics.median(b - a for a, b in zip(starts[:-1], starts[1:], strict=True)),
        "server_cpu_s": cpu[0],
        "edges_cpu_s": sum(cpu[1:]),
        "round_inside_s": statistics.median(r["seconds"] for r in steady),
        "wire_over_raw": wire / raw,
        "raw_per_round": per_round_raw,
        "socket_over_raw": lo_total / (raw / len(steady) * len(history["rounds"])),
        "peak_rss_growth_kib": peak - idle_rss,
    }


# ---- server memory against the number of uploaders ---------------------------------------
def uploaders_round(model: str, uploaders: int, rounds: int, workdir: Path,
                    server_args: tuple[str, ...] = (), server_code: Path | None = None,
                    per_process: int = 16, server_env: dict[str, str] | None = None,
                    server_log: Path | None = None, held: bool = False) -> dict:
    """A real fl-server (FedAvg, or --method in ``server_args``) and ``uploaders`` light
    edges (bench/uploaders.py, ``per_process`` per process, all uploading the global they
    received as soon as it arrives): the server's peak RSS growth over its idle RSS.
    ``server_code``: another checkout to run the server from (the figure before a change).
    ``server_log``: the server's DEBUG log goes there (its "memory at" lines: the RSS at
    each stage of the round), instead of nowhere. ``held``: also the most the server's
    ``fedattn_download_held_bytes`` gauge read (sampled every 20 ms: what the downloads
    under way held in gRPC; the scrapes cost the server some CPU)."""
    channels, size = MODEL_INPUT[model]
    if held:
        server_args = (*server_args, "--metrics-port", "0")
    root = Path(__file__).resolve().parent.parent
    code = server_code or root
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server_env = {**env, "PYTHONPATH": checkout_path(code, workdir), **(server_env or {})}
    ready = workdir / "ready.json"
    server = subprocess.Popen(
        [sys.executable, "-m", "fl_server", "--insecure", "--host", "127.0.0.1", "--port", "0",
         "--ready-file", str(ready), "--checkpoint-dir", str(workdir / "server"),
         "--model", model, "--in-channels", str(channels), "--image-size", str(size),
         "--rounds", str(rounds), "--min-edges", str(uploaders), "--eval-every", "0",
         "--round-timeout", "900", "--upload-idle-timeout", "600", "--log-level",
         "DEBUG" if server_log else "WARNING", *server_args], env=server_env,
        cwd=workdir,  # not a checkout: `python -m` would import its packages first
        stdout=subprocess.DEVNULL, stderr=(server_log or workdir / "server.log").open("w"))
    while not ready.exists():
        if server.poll() is not None:
            tail = (server_log or workdir / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the server exited ({server.returncode}):\n{tail}")
        time.sleep(0.05)
    time.sleep(1.0)
    idle_rss = rss_kib(server.pid, "VmRSS")
    port = json.loads(ready.read_text())["port"]
    sampler = HeldSampler(json.loads(ready.read_text())["metrics_port"]) if held else None
    procs = [subprocess.Popen(
        [sys.executable, str(root / "bench" / "uploaders.py"), "--port", str(port),
         "--edges", str(min(per_process, uploaders - start)), "--prefix", f"p{start:03d}"],
        env=env) for start in range(0, uploaders, per_process)]
    started, peak, cpu = time.monotonic(), idle_rss, cpu_seconds(server.pid)
    idle_cpu = cpu
    last = workdir / "server" / "rounds" / f"{rounds:06d}" / "state.json"
    while server.poll() is None and not last.exists():  # the rounds' peak, not the exit's
        peak = max(peak, rss_kib(server.pid, "VmHWM"))
        cpu = cpu_seconds(server.pid)
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    held_peak = sampler.stop() if sampler else None
    statuses = [p.wait(timeout=300) for p in procs]
    server.wait(timeout=120)
    history = json.loads((workdir / "server" / "history.json").read_text())
    return {"peak_rss_growth_kib": peak - idle_rss, "idle_kib": idle_rss, "seconds": elapsed,
            "server_cpu": cpu - idle_cpu, "held_peak": held_peak,
            "received": [len(r["train"]["received"]) for r in history["rounds"]],
            "uploaders_ok": statuses.count(0) == len(statuses)}


class HeldSampler:
    """The most a server's ``fedattn_download_held_bytes`` gauge read, scraped every 20 ms
    on a thread until ``stop``."""

    def __init__(self, metrics_port: int):
        self.url, self.peak = f"http://127.0.0.1:{metrics_port}/metrics", 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import urllib.request

        while not self.done.wait(0.02):
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("fedattn_download_held_bytes "):
                    self.peak = max(self.peak, float(line.split()[1]))

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return self.peak


def memory_breakdown(lines: list[str], idle_kib: int, model_bytes: int) -> None:
    """The server's "memory at" lines (``fl_server.memory.log_memory``): RSS and peak at
    each stage, as growth over the idle RSS in models; a line whose figures moved less
    than a tenth of a model from the last one printed is left out."""
    last = None
    for line in lines:
        if "memory at " not in line:
            continue
        stage, _, figures = line.split("memory at ", 1)[1].rpartition(": rss ")
        rss, _, peak = figures.partition(" KiB, peak ")
        rss_x = (int(rss) - idle_kib) * 1024 / model_bytes
        peak_x = (int(peak.split()[0]) - idle_kib) * 1024 / model_bytes
        if last and abs(rss_x - last[0]) < 0.1 and abs(peak_x - last[1]) < 0.1:
            continue
        last = (rss_x, peak_x)
        print(f"      {stage:<48} rss {rss_x:+6.2f}x  peak {peak_x:+6.2f}x", flush=True)


def memory_figures(model: str, counts: list[int], rounds: int, before: Path | None,
                   method: str, breakdown: bool = False, extra: tuple[str, ...] = (),
                   held: bool = False) -> None:
    """Server peak RSS growth, in models, for each number of concurrent uploaders, with
    this checkout's server (and ``before``'s, when given), next to the load average."""
    model_bytes = model_params(model) * 4
    print(f"\nserver memory, {model} ({model_bytes / 1e6:.1f} MB), {method}, {rounds} rounds, "
          f"light uploaders (bench/uploaders.py), {os.cpu_count()} cores")
    for count in counts:
        for label, code in (("before", before), ("after", None)):
            if label == "before" and before is None:
                continue
            load = os.getloadavg()[0]
            with tempfile.TemporaryDirectory() as tmp:
                log_path = Path(tmp) / "server.log" if breakdown else None
                r = uploaders_round(model, count, rounds, Path(tmp),
                                    ("--method", method, *extra), server_code=code,
                                    server_log=log_path, held=held)
                lines = log_path.read_text().splitlines() if log_path else []
            growth = r["peak_rss_growth_kib"] * 1024
            print(f"  {count:3d} uploaders, {label:6s}: peak RSS growth {growth / 1e6:7.1f} MB = "
                  f"{growth / model_bytes:5.2f}x one model (idle {r['idle_kib'] / 1024:.0f} MiB), "
                  f"{r['seconds']:.1f} s for {rounds} rounds (server CPU {r['server_cpu']:.1f} s), "
                  f"received {r['received']}, "
                  + (f"downloads held at most {r['held_peak'] / model_bytes:.2f}x in gRPC, "
                     if held else "")
                  + f"uploaders ok {r['uploaders_ok']}, load avg {load:.2f} before", flush=True)
            memory_breakdown(lines, r["idle_kib"], model_bytes)


# ---- bare grpcio --------------------------------------------------------------------------
def _grpc_client(port: int, nbytes: int, start, done) -> None:
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)])
    pull = channel.unary_stream("/bench/Pull", request_serializer=None, response_deserializer=None)
    push = channel.stream_unary("/bench/Push", request_serializer=None, response_deserializer=None)
    list(pull(b"warmup"))  # connect outside the timed round
    start.wait()
    cpu = time.process_time()
    chunks = list(pull(b"go"))
    push(iter(chunks))
    done.put((time.perf_counter(), time.process_time() - cpu))


class PeakRss:
    """Peak VmRSS of this process while the block runs, sampled every 5 ms."""

    def __enter__(self) -> PeakRss:
        self.base = self.peak = rss_kib(os.getpid(), "VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_kib(os.getpid(), "VmRSS"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_kib(self) -> int:
        return self.peak - self.base


GRPC_OPTIONS = [("grpc.max_receive_message_length", 8 << 20),
                ("grpc.max_send_message_length", 8 << 20)]


class AioServer:
    """The bare round's server on gRPC's asyncio stack (``grpc.aio``, as fl-server), its
    event loop on a thread of this process: the same two calls as the sync stack's, so
    that the two stacks' CPU can be told apart with the same clients."""

    def __init__(self, payload: bytes):
        import asyncio

        import grpc

        nbytes = len(payload)

        async def pull(request, context):
            if request == b"warmup":
                return
            for i in range(0, nbytes, CHUNK):
                yield payload[i : i + CHUNK]

        async def push(iterator, context):
            total = 0
            async for chunk in iterator:
                total += len(chunk)
            return total.to_bytes(8, "little")

        self.handler = grpc.method_handlers_generic_handler("bench", {
            "Pull": grpc.unary_stream_rpc_method_handler(pull),
            "Push": grpc.stream_unary_rpc_method_handler(push)})
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> int:
        import grpc

        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        self.server.add_generic_rpc_handlers((self.handler,))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def stop(self, grace: float | None) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def grpc_round(nbytes: int, edges: int, repeats: int = 3, stack: str = "sync"
               ) -> tuple[float, int, float, float, float]:
    """Median round time, the server's peak RSS growth over its idle RSS (KiB), the median
    CPU seconds per round of the server and of all clients together, and (``stack``
    "aio") of the server's event loop thread alone (NaN on the sync stack). ``stack``:
    the server on gRPC's sync stack (a thread per call) or on its asyncio one."""
    import grpc

    payload = os.urandom(nbytes)

    def pull(request, context):
        if request == b"warmup":
            return
        for i in range(0, nbytes, CHUNK):
            yield payload[i : i + CHUNK]

    def push(iterator, context):
        total = sum(len(c) for c in iterator)
        return total.to_bytes(8, "little")

    if stack == "aio":
        server = AioServer(payload)
        port = server.port
    else:
        handler = grpc.method_handlers_generic_handler("bench", {
            "Pull": grpc.unary_stream_rpc_method_handler(pull),
            "Push": grpc.stream_unary_rpc_method_handler(push)})
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2 * edges),
                             options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
    times, server_cpu, clients_cpu, loop_cpu = [], [], [], []
    loop_thread = server.thread.native_id if stack == "aio" else None

    def loop_seconds() -> float:
        if loop_thread is None:
            return math.nan
        return thread_cpu(os.getpid())[loop_thread][1]

    ctx = mp.get_context("spawn")
    with PeakRss() as rss:
        for _ in range(repeats):
            start, done = ctx.Event(), ctx.Queue()
            procs = [ctx.Process(target=_grpc_client, args=(port, nbytes, start, done))
                     for _ in range(edges)]
            for p in procs:
                p.start()
            time.sleep(2.0)
            t0, cpu0, loop0 = time.perf_counter(), cpu_seconds(os.getpid()), loop_seconds()
            start.set()
            ends = [done.get(timeout=300) for _ in procs]
            loop_cpu.append(loop_seconds() - loop0)
            # The RSS sampler's share of this process's CPU is left in: it slightly
            # overstates the bare server's cost.
            server_cpu.append(cpu_seconds(os.getpid()) - cpu0)
            times.append(max(end for end, _ in ends) - t0)
            clients_cpu.append(sum(cpu for _, cpu in ends))
            for p in procs:
                p.join()
    server.stop(0)
    return (statistics.median(times), rss.growth_kib, statistics.median(server_cpu),
            statistics.median(clients_cpu), statistics.median(loop_cpu))


# ---- plain sockets ------------------------------------------------------------------------
def _socket_client(port: int, nbytes: int, start, done) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    start.wait()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        got += sock.recv_into(view[got:])
    sock.sendall(buf)
    sock.recv(1)
    done.put(time.perf_counter())
    sock.close()


def socket_round(nbytes: int, edges: int, repeats: int = 3) -> float:
    payload = os.urandom(nbytes)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve(conn: socket.socket) -> None:
        conn.sendall(payload)
        buf = bytearray(nbytes)
        view = memoryview(buf)
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:])
        conn.sendall(b"k")
        conn.close()

    times = []
    ctx = mp.get_context("spawn")
    for _ in range(repeats):
        start, done = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_socket_client, args=(port, nbytes, start, done))
                 for _ in range(edges)]
        for p in procs:
            p.start()
        conns = [listener.accept()[0] for _ in procs]
        time.sleep(0.5)
        threads = [threading.Thread(target=serve, args=(c,)) for c in conns]
        t0 = time.perf_counter()
        start.set()
        for t in threads:
            t.start()
        ends = [done.get(timeout=300) for _ in procs]
        times.append(max(ends) - t0)
        for t in threads:
            t.join()
        for p in procs:
            p.join()
    listener.close()
    return statistics.median(times)


def compare_rounds(models: list[str], edges: int, rounds: int, before: Path, repeats: int,
                   profile: Path | None = None, server_args: tuple[str, ...] = ()) -> None:
    """The round before and after a change, interleaved in one sitting (before, after,
    bare grpcio, ``repeats`` times) so that the machine's load falls on both alike: round
    time (start to start) and the CPU per steady round of the server and of the edges,
    each next to bare grpcio's in the same repeat, then the medians. ``profile``: py-spy samples the
    server of each run into that folder; ``server_args``: more fl-server arguments, on
    both sides."""
    print(f"{edges} edges on loopback, {os.cpu_count()} cores; FedAvg, no local steps; "
          f"before = {before}, after = this checkout; {repeats} interleaved repeats; "
          f"server arguments {list(server_args)}")
    for model in models:
        nbytes = model_params(model) * 4
        print(f"\n{model} ({nbytes / 1e6:.1f} MB)")
        # (round, server CPU, edges' CPU) per repeat: on a machine the edges share, the
        # round is the CPU of both sides, and a change may move either.
        figures: dict[str, list[tuple[float, float, float]]] = {
            "before": [], "after": [], "bare": []}
        for repeat in range(repeats):
            load = os.getloadavg()[0]
            for label, code in (("before", before), ("after", None)):
                out = None if profile is None else profile / f"{model}-{label}-{repeat}.txt"
                with tempfile.TemporaryDirectory() as tmp:
                    f = fedattn_round(model, edges, rounds, Path(tmp), local_epochs=0,
                                      server_args=server_args, code=code, profile=out)
                figures[label].append((f["round_s"], f["server_cpu_s"], f["edges_cpu_s"]))
            bare, _, bare_cpu, bare_edges, _ = grpc_round(nbytes, edges)
            figures["bare"].append((bare, bare_cpu, bare_edges))
            (b, bc, be), (a, ac, ae) = figures["before"][-1], figures["after"][-1]
            print(f"  repeat {repeat}: before {b:.3f} s = {b / bare:.2f}x, CPU server {bc:.3f} s"
                  f" edges {be:.3f} s | after {a:.3f} s = {a / bare:.2f}x, CPU server {ac:.3f} s"
                  f" edges {ae:.3f} s | bare grpcio {bare:.3f} s, CPU server {bare_cpu:.3f} s "
                  f"edges {bare_edges:.3f} s | load avg {load:.2f} before", flush=True)
        med = {k: [statistics.median(row[i] for row in v) for i in range(3)]
               for k, v in figures.items()}
        ratios = {k: statistics.median(row[0] / bare[0] for row, bare in
                                       zip(figures[k], figures["bare"], strict=True))
                  for k in ("before", "after")}
        for k in ("before", "after"):
            print(f"  median {k:6s}: round {med[k][0]:.3f} s = {ratios[k]:.2f}x bare grpcio; "
                  f"CPU per round, server {med[k][1]:.3f} s = {med[k][1] / med['bare'][1]:.2f}x "
                  f"bare grpcio's, edges {med[k][2]:.3f} s = {med[k][2] / med['bare'][2]:.2f}x")
        print(f"  median bare  : round {med['bare'][0]:.3f} s, CPU server {med['bare'][1]:.3f} s"
              f" edges {med['bare'][2]:.3f} s; after / before: round "
              f"{med['after'][0] / med['before'][0]:.2f}x, CPU server "
              f"{med['after'][1] / med['before'][1]:.2f}x, edges "
              f"{med['after'][2] / med['before'][2]:.2f}x")


def compare_stacks(models: list[str], edges: int, repeats: int) -> None:
    """The bare round with its server on gRPC's sync stack and on its asyncio stack (the
    one fl-server runs on), interleaved ``repeats`` times, the same client processes:
    how much of fedattn's distance from the bare round is the stack's."""
    print(f"bare grpcio, {edges} client processes on loopback, {os.cpu_count()} cores; "
          f"server on the sync stack (threads) against the asyncio stack; {repeats} "
          "interleaved repeats")
    for model in models:
        nbytes = model_params(model) * 4
        rows: dict[str, list[tuple[float, float, float, float]]] = {"sync": [], "aio": []}
        for repeat in range(repeats):
            for stack in ("sync", "aio"):
                seconds, _, server_cpu, clients_cpu, loop = grpc_round(nbytes, edges, stack=stack)
                rows[stack].append((seconds, server_cpu, clients_cpu, loop))
            (a, ac, ae, _), (b, bc, be, bl) = rows["sync"][-1], rows["aio"][-1]
            print(f"  {model} repeat {repeat}: sync {a:.3f} s, CPU server {ac:.3f} s clients "
                  f"{ae:.3f} s | aio {b:.3f} s, CPU server {bc:.3f} s (its event loop "
                  f"{bl:.3f} s) clients {be:.3f} s", flush=True)
        med = {k: [statistics.median(r[i] for r in v) for i in range(4)] for k, v in rows.items()}
        print(f"  {model} ({nbytes / 1e6:.1f} MB) median: sync {med['sync'][0]:.3f} s, server "
              f"CPU {med['sync'][1]:.3f} s | aio {med['aio'][0]:.3f} s, server CPU "
              f"{med['aio'][1]:.3f} s (its event loop {med['aio'][3]:.3f} s) | aio / sync: "
              f"round {med['aio'][0] / med['sync'][0]:.2f}x, "
              f"server CPU {med['aio'][1] / med['sync'][1]:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=["mobilenet-v3-small", "resnet18-cifar"])
    parser.add_argument("--uploaders", type=int, nargs="+", metavar="N",
                        help="only the server-memory figure: N light uploaders at once "
                             "(ResNet-18, the first of --models when given)")
    parser.add_argument("--before", type=Path, metavar="CHECKOUT",
                        help="with --uploaders: also run the server from this checkout; "
                             "without: only the round and the CPU of the server and the "
                             "edges, before (server and edges from CHECKOUT) and after (this "
                             "checkout), interleaved")
    parser.add_argument("--repeats", type=int, default=3,
                        help="with --before: interleaved repeats of before, after, bare grpcio")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="with --before: py-spy's samples of each run's server into DIR, "
                             "and its CPU per steady round by thread (NAME.threads.json)")
    parser.add_argument("--stacks", action="store_true",
                        help="only the bare round, its server on gRPC's sync stack against "
                             "its asyncio stack (fl-server's), --repeats times interleaved")
    parser.add_argument("--method", default="fedavg", help="with --uploaders: the method")
    parser.add_argument("--breakdown", action="store_true",
                        help="with --uploaders: the server's RSS at each stage of its rounds "
                             "(its DEBUG 'memory at' lines)")
    parser.add_argument("--held", action="store_true",
                        help="with --uploaders: also the most the downloads held in gRPC (the "
                             "server's fedattn_download_held_bytes, scraped every 20 ms)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="with --uploaders or --before: one more fl-server argument "
                             "(repeatable; --server-arg=--no-spill-uploads)")
    args = parser.parse_args()
    if args.uploaders:
        model = "resnet18-cifar" if "--models" not in sys.argv else args.models[0]
        memory_figures(model, args.uploaders, min(args.rounds, 3), args.before, args.method,
                       args.breakdown, tuple(args.server_arg), args.held)
        return 0
    if args.stacks:
        compare_stacks(args.models, args.edges, args.repeats)
        return 0
    if args.before:
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
        compare_rounds(args.models, args.edges, args.rounds, args.before, args.repeats,
                       args.profile, tuple(args.server_arg))
        return 0
    print(f"{args.edges} edges on loopback, {os.cpu_count()} cores; FedAvg, trivial local training")
    for model in args.models:
        params = model_params(model)
        model_bytes = params * 4
        with tempfile.TemporaryDirectory() as tmp:
            f = fedattn_round(model, args.edges, args.rounds, Path(tmp), local_epochs=0)
        with tempfile.TemporaryDirectory() as tmp:
            trained = fedattn_round(model, args.edges, args.rounds, Path(tmp), local_epochs=1)
        with tempfile.TemporaryDirectory() as tmp:  # fl-server limits glibc to 2 arenas
            many_arenas = fedattn_round(model, args.edges, args.rounds, Path(tmp), local_epochs=0,
                                        server_env={"MALLOC_ARENA_MAX": str(8 * os.cpu_count())})
        with tempfile.TemporaryDirectory() as tmp:  # every upload at once: memory for cores
            all_at_once = fedattn_round(
                model, args.edges, args.rounds, Path(tmp), local_epochs=0,
                server_args=("--max-concurrent-uploads", str(args.edges)))
        nbytes = model_bytes  # each edge pulls and pushes one model
        bare, bare_rss_kib, bare_server_cpu, bare_clients_cpu, _ = grpc_round(nbytes, args.edges)
        plain = socket_round(nbytes, args.edges)
        print(f"\n{model}: {params / 1e6:.2f} M float tensors ({model_bytes / 1e6:.1f} MB)")
        print(f"  wire bytes / raw tensor bytes          {f['wire_over_raw']:.4f}")
        print(f"  loopback socket bytes / raw bytes      {f['socket_over_raw']:.4f}")
        print(f"  fedattn round, no local steps          {f['round_s']:.3f} s start to start "
              f"({f['round_inside_s']:.3f} s from task hand-out to aggregate)")
        print(f"  fedattn round, one step on 2 images    {trained['round_s']:.3f} s "
              f"({args.edges} edges share {os.cpu_count()} cores)")
        label = f"... all {args.edges} uploads at once"
        print(f"  {label:<38} {all_at_once['round_s']:.3f} s "
              f"= {all_at_once['round_s'] / bare:.2f}x bare grpcio, server RSS growth "
              f"{all_at_once['peak_rss_growth_kib'] * 1024 / model_bytes:.2f}x one model "
              "(default: 2 at once)")
        print(f"  bare grpcio round (same bytes)         {bare:.3f} s")
        print(f"  plain-socket round (same bytes)        {plain:.3f} s")
        print(f"  fedattn (no local steps) / bare grpcio {f['round_s'] / bare:.2f}x")
        print(f"  fedattn (no local steps) / plain socket {f['round_s'] / plain:.2f}x")
        print(f"  CPU per round, server / edges          {f['server_cpu_s']:.2f} s / "
              f"{f['edges_cpu_s']:.2f} s (bare grpcio {bare_server_cpu:.2f} s / "
              f"{bare_clients_cpu:.2f} s; {os.cpu_count()} cores)")
        ours, bare_rss = f["peak_rss_growth_kib"] * 1024, bare_rss_kib * 1024
        print(f"  server peak RSS growth                 {ours / 1e6:.1f} MB = "
              f"{ours / model_bytes:.2f}x one model")
        glibc = many_arenas["peak_rss_growth_kib"] * 1024
        print(f"  ... with glibc's default malloc arenas {glibc / 1e6:.1f} MB = "
              f"{glibc / model_bytes:.2f}x one model (round {many_arenas['round_s']:.3f} s)")
        print(f"  bare grpcio server peak RSS growth     {bare_rss / 1e6:.1f} MB = "
              f"{bare_rss / model_bytes:.2f}x one model")
        print(f"  fedattn's own (beyond bare grpcio)     {(ours - bare_rss) / 1e6:.1f} MB = "
              f"{(ours - bare_rss) / model_bytes:.2f}x one model")
    return 0


if __name__ == "__main__":
    sys.exit(main())

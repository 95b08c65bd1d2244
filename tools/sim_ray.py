"""``fl-sim --ray ADDRESS``: the simulated edges as Ray actors across a Ray cluster.

Ray places the actors; fl-sim writes no scheduler. Each ``EdgeHost`` actor hosts
``--edges-per-actor`` full EdgeDaemons through ``fl_tools.sim.host_edges``, the code an
``fl-sim worker`` process runs, with the same worker options. Their state dirs are on the
actor's node (its temp dir, or ``--state-root``), their partitions are read from a path
every node sees (``--data-root``, checked on the node) or shipped through Ray's object
store and written to the node's disk (``--ship-data``). Ray is an optional extra
(``pip install 'fedattn[ray]'``, on every node): an edge device never needs it, and this
module imports it only when called.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from fedattn_shared.state import StateError

from .sim_worker import host_edges, worker_parser

#: name -> relative POSIX path -> bytes: edge folders as they travel in the object store.
Folders = dict[str, dict[str, bytes]]


def run_id(out: Path) -> str:
    """The run's folder name on every node: stable for one run folder on one machine, so an
    actor placed on the same node again finds its edges' state (identity, private model)."""
    return hashlib.sha256(f"{socket.gethostname()}:{out.resolve()}".encode()).hexdigest()[:12]


def read_folders(dirs: list[Path]) -> Folders:
    """Every regular file under each folder, by the folder's name (the edge's name)."""
    return {d.name: {p.relative_to(d).as_posix(): p.read_bytes()
                     for p in sorted(d.rglob("*")) if p.is_file()} for d in dirs}


def write_folders(folders: Folders, root: Path) -> None:
    """``read_folders``' output written under ``root``. The names come from fl-sim, but a
    path that would leave ``root`` is refused all the same (StateError names it)."""
    for name, files in folders.items():
        for rel, data in files.items():
            inside = PurePosixPath(name, rel)
            if (inside.is_absolute() or ".." in inside.parts or len(inside.parts) < 2
                    or len(PurePosixPath(name).parts) != 1):
                raise StateError(f"shipped file {name}/{rel}: not a path inside an edge folder")
            path = root.joinpath(*inside.parts)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".part")
            tmp.write_bytes(data)
            os.replace(tmp, path)


@dataclass
class ActorSpec:
    """What one actor hosts: its edges, where their data, state and certificates are on its
    node, and the worker options (``fl_tools.sim_worker.worker_parser``) every edge gets."""

    index: int
    names: list[str]
    worker_args: list[str]
    run_id: str
    data_root: str | None = None  # a path every node sees; None: the data is shipped
    state_root: str | None = None  # None: the node's temp dir


def node_root(spec: ActorSpec) -> Path:
    """This run's folder on the actor's node (shipped data, certificates, default state)."""
    return Path(tempfile.gettempdir()) / f"fl-sim-{spec.run_id}"


def worker_argv(spec: ActorSpec, shipped: dict[str, Folders]) -> list[str]:
    """The worker command line of an actor's edges on its node, the shipped folders written
    to its disk first. A ``--data-root`` is checked here, where the edges read it: a
    node that lacks an edge's folder is named (StateError)."""
    root = node_root(spec)
    if "data" in shipped:
        write_folders(shipped["data"], root / "data")
        data_root = root / "data"
    else:
        data_root = Path(spec.data_root or "")
        missing = [n for n in spec.names if not (data_root / n).is_dir()]
        if missing:
            raise StateError(f"--data-root {data_root}: node {socket.gethostname()} has no "
                             f"folder for {', '.join(missing)}: every node must see the "
                             "partitions at that path (a shared folder), or pass --ship-data")
    tls = []
    if "tls" in shipped:
        write_folders(shipped["tls"], root / "tls")
        tls = ["--tls-root", str(root / "tls")]
    state = spec.state_root or str(root / "state")
    return ["--state-root", state, *spec.worker_args, *tls,
            *[str(data_root / n) for n in spec.names]]


class EdgeHost:
    """A Ray actor: one process on a node hosting a group of simulated edges, as an
    ``fl-sim worker`` process does. ``run`` blocks while the edges run; ``end`` (fl-sim's
    server ended the run, a worker's SIGUSR1) comes in on the actor's second thread."""

    def __init__(self) -> None:
        self._over = threading.Event()

    def node(self) -> dict[str, str]:
        """Where Ray placed this actor, for fl-sim's report (RUN/ray.json)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "pid": str(os.getpid())}

    def run(self, spec: ActorSpec, shipped: dict[str, Folders]) -> dict:
        """Runs the edges to their end: their exit statuses and the flaky edges still away,
        or ``error`` when they could not start on this node."""
        try:
            argv = worker_argv(spec, shipped)
        except (StateError, OSError) as err:
            return {"error": str(err)}
        hosted = host_edges(worker_parser().parse_args(argv), self._over)
        return {"codes": hosted.codes, "away": hosted.away}

    def end(self) -> None:
        """fl-sim's own server has ended the run: stop waiting for flaky edges that are away."""
        self._over.set()


class RayError(Exception):
    """The cluster could not run the actors (fl-sim exits with status 1 and the message)."""


def connect(address: str) -> str:
    """Joins the Ray cluster at ``address`` as its driver; returns this machine's address
    as the cluster knows it, where the other nodes reach fl-sim's own server."""
    import ray

    host, colon, port = address.rpartition(":")
    if colon and port.isdigit() and "://" not in address:
        # ray.init retries an address where nothing listens for minutes; say so at once.
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as err:
            raise ConnectionError(f"nothing answers at {address} ({err})") from None
    ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
    return ray.util.get_node_ip_address()


def disconnect() -> None:
    """Leaves the cluster; Ray ends the actors this driver still owns."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def specs(args: argparse.Namespace, names: list[str], worker_args: list[str],
          out: Path) -> list[ActorSpec]:
    """The actors' groups of ``--edges-per-actor`` consecutive edges."""
    k = args.edges_per_actor
    state = str(args.state_root.resolve()) if args.state_root else None
    data = None if args.ship_data or args.data_root is None else str(args.data_root.resolve())
    return [ActorSpec(index=i // k, names=names[i : i + k], worker_args=worker_args,
                      run_id=run_id(out), data_root=data, state_root=state)
            for i in range(0, len(names), k)]


def check_resources(count: int, cpus: float, gpus: float) -> None:
    """Says so when the cluster, as it stands, cannot hold every actor at once (an
    autoscaling cluster may still grow: this is not refused)."""
    import ray

    have = ray.cluster_resources()
    for what, each in (("CPU", cpus), ("GPU", gpus)):
        if each and count * each > have.get(what, 0):
            print(f"fl-sim: {count} actors x --actor-{what.lower()}s {each:g} = "
                  f"{count * each:g} {what}s; the cluster has {have.get(what, 0):g}: "
                  "the rest wait for Ray to find room", file=sys.stderr)


def place(actors: list, groups: list[ActorSpec], out: Path) -> list[dict[str, str]]:
    """Waits for Ray to start every actor, then reports each one's node (and writes
    RUN/ray.json for a bench or a test to read)."""
    import ray

    refs = [actor.node.remote() for actor in actors]
    started = time.monotonic()
    while len(ray.wait(refs, num_returns=len(refs), timeout=30)[0]) < len(refs):
        print(f"fl-sim: waiting for Ray to place the actors ({time.monotonic() - started:.0f}s)",
              file=sys.stderr)
    try:
        nodes = ray.get(refs)
    except ray.exceptions.RayError as err:  # e.g. a node without fedattn installed
        raise RayError(f"an actor did not start: {err}") from None
    for spec, node in zip(groups, nodes, strict=True):
        print(f"fl-sim: actor {spec.index} ({len(spec.names)} edges) on node {node['ip']} "
              f"({node['host']}, {node['node_id'][:12]})")
    report = [{**asdict(spec), **node} for spec, node in zip(groups, nodes, strict=True)]
    for entry in report:
        entry.pop("worker_args")
    (out / "ray.json").write_text(json.dumps(report, indent=1) + "\n")
    return nodes


def _failed(ref) -> bool:
    """Whether a finished actor's edges failed (or the actor itself did)."""
    import ray

    try:
        result = ray.get(ref)
    except ray.exceptions.RayError:
        return True
    return "error" in result or any(result["codes"].values())


def wait_for_actors(actors: list, refs: list, server: subprocess.Popen | None) -> list[dict]:
    """The actors' results, as ``wait_for_workers`` waits for worker processes: once
    fl-sim's own server has exited, each actor still running is told (``end``). An actor
    that died (its node lost) is an ``error``. An actor whose edges failed while the run is
    on ends it, as a failed worker does: the server is stopped, the other actors killed."""
    import ray

    pending = list(refs)
    while pending and (server is None or server.poll() is None):
        pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)[1]
        if server is not None and any(_failed(ref) for ref in refs if ref not in pending):
            print("fl-sim: edges failed; stopping the run", file=sys.stderr)
            server.terminate()
            for actor, ref in zip(actors, refs, strict=True):
                if ref in pending:
                    ray.kill(actor)
            break
    for actor, ref in zip(actors, refs, strict=True):
        if ref in pending:
            actor.end.remote()
    results = []
    for ref in refs:
        try:
            results.append(ray.get(ref))
        except ray.exceptions.RayError as err:
            results.append({"error": f"the actor died: {err}"})
    return results


def run_actors(args: argparse.Namespace, data_dirs: list[Path], worker_args: list[str],
               tls_root: Path | None, out: Path, server: subprocess.Popen | None) -> list[int]:
    """Hosts the edges as Ray actors until the run ends; one status per actor (0: all its
    edges ended with the run). RayError when an actor could not start its edges."""
    import ray

    groups = specs(args, [d.name for d in data_dirs], worker_args, out)
    check_resources(len(groups), args.actor_cpus, args.actor_gpus)
    remote = ray.remote(EdgeHost).options(num_cpus=args.actor_cpus, num_gpus=args.actor_gpus,
                                          max_concurrency=2, scheduling_strategy="SPREAD")
    actors = [remote.remote() for _ in groups]
    by_name = {d.name: d for d in data_dirs}
    try:
        nodes = place(actors, groups, out)
        refs = []
        for actor, spec in zip(actors, groups, strict=True):
            shipped: dict[str, Folders] = {}
            if spec.data_root is None:
                shipped["data"] = read_folders([by_name[n] for n in spec.names])
            if tls_root is not None:
                shipped["tls"] = read_folders([tls_root / n for n in spec.names])
            refs.append(actor.run.remote(spec, ray.put(shipped)))
        results = wait_for_actors(actors, refs, server)
    finally:
        for actor in actors:
            ray.kill(actor)  # an actor whose flaky edges are away still runs their threads
    return statuses(results, nodes)


def statuses(results: list[dict], nodes: list[dict[str, str]]) -> list[int]:
    """Prints what went wrong on which node; RayError when an actor could not start."""
    errors = [f"actor {i} on node {node['ip']}: {result['error']}"
              for i, (result, node) in enumerate(zip(results, nodes, strict=True))
              if "error" in result]
    if errors:
        raise RayError("\n".join(errors))
    codes = []
    for i, result in enumerate(results):
        failed = {name: code for name, code in result["codes"].items() if code}
        if result["away"]:
            print(f"fl-sim: actor {i}: the run ended with flaky edges away: "
                  f"{', '.join(result['away'])}", file=sys.stderr)
        if failed:
            print(f"fl-sim: actor {i}: edges failed: {failed}", file=sys.stderr)
        codes.append(1 if failed else 0)
    return codes

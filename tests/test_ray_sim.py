"""``fl-sim --ray``: a federation through a real two-node Ray cluster on loopback (``ray start
--head`` and a second ``ray start --address`` node, each its own raylet), and the checks an
actor makes on its node before its edges start.

The cluster tests need Ray (the ``ray`` extra, which ``make test`` installs) and skip,
saying so, without it. Each node gets its own TMPDIR, standing for its own disk: an
actor's shipped partitions and its edges' state dirs must land on the node Ray placed it
on. Ray's processes are stopped by their process group (never ``ray stop``, which ends
every Ray on the machine).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO, free_port, write_edge_dirs

from fedattn_shared.state import StateError
from fl_tools.sim_ray import ActorSpec, read_folders, worker_argv, write_folders

HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="Ray is not installed (the `ray` extra: "
                               "pip install -c constraints.txt -e '.[test,ray]')")
RAY = Path(sys.executable).parent / "ray"


def env(**extra: str) -> dict[str, str]:
    """The code under test (PYTHONPATH naming a checkout), one torch thread, no telemetry."""
    return {"OMP_NUM_THREADS": "1", "PATH": f"{RAY.parent}:/usr/bin:/bin",
            "RAY_USAGE_STATS_ENABLED": "0", "HOME": os.environ.get("HOME", "/tmp"),
            **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}, **extra}


def stop(nodes: list[subprocess.Popen]) -> None:
    """Each ``ray start --block`` and what it started: a process group of its own. SIGTERM
    first; what still runs after a moment (``ray start`` drains a node for up to 30 s) is
    killed: the cluster and its data are thrown away."""
    for node in reversed(nodes):  # the worker node first, while its head still answers
        try:
            os.killpg(node.pid, signal.SIGTERM)
            node.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            continue
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.wait()


def wait_for_nodes(address: str, count: int, timeout: float = 90) -> None:
    """Until ``count`` nodes are alive in the cluster (a driver of its own, then gone)."""
    code = ("import ray, sys, time\n"
            f"ray.init(address={address!r}, logging_level=30, configure_logging=False)\n"
            f"deadline = time.monotonic() + {timeout}\n"
            f"while sum(n['Alive'] for n in ray.nodes()) < {count}:\n"
            "    if time.monotonic() > deadline: sys.exit('nodes missing')\n"
            "    time.sleep(0.2)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=env(), timeout=timeout + 30,
                   capture_output=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head and a second node on loopback, one CPU each: (address, {node: its TMPDIR})."""
    root = tmp_path_factory.mktemp("cluster")
    # Ray's sockets live under its temp dir: a short path (AF_UNIX paths are <= 107 bytes).
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes: list[subprocess.Popen] = []
    disks = {name: root / name for name in ("head", "node")}
    try:
        for name, extra in (("head", ["--head", f"--port={port}", "--include-dashboard=false"]),
                            ("node", [f"--address={address}"])):
            disks[name].mkdir()
            with open(root / f"{name}.log", "wb") as log:
                nodes.append(subprocess.Popen(
                    [str(RAY), "start", "--block", "--num-cpus=1", "--node-ip-address=127.0.0.1",
                     f"--temp-dir={ray_tmp}", "--disable-usage-stats", *extra],
                    env=env(TMPDIR=str(disks[name])), stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, cwd=REPO))
            if name == "head":
                deadline = time.monotonic() + 60
                while True:
                    try:
                        socket.create_connection(("127.0.0.1", port), timeout=1).close()
                        break
                    except OSError:
                        assert nodes[0].poll() is None, (root / "head.log").read_text()[-3000:]
                        assert time.monotonic() < deadline, "the Ray head did not start"
                        time.sleep(0.2)
        wait_for_nodes(address, 2)
        yield address, disks
    finally:
        stop(nodes)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def sim(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fl_tools.sim", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env())


@pytest.mark.ray
@pytest.mark.slow
@needs_ray
def test_a_federation_runs_over_a_two_node_ray_cluster(cluster, tmp_path):
    """4 edges, 2 per actor, one CPU per node: an actor on each node, every edge training in
    both rounds, the partitions shipped to and the state kept on the actor's own node."""
    address, disks = cluster
    names = [d.name for d in write_edge_dirs(tmp_path / "data", 4, per_edge=60)]
    out = tmp_path / "run"
    result = sim("--ray", address, "--edges", "4", "--edges-per-actor", "2", "--fraction", "1",
                 "--rounds", "2", "--data-root", str(tmp_path / "data"), "--ship-data",
                 "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    history = json.loads((out / "server" / "history.json").read_text())
    assert [r["round"] for r in history["rounds"]] == [1, 2]
    for record in history["rounds"]:
        assert sorted(record["train"]["received"]) == names
    actors = json.loads((out / "ray.json").read_text())
    assert sorted(n for a in actors for n in a["names"]) == names
    assert len({a["node_id"] for a in actors}) == 2, actors  # one actor on each node
    assert result.stdout.count(" on node ") == 2
    hosted = {}  # TMPDIR (a node's disk) -> the edges whose state and data it holds
    for name, disk in disks.items():
        state = {p.parent.name for p in disk.glob("fl-sim-*/state/*/identity.json")}
        data = {p.parent.name for p in disk.glob("fl-sim-*/data/*/data.npz")}
        assert state == data, (name, state, data)
        hosted[name] = sorted(state)
    assert sorted(hosted.values()) == sorted(a["names"] for a in actors)
    identities = {json.loads(p.read_text())["edge_id"]
                  for disk in disks.values() for p in disk.glob("fl-sim-*/state/*/identity.json")}
    assert len(identities) == 4


@pytest.mark.ray
@needs_ray
def test_an_address_without_a_cluster_is_refused_by_name(tmp_path):
    write_edge_dirs(tmp_path / "data", 2, per_edge=10)
    result = sim("--ray", f"127.0.0.1:{free_port()}", "--edges", "2", "--data-root",
                 str(tmp_path / "data"), "--out", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--ray 127.0.0.1:" in result.stderr and "nothing answers" in result.stderr


def test_a_missing_data_root_is_named_by_the_node(tmp_path):
    """Without --ship-data, every node must see --data-root: the actor checks it where the
    edges would read it and names the flag, the node and the edges it lacks."""
    (tmp_path / "data" / "edge_00").mkdir(parents=True)
    spec = ActorSpec(index=0, names=["edge_00", "edge_01"], worker_args=["--server", "h:1"],
                     run_id="t", data_root=str(tmp_path / "data"))
    with pytest.raises(StateError, match=r"--data-root .*has no folder for edge_01:"):
        worker_argv(spec, {})
    spec.names = ["edge_00"]
    argv = worker_argv(spec, {})
    assert argv[-1] == str(tmp_path / "data" / "edge_00") and argv[0] == "--state-root"


def test_shipped_folders_land_inside_the_run_folder(tmp_path):
    """The shipped partitions and certificates are written back file for file; a path
    that would leave the folder is refused, naming it."""
    src = write_edge_dirs(tmp_path / "src", 2, per_edge=10)
    (src[0] / "sub").mkdir()
    (src[0] / "sub" / "x.txt").write_text("x")
    folders = read_folders(src)
    write_folders(folders, tmp_path / "dst")
    for d in src:
        for p in d.rglob("*"):
            if p.is_file():
                assert (tmp_path / "dst" / d.name / p.relative_to(d)).read_bytes() == p.read_bytes()
    for bad in ({"e": {"../../escape": b""}}, {"..": {"x": b""}}, {"e": {"/abs": b""}},
                {"/abs": {"x": b""}}, {"a/b": {"x": b""}}):
        with pytest.raises(StateError, match="not a path inside an edge folder"):
            write_folders(bad, tmp_path / "dst")
    assert not (tmp_path / "escape").exists()

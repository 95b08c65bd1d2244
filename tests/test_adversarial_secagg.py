"""Secure aggregation under attack, with real processes: a real ``fl-server --secagg`` and
three honest real ``fl-edge`` daemons, plus one attacker -- the real edge daemon speaking
the real protocol over real gRPC, its SecAgg client altered in its own process
(``tests/secagg_attacker.py``):

round 1  adds 2^31 to its masked weight      -> the round aborts by name, global untouched
round 2  behaves                             -> the round completes with all four

Throughout, the server process stays up and finishes the run. Every wait is on a file or a
process exit, with generous timeouts; nothing depends on timing.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO, Proc, read_history, write_edge_dirs

from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.state import load_tensors

HONEST = ["h0", "h1", "h2"]
ATTACKER = "attacker"
EVERYONE = sorted([*HONEST, ATTACKER])


def attacker(cluster, data_dir, plan: str) -> Proc:
    proc = Proc([sys.executable, str(REPO / "tests" / "secagg_attacker.py"), "--plan", plan,
                 "--", "--insecure", "--server", f"127.0.0.1:{cluster.port}",
                 "--data-dir", str(data_dir), "--state-dir", str(cluster.tmp / f"state-{ATTACKER}"),
                 "--name", ATTACKER, "--retry-for", "60", "--device", "cpu"],
                cluster.tmp / f"{ATTACKER}.log")
    cluster.procs.append(proc)
    return proc


def initial_global(manifest: dict) -> dict[str, torch.Tensor]:
    """The server's state before any round, rebuilt from the run's recorded config."""
    train = TrainConfig(**manifest["train"])
    cls = load_method(manifest["method"])
    method = cls(MethodContext(train, cls.Params()))
    return method.server(method.build_models()).state_tensors()


@pytest.mark.slow
def test_one_attacking_edge_never_stops_the_server_nor_spoils_the_global(cluster, tmp_path):
    dirs = write_edge_dirs(tmp_path, 4, per_edge=[60, 80, 100, 70])
    server = cluster.server("--method", "fedavg", "--secagg", "--secagg-graph", "full",
                            "--rounds", "2", "--min-edges", "4", "--eval-every", "0",
                            "--round-timeout", "120", "--set", "server.secagg_timeout=120",
                            "--set", "server.keep_checkpoints=10")
    honest = [cluster.edge(d, name, "--device", "cpu") for d, name in zip(dirs, HONEST, strict=False)]
    bad = attacker(cluster, dirs[3], "1:weight")

    # the server finishes the run (it would exit 2 on the crash this guards against)
    assert server.wait(timeout=240) == 0, server.log()[-3000:]
    assert [e.wait(timeout=60) for e in honest] == [0, 0, 0]
    assert bad.wait(timeout=60) == 0
    assert bad.log().count("ATTACK round") == 1  # the attack really ran

    checkpoint = tmp_path / "server-state"
    history = read_history(checkpoint)
    rounds = {r["round"]: r for r in history["rounds"]}
    assert sorted(rounds) == [1, 2]

    # round 1: the unmasked weight is negative -> aborted by name, nothing aggregated
    first = rounds[1]["aggregate"]
    assert "total weight" in first["secagg-aborted"] and "outside" in first["secagg-aborted"]
    assert first["aggregated"] == 0
    assert "secure aggregation aborted: the unmasked total weight" in server.log()
    saved, _ = load_tensors(checkpoint / "rounds" / "000001" / "state.safetensors")
    start = initial_global(history["manifest"])
    assert saved.keys() == start.keys()
    assert all(torch.equal(saved[k], start[k]) for k in start)  # the global is untouched

    # round 2: everyone behaves
    second = rounds[2]
    assert second["aggregate"]["secagg-unmask"]["unmasked"] == 4
    assert second["aggregate"]["aggregated"] == 4
    assert second["secagg-unmask:train"]["received"] == EVERYONE

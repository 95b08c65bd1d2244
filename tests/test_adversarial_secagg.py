"""Secure aggregation under attack, with real processes: a real ``fl-server --secagg`` and
three honest real ``fl-edge`` daemons, plus one attacker -- the real edge daemon speaking
the real protocol over real gRPC, its SecAgg client altered in its own process
(``tests/secagg_attacker.py``) to attack one round each:

round 1  adds 2^31 to its masked weight      -> the round aborts by name (not the weights the
                                                edges stated), global untouched
round 2  sends garbage encrypted shares      -> reported, dropped before masking; the round
                                                completes with the three honest edges
round 3  tampers with every share it reveals -> its shares are set aside, named; the round
                                                completes (its masked input was honest)
round 4  behaves                             -> the round completes with all four

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
                            "--rounds", "4", "--min-edges", "4", "--eval-every", "0",
                            "--round-timeout", "120", "--set", "server.secagg_timeout=120",
                            "--set", "server.keep_checkpoints=10")
    honest = [cluster.edge(d, name, "--device", "cpu") for d, name in zip(dirs, HONEST, strict=False)]
    bad = attacker(cluster, dirs[3], "1:weight,2:garbage,3:tamper")

    # the server finishes the run (it would exit 2 on the crash this guards against)
    assert server.wait(timeout=240) == 0, server.log()[-3000:]
    assert [e.wait(timeout=60) for e in honest] == [0, 0, 0]
    assert bad.wait(timeout=60) == 0
    assert bad.log().count("ATTACK round") == 3  # the three attacks really ran

    checkpoint = tmp_path / "server-state"
    history = read_history(checkpoint)
    rounds = {r["round"]: r for r in history["rounds"]}
    assert sorted(rounds) == [1, 2, 3, 4]

    # round 1: the unmasked weight is not the stated one -> aborted by name, nothing aggregated
    first = rounds[1]["aggregate"]
    assert "total weight" in first["secagg-aborted"] and "stated" in first["secagg-aborted"]
    assert first["aggregated"] == 0
    assert "secure aggregation aborted: the unmasked total weight" in server.log()
    saved, _ = load_tensors(checkpoint / "rounds" / "000001" / "state.safetensors")
    start = initial_global(history["manifest"])
    assert saved.keys() == start.keys()
    assert all(torch.equal(saved[k], start[k]) for k in start)  # the global is untouched

    # round 2: its garbage shares are reported by every honest holder; it is dropped before
    # masking and the honest three are summed
    second = rounds[2]
    assert second["aggregate"]["secagg-receive"]["reported"] == {ATTACKER: HONEST}
    assert "not among the round's survivors" in second["train"]["dropped"][ATTACKER]
    assert second["train"]["received"] == HONEST
    assert second["aggregate"]["secagg-unmask"]["unmasked"] == 3
    assert second["aggregate"]["aggregated"] == 3
    after_two, _ = load_tensors(checkpoint / "rounds" / "000002" / "state.safetensors")
    assert any(not torch.equal(after_two[k], saved[k]) for k in saved)  # it did aggregate

    # round 3: its tampered reveals are set aside and named; the sum of all four is unmasked
    third = rounds[3]["aggregate"]
    assert third["secagg-unmask"]["inconsistent_reveals"] == [ATTACKER]
    assert third["secagg-unmask"]["unmasked"] == 4 and third["aggregated"] == 4
    assert "secagg-aborted" not in third

    # round 4: everyone behaves
    fourth = rounds[4]
    assert fourth["aggregate"]["secagg-unmask"]["unmasked"] == 4
    assert "inconsistent_reveals" not in fourth["aggregate"]["secagg-unmask"]
    assert fourth["secagg-unmask:train"]["received"] == EVERYONE

"""What one cheating edge can still do under SecAgg+, with real processes: a real
``fl-server --secagg`` and two honest real ``fl-edge`` daemons, plus one attacker -- the
real edge daemon speaking the real protocol over real gRPC, its SecAgg client altered in
its own process (``tests/secagg_attacker.py``) to add to its masked words:

- ``takeover`` (32 bits): the unmasked mean ~12 in every coordinate, under the clip 16.
  Before the bound the global became ~12 everywhere, the honest edges' next models
  exceeded the clip, they sat out and every later round aborted: the run was dead.
- ``claim`` (int8): a masked weight of 65,536 whatever the edge stated, and levels beyond
  the per-edge L: aggregated before the weight was public.
- ``grow`` (int8, rounds in a row): the global added to the mean change, so that the
  next public scales (margin x that mean) let it double again: it grew without bound.

Now the weight is stated in the clear (capped at what the edge declared at join) and must
match the masked one, the public scales have a ceiling and a bounded growth, and one
round may move the global by at most ``server.secagg_max_update`` (L2): the rounds stay
within that bound, or abort by name with the global kept, and the honest edges go on.
Every wait is on a process exit; nothing depends on timing.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import REPO, Proc, read_history, write_edge_dirs

from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.state import load_tensors

HONEST = ["h0", "h1"]
ATTACKER = "attacker"
EVERYONE = sorted([*HONEST, ATTACKER])
CLIP = 16.0                 # server.secagg_clip's default
MAX_UPDATE = CLIP           # server.secagg_max_update's default (0: secagg_clip)
SLACK = 1.05                # the bound's fixed-point rounding allowance, generously
MARGIN = 2.0                # server.secagg_margin: the scale ceiling is MARGIN x MAX_UPDATE


def start(cluster, tmp_path, rounds: int, plan: str, *server_args: str):
    dirs = write_edge_dirs(tmp_path, 3, per_edge=[80, 80, 80])
    server = cluster.server("--method", "fedavg", "--secagg", "--secagg-graph", "full",
                            "--rounds", str(rounds), "--min-edges", "3", "--eval-every", "0",
                            "--round-timeout", "120", "--set", "server.secagg_timeout=120",
                            "--set", f"server.keep_checkpoints={rounds + 1}", *server_args)
    honest = [cluster.edge(d, name, "--device", "cpu") for d, name in zip(dirs, HONEST)]
    bad = Proc([sys.executable, str(REPO / "tests" / "secagg_attacker.py"), "--plan", plan,
                "--", "--insecure", "--server", f"127.0.0.1:{cluster.port}",
                "--data-dir", str(dirs[2]), "--state-dir", str(cluster.tmp / f"state-{ATTACKER}"),
                "--name", ATTACKER, "--retry-for", "60", "--device", "cpu"],
               cluster.tmp / f"{ATTACKER}.log")
    cluster.procs.append(bad)
    assert server.wait(timeout=600) == 0, server.log()[-3000:]
    assert [e.wait(timeout=60) for e in honest] == [0, 0]
    assert bad.wait(timeout=60) == 0
    return server, bad


def globals_by_round(checkpoint, rounds: int) -> list[dict[str, torch.Tensor]]:
    """The global before round 1 (rebuilt from the recorded config) and after each round:
    its floating tensors (the model the masked sum moves)."""
    history = read_history(checkpoint)
    train = TrainConfig(**history["manifest"]["train"])
    cls = load_method(history["manifest"]["method"])
    method = cls(MethodContext(train, cls.Params()))
    out = [method.server(method.build_models()).state_tensors()]
    for r in range(1, rounds + 1):
        out.append(load_tensors(checkpoint / "rounds" / f"{r:06d}" / "state.safetensors")[0])
    return [{k: v.double() for k, v in g.items() if v.is_floating_point()} for g in out]


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[k] - b[k]).pow(2).sum()) for k in a))


def peak(g: dict[str, torch.Tensor]) -> float:
    return max(float(t.abs().max()) for t in g.values())


@pytest.mark.slow
def test_a_takeover_of_the_32_bit_mean_is_refused_and_the_honest_edges_go_on(cluster, tmp_path):
    rounds = 4
    server, bad = start(cluster, tmp_path, rounds, "2:takeover")
    assert bad.log().count("ATTACK round") == 1
    checkpoint = tmp_path / "server-state"
    history = read_history(checkpoint)
    records = {r["round"]: r for r in history["rounds"]}
    assert sorted(records) == list(range(1, rounds + 1))
    g = globals_by_round(checkpoint, rounds)
    for r in range(1, rounds + 1):  # no round moves the global beyond the bound
        assert distance(g[r], g[r - 1]) <= MAX_UPDATE * SLACK, (r, distance(g[r], g[r - 1]))
    # round 2: the takeover's change of the global is beyond the bound: aborted by name
    aborted = records[2]["aggregate"]["secagg-aborted"]
    assert "server.secagg_max_update" in aborted, aborted
    assert distance(g[2], g[1]) == 0.0  # the global was kept
    assert peak(g[rounds]) < 4.0        # never near the ~12 the attacker asked for
    # the honest edges were never locked out: every later round sums all three
    for r in (3, 4):
        unmask = records[r]["aggregate"]["secagg-unmask"]
        assert unmask["unmasked"] == 3 and records[r]["aggregate"]["aggregated"] == 3, records[r]
        assert records[r]["secagg-unmask:train"]["received"] == EVERYONE


@pytest.mark.slow
def test_int8_a_claimed_weight_is_refused_and_growth_is_held_to_the_bound(cluster, tmp_path):
    rounds = 5
    server, bad = start(cluster, tmp_path, rounds, "1:grow,2:grow,3:claim,4:grow,5:grow",
                        "--compress", "up=int8")
    assert bad.log().count("ATTACK round") == 5
    checkpoint = tmp_path / "server-state"
    history = read_history(checkpoint)
    records = {r["round"]: r for r in history["rounds"]}
    assert sorted(records) == list(range(1, rounds + 1))
    g = globals_by_round(checkpoint, rounds)
    moves = [distance(g[r], g[r - 1]) for r in range(1, rounds + 1)]
    # every round stays within the documented bound on one round's change (aborted ones
    # keep the global), so the whole run within rounds x the bound
    assert all(m <= MAX_UPDATE * SLACK for m in moves), moves
    assert distance(g[rounds], g[0]) <= rounds * MAX_UPDATE * SLACK
    # round 3: the masked weight differs from the stated one: aborted by name, global kept
    aborted = records[3]["aggregate"]["secagg-aborted"]
    assert "stated" in aborted and "weight" in aborted, aborted
    assert moves[2] == 0.0
    # the public scales never passed their ceiling nor grew more than the allowed factor
    scales = [records[r]["aggregate"]["secagg-unmask"].get("scale_max")
              for r in range(2, rounds + 1) if "secagg-unmask" in records[r]["aggregate"]]
    scales = [s for s in scales if s is not None]
    assert scales and all(s <= MARGIN * MAX_UPDATE * 1.0001 for s in scales), scales
    # the honest edges took part in every round
    for r in range(1, rounds + 1):
        assert records[r]["secagg-advertise:train"]["received"] == EVERYONE

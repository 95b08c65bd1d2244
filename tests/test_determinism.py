"""A fixed seed gives bit-identical runs on CPU.

A real federation (fl-server and three fl-edge processes over loopback gRPC) runs twice
with the same seed: the final global checkpoint and every edge's private state must match
bit for bit, whatever order the uploads reached the server in; a third run with another
seed must differ (else the comparison could not fail). Three edges, because a float sum
of two terms is commutative and would hide an order-dependent server sum.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, Cluster, write_edge_dirs

from fedattn_shared.methods.aggregators import StreamingMean
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.state import load_tensors

EDGES = 3


def _final_global(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    manifest = json.loads((checkpoint_dir / "manifest.json").read_text())
    tensors, _ = load_tensors(checkpoint_dir / manifest["dir"] / "state.safetensors")
    return tensors


def _run(root: Path, data_dirs: list[Path], seed: int) -> tuple[dict, list[dict]]:
    """One federation; the final global tensors and each edge's private tensors."""
    cluster = Cluster(root)
    root.mkdir(parents=True, exist_ok=True)
    try:
        server = cluster.server("--method", "fedbn", "--rounds", "2", "--min-edges", str(EDGES),
                                "--local-epochs", "1", "--lr", "0.05", "--seed", str(seed))
        edges = [cluster.edge(d, f"e{i}") for i, d in enumerate(data_dirs)]
        assert [e.wait() for e in edges] == [0] * EDGES
        assert server.wait() == 0
    finally:
        cluster.close()
    private = [load_tensors(root / f"state-e{i}" / "private.safetensors")[0] for i in range(EDGES)]
    return _final_global(root / "server-state"), private


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (or exist on one side only)."""
    differ = sorted(set(a) ^ set(b))
    for name in set(a) & set(b):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            differ.append(name)
    return differ


def test_same_seed_bit_identical_federation(tmp_path):
    dirs = write_edge_dirs(tmp_path, EDGES, per_edge=[150, 170, 190])
    global_a, private_a = _run(tmp_path / "a", dirs, seed=3)
    global_b, private_b = _run(tmp_path / "b", dirs, seed=3)
    assert global_a and all(private_a)
    assert _identical(global_a, global_b) == []
    for i in range(EDGES):
        assert _identical(private_a[i], private_b[i]) == [], f"edge e{i}"

    global_c, private_c = _run(tmp_path / "c", dirs, seed=4)
    assert _identical(global_a, global_c) != []
    assert _identical(private_a[0], private_c[0]) != []



def _sim(root: Path, data_root: Path, seed: int, method: str,
         *sets: str) -> tuple[dict, list[dict]]:
    """fl-sim: the three edges as threads of one worker process, so their model builds
    and rounds share torch's global RNG."""
    out = root / "sim"
    subprocess.run([sys.executable, "-m", "fl_tools.sim", "--method", method, "--edges", str(EDGES),
                    "--procs", "1", "--fraction", "1", "--rounds", "2", "--data-root",
                    str(data_root), "--out", str(out), "--seed", str(seed),
                    *(arg for value in sets for arg in ("--set", value))],
                   check=True, capture_output=True, timeout=300, cwd=REPO,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    private = [load_tensors(out / "state" / f"data-{i}" / "private.safetensors")[0]
               for i in range(EDGES)]
    return _final_global(out / "server"), private


def test_edges_sharing_a_process_bit_identical(tmp_path):
    """fl-sim hosts edges as threads: before their rounds took turns on the global RNG,
    dropout masks went to whichever thread drew first and every tensor differed; before
    their model builds did, private layers random at build (Fed-SAP's SE layers, FedPer's
    head) differed. One run covers both: FedPer keeps its head private, and
    mobilenet-v3-compact has dropout before it."""
    write_edge_dirs(tmp_path / "data", EDGES, per_edge=[150, 170, 190])
    sets = ('train.model="mobilenet-v3-compact"',)
    global_a, private_a = _sim(tmp_path / "a", tmp_path / "data", 5, "fedper", *sets)
    global_b, private_b = _sim(tmp_path / "b", tmp_path / "data", 5, "fedper", *sets)
    assert global_a and all(private_a)
    assert _identical(global_a, global_b) == []
    for i in range(EDGES):
        assert _identical(private_a[i], private_b[i]) == [], f"edge data-{i}"


def _sum_in_order(uploads: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    from fedattn_shared.methods.registry import load_method

    method_cls = load_method("fedavg")
    from fedattn_shared.config import TrainConfig
    from fedattn_shared.methods.base import MethodContext

    method = method_cls(MethodContext(TrainConfig(), method_cls.Params()))
    agg = StreamingMean(method, method.build_models())
    agg.begin_round(1, [], 0)
    for i, (values, weight) in enumerate(uploads):
        agg.accept(f"e{i}", Payload([Section(Kind.SHARED_TENSORS, "x", {"w": values})]), weight)
    return agg.means()[(Kind.SHARED_TENSORS, "x")]["w"]


def test_server_sum_independent_of_upload_order():
    """Float32 uploads whose values span 1e-8..1e3, integer weights up to a million, the
    last upload nearly cancelling the others (as edges' values straddling zero do): every
    permutation of the arrival order gives the same bits. A plain float64 running sum
    does not (checked too, so the data really exercises rounding)."""
    g = torch.Generator().manual_seed(0)
    n = 30_000
    weights = (1.0, 37.0, 999_983.0, 4096.0, 12.0)
    uploads = []
    for weight in weights[:-1]:
        scale = torch.pow(10.0, torch.empty(n).uniform_(-8, 3, generator=g))
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        uploads.append(((sign * scale).float(), weight))
    partial = sum(v.double() * w for v, w in uploads)
    last = (-partial / weights[-1]).float() * (1 + 1e-6 * torch.randn(n, generator=g))
    uploads.append((last.float(), weights[-1]))
    orders = list(itertools.permutations(range(len(uploads))))
    results = [_sum_in_order([uploads[i] for i in order]).view(torch.int32) for order in orders]
    assert all(torch.equal(results[0], r) for r in results[1:])

    naive = []
    for order in orders[:24]:
        total = torch.zeros(n, dtype=torch.float64)
        for i in order:
            total.add_(uploads[i][0], alpha=uploads[i][1])
        naive.append((total / sum(weights)).float().view(torch.int32))
    assert any(not torch.equal(naive[0], r) for r in naive[1:])


def _dp_trained(seeded: bool, phase_seed: int) -> dict[str, torch.Tensor]:
    """One DP-SGD round of a fresh FedAvg edge: data order and init fixed, only the
    noise's source varies."""
    from test_dp import dp_config, make_method, split

    from fedattn_shared.privacy.dp import PrivacyPolicy, PrivateTraining
    from fedattn_shared.schema import TRAIN
    from fl_edge.trainer import train_local

    data = split(64)
    method = make_method("fedavg", dp=dp_config(seeded_noise=seeded), batch_size=16)
    algo = method.edge(method.build_models(), torch.device("cpu"))
    state = method.initial_state(algo.models)
    algo.receive(TRAIN, Payload([Section(k, n, t) for (k, n), t in state.items()]), Payload())
    privacy = PrivateTraining(algo, method.dp, len(data), 16,
                              policy=PrivacyPolicy(allow_seeded_noise=True))
    privacy.begin_phase(phase_seed, "train")
    train_local(algo, data, 1, 16, 7, torch.device("cpu"), progress=False, privacy=privacy)
    return {k: v.clone() for k, v in algo.models["model"].state_dict().items()}


def test_dp_noise_unpredictable_unless_seeded_noise_asked():
    """By default the noise comes from an OS-seeded generator: two rounds with the same
    seed, data and init differ (before, Opacus drew it from the global RNG, which the run
    seed sets). With dp.seeded_noise the same phase seed gives the same bits, another
    seed other bits."""
    assert _identical(_dp_trained(False, 1), _dp_trained(False, 1)) != []
    seeded = _dp_trained(True, 1)
    assert _identical(seeded, _dp_trained(True, 1)) == []
    assert _identical(seeded, _dp_trained(True, 2)) != []


def test_edge_refuses_seeded_dp_noise_unless_allowed():
    from fedattn_shared.config import DPConfig
    from fedattn_shared.privacy.dp import PolicyRefusal, PrivacyPolicy

    dp = DPConfig(enabled=True, noise_multiplier=1.0, seeded_noise=True)
    with pytest.raises(PolicyRefusal, match="seeded_noise"):
        PrivacyPolicy().check(dp, None)
    PrivacyPolicy(allow_seeded_noise=True).check(dp, None)


def test_secagg_sum_does_not_depend_on_the_secret_masks():
    """Two SecAgg+ rounds over the same uploads with fresh keys, self-mask seeds and
    pairwise masks (all from ``secrets``, never the run seed) unmask the same bits: the
    masks cancel exactly in the modular sum, so a seeded run needs no seeded mask."""
    import numpy as np
    from test_secagg import protocol

    first, second = protocol(n=5, length=300), protocol(n=5, length=300)
    assert np.array_equal(first[0], second[0]) and first[1] == second[1]
    assert first[0].tobytes() == second[0].tobytes()

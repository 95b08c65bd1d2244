"""SecAgg+ end to end: a real ServerApp and real EdgeDaemons over gRPC on loopback.

Spies on both sides record what each edge would have uploaded in the clear (its weight
and values, before masking) and what the server received, so the tests check that the
aggregate equals the weighted mean over the surviving edges within the fixed-point
bound, and that no model value reached the server unmasked."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from conftest import write_edge_dirs

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.privacy.secagg_layout import flatten_upload, masked_phases
from fedattn_shared.schema import Kind
from fl_edge import secagg as edge_secagg
from fl_edge.daemon import EdgeDaemon, EdgeOptions
from fl_server.app import ServerApp


class Dropout(Exception):
    pass


class DroppingEdge(EdgeDaemon):
    """Leaves the federation (a real Leave over gRPC) when a task of ``phase`` arrives."""

    drop_phase = ""

    def _handle(self, received):
        if received.header.phase == self.drop_phase:
            self.session.leave("simulated dropout")
            raise Dropout(self.identity.edge_id)
        return super()._handle(received)


def run_secure(tmp_path, method_name="fedavg", edges=3, rounds=1, drops=None,
               model="lenet-bn", params=None, **server_options):
    """drops: {edge index: phase name at which it leaves}."""
    drops = drops or {}
    train = TrainConfig(lr=0.05, model=model, local_epochs=1)
    cls = load_method(method_name)
    method = cls(MethodContext(train, cls.Params(**(params or {}))))
    cfg = ServerConfig(method=method_name, rounds=rounds, min_edges=edges, host="127.0.0.1",
                       port=0, checkpoint_dir=str(tmp_path / "server"), insecure=True,
                       poll_timeout=2.0, round_timeout=60, eval_every=0, secagg=True,
                       **server_options)
    app = ServerApp(cfg, train, method)
    engine = app.engine
    seen: list[tuple[str, str, set]] = []   # (phase, edge, section kinds) the server accepted
    plain: dict[tuple[int, str], dict[str, tuple[float, np.ndarray]]] = {}

    accept = engine.secagg.accept

    def server_spy(name, edge, payload):
        seen.append((name, edge, {s.kind for s in payload.sections}))
        return accept(name, edge, payload)

    engine.secagg.accept = server_spy
    engine.aggregator.accept = lambda *a: pytest.fail("an individual upload reached the aggregator")
    sums = []
    accept_sum = engine.aggregator.accept_sum

    def sum_spy(phase, payload, weight, count):
        sums.append((phase, weight, count))
        return accept_sum(phase, payload, weight, count)

    engine.aggregator.accept_sum = sum_spy
    mask = edge_secagg.EdgeSecAgg.mask

    def mask_spy(self, round_number, phase, personal, upload, weight, method, models, **kwargs):
        specs = masked_phases(method, models)[phase]
        plain.setdefault((round_number, phase), {})[self.edge_id] = (
            weight, flatten_upload(specs, upload))
        return mask(self, round_number, phase, personal, upload, weight, method, models,
                    **kwargs)

    loop = asyncio.new_event_loop()
    port = loop.run_until_complete(app.start())
    server = threading.Thread(target=loop.run_until_complete, args=(app.run(),))
    server.start()
    outcome: dict[str, object] = {}

    def edge(i, data_dir):
        options = EdgeOptions(server=f"127.0.0.1:{port}", data_dir=data_dir,
                              state_dir=tmp_path / f"state-{i}", name=f"e{i}", device="cpu",
                              retry_for=30, progress=False)
        daemon = DroppingEdge(options)
        daemon.drop_phase = drops.get(i, "")
        try:
            outcome[f"e{i}"] = daemon.run()
        except Dropout:
            outcome[f"e{i}"] = "dropped"

    dirs = write_edge_dirs(tmp_path, edges, [60 + 30 * i for i in range(edges)])
    edge_secagg.EdgeSecAgg.mask = mask_spy
    try:
        threads = [threading.Thread(target=edge, args=(i, d)) for i, d in enumerate(dirs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        server.join(timeout=60)
    finally:
        edge_secagg.EdgeSecAgg.mask = mask
        loop.close()
    return engine, seen, plain, sums, outcome


def global_vector(engine, phase="train"):
    specs = engine.secagg.masked[phase]
    section = engine.aggregator.state[(Kind.SHARED_TENSORS, "")]
    return np.concatenate([section[n].reshape(-1).double().numpy()
                           for s in specs for n in s.tensors])


def expected_mean(plain_round, survivors):
    weights = {e: plain_round[e][0] for e in survivors}
    total = sum(weights.values())
    return sum(weights[e] * plain_round[e][1] for e in survivors) / total, total


def assert_exact(engine, plain, survivors, phase="train"):
    mean, total = expected_mean(plain[(1, phase)], survivors)
    record = engine.history["rounds"][0]
    unmask = record["aggregate"]["secagg-unmask"]
    assert unmask["unmasked"] == len(survivors)
    quantizer = engine.secagg.quantizer(phase)
    bound = quantizer.parties / (2 * quantizer.scale * total) + 1e-6  # + float32 storage
    error = np.abs(global_vector(engine, phase) - mean).max()
    assert error <= bound, (error, bound)
    return error


def test_secure_round_sums_exactly_and_the_server_sees_only_masked_vectors(tmp_path):
    engine, seen, plain, sums, outcome = run_secure(tmp_path, edges=3)
    assert outcome == {"e0": 0, "e1": 0, "e2": 0}
    assert_exact(engine, plain, ["e0", "e1", "e2"])
    train_uploads = [kinds for phase, _, kinds in seen if phase == "train"]
    assert train_uploads == [{Kind.SECAGG}] * 3
    n = sum(w for w, _ in plain[(1, "train")].values())  # the edges' training-split sizes
    assert [s[1:] for s in sums] == [(pytest.approx(n, rel=1e-6), 3)]
    record = engine.history["rounds"][0]
    # n_k is stated in the clear too (the server caps it and holds the masked weight to it)
    assert record["train"]["num_examples"] == {e: w for e, (w, _) in plain[(1, "train")].items()}
    assert all("train_loss" not in m for m in record["train"]["edge_metrics"].values())
    # every protocol byte is counted under the SECAGG kind
    uplink = record["bytes"]["up"]
    length = engine.secagg.lengths["train"]
    assert uplink["secagg"]["raw"] > 3 * 4 * length  # three masked vectors and the protocol
    assert "shared_tensors" not in uplink


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["secagg-advertise:train", "secagg-share:train",
                                   "secagg-receive:train", "train", "secagg-confirm:train",
                                   "secagg-unmask:train"])
def test_one_dropout_at_each_phase_keeps_the_sum_exact(tmp_path, phase):
    engine, _, plain, _, outcome = run_secure(tmp_path, edges=4, drops={1: phase},
                                              secagg_graph="full")
    assert outcome["e1"] == "dropped"
    # an edge gone before its masked input is not in the sum; one gone after it still is
    after = phase in ("secagg-confirm:train", "secagg-unmask:train")
    survivors = ["e0", "e1", "e2", "e3"] if after else ["e0", "e2", "e3"]
    assert_exact(engine, plain, survivors)


@pytest.mark.slow
def test_maximum_tolerated_dropouts_after_sharing_are_recovered(tmp_path):
    # full graph over 5 edges: t = floor(5 / 2) + 1 = 3, so n - t = 2 may drop
    engine, _, plain, _, _ = run_secure(tmp_path, edges=5, drops={1: "train", 3: "train"},
                                        secagg_graph="full")
    assert engine.history["rounds"][0]["aggregate"]["secagg-advertise"]["threshold"] == 3
    assert engine.history["rounds"][0]["aggregate"]["secagg-unmask"]["recovered_dropouts"] == 2
    assert_exact(engine, plain, ["e0", "e2", "e4"])


@pytest.mark.slow
def test_too_few_survivors_abort_the_round_and_leave_the_global_untouched(tmp_path):
    before = None
    engine, _, _, sums, _ = run_secure(tmp_path, edges=3, drops={0: "train", 1: "train"},
                                       secagg_graph="full")
    record = engine.history["rounds"][0]["aggregate"]
    assert "fewer than the threshold" in record["secagg-aborted"]
    assert sums == []  # nothing was unmasked
    fresh = engine.method.build_models()
    before = engine.method.initial_state(fresh)[(Kind.SHARED_TENSORS, "")]
    after = engine.aggregator.state[(Kind.SHARED_TENSORS, "")]
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_pfedka_masks_alpha_weighted_students(tmp_path):
    engine, seen, plain, sums, outcome = run_secure(
        tmp_path, "pfedka", edges=3, model="resnet10-cifar-compact")
    assert set(outcome.values()) == {0}
    phases = {phase for phase, _, _ in seen}
    assert "upload" in phases and "train" not in phases  # scalars travel in the clear
    alpha = engine.history["rounds"][0]["aggregate"]["gate"]["alpha"]
    weights = {e: w for e, (w, _) in plain[(1, "upload")].items()}
    assert weights == pytest.approx(alpha)
    assert_exact(engine, plain, ["e0", "e1", "e2"], phase="upload")

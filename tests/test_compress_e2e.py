"""Update compression end to end (issue #26): fl-server with ``--compress`` and fl-edge
processes over real gRPC on loopback (the edges take no flag: the run config carries the
codecs), and an attacker speaking the protocol by hand.

- the wire bytes of the model uploads are what the codec's layout predicts (within 2 %),
  the raw bytes what the tensors would be uncompressed; from round 2 the global goes down
  only as deltas; the final global is finite;
- DP-SGD's ledger is the same with and without compression (post-processing);
- coded uploads a codec never produces are refused by name (wrong part sizes before the
  body is read, a NaN scale, indices out of range or unsorted, counts that do not add
  up), cost only their sender's task, and the round completes with the honest edge;
- two seeded compressed runs give bit-identical globals (stochastic rounding is seeded).
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import Cluster, read_history, write_edge_dirs
from rawedge import UPLOAD_CHUNK, RawEdge, Task, shifted, stream
from test_determinism import _final_global, _identical

from fedattn_shared.compress import load_codec
from fedattn_shared.compress.apply import UplinkCompression
from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.schema import TRAIN, Kind, Payload, Section
from fedattn_shared.wire.accounting import data_message_wire_bytes
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import payload_chunks

EDGES = 2
RUN = ["--method", "fedavg", "--rounds", "2", "--min-edges", str(EDGES), "--local-epochs", "1",
       "--lr", "0.05"]


def fedavg_schema():
    """The server's method and models (fedavg's defaults: lenet-bn, 10 classes)."""
    cls = load_method("fedavg")
    method = cls(MethodContext(TrainConfig(model="lenet-bn"), cls.Params()))
    return method, method.build_models()


def federation(root: Path, compress: str, *extra: str, edge_args: tuple[str, ...] = (),
               seed: int = 0) -> dict:
    """One run; its history."""
    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root)
    try:
        dirs = write_edge_dirs(root, EDGES, per_edge=100)
        args = [*RUN, "--seed", str(seed), *extra]
        if compress:
            args += ["--compress", compress]
        server = cluster.server(*args)
        edges = [cluster.edge(d, f"e{i}", *edge_args) for i, d in enumerate(dirs)]
        assert [e.wait() for e in edges] == [0] * EDGES, [e.log()[-2000:] for e in edges]
        assert server.wait() == 0
    finally:
        cluster.close()
    return read_history(root / "server-state")


@pytest.mark.parametrize("up, down", [("fp16", "fp16"), ("int8", "int8"),
                                      ("topk:0.01+ef", "int8")])
def test_compressed_run_sends_what_the_codec_predicts(tmp_path, up, down):
    history = federation(tmp_path, f"up={up},down={down}")
    assert history["manifest"]["compress"] == f"up={load_codec(up).spec},down={load_codec(down).spec}"
    method, models = fedavg_schema()
    (spec,) = method.uplink_schema(TRAIN, models)
    codec = load_codec(up)
    n = sum(math.prod(t.shape) for t in spec.tensors.values() if t.dtype.is_floating_point)
    other = sum(t.nbytes for t in spec.tensors.values() if not t.dtype.is_floating_point)
    section = codec.codec.encoded_bytes(n) + other
    predicted = EDGES * data_message_wire_bytes(section)  # one chunk each (under 1 MiB)
    for record in history["rounds"]:
        assert "aborted" not in record
        assert record["train"]["received"] == ["e0", "e1"]
        sent = record["bytes"]["up"]["shared_tensors"]
        assert abs(sent["wire"] - predicted) <= 0.02 * predicted, (sent, predicted)
        assert sent["raw"] == EDGES * spec.nbytes  # what the tensors are uncompressed
        assert set(sent["codecs"]) == {codec.label}
    # Round 1: the first global goes whole, then its change as a delta; from round 2 on
    # the edges hold the reference: deltas only, coded with the down codec.
    first, second = (r["bytes"]["down"]["shared_tensors"] for r in history["rounds"])
    label = load_codec(down).label
    assert set(first["codecs"]) == {"none", label}
    assert set(second["codecs"]) == {label}
    assert second["wire"] < 0.6 * second["raw"]
    final = _final_global(tmp_path / "server-state")
    assert final and all(bool(torch.isfinite(t).all()) for t in final.values()
                         if t.is_floating_point())
    # Error feedback is private state, written behind each upload.
    feedback = [(tmp_path / f"state-e{i}" / "feedback.safetensors").exists() for i in range(EDGES)]
    assert feedback == [up.endswith("+ef")] * EDGES


def federations(root: Path, runs: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], int]]
                ) -> None:
    """Several independent federations at once (name -> compress, server flags, edge flags,
    seed), each in ``root / name``: most of a short run is processes starting, which
    overlap."""
    with ThreadPoolExecutor(len(runs)) as pool:
        done = [pool.submit(federation, root / name, compress, *extra, edge_args=edge_args,
                            seed=seed)
                for name, (compress, extra, edge_args, seed) in runs.items()]
        for future in done:
            future.result()


def test_two_seeded_compressed_runs_are_bit_identical(tmp_path):
    federations(tmp_path, {"a": ("up=int8,down=int4", (), (), 3),
                           "b": ("up=int8,down=int4", (), (), 3),
                           "c": ("up=int8,down=int4", (), (), 4)})
    a, b, c = (_final_global(tmp_path / name / "server-state") for name in "abc")
    assert not _identical(a, b)
    assert _identical(a, c)


DP = ["--dp", "--dp-fix-model", "--dp-noise-multiplier", "1.0", "--batch-size", "20",
      "--set", "dp.seeded_noise=true"]


def test_dp_ledger_is_unchanged_by_compression(tmp_path):
    allow = ("--allow-seeded-dp-noise",)
    federations(tmp_path, {"plain": ("", tuple(DP), allow, 0),
                           "coded": ("up=int8,down=fp16", tuple(DP), allow, 0)})
    ledgers = [[json.loads((tmp_path / name / f"state-e{i}" / "privacy-ledger.json").read_text())
                for i in range(EDGES)] for name in ("plain", "coded")]
    for plain, coded in zip(*ledgers, strict=True):
        assert plain["rounds"] and plain["rounds"] == coded["rounds"]
        assert {k: v for k, v in plain.items() if k != "updated"} == \
               {k: v for k, v in coded.items() if k != "updated"}


# ---- an attacker speaking the protocol -----------------------------------------------------


class Attack:
    """A server with ``--compress up=CODEC``, an honest raw edge that uploads what the edge's
    compression layer would, and an attacker; one attack per round."""

    def __init__(self, root: Path, codec: str):
        self.cluster = Cluster(root)
        self.server = self.cluster.server(
            "--method", "fedavg", "--rounds", "50", "--min-edges", "2", "--round-timeout", "30",
            "--compress", f"up={codec}")
        self.honest, self.attacker = RawEdge(self.cluster.port, "honest"), RawEdge(self.cluster.port, "bad")
        self.honest.connect()
        self.attacker.connect()
        method, models = fedavg_schema()
        self.up = UplinkCompression(method, models, load_codec(codec))

    def coded(self, task: Task, delta: float) -> Payload:
        """What an honest edge sends: global + delta, coded against the global."""
        common = Payload([Section(Kind.SHARED_TENSORS, "", task.globals)])
        upload = Payload([Section(Kind.SHARED_TENSORS, "", shifted(task.globals, delta))])
        coded, _ = self.up.encode(TRAIN, upload, common, torch.Generator().manual_seed(0))
        return coded

    def messages(self, edge: RawEdge, task: Task, payload: Payload):
        encoded = encode(payload, checksum=False)
        chunks = [chunk for _, chunk in payload_chunks(encoded, UPLOAD_CHUNK)]
        return stream(edge.header(task, encoded.manifest), chunks)

    def train_tasks(self) -> tuple[Task, Task]:
        """Both edges' next training tasks (evaluation tasks on the way answered)."""
        tasks = {}
        # The attacker first: its evaluation of the last round is what that round waits for.
        for edge in (self.attacker, self.honest):
            for _ in range(5):
                task = edge.next_task()
                if task.header.phase == TRAIN:
                    break
                assert edge.submit(edge.evaluation(task)).accepted
            tasks[edge.edge_id] = task
        return tasks[self.honest.edge_id], tasks[self.attacker.edge_id]

    def close(self) -> None:
        self.honest.close()
        self.attacker.close()
        self.cluster.close()


def tampered(part: str, spoil):
    """A builder: the honest coded upload with ``codec:PART`` replaced by spoil(tensor)."""
    def build(attack: Attack, task: Task) -> Payload:
        section = attack.coded(task, 0.01).sections[0]
        tensors = dict(section.tensors)
        tensors[f"codec:{part}"] = spoil(tensors[f"codec:{part}"].clone())
        return Payload([Section(section.kind, section.name, tensors)])
    return build


def _set(index, value):
    def spoil(t):
        t.view(-1)[index] = value
        return t
    return spoil


def _swap_first_two(t):
    first = t[0].clone()
    t[0], t[1] = t[1], first
    return t


ATTACKS = {
    "int8": [
        ("part-size", tampered("q", lambda t: torch.cat([t, t[:1]])), ("codec:q", "shape")),
        ("nan-scale", tampered("scale", _set(0, float("nan"))), ("int8 scale", "non-finite")),
        ("negative-scale", tampered("scale", _set(1, -1.0)), ("int8 scale", "negative")),
        ("part-dtype", tampered("scale", lambda t: t.to(torch.float64)), ("codec:scale", "dtype")),
    ],
    "topk:0.01": [
        ("index-out-of-block", tampered("index", _set(-1, 255)), ("topk index", "outside")),
        ("index-unsorted", tampered("index", _swap_first_two), ("topk index",)),
        ("counts-do-not-add-up", tampered("counts", _set(0, 0)), ("topk counts",)),
        ("nan-value", tampered("values", _set(3, float("nan"))), ("topk values", "non-finite")),
    ],
}


@pytest.mark.parametrize("codec", list(ATTACKS))
def test_bad_coded_uploads_are_refused_by_name_and_the_round_completes(tmp_path, codec):
    attack = Attack(tmp_path, codec)
    try:
        for name, build, needles in ATTACKS[codec]:
            honest_task, bad_task = attack.train_tasks()
            mark = attack.server.mark()
            reply = attack.attacker.submit(attack.messages(attack.attacker, bad_task,
                                                           build(attack, bad_task)))
            assert not reply.accepted, name
            for needle in needles:
                assert needle in reply.reason, (name, reply.reason)
            attack.server.logged(mark, f"dropped {attack.attacker.edge_id} (bad upload")
            coded = attack.coded(honest_task, 0.01)
            reply = attack.honest.submit(attack.messages(attack.honest, honest_task, coded))
            assert reply.accepted, (name, reply.reason)
            # The round completed with the honest upload alone: the next global is it, as
            # the server decodes it.
            common = Payload([Section(Kind.SHARED_TENSORS, "", honest_task.globals)])
            expected = attack.up.decode(TRAIN, coded, common).sections[0].tensors
            after = attack.honest.next_task()
            assert after.header.round == honest_task.header.round
            for tensor, value in after.globals.items():
                if value.is_floating_point():
                    torch.testing.assert_close(value, expected[tensor], rtol=1e-6, atol=1e-7)
            assert attack.honest.submit(attack.honest.evaluation(after)).accepted
        history = json.loads((tmp_path / "server-state" / "history.json").read_text())
        rounds = history["rounds"]
        assert len(rounds) >= len(ATTACKS[codec]) - 1
        for record in rounds:
            assert record["train"]["received"] == [attack.honest.edge_id]
            assert "bad upload" in record["train"]["dropped"][attack.attacker.edge_id]
        assert attack.server.popen.poll() is None  # still serving
    finally:
        attack.close()

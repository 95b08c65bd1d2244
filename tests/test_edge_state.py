"""The edge's private state on disk: atomic, refused when corrupt or mismatched."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import write_edge_dirs

from fedattn_shared.config import TrainConfig
from fedattn_shared.data import DataError, load_edge_data
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.state import StateError, atomic_write, load_tensors, save_tensors
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import payload_chunks
from fl_edge.store import PrivateStore, load_or_create_identity, private_digest


def make_algo(method_name: str = "fedbn", **train_kwargs):
    cls = load_method(method_name)
    method = cls(MethodContext(TrainConfig(**train_kwargs), cls.Params()))
    models = method.build_models()
    return method, method.edge(models, torch.device("cpu")), method.fingerprint(models)


def test_private_state_round_trip_is_bit_identical(tmp_path):
    method, algo, fingerprint = make_algo("fedbn", optimizer="adam")
    x = torch.randn(8, 1, 28, 28)
    y = torch.randint(0, 10, (8,))
    opt = algo.optimizers()[0]
    algo.train_mode()
    opt.zero_grad()
    algo.training_step((x, y)).backward()
    opt.step()
    store = PrivateStore(tmp_path)
    store.save(algo, fingerprint, round_number=3, phase="train")
    before = private_digest(algo)

    _, fresh, _ = make_algo("fedbn", optimizer="adam")
    assert private_digest(fresh) != before
    meta = PrivateStore(tmp_path).load(fresh, fingerprint)
    assert meta["round"] == "3" and private_digest(fresh) == before
    saved_opt = opt.state_dict()["state"]
    loaded_opt = fresh.optimizers()[0].state_dict()["state"]
    for pid, entries in saved_opt.items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded_opt[pid][key]))
    assert oct(os.stat(store.path).st_mode & 0o777) == "0o600"


def test_mismatched_fingerprint_is_refused_with_path(tmp_path):
    _, algo, fingerprint = make_algo("fedbn")
    PrivateStore(tmp_path).save(algo, fingerprint, 1, "train")
    _, other, other_fp = make_algo("fedper")
    with pytest.raises(StateError, match=str(tmp_path / "private.safetensors")):
        PrivateStore(tmp_path).load(other, other_fp)


def test_corrupt_state_file_is_refused_not_overwritten(tmp_path):
    path = tmp_path / "private.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    _, algo, fingerprint = make_algo("fedbn")
    with pytest.raises(StateError, match="corrupt"):
        PrivateStore(tmp_path).load(algo, fingerprint)
    assert path.read_bytes().startswith(b"\x10\x00")


def test_atomic_write_keeps_old_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "state.safetensors"
    save_tensors(path, {"a": torch.ones(3)})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        save_tensors(path, {"a": torch.zeros(3)})
    monkeypatch.undo()
    tensors, _ = load_tensors(path)
    assert torch.equal(tensors["a"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]  # no temp left over
    atomic_write(tmp_path / "x", b"1")
    assert (tmp_path / "x").read_bytes() == b"1"


def test_atomic_write_takes_any_buffers_and_rewrites_a_spare_in_place(tmp_path):
    """Buffers of any format, empty ones among them (an empty file too), back to back;
    with ``recycle``, the spare's inode becomes the file, cut to the new length, mode
    0600, the old bytes beyond it gone."""
    floats = memoryview(torch.arange(4, dtype=torch.float32).numpy())
    atomic_write(tmp_path / "empty", b"")
    assert (tmp_path / "empty").read_bytes() == b""
    atomic_write(tmp_path / "parts", [b"", b"ab", floats, b"", bytearray(b"c")])
    assert (tmp_path / "parts").read_bytes() == b"ab" + floats.tobytes() + b"c"
    spare = tmp_path / "spare"
    spare.write_bytes(b"x" * 10_000)
    inode = spare.stat().st_ino
    atomic_write(tmp_path / "kept", [b"new", b""], recycle=spare)
    kept = tmp_path / "kept"
    assert kept.read_bytes() == b"new" and kept.stat().st_ino == inode and not spare.exists()
    assert kept.stat().st_mode & 0o777 == 0o600
    atomic_write(kept, b"fresh", recycle=spare)  # no spare now: a fresh file
    assert kept.read_bytes() == b"fresh" and kept.stat().st_ino != inode


def _global(values: list[float]) -> tuple:
    encoded = encode(Payload([Section(Kind.SHARED_TENSORS, "", {"w": torch.tensor(values)})]))
    data = bytearray(b"".join(c for _, c in payload_chunks(encoded)))
    return encoded.manifest, data


def _cached(store: PrivateStore) -> list[float]:
    return store.load_global().tensors(Kind.SHARED_TENSORS)["w"].tolist()


def test_global_cache_slots_take_turns_and_a_torn_write_keeps_the_last_global(
        tmp_path, monkeypatch):
    store = PrivateStore(tmp_path)
    assert store.load_global().sections == []  # nothing received yet
    store.save_global(*_global([1.0, 2.0, 3.0]))
    store.save_global(*_global([4.0, 5.0]))  # a smaller payload: the slot is truncated
    assert _cached(PrivateStore(tmp_path)) == [4.0, 5.0]
    assert (tmp_path / "global-0.bin").stat().st_size == 12
    assert (tmp_path / "global-1.bin").stat().st_size == 8

    # A crash after the slot's bytes but before the manifest moved: the last global stays.
    def crash(*args, **kwargs):
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.save_global(*_global([7.0, 8.0, 9.0]))
    monkeypatch.undo()
    assert _cached(PrivateStore(tmp_path)) == [4.0, 5.0]
    # A restarted edge writes the slot the manifest does not name.
    restarted = PrivateStore(tmp_path)
    restarted.save_global(*_global([6.0]))
    assert _cached(PrivateStore(tmp_path)) == [6.0]
    assert (tmp_path / "global-0.bin").stat().st_size == 4


def test_corrupt_global_cache_is_refused_with_its_path(tmp_path):
    store = PrivateStore(tmp_path)
    store.save_global(*_global([1.0, 2.0]))
    slot = tmp_path / "global-0.bin"
    slot.write_bytes(b"\x00" * 8)  # same size, other bytes
    with pytest.raises(StateError, match="global.manifest.*global-0.bin: CRC-32 mismatch"):
        PrivateStore(tmp_path).load_global()
    slot.write_bytes(b"\x00" * 4)
    with pytest.raises(StateError, match="global-0.bin holds 4 bytes"):
        PrivateStore(tmp_path).load_global()
    (tmp_path / "global.manifest").write_bytes(b"\x07junk")
    with pytest.raises(StateError, match="no slot number"):
        PrivateStore(tmp_path).load_global()


def test_identity_is_created_once_and_bound_to_its_name(tmp_path):
    first = load_or_create_identity(tmp_path / "s", "cam7")
    again = load_or_create_identity(tmp_path / "s", None)
    assert first == again and len(first.secret) == 64
    with pytest.raises(StateError, match="belongs to edge 'cam7'"):
        load_or_create_identity(tmp_path / "s", "cam8")


def test_edge_refuses_state_from_another_run(tmp_path):
    """A real fl-edge against a server of another method exits 2 naming the state file."""
    from conftest import Cluster

    cluster = Cluster(tmp_path)
    try:
        (data,) = write_edge_dirs(tmp_path, 1)
        state = tmp_path / "state-solo"
        state.mkdir()
        _, algo, fingerprint = make_algo("fedbn")
        PrivateStore(state).save(algo, fingerprint, 1, "train")
        cluster.server("--method", "fedper", "--rounds", "1", "--min-edges", "1")
        edge = cluster.edge(data, "solo")
        assert edge.wait() == 2
        assert "fingerprint" in edge.log()
    finally:
        cluster.close()


def test_npz_reader_names_the_bad_file(tmp_path):
    cfg = TrainConfig()
    with pytest.raises(DataError, match="no train.npz or data.npz"):
        load_edge_data(tmp_path, cfg)
    np.savez(tmp_path / "data.npz", x=np.zeros((10, 28, 28), np.uint8), y=np.full(10, 12))
    with pytest.raises(DataError, match=r"data.npz: label 12 at index 0"):
        load_edge_data(tmp_path, cfg)
    np.savez(tmp_path / "data.npz", x=np.zeros((10, 32, 32), np.uint8), y=np.zeros(10, int))
    with pytest.raises(DataError, match="32x32"):
        load_edge_data(tmp_path, cfg)
    np.savez(tmp_path / "data.npz", x=np.zeros((10, 28, 28), np.uint8), y=np.zeros(9, int))
    with pytest.raises(DataError, match="10 images but 9 labels"):
        load_edge_data(tmp_path, cfg)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object))
    os.replace(tmp_path / "obj.npy", tmp_path / "x.npy")
    import zipfile
    with zipfile.ZipFile(tmp_path / "data.npz", "w") as z:
        z.write(tmp_path / "x.npy", "x.npy")
        z.write(tmp_path / "x.npy", "y.npy")
    with pytest.raises(DataError, match="data.npz"):
        load_edge_data(tmp_path, cfg)


def test_stratified_split_is_seeded_and_keeps_every_class(tmp_path):
    x = np.zeros((100, 28, 28), np.uint8)
    y = np.repeat(np.arange(10), 10)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    a = load_edge_data(tmp_path, TrainConfig(seed=1))
    b = load_edge_data(tmp_path, TrainConfig(seed=1))
    assert torch.equal(a.test.y, b.test.y) and len(a.test) == 20 and len(a.train) == 80
    assert sorted(torch.bincount(a.test.y).tolist()) == [2] * 10


def test_fl_edge_usage_errors_exit_2(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "fl_edge", "--server", "127.0.0.1:1",
                              "--data-dir", str(tmp_path / "nope"), "--insecure"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "nope" in missing.stderr

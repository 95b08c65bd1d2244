"""Server checkpoints: the tensors file rewritten in place over a recycled one, and the
store that keeps the last rounds plus that spare."""

from __future__ import annotations

import os
import struct

import pytest
import torch
from safetensors.torch import load_file

from fedattn_shared.state import load_tensors, save_tensors
from fl_server.checkpoint import SPARE, CheckpointStore


def test_in_place_file_has_the_safetensors_layout_byte_for_byte(tmp_path):
    spare = tmp_path / "spare"
    spare.write_bytes(b"\xff" * 1000)  # longer than the new file: the tail must go
    path = tmp_path / "state.safetensors"
    save_tensors(path, {"w": torch.tensor([1.0, 2.0])}, recycle=spare)
    # The metadata keeps the order the tensors were given in (safetensors sorts them).
    header = (b'{"__metadata__":{"fedattn.order":"[\\"w\\"]"},'
              b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}')
    assert len(header) == 97  # padded with 7 spaces to 104, a multiple of 8
    expected = struct.pack("<Q", 104) + header + b"       " + struct.pack("<2f", 1.0, 2.0)
    assert path.read_bytes() == expected
    assert not spare.exists()  # consumed: renamed into place
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_in_place_file_loads_like_the_library_written_one(tmp_path):
    flat = torch.randn(100)
    tensors = {  # views of one buffer (safetensors' own writer needs copies), mixed widths
        "a": flat[:60].view(6, 10), "b": flat[60:], "steps": torch.tensor(7),
        "empty": torch.zeros(0), "half": torch.arange(3, dtype=torch.float16),
        "mask": torch.tensor([True, False, True]), "bytes": torch.arange(5, dtype=torch.uint8),
    }
    spare = tmp_path / "spare"
    spare.write_bytes(os.urandom(4096))
    save_tensors(tmp_path / "library.safetensors", tensors, {"round": "3"})
    save_tensors(tmp_path / "recycled.safetensors", tensors, {"round": "3"}, recycle=spare)
    library, meta_l = load_tensors(tmp_path / "library.safetensors")
    recycled, meta_r = load_tensors(tmp_path / "recycled.safetensors")
    assert meta_l == meta_r == {"round": "3"}
    assert sorted(recycled) == sorted(tensors)
    for name, tensor in tensors.items():
        assert recycled[name].dtype == tensor.dtype and torch.equal(recycled[name], tensor)
        assert torch.equal(library[name], recycled[name])
    # Read by safetensors' own file loader too (it checks offsets and alignment).
    assert torch.equal(load_file(tmp_path / "recycled.safetensors")["a"], tensors["a"])


def test_failed_in_place_write_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "state.safetensors"
    save_tensors(path, {"w": torch.ones(4)})
    spare = tmp_path / "spare"
    spare.write_bytes(b"\0" * 64)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_tensors(path, {"w": torch.zeros(4)}, recycle=spare)
    monkeypatch.undo()
    assert torch.equal(load_tensors(path)[0]["w"], torch.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.safetensors"]


def test_store_recycles_the_pruned_round_and_loads_the_latest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for round_number in range(1, 6):
        store.save(round_number, {"global:w": torch.full((256,), float(round_number))},
                   {"round": round_number})
        spare = tmp_path / "rounds" / SPARE
        # From the first pruned round on, its tensors file waits as the spare.
        assert spare.exists() == (round_number >= 3)
        assert sorted(p.name for p in (tmp_path / "rounds").iterdir() if p.name.isdigit()) == \
            [f"{n:06d}" for n in range(max(1, round_number - 1), round_number + 1)]
    number, tensors, state = store.load()
    assert number == 5 and state == {"round": 5}
    assert torch.equal(tensors["global:w"], torch.full((256,), 5.0))
    # The round before stays loadable as well (keep=2 holds while the spare is reused).
    older, _ = load_tensors(tmp_path / "rounds" / "000004" / "state.safetensors")
    assert torch.equal(older["global:w"], torch.full((256,), 4.0))

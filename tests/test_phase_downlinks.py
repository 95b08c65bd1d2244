"""A closed phase lets its downlinks go (``Phase.close`` retires them): they view the
global the phase sent, which the close replaces, and held until the next phase opened
they kept the old global beside the new one and the next downlink's frames (issue #41).
A download whose header went out before the close took its downlinks with the header
(``Downloads._frames``), so it still sends every byte the header announced."""

from __future__ import annotations

import tracemalloc

import torch

from fedattn_shared.config import ServerConfig
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import data_of_frame
from fl_server.downloads import Downloads
from fl_server.phase import Phase, Task

CHUNK = 1024


def test_a_closed_phase_lets_its_downlinks_go_and_a_started_download_sends_all_it_announced():
    weights = torch.arange(1000, dtype=torch.float32)  # 4,000 bytes: four chunks
    common = encode(Payload([Section(Kind.SHARED_TENSORS, "", {"w": weights})]))
    personal = encode(Payload([Section(Kind.CONTROL, "", {"p": -weights[:10]})]))
    phase = Phase(name="train", round=1, tasks={"e0": Task(1, "e0")}, quorum=1, common_id="c",
                  common=common,
                  personal={"e0": personal}, spec_json="{}")
    cfg = ServerConfig(chunk_bytes=CHUNK, max_download_memory=1 << 20)
    downloads = Downloads(engine=None, meter=None, cfg=cfg)
    header = pb.TaskHeader(common=common.manifest, personal=personal.manifest)
    frames = downloads._frames(phase, "e0", header, False, 0)  # as the header goes out
    phase.close("", "closed at quorum")
    assert phase.common.total_bytes == 0 and phase.personal == {}
    sent = b"".join(bytes(data_of_frame(frame)) for frame, *_ in frames)
    assert sent == weights.numpy().tobytes() + (-weights[:10]).numpy().tobytes()


def test_many_downloads_cut_chunks_into_pieces_built_from_tensor_memory():
    """With many downloads under way a chunk goes in pieces of the room's fair share, each
    built for its send from the tensor memory (never from a frame of the whole chunk, which
    every download would hold beside what the room counts): the pieces carry the payload's
    bytes in order, none beyond the share, and a chunk's data bytes are counted once."""
    weights = torch.randn(600_000, generator=torch.Generator().manual_seed(0))  # 2.4 MB
    common = encode(Payload([Section(Kind.SHARED_TENSORS, "", {"w": weights})]))
    personal = encode(Payload())
    phase = Phase(name="train", round=1, tasks={"e0": Task(1, "e0")}, quorum=1, common_id="c",
                  common=common, personal={"e0": personal}, spec_json="{}")
    downloads = Downloads(engine=None, meter=None,
                          cfg=ServerConfig(chunk_bytes=1 << 20, download_window=64 << 20))
    header = pb.TaskHeader(common=common.manifest, personal=personal.manifest)
    others = [downloads.room.downloading(f"other{i}") for i in range(100)]
    for under_way in others:  # 100 downloads under way: a share of 32 MiB / 200
        under_way.__enter__()
    share = downloads.room.piece(1 << 20)
    assert share < 1 << 19
    frames = list(downloads._frames(phase, "e0", header, False, 0))
    assert b"".join(bytes(data_of_frame(f)) for f, _, _ in frames) == weights.numpy().tobytes()
    assert all(0 < raw <= share and len(data_of_frame(f)) == raw for f, _, raw in frames)
    assert sum(entry[3] for _, entry, _ in frames) == weights.numel() * 4
    assert len(frames) > 3 * (weights.numel() * 4 >> 20)
    del frames
    tracemalloc.start()  # sent one at a time, a download holds a piece (and builds the
    for frame, _, _ in downloads._frames(phase, "e0", header, False, 0):  # next), no chunk
        del frame
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 2 * share + (64 << 10), f"{peak} bytes held at once"

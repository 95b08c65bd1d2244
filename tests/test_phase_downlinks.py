"""A closed phase lets its downlinks go (``Phase.close`` retires them): they view the
global the phase sent, which the close replaces, and held until the next phase opened
they kept the old global beside the new one and the next downlink's frames (issue #41).
A download whose header went out before the close took its downlinks with the header
(``Downloads._frames``), so it still sends every byte the header announced."""

from __future__ import annotations

import torch

from fedattn_shared.config import ServerConfig
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import data_frames, data_of_frame
from fl_server.downloads import Downloads
from fl_server.phase import Phase, Task

CHUNK = 1024


def test_a_closed_phase_lets_its_downlinks_go_and_a_started_download_sends_all_it_announced():
    weights = torch.arange(1000, dtype=torch.float32)  # 4,000 bytes: four chunks
    common = encode(Payload([Section(Kind.SHARED_TENSORS, "", {"w": weights})]))
    personal = encode(Payload([Section(Kind.CONTROL, "", {"p": -weights[:10]})]))
    phase = Phase(name="train", round=1, tasks={"e0": Task(1, "e0")}, quorum=1, common_id="c",
                  common=common, common_frames=list(data_frames(common, CHUNK)),
                  personal={"e0": personal}, spec_json="{}")
    cfg = ServerConfig(chunk_bytes=CHUNK, max_download_memory=1 << 20)
    downloads = Downloads(engine=None, meter=None, cfg=cfg)
    header = pb.TaskHeader(common=common.manifest, personal=personal.manifest)
    frames = downloads._frames(phase, "e0", header, False, 0)  # as the header goes out
    phase.close("", "closed at quorum")
    assert phase.common.total_bytes == 0 and phase.common_frames == [] and phase.personal == {}
    sent = b"".join(bytes(data_of_frame(frame)) for frame, *_ in frames)
    assert sent == weights.numpy().tobytes() + (-weights[:10]).numpy().tobytes()

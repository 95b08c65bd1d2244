"""``fl_edge.downspool``: what a killed edge left of a kept task download is loaded up to
its last whole record, through the receivers and the payload's layout; anything else is
let go (and fetched again), never trusted."""

from __future__ import annotations

import torch

from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import PayloadAssembler, chunk_views
from fl_edge.downspool import MAGIC, PARTIAL_FILE, SPARE_FILE, DownloadSpool

CHUNK = 4096


def task() -> tuple[pb.TaskHeader, list[bytes]]:
    encoded = encode(Payload([Section(Kind.SHARED_TENSORS, "w",
                                      {"w": torch.arange(8192, dtype=torch.float32)})]))
    personal = encode(Payload())
    header = pb.TaskHeader(status=pb.TaskHeader.TASK, task_id=3, common=encoded.manifest,
                           personal=personal.manifest)
    chunks = [b"".join(bytes(v) for v in views) for _, views in chunk_views(encoded, CHUNK)]
    return header, chunks


def receivers(header: pb.TaskHeader) -> list[PayloadAssembler]:
    return [PayloadAssembler(m, 1 << 20, CHUNK) for m in (header.common, header.personal)]


def kept(tmp_path, header, chunks, window: int = CHUNK) -> DownloadSpool:
    spool = DownloadSpool(tmp_path)
    spool.begin(header, "cached-id", window)
    for chunk in chunks:
        spool.took(chunk)
    spool.file.close()  # the process is gone
    spool.file = None
    return spool


def test_a_kept_download_loads_and_goes_on_where_it_stopped(tmp_path):
    header, chunks = task()
    kept(tmp_path, header, chunks[:3])
    spool = DownloadSpool(tmp_path)
    loaded_header, assemblers, cached = spool.load(receivers)
    assert loaded_header == header and cached == "cached-id"
    assert assemblers[0].received == 3 * CHUNK
    for chunk in chunks[3:]:  # the rest arrives, and is kept after what was loaded
        assemblers[0].add(chunk)
        spool.took(chunk)
    assert assemblers[0].finish().tensors(Kind.SHARED_TENSORS, "w")["w"].equal(
        torch.arange(8192, dtype=torch.float32))
    spool.file.close()
    spool.file = None
    assert DownloadSpool(tmp_path).load(receivers)[1][0].received == len(chunks) * CHUNK


def test_a_record_cut_short_or_damaged_ends_what_is_loaded(tmp_path):
    header, chunks = task()
    kept(tmp_path, header, chunks[:4])
    path = tmp_path / PARTIAL_FILE
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # killed in the middle of the fourth chunk's write
    assert DownloadSpool(tmp_path).load(receivers)[1][0].received == 3 * CHUNK
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # the third chunk's bytes changed on disk: its CRC fails
    path.write_bytes(bytes(data))
    assert DownloadSpool(tmp_path).load(receivers)[1][0].received == 2 * CHUNK


def test_what_cannot_be_used_is_let_go(tmp_path):
    header, chunks = task()
    path = tmp_path / PARTIAL_FILE
    path.write_bytes(b"something else entirely")
    assert DownloadSpool(tmp_path).load(receivers) is None and not path.exists()

    def refusing(header):
        raise ValueError("over this edge's cap")

    kept(tmp_path, header, chunks[:2])
    assert DownloadSpool(tmp_path).load(refusing) is None and not path.exists()
    # Chunks off the header's layout (a chunk larger than a receiver takes).
    kept(tmp_path, header, [chunks[0] + chunks[1]])
    assert DownloadSpool(tmp_path).load(receivers) is None and not path.exists()


def test_a_download_within_one_window_is_not_kept(tmp_path):
    header, chunks = task()
    spool = DownloadSpool(tmp_path)
    spool.begin(header, "", window=len(chunks) * CHUNK)
    spool.took(chunks[0])
    assert spool.file is None and not (tmp_path / PARTIAL_FILE).exists()


def test_a_finished_download_s_file_is_the_next_one_s_and_its_records_never_load(tmp_path):
    """Whole, a download's file is set aside (its MAGIC zeroed) and the next download is
    written over it in place (the same inode). Its old records, beyond the new ones at
    the very same offsets, continue another CRC chain: only the new download's chunk
    loads. A kill between taking the spare and writing the new header loads nothing."""
    header, chunks = task()
    path, spare = tmp_path / PARTIAL_FILE, tmp_path / SPARE_FILE
    spool = DownloadSpool(tmp_path)
    spool.begin(header, "cached-id", CHUNK)
    for chunk in chunks:
        spool.took(chunk)
    inode = path.stat().st_ino
    spool.forget()  # whole
    assert not path.exists() and spare.stat().st_ino == inode
    assert not spare.read_bytes().startswith(MAGIC)
    spare.rename(path)  # killed right after taking the spare, before the new header
    assert DownloadSpool(tmp_path).load(receivers) is None and spare.exists()

    following = pb.TaskHeader()
    following.CopyFrom(header)
    following.task_id = 4  # the same payload and record sizes: old records line up
    kept(tmp_path, following, chunks[:1])
    assert path.stat().st_ino == inode and path.stat().st_size > 4 * CHUNK  # old bytes follow
    loaded_header, assemblers, _ = DownloadSpool(tmp_path).load(receivers)
    assert loaded_header.task_id == 4 and assemblers[0].received == CHUNK

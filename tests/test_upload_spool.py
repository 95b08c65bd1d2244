"""The upload pipeline's body on disk as it arrives (``transport.Spool``) and its values
checked chunk by chunk (``transport.FiniteScan``): the same verdicts and the same bytes
as a receive buffer scanned once complete, whatever the chunk size (a chunk may end in
the middle of a value)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from conftest import Cluster, wait_for
from rawedge import RawEdge, raw_layout, shifted, stream, train_messages
from test_bad_input import assert_single_upload_mean

from fedattn_shared import kernels
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire.payload import nonfinite_tensors
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import FiniteScan, PayloadAssembler, payload_chunks


def payload(seed: int, spoil: dict[str, int] | None = None) -> Payload:
    """Floats of every width (an odd count of 2-byte values first, so that later tensors
    start off any alignment), integers between them; ``spoil``: tensor -> index that
    becomes NaN/Inf."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {"a16": torch.randn(7, generator=generator).half(),
               "b64": torch.randn(5, 3, generator=generator).double(),
               "count": torch.randint(0, 9, (3,), generator=generator),
               "c32": torch.randn(40, generator=generator),
               "dbf": torch.randn(9, generator=generator).to(torch.bfloat16),
               "empty": torch.zeros(0)}
    extra = {"w": torch.randn(11, generator=generator)}
    for name, index in (spoil or {}).items():
        target = tensors.get(name, extra.get(name))
        target.view(-1)[index] = float("nan") if index % 2 else float("inf")
    return Payload([Section(Kind.SHARED_TENSORS, "", tensors), Section(Kind.CONTROL, "x", extra)])


@pytest.mark.parametrize("loops", ["numpy", "compiled"])
@pytest.mark.parametrize("chunk", [1, 3, 5, 64, 1 << 20])
@pytest.mark.parametrize("spoil", [None, {"a16": 6}, {"b64": 0, "dbf": 8}, {"c32": 39},
                                   {"w": 10}, {"dbf": 3, "a16": 0}])
def test_the_scan_as_it_arrives_finds_what_the_whole_scan_finds(chunk, spoil, loops, tmp_path,
                                                                monkeypatch):
    """With NumPy's passes and with the compiled loop (``kernels``), every float width."""
    if loops == "compiled" and kernels.compiled(kernels.COMPILED_FROM) is None:
        pytest.skip("numba is not installed (the 'server' extra)")
    monkeypatch.setattr(kernels, "COMPILED_FROM", 0 if loops == "compiled" else 1 << 62)
    sent = payload(0, spoil)
    encoded = encode(sent, checksum=False)
    assembler = PayloadAssembler(encoded.manifest, 1 << 20, 1 << 20, checksum=False,
                                 spool=tmp_path)
    scan = FiniteScan(encoded.manifest)
    assert (scan._loops is not None) == (loops == "compiled")
    for _, piece in payload_chunks(encoded, chunk):
        _, offset = assembler.reserve(piece)
        assembler.write(offset, piece)
        scan.feed(offset, piece)
    received = assembler.finish()
    assert scan.bad == nonfinite_tensors(received) == nonfinite_tensors(sent)
    for got, want in zip(received.sections, sent.sections, strict=True):
        for name, tensor in want.tensors.items():
            assert torch.equal(got.tensors[name].view(torch.uint8) if tensor.numel() else
                               got.tensors[name], tensor.view(torch.uint8) if tensor.numel()
                               else tensor)
    assembler.buffer.close()


def test_the_spool_leaves_no_file_and_its_map_is_private(tmp_path):
    encoded = encode(payload(1), checksum=False)
    assembler = PayloadAssembler(encoded.manifest, 1 << 20, 1 << 20, checksum=False,
                                 spool=tmp_path)
    assert os.listdir(tmp_path) == []  # unlinked from the start: a crash leaves nothing
    for _, piece in payload_chunks(encoded, 100):
        assembler.add(piece)
    received = assembler.finish()
    c32 = received.sections[0].tensors["c32"]
    before = c32.clone()
    c32.mul_(2)  # the norm bound scales in place: the process's copy, never the file
    spool = assembler.buffer
    sent = b"".join(bytes(view) for views in encoded.section_views for view in views)
    assert os.pread(spool.fd, len(spool) + 1, 0) == sent  # the file holds what was sent
    spool.close()
    assert torch.equal(c32, before * 2)  # a view outlives the close: freed with it
    assert os.listdir(tmp_path) == []


def spool_files(pid: int, directory: Path) -> list[str]:
    """The files of ``directory`` the process holds open (a spool file has no name: its
    link reads ``<directory>/#inode (deleted)``)."""
    held = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(directory)):
            held.append(target)
    return held


@pytest.mark.parametrize("model", [
    ("lenet-bn",),
    # Above kernels.COMPILED_FROM (1.5 M values): the scan is numba's loop. One window per
    # task: RawEdge's continuation calls are not what this tests.
    ("mobilenet-v3-small", "--in-channels", "3", "--image-size", "32",
     "--download-window", str(16 << 20))], ids=["numpy-scan", "compiled-scan"])
def test_hostile_uploads_leave_no_spool_file_and_the_honest_one_is_the_mean(model, tmp_path):
    # An attacker's uploads, each refused at a different point of the body: a NaN in its
    # last chunk (found by the scan as it arrived, named by tensor), a stream that ends
    # half way, one that stalls until its idle deadline, one whose MAC does not match
    # its body. None leaves its spool file open (the two cut short are held for resuming
    # until --transfer-resume-expiry, then let go with their task), and the honest upload of
    # the same rounds is taken alone. With NumPy's scan and with the compiled one.
    if model[0] != "lenet-bn" and kernels.compiled(kernels.COMPILED_FROM) is None:
        pytest.skip("numba is not installed (the 'server' extra)")
    cluster = Cluster(tmp_path)
    attacker = honest = None
    try:
        server = cluster.server(
            "--method", "fedavg", "--model", *model, "--rounds", "100", "--min-edges", "2",
            "--quorum", "0", "--round-timeout", "60", "--eval-every", "0",
            "--upload-idle-timeout", "3", "--transfer-resume-expiry", "2", "--metrics-port", "0")
        assert ("large passes numba" in server.log()) == (model[0] != "lenet-bn")
        spool = tmp_path / "server-state" / "uploads"
        attacker, honest = RawEdge(cluster.port, "attacker"), RawEdge(cluster.port, "honest")
        for edge in (attacker, honest):
            edge.connect()

        def nan_in_last_chunk(task):
            tensors = shifted(task.globals, 1.0)
            last = list(tensors)[-1]
            tensors[last].view(-1)[-1] = float("nan")
            return attacker.submit(train_messages(attacker, task, tensors)), f"/{last}"

        def half(task):
            header, chunks = raw_layout(attacker, task, shifted(task.globals, 1.0))
            messages = stream(header, chunks)
            attacker.sign(messages)
            return attacker.submit(messages[: 1 + len(chunks) // 2]), "upload ended after"

        def stalled(task):
            header, chunks = raw_layout(attacker, task, shifted(task.globals, 1.0))
            messages = stream(header, chunks)
            attacker.sign(messages)
            release = threading.Event()

            def stalling():
                yield from messages[:2]
                release.wait(60)
            try:
                return attacker.stub.Submit(stalling(), timeout=60), "no data for"
            finally:
                release.set()

        def bad_mac(task):
            messages = train_messages(attacker, task, shifted(task.globals, 1.0))
            attacker.sign(messages, mac_key=bytes(32))
            return attacker.submit(messages), "signature does not verify"

        for attack in (nan_in_last_chunk, half, stalled, bad_mac):
            task, fair = attacker.next_task(), honest.next_task()
            reply, named = attack(task)
            assert not reply.accepted and named in reply.reason, (attack.__name__, reply.reason)
            upload = shifted(fair.globals, 2.0)
            assert honest.submit(train_messages(honest, fair, upload)).accepted
            wait_for(lambda: not spool_files(server.popen.pid, spool), 15,
                     f"no spool file open after {attack.__name__}")
            assert os.listdir(spool) == [] or all(name.endswith(".raw")
                                                  for name in os.listdir(spool))
        _, fair = attacker.next_task(), honest.next_task()
        assert_single_upload_mean(fair.globals, upload)
    finally:
        for edge in (attacker, honest):
            if edge is not None:
                edge.close()
        cluster.close()


def test_a_spool_that_cannot_be_written_refuses_the_upload_by_name(tmp_path):
    # The spool's folder is a file (a full or read-only disk acts alike): the upload is
    # refused naming the disk, the edge's task is dropped (the round goes on without it),
    # and the server keeps serving.
    (tmp_path / "server-state").mkdir()
    (tmp_path / "server-state" / "uploads").write_text("not a folder")
    cluster = Cluster(tmp_path)
    edge = None
    try:
        server = cluster.server(
            "--method", "fedavg", "--model", "lenet-bn", "--rounds", "100", "--min-edges", "1",
            "--round-timeout", "60", "--eval-every", "0", "--no-spill-sums")
        edge = RawEdge(cluster.port, "edge")
        edge.connect()
        task = edge.next_task()
        reply = edge.submit(train_messages(edge, task, shifted(task.globals, 1.0)))
        assert not reply.accepted
        assert "the server could not keep this upload on disk" in reply.reason, reply.reason
        server.logged(0, f"dropped {edge.edge_id} (bad upload")
        assert edge.next_task().header.round == task.header.round + 1
    finally:
        if edge is not None:
            edge.close()
        cluster.close()


def spooled(payload: Payload, directory: Path) -> tuple[Payload, object]:
    """``payload`` as the server holds it after the wire: views of its spool file's map."""
    encoded = encode(payload, checksum=False)
    assembler = PayloadAssembler(encoded.manifest, 1 << 30, 1 << 20, checksum=False,
                                 spool=directory)
    for _, piece in payload_chunks(encoded, 1 << 16):
        assembler.add(piece)
    return assembler.finish(), assembler.buffer


@pytest.mark.parametrize("method", ["fedavg", "fedadam"])
def test_a_spilled_mean_keeps_the_spool_file_itself_and_gives_the_same_bits(method, tmp_path):
    # The streaming mean's spilled file of an upload that arrived in a spool is that very
    # file (a link: the same inode, nothing written again, no page of it mapped), and the
    # round's mean has the bits of the in-memory sum. An upload written in place after it
    # was mapped (the norm bound scales so) is written out as it is now, not linked.
    from test_upload_memory import SHARED, aggregator, streaming_round

    from fedattn_shared.methods.spill import UploadSpill

    in_ram, on_disk = aggregator(method), aggregator(method)
    on_disk.spill = UploadSpill(tmp_path / "uploads", 1 << 30)
    weights = [1.0, 3.0, 1e6]
    generator = torch.Generator().manual_seed(0)
    payloads = [Payload([Section(Kind.SHARED_TENSORS, "", {  # as an edge sends the model
        name: value + torch.randn(value.shape, generator=generator)
        if value.is_floating_point() else value.clone()
        for name, value in in_ram.state[SHARED].items()})]) for _ in range(3)]
    sources = [spooled(p, tmp_path / "uploads") for p in payloads]
    scaled = sources[2][0].sections[0].flat
    scaled.mul_(0.5)  # in place, in the process's copy of the map's pages
    payloads[2] = Payload([Section(s.kind, s.name, {k: v.clone() for k, v in s.tensors.items()})
                           for s in sources[2][0].sections])
    expected = streaming_round(in_ram, payloads, weights)
    edges = ["e0", "e1", "e2"]
    on_disk.begin_round(1, edges, 3)
    for edge, (payload, spool), weight in zip(edges, sources, weights, strict=True):
        on_disk.spill.offered = spool
        try:
            on_disk.accept(edge, payload, weight)
        finally:
            on_disk.spill.offered = None
    files = [path for path, _ in on_disk.spill.files.values()]
    inodes = [os.fstat(spool.fd).st_ino for _, spool in sources]
    assert [os.stat(f).st_ino for f in files[:2]] == inodes[:2]  # linked, not written
    assert os.stat(files[2]).st_ino != inodes[2]  # written out: its pages changed
    assert on_disk.finish() == expected
    assert list((tmp_path / "uploads").iterdir()) == []
    left, right = in_ram.state_tensors(), on_disk.state_tensors()
    assert left.keys() == right.keys()
    assert all(torch.equal(left[k], right[k]) for k in left)
    for _, spool in sources:
        spool.close()


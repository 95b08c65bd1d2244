"""Server memory flat in the number of uploaders (issue #28): the upload-memory budget
(slots and gRPC windows from ``server.max_upload_memory``) and collect-then-learn
uploads spilled to memory-mapped files instead of RAM."""

from __future__ import annotations

import io
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch
from conftest import read_history, wait_for, write_edge_dirs

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.methods.spill import UploadSpill
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import PayloadAssembler, payload_chunks
from fl_server import cli
from fl_server.memory import MIN_WINDOW, attach_spill, global_bytes, plan_upload_memory

SHARED = (Kind.SHARED_TENSORS, "")


def aggregator(name: str = "fedmedian"):
    cls = load_method(name)
    method = cls(MethodContext(TrainConfig(), cls.Params()))
    return method.server(method.build_models())


def received(payload: Payload) -> Payload:
    """``payload`` as the server holds it after the wire: views of one receive buffer."""
    encoded = encode(payload)
    assembler = PayloadAssembler(encoded.manifest, 1 << 30, 1 << 16)
    for _, chunk in payload_chunks(encoded, 1 << 16):
        assembler.add(chunk)
    return assembler.finish()


def uploads(agg, count: int, seed: int = 0) -> list[Payload]:
    """Seeded uploads around the global, a bfloat16 and an int64 tensor in a second
    section (dtypes the spill file must lay out and map back)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tensors = {name: value + torch.randn(value.shape, generator=generator)
                   if value.is_floating_point() else value.clone()
                   for name, value in agg.state[SHARED].items()}
        extra = {"half": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
                 "count": torch.randint(0, 9, (4,), generator=generator),
                 "empty": torch.zeros(0)}
        out.append(received(Payload([Section(Kind.SHARED_TENSORS, "", tensors),
                                     Section(Kind.CONTROL, "", extra)])))
    return out


def run_round(agg, payloads: list[Payload], round_number: int = 1) -> dict:
    edges = [f"e{i}" for i in range(len(payloads))]
    agg.begin_round(round_number, edges, len(edges))
    for edge, payload in zip(edges, payloads, strict=True):
        agg.accept(edge, payload, 1.0 + len(edge))
    return agg.finish()


def test_spilled_uploads_learn_the_same_bits_and_leave_no_file(tmp_path):
    in_ram, on_disk = aggregator(), aggregator()
    on_disk.spill = UploadSpill(tmp_path / "uploads", 1 << 30)
    payloads = uploads(in_ram, 5)
    edges = [f"e{i}" for i in range(5)]
    on_disk.begin_round(1, edges, 5)
    for edge, payload in zip(edges, payloads, strict=True):
        on_disk.accept(edge, payload, 2.0)
    files = sorted(p.name for p in (tmp_path / "uploads").iterdir())
    assert files == [f"r000001-{e}.safetensors" for e in edges]
    # What is kept is the bytes received, mapped from the file, not a clone in RAM.
    for edge, payload in zip(edges, payloads, strict=True):
        kept, weight = on_disk.uploads[edge]
        assert weight == 2.0
        assert [(s.kind, s.name, list(s.tensors)) for s in kept.sections] == \
               [(s.kind, s.name, list(s.tensors)) for s in payload.sections]
        for mine, theirs in zip(kept.sections, payload.sections, strict=True):
            for name, value in theirs.tensors.items():
                assert mine.tensors[name].dtype == value.dtype
                assert torch.equal(mine.tensors[name], value)
    figures = on_disk.finish()
    assert figures == run_round(in_ram, payloads)
    assert list((tmp_path / "uploads").iterdir()) == [] and on_disk.uploads == {}
    ram, disk = in_ram.state_tensors(), on_disk.state_tensors()
    assert ram.keys() == disk.keys()
    for key, value in ram.items():
        assert value.dtype == disk[key].dtype and torch.equal(value, disk[key]), key


def test_a_spilled_view_is_read_from_its_file_not_its_map(tmp_path):
    """``UploadSpill.read`` copies a slice of a kept upload (any dtype, any offset) with a
    read of the file, bytes equal to the mapped view; a tensor no spilled file holds, or
    an output of another size, is not its to read (False, nothing copied)."""
    spill = UploadSpill(tmp_path / "uploads", 1 << 30)
    kept = spill.keep(1, "e0", uploads(aggregator(), 1)[0])
    for section in kept.sections:
        for name, tensor in section.tensors.items():
            flat = tensor.reshape(-1)
            if not flat.numel():
                continue  # an empty tensor has no bytes on disk (nor a map)
            for start, end in ((0, flat.numel()), (1, max(1, flat.numel() - 1))):
                view = flat[start:end]
                out = torch.full_like(view, 7)
                assert spill.read(view, out), name
                assert torch.equal(out.view(torch.uint8), view.view(torch.uint8)), name
    assert not spill.read(torch.ones(3), torch.empty(3))
    some = kept.sections[0].tensors
    first = next(iter(some.values())).reshape(-1)
    assert not spill.read(first[:4], torch.empty(3, dtype=first.dtype))


def test_an_aborted_round_removes_its_files(tmp_path):
    agg = aggregator()
    agg.spill = UploadSpill(tmp_path / "uploads", 1 << 30)
    agg.begin_round(1, ["e0", "e1"], 2)
    snapshot = agg.snapshot_round()
    for i, payload in enumerate(uploads(agg, 2)):
        agg.accept(f"e{i}", payload, 1.0)
    assert len(list((tmp_path / "uploads").iterdir())) == 2
    agg.restore_round(snapshot)  # what the engine does when a phase cannot close
    assert list((tmp_path / "uploads").iterdir()) == [] and agg.uploads == {}


def test_the_disk_bound_refuses_by_name_and_writes_nothing(tmp_path):
    agg = aggregator()
    first, second = uploads(agg, 2)
    size = sum(s.raw_bytes for s in first.sections)
    agg.spill = UploadSpill(tmp_path / "uploads", size + size // 2)
    agg.begin_round(1, ["e0", "e1"], 2)
    agg.accept("e0", first, 1.0)
    with pytest.raises(ValueError, match=r"edge e1: .* beyond server\.max_spill_bytes="):
        agg.accept("e1", second, 1.0)
    assert [p.name for p in (tmp_path / "uploads").iterdir()] == ["r000001-e0.safetensors"]
    assert list(agg.uploads) == ["e0"]
    agg.accept("e0", second, 1.0)  # the same edge's upload replaces its own: within bound
    assert torch.equal(agg.uploads["e0"][0].sections[1].tensors["count"],
                       second.sections[1].tensors["count"])


def test_a_crashed_servers_files_are_removed_at_start(tmp_path):
    directory = tmp_path / "state" / "uploads"
    directory.mkdir(parents=True)
    (directory / "r000003-e0.safetensors").write_bytes(b"left by a crash")
    agg = aggregator()
    attach_spill(agg, ServerConfig(checkpoint_dir=str(tmp_path / "state"), max_spill_bytes=1 << 20))
    assert agg.spill is not None and agg.spill.max_bytes == 1 << 20
    assert list(directory.iterdir()) == []
    plain = aggregator()
    attach_spill(plain, ServerConfig(checkpoint_dir=str(tmp_path / "state"), spill_uploads=False))
    assert plain.spill is None
    streaming = aggregator("fedavg")
    attach_spill(streaming, ServerConfig(checkpoint_dir=str(tmp_path / "state")))
    assert streaming.spill is not None  # server.spill_sums: on by default
    in_ram = aggregator("fedavg")
    attach_spill(in_ram, ServerConfig(checkpoint_dir=str(tmp_path / "state"), spill_sums=False))
    assert in_ram.spill is None


def test_the_budget_gives_slots_and_fixed_windows():
    agg = aggregator()
    model = global_bytes(agg)
    assert model == sum(t.numel() * t.element_size() for t in agg.state[SHARED].values())
    plan = plan_upload_memory(ServerConfig(max_upload_memory=model + model // 2,
                                           max_concurrent_uploads=4), model)
    assert (plan.slots, plan.window) == (1, MIN_WINDOW)  # one upload fits, not two
    assert ("grpc.http2.bdp_probe", 0) in plan.grpc_options()
    assert ("grpc.http2.lookahead_bytes", MIN_WINDOW) in plan.grpc_options()
    plan = plan_upload_memory(ServerConfig(max_upload_memory=10 * model + 100 * (1 << 20),
                                           max_concurrent_uploads=4, max_edges=100), model)
    # Every call 100 edges may have open (CALLS_PER_EDGE each) gets its window.
    assert plan.slots == 4 and plan.window == (6 * model + 100 * (1 << 20)) // 400
    assert plan_upload_memory(ServerConfig(), model).budget > model  # sized from the machine
    with pytest.raises(ValueError, match=r"server\.max_upload_memory=65536 bytes cannot hold "
                                         r"one upload of this model \(181320 bytes\)"):
        plan_upload_memory(ServerConfig(max_upload_memory=65536), model)


@pytest.mark.parametrize("flags, message", [
    (["--max-upload-memory", "-1"], "server.max_upload_memory must be 0"),
    (["--max-upload-memory", "1000"], "server.max_upload_memory must be 0"),
    (["--max-spill-bytes", "-5"], "server.max_spill_bytes must be >= 0"),
    (["--max-download-memory", "1000"], "server.max_download_memory must be 0"),
    (["--max-upload-memory", "65536"], "server.max_upload_memory=65536 bytes cannot hold"),
])
def test_nonsense_values_exit_2_naming_the_key(flags, message, tmp_path):
    err = io.StringIO()
    with redirect_stderr(err):
        status = cli.main(["--insecure", "--port", "0", "--checkpoint-dir", str(tmp_path / "s"),
                           "--method", "fedmedian", *flags])
    assert status == 2 and message in err.getvalue(), err.getvalue()


def test_spilling_is_on_by_default_and_the_flag_turns_it_off():
    base = ["--insecure", "--method", "fedmedian"]
    assert cli.resolve(cli.build_parser().parse_args(base))[0].spill_uploads is True
    off = cli.resolve(cli.build_parser().parse_args([*base, "--no-spill-uploads"]))[0]
    assert off.spill_uploads is False
    assert cli.resolve(cli.build_parser().parse_args(base))[0].spill_sums is True
    off = cli.resolve(cli.build_parser().parse_args([*base, "--no-spill-sums"]))[0]
    assert off.spill_sums is False and off.spill_uploads is True


def test_a_failed_write_refuses_the_upload_by_name(tmp_path):
    """A write that fails (a full disk; here the folder replaced by a file, which fails
    for root too) costs the upload, never the server."""
    agg = aggregator()
    agg.spill = UploadSpill(tmp_path / "uploads", 1 << 30)
    (tmp_path / "uploads").rmdir()
    (tmp_path / "uploads").write_bytes(b"")
    agg.begin_round(1, ["e0"], 1)
    with pytest.raises(ValueError, match=r"edge e0: .* \(server\.spill_uploads\)"):
        agg.accept("e0", uploads(agg, 1)[0], 1.0)
    assert agg.uploads == {}


def test_a_tiny_budget_queues_uploads_and_all_complete(cluster, tmp_path):
    """256 KiB holds one LeNet upload (181 KB): one slot for two edges uploading at
    once; the round still takes both, spilled to disk and removed."""
    dirs = write_edge_dirs(tmp_path, 2, per_edge=40)
    server = cluster.server("--method", "fedmedian", "--rounds", "1", "--min-edges", "2",
                            "--eval-every", "0", "--max-concurrent-uploads", "3",
                            "--max-upload-memory", str(256 << 10), "--log-level", "INFO")
    edges = [cluster.edge(d, f"e{i}") for i, d in enumerate(dirs)]
    assert [e.wait() for e in edges] == [0, 0]
    assert server.wait() == 0
    log = server.log()
    assert "upload memory: 262144 bytes (server.max_upload_memory): 1 upload slot(s)" in log
    assert f"{MIN_WINDOW}-byte gRPC stream windows" in log
    history = read_history(tmp_path / "server-state")
    assert [r["train"]["received"] for r in history["rounds"]] == [["e0", "e1"]]
    assert list(Path(tmp_path / "server-state" / "uploads").iterdir()) == []


@pytest.mark.parametrize("trim", [0.0, 0.2])
@pytest.mark.parametrize("count", [4, 7])
def test_the_median_in_slices_is_the_median_of_whole_tensors(trim, count, tmp_path, monkeypatch):
    """FedMedian sorts a slice of coordinates at a time and gives back the spilled pages
    it read: the same bits as sorting whole stacked tensors (its computation before)."""
    from fedattn_shared.methods import fedmedian

    monkeypatch.setattr(fedmedian, "STEP_BYTES", 4096)  # many slices per LeNet tensor
    cls = load_method("fedmedian")
    method = cls(MethodContext(TrainConfig(), cls.Params(trim_fraction=trim)))
    agg = method.server(method.build_models())
    agg.spill = UploadSpill(tmp_path / "uploads", 1 << 30)
    payloads = uploads(agg, count, seed=count)
    expected = {}
    for name, x in agg.state[SHARED].items():
        ordered = torch.stack([p.tensors(*SHARED)[name].float() for p in payloads]).sort(0).values
        if trim > 0:
            cut = int(trim * count)
            value = ordered[cut : count - cut].to(torch.float64).mean(dim=0)
        elif count % 2:
            value = ordered[(count - 1) // 2]
        else:
            value = (ordered[count // 2 - 1].to(torch.float64) + ordered[count // 2]) / 2
        expected[name] = value.to(x.dtype)
    run_round(agg, payloads)
    for name, value in expected.items():
        assert torch.equal(agg.state[SHARED][name], value), name


def test_an_upload_beyond_the_disk_bound_is_refused_over_the_wire(tmp_path):
    """Two raw edges speak the protocol to a FedMedian server whose spill holds one LeNet
    upload (181,320 bytes of 200,000): the second is refused naming the key and dropped,
    the first is the round's median bit for bit, its file is gone once the round
    closes, and the server serves on."""
    from conftest import Cluster
    from rawedge import RawEdge, shifted, train_messages

    cluster = Cluster(tmp_path)
    edges: list[RawEdge] = []
    try:
        server = cluster.server("--model", "lenet-bn", "--method", "fedmedian", "--rounds",
                                "50", "--eval-every", "0", "--min-edges", "2",
                                "--round-timeout", "30", "--max-spill-bytes", "200000")
        edges = [RawEdge(cluster.port, prefix=name) for name in ("first", "second")]
        for edge in edges:
            edge.connect()
        first, second = edges
        tasks = [edge.next_task() for edge in edges]
        kept = shifted(tasks[0].globals, 0.5)
        assert first.submit(train_messages(first, tasks[0], kept)).accepted
        reply = second.submit(train_messages(second, tasks[1], shifted(tasks[1].globals, 1.0)))
        assert not reply.accepted
        assert "beyond server.max_spill_bytes=200000" in reply.reason, reply.reason
        after = first.next_task()
        assert after.header.round == tasks[0].header.round + 1
        for name, value in kept.items():
            assert torch.equal(after.globals[name], value), name
        path = tmp_path / "server-state" / "history.json"

        def written():
            rounds = read_history(path.parent)["rounds"] if path.exists() else []
            return next((r for r in rounds if r["round"] == tasks[0].header.round), None)

        record = wait_for(written, 30, "the round in history.json")
        assert record["train"]["received"] == [first.edge_id]
        assert second.edge_id in record["train"]["dropped"]
        assert list((tmp_path / "server-state" / "uploads").iterdir()) == []
        assert server.popen.poll() is None and "Traceback" not in server.log()
    finally:
        for edge in edges:
            edge.close()
        cluster.close()


# ---- a streaming mean's uploads spilled, summed a slice at a time at the close ---------
def streaming_uploads(agg, count: int, seed: int = 0) -> list[Payload]:
    """``uploads`` plus, on every other edge, the model's section as separate tensors in
    another order (no flat vector: what a decoded or locally built upload looks like),
    and a float64 section whose values span 1e-8..1e3 (where a plain sum rounds)."""
    generator = torch.Generator().manual_seed(seed + 100)
    out = []
    for i, payload in enumerate(uploads(agg, count, seed)):
        sections = list(payload.sections)
        if i % 2:
            shared = sections[0]
            sections[0] = Section(shared.kind, shared.name,
                                  {k: v.clone() for k, v in reversed(shared.tensors.items())})
        wide = torch.randn(37, generator=generator, dtype=torch.float64) \
            * 10 ** torch.randint(-8, 4, (37,), generator=generator)
        sections.append(Section(Kind.STAT_VECTORS, "wide", {"v": wide}))
        out.append(Payload(sections))
    return out


def streaming_round(agg, payloads: list[Payload], weights: list[float]) -> dict:
    edges = [f"e{i}" for i in range(len(payloads))]
    agg.begin_round(1, edges, len(edges))
    for edge, payload, weight in zip(edges, payloads, weights, strict=True):
        agg.accept(edge, payload, weight)
    return agg.finish()


def assert_same_state(a, b) -> None:
    left, right = a.state_tensors(), b.state_tensors()
    assert left.keys() == right.keys()
    for key, value in left.items():
        assert value.dtype == right[key].dtype and value.shape == right[key].shape, key
        assert torch.equal(value, right[key]), key


@pytest.mark.parametrize("method", ["fedavg", "fedadam"])
@pytest.mark.parametrize("slice_", [7, 1 << 19])
def test_a_spilled_streaming_mean_gives_the_in_memory_bits(method, slice_, tmp_path,
                                                            monkeypatch):
    """Several edges and weights (up to 1e6), float32, bfloat16, int64, float64 and empty
    tensors, a section that arrives as separate tensors in another order: the mean summed
    from disk a slice at a time (7 coordinates: slices cut across tensors) has the bits
    of the in-memory compensated sum, FedAdam's step over it too; no file is left."""
    from fedattn_shared.methods import exact_sum

    monkeypatch.setattr(exact_sum, "SPILL_SLICE", slice_)
    in_ram, on_disk = aggregator(method), aggregator(method)
    on_disk.spill = UploadSpill(tmp_path / "uploads", 1 << 30)
    weights = [1.0, 3.0, 1e6, 17.0, 2.5]
    for round_seed in (0, 1):  # a second round: the moments and the global moved on
        payloads = streaming_uploads(in_ram, 5, seed=round_seed)
        expected = streaming_round(in_ram, payloads, weights)
        edges = [f"e{i}" for i in range(5)]
        on_disk.begin_round(1, edges, 5)
        for i, (edge, payload) in enumerate(zip(edges, payloads, strict=True)):
            on_disk.accept(edge, payload, weights[i])
            assert on_disk._sum == {}  # nothing model-sized kept through the round
        assert len(list((tmp_path / "uploads").iterdir())) == 5
        assert on_disk.finish() == expected
        assert list((tmp_path / "uploads").iterdir()) == []
        assert_same_state(in_ram, on_disk)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_spilled_close_gives_the_same_bits_on_any_number_of_threads(workers, tmp_path,
                                                                       monkeypatch):
    """The close's slices summed by 1 or 3 threads (slices of 7 coordinates cut across
    tensors of several dtypes, each thread taking every third): the bits of the
    in-memory sum either way."""
    from fedattn_shared.methods import exact_sum

    monkeypatch.setattr(exact_sum, "SPILL_SLICE", 7)
    monkeypatch.setattr(exact_sum, "sum_workers", lambda: workers)
    in_ram, on_disk = aggregator("fedavg"), aggregator("fedavg")
    on_disk.spill = UploadSpill(tmp_path / "uploads", 1 << 30)
    payloads = streaming_uploads(in_ram, 4)
    weights = [2.0, 1e6, 3.0, 0.5]
    assert streaming_round(on_disk, payloads, weights) == streaming_round(in_ram, payloads,
                                                                          weights)
    assert_same_state(in_ram, on_disk)


def test_a_spilled_close_opens_one_upload_at_a_time(tmp_path):
    """A round of more spilled uploads than the process may open files: the close reads
    them one descriptor at a time (all at once, a server with 1,000 uploaders and the
    default limit of 1,024 would fail its close)."""
    import os
    import resource

    in_ram, on_disk = aggregator("fedavg"), aggregator("fedavg")
    on_disk.spill = UploadSpill(tmp_path / "uploads", 1 << 30)
    payloads = uploads(in_ram, 3) * 20  # 60 uploads
    weights = [float(i + 1) for i in range(len(payloads))]
    expected = streaming_round(in_ram, payloads, weights)
    edges = [f"e{i}" for i in range(len(payloads))]
    on_disk.begin_round(1, edges, len(edges))
    for edge, payload, weight in zip(edges, payloads, weights, strict=True):
        on_disk.accept(edge, payload, weight)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 20, hard))
    try:
        figures = on_disk.finish()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert figures == expected
    assert_same_state(in_ram, on_disk)


def test_a_spilled_streaming_round_aborts_and_refuses_by_name(tmp_path):
    """The disk bound refuses the upload beyond it by name and keeps nothing of it; an
    aborted round removes its files and leaves the global as it was; the next round
    gives the in-memory bits."""
    agg, in_ram = aggregator("fedavg"), aggregator("fedavg")
    first, second, third = streaming_uploads(agg, 3)
    size = sum(s.raw_bytes for s in first.sections)
    agg.spill = UploadSpill(tmp_path / "uploads", 2 * size + size // 2)
    agg.begin_round(1, ["e0", "e1", "e2"], 3)
    snapshot = agg.snapshot_round()
    before = {k: v.clone() for k, v in agg.state_tensors().items()}
    agg.accept("e0", first, 1.0)
    agg.accept("e1", second, 2.0)
    with pytest.raises(ValueError, match=r"edge e2: .* beyond server\.max_spill_bytes="):
        agg.accept("e2", third, 1.0)
    assert len(list((tmp_path / "uploads").iterdir())) == 2 and agg._count == 2
    agg.restore_round(snapshot)  # what the engine does when a phase cannot close
    assert list((tmp_path / "uploads").iterdir()) == []
    assert all(torch.equal(v, before[k]) for k, v in agg.state_tensors().items())
    assert agg.finish() == {"aggregated": 0, "total_weight": 0.0}
    streaming_round(agg, [first, third], [1.0, 4.0])
    streaming_round(in_ram, [first, third], [1.0, 4.0])
    assert_same_state(in_ram, agg)


def test_a_spilled_streaming_mean_takes_a_secure_sum_and_refuses_a_bad_size(tmp_path):
    """Secure aggregation's sum (``accept_sum``) never touches the disk and gives the
    in-memory bits; an upload whose tensor has another size than the round's first is
    refused by name before anything is written."""
    agg, in_ram = aggregator("fedavg"), aggregator("fedavg")
    agg.spill = UploadSpill(tmp_path / "uploads", 1 << 30)
    sums = Payload([Section(Kind.SHARED_TENSORS, "",
                            {k: v * 3 for k, v in agg.state[SHARED].items()})])
    for target in (agg, in_ram):
        target.begin_round(1, ["e0", "e1"], 2)
        target.accept_sum("train", sums, 3.0, 2)
        target.finish()
    assert_same_state(in_ram, agg)
    assert list((tmp_path / "uploads").iterdir()) == []
    good = streaming_uploads(agg, 1)[0]
    bad = Payload([Section(Kind.SHARED_TENSORS, "",
                           {k: v.reshape(-1)[:1].clone() if i == 0 else v
                            for i, (k, v) in enumerate(good.tensors(*SHARED).items())})])
    agg.begin_round(2, ["e0", "e1"], 2)
    agg.accept("e0", good, 1.0)
    with pytest.raises(ValueError, match=r"edge e1: tensor '.*' of section shared_tensors:'' has 1 "
                                         r"values, this round's first upload \d+"):
        agg.accept("e1", bad, 1.0)
    assert len(list((tmp_path / "uploads").iterdir())) == 1 and agg._count == 1

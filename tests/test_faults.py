"""Faults with real processes: kills at awkward moments, slow and absent peers, bad disks."""

from __future__ import annotations

import errno
import json
import os
import signal

import pytest
from conftest import free_port, read_history, serving, write_edge_dirs

from fedattn_shared.state import load_tensors
from fl_server.history import tensors_digest


def test_edge_killed_during_upload_costs_only_its_task(cluster, tmp_path):
    # Tiny chunks make the upload of the 1.5 M-parameter model take long enough to hit.
    dirs = write_edge_dirs(tmp_path, 3, per_edge=40, size=32, channels=3)
    server = cluster.server("--method", "fedavg", "--model", "mobilenet-v3-small",
                            "--in-channels", "3", "--image-size", "32", "--rounds", "2",
                            "--min-edges", "3", "--quorum", "2", "--chunk-bytes", "1024",
                            "--eval-every", "0")
    edges = [cluster.edge(d, f"e{i}") for i, d in enumerate(dirs)]
    edges[2].wait_log("round 1: trained")
    edges[2].kill()
    server.wait_log("round 1 done")
    restarted = cluster.edge(dirs[2], "e2")
    assert [e.wait() for e in (edges[0], edges[1], restarted)] == [0, 0, 0]
    assert server.wait() == 0
    round1 = read_history(tmp_path / "server-state")["rounds"][0]
    assert round1["aggregate"]["aggregated"] == 2
    reason = round1["train"]["dropped"].get("e2", "")
    assert "disconnected" in reason or "bad upload" in reason or "closed" in reason


def test_server_killed_mid_round_resumes_from_last_checkpoint(cluster, tmp_path):
    # Enough data that round 3's training outlasts the wait for round 2's "done" below.
    dirs = write_edge_dirs(tmp_path, 2, per_edge=2000)
    port = free_port()
    args = ("--method", "scaffold", "--rounds", "4", "--min-edges", "2")
    server = cluster.server(*args, port=port)
    edges = [cluster.edge(d, f"e{i}") for i, d in enumerate(dirs)]
    server.wait_log("round 3 train: 2 task(s)")
    # Round 2's checkpoint is written while round 3's tasks go out; "done" follows it.
    server.wait_log("round 2 done")
    server.kill()  # the round-3 aggregate is being built; round 2 is the last checkpoint
    checkpoint = tmp_path / "server-state"
    tensors, _ = load_tensors(checkpoint / "rounds" / "000002" / "state.safetensors")
    for edge in edges:
        edge.wait_log("unavailable")  # edges back off while the server is away
    restarted = cluster.server(*args, "--resume", port=port, name="server2")
    restarted.wait_log("resumed from round 2")
    assert f"state digest {tensors_digest(tensors)}" in restarted.log()
    assert [e.wait() for e in edges] == [0, 0]
    assert restarted.wait() == 0
    assert [r["round"] for r in read_history(checkpoint)["rounds"]] == [1, 2, 3, 4]
    for edge in edges:  # not just "bad or expired session": what happened, and what next
        assert "restarted, or" in edge.log(), edge.log()[-3000:]


def test_slow_edge_is_dropped_at_the_deadline_and_comes_back(cluster, tmp_path):
    """An edge that stalls past the deadline is dropped for that round, its late result is
    refused, not aggregated, and it is handed work again after. The stall is a frozen
    device (SIGSTOP while it holds its task): late by construction, on any machine, which
    an edge given "more data than the deadline allows" is not."""
    fast = write_edge_dirs(tmp_path, 2, per_edge=40)
    # ~300 local steps: a second or two of training, after round 1's model download and
    # first steps (~2 s here), the window in which it is frozen before it can submit.
    slow_dir = write_edge_dirs(tmp_path / "slow", 1, per_edge=6000)[0]
    # More rounds than the test waits for: the server is still running (and refusing) when
    # the frozen edge finally submits.
    server = cluster.server("--method", "fedavg", "--rounds", "1000", "--min-edges", "3",
                            "--round-timeout", "8", "--local-epochs", "2")
    edges = [cluster.edge(d, f"fast{i}") for i, d in enumerate(fast)]
    slow = cluster.edge(slow_dir, "slow")
    server.wait_log("round 1 train: 3 task(s)")
    os.killpg(slow.popen.pid, signal.SIGSTOP)
    try:
        server.wait_log("round 1 train: dropped slow (deadline)", timeout=60)
    finally:
        os.killpg(slow.popen.pid, signal.SIGCONT)
    assert "round 1: trained" not in slow.log()
    # Thawed, it finishes round 1's training; its result is refused, not aggregated.
    slow.wait_log("round 1 train result refused", timeout=120)
    # It comes back: a later round aggregates its result.
    mark = server.mark()
    done = server.logged(mark, "done in", "3/3 results", timeout=120)
    later = int(done.split("round ")[1].split()[0])
    server.wait_log(f"checkpoint round {later} written", timeout=60)
    server.kill()
    assert server.popen.returncode != 0 and all(e.popen.poll() is None for e in edges)
    rounds = {r["round"]: r for r in read_history(tmp_path / "server-state")["rounds"]}
    assert rounds[1]["train"]["dropped"].get("slow") == "deadline"
    assert "slow" in rounds[later]["train"]["received"] and later > 1
    # The fast edges make the deadline; on a machine loaded by other work one of them can
    # miss it in some round too, and is then dropped by the same rule, never half-counted.
    for r in rounds.values():
        received, dropped = r["train"]["received"], r["train"]["dropped"]
        assert set(received) | set(dropped) == {"fast0", "fast1", "slow"}
        assert not set(received) & set(dropped)
        assert all(why == "deadline" for why in dropped.values())
        assert r["aggregate"]["aggregated"] == len(received)


def test_unwritable_state_dir_is_a_clear_error(tmp_path):
    from fl_edge.daemon import EdgeDaemon, EdgeExit, EdgeOptions

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the state dir should be")
    data = write_edge_dirs(tmp_path, 1)[0]
    with pytest.raises(EdgeExit, match="not-a-dir"):
        EdgeDaemon(EdgeOptions(server="127.0.0.1:1", data_dir=data, state_dir=blocker / "state"))


def test_full_disk_keeps_the_old_state_and_names_the_path(tmp_path, monkeypatch):
    """A disk that fills up mid-run: the edge stops with the path named; its last state
    file is untouched and still loads."""

    from fedattn_shared.config import ServerConfig, TrainConfig
    from fedattn_shared.methods import MethodContext, load_method
    from fl_edge import store as store_module
    from fl_edge.daemon import EdgeDaemon, EdgeExit, EdgeOptions
    from fl_server.app import ServerApp

    data = write_edge_dirs(tmp_path, 1)[0]
    train = TrainConfig()
    method = load_method("fedbn")(MethodContext(train, load_method("fedbn").Params()))
    app = ServerApp(ServerConfig(method="fedbn", rounds=3, min_edges=1, host="127.0.0.1", port=0,
                                 checkpoint_dir=str(tmp_path / "server"), poll_timeout=2),
                    train, method)
    with serving(app) as port:
        state_dir = tmp_path / "state"
        daemon = EdgeDaemon(EdgeOptions(server=f"127.0.0.1:{port}", data_dir=data,
                                        state_dir=state_dir, name="solo", progress=False))
        real_save = store_module.save_tensors
        saves = []

        def filling_disk(path, tensors, metadata=None, durable=True):
            if path.name == "private.safetensors" and saves:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            real_save(path, tensors, metadata, durable)
            if path.name == "private.safetensors":
                saves.append(path.read_bytes())

        monkeypatch.setattr(store_module, "save_tensors", filling_disk)
        with pytest.raises(EdgeExit, match=r"No space left on device.*intact"):
            daemon.run()
        assert (state_dir / "private.safetensors").read_bytes() == saves[0]
        load_tensors(state_dir / "private.safetensors")


@pytest.mark.slow
def test_edge_killed_during_secure_aggregation_is_recovered_from_shares(cluster, tmp_path):
    """SIGKILL after the key exchange, while the edge trains in the masked phase: its pairwise
    masks are rebuilt from the survivors' shares, so round 1 still unmasks the survivors'
    sum; the restarted edge takes part in the next rounds' protocol from scratch."""
    dirs = write_edge_dirs(tmp_path, 3, per_edge=40)
    # The victim's local training is long enough for the kill to land inside it.
    dirs.append(write_edge_dirs(tmp_path / "slow", 1, per_edge=6000)[0])
    server = cluster.server("--method", "fedavg", "--secagg", "--secagg-graph", "full",
                            "--rounds", "3", "--min-edges", "4", "--eval-every", "0")
    edges = [cluster.edge(d, f"e{i}") for i, d in enumerate(dirs)]
    server.wait_log("round 1 train: 4 task(s)")
    edges[3].kill()
    server.wait_log("round 1 done")
    restarted = cluster.edge(dirs[3], "e3")
    assert [e.wait() for e in (*edges[:3], restarted)] == [0, 0, 0, 0]
    assert server.wait() == 0
    rounds = read_history(tmp_path / "server-state")["rounds"]
    assert [r["aggregate"]["secagg-share"]["shared"] for r in rounds] == [4, 4, 4]
    assert rounds[0]["train"]["dropped"] == {"e3": "disconnected"}
    assert [(r["aggregate"]["secagg-unmask"]["unmasked"],
             r["aggregate"]["secagg-unmask"]["recovered_dropouts"]) for r in rounds] == [
        (3, 1), (4, 0), (4, 0)]
    assert not any("secagg-aborted" in r["aggregate"] for r in rounds)


def test_a_checkpoint_written_before_a_setting_existed_resumes_and_a_changed_one_does_not(
        cluster, tmp_path):
    """A release that adds a [train] key still resumes its predecessor's checkpoints: the
    stored config lacks the key, which reads as its default (what that run had). A stored
    config whose value differs is refused, as any other changed setting is."""
    (data,) = write_edge_dirs(tmp_path, 1, per_edge=40)
    args = ("--method", "fedavg", "--min-edges", "1", "--eval-every", "0")
    server = cluster.server(*args, "--rounds", "1")
    edge = cluster.edge(data, "e0")
    assert server.wait() == 0 and edge.wait() == 0
    state_file = tmp_path / "server-state" / "rounds" / "000001" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["config"]["train"]["input_range"] == "symmetric"
    del state["config"]["train"]["input_range"]  # as written before the key existed
    state_file.write_text(json.dumps(state))
    older = cluster.server(*args, "--rounds", "2", "--resume", name="older")
    older.wait_log("resumed from round 1")
    older.kill()
    state["config"]["train"]["input_range"] = "unit"  # a setting that did change
    state_file.write_text(json.dumps(state))
    with pytest.raises(AssertionError, match="(?s)server exited .*checkpoint was written "
                                             "with a different configuration"):
        cluster.server(*args, "--rounds", "2", "--resume", name="changed")

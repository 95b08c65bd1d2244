"""End to end over real gRPC: fl-server and fl-edge as separate processes on loopback."""

from __future__ import annotations

import json
import re
import signal
import stat
import urllib.request

import pytest
import torch
from conftest import read_history, wait_for, write_edge_dirs

from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.state import load_tensors
from fl_edge.store import PrivateStore, private_digest
from fl_server.history import tensors_digest


def test_fedavg_three_edges_account_every_byte(cluster, tmp_path):
    dirs = write_edge_dirs(tmp_path, 3, per_edge=200)
    server = cluster.server("--method", "fedavg", "--rounds", "2", "--min-edges", "3",
                            "--local-epochs", "4", "--lr", "0.05")
    edges = [cluster.edge(d, f"cam{i}") for i, d in enumerate(dirs)]
    assert [e.wait() for e in edges] == [0, 0, 0]
    assert server.wait() == 0

    history = read_history(tmp_path / "server-state")
    assert [r["round"] for r in history["rounds"]] == [1, 2]
    assert history["manifest"]["method"] == "fedavg"
    assert history["manifest"]["train"]["model"] == "lenet-bn"
    for record in history["rounds"]:
        assert record["train"]["received"] == ["cam0", "cam1", "cam2"]
        per_edge = record["evaluation"]["per_edge"]
        assert sorted(per_edge) == ["cam0", "cam1", "cam2"]
        for figures in per_edge.values():  # sums only: no --eval-detail
            assert "confusion" not in figures["test"]
            assert 0 <= figures["test"]["correct"] <= figures["test"]["n"] > 0
        up = record["bytes"]["up"]["shared_tensors"]
        assert up["raw"] > 0 and 1.0 <= up["wire"] / up["raw"] <= 1.01
    # Round 2 must have learned something on these easy generated classes.
    assert history["rounds"][-1]["evaluation"]["summary"]["test"]["mean_accuracy"] > 0.5

    # Private state: atomic file, owner-only, and identity kept.
    for i in range(3):
        state = tmp_path / f"state-cam{i}"
        for name in ("private.safetensors", "identity.json"):
            assert stat.S_IMODE((state / name).stat().st_mode) == 0o600
    manifest = (tmp_path / "server-state" / "manifest.json").read_text()
    assert '"round": 2' in manifest


def test_prometheus_counts_bytes_by_kind_direction_edge(cluster, tmp_path):
    dirs = write_edge_dirs(tmp_path, 2)
    # Rounds to spare after the scrape: an edge closes its metrics port when it hears
    # "run over", and on tiny data the last rounds take well under a second.
    server = cluster.server("--method", "fedavg", "--rounds", "6", "--min-edges", "2",
                            "--metrics-port", "0", "--metrics-linger", "30")
    edges = [cluster.edge(d, f"e{i}", "--metrics-port", "0") for i, d in enumerate(dirs)]
    server.wait_log("round 2 done")
    edge_port = re.search(r"metrics on :(\d+)", edges[0].log()).group(1)
    edge_text = urllib.request.urlopen(f"http://127.0.0.1:{edge_port}/metrics").read().decode()
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    wire = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'fedattn_wire_bytes_total\{codec="none",direction="up",edge="e0",kind="shared_tensors"\}'
        r'() (\S+)', text)}
    assert wire and wire[""] > 0
    assert ('fedattn_raw_tensor_bytes_total{codec="none",direction="down",edge="e1",'
            'kind="shared_tensors"}') in text
    assert 'fedattn_eval_accuracy_mean{split="test"}' in text
    assert "round=" not in text  # the round is never a label
    # Participation, aggregation and checkpoint figures (names per Prometheus conventions).
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    assert samples['fedattn_edges_selected_total{phase="train"}'] >= 4
    assert samples['fedattn_edges_reported_total{phase="evaluate"}'] >= 4
    assert samples['fedattn_edges_dropped_total{phase="train",reason="deadline"}'] == 0
    assert samples['fedattn_phase_timeouts_total{phase="train"}'] == 0
    assert samples["fedattn_checkpoint_seconds_count"] >= 2 <= samples["fedattn_checkpoint_round"]
    assert samples['fedattn_aggregation_seconds_count{phase="train",stage="accept"}'] >= 4
    assert samples['fedattn_edge_last_reported_round{edge="e1"}'] >= 2
    assert samples['fedattn_edge_result{edge="e0",name="samples_per_second"}'] > 0
    edge = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in edge_text.splitlines() if line and not line.startswith("#")}
    assert edge['fedattn_edge_info{device="cpu",edge="e0"}'] == 1
    assert edge["fedattn_edge_last_success_round"] >= 2
    assert edge['fedattn_edge_submissions_total{phase="train",result="accepted"}'] >= 2
    assert edge["fedattn_edge_private_state_bytes"] > 0
    assert edge["fedattn_edge_peak_rss_bytes"] > 50e6 and edge["fedattn_edge_trained_samples_total"] > 0
    assert not any(name.startswith("fedattn_edge_gpu_memory") for name in edge)  # CUDA only
    assert [e.wait() for e in edges] == [0, 0]
    # After the run, /metrics stays up (--metrics-linger) with the last round in it;
    # SIGTERM ends the wait at once.
    server.wait_log("for 30s more (--metrics-linger)")
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    assert re.search(r"^fedattn_checkpoint_round 6(\.0)?$", text, re.M), text[-2000:]
    server.popen.send_signal(signal.SIGTERM)
    assert server.wait(timeout=10) == 0


@pytest.mark.parametrize("method", ["fedadam", "ditto"])
def test_server_optimizer_and_two_model_methods(cluster, tmp_path, method):
    dirs = write_edge_dirs(tmp_path, 2)
    server = cluster.server("--method", method, "--rounds", "2", "--min-edges", "2")
    edges = [cluster.edge(d, f"e{i}") for i, d in enumerate(dirs)]
    assert [e.wait() for e in edges] == [0, 0]
    assert server.wait() == 0
    history = read_history(tmp_path / "server-state")
    assert len(history["rounds"]) == 2
    assert history["rounds"][-1]["evaluate"]["received"] == ["e0", "e1"]
    tensors, _ = load_tensors(next((tmp_path / "server-state" / "rounds").glob("*/state.safetensors")))
    if method == "fedadam":
        # The Adam moments live in the server checkpoint; they never travel.
        assert any(k.startswith("opt:m:") for k in tensors)
        assert "opt" not in str(history["rounds"][-1]["bytes"])
    else:
        # Ditto's personal model never leaves the edge.
        assert not any("personal/" in k for k in tensors)
        assert all(k.startswith("global:shared_tensors::global/") for k in tensors)


def _digest_of_state_file(state_dir, method_name: str) -> str:
    method = load_method(method_name)(MethodContext(TrainConfig(), load_method(method_name).Params()))
    models = method.build_models()
    algo = method.edge(models, torch.device("cpu"))
    PrivateStore(state_dir).load(algo, method.fingerprint(models))
    return private_digest(algo)


def test_edge_killed_mid_round_rejoins_with_identical_private_state(cluster, tmp_path):
    dirs = write_edge_dirs(tmp_path, 3, per_edge=1500)
    server = cluster.server("--method", "fedbn", "--rounds", "4", "--min-edges", "3",
                            "--quorum", "2", "--round-timeout", "120")
    edges = [cluster.edge(d, f"e{i}") for i, d in enumerate(dirs)]
    server.wait_log("round 2 train: 3 task(s)")
    edges[2].kill()
    server.wait_log("dropped e2 (disconnected)")
    server.wait_log("round 2 done")
    saved = _digest_of_state_file(tmp_path / "state-e2", "fedbn")

    restarted = cluster.edge(dirs[2], "e2")
    restarted.wait_log("resumed private state")
    assert f"digest {saved}" in restarted.log()
    assert [e.wait() for e in (edges[0], edges[1], restarted)] == [0, 0, 0]
    assert server.wait() == 0
    history = read_history(tmp_path / "server-state")
    round2 = history["rounds"][1]
    assert round2["train"]["dropped"]["e2"] == "disconnected"
    assert len(round2["train"]["received"]) == 2
    assert "e2" in history["rounds"][-1]["evaluate"]["received"]


def test_server_killed_resumes_bit_identical(cluster, tmp_path):
    dirs = write_edge_dirs(tmp_path, 2)
    checkpoint = tmp_path / "server-state"
    # Enough rounds that the kill lands mid-run however fast rounds are.
    rounds = 20
    args = ("--method", "fedadam", "--rounds", str(rounds), "--min-edges", "2")
    server = cluster.server(*args)
    port = cluster.port
    edges = [cluster.edge(d, f"e{i}") for i, d in enumerate(dirs)]

    def checkpointed_round() -> int:
        manifest = checkpoint / "manifest.json"
        return json.loads(manifest.read_text())["round"] if manifest.exists() else 0

    wait_for(lambda: checkpointed_round() >= 2, 120, "round 2 checkpoint")
    server.kill()
    server.wait()
    killed_at = checkpointed_round()
    assert 2 <= killed_at < rounds
    tensors, _ = load_tensors(checkpoint / "rounds" / f"{killed_at:06d}" / "state.safetensors")
    saved = tensors_digest(tensors)

    restarted = cluster.server(*args, "--resume", port=port, name="server2")
    restarted.wait_log("resumed from round")
    assert f"resumed from round {killed_at} (state digest {saved})" in restarted.log()
    assert [e.wait() for e in edges] == [0, 0]
    assert restarted.wait() == 0
    history = read_history(checkpoint)
    assert [r["round"] for r in history["rounds"]] == list(range(1, rounds + 1))


def test_fresh_run_refuses_existing_checkpoint_and_bad_flags(cluster, tmp_path):
    dirs = write_edge_dirs(tmp_path, 1)
    server = cluster.server("--method", "fedavg", "--rounds", "1", "--min-edges", "1")
    edge = cluster.edge(dirs[0], "solo")
    assert edge.wait() == 0 and server.wait() == 0
    import subprocess
    import sys
    again = subprocess.run([sys.executable, "-m", "fl_server", "--insecure", "--checkpoint-dir",
                            str(tmp_path / "server-state"), "--port", "0"],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "--resume" in again.stderr
    bad = subprocess.run([sys.executable, "-m", "fl_server", "--insecure", "--quorum", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "server.quorum" in bad.stderr
    no_tls = subprocess.run([sys.executable, "-m", "fl_server"], capture_output=True, text=True,
                            timeout=60)
    assert no_tls.returncode == 2 and "--insecure" in no_tls.stderr


def test_stale_state_dir_at_join_names_the_folder_and_the_fix(cluster, tmp_path):
    """An edge whose --state-dir holds private state of another run is refused at join;
    it exits 2 naming that folder and the fix (a fresh --state-dir)."""
    dirs = write_edge_dirs(tmp_path, 1)
    server = cluster.server("--method", "fedbn", "--rounds", "1", "--min-edges", "1")
    edge = cluster.edge(dirs[0], "solo")
    assert edge.wait() == 0 and server.wait() == 0
    other = cluster.server("--method", "fedper", "--rounds", "1", "--min-edges", "1",
                           checkpoint="other-state", name="other")
    again = cluster.edge(dirs[0], "solo")
    assert again.wait() == 2
    assert f"--state-dir {tmp_path / 'state-solo'} belongs to another run" in again.log()
    assert "fresh --state-dir" in again.log()
    other.kill()

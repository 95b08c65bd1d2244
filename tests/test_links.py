"""Real daemons over a shaped link (``netlink``: two network namespaces, a token bucket, loss
by iptables, the delay by a packet relay between TUN devices): what a cellular edge's link
does to a round, done by the kernel.

Slow (minutes per test: the bytes really cross a 256 kbit/s link), so it is its own tier:
``make test-links`` (root; skipped with the reason where namespaces or tc are missing).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Proc, read_history, wait_for, write_edge_dirs
from netlink import SERVER_ADDRESS, Profile, shaped_link, unavailable

pytestmark = [pytest.mark.links, pytest.mark.slow]

WHY = unavailable()
CELLULAR = Profile(rate_kbit=256, loss_pct=1.0, delay_ms=200)


@pytest.mark.skipif(bool(WHY), reason=WHY or "available")
def test_the_link_delays_and_shapes(tmp_path):
    """The link itself: a TCP connect takes the round trip, and 200 kB take their time at
    the rate (what the tests below rely on, measured through the kernel's own sockets)."""
    probe = ("import socket, sys, time\n"
             "t = time.monotonic(); s = socket.create_connection((sys.argv[1], 9911), timeout=30)\n"
             "connect = time.monotonic() - t; t = time.monotonic()\n"
             "s.sendall(b'x' * 200_000); s.shutdown(socket.SHUT_WR); s.recv(1)\n"
             "print(connect, time.monotonic() - t)\n")
    sink = ("import socket\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', 9911)); s.listen(); c, _ = s.accept()\n"
            "while c.recv(65536): pass\n")
    with shaped_link(Profile(rate_kbit=256, delay_ms=200)) as link:
        server = Proc(link.wrap("server", [sys.executable, "-c", sink]), tmp_path / "sink.log")
        try:
            wait_for(lambda: b"9911" in subprocess.run(
                link.wrap("server", ["ss", "-ltn"]), capture_output=True).stdout, 30, "the sink")
            out = subprocess.run(
                link.wrap("edge", [sys.executable, "-c", probe, SERVER_ADDRESS]),
                capture_output=True, text=True, timeout=120, check=True).stdout.split()
        finally:
            server.close()
    connect, transfer = float(out[0]), float(out[1])
    assert 0.2 <= connect < 1.0, connect  # one round trip (plus the queue)
    assert 200_000 * 8 / 256_000 <= transfer < 3 * 200_000 * 8 / 256_000, transfer


@pytest.mark.skipif(bool(WHY), reason=WHY or "available")
@pytest.mark.timeout(1800)
def test_mobilenet_round_over_256_kbit_and_1_percent_loss(tmp_path):
    # MobileNetV3-Small (6.1 MB each way) over a 256 kbit/s link with a 200 ms round trip
    # that drops 1 % of its packets each way: the download comes in windows under
    # deadlines the edge derives from the server's terms, each message within the idle
    # deadline plus its size at the min rate, and the round completes with the edge's
    # result in it. The operator sets the rates a link this slow averages (half the
    # defaults').
    data = write_edge_dirs(tmp_path, 1, per_edge=64)[0]
    rates = ["--download-min-rate", "16384", "--upload-min-rate", "16384"]
    with shaped_link(CELLULAR) as link:
        ready = tmp_path / "server.ready.json"
        server = Proc(link.wrap("server", [
            sys.executable, "-m", "fl_server", "--insecure", "--host", "0.0.0.0", "--port", "0",
            "--ready-file", str(ready), "--checkpoint-dir", str(tmp_path / "server-state"),
            "--method", "fedavg", "--model", "mobilenet-v3-small", "--rounds", "1",
            "--min-edges", "1", "--eval-every", "0", "--local-epochs", "1",
            "--round-timeout", "1500", *rates]), tmp_path / "server.log")
        edge = None
        try:
            wait_for(lambda: ready.exists() or server.popen.poll() is not None, 60, "server")
            port = json.loads(ready.read_text())["port"]
            edge = Proc(link.wrap("edge", [
                sys.executable, "-m", "fl_edge", "--insecure",
                "--server", f"{SERVER_ADDRESS}:{port}", "--data-dir", str(data),
                "--state-dir", str(tmp_path / "state"), "--name", "cell",
                "--retry-for", "600"]), tmp_path / "edge.log")
            started = time.monotonic()
            assert server.wait(timeout=1700) == 0, server.log()[-3000:]
            seconds = time.monotonic() - started
        finally:
            for proc in (edge, server):
                if proc is not None:
                    proc.close()
    history = read_history(tmp_path / "server-state")
    (record,) = history["rounds"]
    assert record["train"]["received"] == ["cell"], record["train"]
    assert "aborted" not in record
    print(f"one round over {CELLULAR}: {seconds:.0f}s")


@pytest.mark.skipif(bool(WHY), reason=WHY or "available")
@pytest.mark.timeout(1800)
def test_a_20_second_cut_mid_download_and_mid_upload_costs_a_chunk_each(tmp_path):
    # MobileNetV3-Small (6.2 MB each way) over 1 Mbit/s, run twice through bench/links.py's
    # round: clean, then with the link dark for 20 s (both ways, neither host told) once
    # the edge received half of its download, and again once it sent half of its upload.
    # The cut round completes with the edge's result, and what the cuts cost on the wire
    # (the link device's counters, each way, over the clean run's) is at most one chunk
    # each way, plus the reconnect's own bytes: the download goes on from the chunks the
    # edge holds (the task stands at the server meanwhile: tests/test_resume_downloads.py),
    # the upload from the chunks the server holds.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from links import one_round

    from fedattn_shared.wire.transport import DEFAULT_CHUNK_BYTES

    runs = {}
    for name, cuts in (("clean", False), ("cuts", True)):
        workdir = tmp_path / name
        workdir.mkdir()
        runs[name] = one_round("mobilenet-v3-small", "none", Profile(rate_kbit=1000), cuts,
                               20.0, 900, workdir)
        assert not runs[name]["failed"] and runs[name]["seconds"], runs[name]
    clean, cut = runs["clean"], runs["cuts"]
    assert len(cut["cuts"]) == 2, cut
    overhead = 64 << 10  # a reconnect: TCP handshake, join, presence; TCP's retries in the dark
    for way in ("down", "up"):
        again = cut[way] - clean[way]
        assert again <= DEFAULT_CHUNK_BYTES + overhead, (way, again, runs)
    print(f"clean {clean['round']:.0f}s, with two 20 s cuts {cut['round']:.0f}s; sent again: "
          f"down {(cut['down'] - clean['down']) / 1024:.0f} KiB, "
          f"up {(cut['up'] - clean['up']) / 1024:.0f} KiB")

"""Resumable uploads between the real daemons: an fl-edge whose connection breaks in the
middle of its upload (``CutProxy`` shuts the TCP connection down both ways) resumes it
from the bytes the server holds, without training again, and the run's result is bit for
bit the one of a run whose link never broke."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from conftest import Cluster, wait_for, write_edge_dirs
from cutproxy import CutProxy
from test_determinism import _final_global, _identical

CHUNK = 16 << 10  # --chunk-bytes: a ~180 KB upload in a dozen chunks
CUT_AFTER = 80_000  # edge-to-server bytes after which the link breaks: inside the upload
#: One round, one edge, seeded: every run here (whole, cut, restarted) is the same round.
SERVER = ("--method", "fedavg", "--rounds", "1", "--min-edges", "1", "--local-epochs", "1",
          "--seed", "7", "--eval-every", "0", "--chunk-bytes", str(CHUNK),
          "--metrics-port", "0", "--metrics-linger", "120")


def raw_bytes(metrics_port: int, edge: str, direction: str) -> int:
    """The data bytes the server counted for ``edge`` in ``direction`` ("up": received
    from it, "down": handed to gRPC for it)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
                   if line.startswith("fedattn_raw_tensor_bytes_total{")
                   and f'direction="{direction}"' in line and f'edge="{edge}"' in line))


def raw_up(metrics_port: int, edge: str) -> int:
    return raw_bytes(metrics_port, edge, "up")


def raw_down(metrics_port: int, edge: str) -> int:
    return raw_bytes(metrics_port, edge, "down")


def federation(root: Path, data: Path, cut_after: int) -> tuple[dict, int, str, str]:
    """One round, one edge behind a ``CutProxy``; the final global, the upload bytes the
    server counted, and both daemons' logs."""
    cluster = Cluster(root)
    root.mkdir(parents=True, exist_ok=True)
    proxy = None
    try:
        server = cluster.server(*SERVER)
        # The cut waits until the server counts the upload's bytes: it then holds the
        # upload, whatever order it learns of the broken calls in (a loaded server's
        # handler can still be a window behind its socket at the byte count).
        proxy = CutProxy(cluster.port, cut_after, before_cut=lambda: wait_for(
            lambda: raw_up(server.metrics_port, "e0") > 0, 60, "the upload's first bytes"))
        edge = cluster.edge(data, "e0", port=proxy.port)
        assert edge.wait() == 0, edge.log()
        wait_for(lambda: (root / "server-state" / "manifest.json").exists(), 30, "checkpoint")
        counted = raw_up(server.metrics_port, "e0")
        assert proxy.cuts == (1 if cut_after else 0)
        return _final_global(root / "server-state"), counted, server.log(), edge.log()
    finally:
        if proxy is not None:
            proxy.close()
        cluster.close()


def test_an_upload_cut_mid_body_resumes_and_the_result_is_the_uncut_runs(tmp_path):
    (data,) = write_edge_dirs(tmp_path, 1)
    whole, whole_bytes, _, _ = federation(tmp_path / "whole", data, 0)
    cut, cut_bytes, server_log, edge_log = federation(tmp_path / "cut", data, CUT_AFTER)
    # Resumed from the bytes the server holds, in one of the edge's two ways: within the
    # call that broke (its UploadOffset answered), or, when that UploadOffset met the
    # channel still down, after the rejoin from the upload it keeps on disk.
    assert ("resuming from there" in edge_log
            or "resuming the upload a previous run of this edge left" in edge_log), edge_log
    resumed = [line for line in server_log.splitlines() if "resumes its upload at byte" in line]
    assert resumed, server_log
    held = int(resumed[0].split("at byte ")[1].split()[0])
    assert 0 < held < whole_bytes
    assert edge_log.count("trained ") == 1, "the edge trained again instead of resuming"
    # At most the chunk in flight at the cut traveled twice, counted by the server.
    assert whole_bytes <= cut_bytes <= whole_bytes + CHUNK, (whole_bytes, cut_bytes)
    assert _identical(whole, cut) == []


def test_an_edge_restarted_mid_upload_resumes_it_from_disk(tmp_path):
    # The link goes silent in the middle of the upload and the edge process is killed
    # (kill -9: nothing of it runs on the way out); started again on its state dir, it
    # rejoins, finds its upload on disk and the server still holding its task and the
    # bytes that arrived, and sends only the rest: no second training, the same result.
    (data,) = write_edge_dirs(tmp_path, 1)
    whole, whole_bytes, _, _ = federation(tmp_path / "whole", data, 0)
    root = tmp_path / "restart"
    cluster = Cluster(root)
    root.mkdir(parents=True)
    proxy = None
    try:
        server = cluster.server(*SERVER)
        proxy = CutProxy(cluster.port, CUT_AFTER, stall=True)
        first = cluster.edge(data, "e0", port=proxy.port)
        assert proxy.cut_done.wait(120), first.log()
        assert (root / "state-e0" / "upload.pending").exists()
        mark = server.mark()
        first.popen.kill()
        first.popen.wait(30)
        server.logged(mark, "refused: upload ended after", "held", timeout=30)
        again = cluster.edge(data, "e0", port=proxy.port)
        assert again.wait() == 0, again.log()
        log = again.log().split("joined ")[-1]  # the second process's lines
        assert "resuming the upload a previous run of this edge left" in again.log()
        assert "trained " not in log, "the restarted edge trained again"
        assert not (root / "state-e0" / "upload.pending").exists()
        resumed = [line for line in server.log().splitlines()
                   if "resumes its upload at byte" in line]
        assert resumed and int(resumed[0].split("at byte ")[1].split()[0]) > 0, server.log()
        wait_for(lambda: (root / "server-state" / "manifest.json").exists(), 30, "checkpoint")
        counted = raw_up(server.metrics_port, "e0")
        assert whole_bytes <= counted <= whole_bytes + CHUNK, (whole_bytes, counted)
        assert _identical(whole, _final_global(root / "server-state")) == []
    finally:
        if proxy is not None:
            proxy.close()
        cluster.close()




def test_an_edge_restarted_mid_download_goes_on_from_the_chunks_it_kept(tmp_path):
    # The link goes silent in the middle of a task download that spans several windows
    # (so the edge keeps it on disk as it arrives: download.partial) and the edge process
    # is killed. Started again on its state dir, it rejoins, finds the server still
    # holding its task (the download's hold) and asks only for the bytes after the last
    # whole chunk it kept: the server sends exactly those, and the run's result is the
    # uncut run's.
    (data,) = write_edge_dirs(tmp_path, 1)
    whole, _, _, _ = federation(tmp_path / "whole", data, 0)
    root = tmp_path / "restart"
    cluster = Cluster(root)
    root.mkdir(parents=True)
    proxy = None
    try:
        server = cluster.server(*SERVER, "--download-window", str(2 * CHUNK))
        proxy = CutProxy(cluster.port, CUT_AFTER, stall=True, downstream=True)
        first = cluster.edge(data, "e0", port=proxy.port)
        assert proxy.cut_done.wait(120), first.log()
        kept = root / "state-e0" / "download.partial"
        wait_for(lambda: kept.exists() and kept.stat().st_size > 2 * CHUNK, 30,
                 "chunks kept on disk")
        # What the server handed out before the kill, once it stopped growing.
        sent = [-1, raw_down(server.metrics_port, "e0")]
        while sent[-1] != sent[-2]:
            time.sleep(1)
            sent.append(raw_down(server.metrics_port, "e0"))
        first.popen.kill()
        first.popen.wait(30)
        again = cluster.edge(data, "e0", port=proxy.port)
        assert again.wait() == 0, again.log()
        line = next((text for text in again.log().splitlines()
                     if "from what an earlier run of this edge kept on disk" in text), None)
        assert line is not None, again.log()
        held, total = (int(word) for word in line.split("at byte ")[1].split()[:3:2])
        assert 0 < held < total and held % CHUNK == 0, line
        assert not kept.exists()
        wait_for(lambda: (root / "server-state" / "manifest.json").exists(), 30, "checkpoint")
        # The restarted edge was sent exactly the bytes after those it kept.
        assert raw_down(server.metrics_port, "e0") - sent[-1] == total - held
        assert _identical(whole, _final_global(root / "server-state")) == []
    finally:
        if proxy is not None:
            proxy.close()
        cluster.close()

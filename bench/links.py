"""Rounds over real shaped links: what a cellular or rural edge's link does to one round.

For each link profile (a rate, with or without random loss, with or without cuts), each
model and with or without ``--compress up=int8,down=int8``, a real fl-server and one real
fl-edge run one FedAvg round in two network namespaces joined by a link the kernel shapes
(``tests/netlink.py``: a token bucket each way, loss by iptables, the round-trip delay by
a packet relay between TUN devices). A ``cuts`` profile takes the link down, both ways and
without telling either host, for ``--cut-seconds`` once the edge has received half of the
download, and again once it has sent half of its upload. It prints, per run:

* the round's time (the server's record of it, and from the edge process's start to the
  server's exit), or that it did not complete within ``--budget`` seconds;
* bytes sent / bytes needed: every byte the link carried, both ways (the TUN or veth
  devices' counters: IP and TCP headers, retransmissions and anything sent again after a
  cut included) over the bytes the round needed (the server's history of the run at that
  rate without loss or cuts: each message of the round counted once; a broken run's
  history also counts the chunks it sent again), and with loss or cuts, the link's bytes
  over the clean run's at the same rate, in all and each way (what the loss or the cuts
  cost: TCP's retransmissions, anything sent again);
* and, per model and codec, the slowest link at which the round completed.

The server's minimum rates are set to half of what the link carries (docs/operations.md,
"Slow links"), as an operator of such edges would. Needs root, iproute2 and iptables;
minutes per run on the slow profiles (MobileNetV3-Small is 6.2 MB each way: 13 minutes
each way at 64 kbit/s; ResNet-18 44.7 MB).

    .venv/bin/python bench/links.py [--models mobilenet-v3-small] [--rates 256 1000]
        [--variants clean loss cuts] [--codecs none int8] [--rtt-ms 200] [--budget 900]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from netlink import SERVER_ADDRESS, Link, Profile, shaped_link, unavailable  # noqa: E402

MODEL_INPUT = {"mobilenet-v3-small": (3, 32), "resnet18-cifar": (3, 32), "lenet-bn": (1, 28)}
CODECS = {"none": [], "int8": ["--compress", "up=int8,down=int8"]}
LOSS_PCT = 1.0


def edge_counter(link: Link, stat: str) -> int:
    """One counter of the edge's end of the link (``tx_bytes``, ``rx_bytes``)."""
    out = subprocess.run(link.wrap("edge", ["cat", f"/sys/class/net/{link.edge_dev}/statistics/"
                                            f"{stat}"]), capture_output=True, text=True,
                         check=True, timeout=30)
    return int(out.stdout)


def device_bytes(link: Link) -> dict[str, int]:
    """Bytes the link has carried so far each way: "down" to the edge, "up" from it."""
    return {"down": edge_counter(link, "rx_bytes"), "up": edge_counter(link, "tx_bytes")}


def write_data(directory: Path, model: str) -> None:
    channels, size = MODEL_INPUT[model]
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    for split in ("train", "test"):  # a few images: the link is what is measured
        np.savez(directory / f"{split}.npz",
                 x=rng.integers(0, 255, (8, size, size, channels), dtype=np.uint8),
                 y=np.arange(8) % 2)


class Cutter(threading.Thread):
    """Takes the link down for ``seconds`` once the edge has received ``down_at`` bytes,
    and again once it has sent ``up_at`` bytes (device counters, polled)."""

    def __init__(self, link: Link, profile: Profile, seconds: float, down_at: int, up_at: int):
        super().__init__(daemon=True)
        self.link, self.profile, self.seconds = link, profile, seconds
        self.marks = [("rx_bytes", down_at), ("tx_bytes", up_at)]
        self.cuts: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        start = {stat: edge_counter(self.link, stat) for stat, _ in self.marks}
        for stat, mark in self.marks:
            while not self.stop.is_set():
                if edge_counter(self.link, stat) - start[stat] >= mark:
                    break
                self.stop.wait(0.2)
            if self.stop.is_set():
                return
            self.link.down()
            self.cuts.append(f"{stat[:2]} at {mark >> 10} KiB ({time.strftime('%H:%M:%S')})")
            self.stop.wait(self.seconds)
            self.link.up(self.profile)


def one_round(model: str, codec: str, profile: Profile, cuts: bool, cut_seconds: float,
              budget: float, workdir: Path, server_args: tuple[str, ...] = ()) -> dict:
    """One FedAvg round over ``profile``: seconds (None when over ``budget``), bytes the
    link carried (in all, and "down" and "up" each way) and the bytes the round needed."""
    channels, size = MODEL_INPUT[model]
    data = workdir / "edge-data"
    write_data(data, model)
    byte_rate = str(max(1024, profile.rate_kbit * 1000 // 8 // 2))  # half the link
    ready = workdir / "ready.json"
    with shaped_link(profile) as link:
        server = subprocess.Popen(link.wrap("server", [
            sys.executable, "-m", "fl_server", "--insecure", "--host", "0.0.0.0", "--port", "0",
            "--ready-file", str(ready), "--checkpoint-dir", str(workdir / "server"),
            "--method", "fedavg", "--model", model, "--in-channels", str(channels),
            "--image-size", str(size), "--rounds", "1", "--min-edges", "1", "--eval-every",
            "0", "--local-epochs", "1", "--batch-size", "8", "--round-timeout", str(budget),
            "--download-min-rate", byte_rate, "--upload-min-rate", byte_rate,
            *CODECS[codec], *server_args]), stdout=subprocess.DEVNULL,
            stderr=(workdir / "server.log").open("wb"), cwd=workdir)
        edge = cutter = None
        try:
            deadline = time.monotonic() + 120
            while not ready.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start: "
                                       + (workdir / "server.log").read_text()[-2000:])
                time.sleep(0.1)
            port = json.loads(ready.read_text())["port"]
            carried = device_bytes(link)
            started = time.monotonic()
            edge = subprocess.Popen(link.wrap("edge", [
                sys.executable, "-m", "fl_edge", "--insecure", "--server",
                f"{SERVER_ADDRESS}:{port}", "--data-dir", str(data), "--state-dir",
                str(workdir / "edge-state"), "--name", "cell", "--device", "cpu",
                "--retry-for", str(budget), "--progress", "off"]), stdout=subprocess.DEVNULL,
                stderr=(workdir / "edge.log").open("wb"), cwd=workdir)
            if cuts:
                model_bytes = model_payload_bytes(model) // (4 if codec == "int8" else 1)
                cutter = Cutter(link, profile, cut_seconds, model_bytes // 2, model_bytes // 2)
                cutter.start()
            try:
                server.wait(timeout=budget)
                seconds = time.monotonic() - started
            except subprocess.TimeoutExpired:
                seconds = None
            after = device_bytes(link)
            each_way = {way: after[way] - carried[way] for way in after}
        finally:
            if cutter is not None:
                cutter.stop.set()
            for proc in (edge, server):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=60)
    needed, inside, failed = 0, None, ""
    history = workdir / "server" / "history.json"
    if seconds is not None and history.exists():
        for record in json.loads(history.read_text())["rounds"]:
            inside = record["seconds"]
            for direction in record["bytes"].values():
                needed += sum(v["wire"] for v in direction.values())
            if "cell" not in record.get("train", {}).get("received", []):
                failed = (f"the round ended without the edge's result: "
                          f"{json.dumps(record.get('train', {}).get('dropped') or record.get('aborted'))}")
    elif seconds is not None:
        failed = "the server exited without a history: " + (
            workdir / "server.log").read_text(errors="replace")[-500:]
    return {"seconds": None if failed else seconds, "round": inside,
            "carried": sum(each_way.values()), **each_way,
            "needed": needed, "failed": failed,
            "cuts": cutter.cuts if cutter is not None else []}


def model_payload_bytes(model: str) -> int:
    """The model's float32 bytes (the size of a whole, uncompressed downlink)."""
    from fedattn_shared.models import build_model

    channels, size = MODEL_INPUT[model]
    net = build_model(model, 10, channels, size)
    return sum(t.numel() * t.element_size() for t in net.state_dict().values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mobilenet-v3-small", "resnet18-cifar"])
    parser.add_argument("--rates", nargs="+", type=int, default=[64, 256, 1000, 10000],
                        help="link rates, kbit/s each way")
    parser.add_argument("--variants", nargs="+", default=["clean", "loss", "cuts"],
                        choices=["clean", "loss", "cuts"])
    parser.add_argument("--codecs", nargs="+", default=["none", "int8"], choices=list(CODECS))
    parser.add_argument("--rtt-ms", type=int, default=200)
    parser.add_argument("--cut-seconds", type=float, default=20.0)
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="one more fl-server argument (repeatable; "
                             "--server-arg=--presence-grace=30)")
    parser.add_argument("--budget", type=float, default=900.0,
                        help="seconds one round may take before it counts as not completed")
    args = parser.parse_args()
    why = unavailable()
    if why:
        print(f"bench/links.py cannot run here: {why}")
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"one FedAvg round, one edge, over a shaped link ({args.rtt_ms} ms RTT; loss "
          f"{LOSS_PCT:g} % each way; cuts: {args.cut_seconds:g} s down mid-download and "
          f"mid-upload); server min rates = half the link; budget {args.budget:g} s a round; "
          f"server arguments {args.server_arg}")
    for model in args.models:
        for codec in args.codecs:
            completed: dict[str, list[int]] = {}
            clean: dict[int, dict] = {}  # rate -> the run without loss or cuts
            for variant in args.variants:
                for rate in sorted(args.rates):
                    profile = Profile(rate, LOSS_PCT if variant == "loss" else 0.0, args.rtt_ms)
                    with tempfile.TemporaryDirectory() as tmp:
                        r = one_round(model, codec, profile, variant == "cuts",
                                      args.cut_seconds, args.budget, Path(tmp),
                                      tuple(args.server_arg))
                    label = f"{model} {codec:4s} {variant:5s} {rate:>6d} kbit/s"
                    if r["seconds"] is None:
                        why = r["failed"] or f"not completed within {args.budget:g} s"
                        print(f"  {label}: {why} (link carried {r['carried'] / 1e6:.1f} MB)",
                              flush=True)
                        continue
                    completed.setdefault(variant, []).append(rate)
                    if variant == "clean":
                        clean[rate] = r
                    # What the round needs is counted once, by the server, in the run that
                    # never broke: a broken run's history counts its resent chunks too.
                    needed = clean[rate]["needed"] if rate in clean else r["needed"]
                    ratio = r["carried"] / needed if needed else float("nan")
                    extra = ""
                    if variant != "clean" and rate in clean:
                        base = clean[rate]
                        extra = (f", {r['carried'] / base['carried']:.3f}x the clean link's "
                                 f"bytes (down {(r['down'] - base['down']) / 1024:+.0f} KiB, "
                                 f"up {(r['up'] - base['up']) / 1024:+.0f} KiB)")
                    cuts = f"; cuts: {', '.join(r['cuts'])}" if r["cuts"] else ""
                    print(f"  {label}: round {r['round']:7.1f} s ({r['seconds']:.0f} s from "
                          f"the edge's start), sent/needed {ratio:.3f} ({r['carried'] / 1e6:.2f}"
                          f" / {needed / 1e6:.2f} MB){extra}{cuts}", flush=True)
            for variant in args.variants:
                rates = completed.get(variant)
                print(f"  {model} {codec} {variant}: slowest link completed: "
                      f"{f'{min(rates)} kbit/s' if rates else 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

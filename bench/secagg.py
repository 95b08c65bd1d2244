"""SecAgg+ cost against plain aggregation, in the same run.

Real fl-server engine and real fl-edge daemons (threads of one process, each with its own
gRPC channel and state dir) on loopback, with MobileNetV3-small (1.53 M parameters, all
shared) and no local training (``local_epochs = 0``: the transport and the protocol
alone). For every number of edges, plain FedAvg, SecAgg+ over the sparse k-regular graph
and over the full graph, each with 0 % and 10 % of the edges dropping out at the masked
phase (after sharing keys: the expensive case, whose pairwise masks the server must
recompute). One round per configuration.

Figures per configuration: per-edge CPU seconds per round (edge threads' CPU time in
task handling, mean; and in the masked phase alone), per-edge bytes per round (up and
down, every kind, as the server counted them), each phase's wall time, the server's
unmask time, and the error of the unmasked mean against the plain mean of the same
uploads (the fixed-point bound).

    .venv/bin/python bench/secagg.py                     # 8, 32 and 100 edges
    .venv/bin/python bench/secagg.py --edges 8 32        # a smaller sweep
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import statistics
import sys
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedattn_shared.config import ServerConfig, TrainConfig  # noqa: E402
from fedattn_shared.methods import MethodContext, load_method  # noqa: E402
from fl_edge.daemon import EdgeDaemon, EdgeOptions  # noqa: E402
from fl_server.app import ServerApp  # noqa: E402

MODEL = "mobilenet-v3-small"


class Dropout(Exception):
    pass


class MeteredEdge(EdgeDaemon):
    """An edge that records the CPU time of its threads' task handling per phase, and
    leaves (a real gRPC Leave) when told to drop at a phase."""

    drop_phase = ""

    def __init__(self, options: EdgeOptions):
        super().__init__(options)
        self.cpu: dict[str, float] = {}

    def _next_task(self):
        started = time.thread_time()
        received = super()._next_task()
        phase = received.header.phase or "poll"
        self.cpu[phase] = self.cpu.get(phase, 0.0) + time.thread_time() - started
        return received

    def _handle(self, received):
        phase = received.header.phase
        if phase == self.drop_phase:
            self.session.leave("benchmark dropout")
            raise Dropout(phase)
        started = time.thread_time()
        try:
            return super()._handle(received)
        finally:
            self.cpu[phase] = self.cpu.get(phase, 0.0) + time.thread_time() - started


def write_data(root: Path, edges: int) -> list[Path]:
    rng = np.random.default_rng(0)
    dirs = []
    for i in range(edges):
        d = root / f"data-{i}"
        d.mkdir(parents=True)
        x = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
        np.savez(d / "data.npz", x=x, y=np.arange(40) % 4)
        dirs.append(d)
    return dirs


def run(edges: int, mode: str, dropout: float, work: Path) -> dict:
    train = TrainConfig(model=MODEL, in_channels=3, image_size=32, local_epochs=0,
                        batch_size=10, test_fraction=0.2)
    cls = load_method("fedavg")
    method = cls(MethodContext(train, cls.Params()))
    dropped = int(round(dropout * edges))
    cfg = ServerConfig(method="fedavg", rounds=1, min_edges=edges, host="127.0.0.1", port=0,
                       checkpoint_dir=str(work / "server"), insecure=True, poll_timeout=5.0,
                       round_timeout=600, eval_every=0, secagg=mode != "plain",
                       secagg_graph="full" if mode == "full" else "sparse",
                       secagg_timeout=600, max_concurrent_uploads=4)
    app = ServerApp(cfg, train, method)
    loop = asyncio.new_event_loop()
    port = loop.run_until_complete(app.start())
    server = threading.Thread(target=loop.run_until_complete, args=(app.run(),))
    server.start()
    daemons = []
    for i, data_dir in enumerate(write_data(work, edges)):
        daemon = MeteredEdge(EdgeOptions(server=f"127.0.0.1:{port}", data_dir=data_dir,
                                         state_dir=work / f"state-{i}", name=f"e{i:03d}",
                                         device="cpu", retry_for=60, progress=False))
        daemon.drop_phase = "train" if i < dropped else ""
        daemons.append(daemon)

    def go(daemon):
        try:
            daemon.run()
        except Dropout:
            pass

    threads = [threading.Thread(target=go, args=(d,)) for d in daemons]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.join()
    loop.close()
    record = app.engine.history["rounds"][0]
    survivors = daemons[dropped:]
    phases = [p for p in ("secagg-advertise:train", "secagg-share:train", "secagg-receive:train",
                          "train", "secagg-confirm:train", "secagg-unmask:train") if p in record]
    cpu = statistics.mean(sum(v for k, v in d.cpu.items() if k != "poll") for d in survivors)
    masked_cpu = statistics.mean(d.cpu.get("train", 0.0) for d in survivors)
    up = sum(k["wire"] for k in record["bytes"].get("up", {}).values()) / edges
    down = sum(k["wire"] for k in record["bytes"].get("down", {}).values()) / edges
    aggregate = record["aggregate"]
    return {
        "edges": edges, "mode": mode, "dropout": dropout, "survivors": len(survivors),
        "edge_cpu": cpu, "masked_cpu": masked_cpu, "up_mb": up / 1e6, "down_mb": down / 1e6,
        "phases": {p: record[p]["seconds"] for p in phases},
        "round_seconds": record["seconds"],
        "unmask_seconds": aggregate.get("secagg-unmask", {}).get("unmask_seconds", 0.0),
        "degree": aggregate.get("secagg-advertise", {}).get("degree", 0),
        "threshold": aggregate.get("secagg-advertise", {}).get("threshold", 0),
        "aborted": aggregate.get("secagg-aborted", ""),
        "aggregated": aggregate.get("aggregated", 0),
    }


def prg_comparison(words: int = 1_528_107, repeats: int = 40) -> list[str]:
    """One mask of the model's size: our AES-256-CTR keystream from a 256-bit seed against
    a general-purpose RNG seeded with 32 bits (numpy's Mersenne Twister, as Flower's
    SecAgg+ derives its masks), best of ``repeats`` each."""
    from fedattn_shared.privacy.secagg_crypto import prg_words

    seed = bytes(range(32))
    candidates = {
        "ours": lambda: prg_words(seed, words),
        "mt": lambda: np.random.RandomState(int.from_bytes(seed[:4], "little")).randint(
            0, 2**32, size=words, dtype=np.uint32),
    }
    best = dict.fromkeys(candidates, math.inf)
    for _ in range(repeats):  # interleaved, so a burst of load hits both alike
        for name, fn in candidates.items():
            started = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - started)
    ours, mt = best["ours"], best["mt"]
    return [f"One mask of {words} words: AES-256-CTR (256-bit seed) {ours * 1e3:.1f} ms, "
            f"Mersenne Twister (32-bit seed, 2^32 possible masks) {mt * 1e3:.1f} ms "
            f"(x{mt / ours:.1f})"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=int, nargs="+", default=[8, 32, 100])
    parser.add_argument("--modes", nargs="+", default=["plain", "sparse", "full"],
                        choices=["plain", "sparse", "full"])
    parser.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    parser.add_argument("--prg-only", action="store_true", help="only the mask PRG comparison")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.prg_only:
        print("\n".join(prg_comparison()))
        return 0
    lines = [f"SecAgg+ vs plain FedAvg, {MODEL} (1.53 M parameters), 1 round, local_epochs 0, "
             "fl-server + fl-edge threads on loopback gRPC", ""]
    header = (f"{'edges':>5} {'mode':>6} {'drop':>5} {'k':>3} {'t':>3} {'edge CPU s':>10} "
              f"{'masked s':>9} {'up MB':>7} {'down MB':>8} {'round s':>8} {'unmask s':>9} "
              "phases s (advertise/share/masked/unmask)")
    print(header, flush=True)
    lines.append(header)
    results = []
    for edges in args.edges:
        for mode in args.modes:
            for dropout in args.dropouts:
                with TemporaryDirectory(prefix="bench-secagg-") as tmp:
                    r = run(edges, mode, dropout, Path(tmp))
                results.append(r)
                phases = "/".join(f"{s:.2f}" for s in r["phases"].values())
                line = (f"{edges:>5} {mode:>6} {dropout:>5.0%} {r['degree'] or '-':>3} "
                        f"{r['threshold'] or '-':>3} {r['edge_cpu']:>10.3f} "
                        f"{r['masked_cpu']:>9.3f} {r['up_mb']:>7.2f} {r['down_mb']:>8.2f} "
                        f"{r['round_seconds']:>8.2f} {r['unmask_seconds']:>9.3f} {phases}"
                        + (f"  ABORTED: {r['aborted']}" if r["aborted"] else ""))
                print(line, flush=True)
                lines.append(line)
    lines.append("")
    lines.append("Ratios SecAgg+/plain at the same edges and dropout (edge CPU, upload bytes, "
                 "round wall time):")
    for r in results:
        if r["mode"] == "plain":
            continue
        base = next(b for b in results if b["mode"] == "plain" and b["edges"] == r["edges"]
                    and b["dropout"] == r["dropout"])
        line = (f"  {r['edges']:>4} edges {r['mode']:>6} {r['dropout']:>4.0%}: CPU x"
                f"{r['edge_cpu'] / max(base['edge_cpu'], 1e-9):.2f}, up x"
                f"{r['up_mb'] / max(base['up_mb'], 1e-9):.3f}, round x"
                f"{r['round_seconds'] / max(base['round_seconds'], 1e-9):.2f}")
        print(line)
        lines.append(line)
    lines += ["", *prg_comparison()]
    print(lines[-1])
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

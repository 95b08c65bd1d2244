"""The edges one ``fl-sim`` worker hosts: full EdgeDaemons as threads of one process.

The same code runs in an ``fl-sim worker`` process (``python -m fl_tools.sim worker``) and
in a Ray actor (``fl_tools.sim_ray``): both are given ``worker_parser``'s options and call
``host_edges``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path


def worker_parser() -> argparse.ArgumentParser:
    """The options of the edges one worker hosts: a worker process's command line, and what
    a Ray actor (``fl_tools.sim_ray``) is given, so both host their edges the same way."""
    p = argparse.ArgumentParser(prog="fl-sim worker")
    p.add_argument("--server", required=True)
    p.add_argument("--state-root", required=True, type=Path)
    p.add_argument("--device", default="cpu")
    p.add_argument("--data-on-device", action="store_true", help="fl-edge --data-on-device")
    p.add_argument("--tls-root", type=Path, help="one certificate folder per edge name")
    p.add_argument("--allow-method", action="append", default=[],
                   help="a module:Class method the edges may import (fl-edge --allow-method)")
    p.add_argument("--allow-model", action="append", default=[],
                   help="a module:callable model the edges may import (fl-edge --allow-model)")
    p.add_argument("--allow-seeded-dp-noise", action="store_true")
    p.add_argument("--throttle", type=float, default=1.0, help="fl-edge --throttle of --slow")
    p.add_argument("--slow", action="append", default=[], metavar="NAME")
    p.add_argument("--disconnect", default="0", help="fl-edge --disconnect of --flaky")
    p.add_argument("--disconnect-seed", type=int, default=0)
    p.add_argument("--flaky", action="append", default=[], metavar="NAME")
    p.add_argument("--batch-edges", type=int, default=0,
                   help="fl-sim --batch-edges: edges trained as one batched computation")
    p.add_argument("data_dirs", nargs="+", type=Path)
    return p


@dataclass
class Hosted:
    """What became of a worker's edges: each edge's exit status (0: the server ended the
    run), and the edges whose threads still live: flaky edges away when the run ended or,
    once an edge failed, the others."""

    codes: dict[str, int]
    away: list[str]

    @property
    def failed(self) -> dict[str, int]:
        return {name: code for name, code in self.codes.items() if code}


def host_edges(args: argparse.Namespace, run_over: threading.Event) -> Hosted:
    """Runs one ``EdgeDaemon`` thread per data dir of ``worker_parser``'s ``args`` (one torch
    thread each) until every edge has ended, or ``run_over`` is set (fl-sim's server ended
    the run) and only flaky edges are left: those are away (--disconnect) and would retry
    a server that is gone, so they are not waited for, and they are no failure. An edge
    that fails (a non-zero exit status, or a crash) ends the wait at once."""
    import torch

    from fedattn_shared.logs import setup_logging
    from fedattn_shared.privacy.dp import PrivacyPolicy
    from fl_edge.daemon import EdgeDaemon, EdgeExit, EdgeOptions
    from fl_edge.heterogeneity import parse_disconnect

    setup_logging("WARNING")
    torch.set_num_threads(1)
    codes: dict[str, int] = {}
    disconnect, offline = parse_disconnect(args.disconnect)
    batcher = None
    if args.batch_edges:
        from fl_tools.sim_batch import EdgeBatcher

        batcher = EdgeBatcher(args.batch_edges)
    slots = {d.name: i for i, d in enumerate(args.data_dirs)}

    def run(data_dir: Path) -> None:
        name = data_dir.name
        options = EdgeOptions(server=args.server, data_dir=data_dir,
                              state_dir=args.state_root / name, name=name,
                              device=args.device, data_on_device=args.data_on_device,
                              progress=False, retry_for=120,
                              tls_dir=args.tls_root / name if args.tls_root else None,
                              allow_methods=tuple(args.allow_method),
                              allow_models=tuple(args.allow_model),
                              privacy=PrivacyPolicy(allow_seeded_noise=args.allow_seeded_dp_noise),
                              throttle=args.throttle if name in args.slow else 1.0,
                              disconnect=disconnect if name in args.flaky else 0.0,
                              offline_seconds=offline, disconnect_seed=args.disconnect_seed,
                              batcher=batcher.slot(slots[name]) if batcher else None)
        try:
            codes[data_dir.name] = EdgeDaemon(options).run()
        except EdgeExit as err:
            logging.getLogger("fl_sim").error("%s: %s", data_dir.name, err)
            codes[data_dir.name] = err.code
        except Exception:  # a crash of one edge is that edge's failure, with its traceback
            logging.getLogger("fl_sim").exception("%s: the edge crashed", data_dir.name)
            codes[data_dir.name] = 1

    threads = [threading.Thread(target=run, args=(d,), name=d.name) for d in args.data_dirs]
    flaky = set(args.flaky)
    for t in threads:
        t.start()
    while any(t.is_alive() and not (run_over.is_set() and t.name in flaky)
              for t in threads):
        if any(codes.values()):  # an edge failed: the run cannot complete (``wait_for_workers``)
            break
        time.sleep(0.2)
    return Hosted(codes=codes, away=sorted(t.name for t in threads if t.is_alive()))


def worker(argv: list[str]) -> int:
    """``python -m fl_tools.sim worker --server H:P --state-root D DATA_DIR...``"""
    args = worker_parser().parse_args(argv)
    # fl-sim's SIGUSR1: its server ended the run (and told every connected edge).
    run_over = threading.Event()
    signal.signal(signal.SIGUSR1, lambda signum, frame: run_over.set())
    hosted = host_edges(args, run_over)
    # Ignored from here on: the interpreter's shutdown would restore the default action
    # (the process killed) for a signal that arrives while it exits.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if hosted.away and not hosted.failed:
        print(f"fl-sim worker: the run ended with flaky edges away: {', '.join(hosted.away)}",
              file=sys.stderr)
    if hosted.failed:
        print(f"fl-sim worker: edges failed: {hosted.failed}", file=sys.stderr)
    if hosted.away:
        # Their threads sleep offline or retry the gone server, or, once an edge failed,
        # still run: the process ends them.
        os._exit(1 if hosted.failed else 0)
    return 1 if hosted.failed else 0

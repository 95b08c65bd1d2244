"""What the bench scripts share: where the repo and the team's datasets are, and running
one step (fl-partition, fl-sim, ...) as a subprocess with its output kept in a log."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The real datasets: $FEDATTN_DATA, else the team's folder beside the repository.
SHARED_DATA = Path(os.environ.get("FEDATTN_DATA") or ROOT.parent / "shared" / "data")


def run(cmd: list[str], log: Path) -> None:
    """Runs ``cmd`` in the repo with stdout and stderr in ``log``; stops the bench with the
    command and the log's tail when it fails."""
    with open(log, "wb") as handle:
        code = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")


def resumable(run: Path) -> bool:
    """Whether an unfinished fl-sim run in ``run`` has a round checkpoint to continue from
    (``fl-sim --resume``: a GPU lease ends each command at 10 minutes); one without is
    removed, to start over."""
    from fl_server.checkpoint import CheckpointStore

    if (run / "server").is_dir() and CheckpointStore(run / "server").latest() is not None:
        return True
    shutil.rmtree(run, ignore_errors=True)
    return False


def fl_partition(out: Path, log_dir: Path, flags: list[str]) -> bool:
    """fl-partition into ``out`` with ``flags``, unless a finished partition (its
    partition.json) is already there: runs share partitions across methods and restarts.
    Returns whether it partitioned now."""
    if (out / "partition.json").exists():
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "fedattn_shared.data.partition", "--out", str(out), *flags],
        log_dir / f"partition-{out.name}.log")
    return True


def dirichlet_partition(out: Path, log_dir: Path, source: Path, edges: int, alpha: float,
                        seed: int, limit: int = 0) -> Path:
    """``fl_partition`` with the benches' label-skew protocol: Dirichlet(``alpha``) over
    ``edges`` folders, at least 20 samples each, the first ``limit`` samples (0: all)."""
    fl_partition(out, log_dir, ["--source", str(source), "--edges", str(edges), "--seed",
                                str(seed), "--min-per-edge", "20", "--scheme", "dirichlet",
                                "--alpha", str(alpha),
                                *(["--limit", str(limit)] if limit else [])])
    return out


def pm(values: list[float], digits: int = 1) -> str:
    """mean ± sample std of the finite values (one value alone; "-" for none): how every
    bench prints a figure over seeds."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "-"
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"

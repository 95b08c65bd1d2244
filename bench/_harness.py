"""What the bench scripts share: where the repo and the team's datasets are, and running
one step (fl-partition, fl-sim, ...) as a subprocess with its output kept in a log."""

from __future__ import annotations

import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The real datasets: $FEDATTN_DATA, else the team's folder beside the repository.
SHARED_DATA = Path(os.environ.get("FEDATTN_DATA") or ROOT.parent / "shared" / "data")


class BudgetSpent(Exception):
    """The command's time budget (``--budget-seconds``) ran out: a run under way was stopped
    and resumes from its last round checkpoint when the same command is given again."""


#: What a bench exits with when its budget ran out before its runs finished.
BUDGET_SPENT = 3


def deadline(budget_seconds: float) -> float | None:
    """The ``time.monotonic()`` by which a bench with ``--budget-seconds`` stops its runs
    (None: no budget). A GPU lease ends each command at 10 minutes: a budget below that
    lets the bench stop the run itself and print what is left, rather than be killed."""
    return time.monotonic() + budget_seconds if budget_seconds > 0 else None


def run(cmd: list[str], log: Path, until: float | None = None) -> None:
    """Runs ``cmd`` in the repo with stdout and stderr in ``log``; stops the bench with the
    command and the log's tail when it fails. With ``until`` (a ``time.monotonic()``
    deadline) the command and every process it started are killed at that time and
    ``BudgetSpent`` is raised; one is not started once the deadline has passed. The kill is
    the one fl-sim's resume is tested against (tests/test_tools.py: SIGKILL to the whole
    process group after a round checkpoint; ``--resume`` ends bit-identical)."""
    if until is not None and time.monotonic() >= until:
        raise BudgetSpent(" ".join(cmd))
    # appended: a run folder that already holds this log is a run being resumed
    with open(log, "ab") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=None if until is None else max(0.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            handle.write(b"\n[bench: stopped at the time budget; the same command resumes]\n")
            raise BudgetSpent(" ".join(cmd)) from None
        except BaseException:  # Ctrl-C, or the bench killed: take the federation with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if code:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")


def add_optimizer_state(parser) -> None:
    """``--optimizer-state``, the same in every bench that trains: what the local optimizer
    starts each round from (``train.optimizer_state``)."""
    parser.add_argument("--optimizer-state", choices=["reset", "carry"], default="reset",
                        help="reset: a fresh local optimizer every round, as the papers (the "
                             "system's default since 2026-11-27); carry: momentum kept across "
                             "rounds (every results file dated before 2026-11-27)")


def optimizer_state_tag(args) -> str:
    """A run folder's suffix for ``--optimizer-state``: none for the default, so a carried
    run is never read back as a reset one (``--out`` doubles as a cache)."""
    return "" if args.optimizer_state == "reset" else f"-{args.optimizer_state}"


def optimizer_state_words(args) -> str:
    """The header's words for ``--optimizer-state``: which behaviour a results file used."""
    return ("local optimizer reset every round" if args.optimizer_state == "reset"
            else "local optimizer state carried across rounds")


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
    Returns whether it partitioned now. Written beside ``out`` and renamed into place, so
    two runs started together on one partition (two rows of a calibration) each finish
    theirs and keep the first (fl-partition refuses a folder that exists: the second
    failed), and a partition a crash left half-written is replaced."""
    if (out / "partition.json").exists():
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        run([sys.executable, "-m", "fedattn_shared.data.partition", "--out", str(staging),
             *flags], log_dir / f"partition-{out.name}.log")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        staging.rename(out)
    except OSError:  # ``out`` exists: another run's partition, or a crash's half of one
        if (out / "partition.json").exists():
            shutil.rmtree(staging)
            return False
        shutil.rmtree(out)
        staging.rename(out)
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


def pm_seeds(values: Sequence[float], seeds: Sequence[int], digits: int = 1) -> str:
    """``pm`` followed by every seed's own figure, in the order given: "53.2 ± 1.2 (s0 51.9,
    s1 54.0, s2 53.9)"; one seed alone reads "51.9 (s0)". A mean over seeds hides which
    seed carries a gap, and a single seed's figure must not read as a mean (issue #44)."""
    if len(values) != len(seeds):
        raise ValueError(f"{len(values)} values for {len(seeds)} seeds")
    if not values:
        return "-"
    each = ", ".join(f"s{seed} {value:.{digits}f}" if math.isfinite(value) else f"s{seed} -"
                     for seed, value in zip(seeds, values, strict=True))
    if len(values) == 1:
        return f"{pm(values, digits)} (s{seeds[0]})"
    return f"{pm(values, digits)} ({each})"

"""What a run leaves on disk: history.json (one record per round, the run manifest at
its head) and the checkpoints a resume starts from.

``RunHistory`` is held by the engine, which builds each checkpoint's state (it owns the
aggregator, the edges and the counters) and hands it here to be written. The write runs
on a worker thread while the next round's tasks go out; the engine waits for it
(``durable``) before anything changes the state the write views.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.config import EVAL_DETAIL_WITH_DP, ServerConfig, TrainConfig
from fedattn_shared.methods.base import Method
from fedattn_shared.privacy.secagg import SecAggPolicy
from fedattn_shared.runconfig import RunConfig, RunConfigError
from fedattn_shared.state import atomic_write, read_json

from .checkpoint import CheckpointStore
from .memory import log_memory
from .metrics import ServerMetrics
from .settings import ServerSettings

log = logging.getLogger("fl_server")


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of the global state, logged on resume: two runs that should match can be
    compared from their logs."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def run_manifest(server: ServerSettings, train: TrainConfig, method: Method) -> dict:
    """The head of history.json: versions, configuration and seeds, so that a result can
    be traced to the code and settings that made it (the join token redacted)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return {
        "fedattn": v("fedattn"), "git_sha": sha or "unknown", "python": sys.version.split()[0],
        "platform": platform.platform(), "torch": torch.__version__, "grpcio": v("grpcio"),
        "protocol_version": PROTOCOL_VERSION, "method": method.name,
        "aggregator": method.aggregator_kind.value,
        "server": {**{f.name: getattr(server, f.name) for f in dataclasses.fields(ServerConfig)},
                   "join_token": "<redacted>" if server.join_token else ""},
        "train": train.__dict__, "params": method.describe_params(),
        "dp": dataclasses.asdict(method.dp) if method.dp is not None else None,
        "seeds": {"train": train.seed},
        "compress": server.compression.text,
        "mode": server.mode,
    }


def history_text(history: dict[str, Any], encoded: list[tuple[dict, str]]) -> str:
    """history.json's text, one line per round. ``encoded`` keeps each round's JSON from
    one call to the next: records never change once their round is over, so each is
    encoded once, by the C encoder. (The pure Python encoder, which ``indent`` selects,
    re-encoding the whole history cost the event loop ~0.3 ms per past round, every
    round.) A history that was replaced (a resume) is encoded afresh."""
    rounds = history["rounds"]
    if len(encoded) > len(rounds) or (encoded and encoded[0][0] is not rounds[0]):
        encoded.clear()
    for record in rounds[len(encoded):]:
        encoded.append((record, json.dumps(record, sort_keys=True)))
    head = "".join(f"{json.dumps(key)}: {json.dumps(value, sort_keys=True)}, "
                   for key, value in sorted(history.items()) if key != "rounds")
    return "{" + head + '"rounds": [\n' + ",\n".join(text for _, text in encoded) + "\n]}"


def run_config(server: ServerSettings, train: TrainConfig, method: Method,
               secagg: SecAggPolicy | None = None) -> str:
    """The run configuration as JSON (``RunConfig``): what every edge builds its method
    from (sent at join) and what a checkpoint must have been written with to be resumed.
    "method" is what the edge loads: the registered name or a module:Class spec; ``secagg``
    (the SecAgg policy) is what every edge holds each SecAgg round to, not the round's word."""
    if server.eval_detail and method.dp is not None:
        # resolve() refuses it first; a ServerApp built in code too
        raise ValueError(EVAL_DETAIL_WITH_DP)
    return RunConfig(method=server.method, train=train, params=method.describe_params(),
                     dp=method.dp, secagg=secagg, compress=server.compression,
                     mode=server.mode, eval_detail=server.eval_detail).to_json()


Snapshot = tuple[int, dict[str, torch.Tensor], dict, str]


def same_run_config(saved: object, current: dict) -> bool:
    """Whether a checkpoint's run config is this run's. Compared parsed (``RunConfig``)
    and written back in full, not as the stored text: a checkpoint written before a [train]
    or [dp] key existed lacks it, and reads as that key's default, which is what the run
    then had (so a release that adds a setting still resumes its predecessor's
    checkpoints when the flags are the same). A key set to another value, or a config
    that does not parse, is different. The method's params are compared as they were
    written (their defaults live with the method)."""
    if saved == current:
        return True
    try:
        return (RunConfig.from_dict(saved, "checkpoint").to_dict()
                == RunConfig.from_dict(current, "run").to_dict())
    except RunConfigError:
        return False


class RunHistory:
    """history.json and the checkpoint store of one run, and the checkpoint write in
    flight. ``data`` is the history as history.json holds it."""

    def __init__(self, server: ServerSettings, train: TrainConfig, method: Method,
                 metrics: ServerMetrics):
        self.store = CheckpointStore(Path(server.checkpoint_dir), server.keep_checkpoints)
        self.path = Path(server.checkpoint_dir) / "history.json"
        self.data: dict[str, Any] = {"manifest": run_manifest(server, train, method),
                                     "rounds": []}
        self.metrics = metrics
        self._encoded_rounds: list[tuple[dict, str]] = []  # (record, its JSON)
        self.checkpointing: asyncio.Task | None = None

    def load(self, fingerprint: str, config: dict) -> tuple[int, dict[str, torch.Tensor], dict]:
        """The latest checkpoint (round, tensors, state), refused when it was written for
        another model, method or configuration; the history is cut back to its round."""
        round_number, tensors, state = self.store.load()
        if state.get("fingerprint") != fingerprint:
            raise ValueError(f"{self.store.root}: checkpoint is for a different model/method "
                             f"(fingerprint {state.get('fingerprint')}, this run "
                             f"{fingerprint}); resume with the same configuration")
        if not same_run_config(state.get("config"), config):
            raise ValueError(f"{self.store.root}: checkpoint was written with a different "
                             "configuration; resume with the same flags and config file")
        if self.path.exists():
            history = read_json(self.path)
            history["rounds"] = [r for r in history["rounds"] if r["round"] <= round_number]
            self.data = history
        return round_number, tensors, state

    def snapshot(self, round_number: int, tensors: dict[str, torch.Tensor],
                 state: dict) -> Snapshot:
        """Everything a checkpoint holds, taken between rounds (the history as text now)."""
        return round_number, tensors, state, history_text(self.data, self._encoded_rounds)

    def write_checkpoint(self, round_number: int, tensors: dict[str, torch.Tensor], state: dict,
                         history_json: str) -> None:
        """Writes one round's history and checkpoint (a worker thread)."""
        # history first: a crash before the manifest moves resumes the previous round and
        # truncates the history to it.
        atomic_write(self.path, (history_json + "\n").encode(), mode=0o644)
        self.store.save(round_number, tensors, state)
        log.info("checkpoint round %d written", round_number)
        log_memory("checkpoint round %d written", round_number)

    def record_changed(self) -> None:
        """A round record changed after it was written (``--mode async``: a version's
        evaluation arrives later): the next write encodes the history afresh."""
        self._encoded_rounds.clear()

    async def write_history(self) -> None:
        """Writes history.json alone, after the checkpoint in flight (which writes it too):
        an async run's evaluations arrive after their version's checkpoint. The text is
        taken on the event loop, written on a worker thread."""
        await self.durable()
        text = history_text(self.data, self._encoded_rounds) + "\n"
        await asyncio.to_thread(atomic_write, self.path, text.encode(), mode=0o644)

    def start_checkpoint(self, snapshot: Snapshot, record: dict[str, Any], participants: int,
                         selected: int) -> None:
        """Writes the round's checkpoint on a worker thread while the next round's tasks
        go out. The snapshot is taken now; the tensors it views change only when the next
        round aggregates, and that waits for the write (``durable``). A crash before the
        write ends resumes from the round before, as a crash later in the round would.
        The round counts as completed (metrics, log) once its checkpoint is on disk."""
        test = record.get("evaluation", {}).get("summary", {}).get("test", {})
        metrics = self.metrics

        async def write() -> None:
            started = time.monotonic()
            await asyncio.to_thread(self.write_checkpoint, *snapshot)
            metrics.checkpoint_seconds.observe(time.monotonic() - started)
            metrics.checkpoint_round.set(record["round"])
            metrics.checkpoint_timestamp.set_to_current_time()
            metrics.round.set(record["round"])
            metrics.rounds_completed.inc()
            metrics.round_seconds.observe(record["seconds"])
            if "version" in record:  # --mode async: its scores come later (``evaluated``)
                log.info("version %d done in %.2fs: %d results", record["round"],
                         record["seconds"], participants)
            else:
                log.info("round %d done in %.2fs: %d/%d results, mean test accuracy %s",
                         record["round"], record["seconds"], participants, selected,
                         f"{test['mean_accuracy']:.4f}" if test else "n/a")

        self.checkpointing = asyncio.create_task(write())

    @staticmethod
    def evaluated(record: dict[str, Any]) -> None:
        """Logs a version's scores once they are in (``--mode async``: after the version's
        own line, which has none yet)."""
        test = record.get("evaluation", {}).get("summary", {}).get("test", {})
        log.info("version %d evaluated: mean test accuracy %s over %d edges", record["round"],
                 f"{test['mean_accuracy']:.4f}" if test else "n/a", test.get("edges", 0))

    async def durable(self) -> None:
        """Waits until the last round's checkpoint is on disk; re-raises its failure."""
        if self.checkpointing is not None:
            await asyncio.shield(self.checkpointing)

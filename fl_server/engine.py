"""The round engine: rounds are ordered phases; each phase sends tasks, waits for a
quorum of results or its deadline, and hands validated results to the aggregator.

Everything runs on one asyncio loop; aggregation and checkpoint writes run in worker
threads under ``agg_lock`` so the running sum is never touched by two uploads at once
and never after its phase has closed.

Nothing an edge sends and nothing a method raises ends the process. An upload the method
or the aggregator cannot take is refused and costs its edge the task. A phase that cannot
close (its aggregator raises, or the new state holds a non-finite or beyond-float32
value) aborts its round: the aggregator returns to its state before the round (nothing
of the round is applied), the history records ``"aborted"`` with the reason, and the next
round runs. Weights are bounded (``server.max_weight`` and what the edge declared at
join) and, with ``server.clip_update_norm``, so is each upload's distance from the global.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import math
import re
import secrets
import time
from typing import Any

import numpy as np
import torch

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods.aggregators import SUM_STEP, RoundSnapshot
from fedattn_shared.methods.base import Method, SectionSpec
from fedattn_shared.methods.phases import EVALUATE, TRAIN
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import ByteMeter
from fedattn_shared.wire.codec import dtype_name, encode, section_layout, torch_dtype
from fedattn_shared.wire.payload import Kind, Payload, WireError
from fedattn_shared.wire.transport import data_frames

from .edges import EdgeBook
from .evaluation import split_figures, summarize
from .history import RunHistory, tensors_digest
from .initial import initial_payload
from .metrics import ServerMetrics, drop_reason_label
from .phase import Phase, Refused, RoundAborted, Task, select_edges
from .secagg import SecAggDriver

log = logging.getLogger("fl_server")


# A declared training-set size: decimal digits only (no sign, exponent or Unicode digits).
DECLARED_COUNT = re.compile(r"[0-9]{1,20}")


class Engine:
    def __init__(self, server: ServerConfig, train: TrainConfig, method: Method,
                 meter: ByteMeter, metrics: ServerMetrics):
        self.cfg = server
        self.train = train
        self.method = method
        self.meter = meter
        self.metrics = metrics
        self.models = method.build_models()
        self.fingerprint = method.fingerprint(self.models)
        # Pretrained weights: the global starts from them, and edges without private state
        # get the whole initial models once, so their private parts start there too.
        self.init_payload = initial_payload(self.models, server.init_weights, method.head,
                                            server.init_skip_head)
        self.aggregator = method.server(self.models)
        self.schemas: dict[str, list[SectionSpec]] = {
            phase: method.uplink_schema(phase, self.models) for phase in method.phases}
        self.edges = EdgeBook(server.max_edges)
        # Secure aggregation: refuses (ValueError, exit 2) a method it cannot serve.
        self.secagg = (SecAggDriver(server, method, self.models, self.aggregator)
                       if server.secagg else None)
        self.runlog = RunHistory(server, train, method, metrics)
        self.round = 0
        self.task_counter = 0
        self.state_version = 0
        self.instance = secrets.token_hex(4)
        self.phase: Phase | None = None
        self.finished = False
        self.agg_lock = asyncio.Lock()
        # "method" is what the edge loads: the registered name or a module:Class spec.
        config = {"method": server.method, "train": train.__dict__,
                  "params": method.describe_params()}
        if method.dp is not None:  # the resolved [dp] section: every edge calibrates from it
            config["dp"] = dataclasses.asdict(method.dp)
        if self.secagg is not None:  # every edge holds each SecAgg round to these, not the round's word
            config["secagg"] = self.secagg.policy.to_config()
        self.config_json = json.dumps(config, sort_keys=True)

    # ---- state ------------------------------------------------------------------------
    def resume(self) -> None:
        """Continues the run from its latest checkpoint (``--resume``)."""
        round_number, tensors, state = self.runlog.load(self.fingerprint,
                                                        json.loads(self.config_json))
        self.aggregator.load_state(tensors, state["aggregator"])
        self.edges = EdgeBook.from_json(state["registry"], self.cfg.max_edges)
        self.round = round_number
        self.task_counter = int(state["task_counter"])
        log.info("resumed from round %d (state digest %s)", round_number,
                 tensors_digest(self.aggregator.state_tensors()))

    @property
    def history(self) -> dict[str, Any]:
        """history.json's content (manifest and round records)."""
        return self.runlog.data

    @property
    def store(self):
        """The checkpoint store (app.start refuses a directory that already holds one)."""
        return self.runlog.store

    def snapshot(self):
        """Everything a checkpoint holds, taken between rounds."""
        state = {
            "round": self.round, "fingerprint": self.fingerprint,
            "config": json.loads(self.config_json), "aggregator": self.aggregator.state_meta(),
            "registry": self.edges.to_json(), "task_counter": self.task_counter,
        }
        tensors = self.aggregator.state_tensors()  # live: nothing aggregates until written
        return self.runlog.snapshot(self.round, tensors, state)

    async def durable(self) -> None:
        """Waits until the last round's checkpoint is on disk; re-raises its failure."""
        await self.runlog.durable()

    # ---- edges ------------------------------------------------------------------------
    def edge_lost(self, edge_id: str, reason: str) -> None:
        phase = self.phase
        if phase is not None and not phase.closed and edge_id in phase.pending():
            self.drop(phase, edge_id, reason)

    def drop(self, phase: Phase, edge_id: str, reason: str) -> None:
        phase.dropped[edge_id] = reason
        self.metrics.dropped.labels(phase.name, drop_reason_label(reason)).inc()
        log.warning("round %d %s: dropped %s (%s)", phase.round, phase.name, edge_id, reason)
        phase.maybe_close()

    def task_for(self, edge_id: str) -> tuple[Phase, Task] | None:
        phase = self.phase
        if phase is None or phase.closed or edge_id not in phase.pending():
            return None
        return phase, phase.tasks[edge_id]

    # ---- uploads ------------------------------------------------------------------------
    def check_submission(self, header: pb.SubmitHeader) -> tuple[Phase, list[SectionSpec]]:
        phase = self.phase
        edge = header.edge_id
        if phase is None or phase.closed:
            raise Refused("no phase is open")
        task = phase.tasks.get(edge)
        if task is None:
            raise Refused(f"edge {edge} has no task in round {phase.round} {phase.name}")
        if header.round != phase.round or header.task_id != task.task_id or header.phase != phase.name:
            raise Refused(f"stale or wrong task (round {header.round}, task {header.task_id}, "
                          f"phase {header.phase!r}; open: round {phase.round}, task "
                          f"{task.task_id}, phase {phase.name!r})")
        if not hmac.compare_digest(header.task_nonce, task.nonce):
            raise Refused(f"task nonce does not match task {task.task_id} (a replay?)")
        if edge in phase.received:
            raise Refused(f"duplicate submission for task {task.task_id}")
        if edge in phase.dropped:
            raise Refused(f"task {task.task_id} was already dropped ({phase.dropped[edge]})")
        schema = self.schemas.get(phase.name, [])
        self.validate_manifest(header.payload, schema, edge)
        if phase.name == TRAIN and header.num_examples < 1 and not self.secured(phase.name):
            raise Refused("num_examples must be >= 1 for a training result", drop=True)
        if phase.name != EVALUATE and not self.secured(phase.name):
            # Refused before a byte of the body is read: the weight is the header's.
            cap, why = self.weight_cap(edge)
            if header.num_examples > cap:
                raise Refused(f"num_examples {header.num_examples} exceeds the weight cap "
                              f"{cap} of edge {edge} ({why})", drop=True)
        if phase.name == EVALUATE:
            self.validate_evaluation(header)
        self.check_metrics(header)
        return phase, schema

    def check_metrics(self, header: pb.SubmitHeader) -> None:
        """A result's monitoring figures become metric series and history entries, so only
        the names the method declares (``Method.metric_names``) are kept: more entries than
        there are names is refused, unknown names are logged here and ignored by ``accept``
        (a newer edge may report a figure this server does not know; the header itself
        stays as signed)."""
        allowed = self.method.metric_names()
        if len(header.metrics) > len(allowed):
            raise Refused(f"{len(header.metrics)} metrics, at most {len(allowed)} (the names "
                          f"method {self.method.name} reports)", drop=True)
        unknown = sorted(name for name in header.metrics if name not in allowed)
        if unknown:
            log.warning("round %d: %s reported metrics %s that method %s does not declare; "
                        "ignored", header.round, header.edge_id,
                        ", ".join(repr(n[:40]) for n in unknown[:3]), self.method.name)

    def secured(self, phase: str) -> bool:
        """Whether secure aggregation handles this phase's uploads (not the method)."""
        return self.secagg is not None and self.secagg.owns(phase)

    def weight_cap(self, edge_id: str) -> tuple[int, str]:
        """The largest num_examples (the aggregation weight n_k) this edge's uploads may
        claim, and where it comes from: the training-set size the edge declared at join
        (``info["num_examples"]``), never above ``server.max_weight``; ``max_weight``
        itself for an edge that declared none. A declaration that is not a whole number
        >= 1 caps the edge at 0: none of its weighted uploads is taken."""
        bound = self.cfg.max_weight
        record = self.edges.records.get(edge_id)
        declared = record.info.get("num_examples") if record is not None else None
        if declared is None:
            return bound, f"--max-weight {bound}; the edge declared no num_examples at join"
        if not DECLARED_COUNT.fullmatch(declared) or int(declared) < 1:
            return 0, (f"its join declared num_examples={declared[:40]!r}, not a whole "
                       "number >= 1")
        if int(declared) > bound:
            return bound, (f"--max-weight {bound}; the edge declared {int(declared)} at "
                           "join: raise --max-weight for so large a training set")
        return int(declared), "the num_examples the edge declared at join"

    def bound_update(self, phase: Phase, edge: str, payload: Payload) -> float | None:
        """``--clip-update-norm``: the L2 norm of the upload's model delta (upload minus the
        current global, over the floating tensors of its SHARED_TENSORS sections that the
        global holds: parameters and BatchNorm statistics alike). Statistics vectors,
        prototypes, scalars and control variates are not model weights and have no global
        value to take a difference from: the bound leaves them to the method's checks.
        Over the bound, ``refuse`` refuses the upload by name; ``scale`` moves it onto the
        sphere of radius C around the global, in place in the receive buffer (no copy).
        Returns the norm (before scaling), or None when the upload holds no model tensor.
        Runs in a worker thread under ``agg_lock``: the global cannot change meanwhile."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for section in payload.sections:
            if section.kind != Kind.SHARED_TENSORS:
                continue
            current = self.aggregator.state.get((section.kind, section.name), {})
            for name, value in section.tensors.items():
                base = current.get(name)
                if (base is None or not value.is_floating_point()
                        or tuple(base.shape) != tuple(value.shape)):
                    continue
                pairs.append((value.reshape(-1), base.reshape(-1)))
        if not pairs:
            return None
        squares = 0.0
        for value, base in pairs:  # float64 in steps: no overflow, no model-sized buffer
            for start in range(0, value.numel(), SUM_STEP):
                delta = value[start : start + SUM_STEP].to(torch.float64)
                delta.sub_(base[start : start + SUM_STEP])
                squares += float(delta.dot(delta))
        norm = math.sqrt(squares)
        bound = self.cfg.clip_update_norm
        if norm <= bound:
            return norm
        if self.cfg.clip_update_mode == "refuse":
            raise Refused(f"update norm {norm:.6g} exceeds --clip-update-norm {bound:g} (L2 norm "
                          "of the upload minus the global over its shared model tensors)",
                          drop=True)
        scale = bound / norm
        for value, base in pairs:
            for start in range(0, value.numel(), SUM_STEP):
                piece = value[start : start + SUM_STEP]
                delta = piece.to(torch.float64)
                delta.sub_(base[start : start + SUM_STEP]).mul_(scale)
                delta.add_(base[start : start + SUM_STEP])
                piece.copy_(delta)
        self.metrics.updates_scaled.inc()
        log.info("round %d %s: scaled the update of %s from norm %.6g to %g", phase.round,
                 phase.name, edge, norm, bound)
        return norm

    def aggregate_upload(self, phase: Phase, edge: str, payload: Payload, weight: float,
                         secured: bool) -> float | None:
        """Bound the update, then hand the upload to the aggregator, or to secure
        aggregation for its phases (a worker thread, under ``agg_lock``). ValueError and
        Refused: the upload is refused, nothing was added. Any other exception is a bug
        that may have left part of the upload in the sums: the upload is refused and the
        phase marked tainted, so its round aborts instead of applying a half-added
        aggregate. Returns the update norm (None when not measured)."""
        norm = None
        if self.cfg.clip_update_norm and not secured:
            norm = self.bound_update(phase, edge, payload)
        try:
            if secured:
                self.secagg.accept(phase.name, edge, payload)
            else:
                self.aggregator.accept_phase(phase.name, edge, payload, weight)
        except ValueError:
            raise
        except Exception as err:
            phase.tainted = phase.tainted or (
                f"the aggregator failed on {edge}'s upload ({type(err).__name__}: {err}); its "
                "sums may hold part of it")
            log.error("round %d %s: the aggregator failed on %s's upload; the phase will not "
                      "be applied", phase.round, phase.name, edge, exc_info=True)
            raise Refused(f"{phase.name} upload: the server could not aggregate it "
                          f"({type(err).__name__})", drop=True) from None
        return norm

    def validate_manifest(self, manifest: pb.PayloadManifest, schema: list[SectionSpec],
                          edge: str) -> None:
        expected = {(int(s.kind), s.name): s for s in schema}
        seen = set()
        for section in manifest.sections:
            key = (section.kind, section.name)
            kind_name = (pb.SectionKind.Name(section.kind)
                         if section.kind in pb.SectionKind.values() else str(section.kind))
            label = f"{kind_name}:{section.name!r}"
            if key not in expected:
                raise Refused(f"section {label} is not in method {self.method.name}'s "
                              f"upload schema", drop=True)
            if key in seen:
                raise Refused(f"section {label} appears twice", drop=True)
            seen.add(key)
            try:
                layout = section_layout(section)
            except WireError:
                layout = None  # refused below, naming the offending tensor
            if layout is not None and (layout.names, layout.dtypes,
                                       layout.shapes) == expected[key].full_layout:
                continue  # the whole section exactly as specified: the usual upload
            specs = expected[key].tensors
            names = [t.name for t in section.tensors]
            # Every required tensor exactly once; optional ones (a per-class subset) at most once.
            missing = sorted(expected[key].required - set(names))[:3]
            extra = sorted(set(names) - set(specs))[:3]
            if missing or extra or len(set(names)) != len(names):
                raise Refused(f"section {label}: tensor names differ from the schema "
                              f"(missing {missing}, unexpected {extra})", drop=True)
            for meta in section.tensors:
                spec = specs[meta.name]
                try:
                    dtype = torch_dtype(meta.dtype)
                except WireError:
                    dtype = None
                if dtype != spec.dtype:
                    raise Refused(f"section {label} tensor {meta.name!r}: dtype "
                                  f"{dtype_name(meta.dtype)}, expected {spec.dtype}", drop=True)
                if tuple(meta.shape) != spec.shape:
                    raise Refused(f"section {label} tensor {meta.name!r}: shape "
                                  f"{list(meta.shape)}, expected {list(spec.shape)}", drop=True)
        missing_sections = set(expected) - seen
        if missing_sections:
            raise Refused(f"missing sections {sorted(missing_sections)}", drop=True)

    def validate_evaluation(self, header: pb.SubmitHeader) -> None:
        classes = self.train.num_classes
        if not header.evaluation:
            raise Refused("evaluation result without any split", drop=True)
        splits = [entry.split for entry in header.evaluation]
        if len(set(splits)) != len(splits):
            raise Refused("an evaluation split appears twice", drop=True)
        for entry in header.evaluation:
            if entry.split not in ("test", "global_test"):
                raise Refused(f"evaluation split {entry.split[:40]!r} is unknown", drop=True)
            if entry.num_classes != classes or len(entry.counts) != classes * classes:
                raise Refused(f"evaluation {entry.split}: expected {classes}x{classes} counts",
                              drop=True)
            if any(c < 0 for c in entry.counts):
                raise Refused(f"evaluation {entry.split}: negative counts", drop=True)
            if not (math.isfinite(entry.loss_sum) and math.isfinite(entry.brier_sum)):
                raise Refused(f"evaluation {entry.split}: non-finite loss or Brier sum", drop=True)

    async def accept(self, phase: Phase, header: pb.SubmitHeader, payload: Payload) -> None:
        """Takes a validated upload into the phase. Whatever the method or the aggregator
        raises on it refuses the upload and costs the edge its task; none of it reaches
        the event loop or the process."""
        edge = header.edge_id
        secured = self.secured(phase.name)
        try:
            if not secured:
                self.method.check_upload(phase.name, payload)
        except ValueError as err:
            raise Refused(str(err), drop=True) from None
        except Exception as err:
            log.error("round %d %s: method %s failed checking %s's upload", phase.round,
                      phase.name, self.method.name, edge, exc_info=True)
            raise Refused(f"the method could not check this upload ({type(err).__name__})",
                          drop=True) from None
        async with self.agg_lock:
            await self.durable()  # the last round's checkpoint views the state this changes
            if phase.closed or edge not in phase.pending():
                raise Refused("the phase closed before the upload completed")
            try:
                await self.take(phase, header, payload, secured)
            except Refused:
                raise
            except ValueError as err:  # values the method cannot use: the edge's fault
                raise Refused(f"{phase.name} upload: {err}", drop=True) from None
            except Exception as err:
                log.error("round %d %s: %s's upload failed on the server", phase.round,
                          phase.name, edge, exc_info=True)
                raise Refused(f"{phase.name} upload: the server could not take it "
                              f"({type(err).__name__})", drop=True) from None
            phase.maybe_close()

    async def take(self, phase: Phase, header: pb.SubmitHeader, payload: Payload,
                   secured: bool) -> None:
        """The body of ``accept``, under ``agg_lock``: aggregate, then record the result."""
        edge = header.edge_id
        norm = None
        if secured:
            await asyncio.to_thread(self.aggregate_upload, phase, edge, payload, 0.0, True)
        elif phase.name != EVALUATE:
            weight = self.method.aggregation_weight(int(header.num_examples))
            started = time.monotonic()
            norm = await asyncio.to_thread(self.aggregate_upload, phase, edge, payload, weight,
                                           False)
            self.metrics.aggregation_seconds.labels(phase.name, "accept").observe(
                time.monotonic() - started)
        # Monitoring figures only, of the names the method declares (``check_metrics``);
        # non-finite ones would make history.json invalid JSON.
        allowed = self.method.metric_names()
        figures = {k: v for k, v in header.metrics.items() if k in allowed and math.isfinite(v)}
        if "dp_epsilon" in header.metrics:
            self.metrics.dp_epsilon.labels(edge).set(header.metrics["dp_epsilon"])
        result = {
            "num_examples": int(header.num_examples),
            "metrics": figures,
            "evaluation": {
                e.split: split_figures(np.array(e.counts, dtype=np.int64).reshape(
                    e.num_classes, e.num_classes), e.loss_sum, e.brier_sum)
                for e in header.evaluation
            },
        }
        if norm is not None:
            result["update_norm"] = norm
        phase.received[edge] = result
        self.metrics.reported.labels(phase.name).inc()
        self.metrics.edge_last_round.labels(edge).set(phase.round)
        for name, value in figures.items():
            self.metrics.edge_result.labels(edge, name).set(value)

    # ---- rounds -------------------------------------------------------------------------
    async def wait_for_edges(self, count: int) -> None:
        announced = False
        while len(self.edges.connected_ids()) < count:
            if not announced:
                log.info("waiting for %d connected edge(s) (have %d)", count,
                         len(self.edges.connected_ids()))
                announced = True
            await asyncio.sleep(0.1)

    async def run(self) -> None:
        self.metrics.rounds_planned.set(self.cfg.rounds)
        self.metrics.init_phases(self.secagg.expand(self.method.phases) if self.secagg
                                 else list(self.method.phases))
        if self.method.dp is not None and self.method.dp.target_epsilon:
            self.metrics.export_dp_budget(self.method.dp.target_epsilon)
        self.metrics.round.set(self.round)
        while self.round < self.cfg.rounds:
            # Every round starts with at least --min-edges connected (as Flower's
            # min_available_clients); stragglers inside a round are what --quorum tolerates.
            await self.wait_for_edges(self.cfg.min_edges)
            await self.run_round(self.round + 1)
        await self.durable()
        self.finished = True
        self.phase = None
        self.edges.wake_all()
        log.info("run finished after %d rounds", self.round)

    async def run_round(self, round_number: int) -> None:
        """Runs the method's phases in order. Non-evaluation phases go to the selected
        edges (minus those an earlier phase of the round lost); evaluation goes to every
        connected edge, every --eval-every rounds and after the last. A phase that cannot
        close aborts the round: the aggregator goes back to its state at the round's start,
        the later aggregating phases are skipped, and evaluation (when due) scores the kept
        global."""
        started = time.monotonic()
        selected = select_edges(self.edges.connected_ids(), self.cfg.fraction,
                                self.train.seed, round_number)
        # Wall-clock start: consecutive starts give the full round period, checkpoint included.
        record: dict[str, Any] = {"round": round_number, "started": time.time(), "aggregate": {}}
        aborted = False
        snapshot: RoundSnapshot | None = None
        try:
            self.aggregator.begin_round(round_number, selected, len(self.edges.records))
            if self.secagg is not None:
                self.secagg.begin_round(round_number, self.edges)
            # References to the global (no copy); taken before the checkpoint write ends,
            # which only reads the state.
            snapshot = self.aggregator.snapshot_round()
        except Exception as err:
            self.abort_round(record, "begin", err)
            aborted = True
        participants = list(selected)
        eval_every = self.cfg.eval_every
        eval_due = bool(eval_every) and (round_number % eval_every == 0
                                         or round_number == self.cfg.rounds)
        phases = self.secagg.expand(self.method.phases) if self.secagg else self.method.phases
        for index, name in enumerate(phases):
            if name == EVALUATE:
                if all(later == EVALUATE for later in phases[index + 1:]):
                    snapshot = None  # nothing left to undo: let the previous global go
                if eval_due:
                    edges = self.edges.connected_ids()
                    try:
                        evaluation = await self.run_phase(EVALUATE, round_number, edges,
                                                          len(edges))
                    except RoundAborted as err:  # the global stands; only its scores are lost
                        record["evaluation_skipped"] = str(err)
                        log.error("round %d: no evaluation: %s", round_number, err,
                                  exc_info=err)
                        continue
                    record[EVALUATE] = self.phase_record(evaluation)
                    per_edge = {e: r["evaluation"] for e, r in evaluation.received.items()}
                    record["evaluation"] = {"per_edge": per_edge, "summary": summarize(per_edge)}
                    self.publish_evaluation(per_edge, record["evaluation"]["summary"])
                continue
            if aborted:
                continue
            secured = self.secured(name)
            if secured and self.secagg.skip(name):
                continue  # the protocol aborted: the aggregator closed with nothing
            quorum = min(self.cfg.quorum or len(participants), len(participants))
            timeout = self.cfg.round_timeout
            if secured:
                self.schemas[name] = self.secagg.schema(name)
                timeout = self.secagg.deadline(name, timeout)
                if name not in self.method.phases:
                    quorum = len(participants)  # protocol steps wait for every edge
            try:
                phase = await self.run_phase(name, round_number, participants, quorum, timeout)
            except RoundAborted as err:
                await self.restore(snapshot)
                self.abort_round(record, name, err)
                aborted = True
                continue
            async with self.agg_lock:
                closing = time.monotonic()
                figures, failure = await asyncio.to_thread(self.close_checked, name, secured,
                                                           phase, snapshot)
                self.metrics.aggregation_seconds.labels(name, "close").observe(
                    time.monotonic() - closing)
                if figures.get("aggregated"):
                    self.state_version += 1
            record[name] = self.phase_record(phase)
            if failure is not None:
                self.abort_round(record, name, failure)
                aborted = True
                continue
            record["aggregate"].update(figures)
            participants = [e for e in participants if e in phase.received]
        record["seconds"] = time.monotonic() - started
        record["bytes"] = self.meter.take_round()
        await self.durable()  # a round that aggregated nothing did not wait for the last one
        self.round = round_number
        self.runlog.data["rounds"].append(record)
        self.runlog.start_checkpoint(self.snapshot(), record, len(participants), len(selected))

    def close_checked(self, name: str, secured: bool, phase: Phase,
                      snapshot: RoundSnapshot | None) -> tuple[dict[str, Any], Exception | None]:
        """Closes a phase (a worker thread, under ``agg_lock``) and checks the state it
        leaves before anything publishes it (the next broadcast, the checkpoint). Returns
        (figures, None), or ({}, the reason) after putting the aggregator back to
        ``snapshot`` when the close raised, the phase was tainted or the new state holds a
        non-finite or beyond-float32 value."""
        try:
            if phase.tainted:
                raise RoundAborted(phase.tainted)
            close = self.secagg.close if secured else self.aggregator.close_phase
            figures = close(name)
            bad = self.aggregator.unusable_tensors(snapshot) if snapshot is not None else []
            if bad:
                more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
                raise RoundAborted(f"the aggregate is not finite within float32 range in "
                                   f"{', '.join(bad[:3])}{more}; it was not applied")
            return figures, None
        except Exception as err:
            if snapshot is not None:
                # A failure here leaves the state unknown: it propagates and stops the
                # server, which resumes from the last checkpoint.
                self.aggregator.restore_round(snapshot)
            return {}, err

    async def restore(self, snapshot: RoundSnapshot | None) -> None:
        """Puts the aggregator back to the round's start (an earlier phase may have
        changed it) when a later phase cannot even start."""
        if snapshot is not None:
            async with self.agg_lock:
                await asyncio.to_thread(self.aggregator.restore_round, snapshot)

    def abort_round(self, record: dict[str, Any], phase: str, err: Exception) -> None:
        """Records why the round aborted (history and metrics) and logs it: with the
        traceback when the cause is an error in the server or the method, without when it
        is the aggregate's values."""
        reason = str(err) if isinstance(err, RoundAborted) else f"{type(err).__name__}: {err}"
        record["aborted"] = f"{phase}: {reason}"
        record["aggregate"] = {}
        self.metrics.rounds_aborted.inc()
        internal = not isinstance(err, RoundAborted) or err.__cause__ is not None
        log.error("round %d %s: round aborted, the global stays as it was: %s",
                  record["round"], phase, reason, exc_info=err if internal else None)

    def phase_record(self, phase: Phase) -> dict:
        record = {
            "selected": sorted(phase.tasks), "received": sorted(phase.received),
            "dropped": dict(sorted(phase.dropped.items())), "quorum": phase.quorum,
            "seconds": time.monotonic() - phase.started,
            "edge_metrics": {e: r["metrics"] for e, r in sorted(phase.received.items())
                             if r["metrics"]},
            "num_examples": {e: r["num_examples"] for e, r in sorted(phase.received.items())},
        }
        # --clip-update-norm: each accepted upload's distance from the global (before any
        # scaling), what an operator chooses C from.
        norms = {e: r["update_norm"] for e, r in sorted(phase.received.items())
                 if "update_norm" in r}
        if norms:
            record["update_norm"] = norms
        return record

    def publish_evaluation(self, per_edge: dict, summary: dict) -> None:
        for edge, splits in per_edge.items():
            for split, figures in splits.items():
                self.metrics.accuracy.labels(edge, split).set(figures["accuracy"])
                self.metrics.loss.labels(edge, split).set(figures["loss"])
        for split, figures in summary.items():
            self.metrics.mean_accuracy.labels(split).set(figures["mean_accuracy"])
            self.metrics.pooled_accuracy.labels(split).set(figures["pooled_accuracy"])
            self.metrics.mean_loss.labels(split).set(figures["mean_loss"])

    def personal_downlink(self, edge_id: str, phase: str) -> Payload:
        payload = self.aggregator.personal(edge_id, phase)
        if self.secured(phase):
            payload = Payload(payload.sections + self.secagg.personal(edge_id, phase).sections)
        record = self.edges.records[edge_id]
        if record.needs_init and self.init_payload is not None:
            record.needs_init = False
            payload = Payload(self.init_payload.sections + payload.sections)
        return payload

    async def run_phase(self, name: str, round_number: int, edges: list[str], quorum: int,
                        timeout: float | None = None) -> Phase:
        try:
            common_payload = self.aggregator.broadcast(
                self.secagg.base_phase(name) if self.secagg else name)
            common = await asyncio.to_thread(encode, common_payload)
            frames = await asyncio.to_thread(
                lambda: list(data_frames(common, self.cfg.chunk_bytes)))
            personal = {e: encode(self.personal_downlink(e, name)) for e in edges}
        except Exception as err:
            raise RoundAborted(f"the {name} downlink could not be built "
                               f"({type(err).__name__}: {err})") from err
        # The id changes when the bytes differ (the manifest carries their CRC-32) and, to
        # rule out a CRC collision on the usual path, whenever a phase aggregated uploads;
        # so an edge's cached copy is reused exactly when it is current.
        layout = hashlib.sha256(common.manifest.SerializeToString(deterministic=True)).hexdigest()
        common_id = f"{self.instance}-v{self.state_version}-{layout[:16]}"
        tasks = {}
        for edge in edges:
            self.task_counter += 1
            tasks[edge] = Task(self.task_counter, edge)
        phase = Phase(
            name=name, round=round_number, tasks=tasks, quorum=quorum,
            common_id=common_id,
            common=common, common_frames=frames,
            personal=personal,
            spec_json=json.dumps({"round": round_number, "rounds": self.cfg.rounds, "phase": name}),
        )
        self.phase = phase
        self.metrics.selected.labels(name).inc(len(tasks))
        log.info("round %d %s: %d task(s), quorum %d", round_number, name, len(tasks), quorum)
        for edge in edges:
            self.edges.records[edge].wakeup.set()
        # While the edges download, the last round's checkpoint finishes (or its failure
        # stops the server here, before anything of this round is aggregated).
        await self.durable()
        phase.maybe_close()
        try:
            await asyncio.wait_for(phase.done.wait(), timeout=timeout or self.cfg.round_timeout)
        except asyncio.TimeoutError:
            self.metrics.phase_timeouts.labels(name).inc()
            for edge in phase.pending():
                self.drop(phase, edge, "deadline")
        async with self.agg_lock:
            phase.closed = True
            phase.closing.set()
        for edge in phase.pending():
            phase.dropped[edge] = "phase closed at quorum"
            self.metrics.dropped.labels(name, drop_reason_label("phase closed at quorum")).inc()
        # Edges still streaming hold their own reference; the phase no longer needs a copy.
        phase.common_frames = []
        self.metrics.participants.labels(name).set(len(phase.received))
        self.metrics.phase_seconds.labels(name).observe(time.monotonic() - phase.started)
        return phase

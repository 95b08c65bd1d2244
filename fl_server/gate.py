"""The upload gate: every check an upload passes before it can touch the aggregate, in
order, in one place -- the README's bad-input promises written as code.

An upload (``Submit``) passes, in this order:

1. who sends, checked once by the transport's call layer (``calls.Call.identify_upload``):
   a valid edge id, the protocol version, a live session of that edge, its certificate
   (mutual TLS);
2. ``admit`` (the header, before a byte of the body is read): the body-MAC IV, an open
   phase, a task of this edge in it, the task's round/id/phase, its nonce (a replay), no
   result yet (a duplicate) and no drop (but one for a lost link, in a phase that keeps
   such tasks: --mode async, ``Phase.revive``), the manifest exactly as the phase's schema, a
   training weight >= 1, the weight cap, the evaluation sums (per-class counts only under
   --eval-detail), the metric names;
3. (the upload pipeline, ``uploads.py``: one stream per task, an upload slot, the body
   within its deadlines)
4. ``verify`` (the body): the signature over header and body MAC, then the driver's
   ``decode`` (a compressed upload back to the method's tensors: a part no honest
   encoder produces is refused by name), then finite values;
5. ``check_values``: the method's own check (``Method.check_upload``);
6. ``take``, under ``agg_lock`` once the last checkpoint is on disk: the phase still
   open, then ``aggregate`` (a worker thread): the update-norm bound
   (``--clip-update-norm``), then the phase driver's ``accept``; then the result.

Each step raises ``Refused``; its ``drop`` says whether the refusal costs the edge its
task (the messages are part of the interface: operators and tests read them). Checks of
who is calling do not drop (a stranger cannot cost an edge its task); checks of what a
registered edge sent for its task do.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods.aggregators import Aggregator
from fedattn_shared.methods.base import Method
from fedattn_shared.methods.exact_sum import SUM_STEP
from fedattn_shared.schema import Kind, Payload, SectionSpec
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.payload import WireError, nonfinite_tensors
from fedattn_shared.wire.serialize import dtype_name, section_layout, torch_dtype
from fedattn_shared.wire.signing import BODY_MAC_IV_BYTES, verify_submission
from fedattn_shared.wire.transport import PayloadAssembler

from .drivers import PhaseDriver
from .edges import EdgeBook, EdgeRecord
from .evaluation import split_figures
from .memory import log_memory
from .metrics import ServerMetrics
from .phase import Phase, Refused

#: A sample's multi-class Brier score, sum_c (p_c - y_c)^2, is at most 2; the slack covers
#: float32 rounding summed over a split.
BRIER_MAX, BRIER_SLACK = 2.0, 1e-5

log = logging.getLogger("fl_server")

# A declared training-set size: decimal digits only (no sign, exponent or Unicode digits).
DECLARED_COUNT = re.compile(r"[0-9]{1,20}")


@dataclass
class Admission:
    """An upload whose header passed: the phase it is for (its driver and the schema its
    body is read against) and the sender's record (keys for the signature and MAC)."""

    phase: Phase
    record: EdgeRecord | None = None


class UploadGate:
    """The checks of the module docstring; holds what they read (configuration, the
    method, the edges, the global for the norm bound) and nothing of a round."""

    def __init__(self, cfg: ServerConfig, train: TrainConfig, method: Method, edges: EdgeBook,
                 aggregator: Aggregator, metrics: ServerMetrics, agg_lock: asyncio.Lock,
                 durable: Callable[[], Awaitable[None]],
                 on_taken: Callable[[Phase], Awaitable[None]] | None = None):
        self.cfg = cfg
        self.classes = train.num_classes
        self.method = method
        self.edges = edges
        self.aggregator = aggregator
        self.metrics = metrics
        self.agg_lock = agg_lock  # the engine's: uploads and closes never overlap
        self.durable = durable  # waits for the last checkpoint, which views the state
        # The schedule's, called after each taken upload, still under agg_lock (--mode
        # async: a full buffer is applied before the next upload is taken).
        self.on_taken = on_taken

    # ---- 2. the header ------------------------------------------------------------------
    def admit(self, header: pb.SubmitHeader, record: EdgeRecord, phase: Phase | None
              ) -> Admission:
        """The header's checks, in order (see the module docstring), for a sender the
        transport identified (step 1)."""
        if len(header.body_mac_iv) != BODY_MAC_IV_BYTES:
            raise Refused(f"body_mac_iv must be {BODY_MAC_IV_BYTES} bytes, "
                          f"got {len(header.body_mac_iv)}")
        admission = self.check_header(header, phase)
        admission.record = record
        return admission

    def check_header(self, header: pb.SubmitHeader, phase: Phase | None) -> Admission:
        """What the header says about the task and the body, against the open phase and
        its driver: task, manifest, weight, evaluation counts, metric names."""
        if phase is None or phase.closed:
            raise Refused(phase.closed_why if phase is not None and phase.closed_why
                          else "no phase is open")
        self.check_task(header, phase)
        driver: PhaseDriver = phase.driver
        self.check_manifest(header.payload, phase.schema)
        if driver.traits.training and header.num_examples < 1:
            raise Refused("num_examples must be >= 1 for a training result", drop=True)
        if driver.traits.weighted:
            # Refused before a byte of the body is read: the weight is the header's.
            cap, why = self.weight_cap(header.edge_id)
            if header.num_examples > cap:
                raise Refused(f"num_examples {header.num_examples} exceeds the weight cap "
                              f"{cap} of edge {header.edge_id} ({why})", drop=True)
        if driver.traits.evaluates:
            self.check_evaluation(header)
        self.check_metrics(header)
        return Admission(phase)

    def check_task(self, header: pb.SubmitHeader, phase: Phase) -> None:
        """This edge's task in the open phase, named exactly, once, and not dropped."""
        edge = header.edge_id
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
            why = phase.dropped[edge]
            if not phase.revive(edge):
                raise Refused(f"task {task.task_id} was already dropped ({why})")
            log.info("round %d %s: %s is back with the result of task %d (dropped: %s)",
                     phase.round, phase.name, edge, task.task_id, why)

    def check_manifest(self, manifest: pb.PayloadManifest, schema: list[SectionSpec]) -> None:
        """Every section of the schema exactly once, no other; each tensor named, typed and
        shaped as specified (optional tensors at most once)."""
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
            self._check_tensors(section, expected[key], label)
        missing_sections = set(expected) - seen
        if missing_sections:
            raise Refused(f"missing sections {sorted(missing_sections)}", drop=True)

    @staticmethod
    def _check_tensors(section: pb.SectionManifest, spec: SectionSpec, label: str) -> None:
        """A section that is not the spec's full layout: a subset of optional tensors, or
        refused naming the first tensor that differs."""
        specs = spec.tensors
        names = [t.name for t in section.tensors]
        # Every required tensor exactly once; optional ones (a per-class subset) at most once.
        missing = sorted(spec.required - set(names))[:3]
        extra = sorted(set(names) - set(specs))[:3]
        if missing or extra or len(set(names)) != len(names):
            raise Refused(f"section {label}: tensor names differ from the schema "
                          f"(missing {missing}, unexpected {extra})", drop=True)
        for meta in section.tensors:
            tensor = specs[meta.name]
            try:
                dtype = torch_dtype(meta.dtype)
            except WireError:
                dtype = None
            if dtype != tensor.dtype:
                raise Refused(f"section {label} tensor {meta.name!r}: dtype "
                              f"{dtype_name(meta.dtype)}, expected {tensor.dtype}", drop=True)
            if tuple(meta.shape) != tensor.shape:
                raise Refused(f"section {label} tensor {meta.name!r}: shape "
                              f"{list(meta.shape)}, expected {list(tensor.shape)}", drop=True)

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

    def check_evaluation(self, header: pb.SubmitHeader) -> None:
        """Known splits (the run's ``evaluation_splits``), once each, each with sums that
        can be true (``check_split``): they become the run's reported figures."""
        if not header.evaluation:
            raise Refused("evaluation result without any split", drop=True)
        splits = [entry.split for entry in header.evaluation]
        if len(set(splits)) != len(splits):
            raise Refused("an evaluation split appears twice", drop=True)
        known = self.method.train.evaluation_splits
        for entry in header.evaluation:
            if entry.split not in known:
                raise Refused(f"evaluation split {entry.split[:40]!r} is unknown", drop=True)
            self.check_split(entry)

    def check_split(self, entry: pb.EvaluationResult) -> None:
        """One split's sums: correct <= total <= --max-weight (the bound on any count an
        edge claims: a made-up total would outweigh every other edge in the pooled
        accuracy), a loss sum >= 0 and a Brier sum in [0, 2 total] (a sample's multi-class
        Brier score is at most 2), both finite and 0 without samples. Per-class counts
        only when the run asked for them (``server.eval_detail``): otherwise they are
        refused by name, since their row sums are the edge's label histogram; when asked,
        a classes x classes matrix of counts >= 0 whose sum is ``total`` and whose trace
        is ``correct``."""
        name, classes = entry.split, self.classes
        if entry.num_classes != classes:
            raise Refused(f"evaluation {name}: {entry.num_classes} classes, the run has "
                          f"{classes}", drop=True)
        if entry.total > self.cfg.max_weight:
            raise Refused(f"evaluation {name}: total {entry.total} samples is over "
                          f"--max-weight {self.cfg.max_weight}", drop=True)
        if entry.correct > entry.total:
            raise Refused(f"evaluation {name}: correct {entry.correct} is over total "
                          f"{entry.total}", drop=True)
        loss, brier = entry.loss_sum, entry.brier_sum
        if not (math.isfinite(loss) and math.isfinite(brier)):
            raise Refused(f"evaluation {name}: non-finite loss or Brier sum", drop=True)
        if loss < 0 or (loss > 0 and not entry.total):
            raise Refused(f"evaluation {name}: loss sum {loss:.6g} is not >= 0 or not 0 "
                          f"without samples", drop=True)
        if not 0 <= brier <= BRIER_MAX * entry.total * (1 + BRIER_SLACK):
            raise Refused(f"evaluation {name}: Brier sum {brier:.6g} is outside [0, "
                          f"{BRIER_MAX:g} x {entry.total} samples]", drop=True)
        if not self.cfg.eval_detail:
            if entry.counts:
                raise Refused(f"evaluation {name}: per-class counts were not asked for (the "
                              "server runs without --eval-detail): their row sums are the "
                              "edge's label histogram", drop=True)
            return
        if len(entry.counts) != classes * classes:
            raise Refused(f"evaluation {name}: expected {classes}x{classes} counts "
                          "(--eval-detail)", drop=True)
        if any(c < 0 for c in entry.counts):
            raise Refused(f"evaluation {name}: negative counts", drop=True)
        # Python ints: a numpy int64 sum of huge counts would wrap round to any total.
        summed = sum(entry.counts)
        diagonal = sum(entry.counts[i * classes + i] for i in range(classes))
        if summed != entry.total or diagonal != entry.correct:
            raise Refused(f"evaluation {name}: the counts sum to {summed} with {diagonal} on "
                          f"the diagonal, not total {entry.total} and correct {entry.correct}",
                          drop=True)

    def check_metrics(self, header: pb.SubmitHeader) -> None:
        """A result's monitoring figures become metric series and history entries, so only
        the names the method declares (``Method.metric_names``) are kept: more entries than
        there are names is refused, unknown names are logged here and ignored by
        ``result`` (a newer edge may report a figure this server does not know; the header
        itself stays as signed)."""
        allowed = self.method.metric_names()
        if len(header.metrics) > len(allowed):
            raise Refused(f"{len(header.metrics)} metrics, at most {len(allowed)} (the names "
                          f"method {self.method.name} reports)", drop=True)
        unknown = sorted(name for name in header.metrics if name not in allowed)
        if unknown:
            log.warning("round %d: %s reported metrics %s that method %s does not declare; "
                        "ignored", header.round, header.edge_id,
                        ", ".join(repr(n[:40]) for n in unknown[:3]), self.method.name)

    # ---- 4. the body --------------------------------------------------------------------
    async def verify(self, admission: Admission, header: pb.SubmitHeader, body_mac: bytes,
                     assembler: PayloadAssembler, nonfinite: list[str] | None = None
                     ) -> Payload:
        """The signature over the header and the body's MAC, then the phase driver's
        ``decode`` (compressed uploads), then the decoded payload's values all finite
        (decoded and scanned off the event loop): a decoded upload passes every check
        a raw one does. ``nonfinite``: what a scan of the body as it arrived found
        (``transport.FiniteScan``), which stands for the scan when the driver's decode
        leaves the body as it is."""
        if not verify_submission(bytes.fromhex(admission.record.signing_key), header, body_mac):
            raise Refused("the signature does not verify over this header and "
                          "body with the edge's signing key", drop=True)
        try:
            payload, bad = await asyncio.to_thread(_decode_checked, assembler,
                                                   admission.phase.driver, header.edge_id,
                                                   nonfinite)
        except ValueError as err:  # WireError included: a part no honest encoder produces
            raise Refused(f"compressed upload refused: {err}", drop=True) from None
        if bad:
            raise Refused(f"non-finite values in {bad[:3]}", drop=True)
        return payload

    # ---- 5. the method's check ----------------------------------------------------------
    def check_values(self, phase: Phase, edge: str, payload: Payload) -> None:
        """The method's check of the upload's values; whatever it raises refuses the upload
        and costs the edge its task, never the server."""
        try:
            phase.driver.check(payload)
        except ValueError as err:
            raise Refused(str(err), drop=True) from None
        except Exception as err:
            log.error("round %d %s: method %s failed checking %s's upload", phase.round,
                      phase.name, self.method.name, edge, exc_info=True)
            raise Refused(f"the method could not check this upload ({type(err).__name__})",
                          drop=True) from None

    # ---- 6. into the phase ---------------------------------------------------------------
    async def take(self, phase: Phase, header: pb.SubmitHeader, payload: Payload,
                   source: Any = None) -> None:
        """Takes an upload that passed the gate's checks into its phase (under
        ``agg_lock``, after the last checkpoint is on disk): the driver's accept, then the
        result. Whatever it raises refuses the upload and costs the edge its task.
        ``source``: the file the body arrived in (``transport.Spool``), which a spilled
        aggregator may keep as it is instead of writing its bytes again."""
        edge = header.edge_id
        driver = phase.driver
        async with self.agg_lock:
            await self.durable()  # the last round's checkpoint views the state this changes
            if phase.closed or not phase.is_pending(edge):
                raise Refused("the phase closed before the upload completed"
                              + (f" ({phase.closed_why})" if phase.closed_why else ""))
            try:
                norm = None
                if driver.traits.weighted:
                    weight = self.method.aggregation_weight(int(header.num_examples))
                    started = time.monotonic()
                    norm = await asyncio.to_thread(self.aggregate, phase, driver, edge,
                                                   payload, weight, source)
                    self.metrics.aggregation_seconds.labels(phase.name, "accept").observe(
                        time.monotonic() - started)
                elif not driver.traits.evaluates:
                    await asyncio.to_thread(self.aggregate, phase, driver, edge, payload, 0.0)
                phase.receive(edge, self.result(header, phase, norm))
            except Refused:
                raise
            except ValueError as err:  # values the method cannot use: the edge's fault
                raise Refused(f"{phase.name} upload: {err}", drop=True) from None
            except Exception as err:
                log.error("round %d %s: %s's upload failed on the server", phase.round,
                          phase.name, edge, exc_info=True)
                raise Refused(f"{phase.name} upload: the server could not take it "
                              f"({type(err).__name__})", drop=True) from None
            if self.on_taken is not None:
                await self.on_taken(phase)

    # (6, a worker thread: the update bound and the driver's accept) ----------------------
    def aggregate(self, phase: Phase, driver: PhaseDriver, edge: str, payload: Payload,
                  weight: float, source: Any = None) -> float | None:
        """Bound the update, then hand the upload to the phase's driver (a worker thread,
        under ``agg_lock``). ValueError and Refused: the upload is refused, nothing was
        added. Any other exception is a bug that may have left part of the upload in the
        sums: the upload is refused and the phase marked tainted, so its round aborts
        instead of applying a half-added aggregate. Returns the update norm (None when
        not measured)."""
        norm = None
        if self.cfg.clip_update_norm and driver.traits.weighted:
            norm = self.bound_update(phase, edge, payload)
        spill = getattr(self.aggregator, "spill", None)
        if spill is not None:
            spill.offered = source  # for this accept only (under agg_lock)
        try:
            driver.accept(edge, payload, weight)
        except ValueError:
            raise
        except Exception as err:
            phase.taint(
                f"the aggregator failed on {edge}'s upload ({type(err).__name__}: {err}); its "
                "sums may hold part of it")
            log.error("round %d %s: the aggregator failed on %s's upload; the phase will not "
                      "be applied", phase.round, phase.name, edge, exc_info=True)
            raise Refused(f"{phase.name} upload: the server could not aggregate it "
                          f"({type(err).__name__})", drop=True) from None
        finally:
            if spill is not None:
                spill.offered = None
        log_memory("round %d %s: %s's upload aggregated", phase.round, phase.name, edge)
        return norm

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
        pairs = self._model_pairs(payload, changes=phase.driver.traits.changes)
        if not pairs:
            return None
        squares = 0.0
        for value, base in pairs:  # float64 in steps: no overflow, no model-sized buffer
            for start in range(0, value.numel(), SUM_STEP):
                delta = value[start : start + SUM_STEP].to(torch.float64)
                if base is not None:
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
            if base is None:  # the upload is the change itself (--mode async)
                value.mul_(scale)
                continue
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

    def _model_pairs(self, payload: Payload, changes: bool = False
                     ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(uploaded, global) flat views of the upload's floating model tensors that the
        global holds with the same shape: what the norm bound measures. With ``changes``
        (the driver's uploads are changes, ``--mode async``) the base is None: the
        upload is measured as it is."""
        pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for section in payload.sections:
            if section.kind != Kind.SHARED_TENSORS:
                continue
            current = self.aggregator.state.get((section.kind, section.name), {})
            for name, value in section.tensors.items():
                base = current.get(name)
                if (base is None or not value.is_floating_point()
                        or tuple(base.shape) != tuple(value.shape)):
                    continue
                pairs.append((value.reshape(-1), None if changes else base.reshape(-1)))
        return pairs

    # ---- the result -----------------------------------------------------------------------
    def result(self, header: pb.SubmitHeader, phase: Phase, norm: float | None) -> dict[str, Any]:
        """What the phase records of a taken upload (history, metrics): its weight, the
        declared metric names' finite figures (non-finite ones would make history.json
        invalid JSON), its evaluation figures and its update norm."""
        edge = header.edge_id
        allowed = self.method.metric_names()
        figures = {k: v for k, v in header.metrics.items() if k in allowed and math.isfinite(v)}
        if "dp_epsilon" in header.metrics:
            self.metrics.dp_epsilon.labels(edge).set(header.metrics["dp_epsilon"])
        result = {
            "num_examples": int(header.num_examples),
            "metrics": figures,
            "evaluation": {
                e.split: split_figures(e.correct, e.total, e.loss_sum, e.brier_sum,
                                       np.array(e.counts, dtype=np.int64).reshape(
                                           e.num_classes, e.num_classes) if e.counts else None)
                for e in header.evaluation
            },
        }
        if norm is not None:
            result["update_norm"] = norm
        self.metrics.reported.labels(phase.name).inc()
        self.metrics.edge_last_round.labels(edge).set(phase.round)
        for name, value in figures.items():
            self.metrics.edge_result.labels(edge, name).set(value)
        return result


def _decode_checked(assembler: PayloadAssembler, driver: PhaseDriver, edge: str,
                    nonfinite: list[str] | None) -> tuple[Payload, list[str]]:
    """Decode, the driver's decode and the finiteness scan (unless the body was scanned as
    it arrived and the driver left it as it is): off the event loop (torch drops the
    GIL)."""
    received = assembler.finish()
    payload = driver.decode(edge, received)
    if payload is received and nonfinite is not None:
        return payload, nonfinite
    return payload, nonfinite_tensors(payload)

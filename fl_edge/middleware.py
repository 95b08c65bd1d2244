"""Middleware around a task: ``(task, next) -> Result``, as Flower's ``secaggplus_mod`` and
``LocalDpMod`` wrap a client app.

Each concern that crosses every phase lives in one class here instead of in the handlers
or the training loop: loading the server's initial weights, SecAgg+ (answers its protocol
steps itself, masks the method's uploads), DP-SGD (checks the budget, privatizes and books
every upload before it leaves, keeps the losses home); update compression has its own
module (``fl_edge.compression``). ``edge_middleware`` states the order as one list.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from fedattn_shared.methods.base import Method
from fedattn_shared.privacy.dp import BudgetSpent, PrivateTraining
from fedattn_shared.schema import EVALUATE, TRAIN, Kind, Payload, Section
from fedattn_shared.wire.payload import WireError

from .compression import Compression
from .metrics import EdgeMetrics
from .options import EdgeExit
from .run import EdgeRun
from .secagg import EdgeSecAgg, SecAggError, is_secagg_phase, strip_secagg
from .store import PrivateStore
from .tasks import WORK_FIGURES, Handler, Middleware, Result, Task
from .writer import StateWriter

log = logging.getLogger("fl_edge")

#: What a masked result may still say: the server sees only the sum, so no n_k and no loss.
SECAGG_FIGURES = ("train_seconds", "steps", "lr")


class InitialWeights:
    """The server's initial (pretrained) models, sent once to an edge without state, are
    loaded before anything else reads the task; the method never sees their section."""

    def __init__(self, run: EdgeRun):
        self.algo = run.algo

    def __call__(self, task: Task, next: Handler) -> Result:
        init = task.personal.get(Kind.SHARED_TENSORS, "init")
        if init is not None:
            self.algo.load_shared(init.tensors)
            task = replace(task, personal=Payload([s for s in task.personal.sections
                                                   if s is not init]))
            log.info("loaded the server's initial weights (%d tensors)", len(init.tensors))
        return next(task)


class UploadChanges:
    """``--mode async`` (FedBuff): a training upload's model parameters leave as their
    change against the global the task brought, Delta = trained - received. The server adds
    each result's change, scaled by its staleness, to the global of a later version; it
    keeps no old global to subtract from. Which sections hold model tensors is the method's
    compression rule ("delta", by kind): the one rule both daemons read. Buffers (BatchNorm's
    running statistics: a stale change of a variance could turn it negative) and
    non-floating tensors travel as values, which the server averages. Inside compression
    (which then codes the change as values) and outside SecAgg and DP."""

    def __init__(self, method: Method, models: dict):
        rules = dict(method.compression)
        # (kind, section) -> the tensors that travel as changes
        self.stepped = {(spec.kind, spec.name): {n for n, t in spec.tensors.items()
                                                 if t.dtype.is_floating_point and not t.is_buffer}
                        for spec in method.uplink_schema(TRAIN, models)
                        if rules.get(spec.kind) == "delta"}

    def __call__(self, task: Task, next: Handler) -> Result:
        result = next(task)
        if task.phase != TRAIN or not result.upload.sections:
            return result
        sections = []
        for section in result.upload.sections:
            stepped = self.stepped.get((section.kind, section.name))
            if not stepped:
                sections.append(section)
                continue
            base = task.common.get(section.kind, section.name)
            changed = {}
            for name, value in section.tensors.items():
                if name not in stepped:
                    changed[name] = value
                    continue
                reference = base.tensors.get(name) if base is not None else None
                if reference is None:
                    raise WireError(f"--mode async: the task's global has no tensor {name!r} "
                                    f"of section {section.kind.label}:{section.name!r} to "
                                    "take the change against")
                changed[name] = value.detach().cpu() - reference.to(value.dtype)
            sections.append(Section(section.kind, section.name, changed))
        return replace(result, upload=Payload(sections))


class SecureAggregation:
    """SecAgg+ on the edge: a protocol step is answered here (the method never sees it);
    a method upload the server asked to be masked goes up as weight * upload, masked, with
    its example count in the clear (the weight the server holds the masked one to) and
    only the figures that say nothing of the data."""

    def __init__(self, secagg: EdgeSecAgg, run: EdgeRun):
        self.secagg = secagg
        self.run = run

    def __call__(self, task: Task, next: Handler) -> Result:
        if is_secagg_phase(task.phase):
            try:
                upload = self.secagg.step(task.phase, task.round, task.personal)
            except SecAggError as err:
                log.error("round %d %s: %s; this edge sits the step out", task.round,
                          task.phase, err)
                upload = Payload()
            return Result(upload)
        masked = task.personal.get(Kind.SECAGG, "request") is not None
        result = next(replace(task, personal=strip_secagg(task.personal)))
        if not masked:
            return result
        algo = self.run.algo
        # The edge clips its change against the global it holds (and under integer
        # compression masks that change, rounded stochastically from the task's seed).
        try:
            upload = self.secagg.mask(task.round, task.phase, task.personal, result.upload,
                                      algo.upload_weight(task.phase, result.num_examples),
                                      self.run.method, algo.models, common=task.common,
                                      seed=task.seed, codec=self.run.compress.up)
        except (SecAggError, ValueError) as err:
            log.error("round %d %s: not masking this upload: %s", task.round, task.phase, err)
            upload = Payload()
        metrics = {k: v for k, v in result.metrics.items()
                   if k in SECAGG_FIGURES or k.startswith("dp_")}
        # num_examples stays in the signed header: the server caps it at what this edge
        # declared at join and holds the masked weight to it.
        return replace(result, upload=upload, metrics=metrics)


class DifferentialPrivacy:
    """DP-SGD's side of every task (the loop's side is ``PrivateTraining``'s loader and
    step): no training once the budget is spent (the edge leaves, status 3); every upload
    but an evaluation's privatized, its steps and releases booked and the ledger written
    before anything of it leaves (the budget survives a crash); the losses, statistics of
    the training data, stay home."""

    def __init__(self, privacy: PrivateTraining, store: PrivateStore, writer: StateWriter,
                 metrics: EdgeMetrics, leave: Callable[[str], None]):
        self.privacy, self.store, self.writer = privacy, store, writer
        self.metrics, self.leave = metrics, leave

    def __call__(self, task: Task, next: Handler) -> Result:
        privacy = self.privacy
        privacy.begin_phase(task.seed, task.phase)
        if task.phase == TRAIN:
            try:
                privacy.check_budget()
            except BudgetSpent as err:
                log.error("%s", err)
                self.leave(str(err))
                raise EdgeExit(3, str(err)) from None
        result = next(task)
        if task.phase == EVALUATE:
            return result
        upload = privacy.privatize_upload(task.phase, result.upload)
        figures = privacy.end_round(task.round, task.phase)
        self.writer.write(self.store.save_ledger, privacy.ledger())
        self.metrics.track_privacy(figures["dp_epsilon"], privacy.budget)
        metrics = {k: v for k, v in result.metrics.items() if k in WORK_FIGURES}
        return replace(result, upload=upload, metrics={**metrics, **figures})


def edge_middleware(run: EdgeRun, secagg: EdgeSecAgg, store: PrivateStore,
                    writer: StateWriter, metrics: EdgeMetrics,
                    leave: Callable[[str], None]) -> list[Middleware]:
    """The order, outermost first: initial weights before anything reads the task;
    compression outside SecAgg and DP, so that it codes what DP privatized (post-processing)
    and leaves masked sections alone; SecAgg outside DP, so that it masks what DP has
    already privatized and booked."""
    layers: list[Middleware] = [InitialWeights(run), Compression(run, store, writer)]
    if run.asynchronous:  # the change, coded by compression as values (--mode async)
        layers.append(UploadChanges(run.method, run.algo.models))
    layers.append(SecureAggregation(secagg, run))
    if run.privacy is not None:
        layers.append(DifferentialPrivacy(run.privacy, store, writer, metrics, leave))
    return layers

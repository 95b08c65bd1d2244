"""What the edge does with a task: a handler per phase, behind a list of middleware.

A task runs as ``middleware[0](task, middleware[1](task, ... handler(task)))``: each
middleware (``fl_edge.middleware``: initial weights, compression, SecAgg+, DP-SGD) may answer a task
itself, change what the next one sees, or change the ``Result`` that comes back, as
Flower's ``secaggplus_mod`` and ``LocalDpMod`` wrap a client app. The handlers know
nothing of privacy: train, evaluate (with the method's fine-tuning) and the method's own
phases each return one ``Result``. The state writes a handler owes (``Result.saves``) are
made behind the upload only after every middleware has run, so under DP the ledger is
booked before the private state that depends on it is written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial

import torch

from fedattn_shared.augment import InputPipeline
from fedattn_shared.config import BN_RECALIBRATED
from fedattn_shared.schema import EVALUATE, TRAIN, Payload
from fedattn_shared.wire import fedattn_pb2 as pb

from .health import EdgeHealth
from .metrics import EdgeMetrics
from .options import EdgeExit, EdgeOptions
from .run import EdgeRun
from .store import PrivateStore
from .telemetry import DeviceTelemetry
from .trainer import evaluate, loader_seed, recalibrated_bn, train_local
from .writer import StateWriter

log = logging.getLogger("fl_edge")

#: The training figures that describe the work, not the data: what may leave the edge when
#: the losses must stay home (DP-SGD; SecAgg keeps fewer, see ``fl_edge.middleware``).
WORK_FIGURES = ("train_seconds", "steps", "samples_per_second", "lr", "energy_joules",
                "device_power_watts", "gpu_utilization")


@dataclass
class Task:
    """One task as the middleware and handlers see it: the header, the two downlinks,
    and the round's seed and learning rate (derived, not sent)."""

    header: pb.TaskHeader
    common: Payload
    personal: Payload
    train_seed: int
    edge_id: str
    lr_at: Callable[[int, int], float]
    # --mode async: an edge may get several tasks on one version, so its seed follows the
    # task id (unique in the run), not the round
    by_task: bool = False

    @property
    def phase(self) -> str:
        """The phase the server asks for."""
        return self.header.phase

    @property
    def round(self) -> int:
        """The round the task belongs to."""
        return self.header.round

    @cached_property
    def seed(self) -> int:
        """The round's ``loader_seed``: data order, dropout, seeded DP noise."""
        key = self.header.task_id if self.by_task else self.header.round
        return loader_seed(self.train_seed, key, self.edge_id)

    @cached_property
    def lr(self) -> float:
        """The scheduled learning rate of this round (the spec names the run's length)."""
        spec = json.loads(self.header.spec_json or "{}")
        return self.lr_at(self.header.round, int(spec.get("rounds", self.header.round)))


@dataclass
class Result:
    """What one task sends back (``upload``, ``num_examples``, ``evaluation``, ``metrics``,
    ``coded``) and the state writes it owes (``saves``: (save function, *args), written behind the
    upload)."""

    upload: Payload = field(default_factory=Payload)
    num_examples: int = 0
    evaluation: list[pb.EvaluationResult] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    saves: list[tuple] = field(default_factory=list)
    # Upload sections that travel coded (``fl_edge.compression``): (Kind, name) ->
    # ``Encoded`` (codec label, decoded bytes), for the byte accounting.
    coded: dict = field(default_factory=dict)


Handler = Callable[[Task], Result]
Middleware = Callable[[Task, Handler], Result]


class TaskRunner:
    """Runs a run's tasks: the middleware in the order given (outermost first), then the
    phase's handler (train, evaluate, or the method's own phase). One per ``EdgeRun``."""

    def __init__(self, run: EdgeRun, opts: EdgeOptions, device: torch.device, edge_id: str,
                 metrics: EdgeMetrics, store: PrivateStore, writer: StateWriter,
                 middleware: list[Middleware], health: EdgeHealth | None = None,
                 telemetry: DeviceTelemetry | None = None):
        self.run, self.opts, self.device, self.edge_id = run, opts, device, edge_id
        self.health, self.telemetry = health, telemetry
        self.metrics, self.store, self.writer = metrics, store, writer
        self.handlers: dict[str, Handler] = {TRAIN: self.train, EVALUATE: self.evaluate}
        chain: Handler = self._dispatch
        for layer in reversed(middleware):
            chain = partial(layer, next=chain)
        self.chain = chain

    def __call__(self, header: pb.TaskHeader, common: Payload, personal: Payload) -> Result:
        """The task's result; its state writes are on their way (flushed before the next)."""
        self.metrics.round.set(header.round)
        task = Task(header, common, personal, self.run.train.seed, self.edge_id,
                    self.run.train.lr_at, by_task=self.run.asynchronous)
        result = self.chain(task)
        for save, *args in result.saves:
            self.writer.write_behind(save, *args)
        return result

    def _dispatch(self, task: Task) -> Result:
        self.run.algo.receive(task.phase, task.common, task.personal)
        return self.handlers.get(task.phase, self.method_phase)(task)

    def _train(self, algo, epochs: int, task: Task, privacy=None):
        """The one training loop with this edge's options (local training and fine-tuning
        alike: both train on the train split, clipped and augmented)."""
        train = self.run.train
        local = train_local if self.opts.batcher is None else self.opts.batcher.train
        return local(algo, self.run.data.train, epochs, self.run.batch_size, task.seed,
                           self.device, self.opts.progress, lr=task.lr, amp=self.run.amp,
                           grad_accum=self.run.grad_accum, privacy=privacy,
                           clip_grad_norm=train.clip_grad_norm,
                           inputs=InputPipeline.of(train),
                           deterministic=train.deterministic, log_every=self.opts.log_every,
                           memory=self.run.memory, channels_last=self.opts.channels_last,
                           on_step=self.health.progress if self.health else None)

    def train(self, task: Task) -> Result:
        """Local training; the upload is the method's ``after_train``. Reports every
        figure; a middleware that must keep some home removes them."""
        run, algo = self.run, self.run.algo
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.telemetry is not None:
            self.telemetry.begin_task()
        result = self._train(algo, run.train.local_epochs, task, privacy=run.privacy)
        device_figures = self.telemetry.end_task() if self.telemetry is not None else {}
        upload = algo.after_train(result.steps)
        saves = [(self.store.save, algo, run.fingerprint, task.round, task.phase)]
        private_figures = algo.private_figures()
        if private_figures:
            saves.append((self.store.record_private, task.round, private_figures))
        metrics = {"train_seconds": result.seconds, "steps": float(result.steps),
                   "samples_per_second": result.samples_per_second, "lr": task.lr,
                   "train_loss": result.mean_loss, "last_epoch_loss": result.last_epoch_loss,
                   **device_figures, **algo.training_metrics()}
        if run.train.clip_grad_norm:
            metrics.update({"grad_norm": result.grad_norm_mean,
                            "clipped_fraction": result.clipped_steps / max(result.steps, 1)})
        self.metrics.observe_training(result, self.device)
        log.info("round %d: trained %d steps in %.2fs (loss %.4f)", task.round,
                 result.steps, result.seconds, result.mean_loss)
        return Result(upload, len(run.data.train), [], metrics, saves)

    def evaluate(self, task: Task) -> Result:
        """Sums on the test splits (per-class counts only under server.eval_detail), of
        the model the method scores with (fine-tuned first when the method asks)."""
        scorer, finetune_epochs = self.run.algo.before_evaluate()
        metrics: dict[str, float] = {}
        saves = []
        if finetune_epochs:
            # Fine-tuning is training on the train split: it is clipped and augmented
            # as local training is; the evaluation below only resizes.
            result = self._train(scorer, finetune_epochs, task)
            # The fine-tuned model is private state: export and predict score it too.
            saves.append((self.store.save, self.run.algo, self.run.fingerprint, task.round,
                          task.phase))
            metrics = {"finetune_loss": result.mean_loss, "finetune_seconds": result.seconds}
            log.info("round %d: fine-tuned %d steps before evaluation", task.round,
                     result.steps)
        evaluation = [self._score(scorer, task, name, split) for name, split in self._splits()]
        if self.run.train.bn_recalibrated_eval:
            evaluation += self._bn_recalibrated(scorer, task)
        return Result(Payload(), len(self.run.data.train), evaluation, metrics, saves)

    def _bn_recalibrated(self, scorer, task: Task) -> list[pb.EvaluationResult]:
        """The splits scored again with BN statistics recomputed on this edge's train split
        (``trainer.recalibrated_bn``; the state is restored after): none without BN."""
        pipeline = InputPipeline.of(self.run.train)
        with recalibrated_bn(scorer, self.run.data.train, self.opts.eval_batch_size,
                             self.device, pipeline) as recalibrated:
            if not recalibrated:
                return []
            return [self._score(scorer, task, name + BN_RECALIBRATED, split)
                    for name, split in self._splits()]

    def _splits(self) -> list:
        data = self.run.data
        return [("test", data.test)] + ([("global_test", data.global_test)]
                                        if data.global_test is not None else [])

    def _score(self, scorer, task: Task, split_name: str, split) -> pb.EvaluationResult:
        train = self.run.train
        counts = evaluate(scorer, split, split_name, train.num_classes,
                          self.opts.eval_batch_size, self.device,
                          InputPipeline.of(train))
        self.metrics.accuracy.labels(split_name).set(counts.accuracy)
        self.metrics.loss.labels(split_name).set(counts.loss_sum / max(counts.total, 1))
        log.info("round %d: %s accuracy %.4f on %d samples", task.round, split_name,
                 counts.accuracy, counts.total)
        # Per-class counts only when the run asks (server.eval_detail, never under DP: see
        # run._read_config): their row sums are this edge's label histogram.
        detail = counts.confusion.reshape(-1).tolist() if self.run.eval_detail else []
        return pb.EvaluationResult(split=split_name, num_classes=train.num_classes,
                                   correct=counts.correct, total=counts.total, counts=detail,
                                   loss_sum=counts.loss_sum, brier_sum=counts.brier_sum)

    def method_phase(self, task: Task) -> Result:
        """A phase the method declares besides train and evaluate: its upload as it is."""
        try:
            upload = self.run.algo.phase_upload(task.phase)
        except ValueError as err:
            raise EdgeExit(2, f"server asked for phase {task.phase!r}: {err} "
                              "(fedattn versions differ?)") from None
        return Result(upload, len(self.run.data.train))

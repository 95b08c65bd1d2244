"""Phase drivers: everything one phase of a round does, behind one small interface.

A round is a plan of drivers run in order (``Engine.run_round``). A driver says what its
uploads must look like (``schema``), what goes down to every edge (``common``) and to
one (``personal``), how many answers close it (``quorum``), how long it waits
(``deadline``), what to do with one checked upload (``accept``) and how it ends
(``close``). The engine only runs drivers; it does not know which kind it runs.

- ``MethodPhase`` serves one of the method's phases through its aggregator.
- ``EvaluatePhase`` collects evaluation results (nothing is aggregated); the engine
  scores the global with them and sends it to every connected edge when due.
- ``Compressed`` wraps every phase of a run with ``--compress``: uploads are checked
  against the coded schema and decoded (``decode``) before the gate's value checks; the
  common downlink goes out as the edges' reference R, or as its delta to the one they hold.
- ``SecAggPlus`` wraps a method phase whose uploads are summed and expands it into the
  SecAgg+ protocol steps (``SecAggStep``), as Flower's ``SecAggPlusWorkflow`` wraps a
  strategy: the aggregator then receives only the unmasked sum.

Flags rather than subclasses tell the engine and the upload gate what differs:
``weighted`` (the header's ``num_examples`` is an aggregation weight: capped, and the
update may be bounded), ``evaluates`` (the header carries evaluation sums),
``protocol_step`` (waits for every participant).
"""

from __future__ import annotations

import logging
from typing import Any

from fedattn_shared.compress import CompressSpec
from fedattn_shared.compress.apply import (
    DownlinkReference,
    Encoded,
    UplinkCompression,
    coded_sections,
)
from fedattn_shared.config import ServerConfig
from fedattn_shared.methods.aggregators import Aggregator
from fedattn_shared.methods.base import Method
from fedattn_shared.schema import EVALUATE, TRAIN, Kind, Payload, SectionSpec

from .edges import EdgeBook
from .secagg import SecAggDriver

log = logging.getLogger("fl_server")


class PhaseDriver:
    """One phase of a round. Subclasses serve a method phase, evaluation or a step of
    secure aggregation; the defaults are those of a plain method phase."""

    name: str = ""
    weighted = False  # num_examples is the upload's aggregation weight
    evaluates = False  # the upload is an evaluation result
    protocol_step = False  # every participant must answer (no quorum below all)
    training = False  # a training result: its weight must be >= 1
    changes = False  # uploads are changes of the model, not the model (--mode async)

    def __init__(self, name: str, aggregator: Aggregator, cfg: ServerConfig):
        self.name = name
        self.aggregator = aggregator
        self.cfg = cfg

    def begin_round(self, round_number: int, edges: EdgeBook) -> None:
        """Called for every driver when a round starts, before its first phase."""

    def schema(self) -> list[SectionSpec]:
        """The sections an upload of this phase must hold, exactly."""
        return []

    def common(self) -> Payload:
        """The downlink every edge of the phase gets (encoded once, cached by the edges)."""
        return self.aggregator.broadcast(self.name)

    def personal(self, edge: str) -> Payload:
        """The downlink one edge gets besides the common one."""
        return self.aggregator.personal(edge, self.name)

    def quorum(self, participants: int) -> int:
        """How many answers close the phase: ``--quorum`` of the participants."""
        return min(self.cfg.quorum or participants, participants)

    def deadline(self) -> float:
        """How long the phase waits for its quorum (``--round-timeout``)."""
        return self.cfg.round_timeout

    def skipped(self) -> bool:
        """True when the phase has nothing to do this round (an aborted protocol)."""
        return False

    def check(self, upload: Payload) -> None:
        """The method's own check of an upload's values (ValueError refuses it)."""

    def decode(self, edge: str, upload: Payload) -> Payload:
        """The upload as the method reads it, from what traveled (a worker thread; the
        gate calls it right after the signature, before every value check). WireError
        names what no honest sender produces. Identity unless the run compresses."""
        return upload

    def common_delta(self) -> tuple[str, Payload] | None:
        """(base id, delta): the common downlink as a change to the one of that id, for
        edges that hold it; None when there is none (called after ``common``)."""
        return None

    def published(self, common_id: str) -> None:
        """The common downlink went out under ``common_id``."""

    def coded_uploads(self) -> dict[tuple[Kind, str], Encoded]:
        """Upload sections that travel coded: their codec label and decoded size."""
        return {}

    def coded_delta(self) -> dict[tuple[Kind, str], Encoded]:
        """Sections of ``common_delta`` that travel coded: codec label, decoded size."""
        return {}

    def accept(self, edge: str, upload: Payload, weight: float) -> None:
        """Takes one checked upload (a worker thread, under ``agg_lock``). ValueError: the
        upload is refused and nothing of it was taken."""

    def close(self) -> dict[str, Any]:
        """Ends the phase (a worker thread, under ``agg_lock``); returns its figures."""
        return {}


class MethodPhase(PhaseDriver):
    """A phase of the method, served by its aggregator: schema from the method, uploads
    checked by the method and added, weighted, to the aggregator's sums."""

    def __init__(self, name: str, aggregator: Aggregator, cfg: ServerConfig, method: Method,
                 models: dict):
        super().__init__(name, aggregator, cfg)
        self.method = method
        self._schema = method.uplink_schema(name, models)
        self.weighted = name != EVALUATE
        self.training = name == TRAIN

    def schema(self) -> list[SectionSpec]:
        """The method's declared upload schema for this phase."""
        return self._schema

    def check(self, upload: Payload) -> None:
        """``Method.check_upload``: values the schema cannot express (count/class pairs)."""
        self.method.check_upload(self.name, upload)

    def accept(self, edge: str, upload: Payload, weight: float) -> None:
        """Adds the upload to the aggregator's running sums."""
        self.aggregator.accept_phase(self.name, edge, upload, weight)

    def close(self) -> dict[str, Any]:
        """The aggregator's close: the phase's new state and its figures."""
        return self.aggregator.close_phase(self.name)


class EvaluatePhase(MethodPhase):
    """Evaluation: every connected edge scores the global; nothing is aggregated, the
    results are the header's evaluation sums (per-class counts too under --eval-detail)."""

    evaluates = True

    def __init__(self, aggregator: Aggregator, cfg: ServerConfig, method: Method, models: dict):
        super().__init__(EVALUATE, aggregator, cfg, method, models)
        self.weighted = False

    def quorum(self, participants: int) -> int:
        """Every edge asked: evaluation has no quorum below all of them."""
        return participants

    def accept(self, edge: str, upload: Payload, weight: float) -> None:
        """Nothing to add: the result is the header's sums."""

    def close(self) -> dict[str, Any]:
        """Nothing to close: evaluation leaves the state as it is."""
        return {}


class SecAggStep(PhaseDriver):
    """One step of SecAgg+ around a masked method phase (or that phase itself, whose
    uploads are masked vectors). Its common downlink is the wrapped phase's (the same
    bytes, so the edges' cached copy serves); its personal one adds the protocol's
    request; its uploads go to the protocol, never to the aggregator one by one."""

    def __init__(self, name: str, base: MethodPhase, secagg: SecAggDriver, step: bool,
                 opens_round: bool = False):
        super().__init__(name, base.aggregator, base.cfg)
        self.base = base
        self.secagg = secagg
        self.protocol_step = step
        self.opens_round = opens_round  # the plan's first step: starts the round's protocol
        # The masked upload states its weight in the clear, as the wrapped phase's uploads
        # do: the gate caps it at the edge's join declaration, the protocol holds the
        # masked weight to it.
        self.weighted = base.weighted and not step
        self.training = base.training and not step

    def begin_round(self, round_number: int, edges: EdgeBook) -> None:
        """Fresh protocol state for the round (once, by the plan's first step), over the
        signing keys the edges are bound to."""
        if self.opens_round:
            self.secagg.begin_round(round_number, edges)

    def schema(self) -> list[SectionSpec]:
        """The step's SECAGG section (it depends on who took part in the earlier steps)."""
        return self.secagg.schema(self.name)

    def common(self) -> Payload:
        """The wrapped phase's common downlink: the global model, sent once."""
        return self.base.common()

    def common_delta(self) -> tuple[str, Payload] | None:
        """The wrapped phase's downlink delta (``--compress down=``)."""
        return self.base.common_delta()

    def published(self, common_id: str) -> None:
        """Told to the wrapped phase, whose reference the delta starts from."""
        self.base.published(common_id)

    def coded_delta(self) -> dict[tuple[Kind, str], Encoded]:
        """The wrapped phase's."""
        return self.base.coded_delta()

    def personal(self, edge: str) -> Payload:
        """The aggregator's personal downlink plus the protocol's request to this edge."""
        payload = self.aggregator.personal(edge, self.name)
        return Payload(payload.sections + self.secagg.personal(edge, self.name).sections)

    def quorum(self, participants: int) -> int:
        """Protocol steps wait for every participant; the masked upload takes --quorum."""
        return participants if self.protocol_step else super().quorum(participants)

    def deadline(self) -> float:
        """Protocol steps have their own deadline (--secagg-timeout)."""
        return self.secagg.deadline(self.name, self.cfg.round_timeout)

    def skipped(self) -> bool:
        """A round whose protocol aborted runs none of its remaining steps."""
        return self.secagg.skip(self.name)

    def accept(self, edge: str, upload: Payload, weight: float) -> None:
        """Hands the protocol message to the protocol (SecAggError refuses it), with the
        weight the masked upload's header stated (capped by the gate)."""
        if self.weighted:
            self.secagg.state_weight(self.name, edge, weight)
        self.secagg.accept(self.name, edge, upload)

    def close(self) -> dict[str, Any]:
        """Closes the step; the unmask step hands the sum to the aggregator and closes the
        wrapped phase there (the change each edge masked under integer compression is
        against the wrapped phase's common downlink: the global as the edges hold it)."""
        return self.secagg.close(self.name, self.base.common)


class Compressed(MethodPhase):
    """A method phase under ``--compress`` (a proxy: what SecAgg wraps stays a
    ``MethodPhase``). Uplink: ``schema`` is the coded schema, so the gate's exact-manifest
    check bounds the declared sizes before a byte is allocated, and ``decode`` restores
    the method's tensors (the base of a delta: the common downlink as the edges hold it)
    before the gate's value checks. Downlink: the common payload is the shared
    ``DownlinkReference``'s R, with the delta to the previous R for edges that hold it."""

    def __init__(self, inner: MethodPhase, up: UplinkCompression | None,
                 down: DownlinkReference | None):
        # Not MethodPhase.__init__: the wrapper is the inner driver, plus the codecs.
        self.inner, self.up, self.down = inner, up, down
        self.name, self.aggregator, self.cfg = inner.name, inner.aggregator, inner.cfg
        self.method = inner.method
        self.weighted, self.evaluates = inner.weighted, inner.evaluates
        self.protocol_step, self.training = inner.protocol_step, inner.training
        self._schema = up.schema(inner.name) if up is not None else inner.schema()
        self._common: Payload | None = None
        self._delta: tuple[str, Payload] | None = None

    @staticmethod
    def wrap(plan: list[PhaseDriver], method: Method, models: dict,
             spec: CompressSpec, seed: int, changes: bool = False) -> list[PhaseDriver]:
        """Every method phase of ``plan`` wrapped (one downlink reference for them all);
        ``changes``: model sections travel as changes already (``--mode async``)."""
        if not spec:
            return plan
        up = (UplinkCompression(method, models, spec.up, changes=changes)
              if spec.up is not None else None)
        down = DownlinkReference(spec.down, seed) if spec.down is not None else None
        return [Compressed(d, up, down) if isinstance(d, MethodPhase) else d for d in plan]

    def begin_round(self, round_number: int, edges: EdgeBook) -> None:
        """The inner driver's."""
        self.inner.begin_round(round_number, edges)

    def schema(self) -> list[SectionSpec]:
        """The coded upload schema (``--compress up=``), else the method's."""
        return self._schema

    def common(self) -> Payload:
        """R: the global as every edge holds it after this phase's downlink (the global
        itself without ``down=``). Remembered as the base uploads are decoded against."""
        payload = self.inner.common()
        if self.down is not None:
            payload, self._delta = self.down.publish(payload)
        self._common = payload
        return payload

    def common_delta(self) -> tuple[str, Payload] | None:
        """The delta to R from the previous R (see ``DownlinkReference``)."""
        return self._delta if self.down is not None else None

    def published(self, common_id: str) -> None:
        """R's id, the base of the next delta."""
        if self.down is not None:
            self.down.published(common_id)

    def coded_uploads(self) -> dict[tuple[Kind, str], Encoded]:
        """The sections the up codec codes, for the byte accounting."""
        return self.up.coded_sizes(self.name) if self.up is not None else {}

    def coded_delta(self) -> dict[tuple[Kind, str], Encoded]:
        """The sections the down codec codes in the delta, for the byte accounting."""
        if self.down is None or self._common is None:
            return {}
        return coded_sections(self._common, self.down.choice)

    def decode(self, edge: str, upload: Payload) -> Payload:
        """The method's tensors from the coded upload (WireError names the bad part)."""
        if self.up is None:
            return upload
        common = self._common if self._common is not None else self.inner.common()
        return self.up.decode(self.name, upload, common)

    def personal(self, edge: str) -> Payload:
        """The inner driver's."""
        return self.inner.personal(edge)

    def quorum(self, participants: int) -> int:
        """The inner driver's."""
        return self.inner.quorum(participants)

    def deadline(self) -> float:
        """The inner driver's."""
        return self.inner.deadline()

    def skipped(self) -> bool:
        """The inner driver's."""
        return self.inner.skipped()

    def check(self, upload: Payload) -> None:
        """The inner driver's, on the decoded upload."""
        self.inner.check(upload)

    def accept(self, edge: str, upload: Payload, weight: float) -> None:
        """The inner driver's, with the decoded upload."""
        self.inner.accept(edge, upload, weight)

    def close(self) -> dict[str, Any]:
        """The inner driver's."""
        return self.inner.close()


class SecAggPlus:
    """Secure aggregation as a wrapper: expands each masked method phase of a plan into
    its SecAgg+ steps and leaves the others as they are."""

    def __init__(self, secagg: SecAggDriver):
        self.secagg = secagg

    def wrap(self, plan: list[PhaseDriver]) -> list[PhaseDriver]:
        """The plan with every masked phase replaced by its protocol steps."""
        out: list[PhaseDriver] = []
        for driver in plan:
            names = self.secagg.expand((driver.name,))
            if names == [driver.name] and not self.secagg.owns(driver.name):
                out.append(driver)
                continue
            assert isinstance(driver, MethodPhase)
            first = not any(isinstance(d, SecAggStep) for d in out)
            out += [SecAggStep(name, driver, self.secagg, step=name != driver.name,
                               opens_round=first and index == 0)
                    for index, name in enumerate(names)]
        return out


def round_plan(method: Method, models: dict, aggregator: Aggregator, cfg: ServerConfig,
               secagg: SecAggPlus | None) -> list[PhaseDriver]:
    """The drivers of every round, in order: the method's phases, each wrapped by
    ``Compressed`` under ``--compress``, then each masked one expanded into its SecAgg+
    steps under ``--secagg``."""
    plan: list[PhaseDriver] = [
        EvaluatePhase(aggregator, cfg, method, models) if name == EVALUATE
        else MethodPhase(name, aggregator, cfg, method, models) for name in method.phases]
    plan = Compressed.wrap(plan, method, models, cfg.compress_spec(), method.train.seed,
                           changes=cfg.mode == "async")
    return secagg.wrap(plan) if secagg is not None else plan

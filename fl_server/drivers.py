"""Phase drivers: everything one phase of a round does, behind one small interface.

A round is a plan of drivers run in order (``Engine.run_round``). A driver says what its
uploads must look like (``schema``), what goes down to every edge (``common``) and to
one (``personal``), how many answers close it (``quorum``), how long it waits
(``deadline``), what to do with one checked upload (``accept``) and how it ends
(``close``). The engine only runs drivers; it does not know which kind it runs.

- ``MethodPhase`` serves one of the method's phases through its aggregator.
- ``EvaluatePhase`` collects evaluation results (nothing is aggregated); the engine
  scores the global with them and sends it to every connected edge when due.
- ``SecAggPlus`` wraps a method phase whose uploads are summed and expands it into the
  SecAgg+ protocol steps (``SecAggStep``), as Flower's ``SecAggPlusWorkflow`` wraps a
  strategy: the aggregator then receives only the unmasked sum.

Flags rather than subclasses tell the engine and the upload gate what differs:
``weighted`` (the header's ``num_examples`` is an aggregation weight: capped, and the
update may be bounded), ``evaluates`` (the header carries confusion counts),
``protocol_step`` (waits for every participant).
"""

from __future__ import annotations

import logging
from typing import Any

from fedattn_shared.config import ServerConfig
from fedattn_shared.methods.aggregators import Aggregator
from fedattn_shared.methods.base import Method, SectionSpec
from fedattn_shared.methods.phases import EVALUATE, TRAIN
from fedattn_shared.wire.payload import Payload

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
    results are the header's confusion counts."""

    evaluates = True

    def __init__(self, aggregator: Aggregator, cfg: ServerConfig, method: Method, models: dict):
        super().__init__(EVALUATE, aggregator, cfg, method, models)
        self.weighted = False

    def quorum(self, participants: int) -> int:
        """Every edge asked: evaluation has no quorum below all of them."""
        return participants

    def accept(self, edge: str, upload: Payload, weight: float) -> None:
        """Nothing to add: the result is the header's counts."""

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
        """Hands the protocol message to the protocol (SecAggError refuses it)."""
        self.secagg.accept(self.name, edge, upload)

    def close(self) -> dict[str, Any]:
        """Closes the step; the unmask step hands the sum to the aggregator and closes the
        wrapped phase there (the change each edge masked under integer compression is
        against the wrapped phase's common downlink: the global as the edges hold it)."""
        return self.secagg.close(self.name, self.base.common)


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
    """The drivers of every round, in order: the method's phases, each masked one
    expanded into its SecAgg+ steps under ``--secagg``."""
    plan: list[PhaseDriver] = [
        EvaluatePhase(aggregator, cfg, method, models) if name == EVALUATE
        else MethodPhase(name, aggregator, cfg, method, models) for name in method.phases]
    return secagg.wrap(plan) if secagg is not None else plan

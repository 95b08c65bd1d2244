"""Phase drivers: everything one phase of a round does, behind one small interface.

A round is a plan of drivers run in order (``Engine.run_round``). A driver says what its
uploads must look like (``schema``), what goes down to every edge (``common``) and to
one (``personal``), how many answers close it (``quorum``), how long it waits
(``deadline``), what to do with one checked upload (``accept``) and how it ends
(``close``). The engine only runs drivers; it does not know which kind it runs.

- ``MethodPhase`` serves one of the method's phases through its aggregator.
- ``EvaluatePhase`` collects evaluation results (nothing is aggregated); the engine
  scores the global with them and sends it to every connected edge when due.
- ``DriverWrapper`` is a driver around another one: it forwards every call, so a wrapper
  overrides only what it changes (``tests/test_drivers.py`` derives the forwarded calls
  from ``PhaseDriver`` itself: a method added there and not forwarded fails it).
- ``Compressed`` wraps every phase of a run with ``--compress``: uploads are checked
  against the coded schema and decoded (``decode``) before the gate's value checks; the
  common downlink goes out as the edges' reference R, or as its delta to the one they hold.
- ``SecAggPlus`` expands each method phase whose uploads are summed into the SecAgg+
  protocol steps (``SecAggStep``, a wrapper of that phase), as Flower's
  ``SecAggPlusWorkflow`` wraps a strategy: the aggregator then receives only the unmasked sum.
- ``fl_server.buffered.BufferedTrain`` wraps the train driver in ``--mode async``.

What the engine and the upload gate treat differently is one frozen value, ``Traits``,
never the driver's class: nothing asks a driver what it is (``isinstance``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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
from .settings import ServerSettings

log = logging.getLogger("fl_server")


@dataclass(frozen=True)
class Traits:
    """What the engine and the upload gate do differently for a driver's uploads.

    ``weighted``: the header's ``num_examples`` is the upload's aggregation weight (capped
    at the edge's join declaration; the update may be bounded). ``evaluates``: the upload
    is an evaluation result (the header carries its sums; nothing is aggregated).
    ``training``: a training result, whose weight must be >= 1. ``changes``: model
    sections are changes of the global, not the model (``--mode async``)."""

    weighted: bool = False
    evaluates: bool = False
    training: bool = False
    changes: bool = False


class PhaseDriver:
    """One phase of a round: its ``name``, its ``traits`` and the calls below. The
    defaults are those of a phase that sends and takes nothing; ``MethodPhase`` and
    ``EvaluatePhase`` serve the method's phases, wrappers (``DriverWrapper``) the rest."""

    def __init__(self, name: str, traits: Traits):
        self.name = name
        self.traits = traits

    def begin_round(self, round_number: int, edges: EdgeBook) -> None:
        """Called for every driver when a round starts, before its first phase."""

    def schema(self) -> list[SectionSpec]:
        """The sections an upload of this phase must hold, exactly."""
        return []

    def common(self) -> Payload:
        """The downlink every edge of the phase gets (encoded once, cached by the edges)."""
        return Payload()

    def personal(self, edge: str) -> Payload:
        """The downlink one edge gets besides the common one."""
        return Payload()

    def quorum(self, participants: int) -> int:
        """How many answers close the phase."""
        return participants

    def deadline(self) -> float:
        """How long the phase waits for its quorum (0: ``--round-timeout``)."""
        return 0.0

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


class DriverWrapper(PhaseDriver):
    """A driver around ``inner``: every call forwarded, ``name`` and ``traits`` the inner
    driver's unless given. A subclass overrides only what it changes; what it does not
    override is the inner driver's, never a default."""

    def __init__(self, inner: PhaseDriver, name: str | None = None,
                 traits: Traits | None = None):
        super().__init__(inner.name if name is None else name,
                         inner.traits if traits is None else traits)
        self.inner = inner

    def begin_round(self, round_number: int, edges: EdgeBook) -> None:
        """The inner driver's."""
        return self.inner.begin_round(round_number, edges)

    def schema(self) -> list[SectionSpec]:
        """The inner driver's."""
        return self.inner.schema()

    def common(self) -> Payload:
        """The inner driver's."""
        return self.inner.common()

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
        """The inner driver's."""
        return self.inner.check(upload)

    def decode(self, edge: str, upload: Payload) -> Payload:
        """The inner driver's."""
        return self.inner.decode(edge, upload)

    def common_delta(self) -> tuple[str, Payload] | None:
        """The inner driver's."""
        return self.inner.common_delta()

    def published(self, common_id: str) -> None:
        """The inner driver's."""
        return self.inner.published(common_id)

    def coded_uploads(self) -> dict[tuple[Kind, str], Encoded]:
        """The inner driver's."""
        return self.inner.coded_uploads()

    def coded_delta(self) -> dict[tuple[Kind, str], Encoded]:
        """The inner driver's."""
        return self.inner.coded_delta()

    def accept(self, edge: str, upload: Payload, weight: float) -> None:
        """The inner driver's."""
        return self.inner.accept(edge, upload, weight)

    def close(self) -> dict[str, Any]:
        """The inner driver's."""
        return self.inner.close()


class MethodPhase(PhaseDriver):
    """A phase of the method, served by its aggregator: schema from the method, uploads
    checked by the method and added, weighted, to the aggregator's sums."""

    def __init__(self, name: str, aggregator: Aggregator, cfg: ServerConfig, method: Method,
                 models: dict, traits: Traits | None = None):
        super().__init__(name, Traits(weighted=True, training=name == TRAIN)
                         if traits is None else traits)
        self.aggregator = aggregator
        self.cfg = cfg
        self.method = method
        self._schema = method.uplink_schema(name, models)

    def schema(self) -> list[SectionSpec]:
        """The method's declared upload schema for this phase."""
        return self._schema

    def common(self) -> Payload:
        """The aggregator's broadcast of this phase (the global model)."""
        return self.aggregator.broadcast(self.name)

    def personal(self, edge: str) -> Payload:
        """The aggregator's personal downlink of this edge."""
        return self.aggregator.personal(edge, self.name)

    def quorum(self, participants: int) -> int:
        """``--quorum`` of the participants."""
        return min(self.cfg.quorum or participants, participants)

    def deadline(self) -> float:
        """``--round-timeout``."""
        return self.cfg.round_timeout

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

    def __init__(self, aggregator: Aggregator, cfg: ServerConfig, method: Method, models: dict):
        super().__init__(EVALUATE, aggregator, cfg, method, models, Traits(evaluates=True))

    def quorum(self, participants: int) -> int:
        """Every edge asked: evaluation has no quorum below all of them."""
        return participants

    def accept(self, edge: str, upload: Payload, weight: float) -> None:
        """Nothing to add: the result is the header's sums."""

    def close(self) -> dict[str, Any]:
        """Nothing to close: evaluation leaves the state as it is."""
        return {}


class SecAggStep(DriverWrapper):
    """One step of SecAgg+ around a masked method phase (or that phase itself, whose
    uploads are masked vectors). Its common downlink is the wrapped phase's (the same
    bytes, so the edges' cached copy serves); its personal one adds the protocol's
    request; its uploads go to the protocol, never to the wrapped phase: none of its
    checks, decoding or coded sizes apply to them."""

    def __init__(self, name: str, base: PhaseDriver, secagg: SecAggDriver, step: bool,
                 opens_round: bool = False):
        # The masked upload states its weight in the clear, as the wrapped phase's uploads
        # do: the gate caps it at the edge's join declaration, the protocol holds the
        # masked weight to it. A protocol step's uploads carry no weight.
        super().__init__(base, name, Traits(weighted=base.traits.weighted and not step,
                                            training=base.traits.training and not step))
        self.secagg = secagg
        self.step = step  # a protocol step: every participant must answer
        self.opens_round = opens_round  # the plan's first step: starts the round's protocol

    def begin_round(self, round_number: int, edges: EdgeBook) -> None:
        """Fresh protocol state for the round (once, by the plan's first step), over the
        signing keys the edges are bound to."""
        if self.opens_round:
            self.secagg.begin_round(round_number, edges)

    def schema(self) -> list[SectionSpec]:
        """The step's SECAGG section (it depends on who took part in the earlier steps)."""
        return self.secagg.schema(self.name)

    def personal(self, edge: str) -> Payload:
        """The aggregator's personal downlink under the step's name plus the protocol's
        request to this edge."""
        payload = self.secagg.aggregator.personal(edge, self.name)
        return Payload(payload.sections + self.secagg.personal(edge, self.name).sections)

    def quorum(self, participants: int) -> int:
        """Protocol steps wait for every participant; the masked upload takes the wrapped
        phase's (--quorum)."""
        return participants if self.step else self.inner.quorum(participants)

    def deadline(self) -> float:
        """Protocol steps have their own deadline (--secagg-timeout)."""
        return self.secagg.deadline(self.name, self.inner.deadline())

    def skipped(self) -> bool:
        """A round whose protocol aborted runs none of its remaining steps."""
        return self.secagg.skip(self.name)

    def check(self, upload: Payload) -> None:
        """None: the protocol checks its own messages (``accept``)."""

    def decode(self, edge: str, upload: Payload) -> Payload:
        """Protocol messages travel as they are."""
        return upload

    def coded_uploads(self) -> dict[tuple[Kind, str], Encoded]:
        """None: SecAgg masks at the codec's width itself."""
        return {}

    def accept(self, edge: str, upload: Payload, weight: float) -> None:
        """Hands the protocol message to the protocol (SecAggError refuses it), with the
        weight the masked upload's header stated (capped by the gate)."""
        if self.traits.weighted:
            self.secagg.state_weight(self.name, edge, weight)
        self.secagg.accept(self.name, edge, upload)

    def close(self) -> dict[str, Any]:
        """Closes the step; the unmask step hands the sum to the aggregator and closes the
        wrapped phase there (the change each edge masked under integer compression is
        against the wrapped phase's common downlink: the global as the edges hold it)."""
        return self.secagg.close(self.name, self.inner.common)


class Compressed(DriverWrapper):
    """A phase under ``--compress``. Uplink: ``schema`` is the coded schema, so the gate's
    exact-manifest check bounds the declared sizes before a byte is allocated, and
    ``decode`` restores the method's tensors (the base of a delta: the common downlink as
    the edges hold it) before the gate's value checks. Downlink: the common payload is the
    shared ``DownlinkReference``'s R, with the delta to the previous R for edges that hold
    it. Everything else is the wrapped phase's."""

    def __init__(self, inner: PhaseDriver, up: UplinkCompression | None,
                 down: DownlinkReference | None):
        super().__init__(inner)
        self.up, self.down = up, down
        self._schema = up.schema(inner.name) if up is not None else inner.schema()
        self._common: Payload | None = None
        self._delta: tuple[str, Payload] | None = None

    @staticmethod
    def wrap(plan: list[PhaseDriver], method: Method, models: dict,
             spec: CompressSpec, seed: int, changes: bool = False) -> list[PhaseDriver]:
        """Every phase of ``plan`` (the method's) wrapped, one downlink reference for them
        all; ``changes``: model sections travel as changes already (``--mode async``)."""
        if not spec:
            return plan
        up = (UplinkCompression(method, models, spec.up, changes=changes)
              if spec.up is not None else None)
        down = DownlinkReference(spec.down, seed) if spec.down is not None else None
        return [Compressed(d, up, down) for d in plan]

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
        return self._delta if self.down is not None else self.inner.common_delta()

    def published(self, common_id: str) -> None:
        """R's id, the base of the next delta."""
        if self.down is not None:
            self.down.published(common_id)
        else:
            self.inner.published(common_id)

    def coded_uploads(self) -> dict[tuple[Kind, str], Encoded]:
        """The sections the up codec codes, for the byte accounting."""
        return self.up.coded_sizes(self.name) if self.up is not None else self.inner.coded_uploads()

    def coded_delta(self) -> dict[tuple[Kind, str], Encoded]:
        """The sections the down codec codes in the delta, for the byte accounting."""
        if self.down is None:
            return self.inner.coded_delta()
        return coded_sections(self._common, self.down.choice) if self._common is not None else {}

    def decode(self, edge: str, upload: Payload) -> Payload:
        """The method's tensors from the coded upload (WireError names the bad part)."""
        if self.up is None:
            return self.inner.decode(edge, upload)
        common = self._common if self._common is not None else self.inner.common()
        return self.up.decode(self.name, upload, common)


class SecAggPlus:
    """Secure aggregation as a wrapper: expands each masked method phase of a plan into
    its SecAgg+ steps and leaves the others as they are."""

    def __init__(self, secagg: SecAggDriver):
        self.secagg = secagg

    def wrap(self, plan: list[PhaseDriver]) -> list[PhaseDriver]:
        """The plan with every masked phase replaced by its protocol steps."""
        out: list[PhaseDriver] = []
        opened = False  # the plan's first protocol step starts the round's protocol
        for driver in plan:
            names = self.secagg.expand((driver.name,))
            if names == [driver.name] and not self.secagg.owns(driver.name):
                out.append(driver)
                continue
            out += [SecAggStep(name, driver, self.secagg, step=name != driver.name,
                               opens_round=not opened and index == 0)
                    for index, name in enumerate(names)]
            opened = True
        return out


def round_plan(method: Method, models: dict, aggregator: Aggregator, cfg: ServerSettings,
               secagg: SecAggPlus | None) -> list[PhaseDriver]:
    """The drivers of every round, in order: the method's phases, each wrapped by
    ``Compressed`` under ``--compress``, then each masked one expanded into its SecAgg+
    steps under ``--secagg``."""
    plan: list[PhaseDriver] = [
        EvaluatePhase(aggregator, cfg, method, models) if name == EVALUATE
        else MethodPhase(name, aggregator, cfg, method, models) for name in method.phases]
    plan = Compressed.wrap(plan, method, models, cfg.compression, method.train.seed,
                           changes=cfg.mode == "async")
    return secagg.wrap(plan) if secagg is not None else plan

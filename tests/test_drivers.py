"""The phase-driver interface (``fl_server.drivers``): one small ``PhaseDriver``, its flags
one frozen ``Traits`` value, and one ``DriverWrapper`` that forwards every call, so
``Compressed``, ``SecAggStep`` and ``BufferedTrain`` override only what they change.

The forwarding is checked against ``PhaseDriver`` itself, not a list written here: a call
added to the interface and not forwarded (which would silently fall back to a default in
every wrapper) fails ``test_the_wrapper_forwards_every_call_of_the_interface``. And no
code asks a driver what it is: the engine and the gate read its traits.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.schema import EVALUATE, TRAIN
from fl_server.buffered import BufferedTrain
from fl_server.drivers import (
    Compressed,
    DriverWrapper,
    PhaseDriver,
    SecAggPlus,
    SecAggStep,
    Traits,
    round_plan,
)
from fl_server.secagg import SecAggDriver
from fl_server.settings import resolve_settings

REPO = Path(__file__).resolve().parent.parent


def interface() -> dict[str, inspect.Signature]:
    """The calls of ``PhaseDriver``: its public methods, read from the class."""
    return {name: inspect.signature(fn) for name, fn in vars(PhaseDriver).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


class Recorder(PhaseDriver):
    """An inner driver that records every call it gets and answers with a token of it."""

    def __init__(self):
        super().__init__("inner-name", Traits(weighted=True, changes=True))
        self.calls: list[tuple[str, tuple]] = []


def _recording(name: str):
    def call(self, *args):
        self.calls.append((name, args))
        return ("answer", name)
    return call


for _name in interface():
    setattr(Recorder, _name, _recording(_name))


def test_the_interface_is_small_and_its_flags_are_one_frozen_value():
    assert len(interface()) <= 15
    traits = Traits(weighted=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        traits.weighted = False  # type: ignore[misc]
    assert {f.name for f in dataclasses.fields(Traits)} == {
        "weighted", "evaluates", "training", "changes"}


def test_the_wrapper_forwards_every_call_of_the_interface():
    calls = interface()
    assert calls, "PhaseDriver has no public methods?"
    for name, signature in calls.items():
        assert name in vars(DriverWrapper), f"DriverWrapper does not forward {name}"
        inner = Recorder()
        wrapper = DriverWrapper(inner)
        args = tuple(object() for p in list(signature.parameters)[1:])  # not self
        answer = getattr(wrapper, name)(*args)
        assert inner.calls == [(name, args)], name
        assert answer == ("answer", name), f"{name}: the inner driver's answer is dropped"
    inner = Recorder()
    assert (DriverWrapper(inner).name, DriverWrapper(inner).traits) == (inner.name, inner.traits)
    renamed = DriverWrapper(inner, "other", Traits())
    assert (renamed.name, renamed.traits) == ("other", Traits())


@pytest.mark.parametrize("wrapper", [Compressed, SecAggStep, BufferedTrain])
def test_the_wrappers_are_driver_wrappers(wrapper):
    assert issubclass(wrapper, DriverWrapper)
    # what each changes, and nothing it only forwards again
    for name, fn in vars(wrapper).items():
        if name in interface():
            assert fn is not getattr(DriverWrapper, name)


def _method():
    cls = load_method("fedavg")
    method = cls(MethodContext(TrainConfig(model="lenet-bn"), cls.Params()))
    models = method.build_models()
    return method, models, method.server(models)


def test_the_plan_s_traits_are_those_of_the_phases_it_serves():
    method, models, aggregator = _method()
    plain = round_plan(method, models, aggregator, resolve_settings(ServerConfig()), None)
    assert [(d.name, d.traits) for d in plain] == [
        (TRAIN, Traits(weighted=True, training=True)), (EVALUATE, Traits(evaluates=True))]
    cfg = resolve_settings(ServerConfig(secagg=True, secagg_graph="full", compress="up=int8"))
    secagg = SecAggDriver(cfg, method, models, aggregator)
    plan = round_plan(method, models, aggregator, cfg, SecAggPlus(secagg))
    traits = {d.name: d.traits for d in plan}
    assert traits[TRAIN] == Traits(weighted=True, training=True)  # the masked upload
    assert traits["secagg-advertise:train"] == Traits()  # a protocol step: no weight
    assert traits[EVALUATE] == Traits(evaluates=True)
    # only the plan's first protocol step starts the round's protocol
    assert [d.name for d in plan if getattr(d, "opens_round", False)] == ["secagg-advertise:train"]
    # the steps' common downlink is the wrapped (compressed) phase's: the same bytes
    step = next(d for d in plan if d.name == "secagg-share:train")
    assert step.common().sections[0].tensors.keys() == plain[0].common().sections[0].tensors.keys()


DRIVER_TYPES = r"(PhaseDriver|DriverWrapper|MethodPhase|EvaluatePhase|Compressed|SecAggStep|BufferedTrain)"


def test_no_code_asks_a_driver_what_it_is():
    """Traits, not classes: no ``isinstance``/``issubclass``/``type(...) is`` against a
    driver class in the server or the shared package."""
    pattern = re.compile(r"(isinstance|issubclass)\([^()]*" + DRIVER_TYPES + r"\b|type\([^()]*\)\s+is\s+"
                         + DRIVER_TYPES + r"\b")
    found = [f"{path.relative_to(REPO)}:{n}" for root in ("fl_server", "shared")
             for path in sorted((REPO / root).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []

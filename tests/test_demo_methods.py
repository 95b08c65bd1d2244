"""The README's promise, "any method: ``fl-demo --method M``", for every registered method.

What a method changes in a demo is the server's settings: its declared model and training
settings, the demo's defaults where it declares none. Those are checked for EVERY method in
this process, through fl-server's own parser and resolver (cheap). The whole demo, a real
``fl-server`` and two real ``fl-edge`` processes over gRPC on loopback for one round, runs
for the methods whose settings differ from the demo's defaults, and for one of each
aggregation kind among the rest (``DEMO_RUNS``): the others run the very same processes with
another ``--method`` string, and tests/test_conformance.py federates each of them over real
gRPC. What costs time is starting torch in three processes per method, not training, so
``main`` runs in this process and the demos run ``WORKERS`` at a time while the cases read
their results. The data is cut to a few hundred images (``--limit``) and the report is
skipped (``tests/test_tools.py`` covers it). Fed-SAP and pFedKA run their demos under
``--dp`` below, and Fed-SAP is ``make demo``'s method (tests/test_tools.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fedattn_shared.methods import available_methods, load_method
from fl_server.cli import build_parser as server_parser
from fl_server.cli import resolve
from fl_tools.demo import DEMO_STATS_SIGMA, build_parser, main, run_flags, server_settings

METHODS = available_methods()
# Own model or training settings (anfr, fedstar, pfedla, scaffold), the demo's defaults
# (fedavg), collect-then-learn (fedmedian), nothing uploaded (local).
DEMO_RUNS = ["anfr", "fedavg", "fedmedian", "fedstar", "local", "pfedla", "scaffold"]
WORKERS = 2  # concurrent demos (each mostly starts torch in 3 processes): one per core
# The first case to ask for ``demos`` waits for all ten demos (about 70 s on 2 idle cores):
# pytest-timeout's 300 s counts that setup, and a loaded machine may take four times longer.
pytestmark = pytest.mark.timeout(900)


# The other real demos of this module, by case: fl-demo's arguments (``--out`` is added).
EXTRA_RUNS = {
    "census": ["--method", "plugin_methods:CensusAvg", "--edges", "2", "--rounds", "1",
               "--limit", "300", "--no-report"],
    **{f"dp-{m}": ["--method", m, "--dp", "--edges", "2", "--rounds", "1", "--local-epochs", "1",
                   "--limit", "300", "--no-report"] for m in ("fedsap", "pfedka")},
}


class ThreadOutput(io.TextIOBase):
    """Standard output while demos run in threads: each thread's prints kept apart."""

    def __init__(self) -> None:
        self.buffers: dict[int, io.StringIO] = {}

    def write(self, text: str) -> int:
        return self.buffers.setdefault(threading.get_ident(), io.StringIO()).write(text)

    def begin(self) -> None:
        """A new capture for this thread (a pool thread runs one demo after another)."""
        self.buffers[threading.get_ident()] = io.StringIO()

    def text(self) -> str:
        return self.buffers[threading.get_ident()].getvalue()


def demo(argv: list[str], out: Path, output: ThreadOutput) -> tuple[int, float, str]:
    """fl-demo's ``main`` in this process (torch is imported once, here), which starts the
    real fl-server and fl-edge processes; returns its exit status, the seconds and what it
    printed."""
    output.begin()
    start = time.monotonic()
    code = main([*argv, "--out", str(out)])
    return code, time.monotonic() - start, output.text()


@pytest.fixture(scope="module")
def demos(request, tmp_path_factory):
    """Runs every real demo of the selected cases, ``WORKERS`` at a time; case -> (status,
    seconds, printed, run folder). The module:class plug-in's processes find it on
    PYTHONPATH (this folder)."""
    wanted = {item.callspec.params["method"] for item in request.session.items
              if item.originalname == "test_fl_demo_runs_every_method" and hasattr(item, "callspec")}
    runs = {m: ["--method", m, "--edges", "2", "--rounds", "1", "--local-epochs", "1",
                "--limit", "300", "--no-report"] for m in sorted(wanted)}
    names = {item.originalname for item in request.session.items}
    if "test_fl_demo_runs_a_module_class_method" in names:
        runs["census"] = EXTRA_RUNS["census"]
    for item in request.session.items:
        if item.originalname == "test_fl_demo_dp_noises_the_statistics_a_method_uploads":
            key = f"dp-{item.callspec.params['method']}"
            runs[key] = EXTRA_RUNS[key]
    root = tmp_path_factory.mktemp("demos")
    output = ThreadOutput()
    tests = str(Path(__file__).resolve().parent)
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(output):
        mp.setenv("PYTHONPATH", os.pathsep.join(
            p for p in (tests, os.environ.get("PYTHONPATH", "")) if p))
        with ThreadPoolExecutor(WORKERS) as pool:
            done = dict(zip(runs, pool.map(lambda k: demo(runs[k], root / k, output), runs),
                            strict=True))
    return {k: (*done[k], root / k) for k in runs}


def logs_of(out: Path) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}"
                   for p in sorted((out / "logs").glob("*.log"))) if (out / "logs").exists() else ""


@pytest.mark.parametrize("method", METHODS)
def test_fl_demo_settings_resolve_for_every_method(method):
    """The server flags fl-demo would start with, through fl-server's parser and resolver:
    the method's own model and settings win, and the server would accept them."""
    args = build_parser().parse_args(["--method", method])
    settings, _ = server_settings(args)
    server, train, built = resolve(server_parser().parse_args(
        ["--insecure", *run_flags(args, settings, 2)]))
    declared = load_method(method)
    assert server.method == method and built.name == method
    assert train.model == (declared.default_model or settings[settings.index("--model") + 1])
    for key, value in declared.train_settings:
        assert getattr(train, key) == value, key
    assert server.min_edges == 2 and server.rounds == args.rounds


def test_demo_runs_cover_every_distinct_setting():
    """Every method that declares its own model or training settings has a real demo run
    here (or its --dp one below): a new such method must be added to ``DEMO_RUNS``."""
    own = {m for m in METHODS if load_method(m).default_model or load_method(m).train_settings}
    assert own <= set(DEMO_RUNS) | {"fedsap", "pfedka"}


@pytest.mark.parametrize("method", DEMO_RUNS)
def test_fl_demo_runs_every_method(demos, method):
    code, seconds, _, out = demos[method]
    assert code == 0, logs_of(out)
    history = json.loads((out / "server" / "history.json").read_text())
    assert history["manifest"]["method"] == method
    (record,) = history["rounds"]
    assert sorted(record["train"]["received"]) == ["edge_00", "edge_01"]
    assert record["evaluation"]["summary"]["global_test"]["edges"] == 2
    print(f"{method}: {seconds:.1f}s")


def test_fl_demo_runs_a_module_class_method(demos):
    """A method named ``module:Class`` instead of installed (the test plug-in): fl-demo's
    edges opt in to it with ``--allow-method``, as fl-sim's do; without that every edge
    refuses a module the server names and the demo cannot run."""
    code, _, _, out = demos["census"]
    assert code == 0, logs_of(out)
    (record,) = json.loads((out / "server" / "history.json").read_text())["rounds"]
    assert sorted(record["census"]["received"]) == ["edge_00", "edge_01"]
    assert sorted(record["train"]["received"]) == ["edge_00", "edge_01"]


@pytest.mark.parametrize("method", ["fedsap", "pfedka"])
def test_fl_demo_dp_noises_the_statistics_a_method_uploads(demos, method):
    """``fl-demo --method M --dp`` for the methods whose uploads carry statistics of the
    data DP-SGD does not cover: the server refuses them without ``--dp-stats-sigma``, so
    the demo passes its default and says so; Fed-SAP also gets the per-sample GSR DP-SGD
    needs. Every edge's result must be accepted (a noised pFedKA cross-entropy below 0
    is clamped, not refused) and the edges must account the statistics' epsilon."""
    code, _, printed, out = demos[f"dp-{method}"]
    assert code == 0, printed + logs_of(out)
    assert f"clipped and noised with --dp-stats-sigma {DEMO_STATS_SIGMA:g}" in printed
    assert "noised statistics epsilon" in printed
    history = json.loads((out / "server" / "history.json").read_text())
    manifest = history["manifest"]
    assert manifest["dp"]["stats_sigma"] == DEMO_STATS_SIGMA
    assert manifest["dp"]["stats_in_clear"] is False
    if method == "fedsap":
        assert manifest["params"]["gsr_form"] == "per-sample"
    (record,) = history["rounds"]
    assert record["train"]["dropped"] == {}, record["train"]["dropped"]
    assert sorted(record["train"]["received"]) == ["edge_00", "edge_01"]
    for figures in record["train"]["edge_metrics"].values():
        assert 0 < figures["dp_stats_epsilon"] and 0 < figures["dp_epsilon"] <= 8.0 + 1e-6


def test_fl_demo_dp_leaves_statistics_alone_where_there_are_none(capsys):
    """FedAvg uploads its model only: no ``--dp-stats-sigma`` (it would noise nothing and
    read as if something were noised); the user's own value and consent are kept."""
    flags, notes = server_settings(build_parser().parse_args(["--method", "fedavg", "--dp"]))
    assert "--dp-stats-sigma" not in flags and not any("statistics" in n for n in notes)
    flags, _ = server_settings(build_parser().parse_args(
        ["--method", "fedsap", "--dp-stats-sigma", "0.5", "--set", "fedsap.gsr_form=batch"]))
    assert flags[flags.index("--dp-stats-sigma") + 1] == "0.5" and "--dp" in flags
    assert not any("gsr_form" in f for f in flags)  # the user's --set goes through as given

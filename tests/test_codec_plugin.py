"""A codec added from outside fedattn works under ``--secagg`` (issue #41): tests/plugins'
distribution registers ``round6`` (6 bits, 31 levels, round to nearest) through the
``fedattn.codecs`` entry point, and implements the integer-codec interface
(``fedattn_shared.compress.integer.IntegerCodec``); nothing in ``privacy/`` names it.

- end to end, a real ``fl-server --secagg --compress up=round6`` and three real ``fl-edge``
  processes over gRPC: the second round (the first with public scales) is masked at the
  codec's width, 6 + ceil(log2 3) = 8 bits a value, as the server's byte accounting shows
  (int8 would take 10);
- in process, through the server's SecAggDriver and the edges' EdgeSecAgg: the unmasked
  mean is within half a level per edge of the plain mean everywhere, which only the
  codec's round-to-nearest gives (int8's stochastic rounding, run alike, is not).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Cluster, read_history, write_edge_dirs
from test_secagg_compress import CompressedRounds

from fedattn_shared.compress import Codec, CodecChoice, available_codecs, load_codec
from fedattn_shared.compress.integer import integer_codec
from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.privacy.secagg_layout import masked_phases, vector_length
from fedattn_shared.privacy.secagg_ring import packed_length, ring_bits

PLUGINS = Path(__file__).resolve().parent / "plugins"
EDGES = 3


@pytest.fixture(autouse=True)
def plugin_installed(monkeypatch) -> None:
    """The plug-in distribution is installed for the test: registered here and in every
    process started from here."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(PLUGINS), os.environ.get("PYTHONPATH", "")) if p))


def test_the_codec_is_registered_through_its_entry_point_and_round_trips():
    assert "round6" in available_codecs()
    choice = load_codec("round6:64")
    codec = integer_codec(choice)  # the interface SecAgg+ masks through
    assert type(codec).__module__ == "fedattn_example_codec"
    assert (codec.integer_bits, codec.levels, codec.block, codec.spec) == (6, 31, 64, "round6:64")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    parts = codec.encode(x)
    y = codec.decode(parts, x.numel())
    step = parts["scale"].repeat_interleave(64)[:1000] / 31
    assert bool(((y - x).abs() <= step / 2 + 1e-6).all())  # round to nearest: half a step
    assert codec.encoded_bytes(1000) == 1000 + 4 * 16


def masked_length() -> int:
    """Values of fedavg's masked vector (lenet-bn), the weight word left out."""
    cls = load_method("fedavg")
    method = cls(MethodContext(TrainConfig(model="lenet-bn"), cls.Params()))
    return vector_length(masked_phases(method, method.build_models())["train"]) - 1


@pytest.mark.slow
def test_a_plugin_codec_runs_under_secagg_end_to_end_at_its_own_width(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        dirs = write_edge_dirs(tmp_path, EDGES, per_edge=[60, 90, 120])
        server = cluster.server("--method", "fedavg", "--secagg", "--secagg-graph", "full",
                                "--compress", "up=round6", "--rounds", "2",
                                "--min-edges", str(EDGES), "--eval-every", "0",
                                "--local-epochs", "1", "--lr", "0.05", "--round-timeout", "120",
                                "--set", "server.secagg_timeout=120")
        edges = [cluster.edge(d, f"e{i}", "--device", "cpu") for i, d in enumerate(dirs)]
        assert [e.wait(timeout=300) for e in edges] == [0] * EDGES, [e.log()[-2000:] for e in edges]
        assert server.wait(timeout=60) == 0, server.log()[-3000:]
    finally:
        cluster.close()
    history = read_history(tmp_path / "server-state")
    assert history["manifest"]["compress"] == "up=round6:256"
    first, second = history["rounds"]
    assert "ring_bits" not in first["aggregate"]["secagg-unmask"]  # no scales yet: 32 bits
    unmask = second["aggregate"]["secagg-unmask"]
    ring = ring_bits(6, EDGES)
    assert (unmask["bits"], unmask["ring_bits"], ring) == (6, 8, 8)
    assert second["aggregate"]["aggregated"] == EDGES and "secagg-aborted" not in second["aggregate"]
    # What traveled: the protocol's other messages cost the same in both rounds, so the
    # drop is the masked vectors', from 32 bits to the codec's ring a value
    n = masked_length()
    saved = first["bytes"]["up"]["secagg"]["wire"] - second["bytes"]["up"]["secagg"]["wire"]
    expected = EDGES * (4 * (n + 1) - packed_length(n, ring) - 4)
    assert saved == pytest.approx(expected, rel=0.01)
    assert saved > EDGES * (packed_length(n, ring_bits(8, EDGES)) - packed_length(n, ring))


def plain_mean_error(rounds: CompressedRounds) -> tuple[np.ndarray, np.ndarray]:
    """After a round: |unmasked mean - plain weighted mean| per value, and half a level per
    edge at the round's public scales (the bound round-to-nearest keeps)."""
    expected = torch.cat([t.reshape(-1) for t in rounds.expected().values()])
    after = torch.cat([t.reshape(-1).double() for t in rounds.global_model().values()])
    integer = rounds.driver.integer("train")
    step = np.repeat(integer.scales.astype(np.float64), integer.block)[:expected.numel()]
    total = sum(rounds.weights.values())
    half = len(rounds.ids) * integer.weight_ref * step / (2 * integer.levels * total)
    return (after - expected).abs().numpy(), half + 1e-6  # + float32 storage


@pytest.mark.parametrize("codec", ["round6:64", "int8:64"])
def test_the_masked_sum_is_rounded_by_the_run_s_codec(tmp_path, codec):
    rounds = CompressedRounds(tmp_path, codec=codec)
    assert "secagg-aborted" not in rounds.run(1)
    second = rounds.run(2)
    assert "secagg-aborted" not in second and second["aggregated"] == 4
    integer = rounds.driver.integer("train")
    assert (type(integer.codec), integer.codec.spec) == (type(rounds.up.codec), rounds.up.codec.spec)
    assert second["secagg-unmask"]["bits"] == integer.bits == integer.codec.integer_bits
    error, half = plain_mean_error(rounds)
    if codec.startswith("round6"):  # nearest: within half a level per edge, everywhere
        assert np.all(error <= half), (error / half).max()
    else:  # stochastic: up to a level per edge, beyond half of it at many values
        assert np.mean(error > half) > 0.01, np.mean(error > half)


def test_a_codec_the_ring_cannot_hold_is_refused_by_name():
    """A codec stating an integer width without the interface, or more levels than its
    width holds, is refused (at the server's start under --secagg; the edge sits out)."""

    class WidthOnly(Codec):
        name = "widthonly"
        integer_bits = 8

        def layout(self, n):
            return {"q": (torch.int8, (n,))}

        def encode(self, x, generator=None):
            return {"q": x.to(torch.int8)}

        def decode(self, parts, n):
            return parts["q"].float()

    with pytest.raises(ValueError, match="does not implement the integer-codec interface"):
        integer_codec(CodecChoice(WidthOnly()))
    round6 = type(load_codec("round6").codec)
    wide = type("Wide", (round6,), {"levels": 40})
    with pytest.raises(ValueError, match=r"levels 40 outside \[1, 31\]"):
        integer_codec(CodecChoice(wide()))

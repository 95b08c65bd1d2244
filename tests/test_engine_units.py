"""Pieces of the round engine with hand-computed expectations."""

import asyncio

import numpy as np
import pytest

from fl_server.edges import AuthError, EdgeBook
from fl_server.evaluation import split_figures, summarize
from fl_server.phase import select_edges
from fl_server.uploads import run_to_end


def test_selection_is_seeded_and_sized():
    edges = [f"e{i}" for i in range(10)]
    assert select_edges(edges, 1.0, 0, 3) == edges
    picked = select_edges(edges, 0.3, 7, 3)
    assert len(picked) == 3 and set(picked) <= set(edges)
    assert picked == select_edges(edges, 0.3, 7, 3)
    assert any(select_edges(edges, 0.3, 7, r) != picked for r in range(4, 10))
    assert len(select_edges(edges[:2], 0.1, 0, 1)) == 1  # never zero


def test_evaluation_figures_from_the_sums():
    a = split_figures(7, 8, loss_sum=4.0, brier_sum=2.0)
    assert (a["n"], a["accuracy"], a["loss"], a["brier"]) == (8, 7 / 8, 0.5, 0.25)
    assert "confusion" not in a  # only under --eval-detail
    b = split_figures(1, 2, loss_sum=1.0, brier_sum=1.0, confusion=np.array([[1, 1], [0, 0]]))
    assert b["confusion"] == [[1, 1], [0, 0]]
    summary = summarize({"x": {"test": a}, "y": {"test": b}})["test"]
    assert summary["mean_accuracy"] == (7 / 8 + 1 / 2) / 2
    assert summary["pooled_accuracy"] == 8 / 10  # (3 + 4 + 1) / 10
    assert summary["edges"] == 2


KEY = b"k" * 32  # the edge's Ed25519 public key, bound at its first join


def test_registry_binds_id_to_secret_and_sessions_expire():
    registry = EdgeBook()
    first = registry.join("cam1", "s" * 32, {}, KEY)
    session = first.session
    assert registry.check("cam1", session) is first
    try:
        registry.join("cam1", "t" * 32, {}, KEY)
        raise AssertionError("another secret was accepted")
    except AuthError as err:
        assert err.permanent
    registry.join("cam1", "s" * 32, {}, KEY)  # a restart of the same edge: new session
    try:
        registry.check("cam1", session)
        raise AssertionError("an old session was accepted")
    except AuthError as err:
        assert not err.permanent
    restored = EdgeBook.from_json(registry.to_json())
    assert restored.join("cam1", "s" * 32, {}, KEY).edge_id == "cam1"
    for bad in ("", "a b", "x" * 65, "../etc"):
        try:
            registry.join(bad, "s" * 32, {}, KEY)
            raise AssertionError(f"edge id {bad!r} accepted")
        except AuthError:
            pass


def test_history_text_encodes_each_round_once_and_reads_back():
    import json

    from fl_server.history import history_text

    history = {"manifest": {"method": "fedavg", "seed": 0}, "rounds": []}
    encoded: list = []
    assert json.loads(history_text(history, encoded)) == history
    history["rounds"].append({"round": 1, "bytes": {"up": 10}, "loss": float("nan")})
    history["rounds"].append({"round": 2, "bytes": {"up": 12}})
    text = history_text(history, encoded)
    assert text.count("\n") == 3  # the head, then one line per round
    back = json.loads(text)
    assert back["manifest"] == history["manifest"] and back["rounds"][1] == {"round": 2, "bytes": {"up": 12}}
    # Encoded rounds are kept: the cached text is used, not the record again.
    encoded[0] = (encoded[0][0], '{"round": 1, "cached": true}')
    history["rounds"].append({"round": 3})
    assert json.loads(history_text(history, encoded))["rounds"][0] == {"round": 1, "cached": True}
    # A replaced history (a resume truncating it) is encoded afresh.
    resumed = {"manifest": history["manifest"], "rounds": [{"round": 1, "resumed": True}]}
    assert json.loads(history_text(resumed, encoded))["rounds"] == [{"round": 1, "resumed": True}]


def test_taking_an_upload_runs_to_its_end_when_the_call_is_cancelled():
    """A client cancelling its Submit mid-take must not stop the take half way (the sums
    would hold an upload no result records; a buffer would be applied twice)."""

    async def scenario():
        release, finished = asyncio.Event(), []

        async def take():
            await release.wait()
            finished.append(True)

        call = asyncio.ensure_future(run_to_end(take()))
        await asyncio.sleep(0)
        call.cancel()
        await asyncio.sleep(0)
        assert not call.done() and not finished  # the cancelled call waits for the take
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert finished == [True]

        async def refuse():
            raise ValueError("refused")

        with pytest.raises(ValueError, match="refused"):
            await run_to_end(refuse())

    asyncio.run(scenario())

"""What a server holding 10,000 connected edges relies on (issue #28): the connected
count and the pending check answer without scanning the fleet, and they agree with the
scan they replace through joins, presence, rejoins, leaves and a resume."""

import time

from fedattn_shared.wire.codec import encode
from fedattn_shared.wire.payload import Payload
from fl_server.edges import EdgeBook
from fl_server.phase import Phase, Task

KEY = bytes(32)


def scanned(book: EdgeBook) -> list[str]:
    return sorted(e for e, r in book.records.items() if r.connected)


def test_connected_set_follows_every_presence_change():
    book = EdgeBook()
    records = {e: book.join(e, "s" * 32, {}, KEY) for e in ("a", "b", "c", "d")}
    assert book.connected_count() == 0 and book.connected_ids() == scanned(book) == []
    for edge in ("a", "b", "c"):
        records[edge].connected = True
    assert book.connected_ids() == scanned(book) == ["a", "b", "c"]
    records["b"].end_session()  # a leave or a revocation
    assert book.connected_ids() == scanned(book) == ["a", "c"]
    book.join("c", "s" * 32, {}, KEY)  # a rejoin ends the old session's presence
    assert book.connected_ids() == scanned(book) == ["a"]
    assert book.connected_count() == 1 and records["a"].connected and not records["c"].connected
    resumed = EdgeBook.from_json(book.to_json())  # a resume: nobody connected until rejoined
    assert resumed.connected_count() == 0
    resumed.join("a", "s" * 32, {}, KEY).connected = True
    assert resumed.connected_ids() == scanned(resumed) == ["a"]
    assert book.connected_ids() == ["a"]  # books never share their sets


def test_connected_count_does_not_scan_the_fleet():
    """10,000 presence changes over a 10,000-edge book: counted in O(1) each, this takes
    milliseconds; a scan of every record per change took tens of seconds."""
    book = EdgeBook(max_edges=10_000)
    records = [book.join(f"e{i:05d}", "s" * 32, {}, KEY) for i in range(10_000)]
    started = time.process_time()
    for record in records:
        record.connected = True
        assert book.connected_count() > 0
    assert time.process_time() - started < 2.0
    assert book.connected_count() == 10_000


def test_is_pending_agrees_with_pending():
    edges = [f"e{i}" for i in range(6)]
    phase = Phase(name="evaluate", round=1, tasks={e: Task(i, e) for i, e in enumerate(edges)},
                  quorum=6, common_id="c", common=encode(Payload()), common_frames=[],
                  personal={}, spec_json="{}")
    phase.received["e1"] = {}
    phase.dropped["e4"] = "deadline"
    phase.dropped["stranger"] = "bad upload"  # an edge without a task of this phase
    for edge in [*edges, "stranger", "nobody"]:
        assert phase.is_pending(edge) == (edge in phase.pending()), edge
    phase.maybe_close()
    assert not phase.done.is_set()
    for edge in ("e0", "e2", "e3"):
        phase.received[edge] = {}
    phase.maybe_close()
    assert not phase.done.is_set()  # e5 still owes its answer
    phase.dropped["e5"] = "disconnected"
    phase.maybe_close()
    assert phase.done.is_set()  # nobody left to answer

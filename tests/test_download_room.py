"""The download room (``fl_server.streams.DownloadRoom``): the bytes of task messages all
downloads may hold in gRPC at once, granted first come first served. The end-to-end case
(a stalled edge holding the room while another waits) is in test_adversarial.py."""

from __future__ import annotations

import asyncio

import pytest

from fl_server.streams import DownloadRoom


def run(coro):
    return asyncio.run(coro)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_room_within_the_limit_is_taken_at_once_and_given_back():
    async def main():
        room = DownloadRoom(100)
        assert await room.take(60) == 60 and await room.take(40) == 40
        assert (room.held, room.waiting) == (100, 0)
        room.give(60)
        room.give(40)
        assert room.held == 0
    run(main())


def test_a_send_waits_until_room_is_given_back():
    async def main():
        room = DownloadRoom(100)
        first = await room.take(80)
        second = asyncio.ensure_future(room.take(30))
        await settle()
        assert not second.done() and room.waiting == 1 and room.held == 80
        room.give(first)
        assert await second == 30 and room.held == 30 and room.waiting == 0
    run(main())


def test_room_is_granted_in_order_so_a_large_frame_is_not_passed_over():
    async def main():
        room = DownloadRoom(100)
        held = await room.take(50)
        large = asyncio.ensure_future(room.take(100))
        await settle()
        small = asyncio.ensure_future(room.take(10))  # would fit now, but the large one waits
        await settle()
        assert not large.done() and not small.done() and room.waiting == 2
        room.give(held)
        assert await large == 100
        await settle()
        assert not small.done()
        room.give(100)
        assert await small == 10
    run(main())


def test_a_message_larger_than_the_limit_waits_for_all_of_it():
    async def main():
        room = DownloadRoom(100)
        assert await room.take(5000) == 100  # capped: it never waits for ever
        assert room.held == 100
        blocked = asyncio.ensure_future(room.take(1))
        await settle()
        assert not blocked.done()
        room.give(100)
        assert await blocked == 1
    run(main())


def test_a_cancelled_wait_takes_nothing_and_lets_the_next_through():
    async def main():
        room = DownloadRoom(100)
        held = await room.take(90)
        gone = asyncio.ensure_future(room.take(50))   # the edge went while it waited
        behind = asyncio.ensure_future(room.take(10))
        await settle()
        assert room.waiting == 2 and not behind.done()
        gone.cancel()
        await settle()
        assert behind.done() and room.held == 100 and room.waiting == 0
        room.give(held)
        room.give(10)
        assert room.held == 0
    run(main())


def test_a_wait_cancelled_just_as_it_was_granted_gives_its_room_back():
    async def main():
        room = DownloadRoom(100)
        held = await room.take(100)
        waiter = asyncio.ensure_future(room.take(70))
        await settle()
        room.give(held)      # grants the waiter (its future is set) ...
        waiter.cancel()      # ... and its task is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (room.held, room.waiting) == (0, 0)
    run(main())


def test_a_room_of_nothing_is_refused():
    with pytest.raises(ValueError, match="download room must be >= 1 byte"):
        DownloadRoom(0)


# ---- the shared form (the default): a shared room, a reserve per holder, chunks cut ----
MiB = 1 << 20
FLOOR = 64 << 10
RESERVE = 2 * (FLOOR + 64)


def test_the_hard_bound_sends_whole_chunks():
    room = DownloadRoom(4 * MiB)
    with room.downloading("a"), room.downloading("b"), room.downloading("c"):
        assert room.piece(MiB) == MiB


def test_the_shared_form_cuts_chunks_to_a_fair_share_of_the_room():
    room = DownloadRoom(32 * MiB, RESERVE, FLOOR)
    assert room.piece(MiB) == MiB
    for count, piece in ((8, MiB), (16, MiB), (32, 512 << 10), (64, 256 << 10),
                         (1000, FLOOR)):
        holders = [f"e{i}" for i in range(count)]
        entered = [room.downloading(h) for h in holders]
        for entry in entered:
            entry.__enter__()
        assert room.piece(MiB) == piece, count
        assert room.piece(1000) == 1000  # a short chunk's tail goes whole
        for entry in entered:
            entry.__exit__(None, None, None)


def test_stalled_holders_cannot_make_another_wait_and_hold_the_room_plus_their_reserves():
    # Stalled holders take pieces until the shared room is spent: each takes what
    # ``piece`` allows it then (twice: a cut piece beside gRPC's copy) and never gives
    # it back. A holder arriving after them still gets a floor piece at once, and what
    # all hold stays within the shared room plus one reserve per holder.
    async def main():
        room = DownloadRoom(4 * MiB, RESERVE, FLOOR)
        stalled = [f"s{i}" for i in range(40)]
        for holder in stalled:
            with room.downloading(holder):
                await asyncio.wait_for(room.take(2 * room.piece(MiB) + 12, holder), 0.1)
        assert room.held > 4 * MiB and room.waiting == 0
        assert room.held <= 4 * MiB + RESERVE * len(stalled)
        with room.downloading("honest"):
            piece = room.piece(MiB)
            assert FLOOR <= piece <= RESERVE // 2  # what its own reserve holds
            taken = await asyncio.wait_for(room.take(2 * piece + 12, "honest"), 0.1)
        assert room.held <= 4 * MiB + RESERVE * (len(stalled) + 1)
        room.give(taken, "honest")
    run(main())


def test_one_holder_in_the_shared_form_still_holds_one_message_at_a_time():
    async def main():
        room = DownloadRoom(4 * MiB, RESERVE, FLOOR)
        first = await room.take(1000, "a")
        assert first == RESERVE  # every message counts a reserve at least
        second = asyncio.ensure_future(room.take(1000, "a"))
        await settle()
        assert not second.done()
        room.give(first, "a")
        assert await second == RESERVE
    run(main())


def test_a_reserve_that_cannot_hold_a_floor_piece_twice_is_refused():
    with pytest.raises(ValueError, match="must cover a piece"):
        DownloadRoom(MiB, FLOOR, FLOOR)


def test_cut_downloads_trim_the_heap_once_a_period_however_many_stall(monkeypatch):
    """Each cut download's frame goes back to the system by a heap trim (a few ms of the
    event loop): one ``TRIM_EVERY`` after a cut, shared by every cut until it runs, so
    any number of stalling identities cost one trim a period."""
    from fedattn_shared.config import ServerConfig
    from fl_server import downloads

    trims = []
    monkeypatch.setattr(downloads, "trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(downloads, "TRIM_EVERY", 0.01)
    pipeline = downloads.Downloads(engine=None, meter=None, cfg=ServerConfig())

    async def stalls():
        for _ in range(1000):
            pipeline._trim_soon()
        assert trims == []  # not before the frames are freed: the call unwinds first
        await asyncio.sleep(0.05)
        assert len(trims) == 1
        pipeline._trim_soon()
        await asyncio.sleep(0.05)

    run(stalls())
    assert len(trims) == 2

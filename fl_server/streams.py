"""What the server's two transfer pipelines (``uploads.py``, ``downloads.py``) share, free
of any transport: the fair room every task download's messages share in the transport
(``DownloadRoom``), a request that did not parse (``Malformed``), the end of a stream
(``END``) and a stream the transport ended under a send (``StreamEnded``). A transport
adapter (``calls.py`` for gRPC) turns its own forms of these into these."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: What an upload stream's ``read`` returns once the sender closed its side.
END = None


@dataclass(frozen=True)
class Malformed:
    """A request that does not parse as its message type: refused by name (INVALID_ARGUMENT
    for a unary call, the upload's reply for a stream) instead of a transport's traceback.
    ``size``: its bytes, counted as a meta message of an unregistered caller."""

    reason: str
    size: int


class StreamEnded(Exception):
    """A send on a stream the transport already ended (the edge went, or its deadline)."""


#: The smallest piece a download's chunk is cut into when the room is shared by many:
#: below it a message's fixed costs (a gRPC write, a frame header) outweigh its bytes.
PIECE_FLOOR = 64 << 10
#: A data frame's bytes beyond its chunk, at most (its tag and the chunk's length).
FRAME_HEADER = 16
#: A holder's own room in the shared form: a floor piece cut for the send and gRPC's copy
#: of it, headers included.
PIECE_RESERVE = 2 * (PIECE_FLOOR + FRAME_HEADER)


class DownloadRoom:
    """What every task download's messages may hold in gRPC at once, over every download.

    A message stays in gRPC (a copy of its bytes) from its send until the edge has taken
    it, or until its call ends (a client that stops reading: at the call's deadline), so
    ten thousand downloads at once, or edges that stop reading, hold a message each. A
    send takes room for its message first and gives it back once gRPC is done with it,
    so ``held`` is what the process holds. One holder (an edge) holds at most one message
    at a time: its next waits until the last is given back. Two forms:

    - **A hard bound** (``reserve`` 0; ``--max-download-memory N``): at most ``limit``
      bytes; messages are whole chunks; room is granted first come first served, so a
      large frame is not passed over for ever by small ones, a message larger than the
      limit waits for all of it, and the others behind a holder whose last message is
      still in gRPC go first: stalled identities fewer than the room has frames for never
      make an honest edge wait for them.
    - **Shared room and a reserve per holder** (the default): ``limit`` bytes shared, and
      each holder with a message in gRPC also has ``reserve`` bytes of its own, so at most
      ``limit + reserve x holders``. Every message is counted at ``reserve`` at least, and
      one larger than that comes out of the shared room, so a message within the reserve
      always fits at once: a piece of ``piece_floor`` bytes cut for the send (counted
      twice, see ``piece``) or a task's header (a few KiB; only one of a model of
      thousands of tensors exceeds it). No number of stalled identities can make an
      honest download wait; ``piece`` cuts a chunk to the holder's fair share of the
      shared room (``limit`` over twice the downloads under way) and to what is free, so
      64 downloads at once hold a quarter-chunk each instead of a chunk, and 8 keep whole
      chunks.
    """

    def __init__(self, limit: int, reserve: int = 0, piece_floor: int = PIECE_FLOOR):
        if limit < 1:
            raise ValueError(f"download room must be >= 1 byte, got {limit}")
        if reserve and reserve < 2 * (piece_floor + FRAME_HEADER):
            raise ValueError(f"a holder's reserve ({reserve}) must cover a piece of "
                             f"{piece_floor} bytes twice")
        self.limit, self.reserve, self.piece_floor = limit, reserve, piece_floor
        self.held = 0
        self._holders: set[str] = set()
        self._open: dict[str, int] = {}  # holder -> its downloads under way
        self._waiting: deque[tuple[int, str, asyncio.Future]] = deque()

    @contextmanager
    def downloading(self, holder: str) -> Iterator[None]:
        """A download of ``holder`` under way: counted in every holder's fair share."""
        self._open[holder] = self._open.get(holder, 0) + 1
        try:
            yield
        finally:
            self._open[holder] -= 1
            if not self._open[holder]:
                del self._open[holder]

    def piece(self, want: int) -> int:
        """How many of ``want`` data bytes the next message of a download may carry: all
        of them under a hard bound; in the shared form the fair share of the shared room
        (``limit`` over twice the downloads under way: a cut piece is a fresh copy beside
        gRPC's), at most what is free of it (its frame's header counted), at least
        ``piece_floor``."""
        if not self.reserve:
            return want
        share = self.limit // (2 * max(1, len(self._open)))
        room = self.limit + self.reserve * (len(self._holders) + 1) - self.held
        free = room // 2 - FRAME_HEADER
        return min(want, max(self.piece_floor, min(share, free)))

    async def take(self, size: int, holder: str = "") -> int:
        """Waits for room for ``size`` bytes (at most the limit; in the shared form at least
        ``reserve``, which never waits) and takes it for ``holder`` ('' : anonymous, no
        one-message rule); returns what was taken, for ``give``. A cancelled wait leaves
        nothing taken."""
        size = min(max(size, self.reserve), self.limit + self.reserve)
        if not self._waiting and self._fits(size, holder):
            self._hold(size, holder)
            return size
        entry = (size, holder, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[2]
        except asyncio.CancelledError:
            if entry[2].done() and not entry[2].cancelled():
                self.give(size, holder)  # granted just as the wait was cancelled
            elif entry in self._waiting:
                self._waiting.remove(entry)
                self._grant()  # those behind it may fit now
            raise
        return size

    def give(self, size: int, holder: str = "") -> None:
        """Gives back what ``take`` returned for ``holder``."""
        self.held -= size
        self._holders.discard(holder)
        self._grant()

    @property
    def waiting(self) -> int:
        """Sends waiting for room."""
        return len(self._waiting)

    def _fits(self, size: int, holder: str) -> bool:
        if holder and holder in self._holders:
            return False
        reserved = self.reserve * (len(self._holders) + (1 if holder else 0))
        return self.held + size <= self.limit + reserved

    def _hold(self, size: int, holder: str) -> None:
        self.held += size
        if holder:
            self._holders.add(holder)

    def _grant(self) -> None:
        for entry in list(self._waiting):
            size, holder, granted = entry
            if granted.done():  # its wait was cancelled
                self._waiting.remove(entry)
                continue
            if holder and holder in self._holders:
                continue  # its own last message is still in gRPC: the others go first
            if not self._fits(size, holder):
                return  # in order: a large frame is not passed over by small ones
            self._waiting.remove(entry)
            self._hold(size, holder)
            granted.set_result(None)


__all__ = ["END", "PIECE_FLOOR", "PIECE_RESERVE", "DownloadRoom", "Malformed", "StreamEnded"]

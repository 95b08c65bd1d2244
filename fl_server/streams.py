"""What the server's two transfer pipelines (``uploads.py``, ``downloads.py``) share, free
of any transport: the fair room every task download's messages share in the transport
(``DownloadRoom``), a request that did not parse (``Malformed``), the end of a stream
(``END``) and a stream the transport ended under a send (``StreamEnded``). A transport
adapter (``calls.py`` for gRPC) turns its own forms of these into these."""

from __future__ import annotations

import asyncio
from collections import deque
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


class DownloadRoom:
    """At most ``limit`` bytes of task messages in gRPC at once, over every download.

    A message stays in gRPC (a copy of its bytes) from its send until the edge has taken
    it, or until its call ends (a client that stops reading: at the call's deadline), so
    ten thousand downloads at once, or edges that stop reading, hold a frame of the model
    each. A send takes room for its message first and gives it back once gRPC is done with
    it, so ``held`` is what the process holds. Room is granted first come first served, so
    a large frame is not passed over for ever by small ones; a message larger than the
    limit waits for all of it. One holder (an edge) holds at most one message at a time:
    its next waits until the last is given back, and the others behind it in the queue go
    first, so no identity takes more than one frame of the room, and stalled identities
    fewer than the room has frames for never make an honest edge wait for them."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"download room must be >= 1 byte, got {limit}")
        self.limit = limit
        self.held = 0
        self._holders: set[str] = set()
        self._waiting: deque[tuple[int, str, asyncio.Future]] = deque()

    async def take(self, size: int, holder: str = "") -> int:
        """Waits for room for ``size`` bytes (at most the limit) and takes it for
        ``holder`` ('' : anonymous, no one-message rule); returns what was taken, for
        ``give``. A cancelled wait leaves nothing taken."""
        size = min(max(size, 0), self.limit)
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
        return self.held + size <= self.limit and not (holder and holder in self._holders)

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
            if self.held + size > self.limit:
                return  # in order: a large frame is not passed over by small ones
            self._waiting.remove(entry)
            self._hold(size, holder)
            granted.set_result(None)


__all__ = ["END", "DownloadRoom", "Malformed", "StreamEnded"]

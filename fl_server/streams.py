"""The bounds of the server's two data streams, in one place: a task download the
edge stops taking (``Download``), the memory all downloads may hold at once
(``DownloadRoom``) and an upload body that stalls or crawls (``BodyReader``). Each names
why it gave up, so the servicer refuses by name."""

from __future__ import annotations

import asyncio
from collections import deque

from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.transport import PayloadAssembler

from .phase import Refused


def download_bytes(header: pb.TaskHeader) -> int:
    """The data bytes a task's download carries (what its total deadline is sized from)."""
    common = 0 if header.common_cached else header.common.total_bytes
    return common + header.personal.total_bytes


class DownloadRoom:
    """At most ``limit`` bytes of task messages in gRPC at once, over every download.

    A message stays in gRPC (a copy of its bytes) from its send until the edge has taken
    it, so ten thousand downloads at once, or edges that stop reading, hold a frame of
    the model each. A send takes room for its message first and gives it back once gRPC
    is done with it. Room is granted first come first served, so a large frame is not
    passed over for ever by small ones; a message larger than the limit waits for all of
    it. A stalled edge holds its room until its download's idle deadline cuts it."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"download room must be >= 1 byte, got {limit}")
        self.limit = limit
        self.held = 0
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()

    async def take(self, size: int) -> int:
        """Waits for room for ``size`` bytes (at most the limit) and takes it; returns what
        was taken, for ``give``. A cancelled wait leaves nothing taken."""
        size = min(max(size, 0), self.limit)
        if not self._waiting and self.held + size <= self.limit:
            self.held += size
            return size
        entry = (size, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self.give(size)  # granted just as the wait was cancelled
            elif entry in self._waiting:
                self._waiting.remove(entry)
                self._grant()  # those behind it may fit now
            raise
        return size

    def give(self, size: int) -> None:
        """Gives back what ``take`` returned."""
        self.held -= size
        self._grant()

    @property
    def waiting(self) -> int:
        """Sends waiting for room."""
        return len(self._waiting)

    def _grant(self) -> None:
        while self._waiting:
            size, granted = self._waiting[0]
            if granted.done():  # its wait was cancelled
                self._waiting.popleft()
                continue
            if self.held + size > self.limit:
                return
            self._waiting.popleft()
            self.held += size
            granted.set_result(None)


class Download:
    """Writes a task's messages to its stream, each within ``idle`` seconds and all within
    ``total``. An edge that stops reading makes gRPC's send wait for flow control for
    ever, holding the frame it sends and the call (and, with many such streams, a frame
    each); the first send past a deadline gives up, naming it in ``stalled``. Each send
    first takes room for its message in ``room``; the time spent waiting there is the
    server's queue, not the edge's pace, so it moves the total deadline along."""

    def __init__(self, context, room: DownloadRoom, idle: float, total: float):
        self.context, self.room, self.idle = context, room, idle
        self.loop = asyncio.get_running_loop()
        self.ends = self.loop.time() + total
        self.sent = 0
        self.stalled = ""

    async def send(self, message: pb.TaskMessage | bytes) -> bool:
        """Sends one message; False (``stalled`` says why) when it did not go in time."""
        size = len(message) if isinstance(message, bytes) else message.ByteSize()
        asked = self.loop.time()
        taken = await self.room.take(size)
        self.ends += self.loop.time() - asked
        try:
            timeout = min(self.idle, self.ends - self.loop.time())
            await asyncio.wait_for(self.context.write(message), max(timeout, 0))
        except asyncio.TimeoutError:
            self.stalled = (f"message {self.sent + 1} not taken within {self.idle:g}s"
                            if timeout == self.idle else "slower than the download's deadline")
            return False
        finally:
            self.room.give(taken)
        self.sent += 1
        return True


class BodyReader:
    """Reads an upload's next message, or raises naming why none will come: the stream
    was cancelled, the phase closed, the upload's deadline passed or it stalled."""

    def __init__(self, context, closing: asyncio.Future, assembler: PayloadAssembler,
                 idle: float, total: float, ends: float):
        self.context, self.closing, self.assembler = context, closing, assembler
        self.idle, self.total, self.ends = idle, total, ends
        self.loop = asyncio.get_running_loop()

    def _progress(self) -> str:
        return f"{self.assembler.received} of {len(self.assembler.buffer)} bytes"

    async def read(self):
        """The next message (a chunk view, a header, Malformed or EOF)."""
        message = asyncio.ensure_future(self.context.read())
        timeout = min(self.idle, self.ends - self.loop.time())
        try:
            await asyncio.wait({message, self.closing}, timeout=max(timeout, 0),
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # gRPC cancels the handler when the stream breaks (the client went, or
            # sent a message over the transport's cap): the upload ends here, and
            # refusing it by name costs the edge its task at once.
            message.cancel()
            raise WireError(f"upload ended after {self._progress()} (the stream was "
                            "cancelled)") from None
        if message.done():
            return message.result()
        message.cancel()
        if self.closing.done():
            raise Refused("the phase closed before the upload completed")
        if self.loop.time() >= self.ends:
            raise WireError(f"upload not complete within its deadline of {self.total:.0f}s "
                            f"({self._progress()})")
        raise WireError(f"no data for {self.idle:g}s (stalled after {self._progress()})")


__all__ = ["BodyReader", "Download", "DownloadRoom", "download_bytes"]

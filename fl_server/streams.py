"""The bounds of the server's two data streams, in one place: a task download the
edge stops taking (``Download``), the memory all downloads may hold at once
(``DownloadRoom``) and an upload body that stalls or crawls (``BodyReader``). Each names
why it gave up, so the servicer refuses by name."""

from __future__ import annotations

import asyncio
from collections import deque

from fedattn_shared.config import ServerConfig
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


class Download:
    """Writes a task's messages to its stream, each taken by the edge within ``idle``
    seconds plus its size at ``min_rate`` (a 1 MiB frame takes 33 s at 256 kbit/s: the
    idle deadline alone cut every slow link) and all before the call's deadline. An edge
    that stops reading makes gRPC's send wait for flow control for ever, holding the frame
    it sends; gRPC (aio) has no way
    to end such a call from the server (an abort waits behind the unsent data), but the
    call's deadline, which the server requires and bounds (``call_seconds``), ends it on
    the wire. So the first send past the idle deadline gives up (``stalled`` says why),
    and ``settle`` waits for gRPC to let that send go: the edge took it after all, or the
    deadline ended the call. Each send takes room for its message in ``room`` and gives it
    back only when gRPC is done with it, so the room holds what the process holds. A
    send that waits for room longer than ``idle`` gives up too (``busy``): that is the
    server's queue, never counted against the edge."""

    def __init__(self, context, room: DownloadRoom, idle: float, min_rate: float, holder: str):
        self.context, self.room, self.idle, self.holder = context, room, idle, holder
        self.min_rate = min_rate
        self.loop = asyncio.get_running_loop()
        self.sent = 0
        self.stalled = ""
        self.busy = False
        self.pending: asyncio.Future | None = None

    async def send(self, message: pb.TaskMessage | bytes) -> bool:
        """Sends one message; False (``stalled`` says why) when it did not go in time."""
        size = len(message) if isinstance(message, bytes) else message.ByteSize()
        try:
            taken = await asyncio.wait_for(self.room.take(size, self.holder), self.idle)
        except asyncio.TimeoutError:
            self.busy = True
            self.stalled = f"no room in the server's download memory within {self.idle:g}s"
            return False
        write = asyncio.ensure_future(self.context.write(message))
        write.add_done_callback(lambda done: self._written(done, taken))
        allowed = self.idle + size / self.min_rate
        finished, _ = await asyncio.wait({write}, timeout=allowed)
        if not finished:
            self.pending = write
            self.stalled = f"message {self.sent + 1} not taken within {allowed:.3g}s"
            return False
        write.result()  # a failed send: the call is over (the edge went, or its deadline)
        self.sent += 1
        return True

    def _written(self, write: asyncio.Future, taken: int) -> None:
        """gRPC is done with a message (sent, or its call ended): its room goes back."""
        self.room.give(taken, self.holder)
        if not write.cancelled():
            write.exception()  # retrieved: a call that ended is not an unhandled error

    async def settle(self) -> bool:
        """After a stall: waits until gRPC lets the stalled send go. True when the edge
        took it after all (the call is still open); False when the call ended."""
        if self.pending is None:
            return True
        await asyncio.wait({self.pending})
        return not self.pending.cancelled() and self.pending.exception() is None


class BodyReader:
    """Reads an upload's next message, or raises naming why none will come: the stream
    was cancelled, the phase closed, the upload's deadline passed or it stalled: no
    chunk within ``idle`` seconds plus the next chunk's largest size (``chunk_bytes``, or
    what is left of its section) at ``min_rate``. A chunk arrives only once all of it has:
    a 1 MiB chunk takes 33 s at 256 kbit/s, and the idle deadline alone cut every slow
    link's upload."""

    def __init__(self, context, closing: asyncio.Future, assembler: PayloadAssembler,
                 cfg: ServerConfig):
        self.context, self.closing, self.assembler = context, closing, assembler
        self.idle, self.min_rate = cfg.upload_idle_timeout, cfg.upload_min_rate
        self.chunk_bytes = cfg.chunk_bytes
        self.total = self.idle + len(assembler.buffer) / self.min_rate
        self.loop = asyncio.get_running_loop()
        self.ends = self.loop.time() + self.total

    def _allowed(self) -> float:
        """Seconds the next chunk may take: idle, plus its largest size at the min rate."""
        left = self.assembler.section_left()
        return self.idle + min(self.chunk_bytes, left if left else self.chunk_bytes) / self.min_rate

    def _progress(self) -> str:
        return f"{self.assembler.received} of {len(self.assembler.buffer)} bytes"

    async def read(self):
        """The next message (a chunk view, a header, Malformed or EOF)."""
        message = asyncio.ensure_future(self.context.read())
        allowed = self._allowed()
        timeout = min(allowed, self.ends - self.loop.time())
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
        raise WireError(f"no data for {allowed:.3g}s (stalled after {self._progress()})")


__all__ = ["BodyReader", "Download", "DownloadRoom", "download_bytes"]

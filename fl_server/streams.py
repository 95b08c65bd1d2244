"""The deadlines of the server's two data streams, in one place: a task download the
edge stops taking (``Download``) and an upload body that stalls or crawls
(``BodyReader``). Each names why it gave up, so the servicer refuses by name."""

from __future__ import annotations

import asyncio

from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.transport import PayloadAssembler

from .phase import Refused


def download_bytes(header: pb.TaskHeader) -> int:
    """The data bytes a task's download carries (what its total deadline is sized from)."""
    common = 0 if header.common_cached else header.common.total_bytes
    return common + header.personal.total_bytes


class Download:
    """Writes a task's messages to its stream, each within ``idle`` seconds and all within
    ``total``. An edge that stops reading makes gRPC's send wait for flow control for
    ever, holding the frame it sends and the call (and, with many such streams, a frame
    each); the first send past a deadline gives up, naming it in ``stalled``."""

    def __init__(self, context, idle: float, total: float):
        self.context, self.idle = context, idle
        self.loop = asyncio.get_running_loop()
        self.ends = self.loop.time() + total
        self.sent = 0
        self.stalled = ""

    async def send(self, message: pb.TaskMessage | bytes) -> bool:
        """Sends one message; False (``stalled`` says why) when it did not go in time."""
        timeout = min(self.idle, self.ends - self.loop.time())
        try:
            await asyncio.wait_for(self.context.write(message), max(timeout, 0))
        except asyncio.TimeoutError:
            self.stalled = (f"message {self.sent + 1} not taken within {self.idle:g}s"
                            if timeout == self.idle else "slower than the download's deadline")
            return False
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


__all__ = ["BodyReader", "Download", "download_bytes"]

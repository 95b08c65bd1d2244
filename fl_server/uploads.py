"""The upload pipeline: one result from its first byte to the aggregate, free of any
transport. ``Uploads.receive`` reads an upload stream (``UploadStream``: what a transport
adapter such as ``calls.Call`` gives it) and takes it through, in order:

1. the header within ``upload_idle_timeout``; who sends, checked once by the stream (a
   valid id, the protocol, a live session, its certificate: ``Call.identify_upload``);
2. the gate's header checks (``gate.UploadGate.admit``) against the phase it names;
3. one stream per edge; an upload slot (``memory.plan_upload_memory``), waited for until
   the phase closes; the body within its deadlines (``BodyReader``: an idle and a total
   one, sized from the bytes still to come), each chunk checked against the layout,
   written and MACed on a worker thread, its bytes counted as they arrive (a coded
   section's with its decoded size once complete, ``accounting.CodedUpload``);
4. the gate's body checks (signature, decode, finite values), the method's check and the
   phase (``take``, run to its end even when the call is cancelled);
5. a refusal counted, and the task dropped when the refusal costs it.

A transfer is addressed by (payload id, offset) (``Transfer``). An upload cut short (its
stream cancelled, closed, stalled or past its deadline: ``Cut``) is held (``Partial``: its
spool file, its assembler's and value scan's positions) for ``transfer_resume_expiry``
seconds, at most one per edge identity, and its task stands meanwhile (``holds``: a
disconnect or a rejoin does not drop it); the edge asks where it stands (``offset``, the
UploadOffset call) and sends a header with ``resume_offset`` and only the bytes from there.
The new header's MAC is computed over the held prefix read back from the spool file, then
the new bytes, so the signature binds the whole body end to end whatever key or IV the
first attempt used. A partial goes when its phase closes, when it expires (its task is then
dropped) and when the edge starts the upload over from byte 0 (for any task).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fedattn_shared.config import ServerConfig
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import UP, ByteMeter, CodedUpload
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.signing import BodyMac
from fedattn_shared.wire.transport import (
    MAX_MESSAGE_BYTES,
    FiniteScan,
    PayloadAssembler,
    UploadTerms,
)

from .edges import EdgeRecord
from .engine import Engine
from .gate import Admission
from .memory import SPILL_DIR, log_memory
from .metrics import routine
from .phase import Phase, Refused
from .streams import END, Malformed

log = logging.getLogger("fl_server")


class UploadStream(Protocol):
    """What the pipeline needs of a transport's upload call."""

    edge: str  # the label the call's reply is counted under
    caller: str  # the edge id the caller claims, once it is a valid one ('' before)

    async def read(self):
        """The next message: a header, a data chunk (memoryview), ``Malformed`` or END."""

    def identify_upload(self, first: pb.SubmitMessage) -> EdgeRecord:
        """The sender of the header message ``first``, checked once (raises ``Refused``);
        counts the message."""

    def received(self, message) -> None:
        """Counts a request message that is no edge's (one that did not parse)."""

    def peer(self) -> str:
        """Who is on the other end, for log lines."""


class Cut(WireError):
    """An upload's stream ended short (cancelled, closed early, stalled, past its
    deadline): what arrived is whole chunks, which the edge may resume after."""


@dataclass
class Partial:
    """A cut upload the server holds for its edge to resume: its payload id, manifest
    (serialized: a resume must declare the very same), phase, the assembler (its spool file
    and the position it reached) and the value scan's position; ``watch`` ends it at its
    expiry or its phase's close."""

    payload_id: str
    manifest: bytes
    phase: Phase
    assembler: PayloadAssembler
    scan: FiniteScan
    watch: asyncio.Future | None = None

    @property
    def offset(self) -> int:
        """The bytes held: the edge sends from here."""
        return self.assembler.written


def manifest_bytes(manifest: pb.PayloadManifest) -> bytes:
    """A manifest as compared on a resume: serialized deterministically."""
    return manifest.SerializeToString(deterministic=True)


@dataclass(frozen=True)
class Transfer:
    """Where a transfer stands: the payload it carries and the byte it goes on from."""

    payload_id: str
    offset: int = 0


def upload_id(header: pb.SubmitHeader) -> str:
    """An upload's payload id: the edge's result for one task."""
    return f"{header.edge_id}/{header.round}/{header.phase}/{header.task_id}"


async def run_to_end(coro: Awaitable[None]) -> None:
    """Awaits ``coro`` to its end even when the caller is cancelled, then re-raises the
    cancellation. Taking an upload must not stop half way: a client that cancels its
    Submit once the body is in would otherwise stop it between adding to the sums and
    recording the result (or, under --mode async, in the middle of applying a buffer),
    and the receive buffer its tensors view would be let go while a worker thread still
    reads it."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                break
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


class BodyReader:
    """Reads an upload's next message, or raises naming why none will come: the stream
    was cancelled, the phase closed, the upload's deadline passed or it stalled: no
    chunk within the time ``UploadTerms.chunk_seconds`` gives the next chunk's largest
    size (``chunk_bytes``, or what is left of its section). The edge hears the same
    terms at its join and sizes its deadline from them."""

    def __init__(self, stream: UploadStream, closing: asyncio.Future,
                 assembler: PayloadAssembler, cfg: ServerConfig):
        self.stream, self.closing, self.assembler = stream, closing, assembler
        self.terms = UploadTerms(cfg.upload_idle_timeout, cfg.upload_min_rate)
        self.chunk_bytes = cfg.chunk_bytes
        # Sized from the bytes still to come (a resumed upload's rest).
        self.total = self.terms.chunk_seconds(len(assembler.buffer) - assembler.received)
        self.loop = asyncio.get_running_loop()
        self.ends = self.loop.time() + self.total

    def _allowed(self) -> float:
        """Seconds the next chunk may take: idle, plus its largest size at the min rate."""
        left = self.assembler.section_left()
        return self.terms.chunk_seconds(min(self.chunk_bytes, left if left else self.chunk_bytes))

    def _progress(self) -> str:
        return f"{self.assembler.received} of {len(self.assembler.buffer)} bytes"

    async def read(self):
        """The next message (a chunk view, a header, Malformed or END)."""
        message = asyncio.ensure_future(self.stream.read())
        allowed = self._allowed()
        timeout = min(allowed, self.ends - self.loop.time())
        try:
            await asyncio.wait({message, self.closing}, timeout=max(timeout, 0),
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The transport cancels the handler when the stream breaks (the client went,
            # or sent a message over the transport's cap): the upload ends here, and
            # refusing it by name costs the edge its task at once.
            message.cancel()
            raise Cut(f"upload ended after {self._progress()} (the stream was "
                      "cancelled)") from None
        if message.done():
            return message.result()
        message.cancel()
        if self.closing.done():
            raise Refused("the phase closed before the upload completed")
        if self.loop.time() >= self.ends:
            raise Cut(f"upload not complete within its deadline of {self.total:.0f}s "
                      f"({self._progress()})")
        raise Cut(f"no data for {allowed:.3g}s (stalled after {self._progress()})")


class Uploads:
    """The server's upload pipeline (see the module docstring); one per server."""

    def __init__(self, engine: Engine, meter: ByteMeter, cfg: ServerConfig, slots: int):
        """``slots``: uploads received at once (``memory.plan_upload_memory``)."""
        self.engine, self.meter, self.cfg = engine, meter, cfg
        self.gate = engine.gate
        self.slots = asyncio.Semaphore(slots)
        self.spool = Path(cfg.checkpoint_dir) / SPILL_DIR  # where bodies stream to
        self.receiving: set[str] = set()  # edges with an upload stream in flight
        self.partials: dict[str, Partial] = {}  # edge -> its cut upload, one at most

    def holds(self, edge: str) -> bool:
        """Whether an upload of ``edge``'s is in flight or held for resuming: its task then
        survives a disconnect or a rejoin (a restarted edge resumes it), until the partial
        expires."""
        return edge in self.receiving or edge in self.partials

    def offset(self, edge: str, request: pb.UploadOffsetRequest) -> pb.UploadOffsetReply:
        """Where ``edge``'s (an identity the call layer checked) cut upload of the task
        ``request`` names stands: not held, or its bytes held and its size."""
        partial = self.partials.get(edge)
        named = f"{edge}/{request.round}/{request.phase}/{request.task_id}"
        if (partial is None or partial.payload_id != named or partial.phase.closed
                or not partial.phase.is_pending(edge)):
            return pb.UploadOffsetReply(held=False)
        return pb.UploadOffsetReply(held=True, offset=partial.offset,
                                    total_bytes=len(partial.assembler.buffer))

    async def receive(self, stream: UploadStream) -> tuple[bool, str] | None:
        """One upload, header to phase: (accepted, the refusal's reason), or None when
        the caller vanished before its header (there is no one to answer)."""
        phase = None
        try:
            try:
                first = await asyncio.wait_for(stream.read(), self.cfg.upload_idle_timeout)
            except asyncio.TimeoutError:
                raise Refused(f"no header within {self.cfg.upload_idle_timeout:g}s") from None
            except Exception:  # noqa: BLE001 - a client that vanished mid-call
                return None
            if isinstance(first, Malformed):
                stream.received(first)
                raise Refused(first.reason)
            if first is END or isinstance(first, memoryview) or not first.HasField("header"):
                raise Refused(f"the first message must be a header (peer {stream.peer()})")
            header = first.header
            record = stream.identify_upload(first)  # 1. who sends
            edge = header.edge_id
            named = self.engine.schedule.phase_for(header)
            try:  # 2. the header, before a byte of the body is read
                admission = self.gate.admit(header, record, named)
            except Refused as err:
                err.phase = named  # a header refusal that costs the task drops it there
                raise
            phase = admission.phase
            stream.edge = edge
            if edge in self.receiving:
                raise Refused(f"an upload for task {header.task_id} is already in progress "
                              "on another stream")
            self.receiving.add(edge)
            try:
                transfer, partial = self._resuming(header)
                await self._take(admission, header, stream, transfer, partial)
            finally:
                self.receiving.discard(edge)
        except (Refused, WireError) as err:
            return False, self.refused(stream.caller, stream.edge, err, phase)
        return True, ""

    def _resuming(self, header: pb.SubmitHeader) -> tuple[Transfer, Partial | None]:
        """The transfer a header starts, and the partial it continues: none from byte 0
        (whatever the edge held before is let go: one partial per identity), else the very
        upload held (same task, same manifest) at exactly the byte held, or a refusal that
        keeps what is held (the claim of an offset the server does not hold is the edge's
        mistake, not a reason to drop its task)."""
        edge, named, offset = header.edge_id, upload_id(header), header.resume_offset
        partial = self.partials.get(edge)
        if not offset:
            if partial is not None:
                self._let_go(edge, partial)
            return Transfer(named), None
        if partial is None or partial.payload_id != named:
            raise Refused(f"resume_offset {offset}: the server holds no cut upload of task "
                          f"{header.task_id} from this edge")
        if partial.manifest != manifest_bytes(header.payload):
            raise Refused(f"resume_offset {offset}: the manifest is not the held upload's")
        if offset != partial.offset:
            raise Refused(f"resume_offset {offset}: the server holds {partial.offset} bytes "
                          "of this upload (ask UploadOffset)")
        del self.partials[edge]
        if partial.watch is not None:
            partial.watch.cancel()
        log.info("round %d %s: %s resumes its upload at byte %d of %d", partial.phase.round,
                 partial.phase.name, edge, offset, len(partial.assembler.buffer))
        return Transfer(named, offset), partial

    def _let_go(self, edge: str, partial: Partial) -> None:
        """Forgets a partial: its watch stops, its spool file goes."""
        if self.partials.get(edge) is partial:
            del self.partials[edge]
        if partial.watch is not None:
            partial.watch.cancel()
        partial.assembler.buffer.close()

    def _hold(self, edge: str, partial: Partial) -> None:
        """Keeps a cut upload for its edge to resume, until it expires or its phase
        closes."""
        self.partials[edge] = partial
        partial.watch = asyncio.ensure_future(self._expire(edge, partial))

    async def _expire(self, edge: str, partial: Partial) -> None:
        """Lets a partial go when its phase closes, or, once ``transfer_resume_expiry``
        passed without a resume, with its task (an identity cannot keep a task alive by
        cutting its upload)."""
        phase, expiry = partial.phase, self.cfg.transfer_resume_expiry
        try:
            await asyncio.wait_for(phase.closing.wait(), expiry)
            expired = False
        except asyncio.TimeoutError:
            expired = True
        if self.partials.get(edge) is not partial:
            return
        self._let_go(edge, partial)
        if expired and not phase.closed and phase.is_pending(edge):
            self.engine.context.drop(phase, edge, f"upload not resumed: its cut upload was "
                                                  f"not resumed within {expiry:g}s")

    async def _take(self, admission: Admission, header: pb.SubmitHeader,
                    stream: UploadStream, transfer: Transfer,
                    partial: Partial | None = None) -> None:
        """3. and 4.: the body under an upload slot, then the gate's body checks and the
        phase."""
        # A slot covers an upload from its first byte until it is aggregated: the body
        # streams to an unlinked file (``transport.Spool``: page cache, not heap), its
        # values checked as they arrive, and is mapped only for the gate's last checks
        # and the aggregate, one upload at a time under the aggregation lock. Held in
        # receive buffers instead, every slot was a model's bytes for the whole of a slow
        # upload. No stream holds a slot longer than its deadlines or past its phase's close.
        phase, record = admission.phase, admission.record
        await self._acquire_slot(phase)
        try:
            try:
                assembler, body_mac, nonfinite = await self._body(
                    phase, header, stream, transfer,
                    BodyMac(record.upload_mac_key, header.body_mac_iv), partial)
            except OSError as err:  # the spool's disk: the server's fault, named
                log.error("round %d %s: %s's upload could not be written to %s: %s",
                          phase.round, phase.name, header.edge_id, self.spool, err)
                raise Refused(f"the server could not keep this upload on disk ("
                              f"{err.strerror or err})", drop=True) from None
            log_memory("round %d %s: %s's upload received", phase.round, phase.name,
                       header.edge_id)
            try:
                payload = await self.gate.verify(admission, header, body_mac, assembler,
                                                 nonfinite)
                self.gate.check_values(phase, header.edge_id, payload)
                await run_to_end(self.gate.take(phase, header, payload, assembler.buffer))
            finally:
                payload = None  # the aggregate holds copies: the map can go now
                assembler.buffer.close()
        finally:
            self.slots.release()

    async def _acquire_slot(self, phase: Phase) -> None:
        """Waits for an upload slot, or refuses once the phase closes while waiting."""
        acquire = asyncio.ensure_future(self.slots.acquire())
        closing = asyncio.ensure_future(phase.closing.wait())
        try:
            await asyncio.wait({acquire, closing}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the call ended while waiting: never leak the slot
            await self._give_up_slot(acquire)
            raise
        finally:
            closing.cancel()
        if acquire.done() and not acquire.cancelled():
            return
        await self._give_up_slot(acquire)
        raise Refused("the phase closed before the upload could start")

    async def _give_up_slot(self, acquire: asyncio.Future) -> None:
        """Withdraws a pending slot request; a slot granted meanwhile goes back."""
        acquire.cancel()
        try:
            await acquire  # raises CancelledError unless the slot was granted first
        except asyncio.CancelledError:
            return
        self.slots.release()

    async def _body(self, phase: Phase, header: pb.SubmitHeader, stream: UploadStream,
                    transfer: Transfer, body: BodyMac, partial: Partial | None = None
                    ) -> tuple[PayloadAssembler, bytes, list[str]]:
        """Reads an upload's chunks from ``transfer.offset`` (``partial``'s) into its spool
        file, MACing them and scanning their values on a worker thread; returns the
        assembler, the body's MAC tag and the tensors holding NaN or Inf. The stream is cut
        by its idle and total deadlines and by its phase closing; a ``Cut`` is held."""
        edge = header.edge_id
        loop = asyncio.get_running_loop()

        def ingest(offset: int, chunk: memoryview) -> None:
            assembler.write(offset, chunk)
            body.update(chunk)
            scan.feed(offset, chunk)

        assembler, scan = await self._receiver(phase, header, body, partial)
        # The signed body MAC binds every byte, so an upload carries no CRC-32. Each chunk's
        # write, MAC and scan run on a worker thread (all release the GIL) while the loop
        # reads the next chunk and serves the other edges: on the loop they would
        # serialize every upload on one core. One chunk at a time per upload keeps the MAC
        # in order.
        writing: asyncio.Future | None = None
        counted = CodedUpload(self.meter, UP, phase.coded_up, edge)
        closing = asyncio.ensure_future(phase.closing.wait())
        read = BodyReader(stream, closing, assembler, self.cfg).read
        try:
            while not assembler.complete:
                message = await read()
                if message is END:
                    raise Cut(f"upload ended after {assembler.received} of "
                              f"{len(assembler.buffer)} bytes")
                if not isinstance(message, memoryview):
                    raise WireError(message.reason if isinstance(message, Malformed)
                                    else "a second header inside one upload")
                kind, offset = assembler.reserve(message)
                counted.chunk(kind.label, len(message))
                if writing is not None:
                    await writing
                writing = loop.run_in_executor(None, ingest, offset, message)
            if writing is not None:
                await writing
            if await read() is not END:
                raise WireError("data beyond the declared payload")
            counted.complete()
        except BaseException as err:
            counted.abandon()
            if writing is not None and not writing.done():
                # Never close the file while a worker writes to it.
                await asyncio.wait([writing])
            written = writing is None or (not writing.cancelled()
                                          and writing.exception() is None)
            if isinstance(err, Cut) and written:
                self._held_or_closed(err, Partial(transfer.payload_id,
                                                  manifest_bytes(header.payload), phase,
                                                  assembler, scan), edge)
            assembler.buffer.close()
            raise
        finally:
            closing.cancel()
        return assembler, body.tag(), scan.bad

    async def _receiver(self, phase: Phase, header: pb.SubmitHeader, body: BodyMac,
                        partial: Partial | None) -> tuple[PayloadAssembler, FiniteScan]:
        """A new upload's assembler and value scan, or a resumed one's, its held prefix
        MACed under the new header's key and IV first (read back on a worker thread)."""
        if partial is None:
            return self._assembler(phase, header), FiniteScan(header.payload)
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._mac_held,
                                                             partial.assembler, body)
        except BaseException:
            partial.assembler.buffer.close()
            raise
        return partial.assembler, partial.scan

    def _held_or_closed(self, err: Cut, partial: Partial, edge: str) -> None:
        """A cut upload: held for resuming (raises the ``Refused`` that says so, which
        costs no task), unless resuming is off or its phase closed (then it returns, and
        the caller lets the bytes go: the cut costs the task as any wire error)."""
        if self.cfg.transfer_resume_expiry <= 0 or partial.phase.closed:
            return
        self._hold(edge, partial)
        raise Refused(f"{err}: the {partial.offset} bytes received are held "
                      f"{self.cfg.transfer_resume_expiry:g}s for the edge to resume from") from None

    def _mac_held(self, assembler: PayloadAssembler, body: BodyMac) -> None:
        """MACs a resumed upload's held prefix, read back from its spool file (on a worker
        thread): the new header's key and IV cover the whole body."""
        step = max(self.cfg.chunk_bytes, 1 << 20)
        for start in range(0, assembler.written, step):
            body.update(assembler.buffer.read(start, min(step, assembler.written - start)))

    def _assembler(self, phase: Phase, header: pb.SubmitHeader) -> PayloadAssembler:
        """The body's receiver, into a spool file; the gate matched the manifest to the
        schema, so the section sizes come from it."""
        specs = {(int(spec.kind), spec.name): spec for spec in phase.schema}
        sizes = [specs[(s.kind, s.name)].nbytes_of(t.name for t in s.tensors)
                 for s in header.payload.sections]
        return PayloadAssembler(header.payload, max_bytes=sum(sizes),
                                max_chunk_bytes=MAX_MESSAGE_BYTES, sizes=sizes,
                                checksum=False, spool=self.spool)

    def refused(self, edge: str, label: str, err: Refused | WireError,
                phase: Phase | None) -> str:
        """5. Counts a refused upload and, when the refusal costs the edge its task,
        drops it. Returns the reason the reply carries."""
        drop = isinstance(err, WireError) or err.drop
        # The reply's reason is what follows "refused" in both daemons' logs ("result
        # refused: stale or wrong task ..."), so a refusal carries no prefix of its own; a
        # wire error names its kind.
        reason = f"{type(err).__name__}: {err}" if isinstance(err, WireError) else str(err)
        log.log(logging.INFO if routine(reason) else logging.WARNING,
                "submission from %s refused: %s", edge or "?", reason)
        self.engine.metrics.refused.labels(label).inc()
        if drop and phase is None:  # refused at the header: the phase it named
            phase = (err.phase if isinstance(err, Refused) and err.phase is not None
                     else self.engine.phase)
        if drop and phase is not None and phase.is_pending(edge) and not phase.closed:
            self.engine.context.drop(phase, edge, f"bad upload: {err}")
        return reason


__all__ = ["BodyReader", "Cut", "Partial", "Transfer", "UploadStream", "Uploads", "run_to_end",
           "upload_id"]

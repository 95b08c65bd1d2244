"""An edge population on one ``grpc.aio`` event loop: thousands of edges per process, no
thread per edge, so a load bench measures the server rather than the simulator.

Each edge is what the server would see from a real one: its own id, Ed25519 signing key,
X25519 upload-key share (signed), session, its own gRPC channel (its own TCP connection:
a local subchannel pool, so channels do not share one), a presence stream held open,
NextTask calls honouring ``cached_common`` (asked once when the presence stream hints that a
task waits, as fl-edge does when the server offers hints; long-polls otherwise, or with
``--long-poll``), and signed, GMAC'd, streamed uploads built
with the wire helpers of ``fedattn_shared`` (the same as fl-edge's). Only the training is
trivial: a train task answers the received shared tensors plus small seeded noise, an
evaluation task plausible sums (correct, total, loss, Brier). Decoded globals are kept once per process
(keyed by common id), so memory does not grow with the edges held here.

    python bench/_aioedges.py --server 127.0.0.1:PORT --edges 2500 --prefix p0 \
        --status status-p0.json

The status file (rewritten every second, and at exit) holds counts the bench adds up:
joined, connected, tasks trained and evaluated, failed RPCs by method and status code,
presence events received, and each edge's join latency once all are connected.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire import fedattn_pb2_grpc as pb_grpc
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.signing import BodyMac, exchange, new_key_share, sign_submission, upload_mac_key
from fedattn_shared.wire.transport import MAX_MESSAGE_BYTES, PayloadAssembler, channel_options, payload_chunks
from fl_edge.daemon import HINT_FALLBACK_POLL  # as fl-edge: ask anyway after this long without a hint

NUM_EXAMPLES = 60
NUM_CLASSES = 10
DOWNLINK_CAP = 256 << 20
NOISE = 1e-3
RETRY_DELAY = 1.0  # seconds before a failed call is tried again (a real edge backs off too)


@dataclass
class Fleet:
    """What the edges of this process share: the server, counters and decoded globals."""

    server: str
    seed: int
    join_slots: asyncio.Semaphore
    long_poll: bool = False  # hold a NextTask long-poll even when the server sends hints
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    globals: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    failed: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)
    join_seconds: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def remember(self, common_id: str, tensors: dict[str, torch.Tensor]) -> None:
        """One decoded global per common id, the two newest only (train, then evaluate)."""
        self.globals[common_id] = tensors
        while len(self.globals) > 2:
            self.globals.pop(next(iter(self.globals)))

    def fail(self, method: str, err: grpc.RpcError) -> None:
        code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
        key = f"{method} {code.name if code else type(err).__name__}"
        self.failed[key] += 1
        if self.failed[key] <= 5:  # the first few of each kind, with when and why, in the log
            # grpc core's own account too: who ended the call (a RST_STREAM from the peer and
            # its HTTP/2 code, a local cancel, a transport error) is only in there.
            details = (f"{err.details()} [{err.debug_error_string()}]"
                       if isinstance(err, grpc.aio.AioRpcError) else str(err))
            print(f"{time.monotonic() - self.started:8.1f}s {key}: {details}", file=sys.stderr,
                  flush=True)


class AioEdge:
    """One edge of the population: join, presence, long-polls, signed uploads."""

    def __init__(self, fleet: Fleet, edge_id: str, index: int):
        self.fleet, self.edge_id, self.index = fleet, edge_id, index
        self.secret = secrets.token_hex(32)
        self.signing_key = Ed25519PrivateKey.generate()
        # BDP probing off: with it, 3,000 edges on two saturated cores saw their
        # data-carrying calls (task downloads, uploads) CANCELLED 0.1 s in (117 to 2,461
        # per run, with main's server too; 0 to 15 without it). At 10,000 edges they come
        # back with or without it (docs/benchmarks.md: cause not found yet).
        self.channel = grpc.aio.insecure_channel(
            fleet.server, options=[*channel_options(), ("grpc.use_local_subchannel_pool", 1),
                                   ("grpc.http2.bdp_probe", 0)])
        self.stub = pb_grpc.FederatedLearningStub(self.channel)
        self.session = ""
        self.mac_key = b""
        self.chunk_bytes = 1 << 20
        self.common_id = ""  # the global this edge downloaded last (what it may say it caches)
        self.presence: asyncio.Task | None = None
        self.present = asyncio.Event()
        self.hints = False  # the server's JoinReply.task_hints (and not --long-poll)
        self.task_ready = asyncio.Event()

    async def join(self) -> None:
        """Join with a signed upload-key share, then open the presence stream; retried
        until the server has counted the edge as connected (its first presence event)."""
        while not self.fleet.stop.is_set():
            async with self.fleet.join_slots:
                private, share, proof = new_key_share(self.signing_key, self.edge_id)
                request = pb.JoinRequest(
                    protocol_version=PROTOCOL_VERSION, edge_id=self.edge_id,
                    edge_secret=self.secret, info={"hostname": "aio-load"},
                    signing_key=self.signing_key.public_key().public_bytes_raw(),
                    upload_key_share=share, upload_key_proof=proof)
                try:
                    reply = await self.stub.Join(request, timeout=60)
                except grpc.RpcError as err:
                    self.fleet.fail("Join", err)
                    await asyncio.sleep(RETRY_DELAY)
                    continue
                self.session, self.chunk_bytes = reply.session, reply.chunk_bytes or self.chunk_bytes
                self.hints = reply.task_hints and not self.fleet.long_poll
                self.mac_key = upload_mac_key(exchange(private, reply.upload_key_share),
                                              self.edge_id, reply.session)
                self.fleet.counts["joins"] += 1
                self.present.clear()
                if self.presence is not None:
                    self.presence.cancel()
                self.presence = asyncio.create_task(self._hold_presence(self.session))
                waiting = asyncio.create_task(self.present.wait())
                done, _ = await asyncio.wait({waiting, self.presence}, timeout=60,
                                             return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                if self.present.is_set():
                    return
            await asyncio.sleep(RETRY_DELAY)

    async def _hold_presence(self, session: str) -> None:
        call = self.stub.Presence(pb.PresenceRequest(edge_id=self.edge_id, session=session))
        try:
            async for event in call:
                self.fleet.counts["presence events"] += 1
                self.present.set()
                if event.task_ready:
                    self.task_ready.set()
        except grpc.RpcError as err:
            if not self.fleet.stop.is_set() and err.code() != grpc.StatusCode.CANCELLED:
                self.fleet.fail("Presence", err)
        finally:
            call.cancel()
            self.task_ready.set()  # the run loop's next call finds out what happened
        if session == self.session and not self.fleet.stop.is_set():
            self.fleet.counts["presence ended"] += 1

    async def run(self) -> None:
        """Joins, then serves tasks until the server says the run is over."""
        started = time.monotonic()
        await self.join()
        self.fleet.join_seconds.append(time.monotonic() - started)
        idle = False
        try:
            while not self.fleet.stop.is_set():
                if self.presence is not None and self.presence.done():
                    await self.join()  # the session ended: a real edge rejoins
                if self.hints and idle:  # told to wait: hold no call until the hint
                    try:
                        await asyncio.wait_for(self.task_ready.wait(), HINT_FALLBACK_POLL)
                    except asyncio.TimeoutError:
                        pass
                self.task_ready.clear()
                try:
                    status = await self.poll()
                    idle = status == pb.TaskHeader.WAIT
                except grpc.RpcError as err:
                    self.fleet.fail("NextTask", err)
                    if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                        await self.join()
                    else:
                        await asyncio.sleep(RETRY_DELAY)
                    continue
                if status == pb.TaskHeader.DONE:
                    self.fleet.counts["heard done"] += 1
                    return
        finally:
            if self.presence is not None:
                self.presence.cancel()

    async def poll(self) -> int:
        """One NextTask long-poll; a task is answered at once. Returns the header status."""
        request = pb.TaskRequest(edge_id=self.edge_id, session=self.session,
                                 cached_common=self.common_id if self.common_id in self.fleet.globals
                                 else "", no_wait=self.hints)
        header, assemblers = None, []
        async for message in self.stub.NextTask(request, timeout=120):
            if message.HasField("header"):
                header = message.header
                if header.status == pb.TaskHeader.TASK:
                    assemblers = [PayloadAssembler(m, DOWNLINK_CAP, MAX_MESSAGE_BYTES)
                                  for m in ((header.personal,) if header.common_cached
                                            else (header.common, header.personal))]
                continue
            next(a for a in assemblers if not a.complete).add(message.data)
        if header is None:
            raise RuntimeError("a task stream without a header")
        if header.status == pb.TaskHeader.TASK:
            if not header.common_cached:
                common = assemblers[0].finish().tensors(Kind.SHARED_TENSORS)
                self.fleet.remember(header.common_id, {k: t.clone() for k, t in common.items()})
            self.common_id = header.common_id
            await self.answer(header, self.fleet.globals[header.common_id])
        return header.status

    async def answer(self, task: pb.TaskHeader, globals_: dict[str, torch.Tensor]) -> None:
        """A train task: the globals plus seeded noise; anything else: an evaluation."""
        if task.phase == "train":
            generator = torch.Generator().manual_seed(
                self.fleet.seed * 1_000_003 + self.index * 10_007 + task.round)
            tensors = {k: (t + NOISE * torch.randn(t.shape, generator=generator)).to(t.dtype)
                       if t.is_floating_point() else t for k, t in globals_.items()}
            encoded = encode(Payload([Section(Kind.SHARED_TENSORS, "", tensors)]))
            chunks = [c for _, c in payload_chunks(encoded, self.chunk_bytes)]
            header = self._header(task, encoded.manifest, NUM_EXAMPLES)
            kind = "trained"
        else:
            correct, total = 9 * NUM_CLASSES, 10 * NUM_CLASSES
            result = pb.EvaluationResult(split="test", num_classes=NUM_CLASSES, correct=correct,
                                         total=total, loss_sum=0.3 * total, brier_sum=0.1 * total)
            header = self._header(task, encode(Payload()).manifest, total)
            header.evaluation.append(result)
            chunks, kind = [], "evaluated"
        header.body_mac_iv = BodyMac.new_iv()
        body = BodyMac(self.mac_key, header.body_mac_iv)
        for chunk in chunks:
            body.update(chunk)
        header.signature = sign_submission(self.signing_key, header, body.tag())
        messages = [pb.SubmitMessage(header=header), *(pb.SubmitMessage(data=c) for c in chunks)]
        try:
            reply = await self.stub.Submit(iter(messages), timeout=120)
        except grpc.RpcError as err:
            self.fleet.fail("Submit", err)
            return
        self.fleet.counts[kind if reply.accepted else "refused"] += 1

    def _header(self, task: pb.TaskHeader, manifest, examples: int) -> pb.SubmitHeader:
        return pb.SubmitHeader(protocol_version=PROTOCOL_VERSION, edge_id=self.edge_id,
                               session=self.session, round=task.round, task_id=task.task_id,
                               phase=task.phase, task_nonce=task.task_nonce,
                               num_examples=examples, payload=manifest)


def write_status(path: Path, fleet: Fleet, edges: list[AioEdge], final: bool = False) -> None:
    status = {"edges": len(edges), "connected": sum(e.present.is_set() for e in edges),
              "counts": dict(fleet.counts), "failed": dict(fleet.failed),
              "elapsed_s": time.monotonic() - fleet.started, "final": final,
              "join_seconds": sorted(fleet.join_seconds) if final else []}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)


async def main_async(args) -> int:
    fleet = Fleet(args.server, args.seed, asyncio.Semaphore(args.join_concurrency),
                  long_poll=args.long_poll)
    edges = [AioEdge(fleet, f"{args.prefix}-{i:05d}", args.first_index + i)
             for i in range(args.edges)]
    runs = [asyncio.create_task(edge.run()) for edge in edges]
    deadline = time.monotonic() + args.deadline
    # bench/load.py sends SIGTERM once the server has exited: an edge that missed the
    # run's end would otherwise call a stopped server until the deadline, and those
    # calls would count as the server's failures.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, fleet.stop.set)
    try:
        while (not all(r.done() for r in runs) and not fleet.stop.is_set()
               and time.monotonic() < deadline):
            write_status(args.status, fleet, edges)
            await asyncio.sleep(1.0)
    finally:
        fleet.stop.set()
        for r in runs:
            r.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        errors = [r.exception() for r in runs if not r.cancelled() and r.exception()]
        for err in errors[:5]:
            print(f"edge task failed: {type(err).__name__}: {err}", file=sys.stderr)
        fleet.counts["edge task errors"] += len(errors)
        write_status(args.status, fleet, edges, final=True)
        await asyncio.gather(*(e.channel.close() for e in edges), return_exceptions=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True)
    p.add_argument("--edges", type=int, required=True)
    p.add_argument("--prefix", default="aio")
    p.add_argument("--first-index", type=int, default=0, help="index of the first edge (noise seeds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--join-concurrency", type=int, default=32,
                   help="joins in flight at once from this process")
    p.add_argument("--deadline", type=float, default=1800)
    p.add_argument("--long-poll", action="store_true",
                   help="hold a NextTask long-poll while idle even when the server sends "
                        "task hints (two calls per idle edge: the protocol before hints)")
    p.add_argument("--status", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())

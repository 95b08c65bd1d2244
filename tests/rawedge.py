"""A raw edge: a hand-written gRPC client that speaks fedattn's wire protocol directly
(join with a signed upload key share, presence stream, task long-polls, signed streamed
submissions), so a test can send exactly the bytes an adversary would. Shared by the
bad-input and adversarial-aggregate suites; the uploads are built here too."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

import grpc
import torch
from conftest import wait_for
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire import fedattn_pb2_grpc as pb_grpc
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.signing import BodyMac, exchange, new_key_share, sign_submission, upload_mac_key
from fedattn_shared.wire.transport import (
    MAX_MESSAGE_BYTES,
    DownloadTerms,
    PayloadAssembler,
    channel_options,
    payload_chunks,
)

UPLOAD_CHUNK = 32 << 10  # several data chunks per upload (the model is ~180 KB)
NUM_EXAMPLES = 5
NUM_CLASSES = 10
DOWNLINK_CAP = 1 << 30


# ---- a raw edge ------------------------------------------------------------------------


@dataclass
class Task:
    header: pb.TaskHeader
    globals: dict[str, torch.Tensor]  # the common payload's shared tensors (copies)


class RawEdge:
    """A minimal edge speaking the wire protocol by hand."""

    def __init__(self, port: int, prefix: str = "raw", options: tuple = ()):
        """``options``: more channel arguments (e.g. a stalling client's fixed window)."""
        self.port, self.options = port, [*channel_options(), *options]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=self.options)
        self.stub = pb_grpc.FederatedLearningStub(self.channel)
        self.edge_id = f"{prefix}-{secrets.token_hex(4)}"
        self.secret = secrets.token_hex(32)
        self.signing_key = Ed25519PrivateKey.generate()
        self.session = ""
        self.upload_mac_key = b""
        self.present = threading.Event()
        self.task_ready = threading.Event()  # a presence event said a task waits
        self.presence_events: list[pb.PresenceEvent] = []
        self.hints = False  # the JoinReply's task_hints
        self.terms = DownloadTerms()  # the JoinReply's: the deadline each NextTask carries
        self._presence_call = None
        self._presence_thread: threading.Thread | None = None

    def join(self, **overrides) -> pb.JoinReply:
        key_private, share, proof = new_key_share(self.signing_key, self.edge_id)
        fields = {"protocol_version": PROTOCOL_VERSION, "edge_id": self.edge_id,
                  "edge_secret": self.secret, "info": {"hostname": "bad-input-suite"},
                  "signing_key": self.signing_key.public_key().public_bytes_raw(),
                  "upload_key_share": share, "upload_key_proof": proof}
        fields.update(overrides)
        reply = self.stub.Join(pb.JoinRequest(**fields), timeout=10)
        self.upload_mac_key = upload_mac_key(exchange(key_private, reply.upload_key_share),
                                             self.edge_id, reply.session)
        return reply

    def connect(self, **join_overrides) -> None:
        """Join, then hold a presence stream open until ``close`` (the server only selects
        connected edges); returns once the server has counted this edge as connected."""
        reply = self.join(**join_overrides)
        self.present.clear()
        self.session, self.hints = reply.session, reply.task_hints
        self.terms = DownloadTerms.of(reply)
        self._presence_call = self.stub.Presence(
            pb.PresenceRequest(edge_id=self.edge_id, session=self.session))

        def watch():
            try:
                for event in self._presence_call:
                    self.presence_events.append(event)
                    if event.task_ready:
                        self.task_ready.set()
                    self.present.set()  # the server marks the edge connected before the first event
            except grpc.RpcError:
                pass

        self._presence_thread = threading.Thread(target=watch, daemon=True)
        self._presence_thread.start()
        wait_for(self.present.is_set, 15, f"presence of {self.edge_id}")

    def next_task(self, timeout: float = 30.0, no_wait: bool = False) -> Task:
        """Long-polls (``no_wait``: asks once) until a task arrives; decodes its common
        payload (never cached). A download larger than the server's window comes in
        continuation calls (task_id, offset), as fl-edge fetches it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            header = None
            assemblers: list[PayloadAssembler] = []
            request = pb.TaskRequest(edge_id=self.edge_id, session=self.session,
                                     cached_common="", no_wait=no_wait)
            for message in self.stub.NextTask(request, timeout=self.terms.deadline(no_wait)):
                if message.HasField("header"):
                    assert header is None, "a second task header in one stream"
                    header = message.header
                    if header.status == pb.TaskHeader.TASK:
                        assert not header.common_cached, "nothing was cached, yet no data follows"
                        assemblers = [PayloadAssembler(header.common, DOWNLINK_CAP, MAX_MESSAGE_BYTES),
                                      PayloadAssembler(header.personal, DOWNLINK_CAP, MAX_MESSAGE_BYTES)]
                    continue
                assert header is not None, "task data before the task header"
                target = next(a for a in assemblers if not a.complete)
                target.add(message.data)
            assert header is not None, "task stream without a header"
            if header.status == pb.TaskHeader.DONE:
                raise AssertionError(f"the run ended at round {header.round}; raise ROUNDS")
            if header.status == pb.TaskHeader.TASK:
                self.rest(header, assemblers)
                common, _personal = (a.finish() for a in assemblers)
                tensors = common.tensors(Kind.SHARED_TENSORS)
                return Task(header, {name: t.clone() for name, t in tensors.items()})
            if no_wait:  # the WAIT answer, for the caller to see
                return Task(header, {})
        raise AssertionError(f"no task for {self.edge_id} within {timeout}s")

    def rest(self, header: pb.TaskHeader, assemblers: list[PayloadAssembler]) -> None:
        """The windows of a task download after the bytes ``assemblers`` hold, in this
        edge's current session (continuation calls by task id and offset); the task must
        still be this edge's (a header instead of data says it is gone)."""
        while not all(a.complete for a in assemblers):
            more = pb.TaskRequest(edge_id=self.edge_id, session=self.session,
                                  task_id=header.task_id,
                                  offset=sum(a.received for a in assemblers))
            for message in self.stub.NextTask(more, timeout=self.terms.deadline(True)):
                assert not message.HasField("header"), f"the task is gone: {message.header}"
                next(a for a in assemblers if not a.complete).add(message.data)

    def submit(self, messages: list[pb.SubmitMessage]) -> pb.SubmitReply:
        """Signs an unsigned header over itself and the data that follows, as an edge does."""
        if messages and messages[0].HasField("header") and not messages[0].header.signature:
            self.sign(messages)
        return self.stub.Submit(iter(messages), timeout=30)

    def sign(self, messages: list[pb.SubmitMessage], key: Ed25519PrivateKey | None = None,
             mac_key: bytes | None = None) -> None:
        """As an edge signs: with its own keys unless a test swaps one in."""
        header = messages[0].header
        if not header.body_mac_iv:
            header.body_mac_iv = BodyMac.new_iv()
        body = BodyMac(self.upload_mac_key if mac_key is None else mac_key, header.body_mac_iv)
        for message in messages[1:]:
            body.update(message.data)
        header.signature = sign_submission(key or self.signing_key, header, body.tag())

    def header(self, task: Task, manifest: pb.PayloadManifest, **overrides) -> pb.SubmitHeader:
        fields = {"protocol_version": PROTOCOL_VERSION, "edge_id": self.edge_id,
                  "session": self.session, "round": task.header.round,
                  "task_id": task.header.task_id, "phase": task.header.phase,
                  "task_nonce": task.header.task_nonce,
                  "num_examples": NUM_EXAMPLES, "payload": manifest}
        fields.update(overrides)
        return pb.SubmitHeader(**fields)

    def evaluation(self, task: Task, detail: bool = False) -> list[pb.SubmitMessage]:
        """A plausible evaluation result: 90 of 180 samples right, as sums; ``detail``
        adds the per-class counts (9 on the diagonal, 1 elsewhere) that only an
        --eval-detail server asks for."""
        counts = [9 if i // NUM_CLASSES == i % NUM_CLASSES else 1 for i in range(NUM_CLASSES ** 2)]
        result = pb.EvaluationResult(split="test", num_classes=NUM_CLASSES, correct=9 * NUM_CLASSES,
                                     total=sum(counts), loss_sum=42.5, brier_sum=17.25,
                                     counts=counts if detail else [])
        header = self.header(task, encode(Payload()).manifest, num_examples=sum(counts),
                             evaluation=[result])
        return [pb.SubmitMessage(header=header)]

    def leave(self) -> None:
        self.stub.Leave(pb.LeaveRequest(edge_id=self.edge_id, session=self.session,
                                        reason="bad-input suite"), timeout=10)

    def close(self) -> None:
        if self._presence_call is not None:
            self._presence_call.cancel()
        if self._presence_thread is not None:
            self._presence_thread.join(timeout=10)
        self.channel.close()

    def reconnect(self) -> None:
        """Back after ``close`` (a new connection, a new session), as a device whose link
        came back."""
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}", options=self.options)
        self.stub = pb_grpc.FederatedLearningStub(self.channel)
        self.connect()


# ---- uploads -----------------------------------------------------------------------------


def shifted(tensors: dict[str, torch.Tensor], delta: float) -> dict[str, torch.Tensor]:
    return {name: (t + delta).to(t.dtype) for name, t in tensors.items()}


def encoded_train(tensors: dict[str, torch.Tensor], extra: tuple[Section, ...] = ()):
    return encode(Payload([Section(Kind.SHARED_TENSORS, "", tensors), *extra]))


def train_messages(edge: RawEdge, task: Task, tensors: dict[str, torch.Tensor],
                   **overrides) -> list[pb.SubmitMessage]:
    encoded = encoded_train(tensors)
    chunks = [chunk for _, chunk in payload_chunks(encoded, UPLOAD_CHUNK)]
    return [pb.SubmitMessage(header=edge.header(task, encoded.manifest, **overrides)),
            *(pb.SubmitMessage(data=c) for c in chunks)]


def raw_layout(edge: RawEdge, task: Task, tensors: dict[str, torch.Tensor]):
    """(header, chunks) of a valid upload, for scenarios that tamper with the stream."""
    encoded = encoded_train(tensors)
    return (edge.header(task, encoded.manifest),
            [chunk for _, chunk in payload_chunks(encoded, UPLOAD_CHUNK)])


def stream(header: pb.SubmitHeader | None, chunks: list[bytes]) -> list[pb.SubmitMessage]:
    head = [pb.SubmitMessage(header=header)] if header is not None else []
    return [*head, *(pb.SubmitMessage(data=c) for c in chunks)]

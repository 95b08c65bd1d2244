"""Light uploaders for ``bench/wire.py --uploaders``: many edges in one process, each
speaking the real protocol (its own channel, join with a signed upload key share, a
presence stream, task long-polls, signed and MAC'd streamed uploads) with no training:
an edge uploads the global it received. 64 fl-edge processes holding ResNet-18 and
torch would need ~25 GB on this 23 GB machine; these hold one model's frames each while
uploading, and what they measure is the server.

    python bench/uploaders.py --port P --edges 16 --prefix a --rounds 2
"""

from __future__ import annotations

import argparse
import secrets
import sys
import threading
import time

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire import fedattn_pb2_grpc as pb_grpc
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.signing import (
    BodyMac,
    exchange,
    new_key_share,
    sign_submission,
    upload_mac_key,
)
from fedattn_shared.wire.transport import (
    MAX_MESSAGE_BYTES,
    DownloadTerms,
    PayloadAssembler,
    channel_options,
    data_frames,
    serialize,
)

SUBMIT = "/fedattn.v1.FederatedLearning/Submit"
NUM_EXAMPLES = 5


class Uploader:
    """One edge: joins, stays present, uploads the received global every round."""

    def __init__(self, port: int, edge_id: str):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        self.stub = pb_grpc.FederatedLearningStub(self.channel)
        self.submit = self.channel.stream_unary(SUBMIT, request_serializer=serialize,
                                                response_deserializer=pb.SubmitReply.FromString)
        self.edge_id = edge_id
        self.key = Ed25519PrivateKey.generate()
        self.session, self.mac_key, self.present = "", b"", threading.Event()

    def connect(self) -> None:
        private, share, proof = new_key_share(self.key, self.edge_id)
        reply = self.stub.Join(pb.JoinRequest(
            protocol_version=PROTOCOL_VERSION, edge_id=self.edge_id,
            edge_secret=secrets.token_hex(32), info={"hostname": "bench-uploaders"},
            signing_key=self.key.public_key().public_bytes_raw(), upload_key_share=share,
            upload_key_proof=proof), timeout=60)
        self.session, self.terms = reply.session, DownloadTerms.of(reply)
        self.mac_key = upload_mac_key(exchange(private, reply.upload_key_share), self.edge_id,
                                      reply.session)
        call = self.stub.Presence(pb.PresenceRequest(edge_id=self.edge_id, session=self.session))

        def watch() -> None:
            try:
                for _ in call:
                    self.present.set()
            except grpc.RpcError:
                pass

        threading.Thread(target=watch, daemon=True).start()
        self.presence = call

    def task(self) -> tuple[pb.TaskHeader, Payload] | None:
        """The next task and its common payload, a window at a time, under the deadlines
        the server's terms allow; None when the run is over."""
        while True:
            header, assemblers = None, []
            request = pb.TaskRequest(edge_id=self.edge_id, session=self.session)
            for message in self.stub.NextTask(request, timeout=self.terms.deadline(False)):
                if message.HasField("header"):
                    header = message.header
                    if header.status == pb.TaskHeader.TASK:
                        assemblers = [PayloadAssembler(header.common, 1 << 31, MAX_MESSAGE_BYTES),
                                      PayloadAssembler(header.personal, 1 << 31, MAX_MESSAGE_BYTES)]
                    continue
                next(a for a in assemblers if not a.complete).add(message.data)
            if header is None or header.status == pb.TaskHeader.DONE:
                return None
            if header.status != pb.TaskHeader.TASK:
                continue
            while not all(a.complete for a in assemblers):
                more = pb.TaskRequest(edge_id=self.edge_id, session=self.session,
                                      task_id=header.task_id,
                                      offset=sum(a.received for a in assemblers))
                for message in self.stub.NextTask(more, timeout=self.terms.deadline(True)):
                    next(a for a in assemblers if not a.complete).add(message.data)
            return header, assemblers[0].finish()

    def upload(self, task: pb.TaskHeader, common: Payload) -> pb.SubmitReply:
        encoded = encode(Payload([Section(Kind.SHARED_TENSORS, "",
                                          common.tensors(Kind.SHARED_TENSORS))]), checksum=False)
        header = pb.SubmitHeader(
            protocol_version=PROTOCOL_VERSION, edge_id=self.edge_id, session=self.session,
            round=task.round, task_id=task.task_id, phase=task.phase,
            task_nonce=task.task_nonce, num_examples=NUM_EXAMPLES, payload=encoded.manifest,
            body_mac_iv=BodyMac.new_iv())
        header.signature = sign_submission(self.key, header,
                                           encoded.body_mac(self.mac_key, header.body_mac_iv))

        def messages():
            yield pb.SubmitMessage(header=header)
            for _, frame, _ in data_frames(encoded):
                yield frame

        return self.submit(messages(), timeout=600)

    def run(self, failures: list[str]) -> None:
        try:
            while (found := self.task()) is not None:
                reply = self.upload(*found)
                if not reply.accepted:
                    failures.append(f"{self.edge_id}: {reply.reason}")
        except grpc.RpcError as err:
            failures.append(f"{self.edge_id}: {err.code()}: {err.details()}")
        finally:
            self.presence.cancel()
            self.channel.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--edges", type=int, required=True)
    parser.add_argument("--prefix", default="up")
    args = parser.parse_args()
    edges = [Uploader(args.port, f"{args.prefix}-{i:03d}") for i in range(args.edges)]
    for edge in edges:
        edge.connect()
    for edge in edges:
        edge.present.wait(60)
    failures: list[str] = []
    threads = [threading.Thread(target=e.run, args=(failures,)) for e in edges]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"{args.prefix}: {len(edges)} edges done in {time.monotonic() - started:.1f} s, "
          f"{len(failures)} failures", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

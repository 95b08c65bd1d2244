"""The edge's upload deadline follows the server's terms (``UploadTerms``, told in the
JoinReply), not a constant: a fixed 600 s cut every upload that needed longer (ResNet-18's
45 MB below ~600 kbit/s), however steadily its link moved. Checked where a deadline
shows: the time a real gRPC server sees left on the edge's Submit call.
"""

from __future__ import annotations

import math
from concurrent import futures
from pathlib import Path

import grpc
import torch
from prometheus_client import CollectorRegistry
from test_adversarial import raw_fleet

from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.accounting import ByteMeter
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import UploadTerms, channel_options
from fl_edge.options import EdgeOptions
from fl_edge.transport import UPLOAD_WAIT, GrpcTransport

CHUNK = 1 << 16


def test_the_join_reply_carries_the_servers_upload_terms(tmp_path):
    with raw_fleet(tmp_path, ("asker",), "--min-edges", "1", "--upload-idle-timeout", "7",
                   "--upload-min-rate", "2048") as (_cluster, (edge,)):
        reply = edge.join()
    assert (reply.upload_idle_timeout, reply.upload_min_rate) == (7.0, 2048.0)
    assert UploadTerms.of(reply) == UploadTerms(7.0, 2048.0)


def test_terms_a_server_left_out_or_should_never_send_are_the_defaults():
    for idle, rate in ((0.0, 0.0), (-1.0, -5.0), (math.nan, math.inf)):
        reply = pb.JoinReply(upload_idle_timeout=idle, upload_min_rate=rate)
        assert UploadTerms.of(reply) == UploadTerms()


class Recorder:
    """A Submit handler that reads the whole stream and notes the deadline left."""

    def __init__(self):
        self.seconds_left: list[float] = []
        self.received = 0

    def submit(self, messages, context):
        self.seconds_left.append(context.time_remaining())
        for message in messages:
            self.received += len(message.data)
        return pb.SubmitReply(accepted=True)


def test_an_uploads_deadline_is_its_bytes_at_the_servers_min_rate(tmp_path):
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=channel_options())
    handler = grpc.method_handlers_generic_handler("fedattn.v1.FederatedLearning", {
        "Submit": grpc.stream_unary_rpc_method_handler(
            recorder.submit, request_deserializer=pb.SubmitMessage.FromString,
            response_serializer=pb.SubmitReply.SerializeToString)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        opts = EdgeOptions(server=f"127.0.0.1:{port}", data_dir=Path(tmp_path),
                           state_dir=Path(tmp_path))
        transport = GrpcTransport(opts, None, ByteMeter(CollectorRegistry()), "edge")
        transport.chunk_bytes = CHUNK
        # A slow server's terms: 1 KiB/s, so 256 KiB take 256 s beyond the idle timeout.
        transport.upload_terms = UploadTerms(idle_timeout=5.0, min_rate=1024.0)
        tensor = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB
        encoded = encode(Payload([Section(Kind.SHARED_TENSORS, "w", {"w": tensor})]))
        size = encoded.manifest.total_bytes
        with transport.connect():
            for offset in (0, 2 * CHUNK):
                header = pb.SubmitMessage(header=pb.SubmitHeader(resume_offset=offset))
                reply = transport.upload(header, encoded, {}, offset)
                assert reply.accepted
        for offset, left in zip((0, 2 * CHUNK), recorder.seconds_left, strict=True):
            wanted = UPLOAD_WAIT + 5.0 + (size - offset) / 1024.0
            # gRPC's timeout header rounds up (to whole seconds past 100 s, tens past 1000)
            assert wanted - 5 < left <= wanted * 1.01 + 1, (offset, left, wanted)
        assert recorder.received == size + size - 2 * CHUNK
    finally:
        server.stop(None)

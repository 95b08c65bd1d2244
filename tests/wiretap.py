"""A recording gRPC proxy in front of a real fl-server: real fl-edge processes connect to
it instead of the server, it forwards every call of the fedattn service byte for byte
(no (de)serialisation, metadata and deadlines passed on, errors passed back) and keeps
every ``SubmitMessage`` the edges sent, exactly as the server received them. A test then
reads what crossed the wire as an observer on the link (or the server itself) would,
rather than trusting either daemon's own account of what it sent."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire.transport import channel_options

SERVICE = pb.DESCRIPTOR.services_by_name["FederatedLearning"]


class WireTap:
    """The proxy (``port``) and what it saw (``submitted``: raw SubmitMessage bytes, in
    the order they arrived). A context manager: stopped, with its upstream channel, on
    exit."""

    def __init__(self, upstream_port: int):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{upstream_port}", options=channel_options())
        self.submitted: list[bytes] = []
        self._lock = threading.Lock()
        handlers = {m.name: self._handler(f"/{SERVICE.full_name}/{m.name}", m.client_streaming,
                                          m.server_streaming) for m in SERVICE.methods}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=channel_options())
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def __enter__(self) -> WireTap:
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(grace=None)
        self.channel.close()

    def submit_headers(self) -> list[pb.SubmitHeader]:
        """The header of every Submit stream the proxy passed on, parsed here."""
        with self._lock:
            raw = list(self.submitted)
        messages = [pb.SubmitMessage.FromString(b) for b in raw]
        return [m.header for m in messages if m.HasField("header")]

    # ---- forwarding ------------------------------------------------------------------------
    def _record(self, requests: Iterator[bytes]) -> Iterator[bytes]:
        for request in requests:
            with self._lock:
                self.submitted.append(request)
            yield request

    def _handler(self, path: str, client_streaming: bool, server_streaming: bool):
        """A bytes-in, bytes-out handler of one method that calls the same method upstream."""
        record = path.endswith("/Submit")

        def call_args(context: grpc.ServicerContext) -> dict:
            remaining = context.time_remaining()
            metadata = [(k, v) for k, v in context.invocation_metadata()
                        if not k.startswith((":", "grpc-")) and k != "user-agent"]
            return {"timeout": remaining if remaining is not None and remaining < 1e6 else None,
                    "metadata": metadata}

        def abort(context: grpc.ServicerContext, err: grpc.RpcError):
            context.abort(err.code(), err.details() or "")

        if client_streaming and not server_streaming:
            upstream = self.channel.stream_unary(path)

            def stream_unary(requests, context):
                try:
                    return upstream(self._record(requests) if record else requests,
                                    **call_args(context))
                except grpc.RpcError as err:
                    abort(context, err)
            return grpc.stream_unary_rpc_method_handler(stream_unary)
        if server_streaming and not client_streaming:
            upstream = self.channel.unary_stream(path)

            def unary_stream(request, context):
                call = upstream(request, **call_args(context))
                context.add_callback(call.cancel)  # the edge went away: so does the upstream call
                try:
                    yield from call
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.CANCELLED:
                        abort(context, err)
            return grpc.unary_stream_rpc_method_handler(unary_stream)
        if not client_streaming:
            upstream = self.channel.unary_unary(path)

            def unary_unary(request, context):
                try:
                    return upstream(request, **call_args(context))
                except grpc.RpcError as err:
                    abort(context, err)
            return grpc.unary_unary_rpc_method_handler(unary_unary)
        raise AssertionError(f"{path}: a bidirectional stream, which fedattn's service has none of")

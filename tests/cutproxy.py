"""A TCP forwarder between an edge and its server that breaks every connection once, the
moment the edge has sent a given number of bytes (its upload under way), or when the test
says (``cut``: no connection is taken until ``restore``, a modem that lost its carrier
behind a NAT that resets): the kernel's
sockets are shut down both ways, so both daemons see what a dropped link or a NAT's reset
does to their real HTTP/2 connection (every call on it ends; gRPC reconnects). Or, with
``stall``, it stops forwarding the edge's bytes (with ``downstream``, the server's) from
there (a link gone silent), until the edge's end of the connection closes (the test kills
the edge process). Everything
else is forwarded byte for byte; loopback only, torn down on ``close``."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


class CutProxy:
    """Listens on a free loopback port (``port``) and forwards to ``target_port``; once
    the edge-to-server bytes pass ``cut_after`` (0: never), every open connection is shut
    down, once (``cuts`` counts it). Connections made afterwards are forwarded whole."""

    def __init__(self, target_port: int, cut_after: int = 0, stall: bool = False,
                 downstream: bool = False, before_cut: Callable[[], object] | None = None):
        """``downstream``: ``cut_after`` counts the server's bytes to the edge instead (a
        cut in the middle of a task download). ``before_cut``: called once the bytes are
        due, before the cut, while the edge's bytes wait (e.g. until the server has taken
        in what arrived: a loaded server's handler can lag its socket by a window)."""
        self.before_cut = before_cut
        self.target_port, self.cut_after, self.stall = target_port, cut_after, stall
        self.downstream = downstream
        self.upstream_bytes = 0
        self.cuts = 0
        self.cut_done = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._silent: set[socket.socket] = set()  # stall: the connections open at the cut
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._down = False  # cut by the test: connections are refused until restore
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Every open connection ends, and new ones are refused until ``restore``."""
        with self._lock:
            self._down = True
            sockets, self._sockets = self._sockets, []
        self._shut(sockets)

    def restore(self) -> None:
        """Connections are taken (and forwarded) again."""
        self._down = False

    @staticmethod
    def _shut(sockets: list[socket.socket]) -> None:
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._down:
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                if upstream != self.downstream and source in self._silent:
                    continue  # the link went silent: the counted side's bytes go nowhere
                sink.sendall(data)
                if upstream != self.downstream:
                    self._count(len(data))
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _count(self, size: int) -> None:
        with self._lock:
            self.upstream_bytes += size
            due = self.cut_after and not self.cuts and self.upstream_bytes >= self.cut_after
            if due:
                self.cuts += 1
            sockets = list(self._sockets) if due and not self.stall else []
            if due and self.stall:
                self._silent = set(self._sockets)
        if due and self.before_cut is not None:
            self.before_cut()
        self._shut(sockets)
        if due:
            self.cut_done.set()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            try:
                sock.close()
            except OSError:
                pass

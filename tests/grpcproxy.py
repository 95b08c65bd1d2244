"""A real L7 gRPC proxy in front of a test's server: nginx from the distribution
(``apt-get install nginx-light``), terminating HTTP/2 from the edges and passing each call
on with ``grpc_pass``, with every timeout of its that can cut an idle stream set to one
``idle`` value, as a corporate proxy or a load balancer with a 60 s idle timeout would.

What nginx measures (its docs, and what ``test_proxy`` sees it do): ``grpc_read_timeout``
runs between two reads from the server on a call's own upstream connection (nginx opens
one per call), so a stream whose server sends nothing for that long is cut (RST_STREAM to
the edge; a 504 before the reply's headers); ``client_body_timeout`` likewise between two
reads of an upload's body; ``grpc_send_timeout`` and ``send_timeout`` while a write is
blocked; ``keepalive_timeout`` closes an edge's connection with no call open. The edge's
HTTP/2 PINGs end at nginx and are no stream's activity.

``unavailable()`` says why no proxy can run here (for a skip); ``grpc_proxy`` runs one
for the body of a ``with`` and stops it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else "")

CONFIG = """daemon off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log info;
events {{ worker_connections 512; }}
http {{
  access_log {root}/access.log;
  client_body_temp_path {root}/body;
  proxy_temp_path {root}/proxy;
  fastcgi_temp_path {root}/fastcgi;
  uwsgi_temp_path {root}/uwsgi;
  scgi_temp_path {root}/scgi;
  server {{
    listen 127.0.0.1:{port} http2;
    client_max_body_size 0;
    grpc_read_timeout {idle}s;
    grpc_send_timeout {idle}s;
    client_body_timeout {idle}s;
    send_timeout {idle}s;
    keepalive_timeout {idle}s;
    location / {{ grpc_pass grpc://127.0.0.1:{upstream}; }}
  }}
}}
"""


def unavailable() -> str:
    """'' when nginx with gRPC and HTTP/2 can run here, else why not."""
    if not NGINX:
        return "needs nginx (apt-get install nginx-light)"
    built = subprocess.run([NGINX, "-V"], capture_output=True, text=True, timeout=30).stderr
    if "--with-http_v2_module" not in built or "--without-http_grpc_module" in built:
        return f"{NGINX} lacks HTTP/2 or gRPC proxying"
    return ""


@dataclass
class Proxy:
    """A running nginx: the port edges connect to, and its error log."""

    port: int
    root: Path

    def errors(self) -> str:
        return (self.root / "error.log").read_text(errors="replace")

    def timeouts(self) -> int:
        """Calls nginx cut for one of its idle timeouts (an upstream's at error level, a
        client's at info)."""
        return sum("timed out" in line for line in self.errors().splitlines())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def grpc_proxy(upstream: int, idle: float, root: Path,
               wrap: Callable[[list[str]], list[str]] | None = None) -> Iterator[Proxy]:
    """nginx on a free loopback port passing every call to ``127.0.0.1:upstream``, each of
    its idle timeouts ``idle`` seconds; stopped (and waited for) on the way out. ``wrap``:
    runs it elsewhere (``netlink.Link.wrap``: in a network namespace, beside the server)."""
    root.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    (root / "nginx.conf").write_text(CONFIG.format(root=root, port=port, upstream=upstream,
                                                   idle=f"{idle:g}"))
    log = open(root / "nginx.out", "ab")
    args = [NGINX, "-c", str(root / "nginx.conf"), "-p", str(root)]
    proc = subprocess.Popen(wrap(args) if wrap else args, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        # nginx writes its pid file once its listening socket is bound and listening.
        deadline = time.monotonic() + 30
        while not (root / "nginx.pid").exists():
            if proc.poll() is not None:
                raise AssertionError(f"nginx exited ({proc.returncode}):\n"
                                     f"{(root / 'nginx.out').read_text(errors='replace')}")
            if time.monotonic() > deadline:
                raise AssertionError("nginx did not start within 30s")
            time.sleep(0.1)
        yield Proxy(port, root)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # fast: held streams end now
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
        log.close()

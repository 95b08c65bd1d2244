"""Two hosts joined by a shaped link, made of the kernel's own parts: a network namespace
each, a veth pair between them, a token bucket (``tc qdisc tbf``) for the bandwidth on both
ends, and iptables' ``statistic`` match dropping packets at random for the loss; a cut drops
everything, both ways, without telling either host (as a modem losing its carrier). What a
cellular link does to the daemons is then what the kernel does to their real TCP
connections, not a simulation inside the process.

Delay is the one thing not emulated: the kernel these tests run on has no ``sch_netem``
(``tc qdisc ... netem`` answers "unknown qdisc"), so the only added latency is the token
bucket's queue (up to ``QUEUE_MS``), as on a link whose modem buffers.

Everything lives in namespaces this module creates (addresses 10.213.x.y inside them only)
and is deleted on the way out. Needs root, iproute2 and iptables: ``unavailable()`` says
why not, for a skip.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SERVER_ADDRESS = "10.213.0.1"
EDGE_ADDRESS = "10.213.0.2"
QUEUE_MS = 400  # the token bucket's queue: what a full modem buffer adds to the RTT


@dataclass(frozen=True)
class Profile:
    """A link: bandwidth (kbit/s, each direction) and random loss (%, each direction)."""

    rate_kbit: int
    loss_pct: float = 0.0

    def __str__(self) -> str:
        return f"{self.rate_kbit} kbit/s, {self.loss_pct:g} % loss"

    def tbf(self) -> list[str]:
        burst = max(1600, self.rate_kbit * 1000 // 8 // 100)  # 10 ms of the rate
        return ["tbf", "rate", f"{self.rate_kbit}kbit", "burst", str(burst),
                "latency", f"{QUEUE_MS}ms"]


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def unavailable() -> str:
    """'' when namespaces and tc can be used here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if not (shutil.which("ip") and shutil.which("tc") and shutil.which("iptables")):
        return "needs iproute2 (ip, tc) and iptables"
    probe = f"fa-probe-{secrets.token_hex(3)}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as err:
        return f"cannot create a network namespace: {err}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return ""


@dataclass
class Link:
    """The two namespaces and their veth ends; ``wrap`` a command to run it on a side."""

    server_ns: str
    edge_ns: str
    server_dev: str
    edge_dev: str

    def wrap(self, side: str, args: list[str]) -> list[str]:
        ns = self.server_ns if side == "server" else self.edge_ns
        return ["ip", "netns", "exec", ns, *args]

    def _sides(self):
        return ((self.server_ns, self.server_dev), (self.edge_ns, self.edge_dev))

    def shape(self, profile: Profile) -> None:
        """Both directions shaped to ``profile`` (replacing what was set, a cut too)."""
        for ns, dev in self._sides():
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                 *profile.tbf())
            _run("ip", "netns", "exec", ns, "iptables", "-F", "OUTPUT")
            if profile.loss_pct:
                _run("ip", "netns", "exec", ns, "iptables", "-A", "OUTPUT", "-o", dev,
                     "-m", "statistic", "--mode", "random", "--probability",
                     f"{profile.loss_pct / 100:g}", "-j", "DROP")

    def down(self) -> None:
        """The link goes dark: nothing passes either way, and neither host is told (no
        reset, no FIN, the interfaces stay up)."""
        for ns, dev in self._sides():
            _run("ip", "netns", "exec", ns, "iptables", "-I", "OUTPUT", "1", "-o", dev,
                 "-j", "DROP")

    def up(self, profile: Profile) -> None:
        """The link is back with ``profile``."""
        self.shape(profile)


@contextmanager
def shaped_link(profile: Profile) -> Iterator[Link]:
    """Two namespaces joined by a veth pair shaped to ``profile``; deleted afterwards."""
    tag = secrets.token_hex(3)
    link = Link(f"fa-srv-{tag}", f"fa-edge-{tag}", f"fas{tag}", f"fae{tag}")
    try:
        for ns in (link.server_ns, link.edge_ns):
            _run("ip", "netns", "add", ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _run("ip", "link", "add", link.server_dev, "type", "veth", "peer", "name", link.edge_dev)
        for ns, dev, address in ((link.server_ns, link.server_dev, SERVER_ADDRESS),
                                 (link.edge_ns, link.edge_dev, EDGE_ADDRESS)):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/30", "dev", dev)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
        link.shape(profile)
        yield link
    finally:
        for ns in (link.server_ns, link.edge_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

"""Two hosts joined by a shaped link, made of the kernel's own parts: a network namespace
each, a veth pair between them, a token bucket (``tc qdisc tbf``) for the bandwidth on both
ends, and iptables' ``statistic`` match dropping packets at random for the loss; a cut drops
everything, both ways, without telling either host (as a modem losing its carrier). What a
cellular link does to the daemons is then what the kernel does to their real TCP
connections, not a simulation inside the process.

Delay: the kernel these tests run on has no ``sch_netem`` (``tc qdisc ... netem`` answers
"unknown qdisc"). A profile with ``delay_ms`` joins the namespaces with a TUN device each
instead of a veth pair, and ``netlink_relay.py`` moves every IP packet from one to the
other half the round-trip time later (the hosts' TCP stays the kernel's, end to end); the
token bucket and the loss sit on the TUN devices as on the veth ends. Without
``delay_ms`` the only added latency is the token bucket's queue (up to ``QUEUE_MS``), as
on a link whose modem buffers.

Everything lives in namespaces this module creates (addresses 10.213.x.y inside them only)
and is deleted on the way out. Needs root, iproute2 and iptables: ``unavailable()`` says
why not, for a skip.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SERVER_ADDRESS = "10.213.0.1"
EDGE_ADDRESS = "10.213.0.2"
QUEUE_MS = 400  # the token bucket's queue: what a full modem buffer adds to the RTT


@dataclass(frozen=True)
class Profile:
    """A link: bandwidth (kbit/s, each direction) and random loss (%, each direction)."""

    rate_kbit: int
    loss_pct: float = 0.0
    delay_ms: int = 0  # round-trip time added (half each way); fixed when the link is made

    def __str__(self) -> str:
        rtt = f", {self.delay_ms} ms RTT" if self.delay_ms else ""
        return f"{self.rate_kbit} kbit/s, {self.loss_pct:g} % loss{rtt}"

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
    relay: subprocess.Popen | None = None  # netlink_relay.py, with a delay_ms profile

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
            # Dropped as they arrive (INPUT), not as they leave: a packet OUTPUT drops
            # fails its send with EPERM, and the sender's TCP sends it again at once,
            # knowing, so no loss ever reached the link (measured: the same bytes and round
            # time as without loss).
            _run("ip", "netns", "exec", ns, "iptables", "-F", "INPUT")
            if profile.loss_pct:
                _run("ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-i", dev,
                     "-m", "statistic", "--mode", "random", "--probability",
                     f"{profile.loss_pct / 100:g}", "-j", "DROP")

    def down(self) -> None:
        """The link goes dark: nothing passes either way, and neither host is told (no
        reset, no FIN, the interfaces stay up)."""
        for ns, dev in self._sides():
            _run("ip", "netns", "exec", ns, "iptables", "-I", "INPUT", "1", "-i", dev,
                 "-j", "DROP")

    def up(self, profile: Profile) -> None:
        """The link is back with ``profile`` (its rate and loss: the delay stays)."""
        self.shape(profile)


def _veth(link: Link) -> None:
    _run("ip", "link", "add", link.server_dev, "type", "veth", "peer", "name", link.edge_dev)
    for ns, dev, address in ((link.server_ns, link.server_dev, SERVER_ADDRESS),
                             (link.edge_ns, link.edge_dev, EDGE_ADDRESS)):
        _run("ip", "link", "set", dev, "netns", ns)
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/30", "dev", dev)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")


def _tun_pair(link: Link, delay_ms: int) -> None:
    """A TUN device in each namespace, point to point, and the relay between them."""
    for ns, dev in link._sides():
        _run("ip", "netns", "exec", ns, "ip", "tuntap", "add", "dev", dev, "mode", "tun")
    link.relay = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("netlink_relay.py")), link.server_ns,
         link.server_dev, link.edge_ns, link.edge_dev, f"{delay_ms / 2000:g}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = link.relay.stdout.readline()  # "ready", or nothing when it failed
    if line.strip() != "ready":
        link.relay.kill()
        raise RuntimeError(f"the delay relay did not start: {link.relay.stderr.read()[-2000:]}")
    for ns, dev, address, peer in ((link.server_ns, link.server_dev, SERVER_ADDRESS, EDGE_ADDRESS),
                                   (link.edge_ns, link.edge_dev, EDGE_ADDRESS, SERVER_ADDRESS)):
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", address, "peer", peer, "dev", dev)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")


@contextmanager
def shaped_link(profile: Profile) -> Iterator[Link]:
    """Two namespaces joined by a veth pair (a TUN pair and the relay, with a delay)
    shaped to ``profile``; deleted afterwards."""
    tag = secrets.token_hex(3)
    link = Link(f"fa-srv-{tag}", f"fa-edge-{tag}", f"fas{tag}", f"fae{tag}")
    try:
        for ns in (link.server_ns, link.edge_ns):
            _run("ip", "netns", "add", ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        if profile.delay_ms:
            _tun_pair(link, profile.delay_ms)
        else:
            _veth(link)
        link.shape(profile)
        yield link
    finally:
        if link.relay is not None:
            link.relay.kill()
            link.relay.wait(timeout=30)
        for ns in (link.server_ns, link.edge_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

"""The delay of a shaped link (``netlink.shaped_link`` with ``Profile.delay_ms``): moves IP
packets between two TUN devices, one in each network namespace, each packet after half
the round-trip time. The kernel on these machines has no ``sch_netem`` (the qdisc that
usually adds delay), so the packets take a detour through this process instead: both
hosts' TCP stacks are the kernel's own and end to end (nothing here terminates, reorders
or acknowledges a connection); the token bucket and the loss stay on the TUN devices.

    python netlink_relay.py SERVER_NS SERVER_TUN EDGE_NS EDGE_TUN ONE_WAY_SECONDS

Prints ``ready`` once both devices are attached, then relays until killed.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import select
import struct
import sys
import time

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def enter(namespace: str) -> None:
    """Moves this (single-threaded) process into the named network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def attach(device: str) -> int:
    """An fd for the TUN device ``device`` of the current namespace (made by ``ip tuntap``),
    non-blocking: each read is one IP packet."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def relay(a: int, b: int, one_way: float) -> None:
    """Forever: each packet read from one device is written to the other ``one_way``
    seconds later. One constant delay keeps each direction's order (a FIFO)."""
    other = {a: b, b: a}
    pending: collections.deque[tuple[float, int, bytes]] = collections.deque()
    while True:
        timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else None
        readable, _, _ = select.select([a, b], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                pending.append((now + one_way, other[fd], packet))
        while pending and pending[0][0] <= now:
            _, out, packet = pending.popleft()
            try:
                os.write(out, packet)
            except (BlockingIOError, OSError):
                pass  # the device's queue is full or it went down: the packet is lost


def main(argv: list[str]) -> int:
    server_ns, server_tun, edge_ns, edge_tun, one_way = argv
    enter(server_ns)
    a = attach(server_tun)
    enter(edge_ns)
    b = attach(edge_tun)
    print("ready", flush=True)
    relay(a, b, float(one_way))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

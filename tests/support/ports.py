"""Loopback ports for tests and benchmarks: one home for the free-port helpers."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A port the kernel just handed out to bind(0) (an ephemeral one): for a server bound at once."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound right now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


class _PortPicker:
    """Free loopback ports outside the kernel's ephemeral range.

    A server is often started minutes after its port is picked (a proxy whose instances are
    already heartbeating to it). A port from bind(0) is an ephemeral one: in that window the
    kernel may hand it to anyone else's bind(0) (vLLM's get_open_port, gloo's store) or use it
    as the source of an outgoing connection, and the late bind fails with EADDRINUSE (seen in
    CI). Ports outside the range are never handed out that way. Ports given once in this
    process are not given again."""

    def __init__(self) -> None:
        low, high = _ephemeral_range()
        # Below the range when there is room (Linux's default 32768-60999), else above it.
        self._span = (10000, low - 2) if low - 2 - 10000 >= 2000 else (high + 1, 65533)
        self._given: set[int] = set()
        self._held: list[socket.socket] = []  # dead ports' sockets, kept until this process exits
        self._rng = random.Random(os.getpid() ^ time.monotonic_ns())

    def pick(self, width: int = 1) -> int:
        """A port p with p..p+width-1 all free."""
        for _ in range(500):
            p = self._rng.randint(*self._span)
            ports = range(p, p + width)
            if any(q in self._given for q in ports) or not all(port_free(HOST, q) for q in ports):
                continue
            self._given.update(ports)
            return p
        raise RuntimeError(f"no free port in {self._span}")

    def hold(self, width: int = 1) -> int:
        """A port p with p..p+width-1 bound here without listening, for good."""
        for _ in range(20):
            p = self.pick(width)
            socks: list[socket.socket] = []
            try:
                for q in range(p, p + width):
                    s = socket.socket()  # no SO_REUSEADDR: nobody else can bind q while it is held
                    socks.append(s)
                    s.bind((HOST, q))
            except OSError:  # taken since the pick
                for s in socks:
                    s.close()
                continue
            self._held.extend(socks)
            return p
        raise RuntimeError(f"no port to hold in {self._span}")


_PORTS = _PortPicker()  # test/benchmark helper state: which ports this process handed out


def spare_port(width: int = 1) -> int:
    """A free port p (p..p+width-1 all free) outside the ephemeral range, for a server started
    long after the pick (see _PortPicker)."""
    return _PORTS.pick(width)


def dead_port(width: int = 1) -> int:
    """A loopback port p (p..p+width-1) where nobody listens, for the rest of this process: a
    connect is refused at once, as at any free port. A free port from bind(0) is not dead for
    long: the next bind(0) anywhere (another test's engine, in another xdist worker) may get
    it, and a send aimed at "nobody" reaches that engine (same transfer key). This one lies
    outside the ephemeral range and stays bound, so nobody else gets it."""
    return _PORTS.hold(width)

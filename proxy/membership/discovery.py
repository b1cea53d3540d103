"""ZMQ discovery: a ROUTER socket that instances heartbeat to, plus the expiry sweep.

What a sender may cost (DiscoveryLimits): the receive loop handles at most TURN_MESSAGES
messages or TURN_S seconds of work per event-loop turn (then yields: a flood cannot stall the
HTTP side), and at most `cpu_share` of each second (then waits for the next second: the rest
stays queued in ZMQ, fairly among the connections, and TCP holds their senders back); a source
host's messages beyond `max_source_rate` a second are dropped before they are decoded
(`rate_limited`). Connections are counted as libzmq accepts them (its socket monitor): beyond
`max_connections` (and a quarter of the file-descriptor limit), or `max_connections_per_source`
from one host, a new one is shut down at once, so idle senders cannot take the descriptors
clients need; one that never completes ZMTP's handshake is dropped after HANDSHAKE_S, and one
that stops answering ZMTP heartbeats after HEARTBEAT_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time
from collections import Counter as Tally
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from proxy.config import ProxyConfig
from proxy.metrics import Metrics
from proxy.registry import RegistrationRefused, Registry
from xpyd_wire.discovery import (
    DROP_REASONS,
    MALFORMED,
    MAX_CLOCK_SKEW_S,
    MAX_MESSAGE_BYTES,
    REPLAYED,
    ProtocolError,
    ReplayGuard,
    decode,
)

log = logging.getLogger("xpyd.proxy.discovery")

# At most this many "dropped" warnings per window, so a flood cannot flood the log.
LOG_BURST = 10
LOG_WINDOW_S = 10.0
# The label values of xpyd_discovery_messages_total: a fixed, small set.
# "refused": a valid registration beyond --discovery-max-per-role / --discovery-max-per-source,
# or for an address another instance owns (proxy/registry.py: reason "conflict").
# "rate_limited": beyond its source host's --discovery-max-source-rate, dropped undecoded.
RATE_LIMITED = "rate_limited"
RESULTS = ("accepted", "left", "refused", RATE_LIMITED, *DROP_REASONS)
# Work done in one event-loop turn before the loop yields: messages, or seconds.
TURN_MESSAGES = 64
TURN_S = 0.002
HANDSHAKE_S = 5.0  # a connection must complete ZMTP's handshake within this
HEARTBEAT_IVL_S, HEARTBEAT_TIMEOUT_S = 10.0, 30.0  # ZMTP pings; a peer silent past the timeout is dropped


@dataclass(frozen=True, slots=True)
class DiscoveryLimits:
    """What senders may cost (see the module docstring); the proxy's flags of the same names."""

    cpu_share: float = 0.2  # of each second, the most the receive loop may work (one core's share)
    max_source_rate: int = 200  # messages per second per source host; beyond: dropped
    max_connections: int = 2 * 1024 + 64  # discovery connections held (also <= a quarter of the fd limit)
    max_connections_per_source: int = 128  # ... from one source host

    @staticmethod
    def of(cfg: ProxyConfig) -> DiscoveryLimits:
        return DiscoveryLimits(cfg.discovery_cpu_share, cfg.discovery_max_source_rate, cfg.discovery_max_connections,
                               cfg.discovery_max_connections_per_source)


@dataclass(slots=True)
class LogLimiter:
    """Allows `burst` log lines per `window_s`; counts the rest so the next line can say
    how many were suppressed."""

    burst: int = LOG_BURST
    window_s: float = LOG_WINDOW_S
    _start: float = float("-inf")
    _count: int = 0
    suppressed: int = 0

    def allow(self, now: float) -> bool:
        if now - self._start >= self.window_s:
            self._start = now
            self._count = 0
        self._count += 1
        if self._count <= self.burst:
            return True
        self.suppressed += 1
        return False

    def take_suppressed(self) -> int:
        n, self.suppressed = self.suppressed, 0
        return n


class Discovery:
    def __init__(
        self,
        registry: Registry,
        metrics: Metrics,
        host: str,
        port: int,
        secret: str | None = None,
        limits: DiscoveryLimits | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.host = host
        self.requested_port = port
        self.secret = secret
        self.limits = limits or DiscoveryLimits()
        self.port: int | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._log_limit = LogLimiter()
        self.replay_guard = ReplayGuard(window_s=MAX_CLOCK_SKEW_S)
        self._counters = {r: metrics.discovery.labels(r) for r in RESULTS}
        # The current second: work done (seconds), and messages per source host.
        self._window = 0.0
        self._busy = 0.0
        self._per_source: Tally[str | None] = Tally()
        # Admitted connections: descriptor -> source host, and how many per host.
        self.connections: dict[int, str] = {}
        self._per_host: Tally[str] = Tally()
        self._conn_refused = {r: metrics.discovery_connections_refused.labels(r) for r in ("limit", "source_limit")}

    async def start(self) -> None:
        # A context of our own (not Context.instance()): several proxies may share a process.
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Oversized messages never reach us: ZMQ drops the sending peer's connection.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # A peer's queue here holds a few heartbeats; beyond, TCP holds its sender back.
        sock.setsockopt(zmq.RCVHWM, 64)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        # Before bind: no connection is accepted unseen.
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        host = "*" if self.host in ("0.0.0.0", "") else self.host
        if self.requested_port == 0:
            self.port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{self.requested_port}")
            self.port = self.requested_port
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._receive_loop(), name="xpyd-discovery"),
            loop.create_task(self._connections_loop(), name="xpyd-discovery-connections"),
            loop.create_task(self._sweep_loop(), name="xpyd-expiry"),
        ]
        log.info(
            "discovery listening address=tcp://%s:%s signed=%s", host, self.port, bool(self.secret)
        )

    @property
    def alive(self) -> bool:
        """Both background tasks (receive, expiry sweep) are running."""
        return bool(self._tasks) and not any(t.done() for t in self._tasks)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._monitor is not None:
            if self._sock is not None:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            try:
                # Frames, not bytes: they carry the sending connection's peer address.
                received = await sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let one bad receive stop discovery
                self._drop(MALFORMED, f"receive failed: {type(e).__name__}: {e}")
                await asyncio.sleep(0.01)
                continue
            # A turn's work: this message and what is queued already, within the turn's budget
            # (a queued message is received without yielding: without a budget a flood would
            # hold the loop for as long as it lasts).
            t0 = time.perf_counter()
            end = t0 + TURN_S
            self._one(received)
            for _ in range(TURN_MESSAGES - 1):
                if time.perf_counter() >= end:
                    break
                try:
                    received = sock.recv_multipart(zmq.NOBLOCK, copy=False).result()
                except zmq.Again:
                    break
                except Exception as e:
                    self._drop(MALFORMED, f"receive failed: {type(e).__name__}: {e}")
                    break
                self._one(received)
            pause = self._spent(t0, time.perf_counter())
            await asyncio.sleep(pause)  # 0: a turn for everyone else

    def _one(self, received: list[zmq.Frame]) -> None:
        try:
            source = _peer_host(received[-1])
            if self._over_rate(source):
                return
            self.handle_frames([f.bytes for f in received], source)
        except Exception as e:  # defensive: a bug here must not kill the loop either
            if self._log_limit.allow(time.monotonic()):
                log.exception("discovery handler failed: %s", e)

    def _over_rate(self, source: str | None) -> bool:
        """Count a message against its source host's budget for this second; True: over it
        (dropped undecoded, counted)."""
        now = time.monotonic()
        if now - self._window >= 1.0:
            self._window, self._busy = now, 0.0
            self._per_source.clear()
        n = self._per_source[source] = self._per_source[source] + 1
        limit = self.limits.max_source_rate
        if n <= limit:
            return False
        if n == limit + 1:  # said once per source and second (the log is rate-limited too)
            self._drop(RATE_LIMITED, f"source {source} over {limit} messages/s")
        else:
            self._counters[RATE_LIMITED].inc()
        return True

    def _spent(self, t0: float, t1: float) -> float:
        """Account a turn's work; how long to pause after it: 0, or (this second's share
        spent) until the next second."""
        self._busy += t1 - t0
        if self._busy < self.limits.cpu_share:
            return 0.0
        return max(0.0, self._window + 1.0 - time.monotonic())

    # ---------------------------------------------------------------- connections

    async def _connections_loop(self) -> None:
        """libzmq's accepted and closed connections: count them, shut down those past a cap."""
        assert self._monitor is not None
        monitor = self._monitor
        turn = 0
        while True:
            turn += 1
            if turn >= TURN_MESSAGES:
                turn = 0
                await asyncio.sleep(0)
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a monitor that failed must not stop discovery
                if self._log_limit.allow(time.monotonic()):
                    log.warning("discovery connection monitor: %s: %s", type(e).__name__, e)
                await asyncio.sleep(0.01)
                continue
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                host = self.connections.pop(fd, None)
                if host is not None:
                    self._per_host[host] -= 1
                    if self._per_host[host] <= 0:
                        del self._per_host[host]
            self.metrics.discovery_connections.set(len(self.connections))

    def max_connections(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft <= 0:
            return self.limits.max_connections
        return max(1, min(self.limits.max_connections, soft // 4))

    def _accepted(self, fd: int) -> None:
        try:  # our own descriptor of the connection: libzmq's stays libzmq's
            conn = socket.socket(fileno=os.dup(fd))
        except OSError:
            return  # closed already: its DISCONNECTED follows
        try:
            try:
                if conn.getsockname()[1] != self.port:
                    return  # the number was reused by something else meanwhile: not ours to judge
                host = str(conn.getpeername()[0])
            except (OSError, IndexError):
                return
            limits = self.limits
            reason = None
            if len(self.connections) >= self.max_connections():
                reason = "limit"
            elif self._per_host[host] >= limits.max_connections_per_source:
                reason = "source_limit"
            if reason is None:
                self.connections[fd] = host
                self._per_host[host] += 1
                return
            # Ends the connection for libzmq too (its read fails), whatever holds the descriptor.
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._conn_refused[reason].inc()
            if self._log_limit.allow(time.monotonic()):
                log.warning("discovery connection refused reason=%s source=%s held=%d from_source=%d "
                            "max=%d max_per_source=%d", reason, host, len(self.connections), self._per_host[host],
                            self.max_connections(), limits.max_connections_per_source)  # fmt: skip
        finally:
            conn.close()

    def handle_frames(self, frames: list[bytes], source: str | None = None) -> None:
        # ROUTER prepends the sender identity. DEALER senders send [payload]; REQ senders add an
        # empty delimiter frame. The payload is the last frame either way.
        if len(frames) < 2:
            self._drop(MALFORMED, f"expected identity and payload, got {len(frames)} frame(s)")
            return
        self.handle_message(frames[-1], source=source)

    def handle_message(
        self, payload: bytes, now: float | None = None, source: str | None = None
    ) -> None:
        """One discovery message. `source`: the host it came from (the TCP peer), which
        bounds registrations per source; None: unknown, bounded per role only."""
        now = time.time() if now is None else now
        try:
            reg = decode(payload, secret=self.secret, now=now)
        except ProtocolError as e:
            self._drop(e.reason, str(e))
            return
        if self.secret is not None:
            # decode() guarantees a signed message has a nonce and a ts in the window.
            assert reg.nonce is not None and reg.ts is not None
            why = self.replay_guard.check(reg.nonce, reg.ts, now)
            if why is not None:
                self._drop(REPLAYED, f"{why} (http_address={reg.http_address})")
                return
        try:
            if reg.leave:
                self.registry.leave(reg, source=source)
                self._counters["left"].inc()
                return
            self.registry.upsert(reg, source=source)
        except RegistrationRefused as e:
            self.metrics.discovery_refuse(reg.role, e.reason)
            self._drop("refused", f"{e.reason}: {e} (role={reg.role} "
                       f"http_address={reg.http_address} source={source})")  # fmt: skip
            return
        self._counters["accepted"].inc()

    def _drop(self, result: str, reason: str) -> None:
        self._counters[result].inc()
        if self._log_limit.allow(time.monotonic()):
            suppressed = self._log_limit.take_suppressed()
            log.warning(
                "discovery message dropped result=%s reason=%s suppressed_since_last=%d",
                result, reason, suppressed,
            )  # fmt: skip

    async def _sweep_loop(self) -> None:
        # Sweep often enough that expiry lands within ~1/5 of the timeout of being due.
        interval = min(1.0, self.registry.heartbeat_timeout / 5)
        while True:
            await asyncio.sleep(interval)
            try:
                self.registry.expire()
            except Exception as e:
                log.exception("expiry sweep failed: %s", e)


def _peer_host(frame: zmq.Frame) -> str | None:
    """The host of the TCP connection a message arrived on (libzmq's Peer-Address property).
    Unlike its ROUTER identity or the addresses it advertises, a sender cannot set this to an
    arbitrary value: only to an address of its own. None where the transport has none."""
    try:
        return frame.get("Peer-Address") or None
    except zmq.ZMQError:
        return None

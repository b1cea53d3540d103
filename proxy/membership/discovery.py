"""ZMQ discovery: a ROUTER socket that instances heartbeat to, plus the expiry sweep."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

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
RESULTS = ("accepted", "left", "refused", *DROP_REASONS)


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
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.host = host
        self.requested_port = port
        self.secret = secret
        self.port: int | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._log_limit = LogLimiter()
        self.replay_guard = ReplayGuard(window_s=MAX_CLOCK_SKEW_S)
        self._counters = {r: metrics.discovery.labels(r) for r in RESULTS}

    async def start(self) -> None:
        # A context of our own (not Context.instance()): several proxies may share a process.
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Oversized messages never reach us: ZMQ drops the sending peer's connection.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
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
                frames = [f.bytes for f in received]
                source = _peer_host(received[-1])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let one bad receive stop discovery
                self._drop(MALFORMED, f"receive failed: {type(e).__name__}: {e}")
                await asyncio.sleep(0.01)
                continue
            try:
                self.handle_frames(frames, source)
            except Exception as e:  # defensive: a bug here must not kill the loop either
                if self._log_limit.allow(time.monotonic()):
                    log.exception("discovery handler failed: %s", e)

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

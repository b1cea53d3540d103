"""ZMQ discovery: a ROUTER socket that instances heartbeat to, plus the expiry sweep."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from proxy.metrics import Metrics
from proxy.protocol import ProtocolError, decode
from proxy.registry import Registry

log = logging.getLogger("xpyd.proxy.discovery")

# Registrations are a few hundred bytes; refuse anything absurd before it is buffered.
MAX_MESSAGE_BYTES = 64 * 1024
# At most this many "dropped" warnings per window, so a flood cannot flood the log.
LOG_BURST = 10
LOG_WINDOW_S = 10.0


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
        self._log_window_start = 0.0
        self._log_count = 0
        self._counters = {
            r: metrics.discovery.labels(r)
            for r in ("accepted", "left", "malformed", "unauthorized")
        }

    async def start(self) -> None:
        # A context of our own (not Context.instance()): several proxies may share a process.
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
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
                frames = await sock.recv_multipart(copy=True)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let one bad receive stop discovery
                self._drop("malformed", f"receive failed: {type(e).__name__}: {e}")
                await asyncio.sleep(0.01)
                continue
            try:
                self.handle_frames(frames)
            except Exception as e:  # defensive: a bug here must not kill the loop either
                log.exception("discovery handler failed: %s", e)

    def handle_frames(self, frames: list[bytes]) -> None:
        # ROUTER prepends the sender identity. DEALER senders send [payload]; REQ senders add an
        # empty delimiter frame. The payload is the last frame either way.
        if len(frames) < 2:
            self._drop("malformed", f"expected identity and payload, got {len(frames)} frame(s)")
            return
        self.handle_message(frames[-1])

    def handle_message(self, payload: bytes) -> None:
        try:
            reg = decode(payload)
        except ProtocolError as e:
            self._drop("malformed", str(e))
            return
        if self.secret is not None:
            try:
                reg = decode(payload, secret=self.secret)
            except ProtocolError as e:
                self._drop("unauthorized", f"{e} (http={reg.http_address})")
                return
        if reg.leave:
            self.registry.remove(reg.role, reg.http_address, "leave")
            self._counters["left"].inc()
            return
        self.registry.upsert(reg)
        self._counters["accepted"].inc()

    def _drop(self, result: str, reason: str) -> None:
        self._counters[result].inc()
        now = time.monotonic()
        if now - self._log_window_start > LOG_WINDOW_S:
            self._log_window_start = now
            self._log_count = 0
        self._log_count += 1
        if self._log_count <= LOG_BURST:
            log.warning("discovery message dropped result=%s reason=%s", result, reason)

    async def _sweep_loop(self) -> None:
        # Sweep often enough that expiry lands within ~1/5 of the timeout of being due.
        interval = min(1.0, self.registry.heartbeat_timeout / 5)
        while True:
            await asyncio.sleep(interval)
            try:
                self.registry.expire()
            except Exception as e:
                log.exception("expiry sweep failed: %s", e)

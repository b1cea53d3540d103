"""A minimal pooled HTTP/1.1 client for talking to vLLM instances.

Why not aiohttp/httpx: on the proxy's hot path the general-purpose clients spend more CPU
building request/response objects (cookies, multidicts, tracing hooks, payload registries)
than the proxy spends on everything else. Measured with scripts/bench_proxy.py on 2 cores,
the proxy's CPU per request is about half of what it is with aiohttp, and 10-100x lower
than with httpx (whose pool degrades with concurrency). This client does
one thing: POST/GET a body over a pooled keep-alive connection and hand back the status,
the content type and the body as it arrives, parsed by httptools (the C parser uvicorn
uses). Instances are plain-HTTP vLLM servers on a trusted network: no TLS, no redirects,
no cookies, no compression.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping

import httptools

from proxy.upstream.base import KEEPALIVE_S, UpstreamError, too_large

# Pause reading from an instance when this much body is buffered but not yet relayed
# (a slow client must slow the instance down, not grow the proxy's memory).
HIGH_WATER = 256 * 1024
# A response head (status line and headers) larger than this is refused: httptools would
# otherwise grow one header without bound. vLLM's heads are a few hundred bytes.
MAX_HEAD = 64 * 1024


class _Conn(asyncio.Protocol):
    """One keep-alive connection; carries one request/response at a time."""

    __slots__ = (
        "pool", "loop", "transport", "parser", "lost", "active", "idle_since", "status",
        "content_type", "head_done", "complete", "keep_alive", "error", "buf", "buffered",
        "paused", "waiter", "sized", "got_data", "length", "head_bytes", "on_body", "body_end",
    )  # fmt: skip

    def __init__(self, pool: _Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.active = False
        self.idle_since = 0.0
        self.waiter: asyncio.Future | None = None
        # The parser hands each body piece (a stream's every chunk) straight to the list:
        # a C call, not a Python one per chunk. The list is never replaced.
        self.buf: list[bytes] = []
        self.on_body = self.buf.append
        self._reset()

    def _reset(self, parser: bool = True) -> None:
        # A pooled connection's parser is left between messages (its last exchange was
        # complete and kept alive): it reads the next response as it is.
        if parser:
            self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.content_type = "application/json"
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.sized = False  # Content-Length or chunked: the body end is known
        self.length = -1  # Content-Length, -1 when not given
        self.head_bytes = 0  # bytes received before the head was complete
        self.got_data = False  # any byte of this exchange's response arrived
        self.error: UpstreamError | None = None
        self.buf.clear()
        self.buffered = 0  # bytes in buf
        self.body_end = -1  # len(buf) when the answer ended within the read being parsed
        self.paused = False

    # -- asyncio.Protocol

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.active:  # nothing is expected on an idle connection: drop it
            self.transport.close()
            return
        self.got_data = True
        buf = self.buf
        before = len(buf)
        stray = self.complete  # the answer is all in: nothing this read holds is part of it
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError("protocol", f"bad HTTP response: {e}"))
            self.transport.close()
            return
        if stray:
            del buf[before:]
        elif self.body_end >= 0:  # the answer ended in this read: what followed is not its
            del buf[self.body_end :]
            self.body_end = -1
        n = len(buf)
        if n > before:
            self.buffered += len(buf[before]) if n == before + 1 else sum(map(len, buf[before:]))
            if self.buffered > HIGH_WATER and not self.paused:
                self.paused = True
                self.transport.pause_reading()
        if not self.head_done:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD:
                self._fail(UpstreamError("protocol", f"response head larger than {MAX_HEAD} bytes"))
                self.transport.close()
                return
        # Once per read, not per parser callback: a stream's read often holds a dozen
        # chunks, each an on_body.
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        if self.active and not self.complete:
            if self.head_done and not self.sized and exc is None:
                self.complete = True  # a body delimited by the connection closing
                self._wake()
            elif self.head_done and not self.sized:
                # A reset is no end of a close-delimited body: the rest may be missing.
                self._fail(UpstreamError("disconnect", f"connection reset before the body's end: {exc}"))
            else:
                reason = f": {exc}" if exc else ""
                self._fail(UpstreamError("disconnect", f"instance closed the connection{reason}"))

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            # Bytes past the end of the answer: never pooled (the parser, kept for the next
            # exchange, would be inside this stray message).
            self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        if lname == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lname == b"content-length":
            self.sized = True
            if value.strip().isdigit():  # llhttp rejects any other form
                self.length = int(value)
        elif lname == b"transfer-encoding" and b"chunked" in value.lower():
            self.sized = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status in (204, 304):
            self.sized = True
        self.head_done = True  # data_received wakes the waiter (as for the two below)

    def on_message_complete(self) -> None:
        if self.complete:
            return  # a stray message after the answer (on_message_begin refused it)
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self.body_end = len(self.buf)

    # -- helpers

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    async def wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take(self) -> bytes:
        buf = self.buf
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        self.buffered = 0
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        return data


class NativeResponse:
    __slots__ = ("_conn", "_limit", "status", "content_type")

    def __init__(self, conn: _Conn, limit: int) -> None:
        self._conn: _Conn | None = conn
        self._limit = limit
        self.status = conn.status
        self.content_type = conn.content_type

    async def read(self, limit: int | None = None) -> bytes:
        conn = self._conn
        assert conn is not None, "response already closed"
        if limit is None:
            limit = self._limit
        if conn.length > limit:  # refused on its Content-Length, before reading any of it
            raise _too_large(conn, limit, f"announced {conn.length} bytes")
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            if conn.buffered > limit:  # at most one socket read past the limit is held
                raise _too_large(conn, limit, "more arrived")
            if conn.paused:  # read() wants everything: no backpressure here
                conn.paused = False
                conn.transport.resume_reading()
            await conn.wait()
        if conn.buffered > limit:
            raise _too_large(conn, limit, f"sent {conn.buffered} bytes")
        return conn.take() if conn.buf else b""

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; each item is all that was buffered at that moment."""
        conn = self._conn
        assert conn is not None, "response already closed"
        return _Chunks(conn)

    def at_eof(self) -> bool:
        conn = self._conn
        return conn is None or (conn.complete and not conn.buf)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.active = False
        if conn.complete and conn.keep_alive and not conn.lost and conn.error is None:
            conn.pool.release(conn)
        elif not conn.lost:
            # Unfinished: closing the connection is how vLLM learns to abort the request.
            conn.transport.close()


class _Chunks:
    """NativeResponse.chunks(): an iterator object rather than an async generator, which
    the event loop's hooks would track (a WeakSet entry per response)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        while True:
            if conn.buf:
                return conn.take()
            if conn.complete:
                raise StopAsyncIteration
            if conn.error is not None:
                raise conn.error
            await conn.wait()


def _too_large(conn: _Conn, limit: int, what: str) -> UpstreamError:
    """Give up on an answer over the limit: drop what is buffered and the connection."""
    error = too_large(limit, what)
    conn._fail(error)
    conn.buf.clear()
    conn.buffered = 0
    if not conn.lost:
        conn.transport.close()
    return error


class _Pool:
    """Idle keep-alive connections to one host:port, most recently used first."""

    __slots__ = ("host", "port", "hostport", "idle", "all")

    def __init__(self, hostport: str) -> None:
        host, _, port = hostport.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self.hostport = hostport
        self.idle: list[_Conn] = []
        self.all: set[_Conn] = set()

    def acquire(self, now: float) -> _Conn | None:
        idle = self.idle
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.transport.close()
        return None

    def release(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def forget(self, conn: _Conn) -> None:
        self.all.discard(conn)
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def close(self) -> None:
        for conn in list(self.all):
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


class NativeUpstream:
    def __init__(self, connect_timeout: float, max_response_bytes: int) -> None:
        self.connect_timeout = connect_timeout
        self.max_response_bytes = max_response_bytes
        self._pools: dict[str, _Pool] = {}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    async def _connect(self, pool: _Pool) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Conn(pool, loop), pool.host, pool.port)
        except TimeoutError:
            raise UpstreamError("connect_timeout", f"connect to {pool.hostport} timed out") from None
        except OSError as e:
            raise UpstreamError("connect", f"cannot connect to {pool.hostport}: {e}") from None
        pool.all.add(conn)
        return conn

    async def request(self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]) -> NativeResponse:
        # url is "http://host:port/path" (instances are always plain HTTP).
        rest = url[7:] if url.startswith("http://") else url
        slash = rest.find("/")
        hostport, path = (rest, "/") if slash < 0 else (rest[:slash], rest[slash:])
        pool = self._pools.get(hostport)
        if pool is None:
            pool = self._pools[hostport] = _Pool(hostport)
        conn = pool.acquire(time.monotonic())
        if conn is None:
            try:
                conn = await self._connect(pool)
            except UpstreamError:
                # Keep no pool for an address that never connected: discovery lets anyone
                # advertise addresses, and the join probe asks each one.
                if not pool.all and self._pools.get(hostport) is pool:
                    del self._pools[hostport]
                raise
            return await self._exchange(conn, method, path, body, headers)
        try:
            return await self._exchange(conn, method, path, body, headers)
        except UpstreamError as e:
            if e.kind != "disconnect" or conn.got_data:
                raise
        # The instance closed (or reset) the pooled connection as we reused it, before a
        # byte of answer: a stale keep-alive, which a fresh connection gets past. Once only.
        return await self._exchange(await self._connect(pool), method, path, body, headers)

    async def _exchange(
        self, conn: _Conn, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> NativeResponse:
        """Send one request on `conn` and wait for the head of its response."""
        conn._reset(parser=False)  # fresh, or pooled after a complete exchange
        conn.active = True
        hostport = conn.pool.hostport
        parts = [f"{method} {path} HTTP/1.1\r\nhost: {hostport}\r\n"]
        for k, v in headers.items():
            parts.append(f"{k}: {v}\r\n")
        if body is not None:
            parts.append(f"content-length: {len(body)}\r\n\r\n")
            conn.transport.write("".join(parts).encode("latin-1") + body)
        else:
            parts.append("\r\n")
            conn.transport.write("".join(parts).encode("latin-1"))
        try:
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            conn.active = False
            if not conn.lost:
                conn.transport.close()
            raise
        return NativeResponse(conn, self.max_response_bytes)

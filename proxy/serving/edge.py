"""The HTTP edge: what a client connection may cost before the app sees its request.

uvicorn's default parser (httptools) has no limit on a request's head, and uvicorn has no
deadline before a request's headers are in nor while its body arrives: one connection
growing one header, or thousands trickling bytes or saying nothing, hold memory and file
descriptors without end. Here, per connection, before any authentication:

* request line + headers over `max_header_bytes`: 431 (a head that arrives in one read too:
  the parser is fed no more than the limit while a head is open);
* headers not complete `header_timeout` s after the connection opened (or after the
  request's first byte on a kept-alive connection): 408;
* a body not complete `body_timeout` s after its headers (a Content-Length larger than
  what is sent): 408, and the app sees the client leave;
* over `max_connections` open at once: the new one gets 503 (logged, counted);
* a request the parser refuses (e.g. a Content-Length shorter than the body): 400.

Every refusal is OpenAI error JSON, then the connection closes (after a short lingering
close, so that the client can read it while still sending); each is counted in
`xpyd_http_refused{reason}`. Enforced cheaply: bytes are counted only while a head is
read, phases are stamped with a clock the sweep keeps (no system call, no timer per
request), and one sweep per interval walks the open connections while there are any: a
deadline is enforced between its value and that plus two intervals (at most 2 s).
"""

from __future__ import annotations

import asyncio
import http
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.errors import error_body

log = logging.getLogger("xpyd.proxy.edge")

# What a connection waits for: a request's head, the rest of a body, or (refused) its
# lingering close: what the client still sends is read and dropped until the next sweep,
# so that closing with unread bytes (a TCP reset) does not destroy the refusal in flight.
HEAD, BODY, LINGER = 0, 1, 2
_LOG_EVERY_S = 10.0  # refusals of one reason are logged at most this often


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    max_header_bytes: int = 32 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections: int = 4096


def refusal(status: int, message: str, code: str) -> bytes:
    """A complete HTTP response refusing a request: OpenAI error JSON, connection closed."""
    body = error_body(message, status, code)
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return head % (status, http.HTTPStatus(status).phrase.encode(), len(body)) + body


def fd_capped(max_connections: int) -> int:
    """At most half the process's file-descriptor limit: the rest stays for the upstream
    connections, discovery and KV-event sockets (accept() failing on EMFILE is silent)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return max_connections
    return max(1, min(max_connections, soft // 2))


class Edge:
    """One server's limits, the sweep over its open connections, and refusal accounting."""

    def __init__(self, limits: EdgeLimits, on_refuse: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self.max_connections = fd_capped(limits.max_connections)
        self.interval = min(1.0, limits.header_timeout / 4, limits.body_timeout / 4)
        self.now = 0.0  # the loop's clock as of the last sweep (or the sweep's start)
        self._on_refuse = on_refuse
        self._sweep: asyncio.TimerHandle | None = None
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last logged, since then)

    def watch(self, loop: asyncio.AbstractEventLoop, connections: set[Any]) -> None:
        """Make sure a sweep runs while `connections` (uvicorn's open ones) is not empty."""
        if self._sweep is None:
            self.now = loop.time()
            self._sweep = loop.call_later(self.interval, self._run, loop, connections)

    def stop(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def _run(self, loop: asyncio.AbstractEventLoop, connections: set[Any]) -> None:
        self.now = now = loop.time()
        for conn in list(connections):
            check = getattr(conn, "edge_check", None)  # a WebSocket protocol has none
            if check is not None:
                check(now)
        self._sweep = loop.call_later(self.interval, self._run, loop, connections) if connections else None

    def refused(self, reason: str, peer: Any) -> None:
        if self._on_refuse is not None:
            self._on_refuse(reason)
        now = self.now
        last, count = self._logged.get(reason, (-_LOG_EVERY_S, 0))
        if now - last < _LOG_EVERY_S:
            self._logged[reason] = (last, count + 1)
            return
        self._logged[reason] = (now, 0)
        level = logging.WARNING if reason == "connection_limit" else logging.INFO
        log.log(level, "http edge refused reason=%s client=%s max_connections=%d "
                "max_header_bytes=%d header_timeout=%s body_timeout=%s refused_since_last_log=%d",
                reason, peer, self.max_connections, self.limits.max_header_bytes,
                self.limits.header_timeout, self.limits.body_timeout, count)  # fmt: skip


def guarded_protocol(base: type[asyncio.Protocol], edge: Edge, h11_parser: bool) -> type[asyncio.Protocol]:
    """uvicorn's protocol class `base` with the edge's limits (see the module docstring)."""
    limits = edge.limits
    max_head = limits.max_header_bytes
    if h11_parser:
        import h11

        h11_body, h11_head = h11.SEND_BODY, h11.IDLE

    class Guarded(base):  # type: ignore[misc,valid-type]
        # What the connection waits for, since when (edge.now; None: nothing, e.g. while
        # the app answers), and the head bytes received so far.
        _edge_phase = HEAD
        _edge_since: float | None = None
        _edge_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            edge.watch(self.loop, self.connections)
            self._edge_since = edge.now
            if len(self.connections) > edge.max_connections:
                message = f"the proxy holds its maximum of {edge.max_connections} client connections; retry later"
                # No lingering here: under a flood that would hold more descriptors.
                self.edge_refuse(503, message, "too_many_connections", "connection_limit", linger=False)

        def data_received(self, data: bytes) -> None:
            if self._edge_phase != HEAD:
                if self._edge_phase == LINGER:
                    return  # refused: dropped
                super().data_received(data)
                if h11_parser:
                    self._h11_phase()
                return
            if self._edge_since is None:  # a kept-alive connection's next request begins
                self._edge_since = edge.now
            room = max_head - self._edge_bytes
            if len(data) > room:
                # The parser would finish a head that arrived whole (and reset the count)
                # before any check: it gets no more than the limit while the head is open.
                self._edge_bytes = max_head
                super().data_received(data[:room])
                if h11_parser:
                    self._h11_phase()
                if self._edge_phase == HEAD and self._edge_bytes == max_head:  # the head goes on
                    if not self.transport.is_closing():
                        self._head_too_large()
                    return
                if self._edge_phase != LINGER and not self.transport.is_closing():
                    self.data_received(data[room:])  # the rest, in whatever phase is now
                return
            self._edge_bytes += len(data)
            super().data_received(data)
            if h11_parser:
                self._h11_phase()

        # httptools' parser callbacks: a head complete, a message complete.
        def on_headers_complete(self) -> None:
            if self._edge_phase != LINGER:
                self._edge_phase, self._edge_since = BODY, edge.now
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            if self._edge_phase != LINGER:
                self._edge_phase, self._edge_since, self._edge_bytes = HEAD, None, 0
            super().on_message_complete()

        def _h11_phase(self) -> None:
            if self._edge_phase == LINGER:
                return
            state = self.conn.their_state
            if state is h11_body:
                if self._edge_phase == HEAD:
                    self._edge_phase, self._edge_since = BODY, edge.now
            elif state is not h11_head or self._edge_phase == BODY:
                # The request is in (DONE), or the connection is ending: nothing awaited.
                self._edge_phase, self._edge_since, self._edge_bytes = HEAD, None, 0

        def _head_too_large(self) -> None:
            message = f"request line and headers exceed {max_head} bytes"
            self.edge_refuse(431, message, "request_header_fields_too_large", "headers_too_large")

        def send_400_response(self, msg: str) -> None:
            # uvicorn's plain-text answer to what the parser refuses; h11 refuses a head
            # over its own limit (set to max_header_bytes) this way too.
            if self._edge_bytes > max_head and self._edge_phase == HEAD:
                self._head_too_large()
                return
            self.edge_refuse(400, "invalid HTTP request", "invalid_http_request", "bad_request")

        def edge_check(self, now: float) -> None:
            """The sweep: refuse a head or a body that took too long."""
            since = self._edge_since
            if since is None or self.transport.is_closing():
                return
            if self._edge_phase == LINGER:
                if now > since:  # at the first sweep after the refusal (<= one interval)
                    self.transport.close()
                return
            # `since` is the sweep's clock, up to one interval behind: never cut early.
            waited = now - since - edge.interval
            if self._edge_phase == HEAD:
                if waited > limits.header_timeout:
                    message = f"request headers not received within {limits.header_timeout} s"
                    self.edge_refuse(408, message, "request_timeout", "header_timeout")
            elif waited > limits.body_timeout:
                message = f"request body not received within {limits.body_timeout} s"
                self.edge_refuse(408, message, "request_timeout", "body_timeout")

        def edge_refuse(self, status: int, message: str, code: str, reason: str, linger: bool = True) -> None:
            transport = self.transport
            if transport.is_closing() or self._edge_phase == LINGER:
                return
            edge.refused(reason, self.client)
            self._edge_phase, self._edge_since = LINGER, edge.now
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                # The app, if it is reading the body, sees the client leave now; what it
                # would still send is dropped (uvicorn's disconnected cycle).
                cycle.disconnected = True
                cycle.message_event.set()
                lost = getattr(self, "client_lost", None)  # the corked protocol's watch
                if lost is not None:
                    lost()
                if cycle.response_started:  # mid-response: only the close can tell
                    transport.close()
                    return
            transport.write(refusal(status, message, code))
            flush = getattr(transport, "flush", None)  # the corked transport's held bytes
            if flush is not None:
                flush()
            if linger and transport.can_write_eof():
                transport.write_eof()  # the answer, then FIN; the sweep closes it
            else:
                transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded

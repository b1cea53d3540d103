"""Client connections whose writes of one loop turn leave in one system call.

uvicorn writes a response's status line and headers as soon as the app starts the response,
then each body piece as it is sent: a streamed answer whose first piece is already in hand
(the proxy's usual case: P's token, or D's first bytes) costs one ``send`` for the headers
and one for the piece. On loopback a ``send`` is the largest single cost of a proxied
request (profile in the README), so the client transport here holds what is written until
the current loop turn ends and hands it over with one ``writelines`` (one ``writev``, no
copy). Nothing waits longer than the turn that wrote it: the flush is the next ready
callback, before the loop polls for I/O. An app that is about to spend the rest of the
turn on other work (the proxy building D's request after P's token) can send what is held
now: each request's ``scope["state"][FLUSH]`` (ASGI has no message for it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from proxy.serving.edge import Edge, guarded_protocol

FLUSH = "xpyd.flush"  # scope["state"] key: a callable that sends what the connection holds
# scope["state"] key: watch(on_lost) calls on_lost() once if the client leaves (at once if it
# has left); it returns the function that stops watching. ASGI says so only through
# receive(), which a request must then keep a task waiting on, a task per request.
WATCH = "xpyd.watch"


class CorkedTransport:
    """A transport whose ``write`` calls of one loop turn are sent together; everything
    else is the wrapped transport's."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Send what is held now (also the turn's end callback: then often nothing)."""
        held, self._held = self._held, []
        if not held or self._transport.is_closing():
            return  # the client is gone: what it would have got goes nowhere, as before
        if len(held) == 1:
            self._transport.write(held[0])
        else:
            self._transport.writelines(held)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self.flush()  # what was written before close() is sent, as transports promise
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _nothing() -> None:
    pass


def corked_protocol(http: str, edge: Edge | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class ``http`` (auto, httptools, h11), whose connections
    write through a CorkedTransport (and, with `edge`, keep its limits: proxy/serving/edge.py)."""
    base: Any = import_from_string(HTTP_PROTOCOLS[http])
    if edge is not None:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = guarded_protocol(base, edge, issubclass(base, H11Protocol))

    class Corked(base):  # type: ignore[misc,valid-type]
        _on_lost: Callable[[], None] | None = None
        _gone = False  # the client left (or was refused mid-request)

        def connection_made(self, transport: asyncio.Transport) -> None:
            corked = CorkedTransport(transport, asyncio.get_running_loop())
            super().connection_made(corked)
            # Every request's scope["state"] is a copy of app_state (both parsers): this
            # connection's requests find its flush and watch there.
            self.app_state = {**self.app_state, FLUSH: corked.flush, WATCH: self.watch_client}

        def watch_client(self, on_lost: Callable[[], None]) -> Callable[[], None]:
            if self._gone:
                on_lost()
                return _nothing
            self._on_lost = on_lost
            # As uvicorn's receive() does while it waits: reading may be paused (a large
            # body), and the client's leaving is only seen by reading.
            if self.flow is not None:
                self.flow.resume_reading()

            def unwatch() -> None:
                if self._on_lost is on_lost:  # not the next request's (pipelining)
                    self._on_lost = None

            return unwatch

        def client_lost(self) -> None:
            self._gone = True
            on_lost, self._on_lost = self._on_lost, None
            if on_lost is not None:
                on_lost()

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            self.client_lost()

    Corked.__name__ = Corked.__qualname__ = f"Corked{base.__name__}"
    return Corked

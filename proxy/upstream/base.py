"""The interface the router uses to talk to P/D instances, and its implementations.

"native" (proxy/upstream/httpclient.py, the default) is a minimal pooled HTTP/1.1 client on asyncio
+ httptools; "aiohttp" and "httpx" wrap those libraries (imported only when chosen). All
keep pooled keep-alive connections and close the connection when a response is abandoned,
which is how vLLM learns that a request was cancelled (it aborts it on disconnect).

All three end a body the same way: complete at its Content-Length, at its last chunk, or
(neither given) at a clean close of the connection. A body cut short, a chunked body without
its last chunk, and a close-delimited body ended by a reset are errors ("disconnect"), never
a complete answer. read() buffers at most max_response_bytes ("too_large" past it, refused
up front on a larger Content-Length); chunks() hands over each piece as it arrives and is
not bounded in total (a stream's pieces are, by the socket reads).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

# Below uvicorn's default keep-alive (5 s): reusing a connection the server is about to
# close would fail a request that never reached it.
KEEPALIVE_S = 4.0


class UpstreamError(Exception):
    """A failed upstream call. kind: connect (refused/unreachable, safe to retry),
    connect_timeout, disconnect (dropped before/while answering, or the body cut short),
    protocol (not HTTP, or a head over the size limit), too_large (read() past its limit;
    the connection is closed)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UpstreamResponse(Protocol):
    status: int
    content_type: str

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body, at most `limit` bytes (None: the client's max_response_bytes)."""
        ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def at_eof(self) -> bool:
        """True when the whole body has arrived and been handed out (False if unknown)."""
        ...

    async def aclose(self) -> None:
        """Release the response; an unread one closes its connection (upstream aborts)."""
        ...


class Upstream(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def request(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]
    ) -> UpstreamResponse: ...


def too_large(limit: int, what: str) -> UpstreamError:
    return UpstreamError("too_large", f"answer larger than {limit} bytes ({what})")


async def read_limited(pieces: AsyncIterator[bytes], announced: int | None, limit: int) -> bytes:
    """A whole body from its pieces as they arrive, refused (too_large) past `limit` bytes:
    up front when the announced length says so, else once the count passes it."""
    if announced is not None and announced > limit:
        raise too_large(limit, f"announced {announced} bytes")
    parts: list[bytes] = []
    size = 0
    async for chunk in pieces:
        size += len(chunk)
        if size > limit:
            raise too_large(limit, "more arrived")
        parts.append(chunk)
    return b"".join(parts)

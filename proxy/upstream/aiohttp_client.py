"""Upstream client on aiohttp (--upstream-client aiohttp); see proxy/upstream/base.py."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Mapping

import aiohttp
from aiohttp.client_proto import ResponseHandler

from proxy.upstream.base import KEEPALIVE_S, UpstreamError, read_limited


class _Handler(ResponseHandler):
    """aiohttp ends a body delimited by the connection closing at any close, a reset too
    (3.14): here a reset before a body's end fails that body, as in the other clients."""

    def connection_lost(self, exc: BaseException | None) -> None:
        payload = self._payload
        if exc is not None and payload is not None and not payload.is_eof():
            payload.set_exception(
                aiohttp.ClientPayloadError(f"connection reset before the body's end: {exc!r}")
            )
        super().connection_lost(exc)


class _AiohttpResponse:
    __slots__ = ("_resp", "_limit", "status", "content_type")

    def __init__(self, resp, limit: int) -> None:
        self._resp = resp
        self._limit = limit
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", "application/json")

    async def read(self, limit: int | None = None) -> bytes:
        try:
            return await read_limited(self.chunks(), self._resp.content_length,
                                      self._limit if limit is None else limit)
        except UpstreamError:
            self._resp.close()  # unread (over the limit, or broken): drop the connection
            raise

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._resp.content
        try:
            # readany() hands over whatever has arrived: fewer, larger relays under load.
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientError, ConnectionError) as e:
            raise UpstreamError("disconnect", f"{type(e).__name__}: {e}") from None

    def at_eof(self) -> bool:
        return self._resp.content.at_eof()

    async def aclose(self) -> None:
        resp = self._resp
        if resp.content.is_eof():
            resp.release()
        else:
            resp.close()


class AiohttpUpstream:
    def __init__(self, connect_timeout: float, max_response_bytes: int) -> None:
        self.connect_timeout = connect_timeout
        self.max_response_bytes = max_response_bytes
        self._session = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # the instances apply their own admission control
            keepalive_timeout=KEEPALIVE_S,
            use_dns_cache=True,
            ttl_dns_cache=10,
        )
        # No public hook for the protocol class; tests/unit/test_proxy_clients.py fails if
        # this stops taking effect.
        connector._factory = functools.partial(_Handler, loop=asyncio.get_running_loop())
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.connect_timeout, connect=self.connect_timeout
            ),
            auto_decompress=False,  # relay bytes as the instance sent them
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            trust_env=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]
    ) -> _AiohttpResponse:
        assert self._session is not None, "upstream client not started"
        try:
            resp = await self._session.request(method, url, data=body, headers=headers)
        except aiohttp.ClientConnectorError as e:
            raise UpstreamError("connect", f"{type(e).__name__}: {e}") from None
        except aiohttp.ServerTimeoutError as e:  # only sock_connect/connect are set
            raise UpstreamError("connect_timeout", f"connect timed out: {e}") from None
        except (aiohttp.ClientError, ConnectionError) as e:
            raise UpstreamError("disconnect", f"{type(e).__name__}: {e}") from None
        return _AiohttpResponse(resp, self.max_response_bytes)

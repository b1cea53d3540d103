"""Upstream client on aiohttp (--upstream-client aiohttp); see proxy/upstream.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import aiohttp

from proxy.upstream import KEEPALIVE_S, UpstreamError


class _AiohttpResponse:
    __slots__ = ("_resp", "status", "content_type")

    def __init__(self, resp) -> None:
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", "application/json")

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, ConnectionError) as e:
            raise UpstreamError("disconnect", f"{type(e).__name__}: {e}") from None

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
    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self._session = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # the instances apply their own admission control
            keepalive_timeout=KEEPALIVE_S,
            use_dns_cache=True,
            ttl_dns_cache=10,
        )
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
        return _AiohttpResponse(resp)

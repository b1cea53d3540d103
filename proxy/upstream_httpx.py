"""Upstream client on httpx (--upstream-client httpx); see proxy/upstream.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import httpx

from proxy.upstream import KEEPALIVE_S, UpstreamError


class _HttpxResponse:
    __slots__ = ("_resp", "status", "content_type")

    def __init__(self, resp) -> None:
        self._resp = resp
        self.status = resp.status_code
        self.content_type = resp.headers.get("content-type", "application/json")

    async def read(self) -> bytes:
        try:
            return await self._resp.aread()
        except httpx.HTTPError as e:
            raise UpstreamError("disconnect", f"{type(e).__name__}: {e}") from None
        finally:
            await self._resp.aclose()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_raw():
                if chunk:
                    yield chunk
        except httpx.HTTPError as e:
            raise UpstreamError("disconnect", f"{type(e).__name__}: {e}") from None

    def at_eof(self) -> bool:
        return False  # not cheaply known: the stream ends with an empty final send

    async def aclose(self) -> None:
        await self._resp.aclose()


class HttpxUpstream:
    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self._client = None

    async def start(self) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.connect_timeout),
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S
            ),
            trust_env=False,
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def request(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]
    ) -> _HttpxResponse:
        assert self._client is not None, "upstream client not started"
        req = self._client.build_request(method, url, content=body, headers=headers)
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.ConnectTimeout as e:
            raise UpstreamError("connect_timeout", f"connect timed out: {e}") from None
        except httpx.ConnectError as e:
            raise UpstreamError("connect", f"{type(e).__name__}: {e}") from None
        except httpx.HTTPError as e:
            raise UpstreamError("disconnect", f"{type(e).__name__}: {e}") from None
        return _HttpxResponse(resp)

"""Upstream client on httpx (--upstream-client httpx); see proxy/upstream/base.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import httpx

from proxy.upstream.base import KEEPALIVE_S, UpstreamError, read_limited


def _why(e: BaseException) -> str:
    # httpx.ReadError from a reset has no text: the OS error a few causes down has.
    cause: BaseException | None = e
    text = ""
    for _ in range(8):
        if cause is None or text:
            break
        text = str(cause)
        cause = cause.__cause__ or cause.__context__
    return f"{type(e).__name__}: {text}"


class _HttpxResponse:
    __slots__ = ("_resp", "_limit", "status", "content_type")

    def __init__(self, resp, limit: int) -> None:
        self._resp = resp
        self._limit = limit
        self.status = resp.status_code
        self.content_type = resp.headers.get("content-type", "application/json")

    async def read(self, limit: int | None = None) -> bytes:
        length = self._resp.headers.get("content-length", "")
        try:
            # chunks() relays raw bytes, as the other clients do (and the limit is on what
            # arrives, not on what a compressed body would expand to).
            return await read_limited(self.chunks(), int(length) if length.isdigit() else None,
                                      self._limit if limit is None else limit)
        finally:
            await self._resp.aclose()  # unread (over the limit): closes the connection

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_raw():
                if chunk:
                    yield chunk
        except httpx.HTTPError as e:
            raise UpstreamError("disconnect", _why(e)) from None

    def at_eof(self) -> bool:
        return False  # not cheaply known: the stream ends with an empty final send

    async def aclose(self) -> None:
        await self._resp.aclose()


class HttpxUpstream:
    def __init__(self, connect_timeout: float, max_response_bytes: int) -> None:
        self.connect_timeout = connect_timeout
        self.max_response_bytes = max_response_bytes
        self._client = None

    async def start(self) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.connect_timeout),
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S
            ),
            trust_env=False,
            # Bodies are relayed as they arrive, undecoded (as with the other clients).
            headers={"accept-encoding": "identity"},
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
            raise UpstreamError("connect", _why(e)) from None
        except httpx.HTTPError as e:
            raise UpstreamError("disconnect", _why(e)) from None
        return _HttpxResponse(resp, self.max_response_bytes)

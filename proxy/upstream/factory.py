"""The upstream client --upstream-client names: "native" (httpclient.py, the default), or the
aiohttp/httpx wrappers, imported only when chosen (their libraries are not needed otherwise).

The clients import only base.py (the interface), never this: no import circle."""

from __future__ import annotations

from proxy.upstream.base import Upstream
from proxy.upstream.httpclient import NativeUpstream


def make_upstream(kind: str, connect_timeout: float, max_response_bytes: int) -> Upstream:
    if kind == "native":
        return NativeUpstream(connect_timeout, max_response_bytes)
    if kind == "aiohttp":
        from proxy.upstream.aiohttp_client import AiohttpUpstream

        return AiohttpUpstream(connect_timeout, max_response_bytes)
    if kind == "httpx":
        from proxy.upstream.httpx_client import HttpxUpstream

        return HttpxUpstream(connect_timeout, max_response_bytes)
    raise ValueError(f"unknown upstream client {kind!r}")

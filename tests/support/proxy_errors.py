"""Helpers of tests/unit/test_proxy_failures.py that other tests use too (moved from it)."""

from __future__ import annotations

import asyncio
import json


def assert_error(resp, status: int, code=None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


async def open_raw(px, path: str, body: dict):
    """A raw client connection with one request sent, for disconnect tests."""
    host, port = px.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return reader, writer

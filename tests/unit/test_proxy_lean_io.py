"""The proxy's per-request I/O, made leaner without losing a guarantee: a client leaving is
told by its connection (no watcher task per request), and pooled upstream connections
keep their parser between answers."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy.upstream.httpclient import NativeUpstream
from tests.support.proxy_errors import open_raw
from tests.support.proxy_helpers import Fault, running_proxy, wait_until
from tests.support.raw_server import RawServer, read_request

COMPLETION = {"model": "fake-model", "prompt": "Hello", "max_tokens": 5}


def _watchers() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__name__", "") == "watch_disconnect"]


async def test_a_request_waiting_on_p_has_no_watcher_task_and_a_client_leaving_still_aborts_it():
    async with running_proxy() as px:
        p, d = await px.pd()
        p.fault = Fault(hang=True)
        reader, writer = await open_raw(px, "/v1/completions", COMPLETION)
        await wait_until(lambda: p.completions(), what="P got the prefill")
        assert _watchers() == []  # the connection tells of the client leaving
        writer.close()
        await wait_until(lambda: p.completions()[0].cancelled, what="P saw the abort")
        await asyncio.sleep(0.05)  # a proxy that missed the leaving would now ask D
        assert not d.completions()
        assert await px.metric("xpyd_client_disconnects_total") == 1


async def test_a_client_leaving_after_a_large_body_is_seen():
    """uvicorn stops reading a connection whose body passed 64 KiB; its close is only seen
    if reading resumes once the body is in (as uvicorn's receive() did for the watcher)."""
    async with running_proxy() as px:
        p, d = await px.pd()
        p.fault = Fault(hang=True)
        reader, writer = await open_raw(px, "/v1/completions", {**COMPLETION, "prompt": "x" * 200_000})
        await wait_until(lambda: p.completions(), what="P got the prefill")
        writer.close()
        await wait_until(lambda: p.completions()[0].cancelled, what="P saw the abort")
        assert not d.completions()


async def test_each_request_of_a_kept_alive_connection_is_watched_on_its_own():
    """The first request's end stops its own watch only: the second, on the same
    connection, is still aborted when the client leaves."""
    async with running_proxy() as px:
        p, d = await px.pd()
        reader, writer = await open_raw(px, "/v1/completions", COMPLETION)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))[15:])
        assert json.loads(await asyncio.wait_for(reader.readexactly(length), 5))["choices"]
        p.fault = Fault(hang=True)
        data = json.dumps(COMPLETION).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(data) + data)  # fmt: skip
        await writer.drain()
        await wait_until(lambda: len(p.completions()) == 2, what="P got the second prefill")
        writer.close()
        await wait_until(lambda: p.completions()[1].cancelled, what="P saw the abort")
        assert len(d.completions()) == 1


OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@pytest.mark.parametrize("stray", [OK, b"HTTP/1.1 500 Oops\r\ncontent-le"])
async def test_bytes_after_an_answer_keep_its_connection_out_of_the_pool(stray):
    """A pooled connection keeps its parser for the next answer, so one whose answer came
    with more bytes after it (another message, whole or cut) is closed, not pooled: the
    next request gets its own answer over a fresh connection."""

    async def answer_then_stray(reader, writer):
        await read_request(reader)
        writer.write(OK + stray)
        await writer.drain()
        try:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nwrong")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    up = NativeUpstream(connect_timeout=2, max_response_bytes=1 << 20)
    try:
        async with RawServer(answer_then_stray) as srv:
            resp = await up.request("POST", srv.url + "/x", b"{}", {})
            assert resp.status == 200 and await resp.read() == b"{}"
            await resp.aclose()
            resp = await up.request("POST", srv.url + "/x", b"{}", {})
            assert resp.status == 200 and await resp.read() == b"{}"
            await resp.aclose()
            assert srv.connections == 2
    finally:
        await up.close()

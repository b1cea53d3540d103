"""The proxy's native upstream HTTP client against real loopback servers."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.upstream.base import KEEPALIVE_S, UpstreamError
from proxy.upstream.httpclient import HIGH_WATER, NativeUpstream, _Conn
from tests.support.ports import dead_port
from tests.support.proxy_helpers import FakeVLLM
from tests.support.raw_server import RawServer, read_request, reset

LIMIT = 64 * 1024 * 1024  # ProxyConfig.max_response_bytes' default


@pytest.fixture
async def client():
    up = NativeUpstream(connect_timeout=2, max_response_bytes=LIMIT)
    await up.start()
    yield up
    await up.close()


async def test_keep_alive_reuse_and_wire_format(client):
    fake = await FakeVLLM("D", register=False).start()
    try:
        base = f"http://{fake.http_address}"
        for i in range(5):
            resp = await client.request(
                "POST", base + "/v1/completions", b'{"prompt":"x","max_tokens":2}',
                {"content-type": "application/json", "x-request-id": f"r{i}"},
            )  # fmt: skip
            assert resp.status == 200 and resp.content_type == "application/json"
            assert b'"text":" t0 t1"' in await resp.read()
            await resp.aclose()
        assert fake.accepted == 1  # one pooled connection for all five
        rec = fake.requests[-1]
        assert rec.headers["host"] == fake.http_address
        assert rec.headers["x-request-id"] == "r4"
        assert rec.headers["content-length"] == str(len(rec.body))
        resp = await client.request("GET", base + "/v1/models", None, {})
        assert resp.status == 200 and b"fake-model" in await resp.read()
        await resp.aclose()
    finally:
        await fake.stop()


async def test_streamed_chunks_arrive_incrementally(client):
    fake = await FakeVLLM("D", register=False, token_delay=0.02).start()
    try:
        resp = await client.request(
            "POST", f"http://{fake.http_address}/v1/completions",
            b'{"prompt":"x","max_tokens":5,"stream":true}', {},
        )  # fmt: skip
        assert resp.content_type.startswith("text/event-stream")
        chunks = [c async for c in resp.chunks()]
        assert len(chunks) >= 3  # not one buffered blob
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
        await resp.aclose()
    finally:
        await fake.stop()


async def test_close_delimited_body_and_connection_close(client):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nhello ")
        await writer.drain()
        writer.write(b"world")

    async with RawServer(handler) as srv:
        for _ in range(2):
            resp = await client.request("POST", srv.url + "/x", b"{}", {})
            assert await resp.read() == b"hello world"
            await resp.aclose()
        assert srv.connections == 2  # a close-delimited response is never reused


async def test_errors_are_classified(client):
    with pytest.raises(UpstreamError) as exc:
        await client.request("POST", f"http://127.0.0.1:{dead_port()}/x", b"{}", {})
    assert exc.value.kind == "connect"

    async def hangup(reader, writer):
        await read_request(reader)

    async with RawServer(hangup) as srv:
        with pytest.raises(UpstreamError) as exc:
            await client.request("POST", srv.url + "/x", b"{}", {})
        assert exc.value.kind == "disconnect"

    async def garbage(reader, writer):
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client gives up on us

    async with RawServer(garbage) as srv:
        with pytest.raises(UpstreamError) as exc:
            await client.request("POST", srv.url + "/x", b"{}", {})
        assert exc.value.kind == "protocol"

    async def truncated(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort")

    async with RawServer(truncated) as srv:
        resp = await client.request("POST", srv.url + "/x", b"{}", {})
        with pytest.raises(UpstreamError) as exc:
            await resp.read()
        assert exc.value.kind == "disconnect"
        await resp.aclose()


async def test_abandoned_response_closes_connection(client):
    closed = asyncio.Event()

    async def endless(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await reader.read()  # returns at EOF: the client went away
        closed.set()

    async with RawServer(endless) as srv:
        resp = await client.request("POST", srv.url + "/x", b"{}", {})
        assert await anext(resp.chunks()) == b"hello"
        await resp.aclose()
        await asyncio.wait_for(closed.wait(), 5)


async def test_cancelled_request_closes_connection(client):
    received, closed = asyncio.Event(), asyncio.Event()

    async def silent(reader, writer):
        await read_request(reader)
        received.set()
        await reader.read()
        closed.set()

    async with RawServer(silent) as srv:
        task = asyncio.ensure_future(client.request("POST", srv.url + "/x", b"{}", {}))
        await asyncio.wait_for(received.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 5)


async def test_backpressure_pauses_reading(client):
    total = 4 * 1024 * 1024
    block = b"x" * 65536

    async def big(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        for _ in range(total // len(block)):
            writer.write(b"%x\r\n%s\r\n" % (len(block), block))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with RawServer(big) as srv:
        resp = await client.request("POST", srv.url + "/x", b"{}", {})
        received = 0
        largest = 0
        async for chunk in resp.chunks():
            received += len(chunk)
            largest = max(largest, len(chunk))
            await asyncio.sleep(0.002)  # a slow consumer
        assert received == total
        # Reading pauses past the high-water mark (one socket read, <= 256 KiB, may overshoot)
        # instead of buffering all 4 MiB.
        assert largest <= HIGH_WATER + 256 * 1024 + 65536
        await resp.aclose()


async def test_idle_connections_expire():
    fake = await FakeVLLM("D", register=False).start()
    up = NativeUpstream(connect_timeout=2, max_response_bytes=LIMIT)
    try:
        url = f"http://{fake.http_address}/v1/models"
        resp = await up.request("GET", url, None, {})
        await resp.read()
        await resp.aclose()
        pool = up._pools[fake.http_address]
        assert len(pool.idle) == 1
        now = time.monotonic()  # the pool's clock
        assert pool.acquire(now + KEEPALIVE_S + 1) is None  # too old: closed, not reused
        resp = await up.request("GET", url, None, {})
        await resp.read()
        await resp.aclose()
        assert fake.accepted == 2
    finally:
        await up.close()
        await fake.stop()


async def test_connect_timeout(monkeypatch):
    # A blackholed address cannot be simulated on loopback: make connecting hang instead.
    loop = asyncio.get_running_loop()

    async def hang(*args, **kwargs):
        await asyncio.sleep(3600)

    monkeypatch.setattr(loop, "create_connection", hang)
    up = NativeUpstream(connect_timeout=0.1, max_response_bytes=LIMIT)
    with pytest.raises(UpstreamError) as exc:
        await asyncio.wait_for(up.request("GET", "http://127.0.0.1:9/x", None, {}), 5)
    assert exc.value.kind == "connect_timeout"


OK_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def test_stale_pooled_connection_is_retried_once_on_a_fresh_one(client):
    """An instance that closes a kept-alive connection just as it is reused (uvicorn's idle
    timeout, or a frozen instance resetting its sockets) must not fail the request."""
    answered: list[int] = []

    async def handler(reader, writer):
        conn = len(answered)
        answered.append(0)
        while True:
            await read_request(reader)
            if conn == 0 and answered[conn] == 1:
                return  # the stale connection: read the request, close without a byte
            writer.write(OK_RESPONSE)
            await writer.drain()
            answered[conn] += 1

    async with RawServer(handler) as srv:
        for _ in range(3):
            resp = await client.request("POST", srv.url + "/v1/completions", b"{}", {})
            assert resp.status == 200 and await resp.read() == b"{}"
            await resp.aclose()
        assert srv.connections == 2 and answered == [1, 2]


async def test_no_retry_once_the_answer_has_begun_or_on_a_fresh_connection(client):
    async def partial(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-")  # then the connection drops
        await writer.drain()

    async with RawServer(partial) as srv:
        with pytest.raises(UpstreamError) as e:
            await client.request("POST", srv.url + "/v1/completions", b"{}", {})
        assert e.value.kind == "disconnect" and srv.connections == 1

    async def close_at_once(reader, writer):
        await read_request(reader)

    async with RawServer(close_at_once) as srv:
        with pytest.raises(UpstreamError) as e:
            await client.request("POST", srv.url + "/v1/completions", b"{}", {})
        assert e.value.kind == "disconnect" and srv.connections == 1


async def test_no_retry_on_a_pooled_connection_once_the_answer_has_begun(client):
    """The stale-connection retry is only for a reused connection that sent nothing: once a
    byte of the answer came, the request may have run, and it fails as it is."""

    async def head_then_reset(reader, writer):
        await read_request(reader)
        writer.write(OK_RESPONSE)  # the first answer: the connection is pooled
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n")  # head only
        await writer.drain()
        reset(writer)

    async with RawServer(head_then_reset) as srv:
        resp = await client.request("POST", srv.url + "/x", b"{}", {})
        assert await resp.read() == b"{}"
        await resp.aclose()
        resp = await client.request("POST", srv.url + "/x", b"{}", {})  # the pooled one
        with pytest.raises(UpstreamError) as e:
            await resp.read()
        assert e.value.kind == "disconnect" and srv.connections == 1
        await resp.aclose()

    async def half_head(reader, writer):  # part of a head is a byte of the answer too
        await read_request(reader)
        writer.write(OK_RESPONSE)
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 200")
        await writer.drain()
        reset(writer)

    async with RawServer(half_head) as srv:
        resp = await client.request("POST", srv.url + "/x", b"{}", {})
        await resp.read()
        await resp.aclose()
        with pytest.raises(UpstreamError) as e:
            await client.request("POST", srv.url + "/x", b"{}", {})
        assert e.value.kind == "disconnect" and srv.connections == 1


async def test_read_buffers_at_most_the_limit_and_one_socket_read(client, monkeypatch):
    """Past the limit the native client stops: what it held never exceeded the limit plus
    one socket read (asyncio reads at most 256 KiB at a time)."""
    most = [0]
    data_received = _Conn.data_received

    def recording(self, data):  # what is held after each socket read (it grows within one)
        data_received(self, data)
        most[0] = max(most[0], self.buffered)

    monkeypatch.setattr(_Conn, "data_received", recording)
    limit = 1024 * 1024
    sent = [0]
    block = b"x" * 65536
    done = asyncio.Event()

    async def endless(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            for _ in range(1024):  # up to 64 MiB, unless the client stops first
                writer.write(b"%x\r\n%s\r\n" % (len(block), block))
                await writer.drain()
                sent[0] += len(block)
        except ConnectionError:
            pass
        done.set()

    async with RawServer(endless) as srv:
        resp = await client.request("POST", srv.url + "/x", b"{}", {})
        with pytest.raises(UpstreamError) as e:
            await resp.read(limit)
        assert e.value.kind == "too_large"
        await resp.aclose()
        assert limit < most[0] <= limit + 256 * 1024 + len(block)
        await asyncio.wait_for(done.wait(), 10)
        assert sent[0] < 1024 * len(block)  # the client hung up long before 64 MiB
        pool = client._pools[srv.url[7:]]
        assert not pool.idle and not pool.all  # the connection is closed, not pooled

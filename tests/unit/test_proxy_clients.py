"""The key behaviours with each alternative upstream client (--upstream-client aiohttp|httpx).
The rest of the suite runs with the default (native); XPYD_TEST_UPSTREAM_CLIENT=aiohttp runs
all of it with another one."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest

from proxy.upstream.base import UpstreamError
from proxy.upstream.factory import make_upstream
from tests.support.proxy_helpers import Fault, running_proxy, wait_until
from tests.support.raw_instance import HEAD, RawInstance
from tests.support.raw_server import RawServer, read_request, reset


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
async def test_alternative_upstream_client(client):
    async with running_proxy(first_token="decode", upstream_client=client, stream_idle_timeout=0.5) as px:
        p, d = await px.pd()
        body = {"prompt": "x", "max_tokens": 3}
        ok = await px.client.post("/v1/completions", json=body)
        assert ok.status_code == 200 and ok.content == px.relayed(d.completions()[-1])
        stream = await px.client.post("/v1/completions", json={**body, "stream": True})
        assert stream.text.endswith("data: [DONE]\n\n")
        assert stream.content == px.relayed(d.completions()[-1])
        assert p.completions()[-1].json["max_tokens"] == 1

        p.fault = Fault(status=500, times=1)  # P fails: relayed, D not called
        n = len(d.completions())
        assert (await px.client.post("/v1/completions", json=body)).status_code == 500
        assert len(d.completions()) == n

        d.fault = Fault(fail_after=2, times=1)  # D breaks mid-stream: SSE error event
        broken = await px.client.post("/v1/completions", json={**body, "stream": True})
        *_, last, done = [e for e in broken.text.split("\n\n") if e]
        assert json.loads(last[6:])["error"]["code"] == "decode_midstream" and done == "data: [DONE]"

        d.fault = Fault(stall_after=1, times=1)  # D goes quiet: idle deadline
        idle = await px.client.post("/v1/completions", json={**body, "stream": True})
        *_, last, done = [e for e in idle.text.split("\n\n") if e]
        assert json.loads(last[6:])["error"]["code"] == "decode_timeout" and done == "data: [DONE]"

        d.fault = Fault(token_delay=0.05, times=1)  # client leaves mid-stream: D aborts
        host, port = px.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        raw = json.dumps({**body, "max_tokens": 100, "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(raw), raw))  # fmt: skip
        await asyncio.wait_for(reader.readuntil(b"data: "), 5)
        writer.close()
        await wait_until(lambda: d.completions()[-1].cancelled, what="D saw the abort")

        # An unreachable P (it answered on joining, then went away) is retried on the live one.
        gone = await px.fake("P")
        await gone.stop()
        assert px.registry.count("P") == 2
        for _ in range(2):
            assert (await px.client.post("/v1/completions", json=body)).status_code == 200
        assert (await px.client.get("/v1/models")).status_code == 200
        # Only the one deliberate disconnect: finished requests never read as the client
        # leaving, even when the client library yields while releasing its connection.
        assert await px.metric("xpyd_client_disconnects_total") == 1
        assert await px.metric("xpyd_requests_total", route="/v1/completions", status="499") == 1


# ---------------------------------------------------------------- every client, raw upstream

CLIENTS = ["native", "aiohttp", "httpx"]
# (what the instance sends, then: "fin" a clean close, "rst" a reset) -> the body, or None
# when it must be an error ("disconnect").
ENDINGS = {
    "close-delimited, clean close": (HEAD + b"\r\n" + b'{"a": 1}', "fin", b'{"a": 1}'),
    "close-delimited, reset": (HEAD + b"\r\n" + b'{"a": 1}', "rst", None),
    "content-length, complete, then reset": (HEAD + b"content-length: 8\r\n\r\n" + b'{"a": 1}',
                                             "rst", b'{"a": 1}'),  # fmt: skip
    "content-length, cut short": (HEAD + b"content-length: 80\r\n\r\n" + b'{"a": 1}', "fin", None),
    "content-length, cut short by a reset": (HEAD + b"content-length: 80\r\n\r\n" + b'{"a"',
                                             "rst", None),  # fmt: skip
    "chunked, complete": (HEAD + b"transfer-encoding: chunked\r\n\r\n8\r\n" + b'{"a": 1}'
                          + b"\r\n0\r\n\r\n", "fin", b'{"a": 1}'),  # fmt: skip
    "chunked, no last chunk": (HEAD + b"transfer-encoding: chunked\r\n\r\n8\r\n" + b'{"a": 1}'
                               + b"\r\n", "fin", None),  # fmt: skip
    "chunked, no last chunk, reset": (HEAD + b"transfer-encoding: chunked\r\n\r\n8\r\n"
                                      + b'{"a": 1}\r\n', "rst", None),  # fmt: skip
}


@asynccontextmanager
async def upstream(kind: str, max_response_bytes: int = 64 * 1024 * 1024):
    up = make_upstream(kind, 2.0, max_response_bytes)
    await up.start()
    try:
        yield up
    finally:
        await up.close()


def scripted(data: bytes, ending: str):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(0.05)  # the client has the bytes before the connection ends
        if ending == "rst":
            reset(writer)

    return handler


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("case", list(ENDINGS))
async def test_a_body_is_complete_only_at_its_proper_end(client, case):
    data, ending, want = ENDINGS[case]
    for mode in ("read", "chunks"):
        # A client each: the server ends every connection after one answer.
        async with upstream(client) as up, RawServer(scripted(data, ending)) as srv:
            resp = await up.request("GET", srv.url + "/x", None, {})
            try:
                if want is None:
                    with pytest.raises(UpstreamError) as e:
                        await (resp.read() if mode == "read" else collect(resp))
                    assert e.value.kind == "disconnect", (mode, e.value)
                else:
                    got = await (resp.read() if mode == "read" else collect(resp))
                    assert got == want, mode
            finally:
                await resp.aclose()


async def collect(resp) -> bytes:
    return b"".join([c async for c in resp.chunks()])


def endless_body(framing: str, sent: list[int], done: asyncio.Event, block: int = 65536,
                 blocks: int = 512):  # fmt: skip
    """Up to 32 MiB of body (less if the client hangs up first); sent[0] counts it."""

    async def handler(reader, writer):
        await read_request(reader)
        head = HEAD + {"chunked": b"transfer-encoding: chunked\r\n\r\n", "close": b"\r\n",
                       "huge-chunk": b"transfer-encoding: chunked\r\n\r\n40000000\r\n"}[framing]  # fmt: skip
        writer.write(head)
        data = b"x" * block
        try:
            for _ in range(blocks):
                writer.write(b"%x\r\n%s\r\n" % (block, data) if framing == "chunked" else data)
                await writer.drain()
                sent[0] += block
        except ConnectionError:
            pass
        done.set()

    return handler


@pytest.mark.parametrize("client", CLIENTS)
async def test_read_is_bounded(client):
    limit = 256 * 1024
    async with upstream(client, max_response_bytes=limit) as up:
        # Refused on its Content-Length at once: the promised body never comes.
        async def promise(reader, writer):
            await read_request(reader)
            writer.write(HEAD + b"content-length: %d\r\n\r\n{" % (limit + 1))
            await writer.drain()
            await reader.read()  # until the client hangs up

        async with RawServer(promise) as srv:
            resp = await up.request("POST", srv.url + "/x", b"{}", {})
            with pytest.raises(UpstreamError) as e:
                await asyncio.wait_for(resp.read(), 5)
            assert e.value.kind == "too_large" and "announced" in str(e.value)
            await resp.aclose()

        # Exactly the limit is fine, one byte more is not (by Content-Length or by count).
        for size, framing in ((limit, "content-length"), (limit, "close"),
                              (limit + 1, "close"), (limit + 1, "chunked")):  # fmt: skip
            body = b"y" * size
            head = {"content-length": b"content-length: %d\r\n\r\n" % size, "close": b"\r\n",
                    "chunked": b"transfer-encoding: chunked\r\n\r\n"}[framing]  # fmt: skip
            if framing == "chunked":
                body = b"%x\r\n%s\r\n0\r\n\r\n" % (size, body)
            async with RawServer(scripted(HEAD + head + body, "fin")) as srv:
                resp = await up.request("POST", srv.url + "/x", b"{}", {})
                try:
                    if size <= limit:
                        assert len(await resp.read()) == size
                    else:
                        with pytest.raises(UpstreamError) as e:
                            await resp.read()
                        assert e.value.kind == "too_large", framing
                finally:
                    await resp.aclose()

        # Without Content-Length: the client stops reading and hangs up past the limit.
        for framing in ("chunked", "close"):
            sent, done = [0], asyncio.Event()
            async with RawServer(endless_body(framing, sent, done)) as srv:
                resp = await up.request("POST", srv.url + "/x", b"{}", {})
                with pytest.raises(UpstreamError) as e:
                    await resp.read()
                assert e.value.kind == "too_large", framing
                await resp.aclose()
                await asyncio.wait_for(done.wait(), 10)
                assert sent[0] < 512 * 65536, framing  # long before the 32 MiB end

        # A smaller limit for one read (the probes use one).
        async with RawServer(scripted(HEAD + b"\r\n" + b"z" * 1000, "fin")) as srv:
            resp = await up.request("GET", srv.url + "/x", None, {})
            with pytest.raises(UpstreamError) as e:
                await resp.read(999)
            assert e.value.kind == "too_large"
            await resp.aclose()


@pytest.mark.parametrize("client", CLIENTS)
async def test_streams_are_not_bounded_in_total_but_each_piece_is(client):
    limit = 256 * 1024
    async with upstream(client, max_response_bytes=limit) as up:
        # One chunk announced as 1 GiB: handed over as it arrives, never gathered whole;
        # its missing end is an error.
        sent, done = [0], asyncio.Event()
        async with RawServer(endless_body("huge-chunk", sent, done, blocks=128)) as srv:
            resp = await up.request("POST", srv.url + "/x", b"{}", {})
            total = largest = 0
            with pytest.raises(UpstreamError) as e:
                async for chunk in resp.chunks():
                    total += len(chunk)
                    largest = max(largest, len(chunk))
            assert e.value.kind == "disconnect"
            await resp.aclose()
            assert total == 128 * 65536 > 4 * limit  # streams pass the read() limit
            assert largest <= 1024 * 1024  # each piece is a few socket reads at most


@pytest.mark.parametrize("client", CLIENTS)
async def test_an_endless_response_head_is_refused(client):
    sent, done = [0], asyncio.Event()

    async def endless_header(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-long: ")
        try:
            for _ in range(512):  # up to 32 MiB of one header value
                writer.write(b"a" * 65536)
                await writer.drain()
                sent[0] += 65536
        except ConnectionError:
            pass
        done.set()

    async with upstream(client) as up, RawServer(endless_header) as srv:
        with pytest.raises(UpstreamError) as e:
            await asyncio.wait_for(up.request("GET", srv.url + "/x", None, {}), 10)
        assert e.value.kind in ("protocol", "disconnect")
        await asyncio.wait_for(done.wait(), 10)
        assert sent[0] < 512 * 65536


# ---------------------------------------------------------------- through a running proxy

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
EVENT = b'data: {"choices": [{"text": " t"}]}\n\n'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def live(px, role: str, n: int) -> None:
    await wait_until(lambda: len(px.registry.live(role)) == n, what=f"{n} {role} live")


STREAM_BREAKS = {
    # Close-delimited (no length, not chunked): a reset is no end.
    "reset": ([SSE_HEAD + b"\r\n" + EVENT, EVENT, b'data: {"choices": [{"te'], "rst"),
    # Chunked: a clean close without the last chunk is no end either.
    "no last chunk": ([SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n" + chunk(EVENT),
                       chunk(EVENT), chunk(b'data: {"choices": [{"te')], "fin"),  # fmt: skip
}


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("how", list(STREAM_BREAKS))
async def test_a_stream_that_breaks_ends_with_an_sse_error_event(client, how):
    async with RawInstance(lambda req: STREAM_BREAKS[how]) as d:
        async with running_proxy(upstream_client=client, decode=(d.url,), health_interval=0.05) as px:
            await live(px, "D", 1)
            resp = await px.client.post("/v1/completions", json={
                "model": "m", "prompt": "x", "max_tokens": 5, "stream": True})  # fmt: skip
            assert resp.status_code == 200  # sent before the break
            events = resp.content.split(b"\n\n")
            assert events[:2] == [EVENT[:-2]] * 2
            assert events[2] == b'data: {"choices": [{"te'  # the broken event, ended
            error = json.loads(events[3].removeprefix(b"data: "))["error"]
            assert error["code"] == "decode_midstream" and error["type"] == "upstream_error"
            assert events[4:] == [b"data: [DONE]", b""] and len(d.posts) == 1


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_non_streamed_answer_cut_by_a_reset_is_a_502(client):
    answer = ([HEAD + b"\r\n" + b'{"choices": [{"text": " t'], "rst")
    async with RawInstance(lambda req: answer) as d:
        async with running_proxy(upstream_client=client, decode=(d.url,), health_interval=0.05) as px:
            await live(px, "D", 1)
            resp = await px.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert resp.status_code == 502
            error = resp.json()["error"]
            assert error["code"] == "decode_unreachable" and error["type"] == "upstream_error"
            assert len(d.posts) == 1


@pytest.mark.parametrize("client", CLIENTS)
async def test_answers_over_max_response_bytes_are_a_502_and_not_retried(client):
    big = b'{"choices": [{"text": "' + b"w" * 2000 + b'"}]}'

    def answer(req: bytes):
        if b'"stream":true' in req.replace(b" ", b""):  # streams are not bounded in total
            return [SSE_HEAD + b"content-length: %d\r\n\r\n" % (4 * len(EVENT) * 40)]  \
                + [EVENT * 40] * 4, "fin"  # fmt: skip
        if b"chunked" in req:  # no Content-Length: counted as it arrives
            return [HEAD + b"transfer-encoding: chunked\r\n\r\n", chunk(big), b"0\r\n\r\n"], "fin"
        return [HEAD + b"content-length: %d\r\n\r\n" % len(big), big], "fin"

    async with RawInstance(answer) as d1, RawInstance(answer) as d2:
        async with running_proxy(upstream_client=client, decode=(d1.url, d2.url),
                                 health_interval=0.05, max_response_bytes=1024) as px:  # fmt: skip
            await live(px, "D", 2)
            for prompt in ("content-length", "chunked"):
                resp = await px.client.post("/v1/completions", json={"model": "m", "prompt": prompt})
                assert resp.status_code == 502, resp.text
                error = resp.json()["error"]
                assert error["code"] == "upstream_response_too_large", error
                assert "1024" in error["message"] and "127.0.0.1" not in error["message"]
            assert len(d1.posts) + len(d2.posts) == 2  # one D each time: never retried
            assert await px.metric("xpyd_upstream_errors_total", role="D", instance=d1.url[7:],
                                   kind="too_large") == 1  # fmt: skip
            stream = await px.client.post("/v1/completions", json={
                "model": "m", "prompt": "x", "stream": True})  # fmt: skip
            assert stream.status_code == 200 and stream.content == EVENT * 160


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_prefill_answer_over_max_response_bytes_is_a_502_and_not_retried(client):
    big = b'{"choices": [{"text": "' + b"w" * 2000 + b'"}]}'
    answer = ([HEAD + b"content-length: %d\r\n\r\n" % len(big), big], "fin")
    async with RawInstance(lambda req: answer) as p1, RawInstance(lambda req: answer) as p2, \
            RawInstance(lambda req: answer) as d:  # fmt: skip
        async with running_proxy(upstream_client=client, prefill=(p1.url, p2.url),
                                 decode=(d.url,), health_interval=0.05,
                                 max_response_bytes=1024) as px:  # fmt: skip
            await live(px, "P", 2)
            await live(px, "D", 1)
            resp = await px.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert resp.status_code == 502, resp.text
            assert resp.json()["error"]["code"] == "upstream_response_too_large"
            assert len(p1.posts) + len(p2.posts) == 1 and not d.posts

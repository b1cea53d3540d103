"""The HTTP edge before any authentication (issue 36, part 2), over raw loopback sockets
against a real proxy: a growing header gets 431, connections that trickle or withhold
their headers or body get 408 and are closed, a connection over the cap gets 503 (logged
and counted), a parser refusal is OpenAI error JSON, and none of it stalls other clients.
Each refusal is checked for both uvicorn parsers (httptools, the default, and h11)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxy.config import ProxyConfig
from proxy.serving.edge import fd_capped
from tests.support.proxy_helpers import free_port, running_proxy

ROOT = Path(__file__).resolve().parents[2]
PARSERS = ["httptools", "h11"]
# Sweep granularity (a quarter of the shortest deadline, at most 1 s) plus a loaded 2-core box.
SLACK_S = 3.0


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def parse(raw: bytes) -> tuple[int, dict]:
    """Status and JSON body of one whole HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), raw[:300]
    return status, json.loads(body)


def assert_openai_error(body: dict, code: str) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, body


async def read_all(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the proxy sends until it closes the connection (fails past timeout)."""
    return await asyncio.wait_for(reader.read(), timeout)


async def timed_health(url_client) -> float:
    t0 = time.perf_counter()
    r = await url_client.get("/health")
    assert r.status_code == 200
    return time.perf_counter() - t0


def test_defaults_bound_the_edge():
    cfg = ProxyConfig()
    assert cfg.max_header_bytes == 32 * 1024
    assert cfg.header_timeout == 10.0 and cfg.body_timeout == 60.0
    assert cfg.max_connections == 4096


@pytest.mark.parametrize("http", PARSERS)
async def test_a_growing_header_gets_431(http):
    """One header growing 64 KiB at a time (the default limit, 32 KiB): 431 JSON and
    closed at the first chunk past the limit; /health stays fast meanwhile."""
    async with running_proxy(http=http) as proxy:
        reader, writer = await connect(proxy.server.port)
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nx-grow: ")
        sent = 0
        for _ in range(64):  # up to 4 MiB if nobody stops it
            try:
                writer.write(b"a" * 65536)
                await writer.drain()
            except ConnectionError:
                break
            sent += 65536
            if reader.at_eof() or reader._buffer:  # the proxy answered
                break
            await asyncio.sleep(0.01)
        assert await timed_health(proxy.client) < 1.0
        status, body = parse(await read_all(reader, 5.0))
        assert status == 431 and sent <= 4 * 65536
        assert_openai_error(body, "request_header_fields_too_large")
        writer.close()
        assert await proxy.metric("xpyd_http_refused_total", reason="headers_too_large") == 1


def _head(size: int, method: bytes = b"GET", path: bytes = b"/health", extra: bytes = b"") -> bytes:
    """A request head (request line, headers, blank line) of exactly `size` bytes."""
    start = method + b" " + path + b" HTTP/1.1\r\nhost: x\r\n" + extra + b"x-pad: "
    head = start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"
    assert len(head) == size
    return head


@pytest.mark.parametrize("http", PARSERS)
async def test_a_head_over_the_limit_in_one_write_gets_431_at_the_bound(http):
    """A head that arrives in one read is measured too (the parser finishes it before any
    check could see its size): exactly max_header_bytes is served, one byte more is 431,
    with or without a body in the same write."""
    limit = 32 * 1024
    async with running_proxy(http=http, max_header_bytes=limit) as proxy:
        for size, body, want in ((limit, b"", 200), (limit + 1, b"", 431), (limit - 40, b"", 200),
                                 (limit + 1, b"{}", 431), (2 * limit, b"", 431)):
            reader, writer = await connect(proxy.server.port)
            extra = b"content-length: %d\r\nconnection: close\r\n" % len(body)
            writer.write(_head(size, extra=extra) + body)
            raw = await read_all(reader, 10.0)
            writer.close()
            status = int(raw.split(b" ", 2)[1])
            assert status == want, (size, raw[:200])
            if want == 431:
                assert_openai_error(parse(raw)[1], "request_header_fields_too_large")
        assert await proxy.metric("xpyd_http_refused_total", reason="headers_too_large") == 3


@pytest.mark.parametrize("http", PARSERS)
async def test_slowloris_and_silent_connections_are_closed(http):
    """60 connections trickling header bytes and 200 silent ones: every one gets 408 JSON
    and is closed after header_timeout; a normal client is served meanwhile."""
    timeout = 1.5
    async with running_proxy(http=http, header_timeout=timeout) as proxy:
        port = proxy.server.port
        t0 = time.monotonic()
        trickling = [await connect(port) for _ in range(60)]
        silent = [await connect(port) for _ in range(200)]

        async def trickle(writer: asyncio.StreamWriter) -> None:
            head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"s" * 200
            for byte in head:  # one byte each 100 ms: ~24 s if nobody stops it
                if writer.is_closing():
                    return
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except ConnectionError:
                    return
                await asyncio.sleep(0.1)

        tricklers = [asyncio.create_task(trickle(w)) for _, w in trickling]
        assert await timed_health(proxy.client) < 1.0
        answers = await asyncio.gather(*(read_all(r, timeout + SLACK_S + 5) for r, _ in trickling + silent))
        elapsed = time.monotonic() - t0
        assert timeout * 0.9 <= elapsed < timeout + SLACK_S + 5
        for raw in answers:
            status, body = parse(raw)
            assert status == 408
            assert_openai_error(body, "request_timeout")
        for task in tricklers:
            task.cancel()
        for _, w in trickling + silent:
            w.close()
        assert await proxy.metric("xpyd_http_refused_total", reason="header_timeout") == 260


@pytest.mark.parametrize("http", PARSERS)
async def test_a_body_shorter_than_its_content_length_times_out(http):
    timeout = 1.0
    async with running_proxy(http=http, body_timeout=timeout) as proxy:
        await proxy.pd()
        reader, writer = await connect(proxy.server.port)
        t0 = time.monotonic()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 500\r\n\r\n{\"prompt\": \"hi\"")  # fmt: skip
        status, body = parse(await read_all(reader, timeout + SLACK_S + 5))
        assert status == 408 and time.monotonic() - t0 >= timeout * 0.9
        assert_openai_error(body, "request_timeout")
        writer.close()
        assert await proxy.metric("xpyd_http_refused_total", reason="body_timeout") == 1
        # The app saw the client leave (499), and nothing stayed in flight.
        assert await proxy.metric("xpyd_client_disconnects_total") == 1
        assert all(i.in_flight == 0 for i in proxy.registry.all())


@pytest.mark.parametrize("http", PARSERS)
async def test_a_parser_refusal_is_openai_json(http):
    """A Content-Length shorter than the body: the rest is not a request."""
    async with running_proxy(http=http) as proxy:
        reader, writer = await connect(proxy.server.port)
        writer.write(b"POST /v1/nope HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}\x01garbage \x00\r\n\r\n")
        raw = await read_all(reader, 10.0)
        writer.close()
        # Each answer on the connection (the first request's, then the refusal) is JSON.
        statuses = []
        while raw:
            status, _, rest = raw.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in status.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))  # fmt: skip
            statuses.append(parse(status + b"\r\n\r\n" + rest[:length]))
            raw = rest[length:]
        assert [s for s, _ in statuses][-1] == 400
        assert_openai_error(statuses[-1][1], "invalid_http_request")


@pytest.mark.parametrize("http", PARSERS)
async def test_connections_over_the_cap_get_503_logged_and_counted(http, caplog):
    cap = 20
    async with running_proxy(http=http, max_connections=cap, header_timeout=1.5) as proxy:
        port = proxy.server.port
        await proxy.client.get("/health")  # the test client's own connection counts too
        idle = [await connect(port) for _ in range(cap - 1)]
        with caplog.at_level(logging.INFO, logger="xpyd.proxy.edge"):
            extra = [await connect(port) for _ in range(5)]
            for reader, _ in extra:
                status, body = parse(await read_all(reader, 5.0))
                assert status == 503
                assert_openai_error(body, "too_many_connections")
        assert any("reason=connection_limit" in r.getMessage() and f"max_connections={cap}" in r.getMessage()
                   for r in caplog.records)  # fmt: skip
        assert await proxy.metric("xpyd_http_refused_total", reason="connection_limit") == 5
        # The idle ones are cut at header_timeout (their clients close on the 408): new
        # clients get in again.
        await asyncio.gather(*(read_all(r, 1.5 + SLACK_S + 5) for r, _ in idle))
        for _, w in idle + extra:
            w.close()

        async def served() -> bool:
            reader, writer = await connect(port)
            try:
                writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                return (await read_all(reader, 5.0)).startswith(b"HTTP/1.1 200")
            except ConnectionError:
                return False
            finally:
                writer.close()

        deadline = time.monotonic() + SLACK_S
        while not await served():
            assert time.monotonic() < deadline, "not served after the idle connections were cut"
            await asyncio.sleep(0.1)


def test_the_cap_keeps_half_the_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert fd_capped(10**9) == (10**9 if soft == resource.RLIM_INFINITY else soft // 2)
    assert fd_capped(3) == 3


def _lower_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


async def test_idle_connections_under_a_low_fd_limit_are_refused_aloud_and_expire():
    """`python -m proxy` with its fd limit at 256 and 400 idle connections: the ones over
    the cap (128) get 503 and a log line instead of a silent accept() failure, and once
    header_timeout cuts the idle ones new clients are served."""
    port, disc = free_port(), free_port()
    cmd = [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port),
           "--discovery-port", str(disc), "--header-timeout", "2", "--log-level", "info"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            preexec_fn=_lower_fd_limit, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        async def up() -> bool:
            try:
                r, w = await connect(port)
            except OSError:
                return False
            try:  # refused (503, then closed unread): the request may meet a reset
                w.write(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                return (await read_all(r, 5.0)).startswith(b"HTTP/1.1 200")
            except ConnectionError:
                return False
            finally:
                w.close()

        deadline = time.monotonic() + 240  # a proxy's start took over 120 s at load 34
        while not await up():
            assert proc.poll() is None and time.monotonic() < deadline, "proxy did not start"
            await asyncio.sleep(0.1)
        for _ in range(400):
            conns.append(await connect(port))
        t0 = time.monotonic()
        reader, writer = await connect(port)
        status, body = parse(await read_all(reader, 5.0))
        assert status == 503 and "128 client connections" in body["error"]["message"]
        writer.close()
        # Within header_timeout + slack, a new client is served again.
        while not await up():
            assert time.monotonic() - t0 < 2 + SLACK_S + 5, "never served again"
            await asyncio.sleep(0.2)
    finally:
        for _, w in conns:
            w.close()
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    text = err.decode(errors="replace")
    assert "http edge refused reason=connection_limit" in text and "max_connections=128" in text, text[-2000:]
    assert "Traceback" not in text, text[-3000:]

"""The proxy's I/O helpers: Deadline (asyncio.timeout with the loop given) and the corked
client transport (one system call for what one loop turn writes)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from proxy.deadline import Deadline
from proxy.serving.corked import CorkedTransport, corked_protocol


async def test_deadline_raises_timeout_and_leaves_the_task_uncancelled():
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError):
        async with Deadline.after(loop, 0.05) as d:
            await asyncio.sleep(5)
    assert d.expired()
    assert asyncio.current_task().cancelling() == 0  # the task may await again
    await asyncio.sleep(0)


async def test_deadline_that_is_not_reached_changes_nothing():
    loop = asyncio.get_running_loop()
    async with Deadline.after(loop, 5) as d:
        await asyncio.sleep(0.01)
    assert not d.expired()
    async with Deadline(loop, None):  # no deadline at all
        await asyncio.sleep(0.01)


async def test_deadline_in_the_past_expires_at_the_first_await():
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError):
        async with Deadline(loop, loop.time() - 1):
            await asyncio.sleep(1)


async def test_deadline_reschedule_extends_and_shortens():
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with Deadline.after(loop, 0.05) as d:
        d.reschedule(loop.time() + 5)  # later: the first deadline no longer applies
        await asyncio.sleep(0.1)
        assert d.when() is not None and d.when() > t0 + 1
    with pytest.raises(TimeoutError):
        async with Deadline.after(loop, 5) as d:
            d.reschedule(loop.time() + 0.02)
            await asyncio.sleep(5)
    assert loop.time() - t0 < 2


async def test_deadline_keeps_an_outside_cancellation_a_cancellation():
    """Cancelled by someone else as the deadline also fires: CancelledError, as
    asyncio.timeout does, so the task's canceller sees its cancellation."""
    loop = asyncio.get_running_loop()
    for also_expire in (True, False):
        held: list[Deadline] = []
        entered = asyncio.Event()

        async def guarded() -> None:
            async with Deadline.after(loop, 5) as d:
                held.append(d)
                entered.set()
                await asyncio.sleep(5)

        task = loop.create_task(guarded())
        await entered.wait()
        if also_expire:
            held[0].reschedule(loop.time() - 1)  # expires at once, beside the cancel below
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_deadline_must_be_used_in_a_task_of_its_loop():
    other = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError):
            async with Deadline.after(other, 1):
                pass
    finally:
        other.close()


class _Recorder(asyncio.Protocol):
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()


class _Counting:
    """A real transport's writes, counted (each write/writelines is one system call on an
    idle socket)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.calls: list[int] = []

    def write(self, data: bytes) -> None:
        self.calls.append(1)
        self.transport.write(data)

    def writelines(self, lines: list[bytes]) -> None:
        self.calls.append(len(lines))
        self.transport.writelines(lines)

    def __getattr__(self, name: str):
        return getattr(self.transport, name)


async def _pair() -> tuple[asyncio.Transport, _Recorder, asyncio.Server]:
    loop = asyncio.get_running_loop()
    peer = _Recorder()
    server = await loop.create_server(lambda: peer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    return transport, peer, server


async def test_corked_writes_of_one_turn_leave_together_in_order():
    transport, peer, server = await _pair()
    counting = _Counting(transport)
    corked = CorkedTransport(counting, asyncio.get_running_loop())  # type: ignore[arg-type]
    try:
        corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
        corked.write(b"")  # nothing to send: no call
        corked.write(b"5\r\nhello\r\n")
        assert counting.calls == []  # held until the turn ends
        assert corked.get_write_buffer_size() == 29
        await asyncio.sleep(0)
        assert counting.calls == [2]  # one writelines of both
        corked.write(b"0\r\n\r\n")
        await asyncio.sleep(0)
        assert counting.calls == [2, 1]  # a lone write is passed on as it is
        corked.close()  # nothing held: just closes
        await asyncio.wait_for(peer.closed.wait(), 5)
        assert bytes(peer.data) == b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    finally:
        server.close()


@pytest.mark.parametrize("ending, received", [
    ("close", b"held"),  # close() sends what was written before it, as transports promise
    ("abort", b""),  # abort() drops it
    ("gone", b""),  # the connection went away before the turn ended: nothing to send it to
])
async def test_corked_connection_end(ending, received):
    transport, peer, server = await _pair()
    corked = CorkedTransport(transport, asyncio.get_running_loop())
    try:
        corked.write(b"held")
        if ending == "close":
            corked.close()
        elif ending == "abort":
            corked.abort()
        else:
            transport.close()
        await asyncio.sleep(0)
        await asyncio.wait_for(peer.closed.wait(), 5)
        await asyncio.sleep(0)
        assert bytes(peer.data) == received
        assert corked.is_closing()  # everything else is the transport's
    finally:
        server.close()


@asynccontextmanager
async def serving(app, http: str) -> AsyncIterator[int]:
    """``app`` behind uvicorn with the corked protocol ``http`` on loopback; yields the port."""
    import uvicorn

    protocol = corked_protocol(http)
    assert protocol.__name__.startswith("Corked")
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=protocol, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        for _ in range(100):
            if server.started:
                break
            await asyncio.sleep(0.05)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("http", ["auto", "httptools", "h11"])
async def test_corked_protocol_serves_http(http):
    """uvicorn's protocol with the corked transport answers a keep-alive client: the
    headers and body of a response, then a second request on the same connection."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"part1", "more_body": True})
        await send({"type": "http.response.body", "body": b"part2"})

    async with serving(app, http) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
            body = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
            assert body == b"5\r\npart1\r\n5\r\npart2\r\n0\r\n\r\n"
        writer.close()


@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_corked_flush_sends_what_is_held_before_the_turn_ends(http):
    """scope["state"][FLUSH] sends the response's held start at once: the client has it
    while the app still holds the loop (blocking here for 0.5 s), not after."""
    from proxy.serving.corked import FLUSH

    flushed_at: list[float] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        scope["state"][FLUSH]()
        flushed_at.append(time.monotonic())
        time.sleep(0.5)  # the rest of the turn: nothing else on the loop runs meanwhile
        await send({"type": "http.response.body", "body": b"rest"})

    async with serving(app, http) as port:

        def client() -> tuple[bytes, float]:  # a thread: the loop is blocked while it reads
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                data = b""
                while b"first" not in data:
                    data += c.recv(65536)
                return data, time.monotonic()

        data, got_at = await asyncio.to_thread(client)
        assert data.startswith(b"HTTP/1.1 200") and b"rest" not in data
        assert got_at - flushed_at[0] < 0.3, "the held start waited for the turn's end"


def test_corked_protocol_rejects_an_unknown_parser():
    with pytest.raises(KeyError):
        corked_protocol("nope")


async def test_deadline_pushed_back_many_times_expires_at_the_last_time():
    """A relay's idle deadline: pushed back on every chunk, it fires only once idle."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        async with Deadline.after(loop, 0.1) as d:
            for _ in range(10):  # 0.3 s of activity, each gap shorter than the deadline
                await asyncio.sleep(0.03)
                d.reschedule(loop.time() + 0.1)
            assert not d.expired()
            await asyncio.sleep(5)
    waited = loop.time() - t0
    assert 0.35 <= waited < 2.0, waited

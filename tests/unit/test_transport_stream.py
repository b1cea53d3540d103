"""The tcp transport's byte stream (connector/transport/stream.py) over real loopback sockets:
calls move to it once a zmq reply said where it is, tensors arrive intact into reused memory
that is never handed out twice while held, and every way the stream can be missing, stale,
refused or slow ends in a served call over zmq or a clear error, never a hang."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import msgpack
import pytest
import torch

from connector.transport import KVAuth, TcpTransport, TransportError, stream

HOST = "127.0.0.1"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte identity (random bits include NaNs, which are never equal as numbers)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _random(n: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen).view(dtype)


class Recorder:
    """A handler that keeps what it received (as a KV store does) and counts calls."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.held: list[list[torch.Tensor]] = []
        self.calls = 0
        self.delay_s = delay_s

    def __call__(self, header, tensors):
        self.calls += 1
        if header.get("op") == "slow":
            time.sleep(self.delay_s)
        if header.get("op") == "keep":
            self.held.append(tensors)
        if header.get("op") == "echo":
            return {"n": len(tensors)}, [t.clone() for t in tensors]
        return {"n": len(tensors)}, []


@contextlib.contextmanager
def served(handler: Recorder, client: dict | None = None, **server):
    """A started server (``server``: its TcpTransport options) and a client (``client``'s),
    both closed afterwards: (server, client, peer)."""
    srv = TcpTransport(**server)
    srv.start(HOST, 0, handler)
    cli = TcpTransport(**(client or {}))
    try:
        yield srv, cli, f"{HOST}:{srv.bound_port}"
    finally:
        cli.close()
        srv.close()


@pytest.fixture
def pair():
    handler = Recorder()
    with served(handler) as (srv, cli, peer):
        yield srv, cli, peer, handler


def test_calls_move_to_the_stream_after_the_first_reply(pair):
    srv, cli, peer, handler = pair
    cli.call(peer, {"op": "ping"})
    assert cli.stream_calls == 0  # the first call learns where the stream is
    sent = [_random(4096, 1), _random(1, 2, torch.float32), _random(0, 3), _random(333, 4, torch.int8)]
    reply, got = cli.call(peer, {"op": "echo"}, sent)
    assert cli.stream_calls == 1 and reply == {"ok": True, "n": 4}
    for a, b in zip(sent, got):
        assert _same(a, b)
    # Non-contiguous input goes as its logical bytes, as over zmq.
    base = _random(64 * 8, 5, torch.float32).reshape(64, 8)
    _, got = cli.call(peer, {"op": "echo"}, [base.t()])
    assert torch.equal(got[0].view(torch.uint8), base.t().contiguous().view(torch.uint8))
    assert cli.stream_calls == 2 and handler.calls == 3


def test_held_payloads_are_never_overwritten_and_memory_comes_back(pair):
    srv, cli, peer, handler = pair
    cli.call(peer, {"op": "ping"})
    payloads = [[_random(100_000, 10 + i), _random(777, 20 + i)] for i in range(5)]
    for p in payloads:
        cli.call(peer, {"op": "keep"}, p)
    assert cli.stream_calls == 5
    mem = srv._recv_memory
    assert mem.lent_bytes >= sum(t.numel() * t.element_size() for p in payloads for t in p)
    addrs = {t.data_ptr() for held in handler.held for t in held}
    assert len(addrs) == 10  # every held tensor in memory of its own
    assert all(_same(a, b) for sent, held in zip(payloads, handler.held) for a, b in zip(sent, held))
    first = handler.held[0][0].data_ptr()
    handler.held.clear()  # the receiver lets go: the memory returns, and is reused
    assert mem.lent_bytes == 0
    cli.call(peer, {"op": "keep"}, payloads[0])
    assert handler.held[0][0].data_ptr() == first and mem.fresh == 0


def test_a_message_over_the_reused_memory_gets_fresh_memory():
    handler = Recorder()
    with served(handler, recv_memory_bytes=4096) as (srv, cli, peer):
        cli.call(peer, {"op": "ping"})
        big = _random(10_000, 7)
        cli.call(peer, {"op": "keep"}, [big])
        assert cli.stream_calls == 1 and srv._recv_memory.fresh == 1
        assert _same(handler.held[0][0], big)


def test_a_restarted_peer_is_reached_over_zmq_then_its_new_stream(pair):
    srv, cli, peer, handler = pair
    cli.call(peer, {"op": "ping"})
    cli.call(peer, {"op": "keep"}, [_random(10, 1)])
    assert cli.stream_calls == 1
    port = srv.bound_port
    srv.close()
    again = Recorder()
    srv2 = TcpTransport()
    srv2.start(HOST, port, again)  # same zmq port, a new stream port and token
    try:
        t = _random(1000, 3)
        try:
            reply, _ = cli.call(peer, {"op": "keep"}, [t], timeout_s=5)
        except TransportError as e:
            # On a loaded box zmq's I/O thread may not have seen the old server's close yet:
            # a message it queued on that dying connection is lost, and the call times out.
            # The next call goes over the new connection.
            assert str(e).startswith("timeout after 5s waiting for reply"), e
            reply, _ = cli.call(peer, {"op": "keep"}, [t], timeout_s=5)
        assert reply["ok"] and again.calls == 1 and _same(again.held[0][0], t)
        cli.call(peer, {"op": "keep"}, [t])
        assert again.calls == 2 and cli.stream_calls == 2  # the stream again, learned anew
    finally:
        srv2.close()


def test_a_stale_token_is_refused_before_anything_runs(pair):
    srv, cli, peer, handler = pair
    cli.call(peer, {"op": "ping"})
    port, _ = cli._stream_at[peer]
    cli._stream_at[peer] = (port, b"\x01" * 8)  # what a client of the port's previous owner holds
    reply, _ = cli.call(peer, {"op": "keep"}, [_random(10, 1)])
    assert reply["ok"] and handler.calls == 2 and cli.stream_calls == 0  # served once, over zmq
    cli.call(peer, {"op": "ping"})
    assert cli.stream_calls == 1


def _raw_request(port: int, token: bytes, header: dict, body: bytes, auth: bytes | None = None) -> dict:
    """Speak the stream protocol by hand; the decoded reply header."""
    from connector.transport.wire import decode_header

    with socket.create_connection((HOST, port), timeout=5) as s:
        deadline = time.monotonic() + 5
        stream.send_parts(s, stream.message(stream.HELLO, token, None, b"", ()), deadline)
        assert stream.read_head(s, deadline).kind == stream.REPLY
        hdr = msgpack.packb({**header, "_id": 1})
        stream.send_parts(s, [stream.message(stream.REQUEST, token, auth, hdr, ())[0], body], deadline)
        head = stream.read_head(s, deadline)
        return decode_header(head.header)


def test_unauthenticated_and_oversized_requests_never_reach_the_handler():
    handler = Recorder()
    auth = KVAuth.from_secret("s3cret", "mac")
    with served(handler, {"auth": auth}, auth=auth, max_msg_bytes=1 << 16) as (srv, cli, peer):
        cli.call(peer, {"op": "ping"})
        cli.call(peer, {"op": "keep"}, [_random(100, 1)])
        assert cli.stream_calls == 1 and handler.calls == 2  # signed calls over the stream
        port, token = cli._stream_at[peer]
        header = {"op": "keep", "tensors": [{"dtype": "uint8", "shape": [8]}]}
        reply = _raw_request(port, token, header, bytes(8))
        assert reply["refused"] == "unauthenticated"
        header["tensors"] = [{"dtype": "uint8", "shape": [1 << 20]}]  # announced, never sent
        reply = _raw_request(port, token, header, b"")
        assert reply["refused"] == "oversized"
        assert handler.calls == 2
        refused = srv.refusals()
        assert refused["unauthenticated"] == 1 and refused["oversized"] == 1
        with pytest.raises(TransportError):  # the client's own oversized call: refused too
            cli.call(peer, {"op": "keep"}, [_random(1 << 17, 2, torch.uint8)])
        assert handler.calls == 2


def test_a_slow_reply_times_out_and_the_next_call_is_served():
    handler = Recorder(delay_s=1.0)
    with served(handler) as (srv, cli, peer):
        cli.call(peer, {"op": "ping"})
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="timeout"):
            cli.call(peer, {"op": "slow"}, [_random(10, 1)], timeout_s=0.3)
        assert time.monotonic() - t0 < 3.0  # ended by its deadline (slack for a loaded box)
        reply, _ = cli.call(peer, {"op": "ping"}, timeout_s=5)
        assert reply["ok"]


def test_concurrent_callers_each_get_their_own_reply(pair):
    srv, cli, peer, handler = pair
    cli.call(peer, {"op": "ping"})
    errors: list[str] = []

    def worker(i: int) -> None:
        for j in range(20):
            t = _random(5000 + i * 100 + j, i * 100 + j)
            _, got = cli.call(peer, {"op": "echo"}, [t], timeout_s=10)
            if not _same(got[0], t):
                errors.append(f"{i}/{j}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and cli.stream_calls == 160


def test_curve_keeps_to_zmq():
    auth = KVAuth.from_secret("s3cret", "curve")
    handler = Recorder()
    with served(handler, {"auth": auth}, auth=auth) as (srv, cli, peer):
        cli.call(peer, {"op": "ping"})
        cli.call(peer, {"op": "keep"}, [_random(10, 1)])
        assert cli.stream_calls == 0 and srv._stream_server is None  # encryption: zmq only


def test_an_unreachable_stream_is_not_tried_again_until_the_peer_moves(pair, monkeypatch):
    srv, cli, peer, handler = pair
    with socket.socket() as s:  # a port nothing listens on (a firewalled one looks the same, slower)
        s.bind((HOST, 0))
        dead = s.getsockname()[1]
    real = srv._stream_server.port
    srv._stream_server.port = dead  # what the server's replies name
    connects: list[int] = []
    create = socket.create_connection
    monkeypatch.setattr(socket, "create_connection", lambda addr, **kw: connects.append(addr[1]) or create(addr, **kw))
    for _ in range(4):
        reply, _ = cli.call(peer, {"op": "keep"}, [_random(10, 1)])
        assert reply["ok"]
    assert connects == [dead] and cli.stream_calls == 0 and handler.calls == 4  # tried once, then zmq
    srv._stream_server.port = real  # the peer moved (as after a restart): tried again, and used
    cli.call(peer, {"op": "ping"})
    cli.call(peer, {"op": "ping"})
    assert connects == [dead, real] and cli.stream_calls == 1


def test_a_server_at_its_connection_cap_sends_callers_to_zmq(pair, monkeypatch):
    srv, cli, peer, handler = pair
    monkeypatch.setattr(stream, "MAX_CONNECTIONS", 1)
    cli.call(peer, {"op": "ping"})
    cli.call(peer, {"op": "ping"})  # holds the one connection (pooled, idle)
    assert cli.stream_calls == 1
    other = TcpTransport()
    try:
        other.call(peer, {"op": "ping"})
        t = _random(100, 9)
        reply, _ = other.call(peer, {"op": "keep"}, [t])
        assert reply["ok"] and other.stream_calls == 0 and _same(handler.held[-1][0], t)  # served once, over zmq
    finally:
        other.close()
    cli.call(peer, {"op": "ping"})
    assert cli.stream_calls == 2  # the first client's connection is untouched

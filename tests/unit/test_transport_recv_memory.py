"""The byte stream's receive path (connector/transport/stream.py: ``read_head``, ``read_tensors``,
``RecvMemory``) over real loopback TCP sockets: a message trickling in pieces arrives whole, a
peer closing mid-frame gives the memory back and exposes nothing, a size over the bound is
refused before any memory is taken, and reused memory never shows a byte of an earlier
message. Then, two processes: the receiver's RSS stays flat and it takes next to no page faults
over many transfers (``scripts/bench_recv_memory.py``; the script runs 1,000)."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch

from connector.transport import TcpTransport, TransportError, stream
from connector.transport.wire import TensorSpec, decode_header

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]


def _bytes(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def _specs(*sizes: int) -> list[TensorSpec]:
    return [TensorSpec(torch.uint8, (n,), n) for n in sizes]


@contextlib.contextmanager
def _tcp_pair():
    """(sender, receiver): a connected pair of plain TCP sockets on loopback."""
    with socket.create_server((HOST, 0)) as lsock:
        a = socket.create_connection(lsock.getsockname(), timeout=5)
        b, _ = lsock.accept()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _trickle(sock: socket.socket, data: bytes, piece: int, pause_s: float = 0.0005) -> None:
    """Send ``data`` in pieces of ``piece`` bytes, so the receiver sees short reads."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(0, len(data), piece):
        sock.sendall(data[i:i + piece])
        if pause_s:
            time.sleep(pause_s)


def _in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def test_a_message_arriving_in_pieces_is_read_whole():
    header = msgpack.packb({"op": "put", "tensors": [], "_id": 7})
    parts = [_bytes(70_001, 1), _bytes(3, 2), _bytes(0, 3), _bytes(131_072, 4)]
    wire = b"".join(bytes(p) for p in stream.message(stream.REQUEST, b"t" * 8, b"a" * 40, header, ()))
    wire += b"".join(p.numpy().tobytes() for p in parts)
    mem = stream.RecvMemory(1 << 20)
    with _tcp_pair() as (tx, rx):
        t = _in_thread(_trickle, tx, wire, 997)  # pieces cut across the prefix, header and frames
        deadline = time.monotonic() + 20
        head = stream.read_head(rx, deadline)
        got = stream.read_tensors(rx, _specs(*(p.numel() for p in parts)), deadline, mem)
        t.join(10)
    assert (head.kind, head.token, head.auth, head.header) == (stream.REQUEST, b"t" * 8, b"a" * 40, header)
    assert [g.numel() for g in got] == [p.numel() for p in parts]
    assert all(torch.equal(g, p) for g, p in zip(got, parts))
    assert mem.fresh == 0 and mem.lent_bytes > 0
    del got
    assert mem.lent_bytes == 0


def test_a_peer_closing_mid_frame_exposes_nothing_and_gives_the_memory_back():
    mem = stream.RecvMemory(1 << 20)
    first = _bytes(200_000, 5)
    with _tcp_pair() as (tx, rx):
        tx.sendall(first.numpy().tobytes()[:150_000])  # 150 of 200 kB, then gone
        tx.close()
        with pytest.raises(stream.StreamClosed, match="mid-message"):
            stream.read_tensors(rx, _specs(100_000, 100_000), time.monotonic() + 10, mem)
    assert mem.lent_bytes == 0 and mem.fresh == 0
    with _tcp_pair() as (tx, rx):
        tx.close()  # nothing at all: closed between messages, not mid-message
        with pytest.raises(stream.StreamClosed, match="between messages"):
            stream.read_head(rx, time.monotonic() + 10)


def test_a_stalled_peer_ends_at_the_deadline_and_gives_the_memory_back():
    mem = stream.RecvMemory(1 << 20)
    with _tcp_pair() as (tx, rx):
        tx.sendall(bytes(1000))  # then nothing more
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            stream.read_tensors(rx, _specs(50_000), time.monotonic() + 0.3, mem)
        assert time.monotonic() - t0 < 5.0
    assert mem.lent_bytes == 0


def test_a_peer_that_stops_reading_ends_a_send_at_its_deadline():
    """Sends block in the kernel (SO_SNDTIMEO) rather than poll: still bounded by the deadline."""
    big = _bytes(64 << 20, 10)  # far more than the two socket buffers hold
    with _tcp_pair() as (tx, rx):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            stream.send_parts(tx, [big.numpy()], time.monotonic() + 0.3)
        assert time.monotonic() - t0 < 5.0


def test_reused_memory_never_shows_an_earlier_message():
    """Each message lands where the one before it did (the memory is reused), and what the
    receiver sees is exactly its own bytes: not the tail of a longer earlier one, nor what a
    message cut off mid-frame had written there."""
    mem = stream.RecvMemory(1 << 20)
    with _tcp_pair() as (tx, rx):
        old = torch.full((300_000,), 0xAA, dtype=torch.uint8)
        tx.sendall(old.numpy().tobytes())
        (a,) = stream.read_tensors(rx, _specs(300_000), time.monotonic() + 10, mem)
        where = a.data_ptr()
        assert torch.equal(a, old)
        del a
        new = [_bytes(1000, 6), _bytes(0, 7), _bytes(4097, 8)]
        tx.sendall(b"".join(p.numpy().tobytes() for p in new))
        got = stream.read_tensors(rx, _specs(1000, 0, 4097), time.monotonic() + 10, mem)
        assert got[0].data_ptr() == where  # the same memory again
        assert all(torch.equal(g, p) for g, p in zip(got, new))
        assert [g.numel() for g in got] == [1000, 0, 4097]  # nothing of the 0xAA tail exposed
        del got
    with _tcp_pair() as (tx, rx):  # a message cut off after writing 0x55 into the region
        tx.sendall(bytes([0x55]) * 2000)
        tx.close()
        with pytest.raises(stream.StreamClosed):
            stream.read_tensors(rx, _specs(10_000), time.monotonic() + 10, mem)
    with _tcp_pair() as (tx, rx):
        last = _bytes(10_000, 9)
        tx.sendall(last.numpy().tobytes())
        (c,) = stream.read_tensors(rx, _specs(10_000), time.monotonic() + 10, mem)
        assert c.data_ptr() == where and torch.equal(c, last)
    assert mem.fresh == 0


def test_memory_a_message_cannot_have_is_a_transport_error():
    """A transport without max_msg_bytes takes fresh memory for what does not fit the reused
    one; a size no machine has (announced by a peer) fails as a TransportError, which callers
    handle, not a MemoryError escaping ``call``."""
    mem = stream.RecvMemory(1 << 16)
    with pytest.raises(TransportError, match="no memory"):
        mem.lend(1 << 60)
    assert mem.lent_bytes == 0


# ---------------------------------------------------------------------------- through the transport


class _Keeper:
    def __init__(self) -> None:
        self.held: list[list[torch.Tensor]] = []
        self.calls = 0

    def __call__(self, header, tensors):
        self.calls += 1
        if header.get("op") == "keep":
            self.held.append(tensors)
        if header.get("op") == "give":
            return {}, [_bytes(header["n"], 11)]
        return {}, []


@contextlib.contextmanager
def _served(server: dict | None = None, client: dict | None = None):
    handler = _Keeper()
    srv = TcpTransport(**(server or {}))
    srv.start(HOST, 0, handler)
    cli = TcpTransport(**(client or {}))
    try:
        peer = f"{HOST}:{srv.bound_port}"
        cli.call(peer, {"op": "ping"})  # learns the stream
        yield srv, cli, peer, handler
    finally:
        cli.close()
        srv.close()


def _hello(port: int, token: bytes) -> socket.socket:
    s = socket.create_connection((HOST, port), timeout=5)
    deadline = time.monotonic() + 5
    stream.send_parts(s, stream.message(stream.HELLO, token, None, b"", ()), deadline)
    assert stream.read_head(s, deadline).kind == stream.REPLY
    return s


def _request(token: bytes, tensors: list[dict]) -> bytes:
    """A request's prefix and header as a client writes them, announcing ``tensors``."""
    hdr = msgpack.packb({"op": "keep", "tensors": tensors, "_id": 1})
    return stream.message(stream.REQUEST, token, None, hdr, ())[0]


def test_a_huge_announced_size_is_refused_before_any_memory_is_taken():
    with _served({"max_msg_bytes": 1 << 20}) as (srv, cli, peer, handler):
        port, token = cli._stream_at[peer]
        for shape in ([1 << 40], [1 << 20, 1 << 20], [(1 << 20) + 1]):  # 1 TiB, 1 TiB, one byte over
            with _hello(port, token) as s:
                stream.send_parts(s, [_request(token, [{"dtype": "uint8", "shape": shape}])], time.monotonic() + 5)
                reply = decode_header(stream.read_head(s, time.monotonic() + 5).header)
                assert reply["refused"] == "oversized"
        assert srv.refusals()["oversized"] == 3 and handler.calls == 1
        mem = srv._recv_memory
        assert mem._buf is None and mem.fresh == 0 and mem.lent_bytes == 0  # nothing reserved, nothing lent


def test_a_reply_over_the_clients_bound_is_refused_before_any_memory_is_taken():
    with _served(client={"max_msg_bytes": 1 << 16}) as (srv, cli, peer, handler):
        cli.call(peer, {"op": "give", "n": 1000})
        assert cli.stream_calls == 1
        with pytest.raises(TransportError, match="over"):
            cli.call(peer, {"op": "give", "n": 1 << 17})
        mem = cli._recv_memory
        assert mem.lent_bytes == 0 and mem.fresh == 0


def test_a_sender_gone_mid_frame_never_reaches_the_handler_and_the_next_call_reuses_the_memory():
    with _served() as (srv, cli, peer, handler):
        first = _bytes(100_000, 12)
        cli.call(peer, {"op": "keep"}, [first])
        where = handler.held[0][0].data_ptr()
        handler.held.clear()
        port, token = cli._stream_at[peer]
        with _hello(port, token) as s:
            stream.send_parts(s, [_request(token, [{"dtype": "uint8", "shape": [100_000]}]), bytes([0x55]) * 60_000],
                              time.monotonic() + 5)
        mem = srv._recv_memory
        deadline = time.monotonic() + 10
        while (mem.lent_bytes or len(srv._stream_server._conns) > 1) and time.monotonic() < deadline:
            time.sleep(0.01)  # its connection's thread sees the close
        assert mem.lent_bytes == 0 and handler.calls == 2
        second = _bytes(100_000, 13)
        cli.call(peer, {"op": "keep"}, [second])
        got = handler.held[0][0]
        assert handler.calls == 3 and got.data_ptr() == where and torch.equal(got, second)
        assert mem.fresh == 0


# ---------------------------------------------------------------------------- two processes, many transfers


def _bench():
    name = "bench_recv_memory"
    if name not in sys.modules:  # registered first: its dataclass looks its module up
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "bench_recv_memory.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("direction", ["put", "get"])
def test_the_receivers_memory_stays_flat_and_takes_no_page_faults_over_many_transfers(direction):
    """40 MiB a transfer in one frame, the receiver holding one payload as D's buffer does.
    Memory taken fresh per message faults it in anew every time: ~10,240 faults a transfer
    over zmq (libzmq's malloc: over glibc's largest mmap threshold, 32 MiB, a fresh mmap), ~530
    with a fresh numpy array per message (huge pages); reused memory, none after the warm-up.
    RSS stays flat either way (the fresh memory is freed): the faults are what tell them apart."""
    # The receiver's start (torch's import) took over 60 s at load 30 on 2 cores: 240 s.
    r = _bench().measure("stream", direction, transfers=40, mib=40, tensors=1, hold=1, warmup=5, start_timeout=240)
    assert r.stream_calls >= 45 and r.fresh == 0
    assert r.rss_growth_mib < 40, r  # flat after the warm-up: not one payload's worth more
    # A few a transfer at most (the checkpoints' own calls fault a little), 0.0-0.1 measured.
    assert r.faults_per_transfer < 50, r

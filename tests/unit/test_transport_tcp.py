"""TcpTransport over real sockets on 127.0.0.1 (in-process and across two processes)."""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq

from connector.transport import TcpTransport, TransportError, make_transport
from tests.support.ports import dead_port

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sha(tensors) -> list[str]:
    return [hashlib.sha256(_bytes(t)).hexdigest() for t in tensors]


def _random_tensor(shape, dtype, gen) -> torch.Tensor:
    """Random bit patterns (NaNs, infs, denormals included): only byte identity counts."""
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _echo(header, tensors):
    return {"echo": header, "n": len(tensors)}, tensors


@pytest.fixture
def server():
    srv = TcpTransport()
    srv.start(HOST, 0, _echo)
    yield srv, f"{HOST}:{srv.bound_port}"
    srv.close()


@pytest.fixture
def client():
    cli = make_transport("tcp")
    yield cli
    cli.close()


def test_roundtrip_dtypes_shapes_and_views(server, client):
    _, peer = server
    gen = torch.Generator().manual_seed(0)
    shapes = [(), (0,), (1,), (7,), (3, 5, 2), (4, 2, 16, 64), (2, 3, 40, 70)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int8):
        sent = [_random_tensor(s, dtype, gen) for s in shapes]
        big = _random_tensor((6, 4, 16, 64), dtype, gen)
        sent += [
            big[:, 1],  # strided slice
            big.transpose(1, 3),  # permuted
            big[::2, :, 3:9],  # stepped
            big[0, 0, 0].expand(5, 64),  # stride-0 broadcast
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch's non-writable-buffer warning
            reply, got = client.call(peer, {"dtype": str(dtype)}, sent)
        assert reply == {"echo": {"dtype": str(dtype)}, "n": len(sent), "ok": True}
        assert len(got) == len(sent)
        for a, b in zip(sent, got):
            assert b.dtype == a.dtype and b.shape == a.shape
            assert b.is_contiguous()
            assert _bytes(a) == _bytes(b)


def test_multi_block_gather_put_and_get(client):
    """KV-like use: gather blocks on one side, scatter them into another cache, read back."""
    gen = torch.Generator().manual_seed(1)
    src = [torch.randn(32, 2, 16, 64, generator=gen).to(torch.bfloat16) for _ in range(3)]
    dst = [torch.zeros_like(t) for t in src]

    def handler(header, tensors):
        ids = torch.tensor(header["dst_blocks"])
        if header["op"] == "put":
            for cache, blocks in zip(dst, tensors):
                cache[ids] = blocks
            return {}, []
        return {}, [cache[ids] for cache in dst]

    srv = TcpTransport()
    srv.start(HOST, 0, handler)
    try:
        peer = f"{HOST}:{srv.bound_port}"
        src_ids, dst_ids = [3, 17, 4, 30, 0], [9, 1, 2, 31, 20]
        reply, _ = client.call(peer, {"op": "put", "dst_blocks": dst_ids}, [c[src_ids] for c in src])
        assert reply == {"ok": True}
        for s, d in zip(src, dst):
            assert torch.equal(d[dst_ids].view(torch.int16), s[src_ids].view(torch.int16))
            mask = torch.ones(32, dtype=torch.bool)
            mask[dst_ids] = False
            assert not d[mask].any()
        _, back = client.call(peer, {"op": "get", "dst_blocks": dst_ids})
        for s, b in zip(src, back):
            assert _bytes(b) == _bytes(s[src_ids])
    finally:
        srv.close()


_SERVER_SCRIPT = """
import hashlib, sys, torch
from connector.transport import TcpTransport
def handler(header, tensors):
    hashes = [hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest() for t in tensors]
    if header.get("op") == "stop":
        stop.append(1)
    return {"sha256": hashes, "pid": __import__("os").getpid()}, tensors
stop = []
srv = TcpTransport()
srv.start("127.0.0.1", 0, handler)
print(srv.bound_port, flush=True)
deadline = __import__("time").monotonic() + 400
while not stop and __import__("time").monotonic() < deadline:
    __import__("time").sleep(0.05)
srv.close()
"""


@pytest.mark.timeout(600)  # its waits are sized for a box at load 30
def test_two_processes_bit_identical(client):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER_SCRIPT], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        port_line: list[str] = []
        reader = threading.Thread(target=lambda: port_line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=240)  # the child's start (torch's import) took over 60 s at load 30
        why = proc.stderr.read() if proc.poll() is not None else "no port"
        assert port_line and port_line[0].strip().isdigit(), why
        peer = f"{HOST}:{int(port_line[0])}"
        gen = torch.Generator().manual_seed(2)
        payload = [
            _random_tensor((24, 2, 16, 128), torch.bfloat16, gen),  # 1.5 MiB
            _random_tensor((8, 1024, 1024), torch.bfloat16, gen)[:, ::2],  # 8 MiB, strided
            _random_tensor((3, 5), torch.float32, gen),
            _random_tensor((1000,), torch.int8, gen),
        ]
        reply, back = client.call(peer, {"op": "hash"}, payload, timeout_s=60)
        assert reply["ok"] and reply["pid"] == proc.pid
        assert reply["sha256"] == _sha(payload)  # arrived bit-identical
        assert _sha(back) == _sha(payload)  # and came back bit-identical
        reply, _ = client.call(peer, {"op": "stop"}, timeout_s=30)
        assert reply["ok"]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_timeout_then_fresh_socket(client, server):
    """A peer that never answers times out; its late reply can't leak into the next call."""
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port(f"tcp://{HOST}")
    peer = f"{HOST}:{port}"
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="timeout"):
            client.call(peer, {"n": 1}, [torch.arange(10)], timeout_s=0.5)
        assert 0.4 <= time.monotonic() - t0 < 2.0
        # The silent peer did receive the request; answer it late.
        assert silent.poll(2000)
        ident, hdr, _ = silent.recv_multipart()
        late = msgpack.unpackb(hdr)
        silent.send_multipart([ident, msgpack.packb({"late": True, "tensors": [], "_id": late["_id"]})])

        # Next call to the same peer: served by a fresh socket, gets its own reply.
        result: list = []
        th = threading.Thread(target=lambda: result.append(client.call(peer, {"n": 2}, timeout_s=5)))
        th.start()
        assert silent.poll(5000)
        ident2, hdr2 = silent.recv_multipart()
        req = msgpack.unpackb(hdr2)
        assert req["n"] == 2 and ident2 != ident
        silent.send_multipart([ident2, msgpack.packb({"fresh": True, "tensors": [], "_id": req["_id"]})])
        th.join(timeout=5)
        assert result and result[0] == ({"fresh": True}, [])

        # And a live server works right after a timeout.
        _, live = server
        assert client.call(live, {"x": 1})[0]["ok"]
    finally:
        silent.close(linger=0)
        ctx.term()


def test_unreachable_peer(client):
    peer = f"{HOST}:{dead_port()}"
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="unreachable"):
        client.call(peer, {"x": 1}, [torch.ones(4)], timeout_s=0.5)
    assert time.monotonic() - t0 < 5.0  # 0.5 s deadline; slack for a loaded 2-core CI box
    with pytest.raises(TransportError):
        client.call("no-port-here", {"x": 1})


def test_malformed_requests_get_error_replies(server):
    srv, peer = server
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{peer}")
    good_meta = [{"dtype": "float32", "shape": [2]}]
    bad = [
        [b"\xc1not msgpack"],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"tensors": good_meta, "_id": 7})],  # frame missing
        [msgpack.packb({"tensors": [], "_id": 8}), b"extra"],  # frame not announced
        [msgpack.packb({"tensors": good_meta, "_id": 9}), b"\x00" * 7],  # size mismatch
        [msgpack.packb({"tensors": [{"dtype": "complex7", "shape": [1]}]}), b"\x00"],
        # unhashable dtypes once crashed the server thread (found by tests/unit/test_connector_fuzz.py)
        [msgpack.packb({"tensors": [{"dtype": {"a": 1}, "shape": [1]}]}), b"\x00"],
        [msgpack.packb({"tensors": [{"dtype": [1], "shape": [1]}]}), b"\x00"],
        [msgpack.packb({"tensors": [{"dtype": "int8", "shape": [-1]}]}), b""],
        [msgpack.packb({"tensors": "nope"})],
        [msgpack.packb({"_id": "x"})],
    ]
    try:
        for frames in bad:
            sock.send_multipart(frames)
            assert sock.poll(5000), frames
            reply = sock.recv_multipart()
            assert len(reply) == 1
            hdr = msgpack.unpackb(reply[0])
            assert hdr["ok"] is False and "malformed" in hdr["error"], hdr
            assert hdr["tensors"] == []
        # call ids are echoed where the header was readable
        sock.send_multipart([msgpack.packb({"tensors": good_meta, "_id": 42})])
        assert sock.poll(5000)
        assert msgpack.unpackb(sock.recv_multipart()[0])["_id"] == 42
    finally:
        sock.close(linger=0)
        ctx.term()
    # The server thread survived all of it.
    cli = TcpTransport()
    try:
        reply, got = cli.call(peer, {"after": True}, [torch.ones(3)])
        assert reply["ok"] and torch.equal(got[0], torch.ones(3))
    finally:
        cli.close()


def test_concurrent_calls_from_threads(server, client):
    _, peer = server
    errors: list = []

    def worker(k: int) -> None:
        try:
            for i in range(10):
                x = torch.full((k + 1, 257), float(k * 100 + i), dtype=torch.bfloat16)
                reply, got = client.call(peer, {"k": k, "i": i}, [x], timeout_s=10)
                assert reply["echo"] == {"k": k, "i": i}
                assert torch.equal(got[0], x)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_handler_exception_becomes_error_reply(client):
    def handler(header, tensors):
        if header.get("boom"):
            raise KeyError("no such request")
        if header.get("bad_reply"):
            return {"tensors": "reserved"}, []
        return {"fine": True}, []

    srv = TcpTransport()
    srv.start(HOST, 0, handler)
    peer = f"{HOST}:{srv.bound_port}"
    try:
        reply, got = client.call(peer, {"boom": True}, [torch.ones(2)])
        assert reply["ok"] is False and "KeyError" in reply["error"] and got == []
        reply, _ = client.call(peer, {"bad_reply": True})
        assert reply["ok"] is False and "reserved" in reply["error"]
        assert client.call(peer, {}) == ({"fine": True, "ok": True}, [])
    finally:
        srv.close()


def test_received_tensors_outlive_frames_and_are_writable(server, client):
    _, peer = server
    x = torch.arange(100_000, dtype=torch.float32)  # > zmq's copy threshold: zero-copy path
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, (got,) = client.call(peer, {}, [x])
        gc.collect()
        assert torch.equal(got, x)
        got += 1  # private memory: writable without warnings
    assert torch.equal(got, x + 1)
    with pytest.raises(ValueError, match="reserved"):
        client.call(peer, {"tensors": 1})


def test_close_is_prompt_and_idempotent(client):
    srv = TcpTransport()
    srv.start(HOST, 0, _echo)
    peer = f"{HOST}:{srv.bound_port}"
    assert client.call(peer, {})[0]["ok"]
    t0 = time.monotonic()
    srv.close()
    assert time.monotonic() - t0 < 1.5  # not a thread join's 2 s (slack for a loaded box)
    srv.close()  # idempotent
    with pytest.raises(TransportError):
        srv.call(peer, {})
    with pytest.raises(TransportError):
        srv.start(HOST, 0, _echo)
    # the pooled socket to the closed server now just times out
    with pytest.raises(TransportError):
        client.call(peer, {}, timeout_s=0.3)
    t0 = time.monotonic()
    client.close()
    client.close()
    assert time.monotonic() - t0 < 1.5


def test_bind_conflict_raises(server):
    srv, _ = server
    other = TcpTransport()
    try:
        with pytest.raises(TransportError, match="cannot bind"):
            other.start(HOST, srv.bound_port, _echo)
    finally:
        other.close()


def test_receive_is_zero_copy_view_of_the_frame():
    from connector.transport.tcp import _frame_to_tensor

    x = torch.arange(50_000, dtype=torch.float32)
    frame = zmq.Frame(x.numpy().tobytes())
    addr = np.frombuffer(frame.buffer, np.uint8).ctypes.data
    t = _frame_to_tensor(frame, torch.float32, [250, 200])
    if addr % 4 == 0:
        assert t.data_ptr() == addr  # no copy
    del frame
    gc.collect()
    assert torch.equal(t.reshape(-1), x)  # the tensor keeps the frame's memory alive


def test_deferred_replies_leave_the_server_serving():
    """A handler that answers later (a Deferred resolved from another thread): other calls
    are served meanwhile, the late reply reaches its caller (signed, with its call id), and
    one never resolved is dropped after its deadline without holding anything up."""
    from connector.transport import KVAuth
    from connector.transport.base import Deferred

    auth = KVAuth.from_secret("s3cret", "mac")
    held: list[Deferred] = []

    def handler(header, tensors):
        if header.get("op") == "slow":
            # Resolved 3 s later: a fast call answered only after it would take that long.
            d = Deferred(time.monotonic() + 10.0)
            threading.Timer(3.0, d.resolve, ({"late": header["n"]}, [t * 2 for t in tensors])).start()
            return d
        if header.get("op") == "never":
            d = Deferred(time.monotonic() + 0.2)
            held.append(d)
            return d
        return {"now": True}, []

    srv = TcpTransport(auth=auth)
    srv.start(HOST, 0, handler)
    cli = TcpTransport(auth=auth)
    addr = f"{HOST}:{srv.bound_port}"
    try:
        out: dict = {}

        def slow() -> None:
            out["slow"] = cli.call(addr, {"op": "slow", "n": 7}, [torch.arange(4)], timeout_s=10)

        t = threading.Thread(target=slow)
        t.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        reply, _ = cli.call(addr, {"op": "fast"}, timeout_s=5)
        assert reply == {"ok": True, "now": True} and time.monotonic() - t0 < 2.0  # slack for a loaded box
        t.join(30)
        reply, tensors = out["slow"]
        assert reply == {"ok": True, "late": 7} and torch.equal(tensors[0], torch.arange(4) * 2)
        # zmq: the caller times out; the byte stream: the server closes the connection at
        # the reply's deadline (0.2 s), so the caller learns sooner.
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="timeout|closed the connection before replying"):
            cli.call(addr, {"op": "never"}, timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0  # slack for a loaded box; a hang would be unbounded
        held[0].resolve({"too": "late"})  # after its deadline: dropped, nobody waits for it
        reply, _ = cli.call(addr, {"op": "fast"}, timeout_s=1)
        assert reply["now"]
    finally:
        cli.close()
        srv.close()

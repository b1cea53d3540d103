"""NcclTransport over real ZMQ control sockets on 127.0.0.1, with the NCCL library object
replaced by the host-memory double (tests/support/nccl_double.py) — the lowest boundary only.

What runs here is the transport's own code: communicator set-up over the control socket,
rank assignment, serialisation, reply tensors, deadlines, abort and re-creation, the
fallback to inline tensors for peers without NCCL, caps before allocation, and the knobs
that must reach the communicator's config (never the process environment).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from connector.transport import TcpTransport, TransportError
from connector.transport.nccl import NcclTransport
from tests.support.nccl_double import Fabric, FakeNccl, rand_bytes

HOST = "127.0.0.1"
CPU = torch.device("cpu")


def _echo(header, tensors):
    """Echo the call's tensors back (reversed bytes, so a copy is visible) plus their sums."""
    return {"n": len(tensors), "sums": [int(t.view(torch.uint8).sum()) for t in tensors], "op": header.get("op")}, \
        [t.flip(0) if t.dim() else t for t in tensors]


@pytest.fixture
def fabric():
    f = Fabric()
    yield f
    f.close()


def _pair(fabric, handler=_echo, server_lib=None, **kw):
    server = NcclTransport(server_lib or FakeNccl(fabric), CPU, **kw)
    server.start(HOST, 0, handler)
    client = NcclTransport(FakeNccl(fabric), CPU, **kw)
    return client, server, f"{HOST}:{server.bound_port}"


@pytest.fixture
def pair(fabric):
    client, server, addr = _pair(fabric)
    yield client, server, addr
    client.close()
    server.close()


def test_tensors_move_over_nccl_and_back(pair):
    client, server, addr = pair
    a = rand_bytes(1 << 20, 1).view(torch.bfloat16).reshape(256, 2048)
    b = rand_bytes(4096, 2)
    reply, tensors = client.call(addr, {"op": "put"}, [a, b], timeout_s=10)
    assert reply["ok"] and reply["n"] == 2 and reply["op"] == "put"
    assert reply["sums"] == [int(a.view(torch.uint8).sum()), int(b.sum())]
    # The reply tensors came back over the communicator (the control reply had none).
    assert tensors[0].dtype == torch.bfloat16 and tensors[0].shape == a.shape
    assert torch.equal(tensors[0].view(torch.uint8), a.flip(0).view(torch.uint8))
    assert torch.equal(tensors[1], b.flip(0))
    assert server._lib.recv_bytes == a.numel() * 2 + b.numel()
    assert client._lib.recv_bytes == server._lib.recv_bytes
    # One communicator, created by the caller (rank 0), reused by later calls.
    client.call(addr, {"op": "again"}, [b], timeout_s=5)
    assert client.communicators() == {"out": 1, "in": 0}
    assert server.communicators() == {"out": 0, "in": 1}


def test_calls_without_tensors_and_non_contiguous_inputs(pair):
    client, _, addr = pair
    reply, tensors = client.call(addr, {"op": "ping"}, timeout_s=5)
    assert reply["ok"] and reply["n"] == 0 and tensors == []
    base = rand_bytes(64 * 64, 3).reshape(64, 64)
    strided = base.t()  # not contiguous: sent as a contiguous copy
    _, tensors = client.call(addr, {"op": "x"}, [strided, torch.empty(0, dtype=torch.uint8)], timeout_s=5)
    assert torch.equal(tensors[0], strided.flip(0))
    assert tensors[1].numel() == 0


def test_concurrent_callers_share_one_communicator_in_order(pair):
    client, _, addr = pair
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(5):
                t = rand_bytes(10_000 + seed * 7 + i, seed * 100 + i)
                reply, back = client.call(addr, {"op": "w"}, [t], timeout_s=10)
                assert reply["sums"] == [int(t.sum())] and torch.equal(back[0], t.flip(0))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert client.communicators()["out"] == 1


def test_num_channels_reaches_the_communicator_config_not_the_environment(fabric):
    before = dict(os.environ)
    client, server, addr = _pair(fabric, num_channels=4)
    try:
        client.call(addr, {"op": "x"}, [rand_bytes(100, 1)], timeout_s=5)
        configs = client._lib.configs + server._lib.configs
        assert len(configs) == 2
        assert all(c.num_channels == 4 and c.blocking is False for c in configs)
        assert dict(os.environ) == before
    finally:
        client.close()
        server.close()


def test_peer_dying_mid_transfer_fails_the_call_by_its_deadline(fabric):
    """The server's library freezes (a dead process): the caller's send is never matched.
    The call must fail at its deadline and the communicator be aborted, never hang."""
    client, server, addr = _pair(fabric)
    try:
        client.call(addr, {"op": "warm"}, [rand_bytes(10, 1)], timeout_s=5)  # communicator up
        server._lib.kill()  # from now on nothing on the server side progresses
        t0 = time.monotonic()
        # The server's receive gives up just before the caller's deadline and says so: the
        # call is resent inline (its handler never saw it) in what time is left, or fails;
        # it never hangs.
        try:
            reply, back = client.call(addr, {"op": "put"}, [rand_bytes(1 << 16, 2)], timeout_s=1.0)
            assert reply["ok"] and torch.equal(back[0], rand_bytes(1 << 16, 2).flip(0))
        except TransportError:
            pass
        assert time.monotonic() - t0 < 3.0
        assert client.aborted >= 1 and client.communicators()["out"] == 0
    finally:
        client.close()
        server.close()


def test_server_side_wait_is_bounded_when_the_caller_dies(fabric):
    """The caller posts its control message but its sends never run (its library is dead):
    the server must give up at the call's budget, abort, and keep serving others."""
    client, server, addr = _pair(fabric, max_wait_s=1.0)
    try:
        client.call(addr, {"op": "warm"}, [rand_bytes(10, 1)], timeout_s=5)
        client._lib.kill()
        t0 = time.monotonic()
        reply, back = client.call(addr, {"op": "put"}, [rand_bytes(1 << 12, 2)], timeout_s=6.0)
        # The server gave up at its max_wait_s (not the caller's 6 s) and said its receive
        # failed: the call was resent inline and served.
        assert reply["ok"] and torch.equal(back[0], rand_bytes(1 << 12, 2).flip(0))
        assert time.monotonic() - t0 < 4.0  # 1 s, with slack for a loaded box
        deadline = time.monotonic() + 3
        while server.communicators()["in"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.communicators()["in"] == 0
        # The server still serves a healthy caller.
        other = NcclTransport(FakeNccl(fabric), CPU)
        try:
            reply, back = other.call(addr, {"op": "x"}, [rand_bytes(50, 3)], timeout_s=5)
            assert reply["ok"] and torch.equal(back[0], rand_bytes(50, 3).flip(0))
        finally:
            other.close()
    finally:
        client.close()
        server.close()


def test_set_up_with_a_peer_that_never_joins_times_out_and_aborts(fabric):
    """The set-up gives up at init_timeout_s and aborts its half-made communicator; the
    call that waited for it goes inline (through host memory) within its own time."""
    client, server, addr = _pair(fabric, server_lib=FakeNccl(fabric, join=False), init_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        reply, back = client.call(addr, {"op": "x"}, [rand_bytes(10, 1)], timeout_s=5)
        assert reply["ok"] and torch.equal(back[0], rand_bytes(10, 1).flip(0))
        assert time.monotonic() - t0 < 2.0
        assert server._lib.recv_bytes == 0 and client.communicators()["out"] == 0
        deadline = time.monotonic() + 30
        while (client._lib.aborts, server._lib.aborts) != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (client._lib.aborts, server._lib.aborts) == (1, 1)  # the server's: bye, or its reaper
    finally:
        client.close()
        server.close()


def test_communicator_is_recreated_after_the_peer_restarts(fabric):
    server = NcclTransport(FakeNccl(fabric), CPU)
    server.start(HOST, 0, _echo)
    port = server.bound_port
    client = NcclTransport(FakeNccl(fabric), CPU)
    addr = f"{HOST}:{port}"
    try:
        client.call(addr, {"op": "x"}, [rand_bytes(10, 1)], timeout_s=5)
        server.close()
        server = NcclTransport(FakeNccl(fabric), CPU)  # same address, knows no communicator
        server.start(HOST, port, _echo)
        reply, back = client.call(addr, {"op": "y"}, [rand_bytes(20, 2)], timeout_s=5)
        assert reply["ok"] and torch.equal(back[0], rand_bytes(20, 2).flip(0))
        assert client.aborted == 1  # the old one, found broken (or told "unknown communicator")
    finally:
        client.close()
        server.close()


def test_tensor_caps_are_checked_before_allocation(fabric):
    client, server, addr = _pair(fabric, max_msg_bytes=1000, max_frames=3)
    try:
        reply, _ = client.call(addr, {"op": "big"}, [rand_bytes(2000, 1)], timeout_s=5)
        assert not reply["ok"] and "cap" in reply["error"]
        reply, _ = client.call(addr, {"op": "many"}, [rand_bytes(1, i) for i in range(5)], timeout_s=5)
        assert not reply["ok"] and "cap" in reply["error"]
        # Refused calls cost their communicator (unmatched sends), not the transport.
        reply, back = client.call(addr, {"op": "ok"}, [rand_bytes(100, 2)], timeout_s=5)
        assert reply["ok"] and torch.equal(back[0], rand_bytes(100, 2).flip(0))
    finally:
        client.close()
        server.close()


def test_forged_tensor_metas_are_refused(fabric):
    """A hand-written control message naming a communicator with bogus shapes."""
    client, server, addr = _pair(fabric)
    raw = TcpTransport()
    try:
        client.call(addr, {"op": "x"}, [rand_bytes(10, 1)], timeout_s=5)
        cid = next(iter(server._in))
        for metas in ([{"dtype": "complex128", "shape": [1]}], [{"dtype": "uint8", "shape": [-1]}], "x"):
            reply, _ = raw.call(addr, {"op": "x", "_nccl": {"cid": cid, "metas": metas}}, timeout_s=5)
            assert not reply["ok"]
        reply, _ = raw.call(addr, {"op": "x", "_nccl": {"cid": "nope", "metas": []}}, timeout_s=5)
        assert not reply["ok"] and "unknown nccl communicator" in reply["error"]
        reply, _ = raw.call(addr, {"op": "_nccl_init", "cid": "c", "uid": b"short"}, timeout_s=5)
        assert not reply["ok"] and "malformed" in reply["error"]
        reply, _ = raw.call(addr, {"op": "_nccl_hello", "version": 7}, timeout_s=5)
        assert not reply["ok"] and reply["no_nccl"]
    finally:
        raw.close()
        client.close()
        server.close()


def test_reserved_header_keys_are_refused_at_the_caller(pair):
    client, _, addr = pair
    with pytest.raises(ValueError):
        client.call(addr, {"op": "x", "_nccl": {}}, timeout_s=1)


def test_peer_without_nccl_gets_tensors_inline(fabric):
    """A tcp-only peer (its handler does not know the hello): tensors go over the control
    socket through host memory, and the caller does not ask again for every call."""
    plain = TcpTransport()
    plain.start(HOST, 0, lambda h, t: ({"ok": False, "unknown_op": True, "error": "unknown op"}, [])
                if h.get("op") == "_nccl_hello" else _echo(h, t))
    client = NcclTransport(FakeNccl(fabric), CPU)
    addr = f"{HOST}:{plain.bound_port}"
    try:
        for seed in range(3):
            reply, back = client.call(addr, {"op": "x"}, [rand_bytes(100, seed)], timeout_s=5)
            assert reply["ok"] and torch.equal(back[0], rand_bytes(100, seed).flip(0))
        assert client.communicators()["out"] == 0 and client._lib.configs == []
    finally:
        client.close()
        plain.close()


def test_unreachable_peer_fails_within_the_deadline(fabric):
    client = NcclTransport(FakeNccl(fabric), CPU)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            client.call(f"{HOST}:1", {"op": "x"}, [rand_bytes(10, 1)], timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0  # slack for a loaded box; no deadline would hang
    finally:
        client.close()


def test_reply_tensors_never_taken_are_reaped(fabric):
    """A caller that gives up after the server enqueued its reply tensors: the server's
    pending sends are reaped and the communicator aborted, not left blocking its stream."""
    slow_reply = threading.Event()

    def handler(header, tensors):
        return {}, [rand_bytes(1000, 5)]

    client, server, addr = _pair(fabric, handler=handler, max_wait_s=0.3)
    try:
        client.call(addr, {"op": "warm"}, timeout_s=5)
        client._lib.kill()  # the caller's receive never runs
        with pytest.raises(TransportError):
            client.call(addr, {"op": "get"}, timeout_s=0.5)
        deadline = time.monotonic() + 3
        while server.communicators()["in"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.communicators()["in"] == 0
    finally:
        slow_reply.set()
        client.close()
        server.close()


def test_caller_retries_once_when_the_peer_forgot_the_communicator(pair):
    """The peer lost its side without an error reaching ours (e.g. restarted at once): it
    answers "unknown communicator", the caller aborts its side and sets up a new one."""
    client, server, addr = pair
    client.call(addr, {"op": "x"}, [rand_bytes(10, 1)], timeout_s=5)
    with server._lock:
        server._in.clear()  # forgotten, not aborted
    reply, back = client.call(addr, {"op": "y"}, [rand_bytes(30, 2)], timeout_s=5)
    assert reply["ok"] and torch.equal(back[0], rand_bytes(30, 2).flip(0))
    assert client.aborted == 1 and client.communicators()["out"] == 1


def test_engine_and_transports_import_without_vllm():
    """The GPU machine has torch and NCCL but no vLLM: the worker engine, the transports
    and the layouts (what the GPU tests and benchmarks run) must import without it."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['vllm'] = None\n"
            "import connector.p2p.engine, connector.layout, connector.transport.nccl, connector.transport.nccl_api\n"
            "from connector.transport import make_transport\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_library_failure_at_set_up_sends_inline(fabric):
    """NCCL refusing to create a communicator here (e.g. out of resources): the call goes
    inline, never a stray exception, and the set-up is not tried again for every call."""
    from connector.transport.nccl_api import NcclError

    class Refusing(FakeNccl):
        def init_rank(self, *a, **kw):
            self.init_calls = getattr(self, "init_calls", 0) + 1
            raise NcclError(2, "system error")

    server = NcclTransport(FakeNccl(fabric), CPU)
    server.start(HOST, 0, _echo)
    client = NcclTransport(Refusing(fabric), CPU)
    try:
        for seed in range(3):
            reply, back = client.call(f"{HOST}:{server.bound_port}", {"op": "x"}, [rand_bytes(10, seed)], timeout_s=5)
            assert reply["ok"] and torch.equal(back[0], rand_bytes(10, seed).flip(0))
        assert client._lib.init_calls == 1 and server._lib.recv_bytes == 0
    finally:
        client.close()
        server.close()

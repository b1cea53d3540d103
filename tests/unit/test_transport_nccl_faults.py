"""The nccl transport's failure paths, on the host-memory NCCL double (tests/support/nccl_double.py),
one test (at least) per defect of issue 20's review: set-up budget, clean-up of incoming
communicators, unique ids, freed communicators and buffers, abort off the serving thread
with a deadline, a server that keeps answering during a long receive, NCCL versions.

Every wait here is bounded; the double counts what a GPU would not show until it crashed:
calls on a communicator after its abort returned (``freed_handle_uses``), memory let go of
while NCCL could still use it (``freed_buffer_uses``), unique ids whose bootstrap never
completed (``Fabric.open_bootstraps``). ``p2p`` fabrics model a single-node pair over
P2P/SHM, where an abort or a death on one side is never seen by the other.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest
import torch

from connector.transport import TcpTransport, TransportError
from connector.transport.nccl import NcclTransport
from tests.support.nccl_double import Fabric, FakeNccl, rand_bytes, until

HOST = "127.0.0.1"
CPU = torch.device("cpu")


def _echo(header, tensors):
    return {"n": len(tensors), "sums": [int(t.view(torch.uint8).sum()) for t in tensors]}, \
        [t.flip(0) for t in tensors]


@pytest.fixture(params=[True, False], ids=["socket", "p2p"])
def fabric(request):
    f = Fabric(abort_reaches_peer=request.param)
    yield f
    f.close()


@pytest.fixture
def closing():
    """Transports (and gates) to close at the end, whatever happened."""
    items: list = []
    yield items
    for x in items:
        if isinstance(x, threading.Event):
            x.set()
    for x in items:
        if not isinstance(x, threading.Event):
            x.close()


def _server(fabric, closing, handler=_echo, lib=None, **kw) -> tuple[NcclTransport, str]:
    server = NcclTransport(lib or FakeNccl(fabric), CPU, **kw)
    server.start(HOST, 0, handler)
    closing.append(server)
    return server, f"{HOST}:{server.bound_port}"


def _client(fabric, closing, lib=None, serve: bool = False, **kw) -> NcclTransport:
    client = NcclTransport(lib or FakeNccl(fabric), CPU, **kw)
    if serve:  # a client with an address of its own (a prefill's engine has one)
        client.start(HOST, 0, _echo)
    closing.append(client)
    return client


def _no_freed_use(*transports: NcclTransport) -> None:
    for t in transports:
        assert t._lib.freed_handle_uses == 0, "a communicator was used after its abort"
        assert t._lib.freed_buffer_uses == 0, "memory was freed while NCCL could still use it"


# ---------------------------------------------------------------- 1: set-up budget


def test_a_slow_set_up_gets_its_own_budget_and_short_calls_still_answer(fabric, closing):
    """A cold NCCL init of 2.5 s: the producer's hello (2 s) and probe (1 s) must not fail
    because of it (the peer would be marked dead), and the set-up must still finish on
    init_timeout_s, after which tensors go over NCCL."""
    server, addr = _server(fabric, closing, lib=FakeNccl(fabric, init_delay_s=2.5), init_timeout_s=10)
    client = _client(fabric, closing, lib=FakeNccl(fabric, init_delay_s=2.5), init_timeout_s=10)
    t0 = time.monotonic()
    reply, _ = client.call(addr, {"op": "hello"}, timeout_s=2.0)
    assert reply["ok"] and time.monotonic() - t0 < 2.0
    t1 = time.monotonic()
    reply, _ = client.call(addr, {"op": "ping"}, timeout_s=1.0)
    assert reply["ok"] and time.monotonic() - t1 < 1.0
    assert until(lambda: client.communicators()["out"] == 1, 8.0)
    t = rand_bytes(5000, 1)
    reply, back = client.call(addr, {"op": "x"}, [t], timeout_s=5)
    assert reply["sums"] == [int(t.sum())] and torch.equal(back[0], t.flip(0))
    assert server._lib.recv_bytes == t.numel()  # over the communicator, not inline
    _no_freed_use(client, server)


def test_a_call_during_set_up_waits_at_most_half_its_budget_then_goes_inline(fabric, closing):
    server, addr = _server(fabric, closing, lib=FakeNccl(fabric, init_delay_s=3.0), init_timeout_s=10)
    client = _client(fabric, closing, init_timeout_s=10)
    t = rand_bytes(3000, 2)
    t0 = time.monotonic()
    # 2 s: half of it (1 s) for the set-up, the rest inline, which a loaded box needs (1 s was tight).
    reply, back = client.call(addr, {"op": "x"}, [t], timeout_s=2.0)
    assert reply["ok"] and torch.equal(back[0], t.flip(0))
    assert 0.9 < time.monotonic() - t0 < 2.0
    assert server._lib.recv_bytes == 0  # inline, over the control socket


# ---------------------------------------------------------------- 2: incoming clean-up


def test_failed_set_ups_leave_no_incoming_communicator(fabric, closing):
    """Four callers whose set-up never completes (their NCCL never joins): the server must
    not keep their half-made communicators (threads, sockets, device memory on a GPU)."""
    server, addr = _server(fabric, closing, init_timeout_s=0.5)
    for i in range(4):
        client = _client(fabric, closing, lib=FakeNccl(fabric, join=False), init_timeout_s=0.5)
        try:
            client.call(addr, {"op": "x"}, [rand_bytes(10, i)], timeout_s=2.0)
        except TransportError:
            pass
    assert until(lambda: len(server._in) == 0, 3.0), f"server still holds {len(server._in)}"
    assert until(lambda: server._lib.aborts == 4)
    _no_freed_use(server)


def test_a_new_set_up_from_the_same_caller_replaces_its_old_communicator(fabric, closing):
    """The caller dropped its side (an abort that never reaches us over P2P/SHM, or it
    restarted at the same address): its next set-up replaces the old one here."""
    server, addr = _server(fabric, closing)
    client = _client(fabric, closing, serve=True)
    client.call(addr, {"op": "x"}, [rand_bytes(10, 1)], timeout_s=5)
    (old,) = list(server._in.values())
    comm = client._out[addr]
    client._abort(comm, "test: dropped on the caller's side")
    client.call(addr, {"op": "y"}, [rand_bytes(10, 2)], timeout_s=5)
    assert until(lambda: old.broken is not None and len(server._in) == 1)
    _no_freed_use(client, server)


# ---------------------------------------------------------------- 3 and 8: unique ids, versions


def test_no_unique_id_is_made_for_a_peer_without_nccl(fabric, closing):
    """ncclGetUniqueId starts a bootstrap thread and socket that stay until both ranks
    joined: asking a tcp-only peer (again every retry period) must not make one."""
    plain = TcpTransport()
    plain.start(HOST, 0, lambda h, t: ({"ok": False, "unknown_op": True, "error": "unknown op"}, [])
                if str(h.get("op", "")).startswith("_nccl") else _echo(h, t))
    closing.append(plain)
    client = _client(fabric, closing, retry_s=0.0)  # asks again every call
    for seed in range(3):
        reply, back = client.call(f"{HOST}:{plain.bound_port}", {"op": "x"}, [rand_bytes(100, seed)], timeout_s=5)
        assert reply["ok"] and torch.equal(back[0], rand_bytes(100, seed).flip(0))
    assert client._lib.unique_ids == 0 and fabric.open_bootstraps() == 0


def test_nccl_versions_that_differ_use_tcp_at_once(fabric, closing, caplog):
    """NCCL's init checks the peer's full version: P and D on different images must not
    try (and fail) a set-up per call, but move tensors inline from the first call on."""
    server, addr = _server(fabric, closing, lib=FakeNccl(fabric, version="2.21.5"))
    client = _client(fabric, closing, lib=FakeNccl(fabric, version="2.27.5"))
    with caplog.at_level(logging.WARNING, logger="connector.transport.nccl"):
        for seed in range(3):
            t = rand_bytes(1000, seed)
            reply, back = client.call(addr, {"op": "x"}, [t], timeout_s=5)
            assert reply["ok"] and torch.equal(back[0], t.flip(0))
    assert server._lib.recv_bytes == 0 and client._lib.configs == [] and server._lib.configs == []
    assert client._lib.unique_ids == 0
    warned = [r.getMessage() for r in caplog.records if "2.21.5" in r.getMessage()]
    assert len(warned) == 1 and "2.27.5" in warned[0], warned


# ---------------------------------------------------------------- 4: freed communicators


def test_nothing_touches_a_communicator_after_its_abort(fabric, closing):
    """Reply sends posted (``unsettled``) when the communicator is aborted: settling it
    afterwards (the reaper works from a snapshot) must not call NCCL on the freed handle."""
    server, addr = _server(fabric, closing, handler=lambda h, t: ({}, [rand_bytes(100, 3)]))
    client = _client(fabric, closing)
    client.call(addr, {"op": "warm"}, timeout_s=5)
    (comm,) = list(server._in.values())
    with comm.lock:
        comm.unsettled = True
    server._abort(comm, "test")
    assert until(lambda: server._lib.aborts == 1)
    server._settle_replies(comm, time.monotonic() + 0.1)
    _no_freed_use(server)


def test_concurrent_calls_aborts_and_reaping_never_use_freed_handles(fabric, closing):
    """Calls whose callers give up (killed mid-reply) while the reaper runs, many times."""
    server, addr = _server(fabric, closing, handler=lambda h, t: ({}, [rand_bytes(2000, 4)]), max_wait_s=0.3)
    for i in range(4):
        client = _client(fabric, closing)
        client.call(addr, {"op": "warm"}, timeout_s=5)
        client._lib.kill()
        with pytest.raises(TransportError):
            client.call(addr, {"op": "get"}, timeout_s=0.4)
    assert until(lambda: server.communicators()["in"] == 0, 5.0)
    gc.collect()
    _no_freed_use(server)


# ---------------------------------------------------------------- 5 and 6: the serving thread


def test_pings_are_answered_while_a_receive_waits(fabric, closing):
    """The caller's sends never come (its NCCL died): the receive waits up to its budget,
    but pings and other callers' calls are served meanwhile (else they time out and this
    decode is marked dead by every prefill)."""
    # The stuck receive waits 8 s: the ping and the other call get 3 s each (slack for a
    # loaded box), and one served only after it would time out.
    server, addr = _server(fabric, closing, max_wait_s=8.0)
    stuck = _client(fabric, closing)
    stuck.call(addr, {"op": "warm"}, [rand_bytes(10, 1)], timeout_s=5)
    stuck._lib.kill()
    done = threading.Event()

    def long_call():
        try:
            stuck.call(addr, {"op": "put"}, [rand_bytes(1 << 12, 2)], timeout_s=8.0)
        except TransportError:
            pass
        done.set()

    threading.Thread(target=long_call, daemon=True).start()
    time.sleep(0.3)
    raw = TcpTransport()
    closing.append(raw)
    reply, _ = raw.call(addr, {"op": "ping"}, timeout_s=3.0)
    assert reply["ok"]
    other = _client(fabric, closing)
    t = rand_bytes(500, 5)
    reply, back = other.call(addr, {"op": "x"}, [t], timeout_s=3.0)
    assert reply["ok"] and torch.equal(back[0], t.flip(0))
    assert not done.is_set()  # the stuck receive was still waiting
    assert done.wait(30)
    _no_freed_use(server, other)


def test_a_hung_abort_holds_up_nothing_and_quarantines_the_peer(fabric, closing):
    """ncclCommAbort hanging (reported upstream, e.g. NVIDIA/nccl #863): it runs off the
    serving threads, is given up after abort_timeout_s, and that peer gets no NCCL again
    (its calls go inline) while everything else goes on."""
    gate = threading.Event()
    closing.append(gate)
    # abort_timeout_s 3 s: a ping served only once the abort is given up would miss its 2 s.
    server, addr = _server(fabric, closing, lib=FakeNccl(fabric, abort_gate=gate), max_wait_s=0.3,
                           abort_timeout_s=3.0)
    stuck = _client(fabric, closing, serve=True)
    stuck.call(addr, {"op": "warm"}, [rand_bytes(10, 1)], timeout_s=5)
    stuck._lib.kill()
    reply, back = stuck.call(addr, {"op": "put"}, [rand_bytes(100, 2)], timeout_s=2.0)
    assert reply["ok"] and torch.equal(back[0], rand_bytes(100, 2).flip(0))  # resent inline
    assert until(lambda: server._lib.aborting == 1)
    raw = TcpTransport()
    closing.append(raw)
    reply, _ = raw.call(addr, {"op": "ping"}, timeout_s=2.0)
    assert reply["ok"]
    assert all(not n.startswith("xpyd-tcp-server") for n in server._lib.abort_threads)
    assert until(lambda: stuck._address in server.quarantined())
    # Others still get NCCL.
    other = _client(fabric, closing)
    t = rand_bytes(300, 3)
    reply, back = other.call(addr, {"op": "x"}, [t], timeout_s=3.0)
    assert reply["ok"] and torch.equal(back[0], t.flip(0)) and server._lib.recv_bytes >= t.numel()


# ---------------------------------------------------------------- 7: buffers outlive the abort


def test_reply_tensors_stay_alive_until_the_abort_returned(fabric, closing):
    """Reply sends never taken (the caller died): the reaper aborts the communicator; the
    tensors NCCL was sending must not be freed before ncclCommAbort returned."""
    server, addr = _server(fabric, closing, handler=lambda h, t: ({}, [rand_bytes(4000, 5)]), max_wait_s=0.3)
    client = _client(fabric, closing)
    client.call(addr, {"op": "warm"}, timeout_s=5)
    client._lib.kill()
    with pytest.raises(TransportError):
        client.call(addr, {"op": "get"}, timeout_s=0.5)
    assert until(lambda: server._lib.aborts == 1)
    gc.collect()
    _no_freed_use(server)


def test_send_tensors_stay_alive_until_the_abort_returned(fabric, closing):
    """A send past its deadline: the caller may free its tensors as soon as call() raised,
    before the (asynchronous) abort ran."""
    gate = threading.Event()
    closing.append(gate)
    server, addr = _server(fabric, closing, max_wait_s=5.0)
    client = _client(fabric, closing, lib=FakeNccl(fabric, abort_gate=gate))
    client.call(addr, {"op": "warm"}, [rand_bytes(10, 1)], timeout_s=5)
    server._lib.kill()
    t = rand_bytes(1 << 14, 6)
    try:  # the server's receive times out too: resent inline, or the caller's own deadline
        client.call(addr, {"op": "put"}, [t], timeout_s=0.5)
    except TransportError:
        pass
    assert client._lib.aborts == 0  # the abort is still hanging, the tensors are the caller's no more
    del t
    gc.collect()
    gate.set()
    assert until(lambda: client._lib.aborts >= 1)
    _no_freed_use(client)


# ---------------------------------------------------------------- on a GPU (what the double cannot show)


class _CudaStreams(FakeNccl):
    """The double's NCCL with real CUDA streams: what the transport allocates and records."""

    def new_stream(self, device):
        return torch.cuda.Stream(device=device)


def _segment_stream(ptr: int) -> int | None:
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg["stream"]
    return None


@pytest.mark.gpu
def test_receive_buffers_are_allocated_on_the_communicators_stream():
    """Item 7: the caching allocator ties a block to the stream it was allocated on; NCCL
    writes receive buffers on the communicator's stream, so they are allocated there (else
    the allocator could hand their memory to the caller's stream's next allocation while
    NCCL still writes it)."""
    fabric = Fabric()
    t = NcclTransport(_CudaStreams(fabric), torch.device("cuda", 0))
    try:
        from connector.transport.nccl import _Comm

        comm = _Comm("c", "p", 0, None, t._lib.new_stream(torch.device("cuda", 0)))
        (buf,) = t._alloc(comm, [(torch.uint8, [1 << 22])])
        assert _segment_stream(buf.data_ptr()) == comm.stream.cuda_stream
        assert comm.stream.cuda_stream != torch.cuda.current_stream().cuda_stream
    finally:
        t.close()
        fabric.close()


@pytest.mark.gpu
def test_pinned_pool_is_page_locked_at_exactly_its_size():
    """Item 9 on a real GPU: cudaHostRegister'ed, exactly nbytes, usable for async copies."""
    from connector.p2p.staging import PinnedPool

    nbytes = 3 * (1 << 20) + 12345
    pool = PinnedPool(nbytes, pin=True)
    try:
        assert pool.buffer.is_pinned() and pool.buffer.numel() == nbytes
        dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        pool.buffer.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(pool.buffer, dev.cpu())
    finally:
        pool.close()

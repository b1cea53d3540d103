"""Pinned staging (connector/p2p/staging.py): the pool allocator against a model, and the
receive stager's placement and exactly-once release through every way a payload leaves
the receive buffer. Host tensors stand in for device ones (the policy is device-agnostic;
pinning needs CUDA, so the pool is plain host memory here)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from connector.p2p.buffer import KVBuffer, Payload
from connector.p2p.staging import ALIGN, PinnedPool, RecvStager
from connector.transport.tcp import TcpTransport


def test_alloc_free_coalesce():
    pool = PinnedPool(4096, pin=False)
    a, b, c = pool.alloc(1000), pool.alloc(1000), pool.alloc(1000)
    assert a.offset == 0 and b.offset == 1024 and c.offset == 2048  # aligned to 256
    assert pool.alloc(2000) is None  # 1024 left: refused, not raised
    b.free()
    assert pool.stats()["free_runs"] == 2
    a.free()
    assert pool.stats()["free_runs"] == 2 and pool.stats()["largest_free"] == 2048  # a+b merged
    c.free()
    c.free()  # a double free is harmless
    assert pool.stats() == {"capacity": 4096, "used": 0, "free": 4096, "largest_free": 4096, "free_runs": 1,
                            "leases": 0, "fragmentation_pct": 0}


def test_fragmentation_is_free_memory_outside_the_largest_run():
    pool = PinnedPool(4096, pin=False)
    leases = [pool.alloc(1024) for _ in range(4)]
    assert pool.stats()["fragmentation_pct"] == 0  # nothing free: nothing fragmented
    leases[0].free()
    leases[2].free()  # two separate 1 KiB holes: half the free bytes lie outside the largest
    st = pool.stats()
    assert st["free"] == 2048 and st["largest_free"] == 1024 and st["fragmentation_pct"] == 50
    assert pool.alloc(1500) is None  # 2 KiB free, but not in one piece
    leases[1].free()  # holes merge: 3 KiB in one run
    assert pool.stats()["fragmentation_pct"] == 0 and pool.alloc(3000) is not None


def test_views_are_the_pool_bytes():
    pool = PinnedPool(4096, pin=False)
    lease = pool.alloc(512)
    v = lease.view(torch.bfloat16, (4, 32))
    v.fill_(1.5)
    assert torch.equal(pool.buffer[lease.offset:lease.offset + 256].view(torch.bfloat16), v.reshape(-1))
    try:
        lease.view(torch.float32, (200,))
    except ValueError as e:
        assert "exceeds" in str(e)
    else:
        raise AssertionError("a view past the lease must be refused")


def test_random_alloc_free_matches_a_model():
    """Seeded random sequence: leases never overlap, accounting is exact, and all memory
    comes back as one run at the end."""
    rng = random.Random(7)
    pool = PinnedPool(1 << 16, pin=False)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live))).free()
        else:
            lease = pool.alloc(rng.randint(1, 5000))
            if lease is not None:
                live.append(lease)
        spans = sorted((x.offset, x.offset + x.nbytes) for x in live)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        # The model: free memory is exactly the gaps between live leases, each one run
        # (neighbours coalesced), so the pool's figures follow from the leases alone.
        gaps = [(a, b - a) for a, b in zip([0] + [e for _, e in spans], [s for s, _ in spans] + [pool.capacity])
                if b > a]
        st = pool.stats()
        assert st["free_runs"] == len(gaps) and st["largest_free"] == max((n for _, n in gaps), default=0)
        assert pool.stats()["used"] == sum(x.nbytes for x in live)
        assert all(x.offset % ALIGN == 0 for x in live)
    for x in live:
        x.free()
    assert pool.stats()["free_runs"] == 1 and pool.stats()["used"] == 0


def test_threads_share_the_pool():
    pool = PinnedPool(1 << 20, pin=False)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(500):
                lease = pool.alloc(rng.randint(1, 20000))
                if lease is not None:
                    lease.free()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and pool.stats()["used"] == 0 and pool.stats()["free_runs"] == 1


def payload(n: int, seed: int = 0) -> Payload:
    g = torch.Generator().manual_seed(seed)
    return Payload.of({"k": seed}, [torch.randint(0, 255, (n // 2,), dtype=torch.uint8, generator=g),
                                    torch.randint(0, 255, (n // 2,), dtype=torch.uint8, generator=g).view(torch.int16)])


def stager(budget=1000, pool=4096):
    st = RecvStager(budget, pool, pool_factory=lambda n: PinnedPool(n, pin=False), on_device=lambda t: True)
    assert st.wait_pool(5)
    return st


def test_overflow_goes_to_the_pool_with_its_bytes_and_comes_back_once():
    st = stager()
    first, second = payload(800, 1), payload(800, 2)
    want = [t.clone() for t in second.tensors]
    assert st.admit(first) is None and st.device_used == 800 and st.staged == 0
    assert st.admit(second) is None and st.staged == 1  # 800 + 800 > 1000: staged
    assert all(torch.equal(a, b) for a, b in zip(second.tensors, want, strict=True))
    assert all(t.untyped_storage().data_ptr() == st.pool.buffer.untyped_storage().data_ptr()
               for t in second.tensors)
    assert st.pool.stats()["leases"] == 1
    figures = st.stats()
    assert figures["staging_device_bytes"] == 800 and figures["staging_staged"] == 1
    assert figures["pool_leases"] == 1 and figures["pool_used"] == 1024  # 800 B + padding, 256-aligned
    second.drop()
    second.drop()
    assert st.pool.stats()["leases"] == 0
    first.drop()
    first.drop()
    assert st.device_used == 0


def test_refused_only_when_both_are_full():
    st = stager(budget=1000, pool=1024)
    assert st.admit(payload(800)) is None
    assert st.admit(payload(800)) is None  # to the pool
    why = st.admit(payload(800))
    assert why is not None and "receive buffer full" in why


def test_every_way_out_of_the_buffer_releases_exactly_once():
    st = stager(budget=0, pool=1 << 16)  # everything staged
    buf = KVBuffer("recv", st.capacity, ttl_s=60)
    p1, p2, p3 = payload(400, 1), payload(400, 2), payload(400, 3)
    for k, p in (("a", p1), ("b", p2), ("c", p3)):
        assert st.admit(p) is None and buf.put(k, p) is None
    assert st.pool.stats()["leases"] == 3
    buf.discard("a")  # consumed by the last load / released
    assert st.pool.stats()["leases"] == 2
    buf.expire(now=1e18)  # TTL
    assert st.pool.stats()["leases"] == 0 and len(buf) == 0
    buf.discard("b")  # already gone: nothing freed twice
    assert st.pool.stats()["used"] == 0


def test_a_drop_while_a_reader_copies_frees_the_lease_only_after_it():
    """The TTL sweep may drop a payload while the worker copies it into the cache: its pool
    bytes must not go to the next payload until the copy is done (else that load reads
    the newer payload's KV)."""
    st = stager(budget=0, pool=512)  # room for exactly one staged payload (400 B + padding)
    buf = KVBuffer("recv", st.capacity, ttl_s=60)
    first = payload(400, 1)
    assert st.admit(first) is None and buf.put("a", first) is None
    want = [t.clone() for t in first.tensors]
    with first.in_use():
        assert buf.expire(now=1e18) == ["a"]  # out of the buffer ...
        assert st.pool.stats()["leases"] == 1  # ... but its bytes still held
        assert "receive buffer full" in st.admit(payload(400, 2))
        assert all(torch.equal(a, b) for a, b in zip(first.tensors, want, strict=True))
    assert st.pool.stats()["leases"] == 0  # the reader left: freed, once
    first.drop()
    assert st.pool.stats()["used"] == 0
    assert st.admit(payload(400, 3)) is None


def test_release_waits_for_the_last_of_several_readers_and_survives_errors():
    calls = []
    p = Payload.of({}, [torch.zeros(8, dtype=torch.uint8)])
    p.release = lambda: calls.append(1)
    with p.in_use():
        try:
            with p.in_use():
                p.drop()
                raise RuntimeError("bad payload")
        except RuntimeError:
            pass
        assert calls == []  # the outer reader is still inside
    assert calls == [1]
    p.drop()
    with p.in_use():
        pass
    assert calls == [1]
    q = Payload.of({}, [torch.zeros(8, dtype=torch.uint8)])
    q.release = lambda: calls.append(2)
    with q.in_use():
        pass
    assert calls == [1]  # reading is not dropping
    q.drop()
    assert calls == [1, 2]


def test_pool_that_cannot_be_allocated_refuses_instead_of_raising():
    def broken(n):
        raise RuntimeError("cudaHostAlloc failed")

    calls = []

    def counted(n):
        calls.append(n)
        broken(n)

    st = RecvStager(0, 1 << 20, pool_factory=counted, on_device=lambda t: True)
    assert st.wait_pool(5)
    assert st.stats()["pool_capacity"] == 0  # not allocated: figures are zeros
    assert "cudaHostAlloc failed" in st.admit(payload(100))
    assert "receive buffer full" in st.admit(payload(100))
    assert calls == [1 << 20]  # tried once, not every time


class _FakeCudart:
    """torch.cuda.cudart() of a CPU machine: records what would be page-locked."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.registered.append((ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_pool_pins_exactly_its_size_not_the_next_power_of_two(monkeypatch):
    """pin_memory=True goes through torch's caching host allocator, which rounds up to a
    power of two (20 GB -> 32 GiB pinned): the pool page-locks exactly its own bytes."""
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    real_empty = torch.empty
    asked_pinned = []

    def empty(*a, **kw):
        asked_pinned.append(bool(kw.get("pin_memory")))
        return real_empty(*a, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    nbytes = 3 * (1 << 20) + 12345  # no power of two
    pool = PinnedPool(nbytes, pin=True)
    assert not any(asked_pinned)
    assert pool.buffer.numel() == nbytes and pool.capacity == nbytes
    assert cudart.registered == [(pool.buffer.data_ptr(), nbytes, 1)]
    pool.close()
    pool.close()
    assert cudart.unregistered == [pool.buffer.data_ptr()]


def test_pool_is_allocated_at_start_off_the_receive_path():
    """Pinning gigabytes takes seconds: it starts with the stager, on a thread of its own,
    and a receive never waits for it (overflow meanwhile is refused, saying why)."""
    threads, gate = [], threading.Event()

    def slow(n):
        threads.append(threading.current_thread().name)
        gate.wait(5)
        return PinnedPool(n, pin=False)

    t0 = time.monotonic()
    st = RecvStager(0, 4096, pool_factory=slow, on_device=lambda t: True)
    assert time.monotonic() - t0 < 2.5  # not the allocation's 5 s (slack for a loaded box)
    deadline = time.monotonic() + 30
    while not threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads and threads[0] != threading.current_thread().name  # started before any receive
    t0 = time.monotonic()
    why = st.admit(payload(400, 1))
    assert time.monotonic() - t0 < 2.5 and why is not None and "still being allocated" in why
    gate.set()
    assert st.wait_pool(5) and st.pool is not None
    assert st.admit(payload(400, 2)) is None and st.staged == 1
    assert len(threads) == 1
    st.close()


class _DeliversOnDevice(TcpTransport):
    """What the engine sees of the nccl transport's receiving side: a call's tensors in device
    memory (NCCL receives into device buffers). The bytes cross loopback tcp, because two
    engines in one process cannot join one NCCL communicator on one GPU; over plain tcp they
    would stay in host memory, where there is nothing to stage."""

    def start(self, bind_host: str, port: int, handler) -> None:
        super().start(bind_host, port, lambda header, tensors: handler(header, [t.cuda() for t in tensors]))


@pytest.mark.gpu
def test_decode_on_gpu_stages_overflow_in_pinned_memory_and_loads_it(engines):
    """CUDA caches: the second of two payloads exceeds D's device share and is staged in
    the pinned pool; both load byte-identical."""
    from tests.support.kv_engines import SRC_IDS, load_spec, make_caches, plan_load, poll_until, rank0, save_spec

    prod_caches = {k: v.cuda() for k, v in make_caches(1).items()}
    cons_caches = {k: v.cuda() for k, v in make_caches(2).items()}
    one = sum(c[list(SRC_IDS)].numel() * c.element_size() for c in prod_caches.values())
    prod = engines("kv_producer", "PUT_ASYNC", caches=prod_caches)
    cons = engines("kv_consumer", "PUT_ASYNC", caches=cons_caches, kv_buffer_size=one + one // 2,
                   mem_pool_size_gb=0.01, transport=lambda cfg: _DeliversOnDevice())
    assert cons._stager.wait_pool(30)
    for i, dst in enumerate(((7, 2, 11), (13, 14, 15))):
        key = f"{i:032x}"
        prod.save(save_spec(prod, rank0(cons), req_id=f"P{i}", key=key))
    deadline = time.monotonic() + 30
    while cons._stager.staged < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cons._stager.staged == 1
    for i, dst in enumerate(((7, 2, 11), (13, 14, 15))):
        plan_load(cons, load_spec(rank0(prod), dst, 2, req_id=f"D{i}", key=f"{i:032x}"))
        res, _ = poll_until(cons, lambda r, i=i: f"D{i}" in r.finished_recving)
        assert not res.failed_recving
        for name, cache in cons.caches.items():
            for d, s in zip(dst, SRC_IDS[2:], strict=True):
                assert torch.equal(cache[d].cpu().view(torch.int16), prod.caches[name][s].cpu().view(torch.int16))
    assert cons._stager.pool.stats()["leases"] == 0

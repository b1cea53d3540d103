"""P's GET send store: bounded by kv_buffer_size, least recently used evicted for newer
transfers, and D told at once that an evicted transfer is gone (never left waiting)."""

from __future__ import annotations

import time

import torch

from connector.p2p.buffer import KVBuffer, Payload
from tests.support.kv_engines import SRC_IDS, load_spec, make_caches, plan_load, poll_until, rank0, save_spec


def payload(n: int) -> Payload:
    return Payload.of({}, [torch.zeros(n, dtype=torch.uint8)])


def test_lru_evicts_the_least_recently_used_and_records_why():
    buf = KVBuffer("send", capacity_bytes=100, ttl_s=60, evict_lru=True)
    assert buf.put("a", payload(40)) is None
    assert buf.put("b", payload(40)) is None
    assert buf.peek("a") is not None  # a used: b is now the least recently used
    assert buf.put("c", payload(40)) is None
    assert buf.contains("a") and buf.contains("c") and not buf.contains("b")
    assert "evicted" in buf.failure("b") and "kv_buffer_size" in buf.failure("b")
    assert buf.evicted == 1 and buf.used_bytes == 80
    # Two go to make room for one big one; one larger than the whole store is refused, evicting nothing.
    assert buf.put("d", payload(90)) is None
    assert not buf.contains("a") and not buf.contains("c") and buf.evicted == 3
    assert "buffer full" in buf.put("e", payload(101))
    assert buf.contains("d") and buf.evicted == 3


def test_without_lru_the_newest_is_refused():
    buf = KVBuffer("recv", capacity_bytes=100, ttl_s=60)
    assert buf.put("a", payload(60)) is None
    assert "buffer full" in buf.put("b", payload(60))
    assert buf.contains("a") and buf.evicted == 0


def test_evicted_transfer_fails_the_decode_load_at_once(engines):
    """A store with room for one transfer: the second save pushes the first out; D's load
    of the first fails within a step or two (not at its 5 s deadline), the second loads."""
    one = sum(c[list(SRC_IDS)].numel() * c.element_size() for c in make_caches(1).values())
    prod = engines("kv_producer", "GET", seed=1, kv_buffer_size=one + one // 2)
    cons = engines("kv_consumer", "GET", seed=2)
    k1, k2 = "1" * 32, "2" * 32
    prod.save(save_spec(prod, rank0(cons), req_id="P1", key=k1, delay_free=False))
    prod.save(save_spec(prod, rank0(cons), req_id="P2", key=k2, delay_free=False))
    assert prod.send_buffer.evicted == 1
    assert prod.xfer_stats.peek().data["failures"].get("send/evicted") == 1
    # P's get op answers the evicted key final (D stops asking), the kept one with its KV.
    reply, tensors = prod._handle({"op": "get", "key": k1}, [])
    assert reply["final"] is True and not reply["ok"] and "evicted" in reply["error"] and tensors == []
    reply, tensors = prod._handle({"op": "get", "key": k2}, [])
    assert reply["ok"] and tensors
    t0 = time.monotonic()
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2, req_id="D1", key=k1))
    res, t1 = poll_until(cons, lambda r: "D1" in r.finished_recving)
    assert res.failed_recving == {"D1"} and t1 - t0 < 2.0
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2, req_id="D2", key=k2))
    res, _ = poll_until(cons, lambda r: "D2" in r.finished_recving)
    assert "D2" not in res.failed_recving

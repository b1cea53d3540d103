"""KVBuffer's bounds and bookkeeping, each limit from both sides: what D holds for loads and P
for pulls. A wrong byte count here either refuses transfers that fit or lets memory grow past
kv_buffer_size; a lost wake-up makes a load wait for its deadline."""

from __future__ import annotations

import threading
import time

import torch

from connector.p2p.buffer import GONE, KVBuffer, Payload, tensor_bytes


def _payload(nbytes: int, created: float | None = None, release=None) -> Payload:
    p = Payload({"op": "put"}, [torch.zeros(nbytes, dtype=torch.uint8)], nbytes, release=release)
    if created is not None:
        p.created = created
    return p


def test_tensor_bytes_counts_every_element_of_every_tensor():
    ts = [torch.zeros(3, 4, dtype=torch.float16), torch.zeros(5, dtype=torch.int64), torch.zeros(0)]
    assert tensor_bytes(ts) == 3 * 4 * 2 + 5 * 8
    p = Payload.of({"k": 1}, ts)
    assert (p.header, p.tensors, p.nbytes) == ({"k": 1}, ts, 64)


def test_drop_releases_once_and_waits_for_the_last_reader():
    calls = []
    p = _payload(4, release=lambda: calls.append(1))
    with p.in_use():
        with p.in_use():
            p.drop()
            assert calls == []  # two readers inside: the memory stays
        assert calls == []  # one still reading
    assert calls == [1]  # the last reader left: released, once
    p.drop()
    with p.in_use():
        pass
    assert calls == [1]


def test_a_reader_without_a_drop_releases_nothing():
    calls = []
    p = _payload(4, release=lambda: calls.append(1))
    with p.in_use():
        pass
    assert calls == []
    p.drop()
    assert calls == [1]


def test_capacity_and_accounting_properties():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=60)
    assert buf.capacity_bytes == 100
    assert buf.reserve("r", 30) is None
    assert buf.put("p", _payload(20)) is None
    assert (buf.used_bytes, buf.reserved_bytes, len(buf)) == (20, 30, 1)
    assert buf.reservation("r") == 30 and buf.reservation("p") is None
    # room left is exactly 50: 50 fits, 51 does not (counting both stored and promised bytes)
    assert "full" in buf.reserve("x", 51)
    assert buf.reserve("y", 50) is None
    assert buf.reserved_bytes == 80


def test_full_refusal_reason_names_the_numbers():
    buf = KVBuffer("recv", capacity_bytes=100, ttl_s=60)
    buf.put("a", _payload(60))
    buf.reserve("b", 30)
    why = buf.reserve("c", 11)
    assert why == "recv buffer full (60+30 reserved+11 > 100 bytes)"
    assert buf.failure("c") == why


def test_at_most_reservation_takes_a_smaller_payload_but_not_a_bigger_one():
    """GET: D reserves for the whole prompt before it learns how many blocks P skipped."""
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=60)
    buf.reserve("small", 40, at_most=True)
    assert buf.put("small", _payload(25)) is None
    assert (buf.used_bytes, buf.reserved_bytes) == (25, 0)
    buf.reserve("big", 40, at_most=True)
    assert "does not match" in buf.put("big", _payload(41))
    buf.reserve("exact", 10)
    assert "does not match" in buf.put("exact", _payload(9))  # a sender's own size is exact
    buf.reserve("same", 10)
    assert buf.put("same", _payload(10)) is None


def test_extend_moves_a_reservations_expiry_a_full_ttl_from_now():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=60, reservation_ttl_s=10)
    assert buf.extend("none") is None
    t0 = time.monotonic()
    buf.reserve("k", 30)
    assert buf.expire(t0 + 5) == []
    time.sleep(0.05)
    assert buf.extend("k") == 30
    # expired only a full reservation TTL after the extension, not after the reserve
    assert buf.expire(t0 + 10.01) == []
    assert buf.expire(time.monotonic() + 10.01) == ["k"]
    assert buf.reserved_bytes == 0


def test_reservation_ttl_defaults_to_the_payload_ttl():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=7)
    t0 = time.monotonic()
    buf.reserve("k", 1)
    assert buf.expire(t0 + 6.5) == []
    assert buf.expire(time.monotonic() + 7.01) == ["k"]


def test_expiry_boundaries_and_failure_lifetime():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=5)
    buf.put("p", _payload(10, created=100.0))
    assert buf.expire(now=105.0) == []  # exactly one TTL old: still good
    assert buf.expire(now=105.01) == ["p"]
    assert buf.failure("p") == "dropped after the 5s TTL"
    assert buf.expire(now=110.01) == []
    assert buf.failure("p") is not None  # recorded at 105.01, good until 110.01
    buf.expire(now=110.02)
    assert buf.failure("p") is None


def test_dropped_payloads_release_their_memory():
    released = []
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=5)
    buf.put("old", _payload(10, created=0.0, release=lambda: released.append("old")))
    buf.put("gone", _payload(10, release=lambda: released.append("gone")))
    buf.put("taken", _payload(10, release=lambda: released.append("taken")))
    buf.discard("gone")
    buf.expire(now=6.0)
    assert sorted(released) == ["gone", "old"]
    p = buf.pop("taken")
    assert released.count("taken") == 0 and p.release is not None  # pop hands the duty over


def test_discard_of_a_reservation_frees_its_bytes_and_refuses_the_payload():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=60)
    buf.reserve("k", 40)
    buf.discard("k")
    assert buf.reserved_bytes == 0 and buf.gone("k") and not buf.gone("other")
    assert buf.put("k", _payload(40)) == GONE
    assert buf.reserve("k", 40) == GONE


def test_a_failed_key_refuses_a_new_reservation_with_the_first_reason():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=60)
    assert buf.fail("k", "sender gave up") is True
    assert buf.reserve("k", 1) == "transfer already failed: sender gave up"
    assert buf.failure("k") == "sender gave up"


def test_changed_is_set_on_store_failure_and_expiry_only():
    ev = threading.Event()
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=5, changed=ev)
    buf.reserve("r", 10)
    assert not ev.is_set()  # a reservation wakes nobody: nothing to load yet
    buf.put("r", _payload(10))
    assert ev.is_set()
    ev.clear()
    buf.peek("r"), buf.pop("r"), buf.contains("r")
    assert not ev.is_set()
    buf.fail("f", "no")
    assert ev.is_set()
    ev.clear()
    buf.reserve("full", 101)
    assert ev.is_set()  # refused for room: recorded as failed, a waiting load wakes
    ev.clear()
    buf.put("x", _payload(5, created=0.0))
    ev.clear()
    assert buf.expire(now=1.0) == []
    assert not ev.is_set()  # nothing expired
    assert buf.expire(now=6.0) == ["x"]
    assert ev.is_set()


def test_lru_eviction_order_counts_and_tells_the_reader():
    ev = threading.Event()
    released = []
    buf = KVBuffer("send", capacity_bytes=100, ttl_s=60, evict_lru=True, changed=ev)
    for k in ("a", "b", "c"):
        buf.put(k, _payload(30, release=lambda k=k: released.append(k)))
    assert buf.peek("a") is not None  # used: now the most recent
    ev.clear()
    assert buf.put("d", _payload(30)) is None  # 90 + 30 > 100: "b" (least recent) goes
    assert released == ["b"] and buf.evicted == 1 and ev.is_set()
    assert not buf.contains("b") and buf.contains("a")
    assert buf.failure("b") == ("evicted from the send buffer (least recently used) to make room for newer "
                                "transfers: raise kv_buffer_size")
    assert buf.used_bytes == 90
    assert buf.put("e", _payload(40)) is None  # 40 more: "c" goes, then it fits exactly ("a" stays)
    assert released == ["b", "c"] and buf.evicted == 2 and buf.used_bytes == 100 and buf.contains("a")


def test_lru_never_evicts_for_what_cannot_fit_and_leaves_reservations_alone():
    buf = KVBuffer("send", capacity_bytes=100, ttl_s=60, evict_lru=True)
    buf.reserve("promised", 50)
    buf.put("a", _payload(30))
    # 51 could never fit beside the 50 promised: refused, and "a" is not evicted for nothing
    assert "full" in buf.put("big", _payload(51))
    assert buf.contains("a") and buf.evicted == 0
    assert buf.put("exact", _payload(50)) is None  # 50 fits once "a" goes
    assert not buf.contains("a") and buf.evicted == 1 and buf.reserved_bytes == 50


def test_peek_without_lru_does_not_reorder():
    buf = KVBuffer("recv", capacity_bytes=100, ttl_s=60)
    buf.put("a", _payload(60))
    assert buf.peek("a").nbytes == 60 and buf.peek("zz") is None
    assert "full" in buf.put("b", _payload(41))  # no eviction without evict_lru
    assert buf.contains("a") and buf.evicted == 0


def test_every_expiry_is_strictly_after_its_deadline(monkeypatch):
    """A reservation, a tombstone and a failure each live until their deadline inclusive (the
    clock is the buffer's own: time.monotonic, pinned here)."""
    import connector.p2p.buffer as buffer_module

    clock = [1000.0]
    monkeypatch.setattr(buffer_module.time, "monotonic", lambda: clock[0])
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=5, reservation_ttl_s=2)
    buf.reserve("r", 1)  # until 1002
    buf.discard("t")  # tombstone until 1005
    buf.fail("f", "no")  # failure until 1005
    assert buf.expire(1002.0) == [] and buf.reservation("r") == 1
    assert buf.expire(1002.5) == ["r"]  # its failure now lives until 1007.5
    assert buf.expire(1005.0) == [] and buf.gone("t") and buf.failure("f") == "no"
    buf.expire(1005.5)
    assert not buf.gone("t") and buf.failure("f") is None
    assert buf.failure("r") == "reserved, but the payload never came"
    buf.expire(1007.5)
    assert buf.failure("r") is not None
    buf.expire(1007.6)
    assert buf.failure("r") is None
    clock[0] = 1010.0
    buf.reserve("late", 1)
    assert buf.expire() == []  # no `now`: the buffer's clock
    clock[0] = 1012.5
    assert buf.expire() == ["late"]


def test_drops_and_evictions_are_logged_with_buffer_key_and_reason(caplog):
    buf = KVBuffer("recv", capacity_bytes=100, ttl_s=5)
    buf.put("k1", _payload(10, created=0.0))
    with caplog.at_level("WARNING", logger="vllm.xpyd.connector.p2p.buffer"):
        buf.expire(now=6.0)
        lru = KVBuffer("send", capacity_bytes=10, ttl_s=5, evict_lru=True)
        lru.put("k2", _payload(10))
        lru.put("k3", _payload(10))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["kv buffer=recv dropped expired transfer=k1 (dropped after the 5s TTL)",
                     "kv buffer=send evicted transfer=k2 bytes=10 (LRU)"]

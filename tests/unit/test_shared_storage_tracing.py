"""The SharedStorageConnector's spans (connector/tracing.py): D's ``kv load`` of stored blocks and P's
``kv store`` of its prompt's blocks (a part per step that completed blocks), children of the request's
trace context, exported over real OTLP/HTTP to a loopback receiver. The scheduler half is driven as
vLLM 0.32 drives it (its Request, SchedulerOutput, KVConnectorOutput) behind the facade's real hooks;
the workers' reports come from a real StorageEngine writing and reading real files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from vllm.v1.request import RequestStatus

from connector.shared_storage.connector import SharedStorageConnector, transfer_spans
from connector.shared_storage.metadata import FetchSpec, StoreSpec
from connector.shared_storage.scheduler import SharedStorageScheduler
from connector.tracing import TransferSpans
from tests.support.connector_spans import ERROR, PROXY_SPAN, TRACE_ID, output, request, spans_to, the_span
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.scheduler import BS, D_ADDR, KEY, FakeKVCacheManager, kv_blocks, pd_id, sched_out
from tests.support.shared_storage_engines import caches, chain, engine, wait_poll
from tests.support.shared_storage_sched import put, sched, toks

TK = f"{KEY}-0"  # the transfer: the proxy's key and the request's index within it


@pytest.fixture
def rx():
    with OtlpReceiver() as receiver:
        yield receiver


def traced(rx: OtlpReceiver, service: str, ranks: int = 1):
    """The provider exporting to rx and the storage connector's spans on it (as its __init__ makes them)."""
    provider, _ = spans_to(rx, service)
    return provider, transfer_spans(ranks, provider.get_tracer("xpyd.connector"))


def facade(s: SharedStorageScheduler, spans: TransferSpans) -> SharedStorageConnector:
    """The scheduler-role facade vLLM holds (without the VllmConfig its __init__ reads)."""
    c = SharedStorageConnector.__new__(SharedStorageConnector)
    c._scheduler, c._worker, c._spans = s, None, spans
    return c


def test_d_load_of_stored_blocks_is_a_child_of_the_request_context_with_the_workers_numbers(rx, tmp_path: Path):
    """P stored one block of three when D was asked: D claims all three (the loader waits for the rest);
    the span runs from the claim to the step that reported the load, with the worker's numbers."""
    provider, spans = traced(rx, "vllm-d")
    c = facade(sched("kv_consumer", tmp_path, spans=spans), spans)
    n = 3 * BS + 5
    put(tmp_path, toks(n), 1)
    req = request(pd_id(d=D_ADDR), n)
    rid = req.request_id
    c.on_new_request(req)
    assert c.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    c.update_state_after_alloc(req, kv_blocks([7, 3, 9, 4]), 3 * BS)
    c.build_connector_meta(sched_out())
    c.update_connector_output(output())  # a step without news: still loading
    assert rx.snapshot() == []
    c.update_connector_output(output(legs=[("load", rid, "ok", 3 * 8192, 0.25, 40.0, None)], recving=[rid]))
    span = the_span(rx, "kv load")
    assert (span.trace_id, span.parent_span_id, span.service) == (TRACE_ID, PROXY_SPAN, "vllm-d")
    waited = span.attributes.pop("xpyd.kv.sender_wait_ms")
    assert span.attributes == {
        "xpyd.kv.storage": "shared", "xpyd.kv.transfer": TK, "xpyd.kv.request": rid, "xpyd.kv.result": "ok",
        "xpyd.kv.tokens": 3 * BS, "xpyd.kv.local_hit": 0, "xpyd.kv.blocks": 3, "xpyd.kv.first_block": 0,
        "xpyd.kv.waited_for_producer": True, "xpyd.kv.bytes": 3 * 8192, "xpyd.kv.ms": 0.25, "xpyd.kv.wait_ms": 40.0}
    assert 0 <= waited <= (span.end_ns - span.start_ns) / 1e6
    assert [e.name for e in span.events] == ["load_planned"] and span.status_code != ERROR
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    c.request_finished(req, [7, 3, 9, 4])  # ended once only
    c.update_connector_output(output())
    assert len(rx.snapshot()) == 1
    provider.shutdown()


def test_a_load_of_blocks_nobody_was_asked_for_has_no_transfer_and_a_miss_says_so(rx, tmp_path: Path):
    """A plain request whose prefix another request stored: no transfer key; the file of its second
    block damaged, the load is a partial miss (the rest recomputed), a failed span saying why."""
    provider, spans = traced(rx, "vllm-d")
    c = facade(sched("kv_consumer", tmp_path, spans=spans), spans)
    n = 3 * BS + 5
    put(tmp_path, toks(n), 3)
    req = request("cmpl-plain-0-1a2b3c4d", n)
    c.on_new_request(req)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, kv_blocks([1, 2, 3, 4]), 3 * BS)
    c.build_connector_meta(sched_out())
    c.update_connector_output(output(legs=[("load", req.request_id, "failed", 8192, 0.1, 2.0, "missed")],
                                     recving=[req.request_id]))
    span = the_span(rx, "kv load")
    assert "xpyd.kv.transfer" not in span.attributes and span.attributes["xpyd.kv.waited_for_producer"] is False
    assert (span.attributes["xpyd.kv.result"], span.attributes["xpyd.kv.reason"]) == ("failed", "missed")
    assert span.status_code == ERROR
    provider.shutdown()


def test_d_waiting_for_ps_first_file_in_vain_ends_its_load_span_when_it_gives_up(rx, tmp_path: Path, monkeypatch):
    """Concurrent dispatch: D asked before P stored anything waits kv_prefill_wait_s, then computes the
    prompt itself: the span covers the wait and ends then, failed (no_sender), not at the request's end."""
    from connector.shared_storage import scheduler as ss_sched

    clock = [1000.0]
    monkeypatch.setattr(ss_sched.time, "monotonic", lambda: clock[0])
    provider, spans = traced(rx, "vllm-d")
    s = sched("kv_consumer", tmp_path, spans=spans)
    c = facade(s, spans)
    req = request(pd_id(d=D_ADDR).replace("___prefill_addr_", "xpyd-early___prefill_addr_"), 3 * BS + 5)
    c.on_new_request(req)
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)
    assert rx.snapshot() == []
    clock[0] += s._cfg.base.kv_prefill_wait_s
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    span = the_span(rx, "kv load")
    assert (span.attributes["xpyd.kv.result"], span.attributes["xpyd.kv.reason"]) == ("failed", "no_sender")
    assert span.attributes["xpyd.kv.transfer"] == TK and span.status_code == ERROR
    req.status = RequestStatus.FINISHED_STOPPED
    c.request_finished(req, [])
    c.update_connector_output(output())
    assert len(rx.snapshot()) == 1
    provider.shutdown()


def test_p_store_span_spans_every_part_of_every_rank_past_the_requests_end(rx, tmp_path: Path):
    """Chunked prefill on two ranks: three stores (parts), each reported by both ranks' writers. Part 1
    written before part 2 is planned does not end the span; the request finishing with part 3 still
    queued does not either; the last rank's last part does, at its time, with every byte counted."""
    provider, spans = traced(rx, "vllm-p", ranks=2)
    kvm = FakeKVCacheManager()
    c = facade(sched("kv_producer", tmp_path, kvm, world=2, spans=spans), spans)
    req = request(pd_id(), 5 * BS + 40)
    rid = req.request_id
    kvm.blocks[rid] = [11, 12, 13, 14, 15, 16]
    c.on_new_request(req)
    part = ("send", rid, "ok", 8192, 1.5, 0.5, None)
    assert len(c.build_connector_meta(sched_out(new=[(rid, 0, 2 * BS)])).stores) == 1
    c.update_connector_output(output(legs=[part, part]))  # part 1, both ranks
    assert len(c.build_connector_meta(sched_out(cached=[(rid, 2 * BS, 200)])).stores) == 1
    c.update_connector_output(output(legs=[part, part]))  # part 2
    assert len(c.build_connector_meta(sched_out(cached=[(rid, 2 * BS + 200, 224)])).stores) == 1
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED  # max_tokens=1: done in the step that completed it
    assert c.request_finished(req, [11, 12]) == (False, {"xpyd": {"storage": "shared", "stored_blocks": 5}})
    c.update_connector_output(output(legs=[part]))  # rank 0's part 3; rank 1's still queued
    assert rx.snapshot() == []
    written = time.time_ns() + 10**9  # after the earlier parts' reports
    c.update_connector_output(output(legs=[("send", rid, "failed", 0, 0.2, 3.0, "io")], when=written))
    span = the_span(rx, "kv store")
    assert (span.trace_id, span.parent_span_id, span.service) == (TRACE_ID, PROXY_SPAN, "vllm-p")
    assert span.end_ns == written
    assert span.attributes == {
        "xpyd.kv.storage": "shared", "xpyd.kv.transfer": TK, "xpyd.kv.request": rid, "xpyd.kv.result": "failed",
        "xpyd.kv.reason": "io", "xpyd.kv.tokens": 5 * BS + 40, "xpyd.kv.blocks": 5, "xpyd.kv.bytes": 5 * 8192,
        "xpyd.kv.ms": 1.5, "xpyd.kv.wait_ms": 3.0}
    provider.shutdown()


def test_no_storage_span_without_trace_headers(rx, tmp_path: Path):
    provider, spans = traced(rx, "vllm-p")
    kvm = FakeKVCacheManager()
    c = facade(sched("kv_producer", tmp_path, kvm, spans=spans), spans)
    req = request(pd_id(), 3 * BS, headers=None)
    kvm.blocks[req.request_id] = [1, 2, 3]
    c.on_new_request(req)
    assert len(c.build_connector_meta(sched_out(new=[(req.request_id, 0, 3 * BS)])).stores) == 1
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    c.request_finished(req, [1, 2, 3])
    c.update_connector_output(output(legs=[("send", req.request_id, "ok", 1, 1.0, None, None)]))
    assert rx.snapshot() == [] and spans._legs == {}
    provider.shutdown()


def test_the_storage_engine_reports_each_store_and_load_while_tracing(tmp_path: Path):
    """The workers' side: a real writer and loader report what the spans show (bytes of blocks
    written or applied, ms, the writer's queue wait or the read's wait), and nothing while not tracing."""
    a, b = caches(1), caches(2)
    ea, eb = engine(tmp_path, a), engine(tmp_path, b)
    try:
        ks = chain(3)
        assert ea.submit_store(StoreSpec("untraced", (1,), ks[:1], 0)) and ea.flush(10)
        assert ea.xfer_stats.take(0, 0, 1).data["legs"] == []
        ea.xfer_stats.legs = eb.xfer_stats.legs = True
        assert ea.submit_store(StoreSpec("p", (3, 4, 9), ks, 0)) and ea.flush(10)
        (store,) = ea.xfer_stats.take(0, 0, 1).data["legs"]
        assert store[:4] == ["send", "p", "ok", 2 * ea.block_bytes]  # the first block was there already
        assert store[4] >= 0 and store[5] >= 0 and store[6] is None
        eb.submit_load(FetchSpec("d", (7, 0, 5), ks, 0, 0.0))
        wait_poll(eb, "d")
        eb.submit_load(FetchSpec("gone", (1, 2), chain(2, salt=5), 0, 0.0))  # never stored
        wait_poll(eb, "gone")
        load, miss = eb.xfer_stats.take(0, 0, 1).data["legs"]
        assert load[:4] == ["load", "d", "ok", 3 * eb.block_bytes] and load[6] is None
        assert load[4] >= 0 and load[5] >= 0
        assert miss[:4] == ["load", "gone", "failed", 0] and miss[6] == "missed"
    finally:
        ea.close()
        eb.close()

"""The connector's spans (connector/tracing.py): D's ``kv load`` and P's ``kv send``, children of the
request's trace context, with the workers' numbers, exported over real OTLP/HTTP to a receiver on
loopback (tests/support/otlp_receiver.py). The scheduler half is driven the way vLLM 0.32 drives it
(its own Request, KVConnectorOutput, SchedulerOutput); the facade's hooks (request_finished,
update_connector_output) are the real ones of P2pNcclConnector."""

from __future__ import annotations

import time

import pytest
from vllm.v1.request import RequestStatus

from connector.p2p.connector import P2pNcclConnector
from connector.p2p.scheduler import P2pScheduler
from connector.stats import StatsRecorder, XpydStats
from connector.tracing import TransferSpans, tracing_on
from tests.support.connector_spans import ERROR, PROXY_SPAN, TRACE_ID, output, request, spans_to, the_span
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.scheduler import BS, KEY, FakeKVCacheManager, kv_blocks, make_cfg, pd_id, sched_out

TK = f"{KEY}-0"


@pytest.fixture
def rx():
    with OtlpReceiver() as receiver:
        yield receiver


def facade(sched: P2pScheduler, spans: TransferSpans) -> P2pNcclConnector:
    """The scheduler-role facade vLLM holds (without the VllmConfig its __init__ reads)."""
    c = P2pNcclConnector.__new__(P2pNcclConnector)
    c._scheduler, c._worker, c._spans = sched, None, spans
    return c


def test_d_load_span_is_a_child_of_the_request_context_with_the_workers_numbers(rx):
    provider, spans = spans_to(rx, "vllm-d")
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False, spans=spans)
    c = facade(s, spans)
    req = request(pd_id(), 300)
    c.on_new_request(req)
    assert c.get_num_new_matched_tokens(req, 0) == (299, True)
    c.update_state_after_alloc(req, kv_blocks([7, 3, 9]), 299)
    c.build_connector_meta(sched_out())
    c.update_connector_output(output())  # a step without news: still loading
    assert rx.snapshot() == []
    c.update_connector_output(output(legs=[("load", req.request_id, "ok", 98304, 0.42, 12.5, None)],
                                     recving=[req.request_id]))
    span = the_span(rx, "kv load")
    assert (span.trace_id, span.parent_span_id, span.service) == (TRACE_ID, PROXY_SPAN, "vllm-d")
    waited = span.attributes.pop("xpyd.kv.sender_wait_ms")
    assert span.attributes == {
        "xpyd.kv.transfer": TK, "xpyd.kv.request": req.request_id, "xpyd.kv.result": "ok",
        "xpyd.kv.tokens": 299, "xpyd.kv.local_hit": 0, "xpyd.kv.blocks": 3, "xpyd.kv.mode": "async",
        "xpyd.kv.bytes": 98304, "xpyd.kv.ms": 0.42, "xpyd.kv.wait_ms": 12.5}
    assert 0 <= waited <= (span.end_ns - span.start_ns) / 1e6
    # The wait before the load was planned, then the transfer: the event splits the span.
    (planned,) = span.events
    assert planned.name == "load_planned" and span.start_ns <= planned.time_ns <= span.end_ns
    assert span.status_code != ERROR
    c.request_finished(req, [7, 3, 9])  # ended once only
    c.update_connector_output(output())
    assert len(rx.snapshot()) == 1
    provider.shutdown()


def test_d_load_that_finishes_with_its_request_waits_for_the_steps_reports(rx):
    """vLLM calls request_finished before it hands the connector that step's output: a synchronous
    load (no finished_recving) of a request done in one step still gets its worker's numbers."""
    provider, spans = spans_to(rx, "vllm-d")
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False, spans=spans)
    c = facade(s, spans)
    req = request(pd_id(), 300)
    c.on_new_request(req)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, kv_blocks([1, 2, 3]), 299)
    c.build_connector_meta(sched_out(new=[(req.request_id, 299, 1)]))
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    c.request_finished(req, [1, 2, 3])
    assert rx.snapshot() == []
    c.update_connector_output(output(legs=[("load", req.request_id, "ok", 4096, 0.1, 0.0, None)]))
    assert the_span(rx, "kv load").attributes["xpyd.kv.bytes"] == 4096
    provider.shutdown()


def producer_facade(rx, blocks: list[int]):
    """A P's scheduler half behind the facade, tracing to rx, and one request of 300 tokens on
    `blocks`: (provider, facade, kv cache manager, request)."""
    provider, spans = spans_to(rx, "vllm-p")
    kvm = FakeKVCacheManager()
    s = P2pScheduler(make_cfg("kv_producer"), BS, start_registrar=False, spans=spans)
    s.bind(kvm)
    req = request(pd_id(), 300)
    kvm.blocks[req.request_id] = blocks
    return provider, facade(s, spans), kvm, req


def test_a_span_ends_when_the_worker_finished_not_when_the_scheduler_heard(rx):
    """P's worker reports a layer-wise send at the end of a long step: the span ends at the send's end."""
    provider, c, kvm, req = producer_facade(rx, [4, 5, 6])
    c.on_new_request(req)
    c.build_connector_meta(sched_out(new=[(req.request_id, 0, 300)]))
    sent_at = time.time_ns()
    while time.time_ns() - sent_at < 20_000_000:  # the rest of the step (its forward pass)
        time.sleep(0.005)
    c.update_connector_output(output(legs=[("send", req.request_id, "ok", 1024, 0.0, None, None)],
                                     sending=[req.request_id], when=sent_at))
    span = the_span(rx, "kv send")
    assert span.end_ns == sent_at and span.start_ns <= sent_at
    provider.shutdown()


@pytest.mark.parametrize("leg, recving, failed, result, reason", [
    (("load", "R", "failed", 0, 0.0, 30000.0, "timeout"), [], ["R"], "failed", "timeout"),
    (None, [], [], "cancelled", None),
])
def test_d_load_that_fails_or_is_cancelled_says_so(rx, leg, recving, failed, result, reason):
    provider, spans = spans_to(rx, "vllm-d")
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False, spans=spans)
    c = facade(s, spans)
    req = request(pd_id(), 300)
    rid = req.request_id
    c.on_new_request(req)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, kv_blocks([1, 2, 3]), 299)
    if leg is not None:
        c.update_connector_output(output(legs=[(leg[0], rid, *leg[2:])], recving=recving,
                                         failed=[rid for _ in failed]))
    else:  # the client went away while D waited for the KV
        req.status = RequestStatus.FINISHED_ABORTED
        c.request_finished(req, [1, 2, 3])
        c.update_connector_output(output())
    span = the_span(rx, "kv load")
    assert span.attributes["xpyd.kv.result"] == result
    assert span.attributes.get("xpyd.kv.reason") == reason
    assert (span.status_code == ERROR) == (result == "failed")
    provider.shutdown()


def test_p_send_span_from_the_planned_send_to_finished_sending(rx):
    provider, c, kvm, req = producer_facade(rx, [4, 5, 6])
    rid = req.request_id
    c.on_new_request(req)
    c.build_connector_meta(sched_out(new=[(rid, 0, 200)]))  # chunked prefill: no send yet
    c.update_connector_output(output())
    meta = c.build_connector_meta(sched_out(cached=[(rid, 200, 100)]))
    assert [x.req_id for x in meta.saves] == [rid]
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.request_finished(req, [4, 5, 6])[0] is True  # PUT_ASYNC: the worker still holds the blocks
    c.update_connector_output(output())
    assert rx.snapshot() == []  # the send goes on after P's request finished
    c.update_connector_output(output(legs=[("send", rid, "ok", 98304, 3.25, None, None)], sending=[rid]))
    span = the_span(rx, "kv send")
    assert (span.trace_id, span.parent_span_id, span.service) == (TRACE_ID, PROXY_SPAN, "vllm-p")
    assert span.attributes == {
        "xpyd.kv.transfer": TK, "xpyd.kv.request": rid, "xpyd.kv.result": "ok", "xpyd.kv.tokens": 300,
        "xpyd.kv.blocks": 3, "xpyd.kv.skipped_blocks": 0, "xpyd.kv.peer": "127.0.0.1:22001",
        "xpyd.kv.mode": "PUT_ASYNC", "xpyd.kv.bytes": 98304, "xpyd.kv.ms": 3.25}
    provider.shutdown()


def test_a_send_planned_again_after_a_preemption_stays_one_span(rx):
    provider, c, kvm, req = producer_facade(rx, [1, 2, 3])
    rid = req.request_id
    c.on_new_request(req)
    c.build_connector_meta(sched_out(new=[(rid, 0, 300)]))
    assert c.build_connector_meta(sched_out(preempted={rid})).preempted == [rid]
    kvm.blocks[rid] = [7, 8, 9]
    assert len(c.build_connector_meta(sched_out(cached=[(rid, 0, 302)], resumed={rid})).saves) == 1
    c.update_connector_output(output(legs=[("send", rid, "ok", 3, 1.0, None, None)], sending=[rid]))
    span = the_span(rx, "kv send")
    assert [e.name for e in span.events] == ["send_replanned"] and "xpyd.kv.sender_wait_ms" not in span.attributes
    provider.shutdown()


def test_no_span_without_trace_headers_or_for_a_send_never_planned(rx):
    provider, spans = spans_to(rx, "vllm-p")
    kvm = FakeKVCacheManager()
    s = P2pScheduler(make_cfg("kv_producer"), BS, start_registrar=False, spans=spans)
    s.bind(kvm)
    c = facade(s, spans)
    plain = request(pd_id(key="a" * 32), 300, headers=None)  # the client and proxy sent no traceparent
    aborted = request(pd_id(key="b" * 32), 300)  # finished before its prompt was complete
    for r in (plain, aborted):
        kvm.blocks[r.request_id] = [1, 2, 3]
        c.on_new_request(r)
    c.build_connector_meta(sched_out(new=[(plain.request_id, 0, 300)]))
    for r in (plain, aborted):
        r.status = RequestStatus.FINISHED_ABORTED
        c.request_finished(r, [1, 2, 3])
    c.update_connector_output(output(legs=[("send", plain.request_id, "ok", 1, 1.0, None, None)],
                                     sending=[plain.request_id]))
    assert rx.snapshot() == [] and spans._legs == {}
    provider.shutdown()


def test_workers_report_legs_only_while_tracing():
    rec = StatsRecorder()
    rec.leg("send", "r", True, 10, 1.0)
    assert rec.take(0, 0, 1).data["legs"] == []
    rec.legs = True
    rec.leg("send", "r", True, 10, 1.0)
    rec.leg("load", "q", False, reason="timeout")
    got = rec.take(0, 0, 1)
    assert [x[:7] for x in got.data["legs"]] == [["send", "r", "ok", 10, 1.0, None, None],
                                                 ["load", "q", "failed", 0, 0.0, None, "timeout"]]
    # Carried as vLLM carries stats (a dict copy), and merged over ranks.
    both = XpydStats.from_dict(got.data).aggregate(XpydStats.from_dict(got.data))
    assert len(both.data["legs"]) == 4 and not both.is_empty()


def test_tracing_follows_vllms_otlp_endpoint():
    class Obs:
        otlp_traces_endpoint: str | None = None

    class Cfg:
        observability_config = Obs()

    assert not tracing_on(Cfg())
    Cfg.observability_config.otlp_traces_endpoint = "http://127.0.0.1:4318/v1/traces"
    assert tracing_on(Cfg())

"""The disaggregated path's prefill failures, as clients and operators see them: a P whose
connection attempts time out, the messages of the errors P's failures end in, the log line
of each failed attempt, and the abandoned D answer of a concurrent dispatch. Real proxy,
fake instances over real HTTP and ZMQ (the mutation survivors of proxy/dispatch/disaggregated.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from contextlib import contextmanager

import pytest

from tests.support.proxy_errors import assert_error
from tests.support.proxy_helpers import Fault, running_proxy, wait_until
from xpyd_wire.discovery import Load, OutputLimits
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_FIRST_TOKEN, XPYD_PATH, XPYD_PREFILL_INSTANCE, XPYD_PREFILL_MS

COMPLETION = {"model": "fake-model", "prompt": "Hello there", "max_tokens": 5}
STREAM = {**COMPLETION, "stream": True}
CHAT_STREAM = {"model": "fake-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5,
               "stream": True}


@contextmanager
def blackholed(port: int):
    """127.0.0.1:port accepts no new connection and refuses none: a listener (backlog 0)
    whose one queued slot is taken and never accepted, so the kernel drops every further
    SYN and a connect attempt waits until its own deadline (as to a host gone silent)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(0)
    filler = socket.create_connection(("127.0.0.1", port), timeout=2)
    try:
        yield
    finally:
        filler.close()
        listener.close()


async def register_silent(px, role: str) -> tuple[str, int]:
    """An instance that registered (and answered its join probe), then went silent: its
    address takes no connection. Returns (http address, port); its registration lives on
    until the heartbeat timeout. Blackhole it with `blackholed(port)`."""
    gone = await px.fake(role, register=False)
    await gone.send_registration()
    addr = gone.http_address
    await wait_until(lambda: any(i.http_address == addr for i in px.registry.live(role)))
    await gone.stop()
    return addr, int(addr.rsplit(":", 1)[1])


async def test_prefill_connect_timeout_cools_p_down_and_counts_as_unreachable():
    """A P that cannot be connected to in connect_timeout is the same as one that refuses:
    it cools down (the next requests skip it), and when it was the only P, D alone serves
    the request (fallback_to_decode), or the client gets 504 prefill_timeout without it."""
    async with running_proxy(connect_timeout=0.3, heartbeat_timeout=30, expose_routing_headers=True) as px:
        addr, port = await register_silent(px, "P")  # first in the table: round robin tries it first
        p, d = await px.pd()
        with blackholed(port):
            for _ in range(3):
                resp = await px.client.post("/v1/completions", json=COMPLETION)
                assert resp.status_code == 200, resp.text
                assert resp.headers[XPYD_PREFILL_INSTANCE] == p.http_address
        # Round robin would have sent the third request to the silent P again: only its
        # cooldown kept it away.
        assert await px.metric("xpyd_upstream_errors_total", role="P", instance=addr, kind="connect_timeout") == 1
        assert len(p.completions()) == 3 and len(d.completions()) == 3
    async with running_proxy(connect_timeout=0.3, heartbeat_timeout=30, prefill_retries=0) as px:
        addr, port = await register_silent(px, "P")
        d = await px.fake("D")
        with blackholed(port):
            resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200, resp.text
        assert resp.headers[XPYD_PATH] == "local_no_prefill"
        assert d.completions()[0].request_id.startswith("xpyd-local-")
    async with running_proxy(connect_timeout=0.3, heartbeat_timeout=30, prefill_retries=0,
                             fallback_to_decode=False) as px:  # fmt: skip
        addr, port = await register_silent(px, "P")
        d = await px.fake("D")
        with blackholed(port):
            err = assert_error(await px.client.post("/v1/completions", json=COMPLETION), 504, "prefill_timeout")
        assert err["message"].startswith("prefill failed on 1 attempt(s), last: ")
        assert "timed out" in err["message"] and not d.completions()


async def test_prefill_errors_say_how_many_attempts_failed_and_the_last_failure():
    # A P that timed out is never tried again for the request, even with retries left.
    async with running_proxy(prefill_timeout=0.3, prefill_retries=1) as px:
        p, d = await px.pd()
        p.fault = Fault(hang=True)
        err = assert_error(await px.client.post("/v1/completions", json=COMPLETION), 504, "prefill_timeout")
        assert err["message"] == "prefill failed on 1 attempt(s), last: timed out after 0.3s"
        assert len(p.completions()) == 1
        assert not d.completions()
    for expose in (False, True):
        async with running_proxy(prefill_retries=2, fallback_to_decode=False, heartbeat_timeout=30,
                                 expose_routing_headers=expose) as px:  # fmt: skip
            addr, port = await register_silent(px, "P")  # its port now refuses
            await px.fake("D")
            err = assert_error(await px.client.post("/v1/completions", json=COMPLETION), 502, "prefill_unreachable")
            # One P, tried three times (each retry takes the P that merely refused again); the
            # client reads how it failed, the address only when exposed.
            head = "no prefill instance could be reached after 3 attempt(s), last: "
            if expose:
                assert err["message"].startswith(f"{head}cannot connect to {addr}: ")
            else:
                assert err["message"] == f"{head}connection refused or unreachable"


async def test_each_failed_prefill_attempt_is_logged(caplog):
    """The operator's record of a prefill that failed: which P, how, which attempt, why."""
    # 2 s: the other P must answer within it on a loaded box.
    async with running_proxy(prefill_timeout=2.0, expose_routing_headers=True) as px:
        slow, fast = await px.fake("P"), await px.fake("P")
        await px.fake("D")
        slow.fault = Fault(hang=True)
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200 and resp.headers[XPYD_PREFILL_INSTANCE] == fast.http_address
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefill failed")]
    assert lines == [f"prefill failed instance={slow.http_address} kind=timeout attempt=1 error=timed out after 2.0s"]


async def test_concurrent_dispatch_closes_ds_opened_answer_when_p_fails():
    """D answered (its chat stream's role chunk: nothing generated yet, as while D waits for
    the KV) before P failed: that open answer is closed at once, so vLLM aborts the request
    instead of decoding for nobody."""
    async with running_proxy(dispatch="concurrent", first_token="decode", prefill_retries=0) as px:
        p, d = await px.pd()
        d.fault = Fault(stall_after=1)  # the role chunk, then nothing until the proxy leaves
        p.fault = Fault(status=500, delay=0.5)
        resp = await px.client.post("/v1/chat/completions", json=CHAT_STREAM)
        assert resp.status_code == 500 and resp.json()["error"]["message"] == "fake P failure"
        (dec,) = d.completions()
        assert dec.sent.startswith(b"data: ") and b'"role"' in dec.sent  # D's answer was open before P failed
        await wait_until(lambda: dec.cancelled, what="D aborted")


async def test_ds_first_token_before_ps_answer_is_relayed_at_once():
    """Concurrent dispatch: D's first generated token came while P's answer was still to come
    (P's HTTP answer trails its forward pass; D stepped on the KV it already had). The stream
    goes to the client at once, not with P's answer: tokens 1 and 2 used to leave together.
    P's call ends on its own afterwards (counted, P released)."""
    async with running_proxy(dispatch="concurrent", first_token="decode") as px:
        p, d = await px.pd()
        gate = asyncio.Event()
        p.fault = Fault(gate=gate)  # P answers only when the test says so
        async with px.client.stream("POST", "/v1/completions", json=STREAM) as resp:
            assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "disaggregated"
            assert XPYD_PREFILL_MS not in resp.headers  # P had not answered
            lines = resp.aiter_lines()
            first = await asyncio.wait_for(anext(lines), 10)
            assert first.startswith("data: {") and not gate.is_set()  # before P's answer
            gate.set()
            rest = [line async for line in lines]
        assert [line for line in rest if line][-1] == "data: [DONE]"
        (inst,) = px.registry.live("P")
        await wait_until(lambda: inst.served == 1 and inst.in_flight == 0, what="P counted and released")
        assert await px.metric("xpyd_phase_duration_seconds_count", phase="prefill") == 1


async def test_shutdown_lets_ps_call_end_after_its_stream_went_out():
    """The proxy stops while a P call outlives its relayed stream: it stops once P's answer
    was read (P counted as served), not with P's call running, which the process's exit
    would cut off (mutant: no settle)."""
    async with running_proxy(dispatch="concurrent", first_token="decode") as px:
        p, d = await px.pd()
        gate = asyncio.Event()
        p.fault = Fault(gate=gate)
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n") and not gate.is_set()
        (inst,) = px.registry.live("P")
        assert inst.served == 0 and inst.in_flight == 1
        asyncio.get_running_loop().call_later(0.3, gate.set)
        px.server.should_exit = True
        await asyncio.wait_for(asyncio.shield(px.serving), 10)  # the proxy stopped ...
        assert inst.served == 1 and inst.in_flight == 0  # ... after P's call ended and was counted


async def test_p_failing_after_ds_stream_went_out_leaves_the_answer_whole():
    """P's call ends in a failure after D's first token was relayed: the client's stream, all
    of it D's (D had the KV to compute it), completes; P is released and its failure counted."""
    async with running_proxy(dispatch="concurrent", first_token="decode") as px:
        p, d = await px.pd()
        gate = asyncio.Event()
        p.fault = Fault(gate=gate, status=500)
        async with px.client.stream("POST", "/v1/completions", json=STREAM) as resp:
            lines = resp.aiter_lines()
            assert (await asyncio.wait_for(anext(lines), 10)).startswith("data: {")
            gate.set()
            rest = [line async for line in lines if line]
        assert resp.status_code == 200 and rest[-1] == "data: [DONE]" and "error" not in "".join(rest)
        (inst,) = px.registry.live("P")
        await wait_until(lambda: inst.in_flight == 0, what="P released")
        assert inst.served == 0
        assert await px.metric("xpyd_upstream_errors_total", role="P", instance=p.http_address, kind="http_500") == 1


@pytest.mark.parametrize("token_delay", [0.0, 0.05])  # D's whole stream in hand at once, or event by event
async def test_a_usage_event_before_ps_answer_waits_for_ps_figures(token_delay):
    """With --enable-prompt-tokens-details the usage names the prompt tokens found cached; D
    counts P's KV there, so P's figures go out instead. A stream relayed before P answered
    holds its usage event until P's answer is in: the event gets P's figures."""
    async with running_proxy(dispatch="concurrent", first_token="decode") as px:
        p, d = await px.pd(token_delay=token_delay)
        p.prompt_details, d.prompt_details = (3, 0), (17, 0)  # cached_tokens each reports
        gate = asyncio.Event()
        p.fault = Fault(gate=gate)
        body = {**STREAM, "stream_options": {"include_usage": True}}
        async with px.client.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.aiter_lines()
            first = await asyncio.wait_for(anext(lines), 10)
            assert first.startswith("data: {") and not gate.is_set()
            asyncio.get_running_loop().call_later(0.3, gate.set)
            rest = [line async for line in lines]
        usage = [line for line in rest if '"usage":{' in line]
        assert len(usage) == 1 and '"cached_tokens":3' in usage[0], usage


@pytest.mark.parametrize("dispatch", ["sequential", "concurrent"])
async def test_a_server_capping_the_answer_at_one_token_gets_it_from_p_alone(dispatch):
    """D's vLLM caps every answer at one token (--override-generation-config
    max_new_tokens=1): the client's max_tokens 5 is one token, so P's answer is all of it,
    under a plain request id (P ships no KV) and D is not asked, even by concurrent dispatch."""
    limits = OutputLimits(override=1, context=8192)
    async with running_proxy(first_token="prefill", dispatch=dispatch) as px:
        p, d = await px.pd(output_limits=limits)
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "prefill_alone"
        (pre,) = p.completions()
        assert pre.request_id.startswith("xpyd-local-") and d.completions() == []
        assert resp.text.endswith("data: [DONE]\n\n")


async def test_a_retried_prefill_goes_to_a_p_not_tried_yet():
    """least_loaded would pick the idle P again: the retry excludes the P that failed, so
    the busier one prefills."""
    async with running_proxy(prefill_timeout=2.0, prefill_policy="least_loaded", expose_routing_headers=True) as px:
        idle = await px.fake("P")
        busy = await px.fake("P", load=Load(running=50))
        await px.fake("D")
        idle.fault = Fault(hang=True)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200 and resp.headers[XPYD_PREFILL_INSTANCE] == busy.http_address
        assert len(idle.completions()) == 1 and len(busy.completions()) == 1


async def test_concurrent_dispatch_gives_an_eligible_request_ds_first_token_also_past_the_bound():
    """With the first token from P and concurrent dispatch: D is asked at once with the client's
    own request and computes the first token (its request overlaps P's prefill; counted as
    reason="concurrent"), also while P has a queue; once D holds decode_max_early requests
    waiting for their prefill, D is asked after P answered, still with the client's own request
    (P's token handed on would put D's admission into the client's first gap between tokens)."""
    async with running_proxy(dispatch="concurrent", first_token="prefill") as px:
        p = await px.fake("P", load=Load(running=1, waiting=1))
        d = await px.fake("D")
        p.fault = Fault(delay=2.0)  # D asked after P's answer would be 2 s late; 1.5 s of slack
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
        assert XPYD_FIRST_TOKEN not in resp.headers
        (pre,), (dec,) = p.completions(), d.completions()
        assert dec.received_at < pre.received_at + 1.5 and dec.request_id == pre.request_id
        assert dec.json == STREAM and "return_token_ids" not in pre.json
        assert await px.metric("xpyd_first_token_to_decode_total", reason="concurrent") == 1
    async with running_proxy(dispatch="concurrent", first_token="prefill", decode_max_early=1) as px:
        p, d = await px.pd()
        p.fault = Fault(delay=1.5)
        first = asyncio.create_task(px.client.post("/v1/completions", json=COMPLETION))
        await wait_until(lambda: len(d.completions()) == 1, what="D asked early")
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
        assert (await first).status_code == 200
        assert XPYD_FIRST_TOKEN not in resp.headers
        (dec,) = [r for r in d.completions() if r.json.get("stream")]
        assert dec.received_at >= pre_of(p, dec.request_id).received_at + 1.4  # after P's answer
        assert dec.json == STREAM and "return_token_ids" not in pre_of(p, dec.request_id).json
        assert await px.metric("xpyd_first_token_to_decode_total", reason="concurrent") == 1  # the stream
        assert await px.metric("xpyd_decode_early_full_total", decode=d.http_address) == 1


@pytest.mark.parametrize("status", [404, 422])
async def test_ps_verdicts_on_the_request_go_to_d_to_judge(status):
    """vLLM's 404 (a model it does not serve) and 422 (a body its schema refuses) on P's
    cut-down request: D judges the client's own request (here it accepts it)."""
    async with running_proxy() as px:
        p, d = await px.pd()
        p.fault = Fault(status=status, times=1)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_verdict"
        (dec,) = d.completions()
        assert dec.json == COMPLETION and dec.request_id.startswith("xpyd-local-")
        assert await px.metric("xpyd_upstream_errors_total", role="P", instance=p.http_address,
                               kind=f"http_{status}") == 1  # fmt: skip


async def test_an_oversized_prefill_answer_is_a_502_not_retried(caplog):
    """P's one-token answer over max_response_bytes would be as large from any P."""
    async with running_proxy(max_response_bytes=200) as px:
        p1, p2 = await px.fake("P"), await px.fake("P")
        d = await px.fake("D")
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json=COMPLETION)
        err = assert_error(resp, 502, "upstream_response_too_large")
        assert err["message"].startswith("prefill instance's answer larger than 200 bytes")
        assert err["message"].endswith(", over the proxy's max_response_bytes")
        assert len(p1.completions()) + len(p2.completions()) == 1 and not d.completions()
        (p,) = [f for f in (p1, p2) if f.completions()]
        assert await px.metric("xpyd_upstream_errors_total", role="P", instance=p.http_address,
                               kind="too_large") == 1  # fmt: skip
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("answer too large")]
    assert line.startswith(f"answer too large phase=prefill instance={p.http_address} error=")


@pytest.mark.parametrize("expose", [True, False])
async def test_a_verdict_left_to_d_is_told_as_ds_answer(expose, caplog):
    """P refused the request (404): the answer's headers describe D's local answer only (P's
    attempt's are dropped), with D named once when exposed; the hand-over is logged
    (proxy/dispatch/dispatcher.py's PrefillRefused branch)."""
    async with running_proxy(expose_routing_headers=expose) as px:
        p, d = await px.pd()
        p.fault = Fault(status=404, times=1)
        with caplog.at_level(logging.INFO, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200 and resp.headers.get_list(XPYD_PATH) == ["local_verdict"]
        assert resp.headers.get_list(XPYD_PREFILL_INSTANCE) == []
        assert resp.headers.get_list(XPYD_DECODE_INSTANCE) == ([d.http_address] if expose else [])
        assert resp.headers.get_list("x-request-id") == []  # as vLLM without --enable-request-id-headers
        assert resp.headers.get_list(XPYD_PREFILL_MS) == []
    assert "prefill refused the request status=404: D judges the client's own" in [
        r.getMessage() for r in caplog.records
    ]


async def test_a_d_that_cannot_be_connected_to_in_time_is_a_504_decode_timeout(caplog):
    """D registered, then its address took no connection within connect_timeout (and D alone
    on it neither): the client gets 504 decode_timeout, not 502 decode_unreachable."""
    async with running_proxy(connect_timeout=0.3, heartbeat_timeout=30) as px:
        await px.fake("P")
        addr, port = await register_silent(px, "D")
        with blackholed(port), caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json=COMPLETION)
        err = assert_error(resp, 504, "decode_timeout")
        assert err["message"] == "decode instance failed before answering: connect timed out"
        assert await px.metric("xpyd_upstream_errors_total", role="D", instance=addr, kind="connect_timeout") == 2
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode failed before first byte")]
    assert lines == [
        f"decode failed before first byte instance={addr} attempt=1 "
        "error=decode instance failed before answering: connect timed out"
    ]


async def test_concurrent_dispatch_bounds_the_requests_d_holds_waiting_for_their_prefill():
    """decode_max_early: once D holds that many of this proxy's requests still waiting for P's
    answer, the next request's D is asked after P answered (as sequential), counted per D;
    when P answers, the room comes back."""
    async with running_proxy(dispatch="concurrent", decode_max_early=1) as px:
        p, d = await px.pd()
        p.fault = Fault(delay=1.5)  # early: within 1 s (slack for a loaded box); late: after 1.5 s
        first = asyncio.create_task(px.client.post("/v1/completions", json=COMPLETION))
        await wait_until(lambda: len(d.completions()) == 1, what="D asked early")
        assert await _early(px) == 1
        # A one-token stream is P's answer alone (no D at all): not counted as kept from D by the bound.
        alone = asyncio.create_task(px.client.post("/v1/completions", json={**STREAM, "max_tokens": 1}))
        second = await px.client.post("/v1/completions", json=COMPLETION)
        assert [r.status_code for r in (await first, second)] == [200, 200]
        assert (await alone).headers[XPYD_PATH] == "prefill_alone"
        pre = {r.request_id: r for r in p.completions()}
        early, late = sorted(d.completions(), key=lambda r: r.received_at)
        assert early.received_at < pre[early.request_id].received_at + 1.0
        assert late.received_at >= pre[late.request_id].received_at + 1.4
        assert await px.metric("xpyd_decode_early_full_total", decode=d.http_address) == 1
        assert await _early(px) == 0
        p.fault = Fault(delay=0.5)
        third = await px.client.post("/v1/completions", json=COMPLETION)
        assert third.status_code == 200
        last = max(d.completions(), key=lambda r: r.received_at)
        assert last.received_at < pre_of(p, last.request_id).received_at + 0.4  # early again
        assert await px.metric("xpyd_decode_early_full_total", decode=d.http_address) == 1


def pre_of(p, request_id: str):
    return next(r for r in p.completions() if r.request_id == request_id)


async def _early(px) -> int:
    (d,) = [i for i in (await px.client.get("/instances")).json() if i["role"] == "D"]
    return d["early"]


async def test_the_bound_on_early_requests_counts_what_ds_heartbeat_reports_from_other_proxies():
    """D's heartbeat says it holds decode_max_early requests for their prefill (other proxies'):
    this proxy's first request already finds no room; once D reports fewer, it has."""
    async with running_proxy(dispatch="concurrent", decode_max_early=2) as px:
        p = await px.fake("P")
        d = await px.fake("D", load=Load(running=0, waiting=2, waiting_for_kv=2))
        p.fault = Fault(delay=1.0)
        assert (await px.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        (pre,), (dec,) = p.completions(), d.completions()
        assert dec.received_at >= pre.received_at + 0.9  # after P's answer
        assert await px.metric("xpyd_decode_early_full_total", decode=d.http_address) == 1
        d.load = Load(running=0, waiting=2, waiting_for_kv=1)
        await wait_until(lambda: px.registry.live("D")[0].load.waiting_for_kv == 1, what="D's new heartbeat")
        assert (await px.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        last = max(d.completions(), key=lambda r: r.received_at)
        assert last.received_at < pre_of(p, last.request_id).received_at + 0.8  # early again

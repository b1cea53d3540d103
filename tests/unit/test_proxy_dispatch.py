"""Dispatch: retries on another D before the first byte, concurrent dispatch, and D serving a
request alone (short prompt, no P). Real proxy, fake instances over real HTTP and ZMQ. Tests
of D's answer before its first byte name first_token="decode": with the first token from P
(the default for streams), the client has a 200 before D answers (test_proxy_first_token.py)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import pytest

from proxy.config import ProxyConfig
from tests.support.fake_vllm import DISAGGREGATED_ID
from tests.support.proxy_helpers import REQUEST_ID_RE, Fault, running_proxy, wait_until
from xpyd_wire import request_id
from xpyd_wire.discovery import Load
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_FIRST_TOKEN, XPYD_PATH

COMPLETION = {"model": "fake-model", "prompt": "Hello there", "max_tokens": 5}
STREAM = {**COMPLETION, "stream": True}
LONG = {**COMPLETION, "prompt": "x" * 400}  # ~100 estimated tokens


async def test_dead_decode_still_registered_costs_no_request():
    """A D that died (its heartbeat not expired yet) while another D is alive: every
    request is answered, the dead one's failures are retried on the live one."""
    # expose_routing_headers: the test reads which D answered from x-xpyd-decode-instance.
    async with running_proxy(heartbeat_timeout=30, expose_routing_headers=True) as px:
        p = await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        await d1.stop()  # the port now refuses; the registry still lists it
        assert px.registry.count("D") == 2
        statuses = []
        for i in range(10):
            body = STREAM if i % 2 else COMPLETION
            resp = await px.client.post("/v1/completions", json=body)
            statuses.append(resp.status_code)
            assert resp.headers[XPYD_DECODE_INSTANCE] == d2.http_address
        assert statuses == [200] * 10
        assert len(d2.completions()) == 10
        # Each retry redid the prefill with a new P/D pair: P saw the dead D's id once.
        retried = await px.metric("xpyd_decode_retries_total")
        assert retried >= 1 and len(p.completions()) == 10 + retried


async def test_decode_5xx_before_first_byte_is_retried_4xx_is_not():
    async with running_proxy(first_token="decode", expose_routing_headers=True) as px:
        await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        d1.fault = Fault(status=503, times=1)  # round robin asks d1 first
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and "data: [DONE]" in resp.text
        assert resp.headers[XPYD_DECODE_INSTANCE] == d2.http_address
    async with running_proxy(first_token="decode", decode_retries=1) as px:
        p = await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        d1.fault = Fault(status=503)
        d2.fault = Fault(status=503)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        # Both failed, and D alone (the local rescue) too: D's own error JSON is relayed.
        assert resp.status_code == 503
        assert resp.json()["error"]["message"] == "fake D failure"
        assert await px.metric("xpyd_decode_retries_total") == 1
        d1.fault = d2.fault = None
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200
        d1.fault = Fault(status=400)
        d2.fault = Fault(status=400)
        before = len(p.completions())
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 400  # D's verdict on the request: not retried
        assert len(p.completions()) == before + 1
        assert await px.metric("xpyd_decode_retries_total") == 1


async def test_decode_retries_zero_relays_the_first_failure():
    """No second P/D pair; D alone once (on the D not tried), and when that fails too the
    first failure is relayed."""
    async with running_proxy(decode_retries=0) as px:
        p = await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        d1.fault = Fault(status=500, error_body=b'{"error": {"message": "first", "type": '
                         b'"InternalServerError", "param": null, "code": 500}}')  # fmt: skip
        d2.fault = Fault(status=502)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 500 and resp.json()["error"]["message"] == "first"
        assert len(p.completions()) == 1
        assert [r.request_id.startswith("xpyd-local-") for r in d2.completions()] == [True]
        assert await px.metric("xpyd_decode_retries_total") == 0


async def test_concurrent_dispatch_overlaps_decode_with_prefill():
    async with running_proxy(first_token="decode", dispatch="concurrent") as px:
        p, d = await px.pd()
        p.fault = Fault(delay=2.0)  # sequential: D at 2 s at the earliest; 1.5 s of slack for a loaded box
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and "data: [DONE]" in resp.text
        (pre,), (dec,) = p.completions(), d.completions()
        # D had the request while P was still prefilling, with the same transfer id.
        assert dec.received_at < pre.received_at + 1.5
        assert pre.request_id == dec.request_id
        assert re.match(REQUEST_ID_RE, dec.request_id)
        assert pre.json["max_tokens"] == 1 and dec.json["max_tokens"] == 5


async def test_concurrent_dispatch_asks_d_at_once_whether_p_is_idle_or_busy():
    """D is asked with P whether P is idle or busy (D's connector holds no blocks while P has
    not begun sending), a stream that may start with P's token too: D computes the first token,
    so its admission and first step do not fall between the client's first and second token."""
    async with running_proxy(dispatch="concurrent") as px:
        p, d = await px.pd()
        p.fault = Fault(delay=2.0)  # early: within 1.5 s (slack for a loaded box); late: after 2 s
        first = asyncio.create_task(px.client.post("/v1/completions", json=COMPLETION))
        await wait_until(lambda: len(p.completions()) == 1, what="P busy")
        second = asyncio.create_task(px.client.post("/v1/completions", json=COMPLETION))  # not a stream
        await wait_until(lambda: len(p.completions()) == 2, what="P busier")
        third = await px.client.post("/v1/completions", json=STREAM)  # may start with P's token
        assert [r.status_code for r in (await first, await second, third)] == [200, 200, 200]
        pre = {r.request_id: r for r in p.completions()}
        dec = {r.request_id: r for r in d.completions() if r.request_id in pre}
        assert len(dec) == 3
        for rid, r in dec.items():
            assert r.received_at < pre[rid].received_at + 1.5, r.json  # at once, P idle or busy
        (streamed,) = [r for r in dec.values() if r.json.get("stream")]
        assert XPYD_FIRST_TOKEN not in third.headers and streamed.json == STREAM  # the client's own request
        assert await px.metric("xpyd_first_token_to_decode_total", reason="concurrent") == 1
    for waiting in (1, 3):  # requests waiting on P (its heartbeat): a queue, D asked at once all the same
        async with running_proxy(dispatch="concurrent") as px:
            p = await px.fake("P", load=Load(running=1, waiting=waiting))
            d = await px.fake("D")
            p.fault = Fault(delay=2.0)
            resp = await px.client.post("/v1/completions", json=STREAM)
            assert resp.status_code == 200 and XPYD_FIRST_TOKEN not in resp.headers, waiting
            (pre,), (dec,) = p.completions(), d.completions()
            assert dec.received_at < pre.received_at + 1.5, waiting


async def test_shipped_defaults_serve_short_prompts_from_d():
    """The shipped defaults (not running_proxy's): concurrent dispatch, and prompts under
    128 estimated tokens answered by D alone, longer ones disaggregated with D asked at once."""
    shipped = ProxyConfig()
    assert (shipped.dispatch, shipped.local_prefill_threshold) == ("concurrent", 128)
    async with running_proxy(dispatch=shipped.dispatch,
                             local_prefill_threshold=shipped.local_prefill_threshold) as px:
        p, d = await px.pd()
        p.fault = Fault(delay=0.3)
        short = {**COMPLETION, "prompt": "x" * 500}  # ~125 estimated tokens
        resp = await px.client.post("/v1/completions", json=short)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_short"
        assert p.completions() == [] and d.completions()[0].request_id.startswith("xpyd-local-")
        long = {**COMPLETION, "prompt": "x" * 520}  # ~130
        resp = await px.client.post("/v1/completions", json=long)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "disaggregated"
        (pre,), dec = p.completions(), d.completions()[1]
        assert pre.request_id == dec.request_id and dec.received_at < pre.received_at + 0.25


async def test_concurrent_dispatch_prefill_failure_aborts_decode_at_once():
    async with running_proxy(dispatch="concurrent", prefill_retries=0) as px:
        p, d = await px.pd()
        d.fault = Fault(hang=True)  # D waits for the KV
        p.fault = Fault(status=500, delay=0.2)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 500 and resp.json()["error"]["message"] == "fake P failure"
        await wait_until(lambda: d.completions()[0].cancelled, what="D aborted")


async def test_concurrent_dispatch_dead_decode_aborts_prefill_and_retries():
    async with running_proxy(dispatch="concurrent", heartbeat_timeout=30,
                             expose_routing_headers=True) as px:  # fmt: skip
        p = await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        await d1.stop()  # round robin asks d1 first
        p.fault = Fault(delay=0.5)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200
        assert resp.headers[XPYD_DECODE_INSTANCE] == d2.http_address
        # The prefill paired with the dead D was abandoned as soon as D refused (if it
        # reached P at all): only the retry's prefill ran to its end.
        await wait_until(lambda: all(r.completed or r.cancelled for r in p.completions()), what="P's requests over")
        assert [r.completed for r in p.completions()].count(True) == 1


async def test_short_prompt_goes_to_decode_alone():
    async with running_proxy(local_prefill_threshold=50) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and "data: [DONE]" in resp.text
        assert resp.headers[XPYD_PATH] == "local_short"
        assert not p.completions()
        (alone,) = d.completions()
        assert alone.request_id.startswith("xpyd-local-")
        assert alone.json == STREAM  # the client's request, unchanged
        resp = await px.client.post("/v1/completions", json=LONG)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "disaggregated"
        assert len(p.completions()) == 1
        assert await px.metric("xpyd_dispatch_total", path="local_short") == 1
        assert await px.metric("xpyd_dispatch_total", path="disaggregated") == 1


async def test_no_prefill_instance_decode_serves_alone():
    async with running_proxy() as px:
        d = await px.fake("D")
        resp = await px.client.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert resp.status_code == 200
        assert resp.headers[XPYD_PATH] == "local_no_prefill"
        assert d.completions()[0].request_id.startswith("xpyd-local-")


async def test_client_leaving_during_concurrent_dispatch_aborts_both():
    async with running_proxy(dispatch="concurrent") as px:
        p, d = await px.pd()
        p.fault = Fault(hang=True)
        d.fault = Fault(hang=True)
        task = asyncio.get_running_loop().create_task(
            px.client.post("/v1/completions", json=COMPLETION)
        )
        await wait_until(lambda: p.completions() and d.completions(), what="both called")
        task.cancel()
        await wait_until(
            lambda: p.completions()[0].cancelled and d.completions()[0].cancelled,
            what="both aborted",
        )
        assert px.registry.live("D")[0].in_flight == 0
        assert px.registry.live("P")[0].in_flight == 0


# ---------------------------------------------------------------- local rescue
# D fails a disaggregated request before its first byte (vLLM answers 500 when the KV load
# failed: kv_load_failure_policy=fail) and no other D is left: D alone, once.

CHAT_STREAM = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 4, "stream": True}  # fmt: skip
KV_LOAD_FAILED = Fault(status=500, id_prefix=DISAGGREGATED_ID, error_body=json.dumps({"error": {
    "message": "Internal server error ({request_id})", "type": "InternalServerError",
    "param": None, "code": 500}}).encode())  # fmt: skip


def kv_load_fails(times: int | None = None) -> Fault:
    """D answers vLLM's 500 to disaggregated requests, quoting the request id."""
    return Fault(**{**KV_LOAD_FAILED.__dict__, "times": times})


def local_id(rid: str) -> bool:
    return rid.startswith("xpyd-local-") and request_id.parse(rid) is None


@pytest.mark.parametrize(
    "path,body,dispatch",
    [
        ("/v1/completions", COMPLETION, "sequential"),
        ("/v1/chat/completions", CHAT_STREAM, "sequential"),
        ("/v1/completions", STREAM, "concurrent"),
    ],
    ids=["json", "stream", "stream-concurrent"],
)
async def test_rescue_decode_alone_after_failed_kv_load(path, body, dispatch):
    async with running_proxy(first_token="decode", dispatch=dispatch) as px:
        p, d = await px.pd()
        d.fault = kv_load_fails(times=1)
        resp = await px.client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        first, second = d.completions()
        assert request_id.parse(first.request_id) is not None and first.status == 500
        # The second time D got the client's request unchanged, under a plain id: no KV to
        # load, D prefills itself; the client gets exactly what D computed alone.
        assert local_id(second.request_id) and second.json == body
        assert resp.content == px.relayed(second)
        if body.get("stream"):
            assert resp.text.endswith("data: [DONE]\n\n")
        else:
            assert resp.json()["choices"][0]["text"] == " t0 t1 t2 t3 t4"
        assert resp.headers[XPYD_PATH] == "local_rescue"
        assert "x-request-id" not in resp.headers  # vLLM sends none without --enable-request-id-headers
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1
        assert await px.metric("xpyd_dispatch_total", path="disaggregated") == 1
        assert await px.metric("xpyd_decode_retries_total") == 0
        assert len(p.completions()) == 1
        assert px.registry.live("D")[0].in_flight == 0
        # The next request is disaggregated again.
        assert (await px.client.post(path, json=body)).status_code == 200
        assert request_id.parse(d.completions()[2].request_id) is not None
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1


async def test_rescue_after_every_decode_retry_failed():
    async with running_proxy(first_token="decode", decode_retries=1) as px:
        p = await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        d1.fault, d2.fault = kv_load_fails(), kv_load_fails()
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
        seen = d1.completions() + d2.completions()
        assert [request_id.parse(r.request_id) is not None for r in seen].count(True) == 2
        (alone,) = [r for r in seen if local_id(r.request_id)]
        assert resp.content == px.relayed(alone)
        assert len(p.completions()) == 2  # one P/D pair per D
        assert await px.metric("xpyd_decode_retries_total") == 1
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1


async def test_rescue_goes_to_a_d_not_tried_yet():
    """With no decode retry left, D alone runs on a D the failed attempt did not use, even a
    busier one: the D whose load failed may be the broken one. least_loaded with the other D
    reporting a heavy load: picked without the exclusion, the rescue would land on the
    failed D again."""
    async with running_proxy(first_token="decode", decode_retries=0, decode_policy="least_loaded") as px:
        await px.fake("P")
        idle = await px.fake("D")
        busy = await px.fake("D", load=Load(running=50))
        idle.fault, busy.fault = kv_load_fails(), kv_load_fails()  # disaggregated requests only
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
        (failed,) = idle.completions()
        assert request_id.parse(failed.request_id) is not None and failed.status == 500
        (alone,) = busy.completions()
        assert local_id(alone.request_id) and resp.content == px.relayed(alone)
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1


async def test_first_token_continuation_rescue_goes_to_another_d():
    """First token from P: the continuation that failed on its D goes on alone on another D,
    even a busier one (the same rule as above for D's continuation; with round_robin, as in
    test_proxy_first_token, the other D comes next anyway and the rule is not exercised)."""
    async with running_proxy(first_token="prefill", decode_policy="least_loaded") as px:
        await px.fake("P")
        idle = await px.fake("D")
        busy = await px.fake("D", load=Load(running=50))
        idle.fault, busy.fault = kv_load_fails(), kv_load_fails()
        resp = await px.client.post("/v1/completions", json=STREAM)
        chunks = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
        assert chunks[-1] == "[DONE]"
        assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1]) == " t0 t1 t2 t3 t4"
        (failed,) = idle.completions()
        assert request_id.parse(failed.request_id) is not None and failed.status == 500
        (alone,) = busy.completions()
        assert local_id(alone.request_id) and alone.json["prompt"] == failed.json["prompt"]
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1


@pytest.mark.parametrize("body", [COMPLETION, STREAM], ids=["json", "stream"])
async def test_rescue_failing_too_relays_the_original_error(body):
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = Fault(**{**KV_LOAD_FAILED.__dict__, "id_prefix": None})  # alone too
        resp = await px.client.post("/v1/completions", json=body)
        assert resp.status_code == 500
        assert resp.headers["content-type"].startswith("application/json")
        err = resp.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        first, second = d.completions()
        assert local_id(second.request_id)
        # The disaggregated attempt's error (it quotes that request's id), with its headers.
        assert err["message"] == f"Internal server error ({px.neutral(first.request_id)})"
        assert resp.headers[XPYD_PATH] == "disaggregated"
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1
        assert px.registry.live("D")[0].in_flight == 0


async def test_rescue_keeps_to_the_failed_attempts_deadline():
    """D alone gets what is left of the decode_ttfb_timeout of the attempt it rescues."""
    # 4 s, the failure at 2.8 s: 0.9 s of slack either side for a loaded box (was 1 s / 0.7 s).
    async with running_proxy(decode_ttfb_timeout=4.0) as px:
        p, d = await px.pd()
        d.fault = Fault(**{**KV_LOAD_FAILED.__dict__, "delay": 2.8, "times": 1})
        task = asyncio.get_running_loop().create_task(
            px.client.post("/v1/completions", json=COMPLETION)
        )
        await wait_until(lambda: d.completions(), what="D got the disaggregated request")
        t0 = time.monotonic()
        d.fault = Fault(hang=True)  # D alone never answers
        resp = await asyncio.wait_for(task, 30)
        elapsed = time.monotonic() - t0
        assert resp.status_code == 500 and "Internal server error" in resp.json()["error"]["message"]
        assert 3.1 < elapsed < 4.9, elapsed  # not 2.8 s + another full 4 s
        first, second = d.completions()
        assert local_id(second.request_id)
        await wait_until(lambda: second.cancelled, what="D alone aborted")


@pytest.mark.parametrize("status", [400, 413])
async def test_decode_client_error_is_not_rescued(status):
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = Fault(status=status, id_prefix=DISAGGREGATED_ID)
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == status
        assert resp.json()["error"]["message"] == "fake D failure"
        assert len(d.completions()) == 1
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 0


async def test_local_paths_and_oversized_answers_are_not_rescued():
    # D alone already (a short prompt) failing: no second try alone.
    async with running_proxy(local_prefill_threshold=50) as px:
        p, d = await px.pd()
        d.fault = Fault(status=500)
        assert (await px.client.post("/v1/completions", json=COMPLETION)).status_code == 500
        assert len(d.completions()) == 1 and not p.completions()
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 0
    # An answer over max_response_bytes would be as large from D alone.
    async with running_proxy(max_response_bytes=1000) as px:  # P's 1-token answer fits
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json={**COMPLETION, "max_tokens": 300})
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "upstream_response_too_large"
        assert len(d.completions()) == 1
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 0


# ---------------------------------------------------------------- a stream's error event
# vLLM answers a stream 200 before generating, so a KV load that failed comes as an SSE
# error event inside it (completions: first; chat: after the role chunk). Before any
# generated content that is still a failure before D's first byte: retried, then rescued.

COMPLETION_STREAM = {**STREAM, "max_tokens": 4}
STREAMS = pytest.mark.parametrize(
    "path,body",
    [("/v1/completions", COMPLETION_STREAM), ("/v1/chat/completions", CHAT_STREAM)],
    ids=["completions", "chat"],
)


def stream_error(code: int = 500, **kw) -> Fault:
    """D streams 200 with vLLM's error event to disaggregated requests."""
    return Fault(stream_error=code, id_prefix=DISAGGREGATED_ID, **kw)


def sse(text: str) -> list[dict]:
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


@STREAMS
async def test_stream_error_event_before_content_is_rescued(path, body):
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = stream_error(times=1)
        resp = await px.client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        first, second = d.completions()
        # D did send vLLM's 200 with its error event (chat: after the role chunk)...
        assert first.status == 200 and request_id.parse(first.request_id) is not None
        assert (b'data: {"error": {"message": "Internal server error", "type": '
                b'"InternalServerError", "param": null, "code": 500}}\n\ndata: [DONE]\n\n'
                ) in first.sent  # fmt: skip
        assert first.sent.startswith(b"data: {\"id\":\"chatcmpl-" if "chat" in path
                                     else b"data: {\"error\"")  # fmt: skip
        # ...and the client got none of it: only what D computed alone.
        assert local_id(second.request_id) and second.json == body
        assert resp.content == px.relayed(second)
        assert not any("error" in e for e in sse(resp.text))
        assert resp.text.endswith("data: [DONE]\n\n")
        assert resp.headers[XPYD_PATH] == "local_rescue"
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1
        assert await px.metric("xpyd_decode_retries_total") == 0
        assert await px.metric("xpyd_upstream_errors_total", role="D",
                               instance=d.http_address, kind="http_500") == 1  # fmt: skip
        assert len(p.completions()) == 1
        assert px.registry.live("D")[0].in_flight == 0


@STREAMS
async def test_stream_error_event_is_retried_on_another_decode(path, body):
    async with running_proxy(first_token="decode", expose_routing_headers=True) as px:
        p = await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        d1.fault = stream_error(503)  # round robin asks d1 first
        resp = await px.client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        assert resp.headers[XPYD_DECODE_INSTANCE] == d2.http_address
        (served,) = d2.completions()
        assert request_id.parse(served.request_id) is not None  # a P/D pair, not D alone
        assert resp.content == served.sent
        assert await px.metric("xpyd_decode_retries_total") == 1
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 0
        assert len(p.completions()) == 2


@STREAMS
async def test_stream_client_error_event_is_relayed(path, body):
    """A 4xx error event is D's verdict on the request: relayed as it came, not retried."""
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        other = await px.fake("D")
        d.fault = other.fault = stream_error(400)
        resp = await px.client.post(path, json=body)
        assert resp.status_code == 200
        (rec,) = d.completions() + other.completions()
        assert resp.content == px.relayed(rec)
        assert sse(resp.text)[-1]["error"]["code"] == 400
        assert await px.metric("xpyd_decode_retries_total") == 0
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 0


@STREAMS
async def test_stream_error_event_after_content_is_relayed(path, body):
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = stream_error(500, stream_error_after=2)
        resp = await px.client.post(path, json=body)
        assert resp.status_code == 200
        (rec,) = d.completions()
        assert resp.content == px.relayed(rec)
        events = sse(resp.text)
        assert events[-1]["error"]["code"] == 500 and "choices" in events[-2]
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 0


async def test_stream_lead_is_not_held_past_the_first_byte_deadline():
    """D sends the role chunk, then nothing: at the first-byte deadline what was held is
    relayed, and the stream goes on as without the hold (here: the idle deadline ends it)."""
    # 1.5 s and 3 s: held to the first, never to both (4.5 s), with slack for a loaded box.
    async with running_proxy(first_token="decode", decode_ttfb_timeout=1.5, stream_idle_timeout=3.0) as px:
        p, d = await px.pd()
        d.fault = Fault(stall_after=1)  # the role chunk, then silence
        t0 = time.monotonic()
        async with px.client.stream("POST", "/v1/chat/completions", json=CHAT_STREAM) as r:
            assert r.status_code == 200
            chunks = r.aiter_raw()
            head = await anext(chunks)
            held_for = time.monotonic() - t0
            rest = b"".join([c async for c in chunks])
        (rec,) = d.completions()
        assert head == px.relayed(rec)  # the role chunk, held until the deadline
        assert 1.4 < held_for < 3.5, held_for
        error, done = rest.decode().split("\n\n")[:2]
        assert json.loads(error[6:])["error"]["code"] == "decode_timeout" and done == "data: [DONE]"
        await wait_until(lambda: rec.cancelled, what="D saw the abort")
        assert len(d.completions()) == 1  # not rescued
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 0


async def test_stream_first_token_is_not_delayed_by_the_hold():
    """The role chunk waits only for the first token, which is relayed the moment it comes:
    D sends the role chunk and t0, then nothing more; both reach the client (a hold that
    waited for more would relay nothing: no timing to race on a loaded box)."""
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = Fault(stall_after=2)  # the role chunk and t0, then silence
        async with px.client.stream("POST", "/v1/chat/completions", json=CHAT_STREAM) as r:
            async with asyncio.timeout(30):  # generous: not the subject
                head = await anext(r.aiter_raw())
        events = sse(head.decode())
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [e["choices"][0]["delta"].get("content") for e in events[1:]] == [" t0"]
        assert head == px.relayed(d.completions()[0])


async def test_stream_broken_off_before_content_is_rescued():
    """D drops the connection after the role chunk, before any token: a failure before its
    first byte too."""
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = Fault(fail_after=1, id_prefix=DISAGGREGATED_ID, times=1)
        resp = await px.client.post("/v1/chat/completions", json=CHAT_STREAM)
        assert resp.status_code == 200
        first, second = d.completions()
        assert first.fault_closed and local_id(second.request_id)
        assert resp.content == px.relayed(second)
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1


@STREAMS
async def test_stream_error_event_when_the_rescue_fails_too(path, body):
    """D alone streams the error event too: the client gets the first failure as an error
    answer (vLLM's error, its status), never a 200 that hides it."""
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = Fault(stream_error=500)  # disaggregated and alone alike
        resp = await px.client.post(path, json=body)
        assert resp.status_code == 500
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.json() == {"error": {"message": "Internal server error",
                                         "type": "InternalServerError", "param": None,
                                         "code": 500}}  # fmt: skip
        first, second = d.completions()
        assert local_id(second.request_id)
        assert resp.headers[XPYD_PATH] == "disaggregated"  # the first failure, with its headers
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1
        assert px.registry.live("D")[0].in_flight == 0


# ---------------------------------------------------------------- first token: sent before D's request


@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_first_token_leaves_before_ds_request_is_built(http):
    """The client connection holds what a loop turn writes until the turn ends
    (proxy/serving/corked.py); P's token must not wait for the rest of the turn, in which the proxy
    builds and sends D's continuation. Here sending D's request holds the loop for 0.5 s:
    the client must have P's token before that ends."""
    async with running_proxy(first_token="prefill", http=http) as px:
        await px.fake("P")
        d = await px.fake("D")
        upstream = px.state.upstream
        real = upstream.request
        held_at: list[float] = []

        async def request(method, url, body, headers):
            if url.startswith(f"http://{d.http_address}") and not held_at:
                held_at.append(time.monotonic())
                time.sleep(0.5)  # the rest of the turn: nothing else on the loop runs meanwhile
            return await real(method, url, body, headers)

        upstream.request = request
        port = px.server.port
        payload = json.dumps({**STREAM, "max_tokens": 3}).encode()

        def client() -> tuple[bytes, float]:  # a thread: the loop is blocked while it reads
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
                data = b""
                while b" t0" not in data:
                    more = c.recv(65536)
                    assert more, data
                    data += more
                return data, time.monotonic()

        try:
            data, got_at = await asyncio.to_thread(client)
        finally:
            del upstream.request
        assert data.startswith(b"HTTP/1.1 200") and held_at
        assert got_at - held_at[0] < 0.3, "P's token waited for the end of the turn that sends D's request"
        await wait_until(lambda: d.completions() and d.completions()[0].completed, what="D answered")


@pytest.mark.parametrize("fields", [{"echo": True, "logprobs": 1}, {"echo": True, "logprobs": 1, "max_tokens": 0},
                                    {"echo": True, "max_tokens": 0}, {"prompt_logprobs": 1}])
async def test_prompt_scoring_goes_to_d_alone(fields):
    """The prompt's logprobs are computed in the prefill: D would load none of P's KV and
    recompute the prompt (the KV then sat in D's buffer until its TTL). max_tokens 0 with echo
    (how eval harnesses score a prompt) is vLLM's 200, not a proxy's 400."""
    async with running_proxy() as px:
        p, d = await px.pd()
        body = {"model": "fake-model", "prompt": "Tell me about the sea " * 40, "max_tokens": 3, **fields}
        resp = await px.client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_prompt_logprobs"
        assert not p.completions() and d.completions()[0].json == body
        assert d.completions()[0].headers["x-request-id"].startswith("xpyd-local-")

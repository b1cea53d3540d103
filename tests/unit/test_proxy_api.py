"""The API and the two phases on the happy path: relays, request ids, bodies, headers,
the small endpoints, metrics, routing policies."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tests.support.proxy_helpers import REQUEST_ID_RE, Fault, running_proxy, wait_until
from xpyd_wire.headers import (
    XPYD_DECODE_INSTANCE,
    XPYD_DECODE_TTFB_MS,
    XPYD_FIRST_TOKEN,
    XPYD_PREFILL_INSTANCE,
    XPYD_PREFILL_MS,
    XPYD_PREFIX,
    XPYD_QUEUE_MS,
)

COMPLETION = {"model": "fake-model", "prompt": "Hello", "max_tokens": 5}
CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_completion_tokens": 4,
}


def _timing(headers) -> dict[str, float]:
    return {
        k: float(headers[k])
        for k in (XPYD_QUEUE_MS, XPYD_PREFILL_MS, XPYD_DECODE_TTFB_MS)
    }


@pytest.mark.parametrize(
    "path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("expose", [False, True])
async def test_two_phase_relay(path, body, stream, expose):
    async with running_proxy(first_token="decode", expose_routing_headers=expose) as px:
        p, d = await px.pd()
        raw = json.dumps(
            {
                **body,
                "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {}),
            }
        )
        resp = await px.client.post(
            path, content=raw.encode(), headers={"content-type": "application/json"}
        )
        assert resp.status_code == 200
        # Exactly one call each, P first, then D.
        assert len(p.completions()) == 1 and len(d.completions()) == 1
        pre, dec = p.completions()[0], d.completions()[0]
        assert pre.path == dec.path == path
        assert pre.received_at <= dec.received_at
        # The same request id, in the connector's format, to P and D; the client is told
        # it with --expose-routing-headers, else the neutral id (a keyed hash of its uuid), in the
        # answer only: vLLM sends no X-Request-Id header without --enable-request-id-headers.
        rid = pre.request_id
        assert dec.request_id == rid
        m = re.match(REQUEST_ID_RE, rid)
        assert m and m["p"] == p.zmq_address and m["d"] == d.zmq_address
        assert "x-request-id" not in resp.headers
        # Prefill: one token, not streamed, no stream_options; D: the client's bytes.
        assert pre.json["max_tokens"] == 1 and pre.json["stream"] is False
        assert "stream_options" not in pre.json
        if "messages" in body:
            assert pre.json["max_completion_tokens"] == 1
        assert {
            k: v
            for k, v in pre.json.items()
            if k not in ("max_tokens", "max_completion_tokens", "stream")
        } == {
            k: v
            for k, v in json.loads(raw).items()
            if k not in ("max_tokens", "max_completion_tokens", "stream", "stream_options")
        }
        assert dec.body == raw.encode()
        assert "kv_transfer_params" not in pre.json
        # D's answer, byte for byte (but for the request id vLLM echoes in "id").
        assert rid.encode() in dec.sent
        if expose:
            assert resp.content == bytes(dec.sent)
        else:
            assert resp.content == bytes(dec.sent).replace(rid.encode(), px.neutral(rid).encode())
            assert b"prefill_addr" not in resp.content
            if not stream:  # recomputed: the neutral id is shorter
                assert int(resp.headers["content-length"]) == len(resp.content)
        if stream:
            assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert resp.content.endswith(b"data: [DONE]\n\n")
        else:
            assert resp.headers["content-type"] == "application/json"
            assert resp.json()["choices"][0]["finish_reason"] == "length"
        timing = _timing(resp.headers)
        assert all(v >= 0 for v in timing.values())
        if expose:
            assert resp.headers[XPYD_PREFILL_INSTANCE] == p.http_address
            assert resp.headers[XPYD_DECODE_INSTANCE] == d.http_address
        else:
            assert not any(k.startswith(XPYD_PREFIX) and k.endswith("-instance") for k in resp.headers)
            for addr in (p.http_address, d.http_address, p.zmq_address, d.zmq_address):
                assert addr not in str(resp.headers) and addr.encode() not in resp.content


async def test_stream_is_relayed_incrementally():
    async with running_proxy() as px:
        await px.pd(token_delay=0.05)
        async with px.client.stream(
            "POST", "/v1/completions", json={**COMPLETION, "max_tokens": 6, "stream": True}
        ) as r:
            assert r.status_code == 200
            # Headers before the stream: P's token goes out first (the default for this request).
            assert r.headers[XPYD_FIRST_TOKEN] == "prefill" and XPYD_PREFILL_MS in r.headers
            arrivals = []
            loop = asyncio.get_running_loop()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(loop.time())
        assert len(arrivals) == 7  # 6 tokens + [DONE]
        assert arrivals[-1] - arrivals[0] > 0.15  # not buffered until the end


async def test_only_the_headers_vllm_reads_are_forwarded():
    """P and D get the client's trace context, data-parallel rank, session id, priority and
    load-metrics format (what vLLM 0.32 reads), the proxy's own content-type and request id;
    nothing else of the client's: no cookie, forwarding chain, custom or x-xpyd-* header."""
    kept = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "a=1",
            "x-data-parallel-rank": "0", "x-session-id": "s1", "x-vllm-priority": "3",
            "endpoint-load-metrics-format": "json"}
    dropped = {"authorization": "Bearer client-token", "cookie": "session=secret", "forwarded": "for=10.0.0.1",
               "x-forwarded-for": "10.0.0.1", "x-real-ip": "10.0.0.1", XPYD_PREFIX + "path": "local_decode",
               "x-custom": "1", "x-request-id": "client-chosen", "te": "trailers", "user-agent": "sdk/1"}
    async with running_proxy() as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json=COMPLETION, headers={**kept, **dropped})
        assert resp.status_code == 200
        for rec in (p.completions()[0], d.completions()[0]):
            # The client's key stays with the proxy (--forward-client-auth: test_proxy_security).
            assert {k: rec.headers.get(k) for k in kept} == kept
            assert not set(dropped) - {"x-request-id"} & set(rec.headers), rec.headers
            assert rec.headers["content-type"] == "application/json"
            assert rec.headers["x-request-id"].startswith("___prefill_addr_")


async def test_token_id_prompts_and_extra_fields_pass_through():
    async with running_proxy() as px:
        p, d = await px.pd()
        body = {
            "prompt": [[1, 2, 3], [4, 5]],
            "max_tokens": 3,
            "temperature": 0.1,
            "logprobs": 2,
            "vendor_field": {"x": 1},
        }
        resp = await px.client.post("/v1/completions", json=body)
        assert resp.status_code == 200
        assert p.completions()[0].json["vendor_field"] == {"x": 1}
        assert p.completions()[0].json["logprobs"] == 2
        assert d.completions()[0].json == body


async def test_models_health_metrics():
    async with running_proxy() as px:
        assert (await px.client.get("/health")).json() == {"status": "ok"}
        none = await px.client.get("/v1/models")
        assert none.status_code == 503 and "error" in none.json()
        await px.pd(model="tiny")
        models = await px.client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        await px.client.post("/v1/completions", json={**COMPLETION, "model": "tiny"})
        await px.client.post("/v1/completions", content=b"nope")
        metrics = await px.client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        text = metrics.text
        assert 'xpyd_requests_total{route="/v1/completions",status="200"} 1.0' in text
        assert 'xpyd_requests_total{route="/v1/completions",status="400"} 1.0' in text
        for phase in ("queue", "prefill", "decode_ttfb", "decode"):
            assert f'xpyd_phase_duration_seconds_count{{phase="{phase}"}} 1.0' in text
        assert 'xpyd_request_duration_seconds_count{route="/v1/completions"} 2.0' in text
        assert 'xpyd_instances{role="D"} 1.0' in text
        assert "xpyd_instance_in_flight{" in text
        assert "xpyd_discovery_messages_total" in text


async def test_in_flight_tracked_per_instance():
    async with running_proxy() as px:
        p, d = await px.pd()
        d.fault = Fault(stall_after=1)  # the stream stays open until the client leaves
        async with px.client.stream(
            "POST", "/v1/completions", json={**COMPLETION, "stream": True}
        ) as r:
            chunks = r.aiter_raw()  # keep a reference: a collected iterator closes the stream
            await anext(chunks)
            insts = {i["role"]: i for i in (await px.client.get("/instances")).json()}
            assert insts["D"]["in_flight"] == 1 and insts["P"]["in_flight"] == 0
            assert insts["D"]["in_flight_tokens"] > 0
            assert (
                await px.metric("xpyd_instance_in_flight", role="D", instance=d.http_address) == 1
            )
        await wait_until(lambda: px.registry.live("D")[0].in_flight == 0, what="released")


async def test_round_robin_spreads_over_instances():
    async with running_proxy() as px:
        ps = [await px.fake("P") for _ in range(2)]
        ds = [await px.fake("D") for _ in range(2)]
        for stream in (False, True, False, True):
            resp = await px.client.post("/v1/completions", json={**COMPLETION, "stream": stream})
            assert resp.status_code == 200
        assert [len(f.completions()) for f in ps + ds] == [2, 2, 2, 2]
        assert await px.metric("xpyd_requests_total", route="/v1/completions", status="200") == 4
        assert await px.metric("xpyd_client_disconnects_total") == 0


async def test_least_loaded_avoids_busy_decode():
    async with running_proxy(decode_policy="least_loaded", prefill_policy="least_loaded") as px:
        await px.fake("P")
        a, b = await px.fake("D"), await px.fake("D")
        a.fault = Fault(stall_after=1)  # whichever D gets the first request holds it open
        b.fault = Fault(stall_after=1)
        stalled = asyncio.ensure_future(
            px.client.post("/v1/completions", json={**COMPLETION, "stream": True}, timeout=30)
        )
        await wait_until(lambda: sum(i.in_flight for i in px.registry.live("D")) == 1)
        loaded = next(i for i in px.registry.live("D") if i.in_flight == 1)
        other = b if loaded.http_address == a.http_address else a
        other.fault = None
        for _ in range(3):
            assert (await px.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert len(other.completions()) == 3
        stalled.cancel()


async def test_unknown_route_and_method_answer_as_vllm_does():
    """vLLM's (FastAPI's) own JSON for a path it does not serve and a method a route lacks."""
    async with running_proxy() as px:
        r = await px.client.get("/v1/nope")
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
        r = await px.client.get("/v1/completions")
        assert (r.status_code, r.json(), r.headers["allow"]) == (405, {"detail": "Method Not Allowed"}, "POST")


async def test_fastapi_app_serves_completions_without_fast_path():
    """create_app() alone is a complete app: the completion routes are mounted in FastAPI
    too (fast_path() only lets uvicorn skip Starlette's routing for them)."""
    import httpx

    from proxy.config import ProxyConfig
    from proxy.serving.app import create_app
    from tests.support.proxy_helpers import FakeVLLM
    from xpyd_wire.discovery import Registration

    app = create_app(ProxyConfig())
    state = app.state.proxy
    fakes = [await FakeVLLM(role, register=False).start() for role in ("P", "D")]
    try:
        for f in fakes:
            state.registry.admit(state.registry.upsert(Registration(f.role, f.http_address,
                                                                    f.zmq_address)))  # fmt: skip
        await state.upstream.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
                for stream in (False, True):
                    r = await client.post(path, json={**body, "stream": stream})
                    assert r.status_code == 200
                    rec = fakes[1].completions()[-1]
                    rid = rec.request_id  # clients get the neutral id
                    neutral = state.router.dispatcher.decode.ids.neutral(rid)
                    assert r.content == bytes(rec.sent).replace(rid.encode(), neutral.encode())
            bad = await client.post("/v1/completions", content=b"{")
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "Bad Request"  # D's vLLM judged it
            assert fakes[1].requests[-1].body == b"{"
        await state.upstream.close()
    finally:
        for f in fakes:
            await f.stop()

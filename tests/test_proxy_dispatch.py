"""Dispatch: retries on another D before the first byte, concurrent dispatch, and D serving a
request alone (short prompt, no P). Real proxy, fake instances over real HTTP and ZMQ."""

from __future__ import annotations

import asyncio
import re

from proxy_helpers import REQUEST_ID_RE, Fault, running_proxy, wait_until

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
            assert resp.headers["x-xpyd-decode-instance"] == d2.http_address
        assert statuses == [200] * 10
        assert len(d2.completions()) == 10
        # Each retry redid the prefill with a new P/D pair: P saw the dead D's id once.
        retried = await px.metric("xpyd_decode_retries_total")
        assert retried >= 1 and len(p.completions()) == 10 + retried


async def test_decode_5xx_before_first_byte_is_retried_4xx_is_not():
    async with running_proxy(expose_routing_headers=True) as px:
        await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        d1.fault = Fault(status=503, times=1)  # round robin asks d1 first
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and "data: [DONE]" in resp.text
        assert resp.headers["x-xpyd-decode-instance"] == d2.http_address
    async with running_proxy(decode_retries=1) as px:
        p = await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        d1.fault = Fault(status=503, times=1)
        d2.fault = Fault(status=503, times=1)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 503  # both failed: D's own error JSON is relayed
        assert resp.json()["error"]["message"] == "fake D failure"
        assert await px.metric("xpyd_decode_retries_total") == 1
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
    async with running_proxy(decode_retries=0) as px:
        await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        d1.fault = d2.fault = Fault(status=500, times=1)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 500


async def test_concurrent_dispatch_overlaps_decode_with_prefill():
    async with running_proxy(dispatch="concurrent") as px:
        p, d = await px.pd()
        p.fault = Fault(delay=0.3)
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and "data: [DONE]" in resp.text
        (pre,), (dec,) = p.completions(), d.completions()
        # D had the request while P was still prefilling, with the same transfer id.
        assert dec.received_at < pre.received_at + 0.25
        assert pre.request_id == dec.request_id
        assert re.match(REQUEST_ID_RE, dec.request_id)
        assert pre.json["max_tokens"] == 1 and dec.json["max_tokens"] == 5


async def test_concurrent_dispatch_prefill_failure_aborts_decode_at_once():
    async with running_proxy(dispatch="concurrent", prefill_retries=0) as px:
        p, d = await px.pd()
        d.fault = Fault(hang=True)  # D waits for the KV
        p.fault = Fault(status=500, delay=0.2)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 500 and resp.json()["error"]["message"] == "fake P failure"
        await wait_until(lambda: d.completions()[0].cancelled, timeout=2, what="D aborted")


async def test_concurrent_dispatch_dead_decode_aborts_prefill_and_retries():
    async with running_proxy(dispatch="concurrent", heartbeat_timeout=30,
                             expose_routing_headers=True) as px:  # fmt: skip
        p = await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        await d1.stop()  # round robin asks d1 first
        p.fault = Fault(delay=0.5)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200
        assert resp.headers["x-xpyd-decode-instance"] == d2.http_address
        # The prefill paired with the dead D was abandoned as soon as D refused (if it
        # reached P at all): only the retry's prefill ran to its end.
        await asyncio.sleep(0.6)
        assert [r.completed for r in p.completions()].count(True) == 1
        assert all(r.completed or r.cancelled for r in p.completions())


async def test_short_prompt_goes_to_decode_alone():
    async with running_proxy(local_prefill_threshold=50) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and "data: [DONE]" in resp.text
        assert resp.headers["x-xpyd-path"] == "local_short"
        assert not p.completions()
        (alone,) = d.completions()
        assert alone.request_id.startswith("xpyd-local-")
        assert alone.json == STREAM  # the client's request, unchanged
        resp = await px.client.post("/v1/completions", json=LONG)
        assert resp.status_code == 200 and "x-xpyd-path" not in resp.headers
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
        assert resp.headers["x-xpyd-path"] == "local_no_prefill"
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

"""Failures and bad input: always OpenAI error JSON with the right status, never a 200 that
hides a failure; retries, deadlines, cancellation, auth."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.proxy_errors import assert_error, open_raw
from tests.support.proxy_helpers import Fault, running_proxy, wait_until
from xpyd_wire.headers import XPYD_PATH, XPYD_PREFILL_INSTANCE, XPYD_PREFILL_MS

COMPLETION = {"model": "fake-model", "prompt": "Hello", "max_tokens": 5}
STREAM = {**COMPLETION, "stream": True}


async def register_dead(px, role: str, models: bool = True) -> str:
    """Register an instance that answered its join probe and then went away: its HTTP port
    now refuses connections (one that never answered is never selected at all). Its
    registration lives on until the heartbeat timeout. models=False: it never told its models."""
    gone = await px.fake(role, register=False)
    if not models:
        gone.models_status = 404  # admitted on /health, models unknown
    await gone.send_registration()
    addr = gone.http_address
    await wait_until(lambda: any(i.http_address == addr for i in px.registry.live(role)))
    await gone.stop()
    return addr


# ---------------------------------------------------------------- bad input


BAD_INPUT = [
    b"{not json",
    b"",
    b"\xff\xfe",
    b"[1, 2]",
    b'"text"',
    b'{"max_tokens": 5}',
    b'{"prompt": "a", "messages": [{"role": "user"}], "max_tokens": -5}',
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_what_the_proxy_cannot_read_gets_vllms_own_verdict(path):
    """A body the proxy cannot route by goes to one D as it came (P is not asked): the
    client gets vLLM's own 400, not one of the proxy's making (a client cannot tell us
    from one vLLM server, refusals included)."""
    async with running_proxy() as px:
        p, d = await px.pd()
        for content in BAD_INPUT:
            resp = await px.client.post(path, content=content, headers={"content-type": "application/json"})
            assert resp.status_code == 400, content
            assert resp.json() == json.loads(bytes(d.requests[-1].sent))  # D's answer, as it wrote it
            assert d.requests[-1].body == content and resp.headers[XPYD_PATH] == "local_verdict"
        assert not p.requests or all(r.method == "GET" for r in p.requests)
        assert await px.metric("xpyd_requests_total", route=path, status="400") == len(BAD_INPUT)
        assert await px.metric("xpyd_dispatch_total", path="local_verdict") == len(BAD_INPUT)


async def test_what_vllm_accepts_but_the_proxy_cannot_read_is_served_by_d_alone():
    """vLLM's parser converts "stream": "true" and "max_tokens": "3": it serves them, so D does."""
    async with running_proxy() as px:
        p, d = await px.pd()
        body = {**COMPLETION, "stream": "true", "max_tokens": "3"}
        resp = await px.client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_verdict"
        assert d.completions()[-1].json == body and not p.completions()


async def test_body_too_large_is_413():
    async with running_proxy(max_body_bytes=1000) as px:
        p, d = await px.pd()
        big = {"prompt": "x" * 2000}
        assert_error(await px.client.post("/v1/completions", json=big), 413, "request_too_large")

        async def chunked():  # no Content-Length: the limit applies while reading
            for _ in range(4):
                yield b" " * 400
            yield b'{"prompt": "a"}'

        resp = await px.client.post("/v1/completions", content=chunked())
        assert_error(resp, 413, "request_too_large")
        assert (await px.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert len(p.completions()) == 1


# ---------------------------------------------------------------- no instances


async def test_no_decode_is_503_and_no_prefill_without_fallback_is_503():
    async with running_proxy() as px:
        assert_error(
            await px.client.post("/v1/completions", json=COMPLETION), 503, "no_decode_instance"
        )
        p = await px.fake("P")
        assert_error(
            await px.client.post("/v1/completions", json=COMPLETION), 503, "no_decode_instance"
        )
        assert not p.completions()
    async with running_proxy(fallback_to_decode=False) as px:
        d = await px.fake("D")
        err = assert_error(
            await px.client.post("/v1/completions", json=COMPLETION), 503, "no_prefill_instance"
        )
        assert err["message"] == "no prefill instance is available"
        assert not d.completions()


# ---------------------------------------------------------------- prefill failures


async def test_prefill_500_is_relayed_and_decode_never_called():
    async with running_proxy() as px:
        p, d = await px.pd()
        p.fault = Fault(status=500)
        resp = await px.client.post("/v1/completions", json=STREAM)
        err = assert_error(resp, 500)
        assert err["message"] == "fake P failure"  # vLLM's error JSON, relayed as is
        assert "x-request-id" not in resp.headers and XPYD_PREFILL_MS in resp.headers  # P's attempt's headers
        assert not d.completions()
        assert (
            await px.metric(
                "xpyd_upstream_errors_total", role="P", instance=p.http_address, kind="http_500"
            )
            == 1
        )


async def test_prefill_400_is_ds_to_judge_and_html_error_wrapped():
    """P's 400 was on a request cut down to one token, and vLLM answers some refusals as a
    200 stream with an error event: D judges the client's own request (here it accepts it).
    P's 5xx is relayed, D not asked."""
    async with running_proxy() as px:
        p, d = await px.pd()
        p.fault = Fault(status=400, times=1)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_verdict"
        assert d.completions()[-1].json == COMPLETION
        assert d.completions()[-1].headers["x-request-id"].startswith("xpyd-local-")
        d.requests.clear()
        p.fault = Fault(
            status=502, error_body=b"<html>Bad Gateway</html>", content_type="text/html"
        )
        err = assert_error(
            await px.client.post("/v1/completions", json=COMPLETION), 502, "prefill_error"
        )
        # Which instance failed is in the log and the metrics, not in the client's answer.
        assert err["message"] == "prefill instance answered HTTP 502: <html>Bad Gateway</html>"
        assert not d.completions()


async def test_unreachable_prefill_is_retried_on_another():
    async with running_proxy(expose_routing_headers=True) as px:  # reads x-xpyd-*-instance
        dead = await register_dead(px, "P")  # first in the table: round robin tries it first
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200
        assert resp.headers[XPYD_PREFILL_INSTANCE] == p.http_address
        # The id names the P that did the prefill, and D got that same id.
        assert p.completions()[0].request_id == d.completions()[0].request_id
        assert (
            await px.metric("xpyd_upstream_errors_total", role="P", instance=dead, kind="connect")
            == 1
        )
        assert await px.metric("xpyd_prefill_retries_total") == 1
        # The refused instance now cools down: the next requests go straight to the good one.
        for _ in range(2):
            assert (await px.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert (
            await px.metric("xpyd_upstream_errors_total", role="P", instance=dead, kind="connect")
            == 1
        )


async def test_all_prefill_unreachable_falls_back_to_decode_or_is_502():
    async with running_proxy(prefill_retries=2) as px:
        await register_dead(px, "P")
        d = await px.fake("D")
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200, resp.text
        assert resp.headers[XPYD_PATH] == "local_no_prefill"
        # D prefills alone: a plain request id, which the connector does not wait on.
        (seen,) = d.completions()
        assert seen.request_id.startswith("xpyd-local-") and "prefill_addr" not in seen.request_id
        assert await px.metric("xpyd_dispatch_total", path="local_no_prefill") == 1
    async with running_proxy(prefill_retries=2, fallback_to_decode=False) as px:
        await register_dead(px, "P")
        d = await px.fake("D")
        assert_error(
            await px.client.post("/v1/completions", json=COMPLETION), 502, "prefill_unreachable"
        )
        assert not d.completions()


async def test_prefill_timeout_retries_then_504():
    # 2 s: the other P must answer within it on a loaded box.
    async with running_proxy(prefill_timeout=2.0, expose_routing_headers=True) as px:
        slow, fast = await px.fake("P"), await px.fake("P")
        d = await px.fake("D")
        slow.fault = Fault(hang=True)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200  # retried on the other P
        assert resp.headers[XPYD_PREFILL_INSTANCE] == fast.http_address
        await wait_until(lambda: slow.completions()[0].cancelled, what="slow P saw the abort")
        fast.fault = Fault(hang=True)
        assert_error(
            await px.client.post("/v1/completions", json=COMPLETION), 504, "prefill_timeout"
        )
        assert len(d.completions()) == 1


# ---------------------------------------------------------------- decode failures


async def test_decode_error_before_first_byte_is_relayed():
    """D's 5xx, when D alone (the local rescue) fails as well: D's error is relayed."""
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = Fault(status=503)
        assert_error(await px.client.post("/v1/completions", json=STREAM), 503)
        assert len(d.completions()) == 2  # the disaggregated request, then D alone
        d.fault = Fault(status=500, error_body=b"Internal Server Error", content_type="text/plain")
        err = assert_error(
            await px.client.post("/v1/completions", json=STREAM), 500, "decode_error"
        )
        assert "Internal Server Error" in err["message"]


async def test_decode_unreachable_is_502():
    async with running_proxy() as px:
        await px.fake("P")
        await register_dead(px, "D")
        assert_error(
            await px.client.post("/v1/completions", json=COMPLETION), 502, "decode_unreachable"
        )


async def test_decode_first_byte_timeout_is_504():
    async with running_proxy(first_token="decode", decode_ttfb_timeout=0.3) as px:
        p, d = await px.pd()
        d.fault = Fault(stall_after=0)  # headers, then nothing
        assert_error(await px.client.post("/v1/completions", json=STREAM), 504, "decode_timeout")
        await wait_until(lambda: d.completions()[0].cancelled, what="D saw the abort")
        # The deadline is spent: D is not asked again alone.
        assert len(d.completions()) == 1
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 0


async def test_decode_fails_mid_stream_sends_error_event():
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = Fault(fail_after=3)
        resp = await px.client.post("/v1/completions", json={**STREAM, "max_tokens": 10})
        assert resp.status_code == 200  # the status left before the failure
        events = [e for e in resp.text.split("\n\n") if e]
        assert len(events) == 5
        assert all(json.loads(e[6:]).get("choices") for e in events[:3])
        err = json.loads(events[3].removeprefix("data: "))["error"]
        assert err["code"] == "decode_midstream" and set(err) == {
            "message",
            "type",
            "param",
            "code",
        }
        assert events[4] == "data: [DONE]"  # vLLM 0.32 ends a stream with [DONE] after its error event too
        assert (
            await px.metric(
                "xpyd_upstream_errors_total", role="D", instance=d.http_address, kind="midstream"
            )
            == 1
        )


async def test_decode_stream_idle_timeout():
    async with running_proxy(stream_idle_timeout=0.3) as px:
        p, d = await px.pd()
        d.fault = Fault(stall_after=2)
        resp = await px.client.post("/v1/completions", json=STREAM)
        events = [e for e in resp.text.split("\n\n") if e]
        assert json.loads(events[-2][6:])["error"]["code"] == "decode_timeout" and events[-1] == "data: [DONE]"
        await wait_until(lambda: d.completions()[0].cancelled, what="D saw the abort")


# ---------------------------------------------------------------- client disconnects


async def test_client_disconnect_mid_stream_aborts_decode():
    async with running_proxy() as px:
        p, d = await px.pd(token_delay=0.05)
        reader, writer = await open_raw(px, "/v1/completions", {**STREAM, "max_tokens": 200})
        await asyncio.wait_for(reader.readuntil(b"data: "), 5)  # streaming has begun
        writer.close()
        await wait_until(lambda: d.completions()[0].cancelled, what="D saw the abort")
        assert not d.completions()[0].completed
        await wait_until(lambda: px.registry.live("D")[0].in_flight == 0)
        assert await px.metric("xpyd_client_disconnects_total") == 1


async def test_client_disconnect_during_prefill_aborts_and_skips_decode():
    async with running_proxy() as px:
        p, d = await px.pd()
        p.fault = Fault(hang=True)
        reader, writer = await open_raw(px, "/v1/completions", COMPLETION)
        await wait_until(lambda: p.completions(), what="P got the prefill")
        writer.close()
        await wait_until(lambda: p.completions()[0].cancelled, what="P saw the abort")
        await asyncio.sleep(0.05)  # give a wrongly-continuing proxy the chance to call D
        assert not d.completions()
        assert px.registry.live("P")[0].in_flight == 0


async def test_client_disconnect_before_decode_first_byte():
    async with running_proxy() as px:
        p, d = await px.pd()
        d.fault = Fault(hang=True)
        reader, writer = await open_raw(
            px,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": True},
        )
        await wait_until(lambda: d.completions(), what="D got the request")
        writer.close()
        await wait_until(lambda: d.completions()[0].cancelled, what="D saw the abort")


# ---------------------------------------------------------------- auth


async def test_api_key():
    async with running_proxy(api_key="sekret") as px:
        p, d = await px.pd()
        assert_error(
            await px.client.post("/v1/completions", json=COMPLETION), 401, "invalid_api_key"
        )
        bad = await px.client.post(
            "/v1/completions", json=COMPLETION, headers={"authorization": "Bearer nope"}
        )
        assert_error(bad, 401)
        assert bad.headers["www-authenticate"] == "Bearer"
        assert_error(await px.client.get("/v1/models"), 401)
        assert_error(await px.client.get("/instances"), 401)
        assert not p.completions() and not d.completions()
        auth = {"authorization": "Bearer sekret"}
        ok = await px.client.post(
            "/v1/chat/completions",
            headers=auth,
            json={"messages": [{"role": "user", "content": "x"}]},
        )
        assert ok.status_code == 200
        # The client's key is the proxy's: not passed on (--forward-client-auth would).
        assert "authorization" not in p.completions()[0].headers
        assert "authorization" not in d.completions()[0].headers
        assert (await px.client.get("/v1/models", headers=auth)).status_code == 200
        assert (await px.client.get("/instances", headers=auth)).status_code == 200
        for open_path in ("/health", "/metrics"):
            assert (await px.client.get(open_path)).status_code == 200
        assert await px.metric("xpyd_requests_total", route="/v1/completions", status="401") == 2


async def test_models_when_instances_unreachable_is_502():
    async with running_proxy() as px:
        await register_dead(px, "D", models=False)
        assert_error(await px.client.get("/v1/models"), 502)

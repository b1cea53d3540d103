"""D alone after every disaggregated attempt failed before D's first byte (the local rescue):
when it runs, on which D, under which deadline, and what the client and the operator see.
Real proxy, fake instances over real HTTP and ZMQ (mutation survivors of
proxy/dispatch/rescue.py and the paths that lead to it)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from tests.support.proxy_helpers import Fault, register_dead, running_proxy, wait_until
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_FIRST_TOKEN, XPYD_PATH

COMPLETION = {"model": "fake-model", "prompt": "Hello there", "max_tokens": 5}
STREAM = {**COMPLETION, "stream": True}


async def test_rescue_after_a_concurrent_attempt_whose_d_refused_before_p_answered():
    """Concurrent dispatch: the D paired with P refused the connection while P was still
    prefilling, so the attempt failed before P answered (no D answer was ever due). D alone
    on the other D then gets the whole first-byte deadline, from now."""
    async with running_proxy(dispatch="concurrent", decode_retries=0, heartbeat_timeout=30,
                             expose_routing_headers=True) as px:  # fmt: skip
        p = await px.fake("P")
        dead = await register_dead(px, "D")  # first in the table: round robin asks it first
        d = await px.fake("D")
        p.fault = Fault(delay=0.3)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200, resp.text
        assert resp.headers[XPYD_PATH] == "local_rescue"
        assert resp.headers[XPYD_DECODE_INSTANCE] == d.http_address != dead
        (alone,) = d.completions()
        assert alone.request_id.startswith("xpyd-local-") and alone.json == COMPLETION
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1
        # The D that answered alone counts it as served.
        view = {i["http_address"]: i for i in (await px.client.get("/instances")).json()}
        assert view[d.http_address]["served"] == 1 and view[d.http_address]["in_flight"] == 0


# vLLM 0.32's answer to a disaggregated request whose KV load failed (kv_load_failure_policy=fail).
KV_ERROR = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
KV_LOAD_FAILED = Fault(status=500, id_prefix="___prefill_addr_", error_body=json.dumps({"error": KV_ERROR}).encode())


async def test_rescue_is_logged_with_the_failure_it_mends(caplog):
    async with running_proxy(first_token="decode", decode_retries=0, expose_routing_headers=True) as px:
        p, d = await px.pd()
        d.fault = Fault(**{**KV_LOAD_FAILED.__dict__, "times": 1})
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_rescue"
        assert resp.headers[XPYD_DECODE_INSTANCE] == d.http_address
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode rescue")]
    assert lines == [f"decode rescue: D alone instance={d.http_address} attempt=2 failed_status=500 "
                     "error=decode failed: HTTP 500 in its answer"]  # fmt: skip


async def test_rescue_without_a_free_d_before_the_deadline_relays_the_failure(caplog):
    """The only other D is full (decode_max_in_flight 1) past the failed attempt's
    first-byte deadline: no rescue, the client gets D's own error when that deadline ends,
    and the full D is not asked."""
    async with running_proxy(first_token="decode", decode_retries=0, decode_max_in_flight=1,
                             decode_ttfb_timeout=1.0) as px:  # fmt: skip
        await px.fake("P")
        blocker, busy, free = await _one_d_held_one_failing(px)
        try:
            with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
                t0 = time.monotonic()
                resp = await px.client.post("/v1/completions", json=COMPLETION)
                elapsed = time.monotonic() - t0
            assert resp.status_code == 500 and resp.json()["error"]["message"] == "Internal server error"
            assert 0.9 < elapsed < 6, elapsed  # not the 30 s queue_timeout
            assert len(busy.completions()) == 1 and len(free.completions()) == 1
        finally:
            blocker.cancel()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode rescue")]
    assert lines == ["decode rescue skipped attempt=2 reason=no_slot error="]


async def test_rescue_when_every_d_left_meanwhile_relays_the_failure(caplog):
    async with running_proxy(first_token="decode", decode_retries=0) as px:
        p, d = await px.pd()
        d.fault = Fault(**{**KV_LOAD_FAILED.__dict__, "delay": 0.5})
        task = asyncio.get_running_loop().create_task(px.client.post("/v1/completions", json=COMPLETION))
        await wait_until(lambda: d.completions(), what="D asked")
        d.stop_heartbeats()
        await d.send_registration(leave=True)
        await wait_until(lambda: not px.registry.live("D"), what="D left")
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await task
        assert resp.status_code == 500 and resp.json() == {"error": KV_ERROR}
        assert len(d.completions()) == 1  # no D alone
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode rescue")]
    assert lines == ["decode rescue skipped attempt=2 reason=no_instance"]


async def test_a_rescue_that_fails_too_is_logged_with_the_status_relayed(caplog):
    async with running_proxy(first_token="decode", decode_retries=0) as px:
        p, d = await px.pd()
        d.fault = Fault(**{**KV_LOAD_FAILED.__dict__, "id_prefix": None})  # D alone fails too
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 500 and resp.json() == {"error": KV_ERROR}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode rescue")]
    assert lines == [
        f"decode rescue: D alone instance={d.http_address} attempt=2 failed_status=500 "
        "error=decode failed: HTTP 500 in its answer",
        f"decode rescue failed instance={d.http_address} attempt=2 error=decode failed: HTTP 500 in its answer "
        "relaying_status=500",
    ]


# ---------------------------------------------------------------- first token from P: D's continuation


def _sse_events(text: str) -> list:
    return [json.loads(e[6:]) if e != "data: [DONE]" else "[DONE]" for e in text.split("\n\n") if e]


async def test_a_continuation_failing_alone_too_is_logged_with_both_failures(caplog):
    """First token from P; D fails the continuation (500) and D alone fails too: both are
    logged, and the stream ends with the first failure's error (proxy/dispatch/continuation.py)."""
    async with running_proxy() as px:
        p, d = await px.pd()
        d.fault = Fault(status=500)
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json=STREAM)
        got = _sse_events(resp.text)
        assert resp.status_code == 200 and got[0]["choices"][0]["text"] == " t0"
        assert got[1:] == [{"error": {"message": "fake D failure", "type": "BadRequestError", "param": None,
                                      "code": 500}}, "[DONE]"]  # fmt: skip
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode continuation")]
    assert lines == [
        "decode continuation failed before its first byte error=decode failed: HTTP 500 in its answer; "
        f"D alone on instance={d.http_address}",
        f"decode continuation alone failed instance={d.http_address} error=decode failed: HTTP 500 in its answer; "
        "ending the stream with: decode failed: HTTP 500 in its answer",
    ]


async def test_a_continuation_without_a_free_d_before_the_deadline_ends_with_the_failure(caplog):
    """The other D is full (decode_max_in_flight 1) until the continuation's first-byte
    deadline has passed: D alone is skipped, not tried late, and the stream ends with the
    failure when that deadline ends."""
    async with running_proxy(decode_max_in_flight=1, decode_ttfb_timeout=1.0) as px:
        await px.fake("P")
        blocker, busy, free = await _one_d_held_one_failing(px)
        try:
            with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
                t0 = time.monotonic()
                resp = await px.client.post("/v1/completions", json=STREAM)
                elapsed = time.monotonic() - t0
            got = _sse_events(resp.text)
            assert resp.status_code == 200 and got[0]["choices"][0]["text"] == " t0"
            assert got[1:] == [{"error": KV_ERROR}, "[DONE]"]
            assert 0.9 < elapsed < 6, elapsed  # the deadline, not the 30 s queue_timeout
            assert len(busy.completions()) == 1 and len(free.completions()) == 1  # D alone not tried
        finally:
            blocker.cancel()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode continuation")]
    assert lines == [
        f"decode continuation failed before its first byte error=decode failed: HTTP 500 in its answer; "
        f"D alone on instance={free.http_address}",
        f"decode continuation alone skipped instance={free.http_address} reason=deadline_spent; ending the stream "
        "with: decode failed: HTTP 500 in its answer",
    ]


def _texts(got: list) -> str:
    return "".join(
        (e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content") or "")
        for e in got
        if isinstance(e, dict) and e.get("choices")
    )


async def test_a_one_token_answer_from_p_alone_is_a_stream_under_the_neutral_id(caplog):
    """P's token is the whole answer: it goes out as a stream (chunked, like vLLM's), under
    the neutral id, and is closed without an error (mutants: the answer made a whole body,
    without its id rewrite, or a stitched answer that fails to close)."""
    async with running_proxy() as px:
        p, d = await px.pd()
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy"):
            resp = await px.client.post("/v1/completions", json={**STREAM, "max_tokens": 1})
            await wait_until(lambda: px.registry.live("D")[0].in_flight == 0, what="D released")
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "prefill_alone"
        assert resp.headers.get("transfer-encoding") == "chunked" and "content-length" not in resp.headers
        got = _sse_events(resp.text)
        assert _texts(got) == " t0" and got[-1] == "[DONE]" and not d.completions()
        neutral = px.neutral(p.completions()[-1].request_id)
        assert len(neutral) == 16 and "___prefill_addr_" not in resp.text and "x-request-id" not in resp.headers
        assert all(e["id"].startswith(f"cmpl-{neutral}") for e in got[:-1])


async def test_a_continuation_rescued_on_another_d_leaves_no_instance_held(caplog):
    """D alone on the other D: once the answer is relayed, every D is released whole, its
    requests and its tokens, and nothing failed on the way (mutants of the rescuer's release)."""
    async with running_proxy() as px:
        await px.fake("P")
        ds = [await px.fake("D"), await px.fake("D")]
        for d in ds:  # the D chosen fails its disaggregated request; any plain one succeeds
            d.fault = Fault(status=500, id_prefix="___prefill_addr_")
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy"):
            resp = await px.client.post("/v1/completions", json=STREAM)
            got = _sse_events(resp.text)
            assert _texts(got) == " t0 t1 t2 t3 t4" and got[-1] == "[DONE]"
            assert sorted(len(d.completions()) for d in ds) == [1, 1]  # failed on one, alone on the other
            await wait_until(lambda: all(i.in_flight == 0 for i in px.registry.live("D")), what="Ds released")
            assert [(i.in_flight, i.in_flight_tokens) for i in px.registry.live("D")] == [(0, 0), (0, 0)]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_d_alone_continues_a_chat_on_the_completions_route():
    """A chat's continuation is a completions request (its events made chat chunks); D alone
    gets it on the same route (mutant: D alone asked on the client's chat route)."""
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    async with running_proxy() as px:
        p, d = await px.pd()
        d.fault = Fault(status=500, times=1)
        resp = await px.client.post("/v1/chat/completions", json=chat)
        got = _sse_events(resp.text)
        assert resp.status_code == 200 and _texts(got) == " t0 t1 t2 t3" and got[-1] == "[DONE]"
        failed, alone = d.completions()
        assert failed.path == alone.path == "/v1/completions"
        assert "messages" not in alone.json and alone.json["prompt"] == failed.json["prompt"]


async def test_stream_error_events_of_the_continuation_and_of_d_alone_end_the_stream():
    """D's continuation streams vLLM's error event (a failed KV load), and so does D alone:
    each is judged a failure before D's first byte (not relayed as content), and the stream
    ends with the first one (mutants: the request headers or the instance lost on the way)."""
    async with running_proxy() as px:
        p, d = await px.pd()
        d.fault = Fault(stream_error=500)
        resp = await px.client.post("/v1/completions", json=STREAM)
        got = _sse_events(resp.text)
        assert resp.status_code == 200 and got[0]["choices"][0]["text"] == " t0"
        assert got[1:] == [{"error": KV_ERROR}, "[DONE]"]
        failed, alone = d.completions()
        assert failed.request_id.startswith("___prefill_addr_") and alone.request_id.startswith("xpyd-local-")
        assert await px.metric("xpyd_upstream_errors_total", role="D", instance=d.http_address, kind="http_500") == 2


async def test_a_continuations_stream_error_event_is_mended_by_d_alone():
    async with running_proxy() as px:
        p, d = await px.pd()
        d.fault = Fault(stream_error=500, id_prefix="___prefill_addr_")
        resp = await px.client.post("/v1/completions", json=STREAM)
        got = _sse_events(resp.text)
        assert _texts(got) == " t0 t1 t2 t3 t4" and got[-1] == "[DONE]" and len(d.completions()) == 2


async def test_d_alone_is_tried_with_less_than_a_second_of_the_deadline_left():
    """Any time left is enough to ask D alone (mutant: a second or more needed)."""
    async with running_proxy(decode_ttfb_timeout=0.9) as px:
        p, d = await px.pd()
        d.fault = Fault(status=500, times=1)
        resp = await px.client.post("/v1/completions", json=STREAM)
        got = _sse_events(resp.text)
        assert _texts(got) == " t0 t1 t2 t3 t4" and got[-1] == "[DONE]" and len(d.completions()) == 2


async def test_d_alone_gets_only_what_is_left_of_the_continuations_deadline():
    """D fails the continuation 2.5 s into a 4 s first-byte deadline, then D alone says
    nothing: the stream ends when the 4 s are up, not 4 s after D alone was asked (6.5 s)."""
    async with running_proxy(decode_ttfb_timeout=4.0) as px:
        p, d = await px.pd()
        d.fault = Fault(status=500, delay=2.5, times=1)
        t0 = time.monotonic()
        task = asyncio.get_running_loop().create_task(px.client.post("/v1/completions", json=STREAM))
        await wait_until(lambda: d.completions(), what="D asked")
        d.fault = Fault(hang=True)  # D alone's request: no answer
        resp = await task
        t_end = time.monotonic()
        got = _sse_events(resp.text)
        assert got[0]["choices"][0]["text"] == " t0" and got[-2]["error"]["code"] == 500 and got[-1] == "[DONE]"
        assert len(d.completions()) == 2
        # Timed from D alone's request, not the client's: a loaded box delays the proxy's
        # steps before it, not the deadline after it (here ~1.5 s; the mutant's is 4 s).
        elapsed, alone = t_end - t0, t_end - d.completions()[1].received_at
        assert elapsed > 3.9 and alone < 3.2, (elapsed, alone)


async def test_the_continuations_first_byte_is_timed_from_ps_token():
    """decode_ttfb, in first-token mode: from P's token to D's first bytes (mutant: a sum)."""
    async with running_proxy() as px:
        p, d = await px.pd()
        t0 = time.monotonic()
        resp = await px.client.post("/v1/completions", json=STREAM)
        took = time.monotonic() - t0
        assert _texts(_sse_events(resp.text)) == " t0 t1 t2 t3 t4"
        assert await px.metric("xpyd_phase_duration_seconds_count", phase="decode_ttfb") == 1
        assert 0 < await px.metric("xpyd_phase_duration_seconds_sum", phase="decode_ttfb") < took


def test_a_stitched_answer_is_relayed_only_through_its_answer():
    from proxy.dispatch.continuation import _Stitched

    stitched = _Stitched()
    with pytest.raises(NotImplementedError, match="^a stitched stream is relayed through its Answer$"):
        stitched.chunks()
    with pytest.raises(NotImplementedError, match="^a stitched stream is relayed, not read$"):
        asyncio.run(stitched.read())


async def test_ds_continuation_events_carry_ps_created_and_arrive_intact():
    """D answers a second later, event by event: every event the client gets parses, and all
    carry the created of P's (one stream, one created; mutants: D's created kept, bytes
    added between D's pieces)."""
    async with running_proxy() as px:
        p, d = await px.pd()
        d.fault = Fault(delay=1.1, token_delay=0.2)  # D's created is at least a second after P's
        resp = await px.client.post("/v1/completions", json=STREAM)
        got = _sse_events(resp.text)
        assert _texts(got) == " t0 t1 t2 t3 t4" and got[-1] == "[DONE]" and len(got) == 6
        (p_rec,) = p.completions()
        p_created = json.loads(p_rec.sent)["created"]
        assert {e["created"] for e in got[:-1]} == {p_created}
        (d_rec,) = d.completions()
        assert json.loads(bytes(d_rec.sent).split(b"\n\n")[0][6:])["created"] > p_created


async def test_a_client_leaving_before_ds_continuation_answered_is_a_disconnect(caplog):
    """The client has P's token and leaves while D has not answered yet: counted as a
    disconnect, D's request aborted, nothing fails on the way (mutant: closing the stitched
    answer before D's was opened fails)."""
    async with running_proxy() as px:
        p, d = await px.pd()
        d.fault = Fault(hang=True)
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy"):
            async with px.client.stream("POST", "/v1/completions", json=STREAM) as resp:
                lines = resp.aiter_lines()
                assert json.loads((await anext(lines))[6:])["choices"][0]["text"] == " t0"
                await wait_until(lambda: d.completions(), what="D asked")
            await wait_until(lambda: d.completions()[0].cancelled, what="D saw the abort")
            assert await px.metric("xpyd_client_disconnects_total") == 1
        assert px.registry.live("D")[0].in_flight == 0
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_the_rescue_after_two_failed_attempts_is_the_third(caplog):
    """decode_retries 1: both Ds fail their disaggregated attempt (each logged with its
    number), one retry is counted, and D alone is attempt 3 (proxy/dispatch/dispatcher.py)."""
    async with running_proxy(first_token="decode", decode_retries=1, expose_routing_headers=True) as px:
        await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        d1.fault = Fault(**KV_LOAD_FAILED.__dict__)
        d2.fault = Fault(**KV_LOAD_FAILED.__dict__)
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_rescue"
        assert await px.metric("xpyd_decode_retries_total") == 1
        (alone,) = [r for d in (d1, d2) for r in d.completions() if r.request_id.startswith("xpyd-local-")]
        rescuer = d1 if alone in d1.completions() else d2
        assert resp.headers.get_list(XPYD_DECODE_INSTANCE) == [rescuer.http_address]
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode failed before first byte")]
    assert [line.split(" error=")[0].rsplit(" ", 1)[1] for line in failed] == ["attempt=1", "attempt=2"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode rescue")]
    assert lines == [f"decode rescue: D alone instance={rescuer.http_address} attempt=3 failed_status=500 "
                     "error=decode failed: HTTP 500 in its answer"]  # fmt: skip


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _raw_event(text: str) -> bytes:
    return (b'data: {"id":"cmpl-d-own-id","object":"text_completion","created":1,"model":"fake-model",'
            b'"choices":[{"index":0,"text":"%s","logprobs":null,"finish_reason":null,"stop_reason":null}]}'
            b"\n\n" % text.encode())  # fmt: skip


_RAW_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


_RAW_MODELS = b'{"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "vllm"}]}'


async def _registered(px, role: str, url: str):
    """A registration (a fake's, heartbeats and all) for the raw server at `url`, admitted."""
    from tests.support.fake_vllm import FakeVLLM

    fake = FakeVLLM(role, proxy=px.discovery)  # its registration only: the raw server answers
    fake.port = int(url.rsplit(":", 1)[1])
    fake.start_heartbeats()
    await wait_until(lambda: [i for i in px.registry.live(role) if not i.pending], what=f"{role} admitted")
    return fake


async def _first_token_through_raw_d(parts: list[bytes], p_answer: bytes | None = None, **body) -> str:
    """A first-token stream whose continuation D is a raw vLLM stand-in writing `parts`
    (a moment apart), P a fake (or a raw one answering `p_answer`); returns what the client got."""
    from tests.support.raw_instance import RawInstance

    async with RawInstance(lambda req: (parts, "fin"), _RAW_MODELS) as raw_d, \
            RawInstance(lambda req: ([p_answer or b""], "fin"), _RAW_MODELS) as raw_p, running_proxy() as px:
        if p_answer is None:
            await px.fake("P")
        fakes = [await _registered(px, "P", raw_p.url)] if p_answer is not None else []
        fakes.append(await _registered(px, "D", raw_d.url))
        try:
            resp = await px.client.post("/v1/completions", json={**STREAM, "max_tokens": 3, **body})
        finally:
            for fake in fakes:
                await fake.stop()
        assert resp.status_code == 200 and resp.headers[XPYD_FIRST_TOKEN] == "prefill"
        return resp.text


@pytest.mark.parametrize("in_first", [False, True], ids=["later-piece", "first-read"])
async def test_an_event_of_ds_continuation_split_across_reads_gets_ps_id(in_first):
    """D's continuation sends its second event in two pieces, a moment apart (its first part
    in a piece of its own, or with the first event in D's first read): the piece that ends
    inside the event is held until the event is whole, so it too gets P's event id
    (mutants: the first read or every piece flushed, the split event keeping D's id)."""
    second = _raw_event(" t2")
    end = _chunked(second[40:] + b"data: [DONE]\n\n") + b"0\r\n\r\n"
    if in_first:
        parts = [_RAW_HEAD + _chunked(_raw_event(" t1") + second[:40]), end]
    else:
        parts = [_RAW_HEAD + _chunked(_raw_event(" t1")), _chunked(second[:40]), end]
    text = await _first_token_through_raw_d(parts)
    got = _sse_events(text)
    assert _texts(got) == " t0 t1 t2" and got[-1] == "[DONE]"
    assert len({e["id"] for e in got[:-1]}) == 1 and "d-own-id" not in text


@pytest.mark.parametrize("one_read", [True, False], ids=["one-read", "last-piece"])
async def test_a_continuation_ending_inside_an_event_is_relayed_to_its_last_byte(one_read):
    """D's stream ends without the blank line after its last event: at the clean end, what
    was held waiting for that event's end goes out as D sent it (mutants: the held bytes
    dropped at the end, in the first read or in the last piece)."""
    events = _raw_event(" t1") + _raw_event(" t2")
    if one_read:
        parts = [_RAW_HEAD + _chunked(events + b"data: [DONE]") + b"0\r\n\r\n"]
    else:
        parts = [_RAW_HEAD + _chunked(_raw_event(" t1")), _chunked(_raw_event(" t2") + b"data: [DONE]") + b"0\r\n\r\n"]
    text = await _first_token_through_raw_d(parts)
    assert text.endswith("\n\ndata: [DONE]") and _texts(_sse_events(text)) == " t0 t1 t2"


async def test_ds_logprobs_text_offsets_go_on_after_ps_token():
    """logprobs: P's token " t0" sits at text offset 0, so D's continuation, which counts its
    own text from 0, is shifted by the token's 3 characters (mutant: no offset)."""
    logprobs = {"text_offset": [0], "token_logprobs": [-0.5], "tokens": [" t0"], "top_logprobs": [{" t0": -0.5}]}
    p_body = json.dumps({
        "id": "cmpl-p-0-abcd", "object": "text_completion", "created": 1, "model": "fake-model",
        "choices": [{"index": 0, "text": " t0", "logprobs": logprobs, "finish_reason": "length",
                     "stop_reason": None, "token_ids": [900], "prompt_token_ids": [1, 2, 3], "routed_experts": None}],
        "service_tier": None, "system_fingerprint": "fp", "kv_transfer_params": None,
        "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": None},
    }).encode()  # fmt: skip
    p_answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(p_body), p_body)  # fmt: skip

    def d_event(text: str) -> bytes:
        lp = {"text_offset": [0], "token_logprobs": [-0.25], "tokens": [text], "top_logprobs": [{text: -0.25}]}
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": None, "stop_reason": None}
        event = {"id": "cmpl-d-own-id", "object": "text_completion", "created": 1, "model": "fake-model",
                 "choices": [choice]}  # fmt: skip
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    parts = [_RAW_HEAD + _chunked(d_event(" t1") + b"data: [DONE]\n\n") + b"0\r\n\r\n"]
    got = _sse_events(await _first_token_through_raw_d(parts, p_answer, logprobs=1))
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in got[:-1]] == [[0], [3]]
    assert _texts(got) == " t0 t1"


async def _one_d_held_one_failing(px):
    """Two D: another client's stream holds one (one token, then a pause); the other fails its
    KV load. The holding request's task (cancel it), the held D and the failing one."""
    d1, d2 = await px.fake("D"), await px.fake("D")
    d1.fault = d2.fault = Fault(stall_after=1)
    blocker = asyncio.get_running_loop().create_task(px.client.post("/v1/completions", json=STREAM))
    busy = await wait_until(lambda: (d1.completions() and d1) or (d2.completions() and d2), what="D busy")
    free = d2 if busy is d1 else d1
    free.fault = KV_LOAD_FAILED
    return blocker, busy, free

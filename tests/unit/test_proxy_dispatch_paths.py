"""What every dispatch path reports and sends, measured against fakes that take known times:
the per-phase timings (headers and histograms), the request P is sent. Real proxy, fake
instances over real HTTP and ZMQ (mutation survivors of proxy/dispatch/*.py)."""

from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import pytest

from tests.support.proxy_errors import assert_error
from tests.support.proxy_helpers import Fault, register_dead, running_proxy, wait_until
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_DECODE_TTFB_MS, XPYD_PATH, XPYD_PREFILL_MS, XPYD_QUEUE_MS

COMPLETION = {"model": "fake-model", "prompt": "Hello there", "max_tokens": 5}
STREAM = {**COMPLETION, "stream": True}


def phase_sum(text: str, phase: str) -> float:
    """xpyd_phase_duration_seconds_sum{phase=...} from a /metrics page."""
    key = f'xpyd_phase_duration_seconds_sum{{phase="{phase}"}} '
    (line,) = [x for x in text.splitlines() if x.startswith(key)]
    return float(line[len(key) :])


@pytest.mark.parametrize("body", [COMPLETION, STREAM], ids=["json", "stream"])
async def test_disaggregated_phase_timings_measure_each_phase(body):
    """P takes 0.3 s, D 0.2 s to its first byte: the headers and the histograms say so
    (each phase from its own start, never from the clock's epoch: the upper bounds leave a
    loaded box seconds of slack)."""
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        p.fault = Fault(delay=0.3)
        d.fault = Fault(delay=0.2)
        resp = await px.client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "disaggregated"
        assert 0 <= float(resp.headers[XPYD_QUEUE_MS]) < 5000
        assert 300 <= float(resp.headers[XPYD_PREFILL_MS]) < 10000
        assert 200 <= float(resp.headers[XPYD_DECODE_TTFB_MS]) < 10000
        text = (await px.client.get("/metrics")).text
        assert 0 <= phase_sum(text, "queue") < 5
        assert 0.3 <= phase_sum(text, "prefill") < 10
        assert 0.2 <= phase_sum(text, "decode_ttfb") < 10
        assert 0.2 <= phase_sum(text, "decode") < 10  # from P's answer to D's last byte


async def test_a_short_prompt_goes_through_p_while_d_relays_another_answer():
    """D's own prefill of a short prompt would sit between the tokens of the answers D is
    streaming: while D relays one, a short prompt takes P's path; once that answer is all
    sent, D prefills short prompts itself again (mutant: the relaying answers not counted)."""
    import asyncio

    async with running_proxy(local_prefill_threshold=50, dispatch="concurrent") as px:
        p, d = await px.pd()
        d.fault = Fault(token_delay=0.2)
        async with px.client.stream("POST", "/v1/completions", json=STREAM) as slow:
            assert slow.headers[XPYD_PATH] == "local_short"
            lines = slow.aiter_lines()
            assert (await asyncio.wait_for(anext(lines), 10)).startswith("data: {")
            d.fault = None
            resp = await px.client.post("/v1/completions", json=STREAM)
            assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "disaggregated"
            assert [line async for line in lines if line][-1] == "data: [DONE]"
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.headers[XPYD_PATH] == "local_short"
        (inst,) = px.registry.live("D")
        await wait_until(lambda: not inst.relaying, what="each answer's flight left once served")


async def test_local_phase_timings_measure_ds_first_byte():
    async with running_proxy(local_prefill_threshold=50) as px:
        p, d = await px.pd()
        d.fault = Fault(delay=0.2)
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_short"
        assert 200 <= float(resp.headers[XPYD_DECODE_TTFB_MS]) < 10000
        text = (await px.client.get("/metrics")).text
        assert 0.2 <= phase_sum(text, "decode_ttfb") < 10
        assert 0.2 <= phase_sum(text, "decode") < 10


async def test_without_send_only_missing_p_is_told_to_skip_nothing():
    async with running_proxy(send_only_missing=False) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200
        (pre,) = p.completions()
        assert "kv_transfer_params" not in pre.json and pre.json["max_tokens"] == 1


CHAT_STREAM = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
               "max_completion_tokens": 4, "stream": True}  # fmt: skip


@pytest.mark.parametrize("first_token", ["decode", "prefill"])
@pytest.mark.parametrize(
    "path,body", [("/v1/completions", STREAM), ("/v1/chat/completions", CHAT_STREAM)], ids=["completions", "chat"]
)
async def test_p_is_asked_for_the_prompt_and_one_token(first_token, path, body):
    """P's request is the client's cut down to one token (chat: max_completion_tokens too,
    which vLLM reads first); with the first token from P it also asks for the token ids."""
    async with running_proxy(first_token=first_token) as px:
        p, d = await px.pd()
        resp = await px.client.post(path, json=body)
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
        (pre,) = p.completions()
        assert pre.path == path and pre.json["max_tokens"] == 1 and pre.json["stream"] is False
        if "messages" in body:
            assert pre.json["max_completion_tokens"] == 1
        assert pre.json.get("return_token_ids") is (True if first_token == "prefill" else None)


async def test_a_body_nested_deeper_than_the_proxy_can_write_is_refused():
    """orjson reads 1024 levels but writes only 254: P's request cannot be built. A 400 in
    the error JSON, and no instance is asked."""
    nested: object = 1
    for _ in range(300):
        nested = [nested]
    async with running_proxy() as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json={**COMPLETION, "logit_bias_extra": nested})
        assert resp.status_code == 400
        want = {
            "message": "request body is nested too deeply",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_body",
        }
        assert resp.json() == {"error": want}
        assert p.completions() == [] and d.completions() == []


# ---------------------------------------------------------------- D's answer before its first byte


@pytest.mark.parametrize("expose", [False, True])
async def test_a_d_silent_past_its_first_byte_deadline_is_a_504(expose, caplog):
    async with running_proxy(decode_ttfb_timeout=0.3, expose_routing_headers=expose) as px:
        p, d = await px.pd()
        d.fault = Fault(hang=True)
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            err = assert_error(await px.client.post("/v1/completions", json=COMPLETION), 504, "decode_timeout")
        where = f"decode instance {d.http_address}" if expose else "decode instance"
        assert err["message"] == f"{where} sent nothing for 0.3s"
        assert await px.metric("xpyd_upstream_errors_total", role="D", instance=d.http_address, kind="timeout") == 1
    assert f"decode sent nothing instance={d.http_address} for=0.3s" in [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("expose", [False, True])
async def test_an_unreachable_d_cools_down_and_the_client_is_told_how_it_failed(expose):
    async with running_proxy(heartbeat_timeout=30, decode_retries=0, expose_routing_headers=expose) as px:
        await px.fake("P")
        dead = await register_dead(px, "D")
        err = assert_error(await px.client.post("/v1/completions", json=COMPLETION), 502, "decode_unreachable")
        if expose:
            assert err["message"].startswith(f"decode instance {dead} failed before answering: cannot connect")
        else:
            assert err["message"] == "decode instance failed before answering: connection refused or unreachable"
        refused = await px.metric("xpyd_upstream_errors_total", role="D", instance=dead, kind="connect")
        assert refused == 2  # the request, then D alone on the only D
        # Cooling down, the refusing D is skipped while a live one serves.
        d = await px.fake("D")
        for _ in range(2):
            assert (await px.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert await px.metric("xpyd_upstream_errors_total", role="D", instance=dead, kind="connect") == refused
        assert len(d.completions()) == 2


async def test_an_oversized_d_answer_is_named_in_the_error_and_the_log(caplog):
    async with running_proxy(max_response_bytes=1000, first_token="decode") as px:
        p, d = await px.pd()
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json={**COMPLETION, "max_tokens": 300})
        err = assert_error(resp, 502, "upstream_response_too_large")
        assert err["message"].startswith("decode instance's answer larger than 1000 bytes") and err["message"].endswith(
            ", over the proxy's max_response_bytes"
        )
        assert await px.metric("xpyd_upstream_errors_total", role="D", instance=d.http_address,
                               kind="too_large") == 1  # fmt: skip
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("answer too large")]
    assert line.startswith(f"answer too large phase=decode instance={d.http_address} error=")


async def test_ds_stream_error_event_is_logged_as_such(caplog):
    async with running_proxy(first_token="decode", decode_retries=1) as px:
        await px.fake("P")
        d1, _ = await px.fake("D"), await px.fake("D")
        d1.fault = Fault(stream_error=503, id_prefix="___prefill_addr_")  # round robin asks d1 first
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and "error" not in resp.text
        assert await px.metric("xpyd_upstream_errors_total", role="D", instance=d1.http_address,
                               kind="http_503") == 1  # fmt: skip
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode failed")] == [
        f"decode failed before first byte instance={d1.http_address} attempt=1 "
        "error=decode failed: HTTP 503 in its stream's error event"
    ]


@pytest.mark.parametrize("expose", [False, True])
async def test_the_request_id_clients_see(expose):
    """Exposed: the id P and D were sent, also where an instance's error quotes it; else its
    neutral id (16 hex digits, vLLM's own shape), in the answer and in the relayed error alike;
    no X-Request-Id header either way (vLLM sends one only with --enable-request-id-headers)."""
    quoting = json.dumps({"error": {"message": "failed ({request_id})", "type": "InternalServerError",
                                    "param": None, "code": 500}}).encode()  # fmt: skip
    async with running_proxy(expose_routing_headers=expose) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        rid = d.completions()[0].request_id
        assert resp.json()["id"].startswith("cmpl-" + (rid if expose else px.neutral(rid)) + "-")
        assert len(px.neutral(rid)) == 16 and "x-request-id" not in resp.headers
        assert (XPYD_DECODE_INSTANCE in resp.headers) is expose
        p.fault = Fault(status=500, error_body=quoting)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        rid = p.completions()[-1].request_id
        assert resp.status_code == 500 and resp.json()["error"]["message"] == f"failed ({rid if expose else px.neutral(rid)})"
        assert "x-request-id" not in resp.headers


def _ids(resp) -> set[str]:
    """The ids an answer names itself by: each event's, or the body's."""
    if resp.headers["content-type"].startswith("text/event-stream"):
        return {json.loads(line[6:])["id"] for line in resp.text.splitlines() if line.startswith("data: {")}
    return {resp.json()["id"]}


CHAT_STREAM = {"model": "fake-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5,
               "stream": True}


@pytest.mark.parametrize("how", ["header", "body", "both"])
async def test_the_clients_own_request_id_names_the_answer(how):
    """vLLM 0.32 names its answer after the client's X-Request-Id, else the body's request_id
    (``cmpl-{id}``): through the proxy too, on every path (P then D, P's token first, D alone, an
    instance's error quoting it), while P and D are sent the internal id; no X-Request-Id header."""
    mine = 'client "id"-1'
    headers = {"x-request-id": mine} if how != "body" else {}
    extra = {"request_id": "from-the-body" if how == "both" else mine} if how != "header" else {}
    quoting = json.dumps({"error": {"message": "bad ({request_id})", "type": "BadRequestError",
                                    "param": None, "code": 400}}).encode()  # fmt: skip
    async with running_proxy() as px:
        p, d = await px.pd()
        for path, body, route in [("/v1/completions", COMPLETION, "disaggregated"),
                                  ("/v1/completions", STREAM, "disaggregated"),  # P's token first
                                  ("/v1/chat/completions", CHAT_STREAM, "disaggregated"),
                                  ("/v1/completions", {**COMPLETION, "prompt": "Hi"}, "disaggregated")]:
            resp = await px.client.post(path, json={**body, **extra}, headers=headers)
            assert resp.status_code == 200 and resp.headers[XPYD_PATH] == route, resp.text
            prefix = "chatcmpl-" if "messages" in body else "cmpl-"
            assert all(i.startswith(prefix + mine + "-") for i in _ids(resp)), (_ids(resp), body)
            assert d.completions()[-1].request_id.startswith("___prefill_addr_")
            assert "x-request-id" not in resp.headers
        p.fault = Fault(status=400, times=1, error_body=quoting)
        d.fault = Fault(status=400, times=1, error_body=quoting)
        resp = await px.client.post("/v1/completions", json={**COMPLETION, **extra}, headers=headers)
        assert resp.status_code == 400 and resp.json()["error"]["message"] == f"bad ({mine})"
    async with running_proxy(local_prefill_threshold=1000) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json={**STREAM, **extra}, headers=headers)
        assert resp.headers[XPYD_PATH] == "local_short" and d.completions()[-1].request_id.startswith("xpyd-local-")
        assert all(i.startswith("cmpl-" + mine + "-") for i in _ids(resp))


async def test_request_id_headers_as_vllms_flag_adds_them():
    """--enable-request-id-headers: every answer carries X-Request-Id as vLLM's middleware sets
    it, the client's own, else a random uuid4 hex that is not the answer's id."""
    async with running_proxy(enable_request_id_headers=True) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "mine"})
        assert resp.headers.get_list("x-request-id") == ["mine"] and resp.json()["id"].startswith("cmpl-mine-")
        resp = await px.client.post("/v1/completions", json=STREAM)
        (drawn,) = resp.headers.get_list("x-request-id")
        assert re.fullmatch(r"[0-9a-f]{32}", drawn) and not any(drawn in i for i in _ids(resp))
        for r in (await px.client.get("/health"), await px.client.post("/v1/completions", json={"model": 5})):
            assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]), r.headers
    async with running_proxy() as px:
        await px.pd()
        assert "x-request-id" not in (await px.client.get("/health")).headers


async def test_instances_count_the_requests_they_served():
    async with running_proxy(expose_routing_headers=True) as px:
        p, d = await px.pd()
        for body in (COMPLETION, STREAM):
            assert (await px.client.post("/v1/completions", json=body)).status_code == 200
        view = {i["http_address"]: i for i in (await px.client.get("/instances")).json()}
        assert (view[p.http_address]["served"], view[d.http_address]["served"]) == (2, 2)
        assert view[p.http_address]["in_flight"] == view[d.http_address]["in_flight"] == 0


async def test_no_decode_instance_is_a_503_that_says_so():
    async with running_proxy() as px:
        await px.fake("P")
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 503
        want = {"message": "no decode instance is available", "type": "service_unavailable", "param": None,
                "code": "no_decode_instance"}  # fmt: skip
        assert resp.json() == {"error": want}


async def test_ps_held_back_token_leaves_the_answer_to_d():
    """vLLM answers "" for a token that is part of a character: D answers the client's own
    request (from P's KV), and the metric says why P's token did not start the answer."""
    async with running_proxy(first_token="prefill") as px:
        p, d = await px.pd()
        p.first_text = ""
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "disaggregated"
        (dec,) = d.completions()
        assert dec.json == STREAM and dec.request_id == p.completions()[0].request_id
        assert await px.metric("xpyd_first_token_to_decode_total", reason="held_back") == 1
        assert await px.metric("xpyd_first_token_to_decode_total", reason="unusable") == 0


def test_id_rewrite_takes_the_id_shown_and_refuses_ids_it_could_not_hold_back():
    """IdRewrite's own rules (proxy/dispatch/rewrite.py): the id shown is used as it is written
    inside a JSON string; an internal id that a held tail could overlap (some start of it is
    also its end), that holds a newline or is empty, is refused by name."""
    from proxy.dispatch.rewrite import IdRewrite

    internal = "___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_" + "a" * 32
    assert IdRewrite(internal, "b" * 16).whole(f"cmpl-{internal}".encode()) == b"cmpl-" + b"b" * 16
    assert IdRewrite(internal, 'my "id"').whole(f"cmpl-{internal}".encode()) == b'cmpl-my \\"id\\"'
    for bad in ["_a_", "x" + "a" * 32 + "x", "_\n" + "a" * 32, ""]:
        with pytest.raises(ValueError) as e:
            IdRewrite(bad, "b" * 16)
        assert str(e.value) == f"cannot rewrite {bad!r}"


class _Selector:
    """The two questions choose_path asks a Selector, answered from fixed figures and recorded."""

    def __init__(self, p_live: bool = True, d_uncached: int | None = None) -> None:
        self.p_live, self.d_uncached = p_live, d_uncached
        self.asked: list[tuple] = []

    def available(self, role, model):
        self.asked.append(("available", role, model))
        return self.p_live

    def uncached_tokens(self, role, inst, req):
        self.asked.append(("uncached", role, inst, req))
        return self.d_uncached


def _route(tokens: int, body: dict | None = None, path: str = "/v1/completions"):
    from proxy.request import RouteRequest

    body = body if body is not None else {"model": "m1", "prompt": "x"}
    return RouteRequest(path=path, raw=json.dumps(body).encode(), body=body, tokens=tokens, headers={}, model="m1")


@pytest.mark.parametrize(
    "threshold, tokens, d_uncached, path",
    [
        (50, 49, None, "local_short"),  # below the threshold: D alone
        (50, 50, None, "disaggregated"),  # at it: P prefills
        (50, 50, 49, "local_cached"),  # D holds all but 49 tokens
        (50, 50, 50, "disaggregated"),  # all but 50: P prefills
        (1, 0, None, "local_short"),  # the smallest threshold still counts
        (0, 0, 0, "disaggregated"),  # 0 turns the rule off
    ],
)
def test_local_prefill_threshold_edges(threshold, tokens, d_uncached, path):
    """choose_path (proxy/dispatch/local.py) against a recorded Selector: the threshold's edges
    on both figures, which D is asked about, and that a threshold of 0 asks nothing of the
    prefix index (the query computes the prompt's block keys)."""
    from proxy.config import ProxyConfig
    from proxy.dispatch.local import choose_path

    cfg = ProxyConfig(local_prefill_threshold=threshold)
    sel, req, d = _Selector(d_uncached=d_uncached), _route(tokens), SimpleNamespace(relaying=set())
    assert choose_path(cfg, sel, req, d) == path
    asked = [("available", "P", "m1")]
    if threshold > 0 and tokens >= threshold:
        asked.append(("uncached", "D", d, req))
    assert sel.asked == asked


@pytest.mark.parametrize("flights, path", [((False,), "disaggregated"), ((True, False), "disaggregated"),
                                           ((True,), "local_short"), ((), "local_short")])
def test_a_short_prompt_goes_to_d_alone_only_while_d_relays_nothing_unfinished(flights, path):
    """An answer D relays whose last bytes are not sent yet (Flight.done false) sends a short
    prompt to P; answers all sent do not count."""
    from proxy.asgi import Flight
    from proxy.config import ProxyConfig
    from proxy.dispatch.local import choose_path

    d = SimpleNamespace(relaying=set())
    for done in flights:
        f = Flight(None)
        f.done = done
        d.relaying.add(f)
    sel = _Selector(d_uncached=3)  # nor D's cache: the rest of a short prompt is short too
    assert choose_path(ProxyConfig(local_prefill_threshold=50), sel, _route(10), d) == path


def test_without_p_the_path_is_local_or_a_503_that_says_so():
    from proxy.config import ProxyConfig
    from proxy.dispatch.local import choose_path
    from proxy.errors import ProxyError

    assert choose_path(ProxyConfig(), _Selector(p_live=False), _route(500), object()) == "local_no_prefill"
    with pytest.raises(ProxyError) as err:
        choose_path(ProxyConfig(fallback_to_decode=False), _Selector(p_live=False), _route(500), object())
    assert (err.value.status, err.value.message, err.value.code) == (
        503, "no prefill instance is available", "no_prefill_instance")  # fmt: skip


@pytest.mark.parametrize(
    "body, path, local",
    [
        ({"prompt": "x", "echo": True, "logprobs": 1}, "/v1/completions", True),
        ({"prompt": "x", "echo": True, "max_tokens": 0}, "/v1/completions", True),
        ({"prompt": "x", "echo": True, "max_tokens": 1}, "/v1/completions", False),
        ({"prompt": "x", "logprobs": 1}, "/v1/completions", False),  # the answer's logprobs only
        ({"messages": [], "echo": True, "logprobs": True}, "/v1/chat/completions", False),
        ({"messages": [], "logprobs": True, "top_logprobs": 2}, "/v1/chat/completions", False),
        ({"messages": [], "prompt_logprobs": 0}, "/v1/chat/completions", True),
        ({"prompt": "x", "prompt_logprobs": None}, "/v1/completions", False),
        # echo as vLLM's model reads a bool (pydantic, lax): 1 and "true" are true, "0" is not
        ({"prompt": "x", "echo": 1, "logprobs": 1}, "/v1/completions", True),
        ({"prompt": "x", "echo": "true", "max_tokens": 0}, "/v1/completions", True),
        ({"prompt": "x", "echo": "0", "logprobs": 1}, "/v1/completions", False),
    ],
)
def test_only_prompt_logprobs_keep_the_prefill_on_d(body, path, local):
    """The prompt's logprobs come from the prefill, so D computes it; the answer's logprobs do
    not need it (chat has no echo of the prompt's logprobs)."""
    from proxy.config import ProxyConfig
    from proxy.dispatch.local import choose_path

    got = choose_path(ProxyConfig(), _Selector(), _route(500, body, path), object())
    assert got == ("local_prompt_logprobs" if local else "disaggregated")


async def test_an_oversized_d_answer_is_logged_with_what_made_it_too_large(caplog):
    async with running_proxy(max_response_bytes=1000, first_token="decode") as px:
        p, d = await px.pd()
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.dispatch"):
            resp = await px.client.post("/v1/completions", json={**COMPLETION, "max_tokens": 300})
        assert resp.status_code == 502
        (rec,) = d.completions()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("answer too large")]
    announced = len(rec.sent)  # D's whole answer, its Content-Length
    want = f"answer too large phase=decode instance={d.http_address} error=answer larger than 1000 bytes"
    assert line == f"{want} (announced {announced} bytes)"


@pytest.mark.parametrize("expose", [False, True])
async def test_ds_refusal_that_is_not_openai_json_names_d_only_when_exposed(expose):
    """D's 4xx whose body is not OpenAI error JSON is wrapped in one, naming D when exposed."""
    async with running_proxy(first_token="decode", expose_routing_headers=expose) as px:
        p, d = await px.pd()
        d.fault = Fault(status=400, error_body=b"no such thing", content_type="text/plain")
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        where = f"decode instance {d.http_address}" if expose else "decode instance"
        assert resp.status_code == 400
        error = {"message": f"{where} answered HTTP 400: no such thing", "type": "invalid_request_error",
                 "param": None, "code": "decode_error"}  # fmt: skip
        assert resp.json() == {"error": error}


async def test_a_d_status_outside_2xx_is_its_error_not_an_answer():
    """Only 2xx is an answer: D's 300 is relayed as D's error, wrapped in OpenAI error JSON
    and counted, not passed through as D's body."""
    status = 300
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = Fault(status=status, error_body=b"elsewhere", content_type="text/plain")
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == status and resp.headers["content-type"].startswith("application/json")
        assert resp.json()["error"]["message"] == f"decode instance answered HTTP {status}: elsewhere"
        assert await px.metric("xpyd_upstream_errors_total", role="D", instance=d.http_address,
                               kind=f"http_{status}") == 1  # fmt: skip


async def test_an_empty_stream_from_d_is_relayed_empty(caplog):
    """D's 200 event stream with no bytes at all (it ended at once): the client gets that
    empty 200 as it is, nothing made up and nothing failing (mutants: the first read's
    default for an empty stream)."""
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        d.fault = Fault(status=200, error_body=b"", content_type="text/event-stream")
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy"):
            resp = await px.client.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert (resp.status_code, resp.content) == (200, b"")
        assert resp.headers["content-type"] == "text/event-stream"
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_prompt_d_already_holds_is_served_by_that_d_alone():
    """cache_aware with a local_prefill_threshold: the second time, the D chosen is asked how
    much of the prompt it still lacks, and holding all but a short tail it prefills alone
    (the dispatcher passes its D to choose_path)."""
    body = {**COMPLETION, "prompt": "The sea is wide and deep. " * 80, "max_tokens": 3}
    async with running_proxy(decode_policy="cache_aware", local_prefill_threshold=64) as px:
        p, d = await px.pd()
        paths = [(await px.client.post("/v1/completions", json=body)).headers[XPYD_PATH] for _ in range(2)]
        assert paths == ["disaggregated", "local_cached"]
        assert len(p.completions()) == 1 and len(d.completions()) == 2


async def test_the_request_is_tokenized_for_the_precise_policy_before_d_is_chosen(tmp_path):
    """decode_policy precise: the dispatcher has the request's prompt tokenized (once) before
    choosing D (mutant: the selector prepared without the request). A word-level tokenizer
    of the test's own stands in for the served model's: only that the prompt is tokenized counts."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "Hello": 1, "there": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    async with running_proxy(decode_policy="precise", tokenizer=str(tmp_path)) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "disaggregated"
        assert await px.metric("xpyd_prompt_ids_total", result="ok") == 1

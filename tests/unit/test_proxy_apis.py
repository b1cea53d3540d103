"""The routes beyond completions and chat: OpenAI Responses, Anthropic Messages and vLLM's
tokens-in generate split into P then D; stored responses found on their D; the generation-free
routes passed to one instance as they came; vLLM's admin routes never forwarded. Real proxy,
fake instances (tests/support/fake_apis.py) over real HTTP and ZMQ."""

from __future__ import annotations

import json

import pytest

from tests.support.fake_vllm import DISAGGREGATED_ID
from tests.support.proxy_helpers import Fault, running_proxy
from xpyd_wire import request_id
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_PATH

RESPONSE = {"model": "fake-model", "input": "Tell me about the sea, in one line", "max_output_tokens": 4}
MESSAGE = {"model": "fake-model", "max_tokens": 4, "messages": [{"role": "user", "content": "Die Straße ist naß 🌊"}]}
GENERATE = {"model": "fake-model", "token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 3, "seed": 7, "n": 1}}


def sse_types(text: str) -> list[str]:
    return [line[7:] for line in text.splitlines() if line.startswith("event: ")]


# ------------------------------------------------------------------------------ Responses


async def test_responses_prefill_on_p_then_d_answers_with_the_transfer_in_kv_transfer_params():
    async with running_proxy() as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/responses", json={**RESPONSE, "kv_transfer_params": {"mine": 1}})
        assert resp.status_code == 200, resp.text
        assert resp.headers[XPYD_PATH] == "disaggregated"
        (pre,) = p.completions()
        (dec,) = d.completions()
        assert pre.path == dec.path == "/v1/responses"
        # P: one token, never stored, never in the background, its own response id.
        assert (pre.json["max_output_tokens"], pre.json["store"], pre.json["background"], pre.json["stream"]) == (
            1, False, False, False)
        assert "request_id" not in pre.json
        # The transfer rides in kv_transfer_params on both (the engine request is named after the
        # body's request_id there): the id the proxy sent both as X-Request-Id, P's and D's address.
        tid = request_id.parse(pre.json["kv_transfer_params"]["xpyd_transfer_id"])
        assert tid is not None and pre.request_id == dec.request_id == dec.json["kv_transfer_params"]["xpyd_transfer_id"]
        assert (tid.prefill_addr, tid.decode_addr) == (p.zmq_address, d.zmq_address)
        assert pre.json["kv_transfer_params"]["mine"] == dec.json["kv_transfer_params"]["mine"] == 1
        # D: the client's request, with the response id the client then gets.
        assert {k: v for k, v in dec.json.items() if k not in ("request_id", "kv_transfer_params")} == RESPONSE
        assert resp.json()["id"] == dec.json["request_id"]
        assert resp.json()["id"].startswith("resp_") and len(resp.json()["id"]) == 5 + 16  # vLLM 0.32's shape


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_usage_reports_ps_prefix_cache_figures_not_ds_loaded_kv(stream):
    """D counts the KV it loaded as cached and writes none; one server that computed the prompt
    reports what P reports: those two figures are P's in the client's answer."""
    async with running_proxy() as px:
        p, d = await px.pd()
        body = {**RESPONSE, "input": "x" * 300, "stream": stream}
        resp = await px.client.post("/v1/responses", json=body)
        final = json.loads(resp.text.split("data: ")[-1]) if stream else resp.json()
        usage = final["response"]["usage"] if stream else final["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] == 0
        assert usage["input_tokens_details"]["cache_write_tokens"] == 256
        assert b'"cached_tokens":299' in bytes(d.completions()[0].sent)  # what D itself reported
        resp = await px.client.post("/v1/messages", json=MESSAGE)  # P's leg of a message: a prefill leg
        assert p.completions()[-1].json["kv_transfer_params"] == {"do_remote_decode": True}


async def test_responses_client_request_id_is_the_response_id_and_proxy_fields_are_not_the_clients():
    async with running_proxy() as px:
        p, d = await px.pd()
        forged = request_id.build("10.9.9.9:1", "10.9.9.9:2")
        body = {**RESPONSE, "request_id": "resp_mine", "kv_transfer_params": {"xpyd_transfer_id": forged}}
        resp = await px.client.post("/v1/responses", json=body)
        assert resp.status_code == 200 and resp.json()["id"] == "resp_mine"
        (pre,), (dec,) = p.completions(), d.completions()
        assert pre.json["kv_transfer_params"]["xpyd_transfer_id"] == pre.request_id != forged
        assert dec.json["kv_transfer_params"]["xpyd_transfer_id"] == dec.request_id


async def test_responses_stream_is_relayed_event_for_event():
    async with running_proxy() as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/responses", json={**RESPONSE, "stream": True})
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        (dec,) = d.completions()
        # Byte for byte but for the usage's cache figures, which are P's (the next test).
        usage = b'"input_tokens_details":{"cached_tokens":%d,"cache_write_tokens":0'
        n = len(dec.json["input"])
        assert resp.content == bytes(dec.sent).replace(usage % (n - 1), usage % 0)
        assert sse_types(resp.text)[0] == "response.created" and sse_types(resp.text)[-1] == "response.completed"
        assert p.completions()[0].json["stream"] is False


async def test_responses_stream_that_breaks_before_any_text_is_answered_by_d_alone():
    """A Responses stream that breaks off after its opening events (vLLM 0.32 cannot write a
    failed KV load as one of its event types) has sent the client nothing yet: D alone answers."""
    async with running_proxy(decode_retries=0) as px:
        p, d = await px.pd()
        d.fault = Fault(stream_error=500, times=1, id_prefix=DISAGGREGATED_ID)
        resp = await px.client.post("/v1/responses", json={**RESPONSE, "stream": True})
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_rescue"
        assert sse_types(resp.text).count("response.created") == 1
        assert "response.completed" in sse_types(resp.text)


async def test_short_responses_go_to_d_alone_with_the_response_id_and_no_transfer():
    async with running_proxy(local_prefill_threshold=128) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/responses", json=RESPONSE)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_short"
        assert p.completions() == []
        (dec,) = d.completions()
        assert dec.json["request_id"] == resp.json()["id"] and "kv_transfer_params" not in dec.json


# ------------------------------------------------------------------------ stored responses


async def test_stored_response_is_fetched_from_the_d_that_holds_it_and_followed_up_there():
    async with running_proxy(expose_routing_headers=True) as px:
        await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        first = await px.client.post("/v1/responses", json=RESPONSE)
        holder = first.headers[XPYD_DECODE_INSTANCE]
        held, other = (d1, d2) if holder == d1.http_address else (d2, d1)
        rid = first.json()["id"]
        for _ in range(3):  # round robin would alternate: the holder answers every time
            got = await px.client.get(f"/v1/responses/{rid}")
            assert got.status_code == 200 and got.json() == first.json()
        follow = await px.client.post("/v1/responses", json={**RESPONSE, "previous_response_id": rid})
        assert follow.status_code == 200
        assert (follow.headers[XPYD_PATH], follow.headers[XPYD_DECODE_INSTANCE]) == ("local_stored", holder)
        assert held.completions()[-1].json["previous_response_id"] == rid
        assert not any(r.json and r.json.get("previous_response_id") for r in other.completions())
        cancel = await px.client.post(f"/v1/responses/{rid}/cancel")
        assert (cancel.status_code, cancel.json()["error"]["message"]) == (400, "Cannot cancel a synchronous response.")
        assert held.requests[-1].path == f"/v1/responses/{rid}/cancel"


async def test_a_stored_response_this_proxy_never_saw_is_found_on_every_d():
    """Another proxy replica (or this one before a restart) served it: every D is asked."""
    async with running_proxy(expose_routing_headers=True) as px:
        await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        first = await px.client.post("/v1/responses", json=RESPONSE)
        rid = first.json()["id"]
        holder = first.headers[XPYD_DECODE_INSTANCE]
        px.state.router.dispatcher.stored.holders.forget(rid)
        got = await px.client.get(f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.json()["id"] == rid
        follow = await px.client.post("/v1/responses", json={**RESPONSE, "previous_response_id": rid})
        assert follow.headers[XPYD_DECODE_INSTANCE] == holder


async def test_an_unknown_response_gets_vllms_own_404():
    async with running_proxy() as px:
        await px.pd()
        got = await px.client.get("/v1/responses/resp_nope")
        assert got.status_code == 404
        assert got.json()["error"] == {"message": "Response with id 'resp_nope' not found.",
                                       "type": "invalid_request_error", "param": "response_id", "code": 404}
        follow = await px.client.post("/v1/responses", json={**RESPONSE, "previous_response_id": "resp_nope"})
        assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"


# ------------------------------------------------------------------------------ Messages


async def test_messages_prefill_on_p_then_d_answers_the_clients_own_body():
    async with running_proxy() as px:
        p, d = await px.pd()
        raw = json.dumps(MESSAGE, ensure_ascii=False).encode()
        resp = await px.client.post("/v1/messages", content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "disaggregated"
        (pre,), (dec,) = p.completions(), d.completions()
        assert (pre.json["max_tokens"], pre.json["stream"]) == (1, False)
        assert dec.body == raw and request_id.parse(dec.request_id) is not None
        assert resp.json()["content"][0]["text"] == " t0 t1 t2 t3"
        assert resp.json()["id"] == "chatcmpl-" + px.neutral(dec.request_id)  # the neutral id


async def test_messages_stream_error_event_before_any_text_is_retried_on_another_d():
    async with running_proxy(expose_routing_headers=True) as px:
        await px.fake("P")
        d1, d2 = await px.fake("D"), await px.fake("D")
        d1.fault = Fault(stream_error=500, id_prefix=DISAGGREGATED_ID)
        d2.fault = Fault(stream_error=500, id_prefix=DISAGGREGATED_ID)
        resp = await px.client.post("/v1/messages", json={**MESSAGE, "stream": True})
        assert resp.status_code == 200
        assert sse_types(resp.text) == ["message_start", "content_block_start", *["content_block_delta"] * 4,
                                        "content_block_stop", "message_delta", "message_stop"]
        assert resp.headers[XPYD_PATH] == "local_rescue"
        assert await px.metric("xpyd_decode_retries_total") == 1


# ------------------------------------------------------------------------------ generate


async def test_generate_prefill_asks_p_for_one_token_in_its_sampling_params():
    async with running_proxy() as px:
        p, d = await px.pd()
        resp = await px.client.post("/inference/v1/generate", json=GENERATE)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "disaggregated"
        (pre,), (dec,) = ([r for r in f.requests if r.path == "/inference/v1/generate"] for f in (p, d))
        assert pre.json["sampling_params"] == {"max_tokens": 1} and pre.json["stream"] is False
        assert dec.json == GENERATE
        assert resp.json()["choices"][0]["token_ids"] == [900, 901, 902]


# ---------------------------------------------------------------------- one instance, as it came


async def test_generation_free_routes_go_to_one_p_as_they_came():
    async with running_proxy(api_key="k") as px:
        p, d = await px.pd()
        raw = '{"model": "fake-model", "prompt": "héllo 世界"}'.encode()
        auth = {"authorization": "Bearer k", "content-type": "application/json", "x-request-id": "mine-1"}
        resp = await px.client.post("/tokenize?add=1", content=raw, headers=auth)
        assert resp.status_code == 200 and resp.json()["count"] == 8
        (seen,) = p.requests[-1:]
        assert (seen.path, seen.body, seen.headers["x-request-id"]) == ("/tokenize", raw, "mine-1")
        assert "authorization" not in seen.headers  # the client's key is the proxy's, not vLLM's
        assert (await px.client.get("/version", headers=auth)).json() == {"version": "0.32.0"}
        assert (await px.client.get("/version")).status_code == 401
        assert not any(r.path in ("/tokenize", "/version") for r in d.requests)
        assert XPYD_PATH not in resp.headers and "x-request-id" not in resp.headers


@pytest.mark.parametrize("role", ["P", "D"])
async def test_passthrough_role_picks_the_instance_and_the_other_role_stands_in(role):
    async with running_proxy(passthrough_role=role) as px:
        chosen = await px.fake(role)
        resp = await px.client.post("/v1/embeddings", json={"model": "fake-model", "input": ["a", "bb"]})
        assert resp.status_code == 200 and len(resp.json()["data"]) == 2
        assert chosen.requests[-1].path == "/v1/embeddings"
        other = await px.fake("D" if role == "P" else "P")
        await px.client.post("/v1/embeddings", json={"model": "fake-model", "input": "a"})
        assert not any(r.path == "/v1/embeddings" for r in other.requests)


async def test_a_passthrough_instance_that_refuses_connections_is_replaced():
    async with running_proxy() as px:
        gone = await px.fake("P")
        live = await px.fake("P")
        await gone.stop()
        for _ in range(2):
            resp = await px.client.post("/tokenize", json={"model": "fake-model", "prompt": "ab"})
            assert resp.status_code == 200
        assert sum(r.path == "/tokenize" for r in live.requests) == 2


async def test_vllm_admin_routes_are_never_forwarded():
    async with running_proxy() as px:
        p, d = await px.pd()
        for method, path in (("POST", "/sleep"), ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"),
                             ("GET", "/server_info"), ("POST", "/start_profile"), ("POST", "/update_weights"),
                             ("POST", "/inference/v1/abort_requests"), ("GET", "/is_sleeping")):
            resp = await px.client.request(method, path, json={})
            assert (resp.status_code, resp.json()) == (404, {"detail": "Not Found"}), path
        assert not any(r.path not in ("/v1/models", "/health") for r in p.requests + d.requests)


async def test_a_later_vllms_route_is_forwarded_only_when_the_operator_names_it():
    async with running_proxy(passthrough_routes=("/v1/new_route",)) as px:
        p, _ = await px.pd()
        resp = await px.client.post("/v1/new_route", json={"x": 1})
        assert (resp.status_code, resp.json()) == (404, {"detail": "Not Found"})  # the fake's own answer
        assert p.requests[-1].path == "/v1/new_route"
        before = len(p.requests)
        assert (await px.client.post("/v1/other_route", json={})).json() == {"detail": "Not Found"}
        assert len(p.requests) == before  # not forwarded


@pytest.mark.parametrize("path", ["/v1/completions", "/sleep", "relative", "/v1/responses/{id}"])
def test_passthrough_routes_must_be_new_paths(path):
    from proxy.config import ConfigError, ProxyConfig

    with pytest.raises(ConfigError, match="passthrough_routes"):
        ProxyConfig(passthrough_routes=(path,)).validate()


async def test_multipart_audio_goes_to_one_d_byte_for_byte():
    async with running_proxy() as px:
        p, d = await px.pd()
        raw = (b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nfake-model\r\n--b\r\n"
               b"Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\x00\xff\r\n--b--\r\n")
        ctype = "multipart/form-data; boundary=b"
        resp = await px.client.post("/v1/audio/transcriptions", content=raw, headers={"content-type": ctype})
        assert resp.status_code == 404  # the fake serves no audio: its answer comes back as it is
        seen = d.requests[-1]
        assert (seen.path, seen.body, seen.headers["content-type"]) == ("/v1/audio/transcriptions", raw, ctype)
        assert not any(r.path.startswith("/v1/audio") for r in p.requests)


async def test_a_model_no_instance_serves_gets_vllms_own_answer_on_a_passthrough_route():
    async with running_proxy() as px:
        p, d = await px.pd()
        await px.fake("P", model="other-model")  # two models served: the body's model chooses
        resp = await px.client.post("/tokenize", json={"model": "no-such-model", "prompt": "x"})
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError"
        resp = await px.client.post("/tokenize", json={"model": "other-model", "prompt": "xy"})
        assert resp.status_code == 200

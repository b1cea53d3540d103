"""What every dispatch path reports and sends, measured against fakes that take known times:
the per-phase timings (headers and histograms), the request P is sent. Real proxy, fake
instances over real HTTP and ZMQ (mutation survivors of proxy/dispatch/*.py)."""

from __future__ import annotations

import pytest

from tests.support.proxy_helpers import Fault, running_proxy
from xpyd_wire.headers import XPYD_DECODE_TTFB_MS, XPYD_PATH, XPYD_PREFILL_MS, XPYD_QUEUE_MS

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
    (each phase from its own start, never from the epoch of the clock)."""
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        p.fault = Fault(delay=0.3)
        d.fault = Fault(delay=0.2)
        resp = await px.client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "disaggregated"
        assert 0 <= float(resp.headers[XPYD_QUEUE_MS]) < 250
        assert 300 <= float(resp.headers[XPYD_PREFILL_MS]) < 1500
        assert 200 <= float(resp.headers[XPYD_DECODE_TTFB_MS]) < 1500
        text = (await px.client.get("/metrics")).text
        assert 0 <= phase_sum(text, "queue") < 0.25
        assert 0.3 <= phase_sum(text, "prefill") < 1.5
        assert 0.2 <= phase_sum(text, "decode_ttfb") < 1.5
        assert 0.2 <= phase_sum(text, "decode") < 1.5  # from P's answer to D's last byte


async def test_local_phase_timings_measure_ds_first_byte():
    async with running_proxy(local_prefill_threshold=50) as px:
        p, d = await px.pd()
        d.fault = Fault(delay=0.2)
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_short"
        assert 200 <= float(resp.headers[XPYD_DECODE_TTFB_MS]) < 1500
        text = (await px.client.get("/metrics")).text
        assert 0.2 <= phase_sum(text, "decode_ttfb") < 1.5
        assert 0.2 <= phase_sum(text, "decode") < 1.5


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

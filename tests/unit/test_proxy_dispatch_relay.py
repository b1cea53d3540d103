"""Relaying D's answer once it started: the stream's idle deadline (pushed back by every
chunk), and what a client and an operator are told when D goes silent or breaks off after
the status line went out. Real proxy, fake instances over real HTTP and ZMQ (mutation
survivors of proxy/dispatch/relay.py)."""

from __future__ import annotations

import json
import logging

import pytest

from tests.support.proxy_helpers import Fault, relayed, running_proxy, wait_until

STREAM = {"model": "fake-model", "prompt": "Hello there", "max_tokens": 5, "stream": True}


def events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


async def test_every_chunk_pushes_the_idle_deadline_back():
    """0.3 s between tokens, 1 s idle deadline: the whole 1.5 s stream is relayed."""
    async with running_proxy(first_token="decode", stream_idle_timeout=1.0) as px:
        p, d = await px.pd()
        d.fault = Fault(token_delay=0.3)
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200
        (rec,) = d.completions()
        assert resp.content == relayed(rec) and resp.text.endswith("data: [DONE]\n\n")
        assert "error" not in resp.text


@pytest.mark.parametrize("expose", [False, True])
async def test_a_silent_stream_ends_with_a_timeout_event(expose, caplog):
    async with running_proxy(first_token="decode", stream_idle_timeout=0.3, expose_routing_headers=expose) as px:
        p, d = await px.pd()
        d.fault = Fault(stall_after=2)
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.relay"):
            resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200
        got = events(resp.text)
        assert [json.loads(e)["choices"][0]["text"] for e in got[:2]] == [" t0", " t1"]
        where = f"decode instance {d.http_address}" if expose else "decode instance"
        assert json.loads(got[2]) == {"error": {"message": f"{where} sent nothing for 0.3s",
                                                "type": "timeout_error", "param": None,
                                                "code": "decode_timeout"}}  # fmt: skip
        assert got[3:] == ["[DONE]"]
        assert await px.metric("xpyd_upstream_errors_total", role="D", instance=d.http_address,
                               kind="stream_idle_timeout") == 1  # fmt: skip
        await wait_until(lambda: d.completions()[0].cancelled, what="D saw the abort")
    assert [r.getMessage() for r in caplog.records if r.name == "xpyd.proxy.relay"] == [
        f"decode stream idle instance={d.http_address} after=0.3s"
    ]


@pytest.mark.parametrize("expose", [False, True])
async def test_a_stream_broken_off_ends_with_a_midstream_event(expose, caplog):
    async with running_proxy(first_token="decode", expose_routing_headers=expose) as px:
        p, d = await px.pd()
        d.fault = Fault(fail_after=2)
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.relay"):
            resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200
        got = events(resp.text)
        err = json.loads(got[2])["error"]
        if expose:
            assert err["message"].startswith(f"decode instance {d.http_address} failed mid-stream: ")
            assert err["message"] != f"decode instance {d.http_address} failed mid-stream: connection dropped"
        else:
            assert err["message"] == "decode instance failed mid-stream: connection dropped"
        assert (err["code"], err["param"]) == ("decode_midstream", None) and got[3:] == ["[DONE]"]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "xpyd.proxy.relay"]
    assert line.startswith(f"decode stream broke instance={d.http_address} error=")

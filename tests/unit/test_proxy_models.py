"""Several models: per-model pools learned from each instance's /v1/models, the union at
the proxy's /v1/models, OpenAI's 404 for a model nobody serves."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.proxy_errors import assert_error
from tests.support.proxy_helpers import running_proxy, wait_until
from xpyd_wire.headers import XPYD_PATH


def body(model: str | None, prompt: str = "hi") -> dict:
    out = {"prompt": prompt, "max_tokens": 2}
    if model is not None:
        out["model"] = model
    return out


async def learned(px, *models: str) -> None:
    await wait_until(lambda: set(px.registry.models()) >= set(models), what=f"models {models}")


async def test_requests_go_to_the_pool_of_their_model():
    async with running_proxy(prefill_policy="round_robin", decode_policy="round_robin") as px:
        pa, da = await px.pd(model="alpha")
        pb, db = await px.pd(model="beta")
        await learned(px, "alpha", "beta")
        for i in range(4):
            for model in ("alpha", "beta", "alpha"):
                resp = await px.client.post("/v1/completions", json=body(model, f"{model}{i}"))
                assert resp.status_code == 200, resp.text
        for fake, model in ((pa, "alpha"), (da, "alpha"), (pb, "beta"), (db, "beta")):
            got = {r.json["model"] for r in fake.completions()}
            assert got == {model}, (fake.role, got)
        assert len(da.completions()) == 8 and len(db.completions()) == 4
        # The request id names the P and D of the same pool.
        rid = da.completions()[0].request_id
        assert pa.zmq_address in rid and da.zmq_address in rid


async def test_models_lists_the_union_of_every_instance_deduplicated():
    async with running_proxy() as px:
        await px.pd(model="alpha")
        await px.fake("D", model="beta")
        await px.fake("P", model="alpha")
        resp = await px.client.get("/v1/models")
        assert resp.status_code == 200
        data = resp.json()
        assert data["object"] == "list"
        assert [m["id"] for m in data["data"]] == ["alpha", "beta"]
        assert all(m["object"] == "model" and m["owned_by"] == "vllm" for m in data["data"])
        async with openai.AsyncOpenAI(base_url=px.url + "/v1", api_key="x", max_retries=0,
                                      http_client=httpx.AsyncClient(verify=False)) as client:  # fmt: skip
            assert [m.id for m in (await client.models.list()).data] == ["alpha", "beta"]


async def test_unknown_model_is_vllms_own_404():
    """A model no instance lists: one D's vLLM answers it (its 404 names the models it
    serves), as one vLLM server would; P is not asked."""
    async with running_proxy() as px:
        p, d = await px.pd(model="alpha")
        await learned(px, "alpha")
        resp = await px.client.post("/v1/chat/completions", json={
            "model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
        err = assert_error(resp, 404, 404)
        assert err["type"] == "NotFoundError" and err["param"] == "model"
        assert err["message"] == "The model `gpt-nope` does not exist. Valid aliases: alpha."
        assert not p.completions() and len(d.completions()) == 1
        assert resp.headers[XPYD_PATH] == "local_verdict"
        async with openai.AsyncOpenAI(base_url=px.url + "/v1", api_key="x", max_retries=0,
                                      http_client=httpx.AsyncClient(verify=False)) as client:  # fmt: skip
            with pytest.raises(openai.NotFoundError) as info:
                await client.completions.create(model="gpt-nope", prompt="x", max_tokens=1)
            assert str(info.value.code) == "404"
        assert await px.metric("xpyd_requests_total", route="/v1/completions", status="404") == 1


async def test_request_without_model():
    async with running_proxy() as px:
        p, d = await px.pd(model="alpha")
        await learned(px, "alpha")
        # One model served: it is the one.
        assert (await px.client.post("/v1/completions", json=body(None))).status_code == 200
        await px.pd(model="beta")
        await learned(px, "alpha", "beta")
        # Several: P and D must serve the same model, so the client has to say which.
        err = assert_error(await px.client.post("/v1/completions", json=body(None)), 400,
                           "missing_model")  # fmt: skip
        assert err["param"] == "model" and "alpha" in err["message"]


async def test_instances_with_unknown_models_serve_any_model_until_learned():
    async with running_proxy(health_interval=0.1) as px:
        await px.fake("P", model="alpha")
        d = await px.fake("D", model="alpha", register=False)
        d.models_status = 500  # D's /v1/models fails: its models stay unknown
        d.register_enabled = True
        d.start_heartbeats()
        await wait_until(lambda: px.registry.live("D"))
        await learned(px, "alpha")  # from P
        assert px.registry.live("D")[0].models is None
        # "omega" might be D's: it is routed (and P, whose models are known, is skipped); D's
        # vLLM does not serve it either, and says so.
        resp = await px.client.post("/v1/completions", json=body("omega"))
        assert resp.status_code == 404 and resp.headers[XPYD_PATH] == "local_no_prefill"
        assert d.completions()[-1].json == body("omega")
        assert await px.metric("xpyd_upstream_errors_total", role="D",
                               instance=d.http_address, kind="models_http_500") >= 1  # fmt: skip
        d.models_status = 200  # retried every health_interval while unknown
        await wait_until(lambda: px.registry.live("D")[0].models is not None)
        assert_error(await px.client.post("/v1/completions", json=body("omega")), 404, 404)  # D's vLLM's
        assert (await px.client.post("/v1/completions", json=body("alpha"))).status_code == 200


async def test_models_are_refreshed():
    async with running_proxy(models_refresh_interval=0.2, health_interval=0.05) as px:
        p, d = await px.pd(model="alpha")
        await learned(px, "alpha")
        p.model = d.model = "alpha-v2"  # redeployed under a new name
        await wait_until(lambda: list(px.registry.models()) == ["alpha-v2"])
        assert_error(await px.client.post("/v1/completions", json=body("alpha")), 404)
        assert (await px.client.post("/v1/completions", json=body("alpha-v2"))).status_code == 200


async def test_models_endpoint_learns_new_instances_at_once():
    # A long refresh interval: /v1/models itself must ask the instance it does not know.
    async with running_proxy(models_refresh_interval=3600, health_interval=3600) as px:
        d = await px.fake("D", model="fresh")
        resp = await px.client.get("/v1/models")
        assert [m["id"] for m in resp.json()["data"]] == ["fresh"]
        assert d.paths().count("/v1/models") >= 1


async def test_models_answers_are_bounded(monkeypatch):
    """A probe reads at most PROBE_MAX_BYTES (or max_response_bytes when smaller) of
    /v1/models; the proxy's own /v1/models relays one instance's answer up to
    max_response_bytes, and answers a 502 in OpenAI error JSON past it."""
    import proxy.membership.probe
    from tests.support.raw_instance import HEAD, RawInstance

    monkeypatch.setattr(proxy.membership.probe, "PROBE_MAX_BYTES", 4096)
    cards = b",".join(b'{"id": "m%04d", "object": "model", "owned_by": "vllm"}' % i
                      for i in range(200))  # fmt: skip
    models = b'{"object": "list", "data": [' + cards + b"]}"
    assert 4096 < len(models) < 64 * 1024
    answer = ([HEAD + b"content-length: 2\r\n\r\n{}"], "fin")
    async with RawInstance(lambda req: answer, models=models) as d:
        for limit in (64 * 1024, 1024):
            async with running_proxy(decode=(d.url,), health_interval=0.05,
                                     max_response_bytes=limit) as px:  # fmt: skip
                await wait_until(lambda: px.registry.live("D"))
                inst = d.url.removeprefix("http://")
                resp = await px.client.get("/v1/models")
                assert px.registry.live("D")[0].models is None  # the probe gave up on it
                assert await px.metric("xpyd_upstream_errors_total", role="D", instance=inst,
                                       kind="models_too_large") >= 1  # fmt: skip
                if limit > len(models):  # relayed as the instance sent it
                    assert resp.status_code == 200 and resp.content == models
                else:
                    err = assert_error(resp, 502, "upstream_error")
                    assert "no instance answered /v1/models" in err["message"]
                # Its models unknown, the instance still serves.
                ok = await px.client.post("/v1/completions", json=body("m0001"))
                assert ok.status_code == 200 and ok.content == b"{}"

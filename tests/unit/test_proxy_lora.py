"""LoRA adapters through the proxy (issue 46, section 3): the admin routes fanned out to every
P and D (proxy/serving/adapters.py), requests for an adapter routed only to instances that
serve it (Registry.serves), and instances that join later told of the adapters.

A real proxy on loopback; the instances are fake vLLM servers (tests/support/fake_vllm.py with
tests/support/fake_lora.py: vLLM 0.32's LoRA routes and answers) registering over real ZMQ.
The same routes on real vLLM: tests/e2e/test_e2e_lora.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy.config import ConfigError, ProxyConfig
from tests.support import fake_lora
from tests.support.fake_vllm import FakeVLLM, Fault
from tests.support.proxy_errors import assert_error
from tests.support.proxy_helpers import running_proxy, wait_until
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_FANOUT, XPYD_PATH, XPYD_PREFILL_INSTANCE

ADMIN = "admin-secret"
AUTH = {"authorization": f"Bearer {ADMIN}"}
BASE = "fake-model"
SLOW = 30.0  # deadlines that are not the subject: generous for a loaded CI box


def proxy(**kw):
    return running_proxy(admin_api_key=ADMIN, expose_routing_headers=True, **kw)


async def joined(px, role: str, adapters: dict[str, str] | None = None, models_status: int = 200,
                 **kw) -> FakeVLLM:
    """A fake instance holding `adapters` already (name -> path) when it registers."""
    fake = FakeVLLM(role, proxy=px.discovery, **kw)
    fake.adapters.update(adapters or {})
    fake.models_status = models_status
    px._fakes.append(fake)
    await fake.start()
    await wait_until(lambda: any(i.http_address == fake.http_address for i in px.registry.live(role)),
                     timeout=SLOW, what=f"{role} live")  # fmt: skip
    return fake


def admin_calls(fake: FakeVLLM):
    return [r for r in fake.requests if r.path in (fake_lora.LOAD, fake_lora.UNLOAD)]


def generations(fake: FakeVLLM):
    return [r for r in fake.requests if r.path in ("/v1/completions", "/v1/chat/completions")]


async def load(px, name: str, path, query: str = "", **extra):
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return await px.client.post(fake_lora.LOAD + query, json=body, headers=AUTH, timeout=SLOW)


async def complete(px, model: str, prompt: str = "hello there"):
    resp = await px.client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2},
                                timeout=SLOW)
    assert resp.status_code == 200, resp.text
    return resp


async def counted(px, name: str, **labels: str) -> None:
    """Until the proxy's /metrics shows the sample above 0."""
    for _ in range(int(SLOW / 0.05)):
        if await px.metric(name, **labels):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} {labels} never counted")


def listed(px, fake: FakeVLLM, name: str) -> bool:
    return any(i.http_address == fake.http_address and name in (i.models or {}) for i in px.registry.all())


# ---------------------------------------------------------------- the admin credential


async def test_without_an_admin_key_the_routes_are_refused_and_no_instance_is_asked(tmp_path):
    async with running_proxy(api_key="client") as px:
        p, d = await px.pd()
        for path in (fake_lora.LOAD, fake_lora.UNLOAD):
            resp = await px.client.post(path, json={"lora_name": "sql", "lora_path": str(tmp_path)},
                                        headers={"authorization": "Bearer client"})
            err = assert_error(resp, 404, "admin_routes_off")
            assert "--admin-api-key" in err["message"]
        assert not admin_calls(p) and not admin_calls(d)


async def test_the_admin_key_is_required_and_the_client_key_is_not_it(tmp_path):
    async with proxy(api_key="client") as px:
        p, d = await px.pd()
        body = {"lora_name": "sql", "lora_path": str(tmp_path)}
        for headers in ({}, {"authorization": "Bearer client"}, {"authorization": "Bearer admin-secreT"}):
            resp = await px.client.post(fake_lora.LOAD, json=body, headers=headers)
            assert_error(resp, 401, "invalid_admin_key")
            assert resp.headers["www-authenticate"] == "Bearer"
        assert not admin_calls(p) and not admin_calls(d)
        # The admin key is no client key either.
        resp = await px.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=AUTH)
        assert_error(resp, 401, "invalid_api_key")
        assert (await px.client.post(fake_lora.LOAD, json=body, headers=AUTH)).status_code == 200


def test_the_admin_key_must_not_be_the_client_key():
    with pytest.raises(ConfigError, match="admin_api_key must differ"):
        ProxyConfig(api_key="same", admin_api_key="same").validate()
    with pytest.raises(ConfigError, match="must not be empty"):
        ProxyConfig(admin_api_key=" ").validate()


# ---------------------------------------------------------------- the fan-out


async def test_a_load_goes_to_every_p_and_d_and_answers_as_one_vllm(tmp_path):
    async with proxy(upstream_api_key="up") as px:
        fakes = [await joined(px, "P", api_key="up"), await joined(px, "D", api_key="up"),
                 await joined(px, "D", api_key="up")]  # fmt: skip
        resp = await load(px, "sql", tmp_path)
        assert resp.status_code == 200
        # What one vLLM answers: its text, with no content type.
        assert resp.content == bytes(admin_calls(fakes[0])[0].sent)
        assert resp.text == "Success: LoRA adapter 'sql' added successfully."
        assert "content-type" not in resp.headers
        assert resp.headers[XPYD_FANOUT] == ", ".join(f"{f.role} {f.http_address} 200" for f in fakes)
        for fake in fakes:
            (call,) = admin_calls(fake)
            assert call.json == {"lora_name": "sql", "lora_path": str(tmp_path)}
            assert call.headers["content-type"] == "application/json"
            assert call.headers["authorization"] == "Bearer up"  # the upstream key, never the admin's
            assert fake.adapters == {"sql": str(tmp_path)}
            # Routing sees the adapter as soon as the answer is out: no refresh to wait for.
            assert listed(px, fake, "sql")
        # /v1/models lists it as vLLM does: after the base model, with its parent.
        models = (await px.client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == [BASE, "sql"]
        assert models[1] == fake_lora.adapter_card("sql", str(tmp_path), BASE)
        assert await px.metric("xpyd_requests_total", route=fake_lora.LOAD, status="200") == 1


async def test_models_lists_the_adapters_after_the_base_model_in_load_order_as_vllm(tmp_path):
    async with proxy() as px:
        p, d = await px.pd()
        for name in ("zeta", "beta", "aaa"):  # "aaa" sorts before the base model's id
            assert (await load(px, name, tmp_path)).status_code == 200
        ids = [m["id"] for m in (await px.client.get("/v1/models")).json()["data"]]
        assert ids == [BASE, "zeta", "beta", "aaa"] == [BASE, *d.adapters]


async def test_every_instance_refusing_alike_is_vllms_own_answer(tmp_path):
    async with proxy() as px:
        p, d = await px.pd()
        resp = await load(px, "sql", tmp_path / "missing")
        err = assert_error(resp, 404, 404)
        assert err == {"message": "Loading lora sql failed: No adapter found for <path>", "type": "NotFoundError",
                       "param": None, "code": 404}
        assert resp.content == bytes(admin_calls(d)[0].sent)  # byte for byte
        assert resp.headers[XPYD_FANOUT].endswith("404")
        # A body vLLM will not parse goes as it came and comes back as vLLM answers it.
        resp = await px.client.post(fake_lora.LOAD, content=b'{"lora_name": "sql"}',
                                    headers={**AUTH, "content-type": "text/plain"})
        assert_error(resp, 400, 400)
        assert "Unsupported Media Type" in resp.json()["error"]["message"]
        assert admin_calls(p)[-1].headers["content-type"] == "text/plain"
        assert not p.adapters and not d.adapters and not px.state.adapters.kept


async def test_a_partial_failure_is_a_502_naming_each_instance_and_the_failed_one_is_no_candidate(tmp_path):
    async with proxy(adapter_timeout=1.0) as px:
        p = await joined(px, "P")
        good, bad, slow = await joined(px, "D"), await joined(px, "D"), await joined(px, "D")
        bad.fault = Fault(status=500, paths=(fake_lora.LOAD,), times=1)
        slow.fault = Fault(hang=True, paths=(fake_lora.LOAD,), times=1)
        resp = await load(px, "sql", tmp_path)
        err = assert_error(resp, 502, "partial_failure")
        assert err["message"].startswith("LoRA adapter 'sql' loaded on 2 of 4 instances; failed: ")
        assert f"D {bad.http_address}: HTTP 500" in err["message"]
        assert f"D {slow.http_address}: timeout" in err["message"]
        assert [(i["instance"], i["status"]) for i in resp.json()["instances"]] == [
            (p.http_address, 200), (good.http_address, 200), (bad.http_address, 500), (slow.http_address, None)]
        assert resp.headers[XPYD_FANOUT].endswith(f"D {bad.http_address} 500, D {slow.http_address} timeout")
        assert not listed(px, bad, "sql") and not listed(px, slow, "sql")
        for i in range(6):  # only the P and D that both serve it
            r = await complete(px, "sql", f"prompt {i}")
            assert (r.headers[XPYD_PREFILL_INSTANCE], r.headers[XPYD_DECODE_INSTANCE]) == (
                p.http_address, good.http_address)
        assert not generations(bad) and not generations(slow)
        # vLLM's own way to load again where it is loaded: in place. Now everywhere.
        resp = await load(px, "sql", tmp_path, load_inplace=True)
        assert resp.status_code == 200, resp.text
        assert all(listed(px, f, "sql") for f in (p, good, bad, slow))


async def test_an_unload_everywhere_then_vllms_404_for_the_adapter(tmp_path):
    async with proxy() as px:
        p, d1, d2 = await joined(px, "P"), await joined(px, "D"), await joined(px, "D")
        assert (await load(px, "sql", tmp_path)).status_code == 200
        del d2.adapters["sql"]  # d2 lost it meanwhile: unloading there is a no-op, not a failure
        resp = await px.client.post(fake_lora.UNLOAD, json={"lora_name": "sql"}, headers=AUTH)
        assert resp.status_code == 200
        assert resp.text == "Success: LoRA adapter 'sql' removed successfully."
        assert resp.headers[XPYD_FANOUT].endswith(f"D {d2.http_address} 404")
        assert not p.adapters and not d1.adapters and "sql" not in px.registry.models()
        assert not px.state.adapters.kept
        resp = await px.client.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 1})
        err = assert_error(resp, 404, 404)
        assert err["message"] == f"The model `sql` does not exist. Valid aliases: {BASE}."
        assert resp.headers[XPYD_PATH] == "local_verdict" and not generations(p)
        # Nowhere to unload: every instance's 404, as one vLLM answers it.
        resp = await px.client.post(fake_lora.UNLOAD, json={"lora_name": "sql"}, headers=AUTH)
        assert assert_error(resp, 404, 404)["message"] == "The lora adapter 'sql' cannot be found."


async def test_the_fan_out_runs_to_its_end_when_the_admin_hangs_up(tmp_path, caplog):
    async with proxy() as px:
        p, d = await px.pd()
        d.fault = Fault(delay=0.5, paths=(fake_lora.LOAD,), times=1)
        body = json.dumps({"lora_name": "sql", "lora_path": str(tmp_path)}).encode()
        host, port = px.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (fake_lora.LOAD.encode(), ADMIN.encode(), len(body), body))
        await writer.drain()
        await wait_until(lambda: admin_calls(d), timeout=SLOW)
        writer.close()  # gone before D answered
        await wait_until(lambda: listed(px, d, "sql") and listed(px, p, "sql"), timeout=SLOW)
        assert list(px.state.adapters.kept) == ["sql"]
        await counted(px, "xpyd_requests_total", route=fake_lora.LOAD, status="200")
        assert not [r for r in caplog.records if r.levelname == "ERROR"]


# ---------------------------------------------------------------- routing by adapter


async def test_an_adapter_goes_only_to_a_p_and_a_d_that_both_serve_it(tmp_path):
    async with proxy() as px:
        p_base, p_lora = await joined(px, "P"), await joined(px, "P", {"sql": str(tmp_path)})
        d_lora, d_base = await joined(px, "D", {"sql": str(tmp_path)}), await joined(px, "D")
        for i in range(6):
            r = await complete(px, "sql", f"prompt {i}")
            assert r.headers[XPYD_PATH] == "disaggregated"
            assert (r.headers[XPYD_PREFILL_INSTANCE], r.headers[XPYD_DECODE_INSTANCE]) == (
                p_lora.http_address, d_lora.http_address)
        assert not generations(p_base) and not generations(d_base)
        for i in range(4):  # the base model: everywhere
            await complete(px, BASE, f"prompt {i}")
        assert len(generations(p_base)) == len(generations(d_base)) == 2


async def test_an_adapter_no_p_serves_is_served_by_d_alone_never_by_a_base_model_p(tmp_path):
    async with proxy() as px:
        p = await joined(px, "P")
        # Its /v1/models fails (it answers /health): a candidate for any base model, no adapter.
        p_unknown = await joined(px, "P", models_status=503)
        d = await joined(px, "D", {"sql": str(tmp_path)})
        assert [i.models is None for i in px.registry.live("P")] == [False, True]
        for i in range(4):
            r = await complete(px, "sql", f"prompt {i}")
            assert r.headers[XPYD_PATH] == "local_no_prefill" and r.headers[XPYD_DECODE_INSTANCE] == d.http_address
        assert not generations(p) and not generations(p_unknown)
        seen = {(await complete(px, BASE, f"b{i}")).headers[XPYD_PREFILL_INSTANCE] for i in range(4)}
        assert seen == {p.http_address, p_unknown.http_address}


async def test_a_request_for_an_adapter_waiting_for_a_slot_takes_none_on_a_base_model_d(tmp_path):
    """Admission control hands a freed slot only to a waiter whose model the instance serves."""
    async with proxy(decode_max_in_flight=1) as px:
        await joined(px, "P", {"sql": str(tmp_path)})
        d_lora, d_base = await joined(px, "D", {"sql": str(tmp_path)}), await joined(px, "D")
        d_lora.fault = Fault(delay=2.0, times=1, paths=("/v1/completions",))
        d_base.fault = Fault(delay=0.2, times=1, paths=("/v1/completions",))
        first = asyncio.create_task(complete(px, "sql", "first"))
        await wait_until(lambda: px.registry.live("D")[0].in_flight == 1, timeout=SLOW)
        base = asyncio.create_task(complete(px, BASE, "base"))
        await wait_until(lambda: px.registry.live("D")[1].in_flight == 1, timeout=SLOW)
        waiting = asyncio.create_task(complete(px, "sql", "waiting"))  # d_lora is full: it queues
        await base  # d_base's slot frees first: not for a request it cannot serve
        for task in (first, waiting):
            assert (await task).headers[XPYD_DECODE_INSTANCE] == d_lora.http_address
        assert [r.json["model"] for r in generations(d_base)] == [BASE]


# ---------------------------------------------------------------- instances that join later


async def test_an_instance_that_joins_later_is_loaded_before_it_serves_the_adapter(tmp_path):
    async with proxy() as px:
        await joined(px, "P")
        d1 = await joined(px, "D")
        assert (await load(px, "sql", tmp_path)).status_code == 200
        late = FakeVLLM("D", proxy=px.discovery)
        late.fault = Fault(delay=1.0, paths=(fake_lora.LOAD,), times=1)  # its load takes a while
        px._fakes.append(late)
        await late.start()
        await wait_until(lambda: any(i.http_address == late.http_address for i in px.registry.live("D")),
                         timeout=SLOW)  # fmt: skip
        # A candidate for the base model at once, for the adapter only once it holds it.
        while not late.adapters:
            r = await complete(px, "sql")
            assert r.headers[XPYD_DECODE_INSTANCE] == d1.http_address
            await complete(px, BASE)
        await wait_until(lambda: listed(px, late, "sql"), timeout=SLOW)
        assert any(r.json["model"] == BASE for r in generations(late))
        assert json.loads(admin_calls(late)[0].body) == {"lora_name": "sql", "lora_path": str(tmp_path)}
        assert await px.metric("xpyd_adapter_syncs_total", result="loaded") == 1
        seen = {(await complete(px, "sql", f"q{i}")).headers[XPYD_DECODE_INSTANCE] for i in range(4)}
        assert seen == {d1.http_address, late.http_address}


async def test_a_joining_instance_that_cannot_load_is_counted_and_no_candidate_for_the_adapter(tmp_path):
    async with proxy() as px:
        await joined(px, "P")
        d1 = await joined(px, "D")
        assert (await load(px, "sql", tmp_path)).status_code == 200
        late = FakeVLLM("D", proxy=px.discovery)
        late.lora_routes = False  # a vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING: 404
        px._fakes.append(late)
        await late.start()
        await counted(px, "xpyd_adapter_syncs_total", result="failed")
        assert [r.status for r in late.requests if r.path == fake_lora.LOAD] == [404]
        for i in range(4):
            assert (await complete(px, "sql", f"q{i}")).headers[XPYD_DECODE_INSTANCE] == d1.http_address
        seen = {(await complete(px, BASE, f"b{i}")).headers[XPYD_DECODE_INSTANCE] for i in range(4)}
        assert late.http_address in seen


async def test_a_static_instance_back_from_a_restart_is_loaded_again_and_no_candidate_until_then(tmp_path):
    d = FakeVLLM("D", register=False)
    await d.start()
    try:
        async with proxy(decode=(f"http://{d.http_address}",), health_interval=0.1) as px:
            await joined(px, "P")
            await wait_until(lambda: px.registry.live("D"), timeout=SLOW)
            assert (await load(px, "sql", tmp_path)).status_code == 200
            other = await joined(px, "D")
            await wait_until(lambda: listed(px, other, "sql"), timeout=SLOW)
            d.health_status = 503  # it restarts: down, back without the adapter
            await wait_until(lambda: d.http_address not in [i.http_address for i in px.registry.live("D")],
                             timeout=SLOW)  # fmt: skip
            d.adapters.clear()
            d.models_delay = 0.5  # the proxy learns only slowly that the adapter is gone
            d.health_status = 200
            await wait_until(lambda: d.http_address in [i.http_address for i in px.registry.live("D")],
                             timeout=SLOW)  # fmt: skip
            while not listed(px, d, "sql"):  # meanwhile: the base model there, the adapter elsewhere
                assert (await complete(px, "sql")).headers[XPYD_DECODE_INSTANCE] == other.http_address
                await asyncio.sleep(0.02)
            assert d.adapters == {"sql": str(tmp_path)}
            assert len([r for r in admin_calls(d) if r.path == fake_lora.LOAD]) == 2
            seen = {(await complete(px, "sql", f"q{i}")).headers[XPYD_DECODE_INSTANCE] for i in range(4)}
            assert seen == {d.http_address, other.http_address}
    finally:
        await d.stop()


# ---------------------------------------------------------------- bounds and several models


async def test_bounds_on_kept_adapters_and_on_the_body(tmp_path):
    async with proxy(max_adapters=1) as px:
        p, d = await px.pd()
        assert (await load(px, "one", tmp_path)).status_code == 200
        assert (await load(px, "one", tmp_path, load_inplace=True)).status_code == 200  # the same one again
        assert_error(await load(px, "two", tmp_path), 400, "too_many_adapters")
        assert "two" not in d.adapters
        big = json.dumps({"lora_name": "x" * 70_000, "lora_path": str(tmp_path)})
        resp = await px.client.post(fake_lora.LOAD, content=big, headers={**AUTH, "content-type": "application/json"})
        assert_error(resp, 413, "request_too_large")
        assert list(px.state.adapters.kept) == ["one"]


async def test_with_several_base_models_the_load_names_its_base(tmp_path):
    async with proxy() as px:
        pa, da = await px.pd(model="alpha")
        pb, db = await px.pd(model="beta")
        await wait_until(lambda: {"alpha", "beta"} <= set(px.registry.models()), timeout=SLOW)
        assert_error(await load(px, "sql", tmp_path), 400, "missing_base_model")
        assert_error(await load(px, "sql", tmp_path, "?base_model=gamma"), 400, "unknown_base_model")
        resp = await load(px, "sql", tmp_path, "?base_model=alpha")
        assert resp.status_code == 200, resp.text
        assert pa.adapters and da.adapters and not admin_calls(pb) and not admin_calls(db)
        # A beta instance that joins later is not given alpha's adapter.
        late = await joined(px, "D", model="beta")
        await joined(px, "D", model="alpha")
        await counted(px, "xpyd_adapter_syncs_total", result="loaded")
        assert not admin_calls(late)


async def test_sagemakers_adapter_routes_are_not_served(tmp_path):
    async with proxy() as px:
        p, d = await px.pd()
        resp = await px.client.post("/adapters", json={"name": "sql", "src": str(tmp_path)}, headers=AUTH)
        assert resp.status_code == 404
        resp = await px.client.delete("/adapters/sql", headers=AUTH)
        assert resp.status_code in (404, 405)
        assert not [r for r in p.requests + d.requests if r.path.startswith("/adapters")]

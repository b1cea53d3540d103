"""LoRA adapters through the proxy (issue 46, section 3): the admin routes fanned out to every
P and D (proxy/serving/adapters.py), requests for an adapter routed only to instances that
serve it (Registry.serves), and instances that join later told of the adapters.

A real proxy on loopback; the instances are fake vLLM servers (tests/support/fake_vllm.py with
tests/support/fake_lora.py: vLLM 0.32's LoRA routes and answers) registering over real ZMQ.
The same routes on real vLLM: tests/e2e/test_e2e_lora.py."""

from __future__ import annotations

import asyncio

from tests.support import fake_lora
from tests.support.fake_vllm import FakeVLLM, Fault
from tests.support.proxy_helpers import running_proxy, wait_until
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_PATH, XPYD_PREFILL_INSTANCE

ADMIN = "admin-secret"
AUTH = {"authorization": f"Bearer {ADMIN}"}
BASE = "fake-model"
SLOW = 30.0  # deadlines that are not the subject: generous for a loaded CI box


def proxy(**kw):
    return running_proxy(expose_routing_headers=True, **kw)


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

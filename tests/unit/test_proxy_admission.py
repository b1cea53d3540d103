"""Admission control: per-instance in-flight limits, the FIFO wait queue, its deadline,
429 + Retry-After when shedding, and no slot leaked by a client that leaves."""

from __future__ import annotations

import asyncio
import time

import httpx

from proxy.config import ProxyConfig
from proxy.errors import ProxyError
from proxy.metrics import Metrics
from proxy.registry import Registry
from proxy.request import RouteRequest
from proxy.routing.selection import Selector
from tests.support.proxy_errors import assert_error, open_raw
from tests.support.proxy_helpers import Fault, running_proxy, wait_until
from xpyd_wire.discovery import Registration


def body(prompt: str) -> dict:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": 2}


def depth(px, role: str = "D") -> int:
    return len(px.state.router.selector.queues[role].waiters)


async def test_overload_is_429_with_retry_after_and_queued_requests_run_in_order():
    async with running_proxy(decode_max_in_flight=1, queue_size=2, queue_timeout=10) as px:
        p, d = await px.pd()
        # Each D answer takes 0.3 s (one at a time, by the limit), once the gate opens: the
        # first holds D's slot until the others are queued, however slow the box.
        gate = asyncio.Event()
        d.fault = Fault(delay=0.3, gate=gate)
        post = px.client.post
        first = asyncio.create_task(post("/v1/completions", json=body("first")))
        await wait_until(lambda: len(d.completions()) == 1, what="first at D")
        queued = []
        for i, prompt in enumerate(("second", "third")):
            queued.append(asyncio.create_task(post("/v1/completions", json=body(prompt))))
            await wait_until(lambda n=i + 1: depth(px) == n, what=f"{prompt} queued")
        assert await px.metric("xpyd_queue_depth", role="D") == 2

        t = time.monotonic()
        shed = await post("/v1/completions", json=body("shed"))
        assert time.monotonic() - t < 2  # refused at once, not after the 10 s wait
        err = assert_error(shed, 429, "queue_full")
        assert err["type"] == "rate_limit_error"
        assert shed.headers["retry-after"] == "1"

        gate.set()
        answers = await asyncio.gather(first, *queued)
        assert [r.status_code for r in answers] == [200, 200, 200]
        got = d.completions()
        assert [r.json["prompt"] for r in got] == ["first", "second", "third"]  # FIFO
        assert [r.json["prompt"] for r in p.completions()] == ["first", "second", "third"]
        # Never two at D at once: each started after the previous 0.3 s answer.
        gaps = [b.received_at - a.received_at for a, b in zip(got, got[1:])]
        assert all(g >= 0.28 for g in gaps), gaps
        assert await px.metric("xpyd_shed_requests_total", reason="queue_full") == 1
        assert await px.metric("xpyd_queue_depth", role="D") == 0
        assert px.registry.live("D")[0].in_flight == 0


async def test_queue_deadline_is_429_and_the_request_never_reaches_an_instance():
    async with running_proxy(decode_max_in_flight=1, queue_timeout=0.3) as px:
        p, d = await px.pd()
        gate = asyncio.Event()  # the first holds D's only slot until the late one is refused
        d.fault = Fault(gate=gate, times=1)
        first = asyncio.create_task(px.client.post("/v1/completions", json=body("first")))
        await wait_until(lambda: len(d.completions()) == 1)
        t = time.monotonic()
        late = await px.client.post("/v1/completions", json=body("late"))
        waited = time.monotonic() - t
        gate.set()
        assert 0.28 <= waited < 10, waited  # its queue_timeout (0.3 s), not the slot's holder
        err = assert_error(late, 429, "queue_timeout")
        assert err["type"] == "rate_limit_error" and late.headers["retry-after"] == "1"
        assert (await first).status_code == 200
        assert [r.json["prompt"] for r in d.completions()] == ["first"]
        assert [r.json["prompt"] for r in p.completions()] == ["first"]
        assert await px.metric("xpyd_shed_requests_total", reason="queue_timeout") == 1
        # The slot came back: the next request is served at once.
        assert (await px.client.post("/v1/completions", json=body("next"))).status_code == 200


async def test_clients_that_leave_free_their_slot_and_their_place_in_the_queue():
    async with running_proxy(decode_max_in_flight=1, queue_timeout=10) as px:
        p, d = await px.pd()
        d.fault = Fault(hang=True, times=1)
        # A holds D's only slot (D hangs); B waits in the queue. Both clients leave.
        _, writer_a = await open_raw(px, "/v1/completions", body("a"))
        await wait_until(lambda: len(d.completions()) == 1)
        _, writer_b = await open_raw(px, "/v1/completions", body("b"))
        await wait_until(lambda: depth(px) == 1, what="b queued")
        writer_b.close()
        await wait_until(lambda: depth(px) == 0, what="b left the queue")
        writer_a.close()
        inst = px.registry.live("D")[0]
        await wait_until(lambda: inst.in_flight == 0, what="a's slot released")
        # Nothing leaked: the limit still admits exactly one, served right away.
        t = time.monotonic()
        ok = await px.client.post("/v1/completions", json=body("c"))
        assert ok.status_code == 200 and time.monotonic() - t < 2  # queue_timeout is 10
        assert [r.json["prompt"] for r in d.completions()] == ["a", "c"]
        assert await px.metric("xpyd_client_disconnects_total") == 2
        assert await px.metric("xpyd_shed_requests_total", reason="queue_timeout") == 0


async def test_prefill_limit_queues_prefills():
    async with running_proxy(prefill_max_in_flight=1, queue_timeout=10) as px:
        p, d = await px.pd()
        p.fault = Fault(delay=0.2)
        answers = await asyncio.gather(
            *(px.client.post("/v1/completions", json=body(f"r{i}")) for i in range(3))
        )
        assert [r.status_code for r in answers] == [200] * 3
        got = p.completions()
        gaps = [b.received_at - a.received_at for a, b in zip(got, got[1:])]
        assert len(got) == 3 and all(g >= 0.18 for g in gaps), gaps


async def test_no_limit_by_default_means_no_queue():
    async with running_proxy() as px:
        p, d = await px.pd()
        d.fault = Fault(delay=1.0)
        assert px.state.router.selector.queues == {}
        t = time.monotonic()
        answers = await asyncio.gather(
            *(px.client.post("/v1/completions", json=body(f"r{i}")) for i in range(8))
        )
        assert [r.status_code for r in answers] == [200] * 8
        assert time.monotonic() - t < 5.0  # all eight at D together (one by one: 8 s; slack for a loaded box)


async def test_openai_client_sees_rate_limit_error():
    import openai

    async with running_proxy(decode_max_in_flight=1, queue_size=0) as px:
        p, d = await px.pd()
        gate = asyncio.Event()  # the first holds D's only slot until the client was refused
        d.fault = Fault(gate=gate, times=1)
        first = asyncio.create_task(px.client.post("/v1/completions", json=body("first")))
        await wait_until(lambda: len(d.completions()) == 1)
        client = openai.AsyncOpenAI(base_url=px.url + "/v1", api_key="x", max_retries=0,
                                    http_client=httpx.AsyncClient(verify=False))  # fmt: skip
        try:
            await client.completions.create(model="fake-model", prompt="x", max_tokens=1)
            raise AssertionError("expected a 429")
        except openai.RateLimitError as e:
            assert e.status_code == 429 and e.code == "queue_full"
            assert e.response.headers["retry-after"] == "1"
        finally:
            await client.close()
            gate.set()
        assert (await first).status_code == 200


# ---------------------------------------------------------------- the queue itself


def _selector(limit: int) -> tuple[Selector, Registry]:
    registry = Registry(heartbeat_timeout=10)
    cfg = ProxyConfig(decode_max_in_flight=limit, queue_size=8, queue_timeout=5).validate()
    selector = Selector(cfg, registry, Metrics(registry))
    registry.admit(registry.upsert(Registration("D", "127.0.0.1:1", "127.0.0.1:2")))
    return selector, registry


def _req(name: str) -> RouteRequest:
    return RouteRequest("/v1/completions", b"{}", {}, 10, {}, None)


async def test_a_slot_handed_to_a_waiter_that_is_cancelled_goes_to_the_next():
    selector, registry = _selector(1)
    inst = registry.live("D")[0]
    r1, r2, r3 = _req("1"), _req("2"), _req("3")
    assert await selector.acquire("D", r1) is inst
    t2 = asyncio.create_task(selector.acquire("D", r2))
    t3 = asyncio.create_task(selector.acquire("D", r3))
    await wait_until(lambda: len(selector.queues["D"].waiters) == 2)
    # The slot goes to t2 and t2 is cancelled before it could run: the slot must pass on.
    selector.release(inst, r1)
    assert inst.in_flight == 1
    t2.cancel()
    assert await asyncio.wait_for(t3, 30) is inst
    assert t2.cancelled()
    assert inst.in_flight == 1 and inst.in_flight_tokens == 10
    selector.release(inst, r3)
    assert inst.in_flight == 0 and inst.in_flight_tokens == 0
    assert not selector.queues["D"].waiters


async def test_a_new_instance_serves_the_waiters_and_full_queue_sheds():
    selector, registry = _selector(1)
    first = registry.live("D")[0]
    held = _req("held")
    assert await selector.acquire("D", held) is first
    waiters = [asyncio.create_task(selector.acquire("D", _req(str(i)))) for i in range(8)]
    await wait_until(lambda: len(selector.queues["D"].waiters) == 8)
    try:
        await selector.acquire("D", _req("ninth"))
        raise AssertionError("expected 429")
    except ProxyError as e:
        assert e.status == 429 and e.code == "queue_full" and e.headers["retry-after"] == "1"
    # Registered, it is pending: no waiter is served by it until it answered.
    second = registry.upsert(Registration("D", "127.0.0.1:3", "127.0.0.1:4"))
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters) and registry.live("D") == [first]
    registry.admit(second)  # it answered: it joins and takes waiter 0
    assert await asyncio.wait_for(waiters[0], 30) is second
    assert not any(w.done() for w in waiters[1:])
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert first.in_flight == 1 and second.in_flight == 1

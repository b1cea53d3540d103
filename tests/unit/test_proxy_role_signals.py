"""The autoscaling signals on the proxy's /metrics (proxy/metrics.py role_signals; issue 50 §2):
per role and model, the live instances, the load their heartbeats report (waiting, running,
KV-cache use) and the proxy's requests in flight to them. Fake instances (tests/support/fake_vllm.py)
register and heartbeat over real ZMQ; /metrics is scraped over real HTTP."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.proxy_helpers import running_proxy
from xpyd_wire.discovery import Load

COMPLETION = {"model": "fake-model", "prompt": "Hello there", "max_tokens": 5}
WAIT_S = 60.0  # heartbeats every 0.2 s; a loaded box may take long (the deadline is not the subject)


async def samples(px) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name, sorted labels) -> value of every xpyd_role_* sample on /metrics."""
    text = (await px.client.get("/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) if fam.name.startswith("xpyd_role_")
            for s in fam.samples}  # fmt: skip


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


async def until(px, want: dict, what: str) -> dict:
    """The samples once every `want` entry has its value; AssertionError after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        got = await samples(px)
        if all(got.get(k) == pytest.approx(v) for k, v in want.items()):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: want {want}, got {got}")
        await asyncio.sleep(0.05)


async def test_per_role_and_model_what_the_instances_report_and_what_the_proxy_holds():
    async with running_proxy() as px:
        p1 = await px.fake("P", load=Load(running=2, waiting=3, kv_usage=0.5))
        await px.fake("P", load=Load(running=1, waiting=1, kv_usage=0.25))
        # 3 of D's 5 waiting are held for their prefill's KV (concurrent dispatch): not D's queue.
        await px.fake("D", load=Load(running=4, waiting=5, kv_usage=0.8, waiting_for_kv=3), token_delay=0.3)
        await px.fake("D", model="other-model", load=Load(running=1, waiting=2, kv_usage=0.1))
        fake_p = dict(role="P", model="fake-model")
        fake_d = dict(role="D", model="fake-model")
        got = await until(px, {
            key("xpyd_role_instances", **fake_p): 2,
            key("xpyd_role_requests", **fake_p, state="waiting"): 4,
            key("xpyd_role_requests", **fake_p, state="running"): 3,
            key("xpyd_role_kv_cache_usage", **fake_p): 0.375,  # the mean over P's
            key("xpyd_role_instances", **fake_d): 1,
            key("xpyd_role_requests", **fake_d, state="running"): 4,
            key("xpyd_role_requests", **fake_d, state="waiting"): 2,
            key("xpyd_role_requests", **fake_d, state="waiting_for_kv"): 3,
            key("xpyd_role_requests", **fake_p, state="waiting_for_kv"): 0,
            key("xpyd_role_kv_cache_usage", **fake_d): 0.8,
            key("xpyd_role_requests", role="D", model="other-model", state="waiting"): 2,
        }, "the heartbeats' loads per role and model")
        assert got[key("xpyd_role_in_flight", **fake_d)] == 0
        assert not [k for k in got if dict(k[1]).get("role") == "P" and dict(k[1]).get("model") == "other-model"]

        # The gauges follow the heartbeats: P1 drained its queue.
        p1.load = Load(running=2, waiting=0, kv_usage=0.5)
        await until(px, {key("xpyd_role_requests", **fake_p, state="waiting"): 1}, "P1's new load")

        # A request D streams slowly is in flight to D (the proxy's own count) until it ends.
        task = asyncio.get_running_loop().create_task(px.client.post("/v1/completions", json={**COMPLETION,
                                                                                             "stream": True}))
        await until(px, {key("xpyd_role_in_flight", **fake_d): 1}, "the request in flight to D")
        assert (await task).status_code == 200
        await until(px, {key("xpyd_role_in_flight", **fake_d): 0}, "no request in flight after the answer")


async def test_an_instance_whose_models_are_unknown_counts_under_the_empty_model_and_reports_no_load():
    """A static instance (no heartbeat: no load) whose /v1/models failed: counted, no load sample."""
    async with running_proxy(heartbeat_timeout=30) as px:
        d = await px.fake("D", register=False)
        d.models_status = 503
        px.registry.set_healthy(px.registry.add_static("D", d.http_address, d.zmq_address), True)
        got = await until(px, {key("xpyd_role_instances", role="D", model=""): 1}, "the static D")
    assert key("xpyd_role_kv_cache_usage", role="D", model="") not in got
    assert key("xpyd_role_requests", role="D", model="", state="waiting") not in got

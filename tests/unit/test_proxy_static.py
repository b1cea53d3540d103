"""Static instances (--prefill/--decode URL[,kv=HOST:PORT]): mixed with discovered ones,
health-checked (out of the live list while /health fails, back when it passes), never
expired by heartbeat; their config forms."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter

import pytest

from proxy.config import ConfigError, load_config
from proxy.membership.static import DEFAULT_KV_PORT, parse_static
from tests.support.proxy_helpers import REQUEST_ID_RE, FakeVLLM, running_proxy, wait_until
from xpyd_wire.headers import XPYD_DECODE_INSTANCE

BODY = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}


async def started(role: str) -> FakeVLLM:
    return await FakeVLLM(role, register=False).start()


def live(px, role: str) -> set[str]:
    return {i.http_address for i in px.registry.live(role)}


async def test_static_and_discovered_instances_share_the_work():
    sp, sd = await started("P"), await started("D")
    try:
        async with running_proxy(
            prefill=(f"http://{sp.http_address},kv={sp.zmq_address}",),
            decode=(sd.http_address,),  # no scheme, no kv=: the default KV port
            heartbeat_timeout=2.0,  # the discovered D (a heartbeat every 0.2 s) must not lapse on a loaded box
            expose_routing_headers=True,  # /instances with addresses
        ) as px:
            await wait_until(lambda: live(px, "P") and live(px, "D"), what="static live")
            assert (await px.client.get("/ready")).status_code == 200
            dd = await px.fake("D")
            for _ in range(6):
                resp = await px.client.post("/v1/completions", json=BODY)
                assert resp.status_code == 200, resp.text
            assert len(sd.completions()) == 3 and len(dd.completions()) == 3
            assert len(sp.completions()) == 6
            rid = re.match(REQUEST_ID_RE, sd.completions()[0].request_id)
            assert rid["p"] == sp.zmq_address
            assert rid["d"] == f"127.0.0.1:{DEFAULT_KV_PORT}"
            # Heartbeat expiry (2 s) never applies to static instances.
            await asyncio.sleep(3.0)
            assert live(px, "P") == {sp.http_address}
            assert live(px, "D") == {sd.http_address, dd.http_address}
            listed = {i["http_address"]: i for i in (await px.client.get("/instances")).json()}
            assert listed[sd.http_address]["static"] is True
            assert listed[dd.http_address]["static"] is False
    finally:
        await sp.stop()
        await sd.stop()


async def test_static_instance_unhealthy_leaves_and_comes_back():
    sd = await started("D")
    try:
        async with running_proxy(decode=(f"http://{sd.http_address}",), health_interval=0.05,
                                 expose_routing_headers=True) as px:  # fmt: skip
            _p, dd = await px.fake("P"), await px.fake("D")
            await wait_until(lambda: sd.http_address in live(px, "D"))
            sd.health_status = 503
            await wait_until(lambda: sd.http_address not in live(px, "D"), what="left")
            listed = {i["http_address"]: i for i in (await px.client.get("/instances")).json()}
            assert listed[sd.http_address]["healthy"] is False  # still listed, not live
            before = len(sd.completions())
            for _ in range(4):
                assert (await px.client.post("/v1/completions", json=BODY)).status_code == 200
            assert len(sd.completions()) == before and len(dd.completions()) >= 4
            assert await px.metric("xpyd_upstream_errors_total", role="D",
                                   instance=sd.http_address, kind="health_http_503") >= 1  # fmt: skip
            sd.health_status = 200
            await wait_until(lambda: sd.http_address in live(px, "D"), what="back")
            served = Counter()
            for _ in range(4):
                resp = await px.client.post("/v1/completions", json=BODY)
                served[resp.headers[XPYD_DECODE_INSTANCE]] += 1
            assert served[sd.http_address] == 2 and served[dd.http_address] == 2
    finally:
        await sd.stop()


async def test_static_instance_that_never_answers_is_unhealthy_within_the_deadline():
    # Accepts connections, never answers: only the probe deadline can decide.
    conns: list[asyncio.StreamWriter] = []

    async def silent(reader, writer):
        conns.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sd = await started("D")
    try:
        t0 = time.monotonic()
        async with running_proxy(
            decode=(f"127.0.0.1:{port}", sd.http_address), health_interval=0.05, probe_timeout=0.2
        ) as px:
            await px.fake("P")
            await wait_until(lambda: live(px, "D") == {sd.http_address}, what="good D live")
            # Each probe of the silent one ends at its 0.2 s deadline: two have by ~0.45 s
            # (2.5 s: a loaded box; a deadline 10 times longer takes 4 s).
            while await px.metric("xpyd_upstream_errors_total", role="D", instance=f"127.0.0.1:{port}",
                                  kind="health_timeout") < 2:  # fmt: skip
                assert time.monotonic() - t0 < 2.5, "the silent instance's probes outlived their deadline"
                await asyncio.sleep(0.02)
            assert live(px, "D") == {sd.http_address}
            assert (await px.client.post("/v1/completions", json=BODY)).status_code == 200
    finally:
        for w in conns:
            w.close()
        server.close()
        await sd.stop()


async def test_static_instance_that_also_registers_is_one_instance():
    sd = await started("D")
    try:
        async with running_proxy(decode=(sd.http_address,), heartbeat_timeout=0.3) as px:
            await wait_until(lambda: live(px, "D"))
            sd.proxy = px.discovery  # the same server now heartbeats too, with its real kv
            sd.register_enabled = True
            sd.start_heartbeats()
            await wait_until(lambda: px.registry.live("D")[0].zmq_address == sd.zmq_address)
            sd.stop_heartbeats()
            await sd.send_registration(leave=True)
            await asyncio.sleep(0.6)
            assert [i.http_address for i in px.registry.live("D")] == [sd.http_address]
    finally:
        await sd.stop()


# ---------------------------------------------------------------- config


def test_parse_static():
    s = parse_static("P", "http://10.0.0.5:8100,kv=10.0.0.5:21001")
    assert (s.http_address, s.zmq_address) == ("10.0.0.5:8100", "10.0.0.5:21001")
    assert parse_static("D", "10.0.0.6:8200").zmq_address == f"10.0.0.6:{DEFAULT_KV_PORT}"
    assert parse_static("D", "http://h:1/").http_address == "h:1"
    for bad in ("https://h:1", "http://h", "h:1,kv=x", "h:1,foo=1:2", "http://h:1/v1", "h:99999"):
        with pytest.raises(ConfigError):
            parse_static("D", bad)


def test_parse_static_kv_events_option():
    s = parse_static("P", "http://10.0.0.5:8100,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558")
    assert s.kv_events is not None and s.kv_events.endpoint == "tcp://10.0.0.5:5557"
    assert s.kv_events.replay_endpoint == "tcp://10.0.0.5:5558"
    assert parse_static("P", "http://h:1").kv_events is None
    for bad in ("h:1,replay=tcp://h:2", "h:1,events=h:2", "h:1,events=tcp://*:5557", "h:1,events="):
        with pytest.raises(ConfigError):
            parse_static("D", bad)


async def test_static_instance_with_events_is_subscribed():
    from tests.support.kv_publisher import Publisher

    pub = Publisher()
    try:
        async with running_proxy(prefill=(f"http://127.0.0.1:1,events={pub.endpoint},replay={pub.replay_endpoint}",),
                                 health_interval=0.2) as px:
            await wait_until(lambda: px.state.kv_events.streams(), what="static instance subscribed")
            [stream] = px.state.kv_events.streams()
            assert stream.inst.static and stream.endpoint.endpoint == pub.endpoint
            await wait_until(lambda: stream.index.state.value == "known", what="replay answered")
    finally:
        pub.close()


def test_static_config_forms(tmp_path):
    cfg = load_config(["--prefill", "http://a:1,kv=a:2", "--prefill", "http://b:1", "--decode",
                       "c:1"], env={})  # fmt: skip
    assert cfg.prefill == ("http://a:1,kv=a:2", "http://b:1") and cfg.decode == ("c:1",)
    cfg = load_config([], env={"XPYD_DECODE": "http://a:1,kv=a:2; http://b:1  c:3"})
    assert cfg.decode == ("http://a:1,kv=a:2", "http://b:1", "c:3")
    path = tmp_path / "proxy.yaml"
    path.write_text("prefill:\n  - http://a:1,kv=a:2\ndecode: http://d:1\n")
    cfg = load_config(["--config", str(path)], env={})
    assert cfg.prefill == ("http://a:1,kv=a:2",) and cfg.decode == ("http://d:1",)
    # Flag beats env beats file, as for every other setting.
    cfg = load_config(["--config", str(path), "--decode", "x:1"], env={"XPYD_DECODE": "y:1"})
    assert cfg.decode == ("x:1",)
    with pytest.raises(ConfigError):
        load_config(["--decode", "https://a:1"], env={})
    path.write_text("decode: 5\n")
    with pytest.raises(ConfigError):
        load_config(["--config", str(path)], env={})

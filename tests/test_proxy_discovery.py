"""Discovery over real ZMQ: registration, load, expiry, re-registration, leave, bad
messages, signed registrations."""

from __future__ import annotations

import msgpack
import pytest
from proxy_helpers import running_proxy, wait_until

from proxy.protocol import Load, Registration, encode


def _addresses(registry, role):
    return [i.http_address for i in registry.live(role)]


async def test_registration_shows_in_instances_and_ready():
    async with running_proxy() as px:
        assert (await px.client.get("/ready")).status_code == 503
        p = await px.fake("P", load=Load(running=2, waiting=1, kv_usage=0.25))
        ready = await px.client.get("/ready")
        assert ready.status_code == 503 and ready.json()["prefill"] == 1  # no D yet
        d = await px.fake("D")
        assert (await px.client.get("/ready")).status_code == 200
        data = (await px.client.get("/instances")).json()
        by_role = {i["role"]: i for i in data}
        assert by_role["P"]["http_address"] == p.http_address
        assert by_role["P"]["zmq_address"] == p.zmq_address
        assert by_role["P"]["load"] == {"running": 2, "waiting": 1, "kv_usage": 0.25,
                                          "kv_buffer_usage": 0.0}
        assert by_role["D"]["http_address"] == d.http_address and by_role["D"]["load"] is None
        for inst in data:
            assert inst["in_flight"] == 0
            assert inst["heartbeat_age_s"] < 5
            assert inst["last_heartbeat"] > 1e9  # unix time
        assert await px.metric("xpyd_instances", role="P") == 1
        assert await px.metric("xpyd_discovery_messages_total", result="accepted") >= 2


async def test_expiry_of_any_instance_and_reregistration():
    async with running_proxy(heartbeat_timeout=0.5) as px:
        fakes = [await px.fake("D", heartbeat_interval=0.1) for _ in range(3)]
        middle = fakes[1]
        middle.stop_heartbeats()  # the middle entry of the table goes quiet
        await wait_until(
            lambda: middle.http_address not in _addresses(px.registry, "D"),
            timeout=5,
            what="middle instance expired",
        )
        assert _addresses(px.registry, "D") == [fakes[0].http_address, fakes[2].http_address]
        middle.start_heartbeats()  # comes back: registered again
        await wait_until(
            lambda: middle.http_address in _addresses(px.registry, "D"),
            timeout=5,
            what="re-registration",
        )
        assert len(px.registry.live("D")) == 3


async def test_reregistration_updates_zmq_address():
    async with running_proxy() as px:
        p = await px.fake("P")
        p.zmq_address = "127.0.0.1:4242"
        await p.send_registration()
        await wait_until(lambda: px.registry.live("P")[0].zmq_address == "127.0.0.1:4242")
        assert px.registry.count("P") == 1


async def test_leave_removes_instance():
    async with running_proxy() as px:
        p = await px.fake("P", heartbeat_interval=5)
        await p.send_registration(leave=True)
        await wait_until(lambda: px.registry.count("P") == 0, what="leave")
        assert await px.metric("xpyd_discovery_messages_total", result="left") == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1 definitely not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"type": "X", "http_address": "h:1", "zmq_address": "h:2"}),
        msgpack.packb({"type": "P", "http_address": "nohost", "zmq_address": "h:2"}),
        msgpack.packb({"type": "P", "zmq_address": "h:2"}),
        msgpack.packb(
            {"type": "P", "http_address": "h:1", "zmq_address": "h:2", "load": {"running": -1}}
        ),
        [b"", b"", b"too", b"many", b"frames ending in garbage"],
    ],
    ids=["garbage", "list", "unknown-type", "bad-address", "missing-field", "bad-load", "frames"],
)
async def test_malformed_message_dropped_then_good_registration(payload):
    async with running_proxy() as px:
        p = await px.fake("P", register=False)
        await p.send_raw(payload)
        await wait_until(
            lambda: px.state.metrics.discovery.labels("malformed")._value.get() == 1,
            what="malformed counted",
        )
        assert px.registry.count("P") == 0
        await p.send_registration()  # discovery is still alive and accepts the next one
        await wait_until(lambda: px.registry.count("P") == 1, what="good registration")
        assert await px.metric("xpyd_discovery_messages_total", result="malformed") == 1


async def test_many_bad_messages_never_stop_discovery():
    async with running_proxy() as px:
        p = await px.fake("P", register=False)
        for i in range(200):
            await p.send_raw(bytes([i % 256]) * (i % 7 + 1))
        await p.send_registration()
        await wait_until(lambda: px.registry.count("P") == 1, what="registration after flood")


async def test_signed_discovery():
    async with running_proxy(discovery_secret="s3cret") as px:
        unsigned = await px.fake("P", register=False)
        await unsigned.send_registration()
        wrong = await px.fake("P", register=False, secret="wrong")
        await wrong.send_registration()
        await wait_until(
            lambda: px.state.metrics.discovery.labels("unauthorized")._value.get() == 2,
            what="unauthorized counted",
        )
        assert px.registry.count("P") == 0
        good = await px.fake("D", secret="s3cret")
        assert _addresses(px.registry, "D") == [good.http_address]
        # A leave must be signed too: an unsigned one cannot deregister a live instance.
        await unsigned.send_raw(
            encode(Registration("D", good.http_address, good.zmq_address, leave=True))
        )
        await wait_until(
            lambda: px.state.metrics.discovery.labels("unauthorized")._value.get() == 3
        )
        assert px.registry.count("D") == 1


async def test_rejects_stale_signed_message():
    async with running_proxy(discovery_secret="k") as px:
        p = await px.fake("P", register=False)
        await p.send_raw(encode(Registration("P", p.http_address, p.zmq_address, ts=1.0), "k"))
        await wait_until(
            lambda: px.state.metrics.discovery.labels("unauthorized")._value.get() == 1
        )
        assert px.registry.count("P") == 0

"""The connector's discovery heartbeat, against a real ZMQ ROUTER and a real
HTTP /health endpoint on loopback; decoded with the proxy's own parser."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import logging
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import zmq

from connector.config import ConnectorConfig
from connector.registration import Registrar, heartbeat_load
from xpyd_wire.discovery import Load, ProtocolError, decode


class _Health(http.server.BaseHTTPRequestHandler):
    healthy = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        code = 200 if self.path == "/health" and self.healthy.is_set() else 503
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def health_server() -> Iterator[tuple[int, threading.Event]]:
    _Health.healthy = threading.Event()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1], _Health.healthy
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket, int]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, port
    sock.close()
    ctx.term()


def _cfg(http_port: int, proxy_port: int, role: str = "kv_producer", secret: str | None = None) -> ConnectorConfig:
    extra = {"proxy_ip": "127.0.0.1", "proxy_port": proxy_port, "http_port": http_port,
             "heartbeat_interval_s": 0.2}
    if secret:
        extra["discovery_secret"] = secret
    return ConnectorConfig.from_vllm(SimpleNamespace(kv_role=role, kv_port=23001, kv_connector_extra_config=extra))


def _recv(sock: zmq.Socket, timeout_s: float) -> bytes | None:
    if sock.poll(int(timeout_s * 1000)):
        _ident, msg = sock.recv_multipart()
        return msg
    return None


def test_announces_only_once_healthy_then_heartbeats_and_leaves(health_server, router):
    http_port, healthy = health_server
    sock, proxy_port = router
    reg = Registrar(_cfg(http_port, proxy_port, role="kv_consumer"), lambda: Load(2, 3, 0.25, 0.5))
    try:
        assert _recv(sock, 0.8) is None, "announced before /health answered 200"
        healthy.set()
        msg = _recv(sock, 3.0)
        assert msg is not None
        r = decode(msg)
        assert (r.role, r.http_address, r.zmq_address) == ("D", f"127.0.0.1:{http_port}", "127.0.0.1:23001")
        assert r.load == Load(2, 3, 0.25, 0.5)  # buffer occupancy included
        assert not r.leave
        assert _recv(sock, 3.0) is not None  # a periodic heartbeat, not a one-off
    finally:
        t0 = time.monotonic()
        reg.stop()
        assert time.monotonic() - t0 < 3.0
    last = None
    while (m := _recv(sock, 1.0)) is not None:
        last = m
    assert last is not None and decode(last).leave


def test_signed_heartbeat_verifies_with_the_secret_only(health_server, router):
    http_port, healthy = health_server
    healthy.set()
    sock, proxy_port = router
    reg = Registrar(_cfg(http_port, proxy_port, secret="s3cret"), lambda: Load(0, 0, 0.0))
    try:
        msgs = [_recv(sock, 3.0), _recv(sock, 3.0)]
    finally:
        reg.stop()
    assert None not in msgs
    first, second = (decode(m, secret="s3cret") for m in msgs)
    assert first.role == "P"
    # Each heartbeat has a nonce of its own: the proxy's replay check accepts them all.
    assert first.nonce and second.nonce and first.nonce != second.nonce
    with pytest.raises(ProtocolError):
        decode(msgs[0], secret="other")


async def test_registrar_keeps_a_signing_proxy_registered_and_leaves(health_server):
    """The real sender against a real proxy with a secret: accepted every time (a fresh nonce
    per heartbeat, nothing counted as replayed), and its signed leave removes it."""
    from tests.support.proxy_helpers import running_proxy, wait_until

    http_port, healthy = health_server
    healthy.set()
    async with running_proxy(discovery_secret="s3cret") as px:
        port = int(px.discovery.rsplit(":", 1)[1])
        reg = Registrar(_cfg(http_port, port, secret="s3cret"), lambda: Load(1, 0, 0.5, 0.25))
        counter = px.state.metrics.discovery.labels
        try:
            await wait_until(lambda: counter("accepted")._value.get() >= 3, what="3 heartbeats")
            [inst] = px.registry.live("P")
            assert inst.http_address == f"127.0.0.1:{http_port}" and inst.load == Load(1, 0, 0.5, 0.25)
        finally:
            await asyncio.to_thread(reg.stop)
        await wait_until(lambda: px.registry.count("P") == 0, what="signed leave")
        assert counter("replayed")._value.get() == 0 and counter("unauthorized")._value.get() == 0


def test_registrar_says_at_start_up_when_the_proxy_would_drop_it(health_server, router, caplog):
    http_port, _healthy = health_server
    _sock, proxy_port = router
    cfg = dataclasses.replace(_cfg(http_port, proxy_port), kv_ip="10.0.0.1\r\nX: y")
    with caplog.at_level(logging.ERROR, logger="xpyd"):
        reg = Registrar(cfg, lambda: Load())
        try:
            assert "zmq_address" in (reg.check() or "")
            deadline = time.monotonic() + 3
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            reg.stop()
    assert any("will drop this instance's registrations" in r.getMessage() for r in caplog.records)
    good = Registrar(_cfg(http_port, proxy_port), lambda: Load())
    try:
        assert good.check() is None
    finally:
        good.stop()


def test_heartbeat_load_is_always_in_the_range_the_proxy_accepts():
    assert heartbeat_load(None, 2, 5, float("nan")) == Load(2, 3, 0.0, 0.0)
    assert heartbeat_load(None, 2, 5, 0.0, waiting_for_kv=9).waiting_for_kv == 3  # never more than waiting
    assert heartbeat_load(None, 0, 0, 1.7).kv_buffer_usage == 1.0
    assert heartbeat_load(None, 0, 0, -0.2).kv_buffer_usage == 0.0


@pytest.mark.parametrize("extra,env", [
    ({"discovery_secret": ""}, None),
    ({"discovery_secret": "   "}, None),
    ({}, ""),
    ({"discovery_secret": None}, ""),  # None means unset: the empty env is what is used
])  # fmt: skip
def test_empty_discovery_secret_is_a_start_up_error(monkeypatch, extra, env):
    if env is None:
        monkeypatch.delenv("XPYD_DISCOVERY_SECRET", raising=False)
    else:
        monkeypatch.setenv("XPYD_DISCOVERY_SECRET", env)
    kvt = SimpleNamespace(kv_role="kv_producer", kv_port=23001, kv_connector_extra_config=extra)
    with pytest.raises(ValueError, match="discovery_secret|XPYD_DISCOVERY_SECRET"):
        ConnectorConfig.from_vllm(kvt)


def test_discovery_secret_from_extra_wins_over_env_and_unset_means_unsigned(monkeypatch):
    monkeypatch.setenv("XPYD_DISCOVERY_SECRET", "from-env")
    kvt = SimpleNamespace(kv_role="kv_producer", kv_port=1, kv_connector_extra_config={"discovery_secret": "x"})
    assert ConnectorConfig.from_vllm(kvt).discovery_secret == "x"
    monkeypatch.delenv("XPYD_DISCOVERY_SECRET")
    kvt.kv_connector_extra_config = {}
    assert ConnectorConfig.from_vllm(kvt).discovery_secret is None


def test_events_endpoint_from_vllms_kv_events_config(caplog):
    from connector.config import events_endpoint
    from xpyd_wire.kv_events import EventsEndpoint

    def kec(**kw):
        return SimpleNamespace(**{"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": "tcp://*:5557", "replay_endpoint": None, "topic": "", **kw})

    assert events_endpoint(None, "10.0.0.2") is None
    assert events_endpoint(kec(enable_kv_cache_events=False), "10.0.0.2") is None
    assert events_endpoint(kec(publisher="null"), "10.0.0.2") is None
    assert events_endpoint(kec(replay_endpoint="tcp://*:5558", topic="kv"), "10.0.0.2", 512) == \
        EventsEndpoint("tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558", "kv", 512)
    assert events_endpoint(kec(endpoint="tcp://[::ffff:127.0.0.1]:5557"), "127.0.0.1").endpoint == \
        "tcp://127.0.0.1:5557"
    # vLLM connects (not binds) a concrete address, and ipc is not reachable from the proxy.
    assert events_endpoint(kec(endpoint="tcp://127.0.0.1:5557"), "10.0.0.2") is None
    assert events_endpoint(kec(endpoint="ipc:///tmp/kv"), "10.0.0.2") is None
    assert "not advertised" in caplog.text


async def test_registrar_advertises_events_and_the_proxy_subscribes(health_server):
    """The connector's heartbeat (kv_events from vLLM's config, bind address -> kv host) reaches a
    real proxy, which subscribes: its /instances shows the index known and growing; the
    instance leaves and the proxy unsubscribes."""
    from tests.support.kv_publisher import Publisher
    from tests.support.proxy_helpers import running_proxy, wait_until
    from xpyd_wire.kv_events import BlockStored

    http_port, healthy = health_server
    healthy.set()
    pub = Publisher()
    kec = SimpleNamespace(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{pub.port}",
                          replay_endpoint="tcp://*:" + pub.replay_endpoint.rsplit(":", 1)[1], topic="")
    async with running_proxy(expose_routing_headers=True) as px:
        port = int(px.discovery.rsplit(":", 1)[1])
        extra = {"proxy_ip": "127.0.0.1", "proxy_port": port, "http_port": http_port, "heartbeat_interval_s": 0.2}
        cfg = ConnectorConfig.from_vllm(SimpleNamespace(kv_role="kv_producer", kv_port=23001,
                                                        kv_connector_extra_config=extra), kec, 2048)
        assert cfg.kv_events is not None and cfg.kv_events.endpoint == pub.endpoint
        reg = Registrar(cfg, lambda: Load(0, 0, 0.0, 0.0))
        try:
            await wait_until(lambda: px.state.kv_events.streams(), what="subscribed")

            async def view():
                [entry] = (await px.client.get("/instances")).json()
                return entry["kv_events"]

            for _ in range(600):  # 30 s at most: a loaded box
                if (await view())["state"] == "known":
                    break
                await asyncio.sleep(0.05)
            assert (await view())["state"] == "known" and (await view())["cap"] == 2048
            for _ in range(600):  # until the SUB connection is up (ZMQ's slow joiner); 30 s at most
                pub.publish([BlockStored((1, 2), None, tuple(range(32)), 16, None, "GPU", 0)])
                await asyncio.sleep(0.05)
                if (await view())["blocks"] == 2:
                    break
            v = await view()
            assert v["blocks"] == 2 and v["state"] == "known"
        finally:
            await asyncio.to_thread(reg.stop)
            await wait_until(lambda: not px.state.kv_events.streams(), what="unsubscribed on leave")
            pub.close()

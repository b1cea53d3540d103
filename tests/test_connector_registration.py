"""The connector's discovery heartbeat, against a real ZMQ ROUTER and a real
HTTP /health endpoint on loopback; decoded with the proxy's own parser."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import zmq

from connector.config import ConnectorConfig
from connector.registration import Registrar
from proxy.protocol import Load, ProtocolError, decode


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
        msg = _recv(sock, 3.0)
    finally:
        reg.stop()
    assert msg is not None
    assert decode(msg, secret="s3cret").role == "P"
    with pytest.raises(ProtocolError):
        decode(msg, secret="other")

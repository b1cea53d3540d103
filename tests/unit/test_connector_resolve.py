"""Issue 18: every proxy replica behind one DNS name hears every instance.

The registrar resolves a proxy name to all its addresses and heartbeats to each. The
resolver is a double we control (the name resolves to several loopback addresses and then
changes its answer); the proxies are real ZMQ ROUTERs, or real proxy discovery servers,
bound on 127.0.0.21, .22, .23 with one port, as a headless Service's pods would be. One
test uses the real socket.getaddrinfo on `localhost`.
"""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from connector.config import ConnectorConfig
from connector.registration import Registrar
from xpyd_wire.discovery import Load, Registration, decode

NAME = "proxies.xpyd.test"  # only the double resolves it
IPS = ("127.0.0.21", "127.0.0.22", "127.0.0.23")


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def http_port() -> Iterator[int]:
    """The instance's own /health, always 200: the registrar announces only once it answers."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@dataclass
class Dns:
    """A getaddrinfo double: NAME resolves to `answer`; `error` raises instead; `hang`, when
    set, makes a lookup wait on it (a stalled DNS server) until released."""

    answer: tuple[str, ...] = ()
    error: BaseException | None = None
    hang: threading.Event | None = None
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, host: str, port: int, family: int = 0, type: int = 0, proto: int = 0,  # noqa: A002
                 flags: int = 0) -> list[tuple[Any, ...]]:
        with self.lock:
            self.calls += 1
            answer, error, hang = self.answer, self.error, self.hang
        if hang is not None:
            hang.wait(30)  # bounded: the test releases it
        if host != NAME:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if error is not None:
            raise error
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, port, 0, 0) if ":" in ip else (ip, port)) for ip in answer]

    def set(self, *, answer: tuple[str, ...] | None = None, error: BaseException | None = None,
            hang: threading.Event | None = None) -> int:
        """Changes the answer; returns how many lookups had begun before the change."""
        with self.lock:
            if answer is not None:
                self.answer = answer
            self.error, self.hang = error, hang
            return self.calls


@dataclass
class Replica:
    """A proxy replica's discovery socket (a ROUTER, as the proxy's) with a monitor that
    sees the registrar's connection open and close."""

    ip: str
    sock: zmq.Socket
    monitor: zmq.Socket

    def recv(self, timeout_s: float) -> Registration | None:
        if self.sock.poll(int(timeout_s * 1000)):
            _ident, msg = self.sock.recv_multipart()
            return decode(msg)
        return None

    def drain(self, window_s: float) -> list[Registration]:
        """Everything that arrives within window_s (bounded: at most 1000 messages)."""
        out: list[Registration] = []
        deadline = time.monotonic() + window_s
        while len(out) < 1000 and (left := deadline - time.monotonic()) > 0:
            if (r := self.recv(left)) is not None:
                out.append(r)
        return out

    def wait_event(self, event: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.monitor.poll(int(left * 1000)) and recv_monitor_message(self.monitor)["event"] == event:
                return True
        return False


@pytest.fixture
def replicas() -> Iterator[tuple[int, dict[str, Replica]]]:
    """ROUTERs on 127.0.0.21-23 (and ::1), all on one port, like a headless Service's pods."""
    ctx = zmq.Context()
    ips = (*IPS, "::1")
    out: dict[str, Replica] = {}
    for _attempt in range(20):  # bounded: another process may hold the port on one address
        out = {}
        try:
            port = 0
            for ip in ips:
                s = ctx.socket(zmq.ROUTER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.IPV6, 1)
                mon = s.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
                out[ip] = Replica(ip, s, mon)
                host = f"[{ip}]" if ":" in ip else ip
                if port:
                    s.bind(f"tcp://{host}:{port}")
                else:
                    port = s.bind_to_random_port(f"tcp://{host}")
            break
        except zmq.ZMQError:
            for r in out.values():
                r.sock.disable_monitor()
                r.monitor.close()
                r.sock.close()
    else:
        pytest.fail("no port free on every replica address")
    yield port, out
    for r in out.values():
        r.sock.disable_monitor()
        r.monitor.close()
        r.sock.close()
    ctx.term()


def _cfg(http_port: int, proxies: list[str], heartbeat_s: float, resolve_s: float) -> ConnectorConfig:
    extra = {"proxies": proxies, "http_port": http_port, "heartbeat_interval_s": heartbeat_s,
             "proxy_resolve_interval_s": resolve_s}
    return ConnectorConfig.from_vllm(SimpleNamespace(kv_role="kv_producer", kv_port=23001,
                                                     kv_connector_extra_config=extra))


def _wait(pred: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_every_replica_hears_a_new_one_at_once_and_the_leave_goes_to_all_known(http_port, replicas):
    port, rep = replicas
    dns = Dns(answer=IPS[:2])
    # Heartbeats every 30 s: anything within a few seconds is the registrar reacting to DNS.
    reg = Registrar(_cfg(http_port, [f"{NAME}:{port}"], 30.0, 0.3), lambda: Load(1, 0, 0.5), getaddrinfo=dns)
    try:
        for ip in IPS[:2]:
            r = rep[ip].recv(5.0)
            assert r is not None and not r.leave, f"replica {ip} never heard of the instance"
            assert r.http_address == f"127.0.0.1:{http_port}" and r.load == Load(1, 0, 0.5)
        assert reg.replicas == 2
        dns.set(answer=IPS)  # a third proxy pod became ready
        t0 = time.monotonic()
        r = rep[IPS[2]].recv(5.0)
        assert r is not None and not r.leave, "the new replica was not registered with"
        assert time.monotonic() - t0 < 3.0  # about one resolve interval, not the next heartbeat
        assert reg.replicas == 3
        dns.set(answer=IPS[1:])  # .21 is gone
        assert rep[IPS[0]].wait_event(zmq.EVENT_DISCONNECTED, 5.0), "the vanished replica's socket stayed open"
        assert _wait(lambda: reg.replicas == 2, 2.0)
    finally:
        reg.stop()
    assert rep[IPS[0]].drain(0.5) == []  # not even the leave
    for ip in IPS[1:]:
        got = rep[ip].drain(1.0)
        assert got and got[-1].leave, f"replica {ip} got no leave"
    assert reg.replicas == 0


def test_a_vanished_replica_gets_no_more_heartbeats(http_port, replicas):
    port, rep = replicas
    dns = Dns(answer=IPS)
    reg = Registrar(_cfg(http_port, [f"{NAME}:{port}"], 0.1, 0.2), Load, getaddrinfo=dns)
    try:
        for ip in IPS:
            assert len(rep[ip].drain(0.6)) >= 2, f"{ip}: no periodic heartbeats"
        dns.set(answer=IPS[:2])
        assert rep[IPS[2]].wait_event(zmq.EVENT_DISCONNECTED, 5.0)
        rep[IPS[2]].drain(0.2)  # anything sent before the close
        assert rep[IPS[2]].drain(1.0) == []
        assert len(rep[IPS[0]].drain(1.0)) >= 3  # the others still hear every heartbeat
    finally:
        reg.stop()


@pytest.mark.parametrize("failure", [
    {"error": socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")},
    {"answer": ()},  # an empty answer is a failure too, never "forget every replica"
], ids=["error", "empty"])  # fmt: skip
def test_a_failed_resolution_keeps_the_known_replicas_and_says_so_once(http_port, replicas, caplog, failure):
    port, rep = replicas
    dns = Dns(answer=IPS[:2])
    with caplog.at_level(logging.INFO, logger="vllm.xpyd"):
        reg = Registrar(_cfg(http_port, [f"{NAME}:{port}"], 0.1, 0.1), Load, getaddrinfo=dns)
        try:
            assert _wait(lambda: reg.replicas == 2, 5.0)
            dns.set(**failure)
            calls = dns.calls
            for ip in IPS[:2]:
                assert len(rep[ip].drain(1.0)) >= 3, f"{ip} stopped hearing heartbeats"
            assert dns.calls - calls >= 3  # retried every interval...
            assert _warnings(caplog, "re-resolving proxy name") == 1  # ...but said once
            assert reg.replicas == 2
            dns.set(answer=IPS[:2])
            assert _wait(lambda: any("resolves again" in r.getMessage() for r in caplog.records), 5.0)
        finally:
            reg.stop()
    assert rep[IPS[2]].drain(0.2) == []


def test_a_hanging_resolver_does_not_delay_heartbeats_to_known_replicas(http_port, replicas, caplog):
    port, rep = replicas
    dns = Dns(answer=IPS[:1])
    release = threading.Event()
    with caplog.at_level(logging.WARNING, logger="vllm.xpyd"):
        reg = Registrar(_cfg(http_port, [f"{NAME}:{port}"], 0.1, 0.1), Load, getaddrinfo=dns)
        try:
            assert rep[IPS[0]].recv(5.0) is not None
            before = dns.set(answer=IPS, hang=release)  # the next lookup hangs (until released)
            rep[IPS[0]].drain(0.3)
            got = rep[IPS[0]].drain(1.5)
            assert len(got) >= 6, f"heartbeats stalled behind the resolver: {len(got)} in 1.5 s"
            assert dns.calls == before + 1  # one stuck lookup, not one more thread per interval
            assert _wait(lambda: _warnings(caplog, "no answer within") >= 1, 3.0)  # the 1 s deadline
            assert _warnings(caplog, "no answer within") == 1
            assert reg.replicas == 1
            release.set()  # the stuck lookup finally answers: followed, and lookups resume
            assert rep[IPS[1]].recv(5.0) is not None
            assert _wait(lambda: dns.calls >= before + 3, 5.0)
        finally:
            release.set()
            reg.stop()


def test_a_name_that_never_resolves_is_retried_and_logged_while_literals_work(http_port, replicas, caplog):
    port, rep = replicas
    dns = Dns(error=socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    with caplog.at_level(logging.WARNING, logger="vllm.xpyd"):
        # A static list mixing an IPv4 literal, an IPv6 literal and a name.
        reg = Registrar(_cfg(http_port, [f"{IPS[0]}:{port}", f"[::1]:{port}", f"{NAME}:{port}"], 0.1, 0.1),
                        Load, getaddrinfo=dns)
        try:
            assert rep[IPS[0]].recv(5.0) is not None and rep["::1"].recv(5.0) is not None
            assert _wait(lambda: _warnings(caplog, "does not resolve") >= 3, 5.0)
            assert rep[IPS[1]].drain(0.2) == []
            dns.set(answer=IPS[1:2])
            assert rep[IPS[1]].recv(5.0) is not None
            assert _wait(lambda: reg.replicas == 3, 2.0)
        finally:
            reg.stop()


def test_ip_literals_are_never_resolved(http_port, replicas):
    port, rep = replicas
    dns = Dns()
    reg = Registrar(_cfg(http_port, [f"{IPS[0]}:{port}", f"[::1]:{port}"], 0.1, 0.1), Load, getaddrinfo=dns)
    try:
        assert rep[IPS[0]].recv(5.0) is not None and rep["::1"].recv(5.0) is not None
        assert reg.replicas == 2
    finally:
        reg.stop()
    assert dns.calls == 0


def test_a_name_with_ipv4_and_ipv6_addresses_reaches_both(http_port, replicas):
    port, rep = replicas
    dns = Dns(answer=(IPS[2], "::1"))
    reg = Registrar(_cfg(http_port, [f"{NAME}:{port}"], 0.2, 0.2), Load, getaddrinfo=dns)
    try:
        assert rep[IPS[2]].recv(5.0) is not None and rep["::1"].recv(5.0) is not None
    finally:
        reg.stop()


def test_the_real_getaddrinfo_resolves_localhost(http_port, replicas):
    """The product default: socket.getaddrinfo on a name this machine resolves."""
    port, rep = replicas
    addresses = {info[4][0] for info in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)}
    assert addresses and addresses <= {"127.0.0.1", "::1"}, addresses
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)  # the ::1 replica is the fixture's; 127.0.0.1 needs one
    router.setsockopt(zmq.LINGER, 0)
    try:
        router.bind(f"tcp://127.0.0.1:{port}")
    except zmq.ZMQError:
        router.close()
        pytest.skip("127.0.0.1 has the fixture's port in use")
    reg = Registrar(_cfg(http_port, [f"localhost:{port}"], 0.2, 0.5), Load)
    try:
        if "127.0.0.1" in addresses:
            assert router.poll(5000), "nothing reached 127.0.0.1 through localhost"
        if "::1" in addresses:
            assert rep["::1"].recv(5.0) is not None
        assert reg.replicas == len(addresses)
    finally:
        reg.stop()
        router.close()


async def test_two_real_proxies_behind_one_name_both_list_the_instance(http_port):
    """The issue's scenario end to end: two proxy replicas on one port behind one name."""
    import asyncio

    from tests.support.proxy_helpers import running_proxy, wait_until

    port = 0
    for _attempt in range(20):  # bounded: a port free on both addresses
        with socket.socket() as a, socket.socket() as b:
            a.bind((IPS[0], 0))
            try:
                b.bind((IPS[1], a.getsockname()[1]))
            except OSError:
                continue
            port = a.getsockname()[1]
            break
    assert port
    dns = Dns(answer=IPS[:2])
    async with running_proxy(discovery_host=IPS[0], discovery_port=port) as px1, \
            running_proxy(discovery_host=IPS[1], discovery_port=port) as px2:
        reg = Registrar(_cfg(http_port, [f"{NAME}:{port}"], 0.2, 0.2), lambda: Load(1, 2, 0.25),
                        getaddrinfo=dns)
        try:
            for px in (px1, px2):
                await wait_until(lambda px=px: px.registry.count("P") == 1, timeout=10, what="registered")
                [inst] = px.registry.live("P")
                assert inst.http_address == f"127.0.0.1:{http_port}" and inst.load == Load(1, 2, 0.25)
        finally:
            await asyncio.to_thread(reg.stop)
        for px in (px1, px2):
            await wait_until(lambda px=px: px.registry.count("P") == 0, timeout=10, what="leave")


@pytest.mark.parametrize("value", [0, -1, "x", float("nan"), float("inf"), True])
def test_proxy_resolve_interval_must_be_positive_seconds(value):
    extra = {"proxy_resolve_interval_s": value}
    with pytest.raises(ValueError, match="proxy_resolve_interval_s"):
        ConnectorConfig.from_vllm(SimpleNamespace(kv_role="kv_producer", kv_port=1, kv_connector_extra_config=extra))


def test_proxy_resolve_interval_default_and_bad_proxy_addresses():
    def cfg(**extra: Any) -> ConnectorConfig:
        return ConnectorConfig.from_vllm(SimpleNamespace(kv_role="kv_producer", kv_port=1,
                                                         kv_connector_extra_config=extra))

    assert cfg().proxy_resolve_interval_s == 10.0
    assert cfg(proxy_resolve_interval_s="2.5").proxy_resolve_interval_s == 2.5
    assert cfg(proxy_resolve_interval_s=None).proxy_resolve_interval_s == 10.0  # None: unset
    assert cfg(proxies=["proxy:30001", "[::1]:30001"]).proxies == ("proxy:30001", "[::1]:30001")
    for bad in ("proxy", "proxy:", ":30001", "proxy:0", "proxy:http"):
        with pytest.raises(ValueError, match="host:port"):
            cfg(proxies=[bad])

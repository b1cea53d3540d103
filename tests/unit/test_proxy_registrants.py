"""Registrants that lie (issue 36, section 3), on real ZMQ sockets on 127.0.0.1: a heartbeat
for someone else's address, event endpoints on another host or at a listener that drops
every connection, an advertised capacity beyond the flag, batches that would stall the loop,
a message over the size limit, and more instances than one ZMQ context's default sockets."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from proxy.metrics import Metrics
from proxy.registry import RegistrationRefused, Registry
from proxy.routing.kv_events import MAX_MESSAGE_BYTES, EventsConfig, KVEvents
from proxy.routing.kv_index import IndexState
from tests.support.kv_publisher import Publisher, publish_until_applied
from tests.support.proxy_helpers import running_proxy, wait_until
from xpyd_wire.discovery import OutputLimits, ProtocolError, Registration, decode, encode, new_instance_key
from xpyd_wire.kv_events import AllBlocksCleared, BlockStored, EventsEndpoint, chain_block_keys

BS = 16


class Sender:
    """A registrant: its own DEALER to the proxy's discovery port."""

    def __init__(self, discovery_addr: str, secret: str | None = None) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{discovery_addr}")
        self.secret = secret

    async def send(self, reg: Registration) -> None:
        await self._sock.send(encode(reg, self.secret))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def _refused(px, reason: str) -> float:
    return px.state.metrics.discovery_refused.labels("D", reason)._value.get()


# ---------------------------------------------------------------- records bound to their owner


@pytest.mark.parametrize("secret", [None, "s3cret"])
async def test_forged_heartbeat_cannot_rewrite_or_remove_another_instances_record(secret, caplog):
    """Issue 36: a heartbeat for D's http_address set its zmq_address to 127.0.0.1:9 and its
    output_limits.override to 1. With a secret, every engine holds it: no help either."""
    async with running_proxy(discovery_secret=secret, heartbeat_timeout=30) as px:
        d = await px.fake("D", register=False)
        owner, forger = Sender(px.discovery, secret), Sender(px.discovery, secret)
        try:
            key = new_instance_key()
            real = Registration("D", d.http_address, "127.0.0.1:14579", instance_key=key,
                                output_limits=OutputLimits(override=64))
            await owner.send(real)
            await wait_until(lambda: px.registry.live("D"), what="D live")
            forged = Registration("D", d.http_address, "127.0.0.1:9", output_limits=OutputLimits(override=1))
            other_key = Registration("D", d.http_address, "127.0.0.1:9", instance_key=new_instance_key(),
                                     output_limits=OutputLimits(override=1))
            for reg in (forged, other_key):
                await forger.send(reg)
                await forger.send(Registration("D", d.http_address, "127.0.0.1:9", leave=True,
                                               instance_key=reg.instance_key))
            await wait_until(lambda: _refused(px, "conflict") == 4, what="4 conflicts")
            [inst] = px.registry.live("D")
            assert inst.zmq_address == "127.0.0.1:14579" and inst.output_limits == OutputLimits(override=64)
            # The owner still changes its own record, and that is a line of its own.
            with caplog.at_level(logging.WARNING, logger="xpyd.proxy.registry"):
                await owner.send(Registration("D", d.http_address, "127.0.0.1:14580", instance_key=key))
                await wait_until(lambda: inst.zmq_address == "127.0.0.1:14580", what="owner's change")
            assert any("addresses changed by its owner" in r.getMessage() for r in caplog.records)
            await owner.send(Registration("D", d.http_address, "127.0.0.1:14580", instance_key=key, leave=True))
            await wait_until(lambda: not px.registry.every(), what="owner's leave")
        finally:
            owner.close()
            forger.close()


def test_registry_binds_source_and_key_and_hands_over_after_silence():
    reg = Registry(heartbeat_timeout=10)
    key = new_instance_key()
    mine = Registration("D", "10.0.0.5:8200", "10.0.0.5:14579", instance_key=key)
    inst = reg.upsert(mine, now=0.0, source="10.0.0.5")
    # Same key from another host, no key from the same host, another key: all someone else.
    for other, source in ((mine, "10.0.0.6"), (Registration("D", "10.0.0.5:8200", "10.0.0.5:1"), "10.0.0.5"),
                          (Registration("D", "10.0.0.5:8200", "10.0.0.5:1", instance_key=new_instance_key()),
                           "10.0.0.5")):
        with pytest.raises(RegistrationRefused) as e:
            reg.upsert(other, now=1.0, source=source)
        assert e.value.reason == "conflict"
    assert reg.upsert(mine, now=2.0, source="10.0.0.5") is inst and reg.conflicts == 3
    # A restart (new key) takes the address once the old owner is silent for timeout / 2:
    # as a new instance, pending until it answers.
    restarted = Registration("D", "10.0.0.5:8200", "10.0.0.5:14579", instance_key=new_instance_key())
    with pytest.raises(RegistrationRefused):
        reg.upsert(restarted, now=6.9, source="10.0.0.5")
    new = reg.upsert(restarted, now=7.1, source="10.0.0.5")
    assert new is not inst and new.pending and reg.holds(new) and not reg.holds(inst)
    assert reg._per_source == {"10.0.0.5": 1}
    # An old connector (no key) is bound to its source host.
    old = Registration("P", "10.0.0.7:8100", "10.0.0.7:14579")
    reg.upsert(old, now=0.0, source="10.0.0.7")
    with pytest.raises(RegistrationRefused):
        reg.upsert(old, now=1.0, source="10.0.0.8")
    with pytest.raises(RegistrationRefused):
        reg.leave(Registration("P", "10.0.0.7:8100", "10.0.0.7:1", leave=True), now=1.0, source="10.0.0.8")
    assert reg.leave(Registration("P", "10.0.0.7:8100", "10.0.0.7:1", leave=True), now=1.0, source="10.0.0.7")


def test_instance_key_on_the_wire_is_optional_and_checked():
    key = new_instance_key()
    for secret in (None, "s"):
        got = decode(encode(Registration("P", "a:1", "a:2", instance_key=key), secret), secret)
        assert got.instance_key == key
    assert decode(encode(Registration("P", "a:1", "a:2"))).instance_key is None
    for bad in ("", "ABCD" * 8, "0" * 31, "0" * 65, 7, "g" * 32):
        payload = msgpack.packb({"type": "P", "http_address": "a:1", "zmq_address": "a:2", "instance_key": bad})
        with pytest.raises(ProtocolError):
            decode(payload)
    assert "instance_key" not in repr(Registration("P", "a:1", "a:2", instance_key=key))


async def test_registrar_sends_a_key_the_proxy_binds():
    """Both ends: the connector's heartbeats carry one key per start; the proxy binds the
    record to it, and a keyless heartbeat from the same host for that address is refused."""
    import http.server
    from types import SimpleNamespace

    from connector.config import ConnectorConfig
    from connector.registration import Registrar
    from xpyd_wire.discovery import Load

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            return

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    http_port = srv.server_address[1]
    try:
        async with running_proxy(discovery_secret="s3cret") as px:
            port = int(px.discovery.rsplit(":", 1)[1])
            extra = {"proxy_ip": "127.0.0.1", "proxy_port": port, "http_port": http_port,
                     "heartbeat_interval_s": 0.2, "discovery_secret": "s3cret"}
            cfg = ConnectorConfig.from_vllm(SimpleNamespace(kv_role="kv_consumer", kv_port=23001,
                                                            kv_connector_extra_config=extra))
            registrar = Registrar(cfg, lambda: Load())
            forger = Sender(px.discovery, "s3cret")
            try:
                [inst] = await wait_until(lambda: px.registry.live("D"), what="registrar's D live")
                assert inst.key_digest is not None and inst.source == "127.0.0.1"
                await forger.send(Registration("D", inst.http_address, "127.0.0.1:9"))
                await wait_until(lambda: _refused(px, "conflict") == 1, what="forgery refused")
                assert inst.zmq_address == cfg.advertised_address
            finally:
                forger.close()
                await asyncio.to_thread(registrar.stop)
            await wait_until(lambda: not px.registry.every(), what="the registrar's own leave")
    finally:
        srv.shutdown()
        srv.server_close()


# ---------------------------------------------------------------- event endpoints


class Listener:
    """A TCP listener on host:port that accepts and closes every connection, counting them."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


class Events:
    """KVEvents over a Registry on real sockets (no HTTP: instances are admitted directly)."""

    def __init__(self, **cfg) -> None:
        self.registry = Registry(heartbeat_timeout=30)
        self.metrics = Metrics(self.registry)
        self.events = KVEvents(self.registry, self.metrics, EventsConfig(**{
            "probe_s": 0.2, "silence_s": 2.0, "replay_timeout_s": 0.5, "reconcile_s": 0.1, **cfg}))

    def add(self, ep: EventsEndpoint, port: int, source: str | None = "127.0.0.1", host: str = "127.0.0.1"):
        reg = Registration("P", f"{host}:{port}", f"{host}:14579", kv_events=ep)
        inst = self.registry.upsert(reg, source=source)
        self.registry.admit(inst)
        self.events.kick()
        return inst

    def stream(self, inst):
        """inst's stream (None until the reconcile pass opened it)."""
        return next((s for s in self.events.streams() if s.inst is inst), None)

    def failures(self, inst) -> int:
        stream = self.stream(inst)
        return 0 if stream is None else stream.stats.failures

    def metric(self, name, **labels):
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    async def __aenter__(self):
        await self.events.start()
        return self

    async def __aexit__(self, *exc):
        await self.events.stop()


async def test_event_endpoint_is_taken_on_the_registrations_source_host():
    """zmq_address (and so the 'KV host' the endpoints were checked against) is the
    registrant's choice: the proxy connects to the host the registration came from, here
    127.0.0.1, never to the advertised 192.0.2.1 (not this machine's)."""
    near = Listener("127.0.0.1")
    try:
        async with Events() as ev:
            ep = EventsEndpoint(f"tcp://192.0.2.1:{near.port}", f"tcp://192.0.2.1:{near.port}")
            inst = ev.add(ep, 18001, source="127.0.0.1", host="192.0.2.1")
            assert inst.kv_events == EventsEndpoint(f"tcp://127.0.0.1:{near.port}", f"tcp://127.0.0.1:{near.port}")
            await wait_until(lambda: near.accepted >= 1, what="a connection to the source host")
    finally:
        near.close()


def test_event_endpoint_rules_per_source():
    reg = Registry(heartbeat_timeout=10)

    def add(source: str, host: str, port: int = 8000):
        ep = EventsEndpoint(f"tcp://{host}:23001", f"tcp://{host}:23002")
        return reg.upsert(Registration("P", f"{host}:{port}", f"{host}:1", kv_events=ep), source=source).kv_events

    # Another host than the source's: its ports, on the source host.
    assert add("10.0.0.9", "10.0.0.5") == EventsEndpoint("tcp://10.0.0.9:23001", "tcp://10.0.0.9:23002")
    assert add("10.0.0.9", "10.0.0.9", 8001).endpoint == "tcp://10.0.0.9:23001"
    assert add("10.0.0.9", "pub.example", 8002).endpoint == "tcp://10.0.0.9:23001"
    assert add("fd00::9", "10.0.0.5", 8003).endpoint == "tcp://[fd00::9]:23001"
    assert add("::ffff:10.0.0.9", "10.0.0.5", 8004).endpoint == "tcp://10.0.0.9:23001"
    # From this machine (loopback): any address of this machine stands, as in multinode.yaml
    # (an instance bound to 127.0.0.13 heartbeats from 127.0.0.1); others do not.
    assert add("127.0.0.1", "127.0.0.13", 8005).endpoint == "tcp://127.0.0.13:23001"
    assert add("127.0.0.1", "192.0.2.1", 8006).endpoint == "tcp://127.0.0.1:23001"
    # A heartbeat that advertises the same again keeps what was resolved; a change is new.
    inst = reg.upsert(Registration("P", "10.0.0.5:8000", "10.0.0.5:1", kv_events=EventsEndpoint(
        "tcp://10.0.0.5:23001", "tcp://10.0.0.5:23002")), source="10.0.0.9")
    assert inst.kv_events.endpoint == "tcp://10.0.0.9:23001"
    inst = reg.upsert(Registration("P", "10.0.0.5:8000", "10.0.0.5:1", kv_events=EventsEndpoint(
        "tcp://10.0.0.5:24001")), source="10.0.0.9")
    assert inst.kv_events == EventsEndpoint("tcp://10.0.0.9:24001")


async def test_a_listener_that_drops_every_connection_gets_few_of_them():
    """One registration pointing at a listener made 105 connections in 10 s (twenty: 2,136):
    libzmq reconnected every 100 ms and every probe opened a new replay socket."""
    pub_l, replay_l = Listener(), Listener()
    try:
        async with Events(probe_s=2.0, replay_timeout_s=2.0) as ev:
            ev.add(EventsEndpoint(f"tcp://127.0.0.1:{pub_l.port}", f"tcp://127.0.0.1:{replay_l.port}"), 18002)
            await asyncio.sleep(10)
            total = pub_l.accepted + replay_l.accepted
            print(f"connections in 10 s: {pub_l.accepted} to the publisher, {replay_l.accepted} to replay")
            assert 1 <= pub_l.accepted and total <= 16
            assert ev.metric("xpyd_kv_event_reconnects_total", reason="disconnected") >= 1
    finally:
        pub_l.close()
        replay_l.close()


# ---------------------------------------------------------------- memory and CPU


def _chain(first_hash: int, n: int, parent=None) -> BlockStored:
    tokens = tuple((first_hash * BS + k) % 32000 for k in range(n * BS))
    return BlockStored(tuple(range(first_hash, first_hash + n)), parent, tokens, BS, None, "GPU", 0)


async def _publish_until(pub: Publisher, ev: Events, inst, events, timeout=10.0) -> None:
    await publish_until_applied(pub, events, lambda: ev.stream(inst), timeout, first_wait_s=1.0)


async def test_advertised_capacity_cannot_raise_the_index_cap():
    pub = Publisher()
    try:
        async with Events(default_cap=1000) as ev:
            inst = ev.add(EventsEndpoint(pub.endpoint, pub.replay_endpoint, "", 2**32), 18003)
            await wait_until(lambda: ev.events.streams(), what="subscribed")
            assert ev.stream(inst).index.cap == 1000
            await _publish_until(pub, ev, inst, [AllBlocksCleared(), _chain(1, 3000)])
            assert len(ev.stream(inst).index) == 1000 and ev.stream(inst).stats.evicted == 2000
    finally:
        pub.close()


@pytest.mark.timeout(600)  # its waits are sized for a box at load 30
async def test_a_large_batch_never_stalls_the_event_loop():
    """Two 16 MiB batches froze the proxy for 6.0 s: decoding and applying were synchronous.
    Now a payload this size is decoded on a worker thread and applied in steps. Measured as
    the loop thread's own CPU time between two turns of a 2 ms ticker (its wall time between
    turns also counts other processes on a loaded box)."""
    pub = Publisher()
    n = 70_000  # ~3.4 MiB, under the size limit
    stretches: list[float] = []  # loop-thread CPU seconds between two ticks
    walls: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while not stop.is_set():
            await asyncio.sleep(0.002)
            now, cpu = time.perf_counter(), time.thread_time()
            walls.append(now - last)
            stretches.append(cpu - last_cpu)
            last, last_cpu = now, cpu

    try:
        async with Events(default_cap=200_000) as ev:
            inst = ev.add(EventsEndpoint(pub.endpoint, pub.replay_endpoint), 18004)
            await wait_until(lambda: ev.events.state(inst) is IndexState.KNOWN)
            tick = asyncio.get_running_loop().create_task(ticker())
            # 180 s: a 3.4 MiB batch took longer than 60 s to decode and apply at load 30-37 (not the subject).
            await _publish_until(pub, ev, inst, [AllBlocksCleared(), _chain(1, n)], timeout=180)
            stop.set()
            await tick
            assert len(ev.stream(inst).index) == n
            worst = max(stretches)
            print(f"a {n}-block batch: longest loop stretch {worst * 1000:.1f} ms of CPU, "
                  f"worst turn {max(walls) * 1000:.1f} ms of wall time")
            assert worst < 0.1  # one synchronous pass over this batch took ~0.4 s of CPU
    finally:
        pub.close()


async def test_a_message_over_the_limit_is_detected_counted_and_reconnected(caplog):
    """ZMQ drops a connection on a message over MAXMSGSIZE and never reconnects by itself:
    live events stopped for good, with no log, no metric and the index still known."""
    pub = Publisher(replay=False)
    try:
        async with Events() as ev:
            inst = ev.add(EventsEndpoint(pub.endpoint), 18005)
            await wait_until(lambda: ev.events.streams(), what="subscribed")
            await _publish_until(pub, ev, inst, [AllBlocksCleared(), _chain(1, 4)])
            with caplog.at_level(logging.WARNING, logger="xpyd.proxy.kv_events"):
                pub.send_raw([b"", (pub.seq).to_bytes(8, "big"), b"\0" * (32 * 1024 * 1024 + 1)])
                await wait_until(lambda: ev.metric("xpyd_kv_event_reconnects_total", reason="disconnected") >= 1,
                                 timeout=10, what="the dropped connection counted")
            assert any("connection lost" in r.getMessage() for r in caplog.records)
            assert MAX_MESSAGE_BYTES < 32 * 1024 * 1024
            # Live events flow again on the new connection.
            await _publish_until(pub, ev, inst, [_chain(1000, 2, parent=None)])
            keys = chain_block_keys(list(_chain(1000, 2).token_ids), BS)
            assert ev.stream(inst).index.longest_prefix(keys) == 2
    finally:
        pub.close()


# ---------------------------------------------------------------- many instances


@pytest.mark.timeout(600)  # its waits are sized for a box at load 30
async def test_an_instance_joining_after_600_event_publishers_is_followed():
    """Every stream shared one ZMQ context (1,023 sockets) and each held two: the instance
    joining after 600 others' streams failed ('kv events stream failed') and stayed unknown
    forever. The 600 here share one publisher (each still has its own sockets)."""
    crowd, pub = Publisher(), Publisher()
    try:
        async with Events(probe_s=1.0, replay_timeout_s=2.0) as ev:
            ev.registry.max_per_source = 10_000
            crowd_insts = [ev.add(EventsEndpoint(crowd.endpoint, crowd.replay_endpoint), 20000 + i)
                           for i in range(600)]  # fmt: skip
            await wait_until(lambda: sum(ev.events.state(i) is IndexState.KNOWN for i in crowd_insts) >= 500,
                             timeout=180, what="the crowd's streams up")
            inst = ev.add(EventsEndpoint(pub.endpoint, pub.replay_endpoint), 18006)
            await wait_until(lambda: ev.events.state(inst) is IndexState.KNOWN, timeout=120, what="the real one known")
            await _publish_until(pub, ev, inst, [_chain(1, 2)], timeout=20)
            assert sum(ev.failures(i) for i in [*crowd_insts, inst]) == 0
    finally:
        crowd.close()
        pub.close()


async def test_a_failed_stream_is_retried():
    """A stream that fails (here: the context has no socket left for it) is retried with a
    backoff once sockets free up, never left failed for good."""
    pub_a, pub_b = Publisher(), Publisher()
    try:
        async with Events(max_sockets=6, backoff_s=(0.05, 0.4)) as ev:
            a = ev.add(EventsEndpoint(pub_a.endpoint, pub_a.replay_endpoint), 18007)
            await wait_until(lambda: ev.events.state(a) is IndexState.KNOWN, what="a known")
            b = ev.add(EventsEndpoint(pub_b.endpoint, pub_b.replay_endpoint), 18008)
            await wait_until(lambda: ev.failures(b) >= 2, what="b failed, retried, failed")
            assert ev.events.state(b) is IndexState.UNKNOWN
            assert ev.metric("xpyd_kv_event_reconnects_total", reason="failed") >= 2
            ev.registry.remove("P", a.http_address, "test")
            ev.events.kick()
            await wait_until(lambda: ev.events.state(b) is IndexState.KNOWN, timeout=10, what="b known")
    finally:
        pub_a.close()
        pub_b.close()


async def test_a_publisher_that_restarts_on_its_port_is_followed_again():
    """libzmq's own reconnecting is off: the stream itself reconnects when its monitor says
    the connection ended (an engine restart: new sockets on the same port, seq from 0)."""
    from xpyd_wire.kv_events import EventBatch, encode_batch

    pub = Publisher(replay=False)
    endpoint = pub.endpoint
    again: zmq.Socket | None = None
    ctx = zmq.Context()
    try:
        async with Events(backoff_s=(0.05, 0.5)) as ev:
            inst = ev.add(EventsEndpoint(endpoint), 18009)
            await wait_until(lambda: ev.events.streams(), what="subscribed")
            await _publish_until(pub, ev, inst, [AllBlocksCleared(), _chain(1, 4)])
            pub.close()
            again = ctx.socket(zmq.PUB)
            again.setsockopt(zmq.LINGER, 0)
            again.bind(endpoint)
            await wait_until(lambda: ev.stream(inst).stats.reconnects >= 1, timeout=10, what="reconnected")
            deadline = time.monotonic() + 10
            while ev.stream(inst).stats.restarts == 0:  # seq 0 again: the index resets
                again.send_multipart(encode_batch(EventBatch(0, 1.0, (_chain(500, 2),))))
                await asyncio.sleep(0.1)
                assert time.monotonic() < deadline, "the restarted publisher's batch never arrived"
            await wait_until(lambda: len(ev.stream(inst).index) == 2, what="index rebuilt from the new engine")
    finally:
        if again is not None:
            again.close(linger=0)
        ctx.term()

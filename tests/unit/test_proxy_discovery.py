"""Discovery over real ZMQ: registration, load, expiry, re-registration, leave, bad
messages, signed registrations."""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack
import pytest

from tests.support.proxy_helpers import running_proxy, wait_until
from xpyd_wire.discovery import Load, Registration, encode


def _addresses(registry, role):
    return [i.http_address for i in registry.live(role)]


async def test_registration_shows_in_instances_and_ready():
    async with running_proxy(expose_routing_headers=True) as px:  # /instances with addresses
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
        assert by_role["P"]["load"] == {"running": 2, "waiting": 1, "waiting_for_kv": 0, "kv_usage": 0.25,
                                          "kv_buffer_usage": 0.0}
        assert by_role["D"]["http_address"] == d.http_address and by_role["D"]["load"] is None
        for inst in data:
            assert inst["in_flight"] == 0
            assert inst["heartbeat_age_s"] < 5
            assert inst["last_heartbeat"] > 1e9  # unix time
        assert await px.metric("xpyd_instances", role="P") == 1
        assert await px.metric("xpyd_discovery_messages_total", result="accepted") >= 2


async def test_expiry_of_any_instance_and_reregistration():
    # 3 s: the two that keep heartbeating (every 0.1 s) must not lapse on a loaded box.
    async with running_proxy(heartbeat_timeout=3.0) as px:
        fakes = [await px.fake("D", heartbeat_interval=0.1) for _ in range(3)]
        middle = fakes[1]
        middle.stop_heartbeats()  # the middle entry of the table goes quiet
        await wait_until(
            lambda: middle.http_address not in _addresses(px.registry, "D"),
            what="middle instance expired",
        )
        assert _addresses(px.registry, "D") == [fakes[0].http_address, fakes[2].http_address]
        middle.start_heartbeats()  # comes back: registered again
        await wait_until(
            lambda: middle.http_address in _addresses(px.registry, "D"),
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
    "payload,result",
    [
        (b"\xc1 definitely not msgpack", "malformed"),
        (msgpack.packb([1, 2, 3]), "malformed"),
        (msgpack.packb({1: "P", "http_address": "h:1", "zmq_address": "h:2"}), "malformed"),
        (msgpack.packb({"type": "X", "http_address": "h:1", "zmq_address": "h:2"}), "invalid_field"),
        (msgpack.packb({"type": "P", "http_address": "nohost", "zmq_address": "h:2"}), "invalid_field"),
        (msgpack.packb({"type": "P", "zmq_address": "h:2"}), "invalid_field"),
        (
            msgpack.packb(
                {"type": "P", "http_address": "h:1", "zmq_address": "h:2", "load": {"running": -1}}
            ),
            "invalid_field",
        ),
        ([b"", b"", b"too", b"many", b"frames ending in garbage"], "malformed"),
    ],
    ids=["garbage", "list", "int-key", "unknown-type", "bad-address", "missing-field", "bad-load",
         "frames"],
)
async def test_bad_message_dropped_by_reason_then_good_registration(payload, result):
    async with running_proxy() as px:
        p = await px.fake("P", register=False)
        await p.send_raw(payload)
        await wait_until(
            lambda: px.state.metrics.discovery.labels(result)._value.get() == 1,
            what=f"{result} counted",
        )
        assert px.registry.count("P") == 0
        await p.send_registration()  # discovery is still alive and accepts the next one
        await wait_until(lambda: px.registry.count("P") == 1, what="good registration")
        assert await px.metric("xpyd_discovery_messages_total", result=result) == 1
        others = {"malformed", "invalid_field", "unauthorized", "replayed"} - {result}
        for other in others:
            assert await px.metric("xpyd_discovery_messages_total", result=other) == 0


async def test_upstream_unsigned_format_registers_without_a_secret():
    """vLLM's own example sends exactly these three fields, unsigned: still accepted."""
    async with running_proxy() as px:
        p = await px.fake("P", register=False)
        await p.send_raw(msgpack.packb(
            {"type": "P", "http_address": p.http_address, "zmq_address": "127.0.0.1:21001"}
        ))  # fmt: skip
        await wait_until(lambda: px.registry.count("P") == 1, what="upstream registration")
        assert px.registry.live("P")[0].zmq_address == "127.0.0.1:21001"


async def test_crlf_registration_is_dropped_and_requests_still_answered():
    """The registration from issue 10: a zmq_address with CR/LF and a header in it. Dropped and
    counted; the instance it names never gets traffic; the header reaches no upstream; every
    client request is answered 200 by the good instances."""
    async with running_proxy(expose_routing_headers=True) as px:  # /instances with addresses
        p, d = await px.pd()
        victim = await px.fake("P", register=False)  # a real server the registration names
        crlf = {"type": "P", "http_address": victim.http_address,
                "zmq_address": "127.0.0.1:1\r\nX-Injected: yes\r\nA:1"}  # fmt: skip
        await victim.send_raw(msgpack.packb(crlf))
        await wait_until(
            lambda: px.state.metrics.discovery.labels("invalid_field")._value.get() == 1,
            what="CRLF registration counted",
        )
        assert [i.http_address for i in px.registry.every()] == [p.http_address, d.http_address]
        body = {"model": "fake-model", "prompt": "Hello", "max_tokens": 3}
        for _ in range(4):  # round robin would have picked the victim at least once
            resp = await px.client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"]
        assert len(p.completions()) == 4 and len(d.completions()) == 4
        assert not victim.requests
        for fake in (p, d, victim):
            for rec in fake.requests:
                for name, value in rec.headers.items():
                    assert "injected" not in name.lower() and "injected" not in value.lower()
                    assert "\r" not in value and "\n" not in value
        data = (await px.client.get("/instances")).json()
        assert all("\r" not in i["zmq_address"] for i in data)


async def test_flood_of_bad_messages_is_counted_but_logged_a_bounded_number_of_times(caplog):
    from proxy.membership.discovery import LOG_BURST

    n = 300
    async with running_proxy() as px:
        p = await px.fake("P", register=False)
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.discovery"):
            for i in range(n):
                await p.send_raw(msgpack.packb({"type": "P", "http_address": f"bad host:{i}"}))
            # Each counted once: judged, or dropped undecoded past the source's rate (200/s).
            counted = px.state.metrics.discovery.labels
            await wait_until(
                lambda: counted("invalid_field")._value.get() + counted("rate_limited")._value.get() == n,
                what="every bad message counted",
            )
        dropped = [r for r in caplog.records if "discovery message dropped" in r.getMessage()]
        assert 1 <= len(dropped) <= LOG_BURST
        # Heartbeats go on (the flood's source may be over its rate for the rest of the second).
        async def registered() -> bool:
            await p.send_registration()
            await asyncio.sleep(0.2)
            return px.registry.count("P") == 1

        deadline = time.monotonic() + 10
        while not await registered():
            assert time.monotonic() < deadline, "registration after flood"


def test_log_limiter_bounds_each_window_and_reports_what_it_suppressed():
    from proxy.membership.discovery import LogLimiter

    lim = LogLimiter(burst=3, window_s=10.0)
    assert [lim.allow(100.0 + i * 0.01) for i in range(1000)].count(True) == 3
    assert lim.take_suppressed() == 997 and lim.take_suppressed() == 0
    assert not lim.allow(109.0)  # same window
    assert lim.allow(110.5)  # a new window: allowed again, and says how many it dropped
    assert lim.take_suppressed() == 1


async def test_many_bad_messages_never_stop_discovery():
    async with running_proxy() as px:
        p = await px.fake("P", register=False)
        for i in range(150):  # within its source's rate (200/s): every one is judged
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


def _count(px, result: str) -> float:
    return px.state.metrics.discovery.labels(result)._value.get()


async def test_replayed_signed_leave_does_not_remove_the_instance():
    async with running_proxy(discovery_secret="k") as px:
        p = await px.fake("P", secret="k", heartbeat_interval=0.1)
        wire = await px.fake("P", register=False)  # an attacker who captured the leave
        leave = encode(p.registration(leave=True), "k")
        p.stop_heartbeats()
        await wire.send_raw(leave)  # the genuine leave
        await wait_until(lambda: px.registry.count("P") == 0, what="leave")
        p.start_heartbeats()  # the instance comes back
        await wait_until(lambda: px.registry.count("P") == 1, what="back")
        p.stop_heartbeats()  # so nothing but the replay could change the table now
        await wire.send_raw(leave)
        await wait_until(lambda: _count(px, "replayed") == 1, what="replay counted")
        assert _addresses(px.registry, "P") == [p.http_address]
        assert _count(px, "left") == 1


async def test_replayed_signed_heartbeat_is_dropped():
    async with running_proxy(discovery_secret="k") as px:
        p = await px.fake("P", register=False, secret="k")
        heartbeat = encode(p.registration(), "k")
        await p.send_raw(heartbeat)
        await wait_until(lambda: px.registry.count("P") == 1, what="registered")
        await p.send_registration(leave=True)  # a fresh leave: gone
        await wait_until(lambda: px.registry.count("P") == 0, what="left")
        await p.send_raw(heartbeat)  # the captured heartbeat would bring it back
        await wait_until(lambda: _count(px, "replayed") == 1, what="replay counted")
        assert px.registry.count("P") == 0 and _count(px, "accepted") == 1
        await p.send_registration()  # a fresh heartbeat (new nonce) still registers
        await wait_until(lambda: px.registry.count("P") == 1, what="fresh heartbeat")


# ---------------------------------------------------------------- the protocol's rules (unit)


_ABSENT = object()


def _msg(**fields):
    base = {"type": "P", "http_address": "127.0.0.1:8100", "zmq_address": "127.0.0.1:21001"}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not _ABSENT}, use_bin_type=True)


@pytest.mark.parametrize("address", [
    "127.0.0.1:8000", "localhost:1", "h:65535", "[::1]:8000", "[::ffff:1.2.3.4]:9",
    "[2001:db8::7]:21001", "a-b.example.com:80", "node07.cluster.local:8100", "0x7f.example:1",
    "x" * 63 + ".com:1", ".".join(["a" * 63] * 3) + "." + "b" * 61 + ":65535",  # 253 chars
])  # fmt: skip
def test_valid_addresses(address):
    from xpyd_wire.discovery import decode

    assert decode(_msg(http_address=address, zmq_address=address)).zmq_address == address


@pytest.mark.parametrize("address", [
    "127.0.0.1:1\r\nX-Injected: yes\r\nA:1", "127.0.0.1:1\n", "127.0.0.1:1\x00", "h\t:1",
    " 127.0.0.1:80", "127.0.0.1: 80", "127.0.0.1:80 ", "user@host:80", "u:p@host:80",
    "host/path:80", "http://h:80", "host%2f:80", "[fe80::1%eth0]:80", "::1:80", "[::1]80",
    "[::1:80", "[]:80", "[zz::1]:80", "[::1.2.3.4.5]:80", "127.0.0.1:0", "127.0.0.1:65536",
    "127.0.0.1:99999999", "127.0.0.1:080", "127.0.0.1:+80", "127.0.0.1:-1", "127.0.0.1:８０",
    "127.0.0.1:٨٠", "127.0.0.1:", ":80", "h", "", "999.1.1.1:80", "1.2.3:80", "01.2.3.4:80",
    "1.2.3.4.5:80", "-a.com:80", "a-.com:80", "a..b:80", "a.:80", ".a:80", "a_b:80", "ä.com:80",
    "é:80", "a" * 64 + ".com:80", ".".join(["a" * 63] * 4) + ":80", "h:1:2", "h;x:1", "h,x:1",
])  # fmt: skip
def test_invalid_addresses_are_protocol_errors(address):
    from xpyd_wire.discovery import INVALID_FIELD, ProtocolError, decode

    for name in ("http_address", "zmq_address"):
        with pytest.raises(ProtocolError) as e:
            decode(_msg(**{name: address}))
        assert e.value.reason == INVALID_FIELD


@pytest.mark.parametrize("fields", [
    {"type": "p"}, {"type": b"P"}, {"type": ["P"]}, {"type": None}, {"http_address": b"h:1"},
    {"zmq_address": 80}, {"zmq_address": _ABSENT}, {"leave": 1}, {"leave": "true"},
    {"ts": "now"}, {"ts": True}, {"ts": float("nan")}, {"ts": float("inf")},
    {"ts": msgpack.Timestamp(1)}, {"nonce": "XYZ"}, {"nonce": 5}, {"nonce": "ab"},
    {"load": [1]}, {"load": {"running": True}}, {"load": {"running": -1}},
    {"load": {"running": 10**8}}, {"load": {"running": 2**64 - 1}}, {"load": {"waiting": 1.5}},
    {"load": {"waiting": "3"}}, {"load": {"kv_usage": float("nan")}},
    {"load": {"kv_usage": float("inf")}}, {"load": {"kv_usage": 1.01}},
    {"load": {"kv_buffer_usage": -0.1}}, {"load": {"kv_usage": False}},
    {"load": {"kv_usage": "0.5"}}, {"load": {f"k{i}": 0 for i in range(48)}},
    {"load": {"waiting": 1, "waiting_for_kv": 2}}, {"load": {"waiting_for_kv": -1}},
    {"type": msgpack.ExtType(1, b"P")},
    {"kv_transport_fallbacks": -1}, {"kv_transport_fallbacks": 1.5}, {"kv_transport_fallbacks": True},
    {"kv_transport_fallbacks": 10**8},
    {"output_limits": [1]}, {"output_limits": {"default": 0}}, {"output_limits": {"override": -3}},
    {"output_limits": {"default": 1.5}}, {"output_limits": {"default": True}}, {"output_limits": {"default": 2**31}},
    {"output_limits": {"default": "16"}}, {"output_limits": {"other": 1}}, {"output_limits": {"context": 0}},
])  # fmt: skip
def test_invalid_fields_are_protocol_errors(fields):
    from xpyd_wire.discovery import INVALID_FIELD, ProtocolError, decode

    with pytest.raises(ProtocolError) as e:
        decode(_msg(**fields))
    assert e.value.reason == INVALID_FIELD


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"\x81", b"\xa2\xff\xfe", msgpack.packb("P"), msgpack.packb(None),
    msgpack.packb({1: 2}), msgpack.packb({b"type": "P"}), msgpack.packb({"x" * 65: 1}),
    msgpack.packb({f"f{i}": i for i in range(100)}),
    b"\x91" * 5000 + b"\xc0", msgpack.packb({"type": "P", "pad": "x" * 70_000}),
    msgpack.packb(msgpack.ExtType(3, b"xx")), _msg() + b"\xc0",
])  # fmt: skip
def test_malformed_messages_are_protocol_errors(payload):
    from xpyd_wire.discovery import MALFORMED, ProtocolError, decode

    with pytest.raises(ProtocolError) as e:
        decode(payload)
    assert e.value.reason == MALFORMED


def test_unknown_fields_are_tolerated_within_bounds_and_not_kept():
    from dataclasses import fields

    from xpyd_wire.discovery import Registration, decode

    reg = decode(_msg(version=2, note="x" * 1000, more=list(range(48))))
    assert reg.role == "P" and "note" not in repr(reg) and "extra" not in {f.name for f in fields(Registration)}


def test_load_accepts_its_full_range():
    from xpyd_wire.discovery import MAX_LOAD_COUNT, decode

    load = {"running": MAX_LOAD_COUNT, "waiting": 0, "kv_usage": 1, "kv_buffer_usage": 0.0}
    assert decode(_msg(load=load)).load == Load(MAX_LOAD_COUNT, 0, 1.0, 0.0)


def _signed(secret="k", **fields):
    from xpyd_wire.discovery import sign

    body = {"type": "P", "http_address": "127.0.0.1:8100", "zmq_address": "127.0.0.1:21001",
            "ts": time.time(), "nonce": "0" * 32}  # fmt: skip
    body.update(fields)
    body = {k: v for k, v in body.items() if v is not _ABSENT}
    if "hmac" not in body:
        body["hmac"] = sign(body, secret)
    return body


@pytest.mark.parametrize("hmac", [
    "é" * 64, "\u0660" * 64, "0" * 63, "0" * 65, "G" * 64, b"0" * 64, 5, None, [], {"a": 1},
    "A" * 64,
])  # fmt: skip
def test_malformed_or_non_ascii_hmac_is_unauthorized_never_an_exception(hmac):
    from xpyd_wire.discovery import UNAUTHORIZED, ProtocolError, decode

    with pytest.raises(ProtocolError) as e:
        decode(msgpack.packb(_signed(hmac=hmac)), secret="k")
    assert e.value.reason == UNAUTHORIZED


@pytest.mark.parametrize("change,reason", [
    ({}, None),
    ({"nonce": _ABSENT}, "unauthorized"),  # an old sender's signed message: no replay protection
    ({"ts": _ABSENT}, "unauthorized"),
    ({"ts": 1.0}, "unauthorized"),
    ({"ts": time.time() + 3600}, "unauthorized"),
    ({"ts": float("nan")}, "invalid_field"),
    ({"nonce": "xyz"}, "invalid_field"),  # signed with a bad nonce: still refused
    ({"zmq_address": "127.0.0.1:1\r\nX: y"}, "invalid_field"),  # signed is not trusted blindly
])
def test_signed_message_rules(change, reason):
    from xpyd_wire.discovery import ProtocolError, decode

    data = msgpack.packb(_signed(**change))
    if reason is None:
        assert decode(data, secret="k").nonce == "0" * 32
        return
    with pytest.raises(ProtocolError) as e:
        decode(data, secret="k")
    assert e.value.reason == reason


def test_tampered_signed_message_is_unauthorized():
    from xpyd_wire.discovery import ProtocolError, decode

    body = _signed()
    body["zmq_address"] = "127.0.0.1:21002"  # after signing
    with pytest.raises(ProtocolError) as e:
        decode(msgpack.packb(body), secret="k")
    assert e.value.reason == "unauthorized"
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(_signed()), secret="other")


def test_encode_signs_with_a_fresh_nonce_and_stays_upstream_plain_without_a_secret():
    from xpyd_wire.discovery import decode

    reg = Registration("D", "127.0.0.1:8200", "127.0.0.1:22001", load=Load(1, 2, 0.5, 0.25))
    a, b = decode(encode(reg, "k"), secret="k"), decode(encode(reg, "k"), secret="k")
    assert a.nonce and b.nonce and a.nonce != b.nonce and len(a.nonce) == 32
    assert a.load == reg.load
    plain = msgpack.unpackb(encode(Registration("P", "h:1", "h:2")))
    assert plain == {"type": "P", "http_address": "h:1", "zmq_address": "h:2"}


def test_replay_guard_remembers_within_the_window_and_forgets_after():
    from xpyd_wire.discovery import ReplayGuard

    guard = ReplayGuard(window_s=30.0, max_entries=1000)
    assert guard.check("a" * 32, ts=100.0, now=100.0) is None
    assert guard.check("a" * 32, ts=100.0, now=129.0) == "nonce seen before"
    assert guard.check("b" * 32, ts=125.0, now=129.0) is None
    assert len(guard) == 2
    guard.check("c" * 32, ts=131.0, now=131.0)  # a's ts left the window: forgotten
    assert len(guard) == 2 and guard.check("b" * 32, ts=125.0, now=154.0) == "nonce seen before"
    for i in range(500):  # memory follows the message rate, not the history
        guard.check(f"{i:032x}", ts=1000.0 + i * 0.1, now=1000.0 + i * 0.1)
    assert len(guard) <= 301


def test_replay_guard_refuses_new_nonces_when_full():
    from xpyd_wire.discovery import ReplayGuard

    guard = ReplayGuard(window_s=30.0, max_entries=3)
    assert [guard.check(n * 32, ts=0.0, now=0.0) for n in "abc"] == [None] * 3
    assert "full" in guard.check("d" * 32, ts=0.0, now=1.0)
    assert guard.check("a" * 32, ts=0.0, now=1.0) == "nonce seen before"  # not forgotten
    assert guard.check("d" * 32, ts=40.0, now=40.0) is None  # the window moved on


def test_handle_message_counts_each_drop_reason_once():
    from proxy.membership.discovery import RESULTS, Discovery
    from proxy.metrics import Metrics
    from proxy.registry import Registry

    registry = Registry(heartbeat_timeout=10)
    disc = Discovery(registry, Metrics(registry), "127.0.0.1", 0, secret="k")
    now = time.time()
    good = encode(Registration("P", "127.0.0.1:8100", "127.0.0.1:21001", ts=now), "k")
    for payload in [b"\xc1", _msg(type="X"), _msg(), good, good]:
        disc.handle_message(payload, now=now)
    counts = {r: disc._counters[r]._value.get() for r in RESULTS}
    assert counts == {"accepted": 1, "left": 0, "refused": 0, "rate_limited": 0, "malformed": 1,
                      "invalid_field": 0, "unauthorized": 2, "replayed": 1}  # fmt: skip
    assert registry.count_pending("P") == 1  # a candidate once it answers (no prober here)


def test_output_limits_round_trip():
    """Absent: not known (the upstream format); an empty map: no cap but the context."""
    from xpyd_wire.discovery import OutputLimits, decode

    base = Registration("D", "127.0.0.1:1", "127.0.0.1:2")
    assert "output_limits" not in msgpack.unpackb(encode(base)) and decode(encode(base)).output_limits is None
    for limits in (OutputLimits(), OutputLimits(default=512), OutputLimits(override=7), OutputLimits(64, 32, 8192)):
        wire = encode(Registration("D", "127.0.0.1:1", "127.0.0.1:2", output_limits=limits))
        assert decode(wire).output_limits == limits
        assert None not in msgpack.unpackb(wire)["output_limits"].values()
    assert decode(_msg(output_limits={"default": None})).output_limits == OutputLimits()


async def test_transport_fallbacks_reach_instances():
    """An instance's heartbeat says how often its KV left NCCL for tcp: /instances shows
    it (in the address-free view too); 0 is not sent at all (the upstream format)."""
    from xpyd_wire.discovery import decode

    assert "kv_transport_fallbacks" not in msgpack.unpackb(encode(Registration("P", "127.0.0.1:1", "127.0.0.1:2")))
    assert decode(encode(Registration("P", "127.0.0.1:1", "127.0.0.1:2", kv_transport_fallbacks=3))) \
        .kv_transport_fallbacks == 3
    async with running_proxy() as px:
        p = await px.fake("P")
        await px.fake("D")

        async def shown() -> list[int]:
            return [i["kv_transport_fallbacks"] for i in (await px.client.get("/instances")).json() if i["role"] == "P"]

        assert await shown() == [0]
        # Its own heartbeats (fallbacks 0) stopped first: one could overwrite the 2 before it is seen.
        p.stop_heartbeats()
        await p.send_raw(encode(Registration("P", p.http_address, p.zmq_address, kv_transport_fallbacks=2)))
        await wait_until(lambda: px.registry.live("P")[0].kv_transport_fallbacks == 2, what="fallbacks")
        assert await shown() == [2]


# ---------------------------------------------------------------- wire rules, exactly


@pytest.mark.parametrize("limits, requested, allowed", [
    ((None, None), None, None),  # nothing caps it but the context
    ((None, None), 100, 100),
    ((50, None), None, 50),  # the generation config's default applies when the request sets none
    ((50, None), 100, 100),  # ... and only then
    ((None, 30), 100, 30),  # the override caps what is asked
    ((None, 30), 10, 10),
    ((None, 30), None, 30),
    ((50, 30), None, 30),
])
def test_output_limits_is_the_least_cap(limits, requested, allowed):
    from xpyd_wire.discovery import OutputLimits

    assert OutputLimits(*limits).limit(requested) == allowed


def test_kv_events_must_be_on_the_kv_host():
    from xpyd_wire.discovery import ProtocolError, decode

    v6 = decode(_msg(zmq_address="[::1]:21001", kv_events={"endpoint": "tcp://[::1]:5557",
                                                           "replay_endpoint": "tcp://[::1]:5558"}))
    assert v6.kv_events.replay_endpoint == "tcp://[::1]:5558"  # the host is all but the port
    with pytest.raises(ProtocolError, match=r"^kv_events: 'tcp://10\.0\.0\.9:5558' is not on the KV host "
                                            r"'127\.0\.0\.1'$"):
        decode(_msg(kv_events={"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://10.0.0.9:5558"}))
    with pytest.raises(ProtocolError, match="^kv_events: 'tcp://10.0.0.9:5557' is not on the KV host"):
        decode(_msg(kv_events={"endpoint": "tcp://10.0.0.9:5557"}))


@pytest.mark.parametrize("change, why", [
    ({"hmac": None}, "unsigned message (http_address='127.0.0.1:8100')"),
    ({"hmac": "zz"}, "malformed hmac (http_address='127.0.0.1:8100')"),
    ({"hmac": "0" * 64}, "bad signature (http_address='127.0.0.1:8100')"),
    # the sender as the message says it, bounded: it is not validated before the signature
    ({"hmac": None, "http_address": "h" * 100}, "unsigned message (http_address='" + "h" * 59 + "...)"),
])
def test_signed_message_refusals_name_the_sender(change, why):
    """What the proxy logs for a refused registration: which sender, and why."""
    import re

    from xpyd_wire.discovery import UNAUTHORIZED, ProtocolError, decode

    body = _signed(**change)
    if body["hmac"] is None:
        del body["hmac"]
    with pytest.raises(ProtocolError, match=f"^{re.escape(why)}$") as e:
        decode(msgpack.packb(body), secret="k")
    assert e.value.reason == UNAUTHORIZED


def test_replay_guard_remembers_a_nonce_until_its_window_ends_inclusive():
    from xpyd_wire.discovery import ReplayGuard

    guard = ReplayGuard(window_s=30.0, max_entries=10)
    assert guard.check("a" * 32, ts=100.0, now=100.0) is None
    assert guard.check("a" * 32, ts=100.0, now=130.0) == "nonce seen before"  # ts + window: still inside
    assert guard.check("b" * 32, ts=130.5, now=130.5) is None and len(guard) == 1  # "a" forgotten after


@pytest.mark.parametrize("fields, why", [
    ({"type": "X"}, "unknown type 'X'"),
    ({"load": [1]}, "load must be a map"),
    ({"load": {"running": "1"}}, "load.running must be an integer 0..10000000, got '1'"),
    ({"load": {"waiting": 10_000_001}}, "load.waiting must be an integer 0..10000000, got 10000001"),
    ({"load": {"kv_usage": 1.5}}, "load.kv_usage must be a number 0..1, got 1.5"),
    ({"leave": "yes"}, "leave must be a boolean, got 'yes'"),
    ({"kv_transport_fallbacks": -1}, "kv_transport_fallbacks must be an int 0..10000000, got -1"),
    ({"output_limits": {"default": 0}}, "output_limits.default must be an int 1..2147483647, got 0"),
    ({"generation": {"reasoning_parser": 1}}, "generation.reasoning_parser must be a boolean, got 1"),
    ({"zmq_address": 5}, "zmq_address must be a 'host:port' string, got int"),
    ({"zmq_address": "h:0"}, "zmq_address 'h:0': port must be 1..65535"),
    ({"zmq_address": "a_b:1"}, "zmq_address 'a_b:1': host must be a DNS name, an IPv4 or a [IPv6] literal"),
    # a value in a message is shown as its repr, cut at 80 characters
    ({"leave": "x" * 100}, "leave must be a boolean, got '" + "x" * 79 + "..."),
    ({"leave": "x" * 78}, "leave must be a boolean, got '" + "x" * 78 + "'"),  # 80 exactly: whole
])
def test_invalid_field_refusals_say_which_field_and_value(fields, why):
    """The proxy logs this reason for a dropped registration (the operator's only clue)."""
    import re

    from xpyd_wire.discovery import INVALID_FIELD, ProtocolError, decode

    with pytest.raises(ProtocolError, match=f"^{re.escape(why)}$") as e:
        decode(_msg(**fields))
    assert e.value.reason == INVALID_FIELD


def test_instance_key_is_16_random_bytes_in_hex():
    from xpyd_wire.discovery import INSTANCE_KEY_BYTES, new_instance_key

    keys = {new_instance_key() for _ in range(64)}
    assert len(keys) == 64 and INSTANCE_KEY_BYTES == 16
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)


def test_every_registration_field_survives_a_signed_round_trip():
    """What a connector advertises (load, limits, generation defaults, events, fallbacks, key,
    leave) is what the proxy reads, field by field."""
    from xpyd_wire.discovery import GenerationDefaults, OutputLimits, decode, new_instance_key
    from xpyd_wire.kv_events import EventsEndpoint

    reg = Registration(
        "D", "127.0.0.1:8200", "127.0.0.1:22001", load=Load(3, 4, 0.5, 0.25), leave=True, ts=time.time(),
        kv_transport_fallbacks=2, kv_events=EventsEndpoint("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "t", 64),
        output_limits=OutputLimits(default=None, override=7, context=4096),
        generation=GenerationDefaults((("temperature", 0.6), ("top_p", 0.9)), reasoning_parser=True),
        instance_key=new_instance_key(),
    )
    back = decode(encode(reg, "k"), secret="k")
    assert back == Registration(**{**{f: getattr(reg, f) for f in reg.__dataclass_fields__},
                                   "nonce": back.nonce})
    assert reg.generation.to_wire() == {"sampling": {"temperature": 0.6, "top_p": 0.9}, "reasoning_parser": True}
    wire = msgpack.unpackb(encode(reg))
    assert wire["output_limits"] == {"override": 7, "context": 4096}  # None values stay off the wire


def test_load_fields_default_to_idle_and_are_bounded_in_number():
    from xpyd_wire.discovery import MAX_FIELDS, ProtocolError, decode

    assert decode(_msg(load={})).load == Load(0, 0, 0.0, 0.0)  # an older sender's partial load
    assert decode(_msg(load={"kv_usage": 0.5})).load == Load(0, 0, 0.5, 0.0)
    extra = {f"x{i}": 0 for i in range(MAX_FIELDS - 1)}
    assert decode(_msg(load={"running": 1, **extra})).load.running == 1  # MAX_FIELDS fields: fine
    with pytest.raises(ProtocolError, match="^load has too many fields$"):
        decode(_msg(load={"running": 1, "waiting": 0, **extra}))


@pytest.mark.parametrize("data, why", [
    ("text", "payload must be bytes, got str"),
    (b"\x00" * (64 * 1024 + 1), "message of 65537 bytes > 65536"),
    (b"\xc1", "not msgpack: FormatError"),
    (msgpack.packb({1: "a"}), "not msgpack: ValueError"),  # only string keys
    (msgpack.packb([1]), "message is a list, not a map"),
    (msgpack.packb({f"k{i}": 0 for i in range(25)}), "message has 25 fields > 24"),
    # Unknown fields are bounded while decoding: a long value or a large map or array is refused
    # before it is built (a 64 KiB message of them made ~50,000 objects, and was kept).
    (_msg(note="x" * 1025), "a value over the decoding bounds: 1025 exceeds max_str_len(1024)"),
    (_msg(note=b"x" * 1025), "a value over the decoding bounds: 1025 exceeds max_bin_len(1024)"),
    (_msg(note=list(range(49))), "a value over the decoding bounds: 49 exceeds max_array_len(48)"),
    (_msg(load={f"k{i}": 0 for i in range(49)}), "a value over the decoding bounds: 49 exceeds max_map_len(48)"),
    (msgpack.packb({"k" * 65: 0}), "field name '" + "k" * 39 + "... is not a short string"),
])
def test_malformed_messages_say_why(data, why):
    import re

    from xpyd_wire.discovery import MALFORMED, ProtocolError, decode

    with pytest.raises(ProtocolError, match=f"^{re.escape(why)}$") as e:
        decode(data)
    assert e.value.reason == MALFORMED


def test_message_size_and_field_limits_accept_their_maximum():
    from xpyd_wire.discovery import decode

    base = msgpack.unpackb(_msg())
    fields = {**base, **{f"x{i}": 0 for i in range(24 - len(base))}}
    assert decode(msgpack.packb(fields)).role == "P"  # 24 fields
    assert decode(_msg(**{"k" * 64: 1})).role == "P"  # the longest field name
    # 64 KiB: unknown fields of 48 strings of up to 1 KiB each (the decoding bounds).
    big = {"p": ["x" * 1024] * 48, "q": ["x" * 1024] * 15}
    pad = 64 * 1024 - len(_msg(**big, r=""))
    for extra in range(-6, 1):
        data = _msg(**big, r="x" * (pad + extra))
        if len(data) == 64 * 1024:
            assert decode(data).http_address == "127.0.0.1:8100"
            break
    else:
        raise AssertionError("no message of exactly 64 KiB")


@pytest.mark.parametrize("value, ok", [
    ({"default": 1}, True), ({"override": 2**31 - 1}, True), ({"default": 2**31}, False), ({"context": 0}, False),
    ({"default": True}, False), ({"other": 1}, False), ([1], False),
])
def test_output_limits_bounds(value, ok):
    from xpyd_wire.discovery import ProtocolError, check_output_limits

    if ok:
        assert check_output_limits(value) is not None
    else:
        with pytest.raises(ProtocolError):
            check_output_limits(value)


@pytest.mark.parametrize("value, ok", [
    ({"sampling": {f"a{'b' * i}": 1.0 for i in range(16)}}, True),  # MAX_SAMPLING_DEFAULTS entries
    ({"sampling": {f"a{'b' * i}": 1.0 for i in range(17)}}, False),
    ({"sampling": {"temperature": float("inf")}}, False), ({"sampling": {"Temp": 1.0}}, False),
    ({"sampling": {"temperature": "1"}}, False), ({"sampling": {3: 1.0}}, False), ({"sampling": [1]}, False),
    ({"reasoning_parser": True}, True), ({"other": True}, False), ("x", False), ([], False),
])
def test_generation_bounds(value, ok):
    from xpyd_wire.discovery import ProtocolError, check_generation

    if ok:
        assert check_generation(value) is not None
    else:
        with pytest.raises(ProtocolError):
            check_generation(value)


def test_generation_messages_and_defaults():
    import re

    from xpyd_wire.discovery import GenerationDefaults, ProtocolError, check_generation

    assert check_generation({}) == GenerationDefaults((), False, None)  # reasoning_parser absent: False
    with pytest.raises(ProtocolError, match="^generation must be a map of sampling, reasoning_parser$"):
        check_generation({"x": 1})
    with pytest.raises(ProtocolError, match="^generation.sampling must be a map of at most 16 entries$"):
        check_generation({"sampling": [1]})
    with pytest.raises(ProtocolError, match=re.escape("generation.sampling has an invalid entry 'top_p': 'x'")):
        check_generation({"sampling": {"top_p": "x"}})
    with pytest.raises(ProtocolError, match=re.escape("output_limits must be a map of default, override, context")):
        from xpyd_wire.discovery import check_output_limits

        check_output_limits({"x": 1})


def test_clock_skew_limit_both_sides_and_ts_refusals():
    import re

    from xpyd_wire.discovery import UNAUTHORIZED, ProtocolError, decode

    now = 1_000_000.0
    assert decode(msgpack.packb(_signed(ts=now - 30.0)), secret="k", now=now).ts == now - 30.0
    stale = re.escape("stale or future ts (+30.5s, http_address='127.0.0.1:8100')")
    with pytest.raises(ProtocolError, match=stale) as e:
        decode(msgpack.packb(_signed(ts=now - 30.5)), secret="k", now=now)
    assert e.value.reason == UNAUTHORIZED
    with pytest.raises(ProtocolError, match="^signed message without ts"):
        decode(msgpack.packb(_signed(ts=_ABSENT)), secret="k", now=now)
    with pytest.raises(ProtocolError, match="^signed message without nonce"):
        decode(msgpack.packb(_signed(ts=now, nonce=_ABSENT)), secret="k", now=now)
    with pytest.raises(ProtocolError, match="^ts must be a finite number$"):
        decode(_msg(ts="1"))


@pytest.mark.parametrize("address", ["", "h" * 257 + ":80"])  # 0 and 260 characters
def test_address_length_refusal_names_the_field(address):
    from xpyd_wire.discovery import ProtocolError, decode

    with pytest.raises(ProtocolError, match="^http_address must be 1..259 characters$"):
        decode(_msg(http_address=address))
    with pytest.raises(ProtocolError, match="^zmq_address must be 1..259 characters$"):
        decode(_msg(zmq_address=address))


@pytest.mark.parametrize("fields, why", [
    ({"nonce": "XYZ"}, "nonce must be 16..64 lowercase hex digits"),
    ({"instance_key": 5}, "instance_key must be 32..64 lowercase hex digits"),
    ({"instance_key": "G" * 32}, "instance_key must be 32..64 lowercase hex digits"),
    ({"kv_transport_fallbacks": 10_000_001}, "kv_transport_fallbacks must be an int 0..10000000, got 10000001"),
])
def test_identity_field_refusals(fields, why):
    from xpyd_wire.discovery import ProtocolError, decode

    with pytest.raises(ProtocolError, match=f"^{why}$"):
        decode(_msg(**fields))
    assert decode(_msg(kv_transport_fallbacks=10_000_000)).kv_transport_fallbacks == 10_000_000
    assert decode(_msg()).kv_transport_fallbacks == 0  # a sender that never fell back says nothing


def test_load_waiting_for_kv_round_trips_and_is_optional():
    """D's requests held for their prefill's KV ride in the load map; a sender that leaves the
    field out (an older connector) reports none, and a load without them encodes without it
    (so an older proxy sees the map it knows)."""
    from xpyd_wire.discovery import Load, Registration, decode, encode

    reg = Registration("D", "127.0.0.1:1", "127.0.0.1:2", load=Load(1, 5, 0.5, 0.0, waiting_for_kv=3))
    assert decode(encode(reg)).load == Load(1, 5, 0.5, 0.0, 3)
    plain = Registration("D", "127.0.0.1:1", "127.0.0.1:2", load=Load(1, 5, 0.5, 0.0))
    assert "waiting_for_kv" not in msgpack.unpackb(encode(plain))["load"]
    assert decode(_msg(load={"running": 1, "waiting": 2})).load == Load(1, 2)

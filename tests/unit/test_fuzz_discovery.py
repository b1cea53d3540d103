"""Fuzzing the discovery side: seeded random and mutated msgpack registrations (valid ones,
signed and unsigned, mutated field-wise and byte-wise; wrong types, huge values, CR/LF,
unicode, NaN/inf, bools, ext types, deep nesting, oversize, replays).

Unit level: protocol.decode either returns a registration that obeys the rules (checked here
with rules of our own, not the module's) or raises ProtocolError with a known reason; any
other exception fails. Proxy level: the same messages over a real ZMQ socket to a running
proxy's discovery port; afterwards the discovery task is alive, every message was counted
exactly once, nothing in the registry breaks the rules, and a client request is answered 200
by a good instance.

Bounded in count and time. XPYD_FUZZ_SEED / XPYD_FUZZ_COUNT change the seed / count.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import random
import re
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from proxy.membership.discovery import LOG_BURST, LOG_WINDOW_S
from tests.support.proxy_helpers import running_proxy, wait_until
from xpyd_wire.discovery import (
    DROP_REASONS,
    MAX_LOAD_COUNT,
    MAX_MESSAGE_BYTES,
    ProtocolError,
    Registration,
    ReplayGuard,
    decode,
    encode,
    sign,
)

SEED = int(os.environ.get("XPYD_FUZZ_SEED", "20240610"))
COUNT = int(os.environ.get("XPYD_FUZZ_COUNT", "3000"))
TIME_BUDGET_S = 4.0  # generation + checks stop here even if COUNT is not reached
SECRET = "fuzz-secret"

# Our own statement of what an accepted address may look like (deliberately simpler and
# independent of xpyd_wire/discovery.py): printable ASCII, no space, host then ASCII-digit port.
_ADDRESS = re.compile(r"(?:\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?):[0-9]{1,5}")

# The proxy fetches /v1/models from every instance it accepts: the proxy-level run keeps
# accepted http addresses on loopback (LOOPBACK); the unit run may use any host.
LOOPBACK = ["127.0.0.1", "127.0.0.2", "localhost", "[::1]"]
ANY_HOST = [*LOOPBACK, "node-7.cluster.local", "10.1.2.3", "[2001:db8::1]"]
_NASTY_TEXT = [
    "\r\nX-Injected: yes\r\n", "\r", "\n", "\x00", "\t", " ", "/", "@", "%", "%0d%0a", "_", "\\",
    "ä", "\u202e", "\u0660", "８", "\ufeff", "\U0001f600", "..", ":", "[", "]", "?", "#", ";",
]  # fmt: skip
_WEIRD: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 0.5, -0.0, 1e308, -1e308,
    math.nan, math.inf, -math.inf, "", "P", "D", "x" * 300, "x" * 5000, b"", b"\xff\xfe",
    b"127.0.0.1:8000", [], [1, 2], {}, {"a": 1}, {1: 2}, msgpack.ExtType(1, b"\x00" * 8),
    msgpack.ExtType(127, b""), msgpack.Timestamp(0), "127.0.0.1:80\r\nX-Injected: yes",
]  # fmt: skip


def _valid_fields(rng: random.Random, now: float, hosts: list[str]) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "type": rng.choice("PD"),
        "http_address": f"{rng.choice(hosts)}:{rng.randint(1, 65535)}",
        "zmq_address": f"{rng.choice(hosts)}:{rng.randint(1, 65535)}",
    }
    if rng.random() < 0.5:
        fields["load"] = {"running": rng.randint(0, 50), "waiting": rng.randint(0, 50),
                          "kv_usage": rng.random(), "kv_buffer_usage": rng.random()}  # fmt: skip
    if rng.random() < 0.2:
        fields["leave"] = True
    if rng.random() < 0.3:
        fields["ts"] = now
    return fields


def _signed(fields: dict[str, Any], rng: random.Random, now: float) -> dict[str, Any]:
    fields = dict(fields, ts=now, nonce=rng.randbytes(16).hex())
    fields["hmac"] = sign(fields, SECRET)
    return fields


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _mutate_fields(fields: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    fields = dict(fields)
    keys = list(fields)
    op = rng.randrange(9)
    key = rng.choice(keys)
    if op == 0:
        fields[key] = rng.choice(_WEIRD)
    elif op == 1:
        del fields[key]
    elif op == 2 and isinstance(fields.get(key), str):  # insert nasty text into a string
        s = fields[key]
        i = rng.randint(0, len(s))
        fields[key] = s[:i] + rng.choice(_NASTY_TEXT) + s[i:]
    elif op == 3:
        fields[rng.choice(["http_address", "zmq_address"])] = (
            f"{rng.choice(LOOPBACK)}:{rng.choice(['0', '65536', '080', '+1', '', '1e3', '-5', '99999999'])}"
        )
    elif op == 4:
        fields["load"] = {rng.choice(["running", "waiting", "kv_usage", "kv_buffer_usage", "x"]):
                          rng.choice(_WEIRD)}  # fmt: skip
    elif op == 5:  # unknown fields, a few or too many, odd names
        for _ in range(rng.choice([1, 3, 30])):
            fields[rng.choice(["v", "x" * 70, "extra", f"k{rng.randrange(99)}"])] = rng.choice(_WEIRD)
    elif op == 6:
        fields[key] = _nested(rng.choice([10, 100, 400]))
    elif op == 7:
        fields[key] = {f"k{i}": i for i in range(rng.choice([10, 1000]))}
    else:
        fields["hmac"] = rng.choice(["é" * 64, "0" * 64, "f" * 63, b"0" * 64, 7, None, "Z" * 64])
    return fields


def _pack(fields: Any, rng: random.Random) -> bytes:
    try:  # use_bin_type=False: bytes become str frames that may not be UTF-8
        return msgpack.packb(fields, use_bin_type=rng.random() < 0.8, strict_types=False)
    except (ValueError, TypeError, OverflowError):
        return msgpack.packb(repr(fields)[:200])


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    op = rng.randrange(7)
    if op == 0 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1:
        del b[rng.randint(0, len(b)) :]
    elif op == 2:
        i = rng.randint(0, len(b))
        b[i:i] = rng.randbytes(rng.randint(1, 8))
    elif op == 3:
        b += data
    elif op == 4:  # a container header that promises far more than follows
        b = bytearray(rng.choice([b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                                  b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01"])) + b[:10]  # fmt: skip
    elif op == 5:
        b = bytearray(rng.randbytes(rng.randint(0, 64)))
    else:  # a string replaced by invalid UTF-8 (a CESU-encoded surrogate)
        b = bytearray(msgpack.packb({"type": "P", "http_address": "h:1"})[:-4]) + b"\xa3\xed\xa0\x80"
    return bytes(b)


def generate(
    rng: random.Random, n: int, now: float, signed_share: float, hosts: list[str]
) -> Iterator[bytes]:
    """n messages: valid, field-mutated, byte-mutated, signed and replayed ones, mixed."""
    sent_valid: list[bytes] = []
    for _ in range(n):
        fields = _valid_fields(rng, now, hosts)
        signed = rng.random() < signed_share
        kind = rng.randrange(10)
        if kind == 0:  # valid as is (and remembered for a replay)
            data = _pack(_signed(fields, rng, now) if signed else fields, rng)
            sent_valid.append(data)
        elif kind == 1 and sent_valid:  # a replay of an earlier valid message
            data = rng.choice(sent_valid)
        elif kind <= 5:  # a field mutated; signed: before signing (so the MAC is right) or after
            if signed and rng.random() < 0.5:
                data = _pack(_signed(_mutate_fields(fields, rng), rng, now), rng)
            else:
                base = _signed(fields, rng, now) if signed else fields
                data = _pack(_mutate_fields(base, rng), rng)
        else:
            base = _signed(fields, rng, now) if signed else fields
            data = _mutate_bytes(_pack(base, rng), rng)
        yield data


def assert_follows_the_rules(reg: Registration) -> None:
    assert reg.role in ("P", "D")
    for address in (reg.http_address, reg.zmq_address):
        assert len(address) <= 259 and _ADDRESS.fullmatch(address), address
        assert 1 <= int(address.rsplit(":", 1)[1]) <= 65535, address
    assert isinstance(reg.leave, bool)
    if reg.ts is not None:
        assert math.isfinite(reg.ts)
    if reg.load is not None:
        for n in (reg.load.running, reg.load.waiting):
            assert type(n) is int and 0 <= n <= MAX_LOAD_COUNT
        for u in (reg.load.kv_usage, reg.load.kv_buffer_usage):
            assert type(u) is float and 0.0 <= u <= 1.0


def _outcome(data: bytes, secret: str | None, now: float, guard: ReplayGuard | None) -> str:
    """What the proxy must count for this message (accepted/left or a drop reason)."""
    try:
        reg = decode(data, secret=secret, now=now)
    except ProtocolError as e:
        assert e.reason in DROP_REASONS, e.reason
        return e.reason
    except Exception as e:  # noqa: BLE001 (the point of the test)
        raise AssertionError(f"decode raised {type(e).__name__}: {e} on {data[:200]!r} (seed {SEED})") from e
    assert_follows_the_rules(reg)
    if guard is not None and reg.nonce is not None and guard.check(reg.nonce, reg.ts, now):
        return "replayed"
    return "left" if reg.leave else "accepted"


@pytest.mark.parametrize("secret", [None, SECRET])
def test_decode_raises_only_protocol_errors(secret):
    rng = random.Random(SEED)
    now = time.time()
    deadline = time.monotonic() + TIME_BUDGET_S
    seen: dict[str, int] = {}
    guard = ReplayGuard() if secret else None
    n = 0
    for data in generate(rng, COUNT, now, signed_share=0.5, hosts=ANY_HOST):
        result = _outcome(data, secret, now, guard)
        seen[result] = seen.get(result, 0) + 1
        n += 1
        if time.monotonic() > deadline:
            break
    assert n >= min(COUNT, 500), f"only {n} messages within {TIME_BUDGET_S}s"
    # The generator reaches every outcome (else the test would check less than it says).
    expected = {"accepted", "malformed", "invalid_field"} | (
        {"unauthorized", "replayed"} if secret else set()
    )
    assert expected <= set(seen), seen


def _contacts_only_loopback(data: bytes, secret: str | None, now: float) -> bool:
    """False for a message the proxy would accept with a non-loopback http address (it would
    fetch that address's /v1/models); mutations can make one (127.0.0.1 -> 127.0.0.q)."""
    try:
        reg = decode(data, secret=secret, now=now)
    except ProtocolError:
        return True
    host = reg.http_address.rsplit(":", 1)[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _send_all(sock: zmq.asyncio.Socket, messages: list[bytes], rng: random.Random) -> None:
    for data in messages:
        if rng.random() < 0.05:  # extra frames before the payload (REQ-style or junk)
            await sock.send_multipart([b"", rng.randbytes(3), data])
        else:
            await sock.send(data)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
async def test_fuzzed_registrations_leave_the_proxy_serving(secret, caplog):
    rng = random.Random(SEED + 1)
    now = time.time()
    count = min(COUNT, 1500)
    messages = [
        m for m in generate(rng, count, now, signed_share=0.7 if secret else 0.2, hosts=LOOPBACK)
        if len(m) <= MAX_MESSAGE_BYTES and _contacts_only_loopback(m, secret, now)
    ]
    guard = ReplayGuard() if secret else None
    expected: dict[str, int] = {}
    for m in messages:
        r = _outcome(m, secret, now, guard)
        expected[r] = expected.get(r, 0) + 1

    t0 = time.monotonic()
    # Every fuzzed message is to be judged: no per-source rate here (its own test: test_proxy_discovery).
    async with running_proxy(discovery_secret=secret, heartbeat_timeout=1.0, discovery_max_source_rate=10**6,
                             discovery_cpu_share=1.0) as px:
        p, d = await px.pd(secret=secret, heartbeat_interval=0.1)
        # Registered before the flood, which may fill its source's bound (all of it comes
        # from 127.0.0.1): its later heartbeats are updates, never refused.
        marker = await px.fake("P", register=False, secret=secret)
        await marker.send_registration()
        await wait_until(lambda: marker.http_address in [i.http_address for i in px.registry.live("P")])
        good = {p.http_address, d.http_address, marker.http_address}
        counter = px.state.metrics.discovery.labels
        accepted_before = counter("accepted")._value.get()
        ctx = zmq.asyncio.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{px.discovery}")
            oversize = ctx.socket(zmq.DEALER)  # ZMQ drops this peer: its own socket
            oversize.setsockopt(zmq.LINGER, 0)
            oversize.connect(f"tcp://{px.discovery}")
            with caplog.at_level(logging.WARNING, logger="xpyd.proxy"):
                await oversize.send(msgpack.packb({"type": "P", "pad": "x" * (2 * MAX_MESSAGE_BYTES)}))
                await _send_all(sock, messages, rng)
                # Same socket, so it arrives after every fuzzed message: then all were handled.
                marker.zmq_address = "127.0.0.1:1"
                await sock.send(encode(marker.registration(), secret))
                await wait_until(
                    lambda: [i for i in px.registry.live("P")
                             if i.http_address == marker.http_address and i.zmq_address == "127.0.0.1:1"],
                    timeout=120, what="marker heartbeat after the fuzzed messages",
                )  # fmt: skip
            assert px.state.discovery.alive
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "handler error"
            dropped_logs = [r for r in caplog.records if "discovery message dropped" in r.getMessage()]
            windows = 2 + int((time.monotonic() - t0) // LOG_WINDOW_S)  # the flood's windows
            assert 1 <= len(dropped_logs) <= LOG_BURST * windows
            for result in DROP_REASONS:
                assert counter(result)._value.get() == expected.get(result, 0), (result, expected)
            assert counter("left")._value.get() == expected.get("left", 0)
            # Valid ones are accepted, or refused beyond the per-source bound (not dropped);
            # accepted also counts the good fakes' heartbeats and the marker.
            valid = counter("accepted")._value.get() - accepted_before + counter("refused")._value.get()
            assert valid >= expected.get("accepted", 0) + 1
            assert len(px.registry.every()) <= px.state.cfg.discovery_max_per_source
            for inst in px.registry.every():
                assert_follows_the_rules(Registration(inst.role, inst.http_address, inst.zmq_address,
                                                      inst.load))  # fmt: skip
            # The fuzzed registrations stop heartbeating and expire; the good ones stay.
            await sock.send(encode(marker.registration(leave=True), secret))
            await wait_until(
                lambda: {i.http_address for i in px.registry.every()} == good - {marker.http_address},
                timeout=10, what="only the good instances left",
            )
        finally:
            ctx.destroy(linger=0)
        resp = await px.client.post("/v1/completions", json={"model": "fake-model", "prompt": "Hi",
                                                              "max_tokens": 3})  # fmt: skip
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"]
        assert len(p.completions()) == 1 and len(d.completions()) == 1
    assert time.monotonic() - t0 < 30

"""What a peer that cannot authenticate may cost a KV engine (issue 47, part 3), against real
engines over raw TCP: frames with MORE set and never the last are held no longer (the zmq
connection proves the key at its handshake), connections are capped overall and per host and
one that never finishes its handshake is dropped, and a KV port beyond loopback without
kv_secret is a start-up error unless allowed on purpose."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

from connector.config import ConnectorConfig
from tests.support.kv_auth import SECRET, refused
from tests.support.kv_engines import wait_for
from tests.support.zmtp import GREETING, READY, closed, frame_head, idle_connection

FRAME = 8 << 20
FRAMES = 40  # 320 MiB with MORE set, never the last frame: libzmq holds a message until it is whole


def rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _port(eng) -> int:
    return int(eng.address.rpartition(":")[2])


def test_a_peer_without_the_key_cannot_make_the_engine_hold_its_frames(engines):
    """A raw peer completes ZMTP's greeting (NULL: it has no key) and sends 40 frames of
    8 MiB with MORE set: the engine held all 320 MiB until the peer left. Now the connection
    fails its handshake and is closed before libzmq takes a frame; the engine's memory stays."""
    eng = engines("kv_consumer", "PUT_ASYNC", kv_secret=SECRET, kv_buffer_size=16 << 20)
    payload = b"\x00" * FRAME
    before = rss_bytes()
    s = socket.create_connection(("127.0.0.1", _port(eng)), timeout=5)
    sent = 0
    try:
        s.sendall(GREETING + READY)
        for _ in range(FRAMES):
            s.sendall(frame_head(FRAME, more=True) + payload)
            sent += FRAME
        held = rss_bytes() - before  # the peer is still there: whatever the engine took, it holds now
    except OSError:
        held = rss_bytes() - before  # closed on us: the handshake failed
    finally:
        s.close()
    del payload
    assert held < 64 << 20, f"the engine grew {held >> 20} MiB while a peer without the key sent {sent >> 20} MiB"
    wait_for(lambda: set(refused(eng)) == {"handshake"})
    assert eng.stats()["recv_bytes"] == 0


def test_connections_are_capped_overall_and_per_host(engines):
    """Idle connections (ZMTP handshake done, then silence) to an engine without a secret (on
    loopback): at most kv_max_connections_per_host from one host and kv_max_connections in
    all are held, the rest shut down as they come (1,500 were all held)."""
    eng = engines("kv_consumer", "PUT_ASYNC", kv_max_connections=10, kv_max_connections_per_host=6)
    port = _port(eng)
    socks = []
    try:
        first = [idle_connection(port, "127.0.0.1") for _ in range(8)]
        socks += first
        wait_for(lambda: sum(closed(s) for s in first) >= 2)
        time.sleep(0.3)
        assert [closed(s) for s in first] == [False] * 6 + [True] * 2
        second = [idle_connection(port, "127.0.0.2") for _ in range(6)]
        socks += second
        wait_for(lambda: sum(closed(s) for s in second) >= 2)
        time.sleep(0.3)
        assert [closed(s) for s in second] == [False] * 4 + [True] * 2
        assert eng._transport.refused_connections == 4
        for s in first[:3]:  # slots that free are used again
            s.close()
        time.sleep(0.5)
        third = [idle_connection(port, "127.0.0.2") for _ in range(2)]
        socks += third
        time.sleep(0.5)
        assert not any(closed(s) for s in third)
    finally:
        for s in socks:
            s.close()


def test_a_connection_that_never_completes_its_handshake_is_dropped(engines):
    """A TCP connection that sends nothing was held for libzmq's default 30 s; now 5 s."""
    eng = engines("kv_consumer", "PUT_ASYNC", kv_secret=SECRET)
    silent = [socket.create_connection(("127.0.0.1", _port(eng)), timeout=5) for _ in range(3)]
    try:
        t0 = time.monotonic()
        wait_for(lambda: all(closed(s) for s in silent), timeout=15)
        assert time.monotonic() - t0 < 12
    finally:
        for s in silent:
            s.close()


def _cfg(**extra) -> ConnectorConfig:
    return ConnectorConfig.from_vllm(SimpleNamespace(kv_role="kv_consumer", kv_port=23001,
                                                     kv_connector_extra_config=extra))


@pytest.mark.parametrize("kv_ip", ["0.0.0.0", "10.1.2.3", "decode-0.cluster.local", "::"])
def test_a_kv_port_beyond_loopback_needs_a_secret_or_an_explicit_opt_in(kv_ip, monkeypatch):
    """Without kv_secret anyone who reaches the port can put KV for a transfer, which vLLM's
    prefix cache then serves to other requests: like discovery, a wider bind is refused."""
    for env in ("XPYD_KV_SECRET", "XPYD_DISCOVERY_SECRET", "XPYD_KV_SECRET_FILE", "XPYD_DISCOVERY_SECRET_FILE"):
        monkeypatch.delenv(env, raising=False)
    with pytest.raises(ValueError, match="without kv_secret.*allow_unauthenticated_kv"):
        _cfg(kv_ip=kv_ip)
    assert _cfg(kv_ip=kv_ip, allow_unauthenticated_kv=True).allow_unauthenticated_kv is True
    assert _cfg(kv_ip=kv_ip, kv_secret="s").kv_secret == "s"
    monkeypatch.setenv("XPYD_KV_SECRET", "from-env")
    assert _cfg(kv_ip=kv_ip).kv_secret == "from-env"
    monkeypatch.delenv("XPYD_KV_SECRET")
    for loopback in ("127.0.0.1", "127.0.0.5", "::1", "localhost"):
        assert _cfg(kv_ip=loopback).kv_secret is None

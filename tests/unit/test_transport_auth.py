"""KV control-plane authentication and size caps of TcpTransport, over real sockets on
127.0.0.1: the ``mac`` mechanism (MAC on every header and the frame lengths, replay
guard, signed replies), ``curve`` (ZMQ CURVE + ZAP), and the caps over all frames.

Raw DEALER sockets play the attacker (or a peer with another secret) where the
transport's own client would never send such a message."""

from __future__ import annotations

import hmac
import logging
import threading
import time

import msgpack
import pytest
import torch
import zmq

from connector.config import ConnectorConfig
from connector.transport import KVAuth, TcpTransport, TransportError, TransportRefused, derive_kv_key
from connector.transport.auth import REQ_AUTH_LEN, MacAuth, ReplayGuard, is_reply_auth
from connector.transport.base import REFUSAL_REASONS
from connector.transport.wire import encode as _encode
from tests.support.kv_frames import Raw, signed

HOST = "127.0.0.1"
SECRET = "correct horse battery staple"


def auth(secret: str = SECRET, mode: str = "mac", **kw) -> KVAuth:
    return KVAuth.from_secret(secret, mode, **kw)


class Recorder:
    """A handler that records what reached it (nothing refused may)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.lock = threading.Lock()

    def __call__(self, header, tensors):
        with self.lock:
            self.calls.append(dict(header))
        return {"echo": header.get("op"), "n": len(tensors)}, tensors


@pytest.fixture
def started():
    """serve(**transport kwargs) -> (transport, peer, recorder); all closed afterwards."""
    made: list[TcpTransport] = []

    def serve(**kw):
        rec = Recorder()
        srv = TcpTransport(**kw)
        srv.start(HOST, 0, rec)
        made.append(srv)
        return srv, f"{HOST}:{srv.bound_port}", rec

    def client(**kw) -> TcpTransport:
        cli = TcpTransport(**kw)
        made.append(cli)
        return cli

    serve.client = client
    yield serve
    for t in made:
        t.close()


def refused(reply: list[bytes]) -> dict:
    assert reply is not None and len(reply) == 1, reply  # a plain answer: no auth frame
    hdr = msgpack.unpackb(reply[0])
    assert hdr["ok"] is False, hdr
    return hdr


def counts(t: TcpTransport) -> dict[str, int]:
    return {k: v for k, v in t.refusals().items() if v}


# ================================================================ keys


def test_kv_key_is_domain_separated_and_empty_secret_is_refused():
    key = derive_kv_key(SECRET)
    assert key == hmac.digest(SECRET.encode(), b"xpyd-kv-v1", "sha256")
    # Neither the secret nor what the discovery MAC is keyed with (the secret itself).
    assert key != SECRET.encode() and SECRET.encode() not in key
    a = auth()
    assert len({a.mac_key, key, a.curve_server[1], a.curve_client[1]}) == 4
    assert auth().mac_key == a.mac_key and auth("other").mac_key != a.mac_key
    assert SECRET not in repr(a) and a.mac_key.hex() not in repr(a)
    with pytest.raises(ValueError):
        derive_kv_key("")
    with pytest.raises(ValueError):
        KVAuth.from_secret(SECRET, "tls")


class _KvCfg:
    kv_role = "kv_consumer"
    kv_port = 14000

    def __init__(self, **extra) -> None:
        self.kv_connector_extra_config = extra


def test_config_kv_secret_sources(monkeypatch):
    monkeypatch.delenv("XPYD_KV_SECRET", raising=False)
    monkeypatch.delenv("XPYD_DISCOVERY_SECRET", raising=False)
    assert ConnectorConfig.from_vllm(_KvCfg()).kv_secret is None
    assert ConnectorConfig.from_vllm(_KvCfg(discovery_secret="d")).kv_secret == "d"  # the default
    cfg = ConnectorConfig.from_vllm(_KvCfg(discovery_secret="d", kv_secret="kv-s3cr3t", kv_auth="curve"))
    assert (cfg.kv_secret, cfg.kv_auth) == ("kv-s3cr3t", "curve")
    assert "kv-s3cr3t" not in repr(cfg)  # configs get logged
    monkeypatch.setenv("XPYD_KV_SECRET", "from-env")
    assert ConnectorConfig.from_vllm(_KvCfg(discovery_secret="d")).kv_secret == "from-env"
    for bad in ({"kv_secret": ""}, {"kv_secret": "  "}, {"kv_auth": "tls"}):
        with pytest.raises(ValueError):
            ConnectorConfig.from_vllm(_KvCfg(**bad))
    monkeypatch.setenv("XPYD_KV_SECRET", "")
    with pytest.raises(ValueError, match="XPYD_KV_SECRET"):
        ConnectorConfig.from_vllm(_KvCfg())


# ================================================================ mac


def test_mac_roundtrip_with_tensors(started):
    srv, peer, rec = started(auth=auth())
    cli = started.client(auth=auth())
    x = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    reply, got = cli.call(peer, {"op": "put", "key": "k"}, [x, torch.ones(3)])
    assert reply == {"echo": "put", "n": 2, "ok": True}
    assert torch.equal(got[0], x) and torch.equal(got[1], torch.ones(3))
    assert rec.calls == [{"op": "put", "key": "k"}]
    assert counts(srv) == {}


def eventually(srv: TcpTransport, want: dict[str, int]) -> None:
    """The server's refusal counts become `want` (handshake ones are counted by its ZAP and
    monitor threads, a moment after the caller heard)."""
    deadline = time.monotonic() + 10
    while counts(srv) != want:
        assert time.monotonic() < deadline, counts(srv)
        time.sleep(0.02)


def test_wrong_secret_and_no_secret_are_refused_at_the_handshake(started):
    """A connection proves the key at its handshake: another secret, or none, gets no further
    (libzmq takes none of its messages), and the caller is told at once and why."""
    srv, peer, rec = started(auth=auth())
    t0 = time.monotonic()
    with pytest.raises(TransportRefused, match="refused the connection at its handshake: it refused this kv_secret"):
        started.client(auth=auth("wrong")).call(peer, {"op": "put"}, [torch.ones(4)], timeout_s=20)
    with pytest.raises(TransportRefused, match="has a kv_secret where this side has none"):
        started.client().call(peer, {"op": "put"}, [torch.ones(4)], timeout_s=20)
    assert time.monotonic() - t0 < 10  # told, not left to its deadline
    assert rec.calls == []
    eventually(srv, {"handshake": 2})


def test_signed_call_to_an_engine_without_secret_says_so(started):
    srv, peer, rec = started()
    with pytest.raises(TransportRefused, match="kv_secret"):
        started.client(auth=auth()).call(peer, {"op": "ping"}, timeout_s=20)
    assert rec.calls == []
    eventually(srv, {"handshake": 1})


def test_replayed_and_tampered_requests_are_refused(started):
    srv, peer, rec = started(auth=auth())
    mac = MacAuth(auth())
    raw = Raw(peer, auth())  # past the handshake: one who read the connect token off the wire
    try:
        msg = signed(mac, {"op": "put", "key": "k1"}, [torch.ones(8)])
        first = raw.ask(msg)
        assert is_reply_auth(first[0]) and msgpack.unpackb(first[1])["ok"] is True
        assert refused(raw.ask(msg))["refused"] == "replay"
        # Tampering with anything the MAC covers: header bytes, a frame's length, the
        # frame count, the timestamp or nonce. Each is a fresh, otherwise valid message.
        fresh = lambda: signed(mac, {"op": "put", "key": "k2"}, [torch.ones(8)])  # noqa: E731
        m = fresh()
        m[1] = m[1].replace(b"k2", b"k3")
        assert refused(raw.ask(m))["refused"] == "bad_mac"
        m = fresh()
        m[2] = m[2] + b"\x00\x00\x00\x00"
        assert refused(raw.ask(m))["refused"] == "bad_mac"
        m = fresh()
        assert refused(raw.ask([*m, b"extra"]))["refused"] == "bad_mac"
        m = fresh()
        m[0] = m[0][:7] + bytes([m[0][7] ^ 1]) + m[0][8:]  # timestamp
        assert refused(raw.ask(m))["refused"] == "bad_mac"
        m = fresh()
        m[0] = m[0][:-1] + bytes([m[0][-1] ^ 1])  # the tag itself
        assert refused(raw.ask(m))["refused"] == "bad_mac"
        # No auth frame at all / an auth frame of garbage.
        assert refused(raw.ask(_encode({"op": "put", "key": "k4"}, (), 3)))["refused"] == "unauthenticated"
        assert refused(raw.ask([b"\xc1xKVq1" + b"\x00" * (REQ_AUTH_LEN - 6), b"\x80"]))["refused"] == "bad_mac"
        # The untampered fresh message still goes through once.
        ok = raw.ask(fresh())
        assert msgpack.unpackb(ok[1])["ok"] is True
    finally:
        raw.close()
    assert [c["key"] for c in rec.calls] == ["k1", "k2"]
    assert counts(srv) == {"replay": 1, "bad_mac": 6, "unauthenticated": 1}


def test_timestamp_outside_the_window_is_refused(started):
    srv, peer, rec = started(auth=auth(window_s=5.0))
    skewed = started.client(auth=auth(window_s=5.0))
    skewed._mac._clock = lambda: time.time_ns() - 6 * 10**9  # a clock 6 s behind
    with pytest.raises(TransportRefused, match="clocks"):
        skewed.call(peer, {"op": "ping"})
    skewed._mac._clock = lambda: time.time_ns() + 4 * 10**9  # within the window
    assert skewed.call(peer, {"op": "ping"})[0]["ok"] is True
    assert counts(srv) == {"stale": 1} and len(rec.calls) == 1


def test_replay_guard_is_bounded_and_never_readmits():
    g = ReplayGuard(window_s=10.0, capacity=4)
    now = 100 * 10**9
    for i in range(4):
        assert g.check(now + i, b"n%d" % i, now) is None
    assert g.check(now + 1, b"n1", now) == "replay"
    # Full: admitting a fifth forgets the oldest and raises the floor to its timestamp,
    # so the forgotten nonce is refused all the same.
    assert g.check(now + 10, b"n4", now) is None and len(g) == 4
    assert g.check(now + 0, b"n0", now) == "replay"
    # Outside the window either way: stale.
    assert g.check(now - 11 * 10**9, b"x", now) == "stale"
    assert g.check(now + 11 * 10**9, b"y", now) == "stale"
    # Entries fall out of memory once the window refuses them anyway.
    later = now + 30 * 10**9
    assert g.check(later, b"z", later) is None and len(g) == 1


def test_client_acts_only_on_signed_replies(started):
    """A server that does not hold the key cannot answer for one that does: its
    'ok' is a refusal, a forged signature is an error (P ships no KV to it)."""
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    # It takes any password (and learns it): a PLAIN server whose ZAP handler admits everyone.
    zap = ctx.socket(zmq.REP)
    zap.bind("inproc://zeromq.zap.01")
    fake.setsockopt(zmq.PLAIN_SERVER, 1)
    fake.setsockopt(zmq.ZAP_DOMAIN, b"any")
    port = fake.bind_to_random_port(f"tcp://{HOST}")
    ok = msgpack.packb({"ok": True, "tensors": []})
    lying = msgpack.packb({"ok": True, "error": "fine\nkv loaded req=forged " + "x" * 1000, "tensors": []})
    answers = [
        lambda nonce: [lying],  # unsigned "ok", with a line of its own for our log
        lambda nonce: [b"\xc1xKVr1" + nonce + b"\x00" * 32, ok],  # forged tag, right nonce
    ]
    seen: list[list[bytes]] = []

    def serve():
        for answer in answers:
            poller = zmq.Poller()
            poller.register(fake, zmq.POLLIN)
            poller.register(zap, zmq.POLLIN)
            deadline = time.monotonic() + 5
            while fake not in dict(poller.poll(100)):
                while zap.poll(0):  # each connection's handshake: admitted
                    version, request_id, *_ = zap.recv_multipart()
                    zap.send_multipart([version, request_id, b"200", b"OK", b"", b""])
                if time.monotonic() > deadline:
                    return
            ident, *frames = fake.recv_multipart()
            seen.append(frames)
            fake.send_multipart([ident, *answer(frames[0][14:30])])  # magic 6 + ts 8, nonce 16

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    cli = started.client(auth=auth())
    try:
        with pytest.raises(TransportRefused, match="unauthenticated answer") as e:
            cli.call(f"{HOST}:{port}", {"op": "reserve", "key": "k", "nbytes": 10})
        assert "\n" not in str(e.value) and len(str(e.value)) < 400  # one bounded line
        with pytest.raises(TransportError, match="failed authentication"):
            cli.call(f"{HOST}:{port}", {"op": "get", "key": "k"})
    finally:
        t.join(timeout=10)
        fake.close(linger=0)
        zap.close(linger=0)
        ctx.term()
    assert len(seen) == 2 and all(len(f[0]) == REQ_AUTH_LEN for f in seen)


def test_refusals_are_logged_at_a_limited_rate(started, caplog):
    srv, peer, _ = started(auth=auth())
    raw = Raw(peer, auth())
    try:
        with caplog.at_level(logging.WARNING, logger="connector.transport.tcp"):
            for i in range(200):
                assert raw.ask([b"garbage %d" % i, b"x"]) is not None
    finally:
        raw.close()
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert srv.refusals()["unauthenticated"] == 200
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]


def test_refusal_hook_sees_every_refusal(started):
    srv, peer, _ = started(auth=auth())
    got: list[str] = []
    srv.on_refuse = got.append
    with pytest.raises(TransportRefused):
        started.client(auth=auth("wrong")).call(peer, {"op": "ping"})
    eventually(srv, {"handshake": 1})
    assert got == ["handshake"]
    assert set(srv.refusals()) == set(REFUSAL_REASONS)


# ================================================================ size caps


@pytest.mark.parametrize("mode", [None, "mac"])
def test_message_over_the_cap_in_total_is_refused(started, mode):
    """Frames each under the cap, together over it (libzmq's MAXMSGSIZE is per frame,
    so it lets them in), or too many frames: dropped before the handler, answered why."""
    kw = {"auth": auth()} if mode else {}
    srv, peer, rec = started(max_msg_bytes=100_000, max_frames=64, **kw)
    cli = started.client(**kw)

    def refusal(tensors) -> str:
        if mode:  # the answer to a signed call is unsigned: a TransportRefused
            with pytest.raises(TransportRefused) as e:
                cli.call(peer, {"op": "put"}, tensors)
            return str(e.value)
        reply, _ = cli.call(peer, {"op": "put"}, tensors)
        assert reply["ok"] is False and reply["refused"] == "oversized"
        return reply["error"]

    parts = [torch.zeros(20_000, dtype=torch.uint8) for _ in range(6)]  # 120 kB in 6 frames
    assert "over 100000 bytes" in refusal(parts)
    assert "64 frames" in refusal([torch.zeros(1)] * 65)
    # Just under both caps still passes.
    assert cli.call(peer, {"op": "put"}, parts[:4])[0]["ok"] is True
    assert cli.call(peer, {"op": "put"}, [torch.zeros(1)] * 63)[0]["ok"] is True
    assert rec.calls == [{"op": "put"}] * 2
    assert counts(srv) == {"oversized": 2}


def test_oversized_frame_and_header_never_reach_the_handler(started):
    srv, peer, rec = started(max_msg_bytes=3 << 20)
    raw = Raw(peer)
    try:
        # A header frame over 1 MiB: refused before it is decoded.
        assert refused(raw.ask([b"\x81" + b"a" * (2 << 20)]))["refused"] == "oversized"
        # One frame over MAXMSGSIZE: libzmq drops the connection; no answer, no handler.
        assert raw.ask([msgpack.packb({"tensors": []}), b"\x00" * (4 << 20)], timeout_ms=1000) is None
    finally:
        raw.close()
    assert started.client().call(peer, {"op": "after"})[0]["ok"] is True
    assert [c["op"] for c in rec.calls] == ["after"]


# ================================================================ curve


def test_curve_roundtrip_and_refused_handshakes(started):
    srv, peer, rec = started(auth=auth(mode="curve"))
    cli = started.client(auth=auth(mode="curve"))
    x = torch.randn(64, 32)
    reply, got = cli.call(peer, {"op": "put"}, [x])
    assert reply["ok"] and torch.equal(got[0], x)
    with pytest.raises(TransportError, match="handshake"):
        started.client(auth=auth("wrong", mode="curve")).call(peer, {"op": "put"}, [x], timeout_s=1.0)
    with pytest.raises(TransportError, match="handshake|unreachable"):
        started.client().call(peer, {"op": "put"}, [x], timeout_s=1.0)  # no CURVE at all
    assert len(rec.calls) == 1
    deadline = time.monotonic() + 30
    while srv.refusals()["handshake"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.refusals()["handshake"] >= 1
    assert cli.call(peer, {"op": "after"})[0]["ok"] is True


def test_curve_zap_admits_only_the_derived_client_key(started):
    """A client that knows the server's public key (it is not a secret) but has its own
    key pair is refused by ZAP."""
    srv, peer, rec = started(auth=auth(mode="curve"))
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IMMEDIATE, 1)
    pub, sec = zmq.curve_keypair()
    s.setsockopt(zmq.CURVE_SERVERKEY, auth(mode="curve").curve_server[0])
    s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
    s.setsockopt(zmq.CURVE_SECRETKEY, sec)
    try:
        s.connect(f"tcp://{peer}")
        assert not s.poll(1000, zmq.POLLOUT)  # never admitted
    finally:
        s.close(linger=0)
        ctx.term()
    assert rec.calls == [] and srv.refusals()["handshake"] >= 1

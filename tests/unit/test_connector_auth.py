"""The KV control plane with a secret: two (or three) real KVEngines in one process,
each built from its config as the worker builds it (transport, caps and auth from
``kv_secret``/``kv_auth``), on free loopback ports, moving real cache blocks.

The connector refuses a KV put without the right MAC (wrong secret, no secret,
replayed, tampered), and the receiver's buffers stay at zero."""

from __future__ import annotations

import logging
import time

import msgpack
import pytest
import torch

from connector.transport import KVAuth, TcpTransport, TransportError, TransportRefused
from connector.transport.auth import MacAuth
from tests.support.kv_auth import SECRET, kv_put_frames, refused
from tests.support.kv_engines import (
    KEY,
    ZERO,
    assert_untouched,
    load_and_check,
    load_spec,
    plan_load,
    poll_until,
    rank0,
    save_spec,
    snapshot,
    wait_for,
)
from tests.support.kv_frames import Raw, signed


@pytest.mark.parametrize("send_type", ["PUT_ASYNC", "PUT", "GET"])
def test_same_secret_transfers(engines, send_type):
    prod = engines("kv_producer", send_type, seed=1, kv_secret=SECRET)
    cons = engines("kv_consumer", send_type, seed=2, kv_secret=SECRET)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    load_and_check(cons, prod, before)
    assert cons.stats() == ZERO and refused(cons) == {} and refused(prod) == {}


@pytest.mark.parametrize("mode", ["mac", "curve"])
def test_wrong_secret_is_refused_and_buffers_stay_zero(engines, mode):
    """P with one secret, D with another: the reservation is refused before any KV byte
    moves; D's load gets nothing (it would recompute after its deadline); counted."""
    timeouts = dict(send_timeout_s=1.0, kv_load_timeout_s=2.0)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, kv_secret=SECRET, kv_auth=mode, **timeouts)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_secret="another secret", kv_auth=mode, **timeouts)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    assert cons.stats()["recv_reserved_bytes"] == 0
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving, timeout=10)
    assert res.failed_recving == {"D-req"}
    assert_untouched(cons, before)
    assert cons.stats() == ZERO
    poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    assert prod.stats() == ZERO
    # D refused P's connection at its handshake (no byte of it taken); P was told at once and
    # counts the send as refused.
    assert refused(cons).get("handshake", 0) >= 1 and set(refused(cons)) == {"handshake"}
    assert prod.xfer_stats.peek().failures("send", "refused") == 1
    assert cons.xfer_stats.peek().refused("handshake") >= 1


def test_no_secret_on_either_side_is_refused(engines):
    signed_d = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_secret=SECRET)
    plain_d = engines("kv_consumer", "PUT_ASYNC", seed=3)
    plain_p = engines("kv_producer", "PUT", seed=1, send_timeout_s=1.0)
    signed_p = engines("kv_producer", "PUT", seed=4, kv_secret=SECRET, send_timeout_s=1.0)
    # Unsigned P -> signed D, and signed P -> D without a secret: the connection's handshake
    # fails (the mechanisms differ); both sides count it, P's log says why.
    plain_p.save(save_spec(plain_p, rank0(signed_d), req_id="a", key="a" * 32))
    signed_p.save(save_spec(signed_p, rank0(plain_d), req_id="b", key="b" * 32))
    # (libzmq may have tried the connection again before P gave up: one or more each.)
    wait_for(lambda: set(refused(signed_d)) == {"handshake"} and set(refused(plain_d)) == {"handshake"})
    assert signed_d.stats() == ZERO and plain_d.stats() == ZERO
    assert plain_p.xfer_stats.peek().failures("send", "refused") == 1
    assert signed_p.xfer_stats.peek().failures("send", "refused") == 1


def test_forged_replayed_and_tampered_puts_never_reach_the_buffer(engines):
    """An attacker on the KV port who passed the connection's handshake (it read the connect
    token off the wire): no MAC, a MAC with another key, a captured put replayed, a signed put
    with its header changed. Only the genuine put lands. One without the token gets no
    further than the handshake: no answer, nothing held."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_secret=SECRET)
    header, tensors = kv_put_frames(cons)
    outsider = Raw(cons.address)
    try:
        assert outsider.ask([b"\x80"], timeout_ms=1000) is None
    finally:
        outsider.close()
    wait_for(lambda: set(refused(cons)) == {"handshake"})  # once or more: libzmq retries the connection
    raw = Raw(cons.address, KVAuth.from_secret(SECRET))
    right = MacAuth(KVAuth.from_secret(SECRET))
    wrong = MacAuth(KVAuth.from_secret("guess"))
    try:
        def answer(frames) -> dict:
            reply = raw.ask(frames)
            out = msgpack.unpackb(reply[-1] if len(reply) == 1 else reply[1])
            out.pop("_stream", None)  # where the engine's byte stream listens (transport-owned)
            return out

        unsigned = [msgpack.packb({**header, "tensors": [{"dtype": "bfloat16", "shape": list(t.shape)}
                                                         for t in tensors]}),
                    *(t.view(torch.uint8).numpy().tobytes() for t in tensors)]
        assert answer(unsigned)["refused"] == "unauthenticated"
        assert answer(signed(wrong, header, tensors))["refused"] == "bad_mac"
        tampered = signed(right, header, tensors)
        tampered[1] = tampered[1].replace(KEY.encode(), b"f" * 32)
        assert answer(tampered)["refused"] == "bad_mac"
        assert cons.stats() == ZERO
        genuine = signed(right, header, tensors)
        assert answer(genuine) == {"ok": True, "tensors": [], "_id": 1}
        assert cons.stats()["recv_items"] == 1
        assert answer(genuine)["refused"] == "replay"  # captured and sent again
        # Nothing else got in; the one genuine payload is the only one.
        assert cons.stats()["recv_items"] == 1 and cons.recv_buffer.contains(KEY)
    finally:
        raw.close()
    assert {k: v for k, v in refused(cons).items() if k != "handshake"} == {"unauthenticated": 1, "bad_mac": 2,
                                                                            "replay": 1}
    cons.recv_buffer.discard(KEY)
    assert cons.stats() == ZERO


def test_unauthenticated_stats_and_abort_are_refused(engines):
    """Not only puts: without the key nobody reads the engine's stats or fails a
    transfer (an unsigned abort would let anyone break loads)."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, kv_secret=SECRET)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_secret=SECRET)
    plain = TcpTransport()
    try:
        for op in ({"op": "abort", "keys": {KEY: "forged"}}, {"op": "stats"}):
            with pytest.raises(TransportRefused, match="handshake"):
                plain.call(cons.address, op)
    finally:
        plain.close()
    assert cons.recv_buffer.failure(KEY) is None
    # The genuine transfer for that key still goes through.
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    load_and_check(cons, prod, before)
    # An authenticated client reads the stats, refusals included.
    with TcpTransport(auth=KVAuth.from_secret(SECRET)) as cli:
        r, _ = cli.call(cons.address, {"op": "stats"})
    assert r["ok"] and r["refused"]["handshake"] == 2 and r["recv_bytes"] == 0


def test_get_mode_wrong_secret_fails_the_load_fast(engines):
    """GET: D pulls from P. P refuses D's unsigned-for-it calls; D gives up after its
    transport retries, long before its load deadline, and its buffers are empty."""
    prod = engines("kv_producer", "GET", seed=1, kv_secret=SECRET)
    cons = engines("kv_consumer", "GET", seed=2, kv_secret="another secret", kv_load_timeout_s=20.0)
    prod.save(save_spec(prod, rank0(cons)))
    t0 = time.monotonic()
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res, t1 = poll_until(cons, lambda r: "D-req" in r.finished_recving, timeout=10)
    assert res.failed_recving == {"D-req"} and t1 - t0 < 5.0
    assert cons.stats() == ZERO
    assert refused(prod).get("handshake", 0) >= 1
    # P's copy waits for its TTL (nobody authenticated released it).
    assert prod.stats()["send_items"] == 1


def test_secret_on_a_wider_bind_logs_nothing_but_no_secret_warns(engines, caplog, monkeypatch):
    """Without a secret a KV port on a non-loopback address is announced as
    unauthenticated once; on loopback, or with a secret, it is not."""
    from connector.p2p import engine as engine_mod

    with caplog.at_level(logging.WARNING, logger="connector.p2p.engine"):
        engines("kv_consumer", "PUT_ASYNC")  # loopback
        assert not [r for r in caplog.records if "unauthenticated" in r.getMessage()]
        monkeypatch.setattr(engine_mod, "is_loopback", lambda host: False)  # as if bound to a LAN address
        engines("kv_consumer", "PUT_ASYNC", kv_secret=SECRET)
        assert not [r for r in caplog.records if "unauthenticated" in r.getMessage()]
        engines("kv_consumer", "PUT_ASYNC")
    warned = [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert len(warned) == 1 and "kv_secret" in warned[0]


def test_is_loopback():
    from connector.p2p.engine import is_loopback

    for host in ("127.0.0.1", "127.0.0.9", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "10.0.0.5", "::", "example.org", "prefill-0"):
        assert not is_loopback(host), host


def test_refusals_reach_vllm_metrics(engines):
    """A real refusal, taken with the worker's per-step stats, lands on vLLM's
    /metrics series vllm:xpyd_kv_refused_messages_total{reason}."""
    from prometheus_client import CollectorRegistry

    from tests.support.connector_stats import p2p_config, registry_prom

    cons = engines("kv_consumer", "PUT_ASYNC", kv_secret=SECRET)
    with TcpTransport(auth=KVAuth.from_secret("wrong")) as bad, TcpTransport() as plain:
        for _ in range(2):
            with pytest.raises(TransportError):
                bad.call(cons.address, {"op": "ping"})
        with pytest.raises(TransportError):
            plain.call(cons.address, {"op": "ping"})
    wait_for(lambda: cons.xfer_stats.peek().refused("handshake") >= 3)  # 3, or more if libzmq retried one
    with TcpTransport(auth=KVAuth.from_secret(SECRET)) as tapped:  # one who read the connect token
        assert tapped.call(cons.address, {"op": "ping"})[0]["ok"] is True
        raw = Raw(cons.address, KVAuth.from_secret(SECRET))
        try:
            assert raw.ask([b"\x80"]) is not None  # no auth frame: unauthenticated
        finally:
            raw.close()
    reg = CollectorRegistry()
    prom = registry_prom(reg)(p2p_config(), ["model_name", "engine"], {0: ["tiny", "0"]})
    step = cons.xfer_stats.take(0, 0, 1)  # what the worker hands vLLM each step
    handshakes = step.reduce()["refused handshake"]
    assert handshakes >= 3
    prom.observe({**step.to_dict(), "refused": {**step.data["refused"], "made-up": 5}}, engine_idx=0)

    def val(reason: str) -> float | None:
        return reg.get_sample_value("vllm:xpyd_kv_refused_messages_total",
                                    {"model_name": "tiny", "engine": "0", "reason": reason})

    assert (val("handshake"), val("unauthenticated"), val("replay"), val("made-up")) == (handshakes, 1, 0, None)

"""The typed KV protocol (xpyd_wire/kv_transfer.py): the shapes encode to exactly the bytes the
connector has always sent (the wire is unchanged by the typing), decode back, and refuse what
is not theirs."""

from __future__ import annotations

import msgpack
import pytest

from xpyd_wire import kv_transfer as kt
from xpyd_wire.kv_transfer import Abort, Get, Hello, Op, Ping, PutHeader, Ready, Refusal, Release, Reserve

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def _header(**over) -> PutHeader:
    fields = dict(key="0123abcd-0", num_tokens=40, num_blocks=3, first_block=1, layers=LAYERS, runs=[2],
                  layout="LBHNC", dtype="bfloat16", block_shape=[2, 16, 64], tp_size=1, num_kv_heads=2, is_mla=False)
    return PutHeader(**{**fields, **over})


def _old_put(**extra) -> dict:
    """The put header as engine.py wrote it as a dict literal before the protocol was typed."""
    layout = {"layout": "LBHNC", "dtype": "bfloat16", "block_shape": [2, 16, 64]}
    tp = {"tp_size": 1, "num_kv_heads": 2, "is_mla": False}
    header = {"op": "put", "key": "0123abcd-0", "num_tokens": 40, "num_blocks": 3, "first_block": 1,
              "layers": LAYERS, "runs": [2], **layout, **tp}
    if "part" in extra:
        header["part"] = extra.pop("part")
    header.update(extra)
    return header


def _bytes(d: dict) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


def test_put_header_bytes_are_the_old_literal_s():
    assert _bytes(_header().encode()) == _bytes(_old_put())
    assert _bytes(_header(part=(0, 1)).encode()) == _bytes(_old_put(part=[0, 1]))
    # a heterogeneous-TP piece: the producer updated the key in place and appended the piece fields
    piece = _header(part=(1, 2), key="0123abcd-0:p1", piece=1, pieces=2, src_rank=0, heads=(1, 2))
    old = _old_put(part=[1, 2])
    old.update(key="0123abcd-0:p1", piece=1, pieces=2, src_rank=0, heads=[1, 2])
    assert _bytes(piece.encode()) == _bytes(old)


@pytest.mark.parametrize("header", [_header(), _header(part=(0, 2)),
                                    _header(piece=0, pieces=2, src_rank=1, heads=(0, 1))])
def test_put_header_round_trips(header):
    wire = msgpack.unpackb(_bytes(header.encode()), raw=False)
    assert PutHeader.decode(wire) == header
    assert kt.is_part(wire) == (header.part is not None)


@pytest.mark.parametrize("bad", [
    {"op": "get", "key": "k"},
    {k: v for k, v in _old_put().items() if k != "runs"},
    {**_old_put(), "num_tokens": "40"},
    {**_old_put(), "part": [0]},
    {**_old_put(), "layers": [1, 2]},
])
def test_put_header_decode_refuses_what_is_no_put_header(bad):
    with pytest.raises(ValueError):
        PutHeader.decode(bad)


def test_hello_round_trips_and_refuses_missing_fields():
    hello = Hello(rank=1, tp_size=2, num_kv_heads=4, is_mla=False, layout="LBHNC", dtype="float16",
                  block_shape=(2, 16, 64))
    wire = msgpack.unpackb(_bytes(hello.encode()), raw=False)
    assert wire["ok"] is True and wire["rank"] == 1 and wire["block_shape"] == [2, 16, 64]
    assert Hello.decode(wire) == hello
    assert Hello.request()["op"] == Op.HELLO
    with pytest.raises(ValueError, match="tp_size"):
        Hello.decode({k: v for k, v in wire.items() if k != "tp_size"})


def test_refusal_shapes_are_the_old_literals():
    assert Refusal("x").encode() == {"ok": False, "error": "x"}
    assert list(Refusal("x", gone=True).encode()) == ["ok", "error", "gone"]
    assert Refusal("x", final=True).encode() == {"ok": False, "error": "x", "final": True}
    assert Refusal("unknown op 'z'", unknown_op=True).encode() == {"ok": False, "error": "unknown op 'z'",
                                                                    "unknown_op": True}
    assert Refusal.decode({"ok": True}) is None
    assert Refusal.decode({"ok": False, "error": "bad mac", "refused": "bad_mac"}) == Refusal("bad mac",
                                                                                             refused="bad_mac")
    assert kt.ok(ready=True) == {"ok": True, "ready": True}


def test_kv_transfer_params_names_live_in_one_place():
    from xpyd_wire import request_id

    assert kt.SKIP_TOKENS_PARAM is request_id.SKIP_TOKENS_PARAM
    assert kt.PREFILL_PROMPT_TOKENS_PARAM is request_id.PREFILL_PROMPT_TOKENS_PARAM
    assert kt.REPORT_KEY_PARAM == "xpyd_report_transfer_key"
    assert kt.RESPONSE_KEY == "xpyd"


def test_the_version_travels_in_the_hello_both_ways():
    assert Hello.request() == {"op": "hello", kt.VERSION_KEY: kt.KV_PROTOCOL_VERSION}
    hello = Hello(rank=0, tp_size=1, num_kv_heads=2, is_mla=False, layout="LBHNC", dtype="bfloat16",
                  block_shape=(2, 16, 64))
    assert hello.encode()[kt.VERSION_KEY] == kt.KV_PROTOCOL_VERSION
    assert Hello.decode({k: v for k, v in hello.encode().items() if k != kt.VERSION_KEY}).version is None
    assert kt.version_mismatch(kt.KV_PROTOCOL_VERSION) is None
    for other in (None, kt.KV_PROTOCOL_VERSION + 1, str(kt.KV_PROTOCOL_VERSION), True):
        why = kt.version_mismatch(other)
        assert why and f"this instance speaks version {kt.KV_PROTOCOL_VERSION}" in why


@pytest.mark.parametrize("refusal", [Refusal("x", gone=True), Refusal("x", final=True),
                                     Refusal("unknown op 'z'", unknown_op=True), Refusal("too big", refused="size"),
                                     Refusal("plain")])
def test_refusal_round_trips_each_flag(refusal):
    """A caller acts on the flag (gone: not a failure; final: stop polling; unknown_op: the peer
    lacks a feature; refused: the transport's reason): each must survive the wire."""
    wire = msgpack.unpackb(_bytes(refusal.encode()), raw=False)
    assert Refusal.decode(wire) == refusal


def test_is_mla_survives_the_wire():
    hello = Hello(rank=0, tp_size=1, num_kv_heads=1, is_mla=True, layout="LBNC", dtype="bfloat16",
                  block_shape=(16, 576))
    assert Hello.decode(msgpack.unpackb(_bytes(hello.encode()), raw=False)).is_mla is True
    header = _header(is_mla=True)
    assert PutHeader.decode(msgpack.unpackb(_bytes(header.encode()), raw=False)).is_mla is True


def test_put_header_without_first_block_covers_the_prompt_from_block_0():
    """A sender from before first_block existed ships every block from 0."""
    old = {k: v for k, v in _old_put().items() if k != "first_block"}
    assert PutHeader.decode(old).first_block == 0


@pytest.mark.parametrize("bad, why", [
    ({"op": "get", "key": "k"}, "not a put: op='get'"),
    ({**_old_put(), "num_tokens": "40"}, "malformed put header: TypeError: expected an int, got str"),
    ({**_old_put(), "layers": [1, 2]}, "malformed put header: TypeError: expected a str, got int"),
    ({**_old_put(), "part": [0]}, r"malformed put header: TypeError: expected two ints, got \[0\]"),
    ({k: v for k, v in _old_put().items() if k != "runs"}, "malformed put header: KeyError: 'runs'"),
])
def test_put_header_refusal_names_what_is_wrong(bad, why):
    """D logs and returns this reason to P: it must name the field's fault, not be empty."""
    with pytest.raises(ValueError, match=f"^{why}$"):
        PutHeader.decode(bad)


def test_hello_refusal_names_what_is_wrong():
    wire = Hello(rank=1, tp_size=2, num_kv_heads=4, is_mla=False, layout="LBHNC", dtype="float16",
                 block_shape=(2, 16, 64)).encode()
    with pytest.raises(ValueError, match="^malformed hello: TypeError: expected an int, got str$"):
        Hello.decode({**wire, "rank": "1"})


@pytest.mark.parametrize("theirs, said", [
    (None, "sends no kv protocol version (an xPyD from before versions)"),
    (kt.KV_PROTOCOL_VERSION + 1, f"speaks kv protocol version {kt.KV_PROTOCOL_VERSION + 1}"),
    (True, "speaks kv protocol version True"),  # a bool is no version, though True == 1
])
def test_version_mismatch_tells_the_operator_what_to_do(theirs, said):
    """The one line an operator gets when P and D run different releases: it names both versions
    and the fix."""
    assert kt.version_mismatch(theirs) == (
        f"kv protocol mismatch: the peer {said}, this instance speaks version {kt.KV_PROTOCOL_VERSION}; "
        "run the same xPyD release on prefill and decode")
    assert kt.version_mismatch(kt.KV_PROTOCOL_VERSION) is None


# ---- the requests (reserve, get, release, ready, abort, ping): typed, the same bytes as the old literals

KEY = "___prefill_addr_127.0.0.1:21001___decode_addr_127.0.0.1:22001_0123abcd-0"
# Each request as producer.py, consumer.py and scheduler.py wrote it as a dict literal before it was typed.
OLD_LITERALS = [
    (Reserve(KEY, 4096), {"op": "reserve", "key": KEY, "nbytes": 4096}),
    (Reserve(KEY, 0), {"op": "reserve", "key": KEY, "nbytes": 0}),
    (Get(KEY), {"op": "get", "key": KEY}),
    (Release(KEY), {"op": "release", "key": KEY}),
    (Ready(KEY), {"op": "ready", "key": KEY}),
    (Abort({KEY: "sender gave up: deadline", "k2": "x"}), {"op": "abort", "keys": {KEY: "sender gave up: deadline",
                                                                                  "k2": "x"}}),
    (Ping(), {"op": "ping"}),
]


@pytest.mark.parametrize(("msg", "old"), OLD_LITERALS, ids=lambda x: type(x).__name__)
def test_request_bytes_are_the_old_literal_s(msg, old):
    assert _bytes(msg.encode()) == _bytes(old)


@pytest.mark.parametrize(("msg", "old"), OLD_LITERALS, ids=lambda x: type(x).__name__)
def test_request_round_trips_through_msgpack(msg, old):
    wire = msgpack.unpackb(_bytes(msg.encode()), raw=False)
    assert type(msg).decode(wire) == msg


@pytest.mark.parametrize(("cls", "bad", "why"), [
    (Reserve, {"op": "reserve", "nbytes": 1}, "reserve without key"),
    (Reserve, {"op": "reserve", "key": 7, "nbytes": 1}, "reserve without key"),
    (Reserve, {"op": "reserve", "key": KEY}, "reserve needs nbytes"),
    (Reserve, {"op": "reserve", "key": KEY, "nbytes": -1}, "reserve needs nbytes"),
    (Reserve, {"op": "reserve", "key": KEY, "nbytes": 1.0}, "reserve needs nbytes"),
    (Reserve, {"op": "reserve", "key": KEY, "nbytes": True}, "reserve needs nbytes"),  # bool is no byte count
    (Reserve, {"op": "get", "key": KEY, "nbytes": 1}, "op 'get' is not 'reserve'"),
    (Get, {"op": "get"}, "get without key"),
    (Get, {"op": "get", "key": b"k"}, "get without key"),
    (Get, {"op": "release", "key": KEY}, "op 'release' is not 'get'"),
    (Release, {"op": "release", "key": None}, "release without key"),
    (Release, {"key": KEY}, "op None is not 'release'"),
    (Ready, {"op": "ready", "key": ["k"]}, "ready without key"),
    (Ready, {"op": "ready"}, "ready without key"),
    (Abort, {"op": "abort"}, "abort needs keys"),
    (Abort, {"op": "abort", "keys": [KEY]}, "abort needs keys"),
    (Abort, {"op": "ping", "keys": {}}, "op 'ping' is not 'abort'"),
    (Ping, {"op": "pong"}, "op 'pong' is not 'ping'"),
])
def test_request_decode_refuses_a_malformed_message(cls, bad, why):
    with pytest.raises(ValueError) as e:
        cls.decode(bad)
    assert str(e.value) == why


def test_abort_keeps_the_entries_it_can_use():
    """One bad entry fails no other transfer: a key that is no string is dropped, a reason made one."""
    got = Abort.decode({"op": "abort", "keys": {KEY: "gone", 5: "x", "k2": 3}})
    assert got == Abort({KEY: "gone", "k2": "3"})


def test_ready_answer_and_its_reading():
    assert Ready.answer(True) == {"ok": True, "ready": True} and Ready.is_ready(Ready.answer(True))
    assert not Ready.is_ready(Ready.answer(False))
    assert not Ready.is_ready(Refusal("ready without key").encode())
    assert not Ready.is_ready({"ok": True, "ready": 1})  # only True is ready

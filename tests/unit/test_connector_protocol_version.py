"""The KV protocol's version (xpyd_wire.kv_transfer.KV_PROTOCOL_VERSION), exchanged in the hello:
real engines on loopback; a peer of another version (or of none: an xPyD from before versions)
is played by a relay in front of a real engine that rewrites the version in what passes."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from connector.transport.tcp import TcpTransport
from tests.support.connector_log import connector_log
from tests.support.kv_engines import (
    SRC_IDS,
    assert_untouched,
    load_spec,
    plan_load,
    poll_until,
    rank0,
    save_spec,
    snapshot,
    wait_for,
)
from tests.support.kv_fronts import ForwardingPeer
from xpyd_wire.kv_transfer import KV_PROTOCOL_VERSION, VERSION_KEY, Hello, Op, version_mismatch

Rewrite = Callable[[dict], dict]


class Relay(ForwardingPeer):
    """In front of an engine's KV port: ``on_request`` / ``on_reply`` rewrite the hello on its
    way (a peer of another version); counts the ops."""

    def __init__(self, target: str, on_request: Rewrite = dict, on_reply: Rewrite = dict) -> None:
        self.on_request, self.on_reply = on_request, on_reply
        self.ops: list[str] = []
        super().__init__(target)

    def _handle(self, header: dict, tensors: list) -> tuple[dict, list]:
        op = header.get("op")
        self.ops.append(op)
        if op != Op.HELLO:
            return self.forward(header, tensors)
        reply, out = self.forward(self.on_request(dict(header)), tensors)
        return self.on_reply(dict(reply)), out


def _with_version(version: object) -> Rewrite:
    def rewrite(msg: dict) -> dict:
        if version is None:
            msg.pop(VERSION_KEY, None)
        else:
            msg[VERSION_KEY] = version
        return msg
    return rewrite


def test_engines_of_one_version_say_it_in_the_hello(engines):
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    reply, _ = prod._transport.call(rank0(cons), Hello.request(), timeout_s=5)
    assert reply["ok"] is True and reply[VERSION_KEY] == KV_PROTOCOL_VERSION
    assert Hello.decode(reply).version == KV_PROTOCOL_VERSION
    assert version_mismatch(reply[VERSION_KEY]) is None


@pytest.mark.parametrize("theirs", [KV_PROTOCOL_VERSION + 1, None, "1"], ids=["newer", "unversioned", "a-string"])
def test_a_prefill_refuses_a_decode_of_another_protocol_version(engines, theirs):
    """P asks D hello; D's answer says another version (or none): P ships nothing there, fails
    the send at once and says why in one ERROR line naming both versions."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    relay = Relay(rank0(cons), on_reply=_with_version(theirs))
    try:
        before = snapshot(cons.caches)
        with connector_log() as lines:
            prod.save(save_spec(prod, relay.address))
            res, _ = poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        assert res.finished_sending == {"P-req"}
        assert prod.xfer_stats.peek().data["failures"].get("send/invalid") == 1
        # no reserve, no put: not one byte of KV went (D is told the transfer will not come)
        assert relay.ops[0] == Op.HELLO and not {Op.RESERVE, Op.PUT} & set(relay.ops), relay.ops
        assert_untouched(cons, before)
        said = "sends no kv protocol version" if theirs is None else f"speaks kv protocol version {theirs!r}"
        refused = [line for line in lines.lines if "cannot take KV from this instance" in line]
        assert len(refused) == 1, lines.lines
        assert said in refused[0] and f"this instance speaks version {KV_PROTOCOL_VERSION}" in refused[0]
    finally:
        relay.close()


def test_a_decode_refuses_a_hello_of_another_protocol_version(engines, caplog):
    """The other way round: P's hello says another version; D refuses it with a log line, P
    reports D's answer and ships nothing. A hello without a version is answered (tools ask it)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    newer = KV_PROTOCOL_VERSION + 1
    relay = Relay(rank0(cons), on_request=_with_version(newer))
    try:
        with caplog.at_level(logging.ERROR, logger="vllm.xpyd.connector.p2p.engine"), connector_log() as lines:
            prod.save(save_spec(prod, relay.address))
            res, _ = poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        assert relay.ops[0] == Op.HELLO and not {Op.RESERVE, Op.PUT} & set(relay.ops), relay.ops
        assert prod.xfer_stats.peek().data["failures"].get("send/invalid") == 1
        d_line = [r.getMessage() for r in caplog.records if "refused a hello" in r.getMessage()]
        assert len(d_line) == 1 and f"the peer speaks kv protocol version {newer}" in d_line[0]
        p_line = [line for line in lines.lines if "cannot take KV" in line]
        assert len(p_line) == 1 and f"it speaks kv protocol version {KV_PROTOCOL_VERSION}, the hello said {newer}" \
            in p_line[0]
    finally:
        relay.close()
    client = TcpTransport()
    try:
        reply, _ = client.call(rank0(cons), {"op": Op.HELLO}, timeout_s=5)
        assert reply["ok"] is True and reply[VERSION_KEY] == KV_PROTOCOL_VERSION
    finally:
        client.close()


def test_the_same_pair_ships_kv_once_the_versions_agree(engines):
    """The relay itself changes nothing: with the version left alone the KV arrives through it."""
    from tests.support.kv_engines import assert_loaded

    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    relay = Relay(rank0(cons))
    try:
        before = snapshot(cons.caches)
        prod.save(save_spec(prod, relay.address))
        plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
        res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
        assert res.failed_recving == set()
        assert_loaded(cons, before, prod, (7, 2, 11), SRC_IDS[2:])
        wait_for(lambda: Op.PUT in relay.ops)
    finally:
        relay.close()

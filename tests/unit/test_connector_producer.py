"""The producer half of the KV engine (connector/producer.py), on two real KVEngines over
loopback: what a preemption waits for and counts, what a failed first contact logs, counts
and tells D, and the per-layer progress a layer-wise send reads."""

from __future__ import annotations

import re
import threading
import time

from connector.producer import LayerProgress
from connector.transport.tcp import TcpTransport
from tests.support.connector_log import connector_log
from tests.support.kv_engines import KEY, make_caches, poll_until, rank0, save_spec, wait_for
from tests.support.layerwise import LAYERS

SECRET = "a test kv secret"


class SlowPut:
    """Stands in front of a decode engine's KV port (the other side of the boundary): forwards
    every call to it, but answers each put only ``delay_s`` after it came; records the keys."""

    def __init__(self, target: str, delay_s: float) -> None:
        self.target = target
        self.delay_s = delay_s
        self.put_started = threading.Event()
        self.put_answered = threading.Event()
        self.keys: list[str] = []
        self._client = TcpTransport()
        self._server = TcpTransport()
        self._server.start("127.0.0.1", 0, self._handle)
        self.address = f"127.0.0.1:{self._server.bound_port}"

    def _handle(self, header: dict, tensors: list) -> tuple[dict, list]:
        if header.get("op") == "put":
            self.keys.append(header.get("key"))
            self.put_started.set()
            time.sleep(self.delay_s)
        reply = self._client.call(self.target, header, tensors, timeout_s=10)
        if header.get("op") == "put":
            self.put_answered.set()
        return reply

    def close(self) -> None:
        self._server.close()
        self._client.close()


def test_layer_progress_hands_out_each_layers_event():
    """The event of the last layer written is what the send waits on before reading it."""
    lp = LayerProgress(3)
    assert lp.written() == (0, None)
    lp.advance(0, "e0")
    lp.advance(2, "e2")  # out of order: left to the seal
    assert lp.written() == (1, "e0")
    lp.advance(1, "e1")
    assert lp.written() == (2, "e1") and lp.sealed_at is None
    lp.seal("end")
    lp.advance(2, "late")  # after the seal: ignored
    assert lp.written() == (3, "end") and lp.events == ["e0", "e1", "end"] and lp.reported == 2


def test_producer_save_layer_keeps_the_event_it_is_given(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer", send_timeout_s=0.2)
    spec = save_spec(prod, "127.0.0.1:1")  # nobody: the send never gets past first contact
    prod.producer.save_layer(spec, 0, "written-0")
    assert prod.producer._sends["P-req"].layers.written() == (1, "written-0")


def test_preemption_waits_for_a_send_on_the_wire(engines):
    """A send already shipping when its request is preempted is waited for (its blocks are
    read until D answered), not cancelled, and not counted as cancelled."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=3.0)
    front = SlowPut(rank0(cons), delay_s=2.3)
    try:
        prod.save(save_spec(prod, front.address))
        assert front.put_started.wait(10)
        with connector_log() as lines:
            prod.wait_sends(["P-req"])
        assert front.put_answered.is_set()  # returned only once D had answered
        assert prod.xfer_stats.peek().transfers("send", "cancelled") == 0
        assert not [x for x in lines.lines if "still running" in x]
        assert prod.poll({"P-req"}).finished_sending == set()  # forgotten: vLLM frees the blocks
        assert cons.stats()["recv_items"] == 1
    finally:
        front.close()


def test_preemption_cancels_queued_sends_and_counts_them(engines):
    """Queued sends of preempted requests never start and are counted as cancelled; an id
    without a send (never saved, or already reported) is skipped, not the end of the list."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=5.0)
    front = SlowPut(rank0(cons), delay_s=0.5)
    try:
        prod.save(save_spec(prod, front.address, req_id="first", key="a" * 32))
        assert front.put_started.wait(10)  # the sender is busy with "first"
        prod.save(save_spec(prod, front.address, req_id="victim", key="b" * 32))
        prod.save(save_spec(prod, front.address, req_id="victim2", key="c" * 32))
        prod.wait_sends(["unknown", "victim", "victim2"])
        assert prod.xfer_stats.peek().transfers("send", "cancelled") == 2
        poll_until(prod, lambda r: "first" in r.finished_sending, finished={"first"})
        time.sleep(0.2)  # a cancelled send that started anyway would be on its way now
        assert front.keys == ["a" * 32]
    finally:
        front.close()


def test_preemption_gives_up_on_a_send_past_its_deadline(engines):
    """A layer-wise send waits for layers the forward pass has not written: a preemption
    waits send_timeout + 1 s for it, then logs it and returns (vLLM must go on)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer", send_timeout_s=0.3)
    spec = save_spec(prod, rank0(cons))
    prod.save_layer(spec, LAYERS[0])
    wait_for(lambda: cons.stats()["partial_payloads"] == 1)  # layer 0 went; layer 1 never comes
    with connector_log() as lines:
        t0 = time.monotonic()
        prod.wait_sends(["P-req"])
        took = time.monotonic() - t0
    assert 1.3 * 0.95 <= took < 1.3 + 0.6
    assert "kv send still running after its deadline req=P-req" in lines.lines
    assert prod.xfer_stats.peek().transfers("send", "cancelled") == 0


def test_a_decode_that_cannot_take_our_kv_is_told_and_logged(engines):
    """First contact finds another block shape: the send fails before any byte, counted as
    invalid, logged with its reason, and D is told the transfer will not come (same reason)."""
    cons = engines("kv_consumer", "PUT_ASYNC", caches=make_caches(2, shape=(16, 2, 16, 32)))
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    with connector_log() as lines:
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        wait_for(lambda: cons.recv_buffer.failure(KEY) is not None)
    told = cons.recv_buffer.failure(KEY)
    assert told.startswith("sender gave up: ") and told != "sender gave up: None"
    why = told.removeprefix("sender gave up: ")
    assert f"kv send failed req=P-req transfer={KEY} peer={rank0(cons)} error={why}" in lines.lines
    assert prod.xfer_stats.peek().failures("send", "invalid") == 1
    assert prod.xfer_stats.peek().failures("send", "refused") == 0
    assert cons.stats()["recv_items"] == 0


def test_a_decode_that_refuses_the_call_is_counted_as_refused(engines):
    """D requires a kv_secret P does not have: its hello is refused before any handler, so
    the send counts as refused, and P tells D nothing (D knows and logs it)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_secret=SECRET)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    with connector_log() as lines:
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    assert prod.xfer_stats.peek().failures("send", "refused") == 1
    assert prod.xfer_stats.peek().failures("send", "invalid") == 0
    failed = [x for x in lines.lines if x.startswith("kv send failed req=P-req ")]
    assert len(failed) == 1 and re.search(r"error=refused the call: \S", failed[0]), failed
    time.sleep(0.3)  # an abort notice would be on its way now
    assert cons.recv_buffer.failure(KEY) is None

"""The producer half of the KV engine (connector/p2p/producer.py), on two real KVEngines over
loopback: what a preemption waits for and counts, what a failed first contact logs, counts
and tells D, and the per-layer progress a layer-wise send reads."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from connector.p2p.producer import LayerProgress
from connector.transport.base import Deferred
from tests.support.connector_log import connector_log
from tests.support.kv_engines import (
    KEY,
    N_PROMPT,
    SRC_IDS,
    make_caches,
    poll_until,
    rank0,
    save_spec,
    tp_instance,
    wait_for,
)
from tests.support.kv_fronts import ForwardingPeer, SlowHello
from tests.support.layerwise import LAYERS
from tests.support.ports import dead_port, spare_port

SECRET = "a test kv secret"


class SlowPut(ForwardingPeer):
    """In front of a decode engine's KV port: answers each put only ``delay_s`` after it came;
    records the keys."""

    def __init__(self, target: str, delay_s: float) -> None:
        self.delay_s = delay_s
        self.put_started = threading.Event()
        self.put_answered = threading.Event()
        self.keys: list[str] = []
        super().__init__(target)

    def _handle(self, header: dict, tensors: list) -> tuple[dict, list]:
        if header.get("op") == "put":
            self.keys.append(header.get("key"))
            self.put_started.set()
            time.sleep(self.delay_s)
        reply = self.forward(header, tensors)
        if header.get("op") == "put":
            self.put_answered.set()
        return reply


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
    """D requires a kv_secret P does not have: P's connection is refused at its handshake, so
    the send counts as refused, and P tells D nothing (D knows and logs it)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_secret=SECRET)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    with connector_log() as lines:
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    assert prod.xfer_stats.peek().failures("send", "refused") == 1
    assert prod.xfer_stats.peek().failures("send", "invalid") == 0
    failed = [x for x in lines.lines if x.startswith("kv send failed req=P-req ")]
    assert len(failed) == 1 and " refused the connection at its handshake: " in failed[0], failed
    time.sleep(0.3)  # an abort notice would be on its way now
    assert cons.recv_buffer.failure(KEY) is None


# ---- what each send outcome logs and counts (operators grep these lines)

BLOCK_BYTES = 2 * 16 * 64 * 2  # one block of one layer: [2 heads, 16 tokens, 64] bf16
PHASE = r"\d+\.\d"


def test_a_send_logs_what_it_sent_and_where_its_time_went(engines):
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request")  # one payload
    prod.xfer_stats.legs = True  # tracing on: the send's numbers go to the scheduler for its span
    with connector_log() as lines:
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    nbytes = len(SRC_IDS) * BLOCK_BYTES * 2
    sent = [x for x in lines.lines if x.startswith("kv sent")]
    assert len(sent) == 1 and re.fullmatch(
        rf"kv sent req=P-req transfer={KEY} tokens={N_PROMPT} blocks={len(SRC_IDS)} bytes={nbytes} "
        rf"peer={rank0(cons)} ranks=1 ms={PHASE} "
        rf"phases_ms=queue:{PHASE},contact:{PHASE},build:{PHASE},reserve:{PHASE},put:{PHASE}",
        sent[0],
    ), sent
    assert (
        [x for x in lines.lines if x.startswith("kv peer ")]
        == [x for x in lines.lines if re.fullmatch(rf"kv peer {rank0(cons)} first contact ms={PHASE}", x)]
        != []
    )
    stats = prod.xfer_stats.peek()
    assert stats.transfers("send", "ok") == 1 and stats.nbytes("sent") == nbytes
    # The span's numbers are the log line's: bytes and ms.
    (leg,) = stats.data["legs"]
    logged_ms = float(re.search(r" ms=(\S+) ", sent[0]).group(1))
    assert leg[:4] == ["send", "P-req", "ok", nbytes] and round(leg[4], 1) == logged_ms, (leg, sent)


def test_a_slow_send_is_logged_as_slow_at_warning(engines, caplog):
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=5.0)
    front = SlowPut(rank0(cons), delay_s=1.1)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.xpyd.connector.p2p.producer"):
            prod.save(save_spec(prod, front.address))
            poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        sent = [r for r in caplog.records if r.getMessage().startswith("kv sent")]
        assert len(sent) == 1 and sent[0].levelno == logging.WARNING
        assert sent[0].getMessage().startswith("kv sent slowly req=P-req ")
    finally:
        front.close()


def test_a_send_refused_by_a_full_decode_buffer_is_logged_and_counted(engines):
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_buffer_size=1000)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    prod.xfer_stats.legs = True
    with connector_log() as lines:
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    refused = [x for x in lines.lines if x.startswith("kv send refused")]
    assert len(refused) == 1 and refused[0].startswith(
        f"kv send refused req=P-req transfer={KEY} peer={rank0(cons)} error="
    ), refused
    assert refused[0].partition(" error=")[2] not in ("", "None")
    stats = prod.xfer_stats.peek()
    assert stats.failures("send", "refused") == 1 and stats.transfers("send", "ok") == 0
    assert not [x for x in lines.lines if x.startswith("kv sent")]
    assert [leg[:3] + leg[6:7] for leg in stats.data["legs"]] == [["send", "P-req", "failed", "not_taken"]]


def test_a_dead_decode_is_logged_counted_and_told_once_it_is_back(engines):
    """The first send meets no D: a transport failure, the peer marked dead; the one queued
    behind it fails at once as unreachable. Once D is up, a probe says so and D hears that
    neither transfer will come."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=0.3)
    port = spare_port()
    addr = f"127.0.0.1:{port}"
    with connector_log() as lines:
        prod.save(save_spec(prod, addr, req_id="first", key="a" * 32))
        prod.save(save_spec(prod, addr, req_id="second", key="b" * 32))
        poll_until(prod, lambda r: {"first", "second"} <= r.finished_sending, finished={"first", "second"})
        stats = prod.xfer_stats.peek()
        assert stats.failures("send", "transport") == 1 and stats.failures("send", "unreachable") == 1
        assert [x for x in lines.lines if x.startswith(f"kv peer {addr} marked dead: ")] != []
        first = [x for x in lines.lines if x.startswith("kv send failed req=first ")]
        assert len(first) == 1 and re.fullmatch(
            rf"kv send failed req=first transfer={'a' * 32} peer={addr} error=.+ "
            rf"phases_ms=queue:{PHASE}(,\w+:{PHASE})*",
            first[0],
        ), first
        second = [x for x in lines.lines if x.startswith("kv send failed req=second ")]
        assert len(second) == 1 and re.fullmatch(
            rf"kv send failed req=second transfer={'b' * 32} peer={addr} error=peer {addr} unreachable since "
            rf"{PHASE}s",
            second[0],
        ), second
        cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_port=port)
        wait_for(lambda: cons.recv_buffer.failure("b" * 32) is not None)
        wait_for(lambda: cons.recv_buffer.failure("a" * 32) is not None)
        assert [x for x in lines.lines if re.fullmatch(rf"kv peer {addr} answers again after {PHASE}s", x)] != []
    assert (
        cons.recv_buffer.failure("b" * 32)
        == f"sender gave up: peer {addr} unreachable since " + (second[0].rpartition("unreachable since ")[2])
    )
    assert prod.producer.peer(addr).dead_since is None


def test_a_get_copy_that_does_not_fit_is_refused_at_once(engines, kv_client):
    """GET: P's own buffer cannot hold the copy: logged, counted, and D's GET hears why."""
    prod = engines("kv_producer", "GET", seed=1, kv_buffer_size=1000)
    with connector_log() as lines:
        prod.save(save_spec(prod, "127.0.0.1:1", delay_free=False))
    said = [x for x in lines.lines if x.startswith("GET buffer refused")]
    assert len(said) == 1 and said[0].startswith(f"GET buffer refused transfer={KEY} reason="), said
    why = said[0].partition(" reason=")[2]
    assert why not in ("", "None")
    assert prod.xfer_stats.peek().failures("send", "refused") == 1
    reply, _ = kv_client.call(rank0(prod), {"op": "get", "key": KEY}, timeout_s=10)
    assert reply["ok"] is False and reply["error"] == why


def test_first_contact_ahead_of_the_send_that_fails_is_logged(engines):
    """PUT_ASYNC: the scheduler announced a D that does not answer; the early contact fails
    (the send will try again within its own deadline) and says so."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=0.3)
    dead = f"127.0.0.1:{dead_port()}"
    with connector_log() as lines:
        prod.producer.prepare(dead)
        wait_for(lambda: any("first contact ahead of the send failed" in x for x in lines.lines))
    said = [x for x in lines.lines if "first contact ahead of the send failed" in x]
    assert len(said) == 1 and said[0].startswith(f"kv peer {dead}: first contact ahead of the send failed: peer "), said
    assert not prod.producer.peer(dead).contacted


@pytest.mark.parametrize("granularity", ["request", "layer"])
def test_a_send_that_raises_is_logged_counted_and_told(engines, granularity):
    """A bug in one send (here: a block id outside the cache) is an error: logged with its
    traceback, counted, and D hears the exception; the sender thread goes on."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity=granularity)
    bad = "f" * 32
    with connector_log() as lines:
        spec = save_spec(prod, rank0(cons), req_id="bad", key=bad, block_ids=(3, 99))
        prod.save(spec)
        poll_until(prod, lambda r: "bad" in r.finished_sending, finished={"bad"})
        wait_for(lambda: cons.recv_buffer.failure(bad) is not None)
    assert f"kv send failed req=bad transfer={bad} peer={rank0(cons)}" in lines.lines
    assert cons.recv_buffer.failure(bad).startswith("sender gave up: IndexError: ")
    stats = prod.xfer_stats.peek()
    assert stats.failures("send", "error") == 1 and stats.failures("send", "transport") == 0


def test_a_get_copy_pushed_out_by_a_newer_one_is_counted(engines):
    """GET: P's buffer keeps the newest copies; one pushed out unread counts as evicted."""
    prod = engines("kv_producer", "GET", seed=1, kv_buffer_size=len(SRC_IDS) * BLOCK_BYTES * 2 + 100)
    prod.save(save_spec(prod, "127.0.0.1:1", req_id="old", key="a" * 32, delay_free=False))
    assert prod.xfer_stats.peek().failures("send", "evicted") == 0
    prod.save(save_spec(prod, "127.0.0.1:1", req_id="new", key="b" * 32, delay_free=False))
    assert prod.xfer_stats.peek().failures("send", "evicted") == 1
    assert prod.stats()["send_items"] == 1


def test_a_put_to_a_decode_marked_dead_fails_at_once(engines):
    """PUT (the worker thread sends): once a send found D dead, the next one fails at once,
    logged as unreachable since when, instead of waiting out another send_timeout."""
    prod = engines("kv_producer", "PUT", seed=1, send_timeout_s=2.0)
    dead = f"127.0.0.1:{dead_port()}"
    prod.save(save_spec(prod, dead, req_id="first", key="a" * 32, delay_free=False))
    assert prod.producer.peer(dead).dead_since is not None
    with connector_log() as lines:
        t0 = time.monotonic()
        prod.save(save_spec(prod, dead, req_id="second", key="b" * 32, delay_free=False))
        assert time.monotonic() - t0 < 1.5  # at once, not another 2 s (slack for a loaded box)
    said = [x for x in lines.lines if x.startswith("kv send failed req=second ")]
    assert len(said) == 1, lines.lines
    m = re.fullmatch(
        rf"kv send failed req=second transfer={'b' * 32} peer={dead} error=peer {dead} unreachable since (\d+\.\d)s",
        said[0],
    )
    assert m and float(m.group(1)) < 60, said
    assert prod.xfer_stats.peek().failures("send", "unreachable") == 1


def test_layer_wise_sends_queued_behind_one_on_its_way_join_it(engines):
    """Two prompts whose forward pass starts while a first one's layers are on their way join
    its cohort: all three complete, each logged with its own queue time."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer")
    specs = [save_spec(prod, rank0(cons), req_id=f"r{i}", key=f"{i:032x}") for i in range(3)]
    with connector_log() as lines:
        prod.save_layer(specs[0], LAYERS[0])
        wait_for(lambda: cons.stats()["partial_payloads"] == 1)  # r0 is on its way, waiting for layer 1
        for spec in specs[1:]:
            prod.save_layer(spec, LAYERS[0])
        wait_for(lambda: cons.stats()["partial_payloads"] == 3)
        for spec in specs:
            prod.save_layer(spec, LAYERS[1])
            prod.save(spec)
        poll_until(prod, lambda r: {"r0", "r1", "r2"} <= r.finished_sending, finished={"r0", "r1", "r2"})
    assert cons.stats()["recv_items"] == 3
    sent = {re.search(r"req=(\S+)", x).group(1): x for x in lines.lines if x.startswith("kv sent")}
    assert set(sent) == {"r0", "r1", "r2"}
    for rid, line in sent.items():
        assert re.search(rf" phases_ms=queue:{PHASE},", line), (rid, line)
    assert prod.xfer_stats.peek().transfers("send", "ok") == 3


def test_a_cohort_is_capped(engines, monkeypatch):
    """At most MAX_COHORT layer-wise sends ship together (2 here): the next one waits for
    the cohort to end instead of joining it."""
    from connector.p2p import producer

    monkeypatch.setattr(producer, "MAX_COHORT", 2)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer")
    specs = [save_spec(prod, rank0(cons), req_id=f"r{i}", key=f"{i:032x}") for i in range(3)]
    prod.save_layer(specs[0], LAYERS[0])
    wait_for(lambda: cons.stats()["partial_payloads"] == 1)
    for spec in specs[1:]:
        prod.save_layer(spec, LAYERS[0])
    wait_for(lambda: cons.stats()["partial_payloads"] == 2)
    time.sleep(0.3)  # a third member would have shipped its layer 0 by now
    assert cons.stats()["partial_payloads"] == 2
    for spec in specs:
        prod.save_layer(spec, LAYERS[1])
        prod.save(spec)
    poll_until(prod, lambda r: {"r0", "r1", "r2"} <= r.finished_sending, finished={"r0", "r1", "r2"})
    assert cons.stats()["recv_items"] == 3


def test_no_early_contact_is_asked_of_a_decode_marked_dead(engines):
    """The scheduler announces a D the sender found dead: no hello ahead of the send, neither
    now nor once a probe finds D back (the next send makes first contact)."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=0.3)
    port = spare_port()
    addr = f"127.0.0.1:{port}"
    prod.save(save_spec(prod, addr, req_id="lost", key="a" * 32))
    poll_until(prod, lambda r: "lost" in r.finished_sending, finished={"lost"})
    peer = prod.producer.peer(addr)
    assert peer.dead_since is not None
    prod.producer.prepare(addr)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_port=port)
    wait_for(lambda: peer.dead_since is None)  # a probe got through
    wait_for(lambda: cons.recv_buffer.failure("a" * 32) is not None)  # the notice, delivered after it
    time.sleep(0.3)  # an early contact would have been made by now
    assert not peer.contacted


# ---- whole-request sends (send_granularity "request": one payload per decode rank)


def test_a_request_send_to_a_decode_that_cannot_take_our_kv_is_told_and_logged(engines):
    """As for a layer-wise send: first contact finds another block shape, the send fails
    before any byte, counted as invalid, logged with its reason, and D hears the same reason."""
    cons = engines("kv_consumer", "PUT_ASYNC", caches=make_caches(2, shape=(16, 2, 16, 32)))
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request")
    with connector_log() as lines:
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        wait_for(lambda: cons.recv_buffer.failure(KEY) is not None)
    why = cons.recv_buffer.failure(KEY).removeprefix("sender gave up: ")
    assert why.startswith("peer cannot take this KV: "), why
    assert f"kv send failed req=P-req transfer={KEY} peer={rank0(cons)} error={why}" in lines.lines
    stats = prod.xfer_stats.peek()
    assert stats.failures("send", "invalid") == 1 and stats.failures("send", "error") == 0
    assert cons.stats()["recv_items"] == 0


def test_a_request_send_waits_for_a_slow_decode_within_send_timeout(engines):
    """D answers each put 0.3 s late, well inside send_timeout_s: the send goes through, and
    its log counts the wait (not slow: under SLOW_SEND_S)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request", send_timeout_s=5.0)
    front = SlowPut(rank0(cons), delay_s=0.3)
    try:
        with connector_log() as lines:
            prod.save(save_spec(prod, front.address))
            poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        (sent,) = [x for x in lines.lines if x.startswith("kv sent")]
        m = re.fullmatch(rf"kv sent req=P-req transfer={KEY} .* ms=(\d+\.\d) phases_ms=.*,put:(\d+\.\d)", sent)
        assert m, sent
        assert 300 <= float(m.group(2)) <= float(m.group(1)), sent
        assert prod.xfer_stats.peek().transfers("send", "ok") == 1 and cons.stats()["recv_items"] == 1
    finally:
        front.close()


def test_a_request_send_to_a_decode_that_refuses_the_call_is_counted_as_refused(engines):
    """D requires a kv_secret P does not have: the connection is refused at its handshake, the
    send counts as refused (not invalid), and P tells D nothing (D knows and logs it)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_secret=SECRET)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request")
    with connector_log() as lines:
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    stats = prod.xfer_stats.peek()
    assert stats.failures("send", "refused") == 1 and stats.failures("send", "invalid") == 0
    failed = [x for x in lines.lines if x.startswith("kv send failed req=P-req ")]
    assert len(failed) == 1 and " refused the connection at its handshake: " in failed[0], failed
    assert not prod.producer.peer(rank0(cons))._notices  # nothing to tell D


def test_a_request_send_refused_by_a_full_decode_buffer_is_not_counted_as_sent(engines):
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_buffer_size=1000)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request")
    with connector_log() as lines:
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    refused = [x for x in lines.lines if x.startswith("kv send refused")]
    assert len(refused) == 1 and refused[0].startswith(f"kv send refused req=P-req transfer={KEY} "), refused
    stats = prod.xfer_stats.peek()
    assert stats.failures("send", "refused") == 1 and stats.transfers("send", "ok") == 0
    assert stats.nbytes("sent") == 0 and not [x for x in lines.lines if x.startswith("kv sent")]


def test_a_request_send_to_a_dead_decode_marks_it_dead_saying_why(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request", send_timeout_s=0.3)
    addr = f"127.0.0.1:{dead_port()}"
    with connector_log() as lines:
        prod.save(save_spec(prod, addr))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    (failed,) = [x for x in lines.lines if x.startswith("kv send failed req=P-req ")]
    why = re.fullmatch(rf"kv send failed req=P-req transfer={KEY} peer={addr} error=(.+) phases_ms=.*", failed)
    assert why, failed
    assert f"kv peer {addr} marked dead: {why.group(1)}" in lines.lines, lines.lines
    assert prod.xfer_stats.peek().failures("send", "transport") == 1


def test_every_get_copy_pushed_out_is_counted(engines):
    """GET: each save counts the copies its own put pushed out, not the buffer's total."""
    one = len(SRC_IDS) * BLOCK_BYTES * 2
    prod = engines("kv_producer", "GET", seed=1, kv_buffer_size=one + 100)
    for i in range(4):
        prod.save(save_spec(prod, "127.0.0.1:1", req_id=f"r{i}", key=f"{i:032x}", delay_free=False))
        assert prod.xfer_stats.peek().failures("send", "evicted") == i
    assert prod.stats()["send_items"] == 1


def test_a_request_send_to_two_decode_ranks_counts_both_pieces(engines):
    """P tp=1 -> D tp=2 (whole requests): each D rank gets half the heads; the send's bytes
    (log line and counter) are both pieces together."""
    (prod,) = tp_instance("kv_producer", "PUT_ASYNC", 1, 4, seed=1, blocks_heads=4, send_granularity="request")
    dec = tp_instance("kv_consumer", "PUT_ASYNC", 2, 4, seed=2, blocks_heads=2)
    try:
        with connector_log() as lines:
            prod.save(save_spec(prod, rank0(dec[0])))
            poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        whole = len(SRC_IDS) * 2 * 4 * 16 * 64 * 2  # 5 blocks x 2 layers x 4 heads, bf16
        (sent,) = [x for x in lines.lines if x.startswith("kv sent")]
        assert f" bytes={whole} " in sent and " ranks=2 " in sent, sent
        assert prod.xfer_stats.peek().nbytes("sent") == whole
    finally:
        for eng in (prod, *dec):
            eng.close()


def test_an_idle_step_wakes_when_a_request_send_ends(engines):
    """A worker step with nothing to compute waits (poll's wait_s) for a transfer to move: a
    whole-request send ending wakes it, and the step reports the send."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request", send_timeout_s=5.0)
    front = SlowPut(rank0(cons), delay_s=0.3)
    try:
        prod.save(save_spec(prod, front.address))
        t0 = time.monotonic()
        res = prod.poll({"P-req"}, wait_s=8.0)
        took = time.monotonic() - t0
        assert res.finished_sending == {"P-req"}, res
        assert took < 5.0, took  # woken by the send, not the end of wait_s
    finally:
        front.close()


def test_a_request_send_that_fails_at_one_decode_rank_tells_only_that_rank(engines):
    """P tp=1 -> D tp=2 whose rank 1 is down: rank 0 takes its piece, the send fails at rank
    1 (transport), and only rank 1 is to hear that the transfer will not come; rank 0 holds
    its piece and is told nothing."""
    (prod,) = tp_instance(
        "kv_producer", "PUT_ASYNC", 1, 4, seed=1, blocks_heads=4, send_granularity="request", send_timeout_s=0.3
    )
    dec = tp_instance("kv_consumer", "PUT_ASYNC", 2, 4, seed=2, blocks_heads=2)
    dec[1].close()
    try:
        with connector_log() as lines:
            prod.save(save_spec(prod, rank0(dec[0])))
            poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
            # The peer thread probes rank 0 (it answers), then tries rank 1's notice (down again).
            mine = f"kv peer {rank0(dec[0])} marked dead: "  # not a peer an earlier test left behind
            wait_for(lambda: len([x for x in lines.lines if x.startswith(mine)]) >= 2)
        assert dec[0].stats()["recv_items"] == 1  # its piece is here
        assert dec[0].recv_buffer.failure(KEY) is None
        assert prod.xfer_stats.peek().failures("send", "transport") == 1
    finally:
        for eng in (prod, *dec):
            eng.close()


class SlowFirstAbort(ForwardingPeer):
    """In front of a decode engine's KV port: answers the first abort notice only ``delay_s``
    after it came (its one server thread is busy meanwhile); records each abort's keys."""

    def __init__(self, target: str, delay_s: float) -> None:
        self.delay_s = delay_s
        self.aborts: list[dict] = []
        super().__init__(target)

    def _handle(self, header: dict, tensors: list) -> tuple[dict, list]:
        if header.get("op") == "abort":
            self.aborts.append(header.get("keys"))
            if len(self.aborts) == 1:
                time.sleep(self.delay_s)
        return self.forward(header, tensors)


def test_an_abort_notice_the_decode_does_not_answer_in_2s_is_kept_and_sent_again(engines):
    """P tells D a transfer will not come (here: D cannot take our KV); D answers that notice
    only after 3.5 s. P waits at most min(send_timeout_s, 2 s), marks D dead, keeps the notice,
    and delivers it again once a probe finds D back."""
    cons = engines("kv_consumer", "PUT_ASYNC", caches=make_caches(2, shape=(16, 2, 16, 32)))
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=5.0)
    front = SlowFirstAbort(rank0(cons), delay_s=3.5)
    try:
        t0 = time.monotonic()
        with connector_log() as lines:
            prod.save(save_spec(prod, front.address))
            poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
            wait_for(lambda: len(front.aborts) >= 2, timeout=20.0)
            wait_for(lambda: prod.producer.peer(front.address).dead_since is None)
        took = time.monotonic() - t0
        # Only this D: a peer an earlier test left behind may be marked dead meanwhile.
        dead = [x for x in lines.lines if x.startswith(f"kv peer {front.address} marked dead: ")]
        assert dead and dead[0] == (
            f"kv peer {front.address} marked dead: timeout after 2s waiting for reply from {front.address}"
        ), dead
        back = [x for x in lines.lines if x.startswith(f"kv peer {front.address} answers again after ")]
        assert back and 0 <= float(back[0].rpartition(" after ")[2].removesuffix("s")) <= took, back
        assert front.aborts[1] == front.aborts[0] and list(front.aborts[0]) == [KEY], front.aborts
        assert cons.recv_buffer.failure(KEY).startswith("sender gave up: ")
    finally:
        front.close()


def test_a_decode_with_another_kv_secret_refuses_our_calls_and_is_counted_refused(engines):
    """P signs its calls, D holds another kv_secret: D refuses P's connection at its handshake,
    which ends the send as refused (no byte was taken), not as a transport failure."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_secret=SECRET)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, kv_secret="another kv secret")
    with connector_log() as lines:
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    stats = prod.xfer_stats.peek()
    assert stats.failures("send", "refused") == 1 and stats.failures("send", "transport") == 0
    failed = [x for x in lines.lines if x.startswith("kv send failed req=P-req ")]
    assert len(failed) == 1 and " refused the connection at its handshake: it refused this kv_secret" in failed[0], failed


def test_a_decode_back_from_the_dead_hears_the_transport_error(engines):
    """A whole-request send meets no D (a transport failure); once D is up, it hears that the
    transfer will not come, with the error P logged."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request", send_timeout_s=0.3)
    port = spare_port()
    addr = f"127.0.0.1:{port}"
    with connector_log() as lines:
        prod.save(save_spec(prod, addr))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_port=port)
        wait_for(lambda: cons.recv_buffer.failure(KEY) is not None)
    (failed,) = [x for x in lines.lines if x.startswith("kv send failed req=P-req ")]
    why = re.fullmatch(rf"kv send failed req=P-req transfer={KEY} peer={addr} error=(.+) phases_ms=.*", failed)
    assert why, failed
    assert cons.recv_buffer.failure(KEY) == f"sender gave up: {why.group(1)}"


def test_a_send_that_raises_logs_its_traceback(engines, caplog):
    """A bug in one send is logged at ERROR with the exception's traceback (exc_info)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request")
    with caplog.at_level(logging.INFO, logger="vllm.xpyd.connector.p2p.producer"):
        prod.save(save_spec(prod, rank0(cons), req_id="bad", key="f" * 32, block_ids=(3, 99)))
        poll_until(prod, lambda r: "bad" in r.finished_sending, finished={"bad"})
    (rec,) = [r for r in caplog.records if r.getMessage().startswith("kv send failed req=bad ")]
    assert rec.levelno == logging.ERROR and rec.exc_info is not None and rec.exc_info[0] is IndexError


def test_undelivered_abort_notices_are_capped_per_decode(engines, monkeypatch):
    """At most MAX_PENDING_NOTICES (2 here) "will not come" notices wait for a dead D; the
    ones past the cap are dropped (D's loads of those time out instead)."""
    from connector.p2p import producer

    monkeypatch.setattr(producer, "MAX_PENDING_NOTICES", 2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request", send_timeout_s=0.3)
    port = spare_port()
    addr = f"127.0.0.1:{port}"
    keys = [f"{i:032x}" for i in range(4)]
    for i, key in enumerate(keys):
        prod.save(save_spec(prod, addr, req_id=f"r{i}", key=key))
    rids = {f"r{i}" for i in range(4)}
    poll_until(prod, lambda r: rids <= r.finished_sending, finished=rids)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_port=port)
    wait_for(lambda: cons.recv_buffer.failure(keys[0]) is not None)  # one abort call carries them all
    assert [cons.recv_buffer.failure(k) is not None for k in keys] == [True, True, False, False]


class ProbeFront(ForwardingPeer):
    """In front of a decode engine's KV port: the first put is never answered (P's send times
    out, D is marked dead), the first ping (P's probe) is held until ``go`` (0.7 s at most),
    and the second put is answered 0.8 s late."""

    def __init__(self, target: str) -> None:
        self.puts = 0
        self.pings = 0
        self.ping_seen = threading.Event()
        self.go = threading.Event()
        self.put2_started = threading.Event()
        self.put2_answered = threading.Event()
        super().__init__(target)

    def _handle(self, header: dict, tensors: list):
        op = header.get("op")
        if op == "put":
            self.puts += 1
            if self.puts == 1:
                return Deferred(time.monotonic() + 60.0)  # never resolved
            self.put2_started.set()
            time.sleep(0.8)
        elif op == "ping":
            self.pings += 1
            if self.pings == 1:
                self.ping_seen.set()
                self.go.wait(0.7)
        reply = self.forward(header, tensors)
        if op == "put":
            self.put2_answered.set()
        return reply


def test_a_send_queued_while_its_decode_was_dead_goes_once_a_probe_gets_through(engines):
    """D is marked dead (a put timed out); a send queued while P's probe is on its way goes
    out once the probe is answered, and close() waits for that send on the wire (the probe
    before it was a call close() does not wait for; the send is not)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    # 3 s: the second put, answered 0.8 s late through the front, must not time out on a loaded box.
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request", send_timeout_s=3.0)
    front = ProbeFront(rank0(cons))
    try:
        prod.save(save_spec(prod, front.address, req_id="lost", key="a" * 32))
        assert front.ping_seen.wait(10)
        prod.save(save_spec(prod, front.address, req_id="queued", key="b" * 32))
        front.go.set()
        assert front.put2_started.wait(10)
        prod.producer.close()
        assert front.put2_answered.is_set()  # close() returned only once D had answered
        stats = prod.xfer_stats.peek()
        assert stats.transfers("send", "ok") == 1 and stats.failures("send", "unreachable") == 0
    finally:
        front.close()


def test_layer_progress_lag_counts_from_the_seal():
    """The KV arrival lag of a layer-wise send: ms from the end of the forward pass (the
    seal) to ``now``; 0 before the seal and for a ``now`` before it."""
    lp = LayerProgress(2)
    assert lp.lag_ms(time.monotonic()) == 0.0
    lp.seal()
    assert lp.lag_ms(lp.sealed_at + 0.25) == pytest.approx(250.0, abs=1e-6)
    assert lp.lag_ms(lp.sealed_at - 1.0) == 0.0
    assert lp.lag_ms(lp.sealed_at) == 0.0


def test_a_layer_wise_send_logs_its_lag_from_the_end_of_the_forward_pass(engines):
    """A layer-wise send's ms is the KV arrival lag: from the seal (the forward pass's end) to
    D's last answer, not from the send's first layer (here 1.2 s earlier)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer")
    spec = save_spec(prod, rank0(cons))
    with connector_log() as lines:
        prod.save_layer(spec, LAYERS[0])
        wait_for(lambda: cons.stats()["partial_payloads"] == 1)
        time.sleep(1.2)  # a long forward pass: longer than SLOW_SEND_S
        t_seal = time.monotonic()
        prod.save_layer(spec, LAYERS[1])
        prod.save(spec)
        _, t_done = poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    (sent,) = [x for x in lines.lines if x.startswith("kv sent")]
    m = re.search(r" ms=(\d+\.\d) ", sent)
    assert sent.startswith("kv sent req=P-req ") and m, sent
    assert float(m.group(1)) <= (t_done - t_seal) * 1e3 + 0.05, sent


def test_a_layer_wise_send_done_before_the_seal_reports_every_layer(engines):
    """Every layer was reported (save_kv_layer) and shipped before the forward pass ended:
    the log says all of them were reported."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer")
    spec = save_spec(prod, rank0(cons))
    with connector_log() as lines:
        for layer in LAYERS:
            prod.save_layer(spec, layer)
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    (sent,) = [x for x in lines.lines if x.startswith("kv sent")]
    assert sent.endswith(f" layers_reported={len(LAYERS)}/{len(LAYERS)}"), sent


@pytest.mark.parametrize("rank", [0, 1])
def test_first_contact_with_a_dead_decode_waits_no_longer_than_the_send_would(engines, rank):
    """The hello gets the send's budget (send_timeout_s, 3 s): rank 0 asks D's rank 0 for all
    of it; rank 1 asks D's rank 0 for half of it, then D's rank 1 for what is left, and says
    what the last one answered. (Each ask waits its whole budget: an unreachable peer looks
    like a slow one; the slack below is for a loaded box.)"""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, rank=rank, send_timeout_s=3.0)
    port = dead_port(2)
    dead = f"127.0.0.1:{port}"
    with connector_log() as lines:
        t0 = time.monotonic()
        prod.producer.prepare(dead)
        wait_for(lambda: any("first contact ahead of the send failed" in x for x in lines.lines))
        took = time.monotonic() - t0
    (line,) = lines.lines
    peer = dead if rank == 0 else f"127.0.0.1:{port + 1}"  # the last asked
    head = f"kv peer {dead}: first contact ahead of the send failed: peer {peer} unreachable: no connection within "
    assert line.startswith(head) and line.endswith("s"), line
    within = float(line.removeprefix(head).removesuffix("s"))
    assert (2.0 <= within <= 3.0) if rank == 0 else (0.05 <= within <= 1.5), line
    assert 2.7 <= took < 3.0 + 10, took  # the send's budget, not more


def test_a_prompt_send_is_logged_at_info(engines, caplog):
    """A send well under SLOW_SEND_S is an INFO line (operators alert on WARNING)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request")
    with caplog.at_level(logging.INFO, logger="vllm.xpyd.connector.p2p.producer"):
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    (sent,) = [r for r in caplog.records if r.getMessage().startswith("kv sent")]
    ms = float(re.search(r" ms=(\d+\.\d) ", sent.getMessage()).group(1))
    assert sent.levelno == (logging.INFO if ms <= 1000 else logging.WARNING), sent.getMessage()
    assert sent.getMessage().startswith("kv sent req=P-req " if ms <= 1000 else "kv sent slowly req=P-req ")


def test_first_contact_logs_how_long_it_took_and_why_the_decode_cannot_take_our_kv(engines):
    """First contact is logged with its duration (here D answers the hello 0.2 s late), and a
    D that cannot take our KV is logged at ERROR naming the instance and why."""
    cons = engines("kv_consumer", "PUT_ASYNC", caches=make_caches(2, shape=(16, 2, 16, 32)))
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request", send_timeout_s=5.0)
    front = SlowHello(rank0(cons), delay_s=0.2)
    try:
        t0 = time.monotonic()
        with connector_log() as lines:
            prod.save(save_spec(prod, front.address))
            _, t1 = poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        (contact,) = [x for x in lines.lines if x.startswith(f"kv peer {front.address} first contact ms=")]
        assert 200 <= float(contact.rpartition("=")[2]) <= (t1 - t0) * 1e3, contact
        (failed,) = [x for x in lines.lines if x.startswith("kv send failed req=P-req ")]
        why = failed.partition(" error=")[2]
        assert f"kv peer {front.address} cannot take KV from this instance: {why}" in lines.lines, lines.lines
    finally:
        front.close()


def test_first_contact_with_a_decode_of_another_tp_logs_the_head_slices_each_rank_gets(engines):
    """P tp=1 (4 KV heads) -> D tp=2: first contact says which D rank gets which of our heads;
    a P rank whose heads a replica sends says it sends nothing."""
    (prod,) = tp_instance("kv_producer", "PUT_ASYNC", 1, 4, seed=1, blocks_heads=4, send_granularity="request")
    dec = tp_instance("kv_consumer", "PUT_ASYNC", 2, 4, seed=2, blocks_heads=2)
    p_ranks = tp_instance("kv_producer", "PUT_ASYNC", 2, 1, seed=3, blocks_heads=1, send_granularity="request")
    (one,) = tp_instance("kv_consumer", "PUT_ASYNC", 1, 1, seed=4, blocks_heads=1)
    try:
        with connector_log() as lines:
            prod.save(save_spec(prod, rank0(dec[0])))
            p_ranks[1].save(save_spec(p_ranks[1], rank0(one)))
            poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
            poll_until(p_ranks[1], lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        assert f"kv peer {rank0(dec[0])}: tp 1 -> 2, rank 0 sends [(0, 'heads 0:2'), (1, 'heads 2:4')]" in lines.lines
        assert f"kv peer {rank0(one)}: tp 2 -> 1, rank 1 sends nothing (a replica sends our heads)" in lines.lines
    finally:
        for eng in (prod, *dec, *p_ranks, one):
            eng.close()


def test_a_send_decode_no_longer_needs_is_logged_and_counted_unneeded(engines):
    """D's requests for the KV are gone (released, dropped): the send ends as not needed,
    logged at INFO and counted as unneeded, not as a refusal."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request")
    cons.release([KEY])
    cons.poll(set())  # dropped: a payload for it is refused as gone
    with connector_log() as lines:
        prod.save(save_spec(prod, rank0(cons)))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    want = f"kv send not needed req=P-req transfer={KEY} peer={rank0(cons)}: D's requests for it are gone"
    assert want in lines.lines, lines.lines
    stats = prod.xfer_stats.peek()
    assert stats.transfers("send", "unneeded") == 1 and stats.failures("send", "refused") == 0


class _PutSpy:
    """The producer's transport (the wire), recording the tensors of every put it carries and
    every call's (op, peer, header, timeout_s)."""

    def __init__(self, real) -> None:
        self._real = real
        self.puts: list[list] = []
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def call(self, addr, header, *args, **kw):
        self.calls.append((header.get("op"), addr, header, kw.get("timeout_s")))
        if header.get("op") == "put":
            self.puts.append(list(args[0]))
        return self._real.call(addr, header, *args, **kw)


def test_a_put_is_read_straight_from_the_kv_cache_not_copied(engines):
    """A PUT's blocks go on the wire as views of P's KV cache (the send ends before its blocks
    are freed), not as copies: a copy would only cost memory and time (GET needs one, PUT not)."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request")
    spy = prod.producer._transport = _PutSpy(prod.producer._transport)
    prod.save(save_spec(prod, rank0(cons)))
    poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    caches = {c.untyped_storage().data_ptr() for c in prod._caches.values()}
    assert len(spy.puts) == 1 and len(spy.puts[0]) >= len(caches), spy.puts
    assert all(t.untyped_storage().data_ptr() in caches for t in spy.puts[0])


@pytest.mark.parametrize("granularity", ["request", "layer"])
def test_a_sends_reserve_and_put_wait_no_longer_than_send_timeout(engines, granularity):
    """The reserve and the put each wait at most what is left of send_timeout_s (a D that
    stalls one cannot hold the send past it), and never less than a moment."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity=granularity, send_timeout_s=0.8)
    spy = prod.producer._transport = _PutSpy(prod.producer._transport)
    spec = save_spec(prod, rank0(cons))
    if granularity == "layer":
        for layer in LAYERS:
            prod.save_layer(spec, layer)
    prod.save(spec)
    poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    waits = [(op, t) for op, _, _, t in spy.calls if op in ("reserve", "put")]
    assert {op for op, _ in waits} == {"reserve", "put"}, spy.calls
    assert all(t is not None and 0.05 <= t <= 0.8 for _, t in waits), waits


def test_a_layer_wise_send_to_a_decode_of_another_tp_puts_each_piece_in_parts(engines):
    """P tp=1 -> D tp=2, layer-wise: each head slice goes one part (its layers) at a time, not
    the whole piece with every part."""
    from xpyd_wire.request_id import rank_address

    (prod,) = tp_instance("kv_producer", "PUT_ASYNC", 1, 4, seed=1, blocks_heads=4, send_granularity="layer")
    dec = tp_instance("kv_consumer", "PUT_ASYNC", 2, 4, seed=2, blocks_heads=2)
    try:
        spy = prod.producer._transport = _PutSpy(prod.producer._transport)
        spec = save_spec(prod, rank0(dec[0]))
        prod.save_layer(spec, LAYERS[0])
        wait_for(lambda: all(d.stats()["partial_payloads"] == 1 for d in dec))
        prod.save_layer(spec, LAYERS[1])
        prod.save(spec)
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        parts = sorted((addr, tuple(h["part"]) if h.get("part") else None) for op, addr, h, _ in spy.calls
                       if op == "put")
        ranks = sorted(rank_address(rank0(dec[0]), r) for r in range(2))
        assert parts == [(addr, part) for addr in ranks for part in ((0, 1), (1, 2))], parts
    finally:
        for eng in (prod, *dec):
            eng.close()


def test_a_piece_a_decode_rank_refuses_is_noticed_to_that_rank(engines):
    """P tp=1 -> D tp=2, D's buffers too small: each D rank refuses its head slice, and is
    told at once under the transfer's own key which piece will not come and why (it would
    wait for it otherwise); the refusal is counted."""
    from xpyd_wire.request_id import rank_address

    (prod,) = tp_instance("kv_producer", "PUT_ASYNC", 1, 4, seed=1, blocks_heads=4, send_granularity="request")
    dec = tp_instance("kv_consumer", "PUT_ASYNC", 2, 4, seed=2, blocks_heads=2, kv_buffer_size=1000)
    try:
        spy = prod.producer._transport = _PutSpy(prod.producer._transport)
        prod.save(save_spec(prod, rank0(dec[0])))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        refusals = {addr: h for op, addr, h, _ in spy.calls if op == "reserve"}
        assert set(refusals) == {rank_address(rank0(dec[0]), r) for r in range(2)}, spy.calls

        def told() -> dict:
            return {addr: h["keys"] for op, addr, h, _ in list(spy.calls) if op == "abort"}

        wait_for(lambda: len(told()) == 2)
        for addr, keys in told().items():
            assert list(keys) == [KEY], keys
            assert re.fullmatch(r"sender gave up: piece 0 refused: .+", keys[KEY]), keys
            assert "None" not in keys[KEY], keys
        assert prod.xfer_stats.peek().failures("send", "refused") == 2
    finally:
        for eng in (prod, *dec):
            eng.close()


def test_a_piece_one_decode_rank_refuses_is_noticed_to_that_rank_only(engines):
    """P tp=1 -> D tp=2, D rank 1's buffer too small: only rank 1 is told its piece will not
    come; rank 0 took its piece and is not told to give the transfer up."""
    from xpyd_wire.request_id import rank_address

    (prod,) = tp_instance("kv_producer", "PUT_ASYNC", 1, 4, seed=1, blocks_heads=4, send_granularity="request")
    dec = tp_instance("kv_consumer", "PUT_ASYNC", 2, 4, seed=2, blocks_heads=2)
    dec[1]._recv._capacity = 1000  # the other side of the boundary: only this rank is full
    try:
        spy = prod.producer._transport = _PutSpy(prod.producer._transport)
        prod.save(save_spec(prod, rank0(dec[0])))
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
        one = rank_address(rank0(dec[0]), 1)

        def told() -> dict:
            return {addr: h["keys"] for op, addr, h, _ in list(spy.calls) if op == "abort"}

        # Notices go out in D rank order, each after it was recorded: rank 0's would be in first.
        wait_for(lambda: one in told())
        assert list(told()) == [one], told()
        assert prod.xfer_stats.peek().failures("send", "refused") == 1
    finally:
        for eng in (prod, *dec):
            eng.close()


def test_a_layer_wise_send_waits_for_the_forward_pass_and_its_deadline_counts_from_then(engines):
    """Between layers the send waits for the forward pass (logged as its "forward" phase), and
    send_timeout_s counts again from when the next layer is there: a forward pass longer than
    the timeout does not cut the next put's wait short."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer", send_timeout_s=0.6)
    spy = prod.producer._transport = _PutSpy(prod.producer._transport)
    spec = save_spec(prod, rank0(cons))
    with connector_log() as lines:
        prod.save_layer(spec, LAYERS[0])
        wait_for(lambda: cons.stats()["partial_payloads"] == 1)
        time.sleep(0.8)  # a forward pass longer than send_timeout_s
        prod.save_layer(spec, LAYERS[1])
        prod.save(spec)
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    (sent,) = [x for x in lines.lines if x.startswith("kv sent req=P-req ")]
    phases = dict(p.split(":") for p in re.search(r"phases_ms=(\S+)", sent).group(1).split(","))
    assert "forward" in phases and float(phases["forward"]) > 0, sent
    puts = [t for op, _, h, t in spy.calls if op == "put"]
    assert len(puts) == 2 and puts[1] > 0.1, spy.calls  # ~0.6 s left; from the first layer on: the 0.05 s floor


def test_a_layer_wise_send_whose_forward_pass_stops_writing_fails_and_tells_the_decode(engines, monkeypatch):
    """A forward pass that writes no further layer within FORWARD_WAIT_S (here 0.5 s) fails
    the send: counted as an error, and D told why under the transfer's key (it would wait for
    the rest otherwise)."""
    import connector.p2p.producer as producer

    monkeypatch.setattr(producer, "FORWARD_WAIT_S", 0.5)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer")
    spy = prod.producer._transport = _PutSpy(prod.producer._transport)
    prod.save_layer(save_spec(prod, rank0(cons)), LAYERS[0])  # and never the rest, nor the seal

    def told() -> list:
        return [(addr, h["keys"]) for op, addr, h, _ in list(spy.calls) if op == "abort"]

    wait_for(lambda: told())
    want = "sender gave up: RuntimeError: the forward pass wrote no further layer in 0.5s"
    assert told() == [(rank0(cons), {KEY: want})], told()
    assert prod.xfer_stats.peek().failures("send", "error") == 1


def test_a_layer_wise_send_in_parts_logs_and_counts_every_parts_bytes(engines):
    """Two parts (a layer each): the "kv sent" line and the sent-bytes count add both up, the
    same bytes as the whole payload at once."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer")
    spec = save_spec(prod, rank0(cons))
    with connector_log() as lines:
        prod.save_layer(spec, LAYERS[0])
        wait_for(lambda: cons.stats()["partial_payloads"] == 1)
        prod.save_layer(spec, LAYERS[1])
        prod.save(spec)
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    whole = sum(c[list(SRC_IDS)].numel() * c.element_size() for c in prod._caches.values())
    (sent,) = [x for x in lines.lines if x.startswith("kv sent req=P-req ")]
    assert f" bytes={whole} " in sent, (whole, sent)
    assert prod.xfer_stats.peek().nbytes("sent") == whole


def test_a_layer_wise_send_a_full_decode_refuses_is_counted_refused_not_an_error(engines):
    """D's buffer cannot take the payload: the first part's reserve is refused, the send ends
    as refused (logged, counted), not as a failure of the sender."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_buffer_size=1000)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer")
    spec = save_spec(prod, rank0(cons))
    with connector_log() as lines:
        prod.save_layer(spec, LAYERS[0])
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    mine = [x for x in lines.lines if "req=P-req" in x and rank0(cons) in x]
    assert [x for x in mine if x.startswith("kv send refused")], lines.lines
    assert not [x for x in mine if x.startswith("kv send failed")], mine
    stats = prod.xfer_stats.peek()
    assert stats.failures("send", "refused") == 1 and stats.failures("send", "error") == 0


def test_a_layer_wise_send_failing_after_one_rank_refused_tells_only_the_ranks_still_waiting(engines, monkeypatch):
    """P tp=1 -> D tp=2, layer-wise: D rank 1 (full) refuses the first part and is told so;
    rank 0 takes it. When the forward pass then stops writing, only rank 0, still waiting for
    the rest, is told the send failed: rank 1 hears nothing but its own refusal."""
    import connector.p2p.producer as producer
    from xpyd_wire.request_id import rank_address

    monkeypatch.setattr(producer, "FORWARD_WAIT_S", 0.5)
    (prod,) = tp_instance("kv_producer", "PUT_ASYNC", 1, 4, seed=1, blocks_heads=4, send_granularity="layer")
    dec = tp_instance("kv_consumer", "PUT_ASYNC", 2, 4, seed=2, blocks_heads=2)
    dec[1]._recv._capacity = 1000  # the other side of the boundary: only this rank is full
    zero, one = (rank_address(rank0(dec[0]), r) for r in range(2))
    try:
        spy = prod.producer._transport = _PutSpy(prod.producer._transport)
        prod.save_layer(save_spec(prod, rank0(dec[0])), LAYERS[0])  # and never the rest

        def told(addr: str) -> list:
            return [h["keys"][KEY] for op, a, h, _ in list(spy.calls) if op == "abort" and a == addr]

        wait_for(lambda: told(zero))
        prod.close()  # joins the peer thread: every notice queued with rank 0's is delivered
        assert told(zero) == ["sender gave up: RuntimeError: the forward pass wrote no further layer in 0.5s"]
        assert told(one) and all(r.startswith("sender gave up: piece 0 refused: ") for r in told(one)), told(one)
    finally:
        for eng in (prod, *dec):
            eng.close()


def test_the_peer_sender_thread_is_named_after_its_decode(engines):
    """The thread sending to one decode is named after it (what a thread dump or py-spy shows),
    and is a daemon: a send stuck on a dead decode never keeps the process from exiting."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request")
    prod.save(save_spec(prod, rank0(cons)))
    poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    (peer,) = prod.producer._peers.values()
    assert peer._thread is not None and peer._thread.name == f"xpyd-kv-send:{rank0(cons)}", peer._thread
    assert peer._thread.daemon

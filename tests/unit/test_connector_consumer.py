"""The consumer half of the KV engine (connector/consumer.py), on real KVEngines over
loopback: what a synchronous load returns, counts and logs, and a GET pull that does not fit
D's buffer never asks P."""

from __future__ import annotations

import dataclasses

import pytest

from connector.transport.tcp import TcpTransport
from tests.support.connector_log import connector_log
from tests.support.kv_engines import (
    KEY,
    SRC_IDS,
    assert_loaded,
    assert_untouched,
    load_spec,
    plan_load,
    poll_until,
    rank0,
    save_spec,
    snapshot,
    wait_for,
)

DST = (7, 2, 11)


@pytest.fixture
def client():
    cli = TcpTransport()
    yield cli
    cli.close()


def _sync_spec(prod, req_id="D-req"):
    return dataclasses.replace(load_spec(rank0(prod), DST, 2, req_id=req_id), sync=True)


def test_a_synchronous_load_says_so_in_its_log_and_returns_true(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    wait_for(lambda: cons.consumer.ready(KEY))
    with connector_log("consumer") as lines:
        assert cons.consumer.load_now(_sync_spec(prod)) is True
    assert_loaded(cons, before, prod, DST, SRC_IDS[2:])
    loaded = [x for x in lines.lines if x.startswith("kv loaded req=D-req ")]
    assert len(loaded) == 1 and f"transfer={KEY} tokens=" in loaded[0] and " sync apply_ms=" in loaded[0], loaded
    assert cons.take_invalid_blocks() == set()
    assert cons.xfer_stats.peek().transfers("load", "ok") == 1


def test_a_synchronous_load_whose_payload_is_gone_counts_an_error(engines):
    """Nothing here and nothing known about it (dropped by its TTL): an error, said so."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    with connector_log("consumer") as lines:
        assert cons.consumer.load_now(_sync_spec(prod)) is False
    assert f"kv load failed req=D-req transfer={KEY} error=the payload the scheduler saw is gone" in lines.lines
    stats = cons.xfer_stats.peek()
    assert stats.failures("load", "error") == 1 and stats.failures("load", "aborted") == 0
    assert cons.take_invalid_blocks() == set(DST)


def test_a_synchronous_load_whose_sender_gave_up_counts_an_abort(engines, client):
    """P said the transfer will not come: counted as aborted, logged with P's reason."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    assert client.call(rank0(cons), {"op": "abort", "keys": {KEY: "P gave up"}}, timeout_s=10)[0]["ok"]
    with connector_log("consumer") as lines:
        assert cons.consumer.load_now(_sync_spec(prod)) is False
    assert f"kv load failed req=D-req transfer={KEY} error=P gave up" in lines.lines
    stats = cons.xfer_stats.peek()
    assert stats.failures("load", "aborted") == 1 and stats.failures("load", "error") == 0
    assert cons.take_invalid_blocks() == set(DST)


def test_a_synchronous_load_of_a_bad_payload_returns_false(engines):
    """The payload is here but cannot be applied (another prompt length): False, its blocks
    reported, the cache untouched."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), num_tokens=3 * 16))
    wait_for(lambda: cons.consumer.ready(KEY))
    assert cons.consumer.load_now(_sync_spec(prod)) is False
    assert cons.take_invalid_blocks() == set(DST)
    assert cons.xfer_stats.peek().failures("load", "invalid") == 1
    assert_untouched(cons, before)


def test_a_get_that_does_not_fit_the_buffer_never_asks_the_prefill(engines):
    """GET: D reserves the payload's size before asking P; refused, it does not ask (P keeps
    its copy until its TTL) and the load fails at once."""
    prod = engines("kv_producer", "GET", seed=1)
    cons = engines("kv_consumer", "GET", seed=2, kv_buffer_size=1024)
    prod.save(save_spec(prod, rank0(cons), delay_free=False))
    assert prod.stats()["send_items"] == 1
    plan_load(cons, load_spec(rank0(prod), DST, 2))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    assert prod.stats()["send_items"] == 1  # never fetched nor released

"""The consumer half of the KV engine (connector/p2p/consumer.py), on real KVEngines over
loopback: what a synchronous load returns, counts and logs, and a GET pull that does not fit
D's buffer never asks P."""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from connector import layout as kvlayout
from connector.affinity import CpuPlan
from connector.p2p.buffer import KVBuffer, Payload
from connector.p2p.consumer import GET_POOL_SIZE, Consumer
from connector.p2p.engine import PollResult
from connector.p2p.metadata import LoadSpec
from connector.p2p.staging import RecvStager
from connector.p2p.tp import TpSide
from connector.transport.base import Deferred
from connector.transport.tcp import TcpTransport
from tests.support.connector_log import connector_log
from tests.support.kv_engines import (
    KEY,
    SHAPE,
    SRC_IDS,
    TOK,
    assert_loaded,
    assert_untouched,
    bits,
    load_spec,
    make_caches,
    make_cfg,
    plan_load,
    poll_until,
    rank0,
    save_spec,
    snapshot,
    wait_for,
)
from tests.support.ports import dead_port

DST = (7, 2, 11)
LAYER0 = "model.layers.0.self_attn.attn"


def _sync_spec(prod, req_id="D-req"):
    return dataclasses.replace(load_spec(rank0(prod), DST, 2, req_id=req_id), sync=True)


def _consumer(send_type: str, transport: TcpTransport, caches: dict, *, layout: kvlayout.BlockLayout | None = None,
              recv: KVBuffer | None = None, cpus: CpuPlan | None = None, stager: RecvStager | None = None,
              check: Callable[[dict], str | None] | None = None, local: TpSide | None = None, **cfg_over) -> Consumer:
    """A Consumer on its own, rank 0, made as the engine would: make_cfg(..., **cfg_over), the
    caches' own layout and a fresh 100 MB receive buffer unless given."""
    return Consumer(
        make_cfg("kv_consumer", send_type, 1, **cfg_over),
        0,
        transport,
        caches,
        kvlayout.detect(None, caches) if layout is None else layout,
        KVBuffer("recv", 10**8, 60.0) if recv is None else recv,
        cpus,
        stager=stager,
        check=check,
        local=local,
    )


def test_a_synchronous_load_says_so_in_its_log_and_returns_true(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    before = snapshot(cons.caches)
    cons.xfer_stats.legs = True  # tracing on: the load's numbers go to the scheduler for its span
    prod.save(save_spec(prod, rank0(cons)))
    wait_for(lambda: cons.consumer.ready(KEY))
    with connector_log("consumer") as lines:
        assert cons.consumer.load_now(_sync_spec(prod)) is True
    assert_loaded(cons, before, prod, DST, SRC_IDS[2:])
    loaded = [x for x in lines.lines if x.startswith("kv loaded req=D-req ")]
    assert len(loaded) == 1 and f"transfer={KEY} tokens=" in loaded[0] and " sync apply_ms=" in loaded[0], loaded
    assert cons.take_invalid_blocks() == set()
    stats = cons.xfer_stats.peek()
    assert stats.transfers("load", "ok") == 1
    (leg,) = stats.data["legs"]  # the span's numbers: the log line's apply_ms and wait_ms, the bytes received
    apply_ms = float(loaded[0].partition(" apply_ms=")[2].split()[0])
    assert leg[:3] == ["load", "D-req", "ok"] and leg[3] == stats.nbytes("received") > 0, leg
    assert round(leg[4], 2) == apply_ms and leg[6] is None, leg


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


def test_a_synchronous_load_whose_sender_gave_up_counts_an_abort(engines, kv_client):
    """P said the transfer will not come: counted as aborted, logged with P's reason."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    assert kv_client.call(rank0(cons), {"op": "abort", "keys": {KEY: "P gave up"}}, timeout_s=10)[0]["ok"]
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
    with connector_log("consumer") as lines:
        plan_load(cons, load_spec(rank0(prod), DST, 2))
        res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    assert prod.stats()["send_items"] == 1  # never fetched nor released
    said = [x for x in lines.lines if x.startswith("kv get not started ")]
    assert len(said) == 1 and said[0].startswith(f"kv get not started transfer={KEY} reason="), said
    assert said[0].partition(" reason=")[2] not in ("", "None")


# ---- asynchronous loads: what each outcome counts and logs (operators grep these lines)


def _async_load(cons, prod, corrupt=False):
    plan_load(cons, load_spec(rank0(prod), DST, 2, corrupt=corrupt))


def test_an_asynchronous_load_logs_what_it_loaded(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod.save(save_spec(prod, rank0(cons)))
    with connector_log("consumer") as lines:
        _async_load(cons, prod)
        res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set()
    n = load_spec("x", DST, 2).num_tokens
    loaded = [x for x in lines.lines if x.startswith("kv loaded ")]
    assert len(loaded) == 1 and re.fullmatch(
        rf"kv loaded req=D-req transfer={KEY} tokens={n} blocks=3 wait_ms=\d+\.\d apply_ms=\d+\.\d\d", loaded[0]
    ), loaded
    assert cons.xfer_stats.peek().transfers("load", "ok") == 1


def test_a_corrupted_test_load_says_so(engines):
    """allow_debug_corruption: the zeroed load is marked in its log line."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod.save(save_spec(prod, rank0(cons)))
    with connector_log("consumer") as lines:
        _async_load(cons, prod, corrupt=True)
        poll_until(cons, lambda r: "D-req" in r.finished_recving)
    loaded = [x for x in lines.lines if x.startswith("kv loaded req=D-req ")]
    assert len(loaded) == 1 and loaded[0].endswith(" CORRUPTED(test)"), loaded


def test_a_load_whose_request_finished_is_cancelled_and_logged(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    _async_load(cons, prod)
    with connector_log("consumer") as lines:
        res = cons.poll({"D-req"})
    assert res.finished_recving == {"D-req"} and res.failed_recving == set()
    assert lines.lines == [f"kv load cancelled req=D-req transfer={KEY} (request finished)"]
    assert cons.xfer_stats.peek().transfers("load", "cancelled") == 1


def test_a_load_past_its_deadline_times_out_and_is_logged(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_load_timeout_s=0.3)
    cons.xfer_stats.legs = True
    with connector_log("consumer") as lines:
        _async_load(cons, prod)
        res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    assert f"kv load timed out req=D-req transfer={KEY} after 0.3s" in lines.lines
    stats = cons.xfer_stats.peek()
    assert stats.failures("load", "timeout") == 1 and stats.failures("load", "aborted") == 0
    assert [leg[:3] + leg[6:7] for leg in stats.data["legs"]] == [["load", "D-req", "failed", "timeout"]]


def test_a_load_whose_sender_gave_up_fails_at_once_and_is_logged(engines, kv_client):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    with connector_log("consumer") as lines:
        _async_load(cons, prod)
        assert cons.poll(set()) == PollResult()
        assert kv_client.call(rank0(cons), {"op": "abort", "keys": {KEY: "P gave up"}}, timeout_s=10)[0]["ok"]
        res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    failed = [x for x in lines.lines if x.startswith("kv load failed ")]
    assert len(failed) == 1 and re.fullmatch(
        rf"kv load failed req=D-req transfer={KEY} after \d+\.\dms error=P gave up", failed[0]
    ), failed
    stats = cons.xfer_stats.peek()
    assert stats.failures("load", "aborted") == 1 and stats.failures("load", "timeout") == 0


def test_a_payload_that_does_not_fit_the_load_is_logged_with_why(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod.save(save_spec(prod, rank0(cons), num_tokens=3 * 16))
    with connector_log("consumer") as lines:
        _async_load(cons, prod)
        res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    want = load_spec("x", DST, 2).prompt_tokens
    assert (
        f"kv load failed req=D-req transfer={KEY} error=payload is for a 48-token prompt, this request has {want}"
    ) in lines.lines
    assert cons.xfer_stats.peek().failures("load", "invalid") == 1


class _CountingGets(TcpTransport):
    """The real transport; counts the GET calls it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    def call(self, peer, header, tensors=(), timeout_s=5.0):
        if header.get("op") == "get":
            self.gets += 1
        return super().call(peer, header, tensors, timeout_s)


def test_get_gives_up_on_an_unreachable_prefill_after_three_tries(engines):
    """GET: P does not answer; D tries three times, 0.2 s apart, then fails the load with why,
    long before the load's deadline (and before its reservation, send_timeout + 1 s, expires)."""
    counting = _CountingGets()
    cons = engines(
        "kv_consumer", "GET", seed=2, kv_load_timeout_s=30.0, send_timeout_s=0.1, transport=lambda cfg: counting
    )
    dead = f"127.0.0.1:{dead_port()}"
    t0 = time.monotonic()
    with connector_log("consumer") as lines:
        plan_load(cons, load_spec(dead, DST, 2))
        res, t_done = poll_until(cons, lambda r: "D-req" in r.finished_recving, timeout=15.0)
    assert res.failed_recving == {"D-req"}
    assert counting.gets == 3
    assert t_done - t0 >= 3 * 0.1 + 2 * 0.2 - 0.05
    failed = [x for x in lines.lines if x.startswith("kv load failed req=D-req ")]
    assert len(failed) == 1 and f" error=prefill {dead} unreachable: peer {dead} unreachable" in failed[0], failed


# ---- a payload that cannot fill the load: refused before any byte is written, and the
# log says why (the operator's only clue that P and D disagree)


DROP = object()  # a header field left out


def _header(eng, runs=(2,), num_blocks=2, **over) -> dict:
    h = {
        "op": "put",
        "key": KEY,
        "num_tokens": 2 * TOK,
        "num_blocks": num_blocks,
        "layers": list(eng.caches),
        "runs": list(runs),
        **eng.block_layout.describe(),
    }
    return {k: v for k, v in {**h, **over}.items() if v is not DROP}


def _blocks(n, shape=SHAPE[1:], dtype=torch.bfloat16):
    return torch.ones((n, *shape), dtype=dtype)


BAD_PAYLOADS = {
    "tensor-shape": (
        {},
        [torch.ones(2, 2, 16, 32, dtype=torch.bfloat16)] * 2,
        "payload tensor torch.bfloat16[2, 2, 16, 32] does not match its header",
    ),
    "tensor-dtype": (
        {},
        [_blocks(2, dtype=torch.float16)] * 2,
        "payload tensor torch.float16[2, 2, 16, 64] does not match its header",
    ),
    "tensor-count": ({}, [_blocks(2)], "payload tensor count does not match its header"),
    "no-runs": ({"runs": []}, [_blocks(2)] * 2, "payload tensor count does not match its header"),
    "runs-short": ({"runs": [1]}, [_blocks(1)] * 2, "payload runs do not add up to num_blocks"),
    "num-blocks-type": ({"num_blocks": "two"}, [_blocks(2)] * 2, "malformed payload: first_block=0 num_blocks='two'"),
    "first-after-end": ({"first_block": 3}, [_blocks(2)] * 2, "malformed payload: first_block=3 num_blocks=2"),
    "layers": ({"layers": ["a", "b"]}, [_blocks(2)] * 2, "layer names differ between prefill and decode"),
    "no-num-blocks": ({"num_blocks": DROP}, [_blocks(2)] * 2, "peer sent blocks 0..-1, need up to 1"),
    "all-skipped": (
        {"first_block": 2, "runs": [1]},
        [_blocks(1)] * 2,
        "peer skipped prompt blocks 0..1 (the proxy said this instance held them; it no longer does)",
    ),
    "layout-name": (
        {"layout": "HND"},
        [_blocks(2)] * 2,
        "layout mismatch: peer HND vs local unknown (prefill and decode must run the same attention backend, KV cache "
        "dtype and block size)",
    ),
    "tp-mla": (
        {"tp_size": 1, "num_kv_heads": SHAPE[1], "is_mla": True},
        [_blocks(2)] * 2,
        "one side uses MLA and the other does not (prefill tp=1 heads=2 mla=True, decode tp=1 heads=2 mla=False)",
    ),
    "too-few-blocks": ({"num_blocks": 1, "runs": [1]}, [_blocks(1)] * 2, "peer sent blocks 0..0, need up to 1"),
    "skipped": (
        {"first_block": 1, "runs": [1]},
        [_blocks(1)] * 2,
        "peer skipped prompt blocks 0..0 (the proxy said this instance held them; it no longer does)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PAYLOADS))
def test_a_payload_that_cannot_fill_the_load_fails_it_saying_why(engines, kv_client, case):
    over, tensors, why = BAD_PAYLOADS[case]
    cons = engines("kv_consumer", "PUT_ASYNC")
    assert kv_client.call(rank0(cons), _header(cons, **over), tensors, timeout_s=10)[0] == {"ok": True}
    before = snapshot(cons.caches)
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    assert f"kv load failed req=D-req transfer={KEY} error={why}" in lines.lines, lines.lines
    assert_untouched(cons, before)
    assert cons.xfer_stats.peek().failures("load", "invalid") == 1


def test_a_payload_in_runs_lands_block_by_block(engines, kv_client):
    """Runs of 1 and 2 blocks, the load starting past the first (a local prefix hit): each
    destination block gets its own source block."""
    cons = engines("kv_consumer", "PUT_ASYNC")
    src = [torch.full((1, *SHAPE[1:]), 1.0, dtype=torch.bfloat16), torch.stack([_blocks(1)[0] * 2, _blocks(1)[0] * 3])]
    h = _header(cons, runs=(1, 2), num_blocks=3, num_tokens=3 * TOK)
    assert kv_client.call(rank0(cons), h, src * 2, timeout_s=10)[0] == {"ok": True}
    before = snapshot(cons.caches)
    plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (9, 4), 1, 2 * TOK - 1, 3 * TOK, 3))
    res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == set()
    for name, cache in cons.caches.items():
        assert torch.equal(cache[9], _blocks(1)[0] * 2) and torch.equal(cache[4], _blocks(1)[0] * 3)
        others = [b for b in range(SHAPE[0]) if b not in (9, 4)]
        assert torch.equal(bits(cache[others]), bits(before[name][others]))


@pytest.mark.parametrize("pieces, malformed", [(0, True), (1025, True), ("2", True), (1024, False), (2, False)])
def test_a_malformed_piece_count_fails_the_load(engines, kv_client, pieces, malformed):
    """Heterogeneous TP: piece 0 says how many pieces come (1..1024); anything else fails the
    load at once; a valid count waits for the other pieces."""
    cons = engines("kv_consumer", "PUT_ASYNC", kv_load_timeout_s=30.0)
    h = _header(cons, key=f"{KEY}/0", pieces=pieces, piece=0)
    assert kv_client.call(rank0(cons), h, [_blocks(2)] * 2, timeout_s=10)[0] == {"ok": True}
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res = cons.poll(set())
    if malformed:
        assert res.failed_recving == {"D-req"}
        failed = [x for x in lines.lines if x.startswith("kv load failed req=D-req ")]
        assert len(failed) == 1 and failed[0].endswith(f"error=malformed piece header: pieces={pieces!r}"), failed
    else:
        assert res == PollResult() and not cons.consumer.ready(KEY)


def test_a_get_that_outlives_its_deadline_says_so(engines):
    """GET: P never has the KV ready; at the load's deadline the fetch gives up and records
    why, which the next worker step reports (as the sender's reason, not a bare timeout)."""
    prod = engines("kv_producer", "GET", seed=1)
    cons = engines("kv_consumer", "GET", seed=2, kv_load_timeout_s=0.3)
    with connector_log("consumer") as lines:
        plan_load(cons, load_spec(rank0(prod), DST, 2))  # no worker step until the fetch gave up
        wait_for(lambda: cons.recv_buffer.failure(KEY) is not None)
        res = cons.poll(set())
    assert res.failed_recving == {"D-req"}
    failed = [x for x in lines.lines if x.startswith("kv load failed req=D-req ")]
    assert len(failed) == 1 and failed[0].endswith(" error=load deadline passed"), failed
    assert cons.xfer_stats.peek().failures("load", "aborted") == 1


def test_a_get_payload_without_tp_fields_is_still_loaded(engines):
    """A prefill that predates TP in its headers (no tp_size): D checks only the layout, as for
    pushed payloads, and loads it. P here is a stand-in answering GET and release."""
    cons = engines("kv_consumer", "GET", seed=2)
    header = {k: v for k, v in _header(cons).items() if k != "op"}
    tensors = [_blocks(2), _blocks(2) * 2]
    released = []

    def old_prefill(h, t):
        if h.get("op") == "get":
            return {"ok": True, **header}, tensors
        released.append(h.get("op"))
        return {"ok": True}, []

    p = TcpTransport()
    p.start("127.0.0.1", 0, old_prefill)
    try:
        plan_load(cons, LoadSpec("D-req", KEY, f"127.0.0.1:{p.bound_port}", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
        assert res.failed_recving == set()
        for cache in cons.caches.values():
            assert torch.equal(cache[[7, 2]], _blocks(2) * (1 if cache is cons.caches[LAYER0] else 2))
        wait_for(lambda: released == ["release"])
    finally:
        p.close()


def test_a_get_payload_of_another_layout_is_refused_locally_and_logged(engines):
    """GET: the payload P hands over says another dtype: D refuses it before storing it,
    says so, and the load fails with the same reason. P here is a stand-in."""
    cons = engines("kv_consumer", "GET", seed=2)
    header = {k: v for k, v in _header(cons).items() if k != "op"}
    header.update(dtype="float16", tp_size=1, num_kv_heads=SHAPE[1], is_mla=False)

    def other_prefill(h, t):
        if h.get("op") == "get":
            return {"ok": True, **header}, [_blocks(2, dtype=torch.float16)] * 2
        return {"ok": True}, []

    p = TcpTransport()
    p.start("127.0.0.1", 0, other_prefill)
    try:
        with connector_log("consumer") as lines:
            plan_load(cons, LoadSpec("D-req", KEY, f"127.0.0.1:{p.bound_port}", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
            res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    finally:
        p.close()
    assert res.failed_recving == {"D-req"}
    said = [x for x in lines.lines if x.startswith("kv get refused locally ")]
    failed = [x for x in lines.lines if x.startswith("kv load failed req=D-req ")]
    assert len(said) == 1 and len(failed) == 1, lines.lines
    why = said[0].partition(" reason=")[2]
    assert said[0] == f"kv get refused locally transfer={KEY} reason={why}" and "dtype" in why
    assert failed[0].endswith(f" error={why}")


def test_a_get_that_the_prefill_gave_up_fails_with_its_reason(engines):
    """GET: P could not keep the copy (its buffer refused it) and answers so, finally: D's load
    fails at once with P's reason."""
    prod = engines("kv_producer", "GET", seed=1, kv_buffer_size=1000)
    cons = engines("kv_consumer", "GET", seed=2, kv_load_timeout_s=30.0)
    with connector_log("producer") as p_lines:
        prod.save(save_spec(prod, rank0(cons), delay_free=False))
    refused = [x for x in p_lines.lines if x.startswith(f"GET buffer refused transfer={KEY} reason=")]
    assert len(refused) == 1, p_lines.lines
    why = refused[0].partition(" reason=")[2]
    with connector_log("consumer") as lines:
        plan_load(cons, load_spec(rank0(prod), DST, 2))
        res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving, timeout=10.0)
    assert res.failed_recving == {"D-req"}
    failed = [x for x in lines.lines if x.startswith("kv load failed req=D-req ")]
    assert len(failed) == 1 and failed[0].endswith(f" error=prefill says: {why}"), failed


# ---- heterogeneous TP: a prefill with TP 2 sends this TP-1 rank one head each


def _piece(cons, i, n=2, **over):
    h = _header(cons, key=f"{KEY}/{i}", piece=i, pieces=n, src_rank=i, heads=[i, i + 1])
    h.update(tp_size=2, num_kv_heads=SHAPE[1], is_mla=False, block_shape=[1, *SHAPE[2:]], runs=[2])
    h.update(over)
    return h


def _head(n, value):
    return torch.full((n, 1, *SHAPE[2:]), float(value), dtype=torch.bfloat16)


PIECE_DEFECTS = {
    "good": ({}, None),
    "piece-index": (
        {"piece": 1},
        "piece 0 is not what tp expects: from rank 0 heads [0, 1], want rank 0 heads slice(0, 1, None)",
    ),
    "src-rank": (
        {"src_rank": 1},
        "piece 0 is not what tp expects: from rank 1 heads [0, 1], want rank 0 heads slice(0, 1, None)",
    ),
    "heads": (
        {"heads": [1, 2]},
        "piece 0 is not what tp expects: from rank 0 heads [1, 2], want rank 0 heads slice(0, 1, None)",
    ),
    "layers": ({"layers": ["a", "b"]}, "layer names differ between prefill and decode"),
    "tokens": ({"num_tokens": 3 * TOK}, f"payload is for a {3 * TOK}-token prompt, this request has {2 * TOK}"),
    "runs": ({"runs": [1, 1]}, "piece tensor count does not match its header"),
    "skipped": (
        {"first_block": 1, "runs": [1]},
        "peer skipped prompt blocks 0..0 (the proxy said this instance held them; it no longer does)",
    ),
}


@pytest.mark.parametrize("case", list(PIECE_DEFECTS))
def test_pieces_are_checked_before_any_head_is_written(engines, kv_client, case):
    """Piece 0 (head 0, from prefill rank 0) and piece 1 (head 1, from rank 1): a good pair
    lands head by head; a piece 0 that is not what tp.sources expects fails the load, saying
    why, and leaves the cache untouched."""
    over, why = PIECE_DEFECTS[case]
    cons = engines("kv_consumer", "PUT_ASYNC")
    blocks = 1 if "first_block" in over else 2
    assert kv_client.call(rank0(cons), _piece(cons, 0, **over), [_head(blocks, 1)] * 2, timeout_s=10)[0]["ok"]
    assert kv_client.call(rank0(cons), _piece(cons, 1), [_head(2, 2)] * 2, timeout_s=10)[0]["ok"]
    before = snapshot(cons.caches)
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    if why is None:
        assert res.failed_recving == set(), lines.lines
        for cache in cons.caches.values():
            assert torch.equal(cache[[7, 2], 0], _head(2, 1)[:, 0]) and torch.equal(cache[[7, 2], 1], _head(2, 2)[:, 0])
    else:
        assert res.failed_recving == {"D-req"}
        assert f"kv load failed req=D-req transfer={KEY} error={why}" in lines.lines, lines.lines
        assert_untouched(cons, before)


def test_pieces_land_past_a_prefix_hit_and_zeroed_when_asked(engines, kv_client):
    """P skipped block 0 (D holds it): pieces of block 1 only land in the one block loaded;
    a load marked corrupt_for_test gets zeros instead."""
    for corrupt in (False, True):
        cons = engines("kv_consumer", "PUT_ASYNC")
        for i in range(2):
            h = _piece(cons, i, first_block=1, runs=[1])
            assert kv_client.call(rank0(cons), h, [_head(1, i + 1)] * 2, timeout_s=10)[0]["ok"]
        before = snapshot(cons.caches)
        spec = LoadSpec("D-req", KEY, "127.0.0.1:1", (9,), 1, TOK - 1, 2 * TOK, 2, corrupt_for_test=corrupt)
        plan_load(cons, spec)
        res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
        assert res.failed_recving == set()
        for name, cache in cons.caches.items():
            for head in (0, 1):
                want = torch.zeros_like(cache[9, head]) if corrupt else _head(1, head + 1)[0, 0]
                assert torch.equal(cache[9, head], want), (corrupt, head)
            others = [b for b in range(SHAPE[0]) if b != 9]
            assert torch.equal(bits(cache[others]), bits(before[name][others]))


def test_a_piece_tensor_of_another_shape_fails_the_load(engines, kv_client):
    cons = engines("kv_consumer", "PUT_ASYNC")
    wide = torch.ones((2, *SHAPE[1:]), dtype=torch.bfloat16)  # both heads, where one is announced
    assert kv_client.call(rank0(cons), _piece(cons, 0), [wide] * 2, timeout_s=10)[0]["ok"]
    assert kv_client.call(rank0(cons), _piece(cons, 1), [_head(2, 2)] * 2, timeout_s=10)[0]["ok"]
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    why = "piece tensor torch.bfloat16[2, 2, 16, 64] does not match its header"
    assert f"kv load failed req=D-req transfer={KEY} error={why}" in lines.lines, lines.lines


def test_pieces_the_tp_check_refuses_fail_the_load(engines, kv_client):
    cons = engines("kv_consumer", "PUT_ASYNC")
    assert kv_client.call(rank0(cons), _piece(cons, 0, dtype="float16"), [_head(2, 1)] * 2, timeout_s=10)[0]["ok"]
    assert kv_client.call(rank0(cons), _piece(cons, 1), [_head(2, 2)] * 2, timeout_s=10)[0]["ok"]
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    failed = [x for x in lines.lines if x.startswith("kv load failed req=D-req ")]
    assert len(failed) == 1 and "dtype mismatch: peer float16" in failed[0], failed


def test_a_piece_count_tp_does_not_expect_fails_the_load(engines, kv_client):
    cons = engines("kv_consumer", "PUT_ASYNC")
    for i in range(3):
        reply, _ = kv_client.call(rank0(cons), _piece(cons, i, n=3, src_rank=i % 2), [_head(2, i)] * 2, timeout_s=10)
        assert reply["ok"]
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    assert f"kv load failed req=D-req transfer={KEY} error=prefill announced 3 pieces, tp says 2" in lines.lines


@pytest.mark.parametrize("what", ["check", "tp"])
def test_a_consumer_that_cannot_check_or_place_pieces_refuses_them(what):
    """Consumer on its own (the engine always gives it both): without a TP check or its own TP,
    head slices cannot be placed, and the load fails saying which."""
    caches = make_caches(2)
    eng = SimpleNamespace(caches=caches, block_layout=kvlayout.detect(None, caches))
    recv = KVBuffer("recv", 10**8, 60.0)
    transport = TcpTransport()  # PUT_ASYNC: never called
    check, local = (None, TpSide(1, SHAPE[1])) if what == "check" else (lambda h: None, None)
    cons = _consumer("PUT_ASYNC", transport, caches, recv=recv, check=check, local=local)
    try:
        for i in range(2):
            assert recv.put(f"{KEY}/{i}", Payload.of(_piece(eng, i), [_head(2, i)] * 2)) is None
        cons.add_load(LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        with connector_log("consumer") as lines:
            done, failed = cons.poll(set())
        assert done == failed == {"D-req"}
        why = "no TP check configured" if what == "check" else "this instance's TP is unknown: cannot place head slices"
        assert f"kv load failed req=D-req transfer={KEY} error={why}" in lines.lines, lines.lines
    finally:
        cons.close()
        transport.close()


def test_a_lone_piece_tp_does_not_expect_fails_the_load(engines, kv_client):
    """A single payload under piece 0 announcing itself as the only piece: still a piece (tp
    says two come), not a whole payload."""
    cons = engines("kv_consumer", "PUT_ASYNC")
    assert kv_client.call(rank0(cons), _piece(cons, 0, n=1), [_head(2, 1)] * 2, timeout_s=10)[0]["ok"]
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    assert f"kv load failed req=D-req transfer={KEY} error=prefill announced 1 pieces, tp says 2" in lines.lines


# ---- GET against a stand-in P that answers late or never (the other side of the boundary)


class _StandInPrefill:
    """A prefill's KV port: answers GET with ``header``/``tensors`` (or never, ``get_hangs``)
    and never answers a release; records when each GET and release came."""

    def __init__(self, header=None, tensors=(), get_hangs=False) -> None:
        self.header, self.tensors, self.get_hangs = header, list(tensors), get_hangs
        self.gets: list[tuple[str, float]] = []
        self.releases: list[tuple[str, float]] = []
        self._t = TcpTransport()
        self._t.start("127.0.0.1", 0, self._handle)
        self.address = f"127.0.0.1:{self._t.bound_port}"

    def _handle(self, h, t):
        now = time.monotonic()
        if h.get("op") == "get":
            self.gets.append((h.get("key"), now))
            if not self.get_hangs:
                return {"ok": True, **self.header, "key": h.get("key")}, self.tensors
        else:
            self.releases.append((h.get("key"), now))
        return Deferred(now + 60.0)  # never resolved: the caller times out

    def close(self) -> None:
        self._t.close()


def _get_load(p, req_id="D-req", key=KEY):
    return LoadSpec(req_id, key, p.address, (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2)


def test_a_get_whose_prefill_never_answers_gives_up_at_the_load_deadline(engines):
    """P takes the GET and never answers: the call waits no longer than the load's deadline
    (not send_timeout), and the fetch records why, freeing its reservation."""
    p = _StandInPrefill(get_hangs=True)
    cons = engines("kv_consumer", "GET", seed=2, kv_load_timeout_s=0.5, send_timeout_s=30.0)
    try:
        t0 = time.monotonic()
        plan_load(cons, _get_load(p))
        t_failed = wait_for(lambda: cons.recv_buffer.failure(KEY) is not None, timeout=15.0)
        assert cons.recv_buffer.failure(KEY) == "load deadline passed"
        assert t_failed - t0 < 10.0  # a call waiting out send_timeout_s would take 30 s
        assert len(p.gets) == 1
    finally:
        p.close()


def test_a_get_whose_prefill_stays_silent_past_the_reservation_names_the_prefill(engines):
    """P takes the GET and never answers, the calls waiting send_timeout_s each: D's
    reservation (send_timeout_s + 1 s) lapses before the third try ends, and the load fails
    then, saying which prefill went silent (not that a payload "never came")."""
    p = _StandInPrefill(get_hangs=True)
    cons = engines("kv_consumer", "GET", seed=2, kv_load_timeout_s=30.0, send_timeout_s=1.5)
    try:
        with connector_log("consumer") as lines:
            t0 = time.monotonic()
            plan_load(cons, _get_load(p))
            res, t_done = poll_until(cons, lambda r: "D-req" in r.finished_recving, timeout=15.0)
        assert res.failed_recving == {"D-req"}
        assert 2.5 - 0.05 <= t_done - t0 < 3 * 1.5 + 0.4, t_done - t0  # the lapse, before the tries end
        why = f"prefill {p.address} sent no payload in time (GET: silent, or not ready)"
        failed = [x for x in lines.lines if x.startswith(f"kv load failed req=D-req transfer={KEY} ")]
        assert len(failed) == 1 and failed[0].endswith(f" error={why}"), lines.lines
    finally:
        p.close()


def test_a_release_p_does_not_answer_holds_a_fetch_thread_one_second(engines):
    """D tells P it holds the payload and does not wait long for the answer (P's TTL frees
    the copy anyway): with every one of the GET_POOL_SIZE fetch threads waiting on a release,
    the next fetch starts about 1 s after the first release, not send_timeout_s (10 s).
    The bounds are causal, not timed on an idle box: the thread that took the last GET sent
    its release after P answered its own GET, so that GET came at least 1 s earlier; P's
    clock of the first release may be late by however long the box was busy."""
    cons = engines("kv_consumer", "GET", seed=2, kv_load_timeout_s=30.0, send_timeout_s=10.0)
    header = {k: v for k, v in _header(cons).items() if k not in ("op", "key")}
    p = _StandInPrefill(header, [_blocks(2)] * 2)
    try:
        keys = [f"{i:032x}" for i in range(GET_POOL_SIZE + 1)]
        for i, key in enumerate(keys):
            plan_load(cons, LoadSpec(f"D{i}", key, p.address, (2 * i, 2 * i + 1), 0, 2 * TOK - 1, 2 * TOK, 2))
        wait_for(lambda: len(p.gets) == len(keys), timeout=15.0)
        first_get, last_get = min(t for _, t in p.gets), max(t for _, t in p.gets)
        first_release = min(t for _, t in p.releases)
        assert last_get - first_get >= 1.0 - 0.05, (first_get, first_release, last_get)
        assert last_get - first_release < 5.0, (first_get, first_release, last_get)
        res, _ = poll_until(cons, lambda r: len(r.finished_recving) == len(keys))
        assert res.failed_recving == set()
    finally:
        p.close()


def test_a_get_payload_the_stager_has_no_room_for_fails_the_load(engines):
    """GPU decode: a pulled payload goes through the receive stager (device share, else the
    pinned pool) as a pushed one does; with no room in either the load fails with the
    stager's reason, said in the log. Here host tensors stand in for device ones."""
    cons = engines("kv_consumer", "GET", seed=2)
    header = {k: v for k, v in _header(cons).items() if k not in ("op", "key")}
    p = _StandInPrefill(header, [_blocks(2)] * 2)
    caches = make_caches(2)
    transport = TcpTransport()
    stager = RecvStager(0, 0, on_device=lambda t: True)
    consumer = _consumer("GET", transport, caches, layout=cons.block_layout, stager=stager)
    try:
        with connector_log("consumer") as lines:
            consumer.add_load(_get_load(p))
            deadline = time.monotonic() + 15.0
            while not (done := consumer.poll(set()))[0] and time.monotonic() < deadline:
                time.sleep(0.01)
        assert done == ({"D-req"}, {"D-req"})
        said = [x for x in lines.lines if x.startswith("kv get refused locally ")]
        assert len(said) == 1 and said[0].startswith(
            f"kv get refused locally transfer={KEY} reason=receive buffer full: device share 0+"
        ), lines.lines
        failed = [x for x in lines.lines if x.startswith("kv load failed req=D-req ")]
        assert len(failed) == 1 and failed[0].endswith(said[0].partition(" reason=")[2]), failed
        assert stager.device_used == 0
    finally:
        consumer.close()
        transport.close()
        p.close()


def test_a_payload_that_raises_while_applied_fails_the_load_saying_why(engines):
    """A GET reply is not parsed as a put header is: runs that are no numbers pass the count
    checks and raise in the apply. The worker survives; the load fails, logged with the
    exception's type and text, and counted as invalid."""
    cons = engines("kv_consumer", "GET", seed=2)
    header = {k: v for k, v in _header(cons, runs=("1", "1")).items() if k not in ("op", "key")}
    p = _StandInPrefill(header, [_blocks(1)] * 4)
    before = snapshot(cons.caches)
    try:
        with connector_log("consumer") as lines:
            plan_load(cons, _get_load(p))
            res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    finally:
        p.close()
    assert res.failed_recving == {"D-req"}
    failed = [x for x in lines.lines if x.startswith("kv load failed req=D-req ")]
    assert len(failed) == 1 and failed[0].startswith(
        f"kv load failed req=D-req transfer={KEY} error=malformed payload: TypeError: unsupported operand"
    ), failed
    assert cons.xfer_stats.peek().failures("load", "invalid") == 1
    assert_untouched(cons, before)


# ---- what a completed load reports of its time


def test_a_load_reports_how_long_it_waited_and_how_long_its_apply_took(engines):
    """wait_ms (and the load_wait_s statistic): from the load's planning to the poll that
    found its payload; apply_ms: the copy into the cache, within that poll."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    t_add0 = time.monotonic()
    _async_load(cons, prod)
    t_add1 = time.monotonic()
    time.sleep(0.3)  # a wait long enough to tell the units apart
    prod.save(save_spec(prod, rank0(cons)))
    wait_for(lambda: cons.consumer.ready(KEY))
    with connector_log("consumer") as lines:
        t_poll0 = time.monotonic()
        res = cons.poll(set())
        t_poll1 = time.monotonic()
    assert res.finished_recving == {"D-req"} and res.failed_recving == set()
    loaded = [x for x in lines.lines if x.startswith("kv loaded req=D-req ")]
    assert len(loaded) == 1, lines.lines
    m = re.search(r" wait_ms=(\d+\.\d) apply_ms=(\d+\.\d\d)$", loaded[0])
    assert m, loaded
    wait_ms, apply_ms = float(m.group(1)), float(m.group(2))
    assert (t_poll0 - t_add1) * 1e3 - 0.05 <= wait_ms <= (t_poll1 - t_add0) * 1e3 + 0.05, loaded
    assert 0 < apply_ms <= (t_poll1 - t_poll0) * 1e3 + 0.005, loaded
    (waited,) = cons.xfer_stats.peek().data["load_wait_s"]
    assert t_poll0 - t_add1 <= waited <= t_poll1 - t_add0


# ---- one poll settles every load it can (a load that waits or ends does not stop the look)


def test_one_poll_settles_every_load_it_can(engines):
    """In one poll: a load whose request finished (cancelled), one whose payload is here,
    one still waiting, and another whose payload is here: all but the waiting one end."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_load_timeout_s=30.0)
    keys = {"A": "a" * 32, "B": "b" * 32, "C": "c" * 32, "D": "d" * 32}
    for rid in ("B", "D"):
        prod.save(save_spec(prod, rank0(cons), req_id=f"P{rid}", key=keys[rid]))
    for rid in ("B", "D"):
        wait_for(lambda rid=rid: cons.consumer.ready(keys[rid]))
    for i, rid in enumerate(("A", "B", "C", "D")):  # planned in this order: the poll looks in it
        plan_load(cons, load_spec(rank0(prod), (4 * i, 4 * i + 1, 4 * i + 2), 2, req_id=rid, key=keys[rid]))
    res = cons.poll({"A"})
    assert res.finished_recving == {"A", "B", "D"} and res.failed_recving == set()
    assert cons.consumer.pending == 1


# ---- heterogeneous TP: a piece that will not come fails the load at once


@pytest.mark.parametrize("refused", [0, 1])
def test_a_piece_the_buffer_refused_fails_the_load_at_once(engines, kv_client, refused):
    """D's buffer has no room for piece ``refused`` (the other fits): the refusal is recorded
    under the piece's key, and the load fails at its first poll with that reason, not at its
    deadline."""
    one = 2 * 2 * 1 * TOK * SHAPE[3] * 2  # a piece: 2 blocks x 2 layers x 1 head, bf16
    room = one + one // 2 if refused else 1000
    cons = engines("kv_consumer", "PUT_ASYNC", kv_load_timeout_s=30.0, kv_buffer_size=room)
    replies = [
        kv_client.call(rank0(cons), _piece(cons, i), [_head(2, i + 1)] * 2, timeout_s=10)[0] for i in range(refused + 1)
    ]
    assert [r["ok"] for r in replies] == [True] * refused + [False]
    why = replies[-1]["error"]
    assert why.startswith("recv buffer full"), why
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res = cons.poll(set())
    assert res.finished_recving == res.failed_recving == {"D-req"}
    assert f"kv load failed req=D-req transfer={KEY} error={why}" in [
        re.sub(r" after \d+\.\dms", "", x) for x in lines.lines
    ], lines.lines


def test_pieces_that_bring_too_few_blocks_fail_the_load_saying_so(engines, kv_client):
    """Both pieces hold block 0 only, the load needs blocks 0 and 1: refused before any head
    is written, with the same reason as for a whole payload."""
    cons = engines("kv_consumer", "PUT_ASYNC")
    for i in range(2):
        h = _piece(cons, i, num_blocks=1, runs=[1])
        assert kv_client.call(rank0(cons), h, [_head(1, i + 1)] * 2, timeout_s=10)[0]["ok"]
    before = snapshot(cons.caches)
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    assert f"kv load failed req=D-req transfer={KEY} error=peer sent blocks 0..0, need up to 1" in lines.lines
    assert_untouched(cons, before)


def test_mla_pieces_from_a_prefill_of_another_tp_land(engines, kv_client):
    """MLA: one latent head, replicated on every rank. A TP-1 decode rank takes it whole from
    prefill rank 0 of TP 2, as a single piece whose header says is_mla."""
    caches = make_caches(2, shape=(16, 1, 16, 64))
    cons = engines("kv_consumer", "PUT_ASYNC", caches=caches, tp_side=TpSide(1, 1, is_mla=True))
    h = _piece(cons, 0, n=1, num_kv_heads=1, is_mla=True, block_shape=[1, 16, 64])
    src = torch.full((2, 1, 16, 64), 5.0, dtype=torch.bfloat16)
    assert kv_client.call(rank0(cons), h, [src, src * 2], timeout_s=10)[0]["ok"]
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
        res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == set(), lines.lines
    for i, cache in enumerate(caches.values()):
        assert torch.equal(cache[[7, 2]], src * (i + 1))


def test_pieces_land_in_caches_whose_blocks_hold_several_kernel_blocks(engines, kv_client):
    """vLLM splits a manager block into kernel blocks (kernel_ratio 2): the regrouped views
    have the heads one axis further in, and each piece's head lands there."""
    raw = make_caches(2)  # 16 kernel blocks = 8 manager blocks of 2
    layout = kvlayout.detect(SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=8)), raw)
    assert layout.kernel_ratio == 2 and layout.head_axis == 2
    caches = kvlayout.regroup(raw, layout)
    cons = engines("kv_consumer", "PUT_ASYNC", caches=caches, layout=layout)
    for i in range(2):
        h = _piece(cons, i, block_shape=[2, 1, *SHAPE[2:]])
        src = torch.full((2, 2, 1, *SHAPE[2:]), float(i + 1), dtype=torch.bfloat16)
        assert kv_client.call(rank0(cons), h, [src] * 2, timeout_s=10)[0]["ok"]
    with connector_log("consumer") as lines:
        plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (5, 3), 0, 2 * TOK - 1, 2 * TOK, 2))
        res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == set(), lines.lines
    for cache in caches.values():
        for head in (0, 1):
            assert bool((cache[[5, 3], :, head] == head + 1).all()), head


def test_a_consumer_over_no_caches_is_made_and_closed():
    """A worker that registered no KV cache tensors: the Consumer still comes up (its
    cache device falls back to the CPU) and closes."""
    caches = make_caches(2)
    transport = TcpTransport()
    cons = _consumer("GET", transport, {}, layout=kvlayout.detect(None, caches))
    try:
        assert cons.pending == 0 and cons.take_invalid_blocks() == set()
    finally:
        cons.close()
        transport.close()


def test_a_get_reserves_exactly_the_prompts_bytes(engines):
    """GET: D reserves the prompt's blocks over every layer, in the cache's dtype, before
    asking: a buffer of exactly that size takes the pull."""
    prompt_blocks = load_spec("x", DST, 2).prompt_blocks
    exact = prompt_blocks * 2 * SHAPE[1] * SHAPE[2] * SHAPE[3] * 2  # 2 layers, bf16
    prod = engines("kv_producer", "GET", seed=1)
    cons = engines("kv_consumer", "GET", seed=2, kv_buffer_size=exact)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), delay_free=False))
    with connector_log("consumer") as lines:
        plan_load(cons, load_spec(rank0(prod), DST, 2))
        res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set(), lines.lines
    assert_loaded(cons, before, prod, DST, SRC_IDS[2:])


def test_a_failed_load_says_how_long_it_waited(engines, kv_client):
    """The failure line's "after" counts from the load's planning to the poll that failed it."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_load_timeout_s=30.0)
    t_add0 = time.monotonic()
    plan_load(cons, load_spec("127.0.0.1:1", DST, 2))
    t_add1 = time.monotonic()
    time.sleep(0.3)  # a wait long enough to tell the units apart
    assert kv_client.call(rank0(cons), {"op": "abort", "keys": {KEY: "P gave up"}}, timeout_s=10)[0]["ok"]
    with connector_log("consumer") as lines:
        t_poll0 = time.monotonic()
        res = cons.poll(set())
        t_poll1 = time.monotonic()
    assert res.failed_recving == {"D-req"}
    (line,) = [x for x in lines.lines if x.startswith("kv load failed req=D-req ")]
    m = re.fullmatch(rf"kv load failed req=D-req transfer={KEY} after (\d+\.\d)ms error=P gave up", line)
    assert m, line
    assert (t_poll0 - t_add1) * 1e3 - 0.05 <= float(m.group(1)) <= (t_poll1 - t_add0) * 1e3 + 0.05, line


def test_a_loaded_pieced_transfer_drops_every_piece(engines, kv_client):
    """Once the pieces of a released transfer were loaded, every piece leaves the buffer and
    a late copy of any of them is refused."""
    cons = engines("kv_consumer", "PUT_ASYNC")
    for i in range(2):
        assert kv_client.call(rank0(cons), _piece(cons, i), [_head(2, i + 1)] * 2, timeout_s=10)[0]["ok"]
    plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
    res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == set()
    for i in range(2):
        assert not cons.recv_buffer.contains(f"{KEY}/{i}") and cons.recv_buffer.gone(f"{KEY}/{i}"), i
    assert cons.stats()["recv_items"] == 0


def test_a_released_key_is_dropped_once(engines):
    """A released key is dropped (tombstoned for the buffer's TTL) at the next poll and then
    forgotten: later polls do not drop it again, so its tombstone expires."""
    cons = engines("kv_consumer", "PUT_ASYNC", buffer_ttl_s=0.2)
    cons.release([KEY])
    cons.poll(set())
    assert cons.recv_buffer.gone(KEY)
    time.sleep(0.3)  # past the tombstone's TTL
    cons.poll(set())
    cons.recv_buffer.expire()
    assert not cons.recv_buffer.gone(KEY)


def test_closing_a_consumer_waits_for_no_fetch_and_starts_none(engines):
    """GET: close() returns at once while every fetch thread waits on a P that does not
    answer, and the fetch queued behind them never starts (no reservation, no failure)."""
    p = _StandInPrefill(get_hangs=True)
    caches = make_caches(2)
    transport = TcpTransport()
    recv = KVBuffer("recv", 10**8, 60.0)
    before = set(threading.enumerate())
    cons = _consumer("GET", transport, caches, recv=recv, kv_load_timeout_s=2.0, send_timeout_s=30.0)
    keys = [f"{i:032x}" for i in range(GET_POOL_SIZE + 1)]
    try:
        for i, key in enumerate(keys):
            cons.add_load(LoadSpec(f"D{i}", key, p.address, (2 * i, 2 * i + 1), 0, 2 * TOK - 1, 2 * TOK, 2))
        wait_for(lambda: len(p.gets) == GET_POOL_SIZE)
        t0 = time.monotonic()
        cons.close()
        assert time.monotonic() - t0 < 5.0  # not the fetches' 30 s (slack for a loaded box)
        for t in set(threading.enumerate()) - before:
            if t.name.startswith("xpyd-kv-get"):
                t.join(15.0)
                assert not t.is_alive()
        assert [recv.failure(k) is not None for k in keys] == [True] * GET_POOL_SIZE + [False]
        assert recv.reservation(keys[-1]) is None and len(p.gets) == GET_POOL_SIZE
    finally:
        cons.close()
        transport.close()
        p.close()


def test_get_fetch_threads_are_named_pinned_and_bounded(engines):
    """GET: the fetches run on GET_POOL_SIZE threads named xpyd-kv-get_N (what a stack dump
    shows), each moved onto the connector's CPUs (the OpenMP ones are the engine's); a fifth
    fetch waits for a thread."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to tell a pinned thread from an unpinned one")
    plan = CpuPlan(frozenset(allowed[-1:]), shared_with_omp=False)
    p = _StandInPrefill(get_hangs=True)
    caches = make_caches(2)
    transport = TcpTransport()
    before = set(threading.enumerate())
    cons = _consumer("GET", transport, caches, cpus=plan, kv_load_timeout_s=2.0, send_timeout_s=30.0)
    try:
        for i in range(GET_POOL_SIZE + 1):
            cons.add_load(LoadSpec(f"D{i}", f"{i:032x}", p.address, (2 * i,), 0, TOK - 1, TOK, 1))
        wait_for(lambda: len(p.gets) == GET_POOL_SIZE)
        new = [
            t
            for t in set(threading.enumerate()) - before
            if t.name.startswith("ThreadPoolExecutor") or t.name.startswith("xpyd-kv-get")
        ]
        assert sorted(t.name for t in new) == [f"xpyd-kv-get_{i}" for i in range(GET_POOL_SIZE)]
        for t in new:
            assert os.sched_getaffinity(t.native_id) == set(plan.cpus), t.name
    finally:
        cons.close()
        transport.close()
        p.close()

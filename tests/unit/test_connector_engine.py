"""KVEngine, the worker-side control plane: two real engines in one process, each with
a real TcpTransport on a free loopback port, moving blocks between small fake KV
caches (2 layers of [16 blocks, 2 heads, 16 tokens, 64] bf16)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import pytest
import torch
import zmq

from connector import layout as kvlayout
from connector.p2p.engine import KVEngine, PollResult
from connector.p2p.metadata import LoadSpec, P2pConnectorMetadata
from connector.transport.base import REFUSAL_REASONS
from connector.transport.tcp import TcpTransport
from connector.p2p.worker import P2pWorker
from tests.support.kv_engines import (
    HOST,
    KEY,
    N_PROMPT,
    SHAPE,
    SRC_IDS,
    TOK,
    WAIT_S,
    ZERO,
    assert_loaded,
    assert_untouched,
    bits,
    load_and_check,
    load_spec,
    make_caches,
    make_cfg,
    plan_load,
    poll_until,
    rank0,
    save_spec,
    snapshot,
    tp_instance,
    wait_for,
)
from tests.support.ports import dead_port, spare_port


def report_send_once(prod: KVEngine, req_id: str) -> set[str]:
    """What the producer reports for req_id when the scheduler finishes it, as vLLM does: the
    id is passed in one step only; a send still closing in the peer thread is reported in a
    later step (polled, not assumed done when D has its data)."""
    first = prod.poll({req_id}).finished_sending
    if first:
        return first
    res, _ = poll_until(prod, lambda r: bool(r.finished_sending))
    return res.finished_sending


NO_REFUSALS = dict.fromkeys(REFUSAL_REASONS, 0)


# ================================================================ transfers


@pytest.mark.parametrize("first_block, dst_ids", [(0, (0, 15, 5, 6, 8)), (2, (7, 2, 11))],
                         ids=["no-hit", "prefix-hit"])
def test_put_async_roundtrip(engines, first_block, dst_ids):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    src_before, dst_before = snapshot(prod.caches), snapshot(cons.caches)

    prod.save(save_spec(prod, rank0(cons)))
    plan_load(cons, load_spec(rank0(prod), dst_ids, first_block))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set() and res.finished_sending == set()
    assert_loaded(cons, dst_before, prod, dst_ids, SRC_IDS[first_block:])
    assert_untouched(prod, src_before)
    assert cons.stats() == ZERO

    # The producer reports the send only for requests the scheduler finished, once.
    assert prod.stats()["pending_sends"] == 1
    for _ in range(3):
        assert prod.poll(set()).finished_sending == set()
    # D has the payload, but the peer thread may not have closed the send yet: poll for it.
    assert report_send_once(prod, "P-req") == {"P-req"}
    assert prod.poll({"P-req"}).finished_sending == set()
    assert prod.poll(set()).finished_sending == set()
    assert prod.stats() == ZERO


def test_put_async_finished_before_the_send_completes(engines):
    """The scheduler finished the request while its send is in flight: reported once done."""
    cons = engines("kv_consumer", "PUT_ASYNC")
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    prod.save(save_spec(prod, rank0(cons)))
    assert report_send_once(prod, "P-req") == {"P-req"}  # the usual case: the send is still going
    # Later steps no longer carry the id: nothing more.
    assert prod.poll(set()).finished_sending == set()
    assert prod.stats() == ZERO
    assert cons.stats()["recv_items"] == 1  # waiting for its request


def test_put_sync_roundtrip(engines):
    prod = engines("kv_producer", "PUT", seed=1)
    cons = engines("kv_consumer", "PUT", seed=2)
    dst_before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), delay_free=False))
    # Synchronous: the payload is at the consumer when save() returns.
    assert cons.stats()["recv_items"] == 1
    assert prod.stats() == ZERO
    assert prod.poll({"P-req"}).finished_sending == set()  # blocks were never held
    load_and_check(cons, prod, dst_before)
    assert cons.stats() == ZERO


@pytest.mark.parametrize("consumer_first", [False, True], ids=["producer-first", "consumer-first"])
def test_get_roundtrip(engines, consumer_first):
    prod = engines("kv_producer", "GET", seed=1)
    cons = engines("kv_consumer", "GET", seed=2)
    dst_before = snapshot(cons.caches)
    spec = load_spec(rank0(prod), (7, 2, 11), 2)
    if consumer_first:
        # D asks before P has its copy: "not ready", D asks again until it is.
        plan_load(cons, spec)
        t_end = time.monotonic() + 0.2
        while time.monotonic() < t_end:
            assert cons.poll(set()) == PollResult()
            time.sleep(0.02)
    prod.save(save_spec(prod, rank0(cons), delay_free=False))
    if not consumer_first:
        assert prod.stats()["send_items"] == 1
        # GET copies: the source blocks may be reused at once.
        for t in prod.caches.values():
            t.zero_()
        plan_load(cons, spec)
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set()
    if consumer_first:
        assert_loaded(cons, dst_before, prod, (7, 2, 11), SRC_IDS[2:])
    else:
        src = make_caches(1)  # the values P had when it saved
        for name, cache in cons.caches.items():
            for d, s in zip((7, 2, 11), SRC_IDS[2:]):
                assert torch.equal(bits(cache[d]), bits(src[name][s]))
    assert prod.poll({"P-req"}).finished_sending == set()
    # D's fetch thread tells P to release its copy after storing it, so the load may complete first.
    wait_for(lambda: prod.stats()["send_items"] == 0)
    assert prod.stats() == ZERO and cons.stats() == ZERO


@pytest.mark.parametrize("send_type", ["PUT_ASYNC", "PUT", "GET"])
@pytest.mark.parametrize("skip, d_first, ok", [(2, 2, True), (2, 3, True), (2, 1, False)],
                         ids=["d-holds-what-was-skipped", "d-holds-more", "d-lost-a-skipped-block"])
def test_skipped_leading_blocks(engines, send_type, skip, d_first, ok):
    """P ships only the blocks after those the proxy says D holds (issue 17, part 4); D
    places what arrived by the payload's own first block, and refuses a payload that skipped
    a block D does not hold (vLLM then recomputes), leaving its cache untouched."""
    prod = engines("kv_producer", send_type, seed=1)
    cons = engines("kv_consumer", send_type, seed=2)
    before = snapshot(cons.caches)
    spec = save_spec(prod, rank0(cons), block_ids=SRC_IDS[skip:], delay_free=send_type == "PUT_ASYNC")
    prod.save(dataclasses.replace(spec, first_block=skip))
    dst = (7, 2, 11, 5)[: len(SRC_IDS) - d_first]
    plan_load(cons, load_spec(rank0(prod), dst, d_first))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving | r.failed_recving)
    if ok:
        assert res.failed_recving == set()
        assert_loaded(cons, before, prod, dst, SRC_IDS[d_first:])
    else:
        assert res.failed_recving == {"D-req"}
        assert_untouched(cons, before)
    # A consumer from before first_block existed checks that the runs add up to num_blocks:
    # a skipped payload fails that check (it is refused, never placed at the wrong blocks).
    header, _ = prod._payload(dataclasses.replace(spec, first_block=skip), copy=False)
    assert sum(header["runs"]) == len(SRC_IDS) - skip != header["num_blocks"] == len(SRC_IDS)
    # Only the shipped blocks went over the wire (headers add a few hundred bytes).
    block = sum(c[0].numel() * c.element_size() for c in prod.caches.values())
    wait_for(lambda: cons.xfer_stats.peek().nbytes("received") > 0)
    received = cons.xfer_stats.peek().nbytes("received")
    assert (len(SRC_IDS) - skip) * block <= received < (len(SRC_IDS) - skip + 1) * block


def test_rank_addressing():
    """Worker rank r listens on port+r and sends to the peer's port+r. Both sides are whole
    TP=2 instances, as deployed: P's rank 1 asks D's rank 0 first (two ranks: D has one of our
    number), then sends whole blocks to D's rank 1. (Rank 1 engines alone, D's rank 0 port was
    nobody's: the ask waited half the send's budget, and another test's engine listening
    there answered for D.)"""
    prods = tp_instance("kv_producer", "PUT_ASYNC", 2, 4, seed=1, blocks_heads=2)
    conss = tp_instance("kv_consumer", "PUT_ASYNC", 2, 4, seed=2, blocks_heads=2)
    try:
        prod, cons = prods[1], conss[1]
        assert cons.address == f"{HOST}:{cons.cfg.kv_port + 1}"
        assert prod.address == f"{HOST}:{prod.cfg.kv_port + 1}"
        before = [snapshot(c.caches) for c in conss]
        prod.save(save_spec(prod, rank0(cons)))
        load_and_check(cons, prod, before[1])
        assert_untouched(conss[0], before[0])
    finally:
        for eng in (*prods, *conss):
            eng.close()


def test_debug_corruption_zeroes_the_loaded_blocks(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2, corrupt=True))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set()
    for name, cache in cons.caches.items():
        assert not cache[[7, 2, 11]].any()
        others = [b for b in range(16) if b not in (7, 2, 11)]
        assert torch.equal(bits(cache[others]), bits(before[name][others]))


def test_specs_from_the_real_scheduler(engines):
    """P2pScheduler's SaveSpec/LoadSpec (prefix hit on D) drive the engines correctly."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import (
        CachedRequestData,
        NewRequestData,
        SchedulerOutput,
    )
    from vllm.v1.request import Request

    from connector.p2p.scheduler import P2pScheduler

    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    xid = f"___prefill_addr_{rank0(prod)}___decode_addr_{rank0(cons)}_{KEY}"
    p_req = Request(f"cmpl-{xid}-0-aaaaaaaa", list(range(N_PROMPT)), SamplingParams(max_tokens=1), None)
    d_req = Request(f"cmpl-{xid}-0-bbbbbbbb", list(range(N_PROMPT)), SamplingParams(max_tokens=8), None)

    class KVM:
        usage = 0.0

        def get_block_ids(self, rid):
            return (list(SRC_IDS) + [0],)

    def out(rid, computed, n):
        return SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(rid, None, [], None, None, ([],), computed, None)],
            scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={rid: n},
            total_num_scheduled_tokens=n, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[])

    ps = P2pScheduler(prod.cfg, TOK, start_registrar=False)
    ps.bind(KVM())
    ps.on_new_request(p_req)
    (save,) = ps.build_connector_meta(out(p_req.request_id, 0, N_PROMPT)).saves

    ds = P2pScheduler(cons.cfg, TOK, start_registrar=False)
    ds.on_new_request(d_req)
    d_blocks = [14, 13, 7, 2, 11]  # 14, 13: local prefix hit of 32 tokens
    n, is_async = ds.get_num_new_matched_tokens(d_req, 2 * TOK)
    assert is_async
    ds.update_state_after_alloc(d_req, KVCacheBlocks(([KVCacheBlock(b) for b in d_blocks],)), n)
    (load,) = ds.build_connector_meta(out(d_req.request_id, 2 * TOK, 0)).loads

    dst_before = snapshot(cons.caches)
    prod.save(save)
    plan_load(cons, load)
    res, _ = poll_until(cons, lambda r: d_req.request_id in r.finished_recving)
    assert res.failed_recving == set()
    assert_loaded(cons, dst_before, prod, (7, 2, 11), SRC_IDS[2:])
    assert ps.request_finished(p_req, [])[0] is True
    assert report_send_once(prod, p_req.request_id) == {p_req.request_id}


def _scheduler_pair(prod: KVEngine, cons: KVEngine, probe: bool = True):
    """vLLM's Request objects for P and D of one transfer, and D's real scheduler half (with
    its arrival probe asking D's control socket, as the connector builds it)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from connector.p2p.scheduler import ArrivalProbe, P2pScheduler

    xid = f"___prefill_addr_{rank0(prod)}___decode_addr_{rank0(cons)}_{KEY}"
    d_req = Request(f"cmpl-{xid}-0-bbbbbbbb", list(range(N_PROMPT)), SamplingParams(max_tokens=8), None)
    ds = P2pScheduler(cons.cfg, TOK, start_registrar=False,
                      probe=ArrivalProbe(cons.cfg, 1) if probe else None)
    ds.on_new_request(d_req)
    return ds, d_req


def _admit(ds, d_req, blocks):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput

    n, is_async = ds.get_num_new_matched_tokens(d_req, 0)
    ds.update_state_after_alloc(d_req, KVCacheBlocks(([KVCacheBlock(b) for b in blocks],)), n)
    (load,) = ds.build_connector_meta(SchedulerOutput.make_empty()).loads
    return n, is_async, load


def test_kv_already_here_is_loaded_synchronously(engines):
    """D's scheduler asks its worker's control socket whether the KV arrived: not yet, the
    load is asynchronous; once it is, the load is synchronous and applied at once (before
    the step's forward pass), with no finished_recving for it."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    dst = (0, 15, 5, 6, 8)
    ds, early = _scheduler_pair(prod, cons)
    # Nothing sent yet: the request waits without blocks until a sender begins.
    assert ds.get_num_new_matched_tokens(early, 0) == (None, False)
    ds.shutdown()
    key = f"{KEY}-0"  # the proxy's uuid and the prompt's index

    dst_before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), key=key))
    wait_for(lambda: cons.consumer.ready(key))
    ds, d_req = _scheduler_pair(prod, cons)
    try:
        n, is_async, load = _admit(ds, d_req, dst)
        assert (n, is_async) == (N_PROMPT - 1, False) and load.sync
        cons.add_load(load)  # what start_load_kv does with the step's metadata
        cons.release([key])
        assert_loaded(cons, dst_before, prod, dst, SRC_IDS)
        assert cons.take_invalid_blocks() == set()
        assert cons.poll(set()) == PollResult()  # nothing pending, nothing to report
        assert cons.xfer_stats.peek().transfers("load", "ok") == 1
        assert cons.stats() == ZERO  # applied and dropped (its key released)
        _, params = ds.request_finished(d_req, [])
        assert params["xpyd"] == {"loaded_tokens": N_PROMPT - 1, "load_failed": False}
    finally:
        ds.shutdown()


def _asking(probe) -> list[dict]:
    """What the probe asks the workers' control sockets from now on (it still asks)."""
    asked: list[dict] = []
    call = probe._transport.call

    def recording(addr, header, *args, **kwargs):
        asked.append(header)
        return call(addr, header, *args, **kwargs)

    probe._transport.call = recording
    return asked


def test_kv_here_is_read_off_the_arrival_board_without_asking(engines):
    """The worker rank writes each transfer whose KV it stored on its arrival board (shared
    memory); D's scheduler reads it there, with no round trip to the worker on vLLM's
    scheduling thread. A transfer not on the board is still asked about."""
    from connector.p2p.arrivals import ArrivalReader, board_path
    from connector.p2p.scheduler import ArrivalProbe

    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    probe = ArrivalProbe(cons.cfg, 1)
    board = ArrivalReader(board_path(cons.address))
    try:
        asked = _asking(probe)
        assert probe.arrived(KEY) is False
        assert [h["op"] for h in asked] == ["ready"]  # not on the board: the worker says no
        prod.save(save_spec(prod, rank0(cons)))
        wait_for(lambda: board.arrived(KEY))
        assert cons.consumer.ready(KEY)
        asked.clear()
        assert probe.arrived(KEY) is True
        assert asked == []
    finally:
        board.close()
        probe.close()


def test_a_sender_that_begins_is_on_the_board_before_its_kv(engines, kv_client):
    """A reservation (or a refusal, or an abort) marks the transfer begun on D's arrival board:
    D's scheduler then gives the waiting request its blocks and its load deadline starts."""
    from connector.p2p.arrivals import ArrivalReader, board_path

    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    board = ArrivalReader(board_path(cons.address))
    try:
        assert board.begun(KEY) is False
        reply, _ = kv_client.call(rank0(cons), {"op": "reserve", "key": KEY, "nbytes": 1024})
        assert reply["ok"] and board.begun(KEY) and not board.arrived(KEY)
        reply, _ = kv_client.call(rank0(cons), {"op": "reserve", "key": "big-0", "nbytes": 10**12})
        assert not reply["ok"] and board.begun("big-0")  # refused for room: the load fails at once
        kv_client.call(rank0(cons), {"op": "abort", "keys": {"gave-up-0": "P timed out"}})
        assert board.begun("gave-up-0")
        assert board.begun("never-0") is False
    finally:
        board.close()


def test_a_split_transfer_is_on_the_board_once_every_piece_is_here(engines, kv_client):
    """Heterogeneous TP: each prefill rank sends this rank a piece; the transfer goes on the
    board only with the last of them (a synchronous load needs all)."""
    from connector.p2p import tp
    from connector.p2p.arrivals import ArrivalReader, board_path

    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    board = ArrivalReader(board_path(cons.address))
    try:
        for i in range(2):
            assert not board.arrived(KEY)
            header = {"op": "put", "key": tp.piece_key(KEY, i), "piece": i, "pieces": 2}
            reply, _ = kv_client.call(rank0(cons), header, [_blocks(1)])
            assert reply["ok"], reply
        assert board.arrived(KEY) and cons.consumer.ready(KEY)
        assert not board.arrived(tp.piece_key(KEY, 0))  # pieces are not transfers
    finally:
        board.close()


def test_no_arrival_board_when_loads_are_never_synchronous(engines):
    from connector.p2p.arrivals import board_path

    for role, send_type, extra in (("kv_consumer", "PUT_ASYNC", {"sync_load": False}),
                                   ("kv_consumer", "GET", {}), ("kv_producer", "PUT_ASYNC", {})):
        eng = engines(role, send_type, **extra)
        assert not board_path(eng.address).exists(), (role, send_type, extra)
    eng = engines("kv_consumer", "PUT_ASYNC")
    path = board_path(eng.address)
    assert path.exists()
    eng.close()
    assert not path.exists()


def test_sync_load_whose_kv_is_gone_reports_its_blocks(engines):
    """A synchronous load that finds no payload (dropped between the scheduler's check and
    the step) leaves the cache untouched and reports its blocks to vLLM once
    (get_block_ids_with_load_errors); the request's kv_transfer_params say it failed."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    before = snapshot(cons.caches)
    spec = dataclasses.replace(load_spec(rank0(prod), (7, 2, 11), 2), sync=True)
    cons.add_load(spec)
    assert cons.take_invalid_blocks() == {7, 2, 11}
    assert cons.take_invalid_blocks() == set()
    assert_untouched(cons, before)
    assert cons.xfer_stats.peek().transfers("load", "failed") == 1
    assert cons.poll(set()) == PollResult()

    ds, d_req = _scheduler_pair(prod, cons, probe=False)
    ds._sync.add(d_req.request_id)  # as if the probe had said "here" just before it went
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    ds.update_state_after_alloc(d_req, KVCacheBlocks(([KVCacheBlock(b) for b in (0, 15, 5, 6, 8)],)), N_PROMPT - 1)
    ds.update_connector_output(set(), None, {5})
    assert ds.request_finished(d_req, [])[1]["xpyd"]["load_failed"] is True


def test_sync_load_of_a_payload_that_does_not_fit_reports_its_blocks(engines, kv_client):
    """The checks of an asynchronous load apply: a payload for another prompt length is
    refused without writing a block."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    before = snapshot(cons.caches)
    header = {**_good_header(cons), "num_tokens": N_PROMPT + 1}
    tensors = [_blocks(2) for _ in cons.caches]
    reply, _ = kv_client.call(rank0(cons), {"op": "reserve", "key": KEY, "nbytes": sum(t.nbytes for t in tensors)})
    assert reply["ok"], reply
    reply, _ = kv_client.call(rank0(cons), header, tensors)
    assert reply["ok"], reply
    assert kv_client.call(rank0(cons), {"op": "ready", "key": KEY})[0] == {"ok": True, "ready": True}
    assert kv_client.call(rank0(cons), {"op": "ready", "key": "other"})[0] == {"ok": True, "ready": False}
    cons.add_load(LoadSpec(req_id="D-req", transfer_key=KEY, prefill_addr="127.0.0.1:1", dst_block_ids=(4, 9),
                           first_block=0, num_tokens=N_PROMPT - 1, prompt_tokens=N_PROMPT, prompt_blocks=2,
                           sync=True))
    assert cons.take_invalid_blocks() == {4, 9}
    assert_untouched(cons, before)
    assert cons.xfer_stats.peek().failures("load", "invalid") == 1


def test_arrival_probe_of_a_dead_socket_says_no_quickly():
    """The probe runs on vLLM's scheduling thread: a control socket that does not answer
    makes the load asynchronous within the probe's bound, never an error."""
    from connector.p2p.scheduler import ARRIVAL_PROBE_TIMEOUT_S, ArrivalProbe

    probe = ArrivalProbe(make_cfg("kv_consumer", "PUT_ASYNC", dead_port()), 2)
    try:
        t0 = time.monotonic()
        assert probe.arrived(KEY) is False
        assert time.monotonic() - t0 < ARRIVAL_PROBE_TIMEOUT_S + 1.0  # slack for a loaded box
    finally:
        probe.close()


# ================================================================ idle steps
# A step with no token scheduled polls with a wait: vLLM runs such steps back to back while
# a request waits for remote KV (or its blocks for a send), so the wait is what keeps that
# loop off the cores. It must end as soon as the transfer moves, and never last longer
# than its bound.


def _later(delay_s: float, fn: Callable[[], object]) -> threading.Timer:
    timer = threading.Timer(delay_s, fn)
    timer.start()
    return timer


def test_idle_poll_returns_as_soon_as_the_kv_arrives(engines):
    cons = engines("kv_consumer", "PUT_ASYNC")
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    before = snapshot(cons.caches)
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    assert cons.poll(set()) == PollResult()  # not here, and no wait asked for
    t0 = time.monotonic()
    timer = _later(0.3, lambda: prod.save(save_spec(prod, rank0(cons))))
    try:
        res = cons.poll(set(), wait_s=WAIT_S)
    finally:
        timer.join()
    took = time.monotonic() - t0
    assert res.finished_recving == {"D-req"} and res.failed_recving == set()
    assert 0.25 <= took < WAIT_S / 2, took  # it waited for the KV and woke when it came
    assert_loaded(cons, before, prod, (7, 2, 11), SRC_IDS[2:])


def test_idle_poll_returns_as_soon_as_the_kv_will_not_come(engines, kv_client):
    cons = engines("kv_consumer", "PUT_ASYNC", kv_load_timeout_s=30.0)
    plan_load(cons, load_spec(f"{HOST}:{dead_port()}", (7, 2, 11), 2))
    t0 = time.monotonic()
    timer = _later(0.3, lambda: kv_client.call(cons.address, {"op": "abort", "keys": {KEY: "P gave up"}},
                                            timeout_s=5))
    try:
        res = cons.poll(set(), wait_s=WAIT_S)
    finally:
        timer.join()
    assert res.failed_recving == {"D-req"}
    assert time.monotonic() - t0 < WAIT_S / 2


def test_idle_poll_returns_as_soon_as_a_send_ends(engines):
    """P: the blocks of a finished request wait for its send; the idle step wakes when the
    send ends (here: it gives up on a dead peer after send_timeout_s)."""
    prod = engines("kv_producer", "PUT_ASYNC", send_timeout_s=0.5, seed=1)
    prod.save(save_spec(prod, f"{HOST}:{dead_port()}"))
    t0 = time.monotonic()
    res = prod.poll({"P-req"}, wait_s=WAIT_S)
    assert res.finished_sending == {"P-req"}
    assert time.monotonic() - t0 < WAIT_S / 2
    assert prod.stats() == ZERO


def test_idle_poll_returns_as_soon_as_an_awaited_sender_begins(engines, kv_client):
    """D's scheduler holds requests no sender began (concurrent dispatch): an idle step
    waits for a begin instead of letting vLLM run empty steps back to back (which starved
    a P sharing the cores), and wakes at P's reservation."""
    cons = engines("kv_consumer", "PUT_ASYNC")
    t0 = time.monotonic()
    timer = _later(0.3, lambda: kv_client.call(rank0(cons), {"op": "reserve", "key": KEY, "nbytes": 1024}))
    try:
        assert cons.poll(set(), wait_s=WAIT_S, awaiting=True) == PollResult()
    finally:
        timer.join()
    assert 0.25 <= time.monotonic() - t0 < WAIT_S / 2
    t0 = time.monotonic()
    assert cons.poll(set(), wait_s=0.3, awaiting=True) == PollResult()  # none begins: its bound
    assert time.monotonic() - t0 >= 0.25


def test_idle_poll_waits_at_most_its_bound(engines):
    cons = engines("kv_consumer", "PUT_ASYNC", kv_load_timeout_s=30.0)
    plan_load(cons, load_spec(f"{HOST}:{dead_port()}", (7, 2, 11), 2))  # nothing will come
    t0 = time.monotonic()
    assert cons.poll(set(), wait_s=0.3) == PollResult()
    assert 0.25 <= time.monotonic() - t0 < WAIT_S / 2
    assert cons.stats()["pending_loads"] == 1


def test_idle_poll_without_pending_transfers_does_not_wait(engines):
    for eng in (engines("kv_consumer", "PUT_ASYNC"), engines("kv_producer", "PUT_ASYNC")):
        t0 = time.monotonic()
        assert eng.poll(set(), wait_s=WAIT_S) == PollResult()
        assert time.monotonic() - t0 < WAIT_S / 2


def test_worker_waits_only_in_steps_that_compute_nothing(engines):
    # A 3 s idle wait: the steps that must not wait get 1.5 s of slack for a loaded box.
    cons = engines("kv_consumer", "PUT_ASYNC", kv_load_timeout_s=30.0, idle_wait_ms=3000.0)
    worker = P2pWorker(cons.cfg, None, 0)
    worker.engine = cons
    plan_load(cons, load_spec(f"{HOST}:{dead_port()}", (7, 2, 11), 2))
    t0 = time.monotonic()
    assert worker.poll(set(), P2pConnectorMetadata()) == PollResult()  # a step that computes
    t1 = time.monotonic()
    assert worker.poll(set(), P2pConnectorMetadata(idle=True)) == PollResult()
    t2 = time.monotonic()
    assert t1 - t0 < 1.5 and t2 - t1 >= 2.95, (t1 - t0, t2 - t1)
    off = engines("kv_consumer", "PUT_ASYNC", kv_load_timeout_s=30.0, idle_wait_ms=0.0)
    worker = P2pWorker(off.cfg, None, 0)  # idle_wait_ms 0: vLLM's own behaviour, no wait
    worker.engine = off
    plan_load(off, load_spec(f"{HOST}:{dead_port()}", (7, 2, 11), 2))
    t0 = time.monotonic()
    assert worker.poll(set(), P2pConnectorMetadata(idle=True)) == PollResult()
    assert time.monotonic() - t0 < 1.5


# ================================================================ failures


@pytest.mark.parametrize("send_type", ["PUT_ASYNC", "GET"])
def test_load_timeout_without_producer(engines, send_type):
    timeout = 0.8
    cons = engines("kv_consumer", send_type, kv_load_timeout_s=timeout, send_timeout_s=0.3)
    before = snapshot(cons.caches)
    dead = f"{HOST}:{dead_port()}"  # nobody listens there
    t0 = time.monotonic()
    plan_load(cons, load_spec(dead, (7, 2, 11), 2))
    res, t_done = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.finished_recving == {"D-req"} and res.failed_recving == {"D-req"}
    assert t_done - t0 >= timeout  # not before the timeout
    assert t_done - t0 < timeout + WAIT_S
    assert_untouched(cons, before)
    assert cons.stats() == ZERO
    assert cons.poll(set()) == PollResult()  # reported once


def test_abort_while_waiting(engines, kv_client):
    cons = engines("kv_consumer", "PUT_ASYNC")
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    before = snapshot(cons.caches)
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    assert cons.poll(set()) == PollResult()
    res = cons.poll({"D-req"})  # the scheduler finished (aborted) it
    assert res.finished_recving == {"D-req"} and res.failed_recving == set()
    assert cons.stats() == ZERO
    # A payload arriving afterwards is refused, not kept until its TTL.
    prod.save(save_spec(prod, rank0(cons)))
    poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    reply, _ = kv_client.call(cons.address, {"op": "put", "key": KEY}, [torch.zeros(1, 2, 16, 64)], timeout_s=5)
    assert reply["ok"] is False and "gone" in reply["error"]
    assert cons.poll(set()) == PollResult()
    assert cons.stats() == ZERO and prod.stats() == ZERO
    assert_untouched(cons, before)


def test_abort_after_payload_arrived(engines):
    cons = engines("kv_consumer", "PUT")
    prod = engines("kv_producer", "PUT", seed=1)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), delay_free=False))
    assert cons.stats()["recv_items"] == 1
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res = cons.poll({"D-req"})  # finished in the same step: the blocks are being freed
    assert res.finished_recving == {"D-req"} and res.failed_recving == set()
    assert_untouched(cons, before)
    assert cons.stats() == ZERO


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_send_to_dead_peer(engines, scheduler_first):
    send_timeout = 0.5
    prod = engines("kv_producer", "PUT_ASYNC", send_timeout_s=send_timeout, seed=1)
    dead = f"{HOST}:{dead_port()}"
    t0 = time.monotonic()
    prod.save(save_spec(prod, dead))
    if scheduler_first:
        # Finished right away; the send cannot have given up yet.
        assert prod.poll({"P-req"}).finished_sending == set()
        res, t_done = poll_until(prod, lambda r: bool(r.finished_sending))
        assert res.finished_sending == {"P-req"}
        assert send_timeout * 0.8 <= t_done - t0 < send_timeout + WAIT_S
    else:
        prod.wait_sends(["P-req"])  # what a preemption does; bounded by send_timeout
        assert time.monotonic() - t0 < send_timeout + WAIT_S
        # vLLM frees a preempted request's blocks itself and the scheduler plans the
        # send again: this one is forgotten, never reported as a delayed free.
        assert prod.poll({"P-req"}).finished_sending == set()
    assert prod.poll({"P-req"}).finished_sending == set()
    assert prod.stats() == ZERO


def test_put_sync_to_dead_peer_returns(engines):
    prod = engines("kv_producer", "PUT", send_timeout_s=0.5, seed=1)
    t0 = time.monotonic()
    prod.save(save_spec(prod, f"{HOST}:{dead_port()}", delay_free=False))
    assert time.monotonic() - t0 < 0.5 + WAIT_S
    assert prod.poll({"P-req"}) == PollResult()
    assert prod.stats() == ZERO


def test_sender_survives_a_failing_send(engines):
    """One send that raises (here: a block id outside the cache) must not stop the
    sender thread; later sends still go out and every send is reported."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod.save(save_spec(prod, rank0(cons), req_id="bad", key="f" * 32, block_ids=(3, 99)))
    prod.save(save_spec(prod, rank0(cons)))
    res, _ = poll_until(prod, lambda r: r.finished_sending == {"bad", "P-req"}, finished={"bad", "P-req"})
    dst_before = snapshot(cons.caches)
    load_and_check(cons, prod, dst_before)
    assert cons.stats() == ZERO and prod.stats() == ZERO


@pytest.mark.parametrize("send_type", ["PUT", "PUT_ASYNC"])
def test_buffer_full_refuses_before_the_bytes_and_the_load_fails_at_once(engines, send_type):
    cons = engines("kv_consumer", send_type, kv_buffer_size=1000, kv_load_timeout_s=30.0)
    prod = engines("kv_producer", send_type, seed=1)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    if send_type == "PUT_ASYNC":
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    assert cons.stats() == ZERO  # refused at the reservation: no byte was taken in
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    t0 = time.monotonic()
    res, t_done = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    assert t_done - t0 < 2.0  # not the 30 s deadline
    assert_untouched(cons, before)
    assert cons.stats() == ZERO and prod.stats() == ZERO


def test_get_producer_buffer_full_fails_the_load_at_once(engines):
    prod = engines("kv_producer", "GET", kv_buffer_size=1000, seed=1)
    cons = engines("kv_consumer", "GET", kv_load_timeout_s=30.0)
    prod.save(save_spec(prod, rank0(cons), delay_free=False))
    assert prod.stats() == ZERO
    t0 = time.monotonic()
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res, t_done = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    assert t_done - t0 < 2.0
    assert cons.stats() == ZERO


def test_ttl_drops_unclaimed_payloads(engines):
    ttl = 0.3
    cons = engines("kv_consumer", "PUT", buffer_ttl_s=ttl, kv_load_timeout_s=0.3)
    prod = engines("kv_producer", "GET", buffer_ttl_s=ttl, seed=1)
    t0 = time.monotonic()
    # D never asks for this one (its request never came).
    prod.save(save_spec(prod, rank0(cons), key="a" * 32, delay_free=False))
    # P pushed this one, its request never came.
    pusher = engines("kv_producer", "PUT", seed=3)
    pusher.save(save_spec(pusher, rank0(cons), delay_free=False))
    assert cons.stats()["recv_items"] == 1 and prod.stats()["send_items"] == 1

    def gone():
        cons.poll(set())  # a worker keeps stepping; an idle one does not have to
        prod.poll(set())
        return cons.stats() == ZERO and prod.stats() == ZERO

    t_gone = wait_for(gone)
    assert t_gone - t0 >= ttl
    # The request that shows up too late times out instead of loading stale data.
    before = snapshot(cons.caches)
    plan_load(cons, load_spec(rank0(pusher), (7, 2, 11), 2))
    res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    assert_untouched(cons, before)


def test_ttl_expires_without_worker_steps(engines):
    """An idle instance gets no poll() from vLLM; unclaimed payloads must still go."""
    cons = engines("kv_consumer", "PUT", buffer_ttl_s=0.2)
    prod = engines("kv_producer", "PUT", seed=1)
    prod.save(save_spec(prod, rank0(cons), delay_free=False))
    assert cons.stats()["recv_items"] == 1
    wait_for(lambda: cons.stats() == ZERO)


# ================================================================ control plane


def test_malformed_control_messages(engines, kv_client):
    cons = engines("kv_consumer", "PUT_ASYNC")
    addr = cons.address

    def call(h, t=()):
        return kv_client.call(addr, h, list(t), timeout_s=5)[0]

    r = call({"op": "bogus"})
    assert r["ok"] is False and "unknown op" in r["error"]
    r = call({})
    assert r["ok"] is False and "unknown op" in r["error"]
    r = call({"op": "put"}, [torch.zeros(2)])
    assert r == {"ok": False, "error": "put without key"}
    r = call({"op": "put", "key": 7})
    assert r["ok"] is False
    r = call({"op": "get"})
    assert r["ok"] is False
    r = call({"op": "get", "key": KEY})
    assert r == {"ok": False, "error": "not ready"}
    # The typed requests (xpyd_wire/kv_transfer.py) refuse with the reason; nothing is reserved or failed.
    for bad, why in [({"op": "reserve", "key": KEY}, "reserve needs nbytes"),
                     ({"op": "reserve", "key": KEY, "nbytes": -1}, "reserve needs nbytes"),
                     ({"op": "reserve", "nbytes": 1}, "reserve without key"),
                     ({"op": "abort", "keys": [KEY]}, "abort needs keys"),
                     ({"op": "release"}, "release without key"),
                     ({"op": "ready", "key": 7}, "ready without key")]:
        assert call(bad) == {"ok": False, "error": why}, bad
    assert call({"op": "ready", "key": KEY}) == {"ok": True, "ready": False}
    assert call({"op": "abort", "keys": {b"bytes": "not a key"}}) == {"ok": True}  # skipped, not refused
    r = call({"op": "ping"})
    assert r == {"ok": True, "address": addr}
    r = call({"op": "stats"})
    # The put without a key above carried 8 bytes, over the byte stream (a counter since start).
    assert r.pop("stream_received_bytes") >= 8
    assert r == {"ok": True, **ZERO, "refused": NO_REFUSALS}
    # Raw garbage on the socket: the transport answers, the engine keeps serving.

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.connect(f"tcp://{addr}")
        s.send_multipart([b"\xc1not msgpack"])
        assert s.poll(5000)
        s.recv_multipart()
    finally:
        s.close(linger=0)
        ctx.term()

    # Still serves real transfers afterwards.
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    load_and_check(cons, prod, before)
    r = call({"op": "stats"})
    assert r.pop("stream_received_bytes") > 0  # the transfer came over the byte stream
    assert r == {"ok": True, **ZERO, "refused": {**NO_REFUSALS, "malformed": 1}}


def _good_header(eng: KVEngine, runs=(2,), num_blocks=2) -> dict:
    return {"op": "put", "key": KEY, "num_tokens": 2 * TOK, "num_blocks": num_blocks,
            "layers": list(eng.caches), "runs": list(runs), **eng.block_layout.describe()}


def _blocks(n, shape=SHAPE[1:], dtype=torch.bfloat16):
    return torch.ones((n, *shape), dtype=dtype)


@pytest.mark.parametrize(
    "case",
    ["good", "tensor-shape", "tensor-dtype", "tensor-count", "runs-short", "num-blocks-type", "layers",
     "too-few-blocks"],
)
def test_payload_not_matching_its_header_fails_the_load(engines, kv_client, case):
    """A peer's payload is checked before anything is written; a bad one fails the load
    (vLLM recomputes) instead of raising in the worker or writing garbage."""
    cons = engines("kv_consumer", "PUT_ASYNC")
    h, t = _good_header(cons), [_blocks(2), _blocks(2)]
    if case == "tensor-shape":
        t = [torch.ones(2, 2, 16, 32, dtype=torch.bfloat16)] * 2
    elif case == "tensor-dtype":
        t = [_blocks(2, dtype=torch.float16)] * 2
    elif case == "tensor-count":
        t = [_blocks(2)]
    elif case == "runs-short":
        h["runs"], t = [1], [_blocks(1), _blocks(1)]
    elif case == "num-blocks-type":
        h["num_blocks"] = "two"
    elif case == "layers":
        h["layers"] = ["a", "b"]
    elif case == "too-few-blocks":
        h, t = _good_header(cons, runs=(1,), num_blocks=1), [_blocks(1), _blocks(1)]
    assert kv_client.call(cons.address, h, t, timeout_s=5)[0] == {"ok": True}
    before = snapshot(cons.caches)
    plan_load(cons, LoadSpec("D-req", KEY, "127.0.0.1:1", (7, 2), 0, 2 * TOK - 1, 2 * TOK, 2))
    res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    if case == "good":
        assert res.failed_recving == set()
        for cache in cons.caches.values():
            assert torch.equal(cache[[7, 2]], _blocks(2))
    else:
        assert res.failed_recving == {"D-req"}
        assert_untouched(cons, before)
    assert cons.stats() == ZERO


def _mismatch(case: str):
    """(consumer caches, consumer layout) that disagree with the default producer."""
    caches = make_caches(2)
    if case == "block-shape":
        caches = make_caches(2, shape=(16, 2, 16, 32))
    elif case == "dtype":
        caches = make_caches(2, dtype=torch.float16)
    elif case == "layers":
        caches = make_caches(2, names=("layers.0.attn", "layers.1.attn"))
    elif case == "layer-count":
        caches = make_caches(2, names=("model.layers.0.self_attn.attn",))
    lay = kvlayout.detect(None, caches)
    if case == "layout-name":
        lay = dataclasses.replace(lay, layout="HND")
    return caches, lay


@pytest.mark.parametrize("case", ["block-shape", "dtype", "layout-name", "layers", "layer-count"])
def test_layout_mismatch_fails_the_load(engines, case):
    caches, lay = _mismatch(case)
    cons = engines("kv_consumer", "PUT_ASYNC", caches=caches, layout=lay)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.finished_recving == {"D-req"} and res.failed_recving == {"D-req"}
    assert_untouched(cons, before)
    assert cons.stats() == ZERO
    assert report_send_once(prod, "P-req") == {"P-req"}


def test_strided_layout_roundtrip(engines):
    """Blocks that are not one byte run (a permuted physical layout) go gathered."""
    def strided(seed):
        c = make_caches(seed)
        return {k: v.transpose(0, 1).contiguous().transpose(0, 1) for k, v in c.items()}

    pc, cc = strided(1), strided(2)
    prod = engines("kv_producer", "PUT_ASYNC", caches=pc)
    cons = engines("kv_consumer", "PUT_ASYNC", caches=cc)
    assert not prod.block_layout.contiguous_blocks
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    load_and_check(cons, prod, before)


def test_close_is_prompt(engines):
    eng = engines("kv_consumer", "PUT_ASYNC")
    t0 = time.monotonic()
    eng.close()
    assert time.monotonic() - t0 < 5.0


def test_close_wakes_the_transport_threads(engines):
    """close() wakes the transport's server thread and its byte stream's accept loop instead of
    waiting out their timeouts (raised to 30 s here, so that a close that waits shows)."""
    eng = engines("kv_consumer", "PUT_ASYNC", transport=lambda cfg: TcpTransport(poll_interval_s=30.0))
    eng._transport._stream_server._listener.settimeout(30.0)
    time.sleep(0.3)  # the accept loop's next accept() takes the 30 s timeout (it had 0.2 s)
    t0 = time.monotonic()
    eng.close()
    assert time.monotonic() - t0 < 1.5  # each thread's join would give up after 2 s (slack for a loaded box)


class _CallSeen(TcpTransport):
    """The real transport; tells when a call of one op has started (to close during it)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op, self.started = op, threading.Event()

    def call(self, peer, header, tensors=(), timeout_s=5.0):
        if header.get("op") == self.op:
            self.started.set()
        return super().call(peer, header, tensors, timeout_s)


@pytest.mark.parametrize("send_type, op, send_timeout", [("PUT_ASYNC", "ping", 0.3), ("PUT", "abort", 5.0)],
                         ids=["probe", "abort-notice"])
def test_close_does_not_wait_for_a_call_to_a_dead_peer(engines, send_type, op, send_timeout, monkeypatch):
    """A probe of a dead D (PUT_ASYNC, after its send failed) or the abort notice for a failed
    send (PUT) reads no KV: close() returns without waiting out its timeout (5 s here, so
    that a loaded box's slack cannot pass for a close that waited)."""
    from connector.p2p import producer

    monkeypatch.setattr(producer, "PROBE_TIMEOUT_S", 5.0)  # the probe's; the notice's is min(send, 2x)
    seen = _CallSeen(op)
    prod = engines("kv_producer", send_type, seed=1, send_timeout_s=send_timeout, transport=lambda cfg: seen)
    prod.save(save_spec(prod, f"{HOST}:{dead_port()}", delay_free=send_type != "PUT"))
    assert seen.started.wait(WAIT_S)
    t0 = time.monotonic()
    prod.close()
    assert time.monotonic() - t0 < 2.5


# ================================================================ added by the lead


def test_get_reply_can_be_fetched_again_until_released(engines, kv_client):
    """P keeps its GET copy until D releases it: a reply lost to a timeout is not
    a lost transfer."""
    prod = engines("kv_producer", "GET", seed=1)
    prod.save(save_spec(prod, "127.0.0.1:1", delay_free=False))
    for _ in range(2):
        reply, tensors = kv_client.call(rank0(prod), {"op": "get", "key": KEY}, timeout_s=WAIT_S)
        assert reply["ok"] and tensors
    assert prod.stats()["send_items"] == 1
    reply, _ = kv_client.call(rank0(prod), {"op": "release", "key": KEY}, timeout_s=WAIT_S)
    assert reply["ok"]
    assert prod.stats() == ZERO


def test_get_retries_until_producer_is_reachable(engines):
    """D's pull survives transport errors (P not up yet) within the load deadline."""
    cons = engines("kv_consumer", "GET", seed=2, kv_load_timeout_s=1.0)
    plan_load(cons, load_spec(f"127.0.0.1:{dead_port()}", (7, 2, 11), 2))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}  # the deadline, not the first error, ended it
    assert cons.stats() == ZERO


def test_preemption_cancels_a_queued_send(engines):
    """A send still queued when its request is preempted never starts: its blocks
    are about to be reused."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=4.0)
    dead = f"127.0.0.1:{dead_port()}"
    prod.save(save_spec(prod, dead, req_id="first", key="a" * 32))  # occupies the sender
    prod.save(save_spec(prod, dead, req_id="victim", key="b" * 32))
    t0 = time.monotonic()
    prod.wait_sends(["victim"])
    assert time.monotonic() - t0 < 2.0  # cancelled, not waited for (4 s; slack for a loaded box)
    # Only "first" held blocks that wait for its send; the victim's were freed by vLLM.
    res, _ = poll_until(prod, lambda r: "first" in r.finished_sending, finished={"first", "victim"})
    assert res.finished_sending == {"first"}
    assert prod.stats() == ZERO


def test_released_transfer_is_dropped_and_refused_later(engines, kv_client):
    """No request will load it (full local hit, aborted before admission): dropped at
    the next step, and a late duplicate is refused before its bytes are sent."""
    prod = engines("kv_producer", "PUT", seed=1)
    cons = engines("kv_consumer", "PUT", seed=2)
    prod.save(save_spec(prod, rank0(cons), delay_free=False))
    assert cons.stats()["recv_items"] == 1
    cons.release([KEY])
    assert cons.poll(set()) == PollResult()
    assert cons.stats() == ZERO
    prod.save(save_spec(prod, rank0(cons), req_id="again", delay_free=False))  # a late duplicate
    assert cons.stats() == ZERO


# ================================================================ real traffic: fan-out, fail fast, peers


@pytest.mark.parametrize("send_type", ["PUT_ASYNC", "GET"])
def test_children_of_one_prompt_share_one_payload_once(engines, send_type):
    """n=2: two loads of one key get the same bytes from one transfer; the payload is
    dropped after the key's release, and nothing is loaded twice."""
    prod = engines("kv_producer", send_type, seed=1)
    cons = engines("kv_consumer", send_type, seed=2)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), delay_free=send_type == "PUT_ASYNC"))
    if send_type == "PUT_ASYNC":
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    cons.add_load(load_spec(rank0(prod), (7, 2, 11), 2, req_id="child-0"))
    cons.add_load(load_spec(rank0(prod), (4, 5, 6), 2, req_id="child-1"))
    res, _ = poll_until(cons, lambda r: {"child-0", "child-1"} <= r.finished_recving)
    assert res.failed_recving == set()
    assert_loaded(cons, before, prod, (7, 2, 11, 4, 5, 6), SRC_IDS[2:] * 2)
    assert cons.stats()["recv_items"] == 1  # kept: the scheduler has not released the key
    cons.release([KEY])
    assert cons.poll(set()) == PollResult()
    assert cons.stats() == ZERO
    wait_for(lambda: prod.stats() == ZERO)  # GET: D released P's copy


def test_payload_for_another_prompt_length_is_refused(engines):
    prod = engines("kv_producer", "PUT", seed=1)
    cons = engines("kv_consumer", "PUT", seed=2)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), num_tokens=N_PROMPT - 1, delay_free=False))
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res, _ = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    assert_untouched(cons, before)


def test_sender_giving_up_fails_the_load_at_once(engines):
    """P could not build or ship the payload: it tells D, whose load fails on its
    next poll rather than after kv_load_timeout_s."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", kv_load_timeout_s=30.0)
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    t0 = time.monotonic()
    prod.save(save_spec(prod, rank0(cons), block_ids=(3, 99)))  # block 99 does not exist
    res, t_done = poll_until(cons, lambda r: bool(r.finished_recving))
    assert res.failed_recving == {"D-req"}
    assert t_done - t0 < 3.0
    poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    assert cons.stats() == ZERO and prod.stats() == ZERO


def test_dead_decode_does_not_delay_a_healthy_one(engines):
    """Per-peer queues: while sends to an unreachable D wait out their deadline, a
    healthy D's transfers go through at once."""
    send_timeout = 2.0
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=send_timeout)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    dead = f"{HOST}:{dead_port()}"
    for i in range(3):
        prod.save(save_spec(prod, dead, req_id=f"dead-{i}", key=f"{i:032x}"))
    t0 = time.monotonic()
    prod.save(save_spec(prod, rank0(cons)))
    wait_for(lambda: cons.stats()["recv_items"] == 1)
    # Not behind the dead peer's deadline: its first send is still waiting for it.
    assert prod.producer.peer(dead).dead_since is None
    assert time.monotonic() - t0 < send_timeout
    load_and_check(cons, prod, snapshot(cons.caches))
    # The dead peer: the first send waits its deadline, then the peer is marked dead
    # and the queued ones fail (after one probe).
    res, t_done = poll_until(prod, lambda r: {"dead-0", "dead-1", "dead-2", "P-req"} <= r.finished_sending,
                             finished={"dead-0", "dead-1", "dead-2", "P-req"})
    assert t_done - t0 < send_timeout + 2.0
    assert prod.producer.peer(dead).dead_since is not None


def test_dead_peer_is_used_again_once_it_answers(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=0.5)
    port = spare_port()
    addr = f"{HOST}:{port}"
    prod.save(save_spec(prod, addr, req_id="lost", key="a" * 32))
    poll_until(prod, lambda r: "lost" in r.finished_sending, finished={"lost"})
    assert prod.producer.peer(addr).dead_since is not None
    cfg = make_cfg("kv_consumer", "PUT_ASYNC", port)
    cons = KVEngine(cfg, 0, make_caches(2), kvlayout.detect(None, make_caches(2)), transport=TcpTransport())
    try:
        cons.caches, cons.cfg = cons._caches, cfg
        wait_for(lambda: prod.producer.peer(addr).dead_since is None)  # a probe got through
        # The abort for the lost transfer is delivered once the peer is up (the probe that
        # revived it comes first, so wait for it rather than race it).
        wait_for(lambda: cons.recv_buffer.failure("a" * 32) is not None)
        prod.save(save_spec(prod, addr))
        wait_for(lambda: cons.stats()["recv_items"] == 1)
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    finally:
        cons.close()


def test_get_fetch_stops_when_its_request_is_aborted(engines):
    """GET: D keeps asking a P that has nothing yet; an abort stops the asking."""
    gets: list[float] = []

    def fake_prefill(header, tensors):  # the other side of the boundary: a P with nothing ready
        if header.get("op") == "get":
            gets.append(time.monotonic())
        return {"ok": False, "error": "not ready"}, []

    p = TcpTransport()
    p.start(HOST, 0, fake_prefill)
    try:
        cons = engines("kv_consumer", "GET", kv_load_timeout_s=30.0)
        plan_load(cons, load_spec(f"{HOST}:{p.bound_port}", (7, 2, 11), 2))
        wait_for(lambda: len(gets) >= 3)
        res = cons.poll({"D-req"})  # aborted
        assert res.finished_recving == {"D-req"} and res.failed_recving == set()
        time.sleep(0.3)
        n = len(gets)
        time.sleep(0.5)
        assert len(gets) == n  # no more asking
        assert cons.stats() == ZERO  # the reservation went with it
    finally:
        p.close()


@pytest.mark.gpu
@pytest.mark.parametrize("send_type", ["PUT_ASYNC", "GET"])
def test_cuda_caches_roundtrip_over_tcp(engines, send_type):
    """CUDA KV caches: tcp stages blocks through host memory both ways, bytes intact."""
    prod_caches = {k: v.cuda() for k, v in make_caches(1).items()}
    cons_caches = {k: v.cuda() for k, v in make_caches(2).items()}
    prod = engines("kv_producer", send_type, caches=prod_caches)
    cons = engines("kv_consumer", send_type, caches=cons_caches)
    dst_before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), delay_free=send_type == "PUT_ASYNC"))
    load_and_check(cons, prod, dst_before)

"""TP topology arithmetic (connector/p2p/tp.py) against a brute-force reference, and the
first-contact check between two real engines (different layouts or TP sizes fail the
send at once with a clear reason, never garbage tokens)."""

from __future__ import annotations

import pytest

from connector.p2p import tp
from connector.p2p.tp import TopologyError, TpSide
from tests.support.kv_engines import tp_instance

CASES = [  # (prefill tp, decode tp, kv heads, mla)
    (1, 1, 8, False), (1, 2, 8, False), (2, 1, 8, False), (2, 4, 8, False), (4, 2, 8, False),
    (8, 8, 4, False), (2, 8, 4, False), (8, 2, 4, False), (4, 8, 2, False), (1, 4, 1, True), (4, 2, 1, True),
]


def global_heads_of(side: TpSide, rank: int) -> list[int]:
    """Reference: heads split in tp order, or each head replicated on tp/heads ranks."""
    if side.is_mla:
        return [0]
    if side.tp_size <= side.num_kv_heads:
        per = side.num_kv_heads // side.tp_size
        return list(range(rank * per, (rank + 1) * per))
    return [rank * side.num_kv_heads // side.tp_size]


@pytest.mark.parametrize("p_tp, d_tp, heads, mla", CASES)
def test_every_decode_head_comes_once_from_a_prefill_rank_that_holds_it(p_tp, d_tp, heads, mla):
    p, d = TpSide(p_tp, heads, mla), TpSide(d_tp, heads, mla)
    for r in range(d_tp):
        want = global_heads_of(d, r)
        got: dict[int, int] = {}
        for piece in tp.sources(p, d, r):
            p_heads = global_heads_of(p, piece.remote_rank)
            remote = list(range(piece.remote_heads.start, piece.remote_heads.stop))
            local = list(range(piece.local_heads.start, piece.local_heads.stop))
            assert len(remote) == len(local) > 0
            for rh, lh in zip(remote, local, strict=True):
                assert lh not in got, "a head filled twice"
                got[lh] = p_heads[rh]
        assert [got[i] for i in range(len(want))] == want, (r, got, want)
    # targets are exactly the inverse of sources
    inverse = sorted((d_rank, piece.remote_rank, piece.local_heads.start)
                     for p_rank in range(p_tp) for d_rank, piece in tp.targets(p, d, p_rank))
    direct = sorted((r, piece.remote_rank, piece.local_heads.start)
                    for r in range(d_tp) for piece in tp.sources(p, d, r))
    assert inverse == direct


def test_symmetric_tp_is_rank_to_rank_with_whole_blocks():
    p = d = TpSide(4, 8)
    for r in range(4):
        assert tp.sources(p, d, r) == [tp.Piece(r, slice(0, 2), slice(0, 2))]
    assert tp.supported_by_data_path(p, d) is None
    assert tp.tp_ratio(TpSide(2, 8), TpSide(4, 8)) == 2 and tp.tp_ratio(TpSide(4, 8), TpSide(2, 8)) == -2


def test_decode_with_more_ranks_gets_head_slices():
    pieces = tp.sources(TpSide(1, 8), TpSide(2, 8), 1)
    assert pieces == [tp.Piece(0, slice(4, 8), slice(0, 4))]
    pieces = tp.sources(TpSide(4, 8), TpSide(1, 8), 0)
    assert [p.remote_rank for p in pieces] == [0, 1, 2, 3] and all(p.remote_heads == slice(0, 2) for p in pieces)


def test_replicated_heads_are_fetched_once_and_spread():
    p, d = TpSide(8, 4), TpSide(8, 4)  # every head on 2 prefill ranks
    assert {tp.sources(p, d, r)[0].remote_rank for r in range(8)} == set(range(8))
    mla = [tp.sources(TpSide(4, 1, True), TpSide(2, 1, True), r) for r in range(2)]
    assert all(len(x) == 1 and x[0].whole for x in mla)


@pytest.mark.parametrize("p, d, words", [
    (TpSide(3, 8), TpSide(2, 8), "divide each other"),
    (TpSide(2, 8), TpSide(2, 4), "different numbers of KV heads"),
    (TpSide(2, 1, True), TpSide(2, 8), "MLA"),
    (TpSide(6, 4), TpSide(6, 4), "not a multiple"),
    (TpSide(3, 8), TpSide(3, 8), "do not split evenly"),
])
def test_unsupported_pairs_are_refused_naming_both_sides(p, d, words):
    with pytest.raises(TopologyError, match=words) as e:
        tp.check(p, d)
    assert f"prefill tp={p.tp_size}" in str(e.value) and f"decode tp={d.tp_size}" in str(e.value)


def test_heterogeneous_tp_is_refused_only_for_get_with_a_clear_message():
    assert tp.supported_by_data_path(TpSide(1, 8), TpSide(2, 8)) is None
    why = tp.supported_by_data_path(TpSide(1, 8), TpSide(2, 8), get_mode=True)
    assert why is not None and "prefill tp=1, decode tp=2" in why and "GET" in why
    assert tp.supported_by_data_path(TpSide(2, 8), TpSide(2, 8), get_mode=True) is None


@pytest.mark.parametrize("p_tp, d_tp, heads, mla", CASES)
def test_routes_number_each_piece_as_its_decode_rank_expects(p_tp, d_tp, heads, mla):
    p, d = TpSide(p_tp, heads, mla), TpSide(d_tp, heads, mla)
    seen = {}
    for p_rank in range(p_tp):
        for r in tp.routes(p, d, p_rank):
            assert r.piece.remote_rank == p_rank
            assert tp.sources(p, d, r.decode_rank)[r.index] == r.piece
            assert r.count == len(tp.sources(p, d, r.decode_rank))
            assert (r.decode_rank, r.index) not in seen, "a piece sent twice"
            seen[(r.decode_rank, r.index)] = p_rank
    assert set(seen) == {(dr, i) for dr in range(d_tp) for i in range(len(tp.sources(p, d, dr)))}
    assert len({tp.piece_key("k", i) for i in range(4)}) == 4 and "k" not in {tp.piece_key("k", i) for i in range(4)}


# ------------------------------------------------------------------ first contact, real engines


def test_first_contact_refuses_a_decode_with_another_block_layout(engines):
    """D runs another KV dtype: P's first send to it fails at once with the reason (and D's
    load fails at once, told by P), without shipping a byte; D's cache is untouched."""
    import torch

    from tests.support.kv_engines import load_spec, make_caches, plan_load, poll_until, rank0, save_spec, snapshot

    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", caches=make_caches(2, dtype=torch.float16))
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    assert prod.xfer_stats.peek().data["failures"].get("send/invalid") == 1
    assert prod.xfer_stats.peek().data["bytes"].get("sent", 0) == 0
    for name, cache in cons.caches.items():
        assert torch.equal(cache, before[name])


def test_first_contact_refuses_heterogeneous_tp_with_the_reason(engines):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, tp_side=TpSide(1, 2))
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, tp_side=TpSide(2, 4))
    hello, _ = prod._transport.call(cons.address, {"op": "hello"}, timeout_s=5)
    assert hello["tp_size"] == 2 and hello["num_kv_heads"] == 4
    assert "different numbers of KV heads" in prod.check_peer(hello)
    # D says tp=2 over 2 heads (1 per rank) but its cache holds 2 heads per block: no head slicing
    cons2 = engines("kv_consumer", "PUT_ASYNC", seed=2, tp_side=TpSide(2, 2))
    hello, _ = prod._transport.call(cons2.address, {"op": "hello"}, timeout_s=5)
    why = prod.check_peer(hello)
    assert "the peer (tp=2, 2 kv heads) holds 2 heads" in why and "this tp=1, peer tp=2" in why
    same = engines("kv_consumer", "PUT_ASYNC", seed=2)
    hello, _ = prod._transport.call(same.address, {"op": "hello"}, timeout_s=5)
    assert prod.check_peer(hello) is None


def test_get_load_from_a_prefill_with_another_tp_fails_even_when_block_shapes_match(engines):
    """GET has no first contact on P's side. P tp=8 and D tp=4 over 4 KV heads: both hold one
    head per rank (P replicates), so block shapes match, but D rank r needs head r and P rank r
    holds head r//2: the load must fail with the reason, never copy the wrong head."""
    import torch

    from tests.support.kv_engines import (
        SHAPE,
        load_spec,
        make_caches,
        plan_load,
        poll_until,
        rank0,
        save_spec,
        snapshot,
    )

    one_head = (SHAPE[0], 1, *SHAPE[2:])
    prod = engines("kv_producer", "GET", caches=make_caches(1, shape=one_head), tp_side=TpSide(8, 4))
    cons = engines("kv_consumer", "GET", caches=make_caches(2, shape=one_head), tp_side=TpSide(4, 4))
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), delay_free=False))
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    for name, cache in cons.caches.items():
        assert torch.equal(cache, before[name])
    same = engines("kv_consumer", "GET", caches=make_caches(3, shape=one_head), tp_side=TpSide(8, 4))
    prod.save(save_spec(prod, rank0(same), key="f" * 32, delay_free=False))
    plan_load(same, load_spec(rank0(prod), (7, 2, 11), 2, key="f" * 32))
    res, _ = poll_until(same, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set()


# ------------------------------------------------------------------ heterogeneous TP, real engines


@pytest.fixture
def instances():
    started: list = []

    def start(*args, **kw) -> list:
        ranks = tp_instance(*args, **kw)
        started.extend(ranks)
        return ranks

    start.started = started
    yield start
    for eng in started:
        eng.close()


def _global_heads(ranks: list, name: str, block: int):
    """One block of one layer with the heads of every rank side by side (replicas once)."""
    import torch

    side = ranks[0]._tp
    per = {}
    for r, eng in enumerate(ranks):
        for i, h in enumerate(side.heads_of(r)):
            per.setdefault(h, eng.caches[name][block][i])
    return torch.stack([per[h] for h in sorted(per)])


def _check_decode(d_ranks: list, p_ranks: list, before: list, dst=(7, 2, 11), src=None) -> None:
    """Every decode rank's dst blocks hold exactly its heads of the prefill's src blocks,
    byte for byte; nothing else changed."""
    import torch

    from tests.support.kv_engines import SRC_IDS, bits

    src = src or SRC_IDS[2:]
    side = d_ranks[0]._tp
    for r, eng in enumerate(d_ranks):
        heads = list(side.heads_of(r))
        for name, cache in eng.caches.items():
            for d, s in zip(dst, src, strict=True):
                want = _global_heads(p_ranks, name, s)[heads]
                assert torch.equal(bits(cache[d]), bits(want)), (r, name, d, s)
            others = [b for b in range(cache.shape[0]) if b not in dst]
            assert torch.equal(bits(cache[others]), bits(before[r][name][others]))


def _send_one_and_check(prod, dec) -> None:
    """One prompt from a single prefill rank to every decode rank: each loads without
    failure, and each got exactly its heads (nothing else changed)."""
    from tests.support.kv_engines import load_spec, plan_load, poll_until, rank0, save_spec, snapshot

    before = [snapshot(d.caches) for d in dec]
    for d in dec:
        plan_load(d, load_spec(rank0(prod), (7, 2, 11), 2))
    spec = save_spec(prod, rank0(dec[0]))
    for name in prod.caches:  # the forward pass layer by layer (ignored unless sends are layer-wise)
        prod.save_layer(spec, name)
    prod.save(spec)
    for d in dec:
        res, _ = poll_until(d, lambda r: "D-req" in r.finished_recving)
        assert res.failed_recving == set()
    _check_decode(dec, [prod], before)


@pytest.mark.parametrize("send_type, granularity", [("PUT_ASYNC", "request"), ("PUT", "request"),
                                                    ("PUT_ASYNC", "layer")])
def test_prefill_tp1_to_decode_tp2_each_rank_gets_its_heads(instances, send_type, granularity):
    from tests.support.kv_engines import poll_until

    (prod,) = instances("kv_producer", send_type, 1, 4, seed=1, blocks_heads=4, send_granularity=granularity)
    dec = instances("kv_consumer", send_type, 2, 4, seed=2, blocks_heads=2)
    _send_one_and_check(prod, dec)
    if send_type == "PUT_ASYNC":  # PUT sent within save(): its blocks were never held
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    assert prod.xfer_stats.peek().data["failures"] == {}
    for d in dec:  # the pieces are dropped once loaded and released
        assert d.stats()["recv_items"] == 0


@pytest.mark.parametrize("granularity", ["request", "layer"])
def test_head_slices_over_the_nccl_transport(instances, granularity):
    """P tp=1 -> D tp=2 over the nccl transport (host-memory NCCL double): the head slices
    go over the communicators, each D rank gets exactly its heads."""
    import torch

    from connector.transport.nccl import NcclTransport
    from tests.support.nccl_double import Fabric, FakeNccl

    fabric = Fabric()
    libs: list = []

    def build(cfg):
        libs.append(FakeNccl(fabric))
        return NcclTransport(libs[-1], torch.device("cpu"), max_msg_bytes=cfg.kv_buffer_size + (1 << 20))

    try:
        (prod,) = instances("kv_producer", "PUT_ASYNC", 1, 4, seed=1, blocks_heads=4, transport=build,
                            send_granularity=granularity)
        dec = instances("kv_consumer", "PUT_ASYNC", 2, 4, seed=2, blocks_heads=2, transport=build)
        _send_one_and_check(prod, dec)
        half = sum(c[:5, :2].numel() * c.element_size() for c in prod.caches.values())  # 5 blocks, 2 heads
        # (the libraries of engines built on a port taken meanwhile received nothing)
        assert sorted(lib.recv_bytes for lib in libs if lib.recv_bytes) == [half, half]
    finally:
        for eng in instances.started:
            eng.close()
        fabric.close()


def test_prefill_tp2_to_decode_tp1_waits_for_every_piece(instances):
    """D's one rank assembles its 4 heads from both prefill ranks: nothing is written
    before the second piece came; then every head is right."""
    import time

    from tests.support.kv_engines import assert_untouched, load_spec, plan_load, poll_until, rank0, save_spec, snapshot

    p_ranks = instances("kv_producer", "PUT_ASYNC", 2, 4, seed=1, blocks_heads=2)
    (dec,) = instances("kv_consumer", "PUT_ASYNC", 1, 4, seed=2, blocks_heads=4)
    before = snapshot(dec.caches)
    plan_load(dec, load_spec(rank0(p_ranks[0]), (7, 2, 11), 2))
    p_ranks[1].save(save_spec(p_ranks[1], rank0(dec)))
    poll_until(p_ranks[1], lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # one piece of two: the load must not complete
        res = dec.poll(set())
        assert "D-req" not in res.finished_recving
        time.sleep(0.02)
    assert dec.stats()["recv_items"] == 1
    assert_untouched(dec, before)
    p_ranks[0].save(save_spec(p_ranks[0], rank0(dec)))
    res, _ = poll_until(dec, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set()
    _check_decode([dec], p_ranks, [before])


def test_a_prefill_rank_with_no_decode_rank_of_its_number_asks_rank_0_at_once(instances):
    """P tp=2 -> D tp=1: P's rank 1 asks D's rank 0 first, whose TP size says D has no rank 1:
    its send goes without waiting out its budget on a rank that does not exist (before: the
    whole send_timeout_s, 30 s here, then rank 0 with a 0.05 s floor, which a loaded box
    missed: issue 48)."""
    import time

    from tests.support.kv_engines import load_spec, plan_load, poll_until, rank0, save_spec

    p_ranks = instances("kv_producer", "PUT_ASYNC", 2, 4, seed=1, blocks_heads=2, send_timeout_s=30.0)
    (dec,) = instances("kv_consumer", "PUT_ASYNC", 1, 4, seed=2, blocks_heads=4)
    plan_load(dec, load_spec(rank0(p_ranks[0]), (7, 2, 11), 2))
    t0 = time.monotonic()
    p_ranks[1].save(save_spec(p_ranks[1], rank0(dec)))
    poll_until(p_ranks[1], lambda r: "P-req" in r.finished_sending, finished={"P-req"}, timeout=60)
    assert time.monotonic() - t0 < 15, "waited for a decode rank that does not exist"
    assert p_ranks[1].producer.peer(rank0(dec)).peer == rank0(dec)


def test_replicated_heads_come_from_one_prefill_rank(instances):
    """1 KV head, P tp=2 (both ranks hold it), D tp=1: rank 0 sends, rank 1 sends nothing
    and still finishes its send at once."""
    from tests.support.kv_engines import load_spec, plan_load, poll_until, rank0, save_spec, snapshot

    p_ranks = instances("kv_producer", "PUT_ASYNC", 2, 1, seed=1, blocks_heads=1)
    (dec,) = instances("kv_consumer", "PUT_ASYNC", 1, 1, seed=2, blocks_heads=1)
    before = snapshot(dec.caches)
    plan_load(dec, load_spec(rank0(p_ranks[0]), (7, 2, 11), 2))
    for p in p_ranks:
        p.save(save_spec(p, rank0(dec)))
    res, _ = poll_until(dec, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set()
    _check_decode([dec], p_ranks[:1], [before])
    for p in p_ranks:
        poll_until(p, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    sent = [p.xfer_stats.peek().data["bytes"].get("sent", 0) for p in p_ranks]
    assert sent[0] > 0 and sent[1] == 0


def test_a_piece_that_will_not_come_fails_the_load_at_once(instances):
    """P tp=2 -> D tp=1: rank 0's piece arrives, rank 1 runs another KV dtype and is
    refused at first contact: D's load fails at once (not at its deadline), cache untouched."""
    import time

    import torch

    from tests.support.kv_engines import assert_untouched, load_spec, plan_load, poll_until, rank0, save_spec, snapshot

    p_ranks = instances("kv_producer", "PUT_ASYNC", 2, 4, seed=1, blocks_heads=2, dtypes={1: torch.float16})
    (dec,) = instances("kv_consumer", "PUT_ASYNC", 1, 4, seed=2, blocks_heads=4, kv_load_timeout_s=30.0)
    before = snapshot(dec.caches)
    plan_load(dec, load_spec(rank0(p_ranks[0]), (7, 2, 11), 2))
    t0 = time.monotonic()
    for p in p_ranks:
        p.save(save_spec(p, rank0(dec)))
    res, t1 = poll_until(dec, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"} and t1 - t0 < 5.0
    # Rank 0's send ends too, never hangs: its piece either went through before rank 1's refusal
    # failed the load, or (on a loaded box, when it came after) D told it the KV is not needed.
    poll_until(p_ranks[0], lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    stats0 = p_ranks[0].xfer_stats.peek()
    assert (stats0.data["bytes"].get("sent", 0) > 0) != (stats0.transfers("send", "unneeded") == 1)
    assert p_ranks[1].xfer_stats.peek().data["failures"].get("send/invalid") == 1
    assert_untouched(dec, before)


def test_get_refuses_heterogeneous_tp_at_the_load(instances):
    """GET pulls whole blocks from the rank of the same number: a decode of another TP
    size fails its load with the reason, cache untouched."""
    from tests.support.kv_engines import (
        KEY,
        assert_untouched,
        load_spec,
        plan_load,
        poll_until,
        rank0,
        save_spec,
        snapshot,
    )

    (prod,) = instances("kv_producer", "GET", 1, 4, seed=1, blocks_heads=4)
    dec = instances("kv_consumer", "GET", 2, 4, seed=2, blocks_heads=2)
    before = snapshot(dec[0].caches)
    prod.save(save_spec(prod, rank0(dec[0]), delay_free=False))
    plan_load(dec[0], load_spec(rank0(prod), (7, 2, 11), 2))
    res, _ = poll_until(dec[0], lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    why = dec[0].recv_buffer.failure(KEY)
    assert "heterogeneous tensor parallelism (prefill tp=1, decode tp=2)" in why and "GET" in why
    assert_untouched(dec[0], before)

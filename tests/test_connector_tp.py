"""TP topology arithmetic (connector/tp.py) against a brute-force reference, and the
first-contact check between two real engines (different layouts or TP sizes fail the
send at once with a clear reason, never garbage tokens)."""

from __future__ import annotations

import pytest

from connector import tp
from connector.tp import TopologyError, TpSide

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


def test_heterogeneous_tp_is_refused_by_the_data_path_with_a_clear_message():
    why = tp.supported_by_data_path(TpSide(1, 8), TpSide(2, 8))
    assert why is not None and "prefill tp=1, decode tp=2" in why and "--tensor-parallel-size" in why


# ------------------------------------------------------------------ first contact, real engines


def test_first_contact_refuses_a_decode_with_another_block_layout(engines):
    """D runs another KV dtype: P's first send to it fails at once with the reason (and D's
    load fails at once, told by P), without shipping a byte; D's cache is untouched."""
    import torch
    from test_connector_engine import load_spec, make_caches, plan_load, poll_until, rank0, save_spec, snapshot

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
    cons2 = engines("kv_consumer", "PUT_ASYNC", seed=2, tp_side=TpSide(2, 2))
    hello, _ = prod._transport.call(cons2.address, {"op": "hello"}, timeout_s=5)
    assert "heterogeneous tensor parallelism (prefill tp=1, decode tp=2)" in prod.check_peer(hello)
    same = engines("kv_consumer", "PUT_ASYNC", seed=2)
    hello, _ = prod._transport.call(same.address, {"op": "hello"}, timeout_s=5)
    assert prod.check_peer(hello) is None


def test_get_load_from_a_prefill_with_another_tp_fails_even_when_block_shapes_match(engines):
    """GET has no first contact on P's side. P tp=8 and D tp=4 over 4 KV heads: both hold one
    head per rank (P replicates), so block shapes match, but D rank r needs head r and P rank r
    holds head r//2: the load must fail with the reason, never copy the wrong head."""
    import torch
    from test_connector_engine import SHAPE, load_spec, make_caches, plan_load, poll_until, rank0, save_spec, snapshot

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

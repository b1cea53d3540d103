"""Helpers of tests/unit/test_connector_engine.py that other tests use too (moved from it)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from connector.config import ConnectorConfig
from connector.p2p.engine import KVEngine, PollResult
from connector.p2p.metadata import LoadSpec, SaveSpec
from tests.support.ports import dead_port, free_port  # noqa: F401  (re-exported)

HOST = "127.0.0.1"
SHAPE = (16, 2, 16, 64)  # [blocks, kv heads, tokens per block, content]
TOK = SHAPE[2]
KEY = "0123456789abcdef0123456789abcdef"
WAIT_S = 30.0  # upper bound for anything that should happen "soon" on a loaded 2-core box (load ~20 seen)

# Source blocks of a 77-token prompt (5 blocks), deliberately non-contiguous: runs
# (3, 4), (9), (1), (12).
SRC_IDS = (3, 4, 9, 1, 12)
N_PROMPT = 5 * TOK - 3


def make_caches(seed: int, shape=SHAPE, dtype=torch.bfloat16, names=("model.layers.0.self_attn.attn",
                                                                    "model.layers.1.self_attn.attn")):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen).to(dtype) for n in names}


def make_cfg(role: str, send_type: str, port: int, **over) -> ConnectorConfig:
    base = {
        "role": role, "kv_ip": HOST, "kv_port": port, "http_host": HOST, "http_port": None,
        "proxies": (), "send_type": send_type, "kv_buffer_size": 10**8,
        # Generous: a test whose subject is one of these deadlines sets its own (a loaded
        # 2-core box stalled a 2 s send: issue 48).
        "kv_load_timeout_s": 30.0, "send_timeout_s": 30.0,
        "buffer_ttl_s": 60.0, "heartbeat_interval_s": 3.0, "transport": "tcp",
        "thread_affinity": "auto",
        "discovery_secret": None, "allow_debug_corruption": False,
    }
    return ConnectorConfig(**{**base, **over})


def rank0(eng: KVEngine) -> str:
    """The advertised (rank-0) address the scheduler puts in the specs."""
    return eng.cfg.advertised_address


def save_spec(prod: KVEngine, cons_addr: str, req_id="P-req", key=KEY, block_ids=SRC_IDS,
              num_tokens=N_PROMPT, delay_free=True) -> SaveSpec:
    return SaveSpec(req_id=req_id, transfer_key=key, decode_addr=cons_addr, prefill_addr=rank0(prod),
                    block_ids=tuple(block_ids), num_tokens=num_tokens, delay_free=delay_free)


def load_spec(prod_addr: str, dst_ids, first_block: int, req_id="D-req", key=KEY, corrupt=False) -> LoadSpec:
    n = N_PROMPT - 1 - first_block * TOK
    return LoadSpec(req_id=req_id, transfer_key=key, prefill_addr=prod_addr, dst_block_ids=tuple(dst_ids),
                    first_block=first_block, num_tokens=n, prompt_tokens=N_PROMPT,
                    prompt_blocks=-(-N_PROMPT // TOK), corrupt_for_test=corrupt)


def poll_until(eng: KVEngine, cond: Callable[[PollResult], bool], timeout: float = WAIT_S,
               finished: set[str] = frozenset()) -> tuple[PollResult, float]:
    """Poll (like a worker step) until cond(accumulated result); returns it and the time."""
    acc = PollResult()
    deadline = time.monotonic() + timeout
    while True:
        r = eng.poll(set(finished))
        acc.finished_sending |= r.finished_sending
        acc.finished_recving |= r.finished_recving
        acc.failed_recving |= r.failed_recving
        if cond(acc):
            return acc, time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {acc}")
        time.sleep(0.01)


def wait_for(pred: Callable[[], bool], timeout: float = WAIT_S) -> float:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.01)
    return time.monotonic()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def assert_loaded(cons: KVEngine, before: dict, prod: KVEngine, dst_ids, src_ids) -> None:
    """dst blocks are byte-identical to the source blocks; every other block unchanged."""
    for name, cache in cons.caches.items():
        for d, s in zip(dst_ids, src_ids, strict=True):
            assert torch.equal(bits(cache[d]), bits(prod.caches[name][s])), (name, d, s)
        others = [b for b in range(cache.shape[0]) if b not in dst_ids]
        assert torch.equal(bits(cache[others]), bits(before[name][others]))


def plan_load(cons: KVEngine, spec: LoadSpec) -> None:
    """What the worker does with a step's metadata for a single-child request: the
    load, and the release of its key (no other request will load it)."""
    cons.add_load(spec)
    cons.release([spec.transfer_key])


def load_and_check(cons: KVEngine, prod: KVEngine, before: dict) -> None:
    """D loads the prompt's blocks 2.. (a 2-block local hit) into (7, 2, 11); they must
    arrive intact and nothing else may change."""
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set()
    assert_loaded(cons, before, prod, (7, 2, 11), SRC_IDS[2:])


def snapshot(caches: dict) -> dict:
    return {k: v.clone() for k, v in caches.items()}


def assert_untouched(eng: KVEngine, before: dict) -> None:
    for name, cache in eng.caches.items():
        assert torch.equal(bits(cache), bits(before[name])), name


ZERO = {"recv_bytes": 0, "recv_reserved_bytes": 0, "recv_items": 0, "send_bytes": 0, "send_items": 0,
        "pending_sends": 0, "pending_loads": 0, "partial_payloads": 0}


def tp_instance(role: str, send_type: str, tp_size: int, heads: int, seed: int, blocks_heads: int,
                dtypes: dict | None = None, transport=None, **over) -> list:
    """The ranks of one tensor-parallel instance: engines at kv_port + r, each with its share of the heads
    (``dtypes``: rank -> another KV dtype than bfloat16; ``transport(cfg)``: instead of tcp)."""
    import torch

    from connector import layout as kvlayout
    from connector.p2p.engine import KVEngine
    from connector.p2p.tp import TpSide
    from connector.transport import TransportError

    shape = (SHAPE[0], blocks_heads, *SHAPE[2:])
    for _ in range(5):
        port = free_port()
        ranks: list = []
        try:
            for r in range(tp_size):
                caches = make_caches(seed * 10 + r, shape=shape, dtype=(dtypes or {}).get(r, torch.bfloat16))
                cfg = make_cfg(role, send_type, port, **over)
                eng = KVEngine(cfg, r, caches, kvlayout.detect(None, caches), tp_side=TpSide(tp_size, heads),
                               transport=transport(cfg) if transport else None)
                eng.caches, eng.cfg = caches, cfg
                ranks.append(eng)
            return ranks
        except TransportError:  # port + r taken meanwhile: another base
            for eng in ranks:
                eng.close()
    raise RuntimeError("no free ports")

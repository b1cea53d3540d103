"""SharedStorageScheduler driven the way vLLM 0.32's scheduler drives it: vLLM's own
Request, KVCacheBlocks and SchedulerOutput; block files are real files in a
temp directory (the scheduler only looks at which exist)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.lora.request import LoRARequest
from vllm.v1.request import Request

from connector.shared_storage.config import SharedStorageConfig
from connector.shared_storage.metadata import FetchSpec, StoreSpec
from connector.shared_storage.scheduler import SharedStorageScheduler
from connector.shared_storage.store import block_path
from tests.support.scheduler import BS, D_ADDR, FakeKVCacheManager, kv_blocks, pd_id, sched_out
from tests.support.shared_storage_sched import TIMEOUT, chain_of, put, req, sched, toks
from xpyd_wire.discovery import Load


def admit(s: SharedStorageScheduler, r: Request, num_computed: int, block_ids) -> tuple[int, bool]:
    n, is_async = s.get_num_new_matched_tokens(r, num_computed)
    s.update_state_after_alloc(r, kv_blocks(block_ids), n)
    return n, is_async


# ======================================================================== consumer


def test_nothing_stored_nothing_claimed(tmp_path: Path):
    s = sched("kv_consumer", tmp_path)
    r = req("cmpl-a-0-1a2b3c4d", toks(300))
    s.on_new_request(r)
    assert admit(s, r, 0, [1, 2, 3]) == (0, False)
    assert s.build_connector_meta(sched_out()).loads == []
    assert s.request_finished(r, [1, 2, 3]) == (False, None)


def test_longest_stored_prefix_is_claimed_and_loaded_async(tmp_path: Path):
    s = sched("kv_consumer", tmp_path)
    t = toks(600)  # 4 full blocks + 88 tokens
    ks = put(tmp_path, t, 3)
    r = req("cmpl-a-0-1a2b3c4d", t)
    s.on_new_request(r)
    # Side-effect free until the allocation: asking twice answers the same.
    assert s.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    assert s.build_connector_meta(sched_out()).loads == []
    assert admit(s, r, 0, [9, 4, 7, 2, 5]) == (3 * BS, True)
    meta = s.build_connector_meta(sched_out())
    assert meta.loads == [FetchSpec(req_id=r.request_id, block_ids=(9, 4, 7), keys=tuple(ks), first_index=0,
                                    wait_s=0.0)]
    assert meta.stores == []  # a consumer never stores
    assert s.build_connector_meta(sched_out()).loads == []  # announced once
    s.update_connector_output({r.request_id}, set())
    assert s.request_finished(r, [])[1] == {"xpyd": {"storage": "shared", "loaded_tokens": 3 * BS,
                                                     "load_failed": False, "waited_for_producer": False}}


def test_gap_in_the_chain_ends_the_hit(tmp_path: Path):
    s = sched("kv_consumer", tmp_path)
    t = toks(600)
    ks = put(tmp_path, t, 4)
    block_path(tmp_path, ks[1], 0, 1).unlink()  # evicted
    r = req("cmpl-a-0-1a2b3c4d", t)
    assert s.get_num_new_matched_tokens(r, 0) == (BS, True)


def test_local_hit_loads_only_the_rest(tmp_path: Path):
    s = sched("kv_consumer", tmp_path)
    t = toks(600)
    ks = put(tmp_path, t, 4)
    r = req("cmpl-a-0-1a2b3c4d", t)
    assert admit(s, r, 2 * BS, [1, 2, 3, 4, 5]) == (2 * BS, True)
    (spec,) = s.build_connector_meta(sched_out()).loads
    assert (spec.block_ids, spec.keys, spec.first_index) == ((3, 4), tuple(ks[2:4]), 2)
    # A local hit covering the stored prefix: nothing to load.
    r2 = req("cmpl-b-0-1a2b3c4d", t)
    assert s.get_num_new_matched_tokens(r2, 4 * BS) == (0, False)


@pytest.mark.parametrize("n,stored,claim", [
    (2 * BS, 2, 2 * BS - 1),  # block-aligned prompt: the last token is left to compute
    (2 * BS + 1, 2, 2 * BS),
    (BS - 1, 0, 0),  # no full block
    (BS, 1, BS - 1),
])
def test_one_token_is_always_left_to_compute(tmp_path: Path, n: int, stored: int, claim: int):
    s = sched("kv_consumer", tmp_path)
    t = toks(n)
    put(tmp_path, t, stored)
    assert s.get_num_new_matched_tokens(req("cmpl-a-0-1a2b3c4d", t), 0) == (claim, claim > 0)


def test_common_prefix_reuses_another_prompts_blocks(tmp_path: Path):
    s = sched("kv_consumer", tmp_path)
    a = toks(3 * BS + 10)
    put(tmp_path, a, 3)
    b = a[:2 * BS] + toks(2 * BS, start=5000)
    assert s.get_num_new_matched_tokens(req("cmpl-b-0-1a2b3c4d", b), 0) == (2 * BS, True)


def test_every_rank_must_have_its_file(tmp_path: Path):
    s = sched("kv_consumer", tmp_path, world=2)
    t = toks(3 * BS)
    ks = put(tmp_path, t, 2, world=2)
    block_path(tmp_path, ks[1], 1, 2).unlink()
    assert s.get_num_new_matched_tokens(req("cmpl-a-0-1a2b3c4d", t), 0) == (BS, True)


def test_lora_and_cache_salt_have_their_own_keys(tmp_path: Path):
    s = sched("kv_consumer", tmp_path)
    t = toks(3 * BS)
    put(tmp_path, t, 2)
    assert s.get_num_new_matched_tokens(req("cmpl-a-0-1a2b3c4d", t, cache_salt="tenant-b"), 0) == (0, False)
    lora = LoRARequest("sql", 1, "/nonexistent")
    assert s.get_num_new_matched_tokens(req("cmpl-b-0-1a2b3c4d", t, lora_request=lora), 0) == (0, False)
    put(tmp_path, t, 2, cache_salt="tenant-b")
    assert s.get_num_new_matched_tokens(req("cmpl-c-0-1a2b3c4d", t, cache_salt="tenant-b"), 0) == (2 * BS, True)


def test_proxy_request_claims_what_the_producer_was_told_to_store(tmp_path: Path):
    """P answers the proxy once its step copied the blocks out; the files may land
    later: D claims the prompt's full blocks and the loader waits for them."""
    s = sched("kv_consumer", tmp_path)
    t = toks(3 * BS + 5)
    put(tmp_path, t, 1)
    r = req(pd_id(d=D_ADDR), t)
    assert admit(s, r, 0, [1, 2, 3, 4]) == (3 * BS, True)
    (spec,) = s.build_connector_meta(sched_out()).loads
    assert spec.wait_s == TIMEOUT and spec.block_ids == (1, 2, 3) and len(spec.keys) == 3


def test_request_asked_before_p_answered_waits_without_blocks_for_ps_first_file(tmp_path: Path, monkeypatch):
    """Concurrent dispatch: D is asked while P is queued or computing (the proxy's early mark).
    No file of P's yet: no blocks, no load (None: asked again next step), and the worker's idle
    steps wait (awaiting); P's first file: the claim as above, the loader waiting kv_load_timeout_s
    for the rest. None within kv_prefill_wait_s: D computes the prompt."""
    from connector.shared_storage import scheduler as ss_sched

    clock = [1000.0]
    monkeypatch.setattr(ss_sched.time, "monotonic", lambda: clock[0])
    s = sched("kv_consumer", tmp_path)
    t = toks(3 * BS + 5)
    r = req(pd_id(d=D_ADDR).replace("___prefill_addr_", "xpyd-early___prefill_addr_"), t)
    s.on_new_request(r)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    meta = s.build_connector_meta(sched_out())
    assert meta.loads == [] and meta.idle and meta.awaiting
    assert s.load_report().waiting_for_kv == 1  # the heartbeat: waiting for P, not for D's compute
    clock[0] += 100.0
    put(tmp_path, t, 1)  # P's first block is stored
    assert admit(s, r, 0, [1, 2, 3, 4]) == (3 * BS, True)
    meta = s.build_connector_meta(sched_out())
    (spec,) = meta.loads
    assert spec.wait_s == TIMEOUT and not meta.awaiting and s.load_report().waiting_for_kv == 0
    late = req(pd_id(key="cd" * 16, d=D_ADDR).replace("___prefill_addr_", "xpyd-early___prefill_addr_"),
               toks(3 * BS + 5, 9000))
    s.on_new_request(late)
    assert s.get_num_new_matched_tokens(late, 0) == (None, False)
    clock[0] += s._cfg.base.kv_prefill_wait_s
    assert s.get_num_new_matched_tokens(late, 0) == (0, False)
    assert s.get_num_new_matched_tokens(late, 0) == (0, False)  # computed here from now on
    assert not s.build_connector_meta(sched_out()).awaiting


def test_proxy_request_for_another_decode_does_not_wait(tmp_path: Path):
    """kv_both: a transfer whose decode is someone else is a plain lookup."""
    s = sched("kv_both", tmp_path)
    t = toks(3 * BS + 5)
    r = req(pd_id(d="127.0.0.9:1"), t)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)


def test_failed_blocks_are_reported_and_the_request_recomputes(tmp_path: Path):
    s = sched("kv_consumer", tmp_path)
    t = toks(4 * BS + 5)
    put(tmp_path, t, 4)
    r = req("cmpl-a-0-1a2b3c4d", t)
    admit(s, r, BS, [1, 2, 3, 4, 5])  # local hit of block 0, load blocks 1..3
    s.build_connector_meta(sched_out())
    s.update_connector_output({r.request_id}, {4, 99})  # block 3 of the prompt failed (checksum, evicted...)
    # vLLM keeps blocks before the failure; asking again (it restarted from 0) loads nothing.
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    info = s.request_finished(r, [])[1]["xpyd"]
    assert info["load_failed"] is True and info["loaded_tokens"] == 2 * BS  # blocks 1 and 2


def test_preempted_request_reloads(tmp_path: Path):
    s = sched("kv_consumer", tmp_path)
    t = toks(3 * BS + 5)
    put(tmp_path, t, 3)
    r = req(pd_id(d=D_ADDR), t)
    admit(s, r, 0, [1, 2, 3, 4])
    s.build_connector_meta(sched_out())
    s.update_connector_output({r.request_id}, set())
    # Preempted: blocks freed, vLLM asks again from 0; the stored blocks are loaded
    # again (no waiting this time: the producer's files are known to be there).
    assert admit(s, r, 0, [7, 8, 9, 10]) == (3 * BS, True)
    (spec,) = s.build_connector_meta(sched_out()).loads
    assert spec.block_ids == (7, 8, 9) and spec.wait_s == 0.0


def test_uncacheable_requests_are_left_alone(tmp_path: Path):
    s = sched("kv_both", tmp_path)
    t = toks(3 * BS)
    put(tmp_path, t, 2)
    r = req("cmpl-a-0-1a2b3c4d", t)
    r.mm_features = [object()]  # multimodal: the token ids do not determine the KV
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)


# ======================================================================== producer


def test_producer_stores_full_prompt_blocks_as_chunks_complete(tmp_path: Path):
    kvm = FakeKVCacheManager()
    s = sched("kv_producer", tmp_path, kvm)
    t = toks(5 * BS + 40)
    r = req(pd_id(), t)
    s.on_new_request(r)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # a producer never loads
    kvm.blocks[r.request_id] = [11, 12, 13, 14, 15, 16]
    ks = chain_of(t)
    # Chunk 1: 256 tokens -> blocks 0, 1.
    m1 = s.build_connector_meta(sched_out(new=[(r.request_id, 0, 2 * BS)]))
    assert m1.stores == [StoreSpec(r.request_id, (11, 12), tuple(ks[:2]), 0)]
    # Chunk 2: 200 tokens -> 456 computed -> block 2 complete.
    m2 = s.build_connector_meta(sched_out(cached=[(r.request_id, 2 * BS, 200)]))
    assert m2.stores == [StoreSpec(r.request_id, (13,), (ks[2],), 2)]
    # Last chunk: the prompt is complete; the partial last block is never stored.
    m3 = s.build_connector_meta(sched_out(cached=[(r.request_id, 2 * BS + 200, 224)]))
    assert m3.stores == [StoreSpec(r.request_id, (14, 15), tuple(ks[3:5]), 3)]
    # Decode steps store nothing more.
    assert s.build_connector_meta(sched_out(cached=[(r.request_id, len(t), 1)])).stores == []
    assert s.request_finished(r, [11, 12]) == (False, {"xpyd": {"storage": "shared", "stored_blocks": 5}})


def test_producer_stores_blocks_of_a_local_prefix_hit_too(tmp_path: Path):
    """P's own prefix cache served the first blocks: they still go to storage (D
    may not have them); the writer skips files that exist."""
    kvm = FakeKVCacheManager()
    s = sched("kv_producer", tmp_path, kvm)
    r = req("cmpl-a-0-1a2b3c4d", toks(3 * BS))
    s.on_new_request(r)
    kvm.blocks[r.request_id] = [5, 6, 7]
    (st,) = s.build_connector_meta(sched_out(new=[(r.request_id, 2 * BS, BS)])).stores
    assert st.block_ids == (5, 6, 7) and st.first_index == 0


def test_kv_both_loads_and_stores(tmp_path: Path):
    kvm = FakeKVCacheManager()
    s = sched("kv_both", tmp_path, kvm)
    t = toks(4 * BS + 1)
    put(tmp_path, t, 2)
    r = req("cmpl-a-0-1a2b3c4d", t)
    s.on_new_request(r)
    assert admit(s, r, 0, [1, 2, 3, 4, 5]) == (2 * BS, True)
    kvm.blocks[r.request_id] = [1, 2, 3, 4, 5]
    meta = s.build_connector_meta(sched_out(new=[(r.request_id, 2 * BS, 2 * BS + 1)]))
    assert len(meta.loads) == 1
    assert meta.stores[0].block_ids == (1, 2, 3, 4)


def test_load_report_for_the_heartbeat(tmp_path: Path):
    kvm = FakeKVCacheManager(usage=0.25)
    s = sched("kv_consumer", tmp_path, kvm)
    for i in range(3):
        s.on_new_request(req(f"cmpl-{i}-0-1a2b3c4d", toks(10)))
    s.build_connector_meta(sched_out(new=[("cmpl-0-0-1a2b3c4d", 0, 10)]))
    assert s.load_report() == Load(1, 2, 0.25, 0.0)


def test_config_requires_a_path():
    from types import SimpleNamespace

    kv = SimpleNamespace(kv_connector_extra_config={}, kv_role="kv_both", kv_port=1)
    with pytest.raises(ValueError, match="shared_storage_path"):
        SharedStorageConfig.from_vllm(kv)
    kv.kv_connector_extra_config = {"shared_storage_path": "/x", "shared_storage_max_bytes": "1e9",
                                    "shared_storage_verify": "false", "proxy_ip": "127.0.0.1", "proxy_port": 9,
                                    "http_port": 8000}
    c = SharedStorageConfig.from_vllm(kv)
    assert (c.max_bytes, c.verify, c.base.proxies, c.base.http_port) == (10**9, False, ("127.0.0.1:9",), 8000)

"""Helpers of tests/unit/test_connector_scheduler.py that other tests use too (moved from it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from connector.config import ConnectorConfig

BS = 128  # the CPU backend's default block size
KEY = "0123456789abcdef0123456789abcdef"


P_ADDR = "127.0.0.1:21001"
D_ADDR = "127.0.0.1:22001"


def pd_id(key: str = KEY, p: str = P_ADDR, d: str = D_ADDR, chat: bool = False, suffix: str = "1a2b3c4d") -> str:
    xid = f"___prefill_addr_{p}___decode_addr_{d}_{key}"
    return f"chatcmpl-{xid}-{suffix}" if chat else f"cmpl-{xid}-0-{suffix}"


def make_cfg(role: str, send_type: str = "PUT_ASYNC", addr: str | None = None,
             allow_debug_corruption: bool = False) -> ConnectorConfig:
    addr = addr or (P_ADDR if role == "kv_producer" else D_ADDR)
    host, _, port = addr.rpartition(":")
    return ConnectorConfig(
        role=role, kv_ip=host, kv_port=int(port), http_host=host, http_port=None, proxies=(),
        send_type=send_type, kv_buffer_size=10**9, kv_load_timeout_s=30.0, send_timeout_s=10.0,
        buffer_ttl_s=60.0, heartbeat_interval_s=3.0, transport="tcp", thread_affinity="auto", discovery_secret=None,
        allow_debug_corruption=allow_debug_corruption,
    )


def kv_blocks(ids) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


@dataclass
class FakeKVCacheManager:
    """Stands in for vLLM's KVCacheManager: the two members the connector reads."""

    blocks: dict[str, list[int]] = field(default_factory=dict)
    usage: float = 0.0
    calls: list[str] = field(default_factory=list)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        self.calls.append(request_id)
        return (list(self.blocks[request_id]),)


def sched_out(new=(), cached=(), resumed=(), preempted=None, finished=()) -> SchedulerOutput:
    """new/cached: (req_id, num_computed_tokens_before_this_step, num_scheduled_tokens)."""
    new_reqs = [
        NewRequestData(req_id=r, prompt_token_ids=None, mm_features=[], sampling_params=None,
                       pooling_params=None, block_ids=([],), num_computed_tokens=c, lora_request=None)
        for r, c, _ in new
    ]
    cached_reqs = CachedRequestData(
        req_ids=[r for r, _, _ in cached], resumed_req_ids=set(resumed), new_token_ids=[],
        all_token_ids={}, new_block_ids=[None] * len(cached),
        num_computed_tokens=[c for _, c, _ in cached], num_output_tokens=[0] * len(cached),
    )
    num_sched = {r: n for r, _, n in [*new, *cached]}
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs, num_scheduled_tokens=num_sched,
        total_num_scheduled_tokens=sum(num_sched.values()), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(finished), free_encoder_mm_hashes=[],
        preempted_req_ids=set(preempted) if preempted is not None else None,
    )

"""Worker-side half of the connector (runs in each vLLM worker process)."""

from __future__ import annotations

from typing import Any

import torch

from connector import affinity

from connector.p2p import tp
from connector import layout as kvlayout
from connector.config import ConnectorConfig
from connector.affinity import init_cpu_amx
from connector.p2p.engine import KVEngine, PollResult
from connector.log import get_logger
from connector.p2p.metadata import P2pConnectorMetadata
from connector.stats import XpydStats
from connector.tracing import tracing_on

logger = get_logger(__name__)


def tp_side(vllm_config: Any, block_layout: kvlayout.BlockLayout) -> tp.TpSide:
    """This instance's TP size, the model's total KV heads and MLA, from vLLM's config
    (what a peer checks at first contact); the cache's own head count when unknown."""
    size = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    model = getattr(vllm_config, "model_config", None)
    mla = bool(getattr(model, "use_mla", False))
    try:
        heads = 1 if mla else int(model.get_total_num_kv_heads())
    except Exception:  # noqa: BLE001 - no model config (tests): what this rank holds, times TP
        heads = block_layout.num_kv_heads * int(size)
    return tp.TpSide(int(size), heads, mla)


class P2pWorker:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any, rank: int) -> None:
        self._cfg = cfg
        self._vllm_config = vllm_config
        self._rank = rank
        self.engine: KVEngine | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        if first.device.type == "cpu":
            init_cpu_amx()
        block_layout = kvlayout.detect(self._vllm_config, kv_caches)
        kv_caches = kvlayout.regroup(kv_caches, block_layout)  # axis 0 = the scheduler's blocks
        # Our threads must not inherit the core OpenMP pinned the main thread to.
        on_cpu = first.device.type == "cpu" and self._cfg.thread_affinity == "auto"
        cpus = affinity.plan() if on_cpu else None
        affinity.log_plan(cpus)
        self.engine = KVEngine(self._cfg, self._rank, kv_caches, block_layout, cpus=cpus,
                               tp_side=tp_side(self._vllm_config, block_layout))
        self.engine.xfer_stats.legs = tracing_on(self._vllm_config)  # each transfer's numbers, for its span

    @property
    def layerwise(self) -> bool:
        """Whether this worker ships each layer as the forward pass writes it."""
        return self.engine is not None and self.engine.layerwise

    def _engine(self) -> KVEngine:
        if self.engine is None:
            raise RuntimeError("register_kv_caches was not called")
        return self.engine

    def prepare(self, meta: P2pConnectorMetadata) -> None:
        if meta.contacts and self.engine is not None:
            for addr in meta.contacts:
                self.engine.producer.prepare(addr)

    def start_load_kv(self, meta: P2pConnectorMetadata) -> None:
        for spec in meta.loads:
            self._engine().add_load(spec)
        if meta.release:
            self._engine().release(meta.release)

    def invalid_block_ids(self) -> set[int]:
        """Blocks of synchronous loads that failed since the last step."""
        return self.engine.take_invalid_blocks() if self.engine is not None else set()

    def save_layer(self, meta: P2pConnectorMetadata, layer_name: str) -> None:
        """Layer-wise sends: one layer's attention ran in this step's forward pass."""
        for spec in meta.saves:
            self._engine().save_layer(spec, layer_name)

    def wait_for_save(self, meta: P2pConnectorMetadata) -> None:
        for spec in meta.saves:
            self._engine().save(spec)

    def handle_preemptions(self, meta: P2pConnectorMetadata) -> None:
        if meta.preempted:
            self._engine().wait_sends(meta.preempted)

    def stats(self) -> XpydStats | None:
        if self.engine is None:
            return None
        buf = self.engine.recv_buffer
        return self.engine.xfer_stats.take(self._rank, buf.used_bytes + buf.reserved_bytes, buf.capacity_bytes)

    def poll(self, finished_req_ids: set[str], meta: P2pConnectorMetadata | None = None) -> PollResult:
        """What finished this step. In a step that computes nothing (``meta.idle``) the engine
        may wait up to ``idle_wait_ms`` for a pending transfer to move, or for a sender to
        begin when requests wait for one."""
        if self.engine is None:
            return PollResult()
        wait_s = self._cfg.idle_wait_ms / 1e3 if meta is not None and meta.idle else 0.0
        return self.engine.poll(finished_req_ids, wait_s, awaiting=meta is not None and meta.awaiting_senders)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

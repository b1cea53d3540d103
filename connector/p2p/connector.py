"""The facade vLLM loads: ``kv_connector: P2pNcclConnector``,
``kv_connector_module_path: connector``.

It only routes vLLM's calls to the scheduler-side or worker-side object for the
process it runs in; those two share nothing but ``P2pConnectorMetadata``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.config import ConnectorConfig
from connector.base import XpydConnectorBase, reasoning_parser_of, warn_unless_recompute
from connector.p2p.metadata import P2pConnectorMetadata
from connector.p2p.scheduler import ArrivalProbe, P2pScheduler
from connector.p2p.worker import P2pWorker
from connector.tracing import TransferSpans, tracing_on

if TYPE_CHECKING:
    import torch
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput


def arrival_probe(cfg: ConnectorConfig, vllm_config: "VllmConfig") -> ArrivalProbe | None:
    """D's scheduler asks its worker ranks whether a prompt's KV is here (a synchronous
    load). Their control sockets are at the advertised address + rank for ranks 0..TP-1 only
    with one data-parallel rank; with more, loads stay asynchronous."""
    par = vllm_config.parallel_config
    if not cfg.loads_sync or getattr(par, "data_parallel_size", 1) != 1 \
            or getattr(par, "pipeline_parallel_size", 1) != 1:
        return None
    return ArrivalProbe(cfg, par.tensor_parallel_size)


def _worker_rank() -> int:
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().rank


class P2pNcclConnector(XpydConnectorBase):
    _metadata_type = P2pConnectorMetadata
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = ConnectorConfig.from_vllm(vllm_config.kv_transfer_config, vllm_config.kv_events_config,
                                       vllm_config.cache_config.num_gpu_blocks,
                                       vllm_config.model_config if role == KVConnectorRole.SCHEDULER else None,
                                       reasoning_parser_of(vllm_config))
        self._scheduler: P2pScheduler | None = None
        self._worker: P2pWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if cfg.is_consumer:
                warn_unless_recompute("P2pNcclConnector", vllm_config,
                                      "a KV transfer that fails (P gone, a send timed out, refused or evicted KV)")
            self._spans = TransferSpans(vllm_config.parallel_config.world_size) \
                if tracing_on(vllm_config) else None
            self._scheduler = P2pScheduler(cfg, vllm_config.cache_config.block_size,
                                           probe=arrival_probe(cfg, vllm_config), spans=self._spans)
        else:
            self._worker = P2pWorker(cfg, vllm_config, _worker_rank())

    # ---- worker side ----
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: first contact with new decode peers starts now."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, P2pConnectorMetadata):
            self._worker.prepare(connector_metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Layer-wise sends: this layer's blocks of the prompts completed in this step go now,
        while the later layers run. Whole-request sends wait for the step's end (wait_for_save)."""
        if self._worker is not None and self._worker.layerwise:
            meta = self._meta()
            if isinstance(meta, P2pConnectorMetadata) and meta.saves:
                self._worker.save_layer(meta, layer_name)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None
        if isinstance(kv_connector_metadata, P2pConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        meta = self._meta_if_bound()
        r = self._worker.poll(finished_req_ids, meta)
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.invalid_block_ids()

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self._scheduler is not None
        if self._spans is not None:
            self._spans.output(connector_output)
        self._scheduler.update_connector_output(set(connector_output.failed_recving or ()),
                                                connector_output.kv_connector_stats,
                                                set(connector_output.invalid_block_ids or ()))

"""The facade vLLM loads: ``kv_connector: SharedStorageConnector``,
``kv_connector_module_path: connector``, ``kv_connector_extra_config:
{"shared_storage_path": DIR, ...}``.

Routes vLLM's calls to the scheduler-side or worker-side half; they share only
``SharedStorageMetadata`` and the files under the shared path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.base import XpydConnectorBase, reasoning_parser_of, warn_unless_recompute
from connector.log import get_logger
from connector.shared_storage.config import SharedStorageConfig
from connector.shared_storage.metadata import SharedStorageMetadata
from connector.shared_storage.scheduler import SharedStorageScheduler
from connector.shared_storage.worker import SharedStorageWorker
from connector.tracing import STORAGE_SPAN_NAMES, TransferSpans, tracing_on

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput

logger = get_logger(__name__)


def model_identity(cfg: SharedStorageConfig, vllm_config: "VllmConfig") -> str:
    """What names the model in keys and files: the operator's shared_storage_model_id,
    else the served checkpoint (path or hub name, and revision)."""
    if cfg.model_id:
        return cfg.model_id
    mc = vllm_config.model_config
    rev = getattr(mc, "revision", None)
    return f"{mc.model}@{rev}" if rev else str(mc.model)


def transfer_spans(ranks: int, tracer: Any = None) -> TransferSpans:
    """The requests' ``kv load`` / ``kv store`` spans while vLLM traces (connector/tracing.py)."""
    return TransferSpans(ranks, tracer, names=STORAGE_SPAN_NAMES, attributes={"xpyd.kv.storage": "shared"})


class SharedStorageConnector(XpydConnectorBase):
    _metadata_type = SharedStorageMetadata
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = SharedStorageConfig.from_vllm(vllm_config.kv_transfer_config, vllm_config.kv_events_config,
                                           vllm_config.cache_config.num_gpu_blocks,
                                           vllm_config.model_config if role == KVConnectorRole.SCHEDULER else None,
                                           reasoning_parser_of(vllm_config))
        model_id = model_identity(cfg, vllm_config)
        world = vllm_config.parallel_config.world_size
        self._scheduler: SharedStorageScheduler | None = None
        self._worker: SharedStorageWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if cfg.is_consumer:
                warn_unless_recompute("SharedStorageConnector", vllm_config, "a missing, evicted or damaged block file")
            self._spans = transfer_spans(world) if tracing_on(vllm_config) else None
            self._scheduler = SharedStorageScheduler(cfg, vllm_config.cache_config.block_size, world, model_id,
                                                     spans=self._spans)
        else:
            from vllm.distributed.parallel_state import get_world_group

            self._worker = SharedStorageWorker(cfg, vllm_config, get_world_group().rank, world, model_id)

    # ---- worker side ----
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        meta = self._meta_if_bound()
        r = self._worker.poll(finished_req_ids, idle=meta is not None and meta.idle,
                              awaiting=meta is not None and meta.awaiting)
        return KVConnectorTransferResults(finished_recving=r.finished)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_invalid_block_ids()

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self._scheduler is not None
        if self._spans is not None:
            self._spans.output(connector_output)
        self._scheduler.update_connector_output(set(connector_output.finished_recving or ()),
                                                set(connector_output.invalid_block_ids or ()),
                                                connector_output.kv_connector_stats)

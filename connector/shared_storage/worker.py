"""Worker-side half of the SharedStorageConnector (each vLLM worker process)."""

from __future__ import annotations

from typing import Any

import torch

from connector import affinity
from connector.affinity import init_cpu_amx
from connector import layout as kvlayout
from connector.log import get_logger
from connector.shared_storage.config import SharedStorageConfig
from connector.shared_storage.engine import PollResult, StorageEngine, file_meta
from connector.shared_storage.metadata import SharedStorageMetadata
from connector.shared_storage.store import BlockStore
from connector.stats import XpydStats
from connector.tracing import tracing_on

logger = get_logger(__name__)


class SharedStorageWorker:
    def __init__(self, cfg: SharedStorageConfig, vllm_config: Any, rank: int, world: int, model_id: str) -> None:
        self._cfg = cfg
        self._vllm_config = vllm_config
        self._rank = rank
        self._world = world
        self._model_id = model_id
        self.engine: StorageEngine | None = None
        self._invalid: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        if first.device.type == "cpu":
            init_cpu_amx()
        block_layout = kvlayout.detect(self._vllm_config, kv_caches)
        on_cpu = first.device.type == "cpu" and self._cfg.base.thread_affinity == "auto"
        cpus = affinity.plan() if on_cpu else None
        affinity.log_plan(cpus)
        meta = file_meta(self._model_id, self._vllm_config.cache_config.block_size, block_layout,
                         list(kv_caches), self._rank, self._world)
        store = BlockStore(self._cfg.path, meta, verify=self._cfg.verify, fsync=self._cfg.fsync)
        self.engine = StorageEngine(store, kv_caches, block_layout, self._cfg.max_bytes, self._cfg.queue_bytes,
                                    self._cfg.queue_wait_s, cpus=cpus)
        self.engine.xfer_stats.legs = tracing_on(self._vllm_config)  # each store's / load's numbers, for its span
        logger.info("kv storage up path=%s role=%s rank=%d/%d model_id=%s layout=%s block_bytes=%d max_bytes=%d",
                    self._cfg.path, self._cfg.role, self._rank, self._world, self._model_id, block_layout,
                    self.engine.block_bytes, self._cfg.max_bytes)

    def _engine(self) -> StorageEngine:
        if self.engine is None:
            raise RuntimeError("register_kv_caches was not called")
        return self.engine

    def start_load_kv(self, meta: SharedStorageMetadata) -> None:
        for spec in meta.loads:
            self._engine().submit_load(spec)

    def wait_for_save(self, meta: SharedStorageMetadata) -> None:
        for spec in meta.stores:
            self._engine().submit_store(spec)

    def poll(self, finished_req_ids: set[str], idle: bool = False, awaiting: bool = False) -> PollResult:
        """What finished this step; in a step that computes nothing, wait up to idle_wait_ms
        for a pending read to finish (or that long, when requests await a producer's files)."""
        if self.engine is None:
            return PollResult()
        r = self.engine.poll(finished_req_ids, self._cfg.base.idle_wait_ms / 1e3 if idle else 0.0, awaiting)
        self._invalid |= r.invalid_block_ids
        return r

    def take_invalid_block_ids(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def stats(self) -> XpydStats | None:
        if self.engine is None:
            return None
        return self.engine.xfer_stats.take(self._rank, self.engine.queued_bytes, self.engine.queue_bytes)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

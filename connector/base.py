"""The base class of both xPyD connectors (``XpydConnectorBase``), what the classes vLLM loads do
alike: the calls vLLM makes that go unchanged to the
worker or scheduler half, stats for vLLM's loggers, and shutdown. Each subclass sets
`_scheduler` and `_worker` (one of them per process) in __init__, and `_metadata_type`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from connector.log import get_logger
from connector.stats import XpydPromMetrics, XpydStats

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


logger = get_logger(__name__)


def warn_unless_recompute(name: str, vllm_config: Any, lost: str) -> None:
    """A consumer under vLLM's default kv_load_failure_policy ("fail") turns every load that
    fails into an error for the client. Say so once at start-up, with what is lost and how to
    recompute instead (operators copy vLLM's own examples, which do not set it)."""
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
    if policy != "recompute":
        logger.warning("%s: kv_load_failure_policy is %r, so %s fails the request with an internal error "
                       "(the xPyD proxy then retries it on a decode instance alone); set "
                       "\"kv_load_failure_policy\": \"recompute\" to recompute the prompt instead", name, policy, lost)


def reasoning_parser_of(vllm_config: Any) -> str | None:
    """--reasoning-parser's name, where vLLM 0.32 keeps it (None: none, or not found)."""
    return getattr(getattr(vllm_config, "structured_outputs_config", None), "reasoning_parser", None) or None


class XpydConnectorBase(KVConnectorBase_V1):
    _scheduler: Any
    _worker: Any
    _metadata_type: type[KVConnectorMetadata]  # what the scheduler half sends the worker half
    _spans: Any = None  # scheduler: the kv send/load spans (connector/tracing.py) while vLLM traces

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33: sleep mode frees the KV cache our engines hold views of (to serve
        peers, to write loaded blocks into); unregister/restore are not implemented, so no."""
        return False

    # ---- worker side ----
    def _meta(self) -> KVConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, self._metadata_type)
        return meta

    def _meta_if_bound(self) -> Any:
        """This step's metadata, or None outside a step (get_transfer_results may be called then)."""
        return self._meta() if self.has_connector_metadata() else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous (before the request's first forward)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any
    ) -> None:
        return  # whole blocks are taken once per step, after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            self._worker.wait_for_save(self._meta())

    def get_kv_connector_stats(self) -> XpydStats | None:
        """Worker: this step's transfer counters and the buffer occupancy (heartbeat load),
        carried to the scheduler and on to vLLM's stat loggers."""
        return self._worker.stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> XpydStats:
        return XpydStats.from_dict(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type[Any], type[Any]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> XpydPromMetrics:
        """The ``vllm:xpyd_kv_*`` series on vLLM's /metrics (see connector/stats.py)."""
        return XpydPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._spans is not None:
            self._spans.close()

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.bind(kv_cache_manager)

    def on_new_request(self, request: "Request") -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        out = self._scheduler.request_finished(request, block_ids)
        if self._spans is not None:
            self._spans.finished(request, *out)
        return out

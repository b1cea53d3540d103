"""vLLM's KV connector API, checked against what both xPyD connectors (P2pNcclConnector,
SharedStorageConnector) were reviewed for: vLLM 0.32's base class and 0.33's additions. The
unit tier runs this on 0.32 (the CPU build); scripts/check_vllm033.sh runs it on 0.33.0's Python
code (the rest tier, tests/unit/test_vllm033.py). What each addition means for the connectors:
docs/connector/index.md, "vLLM versions"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

# Every public member of KVConnectorBase_V1 in vLLM 0.32.0 and 0.33.0, each looked at for both
# connectors. A later vLLM that adds one fails here until someone has looked at it too.
REVIEWED = frozenset({
    "bind_connector_metadata", "bind_gpu_block_pool", "bind_kv_cache_manager", "build_connector_meta",
    "build_connector_worker_meta", "build_kv_connector_stats", "build_prom_metrics", "clear_connector_metadata",
    "finish_forward", "get_block_ids_with_load_errors", "get_external_cache_hit_sources", "get_finished",
    "get_finished_count", "get_handshake_metadata", "get_kv_connector_kv_cache_events", "get_kv_connector_stats",
    "get_loaded_kv_cache_group_ids", "get_mem_pool_context", "get_num_new_matched_tokens",
    "get_required_kvcache_layout", "get_transfer_results", "handle_preemptions", "has_connector_metadata",
    "has_pending_block_frees", "has_pending_push_work", "on_new_request", "register_finished_partial_tail",
    "register_kv_caches", "request_finished", "requires_kv_delivery", "requires_piecewise_for_cudagraph",
    "reset_cache", "reset_capture_state", "role", "save_kv_layer", "set_host_xfer_buffer_ops",
    "set_xfer_handshake_metadata", "set_xfer_handshake_metadata_pp_aware", "shutdown", "start_load_kv",
    "supports_divergent_local_hybrid_hits", "take_events", "update_connector_output", "update_state_after_alloc",
    "wait_for_layer_load", "wait_for_save",
    # 0.33: sleep mode asks the connector, and tells it around remapping the KV cache.
    "supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches",
})  # fmt: skip

CONNECTORS = ["P2pNcclConnector", "SharedStorageConnector"]


def _cls(name: str) -> type:
    import connector

    return getattr(connector, name)


def _kv_config(name: str) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_connector_module_path="connector", kv_role="kv_both")


def test_the_connector_base_has_no_member_nobody_reviewed():
    public = {n for n in dir(KVConnectorBase_V1) if not n.startswith("_")}
    unknown = sorted(public - REVIEWED)
    assert not unknown, (f"vLLM {vllm.__version__}'s KVConnectorBase_V1 has members not reviewed for xPyD's "
                         f"connectors: {unknown} (see docs/connector/index.md, 'vLLM versions')")


@pytest.mark.parametrize("name", CONNECTORS)
def test_both_connectors_decline_sleep_mode_whatever_the_config(name):
    """vLLM 0.33's default is True. Both connectors keep what sleep mode remaps: the P2P
    engine's views of every layer's KV cache (served to peers, written into by loads, pinned
    staging sized to them), the shared-storage engine's the same for its reads and writes.
    Neither implements unregister/restore, so neither may say yes."""
    cls = _cls(name)
    assert cls.supports_sleep_mode(_kv_config(name)) is False
    assert cls.supports_sleep_mode(None) is False
    # Never called while sleep is refused: the base's no-ops (0.33), or absent (0.32).
    for hook in ("unregister_kv_caches", "restore_kv_caches"):
        assert getattr(cls, hook, None) is getattr(KVConnectorBase_V1, hook, None)


@pytest.mark.parametrize("name", CONNECTORS)
def test_vllm_refuses_sleep_mode_with_either_connector(name):
    """vLLM 0.33's config check (VllmConfig._verify_kv_transfer_compat) loads the connector
    class named in --kv-transfer-config and refuses --enable-sleep-mode when it says no."""
    from vllm.config import VllmConfig

    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        pytest.skip(f"vLLM {vllm.__version__} does not ask the connector about sleep mode (0.33 does)")
    check = VllmConfig._verify_kv_transfer_compat
    config = SimpleNamespace(kv_transfer_config=_kv_config(name), model_config=SimpleNamespace(enable_sleep_mode=True))
    with pytest.raises(ValueError, match=f"^{name} does not support sleep mode.$"):
        check(config)

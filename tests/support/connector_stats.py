"""Helpers of tests/unit/test_connector_stats.py that other tests use too (moved from it)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm


def registry_prom(reg: CollectorRegistry) -> type[KVConnectorProm]:
    class Prom(KVConnectorProm):  # vLLM's class, with metrics on a private registry
        _gauge_cls = functools.partial(Gauge, registry=reg)
        _counter_cls = functools.partial(Counter, registry=reg)
        _histogram_cls = functools.partial(Histogram, registry=reg)

    return Prom


def p2p_config(module_path: str = "connector", name: str = "P2pNcclConnector") -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector=name, kv_connector_module_path=module_path, kv_role="kv_both"))

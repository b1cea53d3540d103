"""Typed view of the SharedStorageConnector's ``kv_connector_extra_config``.

Registration with the proxy (``proxy_ip``/``proxy_port``/``proxies``, ``http_port``,
``discovery_secret``, ``heartbeat_interval_s``), ``kv_load_timeout_s`` and
``thread_affinity`` mean exactly what they mean for the P2P connector: they are
parsed by the same ``ConnectorConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connector.config import ConnectorConfig, as_bool

DEFAULT_MAX_BYTES = 10 * 2**30
DEFAULT_QUEUE_BYTES = 2**30
DEFAULT_QUEUE_WAIT_S = 5.0


def _size(value: Any) -> int:
    return int(float(value))  # JSON may say 1e9


@dataclass(frozen=True, slots=True)
class SharedStorageConfig:
    base: ConnectorConfig
    path: Path
    max_bytes: int  # <= 0: no limit
    model_id: str | None  # None: the served model's path/name (and revision)
    queue_bytes: int  # the writer's queue bound
    queue_wait_s: float  # a full queue blocks the step this long, then the store is dropped
    verify: bool  # CRC32 of every payload checked on load
    fsync: bool  # fsync each file before its rename (survives power loss, costs)

    @property
    def role(self) -> str:
        return self.base.role

    @property
    def is_producer(self) -> bool:
        return self.base.is_producer

    @property
    def is_consumer(self) -> bool:
        return self.base.is_consumer

    @staticmethod
    def from_vllm(kv_transfer_config: Any, kv_events_config: Any = None,
                  kv_blocks: int | None = None, model_config: Any = None,
                  reasoning_parser: str | None = None) -> "SharedStorageConfig":
        extra: dict[str, Any] = dict(kv_transfer_config.kv_connector_extra_config or {})
        path = extra.get("shared_storage_path")
        if not path:
            raise ValueError("SharedStorageConnector needs kv_connector_extra_config.shared_storage_path")
        queue_bytes = _size(extra.get("shared_storage_queue_bytes", DEFAULT_QUEUE_BYTES))
        if queue_bytes <= 0:
            raise ValueError("shared_storage_queue_bytes must be > 0")
        model_id = extra.get("shared_storage_model_id")
        return SharedStorageConfig(
            base=ConnectorConfig.from_vllm(kv_transfer_config, kv_events_config, kv_blocks, model_config,
                                           reasoning_parser),
            path=Path(str(path)),
            max_bytes=_size(extra.get("shared_storage_max_bytes", DEFAULT_MAX_BYTES)),
            model_id=str(model_id) if model_id else None,
            queue_bytes=queue_bytes,
            queue_wait_s=float(extra.get("shared_storage_queue_wait_s", DEFAULT_QUEUE_WAIT_S)),
            verify=as_bool(extra.get("shared_storage_verify", True)),
            fsync=as_bool(extra.get("shared_storage_fsync", False)),
        )


def kv_transfer_config(role: str, path: str | Path, **extra: object) -> dict[str, Any]:
    """A vLLM ``--kv-transfer-config`` for this connector (scripts, tests, examples).

    ``extra`` goes to ``kv_connector_extra_config`` (proxy keys, limits...). A missing
    or damaged block file is an ordinary miss, so failed loads are recomputed.
    """
    kv_port = extra.pop("kv_port", None)
    cfg: dict[str, Any] = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_module_path": "connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"shared_storage_path": str(path), **extra},
    }
    if kv_port is not None:
        cfg["kv_port"] = kv_port
    return cfg

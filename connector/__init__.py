"""xPyD's KV connectors for vLLM 0.32: load one with
``"kv_connector": "P2pNcclConnector"`` (or ``"SharedStorageConnector"``),
``"kv_connector_module_path": "connector"``.

The facade is imported lazily so that pieces without a vLLM dependency (the
transport, the buffer, request-id parsing) import on their own.
"""

from typing import Any

__all__ = ["P2pNcclConnector", "SharedStorageConnector"]


def __getattr__(name: str) -> Any:
    if name == "P2pNcclConnector":
        from connector.connector import P2pNcclConnector

        return P2pNcclConnector
    if name == "SharedStorageConnector":
        from connector.shared_storage.connector import SharedStorageConnector

        return SharedStorageConnector
    raise AttributeError(name)

"""xPyD's KV connectors for vLLM 0.32: load one with
``"kv_connector": "P2pNcclConnector"`` (or ``"SharedStorageConnector"``),
``"kv_connector_module_path": "connector"``.

Each connector is a wing of its own (``p2p/``, ``shared_storage/``); this module is the name
vLLM's config gives, and imports each class from its wing lazily, so that pieces without a vLLM
dependency (the transport, the buffer, request-id parsing) import on their own.
"""

from typing import Any

__all__ = ["P2pNcclConnector", "SharedStorageConnector"]


def __getattr__(name: str) -> Any:
    if name == "P2pNcclConnector":
        from connector.p2p.connector import P2pNcclConnector

        return P2pNcclConnector
    if name == "SharedStorageConnector":
        from connector.shared_storage.connector import SharedStorageConnector

        return SharedStorageConnector
    raise AttributeError(name)

"""The P2P connector (``P2pNcclConnector``): P ships each prompt's KV straight to D over the
transport (tcp on CPU, NCCL on GPU). Its scheduler half (``scheduler``, ``arrivals``) and worker
half (``worker``, ``engine``, ``producer``, ``consumer``, ``assembly``, ``buffer``, ``staging``)
share only ``metadata``; ``tp`` matches P and D of different tensor-parallel sizes. It imports
the shared root of ``connector/`` and ``connector.transport``, never ``shared_storage/``."""

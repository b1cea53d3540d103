"""SharedStorageConnector: vLLM KV through a shared filesystem.

Producers write the KV of each full prompt block to ``shared_storage_path`` as one
file per block (and worker rank), named by a hash chained over the block's token
ids and its prefix; consumers load the longest stored prefix. Modules:

- ``keys``: the hash chain (which file holds which block),
- ``store``: the file format, atomic writes, verified reads, LRU eviction,
- ``scheduler`` / ``worker``: the two halves inside vLLM, sharing only ``metadata``,
- ``connector``: the facade vLLM loads (``connector.SharedStorageConnector``).

Only ``connector`` and its halves import vLLM; ``keys`` and ``store`` do not.
"""

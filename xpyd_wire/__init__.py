"""xPyD's wire formats, the one place both sides of every boundary import them from.

- ``discovery``: the registration heartbeat an instance sends the proxy (msgpack over ZMQ),
- ``request_id``: the request id the proxy builds and the connector parses,
- ``kv_events``: vLLM's KV-event stream (endpoint fields of the registration, the
  ``[topic, seq, KVEventBatch]`` frames, the replay request) and the chained block keys,
- ``kv_transfer``: the P<->D KV protocol between two connector engines (its version, the typed
  requests ``Hello``, ``Reserve``, ``PutHeader``, ``Get``, ``Release``, ``Ready``, ``Abort``,
  ``Ping``, the ``Refusal``) and the ``kv_transfer_params`` fields the proxy sets for the connector,
- ``headers``: the ``x-xpyd-*`` response header names; ``secret_file``: reading a secret from a file.

``proxy/`` and ``connector/`` import from here and never from each other
(tests/unit/test_wire_boundaries.py enforces it). Nothing here imports torch, vLLM or asyncio,
so vLLM's processes and the proxy load it cheaply.
"""

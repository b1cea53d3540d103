"""xPyD's wire formats, the one place both sides of every boundary import them from.

- ``discovery``: the registration heartbeat an instance sends the proxy (msgpack over ZMQ),
- ``request_id``: the request id the proxy builds and the connector parses,
- ``kv_events``: vLLM's KV-event stream (endpoint fields of the registration, the
  ``[topic, seq, KVEventBatch]`` frames, the replay request) and the chained block keys.

``proxy/`` and ``connector/`` import from here and never from each other
(tests/unit/test_wire_boundaries.py enforces it). Nothing here imports torch, vLLM or asyncio,
so vLLM's processes and the proxy load it cheaply.
"""

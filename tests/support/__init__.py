"""Code the tests and scripts/ share: ports, waiting, fakes (fake vLLM, KV publisher,
NCCL), clients, the cluster spawner, engine and proxy helpers (tests.support.X)."""

"""The SharedStorageScheduler's test helpers (tests/unit/test_shared_storage_scheduler.py and
test_shared_storage_tracing.py): its config, a scheduler bound to a fake KV cache manager, and block
files a producer would have stored (the scheduler only looks at which exist)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vllm import SamplingParams
from vllm.v1.request import Request

from connector.shared_storage import keys
from connector.shared_storage.config import SharedStorageConfig
from connector.shared_storage.scheduler import SharedStorageScheduler
from connector.shared_storage.store import block_path
from connector.tracing import TransferSpans
from tests.support.scheduler import BS, FakeKVCacheManager, make_cfg

MODEL = "tiny"
TIMEOUT = 7.5


def ss_cfg(role: str, path: Path) -> SharedStorageConfig:
    base = dataclasses.replace(make_cfg(role), kv_load_timeout_s=TIMEOUT)
    return SharedStorageConfig(base=base, path=path, max_bytes=0, model_id=None, queue_bytes=1 << 30,
                               queue_wait_s=1.0, verify=True, fsync=False)


def sched(role: str, path: Path, kvm: FakeKVCacheManager | None = None, world: int = 1,
          spans: TransferSpans | None = None) -> SharedStorageScheduler:
    s = SharedStorageScheduler(ss_cfg(role, path), BS, world, MODEL, start_registrar=False, spans=spans)
    s.bind(kvm or FakeKVCacheManager())
    return s


def req(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=16), None, **kw)


def toks(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def chain_of(tokens: list[int], **root_kw) -> list[str]:
    return [k.hex() for k in keys.chain(keys.root(MODEL, BS, **root_kw), tokens, BS)]


def put(path: Path, tokens: list[int], n_blocks: int, world: int = 1, **root_kw) -> list[str]:
    """Pretend a producer stored the first n_blocks blocks of tokens (every rank)."""
    ks = chain_of(tokens, **root_kw)[:n_blocks]
    for k in ks:
        for r in range(world):
            p = block_path(path, k, r, world)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x")
    return ks

"""Helpers of tests/unit/test_shared_storage_engine.py that other tests use too (moved from it)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from connector import layout as kvlayout
from connector.shared_storage import keys
from connector.shared_storage.engine import StorageEngine, file_meta
from connector.shared_storage.store import BlockStore

BS = 16
SHAPE = (2, BS, 8)  # [kv_heads, block_size, 2*head_size] per block
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def caches(seed: int, n_blocks: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn((n_blocks, *SHAPE), generator=g).to(torch.bfloat16) for n in LAYERS}


def engine(root: Path, c: dict[str, torch.Tensor], max_bytes: int = 0, queue_bytes: int = 1 << 30,
           queue_wait_s: float = 1.0) -> StorageEngine:
    lay = kvlayout.BlockLayout("LBHNC", "bfloat16", SHAPE, True)
    meta = file_meta("tiny", BS, lay, list(c), 0, 1)
    return StorageEngine(BlockStore(root, meta), c, lay, max_bytes, queue_bytes, queue_wait_s)


def chain(n: int, salt: int = 0) -> tuple[str, ...]:
    return tuple(k.hex() for k in keys.chain(keys.root("tiny", BS), [salt] + list(range(n * BS - 1)), BS))


def wait_poll(e: StorageEngine, rid: str, timeout: float = 10.0, finished: set[str] | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = e.poll(finished or set())
        if rid in r.finished:
            return r
        time.sleep(0.005)
    raise AssertionError(f"load of {rid} did not finish")

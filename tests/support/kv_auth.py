"""Helpers of tests/unit/test_connector_auth.py that other tests use too (moved from it)."""

from __future__ import annotations

import torch

from connector.p2p.engine import KVEngine
from tests.support.kv_engines import KEY

SECRET = "kv-secret-for-tests"


def refused(eng: KVEngine) -> dict[str, int]:
    return {k: v for k, v in eng.refusals().items() if v}


def kv_put_frames(eng: KVEngine, key: str = KEY) -> tuple[dict, list[torch.Tensor]]:
    """A well-formed put of two blocks for eng's caches (what a producer would send)."""
    header = {"op": "put", "key": key, "num_tokens": 2 * 16, "num_blocks": 2, "layers": list(eng.caches),
              "runs": [2], **eng.block_layout.describe()}
    return header, [torch.ones((2, *eng.block_layout.block_shape), dtype=torch.bfloat16)] * len(eng.caches)

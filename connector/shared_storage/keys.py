"""Which file holds which block: a hash chained over full blocks of token ids.

Block i's key is ``sha256(key(i-1) || token ids of block i)``, starting from a
root that names everything else the KV depends on (model, block size, LoRA,
cache salt). So two prompts sharing their first k blocks share those k keys, and
a block's key also fixes everything before it: a hit on key i is a hit on the
whole prefix up to block i. Only full blocks have keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

FORMAT_VERSION = "xpyd-ss-v1"


def root(model_id: str, block_size: int, lora: str | None = None, cache_salt: str | None = None) -> bytes:
    """The chain's seed: KV of the same tokens under another model, block size,
    adapter or salt must never share a key."""
    parts = [FORMAT_VERSION, model_id, str(block_size), lora or "", cache_salt or ""]
    h = hashlib.sha256()
    for p in parts:  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        b = p.encode()
        h.update(struct.pack("<I", len(b)))
        h.update(b)
    return h.digest()


def chain(seed: bytes, token_ids: Sequence[int], block_size: int, start: int = 0,
          prev: bytes | None = None) -> list[bytes]:
    """Keys of the full blocks ``start, start+1, ...`` of ``token_ids``.

    ``prev`` is the key of block ``start - 1`` (None for block 0, which chains from
    ``seed``): callers extend a chain as tokens arrive without rehashing it.
    """
    out: list[bytes] = []
    prev = seed if start == 0 or prev is None else prev
    if start > 0 and prev is seed:
        raise ValueError("extending a chain needs the key of the block before start")
    n_full = len(token_ids) // block_size
    for i in range(start, n_full):
        block = token_ids[i * block_size:(i + 1) * block_size]
        h = hashlib.sha256(prev)
        # 8 bytes per id: vocabularies fit, and the width is fixed by the format.
        h.update(struct.pack(f"<{block_size}q", *block))
        prev = h.digest()
        out.append(prev)
    return out


def name(key: bytes) -> str:
    return key.hex()

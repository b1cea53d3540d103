"""Which KV blocks each instance holds, learned from its KV events (proxy/routing/kv_events.py).

Blocks are keyed by xpyd_wire.kv_events.chain_block_keys (a chained hash of the full blocks'
token ids, salted by LoRA name), not by vLLM's block hashes, so a prompt's keys computed by the
proxy from its tokens can be looked up directly; a map vLLM hash -> key applies BlockRemoved
and chains a BlockStored onto its parent. Only the primary tier (medium GPU or unset) of KV
cache group 0 is indexed: that is what a request on the instance hits; blocks whose vLLM hash
covers more than tokens and LoRA (a cache_salt, images) are left out, since no unsalted
prompt hits them.

Memory is bounded by a cap on blocks per instance (the proxy's --kv-index-max-blocks, or
the instance's KV capacity when its registration gives a smaller one); past the cap the oldest blocks are
forgotten, so the index never claims more than the instance holds — only less. Every
operation is O(blocks in the event).

State: KNOWN (the index has everything since the engine started or last cleared its cache),
PARTIAL (it holds a subset: joined late or lost events that could not be replayed; it becomes
KNOWN again after AllBlocksCleared or an engine restart), UNKNOWN (no events yet, or the
publisher went silent or away): a policy must not read an UNKNOWN index as "empty".
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from xpyd_wire.kv_events import (
    ROOT_KEY,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    chain_block_key,
    chain_block_keys,
)

__all__ = ["IndexState", "InstanceIndex", "chain_block_keys"]

_PRIMARY_MEDIA = (None, "GPU")
# Blocks applied between two yields of apply_steps (~0.5 ms of Python on a 2-core CI box).
APPLY_STEP_BLOCKS = 256


class IndexState(str, enum.Enum):
    UNKNOWN = "unknown"
    PARTIAL = "partial"
    KNOWN = "known"


@dataclass(slots=True)
class ApplyStats:
    stored: int = 0
    removed: int = 0
    orphans: int = 0  # stored blocks whose parent the index does not hold (cannot be keyed)
    ignored: int = 0  # other media or cache groups
    evicted: int = 0  # forgotten to stay within the cap


@dataclass(slots=True)
class InstanceIndex:
    cap: int
    # The content: everything the instance holds (True) or a subset (False).
    complete: bool = False
    # Events are flowing (or the publisher confirmed it has nothing new): False until the
    # first one and while the publisher is silent or unreachable.
    live: bool = False
    # vLLM block hash -> our key, oldest first (the cap evicts from the front).
    _by_hash: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)
    # our key -> how many vLLM hashes map to it (extra keys such as a cache salt make
    # vLLM hashes differ for the same tokens).
    _refs: dict[int, int] = field(default_factory=dict)
    block_size: int | None = None

    def __len__(self) -> int:
        return len(self._by_hash)

    @property
    def state(self) -> IndexState:
        if not self.live:
            return IndexState.UNKNOWN
        return IndexState.KNOWN if self.complete else IndexState.PARTIAL

    @property
    def keys(self) -> int:
        return len(self._refs)

    def clear(self, complete: bool) -> None:
        """Forget every block; `complete`: the instance is known to hold none either
        (engine restarted), else the index rebuilds from here as a subset."""
        self._by_hash.clear()
        self._refs.clear()
        self.complete = complete

    def holds(self, key: int) -> bool:
        return key in self._refs

    def longest_prefix(self, keys: Sequence[int]) -> int:
        """How many of a prompt's leading block keys the instance holds (for the `precise`
        policies; read `state` first: UNKNOWN means "no idea", not 0)."""
        refs = self._refs
        n = 0
        for key in keys:
            if key not in refs:
                break
            n += 1
        return n

    def _add(self, vhash: BlockHash, key: int, stats: ApplyStats) -> None:
        old = self._by_hash.get(vhash)
        if old is not None:  # re-reported (prefix-cache reuse): refresh its age only
            self._by_hash.move_to_end(vhash)
            return
        while len(self._by_hash) >= self.cap:
            _, gone = self._by_hash.popitem(last=False)
            self._unref(gone)
            stats.evicted += 1
        self._by_hash[vhash] = key
        self._refs[key] = self._refs.get(key, 0) + 1
        stats.stored += 1

    def _unref(self, key: int) -> None:
        left = self._refs[key] - 1
        if left:
            self._refs[key] = left
        else:
            del self._refs[key]

    def apply(self, events: Sequence[Event], stats: ApplyStats | None = None) -> ApplyStats:
        """Apply one batch's events in order."""
        stats = ApplyStats() if stats is None else stats
        for _ in self.apply_steps(events, stats):
            pass
        return stats

    def apply_steps(self, events: Sequence[Event], stats: ApplyStats,
                    step_blocks: int = APPLY_STEP_BLOCKS) -> Iterator[None]:
        """apply() in steps: yields after about every `step_blocks` blocks, so that the caller
        can hand the event loop back in the middle of a large batch (the index is then what
        the events so far made it, as if the batch had come in parts)."""
        done = 0
        for event in events:
            if done >= step_blocks:
                done = 0
                yield
            if not isinstance(event, AllBlocksCleared):
                done += len(event.block_hashes)
            if isinstance(event, BlockStored):
                # Salted (or multimodal) blocks: a prompt's token keys never name them.
                if event.extra or event.medium not in _PRIMARY_MEDIA or event.group_idx not in (None, 0):
                    stats.ignored += len(event.block_hashes)
                    continue
                self.block_size = event.block_size
                if event.parent_block_hash is None:
                    parent = ROOT_KEY
                else:
                    found = self._by_hash.get(event.parent_block_hash)
                    if found is None:
                        stats.orphans += len(event.block_hashes)
                        continue
                    parent = found
                size = event.block_size
                tokens = event.token_ids
                for i, vhash in enumerate(event.block_hashes):
                    parent = chain_block_key(parent, tokens[i * size:(i + 1) * size], event.lora_name)
                    self._add(vhash, parent, stats)
                    if i % step_blocks == step_blocks - 1:  # one event may hold 100k blocks
                        yield
            elif isinstance(event, BlockRemoved):
                if event.medium not in _PRIMARY_MEDIA or event.group_idx not in (None, 0):
                    stats.ignored += len(event.block_hashes)
                    continue
                for i, vhash in enumerate(event.block_hashes):
                    key = self._by_hash.pop(vhash, None)
                    if key is not None:
                        self._unref(key)
                        stats.removed += 1
                    if i % step_blocks == step_blocks - 1:
                        yield
            elif isinstance(event, AllBlocksCleared):
                self._by_hash.clear()
                self._refs.clear()
                self.complete = True  # everything from here on is seen: complete again

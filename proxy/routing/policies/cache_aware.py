"""Prefix-aware routing: send a prompt where its prefix was recently computed.

The proxy cannot see an instance's KV cache, so it keeps its own approximation of it: what
it sent there. A routing key (prompt text, token ids, or chat messages, see
openai_api.routing_key) is cut into fixed-size chunks and hashed as a chain, each chunk's
hash covering its predecessor's, so one hash stands for the whole prefix up to that chunk
(the way vLLM's prefix cache hashes blocks). Each instance has an LRU of the chain hashes it
served, bounded like a real cache; a shared map from hash to holders answers "who has this
prefix" in one dict lookup per chunk: O(prompt length) per request.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.registry import Instance
from proxy.request import RouteRequest
from proxy.routing.policies.base import adapter_of, load_score
from proxy.routing.policies.least_loaded import LeastLoaded

# The proxy's own prompt-size estimate (openai_api.estimate_prompt_tokens) counts 4 ASCII
# characters per token; text chunks use that rate so matches convert back to tokens.
CHARS_PER_TOKEN = 4
# Instances that were not among the candidates for this long are forgotten (they left;
# a re-registered instance is a new Instance object with a cold cache anyway).
FORGET_AFTER_S = 60.0
SWEEP_EVERY = 1024  # choices between two sweeps for forgotten instances


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    chunk_tokens: int = 16  # index granularity
    capacity_tokens: int = 500_000  # per instance: about what its KV cache holds
    min_match: float = 0.5  # matched fraction of the prompt needed to follow the cache
    balance_abs: float = 8.0  # load_score gap tolerated above the least loaded ...
    balance_rel: float = 1.5  # ... and ratio: beyond both, go to the least loaded


class PrefixIndex:
    """Approximate prefix-cache contents of a set of instances."""

    def __init__(self, chunk_tokens: int, capacity_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self.chunk_chars = chunk_tokens * CHARS_PER_TOKEN
        self.capacity_chunks = max(1, capacity_tokens // chunk_tokens)
        # chain hash -> instances holding it. Tuples: smaller than sets, and membership
        # tests on a handful of instances compare identities (Instance has eq=False).
        self._holders: dict[int, tuple[Instance, ...]] = {}
        self._lru: dict[Instance, OrderedDict[int, None]] = {}

    def chain(self, key: str | list[int], adapter: str | None = None) -> list[int]:
        """Chain hashes of the full chunks of `key`, first chunk first, at most as many as an
        instance holds (capacity_chunks): one holds no longer a prefix, and a long prompt
        costs no more than that (a 16 MiB prompt took ~1 s). A LoRA `adapter` salts the chain
        (vLLM never shares a prefix between adapters or with the base model)."""
        size = self.chunk_chars if isinstance(key, str) else self.chunk_tokens
        out: list[int] = []
        h = 0 if adapter is None else hash(("lora", adapter))
        end = min(len(key) - size + 1, self.capacity_chunks * size)
        if isinstance(key, str):
            for i in range(0, end, size):
                h = hash((h, key[i : i + size]))
                out.append(h)
        else:
            for i in range(0, end, size):
                h = hash((h, tuple(key[i : i + size])))
                out.append(h)
        return out

    def match(self, hashes: list[int], candidates: Sequence[Instance]) -> tuple[int, list[Instance]]:
        """The longest matched prefix (in chunks) among `candidates`, and who holds it."""
        holders_of = self._holders
        alive = list(candidates)
        depth = 0
        prev: tuple[Instance, ...] = ()
        for h in hashes:
            holders = holders_of.get(h)
            if holders is None:
                break
            # Along a prompt the holders rarely change: same holders, same survivors.
            if holders != prev:
                nxt = [c for c in alive if c in holders]
                if not nxt:
                    break
                alive = nxt
                prev = holders
            depth += 1
        return depth, (alive if depth else [])

    def insert(self, inst: Instance, hashes: list[int]) -> None:
        """Record that `inst` now holds every chunk of `hashes`."""
        lru = self._lru.get(inst)
        if lru is None:
            lru = self._lru[inst] = OrderedDict()
        holders_of = self._holders
        # Last chunk first, so the prefix ends up most recent: like vLLM, evict tails first
        # (a chunk is useless once its predecessor is gone).
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            holders = holders_of.get(h)
            holders_of[h] = (inst,) if holders is None else (*holders, inst)
        excess = len(lru) - self.capacity_chunks
        for _ in range(excess):
            h, _none = lru.popitem(last=False)
            self._drop(h, inst)

    def forget(self, inst: Instance) -> None:
        lru = self._lru.pop(inst, None)
        for h in lru or ():
            self._drop(h, inst)

    def _drop(self, h: int, inst: Instance) -> None:
        holders = self._holders.get(h)
        if holders is None:
            return
        rest = tuple(i for i in holders if i is not inst)
        if rest:
            self._holders[h] = rest
        else:
            del self._holders[h]

    def instances(self) -> list[Instance]:
        return list(self._lru)

    def size(self, inst: Instance | None = None) -> int:
        """Chunks held by `inst` (all instances together when None)."""
        if inst is not None:
            lru = self._lru.get(inst)
            return len(lru) if lru else 0
        return sum(len(lru) for lru in self._lru.values())


class CacheAware:
    """Longest cached prefix wins, unless its holder is loaded well beyond the least loaded
    candidate (both an absolute and a relative gap, as in SGLang's router); prompts that
    match too little of any instance go to the least loaded one."""

    name = "cache_aware"

    def __init__(self, settings: CacheAwareSettings | None = None) -> None:
        s = settings or CacheAwareSettings()
        self.settings = s
        self.index = PrefixIndex(s.chunk_tokens, s.capacity_tokens)
        self._least = LeastLoaded()  # the fallback, ties rotating
        # (request, instance chosen for it, chunks that instance matched before the
        # insertion): cached_tokens() follows choose() for the same request.
        self._last: tuple[RouteRequest | None, Instance | None, int] = (None, None, 0)
        self._seen: dict[Instance, float] = {}
        self._choices = 0

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Instance:
        self.note_seen(candidates)
        hashes = self.index.chain(req.key, adapter_of(candidates, req.model))
        depth, holders = self.index.match(hashes, candidates)
        least, least_score = self._least.pick(candidates)
        choice = least
        if depth and depth >= self.settings.min_match * len(hashes):
            best = min(holders, key=load_score)
            if not self.imbalanced(load_score(best), least_score):
                choice = best
        if choice in holders:
            matched = depth
        else:  # the least loaded may still hold a shorter part of the prefix
            matched = self.index.match(hashes, (choice,))[0] if depth else 0
        self.index.insert(choice, hashes)
        self._last = (req, choice, matched)
        return choice

    def cached_tokens(self, inst: Instance, req: RouteRequest) -> int:
        """Tokens of req's prompt that `inst` likely holds (as known before req was sent)."""
        last_req, last_inst, chunks = self._last
        if last_req is not req or last_inst is not inst:
            chunks = self.index.match(self.index.chain(req.key, adapter_of((inst,), req.model)), (inst,))[0]
        return min(chunks * self.settings.chunk_tokens, req.tokens)

    def imbalanced(self, score: float, least: float) -> bool:
        s = self.settings
        return score - least > s.balance_abs and score > least * s.balance_rel

    def note_seen(self, candidates: Sequence[Instance]) -> None:
        now = time.monotonic()
        seen = self._seen
        for c in candidates:
            seen[c] = now
        self._choices += 1
        if self._choices % SWEEP_EVERY:
            return
        # Lazily drop instances that stopped being candidates: they left the registry.
        for inst in [i for i, t in seen.items() if now - t > FORGET_AFTER_S]:
            del seen[inst]
            self.index.forget(inst)

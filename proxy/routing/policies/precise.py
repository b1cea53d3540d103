"""`precise`: route a prompt to the instance whose KV cache really holds its longest prefix,
as that instance's own vLLM KV events report it (proxy/routing/kv_events.py, proxy/routing/kv_index.py).

For each candidate the prompt's exact token ids (proxy/routing/prompt_keys.py, computed once per
request before selection) are cut into the instance's block size and chained
(xpyd_wire.kv_events.chain_block_keys, salted by the LoRA adapter when the requested model
is one), and the index says how many leading blocks it holds. An instance whose index is
UNKNOWN (no events yet, publisher silent or gone), or a request whose token ids cannot be
reproduced, is judged by `cache_aware`'s guess instead, per instance: the guess is kept
warm with every choice this policy makes. Matches are compared as a fraction of the prompt,
so a real count and a guess can stand side by side.

The decision is cache_aware's (same settings): the best holder wins when it holds at least
`min_match` of the prompt and is not loaded well beyond the least loaded candidate (both
the absolute and the relative gap); otherwise the least loaded candidate. Two proxies
subscribed to the same instances hold the same indexes and so choose alike; their loads
differ only by what each has in flight.

Used for D too: a decode instance's events show the blocks a conversation's earlier turns
left there (loaded from P, then extended by its own decoding), so the next turn goes where
its history lives, and conditional disaggregation (`local_cached`) reads the real figure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.registry import Instance
from proxy.request import RouteRequest
from proxy.routing.kv_events import KVEvents
from proxy.routing.kv_index import IndexState
from proxy.routing.policies.base import adapter_of, load_score
from proxy.routing.policies.cache_aware import CacheAware, CacheAwareSettings
from proxy.routing.policies.least_loaded import LeastLoaded
from xpyd_wire.kv_events import chain_block_keys


class Precise:
    name = "precise"

    def __init__(self, events: KVEvents, settings: CacheAwareSettings | None = None,
                 on_choice: Callable[[str], None] | None = None) -> None:
        self.events = events
        self._on_choice = on_choice  # called with "events" or "guess" per choice
        self.fallback = CacheAware(settings)
        self.settings = self.fallback.settings
        self._least = LeastLoaded()
        # The last request chosen for and what each candidate held (tokens, or None where
        # its index was unknown): cached_tokens() and uncached_tokens() follow choose().
        self._last_req: RouteRequest | None = None
        self._last_held: dict[Instance, int | None] = {}

    # ------------------------------------------------------------------ what is held

    def held_tokens(self, inst: Instance, req: RouteRequest) -> int | None:
        """Leading prompt tokens `inst` holds per its KV events; None when unknown (no
        events, index UNKNOWN, or the prompt's token ids are not known)."""
        ids = req.prompt_ids
        if ids is None:
            return None
        index = self.events.index(inst)
        if index is None or index.state is IndexState.UNKNOWN:
            return None
        size = index.block_size
        if size is None:  # known and nothing stored since: it holds nothing
            return 0
        lora = adapter_of((inst,), req.model)
        keys = req.block_keys.get((size, lora))
        if keys is None:
            keys = req.block_keys[(size, lora)] = chain_block_keys(ids, size, lora)
        return index.longest_prefix(keys) * size

    def _fraction(self, inst: Instance, req: RouteRequest, held: int | None, hashes: list[int]) -> float:
        if held is not None:
            return held / max(1, len(req.prompt_ids or ()))
        chunks = self.fallback.index.match(hashes, (inst,))[0] if hashes else 0
        return min(1.0, chunks * self.settings.chunk_tokens / max(1, req.tokens))

    # ------------------------------------------------------------------ choosing

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Instance:
        fallback = self.fallback
        fallback.note_seen(candidates)
        hashes = fallback.index.chain(req.key, adapter_of(candidates, req.model))
        held = {c: self.held_tokens(c, req) for c in candidates}
        best: Instance | None = None
        best_frac = 0.0
        best_score = 0.0
        for c in candidates:
            frac = self._fraction(c, req, held[c], hashes)
            if frac <= 0.0:
                continue
            score = load_score(c)
            if best is None or frac > best_frac or (frac == best_frac and score < best_score):
                best, best_frac, best_score = c, frac, score
        least, least_score = self._least.pick(candidates)
        choice = least
        if best is not None and best_frac >= self.settings.min_match and not fallback.imbalanced(best_score,
                                                                                                least_score):
            choice = best
        if self._on_choice is not None:
            self._on_choice("guess" if held[choice] is None else "events")
        fallback.index.insert(choice, hashes)  # the guess stays warm for when events stop
        self._last_req, self._last_held = req, held
        return choice

    def cached_tokens(self, inst: Instance, req: RouteRequest) -> int:
        """Prompt tokens `inst` holds: the real figure where its events are known, else
        cache_aware's guess (in the proxy's estimated tokens)."""
        held = self._held_before(inst, req)
        if held is not None:
            return held
        return self.fallback.cached_tokens(inst, req)

    def uncached_tokens(self, inst: Instance, req: RouteRequest) -> int | None:
        """Prompt tokens `inst` would still have to compute; None when nothing is known
        to be held there."""
        held = self._held_before(inst, req)
        if held is not None and req.prompt_ids is not None:
            return len(req.prompt_ids) - held if held else None
        guess = self.fallback.cached_tokens(inst, req)
        return req.tokens - guess if guess else None

    def events_held(self, inst: Instance, req: RouteRequest) -> int:
        """Leading prompt tokens `inst`'s own KV events say it holds (whole blocks); 0 when
        they do not say (never the guess): what P may skip sending to this D."""
        return self._held_before(inst, req) or 0

    def _held_before(self, inst: Instance, req: RouteRequest) -> int | None:
        if req is self._last_req and inst in self._last_held:
            return self._last_held[inst]
        return self.held_tokens(inst, req)

"""Instance selection policies. P and D each get their own policy object."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from proxy.registry import Instance
from proxy.request import RouteRequest

if TYPE_CHECKING:
    from proxy.config import ProxyConfig
    from proxy.metrics import Metrics
    from proxy.routing.kv_events import KVEvents

# One in-flight request counts as much as this many in-flight prompt tokens.
TOKENS_PER_REQUEST = 1024.0
# Weight of the instance-reported KV cache usage (0..1): a full cache means preemption.
KV_USAGE_WEIGHT = 4.0


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Instance:
        """Pick one of the non-empty candidates for `req`."""
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Instance:
        i = self._next % len(candidates)
        self._next = i + 1
        return candidates[i]


def load_score(inst: Instance) -> float:
    """Lower is better. The proxy's own in-flight count is exact for its requests; the
    heartbeat's running+waiting also covers other clients' requests, so take the max."""
    queued = inst.in_flight
    kv = 0.0
    load = inst.load
    if load is not None:
        reported = load.running + load.waiting
        if reported > queued:
            queued = reported
        # A D whose KV receive buffer is full refuses transfers: as bad as a full cache.
        kv = max(load.kv_usage, load.kv_buffer_usage)
    return queued + inst.in_flight_tokens / TOKENS_PER_REQUEST + KV_USAGE_WEIGHT * kv


class LeastLoaded:
    name = "least_loaded"

    def __init__(self) -> None:
        self._start = 0

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Instance:
        return self.pick(candidates)[0]

    def pick(self, candidates: Sequence[Instance]) -> tuple[Instance, float]:
        """The least loaded candidate and its load_score."""
        n = len(candidates)
        # Scan from a rotating start so that ties spread round-robin.
        start = self._start % n
        self._start = start + 1
        best = candidates[start]
        best_score = load_score(best)
        for k in range(1, n):
            inst = candidates[(start + k) % n]
            score = load_score(inst)
            if score < best_score:
                best, best_score = inst, score
        return best, best_score


class PowerOfTwo:
    """Two random candidates, the less loaded wins: near least_loaded's balance without
    every request herding onto the same momentarily idle instance."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Instance:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        rand = self._rng.randrange
        i = rand(n)
        j = rand(n - 1)
        j += j >= i  # a second, different candidate
        a, b = candidates[i], candidates[j]
        return b if load_score(b) < load_score(a) else a


def make_policy(name: str, cfg: ProxyConfig | None = None, events: KVEvents | None = None,
                metrics: Metrics | None = None, role: str = "P") -> Policy:
    """`precise` needs the proxy's KV-event intake (`events`)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "power_of_two":
        return PowerOfTwo()
    if name not in ("cache_aware", "precise"):
        raise ValueError(f"unknown policy {name!r}")
    from proxy.routing.policies.cache_aware import CacheAware, CacheAwareSettings  # imports this module

    settings = None
    if cfg is not None:
        settings = CacheAwareSettings(
            chunk_tokens=cfg.cache_aware_chunk_tokens,
            capacity_tokens=cfg.cache_aware_capacity_tokens,
            min_match=cfg.cache_aware_min_match,
            balance_abs=cfg.cache_aware_balance_abs,
            balance_rel=cfg.cache_aware_balance_rel,
        )
    if name == "cache_aware":
        return CacheAware(settings)
    if events is None:
        raise ValueError("the precise policy needs the proxy's KV-event intake")
    from proxy.routing.policies.precise import Precise

    on_choice = None
    if metrics is not None:
        children = {s: metrics.precise_choices.labels(role, s) for s in ("events", "guess")}
        on_choice = lambda source: children[source].inc()  # noqa: E731
    return Precise(events, settings, on_choice)

"""The policy a role gets, by its name (--prefill-policy / --decode-policy).

The one module that knows every policy: the policies import only base.py (and cache_aware,
which precise builds on), never this, so no import circle."""

from __future__ import annotations

from proxy.config import ProxyConfig
from proxy.metrics import Metrics
from proxy.routing.kv_events import KVEvents
from proxy.routing.policies.base import Policy
from proxy.routing.policies.cache_aware import CacheAware, CacheAwareSettings
from proxy.routing.policies.least_loaded import LeastLoaded
from proxy.routing.policies.power_of_two import PowerOfTwo
from proxy.routing.policies.precise import Precise
from proxy.routing.policies.round_robin import RoundRobin


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
    on_choice = None
    if metrics is not None:
        children = {s: metrics.precise_choices.labels(role, s) for s in ("events", "guess")}
        on_choice = lambda source: children[source].inc()  # noqa: E731
    return Precise(events, settings, on_choice)

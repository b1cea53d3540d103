"""Choosing an instance of a role for one request: live candidates, then the role's policy.

The router never touches the registry's in-flight counters itself: acquire() and release()
own them, so the load the policies see is exactly what the proxy has outstanding."""

from __future__ import annotations

import time
from collections.abc import Collection

from proxy.config import ProxyConfig
from proxy.policies import Policy, make_policy
from proxy.registry import Instance, Registry
from proxy.request import RouteRequest


class Selector:
    def __init__(self, cfg: ProxyConfig, registry: Registry) -> None:
        self.registry = registry
        self.policies: dict[str, Policy] = {
            "P": make_policy(cfg.prefill_policy, cfg),
            "D": make_policy(cfg.decode_policy, cfg),
        }

    def available(self, role: str) -> bool:
        return self.registry.count(role) > 0

    def candidates(self, role: str, exclude: Collection[Instance] = ()) -> list[Instance]:
        live = self.registry.live(role)
        if not live:
            return live
        now = time.monotonic()
        ok = [i for i in live if i.cooldown_until <= now and i not in exclude]
        if ok:
            return ok
        # Everything is cooling down or already tried: better a doubtful instance than none.
        return [i for i in live if i not in exclude]

    def acquire(
        self, role: str, req: RouteRequest, exclude: Collection[Instance] = ()
    ) -> Instance | None:
        """Pick an instance for `req` and count it as in flight there; None if none is left."""
        candidates = self.candidates(role, exclude)
        if not candidates:
            return None
        inst = self.policies[role].choose(candidates, req)
        inst.in_flight += 1
        inst.in_flight_tokens += req.tokens
        return inst

    def cached_tokens(self, role: str, inst: Instance, req: RouteRequest) -> int:
        """How much of the prompt `inst` likely holds in its prefix cache, as far as the
        role's policy tracks it (0 when it does not)."""
        estimate = getattr(self.policies[role], "cached_tokens", None)
        return estimate(inst, req) if estimate is not None else 0

    def release(self, inst: Instance, req: RouteRequest) -> None:
        inst.in_flight -= 1
        inst.in_flight_tokens -= req.tokens

"""Which D holds each stored response (vLLM's Responses API with its store on).

vLLM keeps a stored response in the memory of the server that made it, the D that answered:
``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and a follow-up naming it in
``previous_response_id`` must reach that D. The proxy names every response itself (it sends D
the body's ``request_id``: openai_api.response_id), so it records the D as the answer goes out.

The record is a cache, not the truth: bounded (oldest forgotten first) and expiring, and it
dies with the proxy. An id it does not hold (another proxy replica served it, this one
restarted, or it was forgotten) is asked of every live D, and the one that has it is
recorded. So replicas behind a balancer need no shared state; a lookup costs one GET per D.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from proxy.registry import Instance, Registry


class ResponseHolders:
    def __init__(self, registry: Registry, capacity: int, ttl_s: float) -> None:
        self.registry = registry
        self.capacity = capacity
        self.ttl_s = ttl_s
        # id -> (D, expiry, P's prompt-cache figures for its usage: see dispatch/rewrite.py)
        self._held: OrderedDict[str, tuple[Instance, float, tuple[int, int] | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def record(self, response_id: str, d: Instance, usage: tuple[int, int] | None = None,
               now: float | None = None) -> None:  # fmt: skip
        """`d` answered (and so stores) the response `response_id`; `usage`: the prompt-cache
        figures the client was told instead of D's (a disaggregated answer)."""
        expires = (time.monotonic() if now is None else now) + self.ttl_s
        self._held[response_id] = (d, expires, usage)
        self._held.move_to_end(response_id)
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)

    def holder(self, response_id: str, now: float | None = None) -> Instance | None:
        """The D recorded for `response_id`, while recorded, unexpired and still registered."""
        entry = self._held.get(response_id)
        if entry is None:
            return None
        d, expires, _ = entry
        if expires <= (time.monotonic() if now is None else now) or not self.registry.holds(d):
            del self._held[response_id]
            return None
        return d

    def usage(self, response_id: str) -> tuple[int, int] | None:
        entry = self._held.get(response_id)
        return entry[2] if entry is not None else None

    def forget(self, response_id: str) -> None:
        self._held.pop(response_id, None)

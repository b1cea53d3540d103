"""What every instance selection policy is (Policy) and the load score they share.

P and D each get their own policy object (factory.py); one module per policy."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from proxy.registry import Instance
from proxy.request import RouteRequest

# One in-flight request counts as much as this many in-flight prompt tokens.
TOKENS_PER_REQUEST = 1024.0
# Weight of the instance-reported KV cache usage (0..1): a full cache means preemption.
KV_USAGE_WEIGHT = 4.0


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Instance:
        """Pick one of the non-empty candidates for `req`."""
        ...


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


def adapter_of(instances: Iterable[Instance], model: str | None) -> str | None:
    """The LoRA adapter a request for `model` runs on these instances (vLLM keys its prefix
    cache and its KV events by it): `model` when the first instance that lists it lists it as
    an adapter (a card with a parent, as vLLM's /v1/models), else None (the base model)."""
    if model is None:
        return None
    for inst in instances:
        card = inst.models.get(model) if inst.models else None
        if card is not None:
            return model if card.get("parent") else None
    return None

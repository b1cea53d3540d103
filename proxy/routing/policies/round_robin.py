"""`round_robin`: each candidate in turn."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.registry import Instance
from proxy.request import RouteRequest


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Instance:
        i = self._next % len(candidates)
        self._next = i + 1
        return candidates[i]

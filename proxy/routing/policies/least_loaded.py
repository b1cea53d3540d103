"""`least_loaded`: the candidate with the lowest load_score, ties spread round-robin."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.registry import Instance
from proxy.request import RouteRequest
from proxy.routing.policies.base import load_score


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

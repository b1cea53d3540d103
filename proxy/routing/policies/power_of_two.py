"""`power_of_two`: two random candidates, the less loaded wins."""

from __future__ import annotations

import random
from collections.abc import Sequence

from proxy.registry import Instance
from proxy.request import RouteRequest
from proxy.routing.policies.base import load_score


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

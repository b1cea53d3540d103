"""What the workers tell the scheduler each step through vLLM's connector stats
interface (``get_kv_connector_stats`` -> ``KVConnectorOutput`` ->
``update_connector_output``): receive-buffer occupancy, for the heartbeat.

Occupancy is a gauge: aggregating keeps the latest figure per worker rank (vLLM
aggregates across workers and, in its logger, across steps), never a sum over time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class XpydStats(KVConnectorStats):
    @classmethod
    def of(cls, rank: int, used_bytes: int, capacity_bytes: int) -> "XpydStats":
        return cls(data={"buffers": {rank: (used_bytes, capacity_bytes)}})

    def _buffers(self) -> dict[Any, tuple[int, int]]:
        return self.data.setdefault("buffers", {})

    def reset(self) -> None:
        self.data = {"buffers": {}}

    def aggregate(self, other: KVConnectorStats) -> "XpydStats":
        if isinstance(other, XpydStats):
            self._buffers().update(other._buffers())
        return self

    def buffer_usage(self) -> float:
        """Fraction (0..1) of the receive buffers promised or filled, over all workers."""
        used = sum(u for u, _ in self._buffers().values())
        cap = sum(c for _, c in self._buffers().values())
        return min(1.0, used / cap) if cap > 0 else 0.0

    def reduce(self) -> dict[str, int | float]:
        return {"kv_buffer_used_bytes": sum(u for u, _ in self._buffers().values()),
                "kv_buffer_usage": round(self.buffer_usage(), 4)}

    def is_empty(self) -> bool:
        return not self._buffers()

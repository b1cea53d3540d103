"""A byte-accounted, TTL-bounded store of KV payloads keyed by transfer key.

D keeps what P pushed until the matching request asks for it; P (GET mode)
keeps copies until D pulls them. Both sides are touched by the transport's
server thread and the vLLM worker thread, hence the lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from connector.log import get_logger

logger = get_logger(__name__)


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(slots=True)
class Payload:
    header: dict[str, Any]
    tensors: list[torch.Tensor]
    nbytes: int
    created: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, header: dict[str, Any], tensors: list[torch.Tensor]) -> "Payload":
        return cls(header, tensors, tensor_bytes(tensors))


class KVBuffer:
    def __init__(self, name: str, capacity_bytes: int, ttl_s: float) -> None:
        self._name = name
        self._capacity = capacity_bytes
        self._ttl = ttl_s
        self._lock = threading.Lock()
        self._items: dict[str, Payload] = {}
        self._used = 0
        # Keys whose request is gone: a late payload for them is dropped, not kept
        # until the TTL. Maps key -> expiry (monotonic).
        self._tombstones: dict[str, float] = {}

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def put(self, key: str, payload: Payload) -> str | None:
        """Store a payload; returns None on success or the reason it was refused."""
        with self._lock:
            if key in self._tombstones:
                return "request already gone"
            if key in self._items:
                return "duplicate transfer"
            if self._used + payload.nbytes > self._capacity:
                return (
                    f"{self._name} buffer full ({self._used}+{payload.nbytes}"
                    f" > {self._capacity} bytes)"
                )
            self._items[key] = payload
            self._used += payload.nbytes
            return None

    def peek(self, key: str) -> Payload | None:
        with self._lock:
            return self._items.get(key)

    def pop(self, key: str) -> Payload | None:
        with self._lock:
            p = self._items.pop(key, None)
            if p is not None:
                self._used -= p.nbytes
            return p

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def discard(self, key: str) -> None:
        """Drop a payload and refuse later ones for the same key."""
        with self._lock:
            p = self._items.pop(key, None)
            if p is not None:
                self._used -= p.nbytes
            self._tombstones[key] = time.monotonic() + self._ttl

    def expire(self, now: float | None = None) -> list[str]:
        """Drop payloads older than the TTL; returns their keys."""
        now = time.monotonic() if now is None else now
        dropped: list[str] = []
        with self._lock:
            for key, p in list(self._items.items()):
                if now - p.created > self._ttl:
                    del self._items[key]
                    self._used -= p.nbytes
                    dropped.append(key)
            for key, until in list(self._tombstones.items()):
                if until < now:
                    del self._tombstones[key]
        for key in dropped:
            logger.warning("kv buffer=%s dropped expired transfer=%s", self._name, key)
        return dropped

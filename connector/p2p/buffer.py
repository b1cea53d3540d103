"""A byte-accounted, TTL-bounded store of KV payloads keyed by transfer key.

D keeps what P pushed until the matching requests took it; P (GET mode) keeps
copies until D pulls them. Memory is bounded *before* it is spent: a sender
first reserves the payload's size (``reserve``), and only then ships the bytes
(``put`` fills the reservation). Both sides are touched by the transport's
server thread and the vLLM worker thread, hence the lock.

Besides payloads it remembers, for a TTL, two kinds of keys:
- tombstones: the transfer's requests are gone; a late payload is dropped.
- failures: the transfer will not come (refused, expired, given up by the
  sender); a load waiting for it fails at once instead of at its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from connector.log import get_logger

logger = get_logger(__name__)


# Why a payload is refused once every request that could load it is gone here (finished,
# aborted, or served from this instance's own prefix cache): nobody needed it, so the
# sender counts it as unneeded, not failed.
GONE = "request already gone"


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(slots=True)
class Payload:
    header: dict[str, Any]
    tensors: list[torch.Tensor]
    nbytes: int
    created: float = field(default_factory=time.monotonic)
    # Gives back what holds the tensors (a pinned lease, a device budget share); called by
    # the buffer when it drops the payload (consumed, discarded, expired, evicted). ``pop``
    # hands the payload, and this duty, to the caller.
    release: Callable[[], None] | None = None
    # Readers inside ``in_use``; a drop meanwhile (the TTL sweep) waits for the last one, so a
    # lease is never handed to the next payload while its bytes are still being copied out.
    _users: int = 0
    _dropped: bool = False
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def drop(self) -> None:
        """Give back what holds the tensors: once, however often called, and only after the
        last reader left."""
        with self._guard:
            self._dropped = True
            if self._users:
                return
            release, self.release = self.release, None
        if release is not None:
            release()

    @contextmanager
    def in_use(self) -> Iterator["Payload"]:
        """Read the tensors without a concurrent ``drop`` freeing their memory under you."""
        with self._guard:
            self._users += 1
        try:
            yield self
        finally:
            with self._guard:
                self._users -= 1
                release = None
                if self._dropped and not self._users:
                    release, self.release = self.release, None
            if release is not None:
                release()

    @classmethod
    def of(cls, header: dict[str, Any], tensors: list[torch.Tensor]) -> "Payload":
        return cls(header, tensors, tensor_bytes(tensors))


NEVER_CAME = "reserved, but the payload never came"


@dataclass(slots=True)
class _Reservation:
    nbytes: int
    expires: float
    # A bound, not the size (GET: D reserves for the whole prompt before it learns how many
    # blocks P skipped); a sender's own reservation (PUT) is exact.
    at_most: bool = False
    # What a load waiting for this payload is told when the reservation lapses: a reader that
    # pulls (GET) knows better than "never came" who went silent.
    expired_reason: str = NEVER_CAME


class KVBuffer:
    """``evict_lru``: a payload that does not fit pushes out the least recently used ones
    (``peek`` counts as use) instead of being refused (P's GET store: newer transfers
    matter more); each evicted key is recorded as failed, so its reader is told at once."""

    def __init__(self, name: str, capacity_bytes: int, ttl_s: float, reservation_ttl_s: float | None = None,
                 evict_lru: bool = False, changed: threading.Event | None = None) -> None:
        self._name = name
        # Set whenever a payload is stored or a key fails: a waiting reader wakes (engine.poll).
        self._changed = changed
        self._evict_lru = evict_lru
        self.evicted = 0  # payloads pushed out by newer ones, since start
        self._capacity = capacity_bytes
        self._ttl = ttl_s
        self._reservation_ttl = reservation_ttl_s if reservation_ttl_s is not None else ttl_s
        self._lock = threading.Lock()
        self._items: dict[str, Payload] = {}
        self._reserved: dict[str, _Reservation] = {}
        self._used = 0  # bytes of stored payloads
        self._reserved_bytes = 0  # bytes promised to payloads on their way
        self._tombstones: dict[str, float] = {}  # key -> expiry
        self._failures: dict[str, tuple[str, float]] = {}  # key -> (reason, expiry)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return self._reserved_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _fail_locked(self, key: str, reason: str) -> None:
        self._failures[key] = (reason, time.monotonic() + self._ttl)
        self._signal()

    def _signal(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _unreserve_locked(self, key: str) -> _Reservation | None:
        res = self._reserved.pop(key, None)
        if res is not None:
            self._reserved_bytes -= res.nbytes
        return res

    def _refuse_locked(self, key: str, nbytes: int) -> str | None:
        """Why a new payload of nbytes for key cannot be taken, or None. A refusal
        for room is recorded as a failure: a load must not wait for that payload."""
        if key in self._tombstones:
            return GONE
        if key in self._items or key in self._reserved:
            return "duplicate transfer"
        if key in self._failures:
            return f"transfer already failed: {self._failures[key][0]}"
        if self._evict_lru and nbytes <= self._capacity - self._reserved_bytes:
            self._evict_locked(nbytes)
        if self._used + self._reserved_bytes + nbytes > self._capacity:
            reason = (f"{self._name} buffer full ({self._used}+{self._reserved_bytes} reserved"
                      f"+{nbytes} > {self._capacity} bytes)")
            self._fail_locked(key, reason)
            return reason
        return None

    def _evict_locked(self, nbytes: int) -> None:
        """Drop least recently used payloads until nbytes more fit (dicts keep insertion
        order; a use moves the key to the end)."""
        while self._items and self._used + self._reserved_bytes + nbytes > self._capacity:
            key = next(iter(self._items))
            p = self._items.pop(key)
            self._used -= p.nbytes
            p.drop()
            self.evicted += 1
            self._fail_locked(key, f"evicted from the {self._name} buffer (least recently used) to make room "
                                   f"for newer transfers: raise kv_buffer_size")
            logger.warning("kv buffer=%s evicted transfer=%s bytes=%d (LRU)", self._name, key, p.nbytes)

    def reserve(self, key: str, nbytes: int, at_most: bool = False, expired_reason: str = NEVER_CAME) -> str | None:
        """Promise room for a payload of nbytes (of at most nbytes); None, or why not.
        ``expired_reason``: the failure recorded if the promise lapses."""
        with self._lock:
            refused = self._refuse_locked(key, nbytes)
            if refused is None:
                self._reserved[key] = _Reservation(nbytes, time.monotonic() + self._reservation_ttl, at_most,
                                                   expired_reason)
                self._reserved_bytes += nbytes
            return refused

    def reservation(self, key: str) -> int | None:
        """The bytes reserved for key, or None."""
        with self._lock:
            res = self._reserved.get(key)
            return res.nbytes if res is not None else None

    def extend(self, key: str) -> int | None:
        """A reservation's bytes, its expiry moved to a full TTL from now (a layer-wise sender
        fills it part by part); None without one."""
        with self._lock:
            res = self._reserved.get(key)
            if res is None:
                return None
            res.expires = time.monotonic() + self._reservation_ttl
            return res.nbytes

    def put(self, key: str, payload: Payload) -> str | None:
        """Store a payload into its reservation (or, unreserved, if it fits);
        returns None on success or the reason it was refused."""
        with self._lock:
            res = self._unreserve_locked(key)
            if res is None:
                refused = self._refuse_locked(key, payload.nbytes)
                if refused is not None:
                    return refused
            elif payload.nbytes > res.nbytes or (payload.nbytes != res.nbytes and not res.at_most):
                reason = f"payload of {payload.nbytes} bytes does not match its reservation of {res.nbytes}"
                self._fail_locked(key, reason)
                return reason
            self._items[key] = payload
            self._used += payload.nbytes
            self._signal()
            return None

    def peek(self, key: str) -> Payload | None:
        with self._lock:
            p = self._items.get(key)
            if p is not None and self._evict_lru:
                self._items[key] = self._items.pop(key)  # most recently used: evicted last
            return p

    def pop(self, key: str) -> Payload | None:
        with self._lock:
            p = self._items.pop(key, None)
            if p is not None:
                self._used -= p.nbytes
            return p

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def fail(self, key: str, reason: str) -> bool:
        """The sender says this transfer will not come. Ignored (False) when the
        payload is already here: what arrived is still good."""
        with self._lock:
            if key in self._items:
                return False
            self._unreserve_locked(key)
            self._fail_locked(key, reason)
            return True

    def failure(self, key: str) -> str | None:
        """Why this transfer will not come, or None."""
        with self._lock:
            f = self._failures.get(key)
            return f[0] if f else None

    def gone(self, key: str) -> bool:
        """Whether every request that could load key is gone (a late payload is refused)."""
        with self._lock:
            return key in self._tombstones

    def discard(self, key: str) -> None:
        """Drop a payload (or its reservation) and refuse later ones for the same key."""
        with self._lock:
            p = self._items.pop(key, None)
            if p is not None:
                self._used -= p.nbytes
                p.drop()
            self._unreserve_locked(key)
            self._tombstones[key] = time.monotonic() + self._ttl

    def expire(self, now: float | None = None) -> list[str]:
        """Drop payloads older than the TTL and reservations whose bytes never
        came; both are recorded as failed. Returns the dropped keys."""
        now = time.monotonic() if now is None else now
        dropped: list[tuple[str, str]] = []
        with self._lock:
            for key, p in list(self._items.items()):
                if now - p.created > self._ttl:
                    del self._items[key]
                    self._used -= p.nbytes
                    p.drop()
                    dropped.append((key, f"dropped after the {self._ttl:g}s TTL"))
            for key, res in [(k, r) for k, r in self._reserved.items() if r.expires < now]:
                self._unreserve_locked(key)
                dropped.append((key, res.expired_reason))
            for key, reason in dropped:
                self._failures[key] = (reason, now + self._ttl)
            if dropped:
                self._signal()
            for key in [k for k, until in self._tombstones.items() if until < now]:
                del self._tombstones[key]
            for key in [k for k, (_, until) in self._failures.items() if until < now]:
                del self._failures[key]
        for key, reason in dropped:
            logger.warning("kv buffer=%s dropped expired transfer=%s (%s)", self._name, key, reason)
        return [k for k, _ in dropped]

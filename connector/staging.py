"""Pinned host staging for KV received on a GPU decode instance.

KV arrives in device memory (nccl). While the device share of the receive buffer
(``kv_buffer_size``) has room it stays there; beyond it a payload is copied into one pinned
host pool (``mem_pool_size_gb``) and its device memory freed, so a burst of prompts does not
take the GPU memory vLLM planned for itself; it is copied back into the cache when its
request is scheduled. Refused only when neither has room.

The pool is one pinned buffer allocated on first use, carved by a best-fit allocator with
coalescing. An allocation that does not fit returns None (a refusal, never an exception in
the transport's thread); a lease is returned when its payload is consumed, discarded,
expired or refused (``Payload.release``), and a second return is harmless.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from connector.buffer import KVBuffer, Payload
from connector.log import get_logger

logger = get_logger(__name__)

ALIGN = 256  # bytes: every lease starts aligned, whatever dtype it is viewed as


@dataclass(slots=True)
class Lease:
    pool: "PinnedPool"
    offset: int
    nbytes: int
    _freed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def view(self, dtype: torch.dtype, shape: list[int] | tuple[int, ...], at: int = 0) -> torch.Tensor:
        """A tensor over bytes [offset+at, ...) of the pool."""
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if at + n > self.nbytes:
            raise ValueError(f"view of {n} bytes at {at} exceeds the lease of {self.nbytes}")
        return self.pool.buffer.narrow(0, self.offset + at, n).view(dtype).view(shape)

    def free(self) -> None:
        with self._lock:
            if self._freed:
                return
            self._freed = True
        self.pool._give_back(self.offset, self.nbytes)


class PinnedPool:
    """A fixed host buffer carved into leases (best fit, neighbours coalesced)."""

    def __init__(self, nbytes: int, pin: bool | None = None) -> None:
        if nbytes <= 0:
            raise ValueError("pool size must be positive")
        pin = torch.cuda.is_available() if pin is None else pin
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.capacity = nbytes
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset
        self._used = 0
        self.leases = 0

    def alloc(self, nbytes: int) -> Lease | None:
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            best = None
            for i, (off, n) in enumerate(self._free):
                if n >= size and (best is None or n < self._free[best][1]):
                    best = i
            if best is None:
                return None
            off, n = self._free[best]
            if n == size:
                del self._free[best]
            else:
                self._free[best] = (off + size, n - size)
            self._used += size
            self.leases += 1
        return Lease(self, off, size)

    def _give_back(self, offset: int, size: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._free, (offset, 0))
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] > offset or \
                    i < len(self._free) and offset + size > self._free[i][0]:
                raise AssertionError(f"lease [{offset}, {offset + size}) overlaps free memory")
            self._free.insert(i, (offset, size))
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:  # merge right
                self._free[i] = (offset, size + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # merge left
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]
            self._used -= size
            self.leases -= 1

    def stats(self) -> dict[str, int]:
        """Bytes used and free, the largest free run (the biggest lease that would succeed
        now), and fragmentation: the share of free bytes, in percent, outside that run."""
        with self._lock:
            largest = max((n for _, n in self._free), default=0)
            free = self.capacity - self._used
            return {"capacity": self.capacity, "used": self._used, "free": free,
                    "largest_free": largest, "free_runs": len(self._free), "leases": self.leases,
                    "fragmentation_pct": (free - largest) * 100 // free if free else 0}


class RecvStager:
    """Decides where a received payload lives: the device while ``device_budget`` lasts,
    else the pinned pool. Every payload it admits gets a ``release`` that gives its share
    back (device bytes or lease) exactly once."""

    def __init__(self, device_budget: int, pool_bytes: int, pool_factory: Callable[[int], PinnedPool] = PinnedPool,
                 on_device: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda) -> None:
        self._on_device = on_device  # tests let host tensors stand in for device ones
        self._budget = device_budget
        self._pool_bytes = pool_bytes
        self._factory = pool_factory
        self._pool: PinnedPool | None = None
        self._pool_failed = False
        self._lock = threading.Lock()
        self.device_used = 0
        self.staged = 0  # payloads moved to the pool, since start

    @property
    def capacity(self) -> int:
        """Bytes a receive buffer may promise: the device share plus the pool."""
        return self._budget + self._pool_bytes

    @property
    def pool(self) -> PinnedPool | None:
        return self._pool

    def stats(self) -> dict[str, int]:
        """Device share in use, payloads staged since start, and the pool's figures
        (``pool_*``; zeros until the first overflow allocated it)."""
        pool = self._pool
        figures = pool.stats() if pool is not None else {"capacity": 0, "used": 0, "free": 0, "largest_free": 0,
                                                          "free_runs": 0, "leases": 0, "fragmentation_pct": 0}
        with self._lock:
            out = {"staging_device_bytes": self.device_used, "staging_staged": self.staged}
        return out | {f"pool_{k}": v for k, v in figures.items()}

    def _get_pool(self) -> PinnedPool | None:
        if self._pool is None and not self._pool_failed and self._pool_bytes > 0:
            try:
                self._pool = self._factory(self._pool_bytes)
            except Exception as e:  # noqa: BLE001 - no pool is a refusal later, not a dead thread
                self._pool_failed = True
                logger.error("pinned staging pool of %d bytes not allocated: %s", self._pool_bytes, e)
        return self._pool

    def admit(self, payload: Payload) -> str | None:
        """Place ``payload`` (in place); None, or why there is no room for it."""
        n = payload.nbytes
        with self._lock:
            if self.device_used + n <= self._budget or not any(self._on_device(t) for t in payload.tensors):
                self.device_used += n
                payload.release = self._device_release(n)
                return None
            pool = self._get_pool()
        # Each tensor starts 16-byte aligned inside the lease (room for that padding too).
        lease = pool.alloc(n + 16 * len(payload.tensors)) if pool is not None else None
        if lease is None:
            return (f"receive buffer full: device share {self.device_used}+{n} > {self._budget} bytes and "
                    f"no room in the pinned pool ({pool.stats() if pool else 'none'})")
        at = 0
        staged = []
        for t in payload.tensors:
            dst = lease.view(t.dtype, t.shape, at)
            dst.copy_(t)  # synchronous: the device copy may go as soon as we return
            staged.append(dst)
            at += -(-(t.numel() * t.element_size()) // 16) * 16
        payload.tensors = staged
        payload.release = lease.free
        with self._lock:
            self.staged += 1
        return None

    def _device_release(self, n: int) -> Callable[[], None]:
        done = threading.Event()

        def release() -> None:
            if done.is_set():
                return
            done.set()
            with self._lock:
                self.device_used -= n

        return release


def store_received(recv: KVBuffer, stager: RecvStager | None, key: str, payload: Payload) -> str | None:
    """Place a received payload (device or pinned pool) and store it under ``key``; None,
    or why not. A refusal is recorded on the key (its loads fail at once) and gives back
    whatever the payload held."""
    refused = stager.admit(payload) if stager is not None else None
    if refused:
        recv.fail(key, refused)
        return refused
    refused = recv.put(key, payload)
    if refused:
        payload.drop()
    return refused

"""Pinned host staging for KV received on a GPU decode instance.

KV arrives in device memory (nccl). While the device share of the receive buffer
(``kv_buffer_size``) has room it stays there; beyond it a payload is copied into one pinned
host pool (``mem_pool_size_gb``) and its device memory freed, so a burst of prompts does not
take the GPU memory vLLM planned for itself; it is copied back into the cache when its
request is scheduled. Refused only when neither has room.

The pool is one host buffer of exactly ``mem_pool_size_gb``, page-locked with
``cudaHostRegister`` (``torch.empty(pin_memory=True)`` goes through torch's caching host
allocator, which rounds every block up to a power of two: 20 GB would pin 32 GiB), allocated
and pinned on a thread of its own as the engine starts: pinning gigabytes takes seconds,
which inside a receive would outlast the sender's deadline. Until it is ready, overflow is
refused (and said so). It is carved by a best-fit allocator with coalescing. An allocation that does not fit returns None (a refusal, never an exception in
the transport's thread); a lease is returned when its payload is consumed, discarded,
expired or refused (``Payload.release``), and a second return is harmless.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from connector.p2p.buffer import KVBuffer, Payload
from connector.log import get_logger

logger = get_logger(__name__)

ALIGN = 256  # bytes: every lease starts aligned, whatever dtype it is viewed as
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def _pin(buf: torch.Tensor) -> None:
    """Page-lock ``buf``'s memory as it is, byte for byte (as torch's own checkpoint stager
    does, ``torch.cuda._pin_memory_utils``)."""
    nbytes = buf.numel() * buf.element_size()
    code = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: cudaError {code}")


def _unpin(buf: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))
    if code != 0:
        logger.warning("cudaHostUnregister of the staging pool failed: cudaError %d", code)


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
        # Exactly nbytes: plain host memory, then page-locked in place (not pin_memory=True,
        # whose caching allocator rounds up to the next power of two).
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = False
        if pin:
            _pin(self.buffer)
            self.pinned = True
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

    def close(self) -> None:
        """Unpin (once). Views handed out stay valid host memory, just no longer pinned."""
        if self.pinned:
            self.pinned = False
            _unpin(self.buffer)

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
        self._pool_error: str | None = None
        self._pool_done = threading.Event()  # allocated, failed, or none configured
        self._closed = False
        self._lock = threading.Lock()
        self.device_used = 0
        self.staged = 0  # payloads moved to the pool, since start
        if pool_bytes > 0:
            threading.Thread(target=self._allocate, name="xpyd-kv-pool", daemon=True).start()
        else:
            self._pool_done.set()

    def _allocate(self) -> None:
        """Allocate and pin the pool off the receive path, as the engine starts."""
        t0 = time.monotonic()
        try:
            pool = self._factory(self._pool_bytes)
        except Exception as e:  # noqa: BLE001 - no pool is a refusal later, not a dead engine
            self._pool_error = f"{type(e).__name__}: {e}"
            logger.error("pinned staging pool of %d bytes not allocated: %s", self._pool_bytes, e)
            self._pool_done.set()
            return
        with self._lock:
            closed = self._closed
            if not closed:
                self._pool = pool
        if closed:
            pool.close()
        else:
            logger.info("pinned staging pool of %d bytes ready in %.1fs", self._pool_bytes, time.monotonic() - t0)
        self._pool_done.set()

    def wait_pool(self, timeout_s: float) -> bool:
        """Whether the pool's allocation ended (ready or failed) within ``timeout_s``."""
        return self._pool_done.wait(timeout_s)

    def close(self) -> None:
        """Unpin the pool (once its allocation ended, if it is still running)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    @property
    def capacity(self) -> int:
        """Bytes a receive buffer may promise: the device share plus the pool."""
        return self._budget + self._pool_bytes

    @property
    def pool(self) -> PinnedPool | None:
        return self._pool

    def stats(self) -> dict[str, int]:
        """Device share in use, payloads staged since start, and the pool's figures
        (``pool_*``; zeros until it is allocated)."""
        pool = self._pool
        figures = pool.stats() if pool is not None else {"capacity": 0, "used": 0, "free": 0, "largest_free": 0,
                                                          "free_runs": 0, "leases": 0, "fragmentation_pct": 0}
        with self._lock:
            out = {"staging_device_bytes": self.device_used, "staging_staged": self.staged}
        return out | {f"pool_{k}": v for k, v in figures.items()}

    def admit(self, payload: Payload) -> str | None:
        """Place ``payload`` (in place); None, or why there is no room for it."""
        n = payload.nbytes
        with self._lock:
            if self.device_used + n <= self._budget or not any(self._on_device(t) for t in payload.tensors):
                self.device_used += n
                payload.release = self._device_release(n)
                return None
            pool = self._pool  # never allocated here: pinning takes seconds
        # Each tensor starts 16-byte aligned inside the lease (room for that padding too).
        lease = pool.alloc(n + 16 * len(payload.tensors)) if pool is not None else None
        if lease is None:
            if pool is not None:
                where = str(pool.stats())
            elif self._pool_bytes and not self._pool_done.is_set():
                where = f"the pool of {self._pool_bytes} bytes is still being allocated"
            else:
                where = f"none: {self._pool_error}" if self._pool_error else "none"
            return (f"receive buffer full: device share {self.device_used}+{n} > {self._budget} bytes and "
                    f"no room in the pinned pool ({where})")
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

"""The worker's storage engine: a writer thread and a loader thread around a BlockStore.

Stores: the worker copies the blocks out of the KV cache when the step that
computed them ends (``store``: the gather, a memory copy, so the blocks can be
reused at once) and queues the copy; the writer thread writes the files. The
queue is bounded in bytes: when full, the step waits (back-pressure, logged) up
to ``queue_wait_s``, then the store is dropped (logged) - a missing block costs
a recomputation, never a wrong answer.

Loads: the loader thread reads and verifies files into host memory, waiting up
to the spec's ``wait_s`` for a file a producer has not finished; ``poll`` (the
worker thread, once per step) copies finished reads into the cache and reports
the blocks that could not be loaded, from the first miss on.

No vLLM import here: the unit tests drive it with plain tensors.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from connector import layout as kvlayout
from connector.affinity import CpuPlan, pin_current_thread
from connector.log import get_logger
from connector.shared_storage.metadata import FetchSpec, StoreSpec
from connector.shared_storage.store import BlockStore, Evictor, FileMeta, Miss
from connector.stats import StatsRecorder

logger = get_logger(__name__)

FILE_POLL_S = 0.005  # how often a load waiting for a producer's file looks again


@dataclass(slots=True)
class _StoreJob:
    spec: StoreSpec
    buf: torch.Tensor  # [n_blocks, n_layers, *block_shape], CPU
    nbytes: int
    queued_at: float


@dataclass(slots=True)
class _Read:
    spec: FetchSpec
    started: float
    buf: torch.Tensor | None = None
    ok_blocks: int = 0
    reason: str | None = None
    waited_s: float = 0.0
    done: bool = False


@dataclass(slots=True)
class PollResult:
    finished: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


@dataclass(slots=True)
class EngineStats:
    stored_blocks: int = 0
    existing_blocks: int = 0
    written_bytes: int = 0
    dropped_stores: int = 0
    loaded_blocks: int = 0
    missed_blocks: int = 0


class StorageEngine:
    def __init__(self, store: BlockStore, caches: dict[str, torch.Tensor], block_layout: kvlayout.BlockLayout,
                 max_bytes: int, queue_bytes: int, queue_wait_s: float, cpus: CpuPlan | None = None) -> None:
        self.store = store
        self._caches = caches
        self._layers = list(caches)
        self._layout = block_layout
        self._dtype = next(iter(caches.values())).dtype
        self._pin = next(iter(caches.values())).device.type == "cuda"
        elem = torch.empty((), dtype=self._dtype).element_size()
        self.block_bytes = math.prod(block_layout.block_shape) * elem * len(self._layers)
        self._evictor = Evictor(store.root, max_bytes)
        self.queue_bytes = queue_bytes
        self._queue_wait_s = queue_wait_s
        self._cpus = cpus
        self.stats = EngineStats()
        # Per-request store/load counters for vLLM's connector stats (/metrics).
        self.xfer_stats = StatsRecorder()
        self._stop = threading.Event()
        # Writer: jobs and the bytes they hold, under _wcond.
        self._wcond = threading.Condition()
        self._wqueue: deque[_StoreJob] = deque()
        self.queued_bytes = 0
        self._writing = 0  # jobs taken by the writer, not finished
        # Loader: reads to do and reads in flight; results picked up by poll().
        self._lcond = threading.Condition()
        self._lqueue: deque[_Read] = deque()
        self._reads: dict[str, _Read] = {}  # req_id -> read, worker thread owns the dict
        self._writer = threading.Thread(target=self._write_loop, name="xpyd-ss-writer", daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="xpyd-ss-loader", daemon=True)
        self._writer.start()
        self._loader.start()

    def _host_buffer(self, n_blocks: int) -> torch.Tensor:
        return torch.empty((n_blocks, len(self._layers), *self._layout.block_shape), dtype=self._dtype,
                           pin_memory=self._pin)

    # ---------------------------------------------------------------- stores
    def submit_store(self, spec: StoreSpec) -> bool:
        """Worker thread, after the forward: copy the blocks out and queue them.
        False if the store was dropped (queue full past queue_wait_s)."""
        n = len(spec.block_ids)
        nbytes = n * self.block_bytes
        buf = self._host_buffer(n)
        for li, name in enumerate(self._layers):
            off = 0
            for part in kvlayout.gather(self._caches[name], spec.block_ids, self._layout):
                buf[off:off + part.shape[0], li].copy_(part)
                off += part.shape[0]
        job = _StoreJob(spec, buf, nbytes, time.monotonic())
        with self._wcond:
            if self.queued_bytes and self.queued_bytes + nbytes > self.queue_bytes:
                t0 = time.monotonic()
                logger.warning("kv storage writer queue full (%d of %d bytes): step waits up to %.1fs req=%s",
                               self.queued_bytes, self.queue_bytes, self._queue_wait_s, spec.req_id)
                deadline = t0 + self._queue_wait_s
                while self.queued_bytes and self.queued_bytes + nbytes > self.queue_bytes:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stop.is_set():
                        self.stats.dropped_stores += 1
                        self.xfer_stats.failure("send", "queue_full")
                        self.xfer_stats.leg("send", spec.req_id, False, reason="queue_full")  # its span
                        logger.error("kv store dropped req=%s blocks=%d: writer queue still full after %.1fs",
                                     spec.req_id, n, self._queue_wait_s)
                        return False
                    self._wcond.wait(left)
                logger.warning("kv storage back-pressure: step waited %.1fms for the writer",
                               (time.monotonic() - t0) * 1e3)
            self._wqueue.append(job)
            self.queued_bytes += nbytes
            self._wcond.notify_all()
        return True

    def _write_loop(self) -> None:
        pin_current_thread(self._cpus)
        self._evictor.maybe_evict()  # learn the directory's size at start-up
        while True:
            with self._wcond:
                while not self._wqueue and not self._stop.is_set():
                    self._wcond.wait()
                if not self._wqueue:
                    return  # stopped and drained
                job = self._wqueue.popleft()
                self._writing += 1
            try:
                self._write(job)
            finally:
                with self._wcond:
                    self._writing -= 1
                    self.queued_bytes -= job.nbytes
                    self._wcond.notify_all()

    def _write(self, job: _StoreJob) -> None:
        spec = job.spec
        t0 = time.monotonic()
        written = existing = nbytes = 0
        io_error = False
        for i, key in enumerate(spec.keys):
            try:
                b = self.store.write(key, spec.first_index + i, job.buf[i])
            except OSError as e:
                logger.error("kv store failed req=%s block=%d key=%s error=%s",
                             spec.req_id, spec.first_index + i, key[:16], e)
                io_error = True
                break  # later blocks are useless without this one (the chain)
            if b:
                written += 1
                nbytes += b
                self._evictor.added(b)
            else:
                existing += 1
        self.stats.stored_blocks += written
        self.stats.existing_blocks += existing
        self.stats.written_bytes += nbytes
        # KV bytes (not file bytes with headers), as the load side counts them.
        if io_error:
            self.xfer_stats.failure("send", "io")
            self.xfer_stats.moved("sent", written * self.block_bytes)
        else:
            self.xfer_stats.transfer("send", "ok", written * self.block_bytes, "sent")
        queue_ms, write_ms = (t0 - job.queued_at) * 1e3, (time.monotonic() - t0) * 1e3
        self.xfer_stats.leg("send", spec.req_id, not io_error, written * self.block_bytes, write_ms, queue_ms,
                            "io" if io_error else None)  # this part of the request's kv store span
        logger.info("kv stored req=%s blocks=%d written=%d existing=%d bytes=%d queue_ms=%.1f write_ms=%.1f",
                    spec.req_id, len(spec.keys), written, existing, nbytes, queue_ms, write_ms)
        try:
            self._evictor.maybe_evict()
        except OSError as e:  # eviction is best effort
            logger.warning("kv storage eviction failed: %s", e)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued store is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._wcond:
            while self._wqueue or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wcond.wait(left)
        return True

    # ---------------------------------------------------------------- loads
    def submit_load(self, spec: FetchSpec) -> None:
        """Worker thread: start reading a request's blocks."""
        r = _Read(spec, time.monotonic())
        self._reads[spec.req_id] = r
        with self._lcond:
            self._lqueue.append(r)
            self._lcond.notify()

    def _load_loop(self) -> None:
        pin_current_thread(self._cpus)
        while True:
            with self._lcond:
                while not self._lqueue and not self._stop.is_set():
                    self._lcond.wait()
                if self._stop.is_set():
                    return
                r = self._lqueue.popleft()
            try:
                self._read(r)
            except Exception as e:  # noqa: BLE001 - a bad file must not kill the loader
                r.reason = f"{type(e).__name__}: {e}"
                logger.exception("kv storage read crashed req=%s", r.spec.req_id)
            with self._lcond:
                r.done = True
                self._lcond.notify_all()  # an idle step's poll waits for a read to finish

    def _read(self, r: _Read) -> None:
        spec = r.spec
        deadline = r.started + spec.wait_s
        buf = self._host_buffer(len(spec.keys))
        for i, key in enumerate(spec.keys):
            # A file the producer has not renamed into place yet: wait for it.
            while spec.wait_s > 0 and not self.store.stored(key):
                if time.monotonic() >= deadline or self._stop.is_set():
                    break
                self._stop.wait(FILE_POLL_S)
            try:
                self.store.read_into(key, buf[i])
            except Miss as m:
                r.reason = f"block {spec.first_index + i} key={key[:16]}: {m.reason}"
                break
            r.ok_blocks = i + 1
        r.waited_s = max(0.0, time.monotonic() - r.started)
        r.buf = buf

    def poll(self, finished_req_ids: set[str], wait_s: float = 0.0, awaiting: bool = False) -> PollResult:
        """Worker thread, once per step: apply finished reads. ``wait_s`` > 0 (a step that
        computes nothing): when reads are pending and none is done, or requests await a
        producer's first file (``awaiting``), wait up to that long for a read to finish."""
        out = PollResult()
        if wait_s > 0 and (self._reads or awaiting):
            with self._lcond:
                self._lcond.wait_for(lambda: any(r.done for r in self._reads.values()), wait_s)
        for rid, r in list(self._reads.items()):
            if rid in finished_req_ids:
                # Aborted while loading: its blocks may already belong to another
                # request, so nothing is written; the reader's result is dropped.
                del self._reads[rid]
                out.finished.add(rid)
                self.xfer_stats.transfer("load", "cancelled")
                self.xfer_stats.leg("load", rid, False, reason="aborted")
                logger.info("kv storage load cancelled req=%s (request finished)", rid)
                continue
            with self._lcond:
                if not r.done:
                    continue
            del self._reads[rid]
            out.finished.add(rid)
            spec = r.spec
            ok = r.ok_blocks
            applied = time.monotonic()
            if ok and r.buf is not None:
                dst = spec.block_ids[:ok]
                for li, name in enumerate(self._layers):
                    kvlayout.scatter(self._caches[name], dst, r.buf[:ok, li])
            apply_ms = (time.monotonic() - applied) * 1e3
            bad = spec.block_ids[ok:]
            out.invalid_block_ids.update(bad)
            self.stats.loaded_blocks += ok
            self.stats.missed_blocks += len(bad)
            elapsed = time.monotonic() - r.started
            ms = elapsed * 1e3
            # A miss is not a failure (the rest is recomputed), but it is no hit either.
            self.xfer_stats.transfer("load", "missed" if bad else "ok", ok * self.block_bytes, "received")
            if not bad:
                self.xfer_stats.load_wait(elapsed)
            # Its span (connector/tracing.py): applying it, and the read (with any wait for P's files).
            self.xfer_stats.leg("load", rid, not bad, ok * self.block_bytes, apply_ms, r.waited_s * 1e3,
                                "missed" if bad else None)
            if bad:
                logger.warning("kv storage miss req=%s loaded_blocks=%d of %d (recomputing the rest) reason=%s",
                               rid, ok, len(spec.block_ids), r.reason)
            logger.info("kv loaded from storage req=%s blocks=%d first_block=%d ms=%.1f",
                        rid, ok, spec.first_index, ms)
        return out

    @property
    def pending_loads(self) -> int:
        return len(self._reads)

    def close(self, flush_timeout: float = 10.0) -> None:
        if not self.flush(flush_timeout):
            logger.warning("kv storage: %d queued bytes not written at shutdown", self.queued_bytes)
        self._stop.set()
        with self._wcond:
            self._wcond.notify_all()
        with self._lcond:
            self._lcond.notify_all()
        self._writer.join(2.0)
        self._loader.join(2.0)


def file_meta(model_id: str, block_size: int, block_layout: kvlayout.BlockLayout, layers: list[str],
              rank: int, world: int) -> FileMeta:
    return FileMeta(model_id=model_id, block_size=block_size, layout=block_layout.layout,
                    dtype=block_layout.dtype, block_shape=tuple(block_layout.block_shape),
                    layers=tuple(layers), rank=rank, world=world)

"""Consumer side of the worker's KV engine (runs on D).

A load waits for its transfer's payload in the receive buffer and is applied in
the worker thread (``poll``, once per step). It fails at once, not at its
deadline, when the buffer knows the payload will not come (refused for room,
expired, or given up by P). The ``n`` children of one prompt share one payload:
it stays in the buffer until the scheduler released its key and the last
planned load took it.

GET mode: D pulls from P on a bounded pool of threads, one fetch per key,
reserving the payload's size in its own buffer before asking.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from connector import layout as kvlayout
from connector.affinity import CpuPlan, pin_current_thread
from connector.buffer import KVBuffer, Payload
from connector.config import ConnectorConfig
from connector.log import get_logger
from connector.metadata import LoadSpec
from connector.request_id import rank_address
from connector.staging import RecvStager
from connector.stats import StatsRecorder
from connector.transport import Transport, TransportError

logger = get_logger(__name__)

GET_POOL_SIZE = 4
GET_RETRY_S = 0.02  # P has not finished its copy yet: ask again after this
GET_TRANSPORT_RETRIES = 2  # then the fetch (and its loads) fail: P is unreachable


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    deadline: float
    started: float


class Consumer:
    def __init__(self, cfg: ConnectorConfig, rank: int, transport: Transport, caches: dict[str, torch.Tensor],
                 block_layout: kvlayout.BlockLayout, recv: KVBuffer, cpus: CpuPlan | None,
                 stats: StatsRecorder | None = None, stager: RecvStager | None = None,
                 check: Callable[[dict], str | None] | None = None) -> None:
        self._cfg = cfg
        # Checks a payload header's layout and TP against ours (GET has no first contact).
        self._check = check
        self._stager = stager
        self.stats = stats or StatsRecorder()
        self._rank = rank
        self._transport = transport
        self._caches = caches
        self._layer_names = list(caches)
        self._layout = block_layout
        self._recv = recv
        # Bytes one prompt block takes over all layers: sizes a GET reservation.
        elem = torch.empty((), dtype=getattr(torch, block_layout.dtype)).element_size()
        self._block_bytes = math.prod(block_layout.block_shape) * elem * len(self._layer_names)
        self._loads: dict[str, _Load] = {}  # req_id -> pending load, worker thread only
        self._released: set[str] = set()  # keys no further load will be planned for
        self._stop = threading.Event()
        self._fetches: dict[str, threading.Event] = {}  # GET: key -> cancel
        self._pool: ThreadPoolExecutor | None = None
        if cfg.send_type == "GET":
            self._pool = ThreadPoolExecutor(GET_POOL_SIZE, thread_name_prefix="xpyd-kv-get",
                                            initializer=pin_current_thread, initargs=(cpus,))

    @property
    def pending(self) -> int:
        return len(self._loads)  # len() of a dict is atomic under the GIL

    # ---- worker thread: what the scheduler planned ----
    def add_load(self, spec: LoadSpec) -> None:
        now = time.monotonic()
        deadline = now + self._cfg.kv_load_timeout_s
        self._loads[spec.req_id] = _Load(spec, deadline, now)
        if self._pool is not None and spec.transfer_key not in self._fetches:
            cancel = threading.Event()
            self._fetches[spec.transfer_key] = cancel
            self._pool.submit(self._fetch, spec, deadline, cancel)

    def release(self, keys: list[str]) -> None:
        self._released.update(keys)

    # ---- GET: pull from P (pool thread) ----
    def _fetch(self, spec: LoadSpec, deadline: float, cancel: threading.Event) -> None:
        key = spec.transfer_key
        peer = rank_address(spec.prefill_addr, self._rank)
        refused = self._recv.reserve(key, spec.prompt_blocks * self._block_bytes)
        if refused:
            logger.warning("kv get not started transfer=%s reason=%s", key, refused)
            return
        errors = 0
        why = "load deadline passed"
        while not (self._stop.is_set() or cancel.is_set()) and time.monotonic() < deadline:
            try:
                reply, tensors = self._transport.call(
                    peer, {"op": "get", "key": key},
                    timeout_s=max(0.05, min(self._cfg.send_timeout_s, deadline - time.monotonic())))
            except TransportError as e:
                errors += 1
                if errors > GET_TRANSPORT_RETRIES:
                    why = f"prefill {peer} unreachable: {e}"
                    break
                self._stop.wait(GET_RETRY_S * 10)
                continue
            if reply.get("ok"):
                header = {k: v for k, v in reply.items() if k != "ok"}
                payload = Payload.of(header, tensors)
                refused = self._stager.admit(payload) if self._stager is not None else None
                if refused:
                    self._recv.fail(key, refused)
                else:
                    refused = self._recv.put(key, payload)
                    if refused:
                        payload.drop()
                if refused:
                    logger.warning("kv get refused locally transfer=%s reason=%s", key, refused)
                else:
                    self.stats.moved("received", payload.nbytes)
                try:
                    self._transport.call(peer, {"op": "release", "key": key}, timeout_s=1.0)
                except TransportError:
                    pass  # P's TTL frees it
                return
            if reply.get("final"):
                why = f"prefill says: {reply.get('error')}"
                break
            self._stop.wait(GET_RETRY_S)
        if not cancel.is_set():
            self._recv.fail(key, why)  # frees the reservation; waiting loads fail at once

    # ---- worker thread: complete what can be completed ----
    def _apply(self, load: _Load, payload: Payload) -> str | None:
        """Copy a payload into the cache; returns an error or None."""
        spec, h = load.spec, payload.header
        # Headers of older senders carry no TP: only the layout can be checked then.
        bad = self._check(h) if self._check is not None and "tp_size" in h else self._layout.mismatch(h)
        if bad:
            return bad
        if h.get("layers") != self._layer_names:
            return "layer names differ between prefill and decode"
        if h.get("num_tokens") != spec.prompt_tokens:
            return f"payload is for a {h.get('num_tokens')}-token prompt, this request has {spec.prompt_tokens}"
        runs = h.get("runs") or []
        per_layer = len(runs)
        if per_layer == 0 or len(payload.tensors) != per_layer * len(self._layer_names):
            return "payload tensor count does not match its header"
        last = spec.first_block + len(spec.dst_block_ids)
        if int(h.get("num_blocks", 0)) < last:
            return f"peer sent {h.get('num_blocks')} blocks, need {last}"
        # Check every tensor before writing any, so a bad payload leaves the cache untouched.
        if sum(runs) != h.get("num_blocks"):
            return "payload runs do not add up to num_blocks"
        for t, n in zip(payload.tensors, runs * len(self._layer_names)):
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype != self._layout.dtype or tuple(t.shape) != (n, *self._layout.block_shape):
                return f"payload tensor {t.dtype}{list(t.shape)} does not match its header"
        for i, name in enumerate(self._layer_names):
            parts = payload.tensors[i * per_layer:(i + 1) * per_layer]
            src = parts[0] if len(parts) == 1 else torch.cat(parts, dim=kvlayout.BLOCK_AXIS)
            src = src.narrow(kvlayout.BLOCK_AXIS, spec.first_block, len(spec.dst_block_ids))
            if spec.corrupt_for_test:
                src = torch.zeros_like(src)
            kvlayout.scatter(self._caches[name], spec.dst_block_ids, src)
        for t in payload.tensors:
            if t.is_cuda:
                # Received on the transport's stream, read on this thread's: keep the memory
                # from being reused before this stream's copy ran.
                t.record_stream(torch.cuda.current_stream(t.device))
        return None

    def poll(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving); called once per step by the worker."""
        done: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            key = load.spec.transfer_key
            if rid in finished_req_ids:
                # Aborted while waiting: nothing to load; the key's release drops the KV.
                del self._loads[rid]
                done.add(rid)
                self.stats.transfer("load", "cancelled")
                logger.info("kv load cancelled req=%s transfer=%s (request finished)", rid, key)
                continue
            payload = self._recv.peek(key)
            if payload is not None:
                try:
                    with payload.in_use():  # a TTL drop meanwhile frees a pinned lease only after
                        err = self._apply(load, payload)
                except Exception as e:  # noqa: BLE001 - a peer's bad payload must not kill the worker
                    err = f"malformed payload: {type(e).__name__}: {e}"
                del self._loads[rid]
                done.add(rid)
                if err:
                    failed.add(rid)
                    self.stats.failure("load", "invalid")
                    logger.error("kv load failed req=%s transfer=%s error=%s", rid, key, err)
                else:
                    self.stats.transfer("load", "ok")
                    self.stats.load_wait(now - load.started)
                    logger.info(
                        "kv loaded req=%s transfer=%s tokens=%d blocks=%d wait_ms=%.1f%s",
                        rid, key, load.spec.num_tokens, len(load.spec.dst_block_ids),
                        (now - load.started) * 1e3,
                        " CORRUPTED(test)" if load.spec.corrupt_for_test else "",
                    )
                continue
            why = self._recv.failure(key)
            if why is None and now <= load.deadline:
                continue
            del self._loads[rid]
            done.add(rid)
            failed.add(rid)
            self.stats.failure("load", "timeout" if why is None else "aborted")
            if why is None:
                logger.error("kv load timed out req=%s transfer=%s after %.1fs",
                             rid, key, self._cfg.kv_load_timeout_s)
            else:
                logger.error("kv load failed req=%s transfer=%s after %.1fms error=%s",
                             rid, key, (now - load.started) * 1e3, why)
        self._drop_released()
        return done, failed

    def _drop_released(self) -> None:
        """Drop the KV of released keys that no planned load still needs."""
        if not self._released:
            return
        wanted = {load.spec.transfer_key for load in self._loads.values()}
        for key in self._released - wanted:
            self._recv.discard(key)
            cancel = self._fetches.pop(key, None)
            if cancel is not None:
                cancel.set()
            self._released.discard(key)

    def close(self) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

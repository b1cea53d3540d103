"""Consumer side of the worker's KV engine (runs on D).

A load waits for its transfer's payload in the receive buffer and is applied in
the worker thread (``poll``, once per step). It fails at once, not at its
deadline, when the buffer knows the payload will not come (refused for room,
expired, or given up by P). When the payload was here already as the scheduler
planned the load (it asks the control socket, op ``ready``), the load is
synchronous instead: applied before the forward pass of the step that schedules
the request (``load_now``), which saves the engine step an asynchronous load waits
for. The ``n`` children of one prompt share one payload: it stays in the buffer
until the scheduler released its key and the last planned load took it.

GET mode: D pulls from P on a bounded pool of threads, one fetch per key,
reserving the payload's size in its own buffer before asking.

Heterogeneous TP (PUT, PUT_ASYNC): each prefill rank sends this rank the heads it owns
as a piece under ``tp.piece_key(key, i)``; piece 0's header says how many there are. A
load completes once every piece is here and each is checked against ``tp.sources``; it
fails at once when any piece will not come.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from connector import layout as kvlayout
from connector.p2p import tp
from connector.affinity import CpuPlan, pin_current_thread
from connector.p2p.buffer import KVBuffer, Payload
from connector.config import ConnectorConfig
from connector.log import get_logger
from connector.p2p.metadata import LoadSpec
from connector.p2p.staging import RecvStager, store_received
from connector.stats import StatsRecorder
from connector.transport import Transport, TransportError
from xpyd_wire.kv_transfer import FINAL_KEY, OK_KEY, Get, Release
from xpyd_wire.request_id import rank_address

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
                 check: Callable[[dict], str | None] | None = None, local: tp.TpSide | None = None,
                 head_axis: int = kvlayout.HEAD_AXIS) -> None:
        self._cfg = cfg
        self._local = local  # this instance's TP: which heads each piece must bring
        self._head_axis = head_axis  # of the (regrouped) cache views
        # Checks a payload header's layout and TP against ours (GET has no first contact).
        self._check = check
        self._stager = stager
        self.stats = stats or StatsRecorder()
        self._rank = rank
        self._transport = transport
        self._caches = caches
        self._layer_names = list(caches)
        # Where the caches live (block id tensors go there); the first cache's, as they all agree.
        self._cache_device = next(iter(caches.values())).device if caches else torch.device("cpu")
        self._layout = block_layout
        self._recv = recv
        # Bytes one prompt block takes over all layers: sizes a GET reservation.
        elem = torch.empty((), dtype=getattr(torch, block_layout.dtype)).element_size()
        self._block_bytes = math.prod(block_layout.block_shape) * elem * len(self._layer_names)
        self._loads: dict[str, _Load] = {}  # req_id -> pending load, worker thread only
        self._released: set[str] = set()  # keys no further load will be planned for
        self._pieces: dict[str, int] = {}  # key -> pieces announced (heterogeneous TP), worker thread only
        self._invalid: set[int] = set()  # blocks of failed synchronous loads, worker thread only
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
        # At most: P may have skipped leading blocks this instance holds.
        # P silent past the reservation (send_timeout_s + 1 s) fails the load then, by this name.
        lapsed = f"prefill {peer} sent no payload in time (GET: silent, or not ready)"
        refused = self._recv.reserve(key, spec.prompt_blocks * self._block_bytes, at_most=True, expired_reason=lapsed)
        if refused:
            logger.warning("kv get not started transfer=%s reason=%s", key, refused)
            return
        errors = 0
        why = "load deadline passed"
        while not (self._stop.is_set() or cancel.is_set()) and time.monotonic() < deadline:
            try:
                reply, tensors = self._transport.call(
                    peer, Get(key).encode(),
                    timeout_s=max(0.05, min(self._cfg.send_timeout_s, deadline - time.monotonic())))
            except TransportError as e:
                errors += 1
                if errors > GET_TRANSPORT_RETRIES:
                    why = f"prefill {peer} unreachable: {e}"
                    break
                self._stop.wait(GET_RETRY_S * 10)
                continue
            if reply.get(OK_KEY):
                header = {k: v for k, v in reply.items() if k != OK_KEY}
                payload = Payload.of(header, tensors)
                # Another TP size or layout: say so, not that the size missed the reservation.
                refused = self._check(header) if self._check is not None and "tp_size" in header else None
                if refused:
                    self._recv.fail(key, refused)
                else:
                    refused = store_received(self._recv, self._stager, key, payload)
                if refused:
                    logger.warning("kv get refused locally transfer=%s reason=%s", key, refused)
                else:
                    self.stats.moved("received", payload.nbytes)
                try:
                    self._transport.call(peer, Release(key).encode(), timeout_s=1.0)
                except TransportError:
                    pass  # P's TTL frees it
                return
            if reply.get(FINAL_KEY):
                why = f"prefill says: {reply.get('error')}"
                break
            self._stop.wait(GET_RETRY_S)
        if not cancel.is_set():
            self._recv.fail(key, why)  # frees the reservation; waiting loads fail at once

    # ---- worker thread: complete what can be completed ----
    def _look(self, key: str) -> tuple[list[Payload] | None, int | None, str | None]:
        """Any thread, reads only: (the payload, or every piece of it, when all are here; the
        pieces piece 0 announces, if it is here; why it will not come)."""
        payload = self._recv.peek(key)
        if payload is not None:
            return [payload], None, None
        first = self._recv.peek(tp.piece_key(key, 0))
        if first is None:
            return None, None, self._recv.failure(key) or self._recv.failure(tp.piece_key(key, 0))
        n = first.header.get("pieces")
        if type(n) is not int or not 1 <= n <= 1024:
            return None, None, f"malformed piece header: pieces={n!r}"
        got = [first]
        for i in range(1, n):
            p = self._recv.peek(tp.piece_key(key, i))
            if p is None:
                return None, n, self._recv.failure(key) or self._recv.failure(tp.piece_key(key, i))
            got.append(p)
        return got, n, None

    def _arrived(self, key: str) -> tuple[list[Payload] | None, str | None]:
        """Worker thread: ``_look``, remembering how many pieces to drop on release."""
        payloads, pieces, why = self._look(key)
        if pieces is not None:
            self._pieces[key] = pieces
        return payloads, why

    def _apply_pieces(self, load: _Load, pieces: list[Payload]) -> str | None:
        """Copy the head slices of a heterogeneous-TP transfer into the cache, after checking
        all of them (a bad piece leaves the cache untouched); an error or None."""
        spec = load.spec
        last = spec.first_block + len(spec.dst_block_ids)
        want: list[tp.Piece] | None = None
        for i, p in enumerate(pieces):
            h = p.header
            bad = self._check(h) if self._check is not None else "no TP check configured"
            if bad:
                return bad
            if self._local is None:
                return "this instance's TP is unknown: cannot place head slices"
            if want is None:
                prefill = tp.TpSide(int(h["tp_size"]), int(h["num_kv_heads"]), bool(h["is_mla"]))
                want = tp.sources(prefill, self._local, self._rank)
                if len(want) != len(pieces):
                    return f"prefill announced {len(pieces)} pieces, tp says {len(want)}"
            if h.get("piece") != i or h.get("pieces") != len(pieces) or h.get("src_rank") != want[i].remote_rank \
                    or h.get("heads") != [want[i].local_heads.start, want[i].local_heads.stop]:
                return (f"piece {i} is not what tp expects: from rank {h.get('src_rank')} heads {h.get('heads')}, "
                        f"want rank {want[i].remote_rank} heads {want[i].local_heads}")
            if h.get("layers") != self._layer_names:
                return "layer names differ between prefill and decode"
            if h.get("num_tokens") != spec.prompt_tokens:
                return f"payload is for a {h.get('num_tokens')}-token prompt, this request has {spec.prompt_tokens}"
            bad = _skip_mismatch(h, spec, last)
            if bad:
                return bad
            nb = int(h["num_blocks"]) - int(h.get("first_block", 0))  # blocks in the tensors
            if h.get("runs") != [nb] or len(p.tensors) != len(self._layer_names):
                return "piece tensor count does not match its header"
            shape = list(self._layout.block_shape)
            shape[self._head_axis - 1] = want[i].local_heads.stop - want[i].local_heads.start
            for t in p.tensors:
                if str(t.dtype).removeprefix("torch.") != self._layout.dtype or list(t.shape) != [nb, *shape]:
                    return f"piece tensor {t.dtype}{list(t.shape)} does not match its header"
        assert want is not None
        idx = kvlayout.index(spec.dst_block_ids, self._cache_device)  # once, not once per layer and piece
        for li, name in enumerate(self._layer_names):
            for piece, p in zip(want, pieces, strict=True):
                start = spec.first_block - int(p.header.get("first_block", 0))
                src = p.tensors[li].narrow(kvlayout.BLOCK_AXIS, start, len(spec.dst_block_ids))
                if spec.corrupt_for_test:
                    src = torch.zeros_like(src)
                kvlayout.scatter_packed(self._caches[name], idx, src, heads=piece.local_heads,
                                        head_axis=self._head_axis)
        for p in pieces:
            for t in p.tensors:
                if t.is_cuda:
                    t.record_stream(torch.cuda.current_stream(t.device))
        return None

    def _apply(self, load: _Load, payloads: list[Payload]) -> str | None:
        """Copy a payload (or the pieces of one) into the cache; returns an error or None."""
        if len(payloads) > 1 or "pieces" in payloads[0].header:
            return self._apply_pieces(load, payloads)
        payload = payloads[0]
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
        bad = _skip_mismatch(h, spec, last)
        if bad:
            return bad
        first = int(h.get("first_block", 0))
        start = spec.first_block - first
        # Check every tensor before writing any, so a bad payload leaves the cache untouched.
        if sum(runs) != int(h["num_blocks"]) - first:
            return "payload runs do not add up to num_blocks"
        for t, n in zip(payload.tensors, runs * len(self._layer_names)):
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype != self._layout.dtype or tuple(t.shape) != (n, *self._layout.block_shape):
                return f"payload tensor {t.dtype}{list(t.shape)} does not match its header"
        want = len(spec.dst_block_ids)
        # Each run straight into its blocks (joining the runs first would copy every byte
        # twice). Every layer has the same runs: their destination ids become index tensors
        # once per transfer, not once per layer (on CUDA each is a host-to-device copy).
        plan: list[tuple[int, int, int, torch.Tensor]] = []  # (run, first block in it, blocks, dst ids)
        off = 0
        for r, n in enumerate(runs):
            lo, hi = max(start, off), min(start + want, off + n)  # payload blocks this run brings
            if lo < hi:
                plan.append((r, lo - off, hi - lo, kvlayout.index(spec.dst_block_ids[lo - start:hi - start],
                                                                  self._cache_device)))
            off += n
        for i, name in enumerate(self._layer_names):
            for r, at, n, idx in plan:
                src = payload.tensors[i * per_layer + r].narrow(kvlayout.BLOCK_AXIS, at, n)
                if spec.corrupt_for_test:
                    src = torch.zeros_like(src)
                kvlayout.scatter(self._caches[name], idx, src)
        for t in payload.tensors:
            if t.is_cuda:
                # Received on the transport's stream, read on this thread's: keep the memory
                # from being reused before this stream's copy ran.
                t.record_stream(torch.cuda.current_stream(t.device))
        return None

    def _complete(self, load: _Load, payloads: list[Payload], now: float, how: str = "") -> bool:
        """Apply a load whose payload is here, count and log it; False if it failed."""
        rid, key = load.spec.req_id, load.spec.transfer_key
        t0 = time.perf_counter()
        try:
            with ExitStack() as held:  # a TTL drop meanwhile frees a pinned lease only after
                for p in payloads:
                    held.enter_context(p.in_use())
                err = self._apply(load, payloads)
        except Exception as e:  # noqa: BLE001 - a peer's bad payload must not kill the worker
            err = f"malformed payload: {type(e).__name__}: {e}"
        apply_ms, wait_ms = (time.perf_counter() - t0) * 1e3, (now - load.started) * 1e3
        nbytes = sum(p.nbytes for p in payloads)
        self.stats.leg("load", rid, not err, nbytes, apply_ms, wait_ms, "invalid" if err else None)  # its span
        if err:
            self.stats.failure("load", "invalid")
            logger.error("kv load failed req=%s transfer=%s error=%s", rid, key, err)
            return False
        self.stats.transfer("load", "ok")
        self.stats.load_wait(now - load.started)
        logger.info(
            "kv loaded req=%s transfer=%s tokens=%d blocks=%d wait_ms=%.1f%s apply_ms=%.2f%s",
            rid, key, load.spec.num_tokens, len(load.spec.dst_block_ids), wait_ms, how, apply_ms,
            " CORRUPTED(test)" if load.spec.corrupt_for_test else "",
        )
        return True

    # ---- synchronous loads: the KV was here when the scheduler planned the load ----
    def ready(self, key: str) -> bool:
        """Any thread (the control socket's "ready" op): the whole payload of ``key`` (every
        piece, for heterogeneous TP) is in the receive buffer."""
        return self._look(key)[0] is not None

    def load_now(self, spec: LoadSpec) -> bool:
        """Worker thread, before the step's forward pass: apply a load the scheduler planned as
        synchronous (it saw the payload here). On failure its blocks are reported through
        ``take_invalid_blocks`` and vLLM's kv_load_failure_policy decides, as vLLM does for
        every synchronous load; there is no finished_recving for it either way."""
        now = time.monotonic()
        load = _Load(spec, now, now)
        payloads, why = self._arrived(spec.transfer_key)
        if payloads is not None and self._complete(load, payloads, now, " sync"):
            return True
        if payloads is None:
            # Gone between the scheduler's check and this step (its TTL, a late abort).
            self.stats.failure("load", "aborted" if why else "error")
            self.stats.leg("load", spec.req_id, False, reason="aborted" if why else "error")
            logger.error("kv load failed req=%s transfer=%s error=%s", spec.req_id, spec.transfer_key,
                         why or "the payload the scheduler saw is gone")
        self._invalid.update(spec.dst_block_ids)
        return False

    def take_invalid_blocks(self) -> set[int]:
        """Blocks of synchronous loads that failed since the last call (vLLM's
        get_block_ids_with_load_errors)."""
        out, self._invalid = self._invalid, set()
        return out

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
            payloads, why = self._arrived(key)
            if payloads is not None:
                del self._loads[rid]
                done.add(rid)
                if not self._complete(load, payloads, now):
                    failed.add(rid)
                continue
            if why is None and now <= load.deadline:
                continue
            del self._loads[rid]
            done.add(rid)
            failed.add(rid)
            self.stats.failure("load", "timeout" if why is None else "aborted")
            self.stats.leg("load", rid, False, wait_ms=(now - load.started) * 1e3,
                           reason="timeout" if why is None else "aborted")
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
            for i in range(self._pieces.pop(key, 1)):  # late pieces are refused too
                self._recv.discard(tp.piece_key(key, i))
            cancel = self._fetches.pop(key, None)
            if cancel is not None:
                cancel.set()
            self._released.discard(key)

    def close(self) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _skip_mismatch(h: dict, spec: LoadSpec, last: int) -> str | None:
    """Why a payload holding prompt blocks [first_block, num_blocks) cannot fill this load's
    blocks [spec.first_block, last), or None. P skips the blocks the proxy says D holds;
    when D's own prefix hit is shorter (evicted since), the gap is D's to recompute: the
    load fails and vLLM's kv_load_failure_policy decides."""
    first, end = h.get("first_block", 0), h.get("num_blocks", 0)
    if type(first) is not int or type(end) is not int or not 0 <= first <= end:
        return f"malformed payload: first_block={first!r} num_blocks={end!r}"
    if first > spec.first_block:
        return (f"peer skipped prompt blocks {spec.first_block}..{first - 1} (the proxy said this instance "
                "held them; it no longer does)")
    if end < last:
        return f"peer sent blocks {first}..{end - 1}, need up to {last - 1}"
    return None

"""The per-worker control plane: serves peers, pushes and pulls KV payloads.

One engine per worker process, listening at ``kv_ip:kv_port + rank``. Three send
modes, as upstream P2pNcclConnector defines them:

- PUT: the worker sends synchronously after the forward pass that completed the
  prompt; blocks are free as soon as the step ends.
- PUT_ASYNC (default): a sender thread ships views of the cache blocks; the
  scheduler keeps the blocks until ``poll`` reports the send finished.
- GET: the worker copies the blocks into its own buffer; D pulls them.

Every wait is bounded: sends by ``send_timeout_s``, loads by
``kv_load_timeout_s``, buffered payloads by ``buffer_ttl_s``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from connector import layout as kvlayout
from connector.buffer import KVBuffer, Payload, tensor_bytes
from connector.config import ConnectorConfig
from connector.log import get_logger
from connector.metadata import LoadSpec, SaveSpec
from connector.request_id import rank_address
from connector.transport import Transport, TransportError
from connector.transport import make_transport as transport_factory

logger = get_logger(__name__)

# How often a GET-mode consumer asks again while P has not finished its copy.
_GET_RETRY_S = 0.02
# How often buffered payloads are checked against their TTL.
_SWEEP_S = 0.5


@dataclass(slots=True)
class _Send:
    spec: SaveSpec
    done: threading.Event = field(default_factory=threading.Event)
    # queued -> sending -> done, or queued -> cancelled (preempted before it
    # started: its blocks are about to be reused, so it must never start).
    state: str = "queued"
    lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self) -> bool:
        """Sender thread: move queued -> sending; False if it was cancelled."""
        with self.lock:
            if self.state != "queued":
                return False
            self.state = "sending"
            return True

    def cancel(self) -> bool:
        """Worker thread: cancel if not started; False if already sending/done."""
        with self.lock:
            if self.state != "queued":
                return False
            self.state = "cancelled"
        self.done.set()
        return True


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    deadline: float
    started: float


@dataclass(slots=True)
class PollResult:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


def make_transport(name: str, device: torch.device) -> Transport:
    """tcp everywhere for now; "auto" will pick NCCL on CUDA once that lands."""
    if name == "auto" and device.type == "cuda":
        logger.warning("NCCL transport not available yet: KV goes over tcp via host memory")
    return transport_factory(name)


class KVEngine:
    def __init__(
        self,
        cfg: ConnectorConfig,
        rank: int,
        kv_caches: dict[str, torch.Tensor],
        block_layout: kvlayout.BlockLayout,
        transport: Transport | None = None,
    ) -> None:
        self._cfg = cfg
        self._rank = rank
        self._caches = kv_caches
        self._layer_names = list(kv_caches)
        self._layout = block_layout
        self._device = next(iter(kv_caches.values())).device
        self._recv = KVBuffer("recv", cfg.kv_buffer_size, cfg.buffer_ttl_s)
        self._sendbuf = KVBuffer("send", cfg.kv_buffer_size, cfg.buffer_ttl_s)
        self._sends: dict[str, _Send] = {}  # req_id -> send, worker thread only
        self._finished: set[str] = set()  # req ids the scheduler has finished
        self._loads: dict[str, _Load] = {}  # req_id -> pending load, worker thread only
        self._queue: queue.Queue[_Send | None] = queue.Queue()
        self._stop = threading.Event()
        self._transport = transport or make_transport(cfg.transport, self._device)
        self._device_native = bool(getattr(self._transport, "device_native", False))
        self.address = rank_address(cfg.advertised_address, rank)
        host, _, port = self.address.rpartition(":")
        self._transport.start(host, int(port), self._handle)
        self._sender = threading.Thread(target=self._send_loop, name="xpyd-kv-sender", daemon=True)
        self._sender.start()
        logger.info(
            "kv engine up address=%s rank=%d transport=%s send_type=%s layout=%s",
            self.address, rank, self._transport.name, cfg.send_type, block_layout,
        )

    # ---- bookkeeping visible to tests and logs ----
    @property
    def recv_buffer(self) -> KVBuffer:
        return self._recv

    @property
    def send_buffer(self) -> KVBuffer:
        return self._sendbuf

    def stats(self) -> dict[str, int]:
        """Buffer accounting, for operators and the fault tests (op "stats")."""
        return {
            "recv_bytes": self._recv.used_bytes,
            "recv_items": len(self._recv),
            "send_bytes": self._sendbuf.used_bytes,
            "send_items": len(self._sendbuf),
            # Read from the transport thread: len() of a dict is atomic under the GIL.
            "pending_sends": len(self._sends),
            "pending_loads": len(self._loads),
        }

    # ---- server side (transport thread) ----
    def _handle(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        op = header.get("op")
        if op == "put":
            key = header.get("key")
            if not isinstance(key, str):
                return {"ok": False, "error": "put without key"}, []
            refused = self._recv.put(key, Payload.of(header, tensors))
            if refused:
                logger.warning("refused kv transfer=%s reason=%s", key, refused)
                return {"ok": False, "error": refused}, []
            return {"ok": True}, []
        if op == "get":
            # Not popped: a reply lost to a timeout must be retrievable again.
            # D sends "release" once it holds the payload; the TTL covers the rest.
            key = header.get("key")
            payload = self._sendbuf.peek(key) if isinstance(key, str) else None
            if payload is None:
                return {"ok": False, "error": "not ready"}, []
            return {"ok": True, **payload.header}, payload.tensors
        if op == "release":
            key = header.get("key")
            if isinstance(key, str):
                self._sendbuf.pop(key)
            return {"ok": True}, []
        if op == "ping":
            return {"ok": True, "address": self.address}, []
        if op == "stats":
            return {"ok": True, **self.stats()}, []
        return {"ok": False, "error": f"unknown op {op!r}"}, []

    # ---- producer (worker thread) ----
    def _payload(self, spec: SaveSpec, copy: bool) -> tuple[dict[str, Any], list[torch.Tensor]]:
        tensors: list[torch.Tensor] = []
        run_lens: list[int] | None = None
        for name in self._layer_names:
            parts = kvlayout.gather(self._caches[name], spec.block_ids, self._layout)
            if run_lens is None:
                run_lens = [p.shape[0] for p in parts]
            for p in parts:
                # tcp moves host memory; GET must own its copy (blocks get freed).
                if copy or p.device.type != "cpu" and not self._device_native:
                    p = p.to("cpu", copy=True) if p.device.type != "cpu" else p.clone()
                tensors.append(p)
        header = {
            "op": "put",
            "key": spec.transfer_key,
            "num_tokens": spec.num_tokens,
            "num_blocks": len(spec.block_ids),
            "layers": self._layer_names,
            "runs": run_lens or [],
            **self._layout.describe(),
        }
        return header, tensors

    def save(self, spec: SaveSpec) -> None:
        """Called after the forward pass that completed the prompt."""
        if self._cfg.send_type == "GET":
            header, tensors = self._payload(spec, copy=True)
            refused = self._sendbuf.put(spec.transfer_key, Payload.of(header, tensors))
            if refused:
                logger.warning("GET buffer refused transfer=%s reason=%s", spec.transfer_key, refused)
            return
        send = _Send(spec)
        if self._cfg.send_type == "PUT":
            self._do_send(send)
            return
        self._sends[spec.req_id] = send
        self._queue.put(send)

    def _send_loop(self) -> None:
        # Also the housekeeping thread: an idle engine gets no poll() from vLLM
        # (no steps without requests), yet unclaimed payloads must still expire.
        next_sweep = time.monotonic() + _SWEEP_S
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=_SWEEP_S)
            except queue.Empty:
                item = None
            else:
                if item is None:
                    return
                self._do_send(item)
            if time.monotonic() >= next_sweep:
                self._recv.expire()
                self._sendbuf.expire()
                next_sweep = time.monotonic() + _SWEEP_S

    def _do_send(self, send: _Send) -> None:
        if not send.claim():
            return  # cancelled by a preemption before it started
        spec = send.spec
        peer = rank_address(spec.decode_addr, self._rank)
        t0 = time.monotonic()
        try:
            header, tensors = self._payload(spec, copy=False)
            reply, _ = self._transport.call(peer, header, tensors, timeout_s=self._cfg.send_timeout_s)
            if not reply.get("ok"):
                logger.warning("kv send refused req=%s transfer=%s peer=%s error=%s",
                               spec.req_id, spec.transfer_key, peer, reply.get("error"))
            else:
                nbytes = tensor_bytes(tensors)
                logger.info("kv sent req=%s transfer=%s tokens=%d blocks=%d bytes=%d peer=%s ms=%.1f",
                            spec.req_id, spec.transfer_key, spec.num_tokens, len(spec.block_ids),
                            nbytes, peer, (time.monotonic() - t0) * 1e3)
        except Exception as e:  # noqa: BLE001 - the sender thread must survive any one send
            logger.warning("kv send failed req=%s transfer=%s peer=%s error=%s",
                           spec.req_id, spec.transfer_key, peer, e)
        finally:
            send.done.set()

    def wait_sends(self, req_ids: list[str]) -> None:
        """Preemption: no send may read these requests' blocks after we return.

        A queued send is cancelled (it would otherwise start later, on reused
        blocks); one already on the wire ends within send_timeout_s, since
        every transport call has that deadline.
        """
        for rid in req_ids:
            send = self._sends.get(rid)
            if send is None or send.cancel():
                continue
            if not send.done.wait(timeout=self._cfg.send_timeout_s + 1.0):
                logger.error("kv send still running after its deadline req=%s", rid)

    # ---- consumer (worker thread) ----
    def discard(self, keys: list[str]) -> None:
        """Transfers no request will load (full local prefix hit, finished before
        admission): drop what arrived and refuse what still comes."""
        for key in keys:
            self._recv.discard(key)

    def add_load(self, spec: LoadSpec) -> None:
        now = time.monotonic()
        self._loads[spec.req_id] = _Load(spec, now + self._cfg.kv_load_timeout_s, now)
        if self._cfg.send_type == "GET":
            threading.Thread(target=self._fetch, args=(spec, now + self._cfg.kv_load_timeout_s),
                             name="xpyd-kv-get", daemon=True).start()

    def _fetch(self, spec: LoadSpec, deadline: float) -> None:
        """GET mode: pull from P until it answers or the load deadline passes."""
        peer = rank_address(spec.prefill_addr, self._rank)
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                reply, tensors = self._transport.call(
                    peer, {"op": "get", "key": spec.transfer_key},
                    timeout_s=max(0.05, min(self._cfg.send_timeout_s, deadline - time.monotonic())),
                )
            except TransportError as e:
                logger.warning("kv get retry transfer=%s peer=%s error=%s", spec.transfer_key, peer, e)
                self._stop.wait(_GET_RETRY_S * 10)
                continue
            if reply.get("ok"):
                header = {k: v for k, v in reply.items() if k != "ok"}
                refused = self._recv.put(spec.transfer_key, Payload.of(header, tensors))
                if refused:
                    logger.warning("kv get refused locally transfer=%s reason=%s", spec.transfer_key, refused)
                try:
                    self._transport.call(peer, {"op": "release", "key": spec.transfer_key}, timeout_s=1.0)
                except TransportError:
                    pass  # P's TTL frees it
                return
            self._stop.wait(_GET_RETRY_S)

    def _apply(self, load: _Load, payload: Payload) -> str | None:
        """Copy a payload into the cache; returns an error or None."""
        spec, h = load.spec, payload.header
        mine = self._layout.describe()
        for k in ("layout", "dtype", "block_shape"):
            if h.get(k) != mine[k]:
                return f"{k} mismatch: peer {h.get(k)} vs local {mine[k]}"
        if h.get("layers") != self._layer_names:
            return "layer names differ between prefill and decode"
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
        return None

    def poll(self, finished_req_ids: set[str]) -> PollResult:
        """Complete what can be completed; called once per step by the worker."""
        out = PollResult()
        now = time.monotonic()
        # Sends: the scheduler frees blocks only for ids it finished itself.
        self._finished.update(r for r in finished_req_ids if r in self._sends)
        for rid in list(self._finished):
            send = self._sends.get(rid)
            if send is None:
                self._finished.discard(rid)
            elif send.done.is_set():
                out.finished_sending.add(rid)
                del self._sends[rid]
                self._finished.discard(rid)
        # Loads.
        for rid, load in list(self._loads.items()):
            key = load.spec.transfer_key
            if rid in finished_req_ids:
                # Aborted while waiting: nothing to load; drop what came or comes.
                self._recv.discard(key)
                out.finished_recving.add(rid)
                del self._loads[rid]
                logger.info("kv load cancelled req=%s transfer=%s (request finished)", rid, key)
                continue
            payload = self._recv.pop(key)
            if payload is not None:
                try:
                    err = self._apply(load, payload)
                except Exception as e:  # noqa: BLE001 - a peer's bad payload must not kill the worker
                    err = f"malformed payload: {type(e).__name__}: {e}"
                del self._loads[rid]
                out.finished_recving.add(rid)
                if err:
                    out.failed_recving.add(rid)
                    logger.error("kv load failed req=%s transfer=%s error=%s", rid, key, err)
                else:
                    logger.info(
                        "kv loaded req=%s transfer=%s tokens=%d blocks=%d wait_ms=%.1f%s",
                        rid, key, load.spec.num_tokens, len(load.spec.dst_block_ids),
                        (now - load.started) * 1e3,
                        " CORRUPTED(test)" if load.spec.corrupt_for_test else "",
                    )
            elif now > load.deadline:
                self._recv.discard(key)
                del self._loads[rid]
                out.finished_recving.add(rid)
                out.failed_recving.add(rid)
                logger.error("kv load timed out req=%s transfer=%s after %.1fs",
                             rid, key, self._cfg.kv_load_timeout_s)
        return out

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._sender.join(timeout=2.0)
        self._transport.close()

"""The per-worker KV engine: one control socket at ``kv_ip:kv_port + rank``, a
producer (P: ``producer.py``) and a consumer (D: ``consumer.py``).

Send modes, as upstream P2pNcclConnector defines them:
- PUT: the worker sends synchronously after the forward pass that completed the
  prompt; blocks are free as soon as the step ends.
- PUT_ASYNC (default): a per-peer sender thread ships views of the cache blocks;
  the scheduler keeps the blocks until ``poll`` reports the send finished. Layer-wise
  (``send_granularity``; over tcp by default) each layer goes as soon as the forward pass
  wrote it (``save_layer``), the rest at the step's end (``save``).
- GET: the worker copies the blocks into its own buffer; D pulls them.

Control ops served here: ``reserve`` (room for a payload, before its bytes),
``put`` (a whole payload, or one run of layers of a layer-wise sender's, joined by
``connector.assembly``), ``abort`` (the sender gave a transfer up), ``get`` / ``release`` (GET
mode), ``ready`` (is a transfer's KV here: asked by this instance's scheduler), ``hello``
(first contact: TP, block layout and the KV protocol version; a caller of another version is
refused), ``ping``, ``stats``. The messages are typed in ``xpyd_wire.kv_transfer``. Every wait is bounded: sends by ``send_timeout_s``,
loads by ``kv_load_timeout_s``, buffered payloads by ``buffer_ttl_s``.

With ``kv_secret`` set, the socket serves only calls authenticated with a key
derived from it (``connector.transport.auth``); whatever the secret, a message
larger than ``kv_buffer_size`` allows never reaches ``_handle``. Refused messages
are counted by reason (op ``stats``, ``vllm:xpyd_kv_refused_messages_total``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from connector import affinity, tp
from connector import layout as kvlayout
from connector.arrivals import ArrivalWriter, board_path
from connector.assembly import PartAssembler
from connector.buffer import GONE, KVBuffer, Payload
from connector.config import ConnectorConfig, is_loopback
from connector.consumer import Consumer
from connector.log import get_logger
from connector.metadata import LoadSpec, SaveSpec
from connector.producer import Producer
from connector.staging import RecvStager, store_received
from connector.stats import StatsRecorder
from connector.transport import KVAuth, Transport
from connector.transport import make_transport as transport_factory
from connector.transport.wire import printable
from xpyd_wire.kv_transfer import (
    KEYED_OPS,
    KV_PROTOCOL_VERSION,
    OP_KEY,
    VERSION_KEY,
    Hello,
    Op,
    PutHeader,
    Refusal,
    is_part,
    ok,
    version_mismatch,
)
from xpyd_wire.request_id import rank_address

logger = get_logger(__name__)

# How often buffered payloads, reservations and failure records are checked
# against their TTL. Its own thread: an idle engine gets no poll() from vLLM.
_SWEEP_S = 0.5
# Bytes a control message may carry beyond the KV it announces (its header).
_HEADER_SLACK = 1 << 20


@dataclass(slots=True)
class PollResult:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


def make_transport(cfg: ConnectorConfig, device: torch.device, cpus: affinity.CpuPlan | None,
                   max_msg_bytes: int | None, max_frames: int | None = None,
                   auth: KVAuth | None = None) -> Transport:
    """The transport the config names: nccl for CUDA caches under "auto" (tcp when NCCL does
    not load), tcp on CPU. The tcp knobs apply to the nccl transport's control socket."""
    return transport_factory(cfg.transport, device, num_channels=cfg.nccl_num_channels, cpus=cpus,
                             max_msg_bytes=max_msg_bytes, max_frames=max_frames, auth=auth,
                             byte_stream=cfg.byte_stream, max_connections=cfg.kv_max_connections,
                             max_connections_per_host=cfg.kv_max_connections_per_host)


def _refusal(key: str, why: str, part: object = None) -> dict[str, Any]:
    """The reply to a payload (or part) this buffer will not take. One whose requests are all
    gone here is no failure: nobody would load it, and the sender is told so (``gone``)."""
    at = "" if part is None else f" part={part}"
    if why == GONE:
        logger.info("kv transfer=%s%s not taken: no request here needs it any more (finished, aborted, "
                    "or served from this instance's prefix cache)", key, at)
        return Refusal(why, gone=True).encode()
    logger.warning("refused kv transfer=%s%s reason=%s", key, at, why)
    return Refusal(why).encode()


def _arrival_writer(address: str) -> ArrivalWriter | None:
    """This rank's arrival board, or None (loads are then planned by asking the control socket)."""
    try:
        return ArrivalWriter(board_path(address))
    except OSError as e:
        logger.warning("kv arrival board for %s not made (the scheduler asks the worker instead): %s", address, e)
        return None


class KVEngine:
    def __init__(
        self,
        cfg: ConnectorConfig,
        rank: int,
        kv_caches: dict[str, torch.Tensor],
        block_layout: kvlayout.BlockLayout,
        transport: Transport | None = None,
        cpus: affinity.CpuPlan | None = None,
        tp_side: tp.TpSide | None = None,
    ) -> None:
        self._cfg = cfg
        self._rank = rank
        # This instance's tensor parallelism, told to peers at first contact ("hello").
        self._tp = tp_side or tp.TpSide(1, block_layout.num_kv_heads)
        self._caches = kv_caches
        self._layer_names = list(kv_caches)
        self._layout = block_layout
        # Axis of the heads in the (regrouped) cache views: head slices for heterogeneous TP.
        self._head_axis = kvlayout.HEAD_AXIS + (1 if block_layout.kernel_ratio > 1 else 0)
        self._device = next(iter(kv_caches.values())).device
        # GPU: received KV beyond kv_buffer_size of device memory goes to a pinned host pool.
        self._stager = (RecvStager(cfg.kv_buffer_size, int(cfg.mem_pool_size_gb * (1 << 30)))
                        if self._device.type == "cuda" else None)
        # Set by whatever moves a transfer on (KV stored or failed here, a send of ours ended):
        # an idle step's poll waits on it (cfg.idle_wait_ms) instead of vLLM spinning.
        self._progress = threading.Event()
        self._begins = 0  # transfers a sender began here (a begin ends a wait for one)
        # A reservation whose bytes did not come within the sender's deadline never will.
        self._recv = KVBuffer("recv", self._stager.capacity if self._stager else cfg.kv_buffer_size, cfg.buffer_ttl_s,
                              reservation_ttl_s=cfg.send_timeout_s + 1.0, changed=self._progress)
        # GET: P keeps copies until D pulls them; when full, the oldest unread go first.
        self._sendbuf = KVBuffer("send", cfg.kv_buffer_size, cfg.buffer_ttl_s, evict_lru=True)
        # Layer-wise senders' payloads, part by part, inside their reservation in _recv.
        self._parts = PartAssembler(self._recv)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._stop = threading.Event()
        self._cpus = cpus
        # CUDA: events marking when the blocks of a transfer were written (the forward pass)
        # and when GET's copy of them was made, by transfer key, with their creation time.
        # Readers on other threads/streams wait on these, never on the host.
        self._written: dict[str, tuple[Any, float]] = {}
        self._copied: dict[str, tuple[Any, float]] = {}
        # Transfer counters for vLLM's connector stats (/metrics), fed by every thread.
        self.xfer_stats = StatsRecorder()
        # A payload is at most one tensor per run of blocks per layer: frames beyond that
        # (each costs memory even when empty) are no payload of ours.
        max_frames = 2 + len(kv_caches) * max(1, int(next(iter(kv_caches.values())).shape[0]))
        self._transport = transport or make_transport(
            cfg, self._device, cpus, cfg.kv_buffer_size + _HEADER_SLACK, max_frames,
            KVAuth.from_secret(cfg.kv_secret, cfg.kv_auth) if cfg.kv_secret else None)
        self._transport.on_refuse = self.xfer_stats.refused
        self._transport.on_fallback = self.xfer_stats.fallback  # nccl -> host-staged tcp, per peer
        self._device_native = bool(getattr(self._transport, "device_native", False))
        # P ships each layer's blocks as the forward pass writes them (save_layer), else the
        # whole prompt's at the step's end (save).
        self.layerwise = cfg.layerwise_on(self._transport.name)
        self.producer = Producer(cfg, rank, self._transport, self._payload, self._sendbuf, cpus, self.xfer_stats,
                                 self.check_peer, self._tp, self._progress, num_layers=len(self._layer_names))
        self.consumer = Consumer(cfg, rank, self._transport, kv_caches, block_layout, self._recv, cpus,
                                 self.xfer_stats, self._stager,
                                 lambda header: self.check_peer(header, we_send=False), self._tp, self._head_axis)
        self.address = rank_address(cfg.advertised_address, rank)
        # D: tells this instance's scheduler, through shared memory, which transfers' KV is
        # here (a synchronous load without asking the control socket). Named after the port,
        # so made once the port is ours; a payload stored before that, or with no board, is
        # found by the scheduler asking, as it always could.
        self._arrivals: ArrivalWriter | None = None
        host, _, port = self.address.rpartition(":")
        self._transport.start(host, int(port), self._handle)
        if cfg.loads_sync:
            self._arrivals = _arrival_writer(self.address)
        if not getattr(self._transport, "authenticated", False) and not is_loopback(host):
            # Only with allow_unauthenticated_kv (the config refuses it otherwise).
            logger.warning(
                "kv port %s is unauthenticated (allow_unauthenticated_kv): anyone who reaches it can put KV for a "
                "transfer (served by vLLM's prefix cache to others), read or fail transfers. Set kv_secret "
                "(or XPYD_KV_SECRET, or discovery_secret) alike on every instance, or keep the port on a network "
                "only trusted peers reach", self.address)
        self._sweeper = threading.Thread(target=self._sweep, name="xpyd-kv-sweep", daemon=True)
        self._sweeper.start()
        logger.info(
            "kv engine up address=%s rank=%d transport=%s send_type=%s%s layout=%s auth=%s",
            self.address, rank, self._transport.name, cfg.send_type, " layer-wise" if self.layerwise else "",
            block_layout,
            cfg.kv_auth if getattr(self._transport, "authenticated", False) else "none",
        )

    # ---- bookkeeping visible to tests, logs and the heartbeat ----
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
            "recv_reserved_bytes": self._recv.reserved_bytes,
            "recv_items": len(self._recv),
            "send_bytes": self._sendbuf.used_bytes,
            "send_items": len(self._sendbuf),
            "pending_sends": self.producer.pending,
            "pending_loads": self.consumer.pending,
            "partial_payloads": len(self._parts),
        }

    def refusals(self) -> dict[str, int]:
        """Messages the control socket refused before serving them, by reason."""
        return self._transport.refusals()

    # ---- server side (transport thread) ----
    def _begun(self, key: str) -> None:
        """Tell this instance's scheduler, through the arrival board, that a sender began the
        transfer (a piece's key names its transfer): a request waiting for it may take blocks."""
        if self._arrivals is not None:
            self._arrivals.publish_begun(key.rpartition("/")[0] or key)
        self._begins += 1  # one writer: the transport thread
        self._progress.set()  # an idle step waiting for a sender to begin looks again

    def _handle(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        op = header.get(OP_KEY)
        key = header.get("key")
        if op in KEYED_OPS and not isinstance(key, str):
            return Refusal(f"{op} without key").encode(), []
        if op == Op.RESERVE:
            nbytes = header.get("nbytes")
            if type(nbytes) is not int or nbytes < 0:
                return Refusal("reserve needs nbytes").encode(), []
            refused = self._recv.reserve(key, nbytes)
            self._begun(key)  # room promised, or refused (recorded as failed): either way, begun
            if refused:
                return _refusal(key, refused), []
            return ok(), []
        if op == Op.PUT:
            self._begun(key)
            if is_part(header):  # a layer-wise sender: the payload comes a run of layers at a time
                payload, refused = self._parts.add(key, header, tensors)
                if refused:
                    return _refusal(key, refused, header.get("part")), []
                if payload is None:
                    return ok(), []
            else:
                payload = Payload.of(header, tensors)
            refused = store_received(self._recv, self._stager, key, payload)
            if refused:
                return _refusal(key, refused), []
            self.xfer_stats.moved("received", payload.nbytes)
            if self._arrivals is not None:
                whole = key.rpartition("/")[0] or key  # a piece's transfer (tp.piece_key)
                if self.consumer.ready(whole):  # every piece of it is here
                    self._arrivals.publish(whole)
            return ok(), []
        if op == Op.ABORT:
            keys = header.get("keys")
            if not isinstance(keys, dict):
                return Refusal("abort needs keys").encode(), []
            for k, why in keys.items():
                if isinstance(k, str) and self._recv.fail(k, str(why)):
                    self._parts.drop(k)
                    self._begun(k)  # a load waiting for it fails at once
                    logger.warning("kv transfer=%s will not come: %s", k, why)
            return ok(), []
        if op == Op.GET:
            # Not popped: a reply lost to a timeout must be retrievable again.
            # D sends "release" once it holds the payload; the TTL covers the rest.
            payload = self._sendbuf.peek(key)
            copied = self._copied.get(key)
            if payload is not None and copied is not None:
                # The reply is sent on the transport's stream, ordered after this thread's.
                torch.cuda.current_stream(self._device).wait_event(copied[0])
            if payload is None:
                why = self._sendbuf.failure(key)
                if why is not None:
                    return Refusal(why, final=True).encode(), []
                return Refusal("not ready").encode(), []
            return ok(**payload.header), payload.tensors
        if op == Op.RELEASE:
            # GET: D holds the payload now; this is where P's send ends.
            payload = self._sendbuf.pop(key)
            if payload is not None:
                self.xfer_stats.transfer("send", "ok", payload.nbytes, "sent")
            return ok(), []
        if op == Op.READY:  # this instance's scheduler: is a transfer's KV here (a synchronous load)?
            return ok(ready=isinstance(key, str) and self.consumer.ready(key)), []
        if op == Op.PING:
            return ok(address=self.address), []
        if op == Op.HELLO:  # first contact: what a sender must match before shipping KV
            # A caller that says no version is answered (tools ask too): it judges our version.
            why = version_mismatch(header[VERSION_KEY]) if VERSION_KEY in header else None
            if why is not None:
                logger.error("refused a hello from a kv peer: %s", why)
                return Refusal(f"the peer at {self.address} refused the hello: it speaks kv protocol version "
                               f"{KV_PROTOCOL_VERSION}, the hello said {printable(str(header[VERSION_KEY]), 40)}; "
                               "run the same xPyD release on prefill and decode").encode(), []
            return self._hello().encode(), []
        if op == Op.STATS:
            out = ok(**self.stats(), refused=self._transport.refusals(),
                   # KV (and any tensor) bytes that came over the tcp transport's byte stream, ever.
                     stream_received_bytes=getattr(self._transport, "stream_received_bytes", 0))
            fallbacks = getattr(self._transport, "fallbacks", None)  # nccl: peers on the host path, and why
            if callable(fallbacks):
                out["fallbacks"] = fallbacks()
            return out, []
        # unknown_op: a caller's optional feature (e.g. nccl set-up) is not served here.
        return Refusal(f"unknown op {op!r}", unknown_op=True).encode(), []

    def _hello(self) -> Hello:
        return Hello(rank=self._rank, tp_size=self._tp.tp_size, num_kv_heads=self._tp.num_kv_heads,
                     is_mla=self._tp.is_mla, layout=self._layout.layout, dtype=self._layout.dtype,
                     block_shape=tuple(self._layout.block_shape))

    def check_peer(self, hello: dict[str, Any], we_send: bool = True) -> str | None:
        """Why KV cannot move between this instance and the peer described by ``hello`` (a
        hello reply, or a payload header), or None. ``we_send``: this side is the prefill."""
        try:
            peer = tp.TpSide(int(hello["tp_size"]), int(hello["num_kv_heads"]), bool(hello["is_mla"]))
            prefill, decode = (self._tp, peer) if we_send else (peer, self._tp)
            why = tp.supported_by_data_path(prefill, decode, get_mode=self._cfg.send_type == "GET")
            if why is None:
                hello, why = self._as_local_heads(hello, peer)
        except tp.TopologyError as e:
            why = str(e)
        except (KeyError, TypeError, ValueError) as e:
            return f"malformed hello from peer: {type(e).__name__}: {e}"
        if why is None:
            why = self._layout.mismatch(hello)
            if why and we_send:
                why = f"peer cannot take this KV: {why}"
        return why

    def _as_local_heads(self, hello: dict[str, Any], peer: tp.TpSide) -> tuple[dict[str, Any], str | None]:
        """A peer's block description with its head count replaced by ours, when the TP
        sizes give the two sides different heads per rank: blocks then move as head slices,
        so everything but the head axis must match. Refused when a cache's head axis does
        not hold the heads its TP size says (heads are not a sliceable axis of it)."""
        if peer.local_heads == self._tp.local_heads:
            return hello, None
        i = self._head_axis - 1  # the head axis within one block
        shape = list(hello.get("block_shape") or [])
        for who, side, have in (("this instance", self._tp, self._layout.block_shape[i]),
                                ("the peer", peer, shape[i] if len(shape) > i else None)):
            if have != side.local_heads:
                return hello, (f"{who} (tp={side.tp_size}, {side.num_kv_heads} kv heads) holds {have} heads on its "
                               f"cache's head axis, not {side.local_heads}: cannot split its blocks by head for "
                               f"a different TP size (this tp={self._tp.tp_size}, peer tp={peer.tp_size})")
        shape[i] = self._layout.block_shape[i]
        return {**hello, "block_shape": shape}, None

    def _sweep(self) -> None:
        affinity.pin_current_thread(self._cpus)
        while not self._stop.wait(_SWEEP_S):
            self._drop_events(time.monotonic() - self._cfg.send_timeout_s - self._cfg.buffer_ttl_s)
            self._recv.expire()
            self._parts.sweep()  # parts of transfers whose reservation expired
            self._sendbuf.expire()

    def _drop_events(self, older_than: float) -> None:
        """Forget events of transfers long over (cancelled sends, payloads gone)."""
        for table in (self._written, self._copied):
            for key in [k for k, (_, t) in list(table.items()) if t < older_than]:
                table.pop(key, None)

    # ---- producer (worker thread, and the per-peer sender threads) ----
    def _payload(self, spec: SaveSpec, copy: bool, heads: slice | None = None, layers: tuple[int, int] | None = None,
                 after: Any = None, piece: dict[str, Any] | None = None,
                 ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The put header and blocks of ``spec`` (only ``heads`` of each, for a decode rank of another TP
        size: then one packed tensor per layer). ``layers``: only layers [lo, hi), as one part
        of a layer-wise send; ``after``: the CUDA event that marks them written; ``piece``: the
        ``PutHeader`` fields of a head slice (its own key, piece, pieces, src_rank, heads)."""
        if layers is None:  # the whole payload: after the event save() recorded, if any
            written = self._written.pop(spec.transfer_key, None)
            after = written[0] if written is not None else None
        if after is not None:  # CUDA: read the blocks only after the forward pass wrote them
            torch.cuda.current_stream(self._device).wait_event(after)
        tensors: list[torch.Tensor] = []
        run_lens: list[int] | None = None
        names = self._layer_names if layers is None else self._layer_names[layers[0]:layers[1]]
        # The block ids as an index tensor once for all layers (on CUDA each is an H2D copy).
        idx = (kvlayout.index(spec.block_ids, self._caches[names[0]].device)
               if names and (heads is not None or self._device_native) else None)
        for name in names:
            if heads is not None:
                parts = [kvlayout.gather_packed(self._caches[name], idx, heads=heads, head_axis=self._head_axis)]
                copy = False  # a copy already
            elif self._device_native:
                # One batched gather per layer: one NCCL op (not one per run of blocks), and
                # a copy of its own, which GET needs anyway.
                parts = [kvlayout.gather_packed(self._caches[name], idx)]
                copy = False
            else:
                parts = kvlayout.gather(self._caches[name], spec.block_ids, self._layout)
            if run_lens is None:
                run_lens = [p.shape[0] for p in parts]
            for p in parts:
                # GET must own its copy (blocks get freed): on the device when the transport
                # moves device memory (nccl), else in host memory, which tcp moves.
                stays = p.device.type == "cpu" or self._device_native  # where the transport reads it
                if copy:
                    p = p.clone() if stays else p.to("cpu", copy=True)
                elif not stays:
                    p = p.to("cpu")
                tensors.append(p)
        header = PutHeader(
            key=spec.transfer_key, num_tokens=spec.num_tokens,
            num_blocks=spec.first_block + len(spec.block_ids), first_block=spec.first_block,
            layers=self._layer_names, runs=run_lens or [],
            layout=self._layout.layout, dtype=self._layout.dtype, block_shape=list(self._layout.block_shape),
            # D checks these: rank r to rank r is right only for equal TP
            tp_size=self._tp.tp_size, num_kv_heads=self._tp.num_kv_heads, is_mla=self._tp.is_mla,
            part=layers,
        )
        if piece:
            header = replace(header, **piece)
        return header.encode(), tensors

    def _mark_written(self) -> Any:
        """CUDA: an event after what this thread's stream has queued (the forward pass so far)."""
        if self._device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def save_layer(self, spec: SaveSpec, layer_name: str) -> None:
        """Layer-wise sends: this layer's blocks of ``spec`` are written (its attention ran)."""
        i = self._layer_index.get(layer_name) if self.layerwise else None
        if i is not None:  # a layer without a cache of ours: the end of the forward covers it
            self.producer.save_layer(spec, i, self._mark_written())

    def save(self, spec: SaveSpec) -> None:
        if self.layerwise:  # the forward pass is over: every layer may go
            self.producer.seal(spec, self._mark_written())
            return
        if self._device.type == "cuda":
            # The forward pass that wrote these blocks may still be running on this thread's
            # stream: the sender thread and the transport's stream wait for this event.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
            self._written[spec.transfer_key] = (event, time.monotonic())
        self.producer.save(spec)
        if self._device.type == "cuda" and self._cfg.send_type == "GET":
            event = torch.cuda.Event()  # GET's copy was enqueued on this thread's stream
            event.record(torch.cuda.current_stream(self._device))
            self._copied[spec.transfer_key] = (event, time.monotonic())

    def wait_sends(self, req_ids: list[str]) -> None:
        self.producer.wait_sends(req_ids)

    # ---- consumer (worker thread) ----
    def add_load(self, spec: LoadSpec) -> None:
        if spec.sync:
            self.consumer.load_now(spec)
        else:
            self.consumer.add_load(spec)

    def take_invalid_blocks(self) -> set[int]:
        return self.consumer.take_invalid_blocks()

    def release(self, keys: list[str]) -> None:
        self.consumer.release(keys)

    def poll(self, finished_req_ids: set[str], wait_s: float = 0.0, awaiting: bool = False) -> PollResult:
        """Complete what can be completed; called once per step by the worker.

        ``wait_s`` > 0 (a step that computes nothing): when nothing completed but loads or
        sends are pending, or requests wait for a sender to begin (``awaiting``: a begin
        wakes the wait), wait up to that long for one of them to move, then look again.
        vLLM's engine loop would otherwise run empty steps back to back until the KV
        arrives or the send ends; on a CPU box shared with another engine that loop could
        hold the other one off for seconds (scripts/bench_kv_wait.py)."""
        if wait_s > 0:
            self._progress.clear()  # before looking: whatever happens after it wakes the wait
        begins = self._begins
        result = self._poll_once(finished_req_ids)
        if (wait_s > 0 and not (result.finished_sending or result.finished_recving)
                and (awaiting or self.consumer.pending or self.producer.pending)):
            deadline = time.monotonic() + wait_s
            # Bounded: each pass waits out the rest of wait_s or ends on what woke it.
            while (left := deadline - time.monotonic()) > 0 and self._progress.wait(left):
                self._progress.clear()
                more = self._poll_once(set())
                result.finished_sending |= more.finished_sending
                result.finished_recving |= more.finished_recving
                result.failed_recving |= more.failed_recving
                if (result.finished_sending or result.finished_recving or result.failed_recving
                        or (awaiting and self._begins != begins)):
                    break  # a sender's begin ends the wait only when a request waits for one
        return result

    def _poll_once(self, finished_req_ids: set[str]) -> PollResult:
        recving, failed = self.consumer.poll(finished_req_ids)
        return PollResult(self.producer.finished_sending(finished_req_ids), recving, failed)

    def close(self) -> None:
        self._stop.set()
        self.producer.close()
        self.consumer.close()
        self._sweeper.join(timeout=2.0)
        self._transport.close()
        if self._arrivals is not None:
            self._arrivals.close()
        if self._stager is not None:
            self._stager.close()

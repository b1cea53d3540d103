"""Producer side of the worker's KV engine (runs on P).

Sends go through one queue per decode peer, each served by its own thread, so a
dead or slow D delays only the transfers meant for it. A peer that failed a
call is marked dead: its queued sends fail at once (their blocks are freed)
until it answers a probe again. When a send fails, P tells D that the transfer
will not come (an ``abort`` notice, delivered as soon as D answers), so D's
load fails at its next poll instead of at its deadline.

Every send first reserves room in D's buffer and ships the bytes only once D
agreed: D's memory is bounded before it is spent.

Before the first KV to a decode instance, P asks it ``hello`` (its KV protocol version,
its rank's TP size, KV heads, block layout; cached, asked again after the peer came back) and
refuses at once what cannot be mapped or speaks another protocol version
(``xpyd_wire.kv_transfer``). With equal TP, worker rank r sends whole blocks to D's rank r;
with different TP sizes it sends each D rank the head slice that rank owns
(``connector.p2p.tp``), each piece under its own key, and D loads once it has all pieces.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from connector.p2p import tp
from connector.affinity import CpuPlan, pin_current_thread
from connector.p2p.buffer import KVBuffer, Payload, tensor_bytes
from connector.config import ConnectorConfig
from connector.log import get_logger
from connector.p2p.metadata import SaveSpec
from connector.stats import StatsRecorder
from connector.transport import HandshakeRefused, Transport, TransportError, TransportRefused
from xpyd_wire.kv_transfer import (
    ERROR_KEY,
    GONE_KEY,
    OK_KEY,
    REFUSED_KEY,
    UNKNOWN_OP_KEY,
    VERSION_KEY,
    Abort,
    Hello,
    Ping,
    Reserve,
    ok,
    version_mismatch,
)
from xpyd_wire.request_id import rank_address

logger = get_logger(__name__)

# A dead peer is probed this often; a probe waits at most this long for its answer.
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0
# A peer thread with nothing to do for this long exits (a new send restarts it).
PEER_IDLE_EXIT_S = 30.0
# Abort notices not yet delivered are kept at most this many per peer.
MAX_PENDING_NOTICES = 4096

# Builds (put header, tensors) for a send (xpyd_wire.kv_transfer.PutHeader, encoded); copy=True
# gives P its own copy (GET); a third argument (a slice of this rank's heads) gives only those
# heads of each block, ``piece`` the header fields of such a slice.
PayloadBuilder = Callable[..., tuple[dict[str, Any], list[torch.Tensor]]]
# Checks a peer's "hello" (layout, dtype, block shape, TP): None, or why KV cannot go there.
PeerCheck = Callable[[dict[str, Any]], str | None]
# An incompatible peer is asked again after this long (it may have been reconfigured).
RECHECK_S = 30.0
# A send slower than this is logged at WARNING with where its time went.
SLOW_SEND_S = 1.0
# Layer-wise sends: a forward pass that writes no further layer for this long is not running
# (the worker died or vLLM stopped calling save_kv_layer); the send gives up. Generous: one
# layer of a long chunk takes seconds on a small CPU.
FORWARD_WAIT_S = 300.0
# Layer-wise sends queued while others are on their way join them, layer run by layer run, so a
# prompt that completed in the same step as another does not wait for the other's last layer.
MAX_COHORT = 64


class LayerProgress:
    """Layer-wise sends: how many of a prompt's layers (in cache order) the forward pass has
    written. The worker thread advances it per layer (``save_kv_layer``) and seals it when the
    forward pass is over (``wait_for_save``: every layer written, also those whose attention
    did not report); each change sets ``wake``, which the peer thread waits on."""

    def __init__(self, layers: int, wake: threading.Event | None = None) -> None:
        self.layers = layers
        self.ready = 0
        # Per ready layer: the CUDA event after its write (None on CPU).
        self.events: list[Any] = []
        self.sealed_at: float | None = None
        # Layers vLLM reported written before the forward pass ended (save_kv_layer): all of
        # them when layer-wise sends work, 0 when vLLM never called it (the log says so).
        self.reported = 0
        self.wake = wake or threading.Event()
        self._lock = threading.Lock()

    def advance(self, layer: int, event: Any = None) -> None:
        with self._lock:
            if layer != self.ready or self.sealed_at is not None:
                return  # out of order or repeated: the seal covers it
            self.ready += 1
            self.events.append(event)
        self.wake.set()

    def seal(self, event: Any = None) -> None:
        with self._lock:
            self.reported = self.ready
            self.events.extend([event] * (self.layers - self.ready))
            self.ready = self.layers
            self.sealed_at = time.monotonic()
        self.wake.set()

    def written(self) -> tuple[int, Any]:
        """(layers written so far, the CUDA event of the last of them)."""
        with self._lock:
            return self.ready, self.events[self.ready - 1] if self.ready else None

    def lag_ms(self, now: float) -> float:
        """ms from the end of the forward pass to ``now`` (0 when the last byte was there first)."""
        return max(0.0, now - self.sealed_at) * 1e3 if self.sealed_at is not None else 0.0


@dataclass(slots=True)
class SendPhases:
    """Where one send's time went (ms per phase: contact, build, reserve, put)."""

    ms: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.ms[name] = self.ms.get(name, 0.0) + (now - since) * 1e3
        return now

    def describe(self) -> str:
        return ",".join(f"{k}:{v:.1f}" for k, v in self.ms.items())


@dataclass(slots=True)
class Send:
    spec: SaveSpec
    done: threading.Event = field(default_factory=threading.Event)
    # queued -> sending -> done, or queued -> cancelled (preempted before it
    # started: its blocks are about to be reused, so it must never start).
    state: str = "queued"
    lock: threading.Lock = field(default_factory=threading.Lock)
    # When the forward pass that wrote the blocks ended (save): a send's log line counts from
    # here, so its total is the KV arrival lag (forward end -> D acknowledged every byte).
    created: float = field(default_factory=time.monotonic)
    # Set too when the send ends: a worker waiting in an idle step wakes (engine.poll).
    progress: threading.Event | None = None
    # Layer-wise: the layers written so far (None: the whole payload is written already).
    layers: LayerProgress | None = None

    def finish(self) -> None:
        self.done.set()
        if self.progress is not None:
            self.progress.set()

    def claim(self) -> bool:
        """Peer thread: move queued -> sending; False if it was cancelled."""
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
class _Flight:
    """One layer-wise send on its way: the layers shipped so far, the ranks it goes to."""

    send: Send
    lo: int = 0  # layers [0, lo) shipped to every live rank
    live: list[tuple[str, tp.Route | None]] = field(default_factory=list)  # ranks that took every part so far
    pending: list[str] | None = None  # ranks not served yet (None: before first contact)
    sent: int = 0
    ok: bool = True
    phases: SendPhases = field(default_factory=SendPhases)


class PeerSender:
    """The send queue of one decode instance (the ranks this worker rank sends to), served
    by one thread. ``instance``: the decode's rank-0 kv address."""

    def __init__(self, instance: str, transport: Transport, cfg: ConnectorConfig, build: PayloadBuilder,
                 cpus: CpuPlan | None, stop: threading.Event, stats: StatsRecorder | None = None,
                 check: PeerCheck | None = None, rank: int = 0, local: tp.TpSide | None = None) -> None:
        self.instance = instance
        self._rank = rank
        self._local = local
        # The rank of the same number (equal TP): asked hello and probed; rank 0 when that is
        # no rank of the decode (it has fewer ranks than we have).
        self.home = rank_address(instance, rank)
        self.peer = self.home
        self._check = check
        # First contact: None until the peer's hello was checked; then (why or None, when).
        self._contact: tuple[str | None, float] | None = None
        # Where each send goes, set at first contact: (address, None) ships whole blocks (equal
        # TP), (address, route) the route's head slice. Empty: our heads come from a replica.
        self._routes: list[tuple[str, tp.Route | None]] = [(self.home, None)]
        self._stats = stats or StatsRecorder()
        self._transport = transport
        self._cfg = cfg
        self._build = build
        self._cpus = cpus
        self._stop = stop
        self._cond = threading.Condition()
        self._queue: deque[Send] = deque()
        self._notices: dict[str, dict[str, str]] = {}  # address -> transfer key -> why it will not come
        self._thread: threading.Thread | None = None
        self.dead_since: float | None = None  # monotonic; None while the peer answers
        self._unawaited = False  # the peer thread is in a call close() does not wait for
        self._contact_wanted = False  # prepare() asked for first contact ahead of a send
        # Set by the worker thread whenever a layer-wise send of this peer has more layers.
        self.layers_written = threading.Event()

    # ---- called from the worker thread ----
    def submit(self, send: Send) -> None:
        with self._cond:
            self._queue.append(send)
            self._ensure_thread()
            self._cond.notify()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=f"xpyd-kv-send:{self.peer}", daemon=True)
            self._thread.start()

    @property
    def contacted(self) -> bool:
        """Whether this peer's hello was answered and checked (first contact is behind us)."""
        return self._contact is not None

    def prepare(self) -> None:
        """Make first contact in the peer thread now, ahead of the send (PUT_ASYNC only: the
        peer thread is then the only one that touches the contact state)."""
        with self._cond:
            if self._contact is not None or self.dead_since is not None or self._contact_wanted:
                return
            self._contact_wanted = True
            self._ensure_thread()
            self._cond.notify()

    def _early_contact(self) -> None:
        try:
            self._first_contact(time.monotonic() + self._cfg.send_timeout_s)
        except TransportError as e:  # the send tries again within its own deadline
            logger.info("kv peer %s: first contact ahead of the send failed: %s", self.instance, e)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
        self.layers_written.set()  # a layer-wise send waiting for the forward pass looks again

    def join(self, timeout: float) -> None:
        """Wait for the peer thread to stop, but not through a probe or an abort notice to a
        dead peer (``_call_unawaited``): that would hold close() for up to its timeout."""
        t = self._thread
        if t is not None and not self._unawaited:
            t.join(timeout)

    def send_now(self, send: Send) -> None:
        """PUT mode: send from the calling (worker) thread, bounded by send_timeout_s;
        at once a failure while the peer is marked dead."""
        if self.dead_since is not None:
            self._fail([send], f"peer {self.peer} unreachable since {time.monotonic() - self.dead_since:.1f}s")
            return
        self._send(send)

    # ---- the peer thread ----
    def _run(self) -> None:
        pin_current_thread(self._cpus)
        idle_since = time.monotonic()
        while not self._stop.is_set():
            if self.dead_since is not None and not self._probe():
                with self._cond:
                    sends = list(self._queue)
                    self._queue.clear()
                    if not sends and time.monotonic() - idle_since > PEER_IDLE_EXIT_S:
                        self._thread = None  # a new send starts a thread that probes first
                        return
                if sends:
                    self._fail(sends, f"peer {self.peer} unreachable since "
                                      f"{time.monotonic() - (self.dead_since or 0):.1f}s")
                    idle_since = time.monotonic()
                self._stop.wait(PROBE_INTERVAL_S)
                continue
            with self._cond:
                if not self._queue and not self._notices and not self._contact_wanted:
                    if time.monotonic() - idle_since > PEER_IDLE_EXIT_S:
                        self._thread = None
                        return
                    self._cond.wait(timeout=PROBE_INTERVAL_S)
                    continue
                notices = dict(self._notices)
                self._notices.clear()
                send = self._queue.popleft() if self._queue else None
                early, self._contact_wanted = self._contact_wanted, False
            if notices:
                self._deliver(notices)
                if self._stop.is_set():  # closing: close() may not have waited for the delivery
                    if send is not None:
                        self._fail([send], "kv engine closing")
                    return
            if early and send is None:
                self._early_contact()  # (a queued send makes first contact itself)
            if send is not None and send.layers is not None:
                self._send_layers(send)
            elif send is not None:
                self._send(send)
            idle_since = time.monotonic()

    def _probe(self) -> bool:
        try:
            self._call_unawaited(self.peer, Ping().encode(), PROBE_TIMEOUT_S)
        except TransportError:
            return False
        if self._stop.is_set():
            return False  # closing: close() may not have waited for this probe (join); send nothing
        logger.info("kv peer %s answers again after %.1fs", self.peer, time.monotonic() - (self.dead_since or 0))
        self.dead_since = None
        self._contact = None  # it may have restarted with another configuration
        return True

    def _call_unawaited(self, addr: str, header: dict[str, Any], timeout_s: float) -> None:
        """A call that reads no KV cache (a probe, abort notices): close() does not wait for it,
        since the transport lets a call in flight end after its own close."""
        self._unawaited = True
        try:
            self._transport.call(addr, header, timeout_s=timeout_s)
        finally:
            self._unawaited = False

    def _mark_dead(self, err: Exception) -> None:
        if self.dead_since is None:
            self.dead_since = time.monotonic()
            logger.warning("kv peer %s marked dead: %s", self.peer, err)

    def _fail(self, sends: list[Send], reason: str) -> None:
        for send in sends:
            if send.claim():
                logger.warning("kv send failed req=%s transfer=%s peer=%s error=%s",
                               send.spec.req_id, send.spec.transfer_key, self.peer, reason)
                self._stats.failure("send", "unreachable")
                self._stats.leg("send", send.spec.req_id, False, reason="unreachable")
                self._notice(send.spec.transfer_key, reason)
                send.finish()

    def _targets(self) -> list[str]:
        """The decode ranks our sends go to (where a failed send is told)."""
        return list(dict.fromkeys(addr for addr, _ in self._routes))

    def _notice(self, key: str, reason: str, to: list[str] | None = None) -> None:
        """Queue "this transfer will not come" for the decode ranks ``to`` (all ours by
        default) under the transfer's own key: a decode rank waiting for pieces fails at once
        whichever of them will not come. Delivered by the peer thread as soon as D answers."""
        with self._cond:
            for addr in self._targets() if to is None else to:
                queued = self._notices.setdefault(addr, {})
                if len(queued) < MAX_PENDING_NOTICES:
                    queued[key] = f"sender gave up: {reason}"
            self._ensure_thread()
            self._cond.notify()

    def _deliver(self, notices: dict[str, dict[str, str]]) -> None:
        for i, (addr, keys) in enumerate(notices.items()):
            try:
                self._call_unawaited(addr, Abort(keys).encode(),
                                     min(self._cfg.send_timeout_s, PROBE_TIMEOUT_S * 2))
            except TransportError as e:
                with self._cond:  # keep them for when the peer answers again
                    for a, ks in list(notices.items())[i:]:
                        queued = self._notices.setdefault(a, {})
                        for k, v in ks.items():
                            if len(queued) < MAX_PENDING_NOTICES:
                                queued.setdefault(k, v)
                self._mark_dead(e)
                return

    def _hello(self, deadline: float) -> tuple[dict[str, Any], str]:
        """Ask the decode's rank of our number, or its rank 0 when that is no rank of it
        (unreachable, another engine answers, or rank 0's TP size has no rank of our number):
        (reply, who answered). Raises TransportError when neither answers by ``deadline``.

        First contact opens a connection and may meet a busy peer: it gets the same budget as
        the send it precedes (it had a 2 s cap of its own, which a loaded box's ordinary
        stall outlasted: issue 21). A rank other than 0 asks rank 0 first, with at most half
        of it: a decode with fewer ranks has none of our number, and asking that one would
        wait out the whole budget (an unreachable peer looks like a slow one) and leave rank
        0 nothing (issue 48)."""
        def left(share: float = 1.0) -> float:
            return max(0.05, (deadline - time.monotonic()) * share)

        if self._rank == 0:
            reply, _ = self._transport.call(self.home, Hello.request(), timeout_s=left())
            return reply, self.home
        first = rank_address(self.instance, 0)
        first_reply: dict[str, Any] | None = None
        try:
            first_reply, _ = self._transport.call(first, Hello.request(), timeout_s=left(0.5))
        except TransportError:
            pass
        else:
            size = first_reply.get("tp_size")
            if not first_reply.get(OK_KEY) or (type(size) is int and 0 < size <= self._rank):
                return first_reply, first  # a refusal, or a decode without a rank of our number
        try:
            reply, _ = self._transport.call(self.home, Hello.request(), timeout_s=left())
        except TransportError:
            if first_reply is None:
                raise
            return first_reply, first
        if reply.get(OK_KEY) and reply.get("rank") != self._rank:  # another engine at our number
            if first_reply is None:
                first_reply, _ = self._transport.call(first, Hello.request(), timeout_s=left())
            return first_reply, first
        return reply, self.home

    def _plan(self, reply: dict[str, Any], contact: str) -> str | None:
        """Set where sends go from a checked hello; why not, when we cannot send there."""
        try:
            peer = tp.TpSide(int(reply["tp_size"]), int(reply["num_kv_heads"]), bool(reply["is_mla"]))
        except (KeyError, TypeError, ValueError):
            peer = None  # an engine without TP in its hello: whole blocks, rank r to rank r
        if peer is None or self._local is None or peer.tp_size == self._local.tp_size:
            if contact != self.home:
                return f"decode rank {self._rank} at {self.home} does not answer (rank 0 does)"
            self._routes = [(self.home, None)]
            return None
        self._routes = [(rank_address(self.instance, r.decode_rank), r)
                        for r in tp.routes(self._local, peer, self._rank)]
        logger.info("kv peer %s: tp %d -> %d, rank %d sends %s", self.instance, self._local.tp_size,
                    peer.tp_size, self._rank,
                    [(r.decode_rank, f"heads {r.piece.remote_heads.start}:{r.piece.remote_heads.stop}")
                     for _, r in self._routes if r is not None] or "nothing (a replica sends our heads)")
        return None

    def _first_contact(self, deadline: float) -> tuple[str | None, bool]:
        """Before the first KV to this peer (and again after it came back, or RECHECK_S
        after it could not take it): can it take our KV at all, and which of its ranks get
        which heads? Returns (why not, whether the peer refused the call itself); raises
        TransportError when unreachable by ``deadline``."""
        if self._check is None:
            return None, False
        if self._contact is not None and (self._contact[0] is None or time.monotonic() - self._contact[1] < RECHECK_S):
            return self._contact[0], False
        t0 = time.monotonic()
        reply, contact = self._hello(deadline)
        logger.info("kv peer %s first contact ms=%.1f", contact, (time.monotonic() - t0) * 1e3)
        if reply.get(REFUSED_KEY):  # before its handler (authentication): not an answer to cache
            return f"refused the call: {reply.get(ERROR_KEY)}", True
        self.peer = contact
        if reply.get(OK_KEY):
            why = version_mismatch(reply.get(VERSION_KEY)) or self._check(reply) or self._plan(reply, contact)
        elif reply.get(UNKNOWN_OP_KEY):
            why = version_mismatch(None)  # an engine without hello predates the protocol's versions
        else:
            why = f"hello failed: {reply.get(ERROR_KEY)}"
        if why is not None:
            logger.error("kv peer %s cannot take KV from this instance: %s", self.instance, why)
        self._contact = (why, time.monotonic())
        return why, False

    def _ship(self, spec: SaveSpec, addr: str, route: tp.Route | None, deadline: float,
              phases: SendPhases, part: tuple[int, int, int] | None = None, after: Any = None) -> int | None:
        """Reserve, then send, one payload to one decode rank: the bytes sent, or None when
        D refused it. Raises TransportError. ``part`` (lo, hi, layers): only layers [lo, hi)
        of the payload, written once ``after`` (a CUDA event) ran; the first part reserves
        the whole payload (every layer's blocks have one size)."""
        t = time.monotonic()
        span = {} if part is None else {"layers": part[:2], "after": after}
        if route is None:
            header, tensors = self._build(spec, False, **span)
        else:
            piece = dict(key=tp.piece_key(spec.transfer_key, route.index), piece=route.index, pieces=route.count,
                         src_rank=self._rank, heads=(route.piece.local_heads.start, route.piece.local_heads.stop))
            header, tensors = self._build(spec, False, route.piece.remote_heads, piece=piece, **span)
        nbytes = tensor_bytes(tensors)
        t = phases.add("build", t)
        reply = ok()
        if part is None or part[0] == 0:
            total = nbytes if part is None else nbytes * part[2] // (part[1] - part[0])
            reply, _ = self._transport.call(addr, Reserve(header["key"], total).encode(),
                                            timeout_s=max(0.05, deadline - time.monotonic()))
            t = phases.add("reserve", t)
        if reply.get(OK_KEY):
            reply, _ = self._transport.call(addr, header, tensors, timeout_s=max(0.05, deadline - time.monotonic()))
            phases.add("put", t)
        if reply.get(OK_KEY):
            return nbytes
        if reply.get(GONE_KEY):
            # D finished or aborted every request for this KV, or served it from its own prefix
            # cache: nothing is lost and nobody waits for it (counted per rank, as refusals are).
            logger.info("kv send not needed req=%s transfer=%s peer=%s: D's requests for it are gone",
                        spec.req_id, header["key"], addr)
            self._stats.transfer("send", "unneeded")
            return None
        logger.warning("kv send refused req=%s transfer=%s peer=%s error=%s",
                       spec.req_id, header["key"], addr, reply.get(ERROR_KEY))
        self._stats.failure("send", "refused")
        if route is not None:
            # D knows this piece will not come, but waits for the transfer's key: tell it.
            self._notice(spec.transfer_key, f"piece {route.index} refused: {reply.get(ERROR_KEY)}", [addr])
        return None

    def _absorb(self, flights: list[_Flight], routes: list[tuple[str, tp.Route | None]]) -> None:
        """Take the layer-wise sends queued behind these into them (a send cancelled by a
        preemption is dropped)."""
        with self._cond:
            while self._queue and self._queue[0].layers is not None and len(flights) < MAX_COHORT:
                send = self._queue.popleft()
                if send.claim():
                    flights.append(_Flight(send, live=list(routes), pending=[addr for addr, _ in routes]))
                    flights[-1].phases.add("queue", send.created)

    def _send_layers(self, first: Send) -> None:
        """Layer-wise sends, shipped together: ``first`` and every layer-wise send queued
        while it is on its way. Whenever the forward pass has written more layers of any of
        them, those layers go to every decode rank (the first part reserves the whole
        payload). Each send ends, and is logged, as soon as its last layer is in or a rank
        refused it. A transport failure fails them all (the peer is dead)."""
        if not first.claim():
            return  # cancelled by a preemption before it started
        flights = [_Flight(first)]
        deadline = time.monotonic() + self._cfg.send_timeout_s
        try:
            t = flights[0].phases.add("queue", first.created)
            why, refused = self._first_contact(deadline)
            flights[0].phases.add("contact", t)
            if why is not None:
                self._contact_failed(first.spec, why, refused)
                return
            routes = list(self._routes)
            flights[0].live, flights[0].pending = list(routes), [addr for addr, _ in routes]
            while flights:
                self.layers_written.clear()  # before looking: a layer written after it wakes the wait
                if any(f.send.layers.sealed_at is None for f in flights if f.send.layers is not None):
                    # Only while a forward pass is still writing: a stream of new sends must not
                    # keep this loop (and the abort notices queued behind it) going for ever.
                    self._absorb(flights, routes)
                moved = False
                for f in list(flights):
                    progress = f.send.layers
                    assert progress is not None
                    hi, event = progress.written()
                    if hi <= f.lo:
                        continue
                    moved = True
                    for addr, route in list(f.live):
                        nbytes = self._ship(f.send.spec, addr, route, deadline, f.phases,
                                            (f.lo, hi, progress.layers), event)
                        if nbytes is None or hi == progress.layers:
                            f.pending.remove(addr)
                        if nbytes is None:
                            f.live.remove((addr, route))
                            f.ok = False
                        else:
                            f.sent += nbytes
                    f.lo = hi
                    if f.lo == progress.layers or not f.live:
                        flights.remove(f)
                        self._sent(f.send, f.sent, len(routes), f.phases, f.ok)
                if flights and not moved:
                    t = time.monotonic()
                    if not self.layers_written.wait(FORWARD_WAIT_S):
                        raise RuntimeError(f"the forward pass wrote no further layer in {FORWARD_WAIT_S:g}s")
                    if self._stop.is_set():
                        raise TransportError("kv engine closing")
                    for f in flights:
                        f.phases.add("forward", t)
                    # The deadline counts from when the KV was there to send.
                    deadline = max(deadline, time.monotonic() + self._cfg.send_timeout_s)
        except TransportError as e:
            for f in flights:
                self._failed(f.send.spec, f.phases, e, f.pending)
            self._mark_dead(e)
        except Exception as e:  # noqa: BLE001 - the peer thread must survive any one send
            for f in flights:
                self._failed(f.send.spec, f.phases, e, f.pending)
        finally:
            for f in flights:
                f.send.finish()

    def _contact_failed(self, spec: SaveSpec, why: str, refused: bool) -> None:
        logger.warning("kv send failed req=%s transfer=%s peer=%s error=%s",
                       spec.req_id, spec.transfer_key, self.peer, why)
        # Refused (e.g. another kv_secret): D knows and logs it, as for reserve.
        self._stats.failure("send", "refused" if refused else "invalid")
        self._stats.leg("send", spec.req_id, False, reason="refused" if refused else "invalid")
        if not refused:
            self._notice(spec.transfer_key, why, [self.peer])

    def _sent(self, send: Send, sent: int, ranks: int, phases: SendPhases, ok: bool) -> None:
        """A send is over (every rank took it, or one refused: counted and told already)."""
        if ok:
            spec = send.spec
            self._stats.transfer("send", "ok", sent, "sent")
            # The KV arrival lag: from the end of the forward pass that wrote the blocks.
            layers = send.layers
            took = time.monotonic() - send.created if layers is None else layers.lag_ms(time.monotonic()) / 1e3
            # Layer-wise: how many layers vLLM reported before the forward pass ended (while it
            # is still running, this send's were all reported and shipped before it ended).
            reported = "" if layers is None else (
                f" layers_reported={layers.reported if layers.sealed_at else layers.layers}/{layers.layers}")
            logger.log(logging.WARNING if took > SLOW_SEND_S else logging.INFO,
                       "kv sent%s req=%s transfer=%s tokens=%d blocks=%d bytes=%d peer=%s ranks=%d ms=%.1f "
                       "phases_ms=%s%s", " slowly" if took > SLOW_SEND_S else "", spec.req_id, spec.transfer_key,
                       spec.num_tokens, len(spec.block_ids), sent, self.instance, ranks, took * 1e3,
                       phases.describe(), reported)
            self._stats.leg("send", spec.req_id, True, sent, took * 1e3)  # its span (connector/tracing.py)
        else:  # a rank refused it, or D no longer needed it (logged as such)
            self._stats.leg("send", send.spec.req_id, False, sent, reason="not_taken")
        send.finish()

    def _failed(self, spec: SaveSpec, phases: SendPhases, e: Exception, pending: list[str] | None) -> None:
        """A send failed: count it and tell the decode ranks still waiting for it."""
        self._stats.leg("send", spec.req_id, False, reason=type(e).__name__)
        if isinstance(e, TransportError):
            logger.warning("kv send failed req=%s transfer=%s peer=%s error=%s phases_ms=%s",
                           spec.req_id, spec.transfer_key, self.peer, e, phases.describe())
            # Refused before its handler (another kv_secret, too large): no byte was taken.
            self._stats.failure("send", "refused" if isinstance(e, TransportRefused) else "transport")
            if not isinstance(e, HandshakeRefused):  # else no call reaches D, which knows (and logged it)
                self._notice(spec.transfer_key, str(e), pending)
        else:
            logger.error("kv send failed req=%s transfer=%s peer=%s", spec.req_id, spec.transfer_key, self.peer,
                         exc_info=e)
            self._stats.failure("send", "error")
            self._notice(spec.transfer_key, f"{type(e).__name__}: {e}", pending)

    def _send(self, send: Send) -> None:
        """A whole-request send: every decode rank gets the prompt's blocks in one payload."""
        if not send.claim():
            return  # cancelled by a preemption before it started
        spec = send.spec
        deadline = time.monotonic() + self._cfg.send_timeout_s
        pending: list[str] | None = None  # decode ranks not served yet (None: before first contact)
        phases = SendPhases()
        try:
            t = phases.add("queue", send.created)
            why, refused = self._first_contact(deadline)
            phases.add("contact", t)
            if why is not None:
                self._contact_failed(spec, why, refused)
                return
            routes = list(self._routes)
            pending = [addr for addr, _ in routes]
            sent, ok = 0, True
            for addr, route in routes:
                nbytes = self._ship(spec, addr, route, deadline, phases)
                pending.remove(addr)
                ok = ok and nbytes is not None
                sent += nbytes or 0
            self._sent(send, sent, len(routes), phases, ok)
        except Exception as e:  # noqa: BLE001 - the peer thread must survive any one send
            self._failed(spec, phases, e, pending)
            if isinstance(e, TransportError):
                self._mark_dead(e)
        finally:
            send.finish()


class Producer:
    """Plans nothing (the scheduler did): executes saves and tracks their end."""

    def __init__(self, cfg: ConnectorConfig, rank: int, transport: Transport, build: PayloadBuilder,
                 sendbuf: KVBuffer, cpus: CpuPlan | None, stats: StatsRecorder | None = None,
                 check: PeerCheck | None = None, local: tp.TpSide | None = None,
                 progress: threading.Event | None = None, num_layers: int = 0) -> None:
        self._cfg = cfg
        self._num_layers = num_layers  # layer-wise sends: layers of the cache, in order
        self._progress = progress
        self._local = local  # this instance's TP: which decode ranks get which heads
        self._check = check
        self.stats = stats or StatsRecorder()
        self._rank = rank
        self._transport = transport
        self._build = build
        self._sendbuf = sendbuf
        self._cpus = cpus
        self._stop = threading.Event()
        self._peers: dict[str, PeerSender] = {}
        self._sends: dict[str, Send] = {}  # req_id -> send, worker thread only
        self._finished: set[str] = set()  # req ids the scheduler has finished

    @property
    def pending(self) -> int:
        return len(self._sends)  # len() of a dict is atomic under the GIL

    def peer(self, addr: str) -> PeerSender:
        """The sender of the decode instance whose rank-0 kv address is ``addr``."""
        p = self._peers.get(addr)
        if p is None:
            p = self._peers[addr] = PeerSender(addr, self._transport, self._cfg, self._build, self._cpus,
                                                  self._stop, self.stats, self._check, self._rank, self._local)
        return p

    def prepare(self, addr: str) -> None:
        """PUT_ASYNC: first contact with this decode instance, in its peer thread, now (the
        scheduler announces peers of new requests before their prompt's forward pass)."""
        if self._cfg.send_type == "PUT_ASYNC":
            self.peer(addr).prepare()

    def save(self, spec: SaveSpec) -> None:
        """Called after the forward pass that completed the prompt."""
        if self._cfg.send_type == "GET":
            header, tensors = self._build(spec, True)
            evicted = self._sendbuf.evicted
            refused = self._sendbuf.put(spec.transfer_key, Payload.of(header, tensors))
            for _ in range(self._sendbuf.evicted - evicted):  # only this thread puts
                self.stats.failure("send", "evicted")
            if refused:
                # D's GET is answered with this reason at once, not left waiting.
                self._sendbuf.fail(spec.transfer_key, refused)
                self.stats.failure("send", "refused")
                logger.warning("GET buffer refused transfer=%s reason=%s", spec.transfer_key, refused)
            return
        send = Send(spec, progress=self._progress)
        peer = self.peer(spec.decode_addr)
        if self._cfg.send_type == "PUT":
            peer.send_now(send)  # the step waits, bounded by send_timeout_s
            return
        self._sends[spec.req_id] = send
        peer.submit(send)

    def _layered(self, spec: SaveSpec) -> Send:
        """This step's layer-wise send of ``spec``, queued on its peer at the first layer."""
        send = self._sends.get(spec.req_id)
        if send is None or send.spec is not spec:
            peer = self.peer(spec.decode_addr)
            send = Send(spec, progress=self._progress, layers=LayerProgress(self._num_layers, peer.layers_written))
            self._sends[spec.req_id] = send
            peer.submit(send)
        return send

    def save_layer(self, spec: SaveSpec, layer: int, event: Any = None) -> None:
        """Layer-wise (PUT_ASYNC): layer ``layer`` of the prompt's blocks is written."""
        layers = self._layered(spec).layers
        assert layers is not None
        layers.advance(layer, event)

    def seal(self, spec: SaveSpec, event: Any = None) -> None:
        """Layer-wise: the forward pass is over, every layer may go (also when no layer was
        reported: the whole payload then goes at once)."""
        layers = self._layered(spec).layers
        assert layers is not None
        layers.seal(event)

    def wait_sends(self, req_ids: list[str]) -> None:
        """Preemption: no send may read these requests' blocks after we return.

        A queued send is cancelled (it would otherwise start later, on reused
        blocks; the scheduler plans it again); one already on the wire ends
        within send_timeout_s, since every transport call has that deadline.
        """
        for rid in req_ids:
            send = self._sends.pop(rid, None)
            if send is None:
                continue
            if send.cancel():
                self.stats.transfer("send", "cancelled")
                continue
            if not send.done.wait(timeout=self._cfg.send_timeout_s + 1.0):
                logger.error("kv send still running after its deadline req=%s", rid)

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests the scheduler finished whose send is over: their blocks may go."""
        out: set[str] = set()
        self._finished.update(r for r in finished_req_ids if r in self._sends)
        for rid in list(self._finished):
            send = self._sends.get(rid)
            if send is None:
                self._finished.discard(rid)
            elif send.done.is_set():
                out.add(rid)
                del self._sends[rid]
                self._finished.discard(rid)
        return out

    def close(self) -> None:
        self._stop.set()
        for p in list(self._peers.values()):
            p.wake()
        for p in list(self._peers.values()):
            p.join(timeout=2.0)

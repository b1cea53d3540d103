"""KV-event intake: one ZMQ SUB per instance that advertises a KV-event endpoint, feeding
that instance's block index (proxy/routing/kv_index.py), on the proxy's one event loop.

Lifecycle: a reconcile pass (every `reconcile_s`, and at once through kick()) subscribes to
every instance the registry holds whose registration (or --prefill/--decode `events=`)
names an endpoint, and closes the stream of every instance that left or changed endpoint.

Sequence numbers (vLLM's, from 0 at engine start):
- the next one: applied;
- a jump ahead (a gap: the SUB socket dropped messages, or we joined late): the missed
  batches are asked from the instance's replay endpoint; when it has no replay endpoint, does
  not answer within `replay_timeout_s`, or no longer holds the first missed batch, the index is
  dropped and rebuilt from here (state PARTIAL, a subset of what the instance holds);
- one behind what we expect, outside a range just replayed: the engine restarted (its seq
  is back near 0): the index is reset (complete again once the replay from 0 succeeds).

Silence: vLLM publishes only when blocks change. Every `probe_s` without a message the
replay endpoint is asked for anything after the last seq: its end marker proves the
publisher is alive and nothing was missed. An instance whose publisher has not been heard
from (message or replay answer) for `silence_s` is UNKNOWN, never "empty"; without a replay
endpoint that is every idle instance, so advertise one.

Trust: vLLM's publisher has no authentication. The proxy only connects to endpoints an
accepted registration advertised (signed when --discovery-secret is set), only on the host
the registration came from (proxy/registry.py puts its source address in the endpoint; a
registrant on this machine may name any address of this machine), and
at most once per `probe_s` or backoff: libzmq's own reconnecting is off (RECONNECT_IVL -1),
every connection this module makes is one it asked for. Garbage (wrong frames, not msgpack,
bad types or bounds, wrong topic) is dropped and counted, never raised.

Bounds: an index holds at most --kv-index-max-blocks blocks (an advertised capacity may only
lower that); a message part over MAX_MESSAGE_BYTES makes ZMQ drop the connection (a protocol
error): the monitor sees it, it is logged and counted (xpyd_kv_event_reconnects_total) and
the stream reconnects after a backoff. A payload above INLINE_DECODE_BYTES is decoded on a
worker thread, and a batch is applied in steps that give the loop back every `budget_s`, so a
large batch never stalls the proxy. A stream that fails (say, no socket to be had) is retried
with a backoff, never left for good. The ZMQ context is sized for every instance the registry
may hold (--discovery-max-per-role per role).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.metrics import Metrics
from proxy.registry import Instance, Registry
from proxy.routing.kv_index import ApplyStats, IndexState, InstanceIndex
from xpyd_wire.kv_events import (
    DROP_REASONS,
    END_SEQ,
    MALFORMED,
    MAX_BATCH_BYTES,
    EventBatch,
    EventError,
    EventsEndpoint,
    decode_batch,
    replay_request,
)

log = logging.getLogger("xpyd.proxy.kv_events")

# A replay answers at most vLLM's buffer (buffer_steps, 10 000 by default) batches.
MAX_REPLAY_BATCHES = 100_000
# Largest message part the SUB/DEALER accept: ZMQ drops the connection on anything bigger.
MAX_MESSAGE_BYTES = MAX_BATCH_BYTES
# Payloads above this are decoded on the worker thread (~50 ms of Python per MiB); below it
# (every ordinary batch) inline, which costs less than the hand-off.
INLINE_DECODE_BYTES = 64 * 1024
# ZMQ sockets one stream holds: SUB, its monitor's two PAIRs, the replay DEALER.
SOCKETS_PER_STREAM = 4
# The monitor reports a connection that ended (or a connect that failed): with libzmq's
# reconnecting off, the stream itself reconnects.
_DROP_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


@dataclass(frozen=True, slots=True)
class EventsConfig:
    default_cap: int = 262_144  # blocks per instance when its capacity is not advertised (~50 MiB)
    probe_s: float = 2.0
    silence_s: float = 10.0
    replay_timeout_s: float = 2.0
    reconcile_s: float = 1.0
    # SUB receive high-water mark: beyond it ZMQ drops messages (seen as a gap).
    rcvhwm: int = 100_000
    # Batches handled per wake-up at most (the loop yields between), and the pause after
    # one: the index lags by up to this much, the proxy wakes far less often per batch.
    drain_max: int = 256
    coalesce_s: float = 0.02
    # Event-loop time one stream may take in a row (batches drained, steps of one large
    # batch) before it yields.
    budget_s: float = 0.005
    # Backoff between connections of one stream, and between replay asks that fail: doubles
    # from the first value to the second; a connection that lasted stable_s resets it.
    backoff_s: tuple[float, float] = (0.1, 10.0)
    stable_s: float = 10.0
    # ZMQ sockets of the context; None: enough for every instance the registry may hold.
    max_sockets: int | None = None


@dataclass(slots=True)
class StreamStats:
    batches: int = 0
    gaps: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    restarts: int = 0
    dropped: int = 0
    orphans: int = 0
    evicted: int = 0
    reconnects: int = 0  # connections that dropped (or failed) and were made again
    failures: int = 0  # the stream itself failed (an exception) and was restarted


@dataclass(slots=True, eq=False)
class EventStream:
    """One instance's subscription and index."""

    inst: Instance
    endpoint: EventsEndpoint
    index: InstanceIndex
    next_seq: int | None = None  # the seq expected next; None before the first
    last_heard: float = 0.0  # monotonic
    # A message with seq in [replayed_from, next_seq) is a duplicate of a replayed batch.
    replayed_from: int | None = None
    last_digest: bytes | None = None  # of the last applied batch's payload
    stats: StreamStats = field(default_factory=StreamStats)
    task: asyncio.Task | None = None
    dealer: zmq.asyncio.Socket | None = None  # to the replay endpoint, kept between asks
    retry_s: float = 0.0  # the next reconnect's delay (doubles while connections fail)
    replay_fails: int = 0  # replay asks failed in a row (the probe backs off)
    next_probe: float = 0.0  # monotonic: no replay ask before this

    def view(self) -> dict:
        return {
            "state": self.index.state.value,
            "blocks": len(self.index),
            "cap": self.index.cap,
            "next_seq": self.next_seq,
            "gaps": self.stats.gaps,
            "replays_ok": self.stats.replays_ok,
            "replays_failed": self.stats.replays_failed,
            "restarts": self.stats.restarts,
            "dropped": self.stats.dropped,
            "reconnects": self.stats.reconnects,
            "failures": self.stats.failures,
        }


class KVEvents:
    """Every instance's event stream; owned by ProxyState, one per proxy."""

    def __init__(self, registry: Registry, metrics: Metrics, cfg: EventsConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.registry = registry
        self.metrics = metrics
        self.cfg = cfg or EventsConfig()
        self._clock = clock
        self._streams: dict[Instance, EventStream] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()  # streams cancelled, not finished yet
        self._wake = asyncio.Event()
        self._results = {r: metrics.kv_events.labels(r) for r in ("applied", *DROP_REASONS)}
        metrics.registry.register(_IndexCollector(self))
        self._replays = {True: metrics.kv_event_replays.labels("ok"),
                         False: metrics.kv_event_replays.labels("failed")}  # fmt: skip
        self._reconnects = {r: metrics.kv_event_reconnects.labels(r)
                            for r in ("disconnected", "failed")}  # fmt: skip
        self._decoder: concurrent.futures.ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- queries

    def index(self, inst: Instance) -> InstanceIndex | None:
        stream = self._streams.get(inst)
        return None if stream is None else stream.index

    def state(self, inst: Instance) -> IndexState:
        stream = self._streams.get(inst)
        return IndexState.UNKNOWN if stream is None else stream.index.state

    def view(self, inst: Instance) -> dict | None:
        stream = self._streams.get(inst)
        return None if stream is None else stream.view()

    def streams(self) -> list[EventStream]:
        return list(self._streams.values())

    # ---------------------------------------------------------------- lifecycle

    def max_sockets(self) -> int:
        """Sockets the context may hold: every stream the registry's bounds allow (both
        roles, plus static instances), and a margin."""
        if self.cfg.max_sockets is not None:
            return self.cfg.max_sockets
        streams = 2 * self.registry.max_per_role + 64
        return SOCKETS_PER_STREAM * streams + 64

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        # libzmq's default (1,023) held ~250 streams: the 1,024 instances a role may have
        # would fail to subscribe (issue 36).
        self._ctx.set(zmq.MAX_SOCKETS, self.max_sockets())
        _raise_fd_limit(self._ctx.get(zmq.MAX_SOCKETS) * 2)
        self._decoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xpyd-kv-decode")
        self._task = asyncio.get_running_loop().create_task(self._reconcile_loop(),
                                                             name="xpyd-kv-events")  # fmt: skip

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *(s.task for s in self._streams.values()), *self._closing) if t]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._streams.clear()
        self._task = None
        if self._decoder is not None:
            self._decoder.shutdown(wait=False, cancel_futures=True)
            self._decoder = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # never blocks on a socket left open
            self._ctx = None

    def kick(self) -> None:
        """Reconcile now (a registration or a departure just happened)."""
        self._wake.set()

    async def _reconcile_loop(self) -> None:
        while True:
            try:
                self.reconcile()
            except Exception:  # a bug here must not end event intake for good
                log.exception("kv events reconcile failed")
            try:
                # Not wait_for: on 3.11 it can swallow a cancel that meets a kick(), and stop()
                # would then wait for this loop for ever.
                async with asyncio.timeout(self.cfg.reconcile_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    def reconcile(self) -> None:
        # Pending instances have not answered yet (may be typos or floods): not subscribed.
        wanted = {i: i.kv_events for i in self.registry.every()
                  if i.kv_events is not None and not i.pending}  # fmt: skip
        for inst, stream in list(self._streams.items()):
            if wanted.get(inst) != stream.endpoint:
                self._close(stream, "left" if inst not in wanted else "endpoint_changed")
        for inst, endpoint in wanted.items():
            if inst not in self._streams and endpoint is not None:
                self._open(inst, endpoint)

    def _open(self, inst: Instance, endpoint: EventsEndpoint) -> None:
        # The instance's own capacity when it is smaller: vLLM evicts (and reports) before
        # that. Never more than the flag's: what a registrant says must not size our memory.
        cap = min(endpoint.blocks or self.cfg.default_cap, self.cfg.default_cap)
        stream = EventStream(inst, endpoint, InstanceIndex(cap=cap), retry_s=self.cfg.backoff_s[0])
        self._streams[inst] = stream
        if self._ctx is not None:
            stream.task = asyncio.get_running_loop().create_task(
                self._run(stream), name=f"xpyd-kv-events-{inst.role}")
        log.info("kv events subscribe role=%s http=%s endpoint=%s replay=%s cap=%d", inst.role,
                 inst.http_address, endpoint.endpoint, endpoint.replay_endpoint, stream.index.cap)

    def _close(self, stream: EventStream, reason: str) -> None:
        self._streams.pop(stream.inst, None)
        if stream.task is not None:
            stream.task.cancel()
            self._closing.add(stream.task)
            stream.task.add_done_callback(self._closing.discard)
        log.info("kv events unsubscribe role=%s http=%s reason=%s", stream.inst.role,
                 stream.inst.http_address, reason)  # fmt: skip

    # ---------------------------------------------------------------- one stream

    async def _run(self, stream: EventStream) -> None:
        """Follows the stream until cancelled: a dropped connection is made again and a
        failure retried, each after the stream's backoff."""
        lo, hi = self.cfg.backoff_s
        first = True
        while True:
            began = self._clock()
            try:
                await self._follow(stream, first)
                reason = "disconnected"
            except asyncio.CancelledError:
                raise
            except Exception as e:
                reason = "failed"
                stream.stats.failures += 1
                stream.index.live = False
                if stream.stats.failures <= 10 or stream.stats.failures % 100 == 0:
                    log.warning("kv events stream failed http=%s (%d so far), retry in %.1fs: %s: %s",
                                stream.inst.http_address, stream.stats.failures, stream.retry_s,
                                type(e).__name__, e)  # fmt: skip
            first = False
            stream.stats.reconnects += 1
            self._reconnects[reason].inc()
            if self._clock() - began >= self.cfg.stable_s:
                stream.retry_s = lo
            delay = stream.retry_s
            stream.retry_s = min(hi, stream.retry_s * 2)
            await asyncio.sleep(delay)

    async def _follow(self, stream: EventStream, first: bool) -> None:
        """One connection of the SUB: returns when its monitor says it dropped."""
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        mon: zmq.asyncio.Socket | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self.cfg.rcvhwm)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sub.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection per _follow: ours to make
            sub.setsockopt(zmq.SUBSCRIBE, stream.endpoint.topic.encode())
            mon = sub.get_monitor_socket(_DROP_EVENTS)
            raw_mon = zmq.Socket.shadow(mon.underlying)
            sub.connect(stream.endpoint.endpoint)
            if first:  # what happened before we subscribed: the replay buffer, from seq 0
                await self._catch_up(stream, 0)
            else:  # what passed while disconnected (checks it is still the same engine)
                await self._probe(stream, force=True)
            # The same socket, synchronous: drains what is queued without a wake-up per message.
            raw = zmq.Socket.shadow(sub.underlying)
            budget = self.cfg.budget_s
            while True:
                if not await sub.poll(self.cfg.probe_s * 1000, zmq.POLLIN):
                    if _dropped(raw_mon, stream):
                        return
                    await self._probe(stream)
                    continue
                turn = time.perf_counter()
                for _ in range(self.cfg.drain_max):
                    try:
                        frames = raw.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self.handle(stream, frames)
                    if time.perf_counter() - turn > budget:
                        break
                if _dropped(raw_mon, stream):
                    return
                # Let batches gather: one wake-up per coalesce_s at most, not one per batch.
                await asyncio.sleep(self.cfg.coalesce_s)
        finally:
            if mon is not None:
                sub.disable_monitor()
                mon.close(linger=0)
            sub.close(linger=0)
            if stream.dealer is not None:
                stream.dealer.close(linger=0)
                stream.dealer = None

    async def _probe(self, stream: EventStream, force: bool = False) -> None:
        """Silent for probe_s: ask the replay endpoint whether anything was missed (after
        failed asks, at most once per backoff)."""
        now = self._clock()
        if stream.endpoint.replay_endpoint is not None and (force or now >= stream.next_probe):
            nxt = stream.next_seq
            # From the last applied batch: the publisher must still hold that very batch,
            # else it is another engine (restarted) whose seq has not caught up yet.
            ok = await self._catch_up(stream, 0 if not nxt else nxt - 1)
            stream.replay_fails = 0 if ok else stream.replay_fails + 1
            most = self.cfg.backoff_s[1]
            wait = 0.0 if ok else min(most, self.cfg.probe_s * 2 ** min(stream.replay_fails - 1, 16))
            stream.next_probe = self._clock() + wait
        now = self._clock()
        if now - stream.last_heard > self.cfg.silence_s and stream.index.live:
            stream.index.live = False
            log.warning("kv events silent for %.0fs, index unknown http=%s",
                        now - stream.last_heard, stream.inst.http_address)  # fmt: skip

    async def _decode(self, frames: list[bytes], topic: str) -> EventBatch:
        """decode_batch, on the worker thread for a large payload (EventError if bad)."""
        if self._decoder is not None and len(frames) == 3 and len(frames[2]) > INLINE_DECODE_BYTES:
            return await asyncio.get_running_loop().run_in_executor(
                self._decoder, decode_batch, frames, topic)
        return decode_batch(frames, topic)

    async def handle(self, stream: EventStream, frames: list[bytes]) -> None:
        """One live message from the SUB socket."""
        try:
            batch = await self._decode(frames, stream.endpoint.topic)
        except EventError as e:
            self._drop(stream, e)
            return
        seq = batch.seq
        if stream.next_seq is not None and seq < stream.next_seq:
            if stream.replayed_from is not None and seq >= stream.replayed_from:
                return  # already applied from a replay
            self._restarted(stream, f"seq went back {stream.next_seq} -> {seq}")
        expected = stream.next_seq
        if expected is None and seq != 0 or expected is not None and seq > expected:
            stream.stats.gaps += 1
            self.metrics.kv_event_gaps.inc()
            await self._catch_up(stream, expected or 0)
            if stream.next_seq is not None and seq < stream.next_seq:
                return  # the replay brought it
            if stream.next_seq != seq:  # still a hole: rebuild from here
                stream.index.clear(complete=False)
        elif expected is None:  # seq 0: the engine's first batch, nothing was missed
            stream.index.clear(complete=True)
        await self._apply(stream, batch, frames[2])
        # The SUB delivers in order: past this, a lower seq can only mean a restart.
        stream.replayed_from = None

    def _restarted(self, stream: EventStream, why: str) -> None:
        stream.stats.restarts += 1
        self.metrics.kv_event_restarts.inc()
        log.info("kv events: engine restarted (%s), index reset http=%s", why,
                 stream.inst.http_address)  # fmt: skip
        stream.index.clear(complete=False)
        stream.next_seq = None
        stream.replayed_from = None
        stream.last_digest = None

    async def _apply(self, stream: EventStream, batch: EventBatch, payload: bytes) -> None:
        stats = ApplyStats()
        budget = self.cfg.budget_s
        turn = time.perf_counter()
        for _ in stream.index.apply_steps(batch.events, stats):
            if time.perf_counter() - turn > budget:  # a large batch: let the loop run
                await asyncio.sleep(0)
                turn = time.perf_counter()
        stream.next_seq = batch.seq + 1
        stream.last_digest = _digest(payload)
        stream.last_heard = self._clock()
        stream.index.live = True
        stream.stats.batches += 1
        stream.stats.orphans += stats.orphans
        stream.stats.evicted += stats.evicted
        self._results["applied"].inc()

    def _drop(self, stream: EventStream, e: EventError) -> None:
        stream.stats.dropped += 1
        self._results[e.reason].inc()
        if stream.stats.dropped <= 10 or stream.stats.dropped % 1000 == 0:
            log.warning("kv event dropped reason=%s http=%s (%d so far): %s", e.reason,
                        stream.inst.http_address, stream.stats.dropped, e)  # fmt: skip

    async def _catch_up(self, stream: EventStream, start: int) -> bool:
        """Ask the replay endpoint for every batch from `start` and apply them. True when
        the publisher answered and the index is complete up to its latest batch."""
        ep = stream.endpoint.replay_endpoint
        if ep is None or self._ctx is None:
            return False
        result = await self._replay(stream, ep, start)
        if result == "mismatch":  # another engine at the same address: start over from 0
            self._restarted(stream, f"replay from {start} does not match what was applied")
            result = await self._replay(stream, ep, 0)
        ok = result == "ok"
        if ok:
            stream.stats.replays_ok += 1
        else:
            stream.stats.replays_failed += 1
        self._replays[ok].inc()
        return ok

    async def _replay(self, stream: EventStream, ep: str, start: int) -> str:
        """"ok", "failed" (no answer in time, garbage) or "mismatch" (the batch at `start`
        is not the one applied: the engine restarted)."""
        assert self._ctx is not None
        # One DEALER per stream, kept while every answer is read to its end marker (the
        # protocol has no request ids: after a timeout or an early return, a late answer
        # could pass for the next one, so the socket is replaced then).
        dealer = stream.dealer
        if dealer is None:
            dealer = stream.dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            # One connection per socket: a failed ask replaces it (under the probe's backoff).
            dealer.setsockopt(zmq.RECONNECT_IVL, -1)
            dealer.connect(ep)
        result = "failed"
        try:
            result = await self._replay_on(stream, dealer, start)
        finally:
            if result != "ok":
                dealer.close(linger=0)
                stream.dealer = None
        return result

    async def _replay_on(self, stream: EventStream, dealer: zmq.asyncio.Socket, start: int) -> str:
        deadline = self._clock() + self.cfg.replay_timeout_s
        # Replaying from the last applied batch checks it is still the same one.
        verify = stream.next_seq is not None and start == stream.next_seq - 1
        first = True
        # The send may block too (its queue at the high-water mark): under the same deadline.
        try:
            async with asyncio.timeout(self.cfg.replay_timeout_s):
                await dealer.send_multipart(replay_request(start))
        except TimeoutError:
            log.warning("kv events replay endpoint unreachable http=%s", stream.inst.http_address)
            return "failed"
        for _ in range(MAX_REPLAY_BATCHES + 1):
            left = deadline - self._clock()
            if left <= 0 or not await dealer.poll(left * 1000, zmq.POLLIN):
                log.warning("kv events replay timed out http=%s start=%d",
                            stream.inst.http_address, start)  # fmt: skip
                return "failed"
            frames = await dealer.recv_multipart()
            if len(frames) == 4 and frames[0] == b"" and frames[2] == END_SEQ:
                if first and verify:
                    return "mismatch"  # it no longer has the batch we applied last
                if first and start == 0 and stream.next_seq is None:
                    # Nothing was ever published: the instance holds no cached blocks.
                    stream.index.clear(complete=True)
                    stream.next_seq = 0
                if stream.next_seq is None:
                    return "failed"
                stream.last_heard = self._clock()
                stream.index.live = True
                return "ok"
            try:
                if len(frames) != 4 or frames[0] != b"":
                    raise EventError(f"replay answer of {len(frames)} frames", MALFORMED)
                batch = await self._decode(frames[1:], stream.endpoint.topic)
            except EventError as e:
                self._drop(stream, e)
                return "failed"
            if first:
                first = False
                if verify:
                    if batch.seq != start or _digest(frames[3]) != stream.last_digest:
                        return "mismatch"
                    # What follows may be on its way on the SUB too (vLLM sends a batch,
                    # then buffers it): its live copy is a duplicate, not a restart.
                    if stream.replayed_from is None or stream.replayed_from > start:
                        stream.replayed_from = start
                    continue
                stream.replayed_from = start
                if batch.seq == 0:
                    stream.index.clear(complete=True)
                elif batch.seq > start or stream.next_seq is None:
                    # The buffer no longer holds what we missed: rebuild from here.
                    log.info("kv events replay starts at %d, wanted %d: index rebuilt "
                             "http=%s", batch.seq, start, stream.inst.http_address)
                    stream.index.clear(complete=False)
            if stream.next_seq is not None and batch.seq < stream.next_seq:
                continue
            await self._apply(stream, batch, frames[3])
        return "failed"


def _dropped(mon: zmq.Socket, stream: EventStream) -> bool:
    """The SUB's connection ended (the publisher went away or closed it, a connect failed, or
    a message over MAX_MESSAGE_BYTES was refused): drains the monitor, logs it."""
    events = []
    while True:
        try:
            events.append(mon.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    if not events:
        return False
    kinds = {int.from_bytes(e[0][:2], "little") for e in events if e and len(e[0]) >= 2}
    n = stream.stats.reconnects + 1
    if n <= 10 or n % 100 == 0:
        log.warning("kv events connection lost http=%s endpoint=%s (%s; the publisher went "
                    "away, closed it, or sent a message over %d bytes): reconnect %d in %.1fs",
                    stream.inst.http_address, stream.endpoint.endpoint,
                    "connect failed" if kinds == {zmq.EVENT_CLOSED} else "disconnected",
                    MAX_MESSAGE_BYTES, n, stream.retry_s)  # fmt: skip
    return True


def _raise_fd_limit(wanted: int) -> None:
    """Every ZMQ socket holds a descriptor (its mailbox) besides its connection: raise the
    soft limit toward the hard one when it is below what the sockets may need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError) as e:
        log.warning("cannot raise the open-file limit %d -> %d: %s", soft, new, e)
        return
    if new < wanted:
        log.warning("open-file limit %d (hard) is below the %d KV-event streams may need", new, wanted)
    else:
        log.info("open-file limit raised %d -> %d for KV-event streams", soft, new)


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


class _IndexCollector(Collector):
    """Per-instance index size and state, read at scrape time."""

    def __init__(self, events: KVEvents) -> None:
        self._events = events

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily("xpyd_kv_index_blocks",
                                   "Blocks the proxy's KV index holds per instance",
                                   labels=["role", "instance"])  # fmt: skip
        state = GaugeMetricFamily("xpyd_kv_index_state",
                                  "1 for the instance's KV index state (unknown/partial/known)",
                                  labels=["role", "instance", "state"])  # fmt: skip
        for stream in self._events.streams():
            inst = stream.inst
            blocks.add_metric([inst.role, inst.http_address], len(stream.index))
            state.add_metric([inst.role, inst.http_address, stream.index.state.value], 1)
        yield blocks
        yield state

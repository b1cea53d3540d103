"""KV-event intake: one ZMQ SUB per instance that advertises a KV-event endpoint, feeding
that instance's block index (proxy/kv_index.py), on the proxy's one event loop.

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
accepted registration advertised (signed when --discovery-secret is set), and only on that
instance's own KV host (xpyd_wire.discovery checks it). Garbage (wrong frames, not msgpack,
bad types or bounds, wrong topic) is dropped and counted, never raised.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.kv_index import ApplyStats, IndexState, InstanceIndex
from proxy.metrics import Metrics
from proxy.registry import Instance, Registry
from xpyd_wire.kv_events import (
    DROP_REASONS,
    END_SEQ,
    MALFORMED,
    EventBatch,
    EventError,
    EventsEndpoint,
    decode_batch,
    replay_request,
)

log = logging.getLogger("xpyd.proxy.kv_events")

# A replay answers at most vLLM's buffer (buffer_steps, 10 000 by default) batches.
MAX_REPLAY_BATCHES = 100_000
# Largest message the SUB/DEALER accept (ZMQ drops the connection on anything bigger).
MAX_MESSAGE_BYTES = 32 * 1024 * 1024


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

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
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
                await asyncio.wait_for(self._wake.wait(), self.cfg.reconcile_s)
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
        # The instance's own capacity when it says it: vLLM evicts (and reports) before that.
        stream = EventStream(inst, endpoint, InstanceIndex(cap=endpoint.blocks or self.cfg.default_cap))
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
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.cfg.rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, stream.endpoint.topic.encode())
        sub.connect(stream.endpoint.endpoint)
        try:
            # What happened before we subscribed: the replay buffer, from seq 0.
            await self._catch_up(stream, 0)
            # The same socket, synchronous: drains what is queued without a wake-up per message.
            raw = zmq.Socket.shadow(sub.underlying)
            while True:
                if not await sub.poll(self.cfg.probe_s * 1000, zmq.POLLIN):
                    await self._probe(stream)
                    continue
                for _ in range(self.cfg.drain_max):
                    try:
                        frames = raw.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self.handle(stream, frames)
                # Let batches gather: one wake-up per coalesce_s at most, not one per batch.
                await asyncio.sleep(self.cfg.coalesce_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kv events stream failed http=%s", stream.inst.http_address)
            stream.index.live = False
        finally:
            sub.close(linger=0)
            if stream.dealer is not None:
                stream.dealer.close(linger=0)
                stream.dealer = None

    async def _probe(self, stream: EventStream) -> None:
        """Silent for probe_s: ask the replay endpoint whether anything was missed."""
        if stream.endpoint.replay_endpoint is not None:
            nxt = stream.next_seq
            # From the last applied batch: the publisher must still hold that very batch,
            # else it is another engine (restarted) whose seq has not caught up yet.
            await self._catch_up(stream, 0 if not nxt else nxt - 1)
        now = self._clock()
        if now - stream.last_heard > self.cfg.silence_s and stream.index.live:
            stream.index.live = False
            log.warning("kv events silent for %.0fs, index unknown http=%s",
                        now - stream.last_heard, stream.inst.http_address)  # fmt: skip

    async def handle(self, stream: EventStream, frames: list[bytes]) -> None:
        """One live message from the SUB socket."""
        try:
            batch = decode_batch(frames, stream.endpoint.topic)
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
        self._apply(stream, batch, frames[2])
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

    def _apply(self, stream: EventStream, batch: EventBatch, payload: bytes) -> None:
        stats = stream.index.apply(batch.events, ApplyStats())
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
                batch = decode_batch(frames[1:], stream.endpoint.topic)
            except EventError as e:
                self._drop(stream, e)
                return "failed"
            if first:
                first = False
                if verify:
                    if batch.seq != start or _digest(frames[3]) != stream.last_digest:
                        return "mismatch"
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
            self._apply(stream, batch, frames[3])
        return "failed"


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

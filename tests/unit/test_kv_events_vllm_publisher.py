"""KV-event intake against vLLM 0.32's own ZmqEventPublisher (vllm/distributed/kv_events.py),
not the double in tests/support/kv_publisher.py: its numbering (one counter, from 0), its order
(a batch goes out on the PUB, then into the replay buffer, on one thread that answers a replay
between two batches) and its replay answers. Only where its PUB binds differs: on loopback (vLLM
binds only a wildcard endpoint). The steps that race in a running proxy (a replay answered
while the live copy of a batch it holds is still on its way) are taken in a fixed order here."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import zmq
import zmq.asyncio

from proxy.metrics import Metrics
from proxy.registry import Registry
from proxy.routing.kv_events import EventsConfig, KVEvents
from proxy.routing.kv_index import IndexState
from tests.support.waiting import wait_until
from xpyd_wire import discovery
from xpyd_wire.kv_events import EventsEndpoint

kv = pytest.importorskip("vllm.distributed.kv_events")

BS = 4
# Generous: these deadlines are not the subject (the publisher answers a replay within 0.1 s idle).
WAIT_S = 30.0


class LoopbackPublisher(kv.ZmqEventPublisher):
    """vLLM's publisher with its PUB bound on the given (loopback) endpoint."""

    @staticmethod
    def _is_bind_endpoint(endpoint: str) -> bool:
        return True


def _batch(first_hash: int):
    tokens = list(range(first_hash * BS, (first_hash + 1) * BS))
    event = kv.BlockStored([first_hash], None, tokens, BS, None, "GPU", None)
    return kv.KVEventBatch(ts=time.time(), events=[event])


class Setup:
    """vLLM's publisher, the proxy's intake with one stream to it (its own loop not started:
    the test takes its steps), and a SUB of the test's that reads what the stream would."""

    def __init__(self) -> None:
        self.pub = LoopbackPublisher(0, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="")
        pub_ep = self.pub._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        replay_ep = self.pub._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.registry = Registry(heartbeat_timeout=30)
        self.metrics = Metrics(self.registry)
        self.events = KVEvents(self.registry, self.metrics, EventsConfig(replay_timeout_s=WAIT_S))
        reg = discovery.Registration("D", "127.0.0.1:18001", "127.0.0.1:14579",
                                     kv_events=EventsEndpoint(pub_ep, replay_ep, "", None))  # fmt: skip
        self.inst = self.registry.upsert(reg)
        self.registry.admit(self.inst)
        self.events.reconcile()  # the stream, without its task (no context yet)
        self.stream = self.events.streams()[0]
        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub_ep)
        self.published = 0  # batches handed to the publisher: its next seq

    def publish(self, first_hash: int) -> int:
        """One batch to vLLM's publisher (its thread numbers, sends and buffers it); its seq."""
        self.pub.publish(_batch(first_hash))
        self.published += 1
        return self.published - 1

    async def __aenter__(self) -> Setup:
        await self.events.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.events.stop()
        self.sub.close(linger=0)
        self.ctx.term()
        self.pub.shutdown()

    async def live(self) -> list[bytes]:
        """The next batch off the SUB (generous deadline)."""
        async with asyncio.timeout(WAIT_S):
            return await self.sub.recv_multipart()

    async def joined(self) -> None:
        """Publish until the SUB gets a batch (a SUB misses what goes out before it joined) and
        hand what it gets to the stream (the first: a gap, replayed from 0), then one batch
        more, applied live: the stream's state in a running proxy."""
        seen = None
        for _ in range(200):  # bounded: ~0.05 s each
            self.publish(100 + self.published)
            try:
                async with asyncio.timeout(0.05):
                    seen = await self.sub.recv_multipart()
                break
            except TimeoutError:
                continue
        assert seen is not None, "the SUB never joined"
        await self.events.handle(self.stream, seen)
        last = self.publish(20)
        for _ in range(200):  # what the SUB still holds of the join's batches, then that one
            frames = await self.live()
            await self.events.handle(self.stream, frames)
            if int.from_bytes(frames[1], "big") == last:
                break
        assert self.stream.next_seq == last + 1 and self.stream.replayed_from is None


async def test_a_probes_replay_holding_a_batch_whose_live_copy_comes_after_is_not_a_restart(caplog):
    """vLLM's publisher sends batch N, then buffers it. The proxy's probe (silence, or a
    reconnect) asks the replay from the batch it applied last (N-1) before the SUB's copy of
    N is read: the answer holds N, which is applied; then the live N comes. It is a
    duplicate, not a restart (before: `engine restarted (seq went back N+1 -> N)`, index
    reset, for P and D several times a run)."""
    caplog.set_level(logging.INFO, logger="xpyd.proxy.kv_events")
    async with Setup() as s:
        await s.joined()
        stream = s.stream
        n = stream.next_seq
        assert s.publish(30) == n  # out on the PUB, then buffered
        held = await s.live()  # on its way to the proxy, not read yet
        ok = stream.stats.replays_ok
        await s.events._probe(stream, force=True)  # replay from n - 1: verified, n applied
        assert stream.next_seq == n + 1 and stream.stats.replays_ok == ok + 1
        await s.events.handle(stream, held)  # the live copy of n
        s.publish(40)
        await s.events.handle(stream, await s.live())
        assert stream.stats.restarts == 0 and s.metrics.registry.get_sample_value("xpyd_kv_event_restarts_total") == 0
        assert stream.next_seq == n + 2 and stream.index.state is IndexState.KNOWN
        assert {20, 30, 40} <= set(stream.index._by_hash) and stream.stats.gaps <= 1  # the join's
    assert not [r for r in caplog.records if "restarted" in r.getMessage()]


async def test_after_a_probes_replay_a_seq_below_it_is_still_a_restart(caplog):
    """What the probe's replay brought is a duplicate only from the batch it began at: a
    lower seq after it is another engine (mutant: every lower seq skipped)."""
    caplog.set_level(logging.INFO, logger="xpyd.proxy.kv_events")
    async with Setup() as s:
        await s.joined()
        stream = s.stream
        n = stream.next_seq
        assert s.publish(30) == n
        frames = await s.live()
        await s.events._probe(stream, force=True)  # from n - 1
        assert stream.next_seq == n + 1
        # Another engine's batch n - 2 (its seq from 0 again): batch n's frames, its seq replaced.
        frames[1] = (n - 2).to_bytes(8, "big")
        await s.events.handle(stream, frames)
        assert stream.stats.restarts == 1
    assert [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()] == [
        f"kv events: engine restarted (seq went back {n + 1} -> {n - 2}), index reset http=127.0.0.1:18001"]


async def test_a_probe_right_after_a_replay_keeps_that_replays_duplicates():
    """A replay from 0 (the stream's first) brought batches whose live copies are still on
    the SUB; a probe (a reconnect's) verifies from a later batch before they are read: they
    are still duplicates (mutant: the probe's start replacing the earlier replay's)."""
    async with Setup() as s:
        seen = None
        for _ in range(200):  # bounded: ~0.05 s each
            s.publish(100 + s.published)
            try:
                async with asyncio.timeout(0.05):
                    seen = await s.sub.recv_multipart()
                break
            except TimeoutError:
                continue
        assert seen is not None, "the SUB never joined"
        s.publish(200)
        s.publish(201)
        held = [seen]
        for _ in range(200):  # the live copies up to the last published
            held.append(await s.live())
            if int.from_bytes(held[-1][1], "big") == s.published - 1:
                break
        await s.events.handle(s.stream, held.pop())  # the first read: a gap, replayed from 0
        assert s.stream.next_seq == s.published and s.stream.replayed_from == 0
        await s.events._probe(s.stream, force=True)  # verifies from the last: nothing new
        for frames in held:  # the copies of what the first replay brought
            await s.events.handle(s.stream, frames)
        assert s.stream.stats.restarts == 0 and s.stream.next_seq == s.published >= 3
        assert s.stream.index.state is IndexState.KNOWN and len(held) >= 2

"""KV-event intake (issue 17, part 1): the wire format against vLLM's own encoder, the block
index (keys, bounds, eviction), and the proxy's subscriber on real ZMQ sockets against a
double of vLLM's publisher (tests/support/kv_publisher.py): gaps and replay, an engine restart, a
silent publisher, garbage, an instance leaving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import time
import tracemalloc

import msgpack
import pytest

from proxy.metrics import Metrics
from proxy.registry import Registry
from proxy.routing.kv_events import (
    MAX_MESSAGE_BYTES,
    SOCKETS_PER_STREAM,
    EventsConfig,
    KVEvents,
    _dropped,
    _raise_fd_limit,
)
from proxy.routing.kv_index import ApplyStats, IndexState, InstanceIndex
from tests.support.kv_publisher import Publisher, publish_until_applied
from tests.support.waiting import wait_until
from xpyd_wire import discovery
from xpyd_wire.kv_events import (
    END_SEQ,
    INVALID_EVENT,
    MALFORMED,
    WRONG_TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventError,
    EventsEndpoint,
    advertised,
    chain_block_keys,
    decode_batch,
    decode_endpoint,
    encode_batch,
)

BS = 4  # block size of the synthetic events


def stored(hashes, tokens, parent=None, lora=None, medium="GPU"):
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, lora, medium, 0)


def seq_blocks(tokens, first_hash=1000, parent=None):
    """A BlockStored for the full blocks of `tokens`, hashes first_hash, first_hash+1, ..."""
    n = len(tokens) // BS
    return stored(range(first_hash, first_hash + n), tokens[: n * BS], parent)


# ---------------------------------------------------------------- wire format


def test_decodes_what_vllm_encodes():
    kv = pytest.importorskip("vllm.distributed.kv_events")
    msgspec = pytest.importorskip("msgspec")
    batch = kv.KVEventBatch(ts=12.5, events=[
        kv.BlockStored(block_hashes=[b"\x01" * 32, 7], parent_block_hash=b"\x02" * 32,
                       token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU",
                       lora_name="ad", group_idx=0, session_id="s"),
        kv.BlockRemoved(block_hashes=[5], medium="GPU"),
        kv.AllBlocksCleared(),
    ], data_parallel_rank=0)  # fmt: skip
    payload = msgspec.msgpack.Encoder().encode(batch)
    got = decode_batch([b"t", (41).to_bytes(8, "big"), payload], topic="t")
    assert got.seq == 41 and got.ts == 12.5
    s, r, c = got.events
    assert s == BlockStored((b"\x01" * 32, 7), b"\x02" * 32, tuple(range(32)), 16, "ad", "GPU", 0)
    assert r == BlockRemoved((5,), "GPU", None)
    assert c == AllBlocksCleared()
    # ... and vLLM's decoder reads what the test publisher sends.
    ours = encode_batch(EventBatch(3, 1.0, (s, r, c)), "t")
    back = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(ours[2])
    assert [type(e).__name__ for e in back.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert back.events[0].token_ids == list(range(32)) and back.events[0].lora_name == "ad"


def test_extra_keys_mark_salted_blocks_which_are_not_indexed():
    kv = pytest.importorskip("vllm.distributed.kv_events")
    msgspec = pytest.importorskip("msgspec")

    def decoded(lora, extra_keys):
        ev = kv.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                            lora_id=None, medium="GPU", lora_name=lora, extra_keys=extra_keys)
        payload = msgspec.msgpack.Encoder().encode(kv.KVEventBatch(ts=1.0, events=[ev]))
        return decode_batch([b"", (0).to_bytes(8, "big"), payload]).events[0]

    assert not decoded(None, None).extra
    assert not decoded("ad", [("ad",), ("ad",)]).extra  # the LoRA name alone: tokens + LoRA
    assert decoded(None, [("salt-1",), ("salt-1",)]).extra  # a cache_salt
    assert decoded("ad", [("ad", "salt"), ("ad", "salt")]).extra
    assert decoded(None, [(("mm-hash", 0),), None]).extra  # an image in the first block
    idx = InstanceIndex(cap=100)
    st = idx.apply([decoded(None, [("salt-1",), ("salt-1",)])])
    assert (st.stored, st.ignored, len(idx)) == (0, 2, 0)
    # ... and the test publisher says the same as vLLM's encoder.
    ours = encode_batch(EventBatch(0, 1.0, (decoded(None, [("s",), ("s",)]),)))
    assert decode_batch(ours).events[0].extra


def _payload(events, ts=1.0):
    return msgpack.packb([ts, events, 0])


GOOD = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4], "block_size": 4, "medium": "GPU"}  # fmt: skip


@pytest.mark.parametrize(("frames", "reason"), [
    ([b"", b"\0" * 8], MALFORMED),
    ([b"", b"\0" * 7, _payload([])], MALFORMED),
    ([b"", b"\xff" * 8, _payload([])], MALFORMED),  # negative seq
    ([b"", b"\0" * 8, b"\xc1"], MALFORMED),  # not msgpack
    ([b"", b"\0" * 8, msgpack.packb({"a": 1})], MALFORMED),
    ([b"", b"\0" * 8, msgpack.packb(["x", []])], MALFORMED),
    ([b"", b"\0" * 8, msgpack.packb([float("nan"), []])], MALFORMED),
    ([b"other", b"\0" * 8, _payload([])], WRONG_TOPIC),
    ([b"", b"\0" * 8, _payload([{"type": "Nope"}])], INVALID_EVENT),
    ([b"", b"\0" * 8, _payload([7])], INVALID_EVENT),
    ([b"", b"\0" * 8, _payload([{**GOOD, "token_ids": [1, 2, 3]}])], INVALID_EVENT),
    ([b"", b"\0" * 8, _payload([{**GOOD, "token_ids": [1, 2, 3, -1]}])], INVALID_EVENT),
    ([b"", b"\0" * 8, _payload([{**GOOD, "token_ids": [1, 2, 3, "4"]}])], INVALID_EVENT),
    ([b"", b"\0" * 8, _payload([{**GOOD, "block_size": 0}])], INVALID_EVENT),
    ([b"", b"\0" * 8, _payload([{**GOOD, "block_hashes": []}])], INVALID_EVENT),
    ([b"", b"\0" * 8, _payload([{**GOOD, "block_hashes": [1.5]}])], INVALID_EVENT),
    ([b"", b"\0" * 8, _payload([{**GOOD, "block_hashes": [b"x" * 65]}])], INVALID_EVENT),
    ([b"", b"\0" * 8, _payload([{**GOOD, "lora_name": 3}])], INVALID_EVENT),
    ([b"", b"\0" * 8, _payload([{"type": "BlockRemoved", "block_hashes": None}])], INVALID_EVENT),
])  # fmt: skip
def test_garbage_is_an_event_error_with_a_reason(frames, reason):
    with pytest.raises(EventError) as e:
        decode_batch(frames)
    assert e.value.reason == reason
    assert decode_batch([b"", b"\0" * 8, _payload([GOOD])]).events  # the baseline is valid


def test_endpoints_advertise_the_kv_host_and_are_validated():
    assert advertised("tcp://*:5557", "10.0.0.2") == "tcp://10.0.0.2:5557"
    assert advertised("tcp://0.0.0.0:5557", "node-1") == "tcp://node-1:5557"
    assert advertised("tcp://127.0.0.1:5557", "node-1") == "tcp://127.0.0.1:5557"
    # How vLLM is made to bind one IPv4 address (it binds only "*" or "::" endpoints).
    assert advertised("tcp://[::ffff:127.0.0.1]:5557", "node-1") == "tcp://127.0.0.1:5557"
    for bad in ("ipc:///tmp/x", "tcp://*:0", "tcp://*:x"):
        with pytest.raises(EventError):
            advertised(bad, "h")
    for bad in ({"endpoint": "tcp://h:70000"}, {"endpoint": "tcp://a b:1"}, {"endpoint": 3},
                {"endpoint": "tcp://h:1", "blocks": 0}, {"endpoint": "tcp://h:1", "topic": 5},
                {"endpoint": "tcp://h:1", "replay_endpoint": "http://h:2"}, []):  # fmt: skip
        with pytest.raises(EventError):
            decode_endpoint(bad)


def test_registration_carries_the_endpoint_on_its_own_kv_host_only():
    ep = EventsEndpoint("tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558", "kv", 4096)
    reg = discovery.Registration("P", "10.0.0.2:8000", "10.0.0.2:14579", kv_events=ep)
    assert discovery.decode(discovery.encode(reg, "s"), "s").kv_events == ep
    old = discovery.Registration("P", "10.0.0.2:8000", "10.0.0.2:14579")
    assert discovery.decode(discovery.encode(old)).kv_events is None
    for other in (EventsEndpoint("tcp://10.0.0.9:5557"),
                  EventsEndpoint("tcp://10.0.0.2:5557", "tcp://evil:5558")):  # fmt: skip
        forged = discovery.Registration("P", "10.0.0.2:8000", "10.0.0.2:14579", kv_events=other)
        with pytest.raises(discovery.ProtocolError, match="not on the KV host"):
            discovery.decode(discovery.encode(forged))


def test_chain_block_keys_full_blocks_salted_and_stable_across_processes():
    toks = list(range(10))
    keys = chain_block_keys(toks, 4)
    assert len(keys) == 2 and keys == chain_block_keys(toks[:8], 4)  # partial block: no key
    assert keys[0] == chain_block_keys(toks[:4], 4)[0]
    assert chain_block_keys(toks, 4, "lora-a") != keys
    assert chain_block_keys([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != keys[1]  # chained on the parent
    code = "from xpyd_wire.kv_events import chain_block_keys as c; print(c(list(range(10)), 4))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PYTHONPATH": sys.path[0]})  # fmt: skip
    assert out.stdout.strip() == str(keys)


# ---------------------------------------------------------------- index


def test_index_keys_match_chain_block_keys_and_removals_apply():
    idx = InstanceIndex(cap=100)
    toks = list(range(100, 120))  # 5 blocks
    idx.apply([seq_blocks(toks[:8], 1000)])  # 2 blocks in one event
    idx.apply([stored([1002, 1003], toks[8:16], parent=1001)])  # chained on a vLLM parent hash
    keys = chain_block_keys(toks, BS)
    assert idx.longest_prefix(keys) == 4
    assert idx.longest_prefix(chain_block_keys([0] + toks[1:], BS)) == 0
    idx.apply([BlockRemoved((1001,), "GPU")])
    assert idx.longest_prefix(keys) == 1 and len(idx) == 3
    idx.apply([AllBlocksCleared()])
    assert len(idx) == 0 and idx.complete


def test_index_lora_salt_orphans_other_media_and_duplicates():
    idx = InstanceIndex(cap=100)
    toks = [1, 2, 3, 4]
    st = idx.apply([stored([1], toks, lora="a"), stored([2], toks, parent=999),
                    stored([3], toks, medium="CPU"), stored([1], toks, lora="a")])  # fmt: skip
    assert (st.stored, st.orphans, st.ignored) == (1, 1, 1)
    assert idx.longest_prefix(chain_block_keys(toks, BS, "a")) == 1
    assert idx.longest_prefix(chain_block_keys(toks, BS)) == 0
    # Two vLLM hashes for the same tokens (e.g. a cache salt): the key stays until both go.
    idx.apply([stored([5], toks)])
    idx.apply([stored([6], toks)])
    idx.apply([BlockRemoved((5,), "GPU")])
    assert idx.longest_prefix(chain_block_keys(toks, BS)) == 1
    idx.apply([BlockRemoved((6,), "GPU")])
    assert idx.longest_prefix(chain_block_keys(toks, BS)) == 0


def test_index_is_bounded_and_evicts_oldest_first():
    idx = InstanceIndex(cap=50)
    stats = ApplyStats()
    toks = list(range(400))  # 100 blocks
    idx.apply([seq_blocks(toks, 1)], stats)
    assert len(idx) == 50 and idx.keys == 50 and stats.evicted == 50
    keys = chain_block_keys(toks, BS)
    assert not idx.holds(keys[0]) and idx.holds(keys[-1])  # the newest are kept


def test_index_memory_per_block():
    """Measured, and bounded: the cap times this is the index's memory per instance."""
    n = 20_000
    toks = list(range(n * BS))
    events = [stored(range(i * 100 + 1, i * 100 + 101), toks[i * 100 * BS:(i + 1) * 100 * BS],
                     parent=None if i == 0 else i * 100) for i in range(n // 100)]  # fmt: skip
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = InstanceIndex(cap=n)
    for ev in events:
        idx.apply([ev])
    per_block = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    assert len(idx) == n
    print(f"index memory: {per_block:.0f} bytes per block (int vLLM hashes)")
    assert per_block < 400


# ---------------------------------------------------------------- subscriber


class Harness:
    def __init__(self, pub: Publisher, blocks: int | None = None, replay: str | None = None, **cfg) -> None:
        self.pub = pub
        self.registry = Registry(heartbeat_timeout=30)
        self.metrics = Metrics(self.registry)
        self.events = KVEvents(self.registry, self.metrics, EventsConfig(**{
            # Silence and the replay's deadline generous unless a test is about them: a loaded
            # box's stall must not read as a silent publisher or a failed replay.
            "probe_s": 0.2, "silence_s": 30.0, "replay_timeout_s": 5.0, "reconcile_s": 0.1, **cfg}))
        ep = EventsEndpoint(pub.endpoint, replay or pub.replay_endpoint, pub.topic, blocks)
        reg = discovery.Registration("P", "127.0.0.1:18000", "127.0.0.1:14579", kv_events=ep)
        self.inst = self.registry.upsert(reg)
        self.registry.admit(self.inst)

    @property
    def stream(self):
        return next(iter(self.events.streams()))

    @property
    def index(self):
        return self.events.index(self.inst)

    def metric(self, name, **labels):
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    async def __aenter__(self):
        await self.events.start()
        await wait_until(lambda: self.events.streams())
        return self

    async def __aexit__(self, *exc):
        await self.events.stop()
        self.pub.close()


async def publish_until_received(h: Harness, events, timeout: float = 5.0) -> None:
    await publish_until_applied(h.pub, events, lambda: h.stream, timeout)


async def test_subscribes_applies_and_knows():
    toks = list(range(16))
    async with Harness(Publisher()) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN)  # replay: nothing yet
        assert len(h.index) == 0
        await publish_until_received(h, [seq_blocks(toks)])
        assert h.index.longest_prefix(chain_block_keys(toks, BS)) == 4
        assert h.events.view(h.inst)["state"] == "known"
        assert h.metric("xpyd_kv_index_blocks", role="P", instance="127.0.0.1:18000") == 4
        assert h.metric("xpyd_kv_events_total", result="applied") >= 1


async def test_late_join_replays_from_zero():
    pub = Publisher()
    toks = list(range(12))
    pub.publish([seq_blocks(toks, 1)], send=False)  # before the proxy subscribed
    async with Harness(pub) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN)
        assert h.index.longest_prefix(chain_block_keys(toks, BS)) == 3
        assert pub.replay_requests >= 1


async def test_gap_is_replayed():
    toks = list(range(40))
    async with Harness(Publisher()) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN)
        await publish_until_received(h, [seq_blocks(toks[:8], 1)])
        h.pub.publish([stored([3], toks[8:12], parent=2)], send=False)  # lost
        h.pub.publish([stored([4], toks[12:16], parent=3)], send=False)  # lost
        h.pub.publish([stored([5], toks[16:20], parent=4)])
        # The replay applies the batches (next_seq) before _catch_up counts it: wait for both.
        await wait_until(lambda: h.stream.next_seq == h.pub.seq and h.stream.stats.replays_ok >= 2)
        assert h.index.longest_prefix(chain_block_keys(toks, BS)) == 5
        assert h.index.state is IndexState.KNOWN
        assert h.stream.stats.gaps == 1 and h.metric("xpyd_kv_event_gaps_total") == 1
        assert h.metric("xpyd_kv_event_replays_total", result="ok") == h.stream.stats.replays_ok
        assert h.stream.stats.failures == 0  # by the rules, not by a crash and a retry


async def test_live_batches_a_replay_already_applied_are_not_a_restart():
    """A gap's replay also brings the batches published while it was asked for; when those
    arrive on the SUB afterwards they are duplicates, not an engine restart (which would
    reset the index)."""
    toks = list(range(40))
    async with Harness(Publisher()) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN)
        await publish_until_received(h, [seq_blocks(toks[:8], 1)])
        h.pub.publish([stored([3], toks[8:12], parent=2)], send=False)  # lost
        # Both go out before the subscriber runs again: the replay the first one triggers
        # holds the second, which then also arrives live.
        h.pub.publish([stored([4], toks[12:16], parent=3)])
        h.pub.publish([stored([5], toks[16:20], parent=4)])
        await wait_until(lambda: h.stream.next_seq == h.pub.seq)
        # The SUB delivers in order: once this one is applied, the duplicate was handled.
        h.pub.publish([stored([6], toks[20:24], parent=5)])
        await wait_until(lambda: h.stream.next_seq == h.pub.seq)
        assert h.stream.stats.gaps == 1 and h.stream.stats.restarts == 0
        assert h.metric("xpyd_kv_event_restarts_total") == 0
        assert h.index.state is IndexState.KNOWN
        assert h.index.longest_prefix(chain_block_keys(toks, BS)) == 6


async def test_gap_without_replay_rebuilds_as_partial():
    toks = list(range(40))
    async with Harness(Publisher(replay=False)) as h:
        await publish_until_received(h, [AllBlocksCleared(), seq_blocks(toks[:8], 1)])
        assert h.index.state is IndexState.KNOWN  # a clear (or seq 0) seen: nothing missed
        h.pub.publish([stored([3], toks[8:12], parent=2)], send=False)
        h.pub.publish([seq_blocks(toks[20:28], 10)])
        await wait_until(lambda: h.stream.next_seq == h.pub.seq)
        assert h.index.state is IndexState.PARTIAL
        assert len(h.index) == 2  # dropped and rebuilt: only what came after the gap
        h.pub.publish([AllBlocksCleared()])
        await wait_until(lambda: h.index.state is IndexState.KNOWN)


async def two_batches_then_restart(h: Harness, toks: list[int]) -> None:
    """Seq 0 (blocks of toks[:16]) and seq 1 (one removal) applied, then the engine restarts."""
    await wait_until(lambda: h.index.state is IndexState.KNOWN)
    await publish_until_received(h, [seq_blocks(toks[:16], 1)])
    h.pub.publish([BlockRemoved((1,), "GPU")])
    await wait_until(lambda: h.stream.next_seq == 2)
    h.pub.restart()


async def test_engine_restart_resets_the_index():
    toks = list(range(40))
    async with Harness(Publisher()) as h:
        await two_batches_then_restart(h, toks)
        h.pub.publish([seq_blocks(toks[20:28], 50)])  # seq 0 again
        await wait_until(lambda: h.stream.stats.restarts == 1)
        await wait_until(lambda: h.stream.next_seq == 1)
        assert h.index.state is IndexState.KNOWN and len(h.index) == 2
        assert h.index.longest_prefix(chain_block_keys(toks[:16], BS)) == 0
        assert h.metric("xpyd_kv_event_restarts_total") == 1


async def test_silent_restart_is_caught_by_the_replay_probe():
    """The engine restarted and its first batches were lost: the probe's replay does not
    hold the batch last applied any more, so the index is reset and replayed from 0."""
    toks = list(range(40))
    async with Harness(Publisher()) as h:
        await two_batches_then_restart(h, toks)
        h.pub.publish([seq_blocks(toks[20:28], 50)], send=False)
        await wait_until(lambda: h.stream.stats.restarts == 1)
        await wait_until(lambda: h.index.longest_prefix(chain_block_keys(toks[20:28], BS)) == 2)
        assert h.index.state is IndexState.KNOWN and len(h.index) == 2


async def test_silent_publisher_is_unknown_never_empty():
    toks = list(range(16))
    async with Harness(Publisher(replay=False), silence_s=3.0) as h:  # the check of KNOWN well within it
        await publish_until_received(h, [AllBlocksCleared(), seq_blocks(toks)])
        assert h.index.state is IndexState.KNOWN
        await wait_until(lambda: h.index.state is IndexState.UNKNOWN)
        assert len(h.index) == 4  # kept, but not to be trusted while silent
        h.pub.publish([BlockRemoved((1000,), "GPU")])  # contiguous: nothing was missed
        await wait_until(lambda: h.index.state is IndexState.KNOWN)


async def test_idle_publisher_with_replay_stays_known_until_it_stops_answering():
    # 2 s of silence: a probe every 0.2 s, so a loaded box's slow answers still keep it known.
    async with Harness(Publisher(), silence_s=2.0) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN)
        await asyncio.sleep(4.0)  # idle, but its replay endpoint answers the probes
        assert h.index.state is IndexState.KNOWN
        h.pub.answer_replays = False
        await wait_until(lambda: h.index.state is IndexState.UNKNOWN)


async def test_garbage_is_dropped_counted_and_the_stream_goes_on():
    toks = list(range(16))
    async with Harness(Publisher()) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN)
        await publish_until_received(h, [seq_blocks(toks[:8], 1)])
        h.pub.send_raw([b"", b"\0" * 8, b"\xc1garbage"])
        h.pub.send_raw([b"", (1).to_bytes(8, "big"), _payload([{"type": "BlockStored"}])])
        h.pub.send_raw([b"x"])
        await wait_until(lambda: h.stream.stats.dropped == 3)
        h.pub.publish([stored([3], toks[8:12], parent=2)])
        await wait_until(lambda: h.stream.next_seq == h.pub.seq)
        assert h.index.longest_prefix(chain_block_keys(toks, BS)) == 3
        assert h.metric("xpyd_kv_events_total", result="malformed") == 2
        assert h.metric("xpyd_kv_events_total", result="invalid_event") == 1


async def test_cap_from_the_advertised_capacity():
    toks = list(range(40))
    async with Harness(Publisher(), blocks=3) as h:
        assert h.index.cap == 3
        await publish_until_received(h, [seq_blocks(toks)])
        # 10 blocks into 3 places: 7 evicted. A batch published again (its first copy was slow,
        # not lost, or came back in a replay) evicts all 10 once more.
        batches = h.stream.stats.batches
        assert len(h.index) == 3 and batches >= 1 and h.stream.stats.evicted == 7 + 10 * (batches - 1)


async def test_leaving_instance_is_unsubscribed():
    async with Harness(Publisher()) as h:
        stream = h.stream
        h.registry.remove("P", h.inst.http_address, "test")
        h.events.kick()
        await wait_until(lambda: not h.events.streams() and stream.task.done())
        assert h.events.state(h.inst) is IndexState.UNKNOWN


async def test_dead_replay_endpoint_costs_a_deadline_not_the_stream():
    """Nothing listens on the advertised replay endpoint: every ask gives up after its
    deadline and live events still apply."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    toks = list(range(16))
    async with Harness(Publisher(replay=False), replay=dead, replay_timeout_s=0.5) as h:
        await wait_until(lambda: h.stream.stats.replays_failed >= 1)
        await publish_until_received(h, [AllBlocksCleared(), seq_blocks(toks)])
        assert h.index.state is IndexState.KNOWN and len(h.index) == 4


@pytest.mark.parametrize("bind, want", [
    ("tcp://:::5557", "tcp://node-1:5557"),  # the IPv6 wildcard "::"
    ("tcp://[::]:5557", "tcp://node-1:5557"),
    ("tcp://:5557", "tcp://node-1:5557"),
    ("tcp://*:1", "tcp://node-1:1"),  # the lowest fixed port
    ("tcp://[::1]:5557", "tcp://[::1]:5557"),  # a concrete IPv6 host stays as given
    ("tcp://[::FFFF:10.0.0.7]:5557", "tcp://10.0.0.7:5557"),
])
def test_advertised_wildcards_and_concrete_hosts(bind, want):
    assert advertised(bind, "node-1") == want


@pytest.mark.parametrize("bad, why", [
    ("ipc:///tmp/x", "only tcp:// event endpoints can be advertised, got 'ipc:///tmp/x'"),
    ("tcp://*:0", "event endpoint 'tcp://\\*:0' needs a fixed port"),
    ("tcp://h", "event endpoint 'tcp://h' needs a fixed port"),
])
def test_advertised_refusal_says_why(bad, why):
    """The operator sees this at start-up: it must name the endpoint and the rule."""
    with pytest.raises(EventError, match=f"^{why}$"):
        advertised(bad, "h")


def test_split_endpoint_refusal_names_the_value():
    from xpyd_wire.kv_events import split_endpoint

    with pytest.raises(EventError, match="^endpoint must be a 'tcp://host:port' string, got 3$"):
        split_endpoint(3)
    with pytest.raises(EventError, match="^endpoint 'tcp://a b:1' is not tcp://host:port$"):
        split_endpoint("tcp://a b:1")
    assert split_endpoint("tcp://[::1]:65535") == ("[::1]", 65535)
    with pytest.raises(EventError, match="is not tcp://host:port"):
        split_endpoint("tcp://h:65536")


# ---------------------------------------------------------------- bounds, each side of each limit


def _one(event):
    return decode_batch([b"", b"\0" * 8, _payload([event])]).events[0]


@pytest.mark.parametrize("event", [
    {**GOOD, "block_hashes": [b"x"]},  # the shortest hash
    {**GOOD, "block_hashes": [b"x" * 64]},  # the longest (vLLM's are 32 bytes)
    {**GOOD, "block_size": 1, "token_ids": [7]},
    {**GOOD, "group_idx": 0xFFFF},
    {**GOOD, "lora_name": "a" * 256, "medium": "m" * 256},
    {"type": "BlockRemoved", "block_hashes": list(range(100_000)), "group_idx": 0},  # MAX_BLOCKS_PER_EVENT
])
def test_events_at_their_limits_are_accepted(event):
    ev = _one(event)
    assert ev.block_hashes == tuple(event["block_hashes"])


@pytest.mark.parametrize("event, why", [
    ({**GOOD, "block_hashes": [b""]}, "block hash must be bytes (<= 64) or an int"),
    ({"type": "BlockRemoved", "block_hashes": list(range(100_001))}, "block_hashes must be a list of 1..100000"),
    ({**GOOD, "group_idx": 0x10000}, "group_idx must be a small int"),
    ({**GOOD, "group_idx": "1"}, "group_idx must be a small int"),
    ({**GOOD, "group_idx": -1}, "group_idx must be a small int"),
    ({**GOOD, "lora_name": "a" * 257}, "lora_name must be a short string"),
    ({**GOOD, "extra_keys": "salt"}, "extra_keys must be a list"),
    ({**GOOD, "block_size": 0, "token_ids": []}, "block_size must be an int 1..4096"),
    ("BlockStored", "event is not a map"),
])
def test_events_past_their_limits_are_refused_with_the_reason(event, why):
    """Each refusal is logged with its reason (the metric counts it as invalid_event)."""
    with pytest.raises(EventError, match=f"^{__import__('re').escape(why)}$") as e:
        _one(event)
    assert e.value.reason == INVALID_EVENT


def test_encode_batch_writes_extra_keys_as_vllm_does():
    """The test publisher's extra_keys: vLLM's per-block list, the LoRA name first."""
    def extra_keys(lora, extra):
        ev = BlockStored((1, 2), None, tuple(range(8)), BS, lora, "GPU", 0, extra)
        return msgpack.unpackb(encode_batch(EventBatch(0, 1.0, (ev,)))[2])[1][0]["extra_keys"]

    assert extra_keys(None, False) is None
    assert extra_keys("ad", False) == [["ad"], ["ad"]]
    assert extra_keys("ad", True) == [["ad", "salt"], ["ad", "salt"]]
    assert extra_keys(None, True) == [["salt"], ["salt"]]


def test_chain_block_keys_bounds():
    assert len(chain_block_keys(list(range(11)), 4)) == 2  # 3 trailing tokens: no third key
    assert len(chain_block_keys(list(range(3)), 1)) == 3  # block size 1 is a valid size
    for bad in (0, -4):
        with pytest.raises(ValueError, match="^block_size must be positive$"):
            chain_block_keys([1, 2, 3], bad)


@pytest.mark.parametrize("value", [
    {"endpoint": "tcp://h:1", "replay_endpoint": "tcp://h:2", "topic": "t" * 256, "blocks": 1,
     "a": 1, "b": 2, "c": 3, "d": 4},  # 8 fields, the longest topic, the fewest blocks
    {"endpoint": "tcp://h:1", "blocks": 1 << 32},
])
def test_decode_endpoint_at_its_limits(value):
    ep = decode_endpoint(value)
    assert (ep.endpoint, ep.blocks) == (value["endpoint"], value["blocks"])
    assert ep.topic == value.get("topic", "")


@pytest.mark.parametrize("value, why", [
    ({"endpoint": "tcp://h:1", "a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6, "g": 7, "h": 8},
     "kv_events must be a small map"),
    ({"endpoint": "tcp://h:1", "topic": "t" * 257}, "kv_events.topic must be a string of <= 256 characters"),
    ({"endpoint": "tcp://h:1", "blocks": (1 << 32) + 1}, "kv_events.blocks must be an int 1..4294967296"),
])
def test_decode_endpoint_past_its_limits(value, why):
    with pytest.raises(EventError, match=f"^{why}$"):
        decode_endpoint(value)
    assert decode_endpoint({"endpoint": "tcp://h:1"}).topic == ""


def test_group_idx_survives_the_test_publisher():
    s = BlockStored((1,), None, (1, 2, 3, 4), BS, None, "GPU", 3)
    r = BlockRemoved((1,), "GPU", 2)
    back = decode_batch(encode_batch(EventBatch(0, 1.0, (s, r)))).events
    assert (back[0].group_idx, back[1].group_idx) == (3, 2)


def test_replay_request_is_vllms_frame_shape():
    """vLLM's replay ROUTER reads [identity, b"", start seq as 8 big-endian bytes] (the DEALER
    sends the last two)."""
    from xpyd_wire.kv_events import replay_request

    assert replay_request(5) == [b"", b"\0\0\0\0\0\0\0\x05"]


def _frames(payload: bytes, topic: bytes = b"", seq: bytes = b"\0" * 8) -> list[bytes]:
    return [topic, seq, payload]


@pytest.mark.parametrize("frames, reason, why", [
    ([b"", b"\0" * 8], MALFORMED, "2 frames, not 3"),
    (_frames(_payload([]), seq=b"\0" * 7), MALFORMED, "seq frame of 7 bytes, not 8"),
    (_frames(_payload([]), seq=b"\xff" * 8), MALFORMED, "negative seq"),
    (_frames(_payload([]), topic=b"t" * 50), WRONG_TOPIC, "topic " + repr(b"t" * 40)),
    (_frames(b"\xc1"), MALFORMED, "not msgpack: FormatError"),
    (_frames(msgpack.packb([1.0])), MALFORMED, "payload is not a KVEventBatch array"),
    (_frames(msgpack.packb([1.0, [], 0, 0])), MALFORMED, "payload is not a KVEventBatch array"),
    (_frames(msgpack.packb([1.0, [{"type": "AllBlocksCleared", 1: 2}]])), MALFORMED,
     "not msgpack: ValueError"),  # only string map keys
    (_frames(msgpack.packb([1.0, [{**GOOD, "token_ids": [1] * 1_600_001}]])), MALFORMED,
     "not msgpack: ValueError"),  # no array longer than MAX_BLOCKS_PER_EVENT * 16
    (_frames(_payload([{**GOOD, "block_size": "4"}])), INVALID_EVENT, "block_size must be an int 1..4096"),
    (_frames(_payload([{**GOOD, "token_ids": [1, 2, 3]}])), INVALID_EVENT,
     "token_ids must hold block_size tokens per block hash"),
    (_frames(_payload([{**GOOD, "token_ids": [1, 2, 3, 2**32]}])), INVALID_EVENT, "token ids must be ints 0..2**32-1"),
    (_frames(_payload([{"type": "Nope"}])), INVALID_EVENT, "unknown event type 'Nope'"),
    (_frames(_payload([{"type": "BlockRemoved", "block_hashes": []}])), INVALID_EVENT,
     "block_hashes must be a list of 1..100000"),
    (_frames(msgpack.packb(["1.0", []])), MALFORMED, "batch ts must be a number"),
    (_frames(msgpack.packb([1.0, "xy"])), MALFORMED, "batch events must be a list"),
    (_frames(msgpack.packb([1.0, [{"type": "AllBlocksCleared"}] * 100_001])), MALFORMED,
     "batch events must be a list"),  # at most MAX_EVENTS_PER_BATCH
])  # fmt: skip
def test_refused_batches_say_why(frames, reason, why):
    import re

    with pytest.raises(EventError, match=f"^{re.escape(why)}$") as e:
        decode_batch(frames)
    assert e.value.reason == reason


def test_batch_size_limit_both_sides():
    from xpyd_wire.kv_events import MAX_BATCH_BYTES

    def padded(n: int) -> bytes:  # a valid batch of exactly n bytes (the third field is ignored)
        pad = n - len(msgpack.packb([1.0, [], b""]))  # then adjust for the longer bin header
        for extra in range(-8, 9):
            out = msgpack.packb([1.0, [], b"x" * (pad + extra)])
            if len(out) == n:
                return out
        raise AssertionError(n)

    assert decode_batch(_frames(padded(MAX_BATCH_BYTES))).events == ()
    with pytest.raises(EventError, match=f"^payload of {MAX_BATCH_BYTES + 1} bytes$") as e:
        decode_batch(_frames(padded(MAX_BATCH_BYTES + 1)))
    assert e.value.reason == MALFORMED
    assert len(decode_batch(_frames(msgpack.packb([1.0, [{"type": "AllBlocksCleared"}] * 100_000]))).events) == 100_000
    # the vLLM of two fields (no data_parallel_rank) is a batch too
    assert decode_batch(_frames(msgpack.packb([1.0, []]))).ts == 1.0


def test_events_at_the_block_size_and_token_id_limits():
    big = {**GOOD, "block_size": 4096, "token_ids": [2**32 - 1] * 4096}
    assert _one(big).block_size == 4096
    # 7000 blocks of 16 tokens: 112,000 token ids, past MAX_EVENTS_PER_BATCH but within the array bound
    many = {**GOOD, "block_hashes": list(range(7000)), "block_size": 16, "token_ids": [1] * 112_000}
    assert len(_one(many).token_ids) == 112_000


# ---------------------------------------------------------------- the sequence rules, no sockets
# KVEvents.handle() and reconcile() on a proxy that has not started (no ZMQ context): every
# replay ask fails at once, as for an instance without a replay endpoint.


class Direct:
    def __init__(self, blocks: int | None = None, clock=time.monotonic, topic: str = "", **cfg) -> None:
        self.registry = Registry(heartbeat_timeout=30)
        self.metrics = Metrics(self.registry)
        self.events = KVEvents(self.registry, self.metrics, EventsConfig(**cfg), clock=clock)
        self.ep = EventsEndpoint("tcp://127.0.0.1:23001", None, topic, blocks)
        reg = discovery.Registration("D", "127.0.0.1:18001", "127.0.0.1:14579", kv_events=self.ep)
        self.inst = self.registry.upsert(reg)
        self.registry.admit(self.inst)
        self.events.reconcile()
        self.stream = self.events.streams()[0]

    async def send(self, seq: int, *events) -> None:
        await self.events.handle(self.stream, encode_batch(EventBatch(seq, 1.0, tuple(events)), self.ep.topic))

    def metric(self, name, **labels):
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def _blocks(first: int, n: int = 1):
    """n chained one-block BlockStored events' worth of blocks, hashes first, first+1, ..."""
    return stored(range(first, first + n), range(first * BS, (first + n) * BS), None)


async def test_first_batch_at_seq_0_is_everything_and_the_next_ones_apply():
    d = Direct()
    s = d.stream
    assert d.events.state(d.inst) is IndexState.UNKNOWN and s.next_seq is None and s.last_digest is None
    await d.send(0, _blocks(10, 2))
    assert d.events.state(d.inst) is IndexState.KNOWN and len(s.index) == 2 and s.next_seq == 1
    assert s.stats.batches == 1 and s.stats.gaps == 0 and s.last_digest is not None
    assert d.metric("xpyd_kv_events_total", result="applied") == 1
    digest = s.last_digest
    await d.send(1, _blocks(20))
    assert s.next_seq == 2 and len(s.index) == 3 and s.last_digest != digest and s.stats.batches == 2
    assert d.metric("xpyd_kv_event_gaps_total") == 0 and d.metric("xpyd_kv_event_restarts_total") == 0
    assert s.last_heard > 0 and s.index.live


async def test_a_gap_without_replay_rebuilds_from_the_batch_after_it():
    d = Direct()
    s = d.stream
    await d.send(0, _blocks(10, 2))
    await d.send(5, _blocks(20))  # 1..4 missed, nothing to replay them from
    assert s.stats.gaps == 1 and d.metric("xpyd_kv_event_gaps_total") == 1
    assert d.events.state(d.inst) is IndexState.PARTIAL and len(s.index) == 1 and s.next_seq == 6
    assert s.stats.restarts == 0 and s.stats.replays_failed == 0  # no replay endpoint: no ask
    # A first batch after seq 0 is a gap too: what came before is not known.
    d2 = Direct()
    await d2.send(3, _blocks(10))
    assert d2.stream.stats.gaps == 1 and d2.events.state(d2.inst) is IndexState.PARTIAL
    assert d2.stream.next_seq == 4


async def test_a_seq_going_back_is_an_engine_restart_unless_a_replay_brought_it(caplog):
    caplog.set_level(logging.INFO, logger="xpyd.proxy.kv_events")
    d = Direct()
    s = d.stream
    for seq in range(3):
        await d.send(seq, _blocks(10 + seq))
    assert len(s.index) == 3
    # Duplicates of batches a replay applied (seq in [replayed_from, next_seq)): skipped.
    s.replayed_from = 1
    await d.send(1, _blocks(50))
    await d.send(2, _blocks(51))
    assert s.next_seq == 3 and len(s.index) == 3 and s.stats.restarts == 0 and s.stats.batches == 3
    # Below the replayed range: the engine restarted (its seq starts again near 0).
    await d.send(0, _blocks(60))
    assert s.stats.restarts == 1 and d.metric("xpyd_kv_event_restarts_total") == 1
    assert list(s.index._by_hash) == [60]  # only what came after the restart
    assert d.events.state(d.inst) is IndexState.KNOWN and s.next_seq == 1 and s.replayed_from is None
    # A restart whose seq 0 was missed: the index restarts as a subset.
    await d.send(7, _blocks(70))
    await d.send(2, _blocks(80))
    assert s.stats.restarts == 2 and s.stats.gaps == 2 and list(s.index._by_hash) == [80]
    assert d.events.state(d.inst) is IndexState.PARTIAL and s.next_seq == 3
    assert d.events.view(d.inst) == {
        "state": "partial", "blocks": 1, "cap": 262_144, "next_seq": 3, "gaps": 2, "replays_ok": 0,
        "replays_failed": 0, "restarts": 2, "dropped": 0, "reconnects": 0, "failures": 0}
    assert [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()] == [
        f"kv events: engine restarted (seq went back {a} -> {b}), index reset http=127.0.0.1:18001"
        for a, b in ((3, 0), (8, 2))]


async def test_garbage_is_dropped_and_counted_by_reason(caplog):
    d = Direct()
    await d.send(0, _blocks(10))
    for frames in ([b"x"], [b"", b"\0" * 8, b"\xc1"], [b"other", b"\0" * 8, _payload([])],
                   [b"", (1).to_bytes(8, "big"), _payload([{"type": "Nope"}])]):
        await d.events.handle(d.stream, frames)
    s = d.stream
    assert s.stats.dropped == 4 and s.next_seq == 1 and len(s.index) == 1 and s.stats.batches == 1
    assert d.metric("xpyd_kv_events_total", result="malformed") == 2
    assert d.metric("xpyd_kv_events_total", result="wrong_topic") == 1
    assert d.metric("xpyd_kv_events_total", result="invalid_event") == 1
    assert any("kv event dropped reason=wrong_topic http=127.0.0.1:18001 (3 so far)" in r.getMessage()
               for r in caplog.records)


async def test_orphans_and_evictions_add_up_over_batches_and_the_topic_is_checked():
    d = Direct(blocks=1, topic="kv")
    await d.send(0, _blocks(10, 2))  # two blocks, cap 1: one evicted
    await d.send(1, _blocks(20, 2), stored([30], range(4), parent=999))  # and an orphan
    s = d.stream
    assert (s.stats.evicted, s.stats.orphans, s.next_seq) == (3, 1, 2)
    await d.send(2, stored([31], range(4), parent=998))
    assert (s.stats.evicted, s.stats.orphans, s.next_seq) == (3, 2, 3)
    await d.events.handle(s, encode_batch(EventBatch(3, 1.0, (_blocks(40),))))  # topic "": not ours
    assert s.stats.dropped == 1 and s.next_seq == 3


def test_cap_is_the_advertised_capacity_never_above_the_flag():
    assert Direct().stream.index.cap == 262_144
    assert Direct(blocks=100).stream.index.cap == 100
    assert Direct(blocks=10**9, default_cap=500).stream.index.cap == 500
    assert Direct(default_cap=500).stream.index.cap == 500


def test_reconcile_follows_admission_departure_and_endpoint_changes(caplog):
    caplog.set_level(logging.INFO, logger="xpyd.proxy.kv_events")
    d = Direct()
    ev, reg = d.events, d.registry
    first = d.stream
    assert ev.index(d.inst) is first.index and ev.view(d.inst)["state"] == "unknown"
    # A pending instance (not answered yet) is not subscribed; no endpoint: nothing to follow.
    other_ep = EventsEndpoint("tcp://127.0.0.1:23002")
    p = reg.upsert(discovery.Registration("P", "127.0.0.1:18002", "127.0.0.1:1", kv_events=other_ep))
    reg.upsert(discovery.Registration("P", "127.0.0.1:18003", "127.0.0.1:1"))
    ev.reconcile()
    assert ev.streams() == [first] and ev.index(p) is None and ev.view(p) is None
    assert ev.state(p) is IndexState.UNKNOWN
    reg.admit(p)
    ev.reconcile()
    assert [s.inst for s in ev.streams()] == [d.inst, p] and ev.streams()[1].endpoint == other_ep
    ev.reconcile()  # nothing changed: the same streams
    assert ev.streams()[0] is first
    # The owner moved its endpoint: a new stream on the new one.
    moved = EventsEndpoint("tcp://127.0.0.1:23009")
    reg.upsert(discovery.Registration("D", "127.0.0.1:18001", "127.0.0.1:14579", kv_events=moved))
    ev.reconcile()
    now = {s.inst: s for s in ev.streams()}
    assert now[d.inst] is not first and now[d.inst].endpoint == moved
    reg.remove("P", p.http_address, "leave")
    ev.reconcile()
    assert [s.inst for s in ev.streams()] == [d.inst] and ev.index(p) is None
    lines = [r.getMessage() for r in caplog.records]
    assert "kv events unsubscribe role=D http=127.0.0.1:18001 reason=endpoint_changed" in lines
    assert "kv events unsubscribe role=P http=127.0.0.1:18002 reason=left" in lines
    assert ("kv events subscribe role=D http=127.0.0.1:18001 endpoint=tcp://127.0.0.1:23009 "
            "replay=None cap=262144") in lines


def test_context_sized_for_every_instance_the_registry_may_hold():
    d = Direct()
    assert d.events.max_sockets() == 4 * (2 * 1024 + 64) + 64
    d.registry.max_per_role = 10
    assert d.events.max_sockets() == 4 * (2 * 10 + 64) + 64
    assert Direct(max_sockets=77).events.max_sockets() == 77


async def test_index_size_and_state_per_instance_at_scrape_time():
    d = Direct()
    await d.send(0, _blocks(10, 3))
    labels = {"role": "D", "instance": "127.0.0.1:18001"}
    assert d.metric("xpyd_kv_index_blocks", **labels) == 3
    assert d.metric("xpyd_kv_index_state", state="known", **labels) == 1
    assert d.metrics.registry.get_sample_value("xpyd_kv_index_state", {**labels, "state": "unknown"}) is None


async def test_silence_makes_the_index_unknown_after_silence_s(caplog):
    now = [100.0]
    d = Direct(clock=lambda: now[0], silence_s=10.0)
    await d.send(0, _blocks(10))
    assert d.stream.last_heard == 100.0
    now[0] = 110.0
    await d.events._probe(d.stream)  # exactly silence_s: still known
    assert d.events.state(d.inst) is IndexState.KNOWN
    now[0] = 110.5
    await d.events._probe(d.stream)
    assert d.events.state(d.inst) is IndexState.UNKNOWN and len(d.stream.index) == 1
    assert any(r.getMessage() == "kv events silent for 10s, index unknown http=127.0.0.1:18001"
               for r in caplog.records)


async def test_failed_replay_probes_back_off_doubling_to_the_most():
    now = [0.0]
    d = Direct(clock=lambda: now[0], probe_s=2.0, backoff_s=(0.1, 10.0))
    d.stream.endpoint = EventsEndpoint("tcp://127.0.0.1:23001", "tcp://127.0.0.1:23002")
    waits = []
    for _ in range(5):
        now[0] = d.stream.next_probe
        await d.events._probe(d.stream)
        waits.append(d.stream.next_probe - now[0])
    assert waits == [2.0, 4.0, 8.0, 10.0, 10.0] and d.stream.replay_fails == 5
    now[0] = d.stream.next_probe - 0.01  # before the next ask is due: none
    await d.events._probe(d.stream)
    assert d.stream.replay_fails == 5
    await d.events._probe(d.stream, force=True)  # a reconnect asks at once
    assert d.stream.replay_fails == 6
    # The exponent stops at 16: with no most, the 18th failure waits as long as the 17th.
    far = Direct(clock=lambda: now[0], probe_s=1.0, backoff_s=(0.1, 1e9))
    far.stream.endpoint = d.stream.endpoint
    far.stream.replay_fails = 16
    for fails in (17, 18):
        await far.events._probe(far.stream, force=True)
        assert far.stream.replay_fails == fails and far.stream.next_probe - now[0] == 2.0**16


@contextlib.contextmanager
def _monitor_pair(name: str):
    """(a, b): what a sends, b reads as a SUB's monitor socket would (libzmq's monitor speaks
    over an inproc PAIR)."""
    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind(f"inproc://{name}")
        b.connect(f"inproc://{name}")
        yield a, b
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def _monitor_event(kind: int, value: int | None = 0) -> list[bytes]:
    """A monitor event: its kind (2 bytes, little-endian) and value (4 bytes), then the endpoint."""
    head = kind.to_bytes(2, "little") + (b"" if value is None else value.to_bytes(4, "little"))
    return [head, b"tcp://127.0.0.1:23001"]


def test_a_dropped_connection_is_read_from_the_monitor_and_logged(caplog):
    import zmq

    d = Direct()
    with _monitor_pair("mon") as (a, b):
        assert not _dropped(b, d.stream)  # nothing reported: still connected
        a.send_multipart(_monitor_event(zmq.EVENT_CLOSED))
        assert _dropped(b, d.stream) and not _dropped(b, d.stream)  # drained
        for event in (zmq.EVENT_CLOSED, zmq.EVENT_DISCONNECTED):
            a.send_multipart(_monitor_event(event))
        assert _dropped(b, d.stream)
        d.stream.stats.reconnects = 10  # the 11th: not logged (10 first, then every 100th)
        a.send(b"\x01")
        assert _dropped(b, d.stream)
    lines = [r.getMessage() for r in caplog.records if "connection lost" in r.getMessage()]
    assert lines == [
        f"kv events connection lost http=127.0.0.1:18001 endpoint=tcp://127.0.0.1:23001 ({what}; the "
        f"publisher went away, closed it, or sent a message over {MAX_MESSAGE_BYTES} bytes): reconnect 1 in 0.1s"
        for what in ("connect failed", "disconnected")]


def test_the_open_file_limit_is_raised_toward_what_the_sockets_need(caplog):
    import resource

    caplog.set_level(logging.INFO, logger="xpyd.proxy.kv_events")
    was, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 1000:
        pytest.skip("needs a finite hard open-file limit of 1000 or more")
    soft = hard - 100  # lowering the soft limit needs no privilege; raising it back to hard neither
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        _raise_fd_limit(soft)  # enough already: unchanged
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
        _raise_fd_limit(soft + 10)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft + 10, hard)
        _raise_fd_limit(hard + 5)  # beyond the hard limit: up to it, and said
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (was, hard))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"open-file limit raised {soft} -> {soft + 10} for KV-event streams",
                     f"open-file limit {hard} (hard) is below the {hard + 5} KV-event streams may need"]


async def test_a_failing_stream_is_retried_with_a_doubling_backoff_reset_by_a_stable_connection(caplog):
    """_run's policy, with the connection itself (_follow) replaced: it fails, or lasts."""
    now = [0.0]
    d = Direct(clock=lambda: now[0], backoff_s=(0.001, 0.004), stable_s=10.0)
    s, outcomes, retries = d.stream, ["fail", "fail", "fail", "fail", "stable", "end", "fail"], []

    async def follow(stream, first):
        retries.append((stream.retry_s, first))
        what = outcomes.pop(0) if outcomes else "hang"
        if what == "fail":
            raise RuntimeError("boom")
        if what == "stable":
            now[0] += 10.0  # the connection lasted stable_s
        if what == "hang":
            await asyncio.Event().wait()

    d.events._follow = follow
    s.index.live = True
    task = asyncio.get_running_loop().create_task(d.events._run(s))
    try:
        await wait_until(lambda: not outcomes and len(retries) == 8)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert retries == [(0.001, True), (0.002, False), (0.004, False), (0.004, False), (0.004, False),
                       (0.002, False), (0.004, False), (0.004, False)]
    assert s.stats.failures == 5 and s.stats.reconnects == 7 and not s.index.live
    assert d.metric("xpyd_kv_event_reconnects_total", reason="failed") == 5
    assert d.metric("xpyd_kv_event_reconnects_total", reason="disconnected") == 2
    assert "kv events stream failed http=127.0.0.1:18001 (1 so far), retry in 0.0s: RuntimeError: boom" in [
        r.getMessage() for r in caplog.records]


async def test_dropped_messages_are_logged_ten_then_every_thousandth(caplog):
    d = Direct()
    for _ in range(2000):
        await d.events.handle(d.stream, [b"x"])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv event dropped")]
    assert [line.split("(")[1].split(" ")[0] for line in lines] == [*map(str, range(1, 11)), "1000", "2000"]
    assert lines[0] == ("kv event dropped reason=malformed http=127.0.0.1:18001 (1 so far): "
                        "1 frames, not 3")
    assert d.stream.stats.dropped == 2000 and d.metric("xpyd_kv_events_total", result="malformed") == 2000


async def test_a_large_payload_is_decoded_on_the_worker_thread(monkeypatch):
    import concurrent.futures
    import threading

    import proxy.routing.kv_events as mod

    threads = []

    def spy(frames, topic=""):
        threads.append((threading.current_thread().name, len(frames[2])))
        return decode_batch(frames, topic)

    monkeypatch.setattr(mod, "decode_batch", spy)
    d = Direct(topic="kv")
    d.events._decoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xpyd-kv-decode")
    try:
        await d.send(0, _blocks(10))
        big = encode_batch(EventBatch(1, 1.0, (_blocks(100, 6000),)), "kv")
        assert len(big[2]) > mod.INLINE_DECODE_BYTES
        await d.events.handle(d.stream, big)
        await d.events.handle(d.stream, [b"other", *big[1:]])  # refused on the worker too
    finally:
        d.events._decoder.shutdown()
    (inline, small), (worker, large), (worker2, _) = threads
    assert inline == threading.current_thread().name and small < mod.INLINE_DECODE_BYTES
    assert worker.startswith("xpyd-kv-decode") and worker2.startswith("xpyd-kv-decode")
    assert large > mod.INLINE_DECODE_BYTES and d.stream.next_seq == 2 and len(d.stream.index) == 6001
    assert d.metric("xpyd_kv_events_total", result="wrong_topic") == 1


async def test_stop_waits_for_the_streams_it_closed():
    async with Harness(Publisher()) as h:
        stream = h.stream
        await wait_until(lambda: h.index.state is IndexState.KNOWN)
        h.registry.remove("P", h.inst.http_address, "test")
        h.events.reconcile()  # closes the stream: its task is cancelled, not finished yet
        assert not h.events.streams() and stream.task in h.events._closing
        await h.events.stop()
        await asyncio.sleep(0)  # the task's done callbacks run
        assert stream.task.done() and not h.events._closing


async def test_a_restart_seen_after_its_first_batch_was_lost_replays_from_zero():
    """The engine restarted and its seq 0 was lost: seq 1 arrives live, below what was
    expected. The index is reset and the replay asked from 0, so it is complete again."""
    toks = list(range(40))
    async with Harness(Publisher()) as h:
        await two_batches_then_restart(h, toks)
        h.pub.publish([seq_blocks(toks[20:28], 50)], send=False)  # seq 0: lost
        h.pub.publish([seq_blocks(toks[28:32], 60, parent=51)])  # seq 1
        await wait_until(lambda: h.stream.stats.restarts == 1 and h.stream.next_seq == 2)
        assert h.index.state is IndexState.KNOWN and len(h.index) == 3
        assert h.index.longest_prefix(chain_block_keys(toks[20:32], BS)) == 3
        assert h.stream.stats.failures == 0  # recovered by the rules, not by a crash and a retry


async def test_a_batch_lost_while_idle_is_found_by_the_probe_and_a_good_probe_resets_the_backoff():
    # A replay that timed out would take a new DEALER: 5 s, not the harness's 0.5 s, on a loaded box.
    async with Harness(Publisher(), replay_timeout_s=5.0) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN and h.stream.next_seq == 0)
        h.stream.replay_fails = 3  # as after failed asks
        h.pub.publish([seq_blocks(list(range(8)), 1)], send=False)  # seq 0, lost on the way
        await wait_until(lambda: h.stream.next_seq == 1)  # the probe's replay, from 0, brought it
        await wait_until(lambda: h.stream.replay_fails == 0)
        assert h.stream.next_probe <= time.monotonic() and len(h.index) == 2
        assert h.index.state is IndexState.KNOWN
        # A DEALER that read its answers to the end is kept for the next ask.
        dealer, asked = h.stream.dealer, h.pub.replay_requests
        assert dealer is not None
        await wait_until(lambda: h.pub.replay_requests > asked + 1)
        assert h.stream.dealer is dealer


# ---------------------------------------------------------------- replay asks, answer by answer


class ScriptedReplay:
    """A replay endpoint (a ROUTER, as vLLM's) that answers the n-th ask with answers[n]: the
    messages to send after the asker's id, or None for no answer (asks past the list: the
    last entry again). `delay`: seconds before each answer. For what vLLM's publisher
    (tests/support/kv_publisher.py) cannot be made to do: answer late, wrongly, or not at all."""

    END = [b"", b"", END_SEQ, b""]  # vLLM's end marker, as the DEALER reads it

    def __init__(self, answers: list[list[list[bytes]] | None], delay: float = 0.0) -> None:
        import zmq
        import zmq.asyncio

        self.answers, self.delay, self.asks = answers, delay, []
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            client, _, start = await self._sock.recv_multipart()
            self.asks.append(int.from_bytes(start, "big"))
            answer = self.answers[min(len(self.asks), len(self.answers)) - 1]
            await asyncio.sleep(self.delay)
            for message in answer or ():
                await self._sock.send_multipart([client, *message])

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._sock.close(linger=0)
        self._ctx.term()


def _message(seq: int, *events, topic: str = "") -> list[bytes]:
    """A batch as a replay answer carries it (after the empty delimiter)."""
    return [b"", *encode_batch(EventBatch(seq, 1.0, tuple(events)), topic)]


@pytest.mark.parametrize("answer", [
    [b"x", b"", END_SEQ, b""],  # the end marker but for its delimiter
    [b"x", *encode_batch(EventBatch(0, 1.0, (_blocks(10),)))],  # a batch but for its delimiter
    [b"", b"", END_SEQ],  # three frames
])  # fmt: skip
async def test_replay_answers_not_vllms_fail_the_ask_and_are_counted(answer, caplog):
    caplog.set_level(logging.WARNING, logger="xpyd.proxy.kv_events")
    replay = ScriptedReplay([[answer]])
    try:
        async with Harness(Publisher(replay=False), replay=replay.endpoint, replay_timeout_s=0.5) as h:
            await wait_until(lambda: h.stream.stats.replays_failed >= 1)
            assert h.metric("xpyd_kv_events_total", result="malformed") >= 1 and h.stream.stats.dropped >= 1
            assert h.stream.stats.replays_ok == 0 and len(h.index) == 0 and h.stream.next_seq is None
            assert h.index.state is IndexState.UNKNOWN
    finally:
        await replay.close()
    why = f"replay answer of {len(answer)} frames"
    assert f"kv event dropped reason=malformed http=127.0.0.1:18000 (1 so far): {why}" in [
        r.getMessage() for r in caplog.records
    ]


async def test_an_unanswered_replay_times_out_and_says_so(caplog):
    caplog.set_level(logging.WARNING, logger="xpyd.proxy.kv_events")
    replay = ScriptedReplay([None])
    try:
        async with Harness(Publisher(replay=False), replay=replay.endpoint, replay_timeout_s=0.5) as h:
            await wait_until(lambda: h.stream.stats.replays_failed >= 2)
            assert replay.asks[0] == 0 and h.index.state is IndexState.UNKNOWN
            assert h.stream.stats.replays_failed == h.metric("xpyd_kv_event_replays_total", result="failed")
    finally:
        await replay.close()
    assert "kv events replay timed out http=127.0.0.1:18000 start=0" in [r.getMessage() for r in caplog.records]


async def test_a_kept_dealer_whose_endpoint_went_away_fails_its_ask_at_the_deadline(caplog):
    """The DEALER read its answers to the end and was kept; then the replay endpoint goes
    away. libzmq's reconnecting is off, so the DEALER has no peer and its send blocks: the
    ask gives up at the replay deadline and says so. Answers that take a while (0.2 s, far
    within the deadline) are waited for."""
    caplog.set_level(logging.WARNING, logger="xpyd.proxy.kv_events")
    replay = ScriptedReplay([[ScriptedReplay.END]], delay=0.2)
    try:
        async with Harness(Publisher(replay=False), replay=replay.endpoint, replay_timeout_s=2.0) as h:
            await wait_until(lambda: h.stream.stats.replays_ok >= 2 and h.stream.dealer is not None)
            assert h.stream.stats.replays_failed == 0 and h.index.state is IndexState.KNOWN
            assert h.stream.stats.replays_ok == h.metric("xpyd_kv_event_replays_total", result="ok")
            await replay.close()
            unreachable = "kv events replay endpoint unreachable http=127.0.0.1:18000"
            await wait_until(lambda: unreachable in [r.getMessage() for r in caplog.records])
            assert h.stream.stats.replays_failed >= 1
            assert not any("replay timed out" in r.getMessage() for r in caplog.records)
    finally:
        await replay.close()


async def test_a_restart_whose_replay_from_zero_fails_leaves_the_index_partial():
    """The probe's replay no longer holds the batch applied last (the engine restarted): the
    index is reset, and stays a subset (PARTIAL) while the replay from 0 does not answer."""
    first = [_message(0, _blocks(10)), ScriptedReplay.END]
    replay = ScriptedReplay([first, [ScriptedReplay.END], None])
    try:
        async with Harness(Publisher(replay=False), replay=replay.endpoint, silence_s=30.0) as h:
            await wait_until(lambda: h.stream.stats.restarts == 1 and h.stream.stats.replays_failed >= 1)
            assert replay.asks[:3] == [0, 0, 0]  # from 0; the check of batch 0; from 0 again
            assert h.stream.next_seq is None and len(h.index) == 0
            assert h.index.state is IndexState.PARTIAL
    finally:
        await replay.close()


@pytest.mark.parametrize("batches, failed", [(5, 0), (6, 1)])
async def test_a_replay_reads_at_most_max_replay_batches(monkeypatch, batches, failed):
    """A replay of MAX_REPLAY_BATCHES batches and its end marker is read whole; one more
    batch and the ask stops there (failed: the next probe goes on from what was applied)."""
    import proxy.routing.kv_events as mod

    monkeypatch.setattr(mod, "MAX_REPLAY_BATCHES", 5)
    pub = Publisher()
    for i in range(batches):
        pub.publish([_blocks(10 + i)], send=False)  # before the proxy subscribed
    async with Harness(pub, silence_s=30.0) as h:
        await wait_until(lambda: h.stream.next_seq == batches and h.stream.stats.replays_ok >= 1)
        assert h.stream.stats.replays_failed == failed and len(h.index) == batches
        assert h.index.state is IndexState.KNOWN


async def test_a_replay_under_a_topic_is_applied():
    pub = Publisher(topic="kv")
    pub.publish([_blocks(10, 3)], send=False)
    async with Harness(pub) as h:
        await wait_until(lambda: h.stream.next_seq == 1)
        assert len(h.index) == 3 and h.index.state is IndexState.KNOWN
        assert h.stream.stats.replays_failed == 0 and h.stream.stats.dropped == 0


async def test_a_replay_that_ends_just_before_the_live_batch_applies_the_live_batch():
    """The replay for a gap brings everything up to the live batch that showed the gap, but
    not that batch (a publisher that buffers a batch after sending it): the live batch is
    applied next, not taken for one the replay brought."""
    toks = list(range(40))
    async with Harness(Publisher(), silence_s=30.0) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN)
        await publish_until_received(h, [seq_blocks(toks[:8], 1)])
        h.pub.publish([stored([3], toks[8:12], parent=2)], send=False)  # seq 1: lost, buffered
        h.pub.send_raw(encode_batch(EventBatch(2, 1.0, (stored([4], toks[12:16], parent=3),))))  # not buffered
        await wait_until(lambda: h.stream.next_seq == 3)
        assert h.index.longest_prefix(chain_block_keys(toks, BS)) == 4 and h.index.state is IndexState.KNOWN
        assert h.stream.stats.gaps == 1 and h.stream.stats.failures == 0


@pytest.mark.parametrize("budget_s", [0.0, 60.0])
async def test_a_large_batch_gives_the_loop_back_only_past_its_budget(budget_s):
    """Applied in steps of APPLY_STEP_BLOCKS blocks: past the budget each step lets the loop
    run (at once, not after a pause); within it the batch is applied in one go."""
    from proxy.routing.kv_index import APPLY_STEP_BLOCKS

    d = Direct(budget_s=budget_s)
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(ticker())
    await asyncio.sleep(0)
    try:
        events = [_blocks(1000 * (i + 1), APPLY_STEP_BLOCKS) for i in range(8)]
        before, t0 = turns, time.monotonic()
        await d.send(0, *events)
        during, took = turns - before, time.monotonic() - t0
    finally:
        task.cancel()
    assert len(d.stream.index) == 8 * APPLY_STEP_BLOCKS and d.stream.next_seq == 1
    if budget_s:
        assert during == 0
    else:  # seven steps, each a loop turn (a pause of a second each would take 7 s)
        assert during >= 7 and took < 3.0, (during, took)


@pytest.mark.parametrize("extra, worker", [(0, False), (1, True)])
async def test_payloads_up_to_inline_decode_bytes_are_decoded_inline(monkeypatch, extra, worker):
    """The bound is the payload's size: exactly INLINE_DECODE_BYTES inline, one byte more on
    the worker."""
    import concurrent.futures
    import threading

    import proxy.routing.kv_events as mod

    def frames_of(size: int) -> list[bytes]:
        """A batch whose payload is `size` bytes: 15 blocks of 4096 token ids, each id 1
        (one byte in msgpack) or 200 (two)."""
        tokens = [1] * (15 * 4096)
        frames = encode_batch(EventBatch(0, 1.0, (BlockStored(tuple(range(15)), None, tuple(tokens), 4096),)), "kv")
        grow = size - len(frames[2])
        tokens[:grow] = [200] * grow
        return encode_batch(EventBatch(0, 1.0, (BlockStored(tuple(range(15)), None, tuple(tokens), 4096),)), "kv")

    frames = frames_of(mod.INLINE_DECODE_BYTES + extra)
    assert len(frames[2]) == mod.INLINE_DECODE_BYTES + extra
    threads = []

    def spy(frames, topic):
        threads.append(threading.current_thread().name)
        return decode_batch(frames, topic)

    monkeypatch.setattr(mod, "decode_batch", spy)
    d = Direct(topic="kv")
    d.events._decoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xpyd-kv-decode")
    try:
        await d.events.handle(d.stream, frames)
    finally:
        d.events._decoder.shutdown()
    assert threads[0].startswith("xpyd-kv-decode") is worker and d.stream.next_seq == 1


@pytest.mark.parametrize(
    "events, what",
    [
        ([["CLOSED", 17]], "connect failed"),  # the event's value (a descriptor) is not part of its kind
        ([["CLOSED", None]], "connect failed"),  # a first frame of just the kind
        ([["CLOSED", 0], [b"\x01"]], "connect failed"),  # a frame too short for a kind names none
        ([["CLOSED", 0], ["DISCONNECTED", 0]], "disconnected"),
    ],
)
def test_the_monitors_event_kinds_name_the_drop(caplog, events, what):
    """libzmq's monitor event: a first frame of the event's kind (2 bytes, little-endian) and
    its value (4 bytes), then the endpoint. Only the kind decides what the log says."""
    import zmq

    d = Direct()
    with _monitor_pair("mon-kinds") as (a, b):
        for event in events:
            if isinstance(event[0], bytes):
                a.send_multipart(event)
                continue
            kind, value = event
            a.send_multipart(_monitor_event(getattr(zmq, f"EVENT_{kind}"), value))
        assert _dropped(b, d.stream)
    (line,) = [r.getMessage() for r in caplog.records if "connection lost" in r.getMessage()]
    assert f"endpoint=tcp://127.0.0.1:23001 ({what}; the publisher" in line


@pytest.mark.parametrize("reconnects, logged", [(9, True), (10, False), (98, False), (99, True), (100, False)])
def test_lost_connections_are_logged_ten_then_every_hundredth(caplog, reconnects, logged):
    import zmq

    caplog.set_level(logging.WARNING, logger="xpyd.proxy.kv_events")
    d = Direct()
    d.stream.stats.reconnects = reconnects  # this drop is the (reconnects + 1)-th
    with _monitor_pair("mon-every") as (a, b):
        a.send_multipart(_monitor_event(zmq.EVENT_DISCONNECTED))
        assert _dropped(b, d.stream)
    lines = [r.getMessage() for r in caplog.records if "connection lost" in r.getMessage()]
    assert [line.split("reconnect ")[1].split(" ")[0] for line in lines] == ([str(reconnects + 1)] if logged else [])


async def test_start_sizes_the_fd_limit_and_names_its_decoder_and_task(monkeypatch, caplog):
    """start(): the open-file limit asked for is two per socket the context may hold; a
    large replayed payload is decoded on the one worker thread named for it; the tasks are
    named, the subscription logged and the index metrics described for an operator."""
    import threading

    from prometheus_client import generate_latest

    import proxy.routing.kv_events as mod

    caplog.set_level(logging.INFO, logger="xpyd.proxy.kv_events")
    wanted, threads = [], []
    monkeypatch.setattr(mod, "_raise_fd_limit", wanted.append)

    def spy(frames, topic):
        threads.append(threading.current_thread().name)
        return decode_batch(frames, topic)

    monkeypatch.setattr(mod, "decode_batch", spy)
    pub = Publisher()
    pub.publish([_blocks(100, 6000)], send=False)  # > INLINE_DECODE_BYTES, before the proxy subscribed
    async with Harness(pub, silence_s=30.0) as h:
        await wait_until(lambda: h.stream.next_seq == 1)
        assert wanted == [h.events.max_sockets() * 2]
        assert threads[0] == "xpyd-kv-decode_0" and set(threads) == {threads[0]} and len(h.index) == 6000
        assert h.events._task.get_name() == "xpyd-kv-events" and h.stream.task.get_name() == "xpyd-kv-events-P"
        exposition = generate_latest(h.metrics.registry).decode()
        assert "# HELP xpyd_kv_index_blocks Blocks the proxy's KV index holds per instance\n" in exposition
        assert "# HELP xpyd_kv_index_state 1 for the instance's KV index state (unknown/partial/known)\n" in exposition
    assert (
        f"kv events subscribe role=P http=127.0.0.1:18000 endpoint={pub.endpoint} replay={pub.replay_endpoint} "
        "cap=262144"
    ) in [r.getMessage() for r in caplog.records]


async def test_a_replay_whose_batch_at_the_check_differs_is_a_restart(caplog):
    """The probe asks from the batch applied last: the same seq with another payload is
    another engine (restarted, and its seq caught up): the index is reset and replayed from 0."""
    caplog.set_level(logging.INFO, logger="xpyd.proxy.kv_events")
    replay = ScriptedReplay(
        [
            [_message(0, _blocks(10)), ScriptedReplay.END],
            [_message(0, _blocks(20)), ScriptedReplay.END],  # seq 0 again, other blocks
            [_message(0, _blocks(20)), ScriptedReplay.END],
        ]
    )
    try:
        async with Harness(Publisher(replay=False), replay=replay.endpoint, silence_s=30.0) as h:
            await wait_until(lambda: h.stream.stats.restarts == 1 and h.stream.stats.replays_ok >= 2)
            assert replay.asks[:3] == [0, 0, 0] and list(h.index._by_hash) == [20]
            assert h.index.state is IndexState.KNOWN and h.stream.next_seq == 1
    finally:
        await replay.close()
    why = "replay from 0 does not match what was applied"
    assert f"kv events: engine restarted ({why}), index reset http=127.0.0.1:18000" in [
        r.getMessage() for r in caplog.records
    ]


async def test_a_replay_no_longer_holding_the_first_missed_batch_rebuilds_as_partial(caplog):
    caplog.set_level(logging.INFO, logger="xpyd.proxy.kv_events")
    pub = Publisher(buffer_steps=2)
    async with Harness(pub, silence_s=30.0) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN)
        await publish_until_received(h, [_blocks(10)])  # seq 0
        for seq in (1, 2, 3):
            pub.publish([_blocks(10 + seq)], send=False)  # lost; the buffer keeps the last two
        pub.publish([_blocks(14)])  # seq 4: a gap; the replay from 1 starts at 3
        await wait_until(lambda: h.stream.next_seq == 5)
        assert h.index.state is IndexState.PARTIAL and sorted(h.index._by_hash) == [13, 14]
        assert h.stream.stats.gaps == 1 and h.stream.stats.failures == 0
    assert "kv events replay starts at 3, wanted 1: index rebuilt http=127.0.0.1:18000" in [
        r.getMessage() for r in caplog.records
    ]


async def test_a_replayed_batch_the_index_has_is_skipped_and_the_rest_applied():
    """A replay answer that also holds a batch already applied (not vLLM's order): skipped,
    the ask goes on."""
    b0, b1, b2 = _message(0, _blocks(10)), _message(1, _blocks(11)), _message(2, _blocks(12))
    replay = ScriptedReplay([[b0, b1, ScriptedReplay.END], [b1, b0, b2, ScriptedReplay.END], [b2, ScriptedReplay.END]])
    try:
        async with Harness(Publisher(replay=False), replay=replay.endpoint, silence_s=30.0) as h:
            await wait_until(lambda: h.stream.next_seq == 3)
            assert h.stream.stats.replays_failed == 0 and sorted(h.index._by_hash) == [10, 11, 12]
            assert h.stream.stats.restarts == 0 and h.index.state is IndexState.KNOWN
    finally:
        await replay.close()


async def test_reconcile_runs_every_reconcile_s_and_a_failure_is_logged_not_fatal(caplog):
    caplog.set_level(logging.ERROR, logger="xpyd.proxy.kv_events")
    async with Harness(Publisher(), silence_s=30.0) as h:
        pub2 = Publisher()
        try:
            ep = EventsEndpoint(pub2.endpoint, pub2.replay_endpoint, pub2.topic, None)
            reg = discovery.Registration("D", "127.0.0.1:18001", "127.0.0.1:14580", kv_events=ep)
            h.registry.admit(h.registry.upsert(reg))  # no kick(): the periodic pass finds it
            await wait_until(lambda: len(h.events.streams()) == 2)
            real, calls = h.events.reconcile, []

            def failing() -> None:
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("boom")
                real()

            h.events.reconcile = failing
            h.events.kick()
            await wait_until(lambda: len(calls) >= 2)  # the loop went on after the failure
        finally:
            pub2.close()
    (rec,) = [r for r in caplog.records if r.getMessage() == "kv events reconcile failed"]
    assert rec.exc_info is not None and "boom" in str(rec.exc_info[1])


async def test_stop_closes_the_context_and_the_decoder():
    async with Harness(Publisher()) as h:
        ctx, decoder = h.events._ctx, h.events._decoder
        await h.events.stop()
        assert ctx.closed
        with pytest.raises(RuntimeError):
            decoder.submit(int)  # shut down


async def test_a_reconnect_asks_the_replay_at_once_whatever_the_probe_schedule():
    """A message over MAX_MESSAGE_BYTES makes ZMQ drop the SUB's connection; the stream
    connects again and asks the replay endpoint at once (not at the next scheduled probe)
    for what passed meanwhile."""
    async with Harness(Publisher(), silence_s=30.0) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN)
        await publish_until_received(h, [_blocks(10)])  # seq 0
        h.stream.next_probe = time.monotonic() + 1000  # no probe due
        h.pub.publish([_blocks(11)], send=False)  # seq 1, lost
        h.pub.send_raw([b"", (2).to_bytes(8, "big"), b"\0" * (MAX_MESSAGE_BYTES + 1)])
        await wait_until(lambda: h.stream.next_seq == 2 and h.stream.stats.reconnects >= 1, timeout=10)
        assert sorted(h.index._by_hash) == [10, 11] and h.stream.stats.failures == 0
        assert h.index.state is IndexState.KNOWN
        # The dropped connection's SUB and monitor were closed: open are the new SUB, its
        # monitor's PAIR and the replay DEALER (the monitor's other PAIR is libzmq's own).
        assert len([s for s in h.events._ctx._sockets if not s.closed]) <= SOCKETS_PER_STREAM - 1


@pytest.mark.parametrize("budget_s", [60.0, 0.0])
async def test_a_burst_is_drained_within_the_budget_and_the_stream_stays_connected(budget_s):
    """Within the budget a wake-up drains up to drain_max batches (then one pause of
    coalesce_s); past it the stream pauses and goes on reading the same connection."""
    async with Harness(Publisher(), silence_s=30.0, coalesce_s=0.2, budget_s=budget_s) as h:
        await wait_until(lambda: h.index.state is IndexState.KNOWN)
        await publish_until_received(h, [_blocks(10)])
        n = 60 if budget_s else 5
        t0 = time.monotonic()
        for i in range(n):
            h.pub.publish([_blocks(100 + i)])
        await wait_until(lambda: h.stream.next_seq == n + 1)
        took = time.monotonic() - t0
        assert h.stream.stats.reconnects == 0 and h.stream.stats.gaps == 0
        if budget_s:  # one batch per wake-up would take 60 pauses of 0.2 s (slack for a loaded box)
            assert took < 6.0, took


def test_an_unlimited_hard_open_file_limit_and_a_refused_raise(monkeypatch, caplog):
    """The OS's limits as a double: an unlimited hard limit raises the soft one to what is
    wanted (not to unlimited); a refusal is logged, not raised."""
    import resource

    caplog.set_level(logging.INFO, logger="xpyd.proxy.kv_events")
    asked = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (100, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: asked.append(limits))
    _raise_fd_limit(5000)
    assert asked == [(5000, resource.RLIM_INFINITY)]

    def refuse(which, limits):
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    _raise_fd_limit(5000)
    assert [r.getMessage() for r in caplog.records] == [
        "open-file limit raised 100 -> 5000 for KV-event streams",
        "cannot raise the open-file limit 100 -> 5000: not allowed",
    ]


@pytest.mark.parametrize("failures, logged", [(9, True), (10, False), (98, False), (99, True), (100, False)])
async def test_stream_failures_are_logged_ten_then_every_hundredth(caplog, failures, logged):
    caplog.set_level(logging.WARNING, logger="xpyd.proxy.kv_events")
    d = Direct(backoff_s=(0.001, 0.001))
    d.stream.stats.failures = failures  # this failure is the (failures + 1)-th

    async def follow(stream, first):
        if stream.stats.failures == failures:
            raise RuntimeError("boom")
        await asyncio.Event().wait()  # the retry holds

    d.events._follow = follow
    task = asyncio.get_running_loop().create_task(d.events._run(d.stream))
    try:
        await wait_until(lambda: d.stream.stats.failures == failures + 1 and d.stream.stats.reconnects == 1)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv events stream failed")]
    assert [line.split("(")[1].split(" ")[0] for line in lines] == ([str(failures + 1)] if logged else [])


async def test_before_start_a_large_payload_is_decoded_inline_and_stop_is_harmless():
    d = Direct(topic="kv")  # not started: no decoder thread, no context
    await d.events.handle(d.stream, encode_batch(EventBatch(0, 1.0, (_blocks(100, 6000),)), "kv"))
    assert d.stream.next_seq == 1 and len(d.stream.index) == 6000
    await d.events.stop()

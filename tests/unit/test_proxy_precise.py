"""The `precise` policies (issue 17, part 3): instances' own KV events decide.

The events come from doubles of vLLM's publisher over real ZMQ (tests/support/kv_publisher.py), the
proxy is real (its intake, index, tokenizer and policy), and so are its HTTP clients; the
instances on the other side of the proxy are fake vLLM servers. That the proxy's token ids
equal vLLM's own is tested against a real vLLM server in test_e2e_kv_events.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.config import ConfigError, ProxyConfig
from proxy.metrics import Metrics
from proxy.openai_api import estimate_prompt_tokens
from proxy.registry import Registry
from proxy.request import RouteRequest
from proxy.routing.kv_events import EventsConfig, KVEvents
from proxy.routing.kv_index import IndexState
from proxy.routing.policies.precise import Precise
from proxy.routing.prompt_keys import COMPLETIONS, PromptTokenizer
from tests.support.e2e_client import MODEL_DIR
from tests.support.fake_vllm import FakeVLLM
from tests.support.kv_publisher import Publisher
from tests.support.proxy_helpers import running_proxy, wait_until
from xpyd_wire import discovery
from xpyd_wire.kv_events import BlockStored, EventsEndpoint

BS = 16  # block size the doubles report


def blocks_of(ids: list[int], first_hash: int, lora: str | None = None, extra: bool = False) -> BlockStored:
    """One BlockStored for the full blocks of `ids` (hashes first_hash, first_hash + 1, ...)."""
    n = len(ids) // BS
    return BlockStored(tuple(range(first_hash, first_hash + n)), None, tuple(ids[: n * BS]), BS,
                       lora, "GPU", None, extra)  # fmt: skip


def request(ids: list[int] | None, text: str = "", model: str | None = None) -> RouteRequest:
    body = {"prompt": text or "x" * (4 * len(ids or ()))}
    return RouteRequest(COMPLETIONS, b"", body, len(body["prompt"]) // 4, {}, model, prompt_ids=ids)


async def publish_until(pub: Publisher, events, landed, timeout: float = 5.0) -> None:
    """Publish until `landed()` holds: a SUB misses what is sent before it is connected
    (ZMQ's slow joiner), so a first batch may need saying twice (the events are idempotent)."""
    deadline = time.monotonic() + timeout
    while not landed():
        assert time.monotonic() < deadline, "the published events never reached the index"
        pub.publish(events)
        for _ in range(20):
            if landed():
                return
            await asyncio.sleep(0.01)


class Cluster:
    """Instances in a registry, each with a publisher double, and the proxy's real intake."""

    def __init__(self, roles: str, replay: bool = True, **cfg) -> None:
        self.pubs = [Publisher(replay=replay) for _ in roles]
        self.registry = Registry(heartbeat_timeout=30)
        self.metrics = Metrics(self.registry)
        self.events = KVEvents(self.registry, self.metrics, EventsConfig(**{
            "probe_s": 0.2, "silence_s": 1.0, "replay_timeout_s": 0.5, "reconcile_s": 0.1, **cfg}))
        self.insts = []
        for i, (role, pub) in enumerate(zip(roles, self.pubs)):
            ep = EventsEndpoint(pub.endpoint, pub.replay_endpoint, pub.topic, None)
            reg = discovery.Registration(role, f"127.0.0.1:{18000 + i}", f"127.0.0.1:{14000 + i}", kv_events=ep)
            inst = self.registry.upsert(reg)
            self.registry.admit(inst)
            self.insts.append(inst)

    def index(self, i: int):
        return self.events.index(self.insts[i])

    async def __aenter__(self) -> Cluster:
        await self.events.start()
        await wait_until(lambda: len(self.events.streams()) == len(self.insts))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.events.stop()
        for pub in self.pubs:
            pub.close()


PROMPT = list(range(100, 100 + 5 * BS + 3))  # 5 full blocks and a tail


async def test_the_instance_holding_the_longest_prefix_wins():
    async with Cluster("PPP") as c:
        await wait_until(lambda: all(c.index(i).state is IndexState.KNOWN for i in range(3)))
        pol = Precise(c.events)
        await publish_until(c.pubs[1], [blocks_of(PROMPT[: 3 * BS], 1000)], lambda: len(c.index(1)) == 3)
        await publish_until(c.pubs[2], [blocks_of(PROMPT, 2000)], lambda: len(c.index(2)) == 5)
        req = request(PROMPT)
        assert pol.choose(c.insts, req) is c.insts[2]
        assert pol.cached_tokens(c.insts[2], req) == 5 * BS
        assert pol.uncached_tokens(c.insts[2], req) == 3  # the real tail, not an estimate
        assert pol.cached_tokens(c.insts[1], req) == 3 * BS
        assert pol.uncached_tokens(c.insts[0], req) is None  # known to hold nothing
        # A prompt that shares only its first block with what anyone holds: least loaded.
        other = request(PROMPT[:BS] + [7] * (4 * BS))
        c.insts[0].in_flight = 0
        c.insts[1].in_flight = c.insts[2].in_flight = 3
        assert pol.choose(c.insts, other) is c.insts[0]


async def test_a_loaded_holder_loses_to_the_least_loaded_and_a_known_empty_index_is_real():
    async with Cluster("PP") as c:
        await wait_until(lambda: all(c.index(i).state is IndexState.KNOWN for i in range(2)))
        pol = Precise(c.events)
        await publish_until(c.pubs[0], [blocks_of(PROMPT, 1000)], lambda: len(c.index(0)) == 5)
        req = request(PROMPT)
        c.insts[0].in_flight = 20  # beyond both balance gaps (8 and 1.5x)
        assert pol.choose(c.insts, req) is c.insts[1]
        c.insts[0].in_flight = 4  # within them: the cache wins
        assert pol.choose(c.insts, request(PROMPT)) is c.insts[0]


async def test_unknown_indexes_fall_back_to_the_guess_per_instance():
    # No replay endpoint and nothing published: the indexes stay UNKNOWN (never "empty").
    async with Cluster("PP", replay=False) as c:
        choices = []
        pol = Precise(c.events, on_choice=choices.append)
        first = pol.choose(c.insts, request(PROMPT))
        assert choices == ["guess"]
        c.insts[0].in_flight = c.insts[1].in_flight = 0
        # The guess learned where the prompt went, as cache_aware would.
        assert pol.choose(c.insts, request(PROMPT)) is first
        # One instance's events start flowing and show the prompt there: that counts now.
        holder = c.insts[1] if first is c.insts[0] else c.insts[0]
        k = c.insts.index(holder)
        await publish_until(c.pubs[k], [blocks_of(PROMPT, 1000)], lambda: len(c.index(k)) == 5)
        # Per instance: the one with events is read from them, the other still guessed.
        assert pol.held_tokens(holder, request(PROMPT)) == 5 * BS
        assert pol.held_tokens(first, request(PROMPT)) is None


async def test_events_that_stop_turn_the_instance_back_to_the_guess():
    async with Cluster("PP") as c:
        await wait_until(lambda: all(c.index(i).state is IndexState.KNOWN for i in range(2)))
        choices = []
        pol = Precise(c.events, on_choice=choices.append)
        await publish_until(c.pubs[1], [blocks_of(PROMPT, 1000)], lambda: len(c.index(1)) == 5)
        assert pol.choose(c.insts, request(PROMPT)) is c.insts[1] and choices == ["events"]
        c.pubs[1].answer_replays = False  # the publisher stops answering its probe
        await wait_until(lambda: c.index(1).state is IndexState.UNKNOWN)
        assert pol.held_tokens(c.insts[1], request(PROMPT)) is None
        # The guess was kept warm by the choice above: the prompt still goes there.
        assert pol.choose(c.insts, request(PROMPT)) is c.insts[1] and choices[-1] == "guess"


async def test_lora_adapters_and_salted_blocks():
    async with Cluster("PP") as c:
        await wait_until(lambda: all(c.index(i).state is IndexState.KNOWN for i in range(2)))
        pol = Precise(c.events)
        for inst in c.insts:
            inst.models = {"base": {"id": "base"}, "sql": {"id": "sql", "parent": "base"}}
        # P0 holds the prompt under the adapter "sql", P1 holds it for the base model but
        # under a cache_salt (vLLM's extra_keys): no unsalted request hits that.
        await publish_until(c.pubs[0], [blocks_of(PROMPT, 1000, lora="sql")], lambda: len(c.index(0)) == 5)
        c.pubs[1].publish([blocks_of(PROMPT, 2000, extra=True)])
        await publish_until(c.pubs[1], [blocks_of(PROMPT[:BS], 3000)], lambda: len(c.index(1)) == 1)
        assert pol.held_tokens(c.insts[0], request(PROMPT, model="sql")) == 5 * BS
        assert pol.held_tokens(c.insts[0], request(PROMPT, model="base")) == 0
        assert pol.held_tokens(c.insts[1], request(PROMPT, model="base")) == BS  # the salted ones not
        assert pol.choose(c.insts, request(PROMPT, model="sql")) is c.insts[0]


def test_the_guess_keeps_a_lora_adapters_prefixes_apart_too():
    """Without events (index UNKNOWN) precise follows cache_aware's guess, which is salted
    by the adapter as vLLM's cache is: the base model's prompt is no hit for the adapter."""
    registry = Registry(heartbeat_timeout=30)
    insts = []
    for i in range(2):
        inst = registry.upsert(discovery.Registration("P", f"127.0.0.1:{18100 + i}", f"127.0.0.1:{14100 + i}"))
        registry.admit(inst)
        inst.models = {"base": {"id": "base"}, "sql": {"id": "sql", "parent": "base"}}
        insts.append(inst)
    pol = Precise(KVEvents(registry, Metrics(registry), EventsConfig()))
    held = pol.choose(insts, request(PROMPT, model="base"))
    held.in_flight = 1  # busier, within the balance: a hit would still win
    assert pol.choose(insts, request(PROMPT, model="base")) is held
    assert pol.choose(insts, request(PROMPT, model="sql")) is not held
    assert pol.cached_tokens(held, request(PROMPT, model="sql")) == 0


def test_precise_needs_a_tokenizer():
    with pytest.raises(ConfigError, match="tokenizer"):
        ProxyConfig(prefill_policy="precise").validate()
    ProxyConfig(prefill_policy="precise", tokenizer=str(MODEL_DIR)).validate()


# ---------------------------------------------------------------- through real proxies


def _words(n: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    words = "river stone maple quiet engine silver garden window orbit lantern harbor meadow".split()
    return " ".join(rng.choice(words) for _ in range(n))


async def _holders_ready(proxies, insts: list[FakeVLLM]) -> None:
    def known() -> bool:
        for p in proxies:
            for f in insts:
                inst = next((i for i in p.registry.all() if i.http_address == f.http_address), None)
                if inst is None or p.state.kv_events.state(inst) is not IndexState.KNOWN:
                    return False
        return True

    await wait_until(known, timeout=15, what="every index known on every proxy")


async def test_two_proxies_route_every_prompt_to_its_holder():
    """Two proxies subscribed to the same instances choose alike for every prompt, from
    nothing but the instances' events; P and D are each chosen by what they hold, and a D
    that holds all but a short tail serves the request alone (local_cached, real figure)."""
    tok = PromptTokenizer(MODEL_DIR)
    pubs = [Publisher() for _ in range(4)]
    roles = ["P", "P", "D", "D"]
    fakes = [FakeVLLM(r, register=False) for r in roles]
    try:
        for f in fakes:
            await f.start()
        specs = [f"http://{f.http_address},kv={f.zmq_address},events={p.endpoint},replay={p.replay_endpoint}"
                 for f, p in zip(fakes, pubs)]  # fmt: skip
        cfg = dict(prefill=tuple(specs[:2]), decode=tuple(specs[2:]), prefill_policy="precise",
                   decode_policy="precise", tokenizer=str(MODEL_DIR), health_interval=0.2)  # fmt: skip
        async with running_proxy(**cfg) as a, running_proxy(**cfg) as b:
            await wait_until(lambda: all(len(p.registry.live(r)) == 2 for p in (a, b) for r in "PD"),
                             timeout=10, what="static instances live")  # fmt: skip
            await _holders_ready((a, b), fakes)
            prompts = [_words(120, seed) for seed in range(6)]
            ids = [tok.token_ids(COMPLETIONS, {"prompt": t})[0] for t in prompts]
            # Prompt k is held by P (k % 2) and by D (k % 2) (the other D for odd ones).
            for k, pid in enumerate(ids):
                for idx in (k % 2, 2 + (k + 1) % 2):
                    pubs[idx].publish([blocks_of(pid, 10_000 * (k + 1) + 100 * idx)])
            for k, pid in enumerate(ids):
                for idx in (k % 2, 2 + (k + 1) % 2):
                    await wait_until(lambda: _all_hold((a, b), fakes[idx], pid),
                                     what=f"prompt {k} indexed for instance {idx}")
            for k, text in enumerate(prompts):
                for proxy in (a, b):
                    before = [_served(f) for f in fakes]
                    r = await proxy.client.post("/v1/completions", json={"model": "fake-model", "prompt": text,
                                                                          "max_tokens": 4})
                    assert r.status_code == 200, r.text
                    got = [i for i, f in enumerate(fakes) if _served(f) > before[i]]
                    assert got == sorted([k % 2, 2 + (k + 1) % 2]), (k, got)
                    # D holds every full block of the prompt: P is told to ship only the rest.
                    sent_p = [r for r in fakes[k % 2].requests if r.path == "/v1/completions"][-1].json
                    assert sent_p["kv_transfer_params"] == {"xpyd_skip_tokens": len(ids[k]) // BS * BS}
            for proxy in (a, b):
                assert await proxy.metric("xpyd_precise_choices_total", role="P", source="events") == 6
                assert await proxy.metric("xpyd_precise_choices_total", role="D", source="events") == 6
                assert await proxy.metric("xpyd_prompt_ids_total", result="ok") == 6

        # --send-only-missing false: P ships everything.
        async with running_proxy(**cfg, send_only_missing=False) as c:
            await wait_until(lambda: all(len(c.registry.live(r)) == 2 for r in "PD"), timeout=10)
            await _holders_ready((c,), fakes)
            await wait_until(lambda: _all_hold((c,), fakes[3], ids[0]))
            r = await c.client.post("/v1/completions", json={"model": "fake-model", "prompt": prompts[0],
                                                              "max_tokens": 4})
            assert r.status_code == 200
            assert "kv_transfer_params" not in [r for r in fakes[0].requests if r.path == "/v1/completions"][-1].json

        # local_cached from the real figure: D holds every full block of the prompt, the
        # tail left (< 16 tokens) is under the threshold: D alone, no P request.
        async with running_proxy(**cfg, local_prefill_threshold=32) as c:
            await wait_until(lambda: all(len(c.registry.live(r)) == 2 for r in "PD"), timeout=10)
            await _holders_ready((c,), fakes)
            await wait_until(lambda: _all_hold((c,), fakes[3], ids[0]))
            before = [_served(f) for f in fakes]
            r = await c.client.post("/v1/completions", json={"model": "fake-model", "prompt": prompts[0],
                                                              "max_tokens": 4})
            assert r.status_code == 200
            assert [_served(f) - before[i] for i, f in enumerate(fakes)] == [0, 0, 0, 1]
            assert await c.metric("xpyd_dispatch_total", path="local_cached") == 1
    finally:
        for f in fakes:
            await f.stop()
        for p in pubs:
            p.close()


async def test_local_cached_reads_what_d_really_holds_not_the_guess():
    """Conditional disaggregation with the precise D policy reads D's events in real tokens.
    Three prompts, each over the threshold after what D holds, so each is disaggregated:
    D holds all but 2 blocks (the proxy's character-based estimate of the prompt, less what
    D holds, would be under the threshold), D holds the first block only, D holds nothing
    (cache_aware's guess counts the request just routed there as held: it would say D
    holds it all)."""
    threshold = 2 * BS
    tok = PromptTokenizer(MODEL_DIR)
    pubs = [Publisher() for _ in range(2)]
    fakes = [FakeVLLM(r, register=False) for r in "PD"]
    try:
        for f in fakes:
            await f.start()
        specs = [f"http://{f.http_address},kv={f.zmq_address},events={p.endpoint},replay={p.replay_endpoint}"
                 for f, p in zip(fakes, pubs)]  # fmt: skip
        cfg = dict(prefill=(specs[0],), decode=(specs[1],), decode_policy="precise", tokenizer=str(MODEL_DIR),
                   health_interval=0.2, local_prefill_threshold=threshold)  # fmt: skip
        async with running_proxy(**cfg) as c:
            await wait_until(lambda: all(len(c.registry.live(r)) == 1 for r in "PD"), timeout=10)
            await _holders_ready((c,), fakes)
            prompts = [_words(120, seed) for seed in (11, 12, 13)]
            ids = [tok.token_ids(COMPLETIONS, {"prompt": t})[0] for t in prompts]
            held = [(len(ids[0]) - threshold) // BS * BS, BS]
            # The test's power: by the estimate D would hold all but a short tail.
            assert estimate_prompt_tokens({"prompt": prompts[0]}) - held[0] < threshold <= len(ids[0]) - held[0]
            for k, n in enumerate(held):
                pubs[1].publish([blocks_of(ids[k][:n], 50_000 + 1000 * k)])
                await wait_until(lambda: _all_hold((c,), fakes[1], ids[k][:n]), what="D's blocks indexed")
            for n, text in enumerate(prompts, 1):
                r = await c.client.post("/v1/completions", json={"model": "fake-model", "prompt": text,
                                                                  "max_tokens": 4})
                assert r.status_code == 200, r.text
                assert [_served(f) for f in fakes] == [n, n], n
                assert await c.metric("xpyd_dispatch_total", path="disaggregated") == n
            assert await c.metric("xpyd_dispatch_total", path="local_cached") == 0
    finally:
        for f in fakes:
            await f.stop()
        for p in pubs:
            p.close()


def _served(fake: FakeVLLM) -> int:
    return sum(r.path == "/v1/completions" for r in fake.requests)


def _all_hold(proxies, fake: FakeVLLM, ids: list[int]) -> bool:
    from xpyd_wire.kv_events import chain_block_keys

    keys = chain_block_keys(ids, BS)
    for p in proxies:
        inst = next((i for i in p.registry.all() if i.http_address == fake.http_address), None)
        index = None if inst is None else p.state.kv_events.index(inst)
        if index is None or index.longest_prefix(keys) < len(keys):
            return False
    return True

"""Routing policies beyond round robin: cache_aware (prefix index, imbalance fallback,
cached_tokens, memory bound) and power_of_two; and cache_aware through a real proxy."""

from __future__ import annotations

import collections

import orjson
import pytest

from proxy.config import ConfigError, ProxyConfig
from proxy.openai_api import CHAT, COMPLETIONS, estimate_prompt_tokens
from proxy.registry import Registry
from proxy.request import RouteRequest
from proxy.routing.policies import cache_aware as ca
from proxy.routing.policies.base import load_score
from proxy.routing.policies.cache_aware import CacheAware, CacheAwareSettings, PrefixIndex
from proxy.routing.policies.factory import make_policy
from proxy.routing.policies.power_of_two import PowerOfTwo
from tests.support.proxy_helpers import running_proxy
from xpyd_wire.discovery import Load, Registration
from xpyd_wire.headers import XPYD_PREFILL_INSTANCE

SYSTEMS = [f"System prompt {k}: " + f"rule {k} says be precise. " * 40 for k in range(3)]


def _instances(n: int, role: str = "P"):
    r = Registry(heartbeat_timeout=10)
    for port in range(1, n + 1):
        r.admit(r.upsert(Registration(role, f"127.0.0.1:{port}", f"127.0.0.1:{port + 1000}"), now=0))
    return list(r.live(role))


def completion(prompt) -> RouteRequest:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4}
    return RouteRequest(COMPLETIONS, orjson.dumps(body), body, estimate_prompt_tokens(body), {})


def chat(*turns: tuple[str, str]) -> RouteRequest:
    body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in turns]}
    return RouteRequest(CHAT, orjson.dumps(body), body, estimate_prompt_tokens(body), {})


def policy(**kw) -> CacheAware:
    return CacheAware(CacheAwareSettings(**kw))


# ---------------------------------------------------------------- prefix index


def test_chain_hashes_cover_full_chunks_and_depend_on_predecessors():
    idx = PrefixIndex(chunk_tokens=4, capacity_tokens=1000)  # 16 characters a chunk
    a = "x" * 16 + "y" * 16 + "z" * 16
    b = "w" * 16 + "y" * 16 + "z" * 16  # same chunks 2 and 3, different first one
    ha, hb = idx.chain(a), idx.chain(b)
    assert len(ha) == 3 and len(idx.chain(a + "tail")) == 3  # partial chunk: not indexed
    assert idx.chain(a + "tail")[:3] == ha
    # Chain property: a different first chunk changes every later hash too.
    assert all(x != y for x, y in zip(ha, hb, strict=True))
    p, q = _instances(2)
    idx.insert(p, ha)
    assert idx.match(hb, [p, q]) == (0, [])
    assert idx.match(idx.chain(a[:32] + "v" * 16), [p, q]) == (2, [p])  # shared prefix
    assert idx.match(idx.chain(a), [q]) == (0, [])  # only candidates count


def test_token_id_chunks():
    idx = PrefixIndex(chunk_tokens=4, capacity_tokens=1000)
    p, q = _instances(2)
    ids = list(range(100, 140))
    idx.insert(q, idx.chain(ids))
    assert idx.match(idx.chain(ids[:20] + [1, 2, 3, 4, 5, 6]), [p, q]) == (5, [q])
    assert idx.match(idx.chain([7] + ids[1:]), [p, q]) == (0, [])
    # Text and token ids never collide on equal-looking content.
    assert idx.match(idx.chain("".join(map(chr, ids))), [p, q]) == (0, [])


def test_lru_bound_per_instance_and_prefix_outlives_tail():
    idx = PrefixIndex(chunk_tokens=4, capacity_tokens=40)  # 10 chunks per instance
    p, q = _instances(2)
    prompts = [f"{k:04d}" * 40 for k in range(20)]  # 10 chunks each
    for text in prompts:
        idx.insert(p, idx.chain(text))
        assert idx.size(p) <= 10
    idx.insert(q, idx.chain(prompts[0]))
    assert idx.size(p) == 10 and idx.size(q) == 10 and idx.size() == 20
    # Only the last prompt survives on p; the first one is still q's (per-instance LRU).
    assert idx.match(idx.chain(prompts[-1]), [p]) == (10, [p])
    assert idx.match(idx.chain(prompts[0]), [p, q]) == (10, [q])
    assert idx.match(idx.chain(prompts[5]), [p]) == (0, [])
    assert len(idx._holders) == 20  # evicted hashes leave the shared map too
    # A prompt longer than the budget keeps its prefix (tails are evicted first).
    long_text = "abcd" * 120  # 30 chunks
    idx.insert(p, idx.chain(long_text))
    assert idx.match(idx.chain(long_text), [p]) == (10, [p])


def test_reused_prefix_is_refreshed_in_lru():
    idx = PrefixIndex(chunk_tokens=4, capacity_tokens=40)
    (p,) = _instances(1)
    hot = "hot!" * 20  # 5 chunks
    idx.insert(p, idx.chain(hot))
    for k in range(10):
        idx.insert(p, idx.chain(f"c{k:02d}_" * 4))  # one chunk each, distinct
        idx.insert(p, idx.chain(hot))  # used again: stays
    assert idx.match(idx.chain(hot), [p]) == (5, [p])


def test_forget_drops_every_entry():
    idx = PrefixIndex(chunk_tokens=4, capacity_tokens=1000)
    p, q = _instances(2)
    h = idx.chain("shared! " * 20)
    idx.insert(p, h)
    idx.insert(q, h)
    idx.forget(p)
    assert idx.instances() == [q] and idx.match(h, [p, q]) == (len(h), [q])
    idx.forget(q)
    assert idx.size() == 0 and idx._holders == {}


# ---------------------------------------------------------------- cache_aware


def test_shared_prefix_text_goes_to_the_same_instance():
    pol = policy()
    insts = _instances(3)
    first = {k: pol.choose(insts, completion(s + "Question 0?")) for k, s in enumerate(SYSTEMS)}
    assert len({id(i) for i in first.values()}) == 3  # no match yet: least loaded, spread
    for turn in range(1, 6):
        for k, s in enumerate(SYSTEMS):
            assert pol.choose(insts, completion(s + f"Question {turn}?")) is first[k]


def test_token_ids_and_chat_share_prefixes():
    pol = policy()
    insts = _instances(2)
    ids = list(range(500))
    a = pol.choose(insts, completion(ids + [1]))
    assert all(pol.choose(insts, completion(ids + [k, k])) is a for k in range(5))
    sys_a, sys_b = SYSTEMS[0], SYSTEMS[1]
    c1 = pol.choose(insts, chat(("system", sys_a), ("user", "hi")))
    c2 = pol.choose(insts, chat(("system", sys_b), ("user", "hi")))
    assert c1 is not c2
    # A later turn of the same conversation, and another user on the same system prompt.
    later = chat(("system", sys_a), ("user", "hi"), ("assistant", "hello"), ("user", "more"))
    assert pol.choose(insts, later) is c1
    assert pol.choose(insts, chat(("system", sys_b), ("user", "other"))) is c2


def test_low_match_goes_to_least_loaded():
    pol = policy(min_match=0.5)
    a, b = _instances(2)
    head = "h" * 640  # 10 chunks
    assert pol.choose([a, b], completion(head + "x" * 640)) is a
    a.in_flight = 1  # a is a little busier
    # Shares 10 of 30 chunks with a: below min_match, so least loaded.
    assert pol.choose([a, b], completion(head + "y" * 1280)) is b
    # Shares 10 of 15 chunks with a (and b's own entry for "h"*640 matches as well now):
    c = completion(head + "z" * 320)
    assert pol.index.match(pol.index.chain(c.key), [a])[0] == 10
    assert pol.choose([a, b], c) is b  # both hold the 10 chunks: the less loaded holder


def test_imbalance_falls_back_to_least_loaded():
    pol = policy(balance_abs=4, balance_rel=1.5)
    a, b = _instances(2)
    req = completion(SYSTEMS[0] + "q")
    holder = pol.choose([a, b], req)
    other = b if holder is a else a
    holder.in_flight = 4  # gap 4: not beyond balance_abs
    assert pol.choose([a, b], req) is holder
    holder.in_flight = 5  # gap 5 > 4 and 5 > 0 * 1.5
    assert pol.choose([a, b], req) is other
    # Relative limit: gap 6 > 4 but 18 is not > 12 * 1.5 -> still the cache holder...
    holder.in_flight, other.in_flight = 18, 12
    pol2 = policy(balance_abs=4, balance_rel=1.5)
    pol2.index.insert(holder, pol2.index.chain(req.key))
    assert pol2.choose([a, b], req) is holder
    # ...and heartbeat load counts like in least_loaded.
    other.load = Load(running=40, waiting=0, kv_usage=0.0)
    assert load_score(other) > load_score(holder)
    assert pol2.choose([a, b], req) is holder
    holder.load = Load(running=60, waiting=10, kv_usage=1.0)
    assert pol2.choose([a, b], req) is other


def test_cached_tokens_reports_what_was_held_before_the_request():
    pol = policy(chunk_tokens=16)
    a, b = _instances(2)
    first = completion(SYSTEMS[0] + "Question one?")
    chosen = pol.choose([a, b], first)
    assert pol.cached_tokens(chosen, first) == 0  # nothing was there before it
    second = completion(SYSTEMS[0] + "Question two, longer?")
    other = b if chosen is a else a
    # Before routing: estimated from the index; after routing: the same pre-insert figure.
    held = len(SYSTEMS[0]) // 64 * 16
    assert pol.cached_tokens(chosen, second) == held
    assert pol.cached_tokens(other, second) == 0
    assert pol.choose([a, b], second) is chosen
    assert pol.cached_tokens(chosen, second) == held
    # The whole prompt held: capped at the request's own estimate.
    again = completion(SYSTEMS[0] + "Question one?")
    assert pol.choose([a, b], again) is chosen
    assert (
        pol.cached_tokens(chosen, again) == min(len(again.key) // 64 * 16, again.tokens)
        and again.tokens - pol.cached_tokens(chosen, again) < 16
    )


def test_a_lora_adapters_prefixes_are_apart_from_the_base_models():
    """vLLM keys its prefix cache by the LoRA adapter too: a prompt computed for the base
    model is no cache hit for the same prompt under an adapter (nor the other way round)."""
    pol = policy(chunk_tokens=16)
    a, b = _instances(2)
    for inst in (a, b):
        inst.models = {"m": {"id": "m", "parent": None}, "sql": {"id": "sql", "parent": "m"}}

    def on(model: str, prompt: str) -> RouteRequest:
        req = completion(prompt)
        req.model = req.body["model"] = model
        return req

    prompt = SYSTEMS[0] + "Question one?"
    held = pol.choose([a, b], on("m", prompt))
    other = b if held is a else a
    held.in_flight = 1  # busier, but within the balance: a cache hit would still win
    assert pol.cached_tokens(held, on("m", prompt)) > 0
    assert pol.cached_tokens(held, on("sql", prompt)) == 0
    assert pol.choose([a, b], on("sql", prompt)) is other  # no hit: the least loaded
    assert pol.choose([a, b], on("sql", prompt)) is other  # ... and now its own hit there
    assert pol.cached_tokens(other, on("sql", prompt)) > 0 and pol.cached_tokens(other, on("m", prompt)) == 0


def test_gone_instances_are_forgotten(monkeypatch):
    pol = policy()
    a, b = _instances(2)
    pol.choose([a, b], completion(SYSTEMS[0]))
    pol.choose([a, b], completion(SYSTEMS[1]))
    assert set(map(id, pol.index.instances())) == {id(a), id(b)}
    clock = [1000.0]
    monkeypatch.setattr(ca.time, "monotonic", lambda: clock[0])
    pol._seen = {a: clock[0], b: clock[0]}
    for _ in range(ca.SWEEP_EVERY):
        clock[0] += 1.0  # b is no candidate any more (it left the registry)
        pol.choose([a], completion("short"))
    assert pol.index.instances() == [a] and pol.index.size(b) == 0


def test_make_policy_reads_cache_aware_settings():
    cfg = ProxyConfig(cache_aware_chunk_tokens=8, cache_aware_min_match=0.25).validate()
    pol = make_policy("cache_aware", cfg)
    assert pol.settings.chunk_tokens == 8 and pol.settings.min_match == 0.25
    assert pol.index.chunk_chars == 32
    assert make_policy("power_of_two").name == "power_of_two"
    for bad in (
        {"cache_aware_chunk_tokens": 0},
        {"cache_aware_min_match": 1.5},
        {"cache_aware_balance_rel": 0.5},
        {"cache_aware_capacity_tokens": 4},
    ):
        with pytest.raises(ConfigError):
            ProxyConfig(**bad).validate()


# ---------------------------------------------------------------- power_of_two


def test_power_of_two_spreads_and_avoids_the_loaded():
    insts = _instances(4)
    req = completion("x")
    p2 = PowerOfTwo(seed=7)
    counts = collections.Counter(id(p2.choose(insts, req)) for _ in range(4000))
    # Equal loads: each of two random picks wins ties as the first pick -> uniform.
    assert all(850 < counts[id(i)] < 1150 for i in insts), counts
    insts[0].in_flight = 5
    counts = collections.Counter(id(p2.choose(insts, req)) for _ in range(3000))
    assert counts[id(insts[0])] == 0  # always compared with a less loaded one
    insts[1].in_flight = 3
    counts = collections.Counter(id(p2.choose(insts, req)) for _ in range(3000))
    # insts[1] wins only against insts[0]: 2 of the 12 ordered pairs.
    assert 350 < counts[id(insts[1])] < 650, counts
    assert PowerOfTwo().choose(insts[:1], req) is insts[0]
    seq = [id(PowerOfTwo(seed=3).choose(insts[2:], req)) for _ in range(2)]
    assert seq[0] == seq[1]  # seeded: reproducible


# ---------------------------------------------------------------- through the proxy


@pytest.mark.parametrize("policy_name", ["cache_aware", "round_robin"])
async def test_proxy_routes_shared_prefixes_to_one_prefill(policy_name):
    """3 system prompts x 4 user turns, through a real proxy with fake P and D instances:
    cache_aware sends every turn of a system prompt to the P that prefilled it first and
    uses both Ps; round_robin (the contrast) scatters each system prompt over both."""
    # expose_routing_headers: which P served each request is read from x-xpyd-prefill-instance.
    async with running_proxy(prefill_policy=policy_name, decode_policy=policy_name,
                             expose_routing_headers=True) as px:  # fmt: skip
        ps = [await px.fake("P") for _ in range(2)]
        await px.fake("D")
        by_system: dict[int, set[str]] = {k: set() for k in range(len(SYSTEMS))}
        for turn in range(4):
            for k, system in enumerate(SYSTEMS):
                resp = await px.client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "fake-model",
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": f"turn {turn}"},
                        ],
                        "max_tokens": 2,
                    },
                )
                assert resp.status_code == 200, resp.text
                by_system[k].add(resp.headers[XPYD_PREFILL_INSTANCE])
        served = [len(p.completions()) for p in ps]
        assert sum(served) == 12
        if policy_name == "cache_aware":
            assert all(len(v) == 1 for v in by_system.values()), by_system
            assert all(n > 0 for n in served), served
        else:
            assert all(len(v) == 2 for v in by_system.values()), by_system

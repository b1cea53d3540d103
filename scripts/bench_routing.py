#!/usr/bin/env python3
"""Routing benchmark: TTFT and prefix-cache hit rate per prefill policy, through the real
proxy, with fake P instances that model a prefix cache.

Each fake P (tests/support/fake_vllm.py, extended here) is one serial engine: a prefill waits for
the ones before it (FIFO), then takes overhead + (uncached prompt tokens) x per-token time;
its prefix cache is an LRU of chained 16-token blocks bounded by --p-cache-tokens, looked
up when the prefill starts and filled when it ends, like vLLM's. The fake D streams at
once, so TTFT is the proxy's routing + P's queue and prefill.

Default trace (completions): --systems long system prompts (Zipf popularity, --zipf) x one
fresh user turn per request (4 characters a token), open-loop Poisson arrivals at --rate.
Every policy gets the same trace and a fresh proxy and fresh instances; ratios are against
round_robin in the same run.

--chat: round_robin, cache_aware and `precise` (routing on the instances' own KV events)
through ONE proxy and through TWO proxies over the same instances (requests round robin
over them, as a load balancer would). The trace: --conversations multi-turn conversations
over --systems shared system prompts (Zipf), each --turns turns sent to
/v1/chat/completions (turn k+1 = turn k's messages + an assistant answer + a new user
message). Open loop: conversations start with Poisson arrivals (--conv-rate per second);
within one, each turn is sent a think time (exponential, mean --think-ms) after the
previous one ended, others run meanwhile; no turn starts after --max-s. Prompts are cut
into blocks of their real token ids (tokenized as vLLM would with --tokenizer's chat
template), and each fake P publishes BlockStored/BlockRemoved for what its LRU stores and
evicts (a double of vLLM's ZMQ publisher); instances are static (--prefill ... events=), so
every proxy subscribes to every publisher. Reported: hit rate (cached / prompt tokens, the
fakes' own counts), its ratio to the trace's ideal (one infinite cache shared by all: every
block seen before is a hit), TTFT p50/p99, and the 2-proxy / 1-proxy hit rate per policy.

    .venv/bin/python -m scripts.bench_routing              # 4 policies, ~1 min
    .venv/bin/python -m scripts.bench_routing --sweep      # cache_aware thresholds
    .venv/bin/python -m scripts.bench_routing --chat --json chat.json   # 3 policies x 1|2 proxies

Proxies, fakes and client share one event loop (the simulated prefill times, tens of
milliseconds, dwarf the proxy's sub-millisecond overhead; bench_proxy.py measures that).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

from proxy.routing.kv_index import IndexState  # noqa: E402
from proxy.routing.prompt_keys import CHAT, COMPLETIONS, PromptTokenizer  # noqa: E402
from tests.support.fake_vllm import FakeVLLM  # noqa: E402
from tests.support.kv_publisher import Publisher  # noqa: E402
from tests.support.proxy_helpers import running_proxy, wait_until  # noqa: E402
from xpyd_wire.kv_events import BlockRemoved, BlockStored, chain_block_keys  # noqa: E402

BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4
POLICIES = ("round_robin", "least_loaded", "power_of_two", "cache_aware")
CHAT_POLICIES = ("round_robin", "cache_aware", "precise")
MODEL_DIR = Path(ROOT) / ".models" / "tiny-llama"  # as tests/support/e2e_client.py
ENGINE_SALT = "fake-engine"  # the fake Ps' own block hashes (see EventedFakeP)
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()  # fmt: skip


@dataclass
class EngineModel:
    cache_tokens: int
    us_per_token: float
    overhead_ms: float


class PrefixCache:
    """An instance's prefix cache: LRU of chained block hashes (a block is useless without
    its predecessor, so a lookup stops at the first missing one)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = max(1, capacity_tokens // BLOCK_TOKENS)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def hashes(prompt: str) -> list[int]:
        size = BLOCK_TOKENS * CHARS_PER_TOKEN
        out, h = [], 0
        for i in range(0, len(prompt) - size + 1, size):
            h = hash((h, prompt[i : i + size]))
            out.append(h)
        return out

    def cached(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """Store a prompt's blocks; returns the indexes (in `hashes`) of the blocks that were
        not held before, and the hashes evicted to make room."""
        new = [i for i, h in enumerate(hashes) if h not in self.blocks]
        for h in reversed(hashes):  # prefix most recent: evicted last
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        return new, evicted


class CachingFakeP(FakeVLLM):
    """A P whose prompts are cut into blocks of 4-character "tokens" (the completions trace);
    EventedFakeP (the chat trace) overrides prompt_blocks() and stored()."""

    def __init__(self, model: EngineModel, **kwargs) -> None:
        super().__init__("P", record=False, **kwargs)
        self.sim = model
        self.cache = PrefixCache(model.cache_tokens)
        self.engine = asyncio.Lock()  # FIFO: one prefill at a time
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefills = 0

    def prompt_blocks(self, path: str, body: object) -> tuple[int, list[int], object] | None:
        """(prompt tokens, chained block hashes, anything stored() needs), None: not a prompt."""
        if isinstance(body, dict) and isinstance(body.get("prompt"), str):
            prompt = body["prompt"]
            return len(prompt) // CHARS_PER_TOKEN, PrefixCache.hashes(prompt), None
        return None

    def stored(self, hashes: list[int], new: list[int], evicted: list[int], extra: object) -> None:
        """Called when a prefill's blocks were inserted (new: their indexes in hashes)."""

    async def _respond(self, conn, req, path, body, rec) -> None:
        prompt = self.prompt_blocks(path, body) if req.method == "POST" else None
        if prompt is not None:
            total, hashes, extra = prompt
            async with self.engine:
                hit = self.cache.cached(hashes) * BLOCK_TOKENS
                m = self.sim
                await asyncio.sleep(m.overhead_ms / 1e3 + (total - hit) * m.us_per_token / 1e6)
                self.stored(hashes, *self.cache.insert(hashes), extra)
            self.prompt_tokens += total
            self.cached_tokens += hit
            self.prefills += 1
        await super()._respond(conn, req, path, body, rec)


@dataclass
class Trace:
    prompts: list[str]
    arrivals: list[float]  # seconds from start


def make_trace(args: argparse.Namespace) -> Trace:
    rng = random.Random(args.seed)

    def text(tokens: int, tag: str) -> str:
        words = [tag]
        while sum(len(w) + 1 for w in words) < tokens * CHARS_PER_TOKEN:
            words.append(rng.choice(WORDS))
        return " ".join(words)[: tokens * CHARS_PER_TOKEN]

    systems = [text(args.system_tokens, f"system-{k}:") for k in range(args.systems)]
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.systems)]
    prompts, arrivals, t = [], [], 0.0
    for i in range(args.requests):
        system = rng.choices(systems, weights)[0]
        prompts.append(system + "\n" + text(args.user_tokens, f"user-{i}:"))
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    return Trace(prompts, arrivals)


@dataclass
class Result:
    name: str
    ttft_ms: list[float] = field(default_factory=list)
    errors: int = 0
    hit_rate: float = 0.0
    per_p: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    def pct(self, q: float) -> float:
        xs = sorted(self.ttft_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def run_policy(name: str, policy: str, overrides: dict, trace: Trace,
                     args: argparse.Namespace) -> Result:  # fmt: skip
    model = EngineModel(args.p_cache_tokens, args.us_per_token, args.overhead_ms)
    cfg = dict(prefill_policy=policy, decode_policy="round_robin",
               cache_aware_capacity_tokens=args.p_cache_tokens, **overrides)  # fmt: skip
    res = Result(name)
    async with running_proxy(**cfg) as px:
        ps = []
        for _ in range(args.prefills):
            fake = CachingFakeP(model, proxy=px.discovery)
            px._fakes.append(fake)  # stopped with the proxy
            await fake.start()
            ps.append(fake)
        await px.fake("D", record=False)
        await wait_until(lambda: px.registry.count("P") == args.prefills, what="Ps registered")
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        async with httpx.AsyncClient(base_url=px.url, timeout=120, limits=limits) as client:

            async def one(prompt: str, at: float, t0: float) -> None:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                body = {"model": "fake-model", "prompt": prompt, "max_tokens": 4, "stream": True}
                await stream_ttft(client, "/v1/completions", body, res)

            t0 = time.perf_counter() + 0.05
            await asyncio.gather(*(one(p, at, t0) for p, at in zip(trace.prompts, trace.arrivals)))
            res.wall_s = time.perf_counter() - t0
    total = sum(p.prompt_tokens for p in ps)
    res.hit_rate = sum(p.cached_tokens for p in ps) / total if total else 0.0
    res.per_p = [p.prefills for p in ps]
    return res


def report(results: list[Result], args: argparse.Namespace) -> None:
    base = results[0]
    print(f"\n{args.requests} requests, {args.rate:g} req/s Poisson, {args.prefills} P "
          f"({args.p_cache_tokens} cached tokens each, {args.us_per_token:g} us/token, "
          f"{args.overhead_ms:g} ms overhead), {args.systems} system prompts x "
          f"{args.system_tokens} tokens (zipf {args.zipf:g}), user turns {args.user_tokens} tokens")  # fmt: skip
    head = (f"{'policy':<34} {'TTFT p50':>9} {'p99':>9} {'mean':>8} {'hit rate':>8} "
            f"{'p50 x':>6} {'p99 x':>6} {'errors':>6}  prefills per P")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in results:
        mean = statistics.fmean(r.ttft_ms) if r.ttft_ms else float("nan")
        print(f"{r.name:<34} {r.pct(0.5):>7.1f}ms {r.pct(0.99):>7.1f}ms {mean:>6.1f}ms "
              f"{r.hit_rate:>8.3f} {r.pct(0.5) / base.pct(0.5):>6.2f} "
              f"{r.pct(0.99) / base.pct(0.99):>6.2f} {r.errors:>6}  {r.per_p}")  # fmt: skip
    print(f"(x: ratio to {base.name} in the same run; lower is better)")


def sweep_grid(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    runs: list[tuple[str, str, dict]] = [("round_robin", "round_robin", {})]
    runs.append(("least_loaded", "least_loaded", {}))
    for abs_ in (2.0, 4.0, 8.0, 16.0):
        for rel in (1.0, 1.5):
            runs.append((f"cache_aware abs={abs_:g} rel={rel:g}", "cache_aware",
                         dict(cache_aware_balance_abs=abs_, cache_aware_balance_rel=rel)))  # fmt: skip
    for mm in (0.2, 0.8):
        runs.append((f"cache_aware min_match={mm:g}", "cache_aware",
                     dict(cache_aware_min_match=mm)))  # fmt: skip
    return runs


async def main_async(args: argparse.Namespace) -> None:
    trace = make_trace(args)
    if args.sweep:
        runs = sweep_grid(args)
    else:
        runs = [(p, p, {}) for p in args.policies]
    rounds: dict[str, list[Result]] = {name: [] for name, _, _ in runs}
    for k in range(args.rounds):  # interleaved: load from other processes hits all alike
        for name, policy, overrides in runs:
            r = await run_policy(name, policy, overrides, trace, args)
            print(f"  round {k + 1} {name}: p50 {r.pct(0.5):.1f} ms, p99 {r.pct(0.99):.1f} ms,"
                  f" hit rate {r.hit_rate:.3f}", flush=True)  # fmt: skip
            rounds[name].append(r)
    report([median_result(rs) for rs in rounds.values()], args)


async def stream_ttft(client: httpx.AsyncClient, path: str, body: dict, res: Result) -> None:
    """One streamed request: its time to the first chunk into res.ttft_ms, or an error."""
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            first = True
            async for _ in r.aiter_raw():
                if first:
                    first = False
                    if r.status_code == 200:
                        res.ttft_ms.append((time.perf_counter() - start) * 1e3)
                    else:
                        res.errors += 1
    except httpx.HTTPError:
        res.errors += 1


def median_result(rs: list[Result]) -> Result:
    """The round with the median p50 (its p99 and hit rate come with it)."""
    return sorted(rs, key=lambda r: r.pct(0.5))[len(rs) // 2]


# ---------------------------------------------------------------- chat trace (--chat)
#
# `precise` routes on the instances' own KV events (proxy/routing/policies/precise.py), so here the fake Ps
# work on the prompt's real token ids (tokenized as vLLM would, proxy/routing/prompt_keys.py) and
# publish a BlockStored / BlockRemoved for every block their LRU stores / evicts, through a
# double of vLLM's ZMQ publisher (tests/support/kv_publisher.py) that the proxies subscribe to.


@dataclass
class Conversation:
    system: int  # which shared system prompt
    start: float  # seconds from the run's start (Poisson)
    turns: list[list[dict]]  # each turn's messages
    think: list[float]  # seconds between a turn's end and the next turn


@dataclass
class ChatTrace:
    conversations: list[Conversation]
    ids: dict[tuple, list[int]]  # message key -> prompt token ids
    requests: int
    prompt_tokens: int
    ideal_hit_rate: float  # one infinite cache shared by all: every block seen before hits


def message_key(messages: list[dict]) -> tuple:
    return tuple((m.get("role"), m.get("content")) for m in messages)


def make_chat_trace(args: argparse.Namespace, tok: PromptTokenizer) -> ChatTrace:
    """--systems system prompts (Zipf popularity) x --conversations conversations of --turns
    turns; turn k+1's messages are turn k's plus an assistant answer and a new user message.
    Conversations start with Poisson arrivals (--conv-rate per second); within one, the next
    turn is sent a think time (exponential, mean --think-ms) after the previous one ended."""
    rng = random.Random(args.seed)
    # The NATO words are ~3.9 tokens each with the Llama tokenizer: size texts in words.
    per_word = len(tok.token_ids(COMPLETIONS, {"prompt": " ".join(WORDS)})[0]) / len(WORDS)

    def text(tokens: int, tag: str) -> str:
        return " ".join([tag, *(rng.choice(WORDS) for _ in range(max(1, round(tokens / per_word))))])

    systems = [text(args.system_tokens, f"system-{k}:") for k in range(args.systems)]
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.systems)]
    convs, ids, t = [], {}, 0.0
    for c in range(args.conversations):
        t += rng.expovariate(args.conv_rate)
        s = rng.choices(range(args.systems), weights)[0]
        messages = [{"role": "system", "content": systems[s]}]
        turns, think = [], []
        for k in range(args.turns):
            if k:
                messages = messages + [{"role": "assistant", "content": text(args.answer_tokens, f"answer-{c}-{k}:")}]
            messages = messages + [{"role": "user", "content": text(args.user_tokens, f"user-{c}-{k}:")}]
            turns.append(messages)
            think.append(min(10 * args.think_ms, rng.expovariate(1e3 / args.think_ms)) / 1e3)
            ids[message_key(messages)] = tok.token_ids(CHAT, {"messages": messages})[0]
        convs.append(Conversation(s, t, turns, think))
    # The ideal does not depend on the order: a request hits every block seen before, and
    # a chained block seen before comes with all its predecessors.
    blocks, seen, tokens = 0, set(), 0
    for conv in convs:
        for messages in conv.turns:
            keys = chain_block_keys(ids[message_key(messages)], BLOCK_TOKENS)
            blocks += len(keys)
            seen.update(keys)
            tokens += len(ids[message_key(messages)])
    ideal = (blocks - len(seen)) * BLOCK_TOKENS / tokens
    return ChatTrace(convs, ids, args.conversations * args.turns, tokens, ideal)


class EventedFakeP(CachingFakeP):
    """A caching P on real token ids that publishes its cache's changes as vLLM does."""

    def __init__(self, model: EngineModel, trace: ChatTrace, tok: PromptTokenizer, **kwargs) -> None:
        super().__init__(model, register=False, **kwargs)
        self.trace, self.tok = trace, tok
        self.publisher = Publisher()
        self.tokenized = 0  # prompts not in the trace (tokenized here: should stay 0)

    @property
    def spec(self) -> str:
        pub = self.publisher
        return f"http://{self.http_address},kv={self.zmq_address},events={pub.endpoint},replay={pub.replay_endpoint}"

    def prompt_blocks(self, path: str, body: object) -> tuple[int, list[int], object] | None:
        if path != CHAT or not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return None
        ids = self.trace.ids.get(message_key(body["messages"]))
        if ids is None:
            self.tokenized += 1
            ids = self.tok.token_ids(path, body)[0]
        # The engine's own block hashes: chained over token ids like vLLM's, salted so they
        # differ from the keys the proxy computes (it must map them, not assume them).
        return len(ids), chain_block_keys(ids, BLOCK_TOKENS, ENGINE_SALT), ids

    def stored(self, hashes: list[int], new: list[int], evicted: list[int], extra: object) -> None:
        ids: list[int] = extra  # type: ignore[assignment]
        events: list = []
        run_start = 0
        for j, i in enumerate(new):  # one BlockStored per run of consecutive new blocks
            if j + 1 < len(new) and new[j + 1] == i + 1:
                continue
            a, b = new[run_start], i + 1
            events.append(BlockStored(tuple(hashes[a:b]), hashes[a - 1] if a else None,
                                      tuple(ids[a * BLOCK_TOKENS : b * BLOCK_TOKENS]), BLOCK_TOKENS,
                                      medium="GPU"))  # fmt: skip
            run_start = j + 1
        if evicted:
            events.append(BlockRemoved(tuple(evicted), "GPU"))
        if events:
            self.publisher.publish(events)

    async def close(self) -> None:
        await self.stop()
        self.publisher.close()


@dataclass
class ChatResult(Result):
    proxies: int = 1
    skipped: int = 0  # turns not sent: past --max-s
    events_share: float = float("nan")  # precise: choices made from events (not the guess)


def _setting(kv: str) -> tuple[str, object]:
    """KEY=VALUE from --proxy-set: a ProxyConfig field and a number (or text)."""
    key, _, raw = kv.partition("=")
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


async def run_chat(policy: str, nproxies: int, trace: ChatTrace, tok: PromptTokenizer,
                   args: argparse.Namespace) -> ChatResult:  # fmt: skip
    """A fresh set of instances (static, each with its publisher) and `nproxies` fresh
    proxies over them; the trace's requests go round robin over the proxies."""
    model = EngineModel(args.p_cache_tokens, args.us_per_token, args.overhead_ms)
    res = ChatResult(policy, proxies=nproxies)
    ps = [EventedFakeP(model, trace, tok) for _ in range(args.prefills)]
    d = FakeVLLM("D", register=False, record=False)
    try:
        for f in (*ps, d):
            await f.start()
        cfg = dict(prefill=tuple(p.spec for p in ps), decode=(f"http://{d.http_address},kv={d.zmq_address}",),
                   prefill_policy=policy, decode_policy="round_robin", tokenizer=str(args.tokenizer),
                   health_interval=0.2, cache_aware_capacity_tokens=args.p_cache_tokens,
                   **dict(_setting(kv) for kv in args.proxy_set))  # fmt: skip
        async with contextlib.AsyncExitStack() as stack:
            pxs = [await stack.enter_async_context(running_proxy(**cfg)) for _ in range(nproxies)]
            await wait_until(lambda: all(len(px.registry.live("P")) == args.prefills and px.registry.live("D")
                                         for px in pxs), timeout=20, what="static instances live")  # fmt: skip
            await wait_until(lambda: all(px.state.kv_events.state(i) is IndexState.KNOWN
                                         for px in pxs for i in px.registry.live("P")),
                             timeout=20, what="every P's KV index known on every proxy")  # fmt: skip
            await drive_chat(pxs, trace, res, args)
            await check_indexes(pxs, ps)
            if policy == "precise":
                got = {s: sum([await px.metric("xpyd_precise_choices_total", role="P", source=s) for px in pxs])
                       for s in ("events", "guess")}  # fmt: skip
                res.events_share = got["events"] / max(1.0, got["events"] + got["guess"])
    finally:
        for f in ps:
            await f.close()
        await d.stop()
    total = sum(p.prompt_tokens for p in ps)
    res.hit_rate = sum(p.cached_tokens for p in ps) / total if total else 0.0
    res.per_p = [p.prefills for p in ps]
    if any(p.tokenized for p in ps):
        print(f"  note: {sum(p.tokenized for p in ps)} prompts were not in the trace's table", flush=True)
    return res


async def check_indexes(pxs: list, ps: list[EventedFakeP]) -> None:
    """Sanity: once the events have landed, every proxy's index of a P holds as many blocks
    as that P's cache (a note, not a failure: the numbers above do not depend on it)."""

    def agree() -> bool:
        for px in pxs:
            for p in ps:
                inst = next((i for i in px.registry.all() if i.http_address == p.http_address), None)
                index = None if inst is None else px.state.kv_events.index(inst)
                if index is None or len(index) != len(p.cache.blocks):
                    return False
        return True

    try:
        await wait_until(agree, timeout=5)
    except AssertionError:
        print("  note: a proxy's KV index does not match its P's cache", flush=True)


async def drive_chat(pxs: list, trace: ChatTrace, res: ChatResult, args: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    clients = [httpx.AsyncClient(base_url=px.url, timeout=args.max_s, limits=limits) for px in pxs]
    turn_no = itertools.count()  # round robin over the proxies, per request (a load balancer)
    t0 = time.perf_counter() + 0.05
    deadline = t0 + args.max_s

    async def send(client: httpx.AsyncClient, messages: list[dict]) -> None:
        body = {"model": "fake-model", "messages": messages, "max_tokens": 4, "stream": True}
        await stream_ttft(client, "/v1/chat/completions", body, res)

    async def conversation(conv: Conversation) -> None:
        await asyncio.sleep(max(0.0, t0 + conv.start - time.perf_counter()))
        for k, (messages, think) in enumerate(zip(conv.turns, conv.think)):
            if time.perf_counter() > deadline:
                res.skipped += 1
                continue
            await send(clients[next(turn_no) % len(clients)], messages)
            if k + 1 < len(conv.turns):
                await asyncio.sleep(think)

    try:
        await asyncio.wait_for(asyncio.gather(*(conversation(c) for c in trace.conversations)),
                               timeout=args.max_s + 30)  # fmt: skip
    finally:
        res.wall_s = time.perf_counter() - t0
        for c in clients:
            await c.aclose()


def report_chat(results: list[ChatResult], trace: ChatTrace, args: argparse.Namespace) -> dict:
    ideal = trace.ideal_hit_rate
    print(f"\nchat: {trace.requests} requests ({args.conversations} conversations x {args.turns} turns, "
          f"{args.conv_rate:g} conversations/s Poisson, think {args.think_ms:g} ms), "
          f"{trace.prompt_tokens / trace.requests:.0f} prompt tokens/request; {args.systems} system prompts x "
          f"~{args.system_tokens} tokens (zipf {args.zipf:g}), user {args.user_tokens}, answers "
          f"{args.answer_tokens}; {args.prefills} P ({args.p_cache_tokens} cached tokens each, "
          f"{args.us_per_token:g} us/token, {args.overhead_ms:g} ms overhead)")  # fmt: skip
    print(f"ideal hit rate (one infinite shared cache): {ideal:.3f}")
    head = (f"{'policy':<12} {'proxies':>7} {'TTFT p50':>9} {'p99':>9} {'hit rate':>8} {'/ideal':>7} "
            f"{'p50 x':>6} {'p99 x':>6} {'errors':>6} {'skipped':>7} {'events':>6}  prefills per P")  # fmt: skip
    print(head)
    print("-" * len(head))
    base = {r.proxies: r for r in results if r.name == results[0].name}
    for r in results:
        b = base[r.proxies]
        ev = f"{r.events_share:.2f}" if r.events_share == r.events_share else "-"
        print(f"{r.name:<12} {r.proxies:>7} {r.pct(0.5):>7.1f}ms {r.pct(0.99):>7.1f}ms {r.hit_rate:>8.3f} "
              f"{r.hit_rate / ideal:>7.3f} {r.pct(0.5) / b.pct(0.5):>6.2f} {r.pct(0.99) / b.pct(0.99):>6.2f} "
              f"{r.errors:>6} {r.skipped:>7} {ev:>6}  {r.per_p}")  # fmt: skip
    print(f"(/ideal: hit rate / ideal; x: TTFT ratio to {results[0].name} with as many proxies; "
          "events: share of precise's choices made from KV events)")
    by = {(r.name, r.proxies): r for r in results}
    two_over_one = {}
    for name in dict.fromkeys(r.name for r in results):
        one, two = by.get((name, 1)), by.get((name, 2))
        if one and two:
            two_over_one[name] = two.hit_rate / one.hit_rate if one.hit_rate else float("nan")
            print(f"{name:<12} 2 proxies / 1: hit rate x{two_over_one[name]:.3f}; with 2 proxies it keeps "
                  f"{two.hit_rate / ideal:.1%} of the ideal (1 proxy: {one.hit_rate / ideal:.1%})")  # fmt: skip
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ideal_hit_rate": ideal,
        "requests": trace.requests,
        "results": [{"policy": r.name, "proxies": r.proxies, "hit_rate": r.hit_rate, "hit_vs_ideal": r.hit_rate / ideal,
                     "ttft_p50_ms": r.pct(0.5), "ttft_p99_ms": r.pct(0.99),
                     "ttft_mean_ms": statistics.fmean(r.ttft_ms) if r.ttft_ms else None,
                     "requests_ok": len(r.ttft_ms), "errors": r.errors, "skipped": r.skipped,
                     "events_share": None if r.events_share != r.events_share else r.events_share,
                     "prefills_per_p": r.per_p, "wall_s": r.wall_s} for r in results],  # fmt: skip
        "two_over_one_hit_rate": two_over_one,
    }


async def main_chat(args: argparse.Namespace) -> None:
    tok = PromptTokenizer(args.tokenizer)
    trace = make_chat_trace(args, tok)
    runs = [(p, n) for n in args.proxies for p in args.policies]
    rounds: dict[tuple[str, int], list[ChatResult]] = {run: [] for run in runs}
    for k in range(args.rounds):  # interleaved: load from other processes hits all alike
        for policy, n in runs:
            r = await run_chat(policy, n, trace, tok, args)
            print(f"  round {k + 1} {policy} x{n} proxies: p50 {r.pct(0.5):.1f} ms, p99 {r.pct(0.99):.1f} ms, "
                  f"hit rate {r.hit_rate:.3f} ({r.hit_rate / trace.ideal_hit_rate:.3f} of ideal), "
                  f"{r.wall_s:.1f} s", flush=True)  # fmt: skip
            rounds[(policy, n)].append(r)
    out = report_chat([median_result(rs) for rs in rounds.values()], trace, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", nargs="+", choices=POLICIES + ("precise",),
                    help="first one is the baseline for the ratios (default: the mode's)")  # fmt: skip
    ap.add_argument("--sweep", action="store_true", help="cache_aware threshold grid")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=60.0, help="arrivals per second")
    ap.add_argument("--prefills", type=int, default=4)
    ap.add_argument("--systems", type=int, default=12)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--user-tokens", type=int, default=200)
    ap.add_argument("--zipf", type=float, default=1.0, help="system prompt popularity skew")
    ap.add_argument("--p-cache-tokens", type=int, default=10_000, help="per P")
    ap.add_argument("--us-per-token", type=float, default=25.0, help="prefill cost")
    ap.add_argument("--overhead-ms", type=float, default=1.0, help="per prefill")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="repeat, interleaved; median round")
    chat = ap.add_argument_group("chat trace (--chat; --systems, --system-tokens, --user-tokens, --zipf and the "
                                 "P model apply too; --requests and --rate do not)")  # fmt: skip
    chat.add_argument("--chat", action="store_true", help="multi-turn chat trace, 1 and 2 proxies")
    chat.add_argument("--proxy-set", action="append", default=[], metavar="KEY=VALUE",
                      help="a proxy setting for every run, e.g. cache_aware_balance_abs=4 (repeatable)")
    chat.add_argument("--conversations", type=int, default=120)
    chat.add_argument("--turns", type=int, default=5)
    chat.add_argument("--answer-tokens", type=int, default=120, help="assistant answer in the next turn")
    chat.add_argument("--conv-rate", type=float, default=8.0, help="conversation starts per second")
    chat.add_argument("--think-ms", type=float, default=500.0, help="mean pause between turns")
    chat.add_argument("--proxies", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    chat.add_argument("--max-s", type=float, default=120.0, help="per run: no turn starts after this")
    chat.add_argument("--tokenizer", type=Path, default=MODEL_DIR)
    chat.add_argument("--json", help="write the chat numbers here")
    args = ap.parse_args()
    if args.policies is None:
        args.policies = list(CHAT_POLICIES if args.chat else POLICIES)
    if not args.chat and ("precise" in args.policies or args.json):
        ap.error("precise and --json need --chat (the completions trace's fakes publish no KV events)")
    if min(args.rate, args.requests, args.prefills, args.rounds) <= 0:
        ap.error("--rate, --requests, --prefills and --rounds must be > 0")
    if args.chat and min(args.conversations, args.turns, args.conv_rate, args.think_ms, args.max_s) <= 0:
        ap.error("--conversations, --turns, --conv-rate, --think-ms and --max-s must be > 0")
    run = main_chat(args) if args.chat else main_async(args)
    try:
        import uvloop

        uvloop.run(run)
    except ImportError:
        asyncio.run(run)
    return 0

if __name__ == "__main__":
    sys.exit(main())

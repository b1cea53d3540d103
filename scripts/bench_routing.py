#!/usr/bin/env python3
"""Routing benchmark: TTFT and prefix-cache hit rate per prefill policy on a shared-prefix
trace, through the real proxy, with fake P instances that model a prefix cache.

Each fake P (tests/fake_vllm.py, extended here) is one serial engine: a prefill waits for
the ones before it (FIFO), then takes overhead + (uncached prompt tokens) x per-token time;
its prefix cache is an LRU of chained 16-token blocks (4 characters a token) bounded by
--p-cache-tokens, looked up when the prefill starts and filled when it ends, like vLLM's.
The fake D streams at once, so TTFT is the proxy's routing + P's queue and prefill.

The trace: --systems long system prompts (Zipf popularity, --zipf) x one fresh user turn
per request, open-loop Poisson arrivals at --rate. Every policy gets the same trace and
a fresh proxy and fresh instances; ratios are against round_robin in the same run.

    .venv/bin/python scripts/bench_routing.py              # 4 policies, ~1 min
    .venv/bin/python scripts/bench_routing.py --sweep      # cache_aware thresholds

Proxy, fakes and client share one event loop (the simulated prefill times, tens of
milliseconds, dwarf the proxy's sub-millisecond overhead; bench_proxy.py measures that).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import httpx  # noqa: E402
from fake_vllm import FakeVLLM  # noqa: E402
from proxy_helpers import running_proxy, wait_until  # noqa: E402

BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4
POLICIES = ("round_robin", "least_loaded", "power_of_two", "cache_aware")
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

    def insert(self, hashes: list[int]) -> None:
        for h in reversed(hashes):  # prefix most recent: evicted last
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class CachingFakeP(FakeVLLM):
    def __init__(self, model: EngineModel, **kwargs) -> None:
        super().__init__("P", record=False, **kwargs)
        self.sim = model
        self.cache = PrefixCache(model.cache_tokens)
        self.engine = asyncio.Lock()  # FIFO: one prefill at a time
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefills = 0

    async def _respond(self, conn, req, path, body, rec) -> None:
        if req.method == "POST" and isinstance(body, dict) and isinstance(body.get("prompt"), str):
            prompt = body["prompt"]
            total = len(prompt) // CHARS_PER_TOKEN
            async with self.engine:
                hashes = self.cache.hashes(prompt)
                hit = self.cache.cached(hashes) * BLOCK_TOKENS
                m = self.sim
                await asyncio.sleep(m.overhead_ms / 1e3 + (total - hit) * m.us_per_token / 1e6)
                self.cache.insert(hashes)
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
                start = time.perf_counter()
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
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


def median_result(rs: list[Result]) -> Result:
    """The round with the median p50 (its p99 and hit rate come with it)."""
    return sorted(rs, key=lambda r: r.pct(0.5))[len(rs) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                    help="first one is the baseline for the ratios")  # fmt: skip
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
    args = ap.parse_args()
    if min(args.rate, args.requests, args.prefills, args.rounds) <= 0:
        ap.error("--rate, --requests, --prefills and --rounds must be > 0")
    try:
        import uvloop

        uvloop.run(main_async(args))
    except ImportError:
        asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""End-to-end benchmark on vLLM (CPU build): disaggregated (proxy + P + D) vs colocated.

Two numbers from the issue, each as a ratio against colocated baselines measured in the
same run on the same two cores:

* TTFT of a ~1k-token prompt at concurrency 1 (bar: disaggregated <= 1.2x colocated);
* decode inter-token latency (ITL) p99 of a streaming "victim" request while long prompts
  keep arriving (bar: disaggregated <= 0.5x colocated): the reason disaggregation exists.

Servers, all on 127.0.0.1 with free ports, logs in a temp dir:

* colocated-1omp: one vLLM, no connector, all its processes on cores 0,1, one OMP compute
  thread on core 0: what vLLM's own "auto" binding picks on a 2-core box (it keeps a core
  for the API server and the busy-polling scheduler);
* colocated-2omp: the same with OMP compute threads on both cores (--no-omp2 skips it);
* prefill P pinned to core 0 and decode D pinned to core 1 (everything of each instance on
  its core, one OMP thread each), with the xPyD connector; the proxy (`python -m proxy`)
  unpinned by default (--proxy-cpus); this load generator unpinned.
* "1-core vLLM": P or D hit straight with plain requests (no proxy, no KV transfer), i.e.
  one of two 1-core colocated replicas, as a third reference.

Measurements never overlap: one setup is measured while the others sit idle, and the
setups take turns request by request (TTFT) or round by round (ITL) so drifting load from
other tenants of a shared machine hits them alike. The long prompts arrive open loop at
the same rate for every setup (auto: the slowest setup busy ~60%).

    .venv/bin/python -m scripts.bench_e2e            # full run (~5-7 min on 2 cores)
    .venv/bin/python -m scripts.bench_e2e --quick    # fewer samples (~4 min)
    .venv/bin/python -m scripts.bench_e2e --model tiny
    .venv/bin/python -m scripts.bench_e2e --quick --dispatch-ab --json out.json
    .venv/bin/python -m scripts.bench_e2e --quick --runs 5 --ttft-tokens 4000 --json out.json

The disaggregated setup runs the proxy's shipped defaults (dispatch mode, local-prefill
threshold); --dispatch-ab adds a second proxy on the same P and D with the other dispatch
mode. Short prompts (--short-lengths, default 64 tokens; --short-sweep for 16..512) are
measured idle and while long prompts arrive, colocated vs the default proxy vs proxies
that always disaggregate (threshold 0) or always prefill on D (--local-prefill-threshold
huge). --json FILE writes the medians: ttft_1k_ms {colocated, disaggregated, p_alone} (at
--ttft-tokens, whatever its value), ttft_short_ms {colocated, disaggregated, tokens},
d_share_ms, d_share_parts_ms, prefill_answer_ms (P's answer as the proxy timed it),
itl_p99_*_ms, the shipped defaults, the machine and the command.

--runs N repeats the whole benchmark N times, each time on freshly started servers, and
prints each ratio's median and range over the runs (TTFT disaggregated / colocated, / P alone,
P alone / colocated, short prompts, ITL p99 under load); with --json the file holds the
medians over the runs, the ratios and every run's own figures. Use it for a claim about a few
per cent: two vLLM servers started alike can differ by that much for as long as they live.

--granularity-ab starts a second P (core 0 too) with the other connector send_granularity
than the first one's (with the default, auto, that is request), behind a proxy of its own (two
with --dispatch-ab); D registers with every proxy. Its setups are measured alongside, and the
report and --json (granularity_ab) give each one's TTFT, D's share and KV arrival lag.

D's share of each disaggregated TTFT request (P's answer -> D's first byte) is split from D's
own /metrics histograms and both connector logs, read around the request (one in flight at a
time): outside vLLM's clock, frontend <-> engine, the connector's KV wait, the engine steps
around the load, D's 1-token step, and the KV arrival lag (P's forward end -> D acknowledged
the last byte, from P's 'kv sent ... ms=' line).

--model bench (default) generates `.models/bench-llama-h768-l4` (Llama, hidden 768, 4
layers, 12 heads / 4 KV heads, ~25M parameters, the tiny model's tokenizer) with
scripts/make_tiny_model.py's code, so that a 1k-token prefill costs 150-300 ms on one core
like a small real model instead of the tiny model's few ms, where fixed HTTP costs would
dominate. Loopback only; every loop is bounded in count and time; every process started
here is stopped by its process group at the end, also on error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from xpyd_wire.headers import XPYD_DECODE_TTFB_MS, XPYD_FIRST_TOKEN, XPYD_PREFILL_MS, XPYD_QUEUE_MS

ROOT = Path(__file__).resolve().parent.parent

from tests.support import cluster  # noqa: E402  (tests/support/cluster.py)

MODEL_NAME = "tiny-llama"  # cluster.start_vllm serves every model under this name
# Proxies of the short-prompt sweep, beside the one with the shipped defaults.
ALWAYS_P = "always-prefill"  # --local-prefill-threshold 0
ALWAYS_LOCAL = "always-local"  # every prompt on D alone
DISPATCH_MODES = ("sequential", "concurrent")
GRANULARITIES = ("request", "layer")  # the connector's send_granularity, "auto" resolved (tcp: layer)
BENCH_DIMS = {"hidden": 768, "intermediate": 2048, "layers": 4, "heads": 12, "kv_heads": 4}


# ----------------------------------------------------------------------------- models


def ensure_model(kind: str) -> Path:
    """The tiny test model, or a bigger random Llama built with make_tiny_model's code
    (same tokenizer, same weight recipe) under its own directory."""
    from scripts import make_tiny_model as mtm  # scripts/make_tiny_model.py

    if kind == "tiny":
        out = cluster.DEFAULT_MODEL
        mtm.make_model(out)
        return out
    d = BENCH_DIMS
    out = ROOT / ".models" / f"bench-llama-h{d['hidden']}-l{d['layers']}"
    mtm.make_model(out, seed=0, dims=mtm.Dims(**d))
    return out


class Prompts:
    """Distinct prompts of an exact token count (tokenized with the model's tokenizer);
    each starts with a unique tag, so no two share even their first KV block."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from transformers import AutoTokenizer

        from scripts import make_tiny_model as mtm

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.words = mtm._WORDS
        self.rng = random.Random(seed)
        self.n = 0

    def make(self, n_tokens: int) -> str:
        self.n += 1
        words = [f"Case {self.n} {self.rng.randrange(10**6)}:"]
        words += [self.rng.choice(self.words) for _ in range(int(n_tokens * 1.1))]
        ids = self.tok(" ".join(words))["input_ids"]
        while len(ids) < n_tokens:  # short: add words
            words += [self.rng.choice(self.words) for _ in range(n_tokens - len(ids) + 8)]
            ids = self.tok(" ".join(words))["input_ids"]
        # Trim to exactly n_tokens (BOS included), then back to text; re-check the count.
        for cut in range(n_tokens, n_tokens - 16, -1):
            text = self.tok.decode(ids[1:cut], skip_special_tokens=True)
            if len(self.tok(text)["input_ids"]) == n_tokens:
                return text
        return self.tok.decode(ids[1:n_tokens], skip_special_tokens=True)


# ----------------------------------------------------------------------------- client


@dataclass
class StreamResult:
    t_send: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # completion tokens so far, per chunk
    prompt_tokens: int = 0
    headers: dict = field(default_factory=dict)
    error: str | None = None
    decode: dict[str, float] | None = None  # D's own timings of this request (DecodeProbe)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.t_send

    def gaps(self) -> list[float]:
        c = self.chunk_times
        return [b - a for a, b in itertools.pairwise(c)]


def completion_body(prompt: str, max_tokens: int, stream: bool) -> dict:
    b = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
         "ignore_eos": True, "stream": stream,
         # Special tokens as text: every token yields a non-empty chunk.
         "skip_special_tokens": False}
    if stream:
        b["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return b


async def stream_one(client, url: str, prompt: str, max_tokens: int, timeout: float) -> StreamResult:
    """One streaming completion; a timestamp per SSE data chunk that carries a token."""
    res = StreamResult(time.perf_counter())
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/completions",
                                     json=completion_body(prompt, max_tokens, True)) as r:
                res.headers = dict(r.headers)
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                    return res
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = str(chunk["error"])[:300]
                        return res
                    usage = chunk.get("usage") or {}
                    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                    if chunk.get("choices"):
                        res.chunk_times.append(now)
                        res.chunk_tokens.append(usage.get("completion_tokens", len(res.chunk_times)))
    except Exception as e:  # noqa: BLE001 - timeouts, resets...: reported, not raised
        res.error = res.error or f"{type(e).__name__}: {e}"
    if not res.chunk_times and not res.error:
        res.error = "no token chunk"
    return res


async def post_one(client, url: str, prompt: str, max_tokens: int, timeout: float) -> str | None:
    try:
        r = await client.post(url + "/v1/completions", json=completion_body(prompt, max_tokens, False),
                              timeout=timeout)
        return None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


@dataclass
class Background:
    """Long prompts sent to one setup while a victim decodes: open loop (one arrival every
    `interval` seconds, at most `concurrency` in flight) or closed loop (interval 0:
    `concurrency` workers back to back). Bounded by max_requests and by the caller's stop."""

    client: object
    url: str
    prompts: Prompts
    tokens: int
    max_tokens: int
    concurrency: int
    interval: float
    max_requests: int
    timeout: float
    sent: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _one(self, prompt: str) -> None:
        self.sent.append(time.perf_counter())
        err = await post_one(self.client, self.url, prompt, self.max_tokens, self.timeout)
        if err:
            self.errors.append(err)

    async def run(self) -> None:
        # Prompts are tokenized up front: nothing CPU-heavy in the loop.
        pool = [self.prompts.make(self.tokens) for _ in range(self.max_requests)]
        sem = asyncio.Semaphore(self.concurrency)
        tasks: list[asyncio.Task] = []

        async def guarded(p: str) -> None:
            try:
                await self._one(p)
            finally:
                sem.release()

        for p in pool:
            if self.stop.is_set():
                break
            await sem.acquire()
            if self.stop.is_set():
                sem.release()
                break
            tasks.append(asyncio.create_task(guarded(p)))
            if self.interval > 0:
                try:
                    await asyncio.wait_for(self.stop.wait(), self.interval)
                except TimeoutError:
                    pass
        if tasks:  # drain: the next measurement starts on an idle system
            await asyncio.wait(tasks, timeout=self.timeout)


# ----------------------------------------------------------------------------- stats


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


def ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1000:.1f}"


# ----------------------------------------------------------------------------- bench


def pin_process_tree(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a running process (sched_setaffinity takes one thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def machine_facts() -> list[str]:
    la = os.getloadavg()
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            mem = [ln for ln in f if ln.startswith(("MemTotal", "MemAvailable"))]
        mem_s = ", ".join(" ".join(m.split()[:2]) for m in mem)
    except OSError:
        mem_s = "?"
    return [f"nproc={os.cpu_count()} ({model}); load average at start "
            f"{la[0]:.2f} {la[1]:.2f} {la[2]:.2f}; {mem_s}; python {platform.python_version()}"]


class CpuMeter:
    """How much of the machine others used while we measured: /proc/stat busy time minus
    the CPU time of our own processes (this one and the servers' sessions)."""

    HZ = os.sysconf("SC_CLK_TCK")

    def __init__(self, sessions: list[int]) -> None:
        self.sessions = set(sessions)
        self.start = self._sample()

    @staticmethod
    def _stat() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...
        return v[0] + v[1] + v[2] + v[5] + v[6], v[7] if len(v) > 7 else 0

    def _ours(self) -> int:
        return sum(int(fields[11]) + int(fields[12]) for pid, fields in cluster.proc_stats()
                   if pid == os.getpid() or int(fields[3]) in self.sessions)

    def _sample(self) -> tuple[float, int, int, int]:
        busy, steal = self._stat()
        return time.monotonic(), busy, steal, self._ours()

    def report(self) -> str:
        t1, b1, s1, o1 = self._sample()
        t0, b0, s0, o0 = self.start
        cap = (t1 - t0) * self.HZ * (os.cpu_count() or 1)
        ours, others = (o1 - o0) / cap, ((b1 - b0) - (o1 - o0)) / cap
        return (f"CPU while measuring ({t1 - t0:.0f}s, share of all {os.cpu_count()} cores): ours {ours:.0%}, "
                f"other tenants {max(others, 0.0):.0%}, steal {(s1 - s0) / cap:.0%}")


@dataclass
class Setup:
    name: str
    url: str


# D's per-request histograms (vLLM's frontend and engine timestamps, v1/metrics/stats.py):
# ttft = frontend arrival (after the API server parsed and tokenised) -> first token;
# queue = engine arrival -> first scheduled (a request waiting for remote KV is scheduled only
# once its load finished); prefill = scheduled -> first token (D's 1-token step).
DECODE_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                     "prefill": "vllm:request_prefill_time_seconds"}


def histogram_sums(metrics: str, names: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in a Prometheus text page, over all its label sets;
    ``names``: key -> metric name."""
    out = {k: [0.0, 0.0] for k in names}
    for line in metrics.splitlines():
        for key, name in names.items():
            for i, suffix in enumerate(("_sum", "_count")):
                if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " "):
                    out[key][i] += float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


class DecodeProbe:
    """Where D's share of one disaggregated request goes, from D's own /metrics (sum and
    count of each histogram before and after the request: one request in flight at a time),
    the connector's 'kv loaded ... wait_ms' line D logged for it and the 'kv sent ... ms'
    line P logged for it (P's forward end -> D acknowledged the last byte: the KV arrival lag)."""

    def __init__(self, url: str, log_path: Path, prefill_logs: list[Path]) -> None:
        self.url = url
        self.log_path = log_path
        self.prefill_logs = prefill_logs  # every P behind the probed setups: one of them sends

    async def _histograms(self, client) -> dict[str, tuple[float, float]]:
        return histogram_sums((await client.get(self.url + "/metrics", timeout=10)).text, DECODE_HISTOGRAMS)

    async def before(self, client) -> tuple[dict[str, tuple[float, float]], int, list[int]]:
        return (await self._histograms(client), self.log_path.stat().st_size,
                [p.stat().st_size for p in self.prefill_logs])

    async def after(self, client, mark: tuple[dict[str, tuple[float, float]], int, list[int]]
                    ) -> dict[str, float] | None:
        """D's timings (ms) of the one request since `mark`; None if D did not count exactly one."""
        h0, offset, p_offset = mark
        for _ in range(20):  # the frontend records a request's stats right after its last output
            h1 = await self._histograms(client)
            counts = {h1[k][1] - h0[k][1] for k in DECODE_HISTOGRAMS}
            if counts == {1}:
                break
            await asyncio.sleep(0.05)
        else:
            return None
        out = {k: (h1[k][0] - h0[k][0]) * 1000 for k in DECODE_HISTOGRAMS}
        with self.log_path.open("rb") as f:
            f.seek(offset)
            log = f.read().decode(errors="replace")
        waits = kv_waits(log)
        out["kv_wait"] = waits[0] if len(waits) == 1 else math.nan
        out["sync_load"] = float(loads[0]) if len(loads := kv_load_modes(log)) == 1 else math.nan
        lags = []
        for path, at in zip(self.prefill_logs, p_offset, strict=True):
            with path.open("rb") as f:
                f.seek(at)
                lags += [float(m) for m in re.findall(r"kv sent(?: slowly)? req=.* ms=([0-9.]+) ",
                                                      f.read().decode(errors="replace"))]
        out["arrival_lag"] = lags[0] if len(lags) == 1 else math.nan
        return out


async def warmup(client, setups: list[Setup], prompts: Prompts, args) -> dict[str, float]:
    """First passes of new shapes are slow (oneDNN primitives, AMX init): run each shape
    the bench uses on every setup once, plus a short mixed load. Returns each setup's
    latency for one long (background) prompt, measured after the warm-up."""
    for s in setups:
        for n in (args.victim_prompt_tokens, args.ttft_tokens, args.bg_tokens):
            r = await stream_one(client, s.url, prompts.make(n), 8, 300)
            if r.error:
                raise RuntimeError(f"warm-up on {s.name} failed: {r.error}")
        bg = Background(client, s.url, prompts, args.bg_tokens, args.bg_max_tokens, args.bg_concurrency,
                        0.0, 2, 300)
        task = asyncio.create_task(bg.run())
        await stream_one(client, s.url, prompts.make(args.victim_prompt_tokens), 16, 300)
        bg.stop.set()
        await task
    lat = {}
    for s in setups:
        xs = []
        for _ in range(3):
            t = time.perf_counter()
            err = await post_one(client, s.url, prompts.make(args.bg_tokens), args.bg_max_tokens, 300)
            if err:
                raise RuntimeError(f"long prompt on {s.name} failed: {err}")
            xs.append(time.perf_counter() - t)
        lat[s.name] = min(xs)
    return lat


async def measure_ttft(client, setups: list[Setup], prompts: Prompts, args, ref: Setup,
                       shared: list[Setup], probe: DecodeProbe | None = None) -> dict:
    out: dict = {s.name: [] for s in setups + shared + [ref]}
    everyone = setups + shared
    for i in range(args.ttft_n):
        prompt = prompts.make(args.ttft_tokens)  # same text to every setup: separate servers, no cache hit
        k = i % len(everyone)
        order = everyone[k:] + everyone[:k]  # rotate: no setup always goes first
        # The reference (P straight, no proxy, no transfer) and setups sharing P with the
        # disaggregated one get their own prompts: a repeated prompt would hit P's cache.
        plan = [(s, prompts.make(args.ttft_tokens) if s in shared else prompt) for s in order]
        for s, p in plan + [(ref, prompts.make(args.ttft_tokens))]:
            probed = probe is not None and s.name.startswith("disagg")
            mark = await probe.before(client) if probed else None
            r = await stream_one(client, s.url, p, args.ttft_max_tokens, 300)
            if r.error:
                raise RuntimeError(f"TTFT request to {s.name} failed: {r.error}")
            if probed:
                r.decode = await probe.after(client, mark)
            out[s.name].append(r)
            await asyncio.sleep(args.pause)
    return out


async def measure_victim(client, s: Setup, prompts: Prompts, args,
                         interference: bool) -> tuple[StreamResult, Background | None]:
    prompt = prompts.make(args.victim_prompt_tokens)
    bg = None
    task = None
    if interference:
        bg = Background(client, s.url, prompts, args.bg_tokens, args.bg_max_tokens, args.bg_concurrency,
                        args.bg_interval, args.bg_max_requests, 300)
        task = asyncio.create_task(bg.run())
        for _ in range(500):  # prompts are tokenized first; then the first long prompt goes out
            if bg.sent:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(args.bg_lead)  # let it get going before the victim starts
    try:
        r = await stream_one(client, s.url, prompt, args.victim_tokens, 600)
    finally:
        if bg is not None:
            bg.stop.set()
            await asyncio.wait_for(task, 600)
    if r.error:
        raise RuntimeError(f"victim on {s.name} failed: {r.error}")
    if bg is not None and bg.errors:
        raise RuntimeError(f"background on {s.name} failed: {bg.errors[:3]}")
    return r, bg


async def measure_short(client, colo: Setup, group: list[Setup], bg_url: str, prompts: Prompts,
                        args) -> dict[tuple[str, int, bool], list[float]]:
    """TTFT of short prompts, per length, idle and while long prompts arrive. `group`: the
    setups sharing one P and D (proxies with different routing); while loaded, the long
    prompts go through the proxy with the shipped defaults (`bg_url`), so P is busy
    prefilling them and D decodes their first token, as in production. Every request has a
    prompt of its own (setups share D: a repeated prompt would hit its prefix cache)."""
    out: dict[tuple[str, int, bool], list[float]] = {}
    for loaded in (False, True):
        for n_tok in args.short_lengths:
            for rnd in range(args.short_n):
                k = rnd % len(group)
                for targets, bg_target in (([colo], colo.url), (group[k:] + group[:k], bg_url)):
                    bg = task = None
                    if loaded:
                        bg = Background(client, bg_target, prompts, args.bg_tokens, args.bg_max_tokens,
                                        args.bg_concurrency, args.bg_interval, 4, 300)
                        task = asyncio.create_task(bg.run())
                        for _ in range(500):
                            if bg.sent:
                                break
                            await asyncio.sleep(0.01)
                        # A random phase of the long prompt's prefill, not always its start.
                        await asyncio.sleep(args.bg_lead * random.random() * 2)
                    try:
                        for s in targets:
                            r = await stream_one(client, s.url, prompts.make(n_tok), 1, 300)
                            if r.error:
                                raise RuntimeError(f"short prompt to {s.name} failed: {r.error}")
                            out.setdefault((s.name, n_tok, loaded), []).append(r.ttft)
                            if not loaded:
                                await asyncio.sleep(args.pause)
                    finally:
                        if bg is not None:
                            bg.stop.set()
                            await asyncio.wait_for(task, 600)
                    if bg is not None and bg.errors:
                        raise RuntimeError(f"background to {bg_target} failed: {bg.errors[:3]}")
                    if loaded:
                        await asyncio.sleep(args.pause)
    return out


async def bench(args, setups: list[Setup], p_ref: Setup, d_ref: Setup, prompts: Prompts,
                ttft_only: list[Setup], short_group: list[Setup], probe: DecodeProbe | None = None) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.monotonic()
        long_lat = await warmup(client, setups + ttft_only + [d_ref], prompts, args)
        if args.bg_interval < 0:  # auto: one arrival rate for all, sustainable by all
            args.bg_interval = round(max(long_lat[s.name] for s in setups) / args.bg_util, 2)
        print(f"  warm-up done ({time.monotonic() - t0:.0f}s); one {args.bg_tokens}-token prompt takes "
              + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in long_lat.items())
              + f"; long prompts will arrive every {args.bg_interval}s", flush=True)
        for s in short_group:  # their P and D are warm: one request warms each proxy
            r = await stream_one(client, s.url, prompts.make(args.victim_prompt_tokens), 1, 300)
            if r.error:
                raise RuntimeError(f"warm-up on {s.name} failed: {r.error}")
        t0 = time.monotonic()
        ttft = await measure_ttft(client, setups, prompts, args, p_ref, ttft_only, probe)
        print(f"  TTFT done ({time.monotonic() - t0:.0f}s)", flush=True)
        t0 = time.monotonic()
        victims: dict[tuple[str, bool], list[tuple[StreamResult, Background | None]]] = {}
        for rnd in range(args.victims):
            k = rnd % len(setups)
            order = setups[k:] + setups[:k]
            for interference in (False, True):
                for s in order:
                    res = await measure_victim(client, s, prompts, args, interference)
                    victims.setdefault((s.name, interference), []).append(res)
                    await asyncio.sleep(args.pause)
            res = await measure_victim(client, d_ref, prompts, args, False)
            victims.setdefault((d_ref.name, False), []).append(res)
            await asyncio.sleep(args.pause)
        print(f"  ITL done ({time.monotonic() - t0:.0f}s)", flush=True)
        short: dict = {}
        if short_group:
            t0 = time.monotonic()
            short = await measure_short(client, setups[0], short_group, setups[-1].url, prompts, args)
            print(f"  short prompts done ({time.monotonic() - t0:.0f}s)", flush=True)
    return {"ttft": ttft, "victims": victims, "long_lat": long_lat, "short": short}


def kv_waits(decode_log: str) -> list[float]:
    """D's 'kv loaded ... wait_ms=X' lines (connector/p2p/engine.py)."""
    out = []
    for line in decode_log.splitlines():
        if "kv loaded" in line and "wait_ms=" in line:
            try:
                out.append(float(line.rsplit("wait_ms=", 1)[1].split()[0]))
            except (ValueError, IndexError):
                pass
    return out


def kv_load_modes(decode_log: str) -> list[bool]:
    """Per 'kv loaded' line of D's log: whether the load was synchronous (applied in the step
    that scheduled the request; connector/p2p/consumer.py adds ' sync')."""
    return [" sync" in line.split("wait_ms=", 1)[1] for line in decode_log.splitlines()
            if "kv loaded" in line and "wait_ms=" in line]


def first_gap_parts(results: list[StreamResult]) -> dict[str, float] | None:
    """With the first token from P, D's whole share falls between the client's first and second
    token. Medians (ms) of that gap split per request from D's /metrics and its connector log:
    outside vLLM's clock (the proxy sending D's continuation after P's token, HTTP into D,
    parsing, D's first chunk relayed), vLLM's frontend <-> engine hand-offs, the engine queue
    (the connector's KV wait + the steps around an asynchronous load), D's 1-token step (with a
    synchronous load's scatter), and the share of loads that were synchronous."""
    rows = []
    for r in results:
        d = r.decode
        if d is None or not r.gaps() or r.headers.get(XPYD_FIRST_TOKEN) != "prefill":
            continue
        gap = r.gaps()[0] * 1000
        rows.append({"gap": gap, "outside_vllm": gap - d["ttft"],
                     "frontend_engine": d["ttft"] - d["queue"] - d["prefill"],
                     "engine_queue": d["queue"], "kv_wait": d["kv_wait"], "one_token_step": d["prefill"],
                     "sync_load": d.get("sync_load", math.nan), "kv_arrival_lag": d["arrival_lag"]})
    if not rows:
        return None
    out: dict[str, float] = {"n": len(rows)}
    for k in rows[0]:
        xs = [x[k] for x in rows if not math.isnan(x[k])]
        out[k] = (statistics.mean(xs) if k == "sync_load" else statistics.median(xs)) if xs else math.nan
    return out


def d_share_parts(results: list[StreamResult]) -> dict[str, float] | None:
    """Medians (ms) of D's share split per request: outside vLLM's clock (proxy -> D HTTP,
    parsing, tokenisation, relay of the first chunk; only when D got the request after P
    answered), vLLM's frontend <-> engine hand-offs, the engine queue = the connector's KV
    wait + the engine steps around the load, D's 1-token step, and the KV arrival lag.
    Medians of the parts do not add up exactly to the median of the whole."""
    rows = []
    for r in results:
        d = r.decode
        if d is None or XPYD_DECODE_TTFB_MS not in r.headers:
            continue
        share = float(r.headers[XPYD_DECODE_TTFB_MS])
        rows.append({"d_share": share, "outside_vllm": share - d["ttft"] if d["ttft"] <= share else math.nan,
                     "frontend_engine": d["ttft"] - d["queue"] - d["prefill"], "engine_queue": d["queue"],
                     "kv_wait": d["kv_wait"], "load_steps": d["queue"] - d["kv_wait"],
                     "one_token_step": d["prefill"], "kv_arrival_lag": d["arrival_lag"]})
    if not rows:
        return None
    out: dict[str, float] = {"n": len(rows)}
    for k in rows[0]:
        xs = [x[k] for x in rows if not math.isnan(x[k])]
        out[k] = statistics.median(xs) if xs else math.nan
    return out


def arrival_lag_ms(results: list[StreamResult]) -> float:
    """Median KV arrival lag (P's forward end -> D acknowledged the last byte) of these
    requests, from P's 'kv sent' lines: whether or not D's share is on TTFT (with the first
    token from P there is no D's-share header, but P still ships the KV)."""
    lags = [r.decode["arrival_lag"] for r in results
            if r.decode is not None and not math.isnan(r.decode["arrival_lag"])]
    return statistics.median(lags) if lags else math.nan


def _finite(x: float) -> float | None:
    """JSON has no NaN: a figure that could not be measured is null."""
    return None if math.isnan(x) else x


def report(args, res: dict, setups: list[Setup], p_ref: Setup, d_ref: Setup,
           decode_log: str, notes: list[str]) -> list[str]:
    colos, dis = [s.name for s in setups[:-1]], setups[-1].name
    tt = res["ttft"]
    t = {k: [r.ttft for r in v] for k, v in tt.items()}
    ptoks = sorted({r.prompt_tokens for r in tt[dis]})

    def itl(name: str, interf: bool) -> list[float]:
        return [g for r, _ in res["victims"][(name, interf)] for g in r.gaps()]

    one = "1-core vLLM"  # P (TTFT) or D (idle ITL) hit straight: one colocated 1-core replica
    base = [*colos, one]
    short = {c: c.replace("colocated-", "colo-") for c in colos} | {one: "1-core"}
    hdr = ("metric (ms; ratio = disagg / baseline)", *(f"{short[c]}" for c in base), "disagg",
           *(f"/{short[c]}" for c in base))
    rows = []
    bars = []

    def row(label: str, fn, values: dict[str, list[float] | None], bar: tuple[str, float] | None = None) -> None:
        v = {k: (fn(x) if x else float("nan")) for k, x in values.items()}
        ratios = {c: v[dis] / v[c] if v[c] > 0 else float("nan") for c in base}
        rows.append((label, *(ms(v[c]) for c in base), ms(v[dis]),
                     *("n/a" if math.isnan(r) else f"{r:.2f}x" for r in ratios.values())))
        if bar is not None:
            what, limit = bar
            verdicts = [f"vs {c} {ratios[c]:.2f}x {'MET' if ratios[c] <= limit else 'NOT MET'}"
                        for c in base if not math.isnan(ratios[c])]
            bars.append(f"  {what} <= {limit}x colocated: " + "; ".join(verdicts))

    t.setdefault(one, t[p_ref.name])
    row(f"TTFT, {'/'.join(map(str, ptoks))}-token prompt, c=1: median", statistics.median, t,
        ("TTFT median", 1.2))
    row("TTFT: p90", lambda x: pct(x, 90), t)
    row("TTFT: min", min, t)
    for interf, tag in ((False, "ITL, no other load"), (True, "ITL, long prompts arriving")):
        vals = {k: itl(k, interf) for k in colos + [dis]}
        vals[one] = None if interf else itl(d_ref.name, False)
        row(f"{tag}: p50", lambda x: pct(x, 50), vals)
        row(f"{tag}: p90", lambda x: pct(x, 90), vals)
        row(f"{tag}: p99", lambda x: pct(x, 99), vals, ("ITL p99 under long prompts", 0.5) if interf else None)
        row(f"{tag}: max", max, vals)
    w = [max(len(r[i]) for r in [*rows, hdr]) for i in range(len(hdr))]
    fmt = "  ".join(f"{{:<{x}}}" if i == 0 else f"{{:>{x}}}" for i, x in enumerate(w))
    lines = [fmt.format(*hdr), fmt.format(*("-" * x for x in w))]
    lines += [fmt.format(*r) for r in rows]
    lines.append("")
    lines.append("bars:")
    lines += bars
    lines.append("")
    lines.append("references and breakdown:")
    lines.append("  1-core vLLM = TTFT on P and idle ITL on D hit straight (plain requests: no proxy, "
                 "no KV transfer); what one of two 1-core colocated replicas would do at concurrency 1")
    ab = next((k for k in tt if k.startswith("disagg-") and k in (f"disagg-{m}" for m in DISPATCH_MODES)), None)
    gab = [k for k in tt if k.startswith(tuple(f"disagg-{g}" for g in GRANULARITIES))]  # the second P's setups
    for name in [dis] + ([ab] if ab else []) + gab:
        hd = [r.headers for r in tt[name]]
        try:
            q = statistics.median(float(h[XPYD_QUEUE_MS]) for h in hd)
            pre = statistics.median(float(h[XPYD_PREFILL_MS]) for h in hd)
            dttfb = statistics.median(float(h[XPYD_DECODE_TTFB_MS]) for h in hd)
            total = statistics.median(r.ttft for r in tt[name]) * 1000
            lines.append(f"  {name} TTFT {total:.1f} ms, split (proxy timing headers, medians): proxy queue "
                         f"{q:.1f} ms, P answers the prefill {pre:.1f} ms, D's first byte {dttfb:.1f} ms later "
                         f"(D's share: HTTP + KV load + 1-token step), the rest (client<->proxy, relay) "
                         f"{total - q - pre - dttfb:.1f} ms")
        except (KeyError, ValueError, statistics.StatisticsError):
            if all(r.headers.get(XPYD_FIRST_TOKEN) == "prefill" for r in tt[name]):
                lines.append(first_token_split(name, tt[name], statistics.median(t[p_ref.name]) * 1000))
            else:
                lines.append(f"  {name}: no split of D's share (x-xpyd-decode-ttfb-ms absent)")
        gparts = first_gap_parts(tt[name])
        if gparts:
            lines.append(f"    gap from token 1 to 2 {gparts['gap']:.1f} ms "
                         f"({first_gap_ms(tt[colos[0]]):.1f} {colos[0]}) split "
                         f"(D's /metrics + connector logs, medians of {gparts['n']}): outside vLLM's clock (proxy -> D "
                         f"HTTP, parse, relay) {gparts['outside_vllm']:.1f}; frontend<->engine "
                         f"{gparts['frontend_engine']:.1f}; engine queue {gparts['engine_queue']:.1f} (KV wait "
                         f"{gparts['kv_wait']:.1f}); D's 1-token step {gparts['one_token_step']:.1f}; synchronous "
                         f"loads {gparts['sync_load']:.0%}; KV arrival lag {gparts['kv_arrival_lag']:.1f}")
        parts = d_share_parts(tt[name])
        if parts:
            outside = (f"{parts['outside_vllm']:.1f}" if not math.isnan(parts["outside_vllm"])
                       else "n/a (D had the request before P answered)")
            lines.append(f"    D's share {parts['d_share']:.1f} ms split (D's /metrics + both connector logs, "
                         f"medians of {parts['n']}): outside vLLM's clock (HTTP, parse, tokenise, relay) {outside}; "
                         f"frontend<->engine {parts['frontend_engine']:.1f}; engine queue "
                         f"{parts['engine_queue']:.1f} = the connector's KV wait {parts['kv_wait']:.1f} + engine "
                         f"steps around the load {parts['load_steps']:.1f}; D's 1-token step "
                         f"{parts['one_token_step']:.1f}. KV arrival lag (P's forward end -> D acknowledged the "
                         f"last byte) {parts['kv_arrival_lag']:.1f}")
    if ab:
        a, b = (statistics.median(r.ttft for r in tt[k]) for k in (dis, ab))
        da, db = (statistics.median(float(r.headers.get(XPYD_DECODE_TTFB_MS, "nan")) for r in tt[k])
                  for k in (dis, ab))
        lines.append(f"  dispatch A/B (same P and D, alternating): TTFT median {args.dispatch_default} (default) "
                     f"{a * 1000:.1f} ms, {ab.removeprefix('disagg-')} {b * 1000:.1f} ms ({b / a:.2f}x); "
                     f"D's share {da:.1f} -> {db:.1f} ms; gap from token 1 to 2 {first_gap_ms(tt[dis]):.1f} -> "
                     f"{first_gap_ms(tt[ab]):.1f} ms")
    if FIRST_TOKEN_SETUP in tt:
        ft = first_token_ab(tt, colos[0], dis, args.first_token)
        lines.append(f"  first token A/B (same P and D, alternating): TTFT median decode "
                     f"{ft['decode']['ttft_ms']:.1f} ms ({ft['decode']['ttft_vs_colocated']:.2f}x {colos[0]}), "
                     f"prefill {ft['prefill']['ttft_ms']:.1f} ms ({ft['prefill']['ttft_vs_colocated']:.2f}x); "
                     f"gap from token 1 to 2: {ft['decode']['first_gap_ms']:.1f} -> "
                     f"{ft['prefill']['first_gap_ms']:.1f} ms ({ft['colocated_first_gap_ms']:.1f} colocated)")
    for k in gab:
        a, b = (statistics.median(r.ttft for r in tt[x]) for x in (dis, k))
        la, lb = (arrival_lag_ms(tt[x]) for x in (dis, k))
        lines.append(f"  send granularity A/B (two P on core 0, alternating, one D): TTFT median {args.granularity} "
                     f"{args.dispatch_default} (default) {a * 1000:.1f} ms, {k.removeprefix('disagg-')} {b * 1000:.1f} "
                     f"ms ({b / a:.2f}x); KV arrival lag {la:.1f} -> {lb:.1f} ms")
    waits = kv_waits(decode_log)
    if waits:
        lines.append(f"  D waited for the KV (connector log, all {len(waits)} transfers): median "
                     f"{statistics.median(waits):.1f} ms, max {max(waits):.1f} ms")
    lines.append(f"  one {args.bg_tokens}-token prompt (max_tokens {args.bg_max_tokens}), after warm-up: "
                 + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in res["long_lat"].items()))
    if res["short"]:
        lines += short_table(args, res["short"], colos[0], dis)
    lines.append("victims:")
    for interf in (False, True):
        for name in colos + [dis] + ([] if interf else [d_ref.name]):
            vs = res["victims"][(name, interf)]
            gaps = sum(len(r.gaps()) for r, _ in vs)
            toks = sum(r.chunk_tokens[-1] for r, _ in vs) / max(1, sum(len(r.chunk_times) for r, _ in vs))
            extra = ""
            if interf:
                arrivals, window = 0, 0.0
                for r, bg in vs:
                    t_a, t_b = r.chunk_times[0], r.chunk_times[-1]
                    arrivals += sum(1 for x in bg.sent if t_a <= x <= t_b)
                    window += t_b - t_a
                extra = (f"; {arrivals} long prompts arrived in {window:.1f}s of victim decode "
                         f"({arrivals / max(window, 1e-9):.2f}/s)")
            lines.append(f"  {name:>14}, {'long prompts' if interf else 'no load'}: {len(vs)} victims, "
                         f"{gaps} gaps, {toks:.2f} tokens/chunk, victim TTFT median "
                         f"{ms(statistics.median(r.ttft for r, _ in vs))} ms{extra}")
    lines.append("")
    lines += notes
    return lines


FIRST_TOKEN_SETUP = "disagg-first-token-other"  # the proxy with the other --first-token mode
FIRST_TOKEN_MODES = ("prefill", "decode")


def first_token_split(name: str, results: list[StreamResult], p_alone_ms: float) -> str:
    """TTFT with the first token from P: the proxy's queue, P's answer as the proxy saw it
    (against P hit straight), and the rest (client <-> proxy, the first event)."""
    med = statistics.median
    try:
        q = med(float(r.headers[XPYD_QUEUE_MS]) for r in results)
        pre = med(float(r.headers[XPYD_PREFILL_MS]) for r in results)
    except (KeyError, ValueError):
        return f"  {name}: no split (proxy timing headers absent)"
    total = med(r.ttft for r in results) * 1000
    return (f"  {name} TTFT {total:.1f} ms, first token from P (D's share falls after it), split (medians): "
            f"proxy queue {q:.1f} ms, P answers the prefill {pre:.1f} ms (P alone, hit straight: "
            f"{p_alone_ms:.1f} ms), the rest (client<->proxy, first event) {total - q - pre:.1f} ms")


def other_first_token(mode: str) -> str:
    return next(m for m in FIRST_TOKEN_MODES if m != mode)


def first_gap_ms(results: list) -> float:
    """Median gap from the first token's chunk to the next (ms); NaN without two chunks."""
    gaps = [r.gaps()[0] for r in results if r.gaps()]
    return statistics.median(gaps) * 1000 if gaps else math.nan


def first_token_ab(tt: dict, colo: str, dis: str, mode: str) -> dict:
    """TTFT and the first inter-token gap (P's token -> D's first), medians in ms, of the
    main proxy (--first-token ``mode``) and the one with the other mode, with their ratios
    to colocated."""
    med = statistics.median
    base = med(r.ttft for r in tt[colo])
    out = {m: {"ttft_ms": med(r.ttft for r in tt[name]) * 1000, "first_gap_ms": first_gap_ms(tt[name])}
           for m, name in ((mode, dis), (other_first_token(mode), FIRST_TOKEN_SETUP))}
    for v in out.values():
        v["ttft_vs_colocated"] = v["ttft_ms"] / (base * 1000)
    return {**out, "colocated_first_gap_ms": first_gap_ms(tt[colo])}


def short_table(args, short: dict, colo: str, dis: str) -> list[str]:
    """Short-prompt TTFT medians per length: colocated, the shipped defaults, always through
    P, always on D alone; ratios to colocated."""
    names = [dis, ALWAYS_P, ALWAYS_LOCAL]
    lines = ["", f"short prompts: TTFT median (ms), max_tokens 1, {args.short_n} per setup and length; "
             f"{dis} = shipped defaults (local_prefill_threshold {args.threshold_default}); ratio to {colo}"]
    hdr = ("condition", "tokens", colo, *names, *(f"/{n}" for n in names))
    rows = []
    for loaded in (False, True):
        for n_tok in args.short_lengths:
            v = {n: statistics.median(short[(n, n_tok, loaded)]) for n in [colo, *names]}
            rows.append(("long prompts arriving" if loaded else "idle", str(n_tok), *(ms(v[n]) for n in [colo, *names]),
                         *(f"{v[n] / v[colo]:.2f}x" for n in names)))
    w = [max(len(r[i]) for r in [*rows, hdr]) for i in range(len(hdr))]
    fmt = "  ".join(f"{{:<{x}}}" if i < 2 else f"{{:>{x}}}" for i, x in enumerate(w))
    lines += ["  " + fmt.format(*hdr), "  " + fmt.format(*("-" * x for x in w))]
    lines += ["  " + fmt.format(*r) for r in rows]
    lines.append("")
    return lines


def d_share_ms(results: list) -> float | None:
    """Median of the proxy's x-xpyd-decode-ttfb-ms (None when no answer had it: the first
    token came from P, so the headers went out before D answered)."""
    shares = [float(r.headers[XPYD_DECODE_TTFB_MS]) for r in results if XPYD_DECODE_TTFB_MS in r.headers]
    return statistics.median(shares) if shares else None


def _header_median(results: list[StreamResult], header: str) -> float | None:
    vals = [float(r.headers[header]) for r in results if header in r.headers]
    return statistics.median(vals) if vals else None


def _finite_all(d: dict[str, float] | None) -> dict[str, float | None] | None:
    return None if d is None else {k: _finite(v) for k, v in d.items()}


def summary(args, res: dict, colo: str, dis: str, p_alone: str) -> dict:
    """The shipped defaults' medians (ms) with their same-run colocated baselines, for --json."""
    med = statistics.median
    tt = res["ttft"]
    out: dict = {
        # p_alone: P hit straight (no proxy, no transfer), the disaggregated TTFT's floor.
        "ttft_1k_ms": {"colocated": med(r.ttft for r in tt[colo]) * 1000,
                       "disaggregated": med(r.ttft for r in tt[dis]) * 1000,
                       "p_alone": med(r.ttft for r in tt[p_alone]) * 1000},
        # D's share of TTFT: P answered -> D's first byte. None with the first token from P
        # (the default): D's share then falls between the first token and the second.
        "d_share_ms": d_share_ms(tt[dis]),
        # P's answer to the prefill request as the proxy timed it (x-xpyd-prefill-ms).
        "prefill_answer_ms": _header_median(tt[dis], XPYD_PREFILL_MS),
        "d_share_parts_ms": d_share_parts(tt[dis]),
        # The gap from the first token to the second (with the first token from P, D's share).
        "first_gap_ms": {"colocated": first_gap_ms(tt[colo]), "disaggregated": first_gap_ms(tt[dis])},
        "first_gap_parts_ms": _finite_all(first_gap_parts(tt[dis])),
        "ttft_tokens": sorted({r.prompt_tokens for r in tt[dis]}),
        "ttft_max_tokens": args.ttft_max_tokens,
        "defaults": {"dispatch": args.dispatch_default, "local_prefill_threshold": args.threshold_default,
                     "first_token": args.first_token},
    }
    short = res["short"]
    if short:
        n_short = 64 if 64 in args.short_lengths else args.short_lengths[0]
        out["ttft_short_ms"] = {"colocated": med(short[(colo, n_short, False)]) * 1000,
                                "disaggregated": med(short[(dis, n_short, False)]) * 1000,
                                "tokens": n_short}
        out["ttft_short_sweep_ms"] = {
            ("loaded" if loaded else "idle"): {
                str(n_tok): {k: med(short[(name, n_tok, loaded)]) * 1000
                             for k, name in (("colocated", colo), ("disaggregated", dis),
                                             ("always_prefill", ALWAYS_P), ("always_local", ALWAYS_LOCAL))}
                for n_tok in args.short_lengths}
            for loaded in (False, True)}
    for interf, key in ((False, "itl_p99_idle_ms"), (True, "itl_p99_loaded_ms")):
        out[key] = {k: pct([g for r, _ in res["victims"][(name, interf)] for g in r.gaps()], 99) * 1000
                    for k, name in (("colocated", colo), ("disaggregated", dis))}
    ab = next((k for k in tt if k in (f"disagg-{m}" for m in DISPATCH_MODES)), None)
    if ab:
        out["dispatch_ab"] = {
            args.dispatch_default: {"ttft_ms": out["ttft_1k_ms"]["disaggregated"], "d_share_ms": out["d_share_ms"],
                                    "first_gap_ms": first_gap_ms(tt[dis])},
            ab.removeprefix("disagg-"): {"ttft_ms": med(r.ttft for r in tt[ab]) * 1000,
                                         "d_share_ms": d_share_ms(tt[ab]), "first_gap_ms": first_gap_ms(tt[ab]),
                                         "d_share_parts_ms": d_share_parts(tt[ab])}}
    if FIRST_TOKEN_SETUP in tt:
        out["first_token_ab"] = first_token_ab(tt, colo, dis, args.first_token)
    gab = [k for k in tt if k.startswith(tuple(f"disagg-{g}" for g in GRANULARITIES))]
    if gab:  # keyed "granularity" (sequential dispatch) or "granularity-dispatch"
        out["granularity_ab"] = {
            g: {"ttft_ms": med(r.ttft for r in tt[k]) * 1000, "kv_arrival_lag_ms": _finite(arrival_lag_ms(tt[k])),
                "d_share_ms": d_share_ms(tt[k]), "d_share_parts_ms": parts}
            for g, k in [(args.granularity, dis)] + [(x.removeprefix("disagg-"), x) for x in gab]
            for parts in [d_share_parts(tt[k])]}
    return out


# What --runs compares run by run: (label, numerator, denominator), paths into each run's --json.
RUN_RATIOS = (
    ("TTFT, disaggregated / colocated", ("ttft_1k_ms", "disaggregated"), ("ttft_1k_ms", "colocated")),
    ("TTFT, disaggregated / P alone", ("ttft_1k_ms", "disaggregated"), ("ttft_1k_ms", "p_alone")),
    ("TTFT, P alone / colocated", ("ttft_1k_ms", "p_alone"), ("ttft_1k_ms", "colocated")),
    ("short-prompt TTFT, disaggregated / colocated", ("ttft_short_ms", "disaggregated"),
     ("ttft_short_ms", "colocated")),
    ("ITL p99 under long prompts, disaggregated / colocated", ("itl_p99_loaded_ms", "disaggregated"),
     ("itl_p99_loaded_ms", "colocated")),
    *((f"TTFT, first token A/B: from {w} / colocated", ("first_token_ab", m, "ttft_ms"), ("ttft_1k_ms", "colocated"))
      for w, m in (("P", "prefill"), ("D", "decode"))),
    *((f"TTFT, dispatch A/B: {m} / colocated", ("dispatch_ab", m, "ttft_ms"), ("ttft_1k_ms", "colocated"))
      for m in DISPATCH_MODES),
)
# The gap from token 1 to token 2 over colocated's, in ms (issue 39's goal: <= +2 ms), per setup.
RUN_GAPS = (
    ("this run's proxy (its --first-token)", ("first_gap_ms", "disaggregated")),
    ("first token A/B: from P", ("first_token_ab", "prefill", "first_gap_ms")),
    ("first token A/B: from D", ("first_token_ab", "decode", "first_gap_ms")),
    *((f"dispatch A/B: {m}", ("dispatch_ab", m, "first_gap_ms")) for m in DISPATCH_MODES),
)


def _at(data: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data if isinstance(data, int | float) else None


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without ``flags`` and their values (``--f v`` or ``--f=v``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def _medians(runs: list[dict]) -> dict:
    """Each number of the runs' JSON (nested dicts) as its median over the runs that have it."""
    out: dict = {}
    for key in dict.fromkeys(k for r in runs for k in r):
        vals = [r[key] for r in runs if key in r]
        if all(isinstance(v, dict) for v in vals):
            out[key] = _medians(vals)
        elif all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
            out[key] = statistics.median(vals)
    return out


def child_command(argv: list[str]) -> list[str]:
    """One run of --runs: this module by name from the repository root (run as a file, its
    directory, not the root, would head sys.path and ``tests.support`` would not import)."""
    return [sys.executable, "-m", "scripts.bench_e2e", *_without(argv, ("--runs", "--json", "--log-dir"))]


def run_many(args, argv: list[str]) -> int:
    """--runs N: this benchmark N times, each on freshly started servers, then each ratio's
    median and range over the runs. Two vLLM servers started alike can differ by several
    per cent for as long as they live (measured: 0.91-1.01x between twins on one core, one
    request each in turn), so one run's ratio carries its instances' luck."""
    child = child_command(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="xpyd-bench-runs-") as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}.json"
            print(f"=== run {i + 1} of {args.runs} (fresh servers)", flush=True)
            logs = ["--log-dir", str(Path(args.log_dir).resolve() / f"run{i + 1}")] if args.log_dir else []
            proc = subprocess.Popen([*child, "--json", str(out), *logs], cwd=ROOT)
            try:
                rc = proc.wait()
            except KeyboardInterrupt:  # Ctrl-C reached the child too; SIGTERM (below) did not
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.terminate()  # it stops its servers on SIGTERM
                    proc.wait(120)
                return 130
            if rc != 0:
                print(f"run {i + 1} failed (exit {rc})", file=sys.stderr)
                return rc
            runs.append(json.loads(out.read_text()))
    ratios: dict[str, dict] = {}
    print(f"\n=== {args.runs} runs, each ratio from one run's medians", flush=True)
    for label, num, den in RUN_RATIOS:
        per_run = [a / b for r in runs for a, b in [(_at(r, num), _at(r, den))] if a is not None and b]
        if not per_run:
            continue
        ratios[label] = {"per_run": per_run, "median": statistics.median(per_run)}
        print(f"  {label}: median {statistics.median(per_run):.3f}x, range {min(per_run):.3f}-"
              f"{max(per_run):.3f}x ({', '.join(f'{x:.3f}' for x in per_run)})", flush=True)
    for label, path in RUN_GAPS:
        per_run = [a - b for r in runs for a, b in [(_at(r, path), _at(r, ("first_gap_ms", "colocated")))]
                   if a is not None and b is not None]
        if per_run:
            print(f"  gap from token 1 to 2 over colocated's, {label}: median {statistics.median(per_run):+.1f} ms, "
                  f"range {min(per_run):+.1f} to {max(per_run):+.1f} ms", flush=True)
    if args.json:
        data = {**_medians(runs), "ratios": ratios, "runs": runs}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json} (medians over the runs; each run's own figures under 'runs')", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer samples (TTFT n<=8, <=2 shorter victims)")
    ap.add_argument("--model", choices=("bench", "tiny"), default="bench")
    ap.add_argument("--ttft-n", type=int, default=16, help="TTFT prompts per setup")
    ap.add_argument("--ttft-tokens", type=int, default=1024)
    ap.add_argument("--ttft-max-tokens", type=int, default=8,
                    help="tokens per TTFT request (more than 1: with the first token from P, a 1-token "
                         "answer is all P's and D is not asked)")
    ap.add_argument("--victims", type=int, default=4, help="victim requests per setup and condition")
    ap.add_argument("--victim-tokens", type=int, default=None,
                    help="default 256 (bench model), 1024 (tiny: decode steps are ~4x shorter); --quick halves it")
    ap.add_argument("--victim-prompt-tokens", type=int, default=64)
    ap.add_argument("--bg-tokens", type=int, default=1792, help="long prompt length (fits one 2048-token step)")
    ap.add_argument("--bg-max-tokens", type=int, default=1)
    ap.add_argument("--bg-concurrency", type=int, default=2, help="max long prompts in flight")
    ap.add_argument("--bg-interval", type=float, default=-1,
                    help="seconds between long-prompt arrivals (open loop); 0 = closed loop; "
                         "default: auto, the slowest setup's long-prompt latency / --bg-util")
    ap.add_argument("--bg-util", type=float, default=0.6,
                    help="auto interval: target busy fraction of the slowest setup")
    ap.add_argument("--bg-max-requests", type=int, default=60, help="cap per victim")
    ap.add_argument("--bg-lead", type=float, default=0.3, help="seconds of load before the victim starts")
    ap.add_argument("--pause", type=float, default=1.1,
                    help="seconds between measurements: vLLM's engine and worker spin-wait for 1 s "
                         "after each step, which would steal CPU from the next setup measured")
    ap.add_argument("--dispatch-ab", action="store_true",
                    help="a second proxy with the other --dispatch mode on the same P and D: TTFT both ways")
    ap.add_argument("--first-token", choices=FIRST_TOKEN_MODES, default=None,
                    help="the proxies' --first-token (default: the proxy's default); the dispatch and "
                         "send-granularity A/Bs measure D's share, which is on TTFT only with 'decode'")
    ap.add_argument("--first-token-ab", action="store_true",
                    help="a second proxy with the other --first-token mode on the same P and D")
    ap.add_argument("--short-lengths", default="64",
                    help="short-prompt TTFT at these prompt lengths (tokens, comma-separated; '' skips)")
    ap.add_argument("--short-sweep", action="store_true",
                    help="short prompts at 16,32,64,128,256,512 tokens (what --local-prefill-threshold is chosen by)")
    ap.add_argument("--short-n", type=int, default=8, help="short prompts per setup, length and condition")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="write the shipped defaults' medians and their colocated baselines (ms) to FILE")
    ap.add_argument("--no-omp2", action="store_true",
                    help="skip the second colocated baseline (2 OMP threads on cores 0,1)")
    ap.add_argument("--proxy-cpus", default=None, help="pin the proxy, e.g. 1 (default: unpinned)")
    ap.add_argument("--no-sync-load", action="store_true",
                    help="D loads every prompt's KV asynchronously (connector sync_load=false), for an A/B "
                         "against the default run")
    ap.add_argument("--send-granularity", choices=("request", "layer"), default=None,
                    help="P's connector send_granularity (default: the connector's own), for an A/B of "
                         "layer-wise sends against the default run")
    ap.add_argument("--no-byte-stream", action="store_true",
                    help="P and D keep KV on zmq (connector byte_stream false), to compare a run of each")
    ap.add_argument("--granularity-ab", action="store_true",
                    help="a second P with the other send_granularity (request, with the default auto), behind "
                         "a proxy of its own, sharing D: TTFT and KV arrival lag both ways in one run")
    ap.add_argument("--startup-timeout", type=float, default=480)
    ap.add_argument("--log-dir", default=None, help="default: a temp dir, removed after a clean run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=1,
                    help="repeat the whole benchmark on freshly started servers and report each ratio's "
                         "median and range over the runs (--json then holds the medians and every run)")
    args = ap.parse_args()
    if args.runs > 1:
        return run_many(args, sys.argv[1:])
    from connector.config import DEFAULT_SEND_GRANULARITY

    args.granularity = args.send_granularity or DEFAULT_SEND_GRANULARITY  # the main P's
    if args.victim_tokens is None:
        args.victim_tokens = (1024 if args.model == "tiny" else 256) // (2 if args.quick else 1)
    if args.quick:
        args.ttft_n, args.victims = min(args.ttft_n, 8), min(args.victims, 2)  # an explicit smaller count stands
    args.short_lengths = ([16, 32, 64, 128, 256, 512] if args.short_sweep
                          else [int(x) for x in args.short_lengths.split(",") if x.strip()])
    from proxy.config import ProxyConfig  # the shipped defaults, as the main proxy runs them

    shipped = ProxyConfig()  # a slots dataclass: its class attributes are descriptors
    args.dispatch_default = shipped.dispatch
    args.threshold_default = shipped.local_prefill_threshold
    args.first_token = args.first_token or shipped.first_token
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT)] + sys.argv)

    facts = machine_facts()
    print("$ " + cmd, flush=True)
    print(facts[0], flush=True)
    if (os.cpu_count() or 0) < 2:
        print("needs at least 2 CPUs (P and D on separate cores)", file=sys.stderr)
        return 2

    def on_term(signum, frame):  # stop the servers on SIGTERM too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="xpyd-bench-e2e-"))
    servers: list[cluster.Server] = []
    ok = False
    try:
        t0 = time.monotonic()
        model = ensure_model(args.model)
        prompts = Prompts(model, args.seed)
        mcfg = json.loads((model / "config.json").read_text())
        disc = cluster.free_port()
        # The main proxy runs the shipped defaults; the others (same P and D, registered
        # with every proxy) change one setting each.
        mode = ["--first-token", args.first_token]  # every proxy but the first-token A/B's
        proxy = cluster.start_proxy(cluster.free_port(), disc, log_dir, mode)
        servers.append(proxy)
        proxies: list[cluster.Server] = [proxy]
        reg: dict[str, object] = {"proxies": []}
        others: dict[str, list[str]] = {}
        if args.dispatch_ab:
            other = next(m for m in DISPATCH_MODES if m != args.dispatch_default)
            others[f"disagg-{other}"] = ["--dispatch", other, *mode]
        if args.first_token_ab:
            others[FIRST_TOKEN_SETUP] = ["--first-token", other_first_token(args.first_token)]
        if args.short_lengths:
            others[ALWAYS_P] = ["--local-prefill-threshold", "0", *mode]
            others[ALWAYS_LOCAL] = ["--local-prefill-threshold", str(10**9), *mode]
        for name, flags in others.items():
            d = cluster.free_port()
            proxies.append(cluster.start_proxy(cluster.free_port(), d, log_dir, flags, name=f"proxy-{name}"))
            servers.append(proxies[-1])
            reg["proxies"].append(f"{cluster.HOST}:{d}")
        # --granularity-ab: a P with the other send_granularity registers with a proxy of its own
        # only (D registers with every proxy), so that proxy's requests take that P.
        # With --dispatch-ab that P gets a second proxy, with the other dispatch mode.
        gran: str | None = None  # the second P's send_granularity
        gab: list[tuple[str, int, cluster.Server]] = []  # its proxies: (setup name, discovery port, proxy)
        if args.granularity_ab:
            gran = next(g for g in GRANULARITIES if g != args.granularity)
            variants = {f"disagg-{gran}": mode}
            if args.dispatch_ab:
                other = next(m for m in DISPATCH_MODES if m != args.dispatch_default)
                variants[f"disagg-{gran}-{other}"] = ["--dispatch", other, *mode]
            for name, flags in variants.items():
                d = cluster.free_port()
                gab.append((name, d, cluster.start_proxy(cluster.free_port(), d, log_dir, flags, name=f"proxy-{name}")))
                proxies.append(gab[-1][2])
                servers.append(gab[-1][2])
        common = {"model": model, "log_dir": log_dir}
        zmq_only = {"byte_stream": False} if args.no_byte_stream else {}
        # VLLM_CPU_OMP_THREADS_BIND is explicit everywhere. Note "a|b" means one list per
        # rank: start_vllm's default for cpus="0,1" is "0|1", which gives rank 0 core 0 only.
        # colocated-1omp: what vLLM's own "auto" binding picks on this 2-core box (one OMP
        # thread, the other core left to the API server and scheduler), all of its
        # processes allowed on both cores.
        colos = [cluster.start_vllm("colocated-1omp", cluster.free_port(), cpus="0,1",
                                    env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, **common)]
        if not args.no_omp2:  # both cores for the OMP threads
            colos.append(cluster.start_vllm("colocated-2omp", cluster.free_port(), cpus="0,1",
                                            env={"VLLM_CPU_OMP_THREADS_BIND": "0,1"}, **common))
        servers += colos
        p_port, d_port = cluster.free_port(), cluster.free_port()
        prefill = cluster.start_vllm(
            "prefill", p_port, cpus="0", env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
            kv_config=cluster.kv_transfer_config("kv_producer", cluster.free_port_pair(), p_port, disc, **reg,
                                                 **({"send_granularity": args.send_granularity}
                                                    if args.send_granularity else {}), **zmq_only),
            **common)
        servers.append(prefill)
        prefills = [prefill]
        d_reg = reg
        if gab:
            p2_port = cluster.free_port()
            prefills.append(cluster.start_vllm(
                f"prefill-{gran}", p2_port, cpus="0", env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
                kv_config=cluster.kv_transfer_config("kv_producer", cluster.free_port_pair(), p2_port, gab[0][1],
                                                     proxies=[f"{cluster.HOST}:{d}" for _, d, _ in gab[1:]],
                                                     send_granularity=gran, **zmq_only), **common))
            servers.append(prefills[-1])
            d_reg = {"proxies": [*reg["proxies"], *(f"{cluster.HOST}:{d}" for _, d, _ in gab)]}
        decode = cluster.start_vllm(
            "decode", d_port, cpus="1", env={"VLLM_CPU_OMP_THREADS_BIND": "1"},
            kv_config=cluster.kv_transfer_config("kv_consumer", cluster.free_port_pair(), d_port, disc, **d_reg,
                                                 **({"sync_load": False} if args.no_sync_load else {}), **zmq_only),
            **common)
        servers.append(decode)
        proxy_where = f"cores {args.proxy_cpus}" if args.proxy_cpus else "unpinned"
        print(f"starting {', '.join(c.name for c in colos)} (cores 0,1), prefill (core 0), decode (core 1), "
              f"proxy ({proxy_where}); model {model.name}; logs in {log_dir} ...", flush=True)
        cluster.wait_until(proxies, "/health", 60)
        if args.proxy_cpus:
            pin_process_tree(proxy.proc.pid, {int(c) for c in args.proxy_cpus.split(",")})
        cluster.wait_until(colos + prefills + [decode], "/health", args.startup_timeout)
        deadline = time.monotonic() + 60
        while any(cluster.http_get(px.url + "/ready")[0] != 200 for px in proxies):
            if time.monotonic() > deadline:
                raise TimeoutError("proxy never saw P and D register")
            time.sleep(0.3)
        print(f"  servers up ({time.monotonic() - t0:.0f}s)", flush=True)
        binds = []
        for s in colos + prefills + [decode]:
            line = next((ln for ln in s.log().splitlines() if "local_rank=0, core ids=" in ln), "?")
            binds.append(f"{s.name} {line.split('local_rank=0, ')[-1].strip()}")
        setups = [Setup(c.name, c.url) for c in colos] + [Setup("disaggregated", proxy.url)]
        p_ref, d_ref = Setup("P alone", prefill.url), Setup("D alone", decode.url)
        meter = CpuMeter([srv.proc.pid for srv in servers])
        by_name = {f"proxy-{n}": px.url for n, px in zip(others, proxies[1:1 + len(others)], strict=True)}
        extra = [Setup(n, by_name[f"proxy-{n}"]) for n in others if n.startswith("disagg-")]
        extra += [Setup(name, px.url) for name, _, px in gab]
        short_group = ([setups[-1], Setup(ALWAYS_P, by_name[f"proxy-{ALWAYS_P}"]),
                        Setup(ALWAYS_LOCAL, by_name[f"proxy-{ALWAYS_LOCAL}"])] if args.short_lengths else [])
        probe = DecodeProbe(decode.url, decode.log_path, [p.log_path for p in prefills])
        res = asyncio.run(bench(args, setups, p_ref, d_ref, prompts, extra, short_group, probe))
        cpu_line = meter.report()
        notes = facts + [
            f"model {model.name}: Llama, hidden {mcfg['hidden_size']}, {mcfg['num_hidden_layers']} layers, "
            f"{mcfg['num_attention_heads']} heads / {mcfg['num_key_value_heads']} KV heads, "
            f"intermediate {mcfg['intermediate_size']}, vocab {mcfg['vocab_size']}; bf16, --enforce-eager, "
            "default max-num-batched-tokens (2048 on CPU), prefix caching on",
            "OMP threads (from the logs): " + "; ".join(binds)
            + f"; all colocated processes on cores 0,1; proxy {proxy_where}; load generator unpinned",
            f"connector: P send_granularity {args.granularity}"
            + (f" (a second P on core 0: {gran})" if gran else "")
            + (", KV over zmq alone (byte_stream false)" if args.no_byte_stream else "") + ", D sync_load "
            f"{'false' if args.no_sync_load else 'default'}",
            f"TTFT: {args.ttft_n} distinct prompts, the same text to each setup, rotating order, "
            f"max_tokens {args.ttft_max_tokens}, time to the first SSE chunk with a token",
            f"ITL: {args.victims} victims per setup/condition, {args.victim_prompt_tokens}-token prompt, "
            f"{args.victim_tokens} tokens (ignore_eos), gaps between successive SSE chunks; load = "
            f"{args.bg_tokens}-token prompts, max_tokens {args.bg_max_tokens}, "
            + (f"one every {args.bg_interval}s (open loop, <= {args.bg_concurrency} in flight)"
               if args.bg_interval > 0 else f"{args.bg_concurrency} back to back (closed loop)")
            + ", to the colocated server / through the proxy",
            (f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
             f"total {time.monotonic() - t0:.0f}s; {cpu_line}"),
        ]
        print(flush=True)
        for line in report(args, res, setups, p_ref, d_ref, decode.log(), notes):
            print(line, flush=True)
        if args.json:
            data = summary(args, res, setups[0].name, setups[-1].name, p_ref.name)
            data["machine"] = facts[0]
            data["command"] = cmd
            Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
            print(f"wrote {args.json}", flush=True)
        ok = True
        return 0
    except KeyboardInterrupt:
        print(f"interrupted; stopping servers (logs in {log_dir})", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - reported; the servers are stopped below
        print(f"bench failed: {type(e).__name__}: {e}\nlogs kept in {log_dir}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        cluster.stop_all(servers)
        if ok and not args.log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Traffic benchmark with a frozen decode instance: proxy + 1 P + 2 D (vLLM CPU build).

Sends --requests streaming completions (default 200) at --concurrency (default 8) through
the proxy: a seeded mix of ~70 % single prompts and ~30 % batch prompts ("prompt": [A, B]),
each prompt 200-700 tokens of varied words, distinct per request (no prefix-cache hits),
max_tokens 16, temperature 0. After --freeze-after requests have started, one D's whole
process group is SIGSTOPped for --freeze-s seconds (SIGCONT always follows). Reports TTFT
p50/p99 (time to the first SSE chunk carrying text) overall and for single vs batch requests
(for batch also until both prompts have had text), client errors, and from the servers'
logs how many KV loads succeeded, waited > 1 s or failed.

    .venv/bin/python -m scripts.bench_traffic                        # 200 requests, c=8, D frozen 10 s
    .venv/bin/python -m scripts.bench_traffic --requests 24 --concurrency 4 --freeze-s 3   # smoke
    .venv/bin/python -m scripts.bench_traffic --bind nobind --json out.json --label "nobind"

All servers on 127.0.0.1 with free ports (tests/support/cluster.py), logs kept in a temp dir; every
process started here is stopped by its process group at the end, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from xpyd_wire.headers import XPYD_DECODE_INSTANCE

ROOT = Path(__file__).resolve().parent.parent

from scripts.bench_e2e import Prompts, pct  # noqa: E402  (exact-length distinct prompts; nearest-rank percentile)
from tests.support import cluster  # noqa: E402  (tests/support/cluster.py)

# What the connector logs (connector/p2p/engine.py); adjust here if the messages change.
LOAD_OK_RE = re.compile(r"kv loaded .* wait_ms=([0-9.]+)")  # on D, one per successful load
LOAD_FAIL_RE = re.compile(r"kv load failed|kv load timed out")  # on D
SEND_FAIL_RE = re.compile(r"kv send failed")  # on P
SLOW_LOAD_MS = 1000.0


@dataclass
class Result:
    kind: str  # "single" | "batch"
    ttft: float | None = None  # seconds, first text of any prompt
    ttft_last: float | None = None  # seconds, until every prompt of the request has had text
    error: str | None = "not finished"
    decode: str = "?"  # x-xpyd-decode-instance


def make_requests(args: argparse.Namespace) -> list[tuple[str, dict]]:
    rng = random.Random(args.seed)
    prompts = Prompts(args.model, args.seed)
    out = []
    for _ in range(args.requests):
        kind = "batch" if rng.random() < args.batch_fraction else "single"
        texts = [prompts.make(rng.randint(200, 700)) for _ in range(2 if kind == "batch" else 1)]
        body = {"model": "tiny-llama", "prompt": texts if kind == "batch" else texts[0],
                "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        out.append((kind, body))
    return out


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, res: Result, timeout: float) -> None:
    t0 = time.perf_counter()
    n_prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
    seen: set[int] = set()  # choice indices that have had text
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                res.decode = r.headers.get(XPYD_DECODE_INSTANCE, "?")
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = f"error event: {str(chunk['error'])[:200]}"
                        return
                    seen.update(c.get("index", 0) for c in chunk.get("choices") or [] if c.get("text"))
                    if seen and res.ttft is None:
                        res.ttft = time.perf_counter() - t0
                    if len(seen) == n_prompts and res.ttft_last is None:
                        res.ttft_last = time.perf_counter() - t0
        res.error = None if res.ttft is not None else "no text chunk"
    except TimeoutError:
        res.error = f"client timeout ({timeout:.0f}s)"
    except Exception as e:  # noqa: BLE001 - resets, protocol errors...: counted, not raised
        res.error = f"{type(e).__name__}: {e}"[:200]


async def freeze(d: cluster.Server, seconds: float, marks: dict[str, float]) -> None:
    """SIGSTOP d's whole process group for `seconds`; SIGCONT in any case."""
    os.killpg(d.proc.pid, signal.SIGSTOP)
    marks["freeze_start"] = time.monotonic()
    try:
        await asyncio.sleep(seconds)
    finally:
        os.killpg(d.proc.pid, signal.SIGCONT)
        marks["freeze_end"] = time.monotonic()


async def run_load(args: argparse.Namespace, url: str, reqs: list[tuple[str, dict]], frozen: cluster.Server,
                   marks: dict[str, float]) -> list[Result]:
    results = [Result(kind) for kind, _ in reqs]
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 2, max_keepalive_connections=args.concurrency + 2)

    async def one(body: dict, res: Result) -> None:
        try:
            await stream_one(client, url, body, res, args.request_timeout)
        finally:
            sem.release()

    tasks: list[asyncio.Task] = []
    freezer: asyncio.Task | None = None
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        try:
            async with asyncio.timeout(args.deadline):
                for i, ((_, body), res) in enumerate(zip(reqs, results, strict=True)):
                    await sem.acquire()
                    if i == args.freeze_after and args.freeze_s > 0:
                        freezer = asyncio.create_task(freeze(frozen, args.freeze_s, marks))
                        await asyncio.sleep(0)  # let the SIGSTOP happen before the next request starts
                    tasks.append(asyncio.create_task(one(body, res)))
                await asyncio.gather(*tasks)
                if freezer is not None:
                    await freezer
        except TimeoutError:
            print(f"overall deadline ({args.deadline:.0f}s) reached; unfinished requests count as errors",
                  file=sys.stderr)
        finally:
            for t in [*tasks, *([freezer] if freezer else [])]:
                t.cancel()
            await asyncio.gather(*tasks, *([freezer] if freezer else []), return_exceptions=True)
    return results


def summarize(args: argparse.Namespace, results: list[Result], p: cluster.Server, ds: list[cluster.Server],
              wall: float, marks: dict[str, float]) -> dict:
    def ttft(kind: str | None, attr: str = "ttft") -> dict:
        xs = [getattr(r, attr) * 1000 for r in results
              if r.error is None and getattr(r, attr) is not None and kind in (None, r.kind)]
        return {"n": len(xs), "p50_ms": pct(xs, 50) if xs else None, "p99_ms": pct(xs, 99) if xs else None}

    waits = [float(m.group(1)) for d in ds for m in LOAD_OK_RE.finditer(d.log())]
    names = {d.url.removeprefix("http://"): d.name for d in ds}
    frozen_s = marks.get("freeze_end", 0) - marks.get("freeze_start", 0)
    return {
        "label": args.label, "bind": args.bind, "requests": len(results),
        "single": sum(r.kind == "single" for r in results), "batch": sum(r.kind == "batch" for r in results),
        "concurrency": args.concurrency, "errors": sum(r.error is not None for r in results),
        "ttft_all": ttft(None), "ttft_single": ttft("single"), "ttft_batch": ttft("batch"),
        "ttft_batch_last": ttft("batch", "ttft_last"),
        "loads_ok": len(waits), "loads_waited_gt_1s": sum(w > SLOW_LOAD_MS for w in waits),
        "loads_max_wait_ms": max(waits, default=0.0),
        "loads_failed": sum(len(LOAD_FAIL_RE.findall(d.log())) for d in ds),
        "sends_failed": len(SEND_FAIL_RE.findall(p.log())),
        "per_decode": dict(Counter(names.get(r.decode, r.decode) for r in results)),
        "frozen": ds[-1].name if frozen_s else None, "frozen_s": round(frozen_s, 2),
        "wall_s": round(wall, 1),
        "error_samples": [f"{n}x {e}" for e, n in Counter(r.error for r in results if r.error).most_common(5)],
    }


def table(s: dict) -> str:
    def t(k: str) -> str:
        v = s[k]
        return f"{v['p50_ms']:.1f} / {v['p99_ms']:.1f}  (n={v['n']})" if v["n"] else "n/a (n=0)"

    rows = [
        ("requests (single / batch)", f"{s['requests']} ({s['single']} / {s['batch']}), c={s['concurrency']}"),
        ("errors", str(s["errors"])),
        ("TTFT p50 / p99 ms, all", t("ttft_all")),
        ("TTFT p50 / p99 ms, single", t("ttft_single")),
        ("TTFT p50 / p99 ms, batch", t("ttft_batch")),
        ("  batch, until both prompts", t("ttft_batch_last")),
        ("KV loads ok", f"{s['loads_ok']} (max wait {s['loads_max_wait_ms']:.0f} ms)"),
        ("KV loads waited > 1 s", str(s["loads_waited_gt_1s"])),
        ("KV loads failed", str(s["loads_failed"])),
        ("P sends failed", str(s["sends_failed"])),
        ("requests per D", ", ".join(f"{k} {v}" for k, v in sorted(s["per_decode"].items()))
         + (f"  ({s['frozen']} frozen {s['frozen_s']:.1f} s)" if s["frozen"] else "  (no freeze)")),
        ("wall time s", f"{s['wall_s']:.1f}"),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"bench_traffic: {s['label'] or '-'} (bind {s['bind']})", "-" * (w + 40)]
    lines += [f"{k:<{w}}  {v}" for k, v in rows]
    lines += [f"  error: {e}" for e in s["error_samples"]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--batch-fraction", type=float, default=0.3, help="share of batch ([A, B]) requests")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--freeze-after", type=int, default=None, help="requests started before the freeze "
                    "(default: a quarter of --requests)")
    ap.add_argument("--freeze-s", type=float, default=10.0, help="seconds one D is SIGSTOPped; 0 = no fault")
    ap.add_argument("--bind", choices=("auto", "nobind"), default="auto",
                    help="VLLM_CPU_OMP_THREADS_BIND for every vLLM server (auto = vLLM's default)")
    ap.add_argument("--kv-load-timeout-s", type=float, default=10.0)
    ap.add_argument("--send-timeout-s", type=float, default=5.0)
    ap.add_argument("--connector-option", action="append", default=[], metavar="KEY=VALUE",
                    help="extra kv_connector_extra_config entry for every instance (JSON value), "
                         "e.g. thread_affinity=\"off\"")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="client deadline per request")
    ap.add_argument("--deadline", type=float, default=1800.0, help="overall deadline of the load phase")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--model", type=Path, default=cluster.DEFAULT_MODEL)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()
    if args.freeze_after is None:
        args.freeze_after = args.requests // 4
    if not (args.model / "config.json").exists():
        print(f"no model at {args.model} (scripts/setup.sh makes the tiny one)", file=sys.stderr)
        return 2

    def on_term(signum: int, frame: object) -> None:  # stop the servers on SIGTERM too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    log_dir = Path(tempfile.mkdtemp(prefix="xpyd-bench-traffic-"))
    print(f"logs in {log_dir}", flush=True)
    servers: list[cluster.Server] = []
    ds: list[cluster.Server] = []
    try:
        reqs = make_requests(args)
        disc = cluster.free_port()
        # --expose-routing-headers: which D answered is read from x-xpyd-decode-instance.
        proxy = cluster.start_proxy(cluster.free_port(), disc, log_dir,
                                    ["--heartbeat-timeout", "5", "--expose-routing-headers"])
        servers.append(proxy)
        timeouts = {"kv_load_timeout_s": args.kv_load_timeout_s, "send_timeout_s": args.send_timeout_s}
        for opt in args.connector_option:
            key, _, value = opt.partition("=")
            timeouts[key] = json.loads(value)
        common = {"log_dir": log_dir, "model": args.model, "max_num_batched_tokens": 256,
                  "env": {"VLLM_CPU_OMP_THREADS_BIND": args.bind}}  # explicit: older cluster.py defaults to nobind
        for name, role in (("prefill", "kv_producer"), ("decode1", "kv_consumer"), ("decode2", "kv_consumer")):
            port = cluster.free_port()
            kv = cluster.kv_transfer_config(role, cluster.free_port_pair(), port, disc, **timeouts)
            servers.append(cluster.start_vllm(name, port, kv_config=kv, **common))
        p, ds = servers[1], servers[2:]
        t0 = time.monotonic()
        cluster.wait_until([proxy], "/health", 60)
        cluster.wait_until([p, *ds], "/health", args.startup_timeout)
        deadline = time.monotonic() + 60
        while True:  # /ready, and both Ds registered
            st, body = cluster.http_get(proxy.url + "/instances")
            if cluster.http_get(proxy.url + "/ready")[0] == 200 and st == 200 \
                    and sum(i.get("role") == "D" and not i.get("pending") for i in json.loads(body)) == 2:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("proxy never saw P and both Ds register")
            time.sleep(0.5)
        print(f"servers up ({time.monotonic() - t0:.0f}s); {len(reqs)} requests at c={args.concurrency}, "
              f"{ds[-1].name} frozen {args.freeze_s:g}s after {args.freeze_after} started", flush=True)
        marks: dict[str, float] = {}
        t1 = time.monotonic()
        results = asyncio.run(run_load(args, proxy.url, reqs, ds[-1], marks))
        s = summarize(args, results, p, ds, time.monotonic() - t1, marks)
        s["log_dir"] = str(log_dir)
        print("\n" + table(s), flush=True)
        if args.json:
            args.json.write_text(json.dumps(s, indent=2) + "\n")
        return 0
    except KeyboardInterrupt:
        print(f"interrupted; stopping servers (logs in {log_dir})", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - reported; the servers are stopped below
        print(f"bench failed: {type(e).__name__}: {e}\nlogs in {log_dir}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for d in ds:  # a stopped group would ignore SIGTERM
            try:
                os.killpg(d.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for srv in reversed(servers):
            try:
                srv.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"stopping {srv.name}: {e}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

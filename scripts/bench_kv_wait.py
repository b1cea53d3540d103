#!/usr/bin/env python3
"""What a request waiting for remote KV costs the machine it runs on.

While D holds a request whose KV has not come (concurrent dispatch, a slow P, a lost
transfer), vLLM's engine loop runs steps that compute nothing, back to back: it blocks only
when it has no request at all. This benchmark measures what that costs, per D configuration
given (``--variants``: a JSON list of kv_connector_extra_config additions for D):

* the latency of a plain prefill on P (max_tokens=1) on the same cores: with D idle (the
  baseline, measured in the same run); the first one right after D began waiting
  (``--first-repeats`` times; with vLLM's behaviour it may wait for most of D's KV wait); and
  later in a wait, as ratios to the baseline;
* D's CPU use (all of D's processes, in cores) while one request waits for KV that never
  comes (its prefill address is dead; it waits until D's kv_load_timeout_s).

Both servers run under vLLM's default CPU thread binding (what users get; on a 2-core box
both bind their OpenMP threads to the same cores), 127.0.0.1 only. P stays up; D is
restarted per variant. Every process started here is stopped by its process group.

    .venv/bin/python -m scripts.bench_kv_wait --model tiny --tokens 288 --samples 7
    .venv/bin/python -m scripts.bench_kv_wait --variants '[{"idle_wait_ms": 0}, {"idle_wait_ms": 20}]'

The default variants are vLLM's behaviour (``idle_wait_ms: 0``) and the connector's default.
Results on a 2-core EPYC are in the README (*Concurrent dispatch*).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from scripts import bench_e2e  # noqa: E402  (scripts/bench_e2e.py: the bench model and its prompts)
from tests.support import cluster  # noqa: E402
from xpyd_wire import request_id  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in a process group."""
    return sum(int(f[11]) + int(f[12]) for _, f in cluster.proc_stats() if int(f[2]) == pgid) / CLK


def post(url: str, body: dict, headers: dict[str, str] | None = None, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (loopback)
        return json.loads(r.read())


def prefill_ms(p: cluster.Server, prompts: bench_e2e.Prompts, tokens: int) -> float:
    body = bench_e2e.completion_body(prompts.make(tokens), 1, stream=False)
    t0 = time.perf_counter()
    post(p.url, body)
    return (time.perf_counter() - t0) * 1e3


def wait_on_d(d: cluster.Server, prompts: bench_e2e.Prompts, timeout_s: float) -> threading.Thread:
    """A request on D whose KV never comes (its prefill address is dead): D waits for it
    until its kv_load_timeout_s, then recomputes."""
    rid = request_id.build(f"{cluster.HOST}:{cluster.free_port()}", f"{cluster.HOST}:{d.kv_port}")
    body = bench_e2e.completion_body(prompts.make(200), 2, stream=False)
    waiter = threading.Thread(target=lambda: post(d.url, body, {"X-Request-Id": rid}, timeout=timeout_s + 60),
                              daemon=True)
    waiter.start()
    return waiter


def measure(p: cluster.Server, d: cluster.Server, prompts: bench_e2e.Prompts, args: argparse.Namespace) -> dict:
    """P's prefill with D idle; P's first prefill right after D began waiting for KV (the
    stall: it may last until D's wait ends); then D's CPU and P's prefills in a longer wait."""
    idle = [prefill_ms(p, prompts, args.tokens) for _ in range(args.samples)]
    first = []
    for _ in range(args.first_repeats):
        waiter = wait_on_d(d, prompts, args.load_timeout_s)
        time.sleep(args.settle_s)
        first.append(prefill_ms(p, prompts, args.tokens))
        waiter.join(timeout=args.load_timeout_s + 60)
    waiter = wait_on_d(d, prompts, args.load_timeout_s)
    time.sleep(1.0)
    c0, t0 = group_cpu_s(d.proc.pid), time.monotonic()
    time.sleep(args.window_s)
    d_cores = (group_cpu_s(d.proc.pid) - c0) / (time.monotonic() - t0)
    busy = [prefill_ms(p, prompts, args.tokens) for _ in range(args.samples)]
    waiter.join(timeout=args.load_timeout_s + 60)
    return {"d_cores_while_waiting": round(d_cores, 3),
            "p_prefill_ms_d_idle": round(statistics.median(idle), 1),
            "p_first_prefill_ms_d_starts_waiting": [round(x, 1) for x in first],
            "p_prefill_ms_d_waiting": round(statistics.median(busy), 1),
            "first_ratio": round(statistics.median(first) / statistics.median(idle), 3),
            "ratio": round(statistics.median(busy) / statistics.median(idle), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default='[{"idle_wait_ms": 0}, {}]',
                    help="JSON list of kv_connector_extra_config additions for D, one D per entry")
    ap.add_argument("--samples", type=int, default=5, help="P prefills per condition (median)")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length of P's prefills")
    ap.add_argument("--window-s", type=float, default=3.0, help="how long D's CPU is sampled while it waits")
    ap.add_argument("--settle-s", type=float, default=0.3, help="from D's request to P's first prefill")
    ap.add_argument("--first-repeats", type=int, default=3, help="D waits (and P's first prefills) for the stall")
    ap.add_argument("--load-timeout-s", type=float, default=10.0,
                    help="D's kv_load_timeout_s: the longest the stall can last")
    ap.add_argument("--model", choices=("bench", "tiny"), default="bench")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    variants: list[dict] = json.loads(args.variants)
    model = bench_e2e.ensure_model(args.model)
    prompts = bench_e2e.Prompts(model, seed=7)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-kv-wait-"))
    unbound = {"VLLM_CPU_OMP_THREADS_BIND": None}  # vLLM's default binding
    started: list[cluster.Server] = []
    results: list[dict] = []  # one per variant, in order (a variant may repeat)
    try:
        p_port = cluster.free_port()
        p = cluster.start_vllm("prefill", p_port, log_dir, model=model, env=unbound, kv_config=cluster.kv_transfer_config(
            "kv_producer", cluster.free_port_pair(), p_port, None))
        started.append(p)
        for i, extra in enumerate(variants):
            name = json.dumps(extra, sort_keys=True)
            d_port = cluster.free_port()
            d = cluster.start_vllm(f"decode-{i}", d_port, log_dir, model=model, env=unbound,
                                   kv_config=cluster.kv_transfer_config(
                                       "kv_consumer", cluster.free_port_pair(), d_port, None,
                                       **{"kv_load_timeout_s": args.load_timeout_s, **extra}))
            started.append(d)
            cluster.wait_until([p, d], "/health", 600)
            prefill_ms(p, prompts, args.tokens)  # warm-up
            r = measure(p, d, prompts, args)
            results.append({"d_config": extra, **r})
            print(f"D {name}: P's {args.tokens}-token prefill {r['p_prefill_ms_d_idle']:.1f} ms with D idle; "
                  f"right after D began waiting {r['p_first_prefill_ms_d_starts_waiting']} ms "
                  f"({r['first_ratio']:.2f}x); later in the wait {r['p_prefill_ms_d_waiting']:.1f} ms "
                  f"({r['ratio']:.2f}x), D using {r['d_cores_while_waiting']:.2f} cores", flush=True)
            d.stop()
            started.remove(d)
    finally:
        for s in started:
            s.stop()
    out = {"results": results, "tokens": args.tokens, "samples": args.samples,
           "cpus": os.cpu_count(), "command": " ".join(sys.argv), "logs": str(log_dir)}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

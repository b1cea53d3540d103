"""What one vLLM server (CPU build) spends on a request's first step when all but its last
token are already in the KV cache: D's situation after a KV load with the first token from P.

With the first token from P, the gap between the client's first and second token is D's
share: HTTP into D, vLLM's frontend, one engine step that computes P's token over the loaded
prompt, and the way back. This benchmark takes the connector, the proxy and P out: one
server, pinned to one core like D in `bench_e2e.py`, whose own prefix cache holds the
prompt. Per sample, a prompt A (a multiple of the block size) is prefilled once; then A plus
one token is sent with max_tokens 2 and streamed: vLLM finds A in its cache and computes one
token (its "prefill" in /metrics), then decodes one more (its "decode"). Reported, medians
(ms): the 1-token step over the cached prompt, the decode step after it, and the client's gap
from token 1 to token 2 (a decode step and the way back: what a colocated server's client
sees between those tokens). The 1-token step against the decode step is the part of
`bench_e2e`'s first-token gap that neither the proxy nor the connector adds.

    .venv/bin/python -m scripts.bench_first_step --tokens 1024 3968 --samples 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from scripts.bench_e2e import ensure_model, histogram_sums
from tests.support import cluster

HISTOGRAMS = {"prefill": "vllm:request_prefill_time_seconds", "decode": "vllm:request_decode_time_seconds",
              "queue": "vllm:request_queue_time_seconds"}
BLOCK = 128  # vLLM's CPU block size: a prompt of whole blocks is cached whole


def histograms(client: httpx.Client, url: str) -> dict[str, float]:
    """Each histogram's sum (s) on the server now."""
    return {k: total for k, (total, _) in histogram_sums(client.get(url + "/metrics", timeout=10).text,
                                                           HISTOGRAMS).items()}


def one_sample(client: httpx.Client, url: str, prompt: list[int], extra: int) -> dict[str, float]:
    """Prefill ``prompt``, then stream ``prompt + [extra]`` for 2 tokens: timings (ms)."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    client.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()
    time.sleep(0.3)  # the first request's stats recorded; the engine idle as D is before a load
    h0 = histograms(client, url)
    stamps: list[float] = []
    t0 = time.perf_counter()
    body = {**body, "prompt": [*prompt, extra], "max_tokens": 2, "ignore_eos": True, "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                stamps.append(time.perf_counter())
    for _ in range(40):  # the frontend records a request's stats after its last output
        h1 = histograms(client, url)
        if h1["decode"] > h0["decode"]:
            break
        time.sleep(0.05)
    if len(stamps) != 2:
        raise RuntimeError(f"expected 2 token events, got {len(stamps)}")
    return {"ttft": (stamps[0] - t0) * 1e3, "gap12": (stamps[1] - stamps[0]) * 1e3,
            **{k: (h1[k] - h0[k]) * 1e3 for k in HISTOGRAMS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 3968],
                    help=f"cached prompt lengths (rounded down to {BLOCK}-token blocks)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--model", choices=["bench", "tiny"], default="bench")
    ap.add_argument("--cpus", default="1", help="the core(s) the server is pinned to (D's in bench_e2e)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = ensure_model(args.model)
    rng = random.Random(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="xpyd-bench-first-step-"))
    server = cluster.start_vllm("server", cluster.free_port(), log_dir, model=model, cpus=args.cpus,
                                env={"VLLM_CPU_OMP_THREADS_BIND": args.cpus})
    results: dict[int, dict[str, float]] = {}
    try:
        cluster.wait_until([server], "/health", 600)
        with httpx.Client() as client:
            one_sample(client, server.url, [rng.randrange(1, 1000) for _ in range(BLOCK)], 7)  # warm-up
            for n in args.tokens:
                n = max(BLOCK, n // BLOCK * BLOCK)
                rows = [one_sample(client, server.url, [rng.randrange(1, 1000) for _ in range(n)], 7)
                        for _ in range(args.samples)]
                med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                results[n] = med
                print(f"{n} cached tokens ({args.samples} samples, medians, ms): 1-token step {med['prefill']:.1f}, "
                      f"decode step after it {med['decode']:.1f} (x{med['prefill'] / med['decode']:.2f}); "
                      f"client: TTFT {med['ttft']:.1f}, token 1 -> 2 {med['gap12']:.1f}; queue {med['queue']:.2f}",
                      flush=True)
    finally:
        server.stop()
    print(json.dumps({"model": model.name, "cpus": args.cpus, "medians_ms": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What exact prompt token ids cost the proxy: a local tokenizer (proxy/routing/prompt_keys.py, the
model's Hugging Face tokenizer in the proxy's process) vs asking the instance's own
`/tokenize` (one HTTP round trip to vLLM), per request, for completions text and chat at
~64, ~1k and ~3.5k tokens (the tiny model's limit is 4k). Both in the same run against one
vLLM CPU server with the tiny model (started here on 127.0.0.1, stopped at the end); every
case also checks that the two agree token for token.

    .venv/bin/python -m scripts.bench_prompt_keys [--repeats 50]

Prints medians (µs) per request and the ratio /tokenize ÷ local. Also the cost of the
block keys (xpyd_wire.kv_events.chain_block_keys, block size 16) on top of the ids.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

from proxy.routing.prompt_keys import CHAT, COMPLETIONS, PromptTokenizer  # noqa: E402
from tests.support import cluster  # noqa: E402

WORDS = "river stone maple quiet engine silver garden window orbit lantern harbor meadow".split()


def _text(pt: PromptTokenizer, n_tokens: int) -> str:
    words: list[str] = []
    while True:
        words.extend(WORDS)
        text = " ".join(words)
        if len(pt.token_ids(COMPLETIONS, {"prompt": text})[0]) >= n_tokens:
            return text


def _median_us(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 1024, 3500])
    args = ap.parse_args()

    t0 = time.perf_counter()
    pt = PromptTokenizer(cluster.DEFAULT_MODEL)
    load_s = time.perf_counter() - t0
    log_dir = Path(tempfile.mkdtemp(prefix="xpyd-bench-keys-"))
    server = cluster.start_vllm("vllm", cluster.free_port(), log_dir)
    rows = []
    try:
        cluster.wait_until([server], "/health", 600)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for n in args.sizes:
                text = _text(pt, n)
                cases = {
                    "completion": (COMPLETIONS, {"prompt": text}),
                    "chat": (CHAT, {"messages": [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": text}]}),
                }
                for shape, (path, body) in cases.items():
                    ours = pt.token_ids(path, body)[0]
                    r = client.post("/tokenize", json={"model": "tiny-llama", **body})
                    r.raise_for_status()
                    if r.json()["tokens"] != ours:
                        print(f"MISMATCH {shape} {n}: ours {len(ours)} tokens, vLLM {r.json()['count']}")
                        return 1
                    payload = {"model": "tiny-llama", **body}
                    local = _median_us(lambda: pt.token_ids(path, body), args.repeats)  # noqa: B023
                    keys = _median_us(lambda: pt.block_keys(ours, 16), args.repeats)  # noqa: B023
                    remote = _median_us(lambda: client.post("/tokenize", json=payload).raise_for_status(),  # noqa: B023
                                        args.repeats)
                    rows.append((shape, len(ours), local, keys, remote))
    finally:
        server.stop()
    print(f"tokenizer load (transformers import + files): {load_s:.2f} s, once per proxy")
    print(f"{'shape':<11} {'tokens':>6} {'local ids':>10} {'keys':>8} {'/tokenize':>10} {'/tokenize÷local':>16}")
    for shape, n, local, keys, remote in rows:
        print(f"{shape:<11} {n:>6} {local:>8.0f}µs {keys:>6.0f}µs {remote:>8.0f}µs {remote / local:>15.1f}x")
    print(f"(medians of {args.repeats} requests each; /tokenize: a keep-alive round trip on loopback; ids identical)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

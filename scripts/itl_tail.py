"""What an ITL tail is made of: the inter-token gaps of `bench_load.py --raw FILE` above each point's
pooled p99, and what else happened on the client's clock while each was open.

For every (profile, rate, setup) the gaps of all rounds are pooled; those above the pool's p99 are
sorted by:
* position: the first gap of an answer (token 1 -> 2) or a later one;
* what overlapped it: another request sent (the front forwards it at once; under concurrent
  dispatch D parses and queues it then), another answer's first token (D admitted a request: its
  KV load and first step), both, or neither.
The same shares over *all* gaps are printed beside, so that a cause shows as over-represented.
A second table splits every gap (not only the tail) by whether another request was between its send
and its first token meanwhile (P prefilling it; under xpyd's concurrent dispatch, D holding it):
the typical step with and without that.

    .venv/bin/python -m scripts.bench_load --profiles short --setups xpyd,vllm-router --raw raw.jsonl
    .venv/bin/python -m scripts.itl_tail raw.jsonl
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable

KINDS = ("sent", "first token", "both", "neither")


def gaps_of(point: dict) -> list[tuple[float, int, str, bool]]:
    """(gap seconds, its index in its answer, what overlapped it, whether another request was
    before its first token meanwhile) of every gap of a point."""
    starts, ttfts, itls = point["start_times"], point["ttfts"], point["itls"]
    windows = [(s, s + t) for s, t in zip(starts, ttfts, strict=True)]  # each request's send to first token
    sent = sorted(starts)
    firsts = sorted(first for _, first in windows)
    out = []
    for me, (s, ttft, gaps) in enumerate(zip(starts, ttfts, itls, strict=True)):
        t = s + ttft
        own_first = t
        for i, g in enumerate(gaps):
            lo, hi = t, t + g
            other_sent = _any_in(sent, lo, hi, exclude=s)
            other_first = _any_in(firsts, lo, hi, exclude=own_first)
            kind = KINDS[0 if other_sent and not other_first else 1 if other_first and not other_sent
                         else 2 if other_sent else 3]
            waiting = any(ws < hi and we > lo for j, (ws, we) in enumerate(windows) if j != me)
            out.append((g, i, kind, waiting))
            t = hi
    return out


def _any_in(times: list[float], lo: float, hi: float, exclude: float) -> bool:
    """Whether a time other than ``exclude`` falls in (lo, hi]."""
    i = bisect.bisect_right(times, lo)
    while i < len(times) and times[i] <= hi:
        if times[i] != exclude:
            return True
        i += 1
    return False


def shares(items: Iterable[str], keys: tuple[str, ...]) -> str:
    items = list(items)
    n = len(items) or 1
    return " ".join(f"{k} {100 * sum(x == k for x in items) / n:.0f}%" for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", help="bench_load.py --raw output (JSON lines)")
    args = ap.parse_args()
    pools: dict[tuple, list] = defaultdict(list)
    with open(args.raw) as f:
        for line in f:
            point = json.loads(line)
            pools[(point["profile"], point["rate"], point["setup"])] += gaps_of(point)
    print("| profile | rate/s | setup | gaps | p99 ms | tail gaps | tail: first gap | tail overlapped by "
          "| all gaps overlapped by |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (prof, rate, setup), gaps in sorted(pools.items()):
        ms = sorted(1000 * g for g, _, _, _ in gaps)
        p99 = statistics.quantiles(ms, n=100)[98] if len(ms) >= 100 else ms[-1]
        tail = [(g, i, k) for g, i, k, _ in gaps if 1000 * g > p99]
        first = sum(i == 0 for _, i, _ in tail)
        print(f"| {prof} | {rate:g} | {setup} | {len(gaps)} | {p99:.1f} | {len(tail)} | {first} | "
              f"{shares((k for _, _, k in tail), KINDS)} | {shares((k for _, _, k, _ in gaps), KINDS)} |")
    print()
    print("| profile | rate/s | setup | gaps while another request is before its first token: n, p50 / p90 / p99 ms "
          "| other gaps: n, p50 / p90 / p99 ms |")
    print("|---|---|---|---|---|")
    for (prof, rate, setup), gaps in sorted(pools.items()):
        cells = [_spread([1000 * g for g, _, _, w in gaps if w is busy]) for busy in (True, False)]
        print(f"| {prof} | {rate:g} | {setup} | {cells[0]} | {cells[1]} |")


def _spread(ms: list[float]) -> str:
    if len(ms) < 2:
        return f"{len(ms)}, -"
    q = statistics.quantiles(ms, n=100)
    return f"{len(ms)}, {statistics.median(ms):.2f} / {q[89]:.2f} / {q[98]:.2f}"


if __name__ == "__main__":
    main()

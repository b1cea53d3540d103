#!/usr/bin/env python3
"""What KV-event intake costs the proxy (issue 17, part 1): its CPU per request with events
flowing, against a proxy without events in the same run, and the index's memory.

Two proxies route to the same fake P and D (tests/support/fake_vllm.py, given as static instances);
proxy "events" also subscribes to one KV-event publisher per instance (a double of vLLM's,
tests/support/kv_publisher.py, in a process of its own) publishing --event-rate batches per second per
instance of --blocks blocks each (BlockStored chained on the previous, BlockRemoved of the
oldest beyond --resident blocks, so the index holds that many). Rounds interleave the two
proxies (medians); the ratio events / baseline is the cost.

    .venv/bin/python -m scripts.bench_kv_events                 # ~60 s
    .venv/bin/python -m scripts.bench_kv_events --event-rate 500 --blocks 8 --rounds 5

Also printed: the proxy's CPU per applied batch (events alone, no requests) and its RSS with
the index full against the baseline proxy's. Loopback only; every process it starts is stopped
by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from scripts import bench_proxy as bp  # noqa: E402  (scripts/bench_proxy.py)


def publisher_main(args: argparse.Namespace) -> None:
    """Child mode: one publisher per instance; prints their endpoints, then publishes."""
    from tests.support.kv_publisher import Publisher
    from xpyd_wire.kv_events import BlockRemoved, BlockStored

    pubs = [Publisher() for _ in range(2)]
    print(json.dumps([[p.endpoint, p.replay_endpoint] for p in pubs]), flush=True)
    bs = 16
    next_hash = [1, 1]
    oldest = [1, 1]
    interval = 1.0 / args.event_rate
    t_next = time.perf_counter()
    try:
        while True:
            for i, p in enumerate(pubs):
                h = next_hash[i]
                hashes = tuple(range(h, h + args.blocks))
                tokens = tuple((h * bs + k) % 32000 for k in range(args.blocks * bs))
                events = [BlockStored(hashes, h - 1 if h > 1 else None, tokens, bs, None, "GPU", 0)]
                next_hash[i] = h + args.blocks
                if next_hash[i] - oldest[i] > args.resident:
                    gone = tuple(range(oldest[i], oldest[i] + args.blocks))
                    oldest[i] += args.blocks
                    events.append(BlockRemoved(gone, "GPU", 0))
                p.publish(events)
            t_next += interval
            delay = t_next - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
    finally:
        for p in pubs:
            p.close()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:  # noqa: S310 (loopback)
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def bench(args: argparse.Namespace) -> int:
    procs: list[subprocess.Popen] = []
    py = sys.executable
    try:
        pub = subprocess.Popen([py, "-m", "scripts.bench_kv_events", "--publisher", "--event-rate",
                                str(args.event_rate), "--blocks", str(args.blocks), "--resident",
                                str(args.resident)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        procs.append(pub)
        endpoints = json.loads(pub.stdout.readline())
        p_port, d_port = bp.free_port(), bp.free_port()
        for role, port in (("P", p_port), ("D", d_port)):
            procs.append(subprocess.Popen([py, *bp.FAKE, "--role", role, "--port", str(port), "--uvloop"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        proxies: dict[str, tuple[int, subprocess.Popen]] = {}
        for name in ("baseline", "events"):
            port = bp.free_port()
            specs = []
            for (role, up), (ev, rep) in zip((("prefill", p_port), ("decode", d_port)), endpoints):
                spec = f"http://127.0.0.1:{up},kv=127.0.0.1:{up}"
                specs += [f"--{role}", spec + (f",events={ev},replay={rep}" if name == "events" else "")]
            proc = subprocess.Popen([py, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port),
                                     "--discovery-host", "127.0.0.1", "--discovery-port", str(bp.free_port()),
                                     "--log-level", "warning", "--health-interval", "1", *specs],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
            procs.append(proc)
            proxies[name] = (port, proc)
        for port, _ in proxies.values():
            bp.wait_http(port, "/ready", 60)
        ev_port, ev_proc = proxies["events"]
        # Let the index fill to --resident blocks per instance, then measure events alone.
        fill_s = args.resident / (args.event_rate * args.blocks) + 1.0
        time.sleep(fill_s)
        b0, c0 = metric(ev_port, "xpyd_kv_events_total"), bp.cpu_seconds(ev_proc.pid)
        time.sleep(args.duration)
        b1, c1 = metric(ev_port, "xpyd_kv_events_total"), bp.cpu_seconds(ev_proc.pid)
        idle = {"batches_per_s": (b1 - b0) / args.duration,
                "cpu_us_per_batch": (c1 - c0) * 1e6 / max(1.0, b1 - b0),
                "cpu_share": (c1 - c0) / args.duration}
        runs: dict[str, dict[int, list[bp.Run]]] = {n: {c: [] for c in args.concurrency} for n in proxies}
        for _ in range(args.rounds):
            for c in args.concurrency:
                for name, (port, proc) in proxies.items():
                    runs[name][c].append(bp.measure(port, proc.pid, c, args))
        blocks = metric(ev_port, "xpyd_kv_index_blocks")
        rss = {n: rss_mib(proc.pid) for n, (_, proc) in proxies.items()}
        result = {"idle": idle, "index_blocks": blocks, "rss_mib": rss, "points": {}}
        print(f"events alone: {idle['batches_per_s']:.0f} batches/s ({args.blocks} blocks each, 2 instances), "
              f"{idle['cpu_us_per_batch']:.0f} us CPU per batch, {100 * idle['cpu_share']:.1f}% of a core")
        print(f"index: {blocks:.0f} blocks over 2 instances; RSS events {rss['events']:.1f} MiB vs "
              f"baseline {rss['baseline']:.1f} MiB (+{rss['events'] - rss['baseline']:.1f} MiB, "
              f"{(rss['events'] - rss['baseline']) * 2**20 / max(1, blocks):.0f} B per block incl. runtime)")
        print(f"{'c':>4} {'base req/s':>10} {'ev req/s':>9} {'base p99 ms':>11} {'ev p99 ms':>9} "
              f"{'base CPU ms/req':>15} {'ev CPU ms/req':>13} {'ratio':>6}")
        for c in args.concurrency:
            base, ev = bp.median_run(runs["baseline"][c]), bp.median_run(runs["events"][c])
            ratio = ev.cpu_ms / base.cpu_ms if base.cpu_ms else float("nan")
            result["points"][c] = {"baseline": base.__dict__, "events": ev.__dict__, "cpu_ratio": ratio}
            print(f"{c:>4} {base.rps:>10.0f} {ev.rps:>9.0f} {base.p99:>11.2f} {ev.p99:>9.2f} "
                  f"{base.cpu_ms:>15.3f} {ev.cpu_ms:>13.3f} {ratio:>6.2f}"
                  f"{'' if not (base.errors or ev.errors) else f'  errors {base.errors}/{ev.errors}'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    finally:
        bp.stop_all(procs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--duration", type=float, default=3.0, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--event-rate", type=float, default=200.0, help="batches per second per instance")
    ap.add_argument("--blocks", type=int, default=4, help="blocks stored per batch")
    ap.add_argument("--resident", type=int, default=10_000, help="blocks each instance holds (then removes)")
    ap.add_argument("--json", default=None, help="write the medians here")
    ap.add_argument("--publisher", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.chat = False  # what bench_proxy's load generator reads besides these flags
    args.prompt_chars = 0
    if args.publisher:
        publisher_main(args)
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())

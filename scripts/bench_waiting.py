#!/usr/bin/env python3
"""What requests waiting for their prefill cost a decode instance's running streams.

Concurrent dispatch (the proxy's default) sends D each request as soon as P is chosen; D's
connector keeps a request whose P has not begun sending in vLLM's queue without KV-cache
blocks (connector/p2p/scheduler.py) and looks it up on the arrival board every engine step. This
benchmark starts one D (vLLM's CPU build, our connector, 127.0.0.1), streams one long plain
completion on it, and measures that stream's inter-token latency (ITL) while N requests wait for
a prefill that never begins (their P address is dead, their transfer id marked early), for each
N of ``--waiting``; N = 0 is the baseline, measured in the same run. The tiny model: the
engine step is short, so what the waiting requests add to it shows.

    .venv/bin/python -m scripts.bench_waiting --waiting 0 16 64 --rounds 3

Each point also reports the CPU D's processes (API server, EngineCore, worker) used per token of
the stream. ``--profile DIR`` first records D's processes with py-spy (.venv/bin/py-spy, from
scripts/setup_bench.sh) while each N waits, as speedscope JSON. ``--step-timing`` splits D's
engine step per N (scheduling, the waiting requests' prefix-cache lookups, the connector's
answers, the wait for the worker; scripts/step_timing/sitecustomize.py).

Every process started here is stopped by its process group; the waiting requests are closed
(vLLM aborts them) after each round.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from scripts import bench_e2e  # noqa: E402  (histogram_sums)
from tests.support import cluster  # noqa: E402
from xpyd_wire import request_id  # noqa: E402


def _post(url: str, body: dict, headers: dict[str, str], timeout: float) -> urllib.request.addinfourl:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **headers})
    return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 (loopback)


def stream_itl_ms(d: cluster.Server, tokens: int) -> list[float]:
    """The gaps between a plain stream's token events on D, in ms."""
    body = {"model": "tiny-llama", "prompt": "The river runs past the old mill. " * 8, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    with _post(d.url, body, {"X-Request-Id": request_id.build_local()}, 300) as r:
        for line in r:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:])]  # from the second token on


def engine_itl(d: cluster.Server) -> tuple[float, float]:
    """(sum, count) of D's own inter-token latency histogram: the engine's view, which a loaded
    client (reading several events at once) cannot blur."""
    with urllib.request.urlopen(d.url + "/metrics", timeout=30) as r:  # noqa: S310 (loopback)
        text = r.read().decode()
    return bench_e2e.histogram_sums(text, {"itl": "vllm:inter_token_latency_seconds"})["itl"]


def waiters(d: cluster.Server, n: int) -> list[http.client.HTTPConnection]:
    """n requests whose prefill never begins (a dead P address, the early mark): sent, their
    answers never read; closing the connections ends them (vLLM aborts on disconnect)."""
    dead_p = f"{cluster.HOST}:{cluster.free_port()}"
    conns = []
    for i in range(n):
        rid = request_id.build(dead_p, f"{cluster.HOST}:{d.kv_port}", early=True)
        body = {"model": "tiny-llama", "prompt": f"{i} " + "waiting for a prefill " * 40, "max_tokens": 4}
        conn = http.client.HTTPConnection(cluster.HOST, d.port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                                    "X-Request-Id": rid})
        conns.append(conn)
    return conns


CLK = os.sysconf("SC_CLK_TCK")
ROLES = ("api", "engine", "worker")


def _role(pid: int) -> str:
    """Which of D's processes pid is: vLLM titles its engine and worker processes."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return "gone"
    return "engine" if b"EngineCore" in cmd else "worker" if b"Worker" in cmd else "api"


def cpu_s(d: cluster.Server) -> dict[str, float]:
    """CPU seconds (user + system) D's processes used so far, by role (api, engine, worker)."""
    out: dict[str, float] = {}
    for pid, fields in cluster.proc_stats():
        if int(fields[2]) == d.proc.pid:
            role = _role(pid)
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / CLK
    return out


def profile(d: cluster.Server, n: int, seconds: float, out: Path) -> None:
    """py-spy samples D's processes (API server, EngineCore, worker) for ``seconds`` while n
    requests wait and one stream runs (read until the recording ends; 3,500 tokens last ~8 s at
    the tiny model's 2.3 ms a token); written to ``out`` as speedscope JSON."""
    pid = d.proc.pid
    py_spy = ROOT / ".venv" / "bin" / "py-spy"
    if not py_spy.exists():
        print(f"profile skipped: no {py_spy}", file=sys.stderr)
        return
    conns = waiters(d, n)
    try:
        time.sleep(2.0 if n else 0.0)
        spy = subprocess.Popen([str(py_spy), "record", "--pid", str(pid), "--duration", str(int(seconds)),
                                "--rate", "50", "--format", "speedscope", "--output", str(out), "--nonblocking",
                                "--subprocesses"])
        body = {"model": "tiny-llama", "prompt": "The river runs past the old mill.", "max_tokens": 3500,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with _post(d.url, body, {"X-Request-Id": request_id.build_local()}, 300) as r:
            for _ in r:  # read until the recording ends (closing the stream aborts it)
                if spy.poll() is not None:
                    break
        spy.wait(timeout=seconds + 60)
        print(f"profile of D (pid {pid} and its children) with {n} waiting: {out}", file=sys.stderr)
    finally:
        for conn in conns:
            conn.close()
        time.sleep(2.0)


def step_parts_us(log_dir: Path, n: int) -> dict[str, float]:
    """Mean microseconds a part of D's one-token steps took with n requests waiting, per step
    (--step-timing; a part that did not run in a step counts 0 there)."""
    totals: dict[str, list[float]] = {}
    for path in log_dir.glob("steps-*.json"):
        totals.update(json.loads(path.read_text()))
    steps = totals.get(f"{n}:step", [0, 0.0])[0]
    out = {}
    for key, (_, seconds) in totals.items():
        waiting, _, part = key.partition(":")
        if steps and waiting == str(n):
            out[part] = round(seconds * 1e6 / steps, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waiting", type=int, nargs="+", default=[0, 16, 64], help="requests waiting, per point")
    ap.add_argument("--rounds", type=int, default=3, help="streams per point (medians over them)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the measured stream")
    ap.add_argument("--settle-s", type=float, default=2.0, help="from the waiters' start to the stream")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--profile", type=Path, help="before measuring, record D's processes with py-spy while each "
                    "--waiting N wait and a stream runs (speedscope JSON: this folder's waiting-N.json)")
    ap.add_argument("--profile-s", type=float, default=6.0, help="length of that recording")
    ap.add_argument("--step-timing", action="store_true", help="time the parts of D's engine step (scheduling, "
                    "the prefix-cache lookups of waiting requests, the connector's answers, the worker) per N: "
                    "scripts/step_timing/sitecustomize.py on D's PYTHONPATH")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-waiting-"))
    port = cluster.free_port()
    env: dict[str, str | None] = {"VLLM_CPU_OMP_THREADS_BIND": None}
    if args.step_timing:
        env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'scripts' / 'step_timing'}",
                   XPYD_STEP_TIMING_DIR=str(log_dir))
    d = cluster.start_vllm("decode", port, log_dir, env=env,
                           kv_config=cluster.kv_transfer_config("kv_consumer", cluster.free_port_pair(), port, None))
    results = []
    try:
        cluster.wait_until([d], "/health", 600)
        for _ in range(3):  # warm-up: the first streams after start-up run slower
            stream_itl_ms(d, args.tokens)
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            for n in args.waiting:
                profile(d, n, args.profile_s, args.profile / f"waiting-{n}.json")
        # Rounds outside, points inside: each round measures every N within seconds of its N = 0,
        # so a load that comes and goes on a shared box reaches all points alike.
        runs: dict[int, list[dict]] = {n: [] for n in args.waiting}
        for _ in range(args.rounds):
            for n in args.waiting:
                conns = waiters(d, n)
                time.sleep(args.settle_s if n else 0.0)
                before, cpu0 = engine_itl(d), cpu_s(d)
                gaps = sorted(stream_itl_ms(d, args.tokens))
                after, cpu1 = engine_itl(d), cpu_s(d)
                runs[n].append({
                    "engine": (after[0] - before[0]) / max(1.0, after[1] - before[1]) * 1e3,
                    "p50": statistics.median(gaps), "p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
                    # CPU ms per streamed token, by process
                    "cpu": {k: (cpu1.get(k, 0.0) - cpu0.get(k, 0.0)) * 1e3 / args.tokens for k in ROLES},
                })
                for conn in conns:
                    conn.close()
                time.sleep(args.settle_s if n else 0.0)  # D aborts them
        for n in args.waiting:
            rs = runs[n]
            results.append({"waiting": n, "engine_itl_ms": round(statistics.median(r["engine"] for r in rs), 2),
                            "engine_itl_rounds_ms": [round(r["engine"], 2) for r in rs],
                            "client_itl_p50_ms": round(statistics.median(r["p50"] for r in rs), 2),
                            "client_itl_p99_ms": round(statistics.median(r["p99"] for r in rs), 2),
                            "cpu_ms_per_token": {k: round(statistics.median(r["cpu"][k] for r in rs), 2)
                                                 for k in ROLES}})
        base = results[0]
        for r in results:
            r["engine_ratio"] = round(r["engine_itl_ms"] / base["engine_itl_ms"], 3)
            print(f"{r['waiting']:4d} waiting: D's mean ITL {r['engine_itl_ms']:.2f} ms ({r['engine_ratio']:.2f}x); "
                  f"client p50 {r['client_itl_p50_ms']:.2f} / p99 {r['client_itl_p99_ms']:.2f} ms; CPU ms a token "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_token"].items()), flush=True)
    finally:
        d.stop()
    if args.step_timing:
        for r in results:
            r["step_us"] = step_parts_us(log_dir, r["waiting"])
            print(f"{r['waiting']:4d} waiting: D's decode step, mean us: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in r["step_us"].items()), flush=True)
    out = {"results": results, "rounds": args.rounds, "tokens": args.tokens, "cpus": os.cpu_count(),
           "load": os.getloadavg(), "command": " ".join(sys.argv), "logs": str(log_dir)}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

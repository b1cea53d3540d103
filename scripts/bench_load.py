#!/usr/bin/env python3
"""xPyD under a load-test client users already run, side by side with vllm-router's P/D mode
and with colocated serving, on the same vLLM (CPU build) instances (issue 49).

Two vLLM servers, each pinned to one core with one OMP thread and the xPyD connector (P on
core 0, D on core 1), serve three setups in turn:

* colocated: both servers as plain replicas behind vllm-router's round robin (`--worker-urls`;
  a plain request id: the connector moves no KV);
* xpyd: the proxy (`python -m proxy`, shipped defaults), P prefills, D decodes;
* vllm-router: vllm-router 0.1.17 in its vLLM P/D mode (`--vllm-pd-disaggregation
  --vllm-discovery-address`, `--policy round_robin`), fed by the same connector's heartbeats;
* xpyd-base (with --base DIR): the proxy of another tree, same flags, for a before/after in one run.

The client is `vllm bench serve` (vllm.benchmarks.serve, run in this process: the CPU build's
`vllm` script fails; scripts/bench_serve.py is the same): the random dataset (synthetic token
ids, the model's local tokenizer, nothing downloaded), Poisson arrivals at each --rates value,
TTFT / ITL p50 and p99, output tokens/s and goodput at the stated SLO. `--client guidellm` adds
guidellm (its own venv: scripts/setup_bench.sh) at the same points. Each (profile, rate) is
measured --rounds times, the setups taking turns in a rotating order, every setup the same
prompts (a seed per round and rate), P's and D's prefix caches emptied before each (vLLM's
/reset_prefix_cache, its servers in dev mode: no prefix-cache hits across setups); medians are
reported, with the machine (lscpu) and its load (uptime) before and after.

    .venv/bin/python -m scripts.bench_load --json load.json --plot docs/img/bench_load.png
    .venv/bin/python -m scripts.bench_load --rounds 1 --profiles short --rates-short 2   # smoke

Install (the router, the plot, guidellm): `bash scripts/setup_bench.sh`. Loopback only; every
process started here is stopped by its process group at the end, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support import cluster  # tests/support/cluster.py: the servers' spawner

ROOT = Path(__file__).resolve().parent.parent
SETUPS = ("colocated", "xpyd", "xpyd-base", "vllm-router")  # xpyd-base: only with --base
METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "out_tok_s", "goodput", "goodput_tight")
# Where the CPU went during a point (/proc, every process of a server's session): the front (the
# setup's proxy or router), P and D in cores busy over the point's wall time (a front's CPU a
# request would count its idle heartbeats and probes over a slow point's minute). *_wait: how long
# their threads were ready but waited for a core (the kernel's run-queue delay, schedstat), ms a
# second of the point: on two cores a front that runs on D's core delays D's steps.
CPU = ("front_cores", "p_cores", "d_cores", "front_wait", "p_wait", "d_wait", "gap1_p50", "gap1_max")
# D's connector loads over a point (vllm:xpyd_kv_transfers_total{role="load"}): summed over rounds.
LOADS = ("loads_ok", "loads_failed")
HZ = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Profile:
    """A prompt shape: tokens in and out, its request rates and the goodput SLO (ms)."""

    name: str
    input_len: int
    output_len: int
    rates: tuple[float, ...]
    prompts: int  # requests per point
    slo_ttft_ms: float
    slo_tpot_ms: float
    # A second goodput, at the same TTFT and a TPOT near the unloaded decode step: the SLO an
    # interactive service sets, where a decode that waits behind other prompts' prefills fails.
    tight_tpot_ms: float = 12.0


def machine() -> dict[str, str]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor")
    fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lscpu.splitlines()) if k.strip() in keep}
    return {"lscpu": "; ".join(f"{k}: {v}" for k, v in fields.items()),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


def post_ok(url: str, timeout: float = 60.0) -> bool:
    body = json.dumps({"model": cluster_model_name(), "prompt": "hello there", "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (loopback)
            return r.status == 200
    except OSError:
        return False


def cluster_model_name() -> str:
    return "tiny-llama"  # cluster.start_vllm serves every model under this name


def wait_routed(url: str, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if post_ok(url, timeout=30):
            return
        time.sleep(1)
    raise TimeoutError(f"{name} routed no completion in {timeout:.0f}s")


def start_router(name: str, args: list[str], log_dir: Path) -> cluster.Server:
    port = cluster.free_port()
    cmd = [shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router"),
           "--host", cluster.HOST, "--port", str(port), "--policy", "round_robin", "--log-level", "warning",
           # Its metrics port defaults to a fixed 29000, taken by any other router on the machine.
           "--prometheus-port", str(cluster.free_port()), *args]  # fmt: skip
    return cluster._spawn(name, port, cmd, log_dir, {})


# ----------------------------------------------------------------------------- clients


def vllm_point(url: str, model: Path, p: Profile, rate: float, seed: int,
               max_concurrency: int | None = None, raw: list[dict] | None = None) -> dict[str, float]:
    """One `vllm bench serve` run; its own print-out goes to a buffer (kept on failure). ``raw``
    gets each request's send time, TTFT and inter-token gaps (seconds, the client's clock)."""
    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    # --save-detailed keeps the per-request ITLs and errors in the result (nothing is written).
    argv = ["--backend", "openai", "--base-url", url, "--model", cluster_model_name(), "--tokenizer", str(model),
            "--dataset-name", "random", "--random-input-len", str(p.input_len), "--random-output-len",
            str(p.output_len), "--num-prompts", str(p.prompts), "--request-rate", str(rate), "--seed", str(seed),
            "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--goodput", f"ttft:{p.slo_ttft_ms:g}", f"tpot:{p.slo_tpot_ms:g}", "--disable-tqdm",
            "--save-detailed"]  # fmt: skip
    if max_concurrency:
        argv += ["--max-concurrency", str(max_concurrency)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        r = serve.main(parser.parse_args(argv))
    if r["completed"] != p.prompts:
        errors = [e for e in r.get("errors", []) if e][:3]
        raise RuntimeError(f"{url}: {r['completed']} of {p.prompts} completed; {errors}\n{out.getvalue()[-2000:]}")
    if raw is not None:
        raw.append({k: r[k] for k in ("start_times", "ttfts", "itls")})
    # The gap from each answer's first token to its second, which the ITL figures include: with
    # the first token from P, D's first step after the KV load (issue 49 section 1).
    gaps = sorted(1000 * itl[0] for itl in r["itls"] if itl)
    return {"goodput_tight": tight_goodput(r, p),
            "ttft_p50": r["median_ttft_ms"], "ttft_p99": r["p99_ttft_ms"], "itl_p50": r["median_itl_ms"],
            "itl_p99": r["p99_itl_ms"], "out_tok_s": r["output_throughput"], "goodput": r["request_goodput"],
            "gap1_p50": statistics.median(gaps) if gaps else 0.0, "gap1_max": gaps[-1] if gaps else 0.0}


def tight_goodput(r: dict, p: Profile) -> float:
    """Requests/s within TTFT and the tight TPOT, from vllm bench serve's per-request figures
    (seconds: ``ttfts``, and ``itls`` whose mean is the request's TPOT)."""
    good = sum(1 for ttft, itl in zip(r["ttfts"], r["itls"], strict=True)
               if itl and 1000 * ttft <= p.slo_ttft_ms and 1000 * statistics.fmean(itl) <= p.tight_tpot_ms)
    return good / r["duration"]


def guidellm_point(url: str, model: Path, p: Profile, rate: float, seed: int, out_dir: Path) -> dict[str, float]:
    """One guidellm run (poisson at ``rate``, synthetic prompts from the local tokenizer,
    completions). Its start-up takes ~40 s on a loaded 2-core box: `--client both` doubles a sweep
    and more."""
    exe = ROOT / ".venv-guidellm" / "bin" / "guidellm"
    if not exe.exists():
        raise SystemExit("--client guidellm needs .venv-guidellm (bash scripts/setup_bench.sh)")
    out = out_dir / f"guidellm-{seed}.json"
    cmd = [str(exe), "run", "--backend",
           f"kind=openai_http,target={url},model={cluster_model_name()},request_format=/v1/completions",
           "--profile", f"kind=poisson,rate={rate}", "--constraint", f"kind=max_requests,count={p.prompts}",
           "--tokenizer", f"kind=huggingface_auto,model={model}",
           "--data", f"kind=synthetic_text,prompt_tokens={p.input_len},output_tokens={p.output_len}",
           "--seed", f"kind=static,value={seed}", "--output", f"kind=json,path={out}", "--disable-console"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({res.returncode}): {shlex.join(cmd)}\n{res.stderr[-3000:]}")
    return guidellm_metrics(json.loads(out.read_text()), p)


def guidellm_metrics(report: dict, p: Profile) -> dict[str, float]:
    """TTFT/ITL percentiles and output tokens/s from guidellm's JSON report; goodput from its
    per-request records at the same SLO as vllm bench serve's (TTFT, and time per output token
    after the first)."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]

    def dist(name: str) -> dict:
        return m[name]["successful"]

    ttft, itl = dist("time_to_first_token_ms"), dist("inter_token_latency_ms")
    reqs = bench.get("requests", {}).get("successful", [])
    duration = bench.get("duration") or (bench.get("end_time", 0) - bench.get("start_time", 0)) or 1

    def goodput(tpot_ms: float) -> float:
        return sum(1 for r in reqs if (r.get("time_to_first_token_ms") or 1e18) <= p.slo_ttft_ms
                   and (r.get("inter_token_latency_ms") or 0) <= tpot_ms) / duration

    return {"goodput_tight": goodput(p.tight_tpot_ms),
            "ttft_p50": ttft["median"], "ttft_p99": ttft["percentiles"]["p99"], "itl_p50": itl["median"],
            "itl_p99": itl["percentiles"]["p99"], "out_tok_s": dist("output_tokens_per_second")["mean"],
            "goodput": goodput(p.slo_tpot_ms)}


# ----------------------------------------------------------------------------- run


def session_cpu(sessions: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of every process in each named session (a server and its children)."""
    by_sid = {sid: name for name, sid in sessions.items()}
    out = dict.fromkeys(sessions, 0.0)
    for _, fields in cluster.proc_stats():
        name = by_sid.get(int(fields[3]))
        if name is not None:
            out[name] += (int(fields[11]) + int(fields[12])) / HZ
    return out


def session_threads(sids: set[int]) -> Iterator[tuple[int, int, str]]:
    """(session, pid, tid) of every thread of every live process in these sessions."""
    for pid, fields in cluster.proc_stats():
        sid = int(fields[3])
        if sid not in sids:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone meanwhile
        for tid in tids:
            yield sid, pid, tid


def pin_sessions(sids: list[int], cpus: set[int]) -> None:
    """Every thread of every process in these sessions onto ``cpus`` (threads started later
    inherit it from theirs)."""
    for _, _, tid in session_threads(set(sids)):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            continue  # gone meanwhile


def session_waits(sessions: dict[str, int]) -> dict[str, float]:
    """Run-queue delay so far, ms, summed over every thread of each named session
    (/proc/PID/task/TID/schedstat: on-CPU ns, run-queue wait ns, timeslices)."""
    by_sid = {sid: name for name, sid in sessions.items()}
    out = dict.fromkeys(sessions, 0.0)
    for sid, pid, tid in session_threads(set(by_sid)):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[by_sid[sid]] += int(f.read().split()[1]) / 1e6
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return out


def reset_prefix_caches(urls: list[str]) -> None:
    """Empty P's and D's prefix caches: every setup gets the same prompts, none finds them cached."""
    for url in urls:
        req = urllib.request.Request(url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 (loopback)
            r.read()


def kv_loads(d_url: str) -> dict[str, float]:
    """D's connector loads so far, ok and failed (any result but ok and unneeded), from its /metrics."""
    with urllib.request.urlopen(d_url + "/metrics", timeout=30) as r:  # noqa: S310 (loopback)
        text = r.read().decode()
    out = dict.fromkeys(LOADS, 0.0)
    for line in text.splitlines():
        if line.startswith("vllm:xpyd_kv_transfers_total{") and 'role="load"' in line:
            result = line.split('result="', 1)[1].split('"', 1)[0]
            if result != "unneeded":
                out["loads_ok" if result == "ok" else "loads_failed"] += float(line.rsplit(" ", 1)[1])
    return out


def sweep(args: argparse.Namespace, urls: dict[str, str], model: Path, profiles: list[Profile],
          log_dir: Path, sessions: dict[str, int], engine_urls: list[str]) -> dict:  # fmt: skip
    """{client: {profile: {rate: {setup: [metrics per round]}}}}, the setups taking turns.
    ``sessions``: the session (leader pid) of P, D and each setup's front, named so."""
    clients = ["vllm"] + (["guidellm"] if args.client == "both" else []) if args.client != "guidellm" else ["guidellm"]
    res: dict = {c: {p.name: {r: {s: [] for s in urls} for r in p.rates} for p in profiles} for c in clients}
    d_url = engine_urls[1]
    names = list(urls)
    for rnd in range(args.rounds):
        for p in profiles:
            for i, rate in enumerate(p.rates):
                order = names[rnd % len(names):] + names[:rnd % len(names)]  # who goes first rotates
                for s in order:
                    for c in clients:
                        # The same prompts for every setup of a point (which of them D prefills alone,
                        # under the local threshold, differs with the prompts: 7 to 12 of 12 with
                        # one seed per setup), from caches emptied before each.
                        seed = args.seed + 10_000 * rnd + 1_000 * i + 10 * clients.index(c)
                        seed += 5_000_000 * profiles.index(p)
                        reset_prefix_caches(engine_urls)
                        loads0, t0, cpu0 = kv_loads(d_url), time.monotonic(), session_cpu(sessions)
                        wait0 = session_waits(sessions)
                        raw: list[dict] | None = [] if args.raw else None
                        point = (vllm_point(urls[s], model, p, rate, seed, args.max_concurrency, raw) if c == "vllm"
                                 else guidellm_point(urls[s], model, p, rate, seed, log_dir))
                        wall, cpu1, wait1 = time.monotonic() - t0, session_cpu(sessions), session_waits(sessions)
                        if raw:  # written after the point's clock and CPU figures are read
                            with open(args.raw, "a") as f:
                                f.write(json.dumps({"round": rnd, "profile": p.name, "rate": rate, "setup": s,
                                                    **raw[0]}) + "\n")
                        point |= {"front_cores": (cpu1[s] - cpu0[s]) / wall,
                                  "p_cores": (cpu1["P"] - cpu0["P"]) / wall, "d_cores": (cpu1["D"] - cpu0["D"]) / wall}
                        point |= {f"{k}_wait": (wait1[n] - wait0[n]) / wall
                                  for k, n in (("front", s), ("p", "P"), ("d", "D"))}
                        point |= {k: v - loads0[k] for k, v in kv_loads(d_url).items()}
                        res[c][p.name][rate][s].append(point)
                        print(f"  round {rnd + 1}/{args.rounds} {c} {p.name} {rate:g}/s {s:<12} "
                              + " ".join(f"{k} {v:.1f}" for k, v in point.items())
                              + f" ({time.monotonic() - t0:.0f}s; load {os.getloadavg()[0]:.1f})", flush=True)
    return res


def medians(res: dict) -> dict:
    """Medians over the rounds; D's loads summed."""
    return {c: {p: {r: {s: {k: statistics.median(x[k] for x in runs) for k in METRICS + CPU if k in runs[0]}
                        | {k: sum(x.get(k, 0) for x in runs) for k in LOADS}
                        for s, runs in by_setup.items() if runs}
                    for r, by_setup in by_rate.items()} for p, by_rate in by_prof.items()}
            for c, by_prof in res.items()}


def report(med: dict, profiles: list[Profile], args: argparse.Namespace) -> list[str]:
    lines = []
    for c, by_prof in med.items():
        for p in profiles:
            lines.append(f"\n{c}: {p.name} prompts ({p.input_len} tokens in, {p.output_len} out, {p.prompts} requests "
                         f"a point, Poisson), goodput SLO TTFT <= {p.slo_ttft_ms:g} ms and TPOT <= {p.slo_tpot_ms:g} "
                         f"ms (and TPOT <= {p.tight_tpot_ms:g} ms: tight); medians of {args.rounds} rounds")
            lines.append("| rate/s | setup | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | out tok/s | goodput req/s "
                         "| goodput tight |")
            lines.append("|---|---|---|---|---|---|---|---|---|")
            for rate, by_setup in by_prof[p.name].items():
                for s, m in by_setup.items():
                    lines.append(f"| {rate:g} | {s} | {m['ttft_p50']:.0f} | {m['ttft_p99']:.0f} | {m['itl_p50']:.1f} | "
                                 f"{m['itl_p99']:.1f} | {m['out_tok_s']:.1f} | {m['goodput']:.2f} | "
                                 f"{m.get('goodput_tight', float('nan')):.2f} |")
            rows = [(rate, s, m) for rate, by_setup in by_prof[p.name].items() for s, m in by_setup.items()
                    if "front_cores" in m]
            if rows:
                lines.append("\nwhere the CPU went (/proc: cores busy over the point; the front: the setup's proxy or "
                             "router; P and D have one core each) and the gap from each answer's first token to its "
                             "second (in the ITL figures)")
                lines.append("| rate/s | setup | front cores | P cores | D cores | run-queue wait front / P / D ms/s "
                             "| token 1 -> 2 gap p50 / max ms | D's KV loads ok / failed (all rounds) |")
                lines.append("|---|---|---|---|---|---|---|---|")
                lines += [f"| {rate:g} | {s} | {m['front_cores']:.3f} | {m['p_cores']:.2f} | {m['d_cores']:.2f} | "
                          f"{m.get('front_wait', 0):.1f} / {m.get('p_wait', 0):.1f} / {m.get('d_wait', 0):.1f} | "
                          f"{m.get('gap1_p50', 0):.0f} / {m.get('gap1_max', 0):.0f} | "
                          f"{m['loads_ok']:.0f} / {m['loads_failed']:.0f} |" for rate, s, m in rows]
    return lines


def plot(med: dict, profiles: list[Profile], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install -e '.[bench]')") from None
    by_prof = med["vllm"] if "vllm" in med else next(iter(med.values()))
    panels = [("ttft_p99", "TTFT p99 (ms)"), ("itl_p99", "ITL p99 (ms)"), ("out_tok_s", "output tokens/s"),
              ("goodput", "goodput (req/s)")]
    fig, axes = plt.subplots(len(profiles), len(panels), figsize=(4 * len(panels), 3.2 * len(profiles)), squeeze=False)
    for row, p in zip(axes, profiles):
        rates = sorted(by_prof[p.name])
        for ax, (key, label) in zip(row, panels):
            for s in SETUPS:
                ys = [by_prof[p.name][r][s][key] for r in rates if s in by_prof[p.name][r]]
                if ys:
                    ax.plot(rates[:len(ys)], ys, marker="o", label=s)
            ax.set_title(f"{p.name} ({p.input_len} in / {p.output_len} out): {label}", fontsize=9)
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("bench", "tiny"), default="bench",
                    help="bench: scripts/bench_e2e's 4-layer h768 Llama (a 1k prefill ~150-300 ms on one core); tiny")
    ap.add_argument("--profiles", default="short,long", help="which of short, long")
    ap.add_argument("--short", default="256,64", help="short prompts: input,output tokens")
    ap.add_argument("--long", default="2048,64", help="long prompts: input,output tokens")
    ap.add_argument("--rates-short", default="1,3", help="request rates (req/s) of the short prompts")
    ap.add_argument("--rates-long", default="0.3,0.6", help="request rates (req/s) of the long prompts")
    ap.add_argument("--prompts", type=int, default=12, help="requests per point")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="vllm bench serve's --max-concurrency: at most this many requests in flight (with a rate "
                         "of inf: a closed loop of N clients)")
    ap.add_argument("--slo-short", default="1000,100", help="goodput SLO for short prompts: TTFT,TPOT ms")
    ap.add_argument("--slo-long", default="3000,100", help="goodput SLO for long prompts: TTFT,TPOT ms")
    ap.add_argument("--tight-tpot", type=float, default=12.0,
                    help="a second goodput's TPOT bound, ms (same TTFT): near the bench model's unloaded decode "
                         "step (~9-10 ms on one core), where decodes that wait behind prefills fail")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--setups", default="colocated,xpyd,vllm-router", help="which of " + ", ".join(SETUPS))
    ap.add_argument("--base", default=None, metavar="DIR",
                    help="also run the proxy of another tree as setup xpyd-base, same flags, on the same P and D (a "
                         "before/after in one run; DIR from `git archive REV proxy xpyd_wire`)")
    ap.add_argument("--client", choices=("vllm", "guidellm", "both"), default="vllm")
    ap.add_argument("--proxy-args", default="", help="extra flags for the xPyD proxy (default: shipped defaults)")
    ap.add_argument("--front-cpus", default=None, metavar="CPUS",
                    help="pin every front (proxy, router) to these cores, e.g. 0 (P's): whether a front's CPU on "
                         "D's core shows in the ITL (default: unpinned, as an operator runs them)")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--raw", default=None, metavar="FILE",
                    help="append each point's per-request send times, TTFTs and inter-token gaps (JSON lines; "
                         "vllm bench serve only): what the percentiles are made of")
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()

    def prof(name: str) -> Profile:
        i, o = (int(x) for x in getattr(args, name).split(","))
        ttft, tpot = (float(x) for x in getattr(args, f"slo_{name}").split(","))
        rates = tuple(float(x) for x in getattr(args, f"rates_{name}").split(","))
        return Profile(name, i, o, rates, args.prompts, ttft, tpot, args.tight_tpot)

    if args.max_concurrency and args.client != "vllm":
        ap.error("--max-concurrency is vllm bench serve's: use it with --client vllm")
    profiles = [prof(n) for n in args.profiles.split(",") if n]
    setups = [s for s in args.setups.split(",") if s]
    if args.base and "xpyd-base" not in setups:
        setups.append("xpyd-base")
    if "xpyd-base" in setups and not args.base:
        ap.error("setup xpyd-base needs --base DIR")
    cmd = shlex.join([os.path.relpath(sys.executable, ROOT), "-m", "scripts.bench_load", *sys.argv[1:]])
    before = machine()
    print(f"$ {cmd}\n{before['lscpu']}\nbefore: {before['uptime']}", flush=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="xpyd-bench-load-"))
    servers: list[cluster.Server] = []
    ok = False
    try:
        from scripts.bench_e2e import ensure_model  # the bench model, generated locally

        t0 = time.monotonic()
        model = ensure_model(args.model)
        disc, rdisc = cluster.free_port(), cluster.free_port()
        p_port, d_port = cluster.free_port(), cluster.free_port()
        proxy = cluster.start_proxy(cluster.free_port(), disc, log_dir, shlex.split(args.proxy_args))
        servers.append(proxy)
        base, bdisc = None, cluster.free_port()
        if args.base:
            base = cluster.start_proxy(cluster.free_port(), bdisc, log_dir, shlex.split(args.proxy_args),
                                       name="proxy-base", checkout=Path(args.base).resolve())
            servers.append(base)
        # The routers only for the setups asked for (an xpyd-only run needs no vllm-router installed).
        router_pd = None
        if "vllm-router" in setups:
            router_pd = start_router("router-pd", ["--vllm-pd-disaggregation", "--vllm-discovery-address",
                                                   f"{cluster.HOST}:{rdisc}"], log_dir)
            servers.append(router_pd)
        common = {"model": model, "log_dir": log_dir}
        # The connector registers with every front that routes by its heartbeats.
        more = [f"{cluster.HOST}:{port}" for port, on in ((rdisc, router_pd), (bdisc, base)) if on]
        reg = {"proxies": more} if more else {}
        for name, port, role, cpu in (("prefill", p_port, "kv_producer", "0"), ("decode", d_port, "kv_consumer", "1")):
            servers.append(cluster.start_vllm(
                # Dev mode: /reset_prefix_cache between points (sweep), nothing else of it is used.
                name, port, cpus=cpu, env={"VLLM_CPU_OMP_THREADS_BIND": cpu, "VLLM_SERVER_DEV_MODE": "1"},
                kv_config=cluster.kv_transfer_config(role, cluster.free_port_pair(), port, disc, **reg), **common))
        print(f"starting P (core 0), D (core 1), the proxy{', vllm-router' if router_pd else ''}; model {model.name}; "
              f"logs in {log_dir}",
              flush=True)
        cluster.wait_until(servers[-2:], "/health", args.startup_timeout)
        engines = servers[-2:]
        colocated = None
        if "colocated" in setups:  # started once its workers answer (it checks them at start-up)
            colocated = start_router("router-colocated", ["--worker-urls", f"http://{cluster.HOST}:{p_port}",
                                                          f"http://{cluster.HOST}:{d_port}"], log_dir)
            servers.append(colocated)
        all_urls = {"xpyd": proxy.url} | ({"colocated": colocated.url} if colocated else {}) \
            | ({"vllm-router": router_pd.url} if router_pd else {}) | ({"xpyd-base": base.url} if base else {})
        urls = {s: all_urls[s] for s in SETUPS if s in setups}
        for s, url in urls.items():
            wait_routed(url, s, 120)
        print(f"  up in {time.monotonic() - t0:.0f}s", flush=True)
        sessions = {"P": engines[0].proc.pid, "D": engines[1].proc.pid, "xpyd": proxy.proc.pid}
        sessions |= {s: srv.proc.pid for s, srv in (("colocated", colocated), ("vllm-router", router_pd),
                                                     ("xpyd-base", base)) if srv}
        if args.front_cpus:
            pin_sessions([sid for name, sid in sessions.items() if name not in ("P", "D")],
                         {int(c) for c in args.front_cpus.split(",")})
        res = sweep(args, urls, model, profiles, log_dir, sessions, [e.url for e in engines])
        after = machine()
        med = medians(res)
        title = (f"{before['lscpu']}; {args.model} model; medians of {args.rounds} rounds\n"
                 f"before: {before['uptime']}\nafter: {after['uptime']}")
        lines = report(med, profiles, args)
        print("\n".join([f"\n$ {cmd}", before["lscpu"], f"before: {before['uptime']}", f"after: {after['uptime']}",
                         "setups: colocated = vllm-router round robin over P and D as plain servers; xpyd = the proxy"
                         f" ({args.proxy_args or 'shipped defaults'}){'; xpyd-base = the same of ' + args.base if base else ''}"
                         "; vllm-router = its P/D mode, round_robin",
                         *lines]), flush=True)  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps({"command": cmd, "machine": before, "after": after,
                                                   "profiles": [p.__dict__ for p in profiles], "medians": med,
                                                   "rounds": res}, indent=1, default=str) + "\n")
            print(f"wrote {args.json}")
        if args.plot:
            plot(med, profiles, args.plot, title)
            print(f"wrote {args.plot}")
        ok = True
        return 0
    except KeyboardInterrupt:
        print(f"interrupted; logs in {log_dir}", file=sys.stderr)
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

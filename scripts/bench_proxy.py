#!/usr/bin/env python3
"""Benchmark the xPyD proxy against talking to the decode instance directly.

Starts fake P and D instances (tests/support/fake_vllm.py) and the proxy as separate processes,
then, for each concurrency, runs the load generator (its own process: keep-alive raw
HTTP/1.1 connections, streaming completions of --tokens tokens; --chat: chat completions,
whose role chunk comes first) first straight at D, then through the proxy. Prints req/s,
latency and the added latency p50/p99, and the proxy's CPU per request (from
/proc/<pid>/stat), each with its ratio to the direct run.

    .venv/bin/python -m scripts.bench_proxy                    # c = 1, 16, 64; ~90 s
    .venv/bin/python -m scripts.bench_proxy --rounds 3 --duration 2 --variants \
        native/uvloop/httptools aiohttp/uvloop/httptools native/asyncio/httptools

With --variants, one proxy per variant (each with its own fake P and D) runs side by side
and --rounds interleaves the measurements (medians reported), so that load from other
processes on a shared machine hits every variant alike. A variant may end in "+expose": that
proxy runs with --expose-routing-headers (no neutral-id rewrite of the relayed bytes), in
"+first-token" (--first-token prefill, the default) or in "+decode-first" (--first-token decode):

    .venv/bin/python -m scripts.bench_proxy --rounds 5 --concurrency 1 16 64 --variants \
        native/uvloop/httptools native/uvloop/httptools+expose

--profile SECONDS samples each xPyD proxy with py-spy afterwards (pip install py-spy) and
prints its functions by share of the samples, as the README's proxy-CPU figures were found:

    .venv/bin/python -m scripts.bench_proxy --concurrency 64 --rounds 1 --profile 10

py-spy counts a thread that waits for a CPU as busy, so on a loaded machine it inflates what
comes before a wake-up (a socket write, the event loop's poll). --perf SECONDS samples each
proxy (the router too) with perf's cpu-clock, which counts only CPU time, and prints its CPU by
binary (kernel, interpreter, uvloop, ...); the "sys" column is the kernel's share from
/proc/<pid>/stat.

Loopback only; every process it starts is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.support.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = ["-m", "tests.support.fake_vllm"]  # a module: run from the root
HZ = os.sysconf("SC_CLK_TCK")

# ---------------------------------------------------------------------------- load generator


class _Client(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.header_end = -1
        self.length: int | None = None
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.header_end < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.header_end = end + 4
            head = bytes(buf[:end]).lower()
            i = head.find(b"content-length:")
            if i >= 0:
                j = head.find(b"\r\n", i)
                self.length = int(head[i + 15 : j if j > 0 else len(head)])
        body_len = len(buf) - self.header_end
        if self.length is not None:
            done = body_len >= self.length
        else:  # chunked: nothing follows the terminating chunk (no pipelining)
            done = buf.endswith(b"0\r\n\r\n") and (body_len == 5 or buf.endswith(b"\r\n0\r\n\r\n"))
        if done and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(bytes(buf))

    async def request(self, data: bytes) -> bytes:
        if self.lost or self.transport.is_closing():
            raise ConnectionError("connection closed by the server")
        self.buf = bytearray()
        self.header_end = -1
        self.length = None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter


async def _loadgen(
    host: str, port: int, path: str, body: bytes, concurrency: int, duration: float, warmup: float
) -> dict:
    loop = asyncio.get_running_loop()
    req = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    conns = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(_Client, host, port)
        conns.append(proto)
    latencies: list[float] = []
    errors = 0
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + duration

    async def worker(i: int) -> None:
        nonlocal errors
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            try:
                resp = await asyncio.wait_for(conns[i].request(req), 30)
            except (TimeoutError, ConnectionError):
                errors += 1  # counted, then carry on over a fresh connection
                conns[i].transport.close()
                _, conns[i] = await loop.create_connection(_Client, host, port)
                continue
            t1 = time.perf_counter()
            ok = resp.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in resp
            if t0 >= t_measure:
                if ok:
                    latencies.append(t1 - t0)
                else:
                    errors += 1

    await asyncio.gather(*(worker(i) for i in range(len(conns))))
    for c in conns:
        c.transport.close()
    latencies.sort()
    n = len(latencies)

    def pct(q: float) -> float:
        return latencies[min(n - 1, int(q * n))] * 1000 if n else float("nan")

    return {"n": n, "errors": errors, "rps": n / duration, "p50": pct(0.5), "p99": pct(0.99)}


def prompt_text(chars: int) -> str:
    """The prompt: the fake tokenizer makes one token of each character, so ``chars`` is
    the prompt's length in tokens as P returns it (and D's continuation carries it)."""
    words = "Hello, my name is "
    return (words * (chars // len(words) + 1))[:chars] if chars > 0 else words.strip()


def loadgen_main(args: argparse.Namespace) -> None:
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    body: dict = {"model": "fake-model", "max_tokens": args.tokens, "stream": True}
    text = prompt_text(args.prompt_chars)
    if args.chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    result = run(
        _loadgen(
            args.host,
            args.port,
            "/v1/chat/completions" if args.chat else "/v1/completions",
            json.dumps(body).encode(),
            args.concurrency,
            args.duration,
            args.warmup,
        )
    )
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- orchestration


def cpu_seconds(pid: int) -> float:
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` since it started."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / HZ, int(fields[12]) / HZ  # utime, stime


def syscalls(pid: int) -> tuple[int, int]:
    """(read-like, write-like) system calls of ``pid`` since it started (/proc/<pid>/io)."""
    with open(f"/proc/{pid}/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    return int(io["syscr"]), int(io["syscw"])


@dataclass
class Run:
    rps: float
    p50: float
    p99: float
    errors: int
    cpu_ms: float  # CPU of the measured process per request
    sys_ms: float  # the part of it in the kernel (system calls: loopback TCP, epoll)
    reads: float  # its read-like system calls per request (recv, read, accept...)
    writes: float  # and write-like ones (send, write...)


def median_run(runs: list[Run]) -> Run:
    med = statistics.median
    return Run(
        med(r.rps for r in runs),
        med(r.p50 for r in runs),
        med(r.p99 for r in runs),
        sum(r.errors for r in runs),
        med(r.cpu_ms for r in runs),
        med(r.sys_ms for r in runs),
        med(r.reads for r in runs),
        med(r.writes for r in runs),
    )


def wait_http(port: int, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"port {port}{path} not ready after {timeout}s")


def measure(port: int, pid: int, c: int, args: argparse.Namespace) -> Run:
    cmd = [sys.executable, "-m", "scripts.bench_proxy", "--loadgen", "--port", str(port),
           "--concurrency", str(c), "--duration", str(args.duration), "--warmup",
           str(args.warmup), "--tokens", str(args.tokens), "--prompt-chars", str(args.prompt_chars),
           *(["--chat"] if args.chat else [])]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    # CPU is sampled around the measured window only (the load generator reports the same).
    time.sleep(args.warmup)
    cpu0, io0 = cpu_split(pid), syscalls(pid)
    out, _ = proc.communicate(timeout=args.duration + args.warmup + 60)
    cpu1, io1 = cpu_split(pid), syscalls(pid)
    r = json.loads(out.strip().splitlines()[-1])
    n = max(1, r["n"])
    user, system = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    return Run(
        r["rps"],
        r["p50"],
        r["p99"],
        r["errors"],
        (user + system) * 1000 / n,
        system * 1000 / n,
        (io1[0] - io0[0]) / n,
        (io1[1] - io0[1]) / n,
    )


def _measure(s: Setup, port: int, proc: subprocess.Popen, c: int, args: argparse.Namespace) -> Run:
    """measure(), saying which process failed when the load generator gets no result."""
    try:
        return measure(port, proc.pid, c, args)
    except (IndexError, ValueError) as e:  # no JSON line: the load generator failed
        state = "running" if proc.poll() is None else f"exited {proc.returncode}: {proc.stderr.read()[-2000:]}"
        raise RuntimeError(f"{s.variant}: no result from the load generator on port {port} ({state})") from e


@dataclass
class Setup:
    """One proxy variant with its own fake P and D (each proxy has its own discovery port)."""

    variant: str
    d_port: int
    d_proc: subprocess.Popen
    proxy_port: int
    proxy_proc: subprocess.Popen


def _spawn(procs: list[subprocess.Popen], cmd: list[str], cwd: str | None = None) -> subprocess.Popen:
    """Start a process of this run (stderr kept for its error message); stopped at the end."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd)
    procs.append(p)
    return p


def start_setup(variant: str, procs: list[subprocess.Popen], router_bin: str = "vllm-router",
                router_policy: str = "round_robin", cprofile: str | None = None) -> Setup:  # fmt: skip
    """``cprofile``: run the proxy under cProfile, its stats written to that file at exit."""
    if variant.partition(":")[0] == "vllm-router":  # "vllm-router:POLICY": the router with that --policy
        return _start_router(procs, router_bin, variant.partition(":")[2] or router_policy, variant)
    # "...@DIR": the proxy of another checkout (e.g. a git worktree of an older commit), for
    # an A/B of two versions in one run; `python -m proxy` imports from its working directory.
    variant_spec, _, checkout = variant.partition("@")
    if checkout and not os.path.isdir(os.path.join(checkout, "proxy")):
        raise SystemExit(f"{checkout!r} has no proxy/ package (variant {variant!r})")
    base, *flags = variant_spec.split("+")
    client, loop, http = base.split("/")
    extra = {
        "expose": ["--expose-routing-headers"],
        "first-token": ["--first-token", "prefill"],
        "decode-first": ["--first-token", "decode"],
    }
    if any(f not in extra for f in flags):
        raise SystemExit(f"unknown variant flag in {variant!r} (known: {', '.join(extra)})")
    py = sys.executable
    disc, p_port, d_port, proxy_port = free_port(), free_port(), free_port(), free_port()

    def spawn(cmd: list[str], cwd: str | None = None) -> subprocess.Popen:
        return _spawn(procs, cmd, cwd)

    fake = [py, *FAKE, "--proxy", f"127.0.0.1:{disc}", "--uvloop", "--role"]
    spawn(fake + ["P", "--port", str(p_port)])
    d_proc = spawn(fake + ["D", "--port", str(d_port)])
    run = ["-c", _CPROFILED, cprofile] if cprofile else ["-m", "proxy"]
    proxy = spawn([py, *run, "--host", "127.0.0.1", "--port", str(proxy_port),
                   "--discovery-host", "127.0.0.1", "--discovery-port", str(disc),
                   "--log-level", "warning", "--upstream-client", client, "--loop", loop,
                   "--http", http,
                   # Every request P then D, as vllm-router does: the short prompts here would
                   # otherwise go to D alone (the shipped local_prefill_threshold).
                   "--local-prefill-threshold", "0", *(a for f in flags for a in extra[f])],
                  cwd=checkout or None)  # fmt: skip
    return Setup(variant, d_port, d_proc, proxy_port, proxy)


def _start_router(procs: list[subprocess.Popen], router_bin: str, policy: str = "round_robin",
                  name: str = "vllm-router") -> Setup:  # fmt: skip
    """vllm-router (Rust) in its vLLM P/D mode, fed by the same fake P and D over its ZMQ
    discovery (they speak the upstream registration format): the side-by-side baseline."""
    py = sys.executable
    disc, p_port, d_port, port = free_port(), free_port(), free_port(), free_port()

    def spawn(cmd: list[str]) -> subprocess.Popen:
        return _spawn(procs, cmd)

    router = spawn([router_bin, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                    "--vllm-discovery-address", f"127.0.0.1:{disc}", "--log-level", "warning",
                    # Its metrics port defaults to a fixed 29000, which a second router (another
                    # run on the same machine) would find taken and exit.
                    "--prometheus-port", str(free_port()),
                    # Its default, cache_aware, sends /v1/completions/render and /tokenize to every
                    # P and D before each request; round_robin is the proxy's default too.
                    "--policy", policy])  # fmt: skip
    fake = [py, *FAKE, "--proxy", f"127.0.0.1:{disc}", "--uvloop", "--role"]
    spawn(fake + ["P", "--port", str(p_port)])
    d_proc = spawn(fake + ["D", "--port", str(d_port)])
    return Setup(name, d_port, d_proc, port, router)


def _ready_path(s: Setup) -> str:
    return "/health" if s.variant.startswith("vllm-router") else "/ready"


def _wait_routed(s: Setup, timeout: float = 30.0) -> None:
    """Until a completion goes through (the router has no readiness endpoint that waits for
    its discovered workers)."""
    body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 2, "stream": True}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", s.proxy_port), timeout=2) as c:
                c.sendall(
                    f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                    + body
                )
                if c.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{s.variant} routes no completion after {timeout}s")


def profile(s: Setup, args: argparse.Namespace) -> None:
    """Sample the proxy of ``s`` with py-spy (Python stacks, 500 Hz, the proxy not paused)
    while the load generator runs at the largest concurrency; print where its time goes
    (functions by own and inclusive share of the samples) and keep the raw stacks."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    out = f"{args.profile_out}.{s.variant.replace('/', '-')}.txt"
    seconds = max(1, int(args.profile))
    sampler = subprocess.Popen(
        [
            spy,
            "record",
            "--format",
            "raw",
            "--rate",
            "500",
            "--nonblocking",
            "--duration",
            str(seconds),
            "--pid",
            str(s.proxy_proc.pid),
            "-o",
            out,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_args = argparse.Namespace(**{**vars(args), "duration": seconds + 1.0, "warmup": 0.5})
    measure(s.proxy_port, s.proxy_proc.pid, max(args.concurrency), run_args)
    if sampler.wait(timeout=60) != 0:
        raise SystemExit(f"py-spy failed: {sampler.stderr.read()[-1000:]}")
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    with open(out) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not n.isdigit():
                continue
            total += int(n)
            frames = [re.sub(r":\d+\)$", ")", fr) for fr in stack.split(";")]  # by function, not line
            own[frames[-1]] = own.get(frames[-1], 0) + int(n)
            for fr in set(frames):
                incl[fr] = incl.get(fr, 0) + int(n)
    print(f"\nprofile of {s.variant} at c={max(args.concurrency)}: {total} samples over {seconds}s "
          f"(raw stacks: {out}; C time shows as the Python line that called it)")  # fmt: skip
    top = sorted(own.items(), key=lambda kv: -kv[1])[:25]
    top_incl = sorted(incl.items(), key=lambda kv: -kv[1])[:25]
    print(f"{'own':>6}  {'function':<70} {'incl':>6}  function")
    for (f1, n1), (f2, n2) in zip(top, top_incl):
        print(f"{100 * n1 / total:>5.1f}%  {f1[:70]:<70} {100 * n2 / total:>5.1f}%  {f2[:70]}")


# `python -m proxy` with cProfile on between SIGUSR1 and SIGUSR2 (the measured window: no start-up,
# no warm-up), timed by CPU time (cProfile's default, the wall clock, counts the time a loaded
# machine's scheduler keeps the proxy off a CPU); the stats are written at exit.
_CPROFILED = """import cProfile, runpy, signal, sys, time
out = sys.argv.pop(1)
prof = cProfile.Profile(time.process_time)
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
signal.signal(signal.SIGUSR2, lambda *_: prof.disable())
try:
    runpy.run_module("proxy", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
finally:
    prof.dump_stats(out)
"""


def cprofile(variant: str, args: argparse.Namespace) -> None:
    """A fresh setup of ``variant`` with its proxy under cProfile (deterministic: every Python
    call counted, each made slower), driven at the largest concurrency for --cprofile seconds;
    prints the functions by own time and the Python calls per request. Slower than the
    measured proxies: read shares and call counts, not times."""
    import pstats

    out = f"{args.profile_out}.{variant.replace('/', '-')}.prof"
    procs: list[subprocess.Popen] = []
    try:
        s = start_setup(variant, procs, cprofile=out)
        wait_http(s.d_port, "/health")
        wait_http(s.proxy_port, "/ready")
        _wait_routed(s)
        cmd = [sys.executable, "-m", "scripts.bench_proxy", "--loadgen", "--port", str(s.proxy_port),
               "--concurrency", str(max(args.concurrency)), "--duration", str(args.cprofile), "--warmup", "1",
               "--tokens", str(args.tokens), "--prompt-chars", str(args.prompt_chars),
               *(["--chat"] if args.chat else [])]  # fmt: skip
        gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        time.sleep(1)  # the load generator's warm-up
        s.proxy_proc.send_signal(signal.SIGUSR1)
        time.sleep(args.cprofile)
        s.proxy_proc.send_signal(signal.SIGUSR2)
        r = json.loads(gen.communicate(timeout=args.cprofile + 60)[0].strip().splitlines()[-1])
        s.proxy_proc.send_signal(signal.SIGTERM)
        s.proxy_proc.wait(timeout=60)
    finally:
        stop_all(procs)
    stats = pstats.Stats(out)
    # Requests read while profiled (read_body runs once a request); the load generator's own count
    # covers a window shifted by its start-up.
    served = max(1, next((v[1] for (file, _, fn), v in stats.stats.items()  # type: ignore[attr-defined]
                          if fn == "read_body" and file.endswith(os.path.join("proxy", "asgi.py"))), r["n"]))
    calls = sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.stats.values()) or 1.0  # type: ignore[attr-defined]
    print(f"\ncProfile of {variant} at c={max(args.concurrency)}: {served} requests in {args.cprofile:g}s, "
          f"{calls / served:.0f} Python calls and {1000 * total / served:.3f} ms CPU a request under the profiler "
          f"(stats: {out}); top by own time:")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.cprofile_top]  # type: ignore[attr-defined]
    print(f"{'own %':>6} {'own us/req':>10} {'calls/req':>9}  function")
    for (file, line, fn), (_, ncalls, tt, _, _) in rows:
        where = f"{os.path.relpath(file, ROOT) if file.startswith(ROOT) else os.path.basename(file)}:{line}"
        print(f"{100 * tt / total:>5.1f}% {1e6 * tt / served:>10.1f} {ncalls / served:>9.2f}  {fn} ({where})")


def perf_split(s: Setup, args: argparse.Namespace) -> None:
    """Sample the proxy of ``s`` with perf (cpu-clock: only while it runs on a CPU) while the
    load generator runs at the largest concurrency, and print its CPU by binary: the kernel
    (system calls), the interpreter (Python code), uvloop, httptools, orjson, libc. py-spy
    (--profile) counts a thread that waits for a CPU as busy: on a loaded machine it inflates
    what precedes a wake-up (a socket write, the event loop's poll); perf does not, but sees
    no Python function names."""
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("--perf needs perf (linux-tools)")
    out = f"{args.profile_out}.{s.variant.replace('/', '-')}.perf.data"
    seconds = max(1, int(args.perf))
    sampler = subprocess.Popen([perf, "record", "-q", "-e", "cpu-clock", "-F", "999", "-p", str(s.proxy_proc.pid),
                                "-o", out, "--", "sleep", str(seconds)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    run_args = argparse.Namespace(**{**vars(args), "duration": seconds + 1.0, "warmup": 0.5})
    measure(s.proxy_port, s.proxy_proc.pid, max(args.concurrency), run_args)
    if sampler.wait(timeout=60) != 0:
        raise SystemExit(f"perf record failed: {sampler.stderr.read()[-1000:]}")
    report = subprocess.run([perf, "report", "-i", out, "--sort", "dso", "--stdio", "-q"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    rows = [line.split(None, 1) for line in report.stdout.splitlines()]
    print(f"\nCPU of {s.variant} at c={max(args.concurrency)} by binary (perf cpu-clock, {seconds}s; data: {out})")
    for share, dso in [r for r in rows if len(r) == 2 and r[0].endswith("%")][:12]:
        print(f"{share:>8}  {dso.strip()}")


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in reversed(procs):
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def bench(args: argparse.Namespace) -> int:
    procs: list[subprocess.Popen] = []
    variants = args.variants or [f"{args.upstream_client}/{args.loop}/{args.http}"]
    try:
        setups = [start_setup(v, procs, args.router_bin, args.router_policy) for v in variants]
        for s in setups:
            wait_http(s.d_port, "/health")
            wait_http(s.proxy_port, _ready_path(s))
            _wait_routed(s)
        base = setups[0]
        direct: dict[int, list[Run]] = {c: [] for c in args.concurrency}
        via: dict[tuple[str, int], list[Run]] = {(s.variant, c): [] for s in setups for c in args.concurrency}
        # Rounds interleave direct and every variant, alternating their order, so that load
        # from other processes on a shared machine hits all of them alike.
        for r in range(args.rounds):
            for c in args.concurrency:
                order = setups if r % 2 == 0 else setups[::-1]
                direct[c].append(_measure(base, base.d_port, base.d_proc, c, args))
                for s in order:
                    via[(s.variant, c)].append(_measure(s, s.proxy_port, s.proxy_proc, c, args))
                print(f"  round {r + 1}/{args.rounds} c={c}: direct {direct[c][-1].rps:.0f} req/s, "
                      + ", ".join(f"{s.variant} {via[(s.variant, c)][-1].rps:.0f}" for s in setups),
                      file=sys.stderr, flush=True)  # fmt: skip
        results = {
            s.variant: {c: (median_run(direct[c]), median_run(via[(s.variant, c)])) for c in args.concurrency}
            for s in setups
        }
        report(results, args)
        report_ratios(via, args)
        if args.profile:
            for s in setups:
                if not s.variant.startswith("vllm-router"):
                    profile(s, args)
        if args.perf:
            for s in setups:
                perf_split(s, args)
        if args.cprofile:
            for s in setups:
                if not s.variant.startswith("vllm-router"):
                    cprofile(s.variant, args)
        for s in setups:
            s.proxy_proc.send_signal(signal.SIGTERM)
            if s.proxy_proc.wait(timeout=30) != 0:
                print(f"proxy {s.variant} exited {s.proxy_proc.returncode}: "
                      f"{s.proxy_proc.stderr.read()[-2000:]}", file=sys.stderr)  # fmt: skip
    finally:
        stop_all(procs)
    return 0


def report_ratios(via: dict[tuple[str, int], list[Run]], args: argparse.Namespace) -> None:
    """Each variant's CPU per request over the router's measured in the same round, the median
    (and range) over the rounds: load from other processes that drifts between rounds cancels
    out, which the medians of each variant alone do not (a loaded box moves them by 2x)."""
    routers = [v for v, _ in via if v.startswith("vllm-router")]
    if not routers or args.rounds < 2:
        return
    base = routers[0]
    print(f"\nCPU per request / {base}'s in the same round, median (range) of {args.rounds} rounds:")
    for (variant, c), runs in via.items():
        if variant == base:
            continue
        ratios = sorted(r.cpu_ms / b.cpu_ms for r, b in zip(runs, via[(base, c)], strict=True) if b.cpu_ms)
        if ratios:
            print(f"  {variant:<40} c={c:<3} {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})")


def report(results: dict[str, dict[int, tuple[Run, Run]]], args: argparse.Namespace) -> None:
    rounds = f", median of {args.rounds} interleaved rounds" if args.rounds > 1 else ""
    kind = "chat completions" if args.chat else "completions"
    print(f"\nxPyD proxy benchmark: streaming {kind}, {args.tokens} tokens, "
          f"{len(prompt_text(args.prompt_chars))}-token prompt, fake P/D "
          f"instances, {os.cpu_count()} CPUs, {args.duration:g}s per point{rounds}")  # fmt: skip
    print("direct = load generator -> D;  proxy = load generator -> proxy -> P then D")
    hdr = (f"{'variant':<31} {'c':>3} | {'direct':>7} {'proxy':>7} {'ratio':>5} | "
           f"{'p50 d':>6} {'p50 px':>6} {'+p50':>6} {'+p99':>6} {'x p50':>5} | "
           f"{'D cpu':>6} {'px cpu':>6} {'sys':>4} {'x':>4} | {'px r/w':>9} | err")  # fmt: skip
    print(hdr)
    print(f"{'':<31} {'':>3} | {'req/s':>7} {'req/s':>7} {'':>5} | {'ms':>6} {'ms':>6} "
          f"{'ms':>6} {'ms':>6} {'':>5} | {'ms/req':>6} {'ms/req':>6} {'':>4} {'':>4} | "
          f"{'calls/req':>9} |")  # fmt: skip
    print("-" * len(hdr))
    for variant, rows in results.items():
        for c, (d, p) in rows.items():
            cpu_x = p.cpu_ms / d.cpu_ms if d.cpu_ms else float("nan")
            sys_share = f"{100 * p.sys_ms / p.cpu_ms:3.0f}%" if p.cpu_ms else "  - "
            print(f"{variant:<31} {c:>3} | {d.rps:>7.0f} {p.rps:>7.0f} {p.rps / d.rps:>5.2f} | "
                  f"{d.p50:>6.2f} {p.p50:>6.2f} {p.p50 - d.p50:>6.2f} {p.p99 - d.p99:>6.2f} "
                  f"{p.p50 / d.p50:>5.2f} | {d.cpu_ms:>6.3f} {p.cpu_ms:>6.3f} {sys_share:>4} {cpu_x:>4.1f} | "
                  f"{p.reads:>4.1f}/{p.writes:<4.1f} | {d.errors + p.errors}")  # fmt: skip
    print(
        "ratio = proxy/direct req/s; +p50/+p99 = latency the proxy adds; x p50 = proxy/direct "
        "p50; D cpu = fake D's CPU per request in the direct run; sys = the share of px cpu spent in the kernel "
        "(system calls); x = proxy CPU / D CPU; "
        "px r/w = the proxy's read-like/write-like system calls per request (/proc/<pid>/io)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--duration", type=float, default=3.0, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--prompt-chars",
        type=int,
        default=0,
        help="prompt length in characters, which the fake P counts as tokens (default: a "
        "17-token prompt); e.g. 1000 for a 1k-token prompt",
    )
    ap.add_argument(
        "--chat", action="store_true", help="stream chat completions (a role chunk first) instead of completions"
    )
    ap.add_argument("--upstream-client", default="native", choices=("native", "aiohttp", "httpx"))
    ap.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"))
    ap.add_argument("--http", default="httptools", choices=("httptools", "h11"))
    ap.add_argument("--variants", nargs="*",
                    help="client/loop/http[+expose|+first-token|+decode-first][@DIR] combinations to compare "
                         "(@DIR: the proxy of another checkout, e.g. a git worktree of an older commit), "
                         "or vllm-router (its --policy: --router-policy; vllm-router:POLICY for another)")  # fmt: skip
    ap.add_argument(
        "--router-bin",
        default="vllm-router",
        help="vllm-router executable for the vllm-router variant (pip install vllm-router==0.1.17)",
    )
    ap.add_argument("--router-policy", default="round_robin",
                    help="the router's --policy (its own default, cache_aware, asks every instance to render and "
                         "tokenize each request first: 2 more requests per instance)")  # fmt: skip
    ap.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after the measurements, sample each xPyD proxy with py-spy for SECONDS at the "
        "largest concurrency and print where its CPU goes",
    )
    ap.add_argument("--perf", type=float, default=0.0, metavar="SECONDS",
                    help="after the measurements, sample each proxy (the router too) with perf for SECONDS at the "
                         "largest concurrency and print its CPU by binary: kernel, interpreter, uvloop...")  # fmt: skip
    ap.add_argument("--cprofile", type=float, default=0.0, metavar="SECONDS",
                    help="after the measurements, run a fresh setup of each xPyD variant with its proxy under cProfile "
                         "for SECONDS at the largest concurrency and print its functions by own time and the Python "
                         "calls a request (counts all CPU in Python, none of the waiting py-spy counts)")  # fmt: skip
    ap.add_argument("--cprofile-top", type=int, default=25, help="rows of the --cprofile table")
    ap.add_argument(
        "--profile-out",
        default="/tmp/xpyd-proxy-profile",
        help="prefix of the raw py-spy stack files (one per variant)",
    )
    # internal: load generator mode
    ap.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loadgen:
        args.concurrency = args.concurrency[0]
        loadgen_main(args)
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())

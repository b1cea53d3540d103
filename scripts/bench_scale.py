#!/usr/bin/env python3
"""The proxy at scale (issue 39, goal 4): 8 P and 8 D fake vLLM instances, N = 1, 2, 4 xPyD
proxies behind haproxy, against N vllm-routers behind the same haproxy at the same load.

Every process is started once: the fakes (tests/support/fake_vllm.py's server, one process each,
registering with every proxy's and every router's discovery port), the proxies, the
routers and one haproxy per setup (xpyd_deploy/haproxy_cfg.py's shipped configuration, with
its access log off and, for backends with no /ready, a /health check). Then, for each
concurrency, rounds interleave the setups (their order alternating), so that load from
other processes on a shared machine hits each of them alike; medians are reported.

Setups:
    direct      load generator -> one fake D (the load generator's own ceiling here)
    lb->D       load generator -> haproxy -> the 8 fake D (the baseline: no proxy)
    xpyd xN     load generator -> haproxy -> N xPyD proxies -> a fake P, then a fake D
    router xN   load generator -> haproxy -> N vllm-routers  -> a fake P, then a fake D

Per setup: req/s, p50/p99 latency and what it adds to lb->D's in the same round, the CPU
per request of the proxies (all N together, from /proc/<pid>/stat), of haproxy and of the
fakes, the load generator's share of a core (a share near 1.0 would make it the
bottleneck), and the machine's busy share (/proc/stat: other people's processes included).

    .venv/bin/python -m scripts.bench_scale --quick --router-bin PATH/vllm-router   # ~3 min
    .venv/bin/python -m scripts.bench_scale --router-bin PATH --concurrency 64 256 512 --rounds 5

The load generator is bench_proxy.py's (keep-alive raw HTTP/1.1, streaming completions).
Loopback only; every process it starts is stopped by PID at the end.

Reading it: on a machine with fewer cores than processes (2 cores here: 16 fakes, the proxies,
haproxy and the load generator) every setup shares the same cores, so req/s cannot grow with N
and "busy" reads 1.0; what such a run shows is CPU per request and its ratio to the router's.
Req/s growing with N (the goal: linear) needs a core per proxy beside the fakes' and the load
generator's: on 16 cores, N = 4 gave 2.4-2.7x the req/s of N = 1 (issue 39).
The load generator is one Python process: where "lg core" nears 1.0 (lb->D on many cores) it,
not the setup, sets the req/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from scripts.bench_proxy import _wait_routed, cpu_seconds, free_port, stop_all, wait_http  # noqa: E402
from xpyd_deploy.haproxy_cfg import render_servers  # noqa: E402

BENCH_PROXY = os.path.join(ROOT, "scripts", "bench_proxy.py")
HAPROXY = next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy", "/usr/bin/haproxy")
                if os.access(p, os.X_OK)), "haproxy")  # fmt: skip

# ---------------------------------------------------------------------------- fake mode


async def _fake_main(role: str, port: int, register: list[str], heartbeat: float) -> None:
    """tests/support/fake_vllm.py's server, registering with every address in ``register`` (a fake
    registers with one proxy; here each instance must be known to every proxy and router)."""
    import zmq

    from tests.support.fake_vllm import FakeVLLM
    from xpyd_wire.discovery import encode

    fake = FakeVLLM(role, port=port, record=False, register=False)
    await fake.start()
    ctx = zmq.Context()  # plain sockets: a NOBLOCK send never waits
    socks = []
    for addr in register:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 4)  # a proxy that is gone must not queue heartbeats forever
        s.connect(f"tcp://{addr}")
        socks.append(s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        payload = encode(fake.registration(), None)
        for s in socks:
            try:
                s.send(payload, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that proxy's queue is full (not up yet): the next beat goes
        try:
            await asyncio.wait_for(stop.wait(), heartbeat)
        except TimeoutError:
            pass
    for s in socks:
        s.close(linger=0)
    ctx.term()
    await fake.stop()


# ---------------------------------------------------------------------------- orchestration


@dataclass
class Setup:
    name: str  # "direct", "lb->D", "xpyd x2", "router x4"
    kind: str  # "direct", "lb", "xpyd", "router"
    n: int  # proxies (or routers) behind haproxy
    port: int  # where the load generator sends
    pids: list[int] = field(default_factory=list)  # the proxies' (or routers')
    lb_pid: int | None = None


@dataclass
class Point:
    rps: float
    p50: float
    p99: float
    errors: int
    proxy_ms: float  # CPU per request of the N proxies together
    lb_ms: float  # of haproxy
    fakes_ms: float  # of the 16 fakes together
    loadgen_cores: float  # the load generator's CPU / its wall time (whole life)
    box_busy: float  # share of the machine's CPUs busy in the window (everyone's processes)


def _box_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return sum(v) - idle, sum(v)


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except OSError:
            pass
    return total


def measure(s: Setup, fakes: list[int], c: int, args: argparse.Namespace) -> Point:
    cmd = [sys.executable, BENCH_PROXY, "--loadgen", "--port", str(s.port), "--concurrency", str(c),
           "--duration", str(args.duration), "--warmup", str(args.warmup), "--tokens", str(args.tokens),
           "--prompt-chars", str(args.prompt_chars)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    lb = [s.lb_pid] if s.lb_pid else []
    time.sleep(args.warmup)
    px0, lb0, fk0, box0 = _cpu(s.pids), _cpu(lb), _cpu(fakes), _box_cpu()
    try:
        out, _ = proc.communicate(timeout=args.duration + args.warmup + 90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise RuntimeError(f"{s.name} c={c}: the load generator did not finish") from None
    px1, lb1, fk1, box1 = _cpu(s.pids), _cpu(lb), _cpu(fakes), _box_cpu()
    wall = time.monotonic() - t0
    # The load generator's whole-life CPU (it has exited; its rusage went to us).
    ru = _child_rusage_delta()
    r = json.loads(out.strip().splitlines()[-1])
    n = max(1, r["n"])
    busy = (box1[0] - box0[0]) / max(1, box1[1] - box0[1])
    return Point(r["rps"], r["p50"], r["p99"], r["errors"], (px1 - px0) * 1000 / n, (lb1 - lb0) * 1000 / n,
                 (fk1 - fk0) * 1000 / n, ru / wall, busy)  # fmt: skip


_last_children_cpu = 0.0


def _child_rusage_delta() -> float:
    """CPU seconds of children reaped since the last call (only load generators are reaped
    between two calls: the long-lived processes are reaped at the very end)."""
    global _last_children_cpu  # a counter private to this script's single thread
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    now = ru.ru_utime + ru.ru_stime
    delta, _last_children_cpu = now - _last_children_cpu, now
    return delta


def _haproxy_cfg(tmp: str, name: str, servers: list[tuple[str, str, int]], listen: int, check: str) -> str:
    text = render_servers(name, servers, ("127.0.0.1", listen), ("127.0.0.1", free_port()), "scripts/bench_scale.py")
    # No access log (a line per request would be part of haproxy's CPU here); backends with
    # no /ready (the fakes, vllm-router) are checked on /health.
    text = text.replace("    log stdout format raw local0 info\n", "")
    text = text.replace("option httpchk GET /ready", f"option httpchk GET {check}")
    path = os.path.join(tmp, f"{name}.cfg")
    with open(path, "w") as f:
        f.write(text)
    check_run = subprocess.run([HAPROXY, "-c", "-q", "-f", path], capture_output=True, text=True, timeout=30)
    if check_run.returncode != 0:
        raise SystemExit(f"haproxy -c failed for {name}: {check_run.stdout}{check_run.stderr}")
    return path


def start_all(args: argparse.Namespace, procs: list[subprocess.Popen], tmp: str) -> tuple[list[Setup], list[int]]:
    py = sys.executable

    def spawn(cmd: list[str], cwd: str | None = None) -> subprocess.Popen:
        # stderr to a file of the temp dir: its tail is printed if the process dies early.
        with open(os.path.join(tmp, f"{len(procs)}.log"), "wb") as log:
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL, cwd=cwd)
        procs.append(p)
        return p

    ns = sorted(set(args.proxies))
    most = max(ns)
    checkout = os.path.abspath(args.checkout)

    def listening(
        cmd_for: Callable[[int, int], list[str]], cwd: str | None = None
    ) -> tuple[subprocess.Popen, int, int]:
        """Start a server on two fresh ports (HTTP, discovery) and wait until it accepts a
        connection; a port another process took meanwhile (free_port only names one free
        now) makes it exit: then again on other ports, three times at most."""
        for _ in range(3):
            http, disc = free_port(), free_port()
            p = spawn(cmd_for(http, disc), cwd)
            deadline = time.monotonic() + 60
            while p.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", http), timeout=1).close()
                    return p, http, disc
                except OSError:
                    time.sleep(0.1)
            if p.poll() is None:
                raise RuntimeError(f"{cmd_for(http, disc)[:3]} does not listen on {http} after 60 s")
            procs.remove(p)  # exited: not this run's to stop or to report
        raise RuntimeError(f"{cmd_for(0, 0)[:3]} exited three times (ports taken?)")

    def proxy_cmd(http: int, disc: int) -> list[str]:
        return [py, "-m", "proxy", "--host", "127.0.0.1", "--port", str(http), "--discovery-host", "127.0.0.1",
                "--discovery-port", str(disc), "--log-level", "warning",
                # Every request P then D, as vllm-router does.
                "--local-prefill-threshold", "0", *args.proxy_arg]  # fmt: skip

    def router_cmd(http: int, disc: int) -> list[str]:
        return [args.router_bin, "--host", "127.0.0.1", "--port", str(http), "--vllm-pd-disaggregation",
                "--vllm-discovery-address", f"127.0.0.1:{disc}", "--log-level", "warning",
                "--prometheus-port", str(free_port()), "--policy", args.router_policy]  # fmt: skip

    # The proxies and routers of the largest N; setup xK uses the first K of them.
    px = [listening(proxy_cmd, checkout) for _ in range(most)]
    rt = [listening(router_cmd) for _ in range(most)] if args.router_bin else []
    px_procs, rt_procs = [p for p, _, _ in px], [p for p, _, _ in rt]
    px_ports, rt_ports = [(h, d) for _, h, d in px], [(h, d) for _, h, d in rt]
    register = [f"127.0.0.1:{d}" for _, d in px_ports + rt_ports]
    fake_ports = {role: [free_port() for _ in range(args.instances)] for role in ("P", "D")}
    fakes = []
    for role, ports in fake_ports.items():
        for port in ports:
            fakes.append(spawn([py, "-m", "scripts.bench_scale", "--fake", role, "--fake-port", str(port),
                                "--register", ",".join(register)]))  # fmt: skip
    for port in fake_ports["D"] + fake_ports["P"]:
        wait_http(port, "/health")
    for http, _ in px_ports:
        wait_http(http, "/ready")
    for http, _ in rt_ports:
        wait_http(http, "/health")

    setups = [Setup("direct", "direct", 1, fake_ports["D"][0])]

    def balanced(
        name: str, kind: str, n: int, servers: list[tuple[str, str, int]], check: str, pids: list[int]
    ) -> Setup:
        port = free_port()
        cfg = _haproxy_cfg(tmp, name.replace(" ", "").replace(">", "").replace("-", "_"), servers, port, check)
        lb = spawn([HAPROXY, "-f", cfg, "-db", "-p", os.path.join(tmp, f"{port}.pid")])
        return Setup(name, kind, n, port, pids, lb.pid)

    setups.append(
        balanced(
            "lb->D",
            "lb",
            len(fake_ports["D"]),
            [(f"d{i}", "127.0.0.1", p) for i, p in enumerate(fake_ports["D"])],
            "/health",
            [],
        )
    )
    for n in ns:
        setups.append(balanced(f"xpyd x{n}", "xpyd", n, [(f"p{i}", "127.0.0.1", px_ports[i][0]) for i in range(n)],
                               "/ready", [p.pid for p in px_procs[:n]]))  # fmt: skip
    for n in ns if rt_procs else []:
        setups.append(balanced(f"router x{n}", "router", n,
                               [(f"r{i}", "127.0.0.1", rt_ports[i][0]) for i in range(n)], "/health",
                               [p.pid for p in rt_procs[:n]]))  # fmt: skip
    # Every instance known to every proxy and router: a few heartbeats, then a completion
    # through each setup; the warm-up of the first round's measurements does the rest.
    time.sleep(max(2.0, 2.5 * args.heartbeat))
    for s in setups:
        _wait_routed(argparse.Namespace(proxy_port=s.port, variant=s.name))  # type: ignore[arg-type]
    return setups, [p.pid for p in fakes]


def bench(args: argparse.Namespace) -> int:
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="xpyd-bench-scale-") as tmp:
        try:
            try:
                setups, fakes = start_all(args, procs, tmp)
            except (RuntimeError, OSError):
                _print_dead(procs, tmp)
                raise
            _child_rusage_delta()  # nothing reaped yet; start the counter
            points: dict[tuple[str, int], list[Point]] = {(s.name, c): [] for s in setups for c in args.concurrency}
            for r in range(args.rounds):
                for c in args.concurrency:
                    order = setups if r % 2 == 0 else setups[::-1]
                    for s in order:
                        points[(s.name, c)].append(measure(s, fakes, c, args))
                    print(f"  round {r + 1}/{args.rounds} c={c}: "
                          + ", ".join(f"{s.name} {points[(s.name, c)][-1].rps:.0f}" for s in setups),
                          file=sys.stderr, flush=True)  # fmt: skip
            for p in procs:
                if p.poll() is not None:
                    print(f"warning: process {p.args[:3]} exited early ({p.returncode})", file=sys.stderr)
        finally:
            stop_all(procs)
    rows = report(setups, points, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}, f, indent=1)
    return 0


def _print_dead(procs: list[subprocess.Popen], tmp: str) -> None:
    for i, p in enumerate(procs):
        if p.poll() is not None:
            with open(os.path.join(tmp, f"{i}.log"), "rb") as f:
                tail = f.read()[-1500:].decode(errors="replace")
            print(f"process {' '.join(map(str, p.args[:4]))} exited {p.returncode}:\n{tail}", file=sys.stderr)


def _median(points: list[Point]) -> Point:
    med = statistics.median
    return Point(*(sum(getattr(p, k) for p in points) if k == "errors" else med(getattr(p, k) for p in points)
                   for k in Point.__dataclass_fields__))  # fmt: skip


def _added(points: list[Point], base: list[Point], attr: str) -> float:
    """Median over rounds of (this setup's figure - lb->D's in the same round)."""
    return statistics.median(getattr(p, attr) - getattr(b, attr) for p, b in zip(points, base))


def report(setups: list[Setup], points: dict[tuple[str, int], list[Point]], args: argparse.Namespace) -> list[dict]:
    print(f"\nxPyD at scale: {args.instances} P + {args.instances} D fake instances, streaming completions of "
          f"{args.tokens} tokens, {os.cpu_count()} CPUs, {args.duration:g} s per point, median of {args.rounds} "
          f"interleaved rounds; vllm-router --policy {args.router_policy}")  # fmt: skip
    print(
        "+p50/+p99: added to lb->D (haproxy -> the fake Ds) in the same round; cpu: ms per request "
        "(proxy = the N proxies together); x rt = ours / the router's at the same N"
    )
    hdr = (f"{'setup':<10} {'c':>4} | {'req/s':>6} {'p50':>7} {'p99':>7} {'+p50':>7} {'+p99':>7} | "
           f"{'proxy':>6} {'x rt':>5} {'lb':>6} {'fakes':>6} | {'lg core':>7} {'busy':>5} | err")  # fmt: skip
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for c in args.concurrency:
        base = points[("lb->D", c)]
        meds = {s.name: _median(points[(s.name, c)]) for s in setups}
        for s in setups:
            m = meds[s.name]
            add50 = _added(points[(s.name, c)], base, "p50")
            add99 = _added(points[(s.name, c)], base, "p99")
            peer = meds.get(f"router x{s.n}") if s.kind == "xpyd" else None
            x_rt = m.proxy_ms / peer.proxy_ms if peer and peer.proxy_ms else float("nan")
            px = f"{m.proxy_ms:>6.3f}" if s.pids else f"{'':>6}"
            xr = f"{x_rt:>5.2f}" if peer else f"{'':>5}"
            print(f"{s.name:<10} {c:>4} | {m.rps:>6.0f} {m.p50:>7.2f} {m.p99:>7.2f} {add50:>7.2f} {add99:>7.2f} | "
                  f"{px} {xr} {m.lb_ms:>6.3f} {m.fakes_ms:>6.3f} | {m.loadgen_cores:>7.2f} "
                  f"{m.box_busy:>5.2f} | {m.errors}")  # fmt: skip
            rows.append({"setup": s.name, "kind": s.kind, "n": s.n, "c": c, **asdict(m), "added_p50": add50,
                         "added_p99": add99, "cpu_vs_router": x_rt,
                         "rounds": [asdict(p) for p in points[(s.name, c)]]})  # fmt: skip
        print("-" * len(hdr))
    # Growth from 1 proxy to the most: req/s and CPU per request as ratios to the same kind's
    # at x1; the added p99 in ms (a ratio of two small differences would mean little).
    ns = sorted(set(args.proxies))
    if len(ns) > 1:
        print(f"\ngrowth from x{ns[0]} (req/s and cpu per request / the same kind's at x{ns[0]}; +p99 in ms)")
        print(f"{'kind':<7} {'c':>4} " + " ".join(f"{'x' + str(n) + ' req/s':>10} {'+p99':>6} {'cpu':>5}" for n in ns))
        for c in args.concurrency:
            for kind in ("xpyd", "router"):
                if (f"{kind} x{ns[0]}", c) not in points:
                    continue
                one = _median(points[(f"{kind} x{ns[0]}", c)])
                cells = []
                for n in ns:
                    m = _median(points[(f"{kind} x{n}", c)])
                    a99 = _added(points[(f"{kind} x{n}", c)], points[("lb->D", c)], "p99")
                    cells.append(f"{m.rps / one.rps:>10.2f} {a99:>6.1f} {m.proxy_ms / one.proxy_ms:>5.2f}")
                print(f"{kind:<7} {c:>4} " + " ".join(cells))
    print(
        "\nlg core = the load generator's CPU / its wall time (1.0 = one core: the bottleneck); "
        "busy = the machine's busy share over the window, everyone's processes included"
    )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="c=512 only, 3 rounds of 2 s (the default run is c=64 and 512, 3 rounds of 3 s)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--proxies", type=int, nargs="+", default=[1, 2, 4], help="N proxies behind haproxy")
    ap.add_argument("--instances", type=int, default=8, help="fake P and fake D instances (each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=None, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=0)
    ap.add_argument("--heartbeat", type=float, default=1.0, help="the fakes' registration interval")
    ap.add_argument(
        "--router-bin",
        default=None,
        help="vllm-router executable (pip install vllm-router==0.1.17); without it no router rows",
    )
    ap.add_argument("--router-policy", default="round_robin",
                    help="the routers' --policy (like the proxy's default; the router's own default, cache_aware, "
                         "asks every instance to render and tokenize each request first: with 8 P and 8 D, 32 more "
                         "requests per request)")  # fmt: skip
    ap.add_argument("--checkout", default=ROOT, help="run the proxy of this checkout (default: this one)")
    ap.add_argument("--proxy-arg", action="append", default=[], help="an extra flag for every proxy (repeatable)")
    ap.add_argument("--json", help="write the rows (and every round) here")
    # internal: one fake instance
    ap.add_argument("--fake", choices=("P", "D"), help=argparse.SUPPRESS)
    ap.add_argument("--fake-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--register", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fake:
        import uvloop

        uvloop.run(_fake_main(args.fake, args.fake_port, args.register.split(","), args.heartbeat))
        return 0
    if args.concurrency is None:
        args.concurrency = [512] if args.quick else [64, 512]
    if args.duration is None:
        args.duration = 2.0 if args.quick else 3.0
    if max(args.proxies) < 1 or min(args.proxies) < 1:
        raise SystemExit("--proxies: at least 1")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())

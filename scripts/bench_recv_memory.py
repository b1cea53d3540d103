#!/usr/bin/env python3
"""The receiver's memory over many KV transfers between two processes on loopback: its RSS
(``VmRSS``) and its minor page faults, after a warm-up, per channel and direction.

    python -m scripts.bench_recv_memory [--transfers 1000] [--mib 16] [--tensors 4]
        [--channels stream,zmq] [--directions put,get] [--hold 1] [--json FILE]

PUT: this process sends, a child process's server receives (its figures come back in a
``stats`` call). GET: the child's server sends pre-built tensors, this process receives.
``--hold`` payloads stay held by the receiver (as D's buffer holds KV until it is loaded),
the oldest let go as each new one arrives.

The byte stream (``stream``) reads tensors into memory it reuses (``stream.RecvMemory``):
after the warm-up its RSS stays flat and it takes next to no page faults. zmq alone
(``zmq``: ``byte_stream=False``) receives each message into a fresh allocation: a frame
over glibc's mmap threshold (up to 32 MiB) is a fresh ``mmap``, one fault per 4 KiB page
every time, then ``munmap`` (its RSS stays flat too: the cost is the faults, not a leak).
``CPU ms/GB``: the receiving process's CPU time per GB received, which a loaded machine
disturbs far less than GB/s.
tests/unit/test_transport_recv_memory.py runs this with fewer transfers and asserts both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from connector.transport import TcpTransport, TransportError  # noqa: E402

MiB = 1 << 20
PAGE = 4096


def proc_memory() -> tuple[int, int]:
    """This process's (VmRSS in KiB, minor page faults so far)."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open("/proc/self/stat") as f:
        stat = f.read()
    # Fields after "pid (comm) ": state is field 3, minflt field 10.
    minflt = int(stat[stat.rindex(")") + 2:].split()[7])
    return rss, minflt


def payload(mib: int, tensors: int, seed: int = 0) -> list[torch.Tensor]:
    n = max(1, mib * MiB // tensors)
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for _ in range(tensors)]


# ---------------------------------------------------------------------------- server process


def serve(args: argparse.Namespace) -> None:
    held: deque[list[torch.Tensor]] = deque(maxlen=max(0, args.hold) or None)
    hold = args.hold > 0
    prebuilt = payload(args.mib, args.tensors, seed=1)
    stop = threading.Event()
    srv = TcpTransport(byte_stream=args.channel == "stream")

    def handler(header, tensors):
        op = header.get("op")
        if op == "put":
            if hold:
                held.append(tensors)
            return {}, []
        if op == "get":
            return {}, prebuilt
        if op == "stats":
            rss, minflt = proc_memory()
            return {"rss_kib": rss, "minflt": minflt, "fresh": srv._recv_memory.fresh, "cpu_s": time.process_time()}, []
        if op == "stop":
            stop.set()
        return {}, []

    srv.start("127.0.0.1", 0, handler)
    print(srv.bound_port, flush=True)
    stop.wait(timeout=1800)
    srv.close()


# ---------------------------------------------------------------------------- client


@dataclass
class Result:
    channel: str
    direction: str
    transfers: int
    mib: int
    tensors: int
    rss_warm_mib: float  # the receiver's RSS after the warm-up
    rss_growth_mib: float  # ... and how much it grew over the measured transfers (max - warm)
    faults_per_transfer: float  # the receiver's minor faults per measured transfer
    pages_per_transfer: int  # what a fresh allocation per message would fault in
    fresh: int  # messages that did not fit the reused memory (stream only)
    cpu_ms_per_gb: float  # the receiving process's CPU time (user + sys) per GB received
    gbps: float
    stream_calls: int


def measure(channel: str, direction: str, transfers: int = 1000, mib: int = 16, tensors: int = 4,
            hold: int = 1, warmup: int = 20, start_timeout: float = 60.0) -> Result:
    """``transfers`` calls after ``warmup`` ones; the receiver's RSS and faults around them
    (``start_timeout``: seconds for the receiver process to start, torch's import included)."""
    cmd = [sys.executable, "-m", "scripts.bench_recv_memory", "--serve", "--channel", channel, "--mib", str(mib),
           "--tensors", str(tensors), "--hold", str(hold)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    cli = TcpTransport(byte_stream=channel == "stream")
    peer = None
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=start_timeout)
        if not line or not line[0].strip().isdigit():
            raise RuntimeError(f"server did not start in {start_timeout:g} s")
        peer = f"127.0.0.1:{int(line[0])}"
        src = payload(mib, tensors)
        nbytes = sum(t.numel() for t in src)
        timeout = 30 + nbytes / 1e8
        held: deque[list[torch.Tensor]] = deque(maxlen=max(1, hold))

        def one() -> None:
            if direction == "put":
                cli.call(peer, {"op": "put"}, src, timeout_s=timeout)
            else:
                _, got = cli.call(peer, {"op": "get"}, timeout_s=timeout)
                if hold:
                    held.append(got)
                del got

        def receiver() -> tuple[int, int, int, float]:
            if direction == "put":
                r, _ = cli.call(peer, {"op": "stats"}, timeout_s=10)
                return r["rss_kib"], r["minflt"], r["fresh"], r["cpu_s"]
            rss, minflt = proc_memory()
            return rss, minflt, cli._recv_memory.fresh, time.process_time()

        cli.call(peer, {"op": "ping"}, timeout_s=10)  # learns where the stream is
        for _ in range(warmup):
            one()
        rss0, flt0, fresh0, cpu0 = receiver()
        peak = rss0
        every = max(1, transfers // 10)
        t0 = time.perf_counter()
        for i in range(1, transfers + 1):
            one()
            if i % every == 0:
                peak = max(peak, receiver()[0])
        elapsed = time.perf_counter() - t0
        rss1, flt1, fresh1, cpu1 = receiver()
        # The checkpoints' own faults (a stats call, reading /proc) are counted too: a few each.
        return Result(channel, direction, transfers, mib, tensors, rss0 / 1024, (max(peak, rss1) - rss0) / 1024,
                      (flt1 - flt0) / transfers, -(-nbytes // PAGE), fresh1 - fresh0,
                      (cpu1 - cpu0) * 1e3 / (transfers * nbytes / 1e9), transfers * nbytes / elapsed / 1e9,
                      cli.stream_calls)
    finally:
        if peer is not None:
            try:
                cli.call(peer, {"op": "stop"}, timeout_s=5)
            except TransportError:
                pass  # the server may close before its reply leaves; it exits anyway
        cli.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transfers", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--mib", type=int, default=16, help="MiB per transfer")
    ap.add_argument("--tensors", type=int, default=4, help="tensors (frames) per transfer")
    ap.add_argument("--hold", type=int, default=1, help="payloads the receiver keeps (0: none)")
    ap.add_argument("--channels", default="stream,zmq", type=lambda s: s.split(","))
    ap.add_argument("--directions", default="put,get", type=lambda s: s.split(","))
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--channel", default="stream", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return 0
    rows = []
    print(f"receiver memory over {args.transfers} transfers of {args.mib} MiB ({args.tensors} tensors) after "
          f"{args.warmup} warm-up ones, 2 processes on loopback, holding {args.hold}")
    head = (f"{'channel':>7} {'dir':>4} {'RSS warm MiB':>12} {'RSS growth MiB':>14} {'faults/transfer':>15}"
            f" {'pages/transfer':>14} {'fresh':>5} {'CPU ms/GB':>9} {'GB/s':>5}")
    print(head)
    print("-" * len(head))
    for channel in args.channels:
        for direction in args.directions:
            r = measure(channel, direction, args.transfers, args.mib, args.tensors, args.hold, args.warmup)
            rows.append(asdict(r))
            print(f"{channel:>7} {direction:>4} {r.rss_warm_mib:12.0f} {r.rss_growth_mib:14.1f}"
                  f" {r.faults_per_transfer:15.1f} {r.pages_per_transfer:14d} {r.fresh:5d} {r.cpu_ms_per_gb:9.0f}"
                  f" {r.gbps:5.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

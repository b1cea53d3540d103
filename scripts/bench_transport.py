#!/usr/bin/env python3
"""Benchmark the tcp transport between two processes on loopback against a memory copy.

    python -m scripts.bench_transport [--sizes 1,4,16,64,256] [--repeats 5] [--auth none,mac,curve]
    python -m scripts.bench_transport --device cuda   # NCCL, see scripts/bench_nccl.py

Payload: ``--layers`` bf16 tensors shaped like vLLM CPU KV-cache blocks
``[n_blocks, kv_heads, block_size, 2*head_dim]``, n_blocks chosen so the total is the
requested size. For each size it times (median of ``--repeats``):

* PUT  - client sends the tensors, server replies with an empty header;
* GET  - client sends an empty header, server replies with the tensors (pre-built);
* zPUT, zGET - the same over zmq alone (``byte_stream=False``: what the transport did before
          its byte stream, ``connector/transport/stream.py``);
* copy_ - ``dst.copy_(src)`` into preallocated tensors in this process (the memcpy bar);
* clone - ``src.clone()`` (allocates, so includes page faults like a fresh receive buffer);
* raw   - the same bytes over a plain TCP socket (``sendall`` -> ``recv_into`` a reused
          buffer) between the same two processes: the kernel's loopback ceiling, in PUT's
          direction (client to server); rawG the same in GET's (server to client, asked for
          by an 8-byte request), the like-for-like ceiling of GET.

Copies per byte, each side: one by the kernel on each side in every column. PUT/GET receive
into memory reused across messages; zmq receives each message into a fresh allocation
(page faults on every large one) and hands it from its I/O thread to the caller's.

Repeats are interleaved (PUT, GET, raw, copy_, clone, ... in a new seeded order each
repeat) so that load from other processes on a shared machine hits all columns alike. torch runs single-threaded by
default (``--torch-threads``), so copy_ is a plain one-core memcpy like each TCP side.

Before timing, each size is checked once for bit-identity in both directions (sha256).

``--auth`` lists the KV authentication mechanisms to time side by side (one server
transport each, same secret; see ``connector/transport/auth.py``): ``none`` (no
secret), ``mac`` (a MAC over each header and the frame lengths), ``curve`` (ZMQ CURVE:
authenticated and encrypted). The first is the baseline of the ratios; with more than
one, a second table gives each one's PUT and GET and its ratio to the baseline.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import torch

from connector.transport import KVAuth, TcpTransport, TransportError  # noqa: E402

MiB = 1 << 20
SECRET = "bench-secret"
AUTH_MODES = ("none", "mac", "curve")


def _transport(args, mode: str, byte_stream: bool = True) -> TcpTransport:
    auth = None if mode == "none" else KVAuth.from_secret(SECRET, mode)
    return TcpTransport(sock_buf_bytes=args.sock_buf, auth=auth, byte_stream=byte_stream)


def _sha(tensors) -> list[str]:
    return [hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest() for t in tensors]


def _kv_tensors(size_mib: int, args, seed: int) -> list[torch.Tensor]:
    block_bytes = args.kv_heads * args.block_size * 2 * args.head_dim * 2  # bf16
    n_blocks = max(1, size_mib * MiB // (block_bytes * args.layers))
    gen = torch.Generator().manual_seed(seed)
    shape = (n_blocks, args.kv_heads, args.block_size, 2 * args.head_dim)
    return [torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16) for _ in range(args.layers)]


# ---------------------------------------------------------------------------- server process


RAW_SEND_BACK = 1 << 63  # in the raw baseline's length: send that many bytes back instead


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from the socket (``recv_into``, no copy of ours); False if it closed first."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            return False
        got += k
    return True


def _raw_sink(lsock: socket.socket, stop: threading.Event) -> None:
    """Plain-TCP baseline: read a length-prefixed payload into a reused buffer, ack 1 byte;
    or (RAW_SEND_BACK) send that many bytes from a reused buffer."""
    conn, _ = lsock.accept()
    buf = bytearray()
    with conn:
        while not stop.is_set():
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            n = struct.unpack("<Q", head)[0]
            back = bool(n & RAW_SEND_BACK)
            n &= ~RAW_SEND_BACK
            if len(buf) < n:
                buf = bytearray(n)
            if back:
                conn.sendall(memoryview(buf)[:n])
                continue
            if not _recv_exactly(conn, memoryview(buf)[:n]):
                return
            conn.sendall(b"k")


def serve(args) -> None:
    torch.set_num_threads(args.torch_threads)
    stop = threading.Event()
    store: dict[int, list[torch.Tensor]] = {}

    def handler(header, tensors):
        op = header["op"]
        if op == "put":
            return ({"sha256": _sha(tensors)} if header.get("verify") else {}), []
        if op == "get":
            size = header["size_mib"]
            if size not in store:
                store.clear()
                store[size] = _kv_tensors(size, args, seed=size)
            reply = {"sha256": _sha(store[size])} if header.get("verify") else {}
            return reply, store[size]
        if op == "ping":
            return {}, []
        if op == "stop":
            stop.set()
        return {}, []

    lsock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_sink, args=(lsock, stop), daemon=True).start()
    servers = [_transport(args, mode) for mode in args.auth]
    for srv in servers:
        srv.start("127.0.0.1", 0, handler)
    print(lsock.getsockname()[1], *(srv.bound_port for srv in servers), flush=True)
    stop.wait(timeout=1800)
    for srv in servers:
        srv.close()
    lsock.close()


# ---------------------------------------------------------------------------- client


def run(args) -> int:
    torch.set_num_threads(args.torch_threads)
    cmd = [sys.executable, "-m", "scripts.bench_transport", "--serve", *sys.argv[1:]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=60)
        if not line or len(line[0].split()) != 1 + len(args.auth):
            print("server did not start", file=sys.stderr)
            return 1
        raw_port, *ports = (int(x) for x in line[0].split())
        peers = {mode: f"127.0.0.1:{port}" for mode, port in zip(args.auth, ports)}
        clients = {mode: _transport(args, mode) for mode in args.auth}
        base = args.auth[0]
        peer, cli = peers[base], clients[base]
        zmq_only = _transport(args, base, byte_stream=False)
        raw = socket.create_connection(("127.0.0.1", raw_port), timeout=120)
        print(
            f"tcp transport, 2 processes on loopback; torch threads={torch.get_num_threads()}, "
            f"cpus={os.cpu_count()}, median of {args.repeats} interleaved repeats; GB/s = 1e9 B/s; "
            f"auth={base}"
        )
        hdr = (
            f"{'MiB':>4} {'tensors (bf16)':>20} {'PUT':>6} {'GET':>6} {'zPUT':>6} {'zGET':>6} {'raw':>6} {'rawG':>6}"
            f" {'copy_':>6} {'clone':>6} {'PUT/copy_':>9} {'GET/copy_':>9} {'PUT/raw':>7} {'GET/raw':>7}"
            f" {'GET/rawG':>8} {'zPUT/raw':>8} {'zGET/raw':>8}"
        )
        print(hdr)
        print("-" * len(hdr))
        if len(args.auth) > 1:
            # Per-call cost with no payload (what reserve/abort/release/ping pay), interleaved.
            rtts: dict[str, list[float]] = {m: [] for m in args.auth}
            for _ in range(args.repeats):
                for mode, c in clients.items():
                    c.call(peers[mode], {"op": "ping"}, timeout_s=10)  # warm (and a pooled socket)
                    t0 = time.perf_counter()
                    for _ in range(200):
                        c.call(peers[mode], {"op": "ping"}, timeout_s=10)
                    rtts[mode].append((time.perf_counter() - t0) / 200)
            print("empty call round trip (us): " + ", ".join(
                f"{m} {statistics.median(rtts[m]) * 1e6:.0f}" for m in args.auth) + "; ratio to " + base + ": "
                + ", ".join(f"{m} {statistics.median(rtts[m]) / statistics.median(rtts[base]):.2f}x"
                            for m in args.auth[1:]))
        ok_all = True
        by_auth: list[tuple[float, dict[str, tuple[float, float]]]] = []  # (MiB, mode -> (PUT, GET))
        for size in args.sizes:
            src = _kv_tensors(size, args, seed=size)
            nbytes = sum(t.numel() * t.element_size() for t in src)
            timeout = 30 + nbytes / 1e8  # generous: >= 0.1 GB/s
            # Bit-identity once per size and mechanism, both directions (this also warms up).
            put_ok = get_ok = True
            for mode, c in clients.items():
                reply, _ = c.call(peers[mode], {"op": "put", "verify": True}, src, timeout_s=timeout)
                put_ok &= reply.get("sha256") == _sha(src)
                reply, got = c.call(peers[mode], {"op": "get", "size_mib": size, "verify": True}, timeout_s=timeout)
                get_ok &= reply.get("sha256") == _sha(got) == _sha(src)
                del got
            ok_all &= put_ok and get_ok
            dst = [torch.empty_like(t) for t in src]
            views = [t.reshape(-1).view(torch.uint8).numpy() for t in src]

            def put(mode=base):
                clients[mode].call(peers[mode], {"op": "put"}, src, timeout_s=timeout)

            def get(mode=base):
                clients[mode].call(peers[mode], {"op": "get", "size_mib": size}, timeout_s=timeout)

            def zput():
                zmq_only.call(peer, {"op": "put"}, src, timeout_s=timeout)

            def zget():
                zmq_only.call(peer, {"op": "get", "size_mib": size}, timeout_s=timeout)

            def raw_tcp():
                raw.sendall(struct.pack("<Q", nbytes))
                for v in views:
                    raw.sendall(v)
                assert raw.recv(1) == b"k"

            back = bytearray(nbytes)

            def raw_get():
                raw.sendall(struct.pack("<Q", nbytes | RAW_SEND_BACK))
                if not _recv_exactly(raw, memoryview(back)):
                    raise ConnectionError("raw baseline closed")

            def copy_():
                for d, s in zip(dst, src):
                    d.copy_(s)

            def clone():
                return [s.clone() for s in src]

            others = [m for m in args.auth if m != base]
            fns = (put, get, raw_tcp, copy_, clone, zput, zget, raw_get,
                   *(fn for m in others for fn in (lambda m=m: put(m), lambda m=m: get(m))))
            for fn in fns:  # warm-up
                fn()
            times: list[list[float]] = [[] for _ in fns]
            order = list(range(len(fns)))
            shuffle = random.Random(size).shuffle
            for _ in range(args.repeats):
                # A new order each repeat: what ran just before (allocations freed, caches
                # warmed) then favours no column in particular.
                shuffle(order)
                for i in order:
                    t0 = time.perf_counter()
                    fns[i]()
                    times[i].append(time.perf_counter() - t0)
            rates = [nbytes / statistics.median(ts) / 1e9 for ts in times]
            put_g, get_g, raw_g, copy_g, clone_g, zput_g, zget_g, rawg_g = rates[:8]
            by_auth.append((nbytes / MiB, {base: (put_g, get_g),
                                           **{m: (rates[8 + 2 * i], rates[9 + 2 * i]) for i, m in enumerate(others)}}))
            shape = f"{len(src)}x{list(src[0].shape)}"
            flag = "" if put_ok and get_ok else "  MISMATCH"
            print(
                f"{nbytes / MiB:4.0f} {shape:>20} {put_g:6.2f} {get_g:6.2f} {zput_g:6.2f} {zget_g:6.2f} {raw_g:6.2f}"
                f" {rawg_g:6.2f} {copy_g:6.2f} {clone_g:6.2f} {put_g / copy_g:9.0%} {get_g / copy_g:9.0%}"
                f" {put_g / raw_g:7.0%} {get_g / raw_g:7.0%} {get_g / rawg_g:8.0%} {zput_g / raw_g:8.0%}"
                f" {zget_g / raw_g:8.0%}{flag}",
                flush=True,
            )
            # Release this size's buffers before allocating the next one.
            src = dst = views = back = None  # noqa: F841
        if len(args.auth) > 1:
            print(f"\nauthentication: PUT and GET GB/s per mechanism, and the ratio to {base} (same run)")
            head = f"{'MiB':>4}" + "".join(f" {m + ' PUT':>9} {m + ' GET':>9}" for m in args.auth) + "".join(
                f" {m + '/' + base + ' PUT':>16} {m + '/' + base + ' GET':>16}" for m in args.auth[1:])
            print(head)
            print("-" * len(head))
            for mib, r in by_auth:
                print(f"{mib:4.0f}" + "".join(f" {r[m][0]:9.2f} {r[m][1]:9.2f}" for m in args.auth) + "".join(
                    f" {r[m][0] / r[base][0]:16.0%} {r[m][1] / r[base][1]:16.0%}" for m in args.auth[1:]), flush=True)
        # PUT/GET measure the stream only if they went over it (CURVE has none: zmq both).
        print(f"calls over the byte stream: {cli.stream_calls} (zmq-only client: {zmq_only.stream_calls})")
        try:
            cli.call(peer, {"op": "stop"}, timeout_s=5)
        except TransportError:
            pass  # the server may close its transports before the reply leaves; it exits anyway
        for c in clients.values():
            c.close()
        zmq_only.close()
        raw.close()
        proc.wait(timeout=30)
        print("bit-identical round trips (sha256, both directions):", "yes" if ok_all else "NO")
        return 0 if ok_all else 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16,64,256", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4, help="KV tensors per payload")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sock-buf", type=int, default=None, help="SO_SNDBUF/SO_RCVBUF bytes (default: kernel autotuning)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (copy_/clone)")
    ap.add_argument("--auth", default="none", type=lambda s: s.split(","),
                    help=f"comma-separated KV auth mechanisms to compare, first = baseline ({', '.join(AUTH_MODES)})")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: NCCL between two processes vs tcp and a device copy (scripts/bench_nccl.py)")
    ap.add_argument("--nccl-channels", type=int, default=None, help="--device cuda: NCCL channels (default: NCCL's)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "cuda" and not args.serve:
        from scripts import bench_nccl

        return bench_nccl.run(args)
    if not args.auth or any(m not in AUTH_MODES for m in args.auth) or len(set(args.auth)) != len(args.auth):
        ap.error(f"--auth: distinct values of {AUTH_MODES}")
    if args.serve:
        serve(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

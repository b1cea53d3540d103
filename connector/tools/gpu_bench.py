"""CUDA half of ``scripts/bench_transport.py --device cuda`` (and the figures of ``xpyd doctor``): KV over NCCL between two
processes, against the tcp transport (host staging) between the same processes and a plain
device-to-device copy of the same bytes, all measured in the same run.

    python -m scripts.bench_transport --device cuda [--sizes 1,4,16,64,256] [--repeats 5]

On one GPU the two processes are made two NCCL "hosts" (different NCCL_HOSTID,
NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1), so NCCL uses its socket transport over loopback:
the nccl figures are **loopback-socket** figures, not NVLink or InfiniBand link figures.
Every payload is checked once for bit-identity (sha256) in both directions before timing.
Needs torch with CUDA and libnccl (torch's nvidia-nccl wheel); not vLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import torch

from connector.tools.gpu_peer import child_env, split_host_env
from connector.transport import TcpTransport, TransportError
from connector.transport.nccl import NcclTransport
from connector.transport.nccl_lib import load_nccl_library

MiB = 1 << 20


def kv_tensors(size_mib: int, layers: int, device: str, seed: int) -> list[torch.Tensor]:
    """``layers`` bf16 tensors of whole blocks [n, 8 heads, 16 tokens, 128], ``size_mib`` in all."""
    per_block = 8 * 16 * 128 * 2
    n = max(1, size_mib * MiB // (layers * per_block))
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1 << 15, (n, 8, 16, 128), dtype=torch.int16, generator=g).view(torch.bfloat16).to(device)
            for _ in range(layers)]


def sha(tensors: list[torch.Tensor]) -> list[str]:
    return [hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest() for t in tensors]


def serve(args) -> None:
    """The other process: an nccl and a tcp server with the same handler."""
    device = args.server_device
    store: dict[int, list[torch.Tensor]] = {}
    stop = threading.Event()

    def handler(header, tensors):
        op = header.get("op")
        if op == "put":
            return ({"sha256": sha(tensors)} if header.get("verify") else {}), []
        if op == "get":
            size = header["size_mib"]
            if size not in store:
                store.clear()
                store[size] = kv_tensors(size, args.layers, device, seed=size)
            return ({"sha256": sha(store[size])} if header.get("verify") else {}), store[size]
        if op == "stop":
            stop.set()
        return {}, []

    nccl = NcclTransport(load_nccl_library(), torch.device(device), num_channels=args.nccl_channels)
    nccl.start("127.0.0.1", 0, handler)
    tcp = TcpTransport()
    tcp.start("127.0.0.1", 0, handler)
    print(nccl.bound_port, tcp.bound_port, flush=True)
    stop.wait(timeout=1800)
    nccl.close()
    tcp.close()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str = "cuda") -> float:
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _median_gbs(fn, nbytes: int, repeats: int, device: str, calls: int = 1) -> float:
    """GB/s of ``fn`` (``nbytes`` a call), median of ``repeats`` samples of ``calls`` calls
    in a row. Several calls per sample measure what a transfer sees, one call per layer
    back to back, where one call's launch overlaps the previous one's kernel."""
    fn()  # warm-up (allocator, kernels)

    def many() -> None:
        for _ in range(calls):
            fn()

    return nbytes * calls / statistics.median(_timed(many, device) for _ in range(repeats)) / 1e9


LAYER_CALLS = 8  # gather/scatter calls per timed sample: one per layer of a small model


def bench_layouts(device: str = "cuda", repeats: int = 5, blocks: int = 2048, picked: int = 512) -> list[tuple]:
    """gather_packed / scatter_packed of ``picked`` scattered blocks of one layer, per
    layout, against ``dst.copy_(src)`` of the same bytes on the same device (bar: >= 70 %)."""
    from connector import layout as kvlayout
    from connector.tools.gpu_peer import LAYOUTS, make_caches

    rows = []
    ids = sorted(random.Random(0).sample(range(blocks), picked))
    dst_ids = sorted(random.Random(1).sample(range(blocks), picked))
    for name in sorted(LAYOUTS):
        kv = next(iter(make_caches(name, 1, layers=2, blocks=blocks, heads=8, tokens=16, content=128,
                                   device=device).values()))
        packed = kvlayout.gather_packed(kv, ids)
        nbytes = packed.numel() * packed.element_size()
        plain_src, plain_dst = packed.clone(), torch.empty_like(packed)
        # Ids as index tensors made once, as the connector makes them once per transfer.
        src_idx, dst_idx = kvlayout.index(ids, kv.device), kvlayout.index(dst_ids, kv.device)
        copy = _median_gbs(lambda: plain_dst.copy_(plain_src), nbytes, repeats, device, LAYER_CALLS)
        gather = _median_gbs(lambda: kvlayout.gather_packed(kv, src_idx, out=plain_dst), nbytes, repeats, device,
                             LAYER_CALLS)
        scatter = _median_gbs(lambda: kvlayout.scatter_packed(kv, dst_idx, plain_src), nbytes, repeats, device,
                              LAYER_CALLS)
        rows.append((name, nbytes, gather, scatter, copy))
    print(f"\n{'layout':>6} {'MiB':>6} {'gather':>8} {'scatter':>8} {'copy_':>8}   {'g/copy':>6} {'s/copy':>6}"
          f"   (GB/s, {device}, {picked} of {blocks} blocks, {LAYER_CALLS} calls in a row, medians of {repeats})")
    for name, nbytes, g, sc, c in rows:
        print(f"{name:>6} {nbytes / MiB:>6.1f} {g:>8.1f} {sc:>8.1f} {c:>8.1f}   {g / c:>6.2f} {sc / c:>6.2f}")
    return rows


def bench_staging(repeats: int = 5, sizes_mib: tuple[int, ...] = (4, 64, 256)) -> list[tuple]:
    """Pinned staging (what a decode does with KV beyond its device share): device ->
    a lease of the pool, and back, against cudaMemcpy into a plain pinned tensor."""
    from connector.p2p.staging import PinnedPool

    pool = PinnedPool(max(sizes_mib) * MiB * 2)
    rows = []
    print(f"\n{'MiB':>5} {'D2H pool':>9} {'D2H pin':>9} {'H2D pool':>9} {'H2D pin':>9}   (GB/s, medians of {repeats})")
    for size in sizes_mib:
        n = size * MiB
        dev = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)

        def to_pool():
            lease = pool.alloc(n)
            lease.view(torch.uint8, (n,)).copy_(dev)
            lease.free()

        lease = pool.alloc(n)
        staged = lease.view(torch.uint8, (n,))
        row = (_median_gbs(to_pool, n, repeats, "cuda"),
               _median_gbs(lambda: pinned.copy_(dev), n, repeats, "cuda"),
               _median_gbs(lambda: dev.copy_(staged), n, repeats, "cuda"),
               _median_gbs(lambda: dev.copy_(pinned), n, repeats, "cuda"))
        lease.free()
        rows.append((size, *row))
        print(f"{size:>5} " + " ".join(f"{x:>9.1f}" for x in row))
    return rows


def measure_transfers(sizes: list[int], repeats: int = 5, layers: int = 4, nccl_channels: int | None = None,
                      split_hosts: bool = True, server_device: str = "cuda", timeout_s: float = 120.0) -> dict:
    """NCCL PUT/GET between this process (cuda, the current device) and a server process
    against tcp between the same two and a device copy of the same bytes, in one run.
    Every size is checked for bit-identity both ways before it is timed. Returns
    {"library", "ok", "rows": [{"mib", "nccl_put", "nccl_get", "tcp_put", "d2d_copy"}] (GB/s)}.
    ``split_hosts``: the two processes share a GPU (NCCL_HOSTID trick, loopback sockets);
    False with ``server_device`` on another GPU measures the production path (P2P/SHM)."""
    if split_hosts:
        os.environ.update(split_host_env("xpyd-bench-client"))  # this process only, before NCCL loads
    env = child_env(**(split_host_env("xpyd-bench-server") if split_hosts else {}))
    proc = subprocess.Popen([sys.executable, "-m", "connector.tools.gpu_bench", "--serve", "--layers", str(layers),
                             "--nccl-channels", str(nccl_channels or 0), "--server-device", server_device],
                            stdout=subprocess.PIPE, text=True, env=env)
    out: dict = {"ok": True, "rows": [], "channels": nccl_channels or "auto"}
    try:
        line = proc.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError("bench server did not start")
        nccl_addr, tcp_addr = (f"127.0.0.1:{p}" for p in line)
        lib = load_nccl_library()
        client = NcclTransport(lib, torch.device("cuda", torch.cuda.current_device()), num_channels=nccl_channels)
        tcp = TcpTransport()
        out["library"] = f"{lib.name} {lib.version()}"
        rng = random.Random(0)
        for size in sizes:
            src = kv_tensors(size, layers, "cuda", seed=1000 + size)
            dst = [torch.empty_like(t) for t in src]
            nbytes = sum(t.numel() * t.element_size() for t in src)
            want = sha(src)
            for addr, name in ((nccl_addr, "nccl"), (tcp_addr, "tcp")):
                t = client if name == "nccl" else tcp
                r, _ = t.call(addr, {"op": "put", "verify": True}, src, timeout_s=timeout_s)
                ok = r.get("sha256") == want
                r, back = t.call(addr, {"op": "get", "size_mib": size, "verify": True}, timeout_s=timeout_s)
                ok = ok and r.get("sha256") == sha(back)
                out["ok"] &= ok
                out.setdefault("identical", []).append({"mib": size, "transport": name, "both_ways": ok})
            cols = {
                "nccl_put": lambda: client.call(nccl_addr, {"op": "put"}, src, timeout_s=timeout_s),
                "nccl_get": lambda: client.call(nccl_addr, {"op": "get", "size_mib": size}, timeout_s=timeout_s),
                "tcp_put": lambda: tcp.call(tcp_addr, {"op": "put"}, src, timeout_s=timeout_s),
                "d2d_copy": lambda: [d.copy_(s) for d, s in zip(dst, src, strict=True)],
            }
            times: dict[str, list[float]] = {k: [] for k in cols}
            for _ in range(repeats):
                order = list(cols)
                rng.shuffle(order)  # interleaved: machine noise hits every column alike
                for k in order:
                    times[k].append(_timed(cols[k]))
            out["rows"].append({"mib": size, **{k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}})
        # The server shuts down on "stop": its reply may lose the race with its own close.
        with contextlib.suppress(TransportError):
            client.call(nccl_addr, {"op": "stop"}, timeout_s=10)
        client.close()
        tcp.close()
        proc.wait(timeout=30)
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def measure_transfers_fresh(sizes: list[int], repeats: int = 5, nccl_channels: int | None = None,
                            split_hosts: bool = True, server_device: str = "cuda", timeout_s: float = 300.0) -> dict:
    """``measure_transfers`` in a process of its own. NCCL reads NCCL_HOSTID and the socket
    settings once, at its first communicator: a process that made one already (the doctor's
    one-rank check) would join the server as the same host on the same GPU, which NCCL refuses."""
    cmd = [sys.executable, "-m", "connector.tools.gpu_bench", "--measure", "--sizes", ",".join(map(str, sizes)),
           "--repeats", str(repeats), "--nccl-channels", str(nccl_channels or 0), "--server-device", server_device]
    if not split_hosts:
        cmd.append("--same-host")
    out = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"bench process exited {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def run(args) -> int:
    res = measure_transfers(args.sizes, args.repeats, args.layers, args.nccl_channels)
    print(f"nccl library: {res['library']}; device: {torch.cuda.get_device_name()}")
    print("nccl figures: two processes on one GPU over NCCL's socket transport on loopback "
          "(NCCL_HOSTID trick), not a link figure")
    for row in res.get("identical", []):
        print(f"{row['mib']} MiB {row['transport']}: bit-identical both ways: {'yes' if row['both_ways'] else 'NO'}")
    print(f"\n{'MiB':>5} {'nccl PUT':>9} {'nccl GET':>9} {'tcp PUT':>9} {'d2d copy':>9}   "
          f"{'nccl/tcp':>8} {'nccl/d2d':>8}   (GB/s, medians of {args.repeats})")
    for g in res["rows"]:
        print(f"{g['mib']:>5} {g['nccl_put']:>9.2f} {g['nccl_get']:>9.2f} {g['tcp_put']:>9.2f} {g['d2d_copy']:>9.1f}   "
              f"{g['nccl_put'] / g['tcp_put']:>8.2f} {g['nccl_put'] / g['d2d_copy']:>8.3f}")
    bench_layouts("cuda", args.repeats)
    bench_staging(args.repeats)
    return 0 if res["ok"] else 1


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true", help="the server process")
    ap.add_argument("--measure", action="store_true", help="only the transfers, as one JSON line (the doctor's)")
    ap.add_argument("--sizes", default="4,64,256", help="MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--same-host", action="store_true", help="--measure: no NCCL_HOSTID split (server on another GPU)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--nccl-channels", type=int, default=0)
    ap.add_argument("--server-device", default="cuda")
    args = ap.parse_args()
    args.nccl_channels = args.nccl_channels or None
    args.sizes = [int(x) for x in args.sizes.split(",")]
    if args.serve:
        serve(args)
    elif args.measure:
        res = measure_transfers(args.sizes, args.repeats, args.layers, args.nccl_channels,
                                split_hosts=not args.same_host, server_device=args.server_device)
        print(json.dumps(res), flush=True)
    else:
        return run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

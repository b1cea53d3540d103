#!/usr/bin/env python3
"""SharedStorageConnector benchmark.

1. Store and load throughput (GB/s) of 1-256 MiB of KV through the connector's
   worker engine (gather out of a KV cache + writer thread writing one file per
   block, atomic rename; loader thread reading + CRC check + scatter into another
   cache), against a plain single-file write/read of the same bytes in the same
   run, on tmpfs (/dev/shm) and a disk filesystem (a directory under --disk-dir).
   Reads follow the writes, so both sides read from the page cache. "same thread"
   is the file format's own cost (write/read + CRC per block file, no hand-off to
   the writer/loader thread): the gap to it is thread wake-up latency, which grows
   with CPU contention.
2. TTFT on vLLM CPU of a prompt whose blocks a producer stored vs the same-length
   prompt recomputed, on one consumer instance (P stores, D loads), medians.

    .venv/bin/python -m scripts.bench_shared_storage                # both parts
    .venv/bin/python -m scripts.bench_shared_storage --skip-ttft    # throughput only
    flock /tmp/xpyd-vllm.lock .venv/bin/python -m scripts.bench_shared_storage --quick

Loopback only; every process started here is stopped by its process group.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

from connector import layout as kvlayout  # noqa: E402
from connector.shared_storage import keys as kvkeys  # noqa: E402
from connector.shared_storage.engine import StorageEngine, file_meta  # noqa: E402
from connector.shared_storage.metadata import FetchSpec, StoreSpec  # noqa: E402
from connector.shared_storage.store import BlockStore  # noqa: E402

MiB = 1 << 20
# One block: 8 layers x [8 kv heads, 16 tokens, 2 x 128] bf16 = 1 MiB (a GPU-like
# block of a mid-size model; the CPU backend's 128-token blocks are bigger still).
LAYERS = 8
BLOCK_SHAPE = (8, 16, 256)


# ----------------------------------------------------------------------------- throughput


def _engine(root: Path, caches: dict[str, torch.Tensor]) -> StorageEngine:
    lay = kvlayout.BlockLayout("LBHNC", "bfloat16", BLOCK_SHAPE, True)
    meta = file_meta("bench", BLOCK_SHAPE[1], lay, list(caches), 0, 1)
    return StorageEngine(BlockStore(root, meta), caches, lay, 0, 1 << 34, 30.0)


def _caches(n_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn((n_blocks, *BLOCK_SHAPE), generator=g).to(torch.bfloat16)
            for i in range(LAYERS)}


def _plain(path: Path, data: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """Seconds to write ``data`` as one file and to read it back into ``out``."""
    src = memoryview(data.view(torch.uint8).numpy())
    dst = memoryview(out.view(torch.uint8).numpy())
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(src)
    t1 = time.perf_counter()
    with open(path, "rb") as f:
        n = f.readinto(dst)
    t2 = time.perf_counter()
    assert n == len(src)
    path.unlink()
    return t1 - t0, t2 - t1


def _clear(root: Path) -> None:
    for sub in root.iterdir():
        if sub.is_dir():
            shutil.rmtree(sub, ignore_errors=True)


def throughput(fs_name: str, base: Path, sizes_mib: list[int], reps: int) -> list[dict]:
    """Engines live as long as in a server (threads started once); every repetition
    stores new keys into an emptied directory, so every block is really written."""
    rows = []
    block_bytes = LAYERS * BLOCK_SHAPE[0] * BLOCK_SHAPE[1] * BLOCK_SHAPE[2] * 2
    n_max = max(sizes_mib) * MiB // block_bytes
    src, dst = _caches(n_max, 1), _caches(n_max, 2)
    root = Path(tempfile.mkdtemp(prefix="xpyd-ss-bench-", dir=base))
    ea, eb = _engine(root, src), _engine(root, dst)
    try:
        for size in sizes_mib:
            n = size * MiB // block_bytes
            st, ld, pw, pr, dw, dr = [], [], [], [], [], []
            for rep in range(reps + 1):  # the first round warms up and is not counted
                _clear(root)
                seed = kvkeys.root(f"bench-{size}-{rep}", 16)
                ks = tuple(k.hex() for k in kvkeys.chain(seed, list(range(n * 16)), 16))
                ids = tuple(range(n))
                t0 = time.perf_counter()
                ea.submit_store(StoreSpec("s", ids, ks, 0))
                assert ea.flush(600)
                t1 = time.perf_counter()
                eb.submit_load(FetchSpec("l", tuple(reversed(ids)), ks, 0, 0.0))
                while True:
                    r = eb.poll(set())
                    if "l" in r.finished:
                        break
                    time.sleep(0.0002)
                t2 = time.perf_counter()
                assert not r.invalid_block_ids
                name = next(iter(src))
                assert torch.equal(dst[name][n - 1], src[name][0])
                # The same format work in this thread (no writer/loader hand-off).
                _clear(root)
                blocks = torch.stack([src[k][:n] for k in src], dim=1)  # gather: [n, layers, ...]
                t3 = time.perf_counter()
                for i in range(n):
                    ea.store.write(ks[i], i, blocks[i])
                t4 = time.perf_counter()
                out = torch.empty_like(blocks)
                for i in range(n):
                    eb.store.read_into(ks[i], out[i])
                t5 = time.perf_counter()
                assert torch.equal(out, blocks)
                flat_src = torch.cat([src[k][:n].reshape(-1) for k in src])
                flat_dst = torch.empty_like(flat_src)
                w, rd = _plain(root / "plain.bin", flat_src, flat_dst)
                if rep:
                    dw.append(t4 - t3)
                    dr.append(t5 - t4)
                    st.append(t1 - t0)
                    ld.append(t2 - t1)
                    pw.append(w)
                    pr.append(rd)
            nbytes = n * block_bytes
            gbs = lambda xs: nbytes / statistics.median(xs) / 1e9  # noqa: E731
            rows.append({"fs": fs_name, "mib": size, "blocks": n, "store": gbs(st), "plain_write": gbs(pw),
                         "load": gbs(ld), "plain_read": gbs(pr),
                         "direct_write": gbs(dw), "direct_read": gbs(dr)})
            r = rows[-1]
            print(f"{fs_name:6} {size:4} MiB {n:4} files | store {r['store']:5.2f} GB/s (same thread "
                  f"{r['direct_write']:5.2f}) plain write {r['plain_write']:5.2f} "
                  f"ratio {r['store'] / r['plain_write']:4.2f}"
                  f" | load {r['load']:5.2f} GB/s (same thread {r['direct_read']:5.2f}) plain read "
                  f"{r['plain_read']:5.2f} ratio {r['load'] / r['plain_read']:4.2f}", flush=True)
    finally:
        ea.close()
        eb.close()
        shutil.rmtree(root, ignore_errors=True)
    return rows


# ----------------------------------------------------------------------------- TTFT


def ttft(args: argparse.Namespace) -> None:
    import httpx

    from connector.shared_storage.config import kv_transfer_config
    from scripts import bench_e2e  # scripts/bench_e2e.py: the bench model and exact-length prompts
    from tests.support import cluster

    model = bench_e2e.ensure_model(args.model)
    prompts = bench_e2e.Prompts(model, seed=7)
    store = Path(tempfile.mkdtemp(prefix="xpyd-ss-ttft-", dir=args.disk_dir))
    log_dir = Path(tempfile.mkdtemp(prefix="xpyd-ss-ttft-logs-"))
    p_port, d_port = cluster.free_port(), cluster.free_port()
    p = cluster.start_vllm("prefill", p_port, log_dir, model=model,
                           kv_config=kv_transfer_config("kv_producer", store, kv_port=cluster.free_port()))
    d = cluster.start_vllm("decode", d_port, log_dir, model=model,
                           kv_config=kv_transfer_config("kv_consumer", store, kv_port=cluster.free_port()))
    try:
        cluster.wait_until([p, d], "/health", 600)
        body = lambda pr: {"model": bench_e2e.MODEL_NAME, "prompt": pr, "max_tokens": 1,  # noqa: E731
                           "temperature": 0}
        with httpx.Client(timeout=300) as c:
            def timed(url: str, pr: str) -> float:
                t0 = time.perf_counter()
                r = c.post(url + "/v1/completions", json=body(pr))
                r.raise_for_status()
                return time.perf_counter() - t0

            for _ in range(2):  # warm both servers up
                timed(p.url, prompts.make(args.tokens))
                timed(d.url, prompts.make(args.tokens))
            loaded, recomputed = [], []
            for i in range(args.ttft_n):
                stored = prompts.make(args.tokens)
                timed(p.url, stored)  # P stores its full blocks
                want = args.tokens // 128
                deadline = time.monotonic() + 30
                while len(list(store.rglob("*.kv"))) < want * (i + 1) + 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                fresh = prompts.make(args.tokens)
                # Alternate the order so drift hits both alike.
                pair = [("loaded", stored), ("recomputed", fresh)]
                for kind, pr in pair if i % 2 == 0 else reversed(pair):
                    (loaded if kind == "loaded" else recomputed).append(timed(d.url, pr))
        med_l, med_r = statistics.median(loaded), statistics.median(recomputed)
        print(f"TTFT on vLLM CPU, {args.model} model, {args.tokens}-token prompt, n={args.ttft_n}: "
              f"stored prefix {med_l * 1e3:.1f} ms vs recomputed {med_r * 1e3:.1f} ms (median), "
              f"ratio {med_r / med_l:.2f}x")
        print(f"  loaded:     {[round(x * 1e3, 1) for x in loaded]}")
        print(f"  recomputed: {[round(x * 1e3, 1) for x in recomputed]}")
        n_loads = d.log().count("kv loaded from storage")
        print(f"  D loaded from storage {n_loads} times (log); logs in {log_dir}")
    finally:
        for s in (p, d):
            s.stop()
        shutil.rmtree(store, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16,64,256", help="MiB of KV per measurement")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tmpfs-dir", default="/dev/shm")
    ap.add_argument("--disk-dir", default=str(ROOT / ".logs" / "bench-shared-storage"),
                    help="a directory on a disk filesystem")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--model", default="bench", choices=["bench", "tiny"])
    ap.add_argument("--tokens", type=int, default=2048, help="TTFT prompt length")
    ap.add_argument("--ttft-n", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="3 reps, 4 TTFT pairs")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.ttft_n = 3, 4
    Path(args.disk_dir).mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.sizes.split(",")]
    print(f"KV throughput, median of {args.reps}; block = {LAYERS} layers x {list(BLOCK_SHAPE)} bf16 = 1 MiB; "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs", flush=True)
    for fs_name, d in (("tmpfs", args.tmpfs_dir), ("disk", args.disk_dir)):
        throughput(fs_name, Path(d), sizes, args.reps)
    if not args.skip_ttft:
        ttft(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

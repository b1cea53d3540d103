#!/usr/bin/env python3
"""Benchmark KV block gather/scatter (connector/layout.py) against a plain copy of the
same bytes on the same device, in the same run.

    python -m scripts.bench_layout --device cpu                 # every KVCacheLayout, flash-like
    python -m scripts.bench_layout --device cuda --shape mla --layers 32 --blocks 4096 --ids 1024

Caches: ``--layers`` per-layer ``[B, H, N, C]`` views over one buffer, strided exactly as
vLLM 0.32 lays out each ``KVCacheLayout`` (its ``compute_layout_strides`` for one
group; pure torch here, so it runs where vLLM is not installed). Per repeat (median of
``--repeats``, columns interleaved in a new seeded order each repeat):

* gather  - ``gather_packed`` of ``--ids`` random blocks of every layer into one pack buffer;
* scatter - ``scatter_packed`` of that pack into other random blocks of a second cache;
* copy    - ``dst.copy_(src)`` of two contiguous buffers holding the same number of bytes.

GB/s counts the bytes of the blocks moved (read + write once each, like the copy). The bar
for the nccl path is gather and scatter >= 70 % of copy. Before timing, one round trip is
checked byte for byte.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from connector import layout as kvlayout  # noqa: E402

LAYOUTS = kvlayout.LAYOUT_ORDERS  # logical [L, B, H, N, C] -> physical order, as vLLM's KVCacheLayout
SHAPES = {  # heads, tokens per block, content (elements), dtype
    "flash": (8, 16, 256, torch.bfloat16),  # FlashAttention-like: K|V of head_dim 128
    "mla": (1, 64, 576, torch.bfloat16),  # MLA latent 512 + rope 64
    "fp8": (8, 16, 256, getattr(torch, "float8_e4m3fn", torch.uint8)),
}


def strided_caches(layout: str, layers: int, blocks: int, heads: int, tokens: int, content: int,
                   dtype: torch.dtype, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views over one buffer, strided as vLLM lays out ``layout``."""
    shape = (layers, blocks, heads, tokens, content)
    strides = [0] * 5
    step = 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = step
        step *= shape[dim]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    raw = torch.randint(-128, 128, (step * dtype.itemsize,), dtype=torch.int8, generator=gen).to(device)
    view = torch.as_strided(raw.view(dtype), shape, strides)
    return {f"model.layers.{i}.self_attn.attn": view[i] for i in range(layers)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn: Callable[[], None], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def bench_gather_scatter(device: str = "cpu", layout_name: str = "LBHNC", shape: str = "flash", layers: int = 8,
                         blocks: int = 512, ids: int = 128, repeats: int = 7, seed: int = 0) -> dict[str, float]:
    """GB/s of gather_packed and scatter_packed (every layer, ``ids`` random blocks, one
    pack buffer) and of ``dst.copy_(src)`` of the same bytes on ``device``; medians of
    ``repeats``; ``gather_ratio``/``scatter_ratio`` are against the copy."""
    heads, tokens, content, dtype = SHAPES[shape]
    p = strided_caches(layout_name, layers, blocks, heads, tokens, content, dtype, device, seed)
    d = strided_caches(layout_name, layers, blocks, heads, tokens, content, dtype, device, seed + 1)
    rng = random.Random(seed)
    src_ids = kvlayout.index(rng.sample(range(blocks), ids), torch.device(device))
    dst_ids = kvlayout.index(rng.sample(range(blocks), ids), torch.device(device))
    names = list(p)
    pack = torch.empty((layers, ids, heads, tokens, content), dtype=dtype, device=device)
    nbytes = pack.numel() * pack.element_size()
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)

    def gather() -> None:
        for i, name in enumerate(names):
            kvlayout.gather_packed(p[name], src_ids, out=pack[i])

    def scatter() -> None:
        for i, name in enumerate(names):
            kvlayout.scatter_packed(d[name], dst_ids, pack[i])

    def copy() -> None:
        flat_dst.copy_(flat_src)

    # Check once: what landed in D's blocks is P's blocks, byte for byte.
    gather()
    scatter()
    for name in names:
        got = d[name].index_select(0, dst_ids).contiguous().view(torch.uint8)
        want = p[name].index_select(0, src_ids).contiguous().view(torch.uint8)
        if not torch.equal(got, want):
            raise AssertionError(f"{layout_name}: round trip changed the bytes of {name}")

    cols: dict[str, Callable[[], None]] = {"gather": gather, "scatter": scatter, "copy": copy}
    times: dict[str, list[float]] = {k: [] for k in cols}
    for fn in cols.values():  # warm-up
        _time(fn, device)
    order = list(cols)
    for _ in range(repeats):
        rng.shuffle(order)
        for k in order:
            times[k].append(_time(cols[k], device))
    out = {f"{k}_gbps": nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    out["gather_ratio"] = out["gather_gbps"] / out["copy_gbps"]
    out["scatter_ratio"] = out["scatter_gbps"] / out["copy_gbps"]
    out["mib"] = nbytes / (1 << 20)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated KVCacheLayout names")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="flash")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--ids", type=int, default=128, help="blocks moved per layer (random, unordered)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device")
    print(f"device={args.device} shape={args.shape} layers={args.layers} blocks={args.blocks} ids={args.ids} "
          f"repeats={args.repeats} threads={torch.get_num_threads()}")
    print(f"{'layout':8} {'MiB':>7} {'gather GB/s':>12} {'scatter GB/s':>13} {'copy GB/s':>10} "
          f"{'gather/copy':>12} {'scatter/copy':>13}")
    for name in args.layouts.split(","):
        r = bench_gather_scatter(args.device, name, args.shape, args.layers, args.blocks, args.ids, args.repeats)
        print(f"{name:8} {r['mib']:7.1f} {r['gather_gbps']:12.2f} {r['scatter_gbps']:13.2f} {r['copy_gbps']:10.2f} "
              f"{r['gather_ratio']:12.0%} {r['scatter_ratio']:13.0%}")


if __name__ == "__main__":
    main()

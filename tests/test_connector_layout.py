"""KV cache layouts (connector/layout.py): CPU tensors strided exactly like vLLM lays out
every KVCacheLayout (per-layer [B, H, N, C] views over one buffer), FlashAttention-like,
MLA-like and fp8 caches, kernel-block splitting, head slices; the same round trips on CUDA
(marked gpu; pure torch, no vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gpu_kv_peer import LAYOUTS, make_caches

from connector import layout as kvlayout

SRC = (3, 4, 9, 1, 12, 13)
DST = (7, 2, 11, 0, 15, 5)
SHAPES = {  # (heads, tokens, content, dtype)
    "flash": (8, 16, 256, torch.bfloat16),
    "mla": (1, 16, 576, torch.bfloat16),
    "fp8": (4, 16, 128, getattr(torch, "float8_e4m3fn", torch.uint8)),
}


def vcfg(layout: str, blocks: int | None = None):
    return SimpleNamespace(cache_config=SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: SimpleNamespace(name=layout), num_gpu_blocks=blocks))


def caches(layout: str, seed: int, kind: str, device: str = "cpu", layers: int = 3, blocks: int = 16):
    h, n, c, dtype = SHAPES[kind]
    made = make_caches(layout, seed, layers=layers, blocks=blocks, heads=h, tokens=n, content=c,
                       dtype=torch.bfloat16, device=device)
    if dtype is not torch.bfloat16:  # same bytes seen as another 1- or 2-byte type: a view of the raw buffer
        made = {k: v.view(torch.uint8).view(dtype)[..., : c] if dtype.itemsize == 1 else v.view(dtype)
                for k, v in made.items()}
    return made


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_layout_table_matches_vllm():
    enum = pytest.importorskip("vllm.v1.kv_cache_layout").KVCacheLayout
    assert {m.name: m.value for m in enum} == LAYOUTS


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_detect_names_the_layout_and_whether_blocks_are_contiguous(layout):
    c = caches(layout, 1, "flash")
    got = kvlayout.detect(vcfg(layout, 16), c)
    assert got.layout == layout and got.dtype == "bfloat16" and got.block_shape == (8, 16, 256)
    assert got.kernel_ratio == 1 and got.num_kv_heads == 8
    # One block is one byte run only when it is [H, N, C] inner and layers are outside blocks.
    assert got.contiguous_blocks == (layout in ("LBHNC",)), layout
    assert kvlayout.detect(vcfg(layout), c) == got  # no block count from vLLM: the view's


def roundtrip(layout: str, kind: str, device: str) -> None:
    p, d = caches(layout, 1, kind, device), caches(layout, 2, kind, device)
    before = {k: v.clone() for k, v in d.items()}
    bl = kvlayout.detect(vcfg(layout, 16), p)
    for name in p:
        packed = kvlayout.gather_packed(p[name], SRC)
        assert packed.is_contiguous() and tuple(packed.shape) == (len(SRC), *bl.block_shape)
        kvlayout.scatter_packed(d[name], DST, packed)
        # The tcp path's zero-copy views carry the same bytes as the packed copy.
        views = kvlayout.gather(p[name], SRC, bl)
        assert torch.equal(bits(torch.cat(views)), bits(packed))
    for name in p:
        for s_id, d_id in zip(SRC, DST, strict=True):
            assert torch.equal(bits(d[name][d_id]), bits(p[name][s_id])), (name, s_id, d_id)
        others = [b for b in range(16) if b not in DST]
        assert torch.equal(bits(d[name][others]), bits(before[name][others]))


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_blocks_roundtrip_through_every_layout(layout, kind):
    roundtrip(layout, kind, "cpu")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_head_slices_land_in_the_owning_rank_heads(layout):
    """A decode rank owning heads 4:8 of the prefill's 8 gets exactly those, into its own
    heads 0:4; a decode rank with all 8 heads can take two slices from two sources."""
    p = caches(layout, 1, "flash")
    d_half = make_caches(layout, 2, layers=3, blocks=16, heads=4, tokens=16, content=256, device="cpu")
    for name in p:
        part = kvlayout.gather_packed(p[name], SRC, heads=slice(4, 8))
        assert tuple(part.shape) == (len(SRC), 4, 16, 256)
        kvlayout.scatter_packed(d_half[name], DST, part)
        for s_id, d_id in zip(SRC, DST, strict=True):
            assert torch.equal(bits(d_half[name][d_id]), bits(p[name][s_id, 4:8]))
    d_full = caches(layout, 3, "flash")
    for name in p:
        for heads in (slice(0, 4), slice(4, 8)):
            kvlayout.scatter_packed(d_full[name], DST, kvlayout.gather_packed(p[name], SRC, heads=heads), heads=heads)
        for s_id, d_id in zip(SRC, DST, strict=True):
            assert torch.equal(bits(d_full[name][d_id]), bits(p[name][s_id]))


def test_gather_into_a_preallocated_pack_buffer():
    p = caches("BLHNC", 1, "flash")
    names = list(p)
    pack = torch.empty((len(names), len(SRC), 8, 16, 256), dtype=torch.bfloat16)
    for i, name in enumerate(names):
        kvlayout.gather_packed(p[name], SRC, out=pack[i])
    for i, name in enumerate(names):
        assert torch.equal(bits(pack[i]), bits(p[name][list(SRC)]))


def test_kernel_blocks_are_regrouped_into_the_schedulers_blocks():
    """A backend that splits each 32-token block into two 16-token kernel blocks exposes 32
    "blocks" on axis 0: block id 3 of the scheduler is kernel blocks 6 and 7."""
    c = make_caches("LBHNC", 1, layers=2, blocks=32, heads=4, tokens=16, content=64, device="cpu")
    bl = kvlayout.detect(vcfg("LBHNC", 16), c)
    assert bl.kernel_ratio == 2 and bl.block_shape == (2, 4, 16, 64) and bl.num_kv_heads == 4
    g = kvlayout.regroup(c, bl)
    name = next(iter(g))
    assert torch.equal(bits(kvlayout.gather_packed(g[name], [3])[0]), bits(c[name][6:8]))
    part = kvlayout.gather_packed(g[name], [3], heads=slice(2, 4), head_axis=2)
    assert torch.equal(bits(part[0]), bits(c[name][6:8, 2:4]))
    with pytest.raises(ValueError, match="not a multiple"):
        kvlayout.detect(vcfg("LBHNC", 12), c)


@pytest.mark.parametrize("field, peer", [
    ("layout", {"layout": "LBNHC", "dtype": "bfloat16", "block_shape": [8, 16, 256]}),
    ("dtype", {"layout": "LBHNC", "dtype": "float16", "block_shape": [8, 16, 256]}),
    ("block_shape", {"layout": "LBHNC", "dtype": "bfloat16", "block_shape": [8, 32, 256]}),
])
def test_mismatch_names_what_differs(field, peer):
    bl = kvlayout.detect(vcfg("LBHNC", 16), caches("LBHNC", 1, "flash"))
    assert bl.mismatch(bl.describe()) is None
    why = bl.mismatch(peer)
    assert why is not None and why.startswith(f"{field} mismatch") and "same attention backend" in why


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_blocks_roundtrip_through_every_layout_on_cuda(layout, kind):
    roundtrip(layout, kind, "cuda")

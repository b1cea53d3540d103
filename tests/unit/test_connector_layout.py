"""KV cache layouts (connector/layout.py): CPU tensors strided exactly like vLLM lays out
every KVCacheLayout (per-layer [B, H, N, C] views over one buffer), built both with vLLM's
own create_kv_cache_views (skipped where vLLM is not importable) and with pure torch;
FlashAttention-like, MLA-like and fp8 caches, kernel-block splitting, head slices,
mismatch messages; the same round trips on CUDA (marked gpu; pure torch, no vLLM)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from connector import layout as kvlayout
from connector.tools.gpu_peer import LAYOUTS, make_caches

SRC = (3, 4, 9, 1, 12, 13)
DST = (7, 2, 11, 0, 15, 5)
FP8 = getattr(torch, "float8_e4m3fn", None)
SHAPES = {  # (heads, tokens, content, dtype)
    "flash": (8, 16, 256, torch.bfloat16),
    "mla": (1, 16, 576, torch.bfloat16),
    "fp8": (4, 16, 128, FP8 or torch.uint8),
}
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not importable")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def vcfg(layout: str | None, blocks: int | None = None):
    """What detect reads of a VllmConfig; layout None: not resolved (vLLM raises then)."""
    def resolved():
        if layout is None:
            raise ValueError("KV cache layout has not been resolved yet")
        return SimpleNamespace(name=layout)
    return SimpleNamespace(cache_config=SimpleNamespace(get_resolved_kv_cache_layout=resolved, num_gpu_blocks=blocks))


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


# ---- vLLM's own views (the tensors register_kv_caches receives) ----

def vllm_caches(layout: str, kind: str, seed: int, layers: int = 3, blocks: int = 16, block_size: int = 16,
                kernel_block_size: int | None = None):
    """Per-layer views exactly as vllm.v1.worker.utils.allocate_kv_cache makes them for one
    cache group (strides from compute_layout_strides, as kv_cache_utils computes the
    KVCacheTensor), over a random int8 buffer; also the buffer and a real CacheConfig."""
    from vllm.config import CacheConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    enum = KVCacheLayout[layout]
    if kind == "mla":
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    else:
        dtype = torch.bfloat16 if kind == "flash" else FP8
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype=dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks, layers, enum)
    size = spec.page_size_bytes * blocks * layers
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=gen)
    tensor = KVCacheTensor(size=size, layers=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    views = create_kv_cache_views(raw, spec, blocks, enum, tensor, kernel_block_size=kernel_block_size)
    cfg = CacheConfig(block_size=block_size)
    cfg.kv_cache_layout = layout
    cfg.num_gpu_blocks = blocks
    return dict(zip(tensor.layers, views, strict=True)), raw, SimpleNamespace(cache_config=cfg)


def physical_blocks(raw: torch.Tensor, layout: str, shape_bytes: tuple[int, ...], layer: int,
                    ids: tuple[int, ...]) -> torch.Tensor:
    """Reference read, independent of the views: the raw buffer in its physical order
    (the layout's permutation of [L, B, H, N, C-bytes]), permuted back, blocks picked."""
    order = kvlayout.LAYOUT_ORDERS[layout]
    physical = raw.view(torch.uint8).view(*(shape_bytes[d] for d in order))
    logical = physical.permute(*(order.index(d) for d in range(5)))
    return logical[layer][list(ids)].contiguous()


def test_layout_table_matches_vllm():
    enum = pytest.importorskip("vllm.v1.kv_cache_layout").KVCacheLayout
    assert {m.name: m.value for m in enum} == kvlayout.LAYOUT_ORDERS == LAYOUTS


@needs_vllm
@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_vllm_views_are_detected_and_move_the_blocks_vllm_laid_out(layout, kind):
    """detect() on vLLM's own views and CacheConfig; P's blocks SRC land in D's blocks DST,
    byte for byte as the raw buffer holds them in the layout's physical order; D's other
    blocks untouched. A gather along the wrong axis, or strides misread, fails this."""
    if kind == "fp8" and FP8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    p, p_raw, cfg = vllm_caches(layout, kind, seed=1)
    d, d_raw, _ = vllm_caches(layout, kind, seed=2)
    bl = kvlayout.detect(cfg, p)
    h, n, c, dtype = SHAPES[kind] if kind != "fp8" else (8, 16, 256, FP8)
    assert (bl.layout, bl.dtype, bl.block_shape, bl.kernel_ratio) == (layout, str(dtype)[6:], (h, n, c), 1)
    assert bl.num_kv_heads == h and bl.head_axis == 1
    assert bl.mismatch(kvlayout.detect(cfg, d).describe()) is None
    before = d_raw.clone()
    shape_bytes = (3, 16, h, n, c * dtype.itemsize)
    for li, name in enumerate(p):
        packed = kvlayout.gather_packed(p[name], SRC)
        assert bits(packed).equal(physical_blocks(p_raw, layout, shape_bytes, li, SRC))
        kvlayout.scatter_packed(d[name], DST, packed)
    others = tuple(b for b in range(16) if b not in DST)
    for li in range(3):
        assert physical_blocks(d_raw, layout, shape_bytes, li, DST).equal(
            physical_blocks(p_raw, layout, shape_bytes, li, SRC))
        assert physical_blocks(d_raw, layout, shape_bytes, li, others).equal(
            physical_blocks(before, layout, shape_bytes, li, others))


@needs_vllm
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kernel_block_splitting_roundtrip(layout):
    """A backend with 8-token kernel blocks under 16-token manager blocks: vLLM's views
    count kernel blocks on axis 0. detect() regroups them (as vLLM's group_kernel_blocks),
    so manager block s of P lands in manager block d of D (kernel blocks 2s, 2s+1 ->
    2d, 2d+1), whole or a head slice. vLLM refuses the split where blocks are not dense
    pages (every layout but LBHNC and LBNHC)."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    if layout not in ("LBHNC", "LBNHC"):
        with pytest.raises(ValueError, match="kernel blocks"):
            vllm_caches(layout, "flash", seed=1, kernel_block_size=8)
        return
    p, _, cfg = vllm_caches(layout, "flash", seed=1, kernel_block_size=8)
    d, _, _ = vllm_caches(layout, "flash", seed=2, kernel_block_size=8)
    flat_d = {k: v.clone() for k, v in d.items()}
    assert next(iter(p.values())).shape[0] == 32
    bl = kvlayout.detect(cfg, p)
    assert (bl.kernel_ratio, bl.block_shape, bl.num_kv_heads, bl.head_axis) == (2, (2, 8, 8, 256), 8, 2)
    gp, gd = kvlayout.regroup(p, bl), kvlayout.regroup(d, bl)
    for name in p:
        assert gp[name].shape == group_kernel_blocks(p[name], 16).shape
        assert gp[name].stride() == group_kernel_blocks(p[name], 16).stride()
        kvlayout.scatter_packed(gd[name], DST[:3], kvlayout.gather_packed(gp[name], SRC[:3]))
        half = slice(4, 8)
        part = kvlayout.gather_packed(gp[name], SRC[3:], heads=half, head_axis=bl.head_axis)
        assert tuple(part.shape) == (3, 2, 4, 8, 256)
        kvlayout.scatter_packed(gd[name], DST[3:], part, heads=half, head_axis=bl.head_axis)
    for name in p:
        for s, t in zip(SRC[:3], DST[:3], strict=True):
            assert bits(d[name][2 * t:2 * t + 2]).equal(bits(p[name][2 * s:2 * s + 2]))
        for s, t in zip(SRC[3:], DST[3:], strict=True):
            assert bits(d[name][2 * t:2 * t + 2, 4:8]).equal(bits(p[name][2 * s:2 * s + 2, 4:8]))
            assert bits(d[name][2 * t:2 * t + 2, :4]).equal(bits(flat_d[name][2 * t:2 * t + 2, :4]))
        untouched = [k for b in range(16) if b not in DST for k in (2 * b, 2 * b + 1)]
        assert bits(d[name][untouched]).equal(bits(flat_d[name][untouched]))


@needs_vllm
@pytest.mark.parametrize("field", ["layout", "dtype", "block_shape"])
def test_detected_pairs_that_differ_are_refused(field):
    """P and D detected from vLLM's views: a different layout, KV cache dtype or block
    size is named in the refusal."""
    p_cfg = vllm_caches("LBHNC", "flash", seed=1)
    d_args = {"layout": ("LBNHC", "flash", 16), "dtype": ("LBHNC", "fp8", 16),
              "block_shape": ("LBHNC", "flash", 32)}[field]
    if field == "dtype" and FP8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    d_caches, _, d_cfg = vllm_caches(d_args[0], d_args[1], seed=2, block_size=d_args[2])
    p_bl = kvlayout.detect(p_cfg[2], p_cfg[0])
    why = kvlayout.detect(d_cfg, d_caches).mismatch(p_bl.describe())
    assert why is not None and why.startswith(f"{field} mismatch"), why
    assert "same attention backend, KV cache dtype and block size" in why


# ---- pure torch (also what the GPU machine runs) ----

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_detect_names_the_layout_and_whether_blocks_are_contiguous(layout):
    c = caches(layout, 1, "flash")
    got = kvlayout.detect(vcfg(layout, 16), c)
    assert got.layout == layout and got.dtype == "bfloat16" and got.block_shape == (8, 16, 256)
    assert got.kernel_ratio == 1 and got.num_kv_heads == 8 and got.head_axis == 1
    # One block is one byte run only when it is [H, N, C] inner and layers are outside blocks.
    assert got.contiguous_blocks == (layout in ("LBHNC",)), layout
    assert kvlayout.detect(vcfg(layout), c) == got  # no block count from vLLM: the view's
    # Not resolved (vLLM raises): "unknown", the rest still read from the views.
    assert kvlayout.detect(vcfg(None, 16), c).layout == "unknown"


def roundtrip(layout: str, kind: str, device: str) -> None:
    p, d = caches(layout, 1, kind, device), caches(layout, 2, kind, device)
    before = {k: v.clone() for k, v in d.items()}
    bl = kvlayout.detect(vcfg(layout, 16), p)
    ids = kvlayout.index(DST, torch.device(device))  # built once, reused for every layer
    for name in p:
        packed = kvlayout.gather_packed(p[name], SRC)
        assert packed.is_contiguous() and tuple(packed.shape) == (len(SRC), *bl.block_shape)
        assert packed.dtype == p[name].dtype and packed.device == p[name].device
        kvlayout.scatter_packed(d[name], ids, packed)
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


def test_scatter_through_the_legacy_entry_point():
    """scatter() (the tcp consumer's call) writes the same blocks as scatter_packed."""
    p, d = caches("BLNHC", 1, "flash"), caches("BLNHC", 2, "flash")
    for name in p:
        kvlayout.scatter(d[name], list(DST), kvlayout.gather_packed(p[name], list(SRC)))
        assert bits(d[name][list(DST)]).equal(bits(p[name][list(SRC)]))


@pytest.mark.parametrize("device", DEVICES)
def test_gather_uses_the_block_axis(device):
    """Blocks and heads of the same count, ids a permutation: a gather along the head
    axis would give a tensor of the right shape and wrong bytes (the check has power:
    the two answers differ)."""
    c = make_caches("BHLNC", 5, layers=2, blocks=4, heads=4, tokens=2, content=8, device=device)
    t = next(iter(c.values()))
    ids = [2, 0, 3, 1]
    want = torch.stack([t[i] for i in ids])
    wrong = torch.stack([t[:, i] for i in ids])
    assert not torch.equal(bits(want), bits(wrong))
    assert torch.equal(bits(kvlayout.gather_packed(t, ids)), bits(want))
    d = torch.zeros_like(t)
    kvlayout.scatter_packed(d, ids, want)
    for k, i in enumerate(ids):
        assert torch.equal(bits(d[i]), bits(want[k]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_head_slices_land_in_the_owning_rank_heads(layout, device):
    """A decode rank owning heads 4:8 of the prefill's 8 gets exactly those, into its own
    heads 0:4; a decode rank with all 8 heads can take two slices from two sources."""
    p = caches(layout, 1, "flash", device)
    d_half = make_caches(layout, 2, layers=3, blocks=16, heads=4, tokens=16, content=256, device=device)
    for name in p:
        part = kvlayout.gather_packed(p[name], SRC, heads=slice(4, 8))
        assert tuple(part.shape) == (len(SRC), 4, 16, 256)
        kvlayout.scatter_packed(d_half[name], DST, part)
        for s_id, d_id in zip(SRC, DST, strict=True):
            assert torch.equal(bits(d_half[name][d_id]), bits(p[name][s_id, 4:8]))
    d_full = caches(layout, 3, "flash", device)
    for name in p:
        for heads in (slice(0, 4), slice(4, 8)):
            kvlayout.scatter_packed(d_full[name], DST, kvlayout.gather_packed(p[name], SRC, heads=heads), heads=heads)
        for s_id, d_id in zip(SRC, DST, strict=True):
            assert torch.equal(bits(d_full[name][d_id]), bits(p[name][s_id]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_odd_sizes_and_offsets_move_intact(layout, device):
    """Content of 5 bytes and a head slice starting at an odd byte: the copies cannot use
    wide words there and must still move exactly these bytes."""
    c = make_caches(layout, 7, layers=2, blocks=8, heads=3, tokens=3, content=5, dtype=torch.uint8, device=device)
    d = make_caches(layout, 8, layers=2, blocks=8, heads=3, tokens=3, content=5, dtype=torch.uint8, device=device)
    before = {k: v.clone() for k, v in d.items()}
    for name in c:
        part = kvlayout.gather_packed(c[name], [5, 1], heads=slice(1, 3))
        assert torch.equal(part, c[name][[5, 1], 1:3])
        kvlayout.scatter_packed(d[name], [2, 6], part, heads=slice(1, 3))
        assert torch.equal(d[name][[2, 6], 1:3], c[name][[5, 1], 1:3])
        assert torch.equal(d[name][[2, 6], 0], before[name][[2, 6], 0])
        assert torch.equal(d[name][[0, 1, 3, 4, 5, 7]], before[name][[0, 1, 3, 4, 5, 7]])


@pytest.mark.parametrize("device", DEVICES)
def test_gather_into_a_preallocated_pack_buffer(device):
    """One pack buffer for every layer of a transfer; a destination that is not
    contiguous still gets the right bytes (through one more copy)."""
    p = caches("BLHNC", 1, "flash", device)
    names = list(p)
    pack = torch.empty((len(names), len(SRC), 8, 16, 256), dtype=torch.bfloat16, device=device)
    for i, name in enumerate(names):
        layer = pack[i]  # (pack[i] is a new view object each time: keep the one passed)
        assert kvlayout.gather_packed(p[name], SRC, out=layer) is layer  # the pack itself, no copy
    for i, name in enumerate(names):
        assert torch.equal(bits(pack[i]), bits(p[name][list(SRC)]))
    strided = torch.empty((8, len(SRC), 16, 256), dtype=torch.bfloat16, device=device).transpose(0, 1)
    assert kvlayout.gather_packed(p[names[0]], SRC, out=strided) is strided
    assert torch.equal(bits(strided), bits(p[names[0]][list(SRC)]))


@pytest.mark.parametrize("device", DEVICES)
def test_packs_at_unaligned_addresses(device):
    """A received pack may start at any even address of a transport buffer (tcp frames):
    the copies then use words no wider than that address allows (16-byte words on a
    2-byte-aligned address fault on CUDA) and still move the same bytes."""
    p, d = caches("LBHNC", 1, "flash", device), caches("LBHNC", 2, "flash", device)
    name = next(iter(p))
    want = kvlayout.gather_packed(p[name], SRC)
    nbytes = want.numel() * want.element_size()
    buf = torch.zeros(nbytes + 16, dtype=torch.uint8, device=device)
    odd = buf[2:2 + nbytes].view(torch.bfloat16).view(want.shape)  # 2-byte aligned
    assert odd.data_ptr() % 16 == 2 and kvlayout._alignment(odd) == 2
    kvlayout.gather_packed(p[name], SRC, out=odd)
    assert torch.equal(bits(odd), bits(want))
    kvlayout.scatter_packed(d[name], DST, odd)
    assert torch.equal(bits(d[name][list(DST)]), bits(want))
    assert kvlayout._rows(d[name], kvlayout._alignment(odd)).element_size() == 2
    assert kvlayout._rows(d[name]).element_size() == 16  # aligned: 16-byte words, one row a block
    empty = kvlayout.gather_packed(p[name], [])
    assert tuple(empty.shape) == (0, 8, 16, 256)
    kvlayout.scatter_packed(d[name], [], empty)


def test_bad_arguments_are_refused_before_any_write():
    p, d = caches("LBHNC", 1, "flash"), caches("LBHNC", 2, "flash")
    name = next(iter(p))
    before = d[name].clone()
    with pytest.raises(ValueError, match=r"src is \[6, 8, 16, 256\], need \[5, 8, 16, 256\]"):
        kvlayout.scatter_packed(d[name], DST[:5], kvlayout.gather_packed(p[name], SRC))
    with pytest.raises(ValueError, match="out is"):
        kvlayout.gather_packed(p[name], SRC, out=torch.empty(len(SRC), 8, 16, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="head slice"):
        kvlayout.gather_packed(p[name], SRC, heads=slice(6, 4))
    with pytest.raises(ValueError, match="head slice"):
        kvlayout.gather_packed(p[name], SRC, heads=slice(0, 8, 2))
    assert torch.equal(bits(d[name]), bits(before))


def test_kernel_blocks_are_regrouped_into_the_schedulers_blocks():
    """A backend that splits each 32-token block into two 16-token kernel blocks exposes 32
    "blocks" on axis 0: block id 3 of the scheduler is kernel blocks 6 and 7."""
    c = make_caches("LBHNC", 1, layers=2, blocks=32, heads=4, tokens=16, content=64, device="cpu")
    bl = kvlayout.detect(vcfg("LBHNC", 16), c)
    assert bl.kernel_ratio == 2 and bl.block_shape == (2, 4, 16, 64) and bl.num_kv_heads == 4
    assert bl.head_axis == 2
    g = kvlayout.regroup(c, bl)
    name = next(iter(g))
    assert torch.equal(bits(kvlayout.gather_packed(g[name], [3])[0]), bits(c[name][6:8]))
    part = kvlayout.gather_packed(g[name], [3], heads=slice(2, 4), head_axis=bl.head_axis)
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

"""How KV blocks sit in vLLM's per-layer cache tensors.

Since vLLM 0.32 every attention backend exposes each layer's cache through one
logical view ``[blocks, kv_heads, tokens_in_block, content]`` (RFC #42082) over one
raw buffer; the resolved ``KVCacheLayout`` (``LBHNC``, ``LBNHC``, ``LHBNC``, ``BLHNC``,
``BLNHC``, ``BHLNC``) only permutes the *physical* order, so a layer's view may be
strided along blocks (layers interleaved per block: ``B…`` layouts) or inside a block
(heads outside blocks: ``LHBNC``, ``BHLNC``). The block axis is always 0 of the view,
the head axis 1 (MLA caches have one "head"). Where a backend splits a manager block
into kernel blocks, axis 0 counts kernel blocks: we regroup it so block ids are the
scheduler's. Content is packed per kernel (the CPU backend tiles K and V for AMX), so we
move whole blocks (or whole heads of them), never token slices, and both ends must agree
on layout, dtype and block shape: checked at first contact and on every load.

Copies are batched: one ``index_select`` / ``index_copy_`` per layer whatever the
number and order of blocks (no Python loop per block), over the cache viewed as rows of
the widest words its strides and alignment allow (a dense block is one row of 16-byte
words: 2x faster gathers and 2.7x faster scatters than 2-byte elements on CPU,
scripts/bench_layout.py). Build the block-id tensor once per transfer with ``index``. The
tcp path ships contiguous runs of blocks as zero-copy views instead (``gather``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

BLOCK_AXIS = 0
HEAD_AXIS = 1


@dataclass(frozen=True, slots=True)
class BlockLayout:
    layout: str  # vLLM KVCacheLayout name, e.g. "LBHNC"
    dtype: str  # e.g. "bfloat16"
    block_shape: tuple[int, ...]  # one block: [kv_heads, block_size, content] (or [ratio, ...] regrouped)
    contiguous_blocks: bool  # one block = one contiguous byte run in memory
    kernel_ratio: int = 1  # kernel blocks per manager block (1: no splitting)

    def describe(self) -> dict[str, Any]:
        return {"layout": self.layout, "dtype": self.dtype, "block_shape": list(self.block_shape)}

    @property
    def head_axis(self) -> int:
        """Axis of the KV heads in the (regrouped) cache views: where TP head slices are
        cut (``heads=``/``head_axis=`` of gather_packed and scatter_packed)."""
        return HEAD_AXIS + (1 if self.kernel_ratio > 1 else 0)

    @property
    def num_kv_heads(self) -> int:
        return self.block_shape[self.head_axis - 1]

    def mismatch(self, peer: dict[str, Any]) -> str | None:
        """Why KV described by ``peer`` (another instance's ``describe()``) cannot be
        copied into these caches block for block, or None if it can."""
        mine = self.describe()
        for k in ("layout", "dtype", "block_shape"):
            if peer.get(k) != mine[k]:
                return (f"{k} mismatch: peer {peer.get(k)} vs local {mine[k]} (prefill and decode must run "
                        "the same attention backend, KV cache dtype and block size)")
        return None


# Logical [L, B, H, N, C] -> physical order: vllm.v1.kv_cache_layout.KVCacheLayout's values
# (a test checks them against vLLM's enum), for code that must run without vLLM (the GPU
# tests and scripts/bench_layout.py build caches from it).
LAYOUT_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}


def _resolved_layout_name(vllm_config: Any) -> str:
    try:
        return vllm_config.cache_config.get_resolved_kv_cache_layout().name
    except Exception:  # older/other configs: both ends say "unknown", the block shape still checks
        return "unknown"


def _manager_blocks(vllm_config: Any, first: torch.Tensor) -> int:
    """The scheduler's block count, when vLLM says it (else the view's axis 0). vLLM 0.32's
    worker sets ``cache_config.num_gpu_blocks`` (= ``KVCacheConfig.num_blocks``) in
    ``initialize_from_config`` before it creates the connector and registers the caches."""
    n = getattr(getattr(vllm_config, "cache_config", None), "num_gpu_blocks", None)
    return n if isinstance(n, int) and n > 0 else int(first.shape[BLOCK_AXIS])


def regroup(kv_caches: dict[str, torch.Tensor], layout: BlockLayout) -> dict[str, torch.Tensor]:
    """Views whose axis 0 counts manager blocks (kernel blocks of one block grouped)."""
    if layout.kernel_ratio == 1:
        return kv_caches
    return {name: t.unflatten(BLOCK_AXIS, (-1, layout.kernel_ratio)) for name, t in kv_caches.items()}


def detect(vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> BlockLayout:
    """Describe the caches vLLM registered; raise if layers disagree. Apply
    ``regroup`` to the caches before using ``block_shape`` when ``kernel_ratio`` > 1."""
    if not kv_caches:
        raise ValueError("no KV cache tensors registered")
    first = next(iter(kv_caches.values()))
    for name, t in kv_caches.items():
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
            raise ValueError(f"layer {name} differs in shape/dtype from the first layer")
    if first.dim() < 2:
        raise ValueError(f"a KV cache view of {first.dim()} dims has no block axis and head axis")
    ratio = 1
    blocks = _manager_blocks(vllm_config, first)
    if first.shape[BLOCK_AXIS] != blocks:
        if blocks <= 0 or first.shape[BLOCK_AXIS] % blocks:
            raise ValueError(f"cache has {first.shape[BLOCK_AXIS]} blocks on axis 0, not a multiple of "
                             f"the scheduler's {blocks}")
        ratio = first.shape[BLOCK_AXIS] // blocks
        first = first.unflatten(BLOCK_AXIS, (blocks, ratio))
    block_shape = tuple(first.shape[1:])
    one_block = first[0] if first.shape[0] > 0 else first
    # Contiguous within a block and blocks adjacent: a run of blocks is one slice.
    contiguous = one_block.is_contiguous() and first.stride(BLOCK_AXIS) == one_block.numel()
    return BlockLayout(
        layout=_resolved_layout_name(vllm_config),
        dtype=str(first.dtype).removeprefix("torch."),
        block_shape=block_shape,
        contiguous_blocks=contiguous,
        kernel_ratio=ratio,
    )


def runs(block_ids: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """Split block ids into (start, length) runs of consecutive ids."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def gather(kv: torch.Tensor, block_ids: list[int] | tuple[int, ...], layout: BlockLayout) -> list[torch.Tensor]:
    """The blocks of one layer as a list of tensors, in block order.

    Zero-copy views (one per run of consecutive ids) when blocks are contiguous,
    else one gathered copy.
    """
    if layout.contiguous_blocks:
        return [kv.narrow(BLOCK_AXIS, start, n) for start, n in runs(block_ids)]
    return [gather_packed(kv, block_ids)]


def scatter(kv: torch.Tensor, dst_block_ids: BlockIds, src: torch.Tensor) -> None:
    """Write whole blocks ``src[i]`` into ``kv[dst_block_ids[i]]`` (ids: a sequence, or
    the tensor ``index`` made of it)."""
    scatter_packed(kv, dst_block_ids, src)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Element types the index kernels move as plain words, widest first. complex128 is the only
# 16-byte type they all take (CPU and CUDA); a copy never does arithmetic on it, so any bit
# pattern (NaNs included) arrives intact, which the round-trip tests check on random bytes.
# 16-byte words made CPU index_copy_ ~3x faster than 8-byte ones.
_WORDS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))

BlockIds = Sequence[int] | torch.Tensor


def index(block_ids: BlockIds, device: torch.device) -> torch.Tensor:
    """Block ids as the long tensor the index kernels take, on ``device``. Build it once
    per transfer and pass it to every layer's gather/scatter: on CUDA each list costs an
    H2D copy."""
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=device, dtype=torch.long)
    return torch.as_tensor(list(block_ids), dtype=torch.long).to(device, non_blocking=True)


def _heads(kv: torch.Tensor, heads: slice | None, axis: int) -> torch.Tensor:
    if heads is None:
        return kv
    start, stop, step = heads.indices(kv.shape[axis])
    if step != 1 or stop <= start:
        raise ValueError(f"head slice {heads} is not a non-empty contiguous range of {kv.shape[axis]} heads")
    return kv.narrow(axis, start, stop - start)


def _alignment(t: torch.Tensor) -> int:
    """The widest word (up to 16 bytes) that ``t``'s first byte is aligned to. Received
    tensors may sit at any even offset in a transport buffer."""
    w = 16
    while w > 1 and t.data_ptr() % w:
        w //= 2
    return w


def _rows(t: torch.Tensor, max_word: int = 16) -> torch.Tensor:
    """``t`` (blocks on axis 0) as words as wide as its strides and address allow (up to
    ``max_word`` bytes), with the dims inside a block merged where memory lets them: the
    index kernels then move 16-byte words over few dims (a 64 KiB block is one row)
    instead of 2-byte elements over four. Same memory, same bytes; the caller views the
    result back."""
    e = t.element_size()
    sizes, strides = [int(t.shape[0])], [int(t.stride(0))]
    inner = [(int(n), int(st)) for n, st in zip(t.shape[1:], t.stride()[1:], strict=True) if n != 1]
    merged: list[list[int]] = []
    for n, st in inner:  # outer to inner: merge a dim into the previous when it continues it
        if merged and merged[-1][1] == st * n:
            merged[-1] = [merged[-1][0] * n, st]
        else:
            merged.append([n, st])
    if not merged:
        merged = [[1, 1]]
    if merged[-1][1] != 1:  # innermost not dense (heads strided inside tokens): one element per row
        merged.append([1, 1])
    for n, st in merged:
        sizes.append(n)
        strides.append(st)
    base = t.view(_INT_OF_SIZE[e]) if e in _INT_OF_SIZE else t
    flat = base.as_strided(sizes, strides)
    if e not in _INT_OF_SIZE:
        return flat
    byte_terms = [sizes[-1] * e, t.data_ptr()] + [st * e for st in strides[:-1]]
    for w, word in _WORDS:
        if e < w <= max_word and all(x % w == 0 for x in byte_terms):
            return flat.view(word)
    return flat


def _packed_rows(packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """A contiguous ``[n, *block]`` tensor viewed with ``like``'s row shape and integer
    type (``like``: ``_rows`` of the cache side), or None where memory does not allow it."""
    w = like.element_size()
    row_bytes = math.prod(like.shape[1:]) * w
    if (not packed.is_contiguous() or packed.numel() * packed.element_size() != packed.shape[0] * row_bytes
            or packed.data_ptr() % w):
        return None
    return packed.view(torch.uint8).reshape(-1).view(like.dtype).view(packed.shape[0], *like.shape[1:])


def gather_packed(kv: torch.Tensor, block_ids: BlockIds, heads: slice | None = None,
                  out: torch.Tensor | None = None, head_axis: int = HEAD_AXIS) -> torch.Tensor:
    """The blocks ``block_ids`` of one layer (only ``heads`` of each, if given) as one
    contiguous ``[n, *block]`` tensor: one batched copy (one ``index_select`` kernel)
    whatever the ids' order or the layout's strides. ``out``: a preallocated contiguous
    destination of that shape and dtype (e.g. one layer's slice of a pack buffer)."""
    src = _heads(kv, heads, head_axis)
    rows = _rows(src, 16 if out is None else _alignment(out))
    idx = index(block_ids, kv.device)
    shape = (int(idx.numel()), *src.shape[1:])
    if out is None:
        return rows.index_select(BLOCK_AXIS, idx).view(torch.uint8).view(kv.dtype).view(shape)
    if tuple(out.shape) != shape or out.dtype != kv.dtype or out.device != kv.device:
        raise ValueError(f"out is {out.dtype}{list(out.shape)} on {out.device}, "
                         f"need {kv.dtype}{list(shape)} on {kv.device}")
    dst = _packed_rows(out, rows)
    if dst is None:  # not contiguous or misaligned: gather, then one more copy
        out.copy_(gather_packed(kv, idx, heads, head_axis=head_axis))
    else:
        torch.index_select(rows, BLOCK_AXIS, idx, out=dst)
    return out


def scatter_packed(kv: torch.Tensor, dst_block_ids: BlockIds, src: torch.Tensor,
                   heads: slice | None = None, head_axis: int = HEAD_AXIS) -> None:
    """Write ``src[i]`` into block ``dst_block_ids[i]`` (only its ``heads``, if given), in
    one batched copy (one ``index_copy_`` kernel), through the layout's strides."""
    dst = _heads(kv, heads, head_axis)
    idx = index(dst_block_ids, kv.device)
    want = (int(idx.numel()), *dst.shape[1:])
    if tuple(src.shape) != want:
        raise ValueError(f"src is {list(src.shape)}, need {list(want)} for these blocks")
    src = src.to(device=kv.device, dtype=kv.dtype).contiguous()
    rows = _rows(dst, _alignment(src))
    packed = _packed_rows(src, rows)
    assert packed is not None  # contiguous, words no wider than its alignment: always views
    rows.index_copy_(BLOCK_AXIS, idx, packed)

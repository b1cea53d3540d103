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
number and order of blocks (no Python loop per block); the tcp path ships contiguous
runs of blocks as zero-copy views instead.
"""

from __future__ import annotations

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
    def num_kv_heads(self) -> int:
        return self.block_shape[HEAD_AXIS - 1] if self.kernel_ratio == 1 else self.block_shape[HEAD_AXIS]

    def mismatch(self, peer: dict[str, Any]) -> str | None:
        """Why KV described by ``peer`` (another instance's ``describe()``) cannot be
        copied into these caches block for block, or None if it can."""
        mine = self.describe()
        for k in ("layout", "dtype", "block_shape"):
            if peer.get(k) != mine[k]:
                return (f"{k} mismatch: peer {peer.get(k)} vs local {mine[k]} (prefill and decode must run "
                        "the same attention backend, KV cache dtype and block size)")
        return None


def _resolved_layout_name(vllm_config: Any) -> str:
    try:
        return vllm_config.cache_config.get_resolved_kv_cache_layout().name
    except Exception:  # older/other configs: fall back to the view itself
        return "unknown"


def _manager_blocks(vllm_config: Any, first: torch.Tensor) -> int:
    """The scheduler's block count, when vLLM says it (else the view's axis 0)."""
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


def scatter(kv: torch.Tensor, dst_block_ids: list[int] | tuple[int, ...], src: torch.Tensor) -> None:
    """Write whole blocks ``src[i]`` into ``kv[dst_block_ids[i]]``."""
    scatter_packed(kv, dst_block_ids, src)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same size: block copies move bytes, and index
    kernels exist for every integer type but not for every float (fp8 has none on CPU)."""
    as_int = _INT_OF_SIZE.get(t.element_size())
    return t if as_int is None or t.dtype == as_int else t.view(as_int)


def _index(block_ids: list[int] | tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long).to(device, non_blocking=True)


def _heads(kv: torch.Tensor, heads: slice | None, axis: int) -> torch.Tensor:
    return kv if heads is None else kv.narrow(axis, heads.start, heads.stop - heads.start)


def gather_packed(kv: torch.Tensor, block_ids: list[int] | tuple[int, ...], heads: slice | None = None,
                  out: torch.Tensor | None = None, head_axis: int = HEAD_AXIS) -> torch.Tensor:
    """The blocks ``block_ids`` of one layer (only ``heads`` of each, if given) as one
    contiguous ``[n, *block]`` tensor: one batched copy whatever the ids' order or the
    layout's strides. ``out``: a preallocated destination (e.g. a slice of a pack buffer)."""
    src = _bits(_heads(kv, heads, head_axis))
    idx = _index(block_ids, kv.device)
    if out is None:
        return src.index_select(BLOCK_AXIS, idx).view(kv.dtype)
    torch.index_select(src, BLOCK_AXIS, idx, out=_bits(out))
    return out


def scatter_packed(kv: torch.Tensor, dst_block_ids: list[int] | tuple[int, ...], src: torch.Tensor,
                   heads: slice | None = None, head_axis: int = HEAD_AXIS) -> None:
    """Write ``src[i]`` into block ``dst_block_ids[i]`` (only its ``heads``, if given), in
    one batched copy, through the layout's strides."""
    dst = _bits(_heads(kv, heads, head_axis))
    src = src.to(device=kv.device, dtype=kv.dtype)
    dst.index_copy_(BLOCK_AXIS, _index(dst_block_ids, kv.device), _bits(src))

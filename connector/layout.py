"""How KV blocks sit in vLLM's per-layer cache tensors.

Since vLLM 0.32 every attention backend exposes each layer's cache through one
logical view ``[blocks, kv_heads, tokens_in_block, content]`` (RFC #42082); the
backend's resolved ``KVCacheLayout`` only permutes the *physical* order. So the
block axis is always 0 of the view, and the layout tells us whether one block
is a single contiguous byte run (then we can ship views without copying) or is
strided (then we gather). Content is packed per kernel (the CPU backend tiles K
and V for AMX), so we always move whole blocks, never token slices, and both
ends must agree on layout, dtype and block shape: we check that on every load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BLOCK_AXIS = 0


@dataclass(frozen=True, slots=True)
class BlockLayout:
    layout: str  # vLLM KVCacheLayout name, e.g. "LBHNC"
    dtype: str  # e.g. "bfloat16"
    block_shape: tuple[int, ...]  # one block: [kv_heads, block_size, content]
    contiguous_blocks: bool  # one block = one contiguous byte run in memory

    def describe(self) -> dict[str, Any]:
        return {"layout": self.layout, "dtype": self.dtype, "block_shape": list(self.block_shape)}

    def mismatch(self, peer: dict[str, Any]) -> str | None:
        """Why KV described by ``peer`` (another instance's ``describe()``) cannot be
        copied into these caches block for block, or None if it can."""
        mine = self.describe()
        for k in ("layout", "dtype", "block_shape"):
            if peer.get(k) != mine[k]:
                return f"{k} mismatch: peer {peer.get(k)} vs local {mine[k]}"
        return None


def _resolved_layout_name(vllm_config: Any) -> str:
    try:
        return vllm_config.cache_config.get_resolved_kv_cache_layout().name
    except Exception:  # older/other configs: fall back to the view itself
        return "unknown"


def detect(vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> BlockLayout:
    """Describe the caches vLLM registered; raise if layers disagree."""
    if not kv_caches:
        raise ValueError("no KV cache tensors registered")
    first = next(iter(kv_caches.values()))
    for name, t in kv_caches.items():
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
            raise ValueError(f"layer {name} differs in shape/dtype from the first layer")
    block_shape = tuple(first.shape[1:])
    one_block = first[0] if first.shape[0] > 0 else first
    # Contiguous within a block and blocks adjacent: a run of blocks is one slice.
    contiguous = one_block.is_contiguous() and first.stride(BLOCK_AXIS) == one_block.numel()
    return BlockLayout(
        layout=_resolved_layout_name(vllm_config),
        dtype=str(first.dtype).removeprefix("torch."),
        block_shape=block_shape,
        contiguous_blocks=contiguous,
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
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
    return [kv.index_select(BLOCK_AXIS, idx).contiguous()]


def scatter(kv: torch.Tensor, dst_block_ids: list[int] | tuple[int, ...], src: torch.Tensor) -> None:
    """Write whole blocks ``src[i]`` into ``kv[dst_block_ids[i]]``."""
    idx = torch.tensor(list(dst_block_ids), dtype=torch.long, device=kv.device)
    kv.index_copy_(BLOCK_AXIS, idx, src.to(device=kv.device, dtype=kv.dtype))

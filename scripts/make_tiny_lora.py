#!/usr/bin/env python3
"""Write a tiny LoRA adapter for the tiny Llama (scripts/make_tiny_model.py), without downloads.

    python -m scripts.make_tiny_lora --out /tmp/tiny-lora [--seed 1] [--rank 8]

PEFT's on-disk format, which vLLM's ``--enable-lora`` loads (``/v1/load_lora_adapter``):
``adapter_config.json`` and ``adapter_model.safetensors`` with ``lora_A`` ([r, in]) and
``lora_B`` ([out, r]) for every attention and MLP projection of every layer. Both are
random-normal and nonzero (a freshly initialised PEFT adapter has ``lora_B`` = 0, which
would answer exactly as the base model), large enough that greedy answers differ from the
base model's. Deterministic: the same seed and rank give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.make_tiny_model import TINY, Dims

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_STD = 0.1  # per factor: B @ A * alpha/r moves each weight by ~2.8x the base's std


def shapes(dims: Dims) -> dict[str, tuple[int, int]]:
    """(out, in) of each targeted projection."""
    h, hd, inter = dims.hidden, dims.head_dim, dims.intermediate
    return {"q_proj": (dims.heads * hd, h), "k_proj": (dims.kv_heads * hd, h),
            "v_proj": (dims.kv_heads * hd, h), "o_proj": (h, dims.heads * hd),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}  # fmt: skip


def build_lora(seed: int, rank: int, dims: Dims = TINY) -> dict:
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)

    def normal(*shape: int):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * LORA_STD).to(torch.bfloat16)

    out = {}
    for i in range(dims.layers):
        for name, (o, n) in shapes(dims).items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            out[key + ".lora_A.weight"] = normal(rank, n)
            out[key + ".lora_B.weight"] = normal(o, rank)
    return out


def adapter_config(rank: int, base: str) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": list(TARGETS),
            "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
            "use_dora": False, "inference_mode": True}  # fmt: skip


def make_lora(out: Path, seed: int = 1, rank: int = 8, base: str = "tiny-llama", dims: Dims = TINY) -> Path:
    """Write the adapter into ``out`` (created); returns ``out``."""
    from safetensors.torch import save

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(rank, base), indent=2) + "\n")
    (out / "adapter_model.safetensors").write_bytes(save(build_lora(seed, rank, dims), metadata={"format": "pt"}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--seed", type=int, default=1, help="weight seed (default 1)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank r (default 8; vLLM's --max-lora-rank must fit)")
    args = ap.parse_args(argv)
    make_lora(args.out, args.seed, args.rank)
    print(f"tiny LoRA adapter wrote {args.out} (seed {args.seed}, rank {args.rank})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

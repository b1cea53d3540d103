#!/usr/bin/env python3
"""Write a tiny random Llama checkpoint (+ tokenizer) that vLLM loads, without downloads.

    python -m scripts.make_tiny_model --out .models/tiny-llama [--seed 0]

Why not vLLM's ``--load-format dummy``: its weights make the output depend only on the
last token, so a corrupted or missing KV cache would go unnoticed. Here weights are
random-normal (std 0.02, fixed seed) with unit RMSNorm weights, so the next-token logits
depend on the whole context and KV-transfer bugs change the generated text.

Deterministic (same seed -> byte-identical files; the tokenizer does not depend on the
seed) and idempotent: a stamp file records the script version, seed and file hashes, and
a complete matching model is left as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

# Keep the tokenizers trainer single-threaded: deterministic and polite on shared cores.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Bump whenever the output for a given seed changes, so stale models get rebuilt.
SCRIPT_VERSION = 1
STAMP = ".xpyd-tiny-model.json"

VOCAB_SIZE = 1024
MAX_POS = 4096
INIT_STD = 0.02

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
UNK, BOS, EOS, PAD = SPECIAL_TOKENS[:4]

# One turn per message: "<|role|>\ncontent\n"; assistant turns end with EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors",
)

_WORDS = """
the of and to in is was that for it as with he be on by at his this had not are but from
or have an they which one you were her all she there would their we him been has when who
will more no if out so said what up its about into than them can only other new some could
time these two may then do first any my now such like our over man me even most made after
also did many before must through back years where much your way well down should because
each just those people how too little state good very make world still own see men work long
get here between both life being under never day same another know while last might us great
old year off come since against go came right used take three himself few house use during
without again place american around however home small found thought went say part once high
general upon school every does got united left number course war until always away something
fact water though less public put think almost hand enough far took head yet government system
set better told nothing night end why called didn find going look asked later knew point next
city give group toward young let room president side social given present several order national
second possible rather per face among form important often things looked early white case john
become large big need four within felt along children saw best church ever least power development
light thing seemed family interest want members others mind country area done turned although open
god service problem certain kind different thus began door help means sense whole matter perhaps
itself york times law human line above name example action company hands local show whether five
history gave today either act feet across taken past quite anything having seen death experience
body word half really week car field information money job data model cache block token prefill
decode server request stream memory tensor layer vector batch query answer question story river
mountain garden music paper market window morning evening summer winter letter number simple
""".split()
_PUNCT = [".", ".", ".", "!", "?", ";", ","]


def _corpus(n_sentences: int = 6000) -> list[str]:
    """Deterministic English-like text: words, capitals, punctuation, numbers, newlines."""
    rng = random.Random(20240601)
    lines = []
    for i in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2099)))
        words[0] = words[0].capitalize()
        sentence = " ".join(words) + rng.choice(_PUNCT)
        if rng.random() < 0.1:
            sentence = f'"{sentence}" {rng.choice(_WORDS)} {rng.choice(["said", "asked", "wrote"])}.'
        lines.append(sentence if i % 7 else sentence + "\n")
    return lines


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    # Byte-level: every string (any Unicode, any bytes) tokenizes, and decode inverts encode.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama-style: encode(..., add_special_tokens=True) prepends BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer trained to {size} tokens, expected {VOCAB_SIZE}")
    return tok


@dataclass(frozen=True)
class Dims:
    """Model size. The default is the test model; benchmarks ask for bigger ones."""

    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads  # 32 for the default


TINY = Dims()


def build_weights(seed: int, vocab: int, dims: Dims = TINY) -> dict:
    import numpy as np
    import torch

    # numpy's PCG64 stream is stable across versions and platforms; round to bf16 at the end.
    rng = np.random.default_rng(seed)

    def normal(*shape: int):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * INIT_STD).to(torch.bfloat16)

    def ones(n: int):
        return torch.ones(n, dtype=torch.bfloat16)

    h, hd, inter = dims.hidden, dims.head_dim, dims.intermediate
    w = {"model.embed_tokens.weight": normal(vocab, h)}
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(dims.heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = normal(dims.kv_heads * hd, h)
        w[p + "self_attn.v_proj.weight"] = normal(dims.kv_heads * hd, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, dims.heads * hd)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
        w[p + "input_layernorm.weight"] = ones(h)
        w[p + "post_attention_layernorm.weight"] = ones(h)
    w["model.norm.weight"] = ones(h)
    w["lm_head.weight"] = normal(vocab, h)
    return w


def model_config(vocab: int, bos_id: int, eos_id: int, pad_id: int, dims: Dims = TINY) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_current(out: Path, seed: int, dims: Dims) -> bool:
    try:
        stamp = json.loads((out / STAMP).read_text())
        if stamp.get("script_version") != SCRIPT_VERSION or stamp.get("seed") != seed:
            return False
        if stamp.get("dims", asdict(TINY)) != asdict(dims):
            return False
        hashes = stamp["sha256"]
        return set(hashes) == set(FILES) and all(_sha256(out / f) == h for f, h in hashes.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # readers never see a half-written file


def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def make_model(out: Path, seed: int = 0, force: bool = False, dims: Dims = TINY) -> bool:
    """Write the model into ``out``; returns False when an up-to-date model was already there."""
    out = Path(out)
    if not force and _is_current(out, seed, dims):
        return False
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP).unlink(missing_ok=True)  # incomplete until the stamp is rewritten

    from safetensors.torch import save

    tok = build_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}

    _write(out / "config.json", _json(model_config(vocab, ids[BOS], ids[EOS], ids[PAD], dims)))
    _write(
        out / "generation_config.json",
        _json({"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}),
    )
    _write(out / "tokenizer.json", (tok.to_str(pretty=True) + "\n").encode())
    _write(
        out / "tokenizer_config.json",
        _json(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **specials,
                "additional_special_tokens": SPECIAL_TOKENS[4:],
                "model_max_length": MAX_POS,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            }
        ),
    )
    _write(out / "special_tokens_map.json", _json({**specials, "additional_special_tokens": SPECIAL_TOKENS[4:]}))
    _write(out / "model.safetensors", save(build_weights(seed, vocab, dims), metadata={"format": "pt"}))

    stamp = {
        "script_version": SCRIPT_VERSION,
        "seed": seed,
        **({} if dims == TINY else {"dims": asdict(dims)}),  # the test model's stamp stays as it was
        "sha256": {f: _sha256(out / f) for f in FILES},
    }
    _write(out / STAMP, _json(stamp))
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    for f in fields(Dims):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default,
                        help=f"model {f.name.replace('_', ' ')} (default {f.default})")
    args = ap.parse_args(argv)
    dims = Dims(**{f.name: getattr(args, f.name) for f in fields(Dims)})
    t0 = time.monotonic()
    made = make_model(args.out, args.seed, args.force, dims)
    state = "wrote" if made else "up to date:"
    print(f"tiny model {state} {args.out} (seed {args.seed}, {time.monotonic() - t0:.2f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

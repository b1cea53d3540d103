"""scripts/make_tiny_model.py: a loadable, deterministic, context-sensitive tiny Llama."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_tiny_model.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


mtm = _load_script()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """Built once through the CLI, as scripts/setup.sh does."""
    out = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    # No time assertion: ~5 s on an idle box, 24 s seen with the unit tier's 4 workers on 2 cores.
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--seed", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return out


def _files(d: Path) -> dict[str, bytes]:
    return {f: (d / f).read_bytes() for f in mtm.FILES}


def test_config_and_tokenizer_load_with_transformers(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 256, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.max_position_embeddings == 4096 and cfg.tie_word_embeddings is False
    assert json.loads((model_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == cfg.vocab_size == 1024
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    assert tok.pad_token is not None and tok.unk_token is not None
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id and gen["bos_token_id"] == tok.bos_token_id

    for text in ["Hello, world!", "The KV cache moved 42 blocks.\n", "ünïcødé 🙂 漢字\t\x00 x", ""]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id  # Llama-style BOS
        assert all(0 <= i < cfg.vocab_size for i in ids)
        assert tok.decode(ids, skip_special_tokens=True) == text
    marked = tok("<|user|>\nhi")["input_ids"]
    assert marked[1] == tok.convert_tokens_to_ids("<|user|>")  # role markers are single tokens
    assert tok.decode(marked) == "<s><|user|>\nhi"
    # English-like text compresses: the BPE learned real merges.
    assert len(tok("the people of the world")["input_ids"]) <= 8

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-2:] == [tok.convert_tokens_to_ids("<|assistant|>"), tok("\n", add_special_tokens=False)["input_ids"][0]]


def test_weights_shapes_and_dtypes(model_dir):
    from safetensors.torch import load_file

    w = load_file(model_dir / "model.safetensors")
    expected = {"model.embed_tokens.weight": (1024, 128), "model.norm.weight": (128,), "lm_head.weight": (1024, 128)}
    for i in range(2):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (128, 128),
            p + "self_attn.k_proj.weight": (64, 128),
            p + "self_attn.v_proj.weight": (64, 128),
            p + "self_attn.o_proj.weight": (128, 128),
            p + "mlp.gate_proj.weight": (256, 128),
            p + "mlp.up_proj.weight": (256, 128),
            p + "mlp.down_proj.weight": (128, 256),
            p + "input_layernorm.weight": (128,),
            p + "post_attention_layernorm.weight": (128,),
        }
    assert {k: tuple(v.shape) for k, v in w.items()} == expected
    assert all(v.dtype == torch.bfloat16 for v in w.values())
    for k, v in w.items():
        if k.endswith("norm.weight"):
            assert torch.all(v == 1)
        else:
            assert abs(v.float().std().item() - 0.02) < 0.002, k


def test_deterministic_and_idempotent(model_dir, tmp_path):
    # Same seed, separate process above vs. in-process here: byte-identical files.
    again = tmp_path / "again"
    assert mtm.make_model(again, seed=0) is True
    assert _files(again) == _files(model_dir)

    # Up to date: returns without rewriting (False, the file untouched).
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert mtm.make_model(again, seed=0) is False
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime

    # A damaged file is noticed and the model is rebuilt identically.
    (again / "config.json").write_text("{}")
    assert mtm.make_model(again, seed=0) is True
    assert _files(again) == _files(model_dir)

    # Another seed: other weights, same tokenizer/config.
    other = tmp_path / "other"
    assert mtm.make_model(other, seed=1) is True
    a, b = _files(model_dir), _files(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {
        k: v for k, v in b.items() if k != "model.safetensors"
    }
    # Asking for seed 0 in the seed-1 directory rebuilds it.
    assert mtm.make_model(other, seed=0) is True
    assert _files(other) == a


def test_last_logits_depend_on_early_tokens(model_dir):
    """The property KV-transfer tests rely on: corrupt early context -> different output."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = " ".join(mtm._WORDS[i * 7 % len(mtm._WORDS)] for i in range(200))
    ids = torch.tensor([tok(text)["input_ids"][:160]])
    changed = ids.clone()
    changed[0, 3] = (changed[0, 3] + 100) % 1000 + 7
    swapped = ids.clone()  # same tokens, two 32-token chunks swapped (like mis-ordered blocks)
    swapped[0, 32:64], swapped[0, 96:128] = ids[0, 96:128], ids[0, 32:64]
    with torch.no_grad():
        base, changed_logits, swapped_logits = (model(x).logits[0, -1] for x in (ids, changed, swapped))
    # Logits have std ~0.2; these context changes move them by ~0.1-0.2, while bf16-vs-fp32
    # numerics move them by ~4e-3: corrupted KV is well above the noise.
    assert (base - changed_logits).abs().max().item() > 2e-2
    assert (base - swapped_logits).abs().max().item() > 2e-2


def test_the_tiny_lora_adapter_fits_the_model_and_is_deterministic(model_dir, tmp_path):
    """scripts/make_tiny_lora.py: PEFT's files, lora_A [r, in] and lora_B [out, r] for each
    projection of the base weights, lora_B nonzero (else the adapter answers as the base)."""
    from safetensors.torch import load_file

    from scripts.make_tiny_lora import make_lora

    one = make_lora(tmp_path / "one", seed=1, rank=8)
    base = load_file(model_dir / "model.safetensors")
    lora = load_file(one / "adapter_model.safetensors")
    config = json.loads((one / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    assert len(lora) == 2 * 2 * 7  # two layers, seven projections, A and B
    for key, weight in base.items():
        if not key.endswith("_proj.weight"):
            continue
        stem = "base_model.model." + key.removesuffix(".weight")
        out, n = weight.shape
        assert tuple(lora[stem + ".lora_A.weight"].shape) == (8, n)
        assert tuple(lora[stem + ".lora_B.weight"].shape) == (out, 8)
        assert lora[stem + ".lora_B.weight"].abs().sum() > 0
    again = make_lora(tmp_path / "again", seed=1, rank=8)
    other = make_lora(tmp_path / "other", seed=2, rank=8)
    files = ("adapter_config.json", "adapter_model.safetensors")

    def read(d: Path) -> list[bytes]:
        return [(d / f).read_bytes() for f in files]

    assert read(again) == read(one) and read(other)[1] != read(one)[1]

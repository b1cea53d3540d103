"""proxy/routing/prompt_keys.py without a server: request shapes, what is refused, and the block keys'
properties a `precise` policy relies on. Equality with vLLM's own /tokenize on every shape
is tested against a real vLLM server in test_e2e_kv_events.py."""

from __future__ import annotations

import pytest

from proxy.routing.prompt_keys import CHAT, COMPLETIONS, PromptTokenizer, Unsupported
from tests.support.e2e_client import MODEL_DIR


@pytest.fixture(scope="module")
def pt() -> PromptTokenizer:
    if not MODEL_DIR.joinpath("tokenizer.json").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    return PromptTokenizer(MODEL_DIR)


def test_completion_shapes(pt: PromptTokenizer):
    (text,) = pt.token_ids(COMPLETIONS, {"prompt": "river stone maple"})
    assert text[0] == 1 and len(text) > 3  # the tokenizer's BOS (<s>), then the words
    (no_bos,) = pt.token_ids(COMPLETIONS, {"prompt": "river stone maple", "add_special_tokens": False})
    assert no_bos == text[1:]
    assert pt.token_ids(COMPLETIONS, {"prompt": [5, 6, 7]}) == [[5, 6, 7]]
    assert pt.token_ids(COMPLETIONS, {"prompt": [[5, 6], [7]]}) == [[5, 6], [7]]
    batch = pt.token_ids(COMPLETIONS, {"prompt": ["river stone maple", "quiet"]})
    assert batch[0] == text and len(batch) == 2


def test_chat_uses_the_template_without_a_second_bos(pt: PromptTokenizer):
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}
    (ids,) = pt.token_ids(CHAT, body)
    assert ids.count(1) == 1 and ids[0] == 1  # the template's BOS only
    two = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    parts = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": two}]}
    joined = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hel\nlo"}]}
    assert pt.token_ids(CHAT, parts) == pt.token_ids(CHAT, joined)
    no_gen = pt.token_ids(CHAT, {**body, "add_generation_prompt": False})[0]
    assert ids[:len(no_gen)] == no_gen and len(ids) > len(no_gen)


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, {"prompt": "x", "prompt_embeds": "AAAA"}),
    (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 4}),
    (COMPLETIONS, {"prompt": [1, -2]}),
    (COMPLETIONS, {"prompt": [1, True]}),
    (COMPLETIONS, {"prompt": []}),
    (COMPLETIONS, {"prompt": ["x", 3.5]}),
    (COMPLETIONS, {"prompt": "x", "add_special_tokens": "yes"}),
    (CHAT, {"messages": []}),
    (CHAT, {"messages": [{"content": "no role"}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 'mine' }}"}),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": ["bad"]}),
    ("/v1/embeddings", {"input": "x"}),
])
def test_what_is_not_reproduced_is_refused(pt: PromptTokenizer, path: str, body: dict):
    with pytest.raises(Unsupported):
        pt.token_ids(path, body)


def test_block_keys_are_prefixes_across_turns_and_salted(pt: PromptTokenizer):
    """Turn k's full blocks are a prefix of turn k+1's: the property that sends a chat's
    next turn to the instance holding its history."""
    turn1 = [{"role": "system", "content": "river stone " * 120}, {"role": "user", "content": "maple quiet " * 40}]
    turn2 = turn1 + [{"role": "assistant", "content": "engine silver"}, {"role": "user", "content": "garden " * 60}]
    (a,), (b,) = pt.token_ids(CHAT, {"messages": turn1}), pt.token_ids(CHAT, {"messages": turn2})
    ka, kb = pt.block_keys(a, 16), pt.block_keys(b, 16)
    assert len(ka) == len(a) // 16 and len(kb) > len(ka) >= 10
    assert kb[:len(ka)] == ka
    assert pt.block_keys(a, 16, "lora-a")[0] != ka[0]
    assert pt.block_keys(a[:15], 16) == []  # no full block, no key

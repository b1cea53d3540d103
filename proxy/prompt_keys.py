"""A request's prompt as vLLM tokenizes it, and the chained keys of its full blocks.

Routing from the engines' own KV events (issue 17) needs the prompt's real token ids: the
block keys the proxy's KV index holds (`xpyd_wire.kv_events.chain_block_keys`) are hashes of
token ids, not of text. This module reproduces what vLLM's OpenAI server does with a request
body, using the model's own Hugging Face tokenizer (the object vLLM itself uses):

* /v1/completions: a string prompt is encoded with `add_special_tokens` (vLLM's default
  True: the BOS a Llama tokenizer adds); token-id prompts are taken as they are; a batch
  (a list of strings or of token-id lists) gives one sequence per prompt.
* /v1/chat/completions: the messages go through the model's chat template
  (`apply_chat_template`, `add_generation_prompt` default True, `continue_final_message`,
  `chat_template_kwargs`), text content parts joined with a newline as vLLM's "string"
  content format does, and the rendered text is encoded with `add_special_tokens` default
  False (the template adds BOS).

What it does not reproduce raises `Unsupported`, so a caller falls back (to the instance's
own `/tokenize`, or to the character estimate): a request's own `chat_template`, `tools`,
non-text content (images, audio), `prompt_embeds`, `truncate_prompt_tokens`. Equality with
vLLM's `/tokenize` is tested on a real vLLM server (tests/test_e2e_kv_events.py); the cost
per request is measured by scripts/bench_prompt_keys.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xpyd_wire.kv_events import chain_block_keys

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Body fields that change the prompt in ways this module does not reproduce.
_UNSUPPORTED_FIELDS = ("prompt_embeds", "truncate_prompt_tokens", "tools", "chat_template", "mm_processor_kwargs")
_MAX_TOKEN_ID = 2**32 - 1


class Unsupported(ValueError):
    """The request's prompt cannot be reproduced here; the reason says why."""


class PromptTokenizer:
    """One model's tokenizer, loaded from its directory (or Hugging Face name) once."""

    def __init__(self, tokenizer: str | Path) -> None:
        # transformers is heavy to import (~1 s): only for proxies that need token ids.
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=False)
        self._has_template = getattr(self._tok, "chat_template", None) is not None

    def token_ids(self, path: str, body: dict[str, Any]) -> list[list[int]]:
        """The prompt token ids vLLM computes for `body` sent to `path`: one list per prompt
        (a completions batch gives several, chat one). Raises Unsupported."""
        for name in _UNSUPPORTED_FIELDS:
            if body.get(name) is not None:
                raise Unsupported(f"{name} is not reproduced")
        if path == COMPLETIONS:
            return self._completion(body)
        if path == CHAT:
            return [self._chat(body)]
        raise Unsupported(f"no prompt for {path}")

    def block_keys(self, token_ids: Sequence[int], block_size: int, lora: str | None = None) -> list[int]:
        """Keys of the full blocks, as the KV index stores what the instances report."""
        return chain_block_keys(token_ids, block_size, lora)

    # ------------------------------------------------------------------ shapes

    def _completion(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        special = _flag(body, "add_special_tokens", True)
        if isinstance(prompt, str):
            return [self._encode(prompt, special)]
        if isinstance(prompt, list) and prompt:
            if all(_is_token_id(t) for t in prompt):
                return [list(prompt)]
            out: list[list[int]] = []
            for p in prompt:
                if isinstance(p, str):
                    out.append(self._encode(p, special))
                elif isinstance(p, list) and p and all(_is_token_id(t) for t in p):
                    out.append(list(p))
                else:
                    raise Unsupported("a batch element is neither text nor token ids")
            return out
        raise Unsupported("prompt is neither text, token ids nor a batch of them")

    def _chat(self, body: dict[str, Any]) -> list[int]:
        if not self._has_template:
            raise Unsupported("the tokenizer has no chat template")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Unsupported("messages is not a non-empty list")
        conversation = [_message(m) for m in messages]
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise Unsupported("chat_template_kwargs is not an object")
        kwargs = {**kwargs,
                  "add_generation_prompt": _flag(body, "add_generation_prompt", True),
                  "continue_final_message": _flag(body, "continue_final_message", False)}  # fmt: skip
        try:
            text = self._tok.apply_chat_template(conversation, tokenize=False, **kwargs)
        except Exception as e:  # the template rejected the input (vLLM answers 400)
            raise Unsupported(f"the chat template failed: {e}") from None
        return self._encode(text, _flag(body, "add_special_tokens", False))

    def _encode(self, text: str, special: bool) -> list[int]:
        return list(self._tok(text, add_special_tokens=special)["input_ids"])


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise Unsupported(f"{name} is not a boolean")
    return value


def _is_token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_TOKEN_ID


def _message(m: object) -> dict[str, str]:
    """A chat message as vLLM hands it to a "string"-format template: text parts joined
    with a newline; anything else (images, audio, tool calls) is not reproduced."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise Unsupported("a message is not an object with a role")
    if m.get("tool_calls") or m.get("role") == "tool":
        raise Unsupported("tool messages are not reproduced")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise Unsupported("a content part is not text")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise Unsupported("message content is neither text nor parts")
    return {"role": m["role"], "content": content}

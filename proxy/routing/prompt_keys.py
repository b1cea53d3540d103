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
own `/tokenize`, or to the character estimate): `tools`, non-text content (images, audio),
`prompt_embeds`, `truncate_prompt_tokens`. Equality with vLLM's `/tokenize` is tested on a
real vLLM server (tests/e2e/test_e2e_kv_events.py); the cost per request is measured by
scripts/bench_prompt_keys.py.

A request's own chat template (top-level `chat_template` or `chat_template_kwargs.chat_template`)
is code: the proxy never runs it. Unless trusted (--trust-request-chat-template, as vLLM's
flag of that name), it is refused with vLLM's own answer (`TemplateRefused`); trusted, it goes
to the instances and the proxy routes by the guess. `Tokenizing` runs the tokenizer on its one
thread under a budget (prompt size, jobs queued, wait), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xpyd_wire.kv_events import chain_block_keys

log = logging.getLogger("xpyd.proxy.prompt_keys")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Body fields that change the prompt in ways this module does not reproduce.
_UNSUPPORTED_FIELDS = ("prompt_embeds", "truncate_prompt_tokens", "tools", "chat_template", "mm_processor_kwargs")
# apply_chat_template's own parameters: a client must not set them through
# chat_template_kwargs (a template of its own, tokenize=True, ...).
_TEMPLATE_PARAMS = frozenset({
    "chat_template", "tools", "documents", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "conversation",
})  # fmt: skip
_MAX_TOKEN_ID = 2**32 - 1
# vLLM 0.32's answer to a request carrying its own template without
# --trust-request-chat-template (vllm/renderers/online_renderer.py validate_chat_template).
TEMPLATE_REFUSED = ("Chat template is passed with request, but --trust-request-chat-template "
                    "is not set. Refused request with untrusted chat template.")  # fmt: skip


class Unsupported(ValueError):
    """The request's prompt cannot be reproduced here; the reason says why."""


class TemplateRefused(Exception):
    """The request carries its own chat template and the proxy does not trust request
    templates: answer 400 with vLLM's message (`TEMPLATE_REFUSED`)."""


def carries_template(body: dict[str, Any]) -> bool:
    """Whether `body` brings its own chat template (vLLM's test, both places)."""
    if body.get("chat_template") is not None:
        return True
    kwargs = body.get("chat_template_kwargs")
    return isinstance(kwargs, dict) and kwargs.get("chat_template") is not None


class PromptTokenizer:
    """One model's tokenizer, loaded from its directory (or Hugging Face name) once."""

    def __init__(self, tokenizer: str | Path) -> None:
        # transformers is heavy to import (~1 s): only for proxies that need token ids.
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=False)
        self._has_template = getattr(self._tok, "chat_template", None) is not None

    def token_ids(self, path: str, body: dict[str, Any], first_only: bool = False) -> list[list[int]]:
        """The prompt token ids vLLM computes for `body` sent to `path`: one list per prompt
        (a completions batch gives several, chat one; `first_only`: a batch's first prompt
        alone). Raises Unsupported."""
        for name in _UNSUPPORTED_FIELDS:
            if body.get(name) is not None:
                raise Unsupported(f"{name} is not reproduced")
        if path == COMPLETIONS:
            return self._completion(body, first_only)
        if path == CHAT:
            return [self._chat(body)]
        raise Unsupported(f"no prompt for {path}")

    def block_keys(self, token_ids: Sequence[int], block_size: int, lora: str | None = None) -> list[int]:
        """Keys of the full blocks, as the KV index stores what the instances report."""
        return chain_block_keys(token_ids, block_size, lora)

    # ------------------------------------------------------------------ shapes

    def _completion(self, body: dict[str, Any], first_only: bool = False) -> list[list[int]]:
        prompt = body.get("prompt")
        special = _flag(body, "add_special_tokens", True)
        if isinstance(prompt, str):
            return [self._encode(prompt, special)]
        if isinstance(prompt, list) and prompt:
            if all(_is_token_id(t) for t in prompt):
                return [list(prompt)]
            out: list[list[int]] = []
            for p in prompt[:1] if first_only else prompt:
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
        # Never a template (or any other apply_chat_template parameter) of the client's:
        # a template is code, and rendering it here would run it inside the proxy.
        if not _TEMPLATE_PARAMS.isdisjoint(kwargs):
            raise Unsupported("chat_template_kwargs sets apply_chat_template's own parameters")
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


@dataclass(frozen=True, slots=True)
class TokenizeBudget:
    """What one proxy spends on tokenizing prompts; past it, the policies' estimate."""

    max_bytes: int = 1 << 20  # longest prompt tokenized (~0.5 s of the thread per MiB)
    max_pending: int = 8  # jobs queued or running on the tokenizer thread
    timeout: float = 1.0  # longest a request waits for its ids


class Tokenizing:
    """A PromptTokenizer run on its own thread (a Hugging Face tokenizer must not be used
    by two threads at once), never on the event loop, within a TokenizeBudget.

    `first_ids` answers the first prompt's ids and a result for the metric: ok,
    unsupported, too_large, queue_full, timeout, or failed (the tokenizer raised)."""

    def __init__(self, tokenizer: PromptTokenizer, budget: TokenizeBudget,
                 trust_request_templates: bool = False) -> None:
        self.tokenizer = tokenizer
        self.budget = budget
        self.trust_request_templates = trust_request_templates
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="xpyd-tokenize")
        # Jobs in the thread's queue or running: submitted on the loop minus finished in
        # the thread minus cancelled before they ran (each counter has one writer).
        self._submitted = 0
        self._finished = 0
        self._cancelled = 0

    @property
    def pending(self) -> int:
        return self._submitted - self._finished - self._cancelled

    async def first_ids(self, path: str, body: dict[str, Any], raw_len: int) -> tuple[list[int] | None, str]:
        """Raises TemplateRefused for a request's own template, unless trusted."""
        if path == CHAT and carries_template(body):  # vLLM's completions have no template
            if not self.trust_request_templates:
                raise TemplateRefused(TEMPLATE_REFUSED)
            return None, "unsupported"  # trusted: the instance runs it, the proxy does not
        if body.get("cache_salt") is not None:  # keys the blocks apart from their tokens
            return None, "unsupported"
        budget = self.budget
        if _work_bytes(path, body, raw_len) > budget.max_bytes:
            return None, "too_large"
        if self.pending >= budget.max_pending:
            return None, "queue_full"
        job = self._pool.submit(self._run, path, body)
        self._submitted += 1
        try:
            ids = await asyncio.wait_for(asyncio.wrap_future(job), budget.timeout)
        except TimeoutError:
            job.cancel()  # dropped from the queue if it has not started
            if job.cancelled():
                self._cancelled += 1
            return None, "timeout"
        except asyncio.CancelledError:
            if job.cancel():
                self._cancelled += 1
            raise
        except Unsupported:
            return None, "unsupported"
        except Exception as e:  # the tokenizer choked: route by the guess, never fail the request
            log.warning("prompt not tokenized (%s: %s): the policies use their guess", type(e).__name__, e)
            return None, "failed"
        return ids, "ok"

    def _run(self, path: str, body: dict[str, Any]) -> list[int]:
        try:
            return self.tokenizer.token_ids(path, body, first_only=True)[0]
        finally:
            self._finished += 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _work_bytes(path: str, body: dict[str, Any], raw_len: int) -> int:
    """About how much text tokenizing `body` means: the first prompt's characters for a
    completion (a batch's others are not tokenized), the body's size for chat."""
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, (str, list)):
            return len(prompt)
    return raw_len


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

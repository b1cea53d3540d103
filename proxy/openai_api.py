"""What the proxy needs to know of the OpenAI request bodies it relays.

vLLM validates everything else; the proxy checks only the fields it relies on, derives the
prefill-only body for P, and estimates prompt size and a routing key for the policies.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import ProxyError
from xpyd_wire.request_id import SKIP_TOKENS_PARAM

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def validate_body(kind: str, body: Any) -> None:
    """Check what the proxy itself relies on; vLLM validates everything else."""
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", "invalid_body")
    if kind == COMPLETIONS:
        prompt = body.get("prompt")
        if prompt is None:
            if body.get("prompt_embeds") is None:
                raise ProxyError(400, "'prompt' is required", "missing_field", "prompt")
        elif not _valid_prompt(prompt):
            raise ProxyError(
                400,
                "'prompt' must be a string, a list of strings, a list of token ids "
                "or a list of lists of token ids, and not empty",
                "invalid_field",
                "prompt",
            )
    else:
        messages = body.get("messages")
        if messages is None:
            raise ProxyError(400, "'messages' is required", "missing_field", "messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise ProxyError(
                400, "'messages' must be a non-empty list of objects", "invalid_field", "messages"
            )
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        # vLLM scores a prompt with echo and max_tokens 0 (its logprobs, no new token).
        if value is not None and (type(value) is not int or value < 0 or (value == 0 and body.get("echo") is not True)):
            raise ProxyError(400, f"'{key}' must be a positive integer", "invalid_field", key)
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        raise ProxyError(400, "'stream' must be a boolean", "invalid_field", "stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProxyError(400, "'model' must be a string", "invalid_field", "model")


_INT = frozenset({int})


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    first = prompt[0]
    if isinstance(first, str):
        return all(isinstance(p, str) for p in prompt)
    if type(first) is int:
        return set(map(type, prompt)) == _INT  # C-speed check of long token-id lists
    if isinstance(first, list):
        return all(isinstance(p, list) and p and set(map(type, p)) == _INT for p in prompt)
    return False


def prefill_body(kind: str, body: dict, skip_tokens: int = 0) -> dict:
    """The client's request, cut down to produce the KV cache and one token; `skip_tokens`:
    what D holds already, so P's connector ships only the rest (only the proxy says so: a
    client's own value is dropped)."""
    pre = dict(body)
    params = pre.get("kv_transfer_params")
    if isinstance(params, dict) and SKIP_TOKENS_PARAM in params:
        params = {k: v for k, v in params.items() if k != SKIP_TOKENS_PARAM}
        pre["kv_transfer_params"] = params
    if skip_tokens > 0:
        pre["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}), SKIP_TOKENS_PARAM: skip_tokens}
    pre["max_tokens"] = 1
    if kind == CHAT:
        pre["max_completion_tokens"] = 1
    pre["stream"] = False
    pre.pop("stream_options", None)
    # vLLM rejects min_tokens > max_tokens; prefill only needs one token anyway.
    if pre.get("min_tokens"):
        pre.pop("min_tokens")
    # The n samples of a prompt share its KV: P computes the prompt once, D fans out.
    pre.pop("n", None)
    pre.pop("best_of", None)
    # P's one sampled token is discarded. A seed also gives the request its own
    # generator, which vLLM 0.32's CPU build crashes on under chunked prefill
    # ("CPU Generator does not use offset"); the KV does not depend on it.
    pre.pop("seed", None)
    return pre


def estimate_prompt_tokens(body: dict) -> int:
    """Rough prompt size: ~4 characters per token for text, exact for token ids."""
    prompt = body.get("prompt")
    # A chat body may carry any "prompt" (validate_body checks it for completions only).
    if isinstance(prompt, (str, list)):
        if isinstance(prompt, str):
            return len(prompt) // 4 + 1
        total = 0
        for p in prompt:
            if isinstance(p, str):
                total += len(p) // 4 + 1
            elif isinstance(p, list):
                total += len(p)
            else:
                total += 1
        return total
    chars = 0
    for msg in body.get("messages") or ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    chars += len(part["text"])
    return chars // 4 + 1


def routing_key(body: dict) -> str | list[int]:
    """The text (or token ids) whose prefix decides which instance likely has it cached.

    A batch is keyed by its first prompt. A chat is keyed by its messages in order, role
    and text, so conversations that share their first turns share a key prefix (vLLM's
    chat template preserves that: the rendered prompt grows at the end)."""
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, str):
            return prompt
        first = prompt[0] if isinstance(prompt, list) and prompt else ""
        if isinstance(first, (str, list)):
            return first
        return prompt if isinstance(prompt, list) else ""
    parts: list[str] = []
    for msg in body.get("messages") or ():
        if not isinstance(msg, dict):
            continue
        parts.append(f"\x00{msg.get('role', '')}\x01")
        content = msg.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
    return "".join(parts)

"""What the proxy needs to know of the request bodies it splits into a prefill and a decode:
OpenAI completions and chat, OpenAI Responses, Anthropic Messages, vLLM's tokens-in generate.

vLLM validates everything else; the proxy checks only the fields it relies on, derives the
prefill-only body for P, and estimates prompt size and a routing key for the policies.
"""

from __future__ import annotations

import os
from typing import Any

from proxy.api_routes import CHAT, COMPLETIONS, GENERATE, MESSAGES, RESPONSES
from proxy.errors import ProxyError
from xpyd_wire.request_id import SKIP_TOKENS_PARAM, TRANSFER_ID_PARAM

__all__ = ["CHAT", "COMPLETIONS", "GENERATE", "MESSAGES", "RESPONSES", "validate_body", "prefill_body",
           "estimate_prompt_tokens", "routing_key", "response_id", "decode_responses_body", "client_request_id"]

# The answer's length as each API names it (top level; generate's is in sampling_params).
_LIMIT_FIELDS = {COMPLETIONS: ("max_tokens",), CHAT: ("max_tokens", "max_completion_tokens"),
                 RESPONSES: ("max_output_tokens",), MESSAGES: ("max_tokens",)}  # fmt: skip


def validate_body(kind: str, body: Any) -> None:
    """Check what the proxy itself relies on; vLLM validates everything else."""
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", "invalid_body")
    if kind == RESPONSES:
        _validate_responses(body)
    elif kind == MESSAGES:
        _need_list(body, "messages")
    elif kind == GENERATE:
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or set(map(type, ids)) != _INT:
            raise ProxyError(400, "'token_ids' must be a non-empty list of token ids", "invalid_field", "token_ids")
        if not isinstance(body.get("sampling_params"), dict):
            raise ProxyError(400, "'sampling_params' must be an object", "invalid_field", "sampling_params")
    elif kind == COMPLETIONS:
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
        _need_list(body, "messages")
    for key in _LIMIT_FIELDS.get(kind, ()):
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


def _need_list(body: dict, name: str) -> None:
    value = body.get(name)
    if value is None:
        raise ProxyError(400, f"'{name}' is required", "missing_field", name)
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise ProxyError(400, f"'{name}' must be a non-empty list of objects", "invalid_field", name)


def _validate_responses(body: dict) -> None:
    value = body.get("input")
    if not isinstance(value, str) and not (isinstance(value, list) and all(isinstance(i, dict) for i in value)):
        raise ProxyError(400, "'input' must be a string or a list of items", "invalid_field", "input")
    for name in ("request_id", "previous_response_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ProxyError(400, f"'{name}' must be a string", "invalid_field", name)


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


def prefill_body(kind: str, body: dict, skip_tokens: int = 0, transfer: str | None = None) -> dict:
    """The client's request, cut down to produce the KV cache and one token; `skip_tokens`:
    what D holds already, so P's connector ships only the rest (only the proxy says so: a
    client's own value is dropped); `transfer`: the transfer id, for the Responses API
    (its engine request id is the body's, not the X-Request-Id header)."""
    pre = dict(body)
    params = pre.get("kv_transfer_params")
    if isinstance(params, dict) and (SKIP_TOKENS_PARAM in params or TRANSFER_ID_PARAM in params):
        params = {k: v for k, v in params.items() if k not in (SKIP_TOKENS_PARAM, TRANSFER_ID_PARAM)}
        pre["kv_transfer_params"] = params
    ours: dict[str, Any] = {SKIP_TOKENS_PARAM: skip_tokens} if skip_tokens > 0 else {}
    if transfer is not None:
        ours[TRANSFER_ID_PARAM] = transfer
    if kind == MESSAGES:
        # vLLM's marker of a prefill leg: its Messages API then skips checking a thinking budget
        # against max_tokens (1 here; D's request is checked as the client sent it).
        ours["do_remote_decode"] = True
    if ours:
        pre["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}), **ours}
    if kind == GENERATE:
        return _prefill_generate(pre)
    if kind == RESPONSES:
        # P's one-token response is thrown away: never stored, never run in the background.
        pre["max_output_tokens"] = 1
        pre["store"] = False
        pre["background"] = False
        pre.pop("request_id", None)
    else:
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


def _prefill_generate(pre: dict) -> dict:
    """vLLM's tokens-in generate: the sampling parameters are an object of their own."""
    sampling = dict(pre.get("sampling_params") or {})
    sampling["max_tokens"] = 1
    for name in ("n", "best_of", "seed", "min_tokens"):
        sampling.pop(name, None)
    pre["sampling_params"] = sampling
    pre["stream"] = False
    pre.pop("stream_options", None)
    return pre


def client_request_id(kind: str, header: str | None, body: dict | None) -> str | None:
    """The client's own request id, which vLLM 0.32 names its answer after (``cmpl-{id}``): the
    X-Request-Id header first, else the body's ``request_id`` where the endpoint reads it
    (completions, chat, generate); None: vLLM would draw one. The Responses API names its
    response after the body's alone (``response_id``)."""
    if kind == RESPONSES:
        return None
    if header is not None:
        return header
    given = body.get("request_id") if body is not None and kind in (COMPLETIONS, CHAT, GENERATE) else None
    return given if isinstance(given, str) else None


def response_id(body: dict) -> str:
    """The id vLLM gives the response: the client's request_id, else one of vLLM 0.32's shape
    ("resp_" and 16 hex digits). D is sent it, so the proxy knows which D stores it."""
    given = body.get("request_id")
    return given if isinstance(given, str) else "resp_" + os.urandom(8).hex()


def decode_responses_body(body: dict, resp_id: str, transfer: str | None) -> dict:
    """The Responses request D answers: the client's, with the response id fixed (vLLM names the
    engine request after it) and, when D loads P's KV, the transfer id in kv_transfer_params."""
    out = dict(body)
    out["request_id"] = resp_id
    params = out.get("kv_transfer_params")
    if isinstance(params, dict) and TRANSFER_ID_PARAM in params:
        params = {k: v for k, v in params.items() if k != TRANSFER_ID_PARAM}
        out["kv_transfer_params"] = params
    if transfer is not None:
        out["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}), TRANSFER_ID_PARAM: transfer}
    return out


def _quarters(text: str) -> int:
    """A text's size in quarter tokens: an ASCII character is one (~4 a token, as English runs
    in LLM tokenizers); any other adds two per extra UTF-8 byte (CJK 1.25 tokens, Cyrillic or
    accented Latin 0.75, an emoji 1.75), since Chinese or Japanese runs ~1 token a character:
    counted as 4, a 600-token Chinese prompt looked like 150, under the local threshold.
    isascii is O(1) in CPython; only other text is encoded to count its bytes."""
    if text.isascii():
        return len(text)
    return len(text) + 2 * (len(text.encode("utf-8", "surrogatepass")) - len(text))


def _text_of(content: Any) -> int:
    """Quarter tokens of text in a message's content: a string, or parts/blocks with "text"."""
    if isinstance(content, str):
        return _quarters(content)
    chars = 0
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                chars += _quarters(part["text"])
    return chars


def estimate_prompt_tokens(body: dict, kind: str = COMPLETIONS) -> int:
    """Rough prompt size: ~4 ASCII characters a token for text (_quarters), exact for token ids."""
    if kind == GENERATE:
        ids = body.get("token_ids")
        return len(ids) if isinstance(ids, list) else 1
    if kind == RESPONSES:
        items = body.get("input")
        chars = _text_of(body.get("instructions") if isinstance(body.get("instructions"), str) else None)
        if isinstance(items, str):
            chars += _quarters(items)
        elif isinstance(items, list):
            chars += sum(_text_of(i.get("content")) for i in items if isinstance(i, dict))
        return chars // 4 + 1
    if kind == MESSAGES:
        chars = _text_of(body.get("system"))
        for msg in body.get("messages") or ():
            if isinstance(msg, dict):
                chars += _text_of(msg.get("content"))
        return chars // 4 + 1
    prompt = body.get("prompt")
    # A chat body may carry any "prompt" (validate_body checks it for completions only).
    if isinstance(prompt, (str, list)):
        if isinstance(prompt, str):
            return _quarters(prompt) // 4 + 1
        if prompt and type(prompt[0]) is int:
            return len(prompt)  # token ids (validate_body checked every one): no walk over a long list
        total = 0
        for p in prompt:
            if isinstance(p, str):
                total += _quarters(p) // 4 + 1
            elif isinstance(p, list):
                total += len(p)
            else:
                total += 1
        return total
    chars = 0
    for msg in body.get("messages") or ():
        if isinstance(msg, dict):
            chars += _text_of(msg.get("content"))
    return chars // 4 + 1


def routing_key(body: dict) -> str | list[int]:
    """The text (or token ids) whose prefix decides which instance likely has it cached.

    A batch is keyed by its first prompt. A chat is keyed by its messages in order, role
    and text, so conversations that share their first turns share a key prefix (vLLM's
    chat template preserves that: the rendered prompt grows at the end)."""
    ids = body.get("token_ids")  # generate: the prompt as token ids
    if isinstance(ids, list) and "sampling_params" in body:
        return ids
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, str):
            return prompt
        first = prompt[0] if isinstance(prompt, list) and prompt else ""
        if isinstance(first, (str, list)):
            return first
        return prompt if isinstance(prompt, list) else ""
    parts: list[str] = []
    # Responses and Messages: the instructions or system prompt lead the rendered prompt.
    for lead in (body.get("instructions"), body.get("system")):
        if isinstance(lead, str):
            parts.append("\x00system\x01" + lead)
    items = body.get("input")
    if isinstance(items, str):
        parts.append("\x00user\x01" + items)
    for msg in (items if isinstance(items, list) else body.get("messages")) or ():
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

"""The fake vLLM's answers on the routes beyond completions and chat, in vLLM 0.32's shapes (each
checked against the real server by tests/e2e/test_e2e_routes.py): the Responses API (whole and
streamed, stored responses, cancel), Anthropic Messages (whole and streamed), tokens-in generate,
and a few generation-free routes (tokenize, detokenize, embeddings, version, count_tokens).

The fake's text is " t0 t1 ..." as on its completion routes; its tokenizer is one id per
character (fake_vllm.prompt_token_ids).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tests.support import fake_vllm  # its tokenizer and token ids (it imports this module: used at call time)


def prompt_token_ids(prompt: Any) -> list[int]:
    return fake_vllm.prompt_token_ids(prompt)


def dumps(data: Any) -> bytes:
    """As vLLM's JSONResponse (Starlette's) writes it: compact, not ASCII-escaped."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def vllm_id() -> str:
    """vLLM 0.32's random_uuid(): 16 hex digits."""
    return os.urandom(8).hex()


@dataclass
class Answer:
    status: int
    body: bytes = b""  # whole answer (content_type JSON)
    events: list[bytes] = field(default_factory=list)  # a stream's SSE events, when streaming
    content_type: str = "application/json"

    @property
    def streaming(self) -> bool:
        return bool(self.events)


def error(status: int, message: str, kind: str, param: str | None = None) -> Answer:
    return Answer(status, dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}))


def _text(n: int) -> str:
    return "".join(f" t{i}" for i in range(n))


def _chars(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


# ---------------------------------------------------------------------------------- Responses


def responses_prompt(body: dict) -> list[int]:
    items = body.get("input")
    text = body.get("instructions") or ""
    if isinstance(items, str):
        text += items
    elif isinstance(items, list):
        text += "".join(_chars(i.get("content")) for i in items if isinstance(i, dict))
    return prompt_token_ids(text)


def response_object(body: dict, resp_id: str, model: str, n: int | None, status: str, loads: bool = False) -> dict:
    """vLLM 0.32's ResponsesResponse: `n` tokens generated (None: not yet, in a stream's lead)."""
    limit = body.get("max_output_tokens")
    done = n is not None
    output = []
    usage = None
    if done:
        output = [{"id": "msg_" + vllm_id(), "content": [{"annotations": [], "text": _text(n), "type": "output_text",
                                                          "logprobs": None}],
                   "role": "assistant", "status": "completed", "type": "message", "phase": None}]
        prompt = len(responses_prompt(body))
        # As vLLM 0.32 counts them: a D that loaded the prompt's KV (all but its last token) finds
        # it cached and writes nothing; a server that computed it writes its whole blocks.
        loaded = isinstance(body.get("kv_transfer_params"), dict) and "xpyd_transfer_id" in body["kv_transfer_params"]
        cached, written = (prompt - 1, 0) if loaded and loads else (0, prompt // 128 * 128)
        usage = {"input_tokens": prompt,
                 "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written,
                                          "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                 "output_tokens": n,
                 "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                           "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                 "total_tokens": prompt + n}
    return {
        "id": resp_id, "created_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if done and status == "incomplete" else None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": model,
        "object": "response", "output": output, "parallel_tool_calls": True,
        "temperature": body.get("temperature", 1.0), "tool_choice": "none" if not body.get("tools") else "auto",
        "tools": body.get("tools") or [], "top_p": body.get("top_p", 1.0), "background": bool(body.get("background")),
        "max_output_tokens": limit, "max_tool_calls": None, "previous_response_id": body.get("previous_response_id"),
        "prompt": None, "reasoning": None, "service_tier": "auto", "status": status, "text": None,
        "top_logprobs": None, "truncation": "disabled", "usage": usage, "user": None, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None,
        "output_messages": None,
    }


def responses(body: dict, model: str, n: int, stored: dict[str, bytes], loads: bool = False) -> Answer:
    """POST /v1/responses: every answer runs to max_output_tokens (16 when absent)."""
    resp_id = body.get("request_id") or "resp_" + vllm_id()
    prev = body.get("previous_response_id")
    if prev is not None and prev not in stored:
        return error(404, f"Response with id '{prev}' not found.", "invalid_request_error", "previous_response_id")
    final = response_object(body, resp_id, model, n, "incomplete", loads)
    if body.get("store", True):
        stored[resp_id] = dumps(final)
    if not body.get("stream"):
        return Answer(200, dumps(final))
    item = final["output"][0]
    msg_id, text = item["id"], item["content"][0]["text"]
    events: list[tuple[str, dict]] = [
        ("response.created", {"response": response_object(body, resp_id, model, None, "in_progress")}),
        ("response.in_progress", {"response": response_object(body, resp_id, model, None, "in_progress")}),
        ("response.output_item.added", {"item": {**item, "content": [], "status": "in_progress"}, "output_index": 0}),
        ("response.content_part.added", {"content_index": 0, "item_id": msg_id, "output_index": 0,
                                         "part": {"annotations": [], "text": "", "type": "output_text",
                                                  "logprobs": []}}),
    ]
    for i in range(n):
        events.append(("response.output_text.delta", {"content_index": 0, "delta": f" t{i}", "item_id": msg_id,
                                                      "logprobs": [], "output_index": 0}))
    events += [
        ("response.output_text.done", {"content_index": 0, "item_id": msg_id, "logprobs": [], "output_index": 0,
                                       "text": text}),
        ("response.content_part.done", {"content_index": 0, "item_id": msg_id, "output_index": 0,
                                        "part": item["content"][0]}),
        ("response.output_item.done", {"item": item, "output_index": 0}),
        ("response.completed", {"response": final}),
    ]
    out = []
    for seq, (kind, data) in enumerate(events):
        out.append(b"event: " + kind.encode() + b"\ndata: " + dumps({**data, "sequence_number": seq, "type": kind})
                   + b"\n\n")
    return Answer(200, events=out, content_type="text/event-stream; charset=utf-8")


def stored_response(method: str, path: str, stored: dict[str, bytes]) -> Answer:
    """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel."""
    parts = path.split("/")
    resp_id = parts[3]
    if resp_id not in stored:
        return error(404, f"Response with id '{resp_id}' not found.", "invalid_request_error", "response_id")
    if method == "POST":  # the fake's responses are all synchronous
        return error(400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id")
    return Answer(200, stored[resp_id])


# ----------------------------------------------------------------------------------- Messages


def messages(body: dict, model: str, n: int, rid: str) -> Answer:
    """POST /v1/messages (vLLM renders it as a chat: its id is the chat's)."""
    text = "".join(_chars(m.get("content")) for m in body.get("messages") or () if isinstance(m, dict))
    prompt = len(prompt_token_ids(_chars(body.get("system")) + text))
    msg_id = f"chatcmpl-{rid}" if rid else "chatcmpl-" + vllm_id()
    if not body.get("stream"):
        return Answer(200, dumps({"id": msg_id, "type": "message", "role": "assistant",
                                  "content": [{"type": "text", "text": _text(n)}], "model": model,
                                  "stop_reason": "max_tokens", "usage": {"input_tokens": prompt, "output_tokens": n}}))
    events: list[tuple[str, dict]] = [
        ("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "content": [], "model": model, "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": prompt, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "content_block": {"type": "text", "text": ""},
                                 "index": 0}),
    ]
    for i in range(n):
        events.append(("content_block_delta", {"type": "content_block_delta",
                                               "delta": {"type": "text_delta", "text": f" t{i}"}, "index": 0}))
    events += [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                           "usage": {"input_tokens": prompt, "output_tokens": n}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return Answer(200, events=[b"event: " + k.encode() + b"\ndata: " + dumps(d) + b"\n\n" for k, d in events],
                  content_type="text/event-stream; charset=utf-8")


MESSAGES_ERROR_EVENT = b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":' \
                       b'"Internal server error"}}\n\n'


# ----------------------------------------------------------------------------------- generate


def generate(body: dict, model: str, rid: str) -> Answer:
    """POST /inference/v1/generate (vLLM's --enable-scale-out): token ids in, token ids out."""
    params = body.get("sampling_params") or {}
    n = max(1, min(int(params.get("max_tokens") or 16), 4096))
    request_id = f"generate-tokens-{rid or vllm_id()}"
    prompt = len(body.get("token_ids") or ())
    ids = [fake_vllm.FIRST_TOKEN_ID + i for i in range(n)]
    if not body.get("stream"):
        return Answer(200, dumps({
            "request_id": request_id, "model": model, "created": int(time.time()),
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n,
                      "prompt_tokens_details": None, "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None, "mm_placeholders": None,
            "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": ids,
                         "routed_experts": None, "sampling_mask": None,
                         "weight_versions": [{"version": "default", "start": 0, "end": n}], "logprobs": None}]}))
    events = []
    for i, t in enumerate(ids):
        last = i == n - 1
        events.append(b"data: " + dumps({
            "request_id": request_id, "usage": None, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "length" if last else None, "stop_reason": None, "token_ids": [t],
                         "routed_experts": None, "sampling_mask": None,
                         "weight_versions": [{"version": "default", "start": 0, "end": n}] if last else None,
                         "logprobs": None}]}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return Answer(200, events=events, content_type="text/event-stream; charset=utf-8")


# ------------------------------------------------------------------------ generation-free routes


def tokenize(body: dict) -> Answer:
    ids = prompt_token_ids(body.get("prompt") if "prompt" in body else
                           "".join(_chars(m.get("content")) for m in body.get("messages") or ()))
    return Answer(200, dumps({"count": len(ids), "max_model_len": 8192, "tokens": ids, "token_strs": None}))


def detokenize(body: dict) -> Answer:
    ids = body.get("tokens") or []
    return Answer(200, dumps({"prompt": "".join(chr(t) for t in ids if isinstance(t, int) and 0 <= t < 800)}))


def count_tokens(body: dict) -> Answer:
    text = "".join(_chars(m.get("content")) for m in body.get("messages") or () if isinstance(m, dict))
    n = len(prompt_token_ids(_chars(body.get("system")) + text))
    return Answer(200, dumps({"input_tokens": n, "context_management": {"original_input_tokens": n}}))


def embeddings(body: dict, model: str) -> Answer:
    inputs = body.get("input")
    inputs = inputs if isinstance(inputs, list) else [inputs]
    data = [{"index": i, "object": "embedding", "embedding": [0.5, -0.25, float(len(str(x)))]}
            for i, x in enumerate(inputs)]
    n = sum(len(str(x)) for x in inputs)
    return Answer(200, dumps({"id": "embd-" + vllm_id(), "object": "list", "created": int(time.time()), "model": model,
                              "data": data, "usage": {"prompt_tokens": n, "total_tokens": n,
                                                      "completion_tokens": 0, "prompt_tokens_details": None}}))

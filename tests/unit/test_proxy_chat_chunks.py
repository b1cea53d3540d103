"""D's completion chunks as chat chunks (proxy/dispatch/chat_chunks.py): the replacements that
translate vLLM's usual mid-stream chunks give what the per-event regex gives, byte for byte,
whatever else the piece holds, and are what translates those chunks."""

from __future__ import annotations

import json

import pytest

from proxy.dispatch import chat_chunks

HEAD = '{"id":"cmpl-r-0-1a2b","object":"text_completion","created":1700000000,"model":"tiny-llama","choices":['


def _event(text: str, finish: str | None = None, fingerprint: bool = False, index: int = 0) -> bytes:
    """A completion chunk as vLLM 0.32 streams it (field order, compact JSON, not ASCII-escaped)."""
    choice = (f'{{"index":{index},"text":{json.dumps(text, ensure_ascii=False)},"logprobs":null,'
              f'"finish_reason":{json.dumps(finish)},"stop_reason":null,"prompt_token_ids":null,"token_ids":null}}]')
    return ("data: " + HEAD + choice + (',"system_fingerprint":"fp"' if fingerprint else "") + "}\n\n").encode()


USAGE = (b'data: {"id":"cmpl-r-0-1a2b","object":"text_completion","created":1700000000,"model":"tiny-llama",'
         b'"choices":[],"usage":{"prompt_tokens":5,"total_tokens":9,"completion_tokens":4}}\n\n')
TEXTS = [" a", "", 'say "data: x"', "\\", "\u00e9\u4e2d", "data: {\"id\":1}\n", "},\"logprobs\":null", "\n\n"]


def _by_regex(done: bytes) -> bytes:
    return chat_chunks._MID_CHUNK.sub(chat_chunks._mid_chat, done)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("shape", ["mid", "mid+last", "last alone", "mid+usage", "other index", "partial"])
def test_replacements_give_what_the_regex_gives(text, shape):
    mid = b"".join(_event(t) for t in (" x", text, " y"))
    done = {
        "mid": mid,
        "mid+last": mid + _event(text, "length", fingerprint=True) + b"data: [DONE]\n\n",
        "last alone": _event(text, "stop"),
        "mid+usage": mid + USAGE,
        "other index": mid + _event(text, index=1) + _event(" z"),
        "partial": mid + _event(text)[:40],  # the next event's start, held by ContinuationEvents in use
    }[shape]
    assert chat_chunks.chat_chunks(done) == _by_regex(done)


def test_the_usual_chunks_are_replaced_not_matched_one_by_one(monkeypatch):
    """16 tokens: the regex's per-event call runs for the last chunk only."""
    calls: list[bytes] = []
    mid_chat = chat_chunks._mid_chat
    monkeypatch.setattr(chat_chunks, "_mid_chat", lambda m: calls.append(m.group(0)) or mid_chat(m))
    done = b"".join(_event(f" t{i}") for i in range(15)) + _event(" t15", "length", fingerprint=True)
    out = chat_chunks.chat_chunks(done)
    assert len(calls) == 1 and out.count(b'"object":"chat.completion.chunk"') == 16
    assert b'"delta":{"content":" t3"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n' in out

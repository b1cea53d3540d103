"""D's completion chunks as chat chunks, in C where they are vLLM's usual ones: with the first
token from P, D continues a chat request as a completion (first_token.continuation), and
events.ContinuationEvents turns what D sends into the chat stream the client asked for
(events these do not translate go through its JSON path)."""

from __future__ import annotations

import re

_STR = rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'  # a JSON string (on one line, as JSON writes it)
# vLLM's usual completion chunk, one per line: one choice, no logprobs, no usage, token-id
# fields null, the last one with system_fingerprint (its serving code: pydantic,
# exclude_unset).
_MID_CHUNK = re.compile(
    rb'(?m)^data: \{"id":(' + _STR + rb'),"object":"text_completion","created":(\d+),"model":(' + _STR
    + rb'),"choices":\[\{"index":(\d+),"text":(' + _STR + rb'),"logprobs":null,"finish_reason":('
    # null: the chat chunk has no stop_reason; the last chunk's reason keeps it
    rb'null(?=,"stop_reason":null)|' + _STR + rb',"stop_reason":(?:null|-?\d+|' + _STR + rb'))'
    rb'(?:,"stop_reason":null)?(?:,"[a-z_]+":null)*\}\]((?:,"system_fingerprint":' + _STR + rb')?)\}$'
)


def _mid_chat(m: re.Match[bytes]) -> bytes:
    """A _MID_CHUNK match as ContinuationEvents' JSON path makes it a chat chunk."""
    ident, created, model, index, text, finish, fingerprint = m.groups()
    return (b'data: {"id":' + ident + b',"object":"chat.completion.chunk","created":' + created + b',"model":'
            + model + b',"choices":[{"index":' + index + b',"delta":{"content":' + text
            + b'},"logprobs":null,"finish_reason":' + finish + b',"token_ids":null}]' + fingerprint + b"}")  # fmt: skip


TRANSLATED = b'"object":"chat.completion.chunk"'  # a completions server never writes it
# A _MID_CHUNK with a null finish_reason, by three replacements (issue 49: ~3x cheaper than the
# regex's match and call per event): none of these can be inside a JSON string (their quotes).
_MID = ((b'"object":"text_completion"', TRANSLATED), (b'"choices":[{"index":0,"text":',
        b'"choices":[{"index":0,"delta":{"content":'), (b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
        b'"prompt_token_ids":null,"token_ids":null}]}\n\n', b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'))


def chat_chunks(done: bytes) -> bytes:
    """D's completion chunks as chat chunks: up to the last usual mid-stream chunk by
    replacement when every event there has each piece once (each event ends with the last,
    and "data: " counts no fewer events than there are), the rest by _MID_CHUNK."""
    tail = _MID[2][0]
    cut = done.rfind(tail) + len(tail)
    if cut >= len(tail) and (mid := done[:cut]).count(b"data: ") == (n := mid.count(tail)) \
            and mid.count(_MID[0][0]) == mid.count(_MID[1][0]) == n:
        for old, new in _MID:
            mid = mid.replace(old, new)
        return mid + _MID_CHUNK.sub(_mid_chat, done[cut:])
    return _MID_CHUNK.sub(_mid_chat, done)

"""D's events on the first token from P's path (proxy/dispatch/first_token.py), as the client's
request counts them: usage with P's token as generated, logprobs text offsets after P's token,
P's id and ``created`` on every event, P's prompt-cache figures, and (chat) D's completion chunks
made chat chunks (vLLM's usual ones by chat_chunks.py). The bytes are rewritten where they must be,
at C speed where vLLM writes its usual chunk."""

from __future__ import annotations

import re

import orjson

from proxy.dispatch.chat_chunks import TRANSLATED, chat_chunks
from proxy.dispatch.relay import EVENT_END, EVENT_ENDS

_HOLD_MAX = 64 * 1024
_EVENT_SPLIT = re.compile(b"(" + EVENT_END.pattern + b")")  # keeps each event's end


_EVENT_ID = re.compile(rb'"id":\s*"(?:[^"\\]|\\.)*"')  # an event's first "id" is its top-level one
_EVENT_CREATED = re.compile(rb'"created":\d+')  # outside strings: inside one its quotes are escaped


class ContinuationEvents:
    """D's events as the client's request counts them: usage with P's token as generated
    rather than prompt (every usage D reports: a server may force it), logprobs text
    offsets after P's token, and P's event id (one stream, one id, also when D answered
    under another request id: a rescue, or a server that adds a suffix), and P's prompt-cache
    figures in place of D's, which counts the KV it loaded as cached (``details``: P's
    prompt_tokens_details as a stream writes them; None: P reported none). The stream
    arrives in arbitrary pieces: the complete events pass at once, what follows the last one's
    end (the event still arriving) waits for its end (bounded)."""

    def __init__(self, text_offset: int, event_id: str, chat: bool = False, created: int | None = None,
                 details: dict | None = None) -> None:
        self._chat = chat  # D's completion chunks become chat chunks (delta.content)
        self._details = details
        self._offset = text_offset
        self._held = b""
        self._id = b'"id":' + orjson.dumps(event_id)
        self._d_id: bytes | None = None  # D's "id": member as it writes it, once seen
        # vLLM stamps every event of a stream with one `created`: P's, which the client saw first.
        self._created = None if created is None else b'"created":%d' % created
        self._d_created: bytes | None = None

    def feed(self, chunk: bytes) -> bytes:
        buf = self._held + chunk
        if buf.endswith(EVENT_ENDS):
            cut = len(buf)
        else:
            # After the last complete event (vLLM writes each on one line: no event holds a blank
            # line); the event still arriving waits, up to _HOLD_MAX bytes of it. (The bound once
            # applied to the whole read: a read of 64 KiB and more, as a loaded proxy makes, then
            # let the event it ended inside out in two pieces, neither rewritten.)
            cut = max((i + len(end) for end in EVENT_ENDS if (i := buf.rfind(end)) >= 0), default=0)
            if len(buf) - cut > _HOLD_MAX:
                cut = len(buf)
        self._held, done = buf[cut:], buf[:cut]
        if self._d_id is None and (m := _EVENT_ID.search(done)) is not None:
            self._d_id = m.group(0)
        if self._d_id is not None and self._d_id != self._id:
            done = done.replace(self._d_id, self._id)
        if self._created is not None:
            if self._d_created is None and (m := _EVENT_CREATED.search(done)) is not None:
                self._d_created = m.group(0)
            if self._d_created is not None and self._d_created != self._created:
                done = done.replace(self._d_created, self._created)
        if self._chat:
            # The usual chunks in C (chat_chunks.py): per event in Python, this cost more than all
            # the rest of a proxied chat stream. What is left goes through the JSON path.
            done = chat_chunks(done)
            if b'"text_completion"' not in done and b'"usage"' not in done:
                return done
        elif b'"usage"' not in done and (not self._offset or b'"text_offset"' not in done):
            return done
        if done.endswith(b"\n\n") and done.find(b"\n") == len(done) - 2:  # one event, as vLLM writes them
            return self._event(done[:-2]) + b"\n\n"
        parts = _EVENT_SPLIT.split(done)  # events and their ends, alternating
        return b"".join(self._event(p) if i % 2 == 0 else p for i, p in enumerate(parts))

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held

    def _event(self, event: bytes) -> bytes:
        usage = b'"usage"' in event
        offsets = self._offset and b'"text_offset"' in event
        if not (usage or offsets or self._chat) or not event.startswith(b"data: ") or b"\n" in event \
                or b"\r" in event or event == b"data: [DONE]" or TRANSLATED in event:
            return event  # not vLLM's one-line event (or made a chat chunk above): as it is
        try:
            obj = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return event
        if not isinstance(obj, dict):
            return event
        if usage and isinstance(u := obj.get("usage"), dict) and type(u.get("prompt_tokens")) is int \
                and type(u.get("completion_tokens")) is int:
            u["prompt_tokens"] -= 1
            u["completion_tokens"] += 1
            if self._details is not None and isinstance(u.get("prompt_tokens_details"), dict):
                u["prompt_tokens_details"] = dict(self._details)
        if offsets:
            for choice in obj.get("choices") or ():
                lp = choice.get("logprobs") if isinstance(choice, dict) else None
                if isinstance(lp, dict) and isinstance(lp.get("text_offset"), list):
                    lp["text_offset"] = [o + self._offset if type(o) is int else o for o in lp["text_offset"]]
        if self._chat and isinstance(obj.get("choices"), list) and "error" not in obj:
            obj["object"] = "chat.completion.chunk"
            obj["choices"] = [_chat_choice(c) for c in obj["choices"] if isinstance(c, dict)]
            if obj["choices"] and isinstance(u := obj.get("usage"), dict):
                # vLLM's chat writes it on a token's usage (null without a reasoning parser),
                # not on the last usage event.
                u.setdefault("completion_tokens_details", None)
        return b"data: " + orjson.dumps(obj)


def _chat_choice(choice: dict) -> dict:
    """A completion chunk's choice as a chat chunk's (vLLM's fields: no logprobs here,
    which chat requests on this path do not ask for)."""
    out = {"index": choice.get("index", 0), "delta": {"content": choice.get("text") or ""}, "logprobs": None,
           "finish_reason": choice.get("finish_reason")}
    if out["finish_reason"] is not None:
        out["stop_reason"] = choice.get("stop_reason")
    out["token_ids"] = None  # vLLM 0.32 writes it on every chat chunk but the role's
    return out

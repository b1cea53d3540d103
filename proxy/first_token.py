"""The client's first token from P (``--first-token prefill``).

P computes the prompt's KV and samples one token anyway (the prefill request has
max_tokens=1). In this mode the proxy asks P for that token's id (``return_token_ids``),
sends it to the client as the stream's first event as soon as P answers, and asks D to
continue from the prompt's token ids plus that token, with one token fewer to generate. D's
connector then loads P's KV for all of D's prompt but that last token (the request carries
P's prompt length, ``PREFILL_PROMPT_TOKENS_PARAM``). The client's first token no longer
waits for the KV transfer and D's first step: TTFT is P's.

Greedy output is the same token for token: D sees the same token sequence as a colocated
server would after its first step. Only requests where the split cannot change the answer
take this path; every other request is dispatched as before (``eligible``):
streaming completions of one prompt (text or token ids) with n=1, a max_tokens or none
(vLLM's 16, also for null; capped by the override D advertises, ``OutputLimits``), without
stop strings
(one could span P's token and D's first), presence or frequency penalties (they count
generated tokens: D would count one fewer), echo, prompt logprobs, a seed (P's sampling
runs without one) or structured output. Logprobs come from each side for its tokens (D's
text offsets moved past P's token); usage counts P's token as generated.

Streaming chat completions take it too when their messages are text, they say how many
tokens to generate or D advertises its output limits (D's completion then gets the
server's limit less P's token: the generation config's max_new_tokens, or the context
left), and ask for no tools, chat logprobs or other chat-only output. Every limit is
capped by D's override where D advertises one, as vLLM caps it. P renders the chat template and
returns the rendered prompt's ids; D continues from them with a completion, whose chunks
become chat chunks (``ContinuationEvents(chat=True)``). When P's server parsed its token
as reasoning or a tool call, D answers the client's own request instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.openai_api import CHAT, COMPLETIONS, prefill_body
from proxy.relay import EVENT_END, EVENT_ENDS
from proxy.request import RouteRequest
from xpyd_wire.discovery import OutputLimits
from xpyd_wire.request_id import PREFILL_PROMPT_TOKENS_PARAM, SKIP_TOKENS_PARAM

_OURS = (PREFILL_PROMPT_TOKENS_PARAM, SKIP_TOKENS_PARAM)  # set by the proxy, never by a client

# A field whose value is not in its neutral set makes the request ineligible.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "prompt_logprobs": (None,),
    "stop": (None, "", []),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "seed": (None,),
    "suffix": (None, ""),
    "bad_words": (None, []),
    "return_token_ids": (None, False),
    "return_tokens_as_token_ids": (None, False),
    "prompt_embeds": (None,),
    "response_format": (None,),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "logits_processors": (None,),
    "use_beam_search": (None, False),
    "vllm_xargs": (None,),
}


# Chat: the keys that only shape the prompt (P renders it; D gets its token ids), and the
# chat-only keys that are neutral at these values. Any other chat-only key (tools, logprobs,
# audio, ...) keeps the request on the usual path.
_CHAT_PROMPT_ONLY = frozenset({"messages", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                               "continue_final_message", "add_special_tokens", "documents", "reasoning_effort",
                               "max_completion_tokens"})
_CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),  # without tools: nothing to call
    "parallel_tool_calls": (None, True, False),
    "include_reasoning": (None, True),
    "return_prompt_text": (None, False),
}
# What D's completions request takes from a chat request (vLLM's CompletionRequest fields
# that mean the same there); _NEUTRAL's keys are checked before, so they may pass too.
_COMPLETION_KEYS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                              "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                              "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
                              "allowed_token_ids", "logit_bias", "user", "stream", "stream_options", "priority",
                              "cache_salt", "kv_transfer_params", "truncate_prompt_tokens", "request_id"})


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    """``value`` is absent (None) or one of ``allowed``, of the same type (True is not 1)."""
    return value is None or any(value == n and type(value) is type(n) for n in allowed)


def _text_messages(messages: Any) -> bool:
    """Chat messages of text only: D gets the prompt as token ids, which carry no images
    or audio."""
    if not isinstance(messages, list) or not messages:
        return False
    for m in messages:
        if not isinstance(m, dict):
            return False
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                return False
        elif content is not None and not isinstance(content, str):
            return False
    return True


def _within(limit: Any, limits: OutputLimits | None) -> bool:
    """A limit vLLM takes: none, or a positive int, and no more than the context where D
    says it (beyond it vLLM answers 400, a status only D's first token can still give)."""
    if limit is None:
        return True
    return type(limit) is int and limit >= 1 and (limits is None or limits.context is None or limit <= limits.context)


def _chat_eligible(body: dict, limits: OutputLimits | None) -> bool:
    if not _text_messages(body.get("messages")):
        return False
    given = (body.get("max_completion_tokens"), body.get("max_tokens"))
    if not all(_within(v, limits) for v in given):
        return False
    if given == (None, None) and (limits is None or (limits.limit(None) is None and limits.context is None)):
        # The limit of a chat request that sets none (the generation config's, or the
        # context left) is known here only from D's output limits (its registration's).
        return False
    for key, value in body.items():
        if key in _CHAT_PROMPT_ONLY or key in _COMPLETION_KEYS or key in _NEUTRAL:
            continue
        neutral = _CHAT_NEUTRAL.get(key)
        if neutral is None or not _neutral(value, neutral):
            return False
    return True


def eligible(req: RouteRequest, limits: OutputLimits | None) -> bool:
    """Whether the request's answer may start with P's token (see the module's text);
    ``limits``: D's output limits, None where D did not advertise them."""
    body = req.body
    if body.get("stream") is not True:
        return False  # a whole answer has no first token to hurry
    if req.path == CHAT:
        if not _chat_eligible(body, limits):
            return False
    elif req.path == COMPLETIONS:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and type(prompt[0]) is int)):
            return False  # a batch of prompts
        logprobs = body.get("logprobs")
        if logprobs is not None and (type(logprobs) is not int or logprobs < 0):
            return False
        if not _within(body.get("max_tokens"), limits):  # null: vLLM 0.32's 16, as when absent
            return False
    else:
        return False
    for key, value in body.items():  # a handful of keys, against _NEUTRAL's thirty
        neutral = _NEUTRAL.get(key)
        if neutral is not None and not _neutral(value, neutral):
            return False
    if not isinstance(body.get("kv_transfer_params", {}), dict):
        return False
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}):
        return False
    return True


def usage_wanted(body: dict) -> tuple[bool, bool]:
    """(a usage event at the end, usage on every event), as vLLM reads stream_options."""
    opts = body.get("stream_options")
    if not isinstance(opts, dict) or opts.get("include_usage") is not True:
        return False, False
    return True, opts.get("continuous_usage_stats") is True


def prefill_request(path: str, body: dict, skip_tokens: int = 0) -> dict:
    """P's request: the prefill-only body, asking for the token ids and keeping min_tokens
    (up to the one token): P's token is the client's, so EOS must not come early."""
    pre = prefill_body(path, body, skip_tokens)
    pre["return_token_ids"] = True
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 0:
        pre["min_tokens"] = 1
    return pre


@dataclass(frozen=True, slots=True)
class PromptIds:
    """The prompt's token ids as P's JSON spelled them (``raw``: the array, ``b"[1,2,3]"``)
    and how many. D's request carries them as they are (``orjson.Fragment``): parsing a
    long prompt's ids into ints and writing them back for D was the largest cost of this
    path that grows with the prompt (~12 us to parse and ~3 us to write per 1k tokens)."""

    raw: bytes
    count: int

    @classmethod
    def of(cls, ids: list[int]) -> PromptIds:
        return cls(orjson.dumps(ids), len(ids))

    def __len__(self) -> int:
        return self.count

    def followed_by(self, token_ids: list[int]) -> orjson.Fragment:
        """These ids and then ``token_ids``, as one JSON array."""
        tail = b",".join(str(t).encode() for t in token_ids)
        return orjson.Fragment(self.raw[:-1] + b"," + tail + b"]" if tail else self.raw)


@dataclass(frozen=True, slots=True)
class FirstToken:
    """What P answered: its one token and the prompt's ids as P tokenized them (for chat:
    the rendered prompt's)."""

    chat: bool
    id: str
    created: int
    model: str
    text: str
    token_ids: list[int]
    prompt_ids: PromptIds
    finish_reason: str | None
    stop_reason: Any
    usage: dict | None
    logprobs: dict | None  # P's for its token, when asked for


_PROMPT_IDS_KEY = b'"prompt_token_ids":['
_PLACEHOLDER = -1  # no token id: where the cut-out ids were, for the check that they were P's
_NOT_DIGITS = bytes(c for c in range(256) if c not in b"0123456789,")


def _cut_prompt_ids(data: bytes) -> tuple[bytes, PromptIds] | None:
    """P's answer with its first ``prompt_token_ids`` array replaced by the placeholder,
    and that array, when it is compact JSON of digits and commas (as vLLM writes it);
    else None (the whole answer is then parsed). The array cannot reach past its first "]",
    so D's request gets an array whatever P sent."""
    start = data.find(_PROMPT_IDS_KEY)
    if start < 0:
        return None
    start += len(_PROMPT_IDS_KEY) - 1  # at "["
    end = data.find(b"]", start)
    if end < 0:
        return None
    inner = data[start + 1:end]
    # Digits and commas only: translate deletes everything else.
    if not inner or inner.translate(None, _NOT_DIGITS) != inner:
        return None
    rest = data[:start] + b"[" + str(_PLACEHOLDER).encode() + data[end:]
    return rest, PromptIds(data[start:end + 1], inner.count(b",") + 1)


def _prompt_ids(data: bytes, chat: bool) -> tuple[dict, PromptIds | None]:
    """P's answer as an object and the prompt's ids it holds (None: not usable), cut out of
    the bytes when they are where the prompt's ids belong (the placeholder's place) and P's
    usage counts them (vLLM: prompt_tokens is their number); else the answer is parsed whole
    and its ids are checked for presence and kind, not each of a long prompt's (70 us at 4k
    tokens): the JSON is vLLM's, and D validates the ids it gets like any prompt."""
    def held(obj: dict) -> Any:
        return obj["prompt_token_ids"] if chat else obj["choices"][0]["prompt_token_ids"]

    cut = _cut_prompt_ids(data)
    if cut is not None:
        obj = orjson.loads(cut[0])
        usage = obj.get("usage")
        # An empty element ("1,,2") or another such array first misses one of these.
        if held(obj) == [_PLACEHOLDER] and isinstance(usage, dict) and usage.get("prompt_tokens") == cut[1].count:
            return obj, cut[1]
    obj = orjson.loads(data)
    prompt = held(obj)
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int and type(prompt[-1]) is int:
        return obj, PromptIds.of(prompt)
    return obj, None


def parse(data: bytes, chat: bool = False) -> FirstToken | None:
    """P's answer, or None when it lacks what this mode needs (a vLLM without
    return_token_ids), its token is part of a character, or (chat) the server parsed it as
    reasoning or a tool call: the request then goes on with D's first token (D gets the
    client's request and loads all but the last prompt token)."""
    try:
        obj, ids = _prompt_ids(data, chat)
        if ids is None:
            return None
        choice = obj["choices"][0]
        if chat:
            message = choice["message"]
            if message.get("tool_calls") or message.get("reasoning_content") is not None \
                    or message.get("reasoning") is not None:
                return None  # a server-side parser at work: its output is not plain text
            tokens, text = choice["token_ids"], message.get("content")
        else:
            tokens, text = choice["token_ids"], choice.get("text")
        if not (isinstance(tokens, list) and len(tokens) == 1 and type(tokens[0]) is int):
            return None
        if not isinstance(text, str) or "\ufffd" in text:
            # Part of a character: vLLM would have held it back until the next token, and
            # D cannot take the rest of it. D answers as in the default mode instead.
            return None
        logprobs = None if chat else choice.get("logprobs")
        return FirstToken(chat, str(obj.get("id", "")), int(obj.get("created", 0)), str(obj.get("model", "")), text,
                          tokens, ids, choice.get("finish_reason"), choice.get("stop_reason"),
                          obj.get("usage") if isinstance(obj.get("usage"), dict) else None,
                          logprobs if isinstance(logprobs, dict) else None)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
        return None


# vLLM's CompletionRequest.max_tokens when the request leaves it out (0.32 and 0.33).
COMPLETION_DEFAULT_MAX_TOKENS = 16


def max_tokens(body: dict, chat: bool, limits: OutputLimits | None) -> int | None:
    """How many tokens the server lets the answer have, before the context left (None: only
    that): the client's limit (chat: max_completion_tokens first; a completion without
    max_tokens, or with null, which vLLM 0.32 reads alike: its default), or without one
    the server's default, then capped by its override. ``limits`` None (not known): the
    client's limit as it stands."""
    if chat:
        requested = body.get("max_completion_tokens")
        if requested is None:
            requested = body.get("max_tokens")
    else:
        requested = body.get("max_tokens")
        if requested is None:
            requested = COMPLETION_DEFAULT_MAX_TOKENS
    return requested if limits is None else limits.limit(requested)


def _d_tokens(body: dict, first: FirstToken, limits: OutputLimits | None) -> int:
    """How many tokens D is to add after P's: the limit less P's token, or without a limit
    the context left after P's prompt and token (``eligible`` let such a request through
    only with the context known)."""
    limit = max_tokens(body, first.chat, limits)
    if limit is not None:
        return limit - 1
    assert limits is not None and limits.context is not None
    return limits.context - len(first.prompt_ids) - 1


def complete_at_prefill(body: dict, first: FirstToken, limits: OutputLimits | None) -> bool:
    """P's token ends the answer: it stopped (EOS, a stop token), one token was asked for,
    or it filled the context."""
    return first.finish_reason not in (None, "length") or _d_tokens(body, first, limits) <= 0


def continuation(body: dict, first: FirstToken, limits: OutputLimits | None) -> dict:
    """D's request, always a completion (POST it to COMPLETIONS): the prompt as P's token
    ids plus P's token, one token fewer to generate, and P's prompt length for D's
    connector. A chat request keeps only what a completion means the same way."""
    cont = {k: v for k, v in body.items() if k in _COMPLETION_KEYS} if first.chat else dict(body)
    cont["prompt"] = first.prompt_ids.followed_by(first.token_ids)
    # A number, always: vLLM 0.32 reads a completion's null as its default, 16.
    cont["max_tokens"] = _d_tokens(body, first, limits)
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 0:
        cont["min_tokens"] = body["min_tokens"] - 1
    cont.pop("truncate_prompt_tokens", None)  # P's ids are already cut to it
    own = {k: v for k, v in (body.get("kv_transfer_params") or {}).items() if k not in _OURS}
    cont["kv_transfer_params"] = {**own, PREFILL_PROMPT_TOKENS_PARAM: len(first.prompt_ids)}
    return cont


def alone(cont: dict) -> dict:
    """D's request when it continues alone (its KV load failed): D prefills prompt + token."""
    out = dict(cont)
    params = {k: v for k, v in cont.get("kv_transfer_params", {}).items() if k not in _OURS}
    if params:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return out


def _event(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def first_events(first: FirstToken, final: bool, usage: tuple[bool, bool]) -> bytes:
    """The stream's first events, as vLLM would have sent them (``usage``: ``usage_wanted``;
    chat: the assistant's role chunk, then the token's), and, when P's token ends the
    answer, the rest of the stream: the usage event if asked for, then [DONE]."""
    include_usage, continuous = usage
    kind = "chat.completion.chunk" if first.chat else "text_completion"
    head = {"id": first.id, "object": kind, "created": first.created, "model": first.model}
    end = {"finish_reason": first.finish_reason if final else None,
           "stop_reason": first.stop_reason if final else None}
    out = b""
    if first.chat:
        role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]}
        if continuous and first.usage is not None:
            role["usage"] = {**first.usage, "completion_tokens": 0,
                             "total_tokens": first.usage.get("prompt_tokens", 0)}
        out = _event(role)
        choice = {"index": 0, "delta": {"content": first.text}, "logprobs": None, **end}
    else:
        choice = {"index": 0, "text": first.text, "logprobs": first.logprobs, **end}
    event = {**head, "choices": [choice]}
    if continuous and first.usage is not None:
        event["usage"] = first.usage
    out += _event(event)
    if final:
        if include_usage and first.usage is not None:
            out += _event({**head, "choices": [], "usage": first.usage})
        out += b"data: [DONE]\n\n"
    return out


def text_offset_after(first: FirstToken) -> int:
    """Where D's logprobs text offsets must start: after P's token, as vLLM counts them
    (each token's decoded string, from 0)."""
    if first.logprobs is None:
        return 0
    offsets, tokens = first.logprobs.get("text_offset"), first.logprobs.get("tokens")
    if isinstance(offsets, list) and offsets and isinstance(tokens, list) and tokens \
            and type(offsets[-1]) is int and isinstance(tokens[-1], str):
        return offsets[-1] + len(tokens[-1])
    return 0


_HOLD_MAX = 64 * 1024
_EVENT_SPLIT = re.compile(b"(" + EVENT_END.pattern + b")")  # keeps each event's end


_EVENT_ID = re.compile(rb'"id":\s*"(?:[^"\\]|\\.)*"')  # an event's first "id" is its top-level one


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
    """A _MID_CHUNK match as the JSON path below makes it a chat chunk."""
    ident, created, model, index, text, finish, fingerprint = m.groups()
    return (b'data: {"id":' + ident + b',"object":"chat.completion.chunk","created":' + created + b',"model":'
            + model + b',"choices":[{"index":' + index + b',"delta":{"content":' + text
            + b'},"logprobs":null,"finish_reason":' + finish + b"}]" + fingerprint + b"}")  # fmt: skip


_TRANSLATED = b'"object":"chat.completion.chunk"'  # a completions server never writes it


class ContinuationEvents:
    """D's events as the client's request counts them: usage with P's token as generated
    rather than prompt (every usage D reports: a server may force it), logprobs text
    offsets after P's token, and P's event id (one stream, one id, also when D answered
    under another request id: a rescue, or a server that adds a suffix). The stream
    arrives in arbitrary pieces: what precedes the last event's start passes at once, that
    event waits for its end (bounded)."""

    def __init__(self, text_offset: int, event_id: str, chat: bool = False) -> None:
        self._chat = chat  # D's completion chunks become chat chunks (delta.content)
        self._offset = text_offset
        self._held = b""
        self._id = b'"id":' + orjson.dumps(event_id)
        self._d_id: bytes | None = None  # D's "id": member as it writes it, once seen

    def feed(self, chunk: bytes) -> bytes:
        buf = self._held + chunk
        if buf.endswith(EVENT_ENDS) or len(buf) > _HOLD_MAX:
            cut = len(buf)
        else:
            cut = buf.rfind(b"data:")
            if cut < 0:  # no event starts here, unless the buffer ends with the start of "data:"
                cut = len(buf) - next((k for k in range(4, 0, -1) if buf.endswith(b"data:"[:k])), 0)
        self._held, done = buf[cut:], buf[:cut]
        if self._d_id is None and (m := _EVENT_ID.search(done)) is not None:
            self._d_id = m.group(0)
        if self._d_id is not None and self._d_id != self._id:
            done = done.replace(self._d_id, self._id)
        if self._chat:
            # The usual chunks in one pass in C: per event in Python, this cost more than all
            # the rest of a proxied chat stream. What is left goes through the JSON path.
            done = _MID_CHUNK.sub(_mid_chat, done)
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
                or b"\r" in event or event == b"data: [DONE]" or _TRANSLATED in event:
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
        if offsets:
            for choice in obj.get("choices") or ():
                lp = choice.get("logprobs") if isinstance(choice, dict) else None
                if isinstance(lp, dict) and isinstance(lp.get("text_offset"), list):
                    lp["text_offset"] = [o + self._offset if type(o) is int else o for o in lp["text_offset"]]
        if self._chat and isinstance(obj.get("choices"), list) and "error" not in obj:
            obj["object"] = "chat.completion.chunk"
            obj["choices"] = [_chat_choice(c) for c in obj["choices"] if isinstance(c, dict)]
        return b"data: " + orjson.dumps(obj)


def _chat_choice(choice: dict) -> dict:
    """A completion chunk's choice as a chat chunk's (vLLM's fields: no logprobs here,
    which chat requests on this path do not ask for)."""
    out = {"index": choice.get("index", 0), "delta": {"content": choice.get("text") or ""}, "logprobs": None,
           "finish_reason": choice.get("finish_reason")}
    if out["finish_reason"] is not None:
        out["stop_reason"] = choice.get("stop_reason")
    return out

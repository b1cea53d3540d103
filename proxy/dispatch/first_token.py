"""The client's first token from P (``--first-token prefill``, the default).

P computes the prompt's KV and samples one token anyway (the prefill request has
max_tokens=1). In this mode the proxy asks P for that token's id (``return_token_ids``),
sends it to the client as the stream's first event as soon as P answers, and asks D to
continue from the prompt's token ids plus that token, with one token fewer to generate. D's
connector then loads P's KV for all of D's prompt but that last token (the request carries
P's prompt length, ``PREFILL_PROMPT_TOKENS_PARAM``). The client's first token no longer
waits for the KV transfer and D's first step: TTFT is P's.

The promise is that the client cannot tell: D sees the token sequence a colocated server
sees after its first step, so only requests where the split cannot change the answer take
this path, and every other one is dispatched as before (D's first token, exact by
construction). ``eligible`` is an allow-list over every field of vLLM's request models: a
field it does not name, or names at another value, keeps the request on D's first token.
What the request cannot show, D's connector advertises (``OutputLimits``: how its vLLM
caps answers and the context; ``GenerationDefaults``: the sampling defaults it applies and
whether a reasoning or tool parser reads its chat answers); an instance that advertises neither
(a static one) keeps D's first token.

P's answer decides too (``parse`` and ``starts_answer``): a token that is part of a
character is held back by vLLM's detokenizer (its text is ""), and D, whose detokenizer
would be primed with a prompt ending inside that character, cannot take the rest of it
(it would emit the whole primed prompt as text): D answers the client's own request instead.
So does every answer that is not what vLLM writes (ids that are not ints, a ``created``
out of range), and a chat answer a server-side parser read as reasoning or a tool call.

Logprobs come from each side for its tokens (D's text offsets moved past P's token); usage
counts P's token as generated; D's events carry P's id and ``created``. Chat: P renders the
template and returns the rendered prompt's ids and the answer's role; D continues from them
with a completion, whose chunks become chat chunks (proxy/dispatch/events.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.openai_api import CHAT, COMPLETIONS, prefill_body
from proxy.request import RouteRequest
from xpyd_wire.discovery import GenerationDefaults, OutputLimits
from xpyd_wire.request_id import PREFILL_PROMPT_TOKENS_PARAM, SKIP_TOKENS_PARAM

_OURS = (PREFILL_PROMPT_TOKENS_PARAM, SKIP_TOKENS_PARAM)  # set by the proxy, never by a client

# Every field of vLLM 0.32's CompletionRequest and ChatCompletionRequest this path lets
# through, and how. A field named nowhere here keeps the request on D's first token, so a
# field a newer vLLM adds cannot change an answer unnoticed (tests/unit/test_proxy_first_token.py
# feeds every field of vLLM's request models through these tables).
#
# SAME: means the same to P's one token and to D's continuation (both servers apply it
# alike, or P alone needs it: the prompt's rendering and tokenization).
_SAME = frozenset({
    "model", "temperature", "top_p", "top_k", "min_p",
    # Penalises tokens of prompt and answer alike: P's token counts the same on D.
    "repetition_penalty",
    "length_penalty",  # beam search only, which this path refuses
    "logit_bias", "allowed_token_ids", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "user", "priority", "cache_salt",
    "request_id",  # vLLM takes the X-Request-Id header first, which the proxy sets
    "truncation_side", "add_special_tokens",  # P tokenizes; D gets its ids
})
# Checked by ``eligible`` itself (prompt, limits, logprobs, usage options, truncation).
_CHECKED_CHAT = frozenset({"stream", "max_tokens", "min_tokens", "stream_options", "kv_transfer_params",
                           "truncate_prompt_tokens"})
_CHECKED = _CHECKED_CHAT | {"prompt", "logprobs"}
# Let through only at these values (a value is neutral when it equals one of the same type:
# True is not 1). None (JSON null) is neutral everywhere: vLLM reads it as absent.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "echo": (False,),
    "prompt_logprobs": (),
    "stop": ("", []),  # a stop string could span P's token and D's first
    # Count generated tokens only: D would count one fewer (P's is its prompt).
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "seed": (),  # P's sampling runs without one
    "suffix": ("",),
    "bad_words": ([],),  # a bad word's first token could be P's, which D sees as prompt
    "return_token_ids": (False,),
    "return_tokens_as_token_ids": (False,),
    "return_token_offsets": (False,),
    "logprob_token_ids": (),
    "prompt_embeds": (),
    "response_format": (),
    "structured_outputs": (),
    "use_beam_search": (False,),
    "vllm_xargs": (),
    "watermarking": (),
    "session_id": (),
    "routed_experts_prompt_start": (0,),
    "mm_payload": ("tensors",),
    "return_mm_kwargs": (),
    "ec_transfer_params": (),
    # Checks generated tokens only: D's check would never see P's token.
    "repetition_detection": (),
    "thinking_token_budget": (),
    "stream_interval": (1,),  # D would batch its events, P's token goes alone
}
# Chat: the fields that only shape the prompt (P renders it; D gets its token ids), and the
# chat-only fields that are neutral at these values.
_CHAT_PROMPT_ONLY = frozenset({"messages", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                               "continue_final_message", "documents", "reasoning_effort",
                               "max_completion_tokens"})
_CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,),  # chat logprobs are not translated from D's completion
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # without tools: nothing to call
    "parallel_tool_calls": (True, False),
    "include_reasoning": (True,),
    "return_prompt_text": (False,),
    "media_io_kwargs": (),
    "mm_processor_kwargs": (),
}
# The sampling defaults a server may apply where a request leaves the field out
# (GenerationDefaults.sampling) that mean the same on P and D; any other default (a presence
# or frequency penalty, or one this proxy does not know) keeps requests that leave that
# field out on D's first token.
_SAMPLING_SAME = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty"})
# What D's completions request takes from a chat request (vLLM's CompletionRequest fields
# that mean the same there).
_COMPLETION_KEYS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                              "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                              "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
                              "allowed_token_ids", "logit_bias", "user", "stream", "stream_options", "priority",
                              "cache_salt", "kv_transfer_params", "request_id"})


def fields_named(chat: bool) -> frozenset[str]:
    """Every request field these tables name for an endpoint (any other keeps the request on
    D's first token)."""
    if chat:
        return _SAME | _CHECKED_CHAT | _CHAT_PROMPT_ONLY | set(_CHAT_NEUTRAL) | set(_NEUTRAL)
    return _SAME | _CHECKED | set(_NEUTRAL)


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


def _within(limit: Any, limits: OutputLimits) -> bool:
    """A limit vLLM takes as it is: none, or a positive int no larger than the context
    (anything else is vLLM's 400, or a value it converts, which only D's first token relays
    exactly)."""
    return limit is None or (type(limit) is int and 1 <= limit <= limits.context)  # type: ignore[operator]


def _fields_pass(body: dict, chat: bool) -> bool:
    """Every field of the request is one this path lets through, at a value it allows."""
    checked = _CHECKED_CHAT if chat else _CHECKED
    for key, value in body.items():
        if key in _SAME or key in checked:
            continue
        if chat:
            if key in _CHAT_PROMPT_ONLY:
                continue
            neutral = _CHAT_NEUTRAL.get(key)
            if neutral is not None:
                if not _neutral(value, neutral):
                    return False
                continue
        neutral = _NEUTRAL.get(key)
        if neutral is None or not _neutral(value, neutral):
            return False  # a field this path does not know: D's first token is exact
    return True


def _defaults_pass(body: dict, defaults: GenerationDefaults, chat: bool) -> bool:
    """The server's own sampling defaults change nothing here: each is one P and D apply
    alike, or the request sets that field itself. A chat answer a reasoning or a tool parser
    reads is D's whole answer: vLLM 0.32 streams every chat answer through the parser, whatever
    tool_choice says (it holds back or reshapes deltas: an empty last delta is written {}), and a
    tool parser may adjust the request too (keep special tokens, which D's completion would drop)."""
    if chat and (defaults.reasoning_parser or defaults.tool_parser != "none"):  # None: not known
        return False
    return all(name in _SAMPLING_SAME or body.get(name) is not None for name, _ in defaults.sampling)


# pydantic 2's bool in lax mode, which vLLM's request models use: these strings (any case), the
# ints 0 and 1 and the floats 0.0 and 1.0; anything else is refused (vLLM's 400).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: Any) -> bool | None:
    """``value`` as vLLM reads a bool field (None: absent, JSON null, or a value it refuses:
    ``lax_bool_valid`` tells those apart)."""
    if value is True or value is False:
        return value
    if type(value) is int or type(value) is float:
        return True if value == 1 else False if value == 0 else None
    if isinstance(value, str):
        low = value.lower()
        return True if low in _TRUE else False if low in _FALSE else None
    return None


def lax_bool_valid(value: Any) -> bool:
    """vLLM accepts ``value`` for a ``bool | None`` field."""
    return value is None or lax_bool(value) is not None


def _truncation_pass(body: dict, chat: bool) -> bool:
    """P cuts the prompt as vLLM would for the client's request. truncate_prompt_tokens -1 keeps
    as many tokens as the context allows, less one when the request names a limit (vLLM 0.32's
    TokenizeParams.max_truncation_tokens, with chat's max_completion_tokens or max_tokens, a
    completion's max_tokens: 16 when absent, 0 when null): P, asked for one token, always keeps
    one fewer than the context, so -1 passes only with a limit. Another form vLLM converts
    ("5", 5.0) goes to D as the client's own request."""
    value = body.get("truncate_prompt_tokens")
    if value is None or (type(value) is int and value >= 0):
        return True
    if chat:
        limit = body.get("max_completion_tokens")
        limit = body.get("max_tokens") if limit is None else limit
    else:
        limit = body.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    return value == -1 and type(value) is int and bool(limit)


def eligible(req: RouteRequest, limits: OutputLimits | None, defaults: GenerationDefaults | None) -> bool:
    """Whether the request's answer may start with P's token (see the module's text).
    ``limits`` and ``defaults``: what D advertised of how its vLLM caps and samples answers;
    without both (a static instance, an older connector) nothing here is known to be exact."""
    if limits is None or limits.context is None or defaults is None:
        return False
    body = req.body
    if body.get("stream") is not True:
        return False  # a whole answer has no first token to hurry
    chat = req.path == CHAT
    if chat:
        if not _text_messages(body.get("messages")):
            return False
        given = (body.get("max_completion_tokens"), body.get("max_tokens"))
        if not all(_within(v, limits) for v in given):
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
    if not _fields_pass(body, chat) or not _defaults_pass(body, defaults, chat) or not _truncation_pass(body, chat):
        return False
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        # Above the answer's limit it is vLLM's 400, which only D's first token relays as a status.
        limit = max_tokens(body, chat, limits)
        if type(min_tokens) is not int or min_tokens < 0 or (limit is not None and min_tokens > limit):
            return False
    if not isinstance(body.get("kv_transfer_params", {}), dict):
        return False
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}
                             or not all(map(lax_bool_valid, opts.values()))):  # else vLLM's 400
        return False
    return True


def usage_wanted(body: dict) -> tuple[bool, bool]:
    """(a usage event at the end, usage on every event), as vLLM reads stream_options (its
    should_include_usage, with each value read as its model reads a bool: ``1``, "yes" are true)."""
    opts = body.get("stream_options")
    if not isinstance(opts, dict) or not lax_bool(opts.get("include_usage")):
        return False, False
    return True, bool(lax_bool(opts.get("continuous_usage_stats")))


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
    text: str  # "": vLLM's detokenizer holds the token back (part of a character)
    token_ids: list[int]
    prompt_ids: PromptIds
    finish_reason: str | None
    stop_reason: Any
    usage: dict | None
    logprobs: dict | None  # P's for its token, when asked for
    role: str = "assistant"  # chat: the answer's role as P's server gave it (--response-role)
    fingerprint: str | None = None  # P's system_fingerprint: vLLM puts it on a stream's last event


_PROMPT_IDS_KEY = b'"prompt_token_ids":['
_PLACEHOLDER = -1  # no token id: where the cut-out ids were, for the check that they were P's
# The ids' shape in one pass at C speed: each digit becomes "0", a comma stays, any other
# byte becomes "x". (A regex search for 11 digits took ~0.2 us a byte: more than parsing the
# whole answer, and this path's largest cost at 4k-token prompts.)
_SHAPE = bytes(48 if 48 <= c <= 57 else 44 if c == 44 else 120 for c in range(256))  # "0", ",", "x"
# A token id is an int32 in every vLLM tokenizer; vLLM's `created` is seconds since 1970.
_MAX_ID = 2**31 - 1
# In the shape: 10 digits or more. Past 999,999,999, beyond any vocabulary, and some of them
# past int32: such an answer is parsed whole, where each id's range is checked.
_LONG_ID = b"0" * 10
_MAX_CREATED = 2**53


def _cut_prompt_ids(data: bytes) -> tuple[bytes, PromptIds] | None:
    """P's answer with its first ``prompt_token_ids`` array replaced by the placeholder,
    and that array, when it is compact JSON of digits and commas (as vLLM writes it) with no
    number of 10 digits or more; else None (the whole answer is then parsed). The array
    cannot reach past its first "]", so D's request gets an array whatever P sent."""
    start = data.find(_PROMPT_IDS_KEY)
    if start < 0:
        return None
    start += len(_PROMPT_IDS_KEY) - 1  # at "["
    end = data.find(b"]", start)
    if end < 0:
        return None
    inner = data[start + 1:end]
    shape = inner.translate(_SHAPE)
    if not inner or b"x" in shape or _LONG_ID in shape:  # digits and commas only, no long number
        return None
    rest = data[:start] + b"[" + str(_PLACEHOLDER).encode() + data[end:]
    return rest, PromptIds(data[start:end + 1], inner.count(b",") + 1)


def _token_id(x: Any) -> bool:
    return type(x) is int and 0 <= x <= _MAX_ID


def _prompt_ids(data: bytes, chat: bool) -> tuple[dict, PromptIds | None]:
    """P's answer as an object and the prompt's ids it holds (None: not usable), cut out of
    the bytes when they are where the prompt's ids belong (the placeholder's place) and P's
    usage counts them (vLLM: prompt_tokens is their number); else the answer is parsed whole
    and each id is checked (an int32 of a tokenizer), at C speed."""
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
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == _INT \
            and 0 <= min(prompt) and max(prompt) <= _MAX_ID:
        return obj, PromptIds.of(prompt)
    return obj, None


_INT = frozenset({int})


def parse(data: bytes, chat: bool = False) -> FirstToken | None:
    """P's answer, or None when it is not what this mode needs (a vLLM without
    return_token_ids), not what vLLM writes (ids that are not int32s, a ``created`` out of
    range: a P is input too), or (chat) a server-side parser read its token as reasoning or
    a tool call: the request then goes on with D's first token (D gets the client's request
    and loads all but the last prompt token)."""
    try:
        obj, ids = _prompt_ids(data, chat)
        if ids is None:
            return None
        choice = obj["choices"][0]
        role = "assistant"
        if chat:
            message = choice["message"]
            if message.get("tool_calls") or message.get("reasoning_content") is not None \
                    or message.get("reasoning") is not None:
                return None  # a server-side parser at work: its output is not plain text
            tokens, text, role = choice["token_ids"], message.get("content"), message.get("role")
        else:
            tokens, text = choice["token_ids"], choice.get("text")
        if not (isinstance(tokens, list) and len(tokens) == 1 and _token_id(tokens[0])):
            return None
        if not isinstance(text, str) or not isinstance(role, str):
            return None
        created = obj.get("created", 0)
        fingerprint = obj.get("system_fingerprint")
        if type(created) is not int or not 0 <= created < _MAX_CREATED \
                or not (fingerprint is None or isinstance(fingerprint, str)):
            return None
        logprobs = None if chat else choice.get("logprobs")
        return FirstToken(chat, str(obj.get("id", "")), created, str(obj.get("model", "")), text,
                          tokens, ids, choice.get("finish_reason"), choice.get("stop_reason"),
                          obj.get("usage") if isinstance(obj.get("usage"), dict) else None,
                          logprobs if isinstance(logprobs, dict) else None, role, fingerprint)
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


def _d_tokens(body: dict, first: FirstToken, limits: OutputLimits) -> int:
    """How many tokens D is to add after P's: the answer's limit (vLLM 0.32's get_max_tokens:
    the least of the request's or server's limit and the context left after the prompt)
    less P's token."""
    left = limits.context - len(first.prompt_ids)  # type: ignore[operator]  (eligible: known)
    limit = max_tokens(body, first.chat, limits)
    return (left if limit is None else min(limit, left)) - 1


def complete_at_prefill(body: dict, first: FirstToken, limits: OutputLimits) -> bool:
    """P's token ends the answer: it stopped (EOS, a stop token), one token was asked for,
    or it filled the context."""
    return first.finish_reason not in (None, "length") or _d_tokens(body, first, limits) <= 0


def starts_answer(body: dict, first: FirstToken, limits: OutputLimits) -> bool:
    """Whether P's token may be the client's first: it ends the answer, or its text is what
    vLLM sends. A token vLLM holds back (text "": part of a character, whose rest D could
    not take; U+FFFD where a detokenizer shows such a part) leaves the answer to D's first
    token."""
    return (first.text != "" and "\ufffd" not in first.text) or complete_at_prefill(body, first, limits)


def continuation(body: dict, first: FirstToken, limits: OutputLimits) -> dict:
    """D's request, always a completion (POST it to COMPLETIONS): the prompt as P's token
    ids plus P's token, one token fewer to generate, and P's prompt length for D's
    connector. A chat request keeps only what a completion means the same way."""
    # A neutral field the request sets (presence_penalty 0) must reach D too: left out, D's
    # server would apply its own default there.
    cont = {k: v for k, v in body.items() if k in _COMPLETION_KEYS or k in _NEUTRAL} if first.chat else dict(body)
    cont["prompt"] = first.prompt_ids.followed_by(first.token_ids)
    # A number, always: vLLM 0.32 reads a completion's null as its default, 16.
    cont["max_tokens"] = _d_tokens(body, first, limits)
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 0:
        cont["min_tokens"] = body["min_tokens"] - 1
    cont.pop("truncate_prompt_tokens", None)  # P's ids are already cut to it
    cont.pop("truncation_side", None)
    cont.pop("add_special_tokens", None)  # P's ids have what it added
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


def stream_details(usage: dict | None) -> dict | None:
    """P's prompt_tokens_details (--enable-prompt-tokens-details: its prompt-cache figures, the
    ones one server that computed the prompt reports) as a stream's last usage writes them:
    without null members. None: P reported none."""
    details = usage.get("prompt_tokens_details") if usage is not None else None
    return {k: v for k, v in details.items() if v is not None} if isinstance(details, dict) else None


def _counts(usage: dict, completion_tokens: int | None = None, last: bool = False) -> dict:
    """P's usage as a stream's usage event carries it: the counts (``completion_tokens``: in
    place of P's), and what else P's server reports that is not null; prompt_tokens_details
    only on the ``last`` usage event (vLLM writes it there alone), as a stream writes it."""
    out = {k: v for k, v in usage.items() if v is not None}
    if "prompt_tokens_details" in out:
        if last:
            out["prompt_tokens_details"] = stream_details(usage)
        else:
            del out["prompt_tokens_details"]
    if completion_tokens is not None:
        out["completion_tokens"] = completion_tokens
        out["total_tokens"] = usage.get("prompt_tokens", 0) + completion_tokens
    return out


def first_events(first: FirstToken, final: bool, usage: tuple[bool, bool]) -> bytes:
    """The stream's first events as vLLM 0.32 writes them, field for field (``usage``:
    ``usage_wanted``; chat: the role chunk, then the token's), and, when P's token ends the
    answer, the rest of the stream: the usage event if asked for, then [DONE]. vLLM puts its
    system_fingerprint on the last event before [DONE]."""
    include_usage, continuous = usage
    kind = "chat.completion.chunk" if first.chat else "text_completion"
    head = {"id": first.id, "object": kind, "created": first.created, "model": first.model}
    counts = _counts(first.usage) if continuous and first.usage is not None else None
    out = b""
    if first.chat:
        role: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {"role": first.role, "content": ""},
                                                     "logprobs": None, "finish_reason": None}],
                                "prompt_token_ids": None, "prompt_text": None}
        if counts is not None:
            role["usage"] = {**_counts(first.usage, 0), "completion_tokens_details": None}  # type: ignore[arg-type]
        out = _event(role)
        choice: dict[str, Any] = {"index": 0, "delta": {"content": first.text}, "logprobs": None,
                                  "finish_reason": first.finish_reason if final else None}
        if final:
            choice["stop_reason"] = first.stop_reason
        choice["token_ids"] = None
        if counts is not None:
            counts["completion_tokens_details"] = None
    else:
        choice = {"index": 0, "text": first.text, "logprobs": first.logprobs,
                  "finish_reason": first.finish_reason if final else None,
                  "stop_reason": first.stop_reason if final else None, "prompt_token_ids": None, "token_ids": None}
    event: dict[str, Any] = {**head, "choices": [choice]}
    if counts is not None:
        event["usage"] = counts
    if final and not include_usage and first.fingerprint is not None:
        event["system_fingerprint"] = first.fingerprint
    out += _event(event)
    if final:
        if include_usage and first.usage is not None:
            last: dict[str, Any] = {**head, "choices": [], "usage": _counts(first.usage, last=True)}
            if first.fingerprint is not None:
                last["system_fingerprint"] = first.fingerprint
            out += _event(last)
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

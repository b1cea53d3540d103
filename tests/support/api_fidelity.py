"""What a client reads of an answer, independent of how the server grouped its tokens into events
(a busy API process merges outputs it has not sent yet), and where two such readings differ:
tests/e2e/test_e2e_fidelity.py compares these between a colocated server and the proxy.

- diff: two JSON answers field by field (ids, times and fingerprints by presence; logprobs within
  LOGPROB_TOL);
- summary / comparable: a completions or chat stream (text, logprobs, finish and usage per
  choice; the shape of every event, per choice and place in the stream);
- responses_stream / messages_stream: a Responses or Anthropic Messages stream (the kinds of events
  in order with each run of deltas as one, the text, and the objects that open and close the answer).
"""

from __future__ import annotations

from typing import Any

from tests.support.e2e_client import LOGPROB_TOL


# Fields whose values are the server's own: compared by presence, not value.
_OWN = frozenset({"id", "created", "created_at", "request_id", "previous_response_id", "system_fingerprint"})
# Deliberate differences (see the module's text): not compared at all.
_NOT_COMPARED = frozenset({"kv_transfer_params"})
# Floats compared within LOGPROB_TOL (logprobs); everything else exactly.


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= (LOGPROB_TOL or 0.0)
    return a == b


def diff(got: Any, want: Any, where: str = "") -> str | None:
    """Where two answers (JSON values) differ, field by field: None when every field is
    present in both with equal values (floats within LOGPROB_TOL; _OWN fields by presence)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return f"{where}: {got!r} is not an object"
        keys = (set(got) | set(want)) - _NOT_COMPARED
        for k in sorted(keys):
            if k not in got or k not in want:
                return f"{where}.{k}: only in {'got' if k in got else 'want'}"
            if k in _OWN:
                if (got[k] is None) != (want[k] is None):
                    return f"{where}.{k}: {got[k]!r} vs {want[k]!r}"
                continue
            if (d := diff(got[k], want[k], f"{where}.{k}")) is not None:
                return d
        return None
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{where}: {len(got) if isinstance(got, list) else got!r} vs {len(want)} items"
        for i, (g, w) in enumerate(zip(got, want)):
            if (d := diff(g, w, f"{where}[{i}]")) is not None:
                return d
        return None
    return None if _close(got, want) else f"{where}: {got!r} vs {want!r}"


def _shape(value: Any, mapping: bool = False) -> Any:
    """A JSON value's structure: its keys and the kinds of its values, recursively (the keys
    of a completion's top_logprobs maps are tokens, data rather than fields)."""
    if isinstance(value, dict):
        if mapping:
            return ("map", tuple(sorted({repr(_shape(v)) for v in value.values()})))
        return tuple(sorted((k, _shape(v, k == "top_logprobs")) for k, v in value.items() if k not in _NOT_COMPARED))
    if isinstance(value, list):
        return ("list", tuple(sorted({repr(_shape(v, mapping)) for v in value})))
    return None if value is None else type(value).__name__


def _kind(event: dict, chat: bool, started: set) -> str:
    """Where an event stands in its choice's stream: chat's role chunk, a completion choice's first
    token event before the finish ("first": vLLM puts the prompt's fields there only, the echoed
    prompt and its logprobs, prompt_token_ids), a later token before the finish ("mid"), or the
    finish and what follows (a usage event). ``started``: the completion choices seen so far."""
    choices = event.get("choices") or []
    if chat and any("role" in (ch.get("delta") or {}) for ch in choices if isinstance(ch, dict)):
        return "role"
    if choices and all(isinstance(ch, dict) and ch.get("finish_reason") is None for ch in choices):
        first = not chat and not any(ch.get("index") in started for ch in choices)
        return "first" if first else "mid"
    return "end"


def summary(events: list, chat: bool) -> dict:
    """A stream as what a client reads of it, independent of how the tokens were grouped
    into events (a busy server's API process merges the outputs it has not sent yet, so the
    count of events is not the server's to fix): per choice its text, logprobs, finish and
    stop reasons; the usage of the last event that has one; each event's fields (its shape),
    per choice (and for the events of none, such as the usage event) and per place in the
    stream (chat's role chunk, a completion's first token event, later tokens, finish): the set
    of shapes the events there have, which merging events of one kind does not change and one
    event unlike its neighbours does (P's event without the usage D's carry); the last event's
    fields (vLLM puts the fingerprint there); [DONE] last."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    kinds: dict[str, dict[str, set[str]]] = {}
    started: set = set()
    for e in events[:-1]:
        assert isinstance(e, dict), e
        if e.get("usage") is not None:
            usage = e["usage"]
        track = ",".join(str(ch.get("index")) for ch in e.get("choices") or ()) or "none"
        places = kinds.setdefault(track, {"role": set(), "first": set(), "mid": set(), "end": set()})
        places[_kind(e, chat, started)].add(repr(_shape(e)))
        started.update(ch.get("index") for ch in e.get("choices") or () if isinstance(ch, dict))
        for ch in e.get("choices") or ():
            c = choices.setdefault(ch["index"], {"text": "", "logprobs": {}, "finish_reason": None,
                                                  "stop_reason": None, "role": None})
            delta = ch.get("delta") or {}
            c["text"] += (delta.get("content") or "") if chat else (ch.get("text") or "")
            c["role"] = c["role"] or delta.get("role")
            for k, v in (ch.get("logprobs") or {}).items():
                c["logprobs"][k] = c["logprobs"].get(k, []) + (v or [])
            if ch.get("finish_reason") is not None:
                c["finish_reason"], c["stop_reason"] = ch["finish_reason"], ch.get("stop_reason")
    return {"choices": choices, "usage": usage,
            "kinds": {t: {k: sorted(v) for k, v in places.items()} for t, places in kinds.items()},
            "last": sorted(events[-2]) if len(events) > 1 and isinstance(events[-2], dict) else None,
            "done": events[-1] if events else None}


def comparable(got: dict, want: dict) -> tuple[dict, dict]:
    """Two stream summaries as far as grouping leaves them comparable: a busy API process merges
    the outputs it has not sent yet, so a place may have no event on one side (seen in CI-like
    runs: two tokens and the stop in one event through D, two events colocated; an echoed prompt
    with its logprobs, ~140 KB, then the other three tokens merged into the finishing event
    colocated and one event each through D): a choice's first and later token events are each
    compared only where both streams have some."""
    got_kinds = {t: dict(p) for t, p in got["kinds"].items()}
    want_kinds = {t: dict(p) for t, p in want["kinds"].items()}
    for track in got_kinds.keys() & want_kinds.keys():
        for place in ("first", "mid"):
            if not got_kinds[track][place] or not want_kinds[track][place]:
                got_kinds[track][place] = want_kinds[track][place] = None
    return {**got, "kinds": got_kinds}, {**want, "kinds": want_kinds}


_DELTAS = frozenset({"response.output_text.delta", "response.reasoning_text.delta", "content_block_delta",
                     "response.function_call_arguments.delta"})  # fmt: skip


def _kinds(events: list[dict]) -> list[str]:
    kinds: list[str] = []
    for e in events:
        kind = e.get("type", "?")
        if kind in _DELTAS and kinds and kinds[-1] == kind:
            continue
        kinds.append(kind)
    return kinds


def responses_stream(events: list[Any]) -> dict:
    """A Responses stream: its event kinds, text, sequence numbers in order, and the response
    object of its first and last events (the opening one without generated content)."""
    assert all(isinstance(e, dict) for e in events), events
    text = "".join(e.get("delta", "") for e in events if e.get("type") == "response.output_text.delta")
    numbers = [e.get("sequence_number") for e in events]
    return {"kinds": _kinds(events), "text": text, "numbered": numbers == list(range(len(events))),
            "first": events[0].get("response") if events else None,
            "last": events[-1].get("response") if events else None}


def messages_stream(events: list[Any]) -> dict:
    """An Anthropic Messages stream: its event kinds, text, the opening message, the closing
    delta (stop reason and usage)."""
    assert all(isinstance(e, dict) for e in events), events
    text = "".join((e.get("delta") or {}).get("text", "") for e in events if e.get("type") == "content_block_delta")
    start = next((e["message"] for e in events if e.get("type") == "message_start"), None)
    end = next((e for e in events if e.get("type") == "message_delta"), None)
    return {"kinds": _kinds(events), "text": text, "start": start, "end": end}

"""What a client reads of a Responses or an Anthropic Messages stream, independent of how the
server grouped its tokens into events (a busy API process merges outputs it has not sent yet):
the kinds of events in order with each run of deltas as one, the text, and the objects that
open and close the answer. tests/e2e/test_e2e_fidelity.py compares these between a colocated
server and the proxy."""

from __future__ import annotations

from typing import Any

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

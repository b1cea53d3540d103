"""The differential suite's own comparator (tests/support/api_fidelity.py): two streams that a
client reads alike compare equal however their tokens were grouped into events, and two that a
client can tell apart do not (no server needed)."""

from __future__ import annotations

import copy

from tests.support.api_fidelity import comparable, diff, summary

HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}


def _tok(text: str, finish: str | None = None, usage: dict | None = None, index: int = 0) -> dict:
    e = {**HEAD, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish,
                              "stop_reason": None, "prompt_token_ids": None, "token_ids": None}]}
    if usage is not None:
        e["usage"] = usage
    return e


def _usage(n: int) -> dict:
    return {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n}


def stream(*events: dict) -> list:
    return [*events, "[DONE]"]


def same(got: list, want: list, chat: bool = False) -> str | None:
    return diff(*comparable(summary(got, chat), summary(want, chat)))


CONTINUOUS = stream(_tok(" a", usage=_usage(1)), _tok(" b", usage=_usage(2)), _tok(" c", "length", _usage(3)),
                    {**HEAD, "choices": [], "usage": _usage(3)})


def test_an_event_unlike_its_neighbours_is_told_apart():
    """The blind spot of issue 48: P's first event without the usage every one of D's carries
    (continuous_usage_stats) compared equal while the middle events' fields were merged."""
    got = copy.deepcopy(CONTINUOUS)
    del got[0]["usage"]
    assert same(got, CONTINUOUS) is not None
    assert same(CONTINUOUS, CONTINUOUS) is None


def test_grouping_into_events_is_not_a_difference():
    merged = stream(_tok(" a b", usage=_usage(2)), _tok(" c", "length", _usage(3)),
                    {**HEAD, "choices": [], "usage": _usage(3)})
    assert same(merged, CONTINUOUS) is None
    # A short answer merged into its finishing event: no token event before the finish on one side.
    short = stream(_tok(" a b c", "length", _usage(3)), {**HEAD, "choices": [], "usage": _usage(3)})
    assert same(short, CONTINUOUS) is None
    # ... but its finishing event must still be alike.
    odd = copy.deepcopy(short)
    odd[0]["choices"][0]["stop_reason"] = "x"
    assert same(odd, CONTINUOUS) is not None


def test_choices_interleaved_alike_and_each_choice_judged_alone():
    two = stream(_tok(" a", index=0), _tok(" x", index=1), _tok(" b", "length", index=0), _tok(" y", "length", index=1))
    other_order = stream(_tok(" x", index=1), _tok(" a", index=0), _tok(" y", "length", index=1),
                         _tok(" b", "length", index=0))
    assert same(other_order, two) is None
    extra = copy.deepcopy(two)
    extra[1]["choices"][0]["logprobs"] = {"tokens": [" x"]}  # choice 1's token event unlike choice 0's
    assert same(extra, two) is not None


def test_chat_role_chunk_is_its_own_place():
    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    want = stream(chunk({"role": "assistant", "content": ""}), chunk({"content": "a"}), chunk({"content": "b"}, "stop"))
    assert same(want, want, chat=True) is None
    got = copy.deepcopy(want)
    got[0]["usage"] = _usage(0)  # only the role chunk carries usage
    assert same(got, want, chat=True) is not None


def _echoed(text: str) -> dict:
    """A completion's first event with echo: the prompt's fields ride there only."""
    e = _tok(text)
    e["choices"][0]["prompt_token_ids"] = [1, 2, 3]
    return e


def test_first_token_event_is_its_own_place():
    """An echoed prompt with its logprobs (~140 KB) comes first; a busy API process then merged the
    other three tokens into the finishing event colocated, while D sent them one event each (a
    CI-like run: '.kinds.0.mid: 2 vs 1 items'). The first event's prompt fields are no shape the
    later token events must share."""
    merged = stream(_echoed("prompt a"), _tok(" b c d", "length"))
    one_each = stream(_echoed("prompt a"), _tok(" b"), _tok(" c"), _tok(" d", "length"))
    assert same(one_each, merged) is None
    assert same(merged, one_each) is None
    # ... but the first event must still be alike, and so must the later ones where both have some.
    bare = stream(_tok("prompt a"), _tok(" b"), _tok(" c"), _tok(" d", "length"))
    assert same(bare, one_each) is not None
    odd = copy.deepcopy(one_each)
    odd[2]["choices"][0]["prompt_token_ids"] = [1, 2, 3]  # a later event carrying the prompt's fields
    assert same(odd, one_each) is not None

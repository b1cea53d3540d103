"""The greedy comparison the end-to-end tests use: equal tokens, or a near tie in
both answers at the step where they part (no server needed)."""

from __future__ import annotations

import pytest

from tests.support.e2e_client import (
    LOGPROB_TOL,
    NEAR_TIE,
    Answer,
    answer_of,
    assert_greedy_differs,
    assert_same_greedy,
    parting_step,
    stream_answers,
    text_parting,
    with_token_ids,
)


def ans(steps: list[tuple[str, dict[str, float]]]) -> Answer:
    return Answer.of("".join(t for t, _ in steps), steps)


WANT = ans([("a", {"a": -1.0, "b": -2.0}), ("b", {"b": -1.0, "c": -1.01}), ("c", {"c": -0.5, "a": -3.0})])


def test_equal_tokens_agree():
    assert parting_step(WANT, WANT) == (3, None)
    assert_same_greedy(WANT, WANT)
    with pytest.raises(AssertionError, match="agree up to step 3"):
        assert_greedy_differs(WANT, WANT)


def test_parting_at_a_near_tie_in_both_is_accepted_and_ends_the_comparison():
    got = ans([("a", {"a": -1.0, "b": -2.0}), ("c", {"c": -1.0, "b": -1.0 - NEAR_TIE / 2}), ("x", {"x": -0.1})])
    assert parting_step(got, WANT) == (1, None)
    assert_same_greedy(got, WANT)


def test_parting_at_a_wide_margin_fails():
    got = ans([("z", {"z": -0.5, "a": -2.0}), ("b", {"b": -1.0}), ("c", {"c": -0.5})])
    step, why = parting_step(got, WANT)
    assert step == 0 and "'z' instead of 'a'" in why
    with pytest.raises(AssertionError, match="step 0"):
        assert_same_greedy(got, WANT)
    assert_greedy_differs(got, WANT)


def test_a_tie_on_one_side_only_is_no_near_tie():
    # WANT's step 1 is a near tie (b vs c, 0.01) but got is sure of c: a real difference.
    got = ans([("a", {"a": -1.0, "b": -2.0}), ("c", {"c": -0.2, "b": -3.0}), ("c", {"c": -0.5})])
    assert parting_step(got, WANT)[1] is not None


def test_token_missing_from_the_other_top_logprobs_is_wide():
    got = ans([("a", {"a": -1.0, "b": -2.0}), ("q", {"q": -1.0, "b": -1.001}), ("c", {"c": -0.5})])
    assert parting_step(got, WANT)[1] is not None


def test_length_difference_fails():
    with pytest.raises(AssertionError, match="lengths differ"):
        assert_same_greedy(ans(list(zip(WANT.tokens[:2], WANT.top[:2]))), WANT)


def test_reference_without_logprobs_is_refused():
    with pytest.raises(AssertionError, match="reported no logprobs"):
        assert_same_greedy(Answer.of("text", []), Answer.of("text", []))


def test_answer_of_reads_completions_and_chat_logprobs():
    comp = {"text": "ab", "logprobs": {"tokens": ["a", "b"], "top_logprobs": [{"a": -0.1, "x": -2.0}, {"b": -0.2}]}}
    chat = {"message": {"content": "ab"}, "logprobs": {"content": [
        {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}, {"token": "x", "logprob": -2.0}]},
        {"token": "b", "logprob": -0.2, "top_logprobs": []}]}}
    for choice in (comp, chat):
        a = answer_of(choice)
        assert str(a) == "ab" and a.tokens == ("a", "b") and a.top[0] == {"a": -0.1, "x": -2.0} and a.top[1] == {"b": -0.2}


def test_logprobs_at_agreeing_steps_must_agree():
    """Same tokens, but a logprob off by more than the tolerance: wrong KV can do that
    without changing a greedy token (the old comparator never looked)."""
    off = ans([("a", {"a": -1.0, "b": -2.0}), ("b", {"b": -1.0 - 0.05, "c": -1.06}), ("c", {"c": -0.5, "a": -3.0})])
    step, why = parting_step(off, WANT, LOGPROB_TOL)
    assert step == 1 and "logprob" in why
    assert parting_step(off, WANT) == (3, None)  # not asked for: not compared
    close = ans([("a", {"a": -1.0 + 0.0039, "b": -2.0}), *zip(WANT.tokens[1:], WANT.top[1:])])  # one bf16 step
    assert parting_step(close, WANT, LOGPROB_TOL) == (3, None)


def test_a_near_tie_with_the_tied_tokens_logprobs_moved_is_a_difference():
    """Parting at a near tie in both, but the two tokens' logprobs moved by 0.037 (what zeroing
    105 of 362 loaded tokens did to a step, e2e_client.LOGPROB_TOL): the contexts were the same up
    to there, so where logprobs are compared that is wrong KV, not rounding."""
    moved = ans([("a", {"a": -1.0, "b": -2.0}), ("c", {"c": -1.037, "b": -1.047}), ("x", {"x": -0.1})])
    step, why = parting_step(moved, WANT, LOGPROB_TOL)
    assert step == 1 and "parted at a near tie" in why and "top logprob" in why
    assert parting_step(moved, WANT) == (1, None)  # not asked for: a near tie
    rounded = ans([("a", {"a": -1.0, "b": -2.0}), ("c", {"c": -1.0039, "b": -1.0059}), ("x", {"x": -0.1})])
    assert parting_step(rounded, WANT, LOGPROB_TOL) == (1, None)  # a bf16 step or so: a near tie


def test_same_tokens_with_other_text_fail():
    """Distinct tokens can share a logprob string (byte tokens of one character read ""):
    the text is compared too."""
    other = Answer.of("a\ufffdc", list(zip(WANT.tokens, WANT.top)))
    assert "different text" in parting_step(other, WANT)[1]


def test_a_near_tie_does_not_excuse_a_short_answer():
    """Parting at a near tie at step 0 used to end the comparison: a 1-token answer passed
    against a 3-token one. Both ran to their limit, so they must be as long."""
    want = Answer.of("ab", [("a", {"a": -1.0, "b": -1.01}), ("b", {"b": -0.1})], finish="length")
    short = Answer.of("b", [("b", {"b": -1.0, "a": -1.01})], finish="length")
    assert "different lengths" in parting_step(short, want)[1]
    stopped = Answer.of("b", [("b", {"b": -1.0, "a": -1.01})], finish="stop")  # EOS after its own tie: fine
    assert parting_step(stopped, want) == (0, None)


def test_finish_reasons_must_agree():
    got = Answer.of(str(WANT), list(zip(WANT.tokens, WANT.top)), finish="stop")
    want = Answer.of(str(WANT), list(zip(WANT.tokens, WANT.top)), finish="length")
    assert "finish_reason" in parting_step(got, want)[1]


def test_how_many_steps_were_compared_is_returned():
    assert assert_same_greedy(WANT, WANT) == 3


def test_stream_answers_reads_each_choice_of_completion_and_chat_chunks():
    comp = [{"choices": [{"index": 0, "text": "a", "finish_reason": None,
                          "logprobs": {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1}]}}]},
            {"choices": [{"index": 1, "text": "x", "finish_reason": "length"}]},
            {"choices": [{"index": 0, "text": "b", "finish_reason": "stop",
                          "logprobs": {"tokens": ["b"], "token_logprobs": [-0.2], "top_logprobs": [{"b": -0.2}]}}]},
            {"choices": [], "usage": {}}, "[DONE]"]
    got = stream_answers(comp)
    assert str(got[0]) == "ab" and got[0].tokens == ("a", "b") and got[0].lp == (-0.1, -0.2)
    assert got[0].finish == "stop"
    assert str(got[1]) == "x" and got[1].finish == "length"
    chat = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "length"}]}]
    assert str(stream_answers(chat)[0]) == "hi" and stream_answers(chat)[0].finish == "length"


# Byte tokens as the tiny model's byte-level BPE has them: "A" "B" are whole characters, 0xE4 0xBB 0x8A
# the three bytes of one ("今"); a logprob's string is "" for each of those three.
_BYTES = {1: b"A", 2: b"B", 3: b"\xe4", 4: b"\xbb", 5: b"\x8a", 6: b"C"}


def _bytes(ids: list[int]) -> bytes:
    return b"".join(_BYTES[i] for i in ids)


def id_answer(ids: list[int], runner_up: list[float]) -> Answer:
    """An answer asked with return_tokens_as_token_ids: each step's token is "token_id:N", chosen
    at logprob -1.0 against a runner-up (token 9) at the given logprob."""
    steps = [(f"token_id:{i}", {f"token_id:{i}": -1.0, "token_id:9": r}) for i, r in zip(ids, runner_up)]
    return Answer.of(_bytes(ids).decode(), steps)


def test_text_parting_judges_the_step_by_token_ids_where_strings_are_empty():
    """The answers part inside the character after "A": got has "AB", want "A今C". Adding up
    logprob strings ("" for each byte of 今) would put the parting at the last step, C's, and judge
    its margin; the ids put it at the first byte of 今 (step 1), whose margin decides."""
    want = id_answer([1, 3, 4, 5, 6], [-3.0, -1.01, -3.0, -3.0, -3.0])
    assert str(want) == "A今C"
    assert text_parting("AB", want, _bytes) == (1, True)  # a near tie at step 1
    wide = id_answer([1, 3, 4, 5, 6], [-3.0, -3.0, -3.0, -3.0, -1.01])
    assert text_parting("AB", wide, _bytes) == (1, False)  # no tie there, whatever step 4 holds
    assert text_parting("A今B", wide, _bytes) == (4, True)
    assert text_parting("A今C", want, _bytes) == (5, False)  # never parts
    assert text_parting("A今CD", want, _bytes) == (4, False)  # longer at the very end


def test_the_reference_is_asked_for_its_tokens_as_ids():
    assert with_token_ids({"logprobs": 2}) == {"logprobs": 2, "return_tokens_as_token_ids": True}
    with pytest.raises(AssertionError, match="with_token_ids"):
        text_parting("x", Answer.of("y", [("y", {"y": -1.0})]), _bytes)


def test_token_bytes_are_the_tiny_models_text():
    """The tokenizer's own decoding, byte for byte, also across a character split into byte tokens."""
    pytest.importorskip("transformers")
    from tests.support.e2e_client import MODEL_DIR, load_tokenizer, token_bytes

    if not MODEL_DIR.joinpath("tokenizer.json").exists():
        pytest.skip("the tiny model is made by scripts/setup.sh")
    tok = load_tokenizer()
    text = "今天天气 🌦️ Café — naïve <|user|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert token_bytes()(ids).decode() == tok.decode(ids, skip_special_tokens=True)
    assert token_bytes(False)(ids).decode() == tok.decode(ids, skip_special_tokens=False)

"""A client's prompt is hostile input to the proxy's tokenizer (issue 36, part 1): a
request's own chat template is refused as vLLM refuses it (never run in the proxy), and
tokenizing runs off the event loop within a budget (prompt size, queue, wait), falling back
to the guess past it. A real proxy with the tiny model's real tokenizer and fake instances;
where a slow tokenizer is needed, the real one is slowed by a wrapper that calls through."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from proxy.routing.prompt_keys import CHAT, COMPLETIONS, PromptTokenizer
from tests.support.e2e_client import MODEL_DIR
from tests.support.proxy_helpers import running_proxy

ROOT = Path(__file__).resolve().parents[2]
# vLLM 0.32's answer, word for word (vllm/renderers/online_renderer.py validate_chat_template
# through create_error_response: 400, type BadRequestError, code 400).
VLLM_REFUSAL = {"error": {
    "message": "Chat template is passed with request, but --trust-request-chat-template is not set. "
               "Refused request with untrusted chat template.",
    "type": "BadRequestError", "param": None, "code": 400}}  # fmt: skip
# 213 bytes of body that kept the proxy's event loop busy for 14 s when it rendered them.
SLOW_TEMPLATE = "{% for i in range(26000) %}{% for j in range(26000) %}{% endfor %}{% endfor %}x"
MESSAGES = [{"role": "user", "content": "hi"}]


def precise(**overrides):
    return running_proxy(prefill_policy="precise", decode_policy="precise", tokenizer=str(MODEL_DIR), **overrides)


def tokenizer_of(proxy) -> PromptTokenizer:
    prompts = proxy.state.router.selector.prompts
    return getattr(prompts, "tokenizer", prompts)


def slow_down(tok: PromptTokenizer, seconds: float, seen: list[str] | None = None) -> None:
    """Make every tokenization take `seconds` longer (and note the thread it runs on)."""
    real = tok.token_ids

    def slow(*args, **kwargs):
        if seen is not None:
            seen.append(threading.current_thread().name)
        time.sleep(seconds)
        return real(*args, **kwargs)

    tok.token_ids = slow  # type: ignore[method-assign]


async def ready_latency(proxy) -> float:
    t0 = time.perf_counter()
    await proxy.client.get("/ready")
    return time.perf_counter() - t0


@pytest.mark.parametrize("where", ["kwargs", "top"])
async def test_a_request_template_is_refused_as_vllm_refuses_it(where):
    async with precise() as proxy:
        p, d = await proxy.pd()
        body: dict = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 2}
        if where == "kwargs":
            body["chat_template_kwargs"] = {"chat_template": "INJECTED {{ messages[0].content }} {{ 7 * 7 }}"}
        else:
            body["chat_template"] = SLOW_TEMPLATE
        r = await proxy.client.post(CHAT, json=body)
        assert r.status_code == 400 and r.json() == VLLM_REFUSAL, r.text
        assert not p.completions() and not d.completions()
        # Without a template the same request is served.
        body.pop("chat_template_kwargs", None)
        body.pop("chat_template", None)
        assert (await proxy.client.post(CHAT, json=body)).status_code == 200


async def test_a_completion_is_not_refused_for_a_field_vllm_ignores_there():
    """vLLM's completions API has no chat template (an unknown field): no refusal."""
    async with precise() as proxy:
        await proxy.pd()
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2, "chat_template": SLOW_TEMPLATE}
        assert (await proxy.client.post(COMPLETIONS, json=body)).status_code == 200
        assert await proxy.metric("xpyd_prompt_ids_total", result="unsupported") == 1


async def test_a_trusted_template_goes_to_the_instances_unrendered():
    """--trust-request-chat-template: the instances get the template (vLLM decides, with
    its own flag); the proxy routes by the guess and never runs it: the loop stays free."""
    async with precise(trust_request_chat_template=True) as proxy:
        p, d = await proxy.pd()
        body = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 2,
                "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}}  # fmt: skip
        t0 = time.perf_counter()
        request = asyncio.create_task(proxy.client.post(CHAT, json=body))
        await asyncio.sleep(0.05)
        assert await ready_latency(proxy) < 5.0  # the template, run, would take minutes (slack for a loaded box)
        r = await request
        assert r.status_code == 200 and time.perf_counter() - t0 < 5.0
        assert d.completions()[-1].json["chat_template_kwargs"] == {"chat_template": SLOW_TEMPLATE}
        assert await proxy.metric("xpyd_prompt_ids_total", result="unsupported") == 1


async def test_tokenizing_never_runs_on_the_event_loop():
    """A short prompt (a 2-token body, which was tokenized inline) whose tokenizing takes
    4 s leaves /ready answering at once (2 s: slack for a loaded box)."""
    async with precise() as proxy:
        await proxy.pd()
        seen: list[str] = []
        slow_down(tokenizer_of(proxy), 4.0, seen)
        request = asyncio.create_task(proxy.client.post(COMPLETIONS, json={"model": "fake-model", "prompt": "hi",
                                                                           "max_tokens": 2}))  # fmt: skip
        await asyncio.sleep(0.2)
        assert await ready_latency(proxy) < 2.0
        assert (await request).status_code == 200
        assert seen and threading.main_thread().name not in seen


async def test_tokenizing_has_a_budget_then_the_guess():
    """One job on the tokenizer's thread at most, 0.3 s of waiting: five prompts whose
    tokenizing takes 1 s each are all answered within ~1 s (not one after another), the
    first by the guess after its wait, the others at once; a prompt over
    tokenize_max_bytes is not tokenized at all."""
    async with precise(tokenize_max_pending=1, tokenize_timeout=0.3, tokenize_max_bytes=4000) as proxy:
        await proxy.pd()
        slow_down(tokenizer_of(proxy), 1.0)
        prompts = [f"prompt {k} " + "word " * 300 for k in range(5)]  # > 1 KiB: the old thread path
        t0 = time.perf_counter()
        first = asyncio.create_task(proxy.client.post(COMPLETIONS, json={"model": "fake-model", "prompt": prompts[0],
                                                                         "max_tokens": 2}))  # fmt: skip
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(proxy.client.post(COMPLETIONS, json={"model": "fake-model", "prompt": p,
                                                                         "max_tokens": 2})) for p in prompts[1:]]
        answers = await asyncio.gather(first, *rest)
        assert all(r.status_code == 200 for r in answers)
        assert time.perf_counter() - t0 < 3.5  # serially it would be 5 s (slack for a loaded box)
        assert await proxy.metric("xpyd_prompt_ids_total", result="timeout") == 1
        assert await proxy.metric("xpyd_prompt_ids_total", result="queue_full") == 4
        big = {"model": "fake-model", "prompt": "word " * 1000, "max_tokens": 2}
        assert (await proxy.client.post(COMPLETIONS, json=big)).status_code == 200
        assert await proxy.metric("xpyd_prompt_ids_total", result="too_large") == 1


async def test_a_batch_is_tokenized_by_its_first_prompt_only():
    async with precise() as proxy:
        await proxy.pd()
        tok = tokenizer_of(proxy)
        encoded: list[int] = []
        real = tok._encode

        def counting(text, special):
            encoded.append(len(text))
            return real(text, special)

        tok._encode = counting  # type: ignore[method-assign]
        batch = ["river stone maple", "quiet " * 200_000]
        r = await proxy.client.post(COMPLETIONS, content=orjson.dumps({"model": "fake-model", "prompt": batch,
                                                                       "max_tokens": 2}))  # fmt: skip
        assert r.status_code == 200
        assert encoded == [len(batch[0])]
        assert await proxy.metric("xpyd_prompt_ids_total", result="ok") == 1


def test_first_only_and_template_kwargs_in_the_tokenizer():
    pt = PromptTokenizer(MODEL_DIR)
    both = pt.token_ids(COMPLETIONS, {"prompt": ["river", "stone"]})
    assert pt.token_ids(COMPLETIONS, {"prompt": ["river", "stone"]}, first_only=True) == both[:1]
    from proxy.routing.prompt_keys import Unsupported

    for kwargs in ({"chat_template": "{{ 'x' }}"}, {"tokenize": True}, {"documents": []}):
        with pytest.raises(Unsupported):
            pt.token_ids(CHAT, {"messages": MESSAGES, "chat_template_kwargs": kwargs})
    # An ordinary template variable is still passed on.
    assert pt.token_ids(CHAT, {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}})


def test_a_wrong_tokenizer_is_a_configuration_error(tmp_path):
    cmd = [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", "0", "--discovery-port", "0",
           "--prefill-policy", "precise", "--tokenizer", str(tmp_path / "no-such-tokenizer")]  # fmt: skip
    # 240 s: the proxy's start (torch, transformers) took over 120 s at load 34.
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "configuration error: --tokenizer" in done.stderr and "Traceback" not in done.stderr

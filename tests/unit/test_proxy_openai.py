"""The official `openai` client, unchanged, against the proxy: completions and chat,
streaming and not."""

from __future__ import annotations

import re

import openai
import pytest

from tests.support.proxy_helpers import running_proxy


@pytest.fixture
async def proxy_and_client():
    async with running_proxy(api_key="sk-test") as px:
        p, d = await px.pd()
        client = openai.AsyncOpenAI(
            base_url=px.url + "/v1", api_key="sk-test", max_retries=0, timeout=10
        )
        try:
            yield px, p, d, client
        finally:
            await client.close()


async def test_openai_client(proxy_and_client):
    px, p, d, client = proxy_and_client
    models = await client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]

    comp = await client.completions.create(model="fake-model", prompt="Hello", max_tokens=4)
    assert comp.choices[0].text == " t0 t1 t2 t3"
    assert comp.usage.completion_tokens == 4
    # vLLM echoes the request id in "id": clients see the neutral one, of vLLM's own shape (16 hex).
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}-0-[0-9a-f]{8}", comp.id), comp.id

    chunks = [
        c
        async for c in await client.completions.create(
            model="fake-model", prompt="Hello", max_tokens=3, stream=True
        )
    ]
    assert "".join(c.choices[0].text for c in chunks) == " t0 t1 t2"
    assert len({c.id for c in chunks}) == 1 and "prefill_addr" not in chunks[0].id

    chat = await client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert chat.choices[0].message.content == " t0 t1"
    assert chat.choices[0].finish_reason == "length"

    stream = await client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == " t0 t1 t2" and usage.completion_tokens == 3

    # Each request did both phases; the client's key stayed with the proxy.
    assert len(p.completions()) == len(d.completions()) == 4
    assert not any("authorization" in r.headers for r in p.completions() + d.completions())
    raw = await client.completions.with_raw_response.create(
        model="fake-model", prompt="Hello", max_tokens=1
    )
    assert "x-request-id" not in raw.headers  # as vLLM without --enable-request-id-headers
    assert raw.parse().id.startswith("cmpl-" + px.neutral(d.completions()[-1].request_id))


async def test_openai_client_sees_errors(proxy_and_client):
    px, p, d, client = proxy_and_client
    from tests.support.proxy_helpers import Fault

    p.fault = d.fault = Fault(status=400)  # a request vLLM refuses: P does, and so does D (its verdict)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model="fake-model", prompt="x", max_tokens=2)
    assert exc.value.status_code == 400
    p.fault = None
    d.fault = Fault(fail_after=2)
    with pytest.raises(openai.APIError):
        async for _ in await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "Hi"}], stream=True
        ):
            pass
    bad = openai.AsyncOpenAI(base_url=px.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.completions.create(model="fake-model", prompt="x")
    await bad.close()

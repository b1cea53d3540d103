"""What request bodies may cost the proxy (issue 47, part 2), against a real proxy over loopback:
a body of millions of small values is refused before it is parsed (the event loop stays free);
the bytes all bodies hold, partial ones and those waiting in the admission queue, are one budget,
past which a request is refused with 503; cache_aware hashes no more of a prompt than an
instance can hold."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from proxy.asgi import Bodies, json_shape
from proxy.errors import ProxyError
from proxy.routing.policies.cache_aware import PrefixIndex
from tests.support.fake_vllm import Fault
from tests.support.proxy_helpers import running_proxy, wait_until

COMPLETION = {"model": "fake-model", "prompt": "Hello", "max_tokens": 2}


async def held_at_least(px, n: int, what: str, timeout: float = 10.0) -> None:
    """Until /metrics says the request bodies hold at least (n > 0) or exactly (n == 0) n bytes."""
    deadline = time.monotonic() + timeout
    while True:
        held = await px.metric("xpyd_held_body_bytes")
        if (held >= n) if n else held == 0:
            return
        assert time.monotonic() < deadline, f"{what}: {held} bytes held"
        await asyncio.sleep(0.02)


async def _post(px, raw: bytes) -> httpx.Response:
    async with httpx.AsyncClient(base_url=px.url, timeout=60) as client:
        return await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})


async def _slowest_health(px, task: asyncio.Task) -> float:
    """/health's slowest answer while `task` runs (its own connection)."""
    worst = 0.0
    async with httpx.AsyncClient(base_url=px.url, timeout=60) as client:
        while not task.done():
            t0 = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    return worst


async def test_a_body_of_millions_of_small_lists_is_refused_before_it_is_parsed():
    """4M one-token lists, 15 MiB (inside --max-body-bytes): parsing, checking and sizing it
    held the event loop 6.5-19 s (/health too). Counted before parsing, over the default
    bounds (1M values, 64K arrays and objects), it is refused with 413 and /health stays fast."""
    raw = json.dumps({"model": "fake-model", "prompt": [[1]] * 4_000_000, "max_tokens": 1},
                     separators=(",", ":")).encode()
    assert 15 * 2**20 < len(raw) < 16 * 2**20
    async with running_proxy() as px:
        p, d = await px.pd()
        sending = asyncio.create_task(_post(px, raw))
        worst = await _slowest_health(px, sending)
        resp = await sending
        assert resp.status_code == 413, resp.text[:300]
        err = resp.json()["error"]
        assert err["code"] == "request_too_large" and "--max-body-values" in err["message"], err
        assert not p.completions() and not d.completions()
        assert worst < 1.0, f"/health took {worst:.2f}s while the body was judged"


def test_the_bounds_count_values_and_containers_outside_strings():
    """The count: commas and brackets, again without the strings when over; at the bound a
    body passes, one over it is refused (values, then arrays and objects)."""
    bodies = Bodies(1 << 30, max_values=1000, max_containers=100)
    assert bodies.scan_from == 200
    ints = json.dumps({"prompt": list(range(998))}).encode()  # 997 commas: 998 values
    assert json_shape(ints) == (998, 2)
    assert bodies.cost(ints) > 0
    over = json.dumps({"prompt": list(range(1000)), "n": 1}).encode()  # 1001 values
    with pytest.raises(ProxyError) as e:
        bodies.cost(over)
    assert e.value.status == 413 and "1001 JSON values" in e.value.message
    lists = json.dumps({"prompt": [[1]] * 99}).encode()  # 99 lists + the outer list + the object = 101
    with pytest.raises(ProxyError) as e:
        bodies.cost(lists)
    assert "101 JSON arrays and objects" in e.value.message
    assert bodies.cost(json.dumps({"prompt": [[1]] * 98}).encode()) > 0  # 100: at the bound
    # A text prompt full of commas and brackets is one value: not refused.
    text = json.dumps({"prompt": ", [{" * 5000, "max_tokens": 3}).encode()
    assert json_shape(text)[0] > 1000 and bodies.cost(text) > 0
    escaped = json.dumps({"prompt": '\\", [' * 2000}).encode()  # escaped quotes do not end the string
    assert bodies.cost(escaped) > 0
    assert bodies.cost(b'{"prompt": "short"}') == 0  # under scan_from: not even counted


async def test_request_bodies_share_one_budget_partial_and_queued_alike():
    """Clients that send most of a body and stall hold memory (64 of them held +963 MiB); so
    do requests waiting in the admission queue (parsed: more). One budget counts them all,
    from a body's first byte to its request's end: past it, a new body is refused with 503 and
    Retry-After, while requests that fit are served; what leaves gives its share back."""
    limit = 2 * 2**20
    async with running_proxy(max_body_bytes=512 * 1024, max_held_body_bytes=limit,
                             decode_max_in_flight=1, queue_timeout=30) as px:
        p, d = await px.pd()
        # Three clients send 300 KB of a declared 400 KB and stall: 3 x 600 KB counted.
        stalled = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", px.server.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 400000\r\n\r\n" + b" " * 300_000)
            await writer.drain()
            stalled.append((reader, writer))
        await held_at_least(px, 3 * 600_000, "the stalled bodies counted")
        # A fourth body does not fit: refused at once, with JSON and Retry-After.
        big = json.dumps({**COMPLETION, "prompt": "x" * 200_000}).encode()
        resp = await _post(px, big)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1", resp.text
        assert resp.json()["error"]["code"] == "too_many_request_bytes"
        # A small one fits.
        assert (await px.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        for _, writer in stalled:
            writer.close()
        await held_at_least(px, 0, "the stalled bodies given back")

        # Queued: D takes one request at a time and holds this one; the next waits in the
        # queue, still counted; a third that does not fit beside them is refused.
        d.fault = Fault(hang=True, times=1)
        body = json.dumps({**COMPLETION, "prompt": "y" * 400_000}).encode()  # ~0.8 MB counted
        held_by_d = asyncio.create_task(_post(px, body))
        await wait_until(lambda: len(d.completions()) == 1, what="D holds the first")
        queued = asyncio.create_task(_post(px, body))
        await wait_until(lambda: px.state.metrics.queue_depth.labels("D")._value.get() == 1, what="one queued")
        await held_at_least(px, 2 * 800_000, "the held and the queued request counted")
        resp = await _post(px, body)
        assert resp.status_code == 503, resp.text[:200]
        held_by_d.cancel()
        queued.cancel()
        await asyncio.gather(held_by_d, queued, return_exceptions=True)
        await held_at_least(px, 0, "everything given back")


def test_cache_aware_hashes_no_more_of_a_prompt_than_an_instance_holds():
    """A 16 MiB prompt was cut into 262,144 chunks and hashed (up to 1.3 s on the event loop)
    though an instance holds 31,250 (500k tokens): the chain stops there."""
    index = PrefixIndex(chunk_tokens=16, capacity_tokens=500_000)
    prompt = "abcdefgh" * (2 * 2**20)
    t0 = time.perf_counter()
    chain = index.chain(prompt)
    assert len(chain) == index.capacity_chunks == 31_250
    assert chain == index.chain(prompt[: 31_250 * 64])  # the same prefix, the same chain
    assert len(index.chain(list(range(1_000_000)))) == 31_250
    assert time.perf_counter() - t0 < 10  # generous: the subject is the count

"""SIGTERM: stop accepting, drain in-flight requests up to the grace period, exit 0.
The proxy runs as a real `python -m proxy` subprocess; the fake instances run here."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx

from proxy.config import ProxyConfig
from proxy.serving.app import create_app
from tests.support.proxy_helpers import FakeVLLM, running_proxy, wait_until
from tests.support.proxy_process import start_proxy, stop, wait_ready


async def test_sigterm_drains_in_flight_stream_and_exits_0(tmp_path):
    proc, url, disc = await start_proxy(tmp_path, "--shutdown-grace-s", "10")
    p = await FakeVLLM("P", proxy=disc).start()
    d = await FakeVLLM("D", proxy=disc, token_delay=0.05).start()
    try:
        async with httpx.AsyncClient(timeout=20, verify=False) as client:
            await wait_ready(client, url, proc)
            body = {"prompt": "x", "max_tokens": 12, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                chunks = r.aiter_bytes()
                received = await anext(chunks)
                proc.send_signal(signal.SIGTERM)
                # New connections are refused while the old stream keeps flowing.
                async with httpx.AsyncClient(timeout=2, verify=False) as other:

                    async def refused() -> bool:
                        try:
                            await other.get(url + "/health")
                        except httpx.TransportError:
                            return True
                        return False

                    deadline = asyncio.get_running_loop().time() + 5
                    while not await refused():
                        assert asyncio.get_running_loop().time() < deadline
                        await asyncio.sleep(0.02)
                async for chunk in chunks:
                    received += chunk
            assert received.endswith(b"data: [DONE]\n\n")
            assert received.count(b"data: ") == 13
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        assert d.completions()[0].completed
        log = (tmp_path / "proxy.log").read_text()
        assert "draining" in log
    finally:
        await stop(proc)
        await p.stop()
        await d.stop()


async def test_sigterm_grace_period_bounds_the_drain(tmp_path):
    proc, url, disc = await start_proxy(tmp_path, "--shutdown-grace-s", "0.5")
    p = await FakeVLLM("P", proxy=disc).start()
    d = await FakeVLLM("D", proxy=disc, token_delay=0.2).start()
    try:
        async with httpx.AsyncClient(timeout=20, verify=False) as client:
            await wait_ready(client, url, proc)
            body = {"prompt": "x", "max_tokens": 500, "stream": True}  # ~100 s of tokens
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                chunks = r.aiter_bytes()
                await anext(chunks)
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), 20) == 0
        # The proxy cut the stream at the deadline, and D saw the abort.
        await wait_until(lambda: d.completions()[0].cancelled, what="D abort")
    finally:
        await stop(proc)
        await p.stop()
        await d.stop()


async def test_ready_is_503_while_draining():
    app = create_app(ProxyConfig())
    state = app.state.proxy
    for role in ("P", "D"):
        state.registry.admit(state.registry.upsert(_reg(role)))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        assert (await client.get("/ready")).status_code == 200
        state.draining = True
        r = await client.get("/ready")
        assert r.status_code == 503 and r.json()["draining"] is True


async def test_sigterm_makes_ready_503_during_the_drain():
    """A real SIGTERM through the handler the server installs: /ready answers 503 (so a load
    balancer stops sending) while the in-flight stream still completes. The test above sets
    the flag by hand; this one fails if the signal handler stops setting it."""
    async with running_proxy(shutdown_grace_s=10.0) as px:
        await px.fake("P")
        await px.fake("D", token_delay=0.05)
        assert (await px.client.get("/ready")).status_code == 200
        # uvicorn stops listening once it sees the signal: ask the same app in-process.
        inproc = httpx.AsyncClient(transport=httpx.ASGITransport(app=px.server.config.app), base_url="http://proxy")
        body = {"prompt": "x", "max_tokens": 12, "stream": True}
        async with inproc, px.client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = r.aiter_bytes()
            received = await anext(chunks)
            px.server.handle_signals = True
            with px.server.capture_signals():
                assert signal.getsignal(signal.SIGTERM) == px.server.handle_exit  # else the kill ends pytest
                os.kill(os.getpid(), signal.SIGTERM)
                await wait_until(lambda: px.server.should_exit, what="the signal handled")
            ready = await inproc.get("/ready")
            assert ready.status_code == 503 and ready.json()["draining"] is True
            async for chunk in chunks:
                received += chunk
        assert received.endswith(b"data: [DONE]\n\n") and received.count(b"data: ") == 13


def _reg(role: str):
    from xpyd_wire.discovery import Registration

    return Registration(role, "127.0.0.1:1", "127.0.0.1:2")

"""The key behaviours with each alternative upstream client (--upstream-client aiohttp|httpx).
The rest of the suite runs with the default (native); XPYD_TEST_UPSTREAM_CLIENT=aiohttp runs
all of it with another one."""

from __future__ import annotations

import asyncio
import json

import pytest
from proxy_helpers import Fault, free_port, running_proxy, wait_until


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
async def test_alternative_upstream_client(client):
    async with running_proxy(upstream_client=client, stream_idle_timeout=0.5) as px:
        p, d = await px.pd()
        body = {"prompt": "x", "max_tokens": 3}
        ok = await px.client.post("/v1/completions", json=body)
        assert ok.status_code == 200 and ok.content == bytes(d.completions()[-1].sent)
        stream = await px.client.post("/v1/completions", json={**body, "stream": True})
        assert stream.text.endswith("data: [DONE]\n\n")
        assert stream.content == bytes(d.completions()[-1].sent)
        assert p.completions()[-1].json["max_tokens"] == 1

        p.fault = Fault(status=500, times=1)  # P fails: relayed, D not called
        n = len(d.completions())
        assert (await px.client.post("/v1/completions", json=body)).status_code == 500
        assert len(d.completions()) == n

        d.fault = Fault(fail_after=2, times=1)  # D breaks mid-stream: SSE error event
        broken = await px.client.post("/v1/completions", json={**body, "stream": True})
        last = [e for e in broken.text.split("\n\n") if e][-1]
        assert json.loads(last[6:])["error"]["code"] == "decode_midstream"

        d.fault = Fault(stall_after=1, times=1)  # D goes quiet: idle deadline
        idle = await px.client.post("/v1/completions", json={**body, "stream": True})
        last = [e for e in idle.text.split("\n\n") if e][-1]
        assert json.loads(last[6:])["error"]["code"] == "decode_timeout"

        d.fault = Fault(token_delay=0.05, times=1)  # client leaves mid-stream: D aborts
        host, port = px.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        raw = json.dumps({**body, "max_tokens": 100, "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(raw), raw))  # fmt: skip
        await asyncio.wait_for(reader.readuntil(b"data: "), 5)
        writer.close()
        await wait_until(lambda: d.completions()[-1].cancelled, what="D saw the abort")

        # An unreachable P is retried on the live one.
        sender = await px.fake("P", register=False)
        from proxy.protocol import Registration, encode

        dead = f"127.0.0.1:{free_port()}"
        await sender.send_raw(encode(Registration("P", dead, "127.0.0.1:1")))
        await wait_until(lambda: px.registry.count("P") == 2)
        for _ in range(2):
            assert (await px.client.post("/v1/completions", json=body)).status_code == 200
        assert (await px.client.get("/v1/models")).status_code == 200
        # Only the one deliberate disconnect: finished requests never read as the client
        # leaving, even when the client library yields while releasing its connection.
        assert await px.metric("xpyd_client_disconnects_total") == 1
        assert await px.metric("xpyd_requests_total", route="/v1/completions", status="499") == 1

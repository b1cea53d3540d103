"""Helpers of tests/unit/test_proxy_clients.py that other tests use too (moved from it)."""

from __future__ import annotations

import asyncio

from tests.support.raw_server import RawServer, read_request, reset

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"


MODELS = b'{"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "vllm"}]}'


class RawInstance:
    """A vLLM stand-in on a raw socket: /health and /v1/models answered properly, each POST
    with answer(request) -> (parts, ending): the parts written a moment apart, then the
    connection closed ("fin") or reset ("rst")."""

    def __init__(self, answer, models: bytes = MODELS) -> None:
        self.answer = answer
        self.models = models
        self.posts: list[bytes] = []
        self.server = RawServer(self._handle)

    async def __aenter__(self) -> RawInstance:
        await self.server.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.__aexit__(*exc)

    @property
    def url(self) -> str:
        return self.server.url

    async def _handle(self, reader, writer) -> None:
        for _ in range(1000):  # keep-alive: probes reuse the connection
            try:
                req = await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if req.startswith(b"POST"):
                self.posts.append(req)
                parts, ending = self.answer(req)
                for part in parts:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.02)
                if ending == "rst":
                    reset(writer)
                return
            body = self.models if b" /v1/models " in req.split(b"\r\n", 1)[0] else b"{}"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            await writer.drain()

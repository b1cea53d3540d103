"""Relaying D's answer to the client once its first bytes are in hand."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from proxy.asgi import Flight, Send
from proxy.errors import sse_error_event
from proxy.metrics import Metrics
from proxy.registry import Instance
from proxy.upstream import UpstreamError, UpstreamResponse

log = logging.getLogger("xpyd.proxy.relay")


@dataclass(slots=True)
class Answer:
    """D's response up to its first body bytes: what is needed to start the client's."""

    resp: UpstreamResponse
    first: bytes
    streaming: bool
    chunks: AsyncIterator[bytes] | None  # the rest of a stream


class Relay:
    """Relays D's answers; one per proxy (it holds the stream deadline and the metrics)."""

    def __init__(self, metrics: Metrics, idle_timeout: float) -> None:
        self.metrics = metrics
        self.idle = idle_timeout

    async def __call__(self, answer: Answer, d: Instance, send: Send, flight: Flight) -> None:
        """Send the status line, then the body as it arrives. A failure of D after the
        status line ends the stream with an SSE error event: the status cannot change."""
        metrics, idle = self.metrics, self.idle
        resp = answer.resp
        hdrs = [(b"content-type", resp.content_type.encode("latin-1"))]
        if not answer.streaming:
            hdrs.append((b"content-length", b"%d" % len(answer.first)))
        hdrs.extend(flight.extra)
        flight.started = True
        await send({"type": "http.response.start", "status": resp.status, "headers": hdrs})
        if not answer.streaming or resp.at_eof():  # all of it in hand: one write, not two
            flight.done = True
            await send({"type": "http.response.body", "body": answer.first, "more_body": False})
            return
        await send({"type": "http.response.body", "body": answer.first, "more_body": True})
        assert answer.chunks is not None
        loop = asyncio.get_running_loop()
        last = answer.first
        try:
            async with asyncio.timeout(idle) as deadline:
                async for chunk in answer.chunks:
                    if resp.at_eof():  # last piece: send it with the end of the response
                        flight.done = True
                        await send({"type": "http.response.body", "body": chunk, "more_body": False})
                        return
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if chunk:
                        last = chunk
                    deadline.reschedule(loop.time() + idle)
            tail = b""
        except TimeoutError:
            metrics.upstream_error("D", d.http_address, "stream_idle_timeout")
            log.warning("decode stream idle instance=%s after=%.1fs", d.http_address, idle)
            tail = sse_error_event(
                f"decode instance {d.http_address} sent nothing for {idle}s", 504, "decode_timeout"
            )
        except UpstreamError as e:
            metrics.upstream_error("D", d.http_address, "midstream")
            log.warning("decode stream broke instance=%s error=%s", d.http_address, e)
            tail = sse_error_event(
                f"decode instance {d.http_address} failed mid-stream: {e}", 502, "decode_midstream"
            )
        if tail and not last.endswith(b"\n\n"):
            # D broke off inside an event: end it, so the error is an event of its own.
            tail = b"\n\n" + tail
        flight.done = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})

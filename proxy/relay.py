"""Relaying D's answer to the client once its first bytes are in hand."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from proxy.asgi import Flight, Send
from proxy.errors import instance_text, sse_error_event, upstream_text
from proxy.metrics import Metrics
from proxy.registry import Instance
from proxy.rewrite import IdRewrite
from proxy.upstream import UpstreamError, UpstreamResponse

log = logging.getLogger("xpyd.proxy.relay")


@dataclass(slots=True)
class Answer:
    """D's response up to its first body bytes: what is needed to start the client's."""

    resp: UpstreamResponse
    first: bytes
    streaming: bool
    chunks: AsyncIterator[bytes] | None  # the rest of a stream
    rewrite: IdRewrite | None = None  # internal -> neutral request id (None: exposed)


# What an SSE stream ends with when its last event is complete (LF, CRLF or CR lines).
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n")


def at_event_boundary(tail: bytes) -> bool:
    """Whether a stream whose last bytes are `tail` (empty: nothing sent) may take a new
    event as it is. Unsure (a trailing CR may await its LF) counts as no: an extra blank
    line is harmless in SSE, an event glued to the previous one is not."""
    return not tail or tail.endswith(_EVENT_ENDS)


class Relay:
    """Relays D's answers; one per proxy (it holds the stream deadline and the metrics)."""

    def __init__(self, metrics: Metrics, idle_timeout: float, expose: bool = False) -> None:
        self.metrics = metrics
        self.idle = idle_timeout
        self.expose = expose  # name D in client-visible error events

    async def __call__(self, answer: Answer, d: Instance, send: Send, flight: Flight) -> None:
        """Send the status line, then the body as it arrives. A failure of D after the
        status line ends the stream with an SSE error event: the status cannot change."""
        metrics, idle, rw = self.metrics, self.idle, answer.rewrite
        resp = answer.resp
        first = answer.first
        hdrs = [(b"content-type", resp.content_type.encode("latin-1"))]
        if not answer.streaming:
            if rw is not None:
                first = rw.whole(first)
            hdrs.append((b"content-length", b"%d" % len(first)))
        hdrs.extend(flight.extra)
        flight.started = True
        await send({"type": "http.response.start", "status": resp.status, "headers": hdrs})
        if not answer.streaming or resp.at_eof():  # all of it in hand: one write, not two
            if answer.streaming and rw is not None:
                first = rw.whole(first)
            flight.done = True
            await send({"type": "http.response.body", "body": first, "more_body": False})
            return
        if rw is not None:
            first = rw.feed(first)
        await send({"type": "http.response.body", "body": first, "more_body": True})
        assert answer.chunks is not None
        loop = asyncio.get_running_loop()
        last = first[-4:]  # the stream's last bytes sent: is an error event on a boundary?
        try:
            async with asyncio.timeout(idle) as deadline:
                async for chunk in answer.chunks:
                    if rw is not None:
                        chunk = rw.feed(chunk)
                    if resp.at_eof():  # last piece: send it with the end of the response
                        if rw is not None:
                            chunk += rw.flush()
                        flight.done = True
                        await send({"type": "http.response.body", "body": chunk, "more_body": False})
                        return
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if chunk:
                        last = chunk if len(chunk) >= 4 else (last + chunk)[-4:]
                    deadline.reschedule(loop.time() + idle)
            error = b""
        except TimeoutError:
            metrics.upstream_error("D", d.http_address, "stream_idle_timeout")
            log.warning("decode stream idle instance=%s after=%.1fs", d.http_address, idle)
            error = sse_error_event(
                f"{instance_text('decode', d.http_address, self.expose)} sent nothing for {idle}s",
                504,
                "decode_timeout",
            )
        except UpstreamError as e:
            metrics.upstream_error("D", d.http_address, "midstream")
            log.warning("decode stream broke instance=%s error=%s", d.http_address, e)
            error = sse_error_event(
                f"{instance_text('decode', d.http_address, self.expose)} failed mid-stream: "
                f"{upstream_text(e.kind, str(e), self.expose)}",
                502,
                "decode_midstream",
            )
        if error:
            if rw is not None:
                rw.drop()  # a held start of the internal id is never sent
            if not at_event_boundary(last):
                # D broke off inside an event: end it, so the error is an event of its own.
                error = b"\n\n" + error
            body = error
        else:
            body = rw.flush() if rw is not None else b""
        flight.done = True
        await send({"type": "http.response.body", "body": body, "more_body": False})

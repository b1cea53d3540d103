"""Relaying D's answer to the client once its first bytes are in hand."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus

import orjson

from proxy.asgi import Flight, Send
from proxy.deadline import Deadline
from proxy.dispatch.rewrite import DetailsRewrite, IdRewrite, LateDetails, UsageRewrite
from proxy.errors import instance_text, sse_error_event, upstream_text
from proxy.metrics import Metrics
from proxy.registry import Instance
from proxy.upstream.base import UpstreamError, UpstreamResponse

log = logging.getLogger("xpyd.proxy.relay")


@dataclass(slots=True)
class Answer:
    """D's response up to its first body bytes: what is needed to start the client's."""

    resp: UpstreamResponse
    first: bytes
    streaming: bool
    chunks: AsyncIterator[bytes] | None  # the rest of a stream
    # internal -> client's request id (None: exposed); P's cache figures in D's usage (UsageRewrite for
    # the Responses API, DetailsRewrite over the id rewrite for completions and chat, LateDetails
    # when the stream went out before P's answer)
    rewrite: IdRewrite | UsageRewrite | DetailsRewrite | LateDetails | None = None
    # A read of the stream still under way when the lead's deadline came (see read_lead):
    # `chunks` starts with its result, and closing the answer must cancel it.
    pending: asyncio.Task[bytes | None] | None = None

    async def aclose(self) -> None:
        """Release D's response; an unread one closes its connection (D aborts)."""
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()
        await self.resp.aclose()


# What an SSE stream ends with when its last event is complete (LF, CRLF or CR lines).
EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n")


def at_event_boundary(tail: bytes) -> bool:
    """Whether a stream whose last bytes are `tail` (empty: nothing sent) may take a new
    event as it is. Unsure (a trailing CR may await its LF) counts as no: an extra blank
    line is harmless in SSE, an event glued to the previous one is not."""
    return not tail or tail.endswith(EVENT_ENDS)


# ---------------------------------------------------------------- a stream's lead
# vLLM answers a stream's request with 200 before generating; a failure before the first
# token (a KV load that failed, under kv_load_failure_policy=fail) then comes as an SSE
# error event: first in a completion stream, after the role chunk in a chat stream. Such a
# stream is a failure before D's first byte (retried, then rescued) if it is judged before
# anything is relayed: so D's leading events that carry nothing generated are held back
# until one that does (relayed at once with them), bounded by these bytes and by the
# first-byte deadline.
LEAD_MAX_BYTES = 16 * 1024

EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r|\n\r\n|\r\n\n")
# Error types that are a verdict on the request (vLLM's 4xx, OpenAI's), for an error event
# without an HTTP status in its code: any other type counts as D's failure.
_CLIENT_ERROR_TYPES = frozenset(
    ["BadRequestError", "NotFoundError", "UnprocessableEntityError", "invalid_request_error",
     "authentication_error", "permission_error", "not_found_error", "rate_limit_error"]
    + [s.phrase for s in HTTPStatus if 400 <= s < 500]
)  # fmt: skip


DONE_EVENT = b"data: [DONE]\n\n"

# Typed stream events that open an answer before anything is generated: the Responses API's
# (the response, then each output item and content part announced empty) and Anthropic's
# (the message, each content block, keep-alive pings). Anything else counts as content.
_NOTHING_GENERATED = frozenset({
    "response.created", "response.in_progress", "response.queued", "response.output_item.added",
    "response.content_part.added", "response.reasoning_summary_part.added",
    "message_start", "content_block_start", "ping",
})  # fmt: skip


class StreamFailed(Exception):
    """Raised by an answer's chunks when the answer cannot go on and ``event`` (a complete
    SSE error event, ready to send) says why to the client."""

    def __init__(self, event: bytes, reason: str) -> None:
        super().__init__(reason)
        self.event = event


@dataclass(frozen=True, slots=True)
class StreamError:
    """A server error event that came before any generated content."""

    status: int  # the event's code when an HTTP 5xx status, else 500
    body: bytes  # the event's JSON: {"error": {...}}


def _server_error(err: dict) -> int | None:
    """The HTTP status of an error event when it is D's failure (5xx), else None."""
    code = err.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code < 600:
        return code if code >= 500 else None
    return None if err.get("type") in _CLIENT_ERROR_TYPES else 500


def _carries(choice: object) -> bool:
    """Whether a stream choice carries anything generated (or is not understood)."""
    if not isinstance(choice, dict):
        return True
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    if choice.get("logprobs") or choice.get("token_ids"):
        return True
    delta = choice.get("delta")
    if delta is None:
        return False
    if not isinstance(delta, dict):
        return True
    return any(v for k, v in delta.items() if k != "role")  # chat's role chunk: nothing


def judge_lead(buf: bytes, start: int = 0) -> tuple[bool | StreamError, int]:
    """Judge a stream's complete events from `start` on: (True, _) when one carries
    something, is [DONE] or is not understood, or the events go past LEAD_MAX_BYTES (relay
    now); (StreamError, _) for a server error event; else (False, where the next event
    starts): nothing generated so far. Never looks past LEAD_MAX_BYTES."""
    cap = LEAD_MAX_BYTES
    while True:
        # vLLM's lines end with LF: plain finds (a regex costs more than the rest together).
        lf = buf.find(b"\r", start, cap) < 0
        if lf:
            i = buf.find(b"\n\n", start, cap)
            end = i + 2
        else:
            m = EVENT_END.search(buf, start, cap)
            i, end = (m.start(), m.end()) if m is not None else (-1, 0)
        if i < 0:
            return len(buf) >= cap, start
        event = buf[start:i]
        start = end
        if lf and event.startswith(b"data: ") and b"\n" not in event:
            raw = event[6:]  # vLLM's: one data line
        else:
            data = [line[5:].removeprefix(b" ") for line in event.splitlines()
                    if line.startswith(b"data:")]  # fmt: skip
            if not data:  # a comment or an empty event
                continue
            raw = b"\n".join(data)
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:  # [DONE], or not vLLM's
            return True, start
        if not isinstance(obj, dict):
            return True, start
        err = obj.get("error")
        if err is not None:
            status = _server_error(err) if isinstance(err, dict) else None
            return (True if status is None else StreamError(status, raw)), start
        choices = obj.get("choices")
        if not isinstance(choices, list):
            kind = obj.get("type")  # the Responses API's and Anthropic's typed events
            if kind in _NOTHING_GENERATED:
                continue
            if kind == "error":  # the Responses API's error event: its code at the top
                status = _server_error(obj)
                return (True if status is None else StreamError(status, raw)), start
            return True, start
        for choice in choices:
            if _carries(choice):
                return True, start


async def _next(chunks: AsyncIterator[bytes]) -> bytes | None:
    return await anext(chunks, None)


async def _after(pending: asyncio.Task[bytes | None],
                 rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:  # fmt: skip
    chunk = await pending
    if chunk is None:
        return
    yield chunk
    async for chunk in rest:
        yield chunk


async def read_lead(answer: Answer, until: float) -> StreamError | None:
    """Hold back D's leading events that carry nothing generated (chat's role chunk) until
    one that does, the stream's end, LEAD_MAX_BYTES or the loop time `until`; all of it is
    then answer.first. Returns the server error event that came first, if one did (the
    caller closes the answer). Raises UpstreamError if D broke off meanwhile."""
    assert answer.chunks is not None
    buf = answer.first
    verdict, start = judge_lead(buf)
    if verdict is False:
        resp, chunks = answer.resp, answer.chunks
        loop = asyncio.get_running_loop()
        # Bounded: every turn reads more (or stops), and the cap and deadline end it.
        while verdict is False and len(buf) <= LEAD_MAX_BYTES and not resp.at_eof():
            left = until - loop.time()
            if left <= 0:
                break
            # A task, not a timeout around anext: cancelling a read would end the stream.
            task = loop.create_task(_next(chunks))
            try:
                done, _ = await asyncio.wait((task,), timeout=left)
            except BaseException:
                task.cancel()
                raise
            if not done:  # the deadline: relay as without the lead (the read goes on)
                answer.pending = task
                answer.chunks = _after(task, chunks)
                break
            chunk = task.result()
            if chunk is None:  # the stream ended
                break
            buf += chunk
            verdict, start = judge_lead(buf, start)
        answer.first = buf
    return verdict if isinstance(verdict, StreamError) else None


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
        late = rw if isinstance(rw, LateDetails) else None  # P's figures may still be to come
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
            if late is not None:  # a whole stream before P's answer: only what P's figures amend waits
                first = late.feed(first)
                if late.holding:
                    if first:
                        await send({"type": "http.response.body", "body": first, "more_body": True})
                    first = await late.settle()
                first += late.flush()
            elif answer.streaming and rw is not None:
                first = rw.whole(first)
            flight.done = True
            await send({"type": "http.response.body", "body": first, "more_body": False})
            return
        # D's [DONE] ends the client's response at once: vLLM writes its body's end apart, and
        # a client that read [DONE] may close (the openai SDK does) before it comes, which must
        # not read as the client leaving. `tail`: D's last raw bytes, to find [DONE] split.
        tail = first[-_TAIL:]
        over = _over(tail)
        if rw is not None:
            first = rw.feed(first)
            if late is not None and late.holding:
                first += await late.settle()
            if over:
                first += rw.flush()
        if over:
            flight.done = True
        await send({"type": "http.response.body", "body": first, "more_body": not over})
        assert answer.chunks is not None
        if over:
            await self._drain(answer)
            return
        loop = flight.task.get_loop() if flight.task is not None else asyncio.get_running_loop()
        last = first[-4:]  # the stream's last bytes sent: is an error event on a boundary?
        ended = False  # the response's end sent with D's last piece or its [DONE]
        try:
            async with Deadline.after(loop, idle) as deadline:
                async for chunk in answer.chunks:
                    tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
                    if rw is not None:
                        chunk = rw.feed(chunk)
                        if late is not None and late.holding:  # D's usage before P's answer
                            # P's call has its own deadline (prefill_timeout): D's idle one does
                            # not time the wait for it.
                            deadline.reschedule(None)
                            chunk += await late.settle()
                    if resp.at_eof() or _over(tail):  # last piece: send it with the end of the response
                        if rw is not None:
                            chunk += rw.flush()
                        flight.done = ended = True
                        await send({"type": "http.response.body", "body": chunk, "more_body": False})
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if chunk:
                        last = chunk if len(chunk) >= 4 else (last + chunk)[-4:]
                    deadline.reschedule(loop.time() + idle)
            if ended:
                if not resp.at_eof():
                    await self._drain(answer)
                return
            error = b""
        except TimeoutError:
            metrics.upstream_error("D", d.http_address, "stream_idle_timeout")
            log.warning("decode stream idle instance=%s after=%.1fs", d.http_address, idle)
            error = sse_error_event(
                f"{instance_text('decode', d.http_address, self.expose)} sent nothing for {idle}s",
                504,
                "decode_timeout",
            )
        except StreamFailed as e:  # counted and logged where it was raised
            error = e.event
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
            body = error + DONE_EVENT  # as vLLM ends a stream after its error event
        else:
            body = rw.flush() if rw is not None else b""
        flight.done = True
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _drain(self, answer: Answer) -> None:
        """D's body after its [DONE], read to its end within DRAIN_S so that its connection
        goes back to the pool; whatever comes or fails then is not the client's (its answer
        is complete): past the bound, closing the answer closes the connection."""
        assert answer.chunks is not None
        loop = asyncio.get_running_loop()
        try:
            async with Deadline.after(loop, DRAIN_S):
                async for _ in answer.chunks:
                    pass
        except (TimeoutError, UpstreamError, StreamFailed) as e:
            log.debug("decode stream after [DONE] not read to its end: %r", e)


# How long D's body end is awaited after its [DONE] (vLLM writes it at once).
DRAIN_S = 1.0
_TAIL = len(DONE_EVENT) + 4  # [DONE] and the event end before it


def _over(tail: bytes) -> bool:
    """Whether a stream whose last bytes are `tail` (all of it when shorter) ended with its
    [DONE] event: vLLM's last, on an event boundary (not a data line of a longer event)."""
    return tail.endswith(DONE_EVENT) and at_event_boundary(tail[: -len(DONE_EVENT)])

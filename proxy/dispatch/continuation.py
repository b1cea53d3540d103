"""The first token from P (``--first-token prefill``): P's token goes to the client at once,
D's continuation is opened when the relay asks for what follows it, and a D that fails
before its first byte is replaced by D alone once. The rules (which requests qualify, P's
request, D's continuation request, the event translation) are in first_token.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import orjson

from proxy.config import ProxyConfig
from proxy.dispatch import first_token
from proxy.dispatch.call import LOCAL_RESCUE, Call, DecodeFailed
from proxy.dispatch.decode import Decode
from proxy.dispatch.events import ContinuationEvents
from proxy.dispatch.relay import Answer, StreamFailed
from proxy.errors import ProxyError, sse_event_of
from proxy.metrics import Metrics
from proxy.openai_api import COMPLETIONS
from proxy.registry import Instance
from proxy.routing.selection import Selector
from proxy.upstream.base import UpstreamResponse
from xpyd_wire import request_id
from xpyd_wire.headers import XPYD_FIRST_TOKEN_RAW

log = logging.getLogger("xpyd.proxy.dispatch")


class Continuation:
    def __init__(self, cfg: ProxyConfig, selector: Selector, metrics: Metrics, decode: Decode) -> None:
        self.cfg = cfg
        self.selector = selector
        self.metrics = metrics
        self.decode = decode
        self._phase = metrics.phase_children

    def answer(self, call: Call, d: Instance, first: first_token.FirstToken, headers: dict[str, str]) -> Answer:
        """P's token goes to the client now; D's continuation is opened when the relay
        asks for what follows it (proxy/dispatch/first_token.py)."""
        body = call.req.body
        usage = first_token.usage_wanted(body)
        rewrite = self.decode.rewrite(headers, call.req.client_id)
        call.flight.extra.append((XPYD_FIRST_TOKEN_RAW, b"prefill"))
        call.t_decode = time.perf_counter()
        limits = d.output_limits
        assert limits is not None  # first_token.eligible
        if first_token.complete_at_prefill(body, first, limits):  # D has nothing to add
            return Answer(_Stitched(complete=True), first_token.first_events(first, True, usage), True, None,
                          rewrite)
        stitched = _Stitched()
        # D's events get the id the client sees: the rewrite then finds nothing left to do.
        event_id = first.id if rewrite is None else rewrite.text(first.id)
        events = ContinuationEvents(first_token.text_offset_after(first), event_id, first.chat, first.created,
                                    first_token.stream_details(first.usage))
        cont = first_token.continuation(body, first, limits)
        stitched.gen = self._continue(call, d, cont, headers, stitched, events)
        return Answer(stitched, first_token.first_events(first, False, usage), True, stitched.gen, rewrite)

    async def _continue(self, call: Call, d: Instance, cont: dict, headers: dict[str, str], stitched: _Stitched,
                        events: ContinuationEvents) -> AsyncGenerator[bytes, None]:  # fmt: skip
        """D's continuation of P's token (``cont``: D's completions request, also for a chat
        request: ContinuationEvents turns its chunks into chat chunks), for the relay. The client
        has P's token and the 200 already, so a failure can only reach it as an error event:
        - D's verdict on the request (4xx), an answer over the size limit, or D silent for
          decode_ttfb_timeout: D's error, as the stream's last event;
        - D failed before its first byte (5xx, connection): D alone continues once (a plain
          request id: it prefills prompt + token itself; the KV went to this D, so no other
          can load it), on another D when there is one, else on this one. If that fails too,
          the first failure's error ends the stream."""
        req = call.req
        rescuer: Instance | None = None
        if call.flush is not None:
            # The relay has just written P's token, which the transport would hold until
            # this loop turn ends (proxy/serving/corked.py): send it before D's request is built.
            call.flush()
        try:
            try:
                opening = self.decode.open(req, d, headers, orjson.dumps(cont), COMPLETIONS)
                answer = await self.decode.first_bytes(call.loop, d, opening, headers, client=req.client_id)
            except ProxyError as e:
                raise StreamFailed(sse_event_of(e), e.message) from None
            except DecodeFailed as e:
                if call.trace is not None:
                    call.trace.failed("D", d.http_address, e.error.message)
                rescuer = await self._rescuer(call, d)
                answer = await self._continue_alone(call, rescuer or d, cont, e.error)
            stitched.d = answer.resp
            self._phase["decode_ttfb"].observe(time.perf_counter() - call.t_decode)
            try:
                # The relay sends the piece that ends D's answer as the response's last: it
                # carries whatever event was still held.
                yield events.feed(answer.first) + (events.flush() if stitched.at_eof() else b"")
                if answer.chunks is not None:
                    async for chunk in answer.chunks:
                        yield events.feed(chunk) + (events.flush() if stitched.at_eof() else b"")
                if tail := events.flush():
                    yield tail
            finally:
                await answer.aclose()
        finally:
            if rescuer is not None:
                self.selector.release(rescuer, req)

    def _left(self, call: Call) -> float:
        """Seconds left of D's first-byte deadline for the continuation, from P's token."""
        return call.t_decode + self.cfg.decode_ttfb_timeout - time.perf_counter()

    async def _rescuer(self, call: Call, d: Instance) -> Instance | None:
        """Another D for the continuation, taken (the caller releases it), or None: there is
        none, or none had room before the continuation's deadline."""
        left = self._left(call)
        if left <= 0:
            return None
        try:
            async with asyncio.timeout(left):
                return await self.selector.acquire("D", call.req, (d,))
        except (TimeoutError, ProxyError):  # no room in time, or shed (429)
            return None

    async def _continue_alone(self, call: Call, d: Instance, cont: dict, failed: ProxyError) -> Answer:
        log.warning("decode continuation failed before its first byte error=%s; D alone on instance=%s",
                    failed.message, d.http_address)
        self.metrics.dispatch(LOCAL_RESCUE)
        if call.trace is not None:
            call.trace.instance("D", d.http_address, LOCAL_RESCUE)
        left = self._left(call)
        if left > 0:
            plain = {**call.req.headers, "x-request-id": request_id.build_local()}
            alone = orjson.dumps(first_token.alone(cont))
            try:
                opening = self.decode.open(call.req, d, plain, alone, COMPLETIONS)
                return await self.decode.first_bytes(call.loop, d, opening, plain, left, call.req.client_id)
            except (DecodeFailed, ProxyError) as e:
                log.warning("decode continuation alone failed instance=%s error=%s; ending the stream with: %s",
                            d.http_address, e, failed.message)
        else:
            log.warning("decode continuation alone skipped instance=%s reason=deadline_spent; ending the stream "
                        "with: %s", d.http_address, failed.message)
        raise StreamFailed(sse_event_of(failed), failed.message)


class _Stitched:
    """The client's response in first-token mode, as the relay sees one upstream answer:
    P's token, then D's continuation (its response, once open)."""

    status = 200
    content_type = "text/event-stream; charset=utf-8"

    def __init__(self, complete: bool = False) -> None:
        self.d: UpstreamResponse | None = None
        self.gen: AsyncGenerator[bytes, None] | None = None
        self._complete = complete  # P's token is the whole answer

    def at_eof(self) -> bool:
        return self._complete or (self.d is not None and self.d.at_eof())

    async def read(self, limit: int | None = None) -> bytes:
        raise NotImplementedError("a stitched stream is relayed, not read")

    def chunks(self) -> AsyncIterator[bytes]:
        raise NotImplementedError("a stitched stream is relayed through its Answer")

    async def aclose(self) -> None:
        gen, self.gen = self.gen, None
        if gen is not None:
            try:
                await gen.aclose()  # closes D's answer if it was opened
            except RuntimeError:  # still running: its task's cancellation closes it
                pass
        if self.d is not None:
            await self.d.aclose()

"""One request's journey: choose D, prefill on a P (or let D prefill alone), open D's answer.

Failures are sorted by what can still be done about them:
- P unreachable or timed out: try another P (bounded by prefill_retries);
- D unreachable, dropped or 5xx before its first byte (a stream: a server error event or a
  dropped connection before any generated content): redo the request on another D with a
  new P/D pair (bounded by decode_retries): nothing has reached the client yet; when no D
  is left (or every retry failed), D alone once (local_rescue): a lost KV transfer fails
  D's request, D prefilling itself does not need one;
- an instance's own HTTP error (4xx, or P's 5xx): relayed as it is, never retried;
- with the first token from P (proxy/dispatch/first_token.py) the client has a 200 and a token
  before D is asked: D's failures end the stream with an error event, after one D-alone
  continuation for the failures above that a rescue may mend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import orjson

from proxy.config import ProxyConfig
from proxy.deadline import Deadline
from proxy.dispatch import first_token
from proxy.dispatch.relay import Answer, Relay, StreamFailed, read_lead
from proxy.dispatch.rewrite import IdRewrite, neutral_id
from proxy.errors import ProxyError, instance_text, sse_event_of, upstream_error_body, upstream_text
from proxy.metrics import Metrics
from proxy.openai_api import CHAT, COMPLETIONS, prefill_body
from proxy.registry import Instance
from proxy.request import RouteRequest
from proxy.routing.selection import Selector
from proxy.serving.asgi import Flight, Send, ms
from proxy.upstream.base import Upstream, UpstreamError, UpstreamResponse
from xpyd_wire import request_id

log = logging.getLogger("xpyd.proxy.dispatch")

# Dispatch paths, as counted in xpyd_dispatch_total.
DISAGGREGATED = "disaggregated"
LOCAL_SHORT = "local_short"  # prompt below local_prefill_threshold
LOCAL_CACHED = "local_cached"  # D holds all but a short tail of the prompt
LOCAL_NO_PREFILL = "local_no_prefill"  # no P live or reachable
LOCAL_RESCUE = "local_rescue"  # D failed disaggregated attempts before its first byte
PREFILL_ALONE = "prefill_alone"  # first-token mode, one token asked for: P's answer is all of it
_DISAGGREGATED_PATH = DISAGGREGATED.encode()
_PREFILL_ALONE_PATH = PREFILL_ALONE.encode()
# The answer needs the prompt's logprobs (echo with logprobs, prompt_logprobs): vLLM computes
# them in the prefill, so D would recompute the whole prompt and load none of P's KV.
LOCAL_PROMPT_LOGPROBS = "local_prompt_logprobs"
# A request the proxy cannot read (not JSON, not the shape it routes by, a model no instance
# lists): one D's vLLM judges it, so the client gets vLLM's own answer (its 4xx, or the
# answer where vLLM accepts what the proxy could not read).
LOCAL_VERDICT = "local_verdict"


class DecodeFailed(Exception):
    """D failed before anything reached the client: the request may go to another D, or
    to D alone. Raised for D's 5xx (or a stream's server error event before any generated
    content), a refused, reset or dropped connection, a connect timeout and an invalid
    response; not for D's 4xx (its verdict on the request, the same on any D), an answer
    over max_response_bytes (as large anywhere) nor a D silent for decode_ttfb_timeout
    (the deadline is spent): those are ProxyErrors, relayed."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(error.message)
        self.error = error


class _PrefillRefused(ProxyError):
    """P's 4xx (its verdict on the prefill request): one D judges the client's own request,
    since vLLM answers some refusals as a 200 stream with an error event, and P saw a
    request cut down to one token."""


class _PrefillExhausted(Exception):
    """Every P attempt failed to reach or finish; `error` says how, `unreachable` whether
    no P could even be connected to (then D may prefill alone)."""

    def __init__(self, error: ProxyError, unreachable: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.unreachable = unreachable


@dataclass(slots=True)
class Call:
    """What every step of one request needs."""

    req: RouteRequest
    send: Send
    flight: Flight
    t0: float  # perf_counter() at arrival
    loop: asyncio.AbstractEventLoop  # the request's (given, not looked up: see proxy/deadline.py)
    t_decode: float = 0.0  # when D's part began: P answered, or D was asked alone
    # When the current disaggregated attempt's D answer became due (P answered): a rescue
    # gets what is left of that attempt's decode_ttfb_timeout, never a new one.
    decode_due: float | None = None
    went_local: bool = False  # D was asked alone: a rescue would be a second try of that
    # Sends what the client connection holds now (proxy/serving/corked.py); None: not corked.
    flush: Callable[[], None] | None = None


class Dispatcher:
    def __init__(
        self, cfg: ProxyConfig, selector: Selector, metrics: Metrics, upstream: Upstream
    ) -> None:
        self.cfg = cfg
        self.selector = selector
        self.metrics = metrics
        self.upstream = upstream
        self._phase = metrics.phase_children
        self._concurrent = cfg.dispatch == "concurrent"
        self._first_token = cfg.first_token == "prefill"
        # Off (default): clients see no instance address and a neutral request id.
        self._expose = cfg.expose_routing_headers
        self._relay = Relay(metrics, cfg.stream_idle_timeout, self._expose)

    async def run(self, call: Call) -> int:
        """Serve the request; returns the HTTP status sent."""
        req = call.req
        await self.selector.prepare(req)
        tried: list[Instance] = []
        last: ProxyError | None = None
        attempts = 0
        for attempt in range(self.cfg.decode_retries + 1):
            d = await self.selector.acquire("D", req, tried)
            if d is None:
                break
            attempts += 1
            if attempt:
                self.metrics.decode_retries.inc()
            call.flight.extra.clear()  # headers describe the attempt that answers
            try:
                try:
                    answer = await self._answer(call, d)
                except DecodeFailed as e:
                    tried.append(d)
                    last = e.error
                    log.warning(
                        "decode failed before first byte instance=%s attempt=%d error=%s",
                        d.http_address, attempt + 1, e,
                    )  # fmt: skip
                    continue
                return await self._serve(call, d, answer)
            finally:
                self.selector.release(d, req)
        if last is None:
            raise ProxyError(503, "no decode instance is available", "no_decode_instance")
        if call.went_local:
            raise last
        return await self._rescue(call, tried, last, attempts + 1)

    async def _serve(self, call: Call, d: Instance, answer: Answer) -> int:
        try:
            await self._relay(answer, d, call.send, call.flight)
        finally:
            # Unread (client left, error, timeout): closes the connection, D aborts.
            await answer.aclose()
        d.served += 1
        self._phase["decode"].observe(time.perf_counter() - call.t_decode)
        return answer.resp.status

    async def _rescue(self, call: Call, tried: list[Instance], failed: ProxyError,
                      attempt: int) -> int:  # fmt: skip
        """D alone, once, after every disaggregated attempt failed before D's first byte
        (typically D's 500 for a KV load that failed: vLLM's kv_load_failure_policy=fail).
        Nothing reached the client, so the request may be redone; a plain request id makes
        D prefill itself. If this fails too, the client gets `failed`, as without it."""
        req = call.req
        due = call.decode_due if call.decode_due is not None else time.perf_counter()
        deadline = due + self.cfg.decode_ttfb_timeout
        if deadline <= time.perf_counter():
            log.warning("decode rescue skipped attempt=%d reason=deadline_spent", attempt)
            raise failed
        saved = list(call.flight.extra)  # the failed attempt's id, which `failed` quotes
        try:
            async with asyncio.timeout(deadline - time.perf_counter()):
                # An untried D if any; else any D: the one that failed when it is the only
                # one (a failed KV load leaves D healthy), cooling-down ones last.
                d = await self.selector.acquire("D", req, tried)
                if d is None:
                    d = await self.selector.acquire("D", req)
        except (TimeoutError, ProxyError) as e:  # no slot in time, or shed (429)
            log.warning("decode rescue skipped attempt=%d reason=no_slot error=%s", attempt, e)
            raise failed from None
        if d is None:  # every D left meanwhile
            log.warning("decode rescue skipped attempt=%d reason=no_instance", attempt)
            raise failed
        log.warning(
            "decode rescue: D alone instance=%s attempt=%d failed_status=%d error=%s",
            d.http_address, attempt, failed.status, failed.message,
        )  # fmt: skip
        try:
            call.flight.extra.clear()
            if self._expose:
                call.flight.extra.append((b"x-xpyd-decode-instance", d.http_address.encode()))
            try:
                answer = await self._local(call, d, LOCAL_RESCUE, deadline - time.perf_counter())
            except (DecodeFailed, ProxyError) as e:
                log.warning(
                    "decode rescue failed instance=%s attempt=%d error=%s relaying_status=%d",
                    d.http_address, attempt, e, failed.status,
                )  # fmt: skip
                call.flight.extra[:] = saved
                raise failed from None
            return await self._serve(call, d, answer)
        finally:
            self.selector.release(d, req)

    # ------------------------------------------------------------------ one attempt

    def _path(self, req: RouteRequest, d: Instance) -> str:
        if req.verdict:
            return LOCAL_VERDICT
        if _wants_prompt_logprobs(req):
            return LOCAL_PROMPT_LOGPROBS
        if not self.selector.available("P", req.model):
            if not self.cfg.fallback_to_decode:
                raise ProxyError(503, "no prefill instance is available", "no_prefill_instance")
            return LOCAL_NO_PREFILL
        threshold = self.cfg.local_prefill_threshold
        if threshold > 0:
            if req.tokens < threshold:
                return LOCAL_SHORT
            left = self.selector.uncached_tokens("D", d, req)
            if left is not None and left < threshold:
                return LOCAL_CACHED
        return DISAGGREGATED

    async def _answer(self, call: Call, d: Instance) -> Answer:
        if self._expose:
            call.flight.extra.append((b"x-xpyd-decode-instance", d.http_address.encode()))
        path = self._path(call.req, d)
        if path == DISAGGREGATED:
            try:
                return await self._disaggregated(call, d)
            except _PrefillExhausted as e:
                if not (e.unreachable and self.cfg.fallback_to_decode):
                    raise e.error from None
                path = LOCAL_NO_PREFILL
            except _PrefillRefused as e:
                log.info("prefill refused the request status=%d: D judges the client's own", e.status)
                call.flight.extra.clear()  # the headers describe the answer the client gets
                if self._expose:
                    call.flight.extra.append((b"x-xpyd-decode-instance", d.http_address.encode()))
                path = LOCAL_VERDICT
        return await self._local(call, d, path)

    async def _local(self, call: Call, d: Instance, path: str,
                     limit: float | None = None) -> Answer:  # fmt: skip
        """D prefills the prompt itself: a plain request id, so its connector loads nothing."""
        call.went_local = True
        self.metrics.dispatch(path)
        rid = request_id.build_local()
        call.flight.extra.append((b"x-request-id", self._client_id(rid)))
        call.flight.extra.append((b"x-xpyd-path", path.encode()))
        headers = {**call.req.headers, "x-request-id": rid}
        t = time.perf_counter()
        answer = await self._first_bytes(call.loop, d, self._open(call.req, d, headers), headers, limit)
        self._observe_ttfb(call, t)
        return answer

    async def _disaggregated(self, call: Call, d: Instance) -> Answer:
        cfg = self.cfg
        req = call.req
        limits = d.output_limits
        first_mode = self._first_token and first_token.eligible(req, limits, d.generation)
        # P's one token is the whole answer: a plain request id, so P ships no KV that D would
        # never claim (it would hold D's receive buffer until buffer_ttl_s).
        alone = first_mode and first_token.max_tokens(req.body, req.path == CHAT, limits) == 1
        try:
            skip = self.selector.decode_holds(d, req) if cfg.send_only_missing else 0
            pre_raw = orjson.dumps(first_token.prefill_request(req.path, req.body, skip) if first_mode
                                   else prefill_body(req.path, req.body, skip))
        except orjson.JSONEncodeError:
            # orjson reads nesting up to 1024 levels but writes only up to 254.
            raise ProxyError(400, "request body is nested too deeply", "invalid_body") from None
        call.decode_due = None
        tried: list[Instance] = []
        slow: list[Instance] = []  # timed out: never worth a second try
        failures: list[str] = []  # UpstreamError kinds and "timeout", per attempt
        last_msg = ""
        for attempt in range(cfg.prefill_retries + 1):
            # Prefer a P not tried yet; one that merely refused may be tried again (transient).
            p = (await self.selector.acquire("P", req, tried)
                 or await self.selector.acquire("P", req, slow))  # fmt: skip
            if p is None:
                break
            rid = request_id.build_local() if alone else request_id.build(p.zmq_address, d.zmq_address)
            headers = {**req.headers, "x-request-id": rid}
            t_start = time.perf_counter()
            if attempt == 0:
                self._phase["queue"].observe(t_start - call.t0)
                call.flight.extra.append((b"x-xpyd-queue-ms", ms(t_start - call.t0)))
            else:
                self.metrics.prefill_retries.inc()
            try:
                opening, pre_answer = await self._prefill_then_open(call.loop, p, d, pre_raw, headers, req,
                                                                    concurrent_ok=not first_mode)
            except (UpstreamError, TimeoutError) as e:
                tried.append(p)
                kind = e.kind if isinstance(e, UpstreamError) else "timeout"
                if kind == "timeout":
                    slow.append(p)
                    last_msg = f"timed out after {cfg.prefill_timeout}s"
                else:
                    last_msg = str(e)
                failures.append(kind)
                self._prefill_failed(p, kind, attempt, last_msg)
                if kind != "timeout":
                    last_msg = upstream_text(kind, last_msg, self._expose)
                continue
            except ProxyError:  # P's (or D's) own answer, relayed: say who gave it
                self._prefill_done(call, p, rid, t_start)
                raise
            t_pre = self._prefill_done(call, p, rid, t_start)
            call.decode_due = t_pre
            p.served += 1
            self.metrics.dispatch(PREFILL_ALONE if alone else DISAGGREGATED)
            call.flight.extra.append((b"x-xpyd-path", _PREFILL_ALONE_PATH if alone else _DISAGGREGATED_PATH))
            first = first_token.parse(pre_answer, req.path == CHAT) if first_mode else None
            if first is not None and limits is not None and first_token.starts_answer(req.body, first, limits):
                return self._first_token_answer(call, d, first, headers)
            if first_mode:
                # P's answer cannot start the client's (its token is part of a character, or the
                # answer is not what vLLM writes): D answers the client's own request.
                self.metrics.first_token_to_d("unusable" if first is None else "held_back")
            try:
                answer = await self._first_bytes(
                    call.loop, d, opening if opening is not None else self._open(req, d, headers), headers
                )
            except BaseException:
                await _discard(opening)
                raise
            self._observe_ttfb(call, t_pre)
            return answer
        raise _PrefillExhausted(_prefill_error(failures, last_msg), _unreachable(failures))

    async def _prefill_then_open(self, loop: asyncio.AbstractEventLoop, p: Instance, d: Instance, pre_raw: bytes,
                                 headers: dict[str, str], req: RouteRequest, concurrent_ok: bool = True
                                 ) -> tuple[asyncio.Task[Answer] | None, bytes]:  # fmt: skip
        """Run P's prefill and return its answer; with concurrent dispatch, D's request goes
        out at the same time (D parses, tokenizes and schedules while P prefills; its
        connector waits for the KV under its own deadline) and the still-running D task is
        returned with it.

        P's failure aborts D's request at once; D's failure before P is done aborts P's.
        D is asked early only while P has nothing else to do: behind a queue on P, D would
        hold the prompt's KV blocks and its load deadline (kv_load_timeout_s) would run
        for the whole wait, for a saving of a few ms."""
        try:
            if not (self._concurrent and concurrent_ok and _idle(p)):
                return None, await self._prefill(loop, p, req.path, pre_raw, headers)
            opening = loop.create_task(self._open(req, d, headers))
            prefill = loop.create_task(self._prefill(loop, p, req.path, pre_raw, headers))
            try:
                await asyncio.wait((prefill, opening), return_when=asyncio.FIRST_COMPLETED)
                if opening.done() and opening.exception() is not None and not prefill.done():
                    await _discard(prefill)
                    raise opening.exception()  # type: ignore[misc]
                data = await prefill
            except BaseException:
                await _discard(prefill)
                await _discard(opening)
                raise
            return opening, data
        finally:
            self.selector.release(p, req)

    # ------------------------------------------------------------------ first token from P

    def _first_token_answer(self, call: Call, d: Instance, first: first_token.FirstToken,
                            headers: dict[str, str]) -> Answer:  # fmt: skip
        """P's token goes to the client now; D's continuation is opened when the relay
        asks for what follows it (proxy/dispatch/first_token.py)."""
        body = call.req.body
        usage = first_token.usage_wanted(body)
        rewrite = None if self._expose else IdRewrite(headers["x-request-id"])
        call.flight.extra.append((b"x-xpyd-first-token", b"prefill"))
        call.t_decode = time.perf_counter()
        limits = d.output_limits
        assert limits is not None  # first_token.eligible
        if first_token.complete_at_prefill(body, first, limits):  # D has nothing to add
            return Answer(_Stitched(complete=True), first_token.first_events(first, True, usage), True, None,
                          rewrite)
        stitched = _Stitched()
        # D's events get the id the client sees: the rewrite then finds nothing left to do.
        event_id = first.id if rewrite is None else rewrite.whole(first.id.encode()).decode()
        events = first_token.ContinuationEvents(first_token.text_offset_after(first), event_id, first.chat,
                                                first.created)
        cont = first_token.continuation(body, first, limits)
        stitched.gen = self._continue(call, d, cont, headers, stitched, events)
        return Answer(stitched, first_token.first_events(first, False, usage), True, stitched.gen, rewrite)

    async def _continue(self, call: Call, d: Instance, cont: dict, headers: dict[str, str], stitched: _Stitched,
                        events: first_token.ContinuationEvents) -> AsyncGenerator[bytes, None]:  # fmt: skip
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
                opening = self._open(req, d, headers, orjson.dumps(cont), COMPLETIONS)
                answer = await self._first_bytes(call.loop, d, opening, headers)
            except ProxyError as e:
                raise StreamFailed(sse_event_of(e), e.message) from None
            except DecodeFailed as e:
                rescuer = await self._continuation_rescuer(call, d)
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

    def _continuation_left(self, call: Call) -> float:
        """Seconds left of D's first-byte deadline for the continuation, from P's token."""
        return call.t_decode + self.cfg.decode_ttfb_timeout - time.perf_counter()

    async def _continuation_rescuer(self, call: Call, d: Instance) -> Instance | None:
        """Another D for the continuation, taken (the caller releases it), or None: there is
        none, or none had room before the continuation's deadline."""
        left = self._continuation_left(call)
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
        left = self._continuation_left(call)
        if left > 0:
            plain = {**call.req.headers, "x-request-id": request_id.build_local()}
            alone = orjson.dumps(first_token.alone(cont))
            try:
                opening = self._open(call.req, d, plain, alone, COMPLETIONS)
                return await self._first_bytes(call.loop, d, opening, plain, left)
            except (DecodeFailed, ProxyError) as e:
                log.warning("decode continuation alone failed instance=%s error=%s; ending the stream with: %s",
                            d.http_address, e, failed.message)
        else:
            log.warning("decode continuation alone skipped instance=%s reason=deadline_spent; ending the stream "
                        "with: %s", d.http_address, failed.message)
        raise StreamFailed(sse_event_of(failed), failed.message)

    def _prefill_done(self, call: Call, p: Instance, rid: str, t_start: float) -> float:
        t_pre = time.perf_counter()
        extra = call.flight.extra
        extra.append((b"x-request-id", self._client_id(rid)))
        if self._expose:
            extra.append((b"x-xpyd-prefill-instance", p.http_address.encode()))
        extra.append((b"x-xpyd-prefill-ms", ms(t_pre - t_start)))
        self._phase["prefill"].observe(t_pre - t_start)
        return t_pre

    def _client_id(self, rid: str) -> bytes:
        """The request id the client is told (x-request-id, and inside vLLM's answer)."""
        return (rid if self._expose else neutral_id(rid)).encode()

    def _upstream_error(self, status: int, data: bytes, phase: str, inst: Instance,
                        headers: dict[str, str]) -> bytes:  # fmt: skip
        """An instance's error answer as relayed: without exposure no address, and the
        internal request id (vLLM may quote it) replaced by the neutral one."""
        body = upstream_error_body(status, data, phase, inst.http_address if self._expose else None)
        if self._expose:
            return body
        return IdRewrite(headers["x-request-id"]).whole(body)

    def _prefill_failed(self, p: Instance, kind: str, attempt: int, message: str) -> None:
        self.metrics.upstream_error("P", p.http_address, kind)
        if kind in ("connect", "connect_timeout"):
            p.cooldown_until = time.monotonic() + self.cfg.failure_cooldown
        log.warning(
            "prefill failed instance=%s kind=%s attempt=%d error=%s",
            p.http_address, kind, attempt + 1, message,
        )  # fmt: skip

    def _observe_ttfb(self, call: Call, since: float) -> None:
        call.t_decode = since
        t_first = time.perf_counter()
        self._phase["decode_ttfb"].observe(t_first - since)
        call.flight.extra.append((b"x-xpyd-decode-ttfb-ms", ms(t_first - since)))

    # ------------------------------------------------------------------ upstream calls

    async def _prefill(self, loop: asyncio.AbstractEventLoop, p: Instance, path: str, body: bytes,
                       headers: dict[str, str]) -> bytes:  # fmt: skip
        """P computes the prompt's KV (and ships it, per the connector's send mode); its
        answer (one token) is returned."""
        async with Deadline.after(loop, self.cfg.prefill_timeout):
            resp = await self.upstream.request("POST", p.url + path, body, headers)
            try:
                data = await resp.read()
            except UpstreamError as e:
                if e.kind == "too_large":  # as large from any P: not retried
                    self.metrics.upstream_error("P", p.http_address, e.kind)
                    raise _too_large("prefill", p, e) from None
                raise
            finally:
                await resp.aclose()
        if not 200 <= resp.status < 300:
            # P refused the request: its verdict on the request (400, 404, 422) goes to D for
            # the client's own; anything else (credentials, overload, failure) is relayed and
            # D is not asked.
            self.metrics.upstream_error("P", p.http_address, f"http_{resp.status}")
            refused = _PrefillRefused if resp.status in (400, 404, 422) else ProxyError
            raise refused(
                resp.status,
                "prefill failed",
                raw=self._upstream_error(resp.status, data, "prefill", p, headers),
            )
        return data

    async def _first_bytes(self, loop: asyncio.AbstractEventLoop, d: Instance, opening: Awaitable[Answer],
                           headers: dict[str, str], limit: float | None = None
                           ) -> Answer:  # fmt: skip
        """D's first bytes, under the deadline that starts when D's answer is due (a
        rescue: what is left of it), and the verdict on them: D failed before its first
        byte (DecodeFailed: retried, then rescued) or the answer may be relayed."""
        if limit is None:
            limit = self.cfg.decode_ttfb_timeout
        until = loop.time() + limit
        try:
            async with Deadline(loop, until):
                answer = await opening
        except TimeoutError:
            self.metrics.upstream_error("D", d.http_address, "timeout")
            log.warning("decode sent nothing instance=%s for=%.1fs", d.http_address, limit)
            where = instance_text("decode", d.http_address, self._expose)
            raise ProxyError(504, f"{where} sent nothing for {limit}s", "decode_timeout") from None
        if not answer.streaming:  # _open judged the status
            return answer
        # A stream's 200 says nothing yet: vLLM reports a failure before the first token
        # (a failed KV load) as an error event. Hold the lead until it says something.
        try:
            error = await read_lead(answer, until)
        except UpstreamError as e:  # D broke off before any content: as in _open
            await answer.aclose()
            raise self._broke(d, e) from None
        except BaseException:
            await answer.aclose()
            raise
        if error is None:
            return answer
        await answer.aclose()
        raise self._refused(d, error.status, error.body, headers, "its stream's error event")

    def _refused(self, d: Instance, status: int, data: bytes, headers: dict[str, str],
                 how: str = "its answer") -> ProxyError | DecodeFailed:  # fmt: skip
        """D's error answer (an HTTP error, or a stream's error event) before anything was
        relayed: 5xx is D's failure (another D, or D alone, may serve the request); 4xx is
        D's verdict on the request, the same on any D: relayed."""
        self.metrics.upstream_error("D", d.http_address, f"http_{status}")
        # The message is for the log; the client gets D's own error (raw).
        raw = self._upstream_error(status, data, "decode", d, headers)
        error = ProxyError(status, f"decode failed: HTTP {status} in {how}", raw=raw)
        return DecodeFailed(error) if status >= 500 else error

    def _broke(self, d: Instance, e: UpstreamError) -> ProxyError | DecodeFailed:
        """D's connection failed before anything was relayed."""
        self.metrics.upstream_error("D", d.http_address, e.kind)
        if e.kind == "too_large":  # as large from any D: not retried
            return _too_large("decode", d, e)
        if e.kind == "connect":
            d.cooldown_until = time.monotonic() + self.cfg.failure_cooldown
        status, code = (504, "decode_timeout") if e.kind == "connect_timeout" else (
            502, "decode_unreachable")  # fmt: skip
        where = instance_text("decode", d.http_address, self._expose)
        detail = upstream_text(e.kind, str(e), self._expose)
        return DecodeFailed(ProxyError(status, f"{where} failed before answering: {detail}", code))

    async def _open(self, req: RouteRequest, d: Instance, headers: dict[str, str],
                    body: bytes | None = None, path: str | None = None) -> Answer:  # fmt: skip
        """Send the client's request (or `body`, to `path`) to D and wait for the first bytes
        of its answer."""
        resp = None
        try:
            resp = await self.upstream.request("POST", d.url + (path or req.path), req.raw if body is None else body,
                                               headers)
            if not 200 <= resp.status < 300:
                raise self._refused(d, resp.status, await resp.read(), headers)
            rewrite = None if self._expose else IdRewrite(headers["x-request-id"])
            if resp.content_type.startswith("text/event-stream"):
                chunks = resp.chunks()
                return Answer(resp, await anext(chunks, b""), True, chunks, rewrite)
            return Answer(resp, await resp.read(), False, None, rewrite)
        except UpstreamError as e:
            raise self._broke(d, e) from None
        except BaseException:
            if resp is not None:
                await resp.aclose()
            raise


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


def _idle(p: Instance) -> bool:
    """P has no request but this one from this proxy, and its last heartbeat (from any
    proxy's traffic) reported none waiting."""
    return p.in_flight <= 1 and (p.load is None or p.load.waiting == 0)


async def _discard(task: asyncio.Task | None) -> None:
    """Abandon an upstream call: cancel it if still running, close its answer if it has
    one. Closing D's connection makes vLLM abort the request (and its connector stop
    waiting for the KV)."""
    if task is None:
        return
    if not task.done():
        task.cancel()
        try:
            await task
        except BaseException:
            pass
        return
    if task.cancelled() or task.exception() is not None:
        return
    result = task.result()
    if isinstance(result, Answer):
        await result.aclose()


def _too_large(phase: str, inst: Instance, e: UpstreamError) -> ProxyError:
    """An answer over max_response_bytes: a 502 naming no instance (the log and metrics do)."""
    log.warning("answer too large phase=%s instance=%s error=%s", phase, inst.http_address, e)
    return ProxyError(502, f"{phase} instance's {e}, over the proxy's max_response_bytes",
                      "upstream_response_too_large")  # fmt: skip


def _unreachable(failures: list[str]) -> bool:
    return not failures or all(k in ("connect", "connect_timeout") for k in failures)


def _prefill_error(failures: list[str], last_msg: str) -> ProxyError:
    if not failures:
        return ProxyError(503, "no prefill instance is available", "no_prefill_instance")
    if failures[-1] in ("timeout", "connect_timeout"):
        return ProxyError(
            504, f"prefill failed on {len(failures)} attempt(s), last: {last_msg}", "prefill_timeout"
        )
    return ProxyError(
        502,
        f"no prefill instance could be reached after {len(failures)} attempt(s), last: {last_msg}",
        "prefill_unreachable",
    )


def _wants_prompt_logprobs(req: RouteRequest) -> bool:
    """The answer carries the prompt's logprobs, which vLLM computes in the prefill (a
    completion's echo with logprobs, or prompt_logprobs on either endpoint), or no new token
    at all (echo with max_tokens 0: the prompt scored, nothing to decode)."""
    body = req.body
    if body.get("prompt_logprobs") is not None:
        return True
    return req.path == COMPLETIONS and body.get("echo") is True and (
        body.get("logprobs") is not None or body.get("max_tokens") == 0)

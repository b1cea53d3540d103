"""The disaggregated path: P prefills the prompt (and ships its KV, per the connector's send
mode), D decodes from it. P unreachable or timed out: another P (bounded by prefill_retries).
With the first token from P (continuation.py), P's token may start the client's answer, or be
all of it (prefill_alone: one token asked for, so P ships no KV)."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from proxy.asgi import ms
from proxy.config import ProxyConfig
from proxy.deadline import Deadline
from proxy.dispatch import first_token
from proxy.dispatch.call import DISAGGREGATED, PREFILL_ALONE, Call
from proxy.dispatch.continuation import Continuation
from proxy.dispatch.decode import Decode, too_large
from proxy.dispatch.relay import Answer
from proxy.dispatch.rewrite import (DetailsRewrite, IdRewrite, LateDetails, UsageRewrite, prefill_cache_usage,
                                    prefill_details)
from proxy.errors import ProxyError, upstream_text
from proxy.metrics import Metrics
from proxy.openai_api import CHAT, prefill_body
from proxy.registry import Instance
from proxy.request import RouteRequest
from proxy.routing.selection import Selector
from proxy.upstream.base import Upstream, UpstreamError
from xpyd_wire import request_id
from xpyd_wire.headers import XPYD_PATH_RAW, XPYD_PREFILL_INSTANCE_RAW, XPYD_PREFILL_MS_RAW, XPYD_QUEUE_MS_RAW

log = logging.getLogger("xpyd.proxy.dispatch")

_DISAGGREGATED_PATH = DISAGGREGATED.encode()
_PREFILL_ALONE_PATH = PREFILL_ALONE.encode()


class PrefillRefused(ProxyError):
    """P's 4xx (its verdict on the prefill request): one D judges the client's own request,
    since vLLM answers some refusals as a 200 stream with an error event, and P saw a
    request cut down to one token."""


class PrefillExhausted(Exception):
    """Every P attempt failed to reach or finish; `error` says how, `unreachable` whether
    no P could even be connected to (then D may prefill alone)."""

    def __init__(self, error: ProxyError, unreachable: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.unreachable = unreachable


class Disaggregated:
    def __init__(self, cfg: ProxyConfig, selector: Selector, metrics: Metrics, upstream: Upstream, decode: Decode,
                 continuation: Continuation) -> None:  # fmt: skip
        self.cfg = cfg
        self.selector = selector
        self.metrics = metrics
        self.upstream = upstream
        self.decode = decode
        self.continuation = continuation
        self._phase = metrics.phase_children
        self._concurrent = cfg.dispatch == "concurrent"
        self._max_early = cfg.decode_max_early or None
        self._first_token = cfg.first_token == "prefill"
        self._expose = cfg.expose_routing_headers
        self._later: set[asyncio.Task[bytes]] = set()  # P's calls that outlived their request's dispatch

    async def answer(self, call: Call, d: Instance) -> Answer:
        """P prefills (another P on failure), D decodes from P's KV; the D answer opened."""
        cfg = self.cfg
        req = call.req
        limits = d.output_limits
        eligible = self._first_token and first_token.eligible(req, limits, d.generation)
        # P's one token is the whole answer: a plain request id, so P ships no KV that D would
        # never claim (it would hold D's receive buffer until buffer_ttl_s).
        alone = eligible and first_token.max_tokens(req.body, req.path == CHAT, limits) == 1
        # P's token starts the client's answer with sequential dispatch (or is all of it). With
        # concurrent dispatch D computes the first token, asked with P (its request overlapping
        # P's prefill) or, once it holds decode_max_early waiting, after P's answer: P's token
        # handed on would put D's admission and first step into the client's first gap between
        # tokens, where under load they set the ITL tail (docs/performance.md, issue 49).
        p_token = eligible and (alone or not self._concurrent)
        try:
            skip = self.selector.decode_holds(d, req) if cfg.send_only_missing else 0
            pre_raw = orjson.dumps(first_token.prefill_request(req.path, req.body, skip) if p_token
                                   else prefill_body(req.path, req.body, skip))  # fmt: skip
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
            if call.trace is not None:
                call.trace.instance("P", p.http_address)
            # D is asked at once unless it holds decode_max_early requests waiting for their
            # prefill already; then it is asked once P answered.
            room = self._concurrent and (self._max_early is None or _early_held(d) < self._max_early)
            if self._concurrent and not room and not p_token:  # the bound made D wait for P's answer
                self.metrics.decode_early_full.labels(d.http_address).inc()
            early = room and not p_token  # D asked with P (the id says so to D's connector)
            rid = request_id.build_local() if alone else request_id.build(p.zmq_address, d.zmq_address, early=early)
            body = pre_raw
            if req.response_id is not None:  # the transfer rides in P's body (openai_api.prefill_body)
                body = orjson.dumps(prefill_body(req.path, req.body, skip, rid))
            headers = {**req.headers, "x-request-id": rid}
            t_start = time.perf_counter()
            if attempt == 0:
                self._phase["queue"].observe(t_start - call.t0)
                call.flight.extra.append((XPYD_QUEUE_MS_RAW, ms(t_start - call.t0)))
            else:
                self.metrics.prefill_retries.inc()
            try:
                pre_answer, lead = await self._prefill_then_open(call, p, d, body, headers, early, t_start)
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
                if call.trace is not None:
                    call.trace.failed("P", p.http_address, kind)
                if kind != "timeout":
                    last_msg = upstream_text(kind, last_msg, self._expose)
                continue
            except ProxyError:  # P's (or D's) own answer, relayed: say who gave it
                self._prefill_done(call, p, t_start)
                raise
            self.metrics.dispatch(PREFILL_ALONE if alone else DISAGGREGATED)
            call.flight.extra.append((XPYD_PATH_RAW, _PREFILL_ALONE_PATH if alone else _DISAGGREGATED_PATH))
            if pre_answer is None:  # D's first token came before P's answer: relayed now
                assert lead is not None
                if eligible:
                    self._first_to_d(call, "concurrent")
                call.t_decode = time.perf_counter()
                return lead.result()
            t_pre = self._prefill_done(call, p, t_start)
            call.decode_due = t_pre
            p.served += 1
            first = first_token.parse(pre_answer, req.path == CHAT) if p_token else None
            if first is not None and limits is not None and first_token.starts_answer(req.body, first, limits):
                return self.continuation.answer(call, d, first, headers)
            if eligible:
                # D computes the first token (concurrent dispatch), or P's answer cannot start the
                # client's (its token is part of a character, or the answer is not what vLLM
                # writes): D answers the client's own request.
                self._first_to_d(call, "concurrent" if not p_token else "unusable" if first is None else "held_back")
            if lead is None:
                answer = await self.decode.first_bytes(call.loop, d, self.decode.open(req, d, headers), headers,
                                                       client=req.client_id)  # fmt: skip
            else:
                answer = await self._lead_after_prefill(call.loop, d, lead)
            self.decode.observe_ttfb(call, t_pre)
            if req.response_id is not None and (usage := prefill_cache_usage(pre_answer)) is not None:
                answer.rewrite = UsageRewrite(*usage)  # P's cache figures, not D's (rewrite.py)
                call.cache_usage = usage
            elif (figures := prefill_details(pre_answer)) is not None and isinstance(answer.rewrite, IdRewrite | None):
                answer.rewrite = DetailsRewrite(figures, answer.rewrite)  # likewise (--enable-prompt-tokens-details)
            return answer
        raise PrefillExhausted(_prefill_error(failures, last_msg), _unreachable(failures))

    async def _prefill_then_open(self, call: Call, p: Instance, d: Instance, pre_raw: bytes,
                                 headers: dict[str, str], early: bool, t_start: float
                                 ) -> tuple[bytes | None, asyncio.Task[Answer] | None]:  # fmt: skip
        """Run P's prefill; ``early`` (concurrent dispatch, D computes the first token), D's
        request goes out at the same time (D parses, tokenizes and queues it while P prefills).
        Returns P's answer and, when D was asked with P, the task that waits for D's first
        bytes (still running, or done).

        D's connector gives the request KV-cache blocks, and starts its load deadline, only
        once P began sending (connector/p2p/scheduler.py): a P that is queued or slow costs D
        nothing but a waiting entry (at most decode_max_early: _early_held). P's failure aborts
        D's request at once; D's failure before P is done aborts P's.

        D's first token may come before P's answer (P's HTTP answer trails its forward pass,
        and D stepped on the KV it already has): a stream is then relayed at once, not held
        until P answers, and P's answer is None; P's call goes on to its end (its deadline)
        on its own (_prefill_later). Before, the client's first two tokens left together."""
        loop = call.loop
        req = call.req
        later = False  # P's call outlives this one: it releases P itself
        try:
            if not early:
                return await self._prefill(loop, p, req, pre_raw, headers), None
            lead = loop.create_task(self._lead(loop, d, req, headers))
            prefill = loop.create_task(self._prefill(loop, p, req, pre_raw, headers))
            d.early += 1
            try:
                await asyncio.wait((prefill, lead), return_when=asyncio.FIRST_COMPLETED)
                if lead.done() and not prefill.done():
                    if lead.exception() is not None:
                        await _discard(prefill)
                        raise lead.exception()  # type: ignore[misc]
                    answer = lead.result()
                    if _relay_before_prefill(req, answer):
                        answer.rewrite = LateDetails(prefill, answer.rewrite)  # type: ignore[arg-type]
                        self._prefill_later(call, p, prefill, t_start)
                        later = True
                        return None, lead
                data = await prefill
            except BaseException:
                await _discard(prefill)
                await _discard(lead)
                raise
            finally:
                d.early -= 1
            return data, lead
        finally:
            if not later:
                self.selector.release(p, req)

    async def _lead(self, loop: asyncio.AbstractEventLoop, d: Instance, req: RouteRequest,
                    headers: dict[str, str]) -> Answer:  # fmt: skip
        """D's request, asked with P's, up to its first generated bytes (Decode.first_bytes).
        Its deadline is P's and D's together: once P answered, D has decode_ttfb_timeout from
        then (_lead_after_prefill)."""
        opening = loop.create_task(self.decode.open(req, d, headers))
        try:
            return await self.decode.first_bytes(loop, d, opening, headers,
                                                 self.cfg.prefill_timeout + self.cfg.decode_ttfb_timeout,
                                                 req.client_id)  # fmt: skip
        except BaseException:
            await _discard(opening)
            raise

    async def _lead_after_prefill(self, loop: asyncio.AbstractEventLoop, d: Instance,
                                  lead: asyncio.Task[Answer]) -> Answer:  # fmt: skip
        """D's first bytes, asked with P, once P answered: due within decode_ttfb_timeout."""
        limit = self.cfg.decode_ttfb_timeout
        try:
            done, _ = await asyncio.wait((lead,), timeout=limit)
        except BaseException:
            await _discard(lead)
            raise
        if not done:
            await _discard(lead)
            raise self.decode.silent(d, limit)
        return lead.result()

    def _prefill_later(self, call: Call, p: Instance, prefill: asyncio.Task[bytes], t_start: float) -> None:
        """P's call, still running after D's stream went to the client: held here until it ends
        (its own deadline bounds it), then counted as a prefill, P released."""
        self._later.add(prefill)
        req = call.req

        def ended(task: asyncio.Task[bytes]) -> None:
            self._later.discard(task)
            self.selector.release(p, req)
            if task.cancelled():
                return
            e = task.exception()
            if e is None:
                self._phase["prefill"].observe(time.perf_counter() - t_start)
                p.served += 1
            elif isinstance(e, UpstreamError | TimeoutError):
                kind = e.kind if isinstance(e, UpstreamError) else "timeout"
                self._prefill_failed(p, kind, 0, str(e) or kind)
            # else P's HTTP error, counted in _prefill; D's answer (already relayed) stands

        prefill.add_done_callback(ended)

    async def settle(self, timeout: float) -> None:
        """At shutdown: P's calls that outlived their request end (each within its own
        deadline, all within ``timeout``) before the upstream client closes under them."""
        if self._later:
            await asyncio.wait(set(self._later), timeout=timeout)

    def _first_to_d(self, call: Call, why: str) -> None:
        """Why D, not P, gives the first token (a request eligible for P's)."""
        self.metrics.first_token_to_d(why)
        if call.trace is not None:
            call.trace.note("first_token_to_decode", why)

    async def _prefill(self, loop: asyncio.AbstractEventLoop, p: Instance, req: RouteRequest, body: bytes,
                       headers: dict[str, str]) -> bytes:  # fmt: skip
        """P computes the prompt's KV (and ships it, per the connector's send mode); its
        answer (one token) is returned."""
        async with Deadline.after(loop, self.cfg.prefill_timeout):
            resp = await self.upstream.request("POST", p.url + req.path, body, headers)
            try:
                data = await resp.read()
            except UpstreamError as e:
                if e.kind == "too_large":  # as large from any P: not retried
                    self.metrics.upstream_error("P", p.http_address, e.kind)
                    raise too_large("prefill", p, e) from None
                raise
            finally:
                await resp.aclose()
        if not 200 <= resp.status < 300:
            # P refused the request: its verdict on the request (400, 404, 422) goes to D for
            # the client's own; anything else (credentials, overload, failure) is relayed and
            # D is not asked.
            self.metrics.upstream_error("P", p.http_address, f"http_{resp.status}")
            refused = PrefillRefused if resp.status in (400, 404, 422) else ProxyError
            raise refused(
                resp.status,
                "prefill failed",
                raw=self.decode.upstream_error(resp.status, data, "prefill", p, headers, req.client_id),
            )
        return data

    def _prefill_done(self, call: Call, p: Instance, t_start: float) -> float:
        t_pre = time.perf_counter()
        extra = call.flight.extra
        if self._expose:
            extra.append((XPYD_PREFILL_INSTANCE_RAW, p.http_address.encode()))
        extra.append((XPYD_PREFILL_MS_RAW, ms(t_pre - t_start)))
        self._phase["prefill"].observe(t_pre - t_start)
        return t_pre

    def _prefill_failed(self, p: Instance, kind: str, attempt: int, message: str) -> None:
        self.metrics.upstream_error("P", p.http_address, kind)
        if kind in ("connect", "connect_timeout"):
            p.cooldown_until = time.monotonic() + self.cfg.failure_cooldown
        log.warning(
            "prefill failed instance=%s kind=%s attempt=%d error=%s",
            p.http_address, kind, attempt + 1, message,
        )  # fmt: skip


def _relay_before_prefill(req: RouteRequest, answer: Answer) -> bool:
    """Whether D's answer may go out before P's: a stream whose usage P's figures amend only
    in completions' and chat's way (LateDetails). A Responses stream (UsageRewrite) and a
    whole body (all of it generated: P's answer is due any moment) wait for P."""
    return answer.streaming and req.response_id is None and isinstance(answer.rewrite, IdRewrite | None)


def _early_held(d: Instance) -> int:
    """Requests D holds for their prefill: this proxy's own count, or what D's last heartbeat
    reported (every proxy's, a heartbeat old) when that is more."""
    reported = d.load.waiting_for_kv if d.load is not None else 0
    return d.early if d.early >= reported else reported


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

"""One request's journey: choose D, prefill on a P (or let D prefill alone), open D's answer.

The paths live one per module (proxy/dispatch/call.py lists them); this one runs them.

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

import logging
import time

from proxy.config import ProxyConfig
from proxy.dispatch.call import DISAGGREGATED, LOCAL_NO_PREFILL, LOCAL_STORED, LOCAL_VERDICT, Call, DecodeFailed
from proxy.dispatch.continuation import Continuation
from proxy.dispatch.decode import Decode
from proxy.dispatch.disaggregated import Disaggregated, PrefillExhausted, PrefillRefused
from proxy.dispatch.local import Local, choose_path
from proxy.dispatch.relay import Answer, Relay
from proxy.dispatch.rescue import Rescue
from proxy.dispatch.stored import StoredResponses
from proxy.errors import ProxyError
from proxy.metrics import Metrics
from proxy.registry import Instance
from proxy.routing.selection import Selector
from proxy.upstream.base import Upstream
from xpyd_wire.headers import XPYD_DECODE_INSTANCE_RAW

log = logging.getLogger("xpyd.proxy.dispatch")


class Dispatcher:
    def __init__(
        self, cfg: ProxyConfig, selector: Selector, metrics: Metrics, upstream: Upstream
    ) -> None:
        self.cfg = cfg
        self.selector = selector
        self.metrics = metrics
        self.upstream = upstream
        self._phase = metrics.phase_children
        # Off (default): clients see no instance address and a neutral request id.
        self._expose = cfg.expose_routing_headers
        self._relay = Relay(metrics, cfg.stream_idle_timeout, self._expose)
        self.decode = decode = Decode(cfg, metrics, upstream)
        self._local = Local(metrics, decode)
        self._disaggregated = Disaggregated(cfg, selector, metrics, upstream, decode,
                                            Continuation(cfg, selector, metrics, decode))
        self._rescue = Rescue(cfg, selector, self._local, self._serve)
        self.stored = StoredResponses(cfg, selector.registry, metrics, upstream)

    async def run(self, call: Call) -> int:
        """Serve the request; returns the HTTP status sent."""
        req = call.req
        if req.previous_response_id is not None:
            return await self._follow_up(call)
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
            if call.trace is not None:
                call.trace.instance("D", d.http_address)
            call.flight.extra.clear()  # headers describe the attempt that answers
            try:
                try:
                    answer = await self._answer(call, d)
                except DecodeFailed as e:
                    tried.append(d)
                    last = e.error
                    if call.trace is not None:
                        call.trace.failed("D", d.http_address, e.error.message)
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
        return await self._rescue.run(call, tried, last, attempts + 1)

    async def settle(self, timeout: float) -> None:
        """At shutdown, after the last client's answer: work a request left running ends."""
        await self._disaggregated.settle(timeout)

    async def _follow_up(self, call: Call) -> int:
        """A response that follows a stored one: the D storing it renders the conversation
        (P cannot), alone. No D stores it: any D, whose vLLM answers its own 404."""
        req = call.req
        assert req.previous_response_id is not None
        d = await self.stored.locate(req.previous_response_id, req.headers)
        if d is not None:
            self.selector.take(d, req)
        else:
            d = await self.selector.acquire("D", req)
            if d is None:
                raise ProxyError(503, "no decode instance is available", "no_decode_instance")
        if self._expose:
            call.flight.extra.append((XPYD_DECODE_INSTANCE_RAW, d.http_address.encode()))
        if call.trace is not None:
            call.trace.instance("D", d.http_address, LOCAL_STORED)
        try:
            try:
                answer = await self._local.answer(call, d, LOCAL_STORED)
            except DecodeFailed as e:  # no other D has the conversation
                raise e.error from None
            return await self._serve(call, d, answer)
        finally:
            self.selector.release(d, req)

    async def _serve(self, call: Call, d: Instance, answer: Answer) -> int:
        req = call.req
        if req.response_id is not None and 200 <= answer.resp.status < 300 and req.body.get("store", True):
            # vLLM stores it there (if its store is on), and a background one from now on.
            self.stored.record(req.response_id, d, call.cache_usage)
        relaying = d.relaying
        relaying.add(call.flight)
        try:
            await self._relay(answer, d, call.send, call.flight)
        finally:
            relaying.discard(call.flight)
            # Unread (client left, error, timeout): closes the connection, D aborts.
            await answer.aclose()
        d.served += 1
        self._phase["decode"].observe(time.perf_counter() - call.t_decode)
        return answer.resp.status

    async def _answer(self, call: Call, d: Instance) -> Answer:
        if self._expose:
            call.flight.extra.append((XPYD_DECODE_INSTANCE_RAW, d.http_address.encode()))
        path = choose_path(self.cfg, self.selector, call.req, d)
        if path == DISAGGREGATED:
            try:
                return await self._disaggregated.answer(call, d)
            except PrefillExhausted as e:
                if not (e.unreachable and self.cfg.fallback_to_decode):
                    raise e.error from None
                path = LOCAL_NO_PREFILL
            except PrefillRefused as e:
                log.info("prefill refused the request status=%d: D judges the client's own", e.status)
                call.flight.extra.clear()  # the headers describe the answer the client gets
                if self._expose:
                    call.flight.extra.append((XPYD_DECODE_INSTANCE_RAW, d.http_address.encode()))
                path = LOCAL_VERDICT
        return await self._local.answer(call, d, path)

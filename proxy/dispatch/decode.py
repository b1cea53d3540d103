"""What every path does with D: send it the request, wait for its first bytes under the
first-byte deadline, judge them, and shape an instance's error as the client gets it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

from proxy.asgi import ms
from proxy.config import ProxyConfig
from proxy.deadline import Deadline
from proxy.dispatch.call import Call, DecodeFailed
from proxy.dispatch.relay import Answer, read_lead
from proxy.dispatch.rewrite import IdRewrite, NeutralIds
from proxy.errors import ProxyError, instance_text, upstream_error_body, upstream_text
from proxy.metrics import Metrics
from proxy.registry import Instance
from proxy.request import RouteRequest
from proxy.upstream.base import Upstream, UpstreamError
from xpyd_wire.headers import XPYD_DECODE_TTFB_MS_RAW

log = logging.getLogger("xpyd.proxy.dispatch")


class Decode:
    def __init__(self, cfg: ProxyConfig, metrics: Metrics, upstream: Upstream) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.upstream = upstream
        self._phase = metrics.phase_children
        # Off (default): clients see no instance address and a neutral request id.
        self.expose = cfg.expose_routing_headers
        self.ids = NeutralIds()

    def rewrite(self, headers: dict[str, str], client: str | None) -> IdRewrite | None:
        """The internal request id in ``headers`` as the client is to see it (rewrite.py):
        its own id (``client``), else the neutral one; None: exposed as it is."""
        return None if self.expose else self.ids.rewrite(headers["x-request-id"], client)

    def upstream_error(self, status: int, data: bytes, phase: str, inst: Instance,
                       headers: dict[str, str], client: str | None = None) -> bytes:  # fmt: skip
        """An instance's error answer as relayed: without exposure no address, and the
        internal request id (vLLM may quote it) replaced by the one the client is shown."""
        body = upstream_error_body(status, data, phase, inst.http_address if self.expose else None)
        if self.expose:
            return body
        return self.ids.rewrite(headers["x-request-id"], client).whole(body)

    def observe_ttfb(self, call: Call, since: float) -> None:
        call.t_decode = since
        t_first = time.perf_counter()
        self._phase["decode_ttfb"].observe(t_first - since)
        call.flight.extra.append((XPYD_DECODE_TTFB_MS_RAW, ms(t_first - since)))

    async def first_bytes(self, loop: asyncio.AbstractEventLoop, d: Instance, opening: Awaitable[Answer],
                          headers: dict[str, str], limit: float | None = None, client: str | None = None
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
            raise self.silent(d, limit) from None
        if not answer.streaming:  # open() judged the status
            return answer
        # A stream's 200 says nothing yet: vLLM reports a failure before the first token
        # (a failed KV load) as an error event. Hold the lead until it says something.
        try:
            error = await read_lead(answer, until)
        except UpstreamError as e:  # D broke off before any content: as in open()
            await answer.aclose()
            raise self.broke(d, e) from None
        except BaseException:
            await answer.aclose()
            raise
        if error is None:
            return answer
        await answer.aclose()
        raise self.refused(d, error.status, error.body, headers, "its stream's error event", client)

    def silent(self, d: Instance, limit: float) -> ProxyError:
        """D sent nothing within its first-byte deadline (`limit` seconds): counted, logged, a 504."""
        self.metrics.upstream_error("D", d.http_address, "timeout")
        log.warning("decode sent nothing instance=%s for=%.1fs", d.http_address, limit)
        where = instance_text("decode", d.http_address, self.expose)
        return ProxyError(504, f"{where} sent nothing for {limit}s", "decode_timeout")

    def refused(self, d: Instance, status: int, data: bytes, headers: dict[str, str],
                how: str = "its answer", client: str | None = None) -> ProxyError | DecodeFailed:  # fmt: skip
        """D's error answer (an HTTP error, or a stream's error event) before anything was
        relayed: 5xx is D's failure (another D, or D alone, may serve the request); 4xx is
        D's verdict on the request, the same on any D: relayed."""
        self.metrics.upstream_error("D", d.http_address, f"http_{status}")
        # The message is for the log; the client gets D's own error (raw).
        raw = self.upstream_error(status, data, "decode", d, headers, client)
        error = ProxyError(status, f"decode failed: HTTP {status} in {how}", raw=raw)
        return DecodeFailed(error) if status >= 500 else error

    def broke(self, d: Instance, e: UpstreamError) -> ProxyError | DecodeFailed:
        """D's connection failed before anything was relayed."""
        self.metrics.upstream_error("D", d.http_address, e.kind)
        if e.kind == "too_large":  # as large from any D: not retried
            return too_large("decode", d, e)
        if e.kind == "connect":
            d.cooldown_until = time.monotonic() + self.cfg.failure_cooldown
        status, code = (504, "decode_timeout") if e.kind == "connect_timeout" else (
            502, "decode_unreachable")  # fmt: skip
        where = instance_text("decode", d.http_address, self.expose)
        detail = upstream_text(e.kind, str(e), self.expose)
        return DecodeFailed(ProxyError(status, f"{where} failed before answering: {detail}", code))

    async def open(self, req: RouteRequest, d: Instance, headers: dict[str, str],
                   body: bytes | None = None, path: str | None = None) -> Answer:  # fmt: skip
        """Send the client's request (or `body`, to `path`) to D and wait for the first bytes
        of its answer."""
        resp = None
        try:
            raw = req.raw_for(headers["x-request-id"]) if body is None else body
            resp = await self.upstream.request("POST", d.url + (path or req.path), raw, headers)
            if not 200 <= resp.status < 300:
                raise self.refused(d, resp.status, await resp.read(), headers, client=req.client_id)
            rewrite = self.rewrite(headers, req.client_id)
            if resp.content_type.startswith("text/event-stream"):
                chunks = resp.chunks()
                return Answer(resp, await anext(chunks, b""), True, chunks, rewrite)
            return Answer(resp, await resp.read(), False, None, rewrite)
        except UpstreamError as e:
            raise self.broke(d, e) from None
        except BaseException:
            if resp is not None:
                await resp.aclose()
            raise


def too_large(phase: str, inst: Instance, e: UpstreamError) -> ProxyError:
    """An answer over max_response_bytes: a 502 naming no instance (the log and metrics do)."""
    log.warning("answer too large phase=%s instance=%s error=%s", phase, inst.http_address, e)
    return ProxyError(502, f"{phase} instance's {e}, over the proxy's max_response_bytes",
                      "upstream_response_too_large")  # fmt: skip

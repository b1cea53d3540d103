"""Two-phase request handling: prefill on a P instance, then relay a D instance's answer.

The two completion routes are raw ASGI callables rather than FastAPI endpoints: they are
the hot path, and raw ASGI needs no Request/StreamingResponse objects nor the task group
StreamingResponse starts per request. app.fast_path() also lets them skip Starlette's
routing and middleware, measured at ~30% less proxy CPU per request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from connector import request_id
from proxy.config import ProxyConfig
from proxy.errors import ProxyError, sse_error_event, upstream_error_body
from proxy.metrics import Metrics
from proxy.policies import estimate_prompt_tokens, make_policy
from proxy.registry import Instance, Registry
from proxy.upstream import Upstream, UpstreamError, UpstreamResponse

log = logging.getLogger("xpyd.proxy.routing")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# Never forwarded upstream: hop-by-hop headers, ones the client library recomputes, the
# client's request id (ours replaces it) and Accept-Encoding (we relay bytes verbatim).
DROP_REQUEST_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"content-type",
        b"expect",
        b"x-request-id",
        b"accept-encoding",
    }
)
JSON_CT = b"application/json"


class ClientGone(Exception):
    """The client disconnected before its request was read."""


@dataclass(slots=True)
class _Flight:
    """Per-request state shared with the disconnect watcher."""

    task: asyncio.Task | None
    # Response headers to add: request id, timings, chosen instances.
    extra: list[tuple[bytes, bytes]]
    started: bool = False  # response headers sent: errors can only go in-band now
    # Set before the last send: from then on uvicorn's receive() returns http.disconnect
    # because the response is complete, which must not read as the client leaving.
    done: bool = False
    disconnected: bool = False


def _ms(seconds: float) -> bytes:
    return b"%.2f" % (seconds * 1000.0)


def validate_body(kind: str, body: Any) -> None:
    """Check what the proxy itself relies on; vLLM validates everything else."""
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", "invalid_body")
    if kind == COMPLETIONS:
        prompt = body.get("prompt")
        if prompt is None:
            if body.get("prompt_embeds") is None:
                raise ProxyError(400, "'prompt' is required", "missing_field", "prompt")
        elif not _valid_prompt(prompt):
            raise ProxyError(
                400,
                "'prompt' must be a string, a list of strings, a list of token ids "
                "or a list of lists of token ids, and not empty",
                "invalid_field",
                "prompt",
            )
    else:
        messages = body.get("messages")
        if messages is None:
            raise ProxyError(400, "'messages' is required", "missing_field", "messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise ProxyError(
                400, "'messages' must be a non-empty list of objects", "invalid_field", "messages"
            )
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (type(value) is not int or value <= 0):
            raise ProxyError(400, f"'{key}' must be a positive integer", "invalid_field", key)
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        raise ProxyError(400, "'stream' must be a boolean", "invalid_field", "stream")


_INT = frozenset({int})


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    first = prompt[0]
    if isinstance(first, str):
        return all(isinstance(p, str) for p in prompt)
    if type(first) is int:
        return set(map(type, prompt)) == _INT  # C-speed check of long token-id lists
    if isinstance(first, list):
        return all(isinstance(p, list) and p and set(map(type, p)) == _INT for p in prompt)
    return False


def prefill_body(kind: str, body: dict) -> dict:
    """The client's request, cut down to produce the KV cache and one token."""
    pre = dict(body)
    pre["max_tokens"] = 1
    if kind == CHAT:
        pre["max_completion_tokens"] = 1
    pre["stream"] = False
    pre.pop("stream_options", None)
    # vLLM rejects min_tokens > max_tokens; prefill only needs one token anyway.
    if pre.get("min_tokens"):
        pre.pop("min_tokens")
    # The n samples of a prompt share its KV: P computes the prompt once, D fans out.
    pre.pop("n", None)
    pre.pop("best_of", None)
    # P's one sampled token is discarded. A seed also gives the request its own
    # generator, which vLLM 0.32's CPU build crashes on under chunked prefill
    # ("CPU Generator does not use offset"); the KV does not depend on it.
    pre.pop("seed", None)
    return pre


def make_request_id(prefill: Instance, decode: Instance) -> str:
    # The connector parses this exact shape to learn where the KV cache goes.
    return request_id.build(prefill.zmq_address, decode.zmq_address)


class _Endpoint:
    """A raw ASGI app for one route. An object, not a function: Starlette wraps plain
    functions as request/response endpoints but mounts other callables as ASGI apps."""

    __slots__ = ("router", "path")

    def __init__(self, router: Router, path: str) -> None:
        self.router = router
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.router.handle(self.path, scope, receive, send)


class Router:
    def __init__(
        self,
        cfg: ProxyConfig,
        registry: Registry,
        metrics: Metrics,
        upstream: Upstream,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.upstream = upstream
        self.prefill_policy = make_policy(cfg.prefill_policy)
        self.decode_policy = make_policy(cfg.decode_policy)
        self._api_key = ("Bearer " + cfg.api_key).encode() if cfg.api_key else None
        self._phase = metrics.phase_children

    # ------------------------------------------------------------------ entry points

    def endpoint(self, path: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        return _Endpoint(self, path)

    def check_auth(self, headers: list[tuple[bytes, bytes]]) -> None:
        if self._api_key is None:
            return
        for k, v in headers:
            if k == b"authorization":
                if hmac.compare_digest(v, self._api_key):
                    return
                break
        raise ProxyError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            "invalid_api_key",
            headers={"www-authenticate": "Bearer"},
        )

    async def handle(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        flight = _Flight(asyncio.current_task(), [])
        watcher: asyncio.Task | None = None
        status = 500
        try:
            headers = scope["headers"]
            self.check_auth(headers)
            fwd: dict[str, str] = {"content-type": "application/json"}
            length: bytes | None = None
            for k, v in headers:
                if k not in DROP_REQUEST_HEADERS:
                    fwd[k.decode("latin-1")] = v.decode("latin-1")
                elif k == b"content-length":
                    length = v
            raw = await self._read_body(receive, length)
            try:
                # orjson: 4-8x faster than json here, which matters for long prompts.
                body = orjson.loads(raw)
            except ValueError as e:
                raise ProxyError(
                    400, f"request body is not valid JSON: {e}", "invalid_json"
                ) from None
            validate_body(path, body)
            tokens = estimate_prompt_tokens(body)

            # From here on the request waits on upstreams: watch for the client leaving.
            watcher = asyncio.get_running_loop().create_task(self._watch(receive, flight))
            status = await self._two_phase(path, raw, body, tokens, fwd, send, flight, t0)
        except ProxyError as e:
            status = e.status
            if not flight.started:
                flight.done = True
                await self._send_error(send, e, flight.extra)
        except asyncio.CancelledError:
            if not flight.disconnected:
                raise
            # Our watcher cancelled us: the client left. Upstream requests were closed by
            # the unwinding `finally` blocks, so vLLM aborts them.
            asyncio.current_task().uncancel()
            status = 499
            self.metrics.disconnects.inc()
            log.info("client disconnected path=%s", path)
        except ClientGone:
            status = 499
            self.metrics.disconnects.inc()
        except Exception as e:  # a bug: still answer JSON, never an HTML 500
            log.exception("unexpected error path=%s: %s", path, e)
            status = 500
            if not flight.started:
                flight.done = True
                err = ProxyError(500, f"internal proxy error: {type(e).__name__}", "internal_error")
                await self._send_error(send, err, flight.extra)
        finally:
            flight.done = True
            if watcher is not None and not watcher.done():
                watcher.cancel()
            elapsed = time.perf_counter() - t0
            self.metrics.observe_request(path, status, elapsed)
            if log.isEnabledFor(logging.DEBUG):
                timing = " ".join(
                    f"{k.decode()[7:] if k.startswith(b'x-xpyd-') else k.decode()}={v.decode()}"
                    for k, v in flight.extra
                )
                log.debug(
                    "request path=%s status=%d ms=%.2f %s", path, status, elapsed * 1e3, timing
                )

    async def _watch(self, receive: Receive, flight: _Flight) -> None:
        # After the body, uvicorn's receive() returns only when the client disconnects or the
        # response is complete; only the former must cancel the request.
        try:
            message = await receive()
        except Exception:
            return
        if message.get("type") == "http.disconnect" and not flight.done:
            flight.disconnected = True
            if flight.task is not None:
                flight.task.cancel()

    async def _read_body(self, receive: Receive, length: bytes | None) -> bytes:
        limit = self.cfg.max_body_bytes
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise ProxyError(400, "invalid Content-Length", "invalid_body") from None
            if declared > limit:
                raise ProxyError(413, f"request body exceeds {limit} bytes", "request_too_large")
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone()
        body = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise ProxyError(413, f"request body exceeds {limit} bytes", "request_too_large")
            return body
        parts = [body]
        total = len(body)
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise ClientGone()
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise ProxyError(413, f"request body exceeds {limit} bytes", "request_too_large")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _send_error(
        self, send: Send, err: ProxyError, extra: list[tuple[bytes, bytes]]
    ) -> None:
        payload = err.raw if err.raw is not None else err.body()
        hdrs = [(b"content-type", JSON_CT), (b"content-length", b"%d" % len(payload))]
        hdrs.extend(extra)
        for k, v in err.headers.items():
            hdrs.append((k.encode("latin-1"), v.encode("latin-1")))
        await send({"type": "http.response.start", "status": err.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    # ------------------------------------------------------------------ selection

    def _candidates(self, role: str, exclude: list[Instance]) -> list[Instance]:
        live = self.registry.live(role)
        if not live:
            return live
        now = time.monotonic()
        ok = [i for i in live if i.cooldown_until <= now and i not in exclude]
        if ok:
            return ok
        # Everything is cooling down or already tried: better a doubtful instance than none.
        return [i for i in live if i not in exclude]

    # ------------------------------------------------------------------ the two phases

    async def _two_phase(
        self,
        path: str,
        raw: bytes,
        body: dict,
        tokens: int,
        fwd: dict[str, str],
        send: Send,
        flight: _Flight,
        t0: float,
    ) -> int:
        if self.registry.count("P") == 0:
            raise ProxyError(503, "no prefill instance is available", "no_prefill_instance")
        decoders = self._candidates("D", [])
        if not decoders:
            raise ProxyError(503, "no decode instance is available", "no_decode_instance")
        d = self.decode_policy.choose(decoders, tokens)
        d.in_flight += 1
        d.in_flight_tokens += tokens
        extra = flight.extra
        extra.append((b"x-xpyd-decode-instance", d.http_address.encode()))
        try:
            pre_raw = orjson.dumps(prefill_body(path, body))
            request_id, t_pre = await self._prefill(path, pre_raw, tokens, fwd, d, extra, t0)
            return await self._decode(path, raw, fwd, d, request_id, send, flight, t_pre)
        finally:
            d.in_flight -= 1
            d.in_flight_tokens -= tokens

    async def _prefill(
        self,
        path: str,
        pre_raw: bytes,
        tokens: int,
        fwd: dict[str, str],
        d: Instance,
        extra: list[tuple[bytes, bytes]],
        t0: float,
    ) -> tuple[str, float]:
        cfg = self.cfg
        tried: list[Instance] = []
        slow: list[Instance] = []  # timed out: never worth a second try
        last_kind = ""
        last_msg = ""
        for attempt in range(cfg.prefill_retries + 1):
            # Prefer a P not tried yet; one that merely refused may be tried again (transient).
            candidates = self._candidates("P", tried) or self._candidates("P", slow)
            if not candidates:
                break
            p = self.prefill_policy.choose(candidates, tokens)
            request_id = make_request_id(p, d)
            fwd["x-request-id"] = request_id
            t_start = time.perf_counter()
            if attempt == 0:
                self._phase["queue"].observe(t_start - t0)
                extra.append((b"x-xpyd-queue-ms", _ms(t_start - t0)))
            else:
                self.metrics.prefill_retries.inc()
            p.in_flight += 1
            p.in_flight_tokens += tokens
            try:
                async with asyncio.timeout(cfg.prefill_timeout):
                    resp = await self.upstream.request("POST", p.url + path, pre_raw, fwd)
                    try:
                        data = await resp.read()
                    finally:
                        await resp.aclose()
            except UpstreamError as e:
                tried.append(p)
                last_kind, last_msg = e.kind, str(e)
                self.metrics.upstream_error("P", p.http_address, e.kind)
                if e.kind in ("connect", "connect_timeout"):
                    p.cooldown_until = time.monotonic() + cfg.failure_cooldown
                log.warning(
                    "prefill failed instance=%s kind=%s attempt=%d error=%s",
                    p.http_address, e.kind, attempt + 1, e,
                )  # fmt: skip
                continue
            except TimeoutError:
                tried.append(p)
                slow.append(p)
                last_kind, last_msg = "timeout", f"timed out after {cfg.prefill_timeout}s"
                self.metrics.upstream_error("P", p.http_address, "timeout")
                log.warning(
                    "prefill timed out instance=%s after=%.1fs attempt=%d",
                    p.http_address, cfg.prefill_timeout, attempt + 1,
                )  # fmt: skip
                continue
            finally:
                p.in_flight -= 1
                p.in_flight_tokens -= tokens
            t_end = time.perf_counter()
            extra.append((b"x-request-id", request_id.encode()))
            extra.append((b"x-xpyd-prefill-instance", p.http_address.encode()))
            extra.append((b"x-xpyd-prefill-ms", _ms(t_end - t_start)))
            self._phase["prefill"].observe(t_end - t_start)
            if 200 <= resp.status < 300:
                p.served += 1
                return request_id, t_end
            # P refused the request (bad input, overload...): relay that; D is never called.
            self.metrics.upstream_error("P", p.http_address, f"http_{resp.status}")
            raise ProxyError(
                resp.status,
                "prefill failed",
                raw=upstream_error_body(resp.status, data, "prefill", p.http_address),
            )
        if not tried:
            raise ProxyError(503, "no prefill instance is available", "no_prefill_instance")
        if last_kind in ("timeout", "connect_timeout"):
            raise ProxyError(
                504,
                f"prefill failed on {len(tried)} attempt(s), last: {last_msg}",
                "prefill_timeout",
            )
        raise ProxyError(
            502,
            f"no prefill instance could be reached after {len(tried)} attempt(s), last: {last_msg}",
            "prefill_unreachable",
        )

    async def _decode(
        self,
        path: str,
        raw: bytes,
        fwd: dict[str, str],
        d: Instance,
        request_id: str,
        send: Send,
        flight: _Flight,
        t_pre: float,
    ) -> int:
        cfg = self.cfg
        fwd["x-request-id"] = request_id
        resp = None
        try:
            try:
                async with asyncio.timeout(cfg.decode_ttfb_timeout):
                    resp = await self.upstream.request("POST", d.url + path, raw, fwd)
                    if not 200 <= resp.status < 300:
                        data = await resp.read()
                        self.metrics.upstream_error("D", d.http_address, f"http_{resp.status}")
                        raise ProxyError(
                            resp.status,
                            "decode failed",
                            raw=upstream_error_body(resp.status, data, "decode", d.http_address),
                        )
                    streaming = resp.content_type.startswith("text/event-stream")
                    if streaming:
                        chunks = resp.chunks()
                        first = await anext(chunks, b"")
                    else:
                        first = await resp.read()
            except UpstreamError as e:
                self.metrics.upstream_error("D", d.http_address, e.kind)
                if e.kind == "connect":
                    d.cooldown_until = time.monotonic() + cfg.failure_cooldown
                log.warning("decode failed instance=%s kind=%s error=%s", d.http_address, e.kind, e)
                code = "decode_timeout" if e.kind == "connect_timeout" else "decode_unreachable"
                raise ProxyError(
                    504 if e.kind == "connect_timeout" else 502,
                    f"decode instance {d.http_address} failed before answering: {e}",
                    code,
                ) from None
            except TimeoutError:
                self.metrics.upstream_error("D", d.http_address, "timeout")
                raise ProxyError(
                    504,
                    f"decode instance {d.http_address} sent nothing for {cfg.decode_ttfb_timeout}s",
                    "decode_timeout",
                ) from None
            t_first = time.perf_counter()
            self._phase["decode_ttfb"].observe(t_first - t_pre)
            flight.extra.append((b"x-xpyd-decode-ttfb-ms", _ms(t_first - t_pre)))
            hdrs = [(b"content-type", resp.content_type.encode("latin-1"))]
            if not streaming:
                hdrs.append((b"content-length", b"%d" % len(first)))
            hdrs.extend(flight.extra)
            status = resp.status
            flight.started = True
            await send({"type": "http.response.start", "status": status, "headers": hdrs})
            if not streaming:
                flight.done = True
                await send({"type": "http.response.body", "body": first, "more_body": False})
                d.served += 1
                self._phase["decode"].observe(time.perf_counter() - t_pre)
                return status
            if resp.at_eof():  # the whole stream arrived in one read: one write, not two
                flight.done = True
                await send({"type": "http.response.body", "body": first, "more_body": False})
            else:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                await self._relay(resp, chunks, send, d, flight)
            d.served += 1
            self._phase["decode"].observe(time.perf_counter() - t_pre)
            return status
        finally:
            if resp is not None:
                # Unread (client left, error, timeout): closes the connection, D aborts.
                await resp.aclose()

    async def _relay(
        self, resp: UpstreamResponse, chunks, send: Send, d: Instance, flight: _Flight
    ) -> None:
        """Relay D's stream as it arrives, then end the response; a failure of D ends it with
        an SSE error event (the status line is long gone)."""
        idle = self.cfg.stream_idle_timeout
        loop = asyncio.get_running_loop()
        tail = b""
        try:
            async with asyncio.timeout(idle) as deadline:
                async for chunk in chunks:
                    if resp.at_eof():  # last piece: send it with the end of the response
                        flight.done = True
                        await send(
                            {"type": "http.response.body", "body": chunk, "more_body": False}
                        )
                        return
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    deadline.reschedule(loop.time() + idle)
        except TimeoutError:
            self.metrics.upstream_error("D", d.http_address, "stream_idle_timeout")
            log.warning("decode stream idle instance=%s after=%.1fs", d.http_address, idle)
            tail = sse_error_event(
                f"decode instance {d.http_address} sent nothing for {idle}s", 504, "decode_timeout"
            )
        except UpstreamError as e:
            self.metrics.upstream_error("D", d.http_address, "midstream")
            log.warning("decode stream broke instance=%s error=%s", d.http_address, e)
            tail = sse_error_event(
                f"decode instance {d.http_address} failed mid-stream: {e}", 502, "decode_midstream"
            )
        flight.done = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})

"""The disaggregated routes (completions, chat, Responses, Messages, generate: api_routes.P_THEN_D):
authenticate, read and check the request, hand it to the dispatcher, and answer every failure
with OpenAI error JSON (never an HTML page, never silence)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

import orjson

from proxy.asgi import Bodies, ClientGone, Flight, Headers, Receive, Scope, Send, read_body, send_error
from proxy.asgi import watch_disconnect as _watch
from proxy.config import ProxyConfig
from proxy.credentials import forwards_client_auth, upstream_key_header
from proxy.dispatch.call import Call
from proxy.dispatch.dispatcher import Dispatcher
from proxy.errors import ProxyError
from proxy.metrics import Metrics
from proxy.openai_api import RESPONSES, client_request_id, estimate_prompt_tokens, response_id, validate_body
from proxy.registry import Registry
from proxy.request import RouteRequest
from proxy.routing.kv_events import KVEvents
from proxy.routing.selection import Selector
from proxy.serving.corked import FLUSH, WATCH
from proxy.serving.intake import cleaned, cleaned_unparsed, forwarded, upstream_headers
from proxy.tracing import RequestTrace, Tracing
from proxy.upstream.base import Upstream
from xpyd_wire.headers import XPYD_PREFIX_RAW

log = logging.getLogger("xpyd.proxy.routing")

def _client_header(headers: Headers) -> str | None:
    """The client's X-Request-Id, as vLLM reads it (the first one, latin-1)."""
    for k, v in headers:
        if k == b"x-request-id":
            return v.decode("latin-1")
    return None


def _header_name(k: bytes) -> str:
    """A timing header's name for the log: without the xpyd prefix."""
    return k.decode()[len(XPYD_PREFIX_RAW) :] if k.startswith(XPYD_PREFIX_RAW) else k.decode()


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
        events: KVEvents | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.cfg = cfg
        self._tracing = tracing  # None: no span, no cost (proxy/tracing.py)
        self.metrics = metrics
        self.selector = Selector(cfg, registry, metrics, events)
        self.dispatcher = Dispatcher(cfg, self.selector, metrics, upstream)
        self._api_key = ("Bearer " + cfg.api_key).encode() if cfg.api_key else None
        # The client's Authorization goes upstream only when asked for (--forward-client-auth)
        # and never over --upstream-api-key: see proxy/credentials.py.
        upstream_key = upstream_key_header(cfg)
        self._forwarded = forwarded(forwards_client_auth(cfg))  # what vLLM reads: proxy/serving/intake.py
        self._debug = cfg.forward_debug_params
        # What bodies may cost, together and each (proxy/asgi.py).
        self._bodies = Bodies(cfg.max_held_body_bytes, cfg.max_body_values, cfg.max_body_containers)
        metrics.watch_held_body_bytes(lambda: self._bodies.held)
        self._base_headers = {"content-type": "application/json"}
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once known
        if upstream_key is not None:
            self._base_headers["authorization"] = upstream_key

    @property
    def tracing(self) -> Tracing | None:
        """The proxy's tracer (None: tracing off), for the routes served beside this router."""
        return self._tracing

    def base_headers(self) -> dict[str, str]:
        """What every upstream request carries besides the client's headers (the upstream key)."""
        return {k: v for k, v in self._base_headers.items() if k != "content-type"}

    def forwarded(self) -> frozenset[bytes]:
        """The client headers that go upstream (proxy/serving/intake.py)."""
        return self._forwarded

    @property
    def bodies(self) -> Bodies:
        """The budget every request body is read within (proxy/asgi.py)."""
        return self._bodies

    def endpoint(self, path: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        return _Endpoint(self, path)

    def check_auth(self, headers: Headers) -> None:
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

    async def _read(self, path: str, scope: Scope, receive: Receive) -> RouteRequest:
        headers = scope["headers"]
        self.check_auth(headers)
        fwd, length = upstream_headers(headers, self._forwarded, self._base_headers)
        raw = await read_body(receive, length, self.cfg.max_body_bytes, self._bodies)
        try:
            # orjson: 4-8x faster than json here, which matters for long prompts.
            body = orjson.loads(raw)
            validate_body(path, body)
        except (ValueError, ProxyError):
            # vLLM's answer to it is vLLM's to give (its 400, or an answer where its parser
            # accepts what ours does not): the body goes to one D as it came (less the proxy's fields).
            return RouteRequest(path, cleaned_unparsed(raw, self._debug), {}, 0, fwd, verdict=True,
                                client_id=client_request_id(path, _client_header(headers), None))
        raw = cleaned(raw, body, self._debug)  # the proxy's kv_transfer_params are its own
        req = RouteRequest(path, raw, body, estimate_prompt_tokens(body, path), fwd, body.get("model"),
                           client_id=client_request_id(path, _client_header(headers), body))
        if path == RESPONSES:
            req.response_id = response_id(body)
            req.previous_response_id = body.get("previous_response_id")
        return req

    async def handle(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        # The loop found once: on Python 3.11 each lookup costs a getpid() system call.
        loop = self._loop
        if loop is None or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None  # the server runs each request in a task
        flight = Flight(task)
        watcher: asyncio.Task | None = None
        unwatch: Callable[[], None] | None = None
        status = 500
        trace: RequestTrace | None = None
        if self._tracing is not None:
            trace = self._tracing.start(path, scope["headers"])
        try:
            req = await self._read(path, scope, receive)
            if trace is not None:
                trace.begin(req.headers, req.model)
            if not req.verdict and not self.selector.check_model(req):
                req.verdict, req.model = True, None  # any D: its vLLM's 404 names what it serves
            # From here on the request waits on upstreams: watch for the client leaving.
            state = scope.get("state")
            watch = state.get(WATCH) if state else None
            if watch is not None:  # the proxy's own server: told by the connection
                unwatch = watch(flight.client_left)
            else:  # any other ASGI server: a task waits on receive()
                watcher = loop.create_task(_watch(receive, flight))
            status = await self.dispatcher.run(
                Call(req, send, flight, t0, loop, flush=state.get(FLUSH) if state else None, trace=trace)
            )
        except ProxyError as e:
            status = e.status
            if not flight.started:
                flight.done = True
                await send_error(send, e, flight.extra)
        except asyncio.CancelledError:
            if not flight.disconnected:
                raise
            # Our watcher cancelled us: the client left. Upstream requests were closed by
            # the unwinding `finally` blocks, so vLLM aborts them.
            task.uncancel()
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
                await send_error(send, err, flight.extra)
        finally:
            flight.done = True
            if unwatch is not None:
                unwatch()
            if watcher is not None and not watcher.done():
                watcher.cancel()
            elapsed = time.perf_counter() - t0
            self.metrics.observe_request(path, status, elapsed)
            if trace is not None:
                trace.end(status, flight.extra)
            if log.isEnabledFor(logging.DEBUG):
                timing = " ".join(f"{_header_name(k)}={v.decode()}" for k, v in flight.extra)
                log.debug("request path=%s status=%d ms=%.2f %s", path, status, elapsed * 1e3, timing)

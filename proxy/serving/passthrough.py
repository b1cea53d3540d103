"""The routes one instance answers as they came (proxy/api_routes.py: ONE_INSTANCE, ONE_DECODE,
STORED_RESPONSE), and vLLM's own 404 for the routes the proxy never forwards.

The request goes to one instance serving its model (the role the route's handling names) with
its method, path, query, body and content type unchanged (multipart audio included), and the
client's own X-Request-Id (vLLM names its answer after it, as without the proxy). The answer comes
back with vLLM's status and body: a stream as it arrives, anything else whole. An instance that
cannot be reached is replaced by another (nothing reached it); nothing else is retried.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from proxy.api_routes import ONE_DECODE, STORED_RESPONSE, ApiRoute
from proxy.asgi import JSON_CT, ClientGone, Receive, Scope, Send, read_body, send_error
from proxy.config import ProxyConfig
from proxy.deadline import Deadline
from proxy.dispatch.rewrite import UsageRewrite
from proxy.dispatch.stored import MAX_RESPONSE_ID
from proxy.errors import ProxyError, instance_text, sse_error_event, upstream_text
from proxy.metrics import Metrics
from proxy.registry import Instance
from proxy.request import RouteRequest
from proxy.serving.intake import upstream_headers
from proxy.serving.routes import Router
from proxy.tracing import RequestTrace
from proxy.upstream.base import Upstream, UpstreamError, UpstreamResponse

log = logging.getLogger("xpyd.proxy.passthrough")

NOT_FOUND = b'{"detail":"Not Found"}'  # FastAPI's, as vLLM answers a path it does not serve
# Beyond the headers vLLM reads (serving/intake.py), these routes pass the body's content type (JSON,
# multipart audio) and the client's own request id (vLLM names its answer after it).
_OWN_HEADERS = frozenset({b"content-type", b"x-request-id"})


class _NotFound:
    """vLLM's answer to a route it does not serve, for the routes the proxy never forwards,
    whatever the method. An object: Starlette would treat a function as a request handler."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", JSON_CT), (b"content-length", b"%d" % len(NOT_FOUND))]})
        await send({"type": "http.response.body", "body": NOT_FOUND, "more_body": False})


not_found = _NotFound()


class _Endpoint:
    __slots__ = ("owner", "route")

    def __init__(self, owner: Passthrough, route: ApiRoute) -> None:
        self.owner = owner
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.owner.handle(self.route, scope, receive, send)


class Passthrough:
    def __init__(self, cfg: ProxyConfig, router: Router, metrics: Metrics, upstream: Upstream) -> None:
        self.cfg = cfg
        self.selector = router.selector
        self.metrics = metrics
        self.upstream = upstream
        self.stored = router.dispatcher.stored
        self.check_auth = router.check_auth
        self._tracing = router.tracing  # None: no span, no cost
        self._bodies = router.bodies
        self._base = router.base_headers()
        self._allow = router.forwarded() | _OWN_HEADERS
        other = "D" if cfg.passthrough_role == "P" else "P"
        self._roles = {ONE_DECODE: ("D", "P"), STORED_RESPONSE: ("D",)}
        self._default_roles = (cfg.passthrough_role, other)

    def endpoint(self, route: ApiRoute) -> _Endpoint:
        return _Endpoint(self, route)

    async def handle(self, route: ApiRoute, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        status = 500
        started = False
        tracing = self._tracing
        trace = None if tracing is None else tracing.start(route.path, scope["headers"], scope["method"])
        try:
            self.check_auth(scope["headers"])
            headers, length = upstream_headers(scope["headers"], self._allow, self._base)
            get = scope["method"] == "GET"
            body = b"" if get else await read_body(receive, length, self.cfg.max_body_bytes, self._bodies)
            path = scope.get("raw_path") or scope["path"].encode()
            target = path.decode("latin-1") + (("?" + scope["query_string"].decode("latin-1"))
                                               if scope.get("query_string") else "")  # fmt: skip
            req = RouteRequest(route.path, body, {}, 0, headers, self._model(headers, body))
            if trace is not None:
                trace.begin(headers, req.model)
                trace.note("path", "passthrough")
            pinned = rewrite = None
            if route.handling == STORED_RESPONSE:
                response_id = scope["path"].split("/")[3]
                if len(response_id) <= MAX_RESPONSE_ID:
                    pinned = await self.stored.locate(response_id, headers)
                    usage = self.stored.usage(response_id)
                    rewrite = UsageRewrite(*usage) if usage is not None else None
            status, started = await self._forward(route, req, scope["method"], target, pinned, send, rewrite, trace)
        except ProxyError as e:
            status = e.status
            if not started:
                await send_error(send, e, [])
        except ClientGone:
            status = 499
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.metrics.observe_request(route.path, status, time.perf_counter() - t0)
            if trace is not None:
                trace.end(status, [], generated=False)

    def _model(self, headers: dict[str, str], body: bytes) -> str | None:
        """The body's model, where instances serve more than one (only then does it choose)."""
        if len(self.selector.registry.models()) <= 1 or not headers.get("content-type", "").startswith("application/json"):
            return None
        try:
            model = orjson.loads(body).get("model")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return model if isinstance(model, str) else None

    async def _forward(self, route: ApiRoute, req: RouteRequest, method: str, target: str, pinned: Instance | None,
                       send: Send, rewrite: UsageRewrite | None = None,
                       trace: RequestTrace | None = None) -> tuple[int, bool]:  # fmt: skip
        """Send the request to an instance, relay the answer; (status, whether anything was sent)."""
        roles = self._roles.get(route.handling, self._default_roles)
        tried: list[Instance] = []
        last: ProxyError | None = None
        for _ in range(self.cfg.decode_retries + 1):
            inst = pinned
            if inst is not None:
                self.selector.take(inst, req)
                pinned = None
            else:
                inst = await self._pick(roles, req, tried)
            if inst is None:
                break
            if trace is not None:
                trace.instance(inst.role, inst.http_address)
            try:
                try:
                    resp = await self._open(inst, method, target, req)
                except UpstreamError as e:
                    tried.append(inst)
                    last = self._failed(inst, e)
                    if trace is not None:
                        trace.failed(inst.role, inst.http_address, e.kind)
                    if e.kind in ("connect", "connect_timeout"):
                        continue  # nothing reached it: another may answer
                    raise last from None
                try:
                    return resp.status, await self._relay(inst, resp, send, rewrite)
                finally:
                    await resp.aclose()
            finally:
                self.selector.release(inst, req)
        if last is not None:
            raise last
        raise ProxyError(503, "no instance is available", "no_instance")

    async def _pick(self, roles: tuple[str, ...], req: RouteRequest, tried: list[Instance]) -> Instance | None:
        """An instance of the first role that has one serving the body's model; none serves it:
        any instance, whose vLLM answers its own 404 for the model."""
        for model in (req.model, None) if req.model is not None else (None,):
            req.model = model
            for role in roles:
                inst = await self.selector.acquire(role, req, tried)
                if inst is not None:
                    return inst
        return None

    async def _open(self, inst: Instance, method: str, target: str, req: RouteRequest) -> UpstreamResponse:
        loop = asyncio.get_running_loop()
        try:
            async with Deadline.after(loop, self.cfg.decode_ttfb_timeout):
                return await self.upstream.request(method, inst.url + target, req.raw or None, req.headers)
        except TimeoutError:
            raise UpstreamError("timeout", f"no answer within {self.cfg.decode_ttfb_timeout}s") from None

    def _failed(self, inst: Instance, e: UpstreamError) -> ProxyError:
        self.metrics.upstream_error(inst.role, inst.http_address, e.kind)
        log.warning("passthrough failed instance=%s kind=%s error=%s", inst.http_address, e.kind, e)
        where = instance_text("the", inst.http_address, self.cfg.expose_routing_headers)
        status, code = (504, "upstream_timeout") if e.kind in ("timeout", "connect_timeout") else (
            502, "upstream_unreachable")  # fmt: skip
        detail = upstream_text(e.kind, str(e), self.cfg.expose_routing_headers)
        return ProxyError(status, f"{where} failed: {detail}", code)

    async def _relay(self, inst: Instance, resp: UpstreamResponse, send: Send,
                     rewrite: UsageRewrite | None = None) -> bool:  # fmt: skip
        """The instance's answer as it came (a stored response: with the usage the client was
        first told, see dispatch/rewrite.py); True once the status line is sent."""
        hdrs = [(b"content-type", resp.content_type.encode("latin-1"))]
        if not resp.content_type.startswith("text/event-stream"):
            try:
                data = await resp.read()
            except UpstreamError as e:
                raise self._failed(inst, e) from None
            if rewrite is not None:
                data = rewrite.whole(data)
            hdrs.append((b"content-length", b"%d" % len(data)))
            await send({"type": "http.response.start", "status": resp.status, "headers": hdrs})
            await send({"type": "http.response.body", "body": data, "more_body": False})
            return True
        await send({"type": "http.response.start", "status": resp.status, "headers": hdrs})
        loop = asyncio.get_running_loop()
        idle = self.cfg.stream_idle_timeout
        try:
            async with Deadline.after(loop, idle) as deadline:
                async for chunk in resp.chunks():
                    if rewrite is not None:
                        chunk = rewrite.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    deadline.reschedule(loop.time() + idle)
            end = rewrite.flush() if rewrite is not None else b""
        except (UpstreamError, TimeoutError) as e:
            kind = e.kind if isinstance(e, UpstreamError) else "stream_idle_timeout"
            self.metrics.upstream_error(inst.role, inst.http_address, kind)
            log.warning("passthrough stream broke instance=%s kind=%s", inst.http_address, kind)
            # The status is sent: an error event says why the stream ends here.
            where = instance_text("the", inst.http_address, self.cfg.expose_routing_headers)
            end = b"\n\n" + sse_error_event(f"{where} stream broke off: {kind.replace('_', ' ')}", 502,
                                             "upstream_midstream")
        await send({"type": "http.response.body", "body": end, "more_body": False})
        return True

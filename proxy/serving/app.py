"""The FastAPI application: lifespan wiring, the small endpoints, JSON errors everywhere."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from proxy.asgi import Receive, Scope, Send
from proxy.config import ProxyConfig
from proxy.credentials import on_behalf_headers
from proxy.errors import ProxyError, error_dict, upstream_error_body, upstream_text
from proxy.membership.discovery import Discovery, DiscoveryLimits
from proxy.membership.probe import Prober
from proxy.metrics import Metrics
from proxy.api_routes import ADMIN, ONE_DECODE, ONE_INSTANCE, P_THEN_D, REFUSED, ROUTES, STORED_RESPONSE, ApiRoute
from proxy.registry import Instance, Registry
from proxy.routing.kv_events import EventsConfig, KVEvents
from proxy.serving.adapters import Adapters
from proxy.serving.passthrough import Passthrough, not_found
from proxy.serving.routes import Router
from proxy.tracing import Tracing
from proxy.upstream.base import Upstream, UpstreamError
from proxy.upstream.factory import make_upstream

log = logging.getLogger("xpyd.proxy")


class ProxyState:
    """Everything one proxy owns; hung on app.state.proxy (no module-level state)."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.registry = Registry(cfg.heartbeat_timeout, cfg.discovery_max_per_role,
                                 cfg.discovery_max_per_source)  # fmt: skip
        self.metrics = Metrics(self.registry)
        self.upstream: Upstream = make_upstream(cfg.upstream_client, cfg.connect_timeout, cfg.max_response_bytes)
        self.discovery = Discovery(
            self.registry,
            self.metrics,
            cfg.discovery_host,
            cfg.discovery_port,
            cfg.discovery_secret,
            DiscoveryLimits.of(cfg),
        )
        self.kv_events = KVEvents(self.registry, self.metrics, EventsConfig(
            default_cap=cfg.kv_index_max_blocks, silence_s=cfg.kv_events_silence))
        # --tracing: OpenTelemetry imported only now (proxy/tracing.py).
        self.tracing = Tracing() if cfg.tracing else None
        self.router = Router(cfg, self.registry, self.metrics, self.upstream, self.kv_events, self.tracing)
        self.passthrough = Passthrough(cfg, self.router, self.metrics, self.upstream)
        self.prober = Prober(cfg, self.registry, self.metrics, self.upstream)
        self.adapters = Adapters(cfg, self.registry, self.metrics, self.upstream, self.prober, self.label)
        # Subscribe as soon as an instance becomes a candidate, not at the next sweep.
        self.registry.listeners.append(lambda inst: self.kv_events.kick())
        self.draining = False
        # Keys the opaque instance labels of /instances: stable while this proxy runs, and
        # no way back to the address (a plain hash of host:port is quickly brute-forced).
        self._label_key = os.urandom(16)

    def instance_view(self, inst: Instance, now_wall: float) -> dict:
        """One /instances entry: everything, or without --expose-routing-headers a summary
        that names the instance only by an opaque label (no addresses)."""
        full = inst.to_json(now_wall)
        full["kv_events"] = self.kv_events.view(inst)
        if self.cfg.expose_routing_headers:
            return full
        label = self.label(inst)
        keep = ("role", "models", "healthy", "pending", "probe_error", "static", "in_flight",
                "in_flight_tokens", "early", "served", "cooling_down", "heartbeat_age_s", "load",
                "kv_transport_fallbacks", "kv_events", "output_limits")  # fmt: skip
        return {"label": label, **{k: full[k] for k in keep}}

    def label(self, inst: Instance) -> str:
        """How answers name an instance: its address with --expose-routing-headers, else
        its opaque /instances label."""
        if self.cfg.expose_routing_headers:
            return inst.http_address
        name = f"{inst.role}/{inst.http_address}".encode()
        return hashlib.blake2b(name, digest_size=6, key=self._label_key).hexdigest()

    async def start(self) -> None:
        await self.upstream.start()
        await self.prober.start()
        self.adapters.start()
        await self.discovery.start()
        await self.kv_events.start()

    async def stop(self) -> None:
        await self.kv_events.stop()
        await self.discovery.stop()
        await self.adapters.stop()
        await self.prober.stop()
        # P's calls still finishing after their stream went out: not cut off by the close.
        await self.router.dispatcher.settle(self.cfg.shutdown_grace_s)
        await self.upstream.close()
        self.router.selector.close()
        if self.tracing is not None:  # the spans still batched: exported, within the exporter's timeout
            await asyncio.to_thread(self.tracing.shutdown)


def _json_error(status: int, message: str, code: Any = None, headers=None) -> JSONResponse:
    return JSONResponse(error_dict(message, status, code), status_code=status, headers=headers)


def create_app(cfg: ProxyConfig) -> FastAPI:
    state = ProxyState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(
        title="xPyD proxy",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.proxy = state
    router = state.router

    # Every vLLM route the proxy forwards, from the table (proxy/api_routes.py). The hot ones
    # are raw ASGI apps (Starlette calls a non-function endpoint directly).
    for route in ROUTES:
        if route.handling == P_THEN_D:
            endpoint = router.endpoint(route.path)
        elif route.handling in (ONE_INSTANCE, ONE_DECODE, STORED_RESPONSE):
            endpoint = state.passthrough.endpoint(route)
        elif route.handling == REFUSED:
            endpoint = not_found
        elif route.handling == ADMIN:  # the LoRA admin fan-out (proxy/serving/adapters.py)
            endpoint = state.adapters.endpoint(route.path)
        else:  # the proxy's own (below)
            continue
        methods = None if route.handling == REFUSED else list(route.methods)  # refused: whatever the method
        app.router.routes.append(Route(route.path, endpoint, methods=methods))
    for path in cfg.passthrough_routes:  # the operator's: routes of a later vLLM (--passthrough-routes)
        extra = ApiRoute(path, ("GET", "POST"), ONE_INSTANCE, "--passthrough-routes")
        app.router.routes.append(Route(path, state.passthrough.endpoint(extra), methods=list(extra.methods)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code in (404, 405):  # a route or method it lacks: vLLM's (FastAPI's) own answer
            return JSONResponse({"detail": message}, status_code=exc.status_code, headers=exc.headers)
        return _json_error(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _json_error(400, str(exc.errors()), "invalid_request")

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> Response:
        return Response(
            exc.raw if exc.raw is not None else exc.body(),
            status_code=exc.status,
            media_type="application/json",
            headers=exc.headers or None,
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error path=%s", request.url.path)
        return _json_error(500, f"internal proxy error: {type(exc).__name__}", "internal_error")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # SageMaker's health check, answered as vLLM does
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        p, d = state.registry.count("P"), state.registry.count("D")
        body = {"ready": False, "prefill": p, "decode": d, "draining": state.draining}
        if state.draining:
            return JSONResponse(body, status_code=503)
        body["ready"] = p > 0 and d > 0
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if cfg.metrics_require_api_key:
            router.check_auth(request.scope["headers"])
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/instances")
    async def instances(request: Request) -> list:
        router.check_auth(request.scope["headers"])
        now = time.time()
        return [state.instance_view(inst, now) for inst in state.registry.every()]

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        router.check_auth(request.scope["headers"])
        live = state.registry.live("D") or state.registry.live("P")
        if not live:
            raise ProxyError(503, "no instance is available", "no_instance")
        # The union of every live instance's models (learned by the prober; ask the ones
        # not known yet now, under the probe deadline).
        await state.prober.learn_unknown()
        cards = state.registry.models()
        if cards:
            return Response(orjson.dumps({"object": "list", "data": list(cards.values())}),
                            media_type="application/json")  # fmt: skip
        # No instance told the proxy its models (e.g. they want a key the proxy lacks):
        # relay one instance's own answer, asked as a completion would be (credentials.py).
        headers = on_behalf_headers(cfg, request.headers.get("authorization"))
        expose = cfg.expose_routing_headers
        errors = []
        for inst in live[:3]:
            try:
                resp = await state.upstream.request("GET", inst.url + "/v1/models", None, headers)
                try:
                    data = await resp.read()
                finally:
                    await resp.aclose()
            except UpstreamError as e:
                state.metrics.upstream_error(inst.role, inst.http_address, e.kind)
                log.warning("/v1/models failed instance=%s error=%s", inst.http_address, e)
                where = inst.http_address if expose else inst.role
                errors.append(f"{where}: {upstream_text(e.kind, str(e), expose)}")
                continue
            if 200 <= resp.status < 300:
                return Response(data, status_code=resp.status, media_type="application/json")
            body = upstream_error_body(resp.status, data, "models",
                                       inst.http_address if expose else None)  # fmt: skip
            return Response(body, status_code=resp.status, media_type="application/json")
        raise ProxyError(
            502, "no instance answered /v1/models: " + "; ".join(errors), "upstream_error"
        )

    return app


def fast_path(app: FastAPI) -> Any:
    """Wrap the app so the disaggregated routes skip Starlette's middleware and routing.

    Every other request (and lifespan) still goes through FastAPI."""
    router: Router = app.state.proxy.router
    routes = {r.path: router.endpoint(r.path) for r in ROUTES if r.handling == P_THEN_D}

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = routes.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        await app(scope, receive, send)

    return request_id_headers(asgi) if app.state.proxy.cfg.enable_request_id_headers else asgi


def request_id_headers(app: Any) -> Any:
    """--enable-request-id-headers, as vLLM 0.32's XRequestIdMiddleware: every HTTP response
    gets an X-Request-Id, the client's own (the first one sent) or a random uuid4 hex, which
    is not the id in the answer (vLLM draws it apart)."""

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                rid = given if given is not None else uuid.uuid4().hex.encode()
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid)]}
            await send(message)

        await app(scope, receive, sending)

    return asgi

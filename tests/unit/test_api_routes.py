"""proxy/api_routes.py against vLLM 0.32's own routes and against the app: every route vLLM
declares is in the table, its admin and development routes are refused, each route is served
the way the table says, and each handling is the one this file spells out (so a one-line change
of the table fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from starlette.routing import Route

from proxy.api_routes import ADMIN, ONE_DECODE, ONE_INSTANCE, P_THEN_D, PROXY, REFUSED, ROUTES, STORED_RESPONSE
from proxy.config import ProxyConfig

# What each route must be, written out independently of the table (REFUSED: below, by where
# vLLM declares the route).
EXPECTED = {
    "/v1/completions": P_THEN_D, "/v1/chat/completions": P_THEN_D, "/v1/responses": P_THEN_D,
    "/v1/messages": P_THEN_D, "/inference/v1/generate": P_THEN_D,
    "/v1/responses/{response_id}": STORED_RESPONSE, "/v1/responses/{response_id}/cancel": STORED_RESPONSE,
    "/v1/chat/completions/batch": ONE_DECODE, "/v1/audio/transcriptions": ONE_DECODE,
    "/v1/audio/translations": ONE_DECODE, "/v1/systemone": ONE_DECODE, "/generative_scoring": ONE_DECODE,
    "/cohere/v2/chat": ONE_DECODE, "/invocations": ONE_DECODE,
    "/tokenize": ONE_INSTANCE, "/detokenize": ONE_INSTANCE, "/tokenizer_info": ONE_INSTANCE,
    "/v1/messages/count_tokens": ONE_INSTANCE, "/v1/completions/render": ONE_INSTANCE,
    "/v1/chat/completions/render": ONE_INSTANCE, "/v1/responses/render": ONE_INSTANCE,
    "/v1/messages/render": ONE_INSTANCE, "/v1/completions/derender": ONE_INSTANCE,
    "/v1/chat/completions/derender": ONE_INSTANCE, "/v1/embeddings": ONE_INSTANCE, "/v2/embed": ONE_INSTANCE,
    "/pooling": ONE_INSTANCE, "/classify": ONE_INSTANCE, "/score": ONE_INSTANCE, "/v1/score": ONE_INSTANCE,
    "/rerank": ONE_INSTANCE, "/v1/rerank": ONE_INSTANCE, "/v2/rerank": ONE_INSTANCE, "/version": ONE_INSTANCE,
    "/v1/load_lora_adapter": ADMIN, "/v1/unload_lora_adapter": ADMIN,
    "/health": PROXY, "/ping": PROXY, "/v1/models": PROXY, "/metrics": PROXY,
}  # fmt: skip

# vLLM's source folders whose routes change a server or reach its internals: never forwarded.
_REFUSED_SOURCES = ("serve/dev/", "rl/", "serve/profile/", "serve/elastic_ep/", "serve/fault_tolerance/")
_ROUTE = re.compile(r"(?:@router\.(?:get|post|put|delete|patch|api_route|websocket)|add_api_route)\(\s*\"(/[^\"]*)\"")


def vllm_routes() -> dict[str, str]:
    """Every route path vLLM's entry points declare -> the file (relative) declaring it."""
    vllm = pytest.importorskip("vllm", reason="needs vLLM's sources")
    base = Path(vllm.__file__).parent / "entrypoints"
    found: dict[str, str] = {}
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base).as_posix()
        if rel.startswith(("launchers/", "cli/")):  # other servers (the DP supervisor, preload)
            continue
        for m in _ROUTE.finditer(path.read_text()):
            found.setdefault(m.group(1), rel)
    return found


def table() -> dict[str, str]:
    return {r.path: r.handling for r in ROUTES}


def test_every_route_vllm_declares_is_in_the_table():
    declared = vllm_routes()
    assert len(declared) > 60  # the pattern still finds vLLM's routes
    missing = sorted(set(declared) - set(table()))
    assert not missing, f"vLLM routes the proxy does not know: {missing}"


def test_vllms_admin_development_and_internal_routes_are_refused():
    refused = {p for p, rel in vllm_routes().items() if rel.startswith(_REFUSED_SOURCES) or "abort" in p}
    assert len(refused) > 25
    wrong = {p: table()[p] for p in refused if table().get(p) != REFUSED}
    assert not wrong


def test_each_route_is_handled_as_specified():
    got = {p: h for p, h in table().items() if h != REFUSED}
    assert got == EXPECTED
    assert len(ROUTES) == len(table())  # no path twice


def test_the_app_serves_each_route_the_way_the_table_says():
    from proxy.serving.app import create_app
    from proxy.serving.passthrough import not_found
    from proxy.serving.routes import Router

    app = create_app(ProxyConfig())
    mounted: dict[str, object] = {}
    for r in app.router.routes:
        if isinstance(r, Route):
            mounted.setdefault(r.path, r.app if not hasattr(r, "endpoint") else r.endpoint)
    passthrough = app.state.proxy.passthrough
    for route in ROUTES:
        endpoint = mounted.get(route.path)
        if route.handling == P_THEN_D:
            assert getattr(endpoint, "router", None) is app.state.proxy.router and isinstance(
                app.state.proxy.router, Router), route.path
        elif route.handling in (ONE_INSTANCE, ONE_DECODE, STORED_RESPONSE):
            assert getattr(endpoint, "owner", None) is passthrough and endpoint.route is route, route.path
        elif route.handling == REFUSED:
            assert endpoint is not_found, route.path
        elif route.handling == ADMIN:
            assert getattr(endpoint, "adapters", None) is app.state.proxy.adapters, route.path
        elif route.handling == PROXY:
            assert endpoint is not None and endpoint is not not_found, route.path

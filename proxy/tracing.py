"""One OpenTelemetry trace per request (``--tracing``, off by default): the proxy's span and its context
passed on to P and D, whose vLLM joins the trace (its ``--otlp-traces-endpoint``: each engine's
``llm_request`` span), and the connector's ``kv send`` on P and ``kv load`` on D (connector/tracing.py).

- The span: one per request on the disaggregated routes (api_routes.P_THEN_D) and on the routes one
  instance answers (embeddings, tokenize, a stored response, ...: ``xpyd.path`` passthrough, the
  instance chosen as a prefill or decode event), a SERVER span named ``POST /v1/...``, child of
  the client's ``traceparent`` when it sends one (W3C trace context), else the root of a new trace.
  Its attributes say what the proxy did: the model, the P and D chosen (each attempt is an event, a
  failed one too, so retries show), the path (disaggregated, prefill_alone, local_*), where the
  first token came from, the timings the x-xpyd-* headers carry (queue, prefill, D's first byte:
  the KV wait is in it), the status.
- The context: every request to P and D carries this span as its parent (``traceparent``, with the
  client's ``tracestate``) in place of the client's, so vLLM's ``llm_request`` span of P and of D are
  the proxy span's children.
- Export: OTLP, configured by the standard variables (``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``,
  ``..._PROTOCOL`` ``http/protobuf`` (default) or ``grpc``, ``..._HEADERS``, ``OTEL_SERVICE_NAME``
  (default xpyd-proxy), ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``), in the SDK's batch thread.

The OpenTelemetry packages (the ``tracing`` extra) are imported only when tracing is on: the proxy runs
without them, and with tracing off a request pays one ``is None`` test per hook. Each proxy owns its
provider (never the process-global one).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from proxy.errors import ConfigError
from xpyd_wire.headers import (
    XPYD_DECODE_TTFB_MS_RAW,
    XPYD_FIRST_TOKEN_RAW,
    XPYD_PATH_RAW,
    XPYD_PREFILL_MS_RAW,
    XPYD_QUEUE_MS_RAW,
)

log = logging.getLogger("xpyd.proxy.tracing")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
SERVICE_NAME = "xpyd-proxy"
PROTOCOLS = ("http/protobuf", "grpc")
# The response headers that describe how the request was served (the attempt that answered), as
# span attributes: (attribute, parse as a float).
_FROM_HEADERS: dict[bytes, tuple[str, bool]] = {
    XPYD_PATH_RAW: ("xpyd.path", False),
    XPYD_FIRST_TOKEN_RAW: ("xpyd.first_token", False),
    XPYD_QUEUE_MS_RAW: ("xpyd.queue_ms", True),
    XPYD_PREFILL_MS_RAW: ("xpyd.prefill_ms", True),
    XPYD_DECODE_TTFB_MS_RAW: ("xpyd.decode_ttfb_ms", True),
}
ROLE_NAMES = {"P": "prefill", "D": "decode"}
INSTALL_HINT = "pip install 'xpyd[tracing]' (opentelemetry-sdk and opentelemetry-exporter-otlp)"


class RequestTrace:
    """One request's span, as the dispatch code sees it: a few calls where the proxy decides."""

    __slots__ = ("span", "_attempts")

    def __init__(self, span: Any) -> None:
        self.span = span
        self._attempts = {"P": 0, "D": 0}

    def begin(self, headers: dict[str, str], model: str | None) -> None:
        """The request was read: make this span the parent of whatever P and D do for it
        (``headers``: what goes upstream, the client's trace context replaced)."""
        ctx = self.span.get_span_context()
        headers[TRACEPARENT] = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
        state = ctx.trace_state.to_header() if ctx.trace_state else ""
        if state:
            headers[TRACESTATE] = state  # the client's, when its traceparent was taken
        else:
            headers.pop(TRACESTATE, None)
        if model is not None:
            self.span.set_attribute("gen_ai.request.model", model)

    def instance(self, role: str, address: str, why: str | None = None) -> None:
        """`role`'s instance chosen for an attempt (an event each; the attribute: the last)."""
        self._attempts[role] += 1
        name = ROLE_NAMES[role]
        attrs: dict[str, Any] = {"xpyd.instance": address, "xpyd.attempt": self._attempts[role]}
        if why is not None:
            attrs["xpyd.why"] = why
        self.span.add_event(name, attrs)
        self.span.set_attribute(f"xpyd.{name}.instance", address)

    def failed(self, role: str, address: str, reason: str) -> None:
        """An attempt on `role`'s instance failed (retried elsewhere, or rescued)."""
        self.span.add_event(f"{ROLE_NAMES[role]}_failed", {"xpyd.instance": address, "xpyd.reason": reason})

    def note(self, name: str, value: str | int | float | bool) -> None:
        self.span.set_attribute(f"xpyd.{name}", value)

    def end(self, status: int, extra: list[tuple[bytes, bytes]], generated: bool = True) -> None:
        """The span ends with what the response headers told (``generated``: False for a route
        that produces no tokens, whose span has no first-token source)."""
        span = self.span
        first = not generated
        for key, value in extra:
            found = _FROM_HEADERS.get(key)
            if found is not None:
                attr, number = found
                span.set_attribute(attr, float(value) if number else value.decode("latin-1"))
                first = first or key == XPYD_FIRST_TOKEN_RAW
        if not first and self._attempts["D"]:  # the header is there only when P's token went out
            span.set_attribute("xpyd.first_token", "decode")
        for role, n in self._attempts.items():
            if n:
                span.set_attribute(f"xpyd.{ROLE_NAMES[role]}.attempts", n)
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        span.end()


class Tracing:
    """The proxy's tracer: its own provider and OTLP exporter, configured by the OTEL_* variables."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ConfigError(f"--tracing needs OpenTelemetry ({e}): {INSTALL_HINT}") from None
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                    or "http/protobuf")  # fmt: skip
        if protocol not in PROTOCOLS:
            raise ConfigError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r}: the proxy exports "
                              f"{' or '.join(PROTOCOLS)}")  # fmt: skip
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise ConfigError(f"--tracing over {protocol} needs its OTLP exporter ({e}): {INSTALL_HINT}") from None
        named = "OTEL_SERVICE_NAME" in env or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
        resource = Resource.create({} if named else {"service.name": SERVICE_NAME})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self._tracer = self._provider.get_tracer("xpyd.proxy")
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER
        self.endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                         or "the exporter's default")  # fmt: skip
        log.info("tracing on: OTLP %s to %s", protocol, self.endpoint)

    def start(self, path: str, headers: list[tuple[bytes, bytes]], method: str = "POST") -> RequestTrace:
        """The request's span, child of the client's trace context if it sent a valid one
        (``path``: the route, e.g. ``/v1/responses/{response_id}``, not the URL)."""
        carrier: dict[str, str] = {}
        for k, v in headers:
            if k == b"traceparent" or k == b"tracestate":
                carrier[k.decode()] = v.decode("latin-1")
        parent = self._propagator.extract(carrier) if carrier else None
        span = self._tracer.start_span(f"{method} {path}", context=parent, kind=self._server,
                                       attributes={"http.request.method": method, "http.route": path})
        return RequestTrace(span)

    def shutdown(self) -> None:
        """Export what is left (bounded by the exporter's timeout) and stop the batch thread."""
        self._provider.shutdown()

"""A real OTLP/HTTP trace receiver on loopback, for the tracing tests: what a collector is to the
proxy, vLLM and the connector (the other side of the boundary, so a stand-in is fine).

It serves ``POST /v1/traces`` as OTLP/HTTP does (protobuf ``ExportTraceServiceRequest``, gzip or
not; answers ``ExportTraceServiceResponse``), decodes every span with its resource's attributes and
keeps them, in order, for the test to read. Any other path or content type gets the 4xx a
collector gives. Exporters post from their own threads: a ThreadingHTTPServer, one lock.

    with OtlpReceiver() as rx:                 # rx.endpoint: http://127.0.0.1:PORT/v1/traces
        ...
        spans = rx.wait_for(lambda spans: any(s.name == "llm_request" for s in spans), timeout=60)
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

MAX_BODY = 16 * 1024 * 1024


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class Event:
    name: str
    attributes: dict[str, Any]
    time_ns: int = 0


@dataclass(frozen=True)
class Span:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind (2: SERVER, 3: CLIENT, 1: INTERNAL)
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]  # the resource's attributes (service.name, ...)
    events: tuple[Event, ...] = ()
    status_code: int = 0  # 0 unset, 1 ok, 2 error

    @property
    def service(self) -> str | None:
        return self.resource.get("service.name")


@dataclass
class OtlpReceiver:
    host: str = "127.0.0.1"
    spans: list[Span] = field(default_factory=list)
    requests: int = 0  # export requests decoded
    refused: int = 0  # requests answered 4xx

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet: the test reads the spans
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("content-length") or 0)
                if self.path != "/v1/traces" or length > MAX_BODY:
                    self._answer(404 if self.path != "/v1/traces" else 413, b"")
                    return
                body = self.rfile.read(length)
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.headers.get("content-type") != "application/x-protobuf":
                    self._answer(415, b"")
                    return
                try:
                    req = ExportTraceServiceRequest.FromString(body)
                except Exception:  # noqa: BLE001 - a malformed export is the sender's bug: 400
                    self._answer(400, b"")
                    return
                receiver._add(req)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, data: bytes) -> None:
                if status >= 400:
                    with receiver._cond:
                        receiver.refused += 1
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        """The traces URL (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, vLLM's --otlp-traces-endpoint)."""
        return f"http://{self.host}:{self._server.server_address[1]}/v1/traces"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _add(self, req: ExportTraceServiceRequest) -> None:
        got: list[Span] = []
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        name=s.name, kind=s.kind, start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes), resource=resource,
                        events=tuple(Event(e.name, _attrs(e.attributes), e.time_unix_nano) for e in s.events),
                        status_code=s.status.code,
                    ))  # fmt: skip
        with self._cond:
            self.requests += 1
            self.spans.extend(got)
            self._cond.notify_all()

    def snapshot(self) -> list[Span]:
        with self._cond:
            return list(self.spans)

    def export_env(self, service: str) -> dict[str, str | None]:
        """A process's OpenTelemetry environment for exporting here: OTLP over HTTP (vLLM's default is
        grpc), spans batched for 100 ms, named `service`. vLLM exports only with --otlp-traces-endpoint."""
        return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
                "OTEL_SERVICE_NAME": service}

    def wait_for(self, done: Callable[[list[Span]], bool], timeout: float, what: str = "spans") -> list[Span]:
        """The spans received once ``done(spans)`` holds; AssertionError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans}, key=str)
                    raise AssertionError(f"no {what} after {timeout}s; received {len(self.spans)} spans: {names}")
                self._cond.wait(min(left, 1.0))
            return list(self.spans)


def render(spans: list[Span]) -> str:
    """One trace as indented text (parents before children, siblings by start): service, span name,
    milliseconds from the trace's first start and the span's length, then its attributes and events."""
    by_parent: dict[str, list[Span]] = {}
    ids = {s.span_id for s in spans}
    for s in sorted(spans, key=lambda x: x.start_ns):
        by_parent.setdefault(s.parent_span_id if s.parent_span_id in ids else "", []).append(s)
    t0 = min((s.start_ns for s in spans), default=0)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in by_parent.get(parent, []):
            pad = "  " * depth
            start_ms, length_ms = (s.start_ns - t0) / 1e6, (s.end_ns - s.start_ns) / 1e6
            lines.append(f"{pad}{s.service} {s.name}  +{start_ms:.1f} ms, {length_ms:.1f} ms")
            for k, v in sorted(s.attributes.items()):
                lines.append(f"{pad}    {k} = {v}")
            for e in s.events:
                at = f" +{(e.time_ns - t0) / 1e6:.1f} ms" if e.time_ns else ""
                lines.append(f"{pad}    event {e.name}{at}{' ' + str(e.attributes) if e.attributes else ''}")
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def save(spans: list[Span], path: Path) -> None:
    """One trace as JSON (what scripts/trace_picture.py draws); ``load`` reads it back."""
    path.write_text(json.dumps([dataclasses.asdict(s) for s in spans], indent=1, default=str))


def load(path: Path) -> list[Span]:
    out = []
    for d in json.loads(path.read_text()):
        events = tuple(Event(**e) for e in d.pop("events"))
        out.append(Span(**d, events=events))
    return out

"""What the connector span tests share (tests/unit/test_connector_tracing.py, P2P, and
tests/unit/test_shared_storage_tracing.py): a tracer provider exporting to a loopback OTLP
receiver, vLLM's Request with the proxy's trace context, and a step's KVConnectorOutput carrying
the workers' per-request reports."""

from __future__ import annotations

import time

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from connector.stats import XpydStats
from connector.tracing import TransferSpans
from tests.support.otlp_receiver import OtlpReceiver, Span

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PROXY_SPAN = "00f067aa0ba902b7"
HEADERS = {"traceparent": f"00-{TRACE_ID}-{PROXY_SPAN}-01"}
ERROR = 2  # Status.STATUS_CODE_ERROR


def spans_to(rx: OtlpReceiver, service: str, **kw) -> tuple[TracerProvider, TransferSpans]:
    """What vLLM's EngineCore has with --otlp-traces-endpoint: a provider exporting to `rx` (each span
    as it ends: the test reads it at once), and the connector's spans on it (`kw`: TransferSpans')."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=rx.endpoint)))
    return provider, TransferSpans(ranks=kw.pop("ranks", 1), tracer=provider.get_tracer("xpyd.connector"), **kw)


def request(rid: str, n_prompt: int, headers: dict[str, str] | None = HEADERS, first: int = 1) -> Request:
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=16), None,
                   trace_headers=headers)


def output(legs=(), recving=(), failed=(), sending=(), when: int | None = None) -> KVConnectorOutput:
    """A step's output; `legs`: the workers' reports without their time (`when`, default now)."""
    stats = XpydStats()
    stats.data["legs"] = [[*x, when or time.time_ns()] for x in legs]
    return KVConnectorOutput(finished_sending=set(sending), finished_recving=set(recving),
                             failed_recving=set(failed), kv_connector_stats=stats)


def the_span(rx: OtlpReceiver, name: str) -> Span:
    (span,) = [s for s in rx.snapshot() if s.name == name]
    return span

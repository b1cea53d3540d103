"""--tracing (proxy/tracing.py): one span per request, exported over real OTLP/HTTP to a receiver on
loopback (tests/support/otlp_receiver.py), child of the client's W3C trace context, and that context
carried to P and D (fake instances over real HTTP and ZMQ) so their vLLM's spans join the trace.
Off (the default): the client's trace context goes on unchanged and OpenTelemetry is never imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config import ConfigError
from proxy.tracing import Tracing
from tests.support.otlp_receiver import OtlpReceiver, Span
from tests.support.proxy_helpers import Fault, register_dead, running_proxy

ROOT = Path(__file__).resolve().parents[2]
COMPLETION = {"model": "fake-model", "prompt": "Hello there", "max_tokens": 5}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
SERVER = 2  # opentelemetry.proto SpanKind SPAN_KIND_SERVER
ERROR = 2  # Status.STATUS_CODE_ERROR
WAIT_S = 60.0  # the batch thread exports within OTEL_BSP_SCHEDULE_DELAY; a loaded box may take long


@pytest.fixture
def receiver(monkeypatch):
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SERVICE_NAME",
                     "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_SDK_DISABLED"):
            monkeypatch.delenv(name, raising=False)
        yield rx


def proxy_spans(rx: OtlpReceiver, n: int = 1) -> list[Span]:
    spans = rx.wait_for(lambda s: sum(x.service == "xpyd-proxy" for x in s) >= n, WAIT_S, "proxy span")
    return [s for s in spans if s.service == "xpyd-proxy"]


def parent_of(header: str) -> tuple[str, str, str]:
    """(trace id, parent span id, flags) of a traceparent header."""
    version, trace_id, span_id, flags = header.split("-")
    assert version == "00"
    return trace_id, span_id, flags


async def test_a_request_is_one_span_in_the_clients_trace_and_p_and_d_are_its_children(receiver):
    async with running_proxy(tracing=True) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json=COMPLETION,
                                    headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc"})
        assert resp.status_code == 200, resp.text
        (span,) = proxy_spans(receiver)
    assert (span.trace_id, span.parent_span_id, span.kind) == (TRACE_ID, CLIENT_SPAN, SERVER)
    assert span.name == "POST /v1/completions"
    a = span.attributes
    assert a["http.route"] == "/v1/completions" and a["http.response.status_code"] == 200
    assert a["gen_ai.request.model"] == "fake-model"
    assert a["xpyd.prefill.instance"] == p.http_address and a["xpyd.decode.instance"] == d.http_address
    assert (a["xpyd.prefill.attempts"], a["xpyd.decode.attempts"]) == (1, 1)
    assert a["xpyd.path"] == "disaggregated"
    for timing in ("xpyd.queue_ms", "xpyd.prefill_ms", "xpyd.decode_ttfb_ms"):
        assert isinstance(a[timing], float) and a[timing] >= 0, timing
    assert [(e.name, e.attributes["xpyd.instance"]) for e in span.events] == [
        ("decode", d.http_address), ("prefill", p.http_address)]
    assert span.status_code != ERROR and span.end_ns >= span.start_ns > 0
    # P and D get the proxy's span as their parent, in the client's trace, with its tracestate.
    for fake in (p, d):
        (rec,) = fake.completions()
        assert parent_of(rec.headers["traceparent"]) == (TRACE_ID, span.span_id, "01"), fake.role
        assert rec.headers["tracestate"] == "vendor=abc"


async def test_without_a_client_context_the_proxy_starts_the_trace(receiver):
    async with running_proxy(tracing=True) as px:
        p, d = await px.pd()
        # A traceparent that is not one starts a new trace too; its tracestate is not carried.
        for headers in ({}, {"traceparent": "00-not-a-trace-01", "tracestate": "vendor=abc"}):
            assert (await px.client.post("/v1/completions", json=COMPLETION, headers=headers)).status_code == 200
        spans = proxy_spans(receiver, 2)
    assert len({s.trace_id for s in spans}) == 2 and all(s.parent_span_id == "" for s in spans)
    for fake in (p, d):
        for rec, span in zip(fake.completions(), spans):
            assert parent_of(rec.headers["traceparent"])[:2] == (span.trace_id, span.span_id)
            assert "tracestate" not in rec.headers


async def test_retries_and_the_rescue_show_as_events(receiver):
    """A P that refused the connection, then a D whose KV load failed (its 500), mended by D alone."""
    async with running_proxy(tracing=True, first_token="decode", decode_retries=0, heartbeat_timeout=30) as px:
        dead = await register_dead(px, "P")  # first in the table: round robin tries it first
        p, d = await px.pd()
        d.fault = Fault(status=500, id_prefix="___prefill_addr_", times=1)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200, resp.text
        (span,) = proxy_spans(receiver)
    events = [(e.name, e.attributes["xpyd.instance"], e.attributes.get("xpyd.reason", e.attributes.get("xpyd.why")))
              for e in span.events]
    assert events == [
        ("decode", d.http_address, None),
        ("prefill", dead, None), ("prefill_failed", dead, "connect"), ("prefill", p.http_address, None),
        ("decode_failed", d.http_address, "decode failed: HTTP 500 in its answer"),
        ("decode", d.http_address, "local_rescue"),
    ]  # fmt: skip
    a = span.attributes
    assert (a["xpyd.prefill.attempts"], a["xpyd.decode.attempts"], a["xpyd.path"]) == (2, 2, "local_rescue")
    assert a["xpyd.prefill.instance"] == p.http_address


async def test_the_first_token_source_is_told(receiver):
    async with running_proxy(tracing=True) as px:
        await px.pd()
        resp = await px.client.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert resp.status_code == 200 and "[DONE]" in resp.text
        (span,) = proxy_spans(receiver)
    assert span.attributes["xpyd.first_token"] == "prefill"
    assert span.attributes["xpyd.path"] == "disaggregated"


async def test_why_d_gave_the_first_token_is_told(receiver):
    """P's token is part of a character (vLLM answers ""): D answers, and the span says why."""
    async with running_proxy(tracing=True) as px:
        p, d = await px.pd()
        p.first_text = ""
        resp = await px.client.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert resp.status_code == 200 and "[DONE]" in resp.text
        (span,) = proxy_spans(receiver)
    assert span.attributes["xpyd.first_token_to_decode"] == "held_back"
    assert span.attributes["xpyd.first_token"] == "decode"


async def test_a_continuation_mended_by_d_alone_shows_as_events(receiver):
    """The first token from P went out; D's continuation failed before its first byte (its 500),
    so D alone continued: the stream is whole, and the span says what happened."""
    async with running_proxy(tracing=True) as px:
        p, d = await px.pd()
        d.fault = Fault(status=500, id_prefix="___prefill_addr_", times=1)
        resp = await px.client.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert resp.status_code == 200 and "[DONE]" in resp.text and '"error"' not in resp.text
        (span,) = proxy_spans(receiver)
    assert [(e.name, e.attributes.get("xpyd.why")) for e in span.events] == [
        ("decode", None), ("prefill", None), ("decode_failed", None), ("decode", "local_rescue")]
    assert span.attributes["xpyd.first_token"] == "prefill" and span.attributes["xpyd.decode.attempts"] == 2


async def test_a_local_path_and_an_upstream_failure(receiver):
    async with running_proxy(tracing=True, local_prefill_threshold=1000) as px:
        p, d = await px.pd()
        assert (await px.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        d.fault = Fault(status=503)  # D's own 5xx, D alone: relayed, nothing to retry on
        assert (await px.client.post("/v1/completions", json=COMPLETION)).status_code == 503
        ok, failed = sorted(proxy_spans(receiver, 2), key=lambda s: s.start_ns)
    assert ok.attributes["xpyd.path"] == "local_short" and "xpyd.prefill.instance" not in ok.attributes
    assert failed.attributes["http.response.status_code"] == 503 and failed.status_code == ERROR
    assert not p.completions()


async def test_off_the_clients_context_goes_on_unchanged(receiver):
    async with running_proxy() as px:
        p, d = await px.pd()
        headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}
        assert (await px.client.post("/v1/completions", json=COMPLETION, headers=headers)).status_code == 200
    for fake in (p, d):
        (rec,) = fake.completions()
        assert (rec.headers["traceparent"], rec.headers["tracestate"]) == (TRACEPARENT, "vendor=abc")
    assert receiver.requests == 0


def test_an_unknown_protocol_is_a_configuration_error():
    with pytest.raises(ConfigError, match="http/json"):
        Tracing({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})


BLOCK_OTEL = """
import importlib.abc, sys
class NoOtel(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, NoOtel())
"""


def test_the_proxy_runs_without_opentelemetry_unless_tracing_is_asked_for():
    """The tracing extra is optional: with OpenTelemetry absent the proxy builds and serves (no
    import of it anywhere), and --tracing is a configuration error that says what to install."""
    script = BLOCK_OTEL + """
from proxy.__main__ import main
from proxy.config import load_config
from proxy.serving.app import create_app
create_app(load_config(["--port", "0"], env={}))
assert not [m for m in sys.modules if m.startswith("opentelemetry")]
sys.exit(main(["--tracing", "--port", "0", "--discovery-port", "0"]))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 2, out.stderr
    assert "configuration error: --tracing needs OpenTelemetry" in out.stderr
    assert "pip install 'xpyd[tracing]'" in out.stderr


def test_pyproject_names_the_tracing_extra():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {d.split(">")[0].split("=")[0] for d in extras["tracing"]} == {
        "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp"}
    assert json.dumps(extras["tracing"])  # a list of requirement strings


async def test_a_route_one_instance_answers_is_a_span_too(receiver):
    """/tokenize (and every route passed through to one instance) gets its span: the route, the
    instance as an event (a refused one first: a failed event), path passthrough, no
    first-token source; the instance that answers gets the span as its parent."""
    async with running_proxy(tracing=True, heartbeat_timeout=30) as px:
        dead = await register_dead(px, "P")  # first in the table: round robin tries it first
        p, d = await px.pd()
        resp = await px.client.post("/tokenize", json={"model": "fake-model", "prompt": "Hello"},
                                    headers={"traceparent": TRACEPARENT})
        assert resp.status_code == 200, resp.text
        (span,) = proxy_spans(receiver)
    assert (span.name, span.trace_id, span.parent_span_id) == ("POST /tokenize", TRACE_ID, CLIENT_SPAN)
    a = span.attributes
    assert a["http.route"] == "/tokenize" and a["http.response.status_code"] == 200
    assert a["xpyd.path"] == "passthrough" and "xpyd.first_token" not in a
    assert a["xpyd.prefill.instance"] == p.http_address and a["xpyd.prefill.attempts"] == 2
    assert [(e.name, e.attributes["xpyd.instance"], e.attributes.get("xpyd.reason")) for e in span.events] == [
        ("prefill", dead, None), ("prefill_failed", dead, "connect"), ("prefill", p.http_address, None)]
    (rec,) = [r for r in p.requests if r.path == "/tokenize"]
    assert parent_of(rec.headers["traceparent"])[:2] == (TRACE_ID, span.span_id)
    assert not [r for r in d.requests if r.path == "/tokenize"]

"""The connector's part of a request's trace (issue 50): a ``kv load`` span on D and a ``kv send``
span on P, children of the request's trace context (the ``traceparent`` vLLM's API server got: the
xPyD proxy's span), beside the engines' own ``llm_request`` spans.

- Where: vLLM's EngineCore process, where the scheduler half runs. Started with
  ``--otlp-traces-endpoint``, vLLM gives that process a global OpenTelemetry tracer provider (its
  ``maybe_init_worker_tracer``) and hands each request's W3C headers to the engine
  (``Request.trace_headers``); the spans go out through that provider, named by ``OTEL_SERVICE_NAME``.
- When: ``kv load`` from when the scheduler first sees the request (it may wait there for P to
  begin sending) to the load's end; the event ``load_planned`` splits the two (before: waiting for
  P's KV to begin arriving and for blocks; after: the transfer). ``kv send`` from the step that
  completes the prompt (the send is planned; the worker sends after that step's forward pass) to
  the send's end (``finished_sending``, or the step that sent it).
- The SharedStorageConnector's spans are ``kv load`` on D (from the first step that claims stored
  blocks, or waits for P's first file, to the load's end) and ``kv store`` on P: a store per step
  that completed prompt blocks (chunked prefill: several parts), from the first planned to the last
  part written by every rank, which may be after the request finished (the writer's queue).
- The numbers: the workers' own, those of their ``kv sent`` / ``kv loaded`` log lines, reported per
  request through the connector stats (``StatsRecorder.leg``, only while tracing is on) as
  ``[role, request, result, bytes, ms, wait_ms, reason, when]``: bytes moved, ms (send: from the end
  of the forward pass that wrote the blocks to the last byte, like ``kv sent ... ms=``, 0 when a
  layer-wise send had shipped everything before that pass ended; load: applying the KV,
  ``apply_ms``), wait_ms (load: from the step that planned it to the KV being whole here, ``wait_ms``),
  when it ended (the span's end: the scheduler hears of it only at the end of a step). With several
  worker ranks the bytes add up and the times are the slowest rank's.

Off (no ``--otlp-traces-endpoint``) the connectors hold no ``TransferSpans`` and nothing here runs;
a request without trace headers (the client or proxy sent none) costs one dict lookup per hook.
OpenTelemetry is imported only when tracing is on (vLLM has imported it already then).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

LOAD, SEND = "load", "send"
SPAN_NAMES = {LOAD: "kv load", SEND: "kv send"}
STORAGE_SPAN_NAMES = {LOAD: "kv load", SEND: "kv store"}  # SharedStorageConnector: P writes files
# Open spans are bounded: one that never heard its end (a worker that died) is ended, oldest first.
MAX_OPEN = 4096


def tracing_on(vllm_config: Any) -> bool:
    """Whether vLLM exports spans (its --otlp-traces-endpoint), so the connector's should join."""
    obs = getattr(vllm_config, "observability_config", None)
    return getattr(obs, "otlp_traces_endpoint", None) is not None


@dataclass(slots=True)
class _Leg:
    role: str
    key: str | None  # the transfer (None: a storage load of blocks no producer was asked for)
    context: Any  # the parent (OpenTelemetry Context from the request's trace headers)
    span: Any = None  # started (a send's starts when it is planned)
    seen: int = 0  # when the scheduler first saw the request (ns, the spans' clock)
    started: int = 0  # the span's start (a load's: seen; a send's: planned)
    reports: int = 0  # worker reports: one per rank, per part of a send in parts
    parts: int = 0  # a send in parts (storage: one store per step): how many were planned; 0 = one
    finished: bool = False  # vLLM finished the request: a send in parts has no more to come
    nbytes: int = 0
    ms: float = 0.0
    wait_ms: float | None = None
    ended: int = 0  # when the last rank's part ended (ns), as the worker saw it
    result: str = "ok"  # ok, failed, cancelled (aborted while loading), not_loaded (D computed the prompt
    # itself: its own prefix cache held it, or the request ended before a load), unknown
    reason: str | None = None  # why it failed: a rank's reason, or no_sender (none began in time)


class TransferSpans:
    """Scheduler side: the open ``kv load`` / ``kv send`` spans, by request id. ``ranks``: the worker
    processes that each report their part (vLLM's world size, TP x PP); ``tracer``: vLLM's (tests: theirs)."""

    def __init__(self, ranks: int = 1, tracer: Any = None, names: dict[str, str] | None = None,
                 attributes: dict[str, Any] | None = None) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        from vllm.v1.request import RequestStatus

        if tracer is None:
            from opentelemetry import trace

            tracer = trace.get_tracer_provider().get_tracer("xpyd.connector")
        self._tracer = tracer
        self._propagator = TraceContextTextMapPropagator()
        self._ranks = max(1, ranks)
        self._names = names or SPAN_NAMES
        self._attrs = attributes or {}  # on every span (the storage connector's xpyd.kv.storage)
        self._aborted = RequestStatus.FINISHED_ABORTED
        self._legs: dict[str, _Leg] = {}
        self._closing: set[str] = set()  # the scheduler saw their end: they end after this step's reports

    # ---- the scheduler's hooks ----
    def seen(self, request: Any, role: str, key: str | None) -> None:
        """A request this instance loads (role LOAD: its span starts now) or sends (SEND: at `planned`)."""
        headers = getattr(request, "trace_headers", None)
        if not headers or request.request_id in self._legs:
            return
        leg = _Leg(role, key, self._propagator.extract(dict(headers)), seen=time.time_ns())
        self._legs[request.request_id] = leg
        if role == LOAD:
            self._start(leg, {})
        if len(self._legs) > MAX_OPEN:
            oldest = next(iter(self._legs))
            gone = self._legs.pop(oldest)
            gone.result = "unknown"
            self._end(oldest, gone)

    def planned(self, rid: str, attrs: dict[str, Any]) -> None:
        """The load or send was planned (tokens, blocks, ...): a send's span starts; a load's gets
        the event that ends its wait."""
        leg = self._legs.get(rid)
        if leg is None:
            return
        if leg.span is None:
            self._start(leg, attrs)
        elif leg.role == SEND:  # preempted (its send cancelled if not begun) and recomputed: sent again
            leg.span.set_attributes(attrs)
            leg.span.add_event("send_replanned")
        else:
            now = time.time_ns()
            leg.span.set_attributes({**attrs, "xpyd.kv.sender_wait_ms": round((now - leg.seen) / 1e6, 3)})
            leg.span.add_event("load_planned", timestamp=now)

    def part_planned(self, rid: str, attrs: dict[str, Any]) -> None:
        """One more part of a send in parts was planned (storage: a step's completed blocks): the span
        starts with the first; it ends once the request finished and every rank reported every part
        (the last may be written after the request finished)."""
        leg = self._legs.get(rid)
        if leg is None or leg.role != SEND:
            return
        leg.parts += 1
        if leg.span is None:
            self._start(leg, attrs)
        else:
            leg.span.set_attributes(attrs)

    def gave_up(self, rid: str, reason: str) -> None:
        """The scheduler stopped waiting for a load (storage: P's first file never came): it failed, now."""
        leg = self._legs.pop(rid, None)
        if leg is not None:
            leg.result, leg.reason = "failed", reason
            self._end(rid, leg)

    def _reported(self, leg: _Leg) -> bool:
        if leg.parts:  # more may come until the request finished
            return leg.finished and leg.reports >= self._ranks * leg.parts
        return leg.reports >= self._ranks

    def finished(self, request: Any, delay_free: bool, params: dict[str, Any] | None) -> None:
        """vLLM's request_finished and what the connector answered: a load is over (its result, unless a
        worker reports one in this step); a send the worker still holds (delay_free) ends at
        finished_sending."""
        rid = request.request_id
        leg = self._legs.get(rid)
        if leg is None:
            return
        xpyd = (params or {}).get("xpyd") or {}
        if leg.role == LOAD and not leg.reports:  # else the workers' reports say
            if request.status == self._aborted:
                leg.result = "cancelled"
            elif not xpyd:
                leg.result = "not_loaded"
            elif xpyd.get("load_failed"):
                leg.result, leg.reason = "failed", "no_sender"
        if leg.span is None:  # a send never planned (aborted before its prompt was complete)
            del self._legs[rid]
            return
        leg.finished = True
        if not delay_free and (not leg.parts or self._reported(leg)):  # parts still written: at the last
            self._closing.add(rid)

    def output(self, out: Any) -> None:
        """A step's connector output (vLLM's KVConnectorOutput): the workers' per-request reports, then
        the transfers they finished (finished_recving / failed_recving / finished_sending) and the
        requests finished in this step end."""
        stats = out.kv_connector_stats
        legs = stats.data.get("legs") if stats is not None else None
        finished = [*(out.finished_recving or ()), *(out.failed_recving or ()), *(out.finished_sending or ())]
        for role, rid, result, nbytes, ms, wait_ms, reason, when in legs or ():
            leg = self._legs.get(rid)
            if leg is None or leg.role != role:
                continue
            leg.reports += 1
            leg.ended = max(leg.ended, int(when))
            leg.nbytes += int(nbytes)
            leg.ms = max(leg.ms, float(ms))
            if wait_ms is not None:
                leg.wait_ms = max(leg.wait_ms or 0.0, float(wait_ms))
            if result != "ok":
                leg.result, leg.reason = "failed", reason or result
            if self._reported(leg):
                self._closing.add(rid)
        self._closing.update(r for r in finished if r in self._legs)
        for rid in self._closing:
            leg = self._legs.pop(rid, None)
            if leg is not None:
                self._end(rid, leg)
        self._closing.clear()

    def close(self) -> None:
        """Shutdown: end what is open (their result unknown)."""
        for rid, leg in list(self._legs.items()):
            leg.result = "unknown"
            self._end(rid, leg)
        self._legs.clear()
        self._closing.clear()

    # ---- spans ----
    def _start(self, leg: _Leg, attrs: dict[str, Any]) -> None:
        leg.started = leg.seen if leg.role == LOAD else time.time_ns()
        first = {**self._attrs, **({"xpyd.kv.transfer": leg.key} if leg.key else {}), **attrs}
        leg.span = self._tracer.start_span(self._names[leg.role], context=leg.context, start_time=leg.started,
                                           attributes=first)

    def _end(self, rid: str, leg: _Leg) -> None:
        span = leg.span
        if span is None:
            return
        attrs: dict[str, Any] = {"xpyd.kv.request": rid, "xpyd.kv.result": leg.result}
        if leg.reports:
            attrs["xpyd.kv.bytes"] = leg.nbytes
            attrs["xpyd.kv.ms"] = round(leg.ms, 3)
            if leg.wait_ms is not None:
                attrs["xpyd.kv.wait_ms"] = round(leg.wait_ms, 3)
        if leg.reason is not None:
            attrs["xpyd.kv.reason"] = leg.reason
        span.set_attributes(attrs)
        if leg.result == "failed":
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, leg.reason or "failed"))
        # The worker's end, not when the scheduler heard of it (at the end of a step, maybe long after).
        span.end(end_time=max(leg.ended, leg.started) if leg.reports else time.time_ns())

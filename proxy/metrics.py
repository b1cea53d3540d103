"""Prometheus metrics, on a per-app CollectorRegistry so several proxies can share a process.

The counters and histograms every request updates (requests, latency, phases, dispatch
paths, the first token's fallbacks, the precise policies' tokenizing and choices) are
loop-owned (proxy/loop_metrics.py: no lock, exported at scrape time with the same text);
the rarer ones (errors, retries, refusals, discovery, KV events) stay prometheus_client's."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.loop_metrics import CounterChild, HistogramChild, LoopCounter, LoopHistogram
from proxy.registry import Instance, Registry

# Sub-millisecond buckets matter: proxy overhead and prefill of short prompts live there.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
PHASES = ("queue", "prefill", "decode_ttfb", "decode")


class _InstanceCollector(Collector):
    """Live instances and per-instance in-flight requests, read from the registry at scrape
    time so the request path pays nothing for them."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        live = GaugeMetricFamily("xpyd_instances", "Live instances by role", labels=["role"])
        for role in ("P", "D"):
            live.add_metric([role], self._registry.count(role))
        yield live
        pending = GaugeMetricFamily(
            "xpyd_instances_pending",
            "Registered instances not heard from yet (never selected), by role",
            labels=["role"],
        )
        for role in ("P", "D"):
            pending.add_metric([role], self._registry.count_pending(role))
        yield pending
        inflight = GaugeMetricFamily(
            "xpyd_instance_in_flight",
            "Requests the proxy has in flight per instance",
            labels=["role", "instance"],
        )
        for inst in self._registry.all():
            inflight.add_metric([inst.role, inst.http_address], inst.in_flight)
        yield inflight
        yield from role_signals(self._registry.all())


def role_signals(instances: list[Instance]) -> Iterator[Metric]:
    """What an autoscaler reads, per role and model (docs/deploying/autoscaling.md): the live
    instances, the load their heartbeats report (vLLM's waiting and running requests, KV-cache
    use) and the proxy's requests in flight to them. An instance counts under each model it
    serves; model "" while its models are not known yet. Every proxy replica hears every engine:
    aggregate these across replicas with max, not sum."""
    count: dict[tuple[str, str], int] = {}
    reporting: dict[tuple[str, str], int] = {}
    waiting: dict[tuple[str, str], int] = {}
    for_kv: dict[tuple[str, str], int] = {}
    running: dict[tuple[str, str], int] = {}
    kv: dict[tuple[str, str], float] = {}
    in_flight: dict[tuple[str, str], int] = {}
    for inst in instances:
        for model in inst.models or ("",):
            key = (inst.role, model)
            count[key] = count.get(key, 0) + 1
            in_flight[key] = in_flight.get(key, 0) + inst.in_flight
            load = inst.load
            if load is not None:
                reporting[key] = reporting.get(key, 0) + 1
                waiting[key] = waiting.get(key, 0) + load.waiting - load.waiting_for_kv
                for_kv[key] = for_kv.get(key, 0) + load.waiting_for_kv
                running[key] = running.get(key, 0) + load.running
                kv[key] = kv.get(key, 0.0) + load.kv_usage
    instances_f = GaugeMetricFamily("xpyd_role_instances", "Live instances per role and model",
                                    labels=["role", "model"])  # fmt: skip
    requests_f = GaugeMetricFamily(
        "xpyd_role_requests",
        "Requests the live instances of a role report in their heartbeats: running, waiting (to be computed) "
        "and waiting_for_kv (held by D until their prefill's KV begins to come: concurrent dispatch)",
        labels=["role", "model", "state"],
    )
    kv_f = GaugeMetricFamily("xpyd_role_kv_cache_usage", "Mean KV-cache use (0-1) the live instances of a role "
                             "report in their heartbeats", labels=["role", "model"])  # fmt: skip
    flight_f = GaugeMetricFamily("xpyd_role_in_flight", "Requests the proxy has in flight to a role's instances",
                                 labels=["role", "model"])  # fmt: skip
    for key, n in count.items():
        instances_f.add_metric(list(key), n)
        flight_f.add_metric(list(key), in_flight[key])
        if key in reporting:
            requests_f.add_metric([*key, "waiting"], waiting[key])
            requests_f.add_metric([*key, "waiting_for_kv"], for_kv[key])
            requests_f.add_metric([*key, "running"], running[key])
            kv_f.add_metric(list(key), kv[key] / reporting[key])
    yield from (instances_f, requests_f, kv_f, flight_f)


class Metrics:
    def __init__(self, registry: Registry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = LoopCounter(
            "xpyd_requests", "Client requests by route and status", ["route", "status"], registry=r
        )
        self.latency = LoopHistogram(
            "xpyd_request_duration_seconds",
            "End-to-end request latency by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.phase = LoopHistogram(
            "xpyd_phase_duration_seconds",
            "Per-phase latency: queue, prefill, decode_ttfb (D's first byte), decode (D total)",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "xpyd_upstream_errors",
            "Failed upstream calls by instance and kind",
            ["role", "instance", "kind"],
            registry=r,
        )
        self.discovery = Counter(
            "xpyd_discovery_messages",
            "Discovery messages by result (accepted, left, refused, malformed, invalid_field, "
            "unauthorized, replayed)",
            ["result"],
            registry=r,
        )
        self.discovery_connections = Gauge(
            "xpyd_discovery_connections", "Discovery connections held (libzmq's, as its monitor reports them)",
            registry=r)  # fmt: skip
        self.discovery_connections_refused = Counter(
            "xpyd_discovery_connections_refused",
            "Discovery connections shut down as they came, by reason: limit (--discovery-max-connections or "
            "a quarter of the fd limit), source_limit (--discovery-max-connections-per-source)",
            ["reason"], registry=r)  # fmt: skip
        self.discovery_refused = Counter(
            "xpyd_discovery_refused",
            "Registrations refused by a bound, by role and reason (role_limit, source_limit), "
            "or as another instance's address (conflict)",
            ["role", "reason"],
            registry=r,
        )
        self.adapter_syncs = Counter(
            "xpyd_adapter_syncs",
            "LoRA adapters the proxy loaded on instances that joined without them, by result (loaded, failed)",
            ["result"],
            registry=r,
        )
        self.disconnects = Counter(
            "xpyd_client_disconnects", "Clients that went away before their answer", registry=r
        )
        self.prefill_retries = Counter(
            "xpyd_prefill_retries", "Prefill attempts retried on another P", registry=r
        )
        self.decode_retries = Counter(
            "xpyd_decode_retries",
            "Requests redone on another D after D failed before its first byte",
            registry=r,
        )
        self.decode_early_full = LoopCounter(
            "xpyd_decode_early_full",
            "Disaggregated attempts under concurrent dispatch whose D already held decode_max_early requests "
            "of this proxy waiting for their prefill: D was asked once P answered, as with sequential dispatch",
            ["decode"],
            registry=r,
        )
        self.first_token_fallbacks = LoopCounter(
            "xpyd_first_token_to_decode",
            "Requests eligible for the first token from P whose answer went to D's first token instead "
            "(held_back: P's token is part of a character, which vLLM holds back; unusable: P's answer is "
            "not what vLLM writes; concurrent: concurrent dispatch, where D computes every first token)",
            ["reason"],
            registry=r,
        )
        self.dispatch_paths = LoopCounter(
            "xpyd_dispatch",
            "Requests by dispatch path: disaggregated, or D alone (local_short: short prompt, "
            "local_cached: D holds the prefix, local_no_prefill: no P live or reachable, "
            "local_rescue: D failed disaggregated attempts before its first byte)",
            ["path"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "xpyd_queue_depth",
            "Requests waiting for an instance below its in-flight limit, by role",
            ["role"],
            registry=r,
        )
        for role in ("P", "D"):  # 0 without admission control: a scaler's query finds the series
            self.queue_depth.labels(role)
        self.shed_requests = Counter(
            "xpyd_shed_requests",
            "Requests answered 429 by admission control (queue_full, queue_timeout)",
            ["reason"],
            registry=r,
        )
        r.register(_InstanceCollector(registry))
        self.kv_events = Counter(
            "xpyd_kv_events",
            "KV-event batches from instances: applied, or dropped by reason",
            ["result"], registry=r)  # fmt: skip
        self.prompt_ids = LoopCounter(
            "xpyd_prompt_ids",
            "Prompts tokenized for the precise policies: ok, or judged by the guess because "
            "unsupported, too_large, queue_full, timeout (the tokenizing budget) or failed",
            ["result"], registry=r)  # fmt: skip
        self.precise_choices = LoopCounter(
            "xpyd_precise_choices",
            "precise policy choices by role and source: events (the instance's KV index) or "
            "guess (cache_aware's, while its index is unknown)",
            ["role", "source"], registry=r)  # fmt: skip
        self.kv_event_gaps = Counter(
            "xpyd_kv_event_gaps", "Jumps in an instance's KV-event sequence numbers", registry=r)
        self.kv_event_replays = Counter(
            "xpyd_kv_event_replays", "Replay requests to instances' KV-event replay endpoints",
            ["result"], registry=r)  # fmt: skip
        self.kv_event_restarts = Counter(
            "xpyd_kv_event_restarts",
            "Instances whose KV-event sequence went back (engine restarted): index reset",
            registry=r)  # fmt: skip
        self.kv_event_reconnects = Counter(
            "xpyd_kv_event_reconnects",
            "KV-event connections made again, by reason: disconnected (the publisher went away "
            "or closed it, a connect failed, a message over the size limit) or failed (the "
            "stream's own error)",
            ["reason"], registry=r)  # fmt: skip
        self.http_refused = Counter(
            "xpyd_http_refused",
            "Client connections or requests refused at the HTTP edge, by reason "
            "(connection_limit, headers_too_large, header_timeout, body_timeout, bad_request)",
            ["reason"], registry=r)  # fmt: skip
        # Label children are cached: a dict lookup here, no str() of the status.
        self._req_children: dict[tuple[str, int], CounterChild] = {}
        self._lat_children: dict[str, HistogramChild] = {}
        self.phase_children = {p: self.phase.labels(p) for p in PHASES}
        self._path_children: dict[str, CounterChild] = {}

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        key = (route, status)
        child = self._req_children.get(key)
        if child is None:
            child = self._req_children[key] = self.requests.labels(route, str(status))
        child.inc()
        lat = self._lat_children.get(route)
        if lat is None:
            lat = self._lat_children[route] = self.latency.labels(route)
        lat.observe(seconds)

    def first_token_to_d(self, reason: str) -> None:
        self.first_token_fallbacks.labels(reason).inc()

    def dispatch(self, path: str) -> None:
        child = self._path_children.get(path)
        if child is None:
            child = self._path_children[path] = self.dispatch_paths.labels(path)
        child.inc()

    def shed(self, reason: str) -> None:
        self.shed_requests.labels(reason).inc()

    def watch_held_body_bytes(self, held: Callable[[], float]) -> None:
        """xpyd_held_body_bytes, read at scrape time: the request path pays nothing for it."""
        gauge = Gauge("xpyd_held_body_bytes", "Bytes the proxy's request bodies hold now, as its "
                      "--max-held-body-bytes budget counts them", registry=self.registry)  # fmt: skip
        gauge.set_function(held)

    def discovery_refuse(self, role: str, reason: str) -> None:
        self.discovery_refused.labels(role, reason).inc()

    def upstream_error(self, role: str, instance: str, kind: str) -> None:
        self.upstream_errors.labels(role, instance, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

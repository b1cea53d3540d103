"""proxy/loop_metrics.py: the loop-owned counters and histograms write, for the same updates,
the text prometheus_client's own Counter and Histogram write; and a proxy's /metrics carries
them after real requests."""

from __future__ import annotations

import random
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import metrics as prom_metrics
from prometheus_client.parser import text_string_to_metric_families

from proxy.loop_metrics import LoopCounter, LoopHistogram
from proxy.metrics import LATENCY_BUCKETS, PHASES, Metrics
from proxy.registry import Registry
from tests.support.proxy_helpers import running_proxy

NOW = 1_700_000_000.25  # every series' _created, on both sides


def _amounts(bounds: tuple[float, ...], rng: random.Random) -> list[float]:
    """Each bound exactly, just above and below it, 0, past the last bound, and random ones."""
    finite = [b for b in bounds if b != float("inf")]
    edges = [x for b in finite for x in (b, b * (1 - 1e-12), b * (1 + 1e-12))]
    return [0.0, 1e-9, finite[-1] * 10, *edges, *(rng.uniform(0, finite[-1] * 1.2) for _ in range(200))]


def _twins(family) -> tuple[CollectorRegistry, object, CollectorRegistry, object]:
    """The loop family rebuilt from its own declaration, and prometheus_client's object with the
    same name, help, labels and buckets, each alone on a registry."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    if isinstance(family, LoopHistogram):
        mine = LoopHistogram(family.name, family.documentation, family.labelnames, family.bounds, registry=ours)
        ref = Histogram(family.name, family.documentation, family.labelnames, buckets=family.bounds, registry=theirs)
    else:
        mine = LoopCounter(family.name, family.documentation, family.labelnames, registry=ours)
        ref = Counter(family.name, family.documentation, family.labelnames, registry=theirs)
    return ours, mine, theirs, ref


def _loop_families(metrics: Metrics) -> list[LoopCounter | LoopHistogram]:
    return [c for c in metrics.registry._collector_to_names if isinstance(c, (LoopCounter, LoopHistogram))]


def test_the_proxy_declares_its_per_request_series_loop_owned():
    names = {f.name for f in _loop_families(Metrics(Registry(heartbeat_timeout=10.0)))}
    assert names == {"xpyd_requests", "xpyd_request_duration_seconds", "xpyd_phase_duration_seconds",
                     "xpyd_dispatch", "xpyd_first_token_to_decode", "xpyd_decode_early_full",
                     "xpyd_prompt_ids", "xpyd_precise_choices"}  # fmt: skip


@pytest.mark.parametrize("created", [True, False])
def test_same_updates_same_text_as_prometheus_client(monkeypatch, created):
    """Every loop-owned family the proxy declares, fed the same label values (str and not:
    prometheus_client keys series by str) and amounts as prometheus_client's own object,
    writes the same bytes: HELP, TYPE, labels, each bucket, +Inf, _count, _sum, _created."""
    monkeypatch.setattr(time, "time", lambda: NOW)
    if not created:
        monkeypatch.setattr(prom_metrics, "_use_created", False)
    rng = random.Random(49)
    families = _loop_families(Metrics(Registry(heartbeat_timeout=10.0)))
    assert families
    for family in families:
        ours, mine, theirs, ref = _twins(family)
        values = [("a", 200), ("b", "200"), ("a", "200"), ("c", 404)]
        label_sets = [tuple(v[i % 2] for i in range(len(family.labelnames))) for v in values]
        if isinstance(family, LoopHistogram):
            updates = [(rng.choice(label_sets), x) for x in _amounts(family.bounds, rng)]
            for labels, x in updates:
                mine.labels(*labels).observe(x)
                ref.labels(*labels).observe(x)
        else:
            for _ in range(300):
                labels, n = rng.choice(label_sets), rng.choice((1, 1, 1, 2.5, 0))
                mine.labels(*labels).inc(n)
                ref.labels(*labels).inc(n)
        expected = generate_latest(theirs)
        assert (b"_created" in expected) is created
        assert generate_latest(ours) == expected, family.name


def test_series_created_but_never_updated_are_written_too(monkeypatch):
    # The proxy asks for its phase children up front: each shows at 0 from the start.
    monkeypatch.setattr(time, "time", lambda: NOW)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopHistogram("h", "Help with \\ and\nnewline", ["phase"], LATENCY_BUCKETS, registry=ours)
    ref = Histogram("h", "Help with \\ and\nnewline", ["phase"], buckets=LATENCY_BUCKETS, registry=theirs)
    for p in PHASES:
        mine.labels(p)
        ref.labels(p)
    assert generate_latest(ours) == generate_latest(theirs)


def test_names_are_claimed_on_the_registry():
    r = CollectorRegistry(auto_describe=True)
    LoopCounter("xpyd_x", "x", ["a"], registry=r)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("xpyd_x", "x", ["a"], registry=r)
    LoopHistogram("xpyd_h", "h", ["a"], (1.0,), registry=r)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("xpyd_h_count", "h", registry=r)
    with pytest.raises(ValueError, match="label values"):
        LoopCounter("xpyd_y", "y", ["a", "b"], registry=r).labels("only_one")
    with pytest.raises(ValueError, match="non-negative"):
        LoopCounter("xpyd_z", "z", ["a"], registry=r).labels("a").inc(-1)


COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 3}


async def test_proxy_metrics_after_requests():
    """Requests through a real proxy (fake P and D): /metrics carries the loop-owned families
    with their counts, cumulative buckets ending in +Inf at _count, _sum and _created."""
    async with running_proxy() as px:
        await px.pd(model="tiny")
        for stream in (False, True, False):
            r = await px.client.post("/v1/completions", json={**COMPLETION, "stream": stream})
            assert r.status_code == 200
        assert (await px.client.post("/v1/completions", content=b"nope")).status_code == 400
        text = (await px.client.get("/metrics")).text
    route = "/v1/completions"
    for line in ("# HELP xpyd_requests_total Client requests by route and status",
                 "# TYPE xpyd_requests_total counter",
                 f'xpyd_requests_total{{route="{route}",status="200"}} 3.0',
                 f'xpyd_requests_total{{route="{route}",status="400"}} 1.0',
                 "# TYPE xpyd_requests_created gauge",
                 "# TYPE xpyd_request_duration_seconds histogram",
                 f'xpyd_request_duration_seconds_bucket{{le="+Inf",route="{route}"}} 4.0',
                 f'xpyd_request_duration_seconds_count{{route="{route}"}} 4.0',
                 'xpyd_dispatch_total{path="disaggregated"} 3.0',
                 "# TYPE xpyd_phase_duration_seconds_created gauge"):  # fmt: skip
        assert line in text.splitlines(), line
    families = {f.name: f for f in text_string_to_metric_families(text)}
    latency = families["xpyd_request_duration_seconds"]
    buckets = [s for s in latency.samples if s.name.endswith("_bucket")]
    assert [s.labels["le"] for s in buckets] == [*(str(b) for b in LATENCY_BUCKETS), "+Inf"]
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and counts[-1] == 4
    total = next(s.value for s in latency.samples if s.name.endswith("_sum"))
    assert 0 < total < 60
    phases = families["xpyd_phase_duration_seconds"]
    for phase in PHASES:
        assert phases.samples and any(s.name.endswith("_count") and s.labels == {"phase": phase} and s.value == 3
                                      for s in phases.samples), phase  # fmt: skip
    created = families["xpyd_requests_created"].samples  # the text format writes them as a gauge
    assert len(created) == 2 and all(abs(s.value - time.time()) < 3600 for s in created)

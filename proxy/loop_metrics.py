"""Counters and histograms owned by the proxy's event loop: what every request updates.

prometheus_client's Counter and Histogram take a threading lock per update and a histogram
walks its buckets in Python: ~30 Python calls a request for the proxy's per-request series.
The proxy updates these only on its one event loop, and the /metrics scrape reads them on
the same loop, so a plain float needs no lock. Each class here is a prometheus_client
custom collector (one metric family) registered on the proxy's CollectorRegistry where the
prometheus_client object would be, so generate_latest writes the same text for the same
updates: HELP and TYPE, label order, buckets, _sum, _count and the _created samples
(tests/unit/test_loop_metrics.py compares it with prometheus_client's own objects)."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, metrics as _prom_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString


def _use_created() -> bool:
    # prometheus_client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES or
    # disable_created_metrics()), read at scrape time as its Counter and Histogram do.
    return getattr(_prom_metrics, "_use_created", True)


class CounterChild:
    """One labelled series of a LoopCounter."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramChild:
    """One labelled series of a LoopHistogram: per-bucket counts (cumulated at scrape time,
    as prometheus_client does) and the sum. bisect_left finds the first bound >= amount,
    prometheus_client's `amount <= bound` walk; bounds end with +Inf. (A NaN, which no
    duration is, would count in the first bucket here and in none there.)"""

    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


_Child = TypeVar("_Child", CounterChild, HistogramChild)


class _Family(Collector, Generic[_Child]):
    """The labelled series of one family, keyed by their label values as strings
    (prometheus_client's labels() turns values into str too), in the order first asked for."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry | None) -> None:  # fmt: skip
        if not labelnames:
            raise ValueError(f"{name}: a loop-owned family needs labels")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], _Child] = {}
        self._asked: dict[tuple[object, ...], _Child] = {}  # values as given
        if registry is not None:
            registry.register(self)

    def labels(self, *values: object) -> _Child:
        return self._asked.get(values) or self._add(values)

    def _add(self, values: tuple[object, ...]) -> _Child:
        """The series for label values not asked for before (labels() looks them up first)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values, got {values!r}")
        key = tuple(str(v) for v in values)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = self._new()
        self._asked[values] = child
        return child

    def _new(self) -> _Child:
        raise NotImplementedError

    def describe(self) -> list[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopCounter(_Family[CounterChild]):
    """A labelled counter, written as prometheus_client's Counter writes it (name_total)."""

    def _new(self) -> CounterChild:
        return CounterChild()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> list[Metric]:
        family = self._family()
        created = _use_created()
        for key, child in self._series.items():
            family.add_metric(key, child.value, child.created if created else None)
        return [family]


class LoopHistogram(_Family[HistogramChild]):
    """A labelled histogram with fixed bounds (+Inf added), written as prometheus_client's
    Histogram writes it: cumulative _bucket samples, _count, _sum, _created."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry | None) -> None:  # fmt: skip
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if not bounds or bounds[-1] != INF:
            bounds.append(INF)
        if len(bounds) < 2 or bounds[0] < 0:  # HistogramMetricFamily writes no _sum below 0
            raise ValueError("Buckets need a bound >= 0 below +Inf")
        self.bounds = tuple(bounds)
        self._les = [floatToGoString(b) for b in bounds]
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> list[Metric]:
        family = self._family()
        created = _use_created()
        for key, child in self._series.items():
            acc = 0.0
            buckets = []
            for le, n in zip(self._les, child.counts):
                acc += n
                buckets.append((le, acc))
            family.add_metric(key, buckets, child.sum)
            if created:
                family.add_sample(self.name + "_created", dict(zip(self.labelnames, key)), child.created)
        return [family]

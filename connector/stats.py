"""What the workers report each step through vLLM's connector stats interface
(``get_kv_connector_stats`` -> ``KVConnectorOutput`` -> the scheduler's
``update_connector_output`` and ``SchedulerStats`` -> vLLM's stat loggers):

- buffer occupancy (a gauge, for the heartbeat and ``/metrics``): aggregating
  keeps the latest figure per worker rank, never a sum over time;
- per-step counters: transfers by role and result, failures by role and reason,
  bytes by direction, how long each successful load waited for its KV, and the
  control messages refused before being served (authentication, size), by reason.

``XpydPromMetrics`` turns those into Prometheus series on vLLM's own ``/metrics``
(``build_prom_metrics``); ``reduce`` is the line vLLM's periodic log prints.
The worker's threads record into a ``StatsRecorder``; each step the worker takes
a fresh ``XpydStats`` from it (vLLM may hold on to the object it gets).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
except ImportError:  # the engine without vLLM (GPU tests, benchmarks): counters still record

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        pass

    PromMetric = PromMetricT = Any  # type: ignore[misc,assignment]

from connector.transport.base import FALLBACK_REASONS, REFUSAL_REASONS

# Label values are fixed sets: Prometheus series must not grow with traffic.
Role = Literal["send", "load"]  # P ships KV (or stores it) / D takes KV in
ROLES: tuple[Role, ...] = ("send", "load")
# missed: shared storage found no (or only part of the) stored KV: recomputed.
# unneeded: D refused P's KV because no request there needed it any more (finished,
# aborted, or served from D's own prefix cache): not a failure.
Result = Literal["ok", "failed", "cancelled", "missed", "unneeded"]
RESULTS: tuple[Result, ...] = ("ok", "failed", "cancelled", "missed", "unneeded")
# refused: the receiving buffer said no (full, duplicate, already failed);
# unreachable: the peer was marked dead; transport: a call failed or timed out;
# timeout: D's load deadline passed; aborted: D learnt the KV will not come
# (P gave up, the payload expired or was refused); invalid: a payload that does
# not fit this cache; queue_full: a store dropped by back-pressure; io: a file
# could not be written; evicted: P's GET store pushed an unread payload out for a
# newer one; error: anything else.
Reason = Literal["refused", "unreachable", "transport", "timeout", "aborted", "invalid", "queue_full", "io",
                 "evicted", "error"]
REASONS: tuple[Reason, ...] = ("refused", "unreachable", "transport", "timeout", "aborted", "invalid",
                               "queue_full", "io", "evicted", "error")
Direction = Literal["sent", "received"]
DIRECTIONS: tuple[Direction, ...] = ("sent", "received")
# Why the KV control socket refused a message (see connector/transport/base.py).
REFUSALS = REFUSAL_REASONS

# From a same-host copy (ms) to the default kv_load_timeout_s (30 s) and beyond.
LOAD_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_COUNTERS = ("transfers", "failures", "bytes", "refused", "fallbacks")


def _empty() -> dict[str, Any]:
    # Plain dicts, str keys (rank keys are ints): msgpack carries them to the
    # API server's loggers as they are.
    return {"buffers": {}, "transfers": {}, "failures": {}, "bytes": {}, "refused": {}, "fallbacks": {},
            "load_wait_s": [], "legs": []}


@dataclass
class XpydStats(KVConnectorStats):
    """``data``: ``buffers`` {rank: [used, capacity]}, ``transfers``
    {"role/result": n}, ``failures`` {"role/reason": n}, ``bytes``
    {direction: n}, ``refused`` {reason: n}, ``fallbacks`` {reason: n} (a peer's KV moved
    from NCCL to the host-staged tcp path), ``load_wait_s`` [seconds, ...], ``legs`` (only while
    tracing is on: each request's send or load as its rank saw it, for its span; connector/tracing.py)
    [[role, request id, result, bytes, ms, wait_ms, reason, when (ns since the epoch)], ...]."""

    def __post_init__(self) -> None:
        base = _empty()
        for k, v in (self.data or {}).items():
            if k in base:
                base[k] = v
        self.data = base

    @classmethod
    def of(cls, rank: int, used_bytes: int, capacity_bytes: int) -> "XpydStats":
        s = cls()
        s.set_buffer(rank, used_bytes, capacity_bytes)
        return s

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "XpydStats":
        """A copy: vLLM hands the same payload to more than one logger."""
        d = data or {}
        return cls(data={
            "buffers": {r: list(v) for r, v in (d.get("buffers") or {}).items()},
            **{k: dict(d.get(k) or {}) for k in _COUNTERS},
            "load_wait_s": list(d.get("load_wait_s") or []),
            "legs": [list(x) for x in d.get("legs") or ()],
        })

    # ---- recording (single-threaded; StatsRecorder adds the lock) ----
    def set_buffer(self, rank: int, used_bytes: int, capacity_bytes: int) -> None:
        self.data["buffers"][rank] = [int(used_bytes), int(capacity_bytes)]

    def _inc(self, kind: str, key: str, n: int = 1) -> None:
        c = self.data[kind]
        c[key] = c.get(key, 0) + n

    def record_transfer(self, role: Role, result: Result) -> None:
        self._inc("transfers", f"{role}/{result}")

    def record_failure(self, role: Role, reason: Reason) -> None:
        self.record_transfer(role, "failed")
        self._inc("failures", f"{role}/{reason}")

    def record_bytes(self, direction: Direction, nbytes: int) -> None:
        if nbytes > 0:
            self._inc("bytes", direction, int(nbytes))

    def record_load_wait(self, seconds: float) -> None:
        self.data["load_wait_s"].append(max(0.0, float(seconds)))

    def record_refused(self, reason: str) -> None:
        self._inc("refused", reason)

    def record_fallback(self, reason: str) -> None:
        self._inc("fallbacks", reason)

    # ---- reading ----
    def transfers(self, role: str, result: str) -> int:
        return int(self.data["transfers"].get(f"{role}/{result}", 0))

    def failures(self, role: str, reason: str) -> int:
        return int(self.data["failures"].get(f"{role}/{reason}", 0))

    def nbytes(self, direction: str) -> int:
        return int(self.data["bytes"].get(direction, 0))

    def refused(self, reason: str) -> int:
        return int(self.data["refused"].get(reason, 0))

    def fallbacks(self, reason: str) -> int:
        return int(self.data["fallbacks"].get(reason, 0))

    def has_buffers(self) -> bool:
        return bool(self.data["buffers"])

    def buffer_usage(self) -> float:
        """Fraction (0..1) of the receive buffers promised or filled, over all workers."""
        bufs = self.data["buffers"].values()
        used = sum(u for u, _ in bufs)
        cap = sum(c for _, c in bufs)
        return min(1.0, used / cap) if cap > 0 else 0.0

    def has_events(self) -> bool:
        return any(self.data[k] for k in _COUNTERS) or bool(self.data["load_wait_s"]) or bool(self.data["legs"])

    # ---- vLLM's KVConnectorStats interface ----
    def reset(self) -> None:
        """Clear the per-step counters; the occupancy snapshot is a gauge and stays."""
        self.data = {**_empty(), "buffers": self.data.get("buffers", {})}

    def aggregate(self, other: KVConnectorStats) -> "XpydStats":
        """Merge another worker's or step's stats: counters add up, waits are
        concatenated, occupancy keeps the latest figure per rank."""
        if not isinstance(other, XpydStats):
            return self
        self.data["buffers"].update(other.data["buffers"])
        for kind in _COUNTERS:
            for k, n in other.data[kind].items():
                self._inc(kind, k, n)
        self.data["load_wait_s"].extend(other.data["load_wait_s"])
        self.data["legs"].extend(other.data["legs"])
        return self

    def reduce(self) -> dict[str, int | float]:
        """One log line's worth: totals for the interval, the mean and worst wait."""
        out: dict[str, int | float] = {}
        for k in sorted(self.data["transfers"]):
            out[f"transfers {k}"] = self.data["transfers"][k]
        for k in sorted(self.data["failures"]):
            out[f"failures {k}"] = self.data["failures"][k]
        for d in DIRECTIONS:
            if self.nbytes(d):
                out[f"MB {d}"] = round(self.nbytes(d) / 2**20, 3)
        for k in sorted(self.data["refused"]):
            out[f"refused {k}"] = self.data["refused"][k]
        for k in sorted(self.data["fallbacks"]):
            out[f"nccl fallbacks {k}"] = self.data["fallbacks"][k]
        waits = self.data["load_wait_s"]
        if waits:
            out["avg load wait (ms)"] = round(sum(waits) / len(waits) * 1e3, 3)
            out["max load wait (ms)"] = round(max(waits) * 1e3, 3)
        out["kv_buffer_used_bytes"] = sum(u for u, _ in self.data["buffers"].values())
        out["kv_buffer_usage"] = round(self.buffer_usage(), 4)
        return out

    def is_empty(self) -> bool:
        return not self.has_buffers() and not self.has_events()


class StatsRecorder:
    """Thread-safe front of one worker's counters (peer, transport, loader threads
    record; the worker thread takes a snapshot per step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = XpydStats()
        self.legs = False  # report each request's send/load (its span's numbers): on while tracing is

    def leg(self, role: Role, rid: str, ok: bool, nbytes: int = 0, ms: float = 0.0, wait_ms: float | None = None,
            reason: str | None = None) -> None:
        """One request's send or load ended on this rank (connector/tracing.py); a no-op unless tracing."""
        if self.legs:
            with self._lock:
                self._stats.data["legs"].append([role, rid, "ok" if ok else "failed", int(nbytes), float(ms),
                                                 wait_ms, reason, time.time_ns()])

    def transfer(self, role: Role, result: Result, nbytes: int = 0, direction: Direction | None = None) -> None:
        with self._lock:
            self._stats.record_transfer(role, result)
            if direction is not None:
                self._stats.record_bytes(direction, nbytes)

    def failure(self, role: Role, reason: Reason) -> None:
        with self._lock:
            self._stats.record_failure(role, reason)

    def moved(self, direction: Direction, nbytes: int) -> None:
        with self._lock:
            self._stats.record_bytes(direction, nbytes)

    def load_wait(self, seconds: float) -> None:
        with self._lock:
            self._stats.record_load_wait(seconds)

    def refused(self, reason: str) -> None:
        with self._lock:
            self._stats.record_refused(reason)

    def fallback(self, reason: str) -> None:
        with self._lock:
            self._stats.record_fallback(reason)

    def take(self, rank: int, used_bytes: int, capacity_bytes: int) -> XpydStats:
        """This step's counters plus the current occupancy, as a new object; the
        counters start again from zero."""
        with self._lock:
            out, self._stats = self._stats, XpydStats()
        out.set_buffer(rank, used_bytes, capacity_bytes)
        return out

    def peek(self) -> XpydStats:
        """A copy of the counters so far (tests)."""
        with self._lock:
            return XpydStats.from_dict(self._stats.data)


class XpydPromMetrics(KVConnectorPromMetrics):
    """The connector's series on vLLM's ``/metrics`` (labels ``model_name`` and
    ``engine`` come from vLLM, the rest are fixed sets, created up front so every
    series exists from the start):

    - ``vllm:xpyd_kv_transfers_total{role,result}``: transfers ended, by role
      (send: P shipped or stored a prompt's KV; load: D took it in) and result;
    - ``vllm:xpyd_kv_failures_total{role,reason}``: failed transfers by reason;
    - ``vllm:xpyd_kv_bytes_total{direction}``: KV bytes sent / received;
    - ``vllm:xpyd_kv_load_wait_seconds``: histogram of how long a successful load
      waited for its KV (from the step that planned it to the step that applied it);
    - ``vllm:xpyd_kv_buffer_usage``: receive buffer (P2P) or writer queue (shared
      storage) occupancy, 0..1, the figure the heartbeat reports;
    - ``vllm:xpyd_kv_refused_messages_total{reason}``: messages the KV control socket
      dropped before serving them (unauthenticated, bad_mac, stale, replay, handshake,
      oversized, malformed);
    - ``vllm:xpyd_kv_transport_fallbacks_total{reason}``: times a peer's KV moved from NCCL to
      the host-staged tcp path (setup, version, peer_no_nccl, transfers, abort_hung); NCCL is
      tried again later.
    """

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        engines = self.per_engine_labelvalues
        transfers = self._counter_cls(
            name="vllm:xpyd_kv_transfers",
            documentation="xPyD KV transfers ended, by role (send: P shipped/stored a prompt's KV; "
                          "load: D took it in) and result (ok, failed, cancelled, missed, unneeded).",
            labelnames=[*labelnames, "role", "result"])
        self.transfers = {i: {(ro, re): transfers.labels(*lv, ro, re) for ro in ROLES for re in RESULTS}
                          for i, lv in engines.items()}
        failures = self._counter_cls(
            name="vllm:xpyd_kv_failures",
            documentation="xPyD KV transfers that failed, by role and reason.",
            labelnames=[*labelnames, "role", "reason"])
        self.failures = {i: {(ro, re): failures.labels(*lv, ro, re) for ro in ROLES for re in REASONS}
                         for i, lv in engines.items()}
        nbytes = self._counter_cls(
            name="vllm:xpyd_kv_bytes",
            documentation="xPyD KV cache bytes moved, by direction (sent, received).",
            labelnames=[*labelnames, "direction"])
        self.bytes = {i: {d: nbytes.labels(*lv, d) for d in DIRECTIONS} for i, lv in engines.items()}
        wait = self._histogram_cls(
            name="vllm:xpyd_kv_load_wait_seconds",
            documentation="How long decode waited for a prompt's KV (successful loads).",
            buckets=list(LOAD_WAIT_BUCKETS),
            labelnames=labelnames)
        self.load_wait = {i: wait.labels(*lv) for i, lv in engines.items()}
        usage = self._gauge_cls(
            name="vllm:xpyd_kv_buffer_usage",
            documentation="xPyD KV buffer occupancy (P2P receive buffer or storage writer queue), 0..1.",
            multiprocess_mode="mostrecent",
            labelnames=labelnames)
        self.buffer_usage = {i: usage.labels(*lv) for i, lv in engines.items()}
        refused = self._counter_cls(
            name="vllm:xpyd_kv_refused_messages",
            documentation="Messages the xPyD KV control socket dropped before serving them, by reason "
                          "(unauthenticated, bad_mac, stale, replay, handshake, oversized, malformed).",
            labelnames=[*labelnames, "reason"])
        self.refused = {i: {r: refused.labels(*lv, r) for r in REFUSALS} for i, lv in engines.items()}
        fallbacks = self._counter_cls(
            name="vllm:xpyd_kv_transport_fallbacks",
            documentation="Times a peer's KV moved from NCCL to the host-staged tcp path, by reason (setup, "
                          "version, peer_no_nccl, transfers, abort_hung); NCCL is tried again later.",
            labelnames=[*labelnames, "reason"])
        self.fallbacks = {i: {r: fallbacks.labels(*lv, r) for r in FALLBACK_REASONS} for i, lv in engines.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        s = XpydStats.from_dict(transfer_stats_data)
        for key, n in s.data["transfers"].items():
            child = self.transfers[engine_idx].get(tuple(key.split("/", 1)))
            if child is not None and n > 0:
                child.inc(n)
        for key, n in s.data["failures"].items():
            child = self.failures[engine_idx].get(tuple(key.split("/", 1)))
            if child is not None and n > 0:
                child.inc(n)
        for d, n in s.data["bytes"].items():
            child = self.bytes[engine_idx].get(d)
            if child is not None and n > 0:
                child.inc(n)
        for r, n in s.data["refused"].items():
            child = self.refused[engine_idx].get(r)
            if child is not None and n > 0:
                child.inc(n)
        for r, n in s.data["fallbacks"].items():
            child = self.fallbacks[engine_idx].get(r)
            if child is not None and n > 0:
                child.inc(n)
        for w in s.data["load_wait_s"]:
            self.load_wait[engine_idx].observe(w)
        if s.has_buffers():
            self.buffer_usage[engine_idx].set(s.buffer_usage())


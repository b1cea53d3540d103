"""The connector's metrics through vLLM's connector stats interface: XpydStats
(aggregate / reduce / reset, the payload's trip through msgpack), the recorder the
worker threads feed, what real engines record for real transfers (P2P over
loopback TCP, shared storage on real files), and the Prometheus series vLLM's own
KVConnectorProm / KVConnectorLogging build from them via the connector class."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

from connector.p2p.connector import P2pNcclConnector
from connector.shared_storage.connector import SharedStorageConnector
from connector.shared_storage.metadata import FetchSpec, StoreSpec
from connector.stats import LOAD_WAIT_BUCKETS, StatsRecorder, XpydPromMetrics, XpydStats
from tests.support import kv_engines as te
from tests.support import shared_storage_engines as tse
from tests.support.connector_log import connector_log
from tests.support.connector_stats import p2p_config, registry_prom
from tests.support.layerwise import LAYERS


def step(rank=0, used=0, cap=1000, sent=(), loaded=(), failed=(), sent_bytes=0, recv_bytes=0) -> XpydStats:
    s = XpydStats.of(rank, used, cap)
    for _ in sent:
        s.record_transfer("send", "ok")
    for w in loaded:
        s.record_transfer("load", "ok")
        s.record_load_wait(w)
    for role, reason in failed:
        s.record_failure(role, reason)
    s.record_bytes("sent", sent_bytes)
    s.record_bytes("received", recv_bytes)
    return s


# ================================================================ XpydStats


def test_aggregate_adds_counters_concatenates_waits_and_keeps_latest_occupancy():
    a = step(0, used=300, sent=[1], loaded=[0.01], failed=[("load", "timeout")], sent_bytes=100, recv_bytes=40)
    b = step(1, used=100, sent=[1, 1], loaded=[0.5, 0.02], failed=[("load", "timeout"), ("send", "refused")],
             sent_bytes=50)
    c = step(0, used=0)  # a later step of rank 0: occupancy replaced, no events
    out = a.aggregate(b).aggregate(c)
    assert out is a
    assert out.transfers("send", "ok") == 3 and out.transfers("load", "ok") == 3
    # a failure is a transfer that ended "failed", and counted by reason
    assert out.transfers("load", "failed") == 2 and out.transfers("send", "failed") == 1
    assert out.failures("load", "timeout") == 2 and out.failures("send", "refused") == 1
    assert out.nbytes("sent") == 150 and out.nbytes("received") == 40
    assert sorted(out.data["load_wait_s"]) == [0.01, 0.02, 0.5]
    assert out.data["buffers"] == {0: [0, 1000], 1: [100, 1000]}
    assert out.buffer_usage() == pytest.approx(0.05)
    assert out.aggregate(object()) is out  # another connector's stats are ignored


def test_reduce_summarises_an_interval():
    s = step(0, used=250, cap=1000, sent=[1], loaded=[0.010, 0.030], failed=[("load", "aborted")],
             sent_bytes=3 * 2**20, recv_bytes=2**20)
    assert s.reduce() == {
        "transfers load/failed": 1, "transfers load/ok": 2, "transfers send/ok": 1,
        "failures load/aborted": 1,
        "MB sent": 3.0, "MB received": 1.0,
        "avg load wait (ms)": 20.0, "max load wait (ms)": 30.0,
        "kv_buffer_used_bytes": 250, "kv_buffer_usage": 0.25,
    }
    # an interval without events reports only the occupancy
    assert XpydStats.of(0, 10, 100).reduce() == {"kv_buffer_used_bytes": 10, "kv_buffer_usage": 0.1}


def test_reset_clears_counters_but_keeps_the_occupancy_snapshot():
    s = step(0, used=500, sent=[1], loaded=[0.1], failed=[("send", "transport")], sent_bytes=9)
    s.reset()
    assert not s.has_events() and not s.is_empty()
    assert s.transfers("send", "ok") == 0 and s.nbytes("sent") == 0 and s.data["load_wait_s"] == []
    assert s.buffer_usage() == pytest.approx(0.5)


def test_is_empty():
    assert XpydStats().is_empty()
    assert XpydStats.from_dict(None).is_empty()
    assert not XpydStats.of(0, 0, 10).is_empty()  # occupancy alone is news for the heartbeat
    only_events = XpydStats()
    only_events.record_transfer("load", "cancelled")
    assert not only_events.is_empty() and not only_events.has_buffers()


def test_payload_survives_msgpack_and_from_dict_copies():
    """SchedulerStats carries to_dict() to the API server's loggers over msgpack;
    every logger builds its own object from the same dict."""
    s = step(1, used=7, sent=[1], loaded=[0.25], failed=[("load", "invalid")], recv_bytes=11)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(s.to_dict()))
    back = XpydStats.from_dict(wire)
    assert back.data == s.data
    back.aggregate(step(1, sent=[1], loaded=[0.5]))
    assert XpydStats.from_dict(wire).data == s.data  # the wire dict was not touched
    assert P2pNcclConnector.build_kv_connector_stats(wire).data == s.data
    assert SharedStorageConnector.build_kv_connector_stats(None).is_empty()


def test_recorder_take_hands_out_a_step_and_starts_again():
    rec = StatsRecorder()
    n_threads, per_thread = 4, 500

    def work():
        for _ in range(per_thread):
            rec.transfer("send", "ok", 3, "sent")
            rec.failure("load", "timeout")
            rec.load_wait(0.001)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    first = rec.take(rank=2, used_bytes=5, capacity_bytes=10)
    total = n_threads * per_thread
    assert first.transfers("send", "ok") == total and first.nbytes("sent") == 3 * total
    assert first.failures("load", "timeout") == total and len(first.data["load_wait_s"]) == total
    assert first.data["buffers"] == {2: [5, 10]}
    second = rec.take(rank=2, used_bytes=0, capacity_bytes=10)
    assert not second.has_events() and second.buffer_usage() == 0.0
    first.reset()  # the caller's object is its own
    assert rec.peek().is_empty()


# ================================================================ what real engines record


def kv_bytes(n_blocks: int) -> int:
    """Bytes of n prompt blocks over the test caches' layers (what goes on the wire)."""
    caches = te.make_caches(0)
    return sum(t[0].numel() * t.element_size() for t in caches.values()) * n_blocks


@pytest.mark.parametrize("send_type", ["PUT_ASYNC", "PUT", "GET"])
def test_p2p_transfer_is_counted_on_both_sides(engines, send_type):
    prod, cons = engines("kv_producer", send_type, seed=1), engines("kv_consumer", send_type, seed=2)
    t0 = time.monotonic()
    prod.save(te.save_spec(prod, te.rank0(cons)))
    te.plan_load(cons, te.load_spec(te.rank0(prod), (7, 2, 11), 2))
    te.poll_until(cons, lambda r: "D-req" in r.finished_recving)
    waited = time.monotonic() - t0
    # P's count lands when its send ends (GET: when D released the payload).
    te.wait_for(lambda: prod.xfer_stats.peek().transfers("send", "ok") == 1)
    p, d = prod.xfer_stats.take(0, 0, 1), cons.xfer_stats.take(0, 0, 1)
    whole_prompt = kv_bytes(len(te.SRC_IDS))  # P ships the whole prompt; D uses blocks 2..
    assert p.nbytes("sent") == whole_prompt and d.nbytes("received") == whole_prompt
    assert p.data["transfers"] == {"send/ok": 1} and p.nbytes("received") == 0
    assert d.data["transfers"] == {"load/ok": 1} and d.data["failures"] == {}
    assert len(d.data["load_wait_s"]) == 1 and 0 < d.data["load_wait_s"][0] <= waited


def test_p2p_load_deadline_counts_a_timeout(engines):
    cons = engines("kv_consumer", kv_load_timeout_s=0.2)
    te.plan_load(cons, te.load_spec("127.0.0.1:9", (1, 2, 3), 2))  # nobody sends
    res, _ = te.poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    d = cons.xfer_stats.take(0, 0, 1)
    assert d.data["transfers"] == {"load/failed": 1} and d.data["failures"] == {"load/timeout": 1}
    assert d.data["load_wait_s"] == [] and d.nbytes("received") == 0


def test_p2p_refused_send_counts_on_p_and_aborts_on_d(engines):
    """D's buffer is too small: P's reservation is refused (send/refused), D learns the
    KV will not come and fails its load at once (load/aborted), not at its deadline."""
    prod = engines("kv_producer", seed=1)
    cons = engines("kv_consumer", seed=2, kv_buffer_size=1024, kv_load_timeout_s=30.0)
    prod.save(te.save_spec(prod, te.rank0(cons)))
    te.plan_load(cons, te.load_spec(te.rank0(prod), (7, 2, 11), 2))
    res, _ = te.poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    te.wait_for(lambda: prod.xfer_stats.peek().transfers("send", "failed") == 1)
    assert prod.xfer_stats.peek().data["failures"] == {"send/refused": 1}
    d = cons.xfer_stats.peek()
    assert d.data["failures"] == {"load/aborted": 1} and d.nbytes("received") == 0


@pytest.mark.parametrize("granularity", ["request", "layer"])
def test_p2p_send_nobody_needs_any_more_is_unneeded_not_failed(engines, granularity):
    """D released the key before P's KV came (its request found the whole prompt in its own
    prefix cache, finished or was aborted): P's send is refused as unneeded, neither side
    counts a failure, and P says so at INFO, not as a refused send."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity=granularity)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    cons.release([te.KEY])
    cons.poll(set())
    spec = te.save_spec(prod, te.rank0(cons))
    with connector_log() as log:
        if granularity == "layer":
            for name in LAYERS:
                prod.save_layer(spec, name)
        prod.save(spec)
        te.wait_for(lambda: prod.xfer_stats.peek().transfers("send", "unneeded") == 1)
    p, d = prod.xfer_stats.peek(), cons.xfer_stats.peek()
    assert p.data["transfers"] == {"send/unneeded": 1} and p.data["failures"] == {}
    assert d.data["failures"] == {} and d.nbytes("received") == 0
    assert [ln for ln in log.lines if "kv send" in ln and te.KEY in ln][0].startswith("kv send not needed")
    assert not [ln for ln in log.lines if "refused" in ln or "failed" in ln]


def test_p2p_unreachable_decode_counts_a_transport_failure(engines):
    prod = engines("kv_producer", send_timeout_s=0.5)
    prod.save(te.save_spec(prod, f"127.0.0.1:{te.dead_port()}"))  # nobody listens there
    te.wait_for(lambda: prod.xfer_stats.peek().transfers("send", "failed") == 1)
    p = prod.xfer_stats.peek()
    assert p.data["failures"] == {"send/transport": 1} and p.nbytes("sent") == 0


def test_shared_storage_store_load_and_miss_are_counted(tmp_path: Path):
    a, b = tse.caches(1), tse.caches(2)
    ea, eb = tse.engine(tmp_path, a), tse.engine(tmp_path, b)
    try:
        ks = tse.chain(3)
        assert ea.submit_store(StoreSpec("p", (3, 4, 9), ks, 0))
        assert ea.flush(10)
        eb.submit_load(FetchSpec("d", (7, 0, 5), ks, 0, 0.0))
        tse.wait_poll(eb, "d")
        eb.submit_load(FetchSpec("d2", (1, 2), tse.chain(2, salt=9), 0, 0.0))  # never stored
        tse.wait_poll(eb, "d2")
        s, d = ea.xfer_stats.take(0, 0, 1), eb.xfer_stats.take(0, 0, 1)
        assert s.data["transfers"] == {"send/ok": 1} and s.nbytes("sent") == 3 * ea.block_bytes
        assert d.data["transfers"] == {"load/ok": 1, "load/missed": 1}
        assert d.nbytes("received") == 3 * eb.block_bytes and len(d.data["load_wait_s"]) == 1
    finally:
        ea.close()
        eb.close()


# ================================================================ Prometheus and the log line, as vLLM builds them


@pytest.mark.parametrize("name", ["P2pNcclConnector", "SharedStorageConnector"])
def test_vllm_prom_logger_exposes_the_connector_series(name):
    reg = CollectorRegistry()
    prom = registry_prom(reg)(p2p_config(name=name), ["model_name", "engine"],
                              {0: ["tiny", "0"], 1: ["tiny", "1"]})
    assert isinstance(prom.prom_metrics, XpydPromMetrics)

    def val(metric, **labels):
        return reg.get_sample_value(metric, {"model_name": "tiny", **labels})

    # every fixed series exists at 0 before the first transfer
    assert val("vllm:xpyd_kv_transfers_total", engine="0", role="load", result="ok") == 0
    assert val("vllm:xpyd_kv_failures_total", engine="1", role="send", reason="unreachable") == 0
    assert val("vllm:xpyd_kv_bytes_total", engine="0", direction="received") == 0

    prom.observe(step(0, used=250, cap=1000, loaded=[0.003, 0.2], recv_bytes=4096,
                      failed=[("load", "timeout")]).to_dict(), engine_idx=0)
    prom.observe(step(0, used=0, loaded=[0.004], recv_bytes=1000).to_dict(), engine_idx=0)
    prom.observe(step(1, sent=[1, 1], sent_bytes=77).to_dict(), engine_idx=1)
    assert val("vllm:xpyd_kv_transfers_total", engine="0", role="load", result="ok") == 3
    assert val("vllm:xpyd_kv_transfers_total", engine="0", role="load", result="failed") == 1
    assert val("vllm:xpyd_kv_failures_total", engine="0", role="load", reason="timeout") == 1
    assert val("vllm:xpyd_kv_bytes_total", engine="0", direction="received") == 5096
    assert val("vllm:xpyd_kv_transfers_total", engine="1", role="send", result="ok") == 2
    assert val("vllm:xpyd_kv_bytes_total", engine="1", direction="sent") == 77
    assert val("vllm:xpyd_kv_transfers_total", engine="1", role="load", result="ok") == 0
    assert val("vllm:xpyd_kv_load_wait_seconds_count", engine="0") == 3
    assert val("vllm:xpyd_kv_load_wait_seconds_sum", engine="0") == pytest.approx(0.207)
    assert val("vllm:xpyd_kv_load_wait_seconds_bucket", engine="0", le="0.005") == 2
    assert val("vllm:xpyd_kv_load_wait_seconds_bucket", engine="0", le="0.25") == 3
    assert val("vllm:xpyd_kv_load_wait_seconds_count", engine="1") == 0
    assert val("vllm:xpyd_kv_buffer_usage", engine="0") == 0.0  # the latest step's figure
    les = {s.labels["le"] for m in reg.collect() if m.name == "vllm:xpyd_kv_load_wait_seconds"
           for s in m.samples if "le" in s.labels}
    assert les == {str(b) for b in LOAD_WAIT_BUCKETS} | {"+Inf"}


def test_vllm_prom_logger_ignores_label_values_outside_the_fixed_sets():
    reg = CollectorRegistry()
    prom = registry_prom(reg)(p2p_config(), ["model_name", "engine"], {0: ["tiny", "0"]})
    foreign = XpydStats.from_dict({"transfers": {"send/teleported": 5, "nonsense": 1},
                                   "failures": {"load/cosmic_ray": 2}, "bytes": {"sideways": 3}})
    prom.observe(foreign.to_dict(), 0)
    names = {s.labels.get("result") for m in reg.collect() for s in m.samples}
    assert "teleported" not in names
    assert reg.get_sample_value("vllm:xpyd_kv_transfers_total",
                                {"model_name": "tiny", "engine": "0", "role": "send", "result": "ok"}) == 0


def test_vllm_log_line_sums_an_interval():
    log = KVConnectorLogging(p2p_config().kv_transfer_config)
    log.observe(step(0, used=100, loaded=[0.01], recv_bytes=2**20).to_dict())
    log.observe(step(0, used=300, loaded=[0.03], recv_bytes=2**20, failed=[("load", "timeout")]).to_dict())
    lines: list[str] = []
    log.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: transfers load/failed=1, transfers load/ok=2, "
                     "failures load/timeout=1, MB received=2.0, avg load wait (ms)=20.0, "
                     "max load wait (ms)=30.0, kv_buffer_used_bytes=300, kv_buffer_usage=0.3"]
    log.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # reset after logging


def test_every_connector_series_the_dashboard_queries_is_exposed():
    """The Grafana dashboard's vllm:xpyd_* names against what build_prom_metrics
    registers (the launcher e2e test checks the same against live instances)."""
    from prometheus_client import generate_latest

    from tests.support.launcher_helpers import dashboard_metrics, exposed_metrics

    reg = CollectorRegistry()
    registry_prom(reg)(p2p_config(), ["model_name", "engine"], {0: ["tiny", "0"]})
    wanted = {n for n in dashboard_metrics() if n.startswith("vllm:xpyd_")}
    assert len(wanted) >= 5
    assert wanted <= exposed_metrics(generate_latest(reg).decode()), wanted


def test_transport_fallbacks_reach_the_prometheus_series():
    """A peer's KV moved from NCCL to the host-staged tcp path: counted by reason per worker,
    added up over workers and steps, and exposed as xpyd_kv_transport_fallbacks_total."""
    rec = StatsRecorder()
    rec.fallback("setup")
    rec.fallback("transfers")
    a = rec.take(0, 0, 1000)
    b = XpydStats.of(1, 0, 1000)
    b.record_fallback("setup")
    merged = XpydStats.from_dict(msgspec.msgpack.decode(msgspec.msgpack.encode(a.data))).aggregate(b)
    assert merged.fallbacks("setup") == 2 and merged.fallbacks("transfers") == 1
    assert merged.reduce()["nccl fallbacks setup"] == 2
    reg = CollectorRegistry()
    prom = registry_prom(reg)(p2p_config(), ["model_name", "engine"], {0: ["tiny", "0"]})

    def val(reason):
        return reg.get_sample_value("vllm:xpyd_kv_transport_fallbacks_total",
                                    {"model_name": "tiny", "engine": "0", "reason": reason})

    assert val("abort_hung") == 0 and val("setup") == 0  # every series exists from the start
    prom.observe(merged.to_dict(), 0)
    prom.observe(XpydStats.from_dict({"fallbacks": {"teleport": 3}}).to_dict(), 0)  # not a known reason: ignored
    assert val("setup") == 2 and val("transfers") == 1 and val("version") == 0

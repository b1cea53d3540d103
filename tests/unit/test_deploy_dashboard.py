"""The Grafana dashboard (configs/grafana/xpyd-dashboard.json) only queries metrics that
exist: the proxy's names against a real proxy's /metrics here; the vLLM instances' names
against live instances in tests/e2e/test_e2e_launcher.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from tests.support.cluster import free_port  # noqa: E402
from tests.support.launcher_helpers import DASHBOARD, ROOT, dashboard_metrics, exposed_metrics


def test_dashboard_is_valid_and_covers_proxy_and_connector():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "xpyd" and dash["panels"]
    names = dashboard_metrics()
    for want in ("xpyd_requests_total", "xpyd_phase_duration_seconds_bucket", "xpyd_instances",
                 "xpyd_instance_in_flight", "xpyd_upstream_errors_total",
                 "vllm:prompt_tokens_cached_by_source_total", "vllm:num_requests_kv_fetch_by_stage",
                 # the connector's own series (connector/stats.py, via vLLM's build_prom_metrics)
                 "vllm:xpyd_kv_transfers_total", "vllm:xpyd_kv_bytes_total", "vllm:xpyd_kv_failures_total",
                 "vllm:xpyd_kv_load_wait_seconds_bucket", "vllm:xpyd_kv_buffer_usage"):
        assert want in names
    for p in dash["panels"]:
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_every_proxy_metric_in_the_dashboard_exists():
    port, disc = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port),
                             "--discovery-host", "127.0.0.1", "--discovery-port", str(disc)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240  # a proxy's start took over 120 s at load 34
        while True:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, "proxy did not start"
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    wanted = {n for n in dashboard_metrics() if n.startswith("xpyd_")}
    assert wanted and wanted <= exposed_metrics(text), wanted - exposed_metrics(text)

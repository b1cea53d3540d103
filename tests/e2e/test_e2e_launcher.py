"""The launcher as users run it: `xpyd launch up 1p2d` (the console script of this checkout
installed as its wheel installs it, tests/support/launcher_helpers.install_xpyd) brings up the proxy
and 1 P + 2 D real vLLM (CPU build) servers from configs/topologies/1p2d.yaml, `vllm bench
serve` (its own code, scripts/bench_serve.py) sends 20 requests through the proxy, and a
SIGTERM to the launcher stops every process it started. Also: an instance that cannot start
is reported with its log tail, and Ctrl-C during start-up leaves nothing behind.

One launch for the module (vLLM start-up dominates); the SIGTERM test runs last.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.e2e_client import MODEL_DIR, metric
from tests.support.launcher_helpers import (
    READY_LINE,
    ROOT,
    InstalledXpyd,
    LauncherRun,
    dashboard_metrics,
    descendants,
    exposed_metrics,
    free_port_offset,
    in_groups,
    install_xpyd,
    still_running,
)
from xpyd_deploy.topology import load_topology

pytestmark = pytest.mark.vllm
BENCH_PROMPTS = 20


@pytest.fixture(scope="module")
def xpyd(tmp_path_factory: pytest.TempPathFactory) -> InstalledXpyd:
    return install_xpyd(tmp_path_factory.mktemp("xpyd-install"))


def xpyd_launch(xpyd: InstalledXpyd, args: list[str]) -> LauncherRun:
    return LauncherRun.start(args, command=xpyd.command("launch"), extra_env=xpyd.env())


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, xpyd: InstalledXpyd):
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    offset = free_port_offset(load_topology("1p2d"))
    topo = load_topology("1p2d").with_port_offset(offset)
    log_dir = Path(tmp_path_factory.mktemp("launch-1p2d"))
    run = xpyd_launch(xpyd, ["up", "1p2d", "--port-offset", str(offset), "--log-dir", str(log_dir)])
    try:
        run.wait_for(READY_LINE, timeout=600)
        yield run, topo, log_dir
    finally:
        run.kill()


def test_startup_output_names_every_process_and_log(launched):
    run, topo, log_dir = launched
    assert Path(run.proc.args[0]).name == "xpyd" and run.proc.args[1] == "launch"  # the console script
    out = run.output()
    for name in ("proxy", "prefill-0", "decode-0", "decode-1"):
        assert f"started {name} " in out and f"{name} healthy" in out
        assert (log_dir / f"{name}.log").stat().st_size > 0
    assert '"choices"' in out  # the one completion the launcher sends through the proxy


def test_vllm_bench_serve_through_proxy(launched, tmp_path: Path):
    run, topo, _ = launched
    proxy = topo.proxies[0]
    before = {d.name: metric(d.url, "vllm:prompt_tokens_cached_by_source_total", {"source": "p2p"})
              for d in topo.by_role("D")}
    cmd = [sys.executable, "-m", "scripts.bench_serve", "--backend", "openai",
           "--base-url", proxy.url, "--model", topo.served_model_name, "--tokenizer", str(MODEL_DIR),
           "--dataset-name", "random", "--random-input-len", "400", "--random-output-len", "16",
           "--num-prompts", str(BENCH_PROMPTS), "--max-concurrency", "4", "--ignore-eos", "--seed", "1",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    t0 = time.monotonic()
    bench = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    print(f"bench serve: {result['completed']} completed, {result['failed']} failed in "
          f"{time.monotonic() - t0:.1f}s; output {result.get('output_throughput', 0):.1f} tok/s, "
          f"median TTFT {result.get('median_ttft_ms', 0):.0f} ms")
    assert result["completed"] == BENCH_PROMPTS and result["failed"] == 0, result.get("errors")
    # Through P and both D: each D loaded prompts over the connector, the proxy counted 200s.
    for d in topo.by_role("D"):
        got = metric(d.url, "vllm:prompt_tokens_cached_by_source_total", {"source": "p2p"}) - before[d.name]
        assert got > 0, f"{d.name} loaded no KV from P"
    assert metric(proxy.url, "xpyd_requests_total", {"status": "200"}) >= BENCH_PROMPTS


def test_proxy_indexes_every_instances_kv_events(launched):
    """The topology turns KV events on: after the bench, the proxy holds a known, non-empty
    block index of P (it prefilled 200-token prompts) and a known one of each D."""
    _, topo, _ = launched
    proxy = topo.proxies[0]
    entries = httpx.get(proxy.url + "/instances", timeout=10).json()
    assert len(entries) == len(topo.instances)
    for e in entries:
        assert e["kv_events"] is not None and e["kv_events"]["state"] == "known", e
        assert e["kv_events"]["dropped"] == 0 and e["kv_events"]["cap"] > 0
    assert any(e["role"] == "P" and e["kv_events"]["blocks"] > 0 for e in entries)


def test_every_vllm_metric_in_the_dashboard_exists(launched):
    """The dashboard's KV-transfer panels read the instances' own /metrics (after the bench)."""
    _, topo, _ = launched
    wanted = {n for n in dashboard_metrics() if n.startswith("vllm:")}
    exposed: set[str] = set()
    for inst in topo.instances:
        exposed |= exposed_metrics(httpx.get(inst.url + "/metrics", timeout=10).text)
    assert wanted and wanted <= exposed, wanted - exposed


def test_sigterm_stops_everything(launched):
    """Last in the module: SIGTERM to the launcher's PID, no process of its tree survives."""
    run, topo, _ = launched
    tree = descendants(run.proc.pid)
    # proxy + 3 API servers, each with its EngineCore (and more) below it
    assert len(tree) >= 7, tree
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    rc = run.wait_exit(timeout=90)
    took = time.monotonic() - t0
    print(f"launcher exited rc={rc} {took:.1f}s after SIGTERM ({len(tree)} processes below it)")
    assert rc == 0, run.output()[-3000:]
    assert still_running(tree) == []
    groups = run.started_pids()
    assert len(groups) == 1 + len(topo.instances)
    assert in_groups(groups) == []
    assert "stopped" in run.lines[-1]


def _bad_topology(tmp_path: Path, bad_arg: str) -> tuple[Path, int]:
    data = yaml.safe_load((ROOT / "configs" / "topologies" / "1p1d.yaml").read_text())
    data["name"] = "bad"
    data["instances"][0]["args"] = [bad_arg]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, free_port_offset(load_topology(path), start=3000)


def test_instance_that_cannot_start_is_reported_with_its_log(tmp_path: Path, xpyd: InstalledXpyd):
    path, offset = _bad_topology(tmp_path, "--no-such-flag-xpyd")
    run = xpyd_launch(xpyd, ["up", str(path), "--port-offset", str(offset), "--log-dir", str(tmp_path / "logs")])
    try:
        rc = run.wait_exit(timeout=300)
        out = run.output()
        assert rc == 1, out
        assert "prefill-0 exited during start-up" in out
        assert "no-such-flag-xpyd" in out.split("prefill-0 exited during start-up", 1)[1]  # the log tail
        assert "stopped" in run.lines[-1]
        # decode-0 was still starting: it was stopped too.
        assert "decode-0 healthy" not in out
        assert in_groups(run.started_pids()) == []
    finally:
        run.kill()


def test_ctrl_c_during_startup_leaves_nothing(tmp_path: Path, xpyd: InstalledXpyd):
    path, offset = _bad_topology(tmp_path, "--seed=0")  # a good topology
    run = xpyd_launch(xpyd, ["up", str(path), "--port-offset", str(offset), "--log-dir", str(tmp_path / "logs")])
    try:
        run.wait_for(r"started decode-0", timeout=60)
        time.sleep(3)  # vLLM is importing, its processes are being created
        tree = descendants(run.proc.pid)
        run.proc.send_signal(signal.SIGINT)
        assert run.wait_exit(timeout=60) == 0
        assert "signal received during start-up" in run.output()
        assert still_running(tree) == []
        assert in_groups(run.started_pids()) == []
    finally:
        run.kill()

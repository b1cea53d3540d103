"""Multi-node on loopback (configs/topologies/multinode.yaml): every process on its own
address (127.0.0.11-14 stand in for four hosts), one launcher per "host" (`--only`), two
proxies behind one load balancer (scripts/tcp_lb.py on 127.0.0.10), every instance
registered with both proxies. Requests through the balancer reach P and D on their own
addresses, KV moves P -> D between those addresses, and stopping one proxy costs clients
nothing. Real vLLM (CPU build), real discovery, real KV transfer. The proxies run with their
defaults: clients are told no address (headers, ids, /instances).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from e2e_client import MODEL_DIR, metric
from launcher_helpers import READY_LINE, ROOT, LauncherRun, free_port_offset, in_groups

sys.path.insert(0, str(ROOT / "scripts"))
from topology import load_topology  # noqa: E402  (scripts/topology.py)

pytestmark = pytest.mark.vllm
LB_HOST = "127.0.0.10"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    base = load_topology("multinode")
    offset = free_port_offset(base, start=2000)
    topo = base.with_port_offset(offset)
    log_dir = Path(tmp_path_factory.mktemp("multinode"))
    lb_port = topo.proxies[0].port
    runs: dict[str, LauncherRun] = {}
    lb = None
    try:
        for name in ("proxy-a", "proxy-b", "prefill-0", "decode-0"):
            runs[name] = LauncherRun.start(["up", "multinode", "--only", name, "--port-offset", str(offset),
                                            "--log-dir", str(log_dir / name)])
        for run in runs.values():
            run.wait_for(READY_LINE, timeout=600)
        lb = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "tcp_lb.py"), "--listen",
                               f"{LB_HOST}:{lb_port}"] +
                              [a for p in topo.proxies for a in ("--backend", f"{p.host}:{p.port}")],
                              stdout=open(log_dir / "lb.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(f"http://{LB_HOST}:{lb_port}/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or lb.poll() is not None:
                    raise
                time.sleep(0.2)
        yield topo, runs, f"http://{LB_HOST}:{lb_port}"
    finally:
        if lb is not None:
            lb.send_signal(signal.SIGTERM)
            lb.wait(timeout=10)
        for run in runs.values():
            run.kill()


def _complete(url: str, i: int) -> httpx.Response:
    body = {"model": "tiny-llama", "prompt": f"request {i}: the river stone maple quiet engine silver garden " * 8,
            "max_tokens": 8, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_every_instance_registered_with_both_proxies(hosts):
    topo, _, _ = hosts
    for p in topo.proxies:
        raw = httpx.get(p.url + "/instances", timeout=5).text
        listed = json.loads(raw)
        assert sorted(i["role"] for i in listed) == sorted(i.role for i in topo.instances), p.name
        assert all(i["healthy"] and i["label"] for i in listed)
        assert not any(i.host in raw for i in topo.instances)  # a summary, no addresses


def test_requests_through_the_balancer_reach_both_proxies(hosts):
    topo, _, lb_url = hosts
    before = {p.name: metric(p.url, "xpyd_requests_total", {"status": "200"}) for p in topo.proxies}
    (pre,), (dec,) = topo.by_role("P"), topo.by_role("D")
    for i in range(6):
        r = _complete(lb_url, i)
        assert r.status_code == 200, r.text
        data = r.json()
        # The client sees a neutral id (vLLM's "cmpl-{X-Request-Id}" with the uuid) and no address.
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        assert data["id"] == "cmpl-" + r.headers["x-request-id"]
        assert not any(h in r.text or h in str(r.headers) for h in (pre.host, dec.host))
        # KV went from P's engine on its address to D's engine on its address (the request
        # id named both: D loaded all but the last prompt token, P pushed it there).
        xpyd = data["kv_transfer_params"]["xpyd"]
        assert xpyd["load_failed"] is False and xpyd["loaded_tokens"] == data["usage"]["prompt_tokens"] - 1
    served = {p.name: metric(p.url, "xpyd_requests_total", {"status": "200"}) - before[p.name]
              for p in topo.proxies}
    assert sum(served.values()) == 6 and all(v >= 2 for v in served.values()), served


def test_one_proxy_stopped_clients_see_no_error(hosts):
    topo, runs, lb_url = hosts
    runs["proxy-b"].proc.send_signal(signal.SIGTERM)
    assert runs["proxy-b"].wait_exit(timeout=60) == 0
    for i in range(4):
        r = _complete(lb_url, 100 + i)
        assert r.status_code == 200, r.text
    assert metric(topo.proxies[0].url, "xpyd_instances", {"role": "D"}) == 1


def test_every_host_stops_on_sigterm(hosts):
    _, runs, _ = hosts
    groups = set()
    for run in runs.values():
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGTERM)
    for name, run in runs.items():
        assert run.wait_exit(timeout=90) == 0, name
        groups |= run.started_pids()
    assert len(groups) == 4
    assert in_groups(groups) == []

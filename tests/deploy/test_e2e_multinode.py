"""Multi-node on loopback (configs/topologies/multinode.yaml): every process on its own
address (127.0.0.11-14 stand in for four hosts), one launcher per "host" (`--only`), two
proxies behind haproxy (127.0.0.10, its configuration rendered by scripts/haproxy_cfg.py
as configs/haproxy/multinode.cfg is), every instance registered with both proxies.
Requests through haproxy reach both proxies and P and D on their own addresses, KV moves
P -> D between those addresses; a proxy stopped (SIGTERM: it drains) or killed while
clients keep sending, some of them streaming, costs them nothing. Real vLLM (CPU build),
real discovery, real KV transfer, real haproxy (the module is skipped without it). The
proxies run with their defaults: clients are told no address (headers, ids, /instances).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from scripts.haproxy_cfg import LB_HOST, render  # noqa: E402  (scripts/haproxy_cfg.py)
from scripts.topology import load_topology  # noqa: E402  (scripts/topology.py)
from tests.support.cluster import port_free  # noqa: E402  (tests/support/cluster.py)
from tests.support.e2e_client import MODEL_DIR, metric, poll
from tests.support.haproxy_helpers import HAPROXY, SKIP_REASON, Balancer, any_free_port
from tests.support.launcher_helpers import READY_LINE, LauncherRun, free_port_offset, in_groups

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(HAPROXY is None, reason=SKIP_REASON)]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    base = load_topology("multinode")
    offset = free_port_offset(base, start=2000)
    topo = base.with_port_offset(offset)
    log_dir = Path(tmp_path_factory.mktemp("multinode"))
    lb_port = topo.proxies[0].port
    assert port_free(LB_HOST, lb_port), f"{LB_HOST}:{lb_port} is taken"
    stats_port = any_free_port(LB_HOST)
    cfg = log_dir / "haproxy.cfg"
    cfg.write_text(render(topo, listen=(LB_HOST, lb_port), stats=(LB_HOST, stats_port)))
    runs: dict[str, LauncherRun] = {}
    lb = None
    try:
        for name in ("proxy-a", "proxy-b", "prefill-0", "decode-0"):
            runs[name] = LauncherRun.start(["up", "multinode", "--only", name, "--port-offset", str(offset),
                                            "--log-dir", str(log_dir / name)])
        # haproxy first: it checks the proxies' /ready while the engines start.
        lb = Balancer(cfg, log_dir, f"http://{LB_HOST}:{lb_port}", f"http://{LB_HOST}:{stats_port}")
        for run in runs.values():
            run.wait_for(READY_LINE, timeout=600)
        for p in topo.proxies:
            lb.wait_state(p.name, "UP", timeout=30)
        yield topo, runs, lb, offset, log_dir
    finally:
        if lb is not None:
            lb.stop()
        for run in runs.values():
            run.kill()


# ~780 characters: over the proxies' shipped local_prefill_threshold (128 estimated
# tokens), so P prefills and D loads the KV.
PROMPT = "the river stone maple quiet engine silver garden " * 16


def _complete(url: str, i: int, max_tokens: int = 8) -> httpx.Response:
    body = {"model": "tiny-llama", "prompt": f"request {i}: {PROMPT}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _stream(url: str, i: int) -> str:
    """One streamed completion; '' when it arrived whole (200, text, a finish_reason, [DONE]),
    otherwise what went wrong."""
    body = {"model": "tiny-llama", "prompt": f"stream {i}: {PROMPT}", "max_tokens": 24, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.read()[:300]!r}"
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"stream cut short: {events[-3:]}"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return f"error event: {chunks}"
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    return "" if text and finish == ["length"] else f"incomplete: text={text!r} finish={finish}"


def _one(url: str, i: int, streaming: bool, max_tokens: int) -> str:
    try:
        if streaming:
            return _stream(url, i)
        r = _complete(url, i, max_tokens)
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:300]}"
        return "" if r.json()["choices"][0]["text"] else f"no text: {r.text[:300]}"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


class Clients:
    """`workers` threads sending requests through url back to back (every other one streamed
    when streams is set) until stop() — at most max_each requests each and max_s seconds."""

    def __init__(self, url: str, workers: int, streams: bool, max_tokens: int = 8, max_each: int = 60,
                 max_s: float = 120.0) -> None:
        self.results: list[tuple[bool, float, str]] = []  # (streamed, end time, error or '')
        self._stop = threading.Event()
        self._lock = threading.Lock()
        deadline = time.monotonic() + max_s

        def work(w: int) -> None:
            for k in range(max_each):
                if self._stop.is_set() or time.monotonic() > deadline:
                    return
                streamed = streams and (k + w) % 2 == 0
                err = _one(url, w * 1000 + k, streamed, max_tokens)
                with self._lock:
                    self.results.append((streamed, time.monotonic(), err))

        self._threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(workers)]
        for t in self._threads:
            t.start()

    def done(self, since: float = 0.0) -> int:
        with self._lock:
            return sum(1 for _, end, _ in self.results if end > since)

    def stop(self) -> list[tuple[bool, float, str]]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)
        assert not any(t.is_alive() for t in self._threads)
        return list(self.results)


def _in_flight(url: str) -> float:
    try:
        return metric(url, "xpyd_instance_in_flight")
    except Exception:  # the proxy is gone
        return 0.0


def test_every_instance_registered_with_both_proxies(hosts):
    topo, *_ = hosts
    for p in topo.proxies:
        raw = httpx.get(p.url + "/instances", timeout=5).text
        listed = json.loads(raw)
        assert sorted(i["role"] for i in listed) == sorted(i.role for i in topo.instances), p.name
        assert all(i["healthy"] and i["label"] for i in listed)
        assert not any(i.host in raw for i in topo.instances)  # a summary, no addresses


def test_requests_through_the_balancer_reach_both_proxies(hosts):
    topo, _, lb, _, _ = hosts
    before = {p.name: metric(p.url, "xpyd_requests_total", {"status": "200"}) for p in topo.proxies}
    (pre,), (dec,) = topo.by_role("P"), topo.by_role("D")
    for i in range(4):
        r = _complete(lb.url, i)
        assert r.status_code == 200, r.text
        data = r.json()
        # The client sees a neutral id of vLLM's shape ("cmpl-" and 16 hex digits), no address, and
        # no X-Request-Id header (vLLM sends one only with --enable-request-id-headers).
        assert re.fullmatch(r"cmpl-[0-9a-f]{16}", data["id"]) and "x-request-id" not in r.headers
        assert not any(h in r.text or h in str(r.headers) for h in (pre.host, dec.host))
        # KV went from P's engine on its address to D's engine on its address (the request
        # id named both: D loaded all but the last prompt token, P pushed it there).
        xpyd = data["kv_transfer_params"]["xpyd"]
        assert xpyd["load_failed"] is False and xpyd["loaded_tokens"] == data["usage"]["prompt_tokens"] - 1
    served = {p.name: metric(p.url, "xpyd_requests_total", {"status": "200"}) - before[p.name]
              for p in topo.proxies}
    # roundrobin: in turn (2 each) unless a health check took one out for a moment
    assert sum(served.values()) == 4 and all(v >= 1 for v in served.values()), served


def _stop_mid_run(hosts, stop, streams: bool, max_tokens: int = 8, after: int = 3) -> list:
    """Clients running through haproxy; once proxy-b has a request in flight, stop() (which
    returns once proxy-b is gone); clients go on until `after` more requests have ended
    after that. The results."""
    topo, _, lb, _, _ = hosts
    b = next(p for p in topo.proxies if p.name == "proxy-b")
    clients = Clients(lb.url, workers=3, streams=streams, max_tokens=max_tokens)
    try:
        assert poll(lambda: _in_flight(b.url) >= 1, 60, 0.05), "proxy-b never had a request in flight"
        stop()
        gone = time.monotonic()
        assert poll(lambda: clients.done(since=gone) >= after, 90, 0.1), "clients stalled after proxy-b stopped"
    finally:
        results = clients.stop()
    return results


def test_one_proxy_drained_mid_run_clients_see_no_error(hosts):
    """SIGTERM to proxy-b's launcher (how its host is stopped) while 3 clients send, every
    other request streamed: proxy-b's listener closes at once, what it has in flight
    finishes (drain), haproxy sends everything new to proxy-a."""
    topo, runs, lb, _, _ = hosts

    def stop() -> None:
        signalled.append(time.time())
        runs["proxy-b"].proc.send_signal(signal.SIGTERM)
        assert runs["proxy-b"].wait_exit(timeout=60) == 0

    signalled: list[float] = []
    results = _stop_mid_run(hosts, stop, streams=True)
    errors = [r for r in results if r[2]]
    assert errors == [], errors
    assert sum(1 for s, _, _ in results if s) >= 2, results
    # What proxy-b had open when it was told to stop ended well (200, after the signal).
    drained = [r for r in lb.requests() if r[0] == "proxy-b" and r[2] > signalled[0]]
    assert drained and all(r[1] == 200 for r in drained), drained
    lb.wait_state("proxy-b", "DOWN", timeout=10)
    assert metric(topo.proxies[0].url, "xpyd_instances", {"role": "D"}) == 1


def test_a_killed_proxy_costs_clients_nothing_not_yet_answered(hosts):
    """proxy-b started again (haproxy takes it back once its /ready is 200), then SIGKILLed
    with requests in flight: haproxy replays those it had no byte of an answer for on
    proxy-a (retry-on empty-response). Not streamed: a stream whose first bytes came from
    the killed proxy cannot be replayed."""
    topo, runs, lb, offset, log_dir = hosts
    runs["proxy-b"] = run = LauncherRun.start(["up", "multinode", "--only", "proxy-b", "--port-offset",
                                               str(offset), "--log-dir", str(log_dir / "proxy-b-again")])
    run.wait_for(READY_LINE, timeout=60)
    lb.wait_state("proxy-b", "UP", timeout=30)  # the instances registered again, /ready is 200
    (pid,) = run.started_pids()
    log_before = len(lb.requests())

    def stop() -> None:
        os.killpg(pid, signal.SIGKILL)  # the proxy alone: the launcher started it as a group leader
        run.wait_for(r"proxy-b exited \(rc=-9\)", timeout=30)

    # 24 tokens (a second or more here): a request open on proxy-b when its in-flight gauge
    # was read is still open when the kill lands, milliseconds later.
    results = _stop_mid_run(hosts, stop, streams=False, max_tokens=24, after=2)
    errors = [r for r in results if r[2]]
    assert errors == [], errors
    lb.wait_state("proxy-b", "DOWN", timeout=10)
    # haproxy replayed at least one request (the one(s) open on proxy-b) on proxy-a.
    assert any(r[0] == "proxy-a" and r[3] for r in lb.requests()[log_before:]), lb.requests()[log_before:]


def test_every_host_stops_on_sigterm(hosts):
    _, runs, _, _, _ = hosts
    groups = set()
    for run in runs.values():
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGTERM)
    for name, run in runs.items():
        assert run.wait_exit(timeout=90) == 0, name
        groups |= run.started_pids()
    assert len(groups) == 4
    assert in_groups(groups) == []

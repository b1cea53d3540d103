"""A real Prometheus scrapes a running 1P1D system, and every panel of the Grafana dashboard
(configs/grafana/xpyd-dashboard.json) has data.

`xpyd launch up 1p1d` (proxy + 1 P + 1 D, vLLM CPU build, tiny model) on free
ports, and Debian's `prometheus` binary on 127.0.0.1 scraping the proxy and both instances
every second with the config xpyd_deploy/compose.py renders for the compose file's monitoring
profile (same function, loopback addresses instead of service names). A concurrent load of
streamed and non-streamed completions and chat completions runs through the proxy with the
`openai` client for long enough that the dashboard's rate() windows hold many samples; then
every target `expr` of every panel is evaluated through Prometheus' /api/v1/query and must
return at least one series with a finite value (what Grafana draws: an empty result or only
NaN is a panel showing "No data").

Skipped with its reason where the prometheus binary is missing, a failure where CI=true
(scripts/setup_system.sh installs it from Debian's package).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from xpyd_deploy import compose  # noqa: E402  (xpyd_deploy/compose.py)
from xpyd_deploy.topology import load_topology  # noqa: E402  (xpyd_deploy/topology.py)
from tests.support.cluster import free_port  # noqa: E402  (tests/support/cluster.py)
from tests.support.e2e_client import MODEL_DIR, WORDS
from tests.support.launcher_helpers import DASHBOARD, READY_LINE, LauncherRun, free_port_offset

PROMETHEUS = shutil.which("prometheus") or next(
    (p for p in ("/usr/bin/prometheus", "/usr/local/bin/prometheus") if Path(p).exists()), None)

# Skipped without prometheus; a failure where CI=true (tests/conftest.py).
pytestmark = [pytest.mark.vllm, pytest.mark.tool("prometheus")]

TOPOLOGY = "1p1d"
SCRAPE_INTERVAL_S = 1
LOAD_S = 15.0  # >= 15 scrapes of each target while requests run: every [1m]/[5m] window has many samples
MIN_EACH = 2  # ... and until each kind of request went through twice: a loaded box answers the first
LOAD_LIMIT_S = 240.0  # requests slowly (CI saw 4 answers in 18 s), a duration alone is not enough
LOAD_WORKERS = 4
MAX_REQUESTS = 400  # a bound on the load loop besides its duration
MAX_TOKENS = 8
# Grafana's built-in interval variables, as Grafana would resolve them for a 1 s scrape
# (and the test's short time range); query variables of the dashboard take their "All" regex.
GRAFANA_VARS = {"__rate_interval": "1m", "__interval": "5s", "interval": "5s", "__range": "5m",
                "__range_s": "300", "__interval_ms": "5000"}


def _prompt(i: int) -> str:
    """About 300-500 tokens of the tiny model (~650-1,050 characters), distinct per request
    (no prefix-cache hits between requests): over the proxy's shipped local_prefill_threshold
    (128 estimated tokens, 4 characters each), so P prefills and D loads the KV."""
    n = 100 + (i * 37) % 60
    return f"request {i}: " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


class Prometheus:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path) -> None:
        self.proc, self.url, self.log_path = proc, url, log_path

    def get(self, path: str, **params) -> dict:
        r = httpx.get(self.url + path, params=params, timeout=15)
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_prometheus(config: dict, tmp: Path) -> Prometheus:
    cfg = tmp / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    log_path = tmp / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    prom = Prometheus(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(prom.url + "/-/ready", timeout=2).status_code == 200:
                return prom
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            prom.stop()
            raise AssertionError(f"prometheus did not become ready (rc={proc.poll()}):\n{prom.log()}")
        time.sleep(0.2)


async def _load(base_url: str, model: str) -> dict:
    """LOAD_WORKERS clients, each cycling completions/chat x stream/no stream, until LOAD_S passed
    and each kind was answered MIN_EACH times (at most LOAD_LIMIT_S and MAX_REQUESTS in all).
    Returns counts by kind and every failure."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    done: dict[str, int] = {}
    failures: list[str] = []
    latencies: list[float] = []
    counter = iter(range(MAX_REQUESTS))
    t0 = time.monotonic()
    kinds = ("completions", "chat", "completions stream", "chat stream")

    def more() -> bool:
        elapsed = time.monotonic() - t0
        short = min(done.get(k, 0) for k in kinds) < MIN_EACH
        return elapsed < LOAD_LIMIT_S and (elapsed < LOAD_S or (short and not failures))

    async def one(i: int) -> None:
        chat, stream = bool(i % 2), bool((i // 2) % 2)
        kind = f"{'chat' if chat else 'completions'}{' stream' if stream else ''}"
        args = dict(model=model, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
        if chat:
            out = await client.chat.completions.create(messages=[{"role": "user", "content": _prompt(i)}], **args)
        else:
            out = await client.completions.create(prompt=_prompt(i), **args)
        if stream:
            chunks = [c async for c in out]
            assert chunks and any(c.choices for c in chunks), kind
        else:
            assert out.choices and out.usage.completion_tokens > 0, kind
        done[kind] = done.get(kind, 0) + 1

    async def worker() -> None:
        while more():
            i = next(counter, None)
            if i is None:
                return
            t = time.monotonic()
            try:
                await one(i)
                latencies.append(time.monotonic() - t)
            except Exception as e:  # noqa: BLE001  (every failure is reported by the test)
                failures.append(f"request {i}: {type(e).__name__}: {e}"[:300])

    try:
        await asyncio.gather(*(worker() for _ in range(LOAD_WORKERS)))
    finally:
        await client.close()
    return {"done": done, "failures": failures, "latencies": sorted(latencies)}


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory):
    """(prometheus, topology, load result): the system up, scraped, after the load."""
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    tmp = Path(tmp_path_factory.mktemp("prometheus"))
    offset = free_port_offset(load_topology(TOPOLOGY))
    topo = load_topology(TOPOLOGY).with_port_offset(offset)
    # The generator of configs/prometheus.yml, pointed at this system's loopback addresses.
    config = compose.render_scrape_config(
        [compose.scrape_targets(topo, lambda spec: f"{spec.host}:{spec.port}", {"profile": "e2e"})],
        scrape_interval=f"{SCRAPE_INTERVAL_S}s")
    run = LauncherRun.start(["up", TOPOLOGY, "--port-offset", str(offset), "--log-dir", str(tmp / "logs")])
    prom = None
    try:
        prom = start_prometheus(config, tmp)  # while vLLM starts: its targets are down until then
        run.wait_for(READY_LINE, timeout=600)
        _wait(lambda: all(t["health"] == "up" for t in prom.get("/api/v1/targets", state="active")["activeTargets"]),
              30, "every target up")
        t0 = time.monotonic()
        load = asyncio.run(_load(topo.proxies[0].url, topo.served_model_name))
        load["seconds"] = time.monotonic() - t0
        ended = time.time()
        # One more scrape of every target after the last answer, so the panels see all of it.
        _wait(lambda: prom.query(f"min(timestamp(up)) > {ended:.3f}"), 15, "a scrape after the load")
        lat = load["latencies"] or [math.nan]
        print(f"\nload: {load['done']} in {load['seconds']:.1f}s, {len(load['failures'])} failed; "
              f"latency median {lat[len(lat) // 2]:.2f}s max {lat[-1]:.2f}s")
        yield prom, topo, load
    finally:
        if prom is not None:
            prom.stop()
        run.kill()


def _wait(fn, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.5)


def _targets() -> list[tuple[str, str, str]]:
    """(panel title, legend, expr) of every query of every panel (rows' nested panels too)."""
    dash = json.loads(DASHBOARD.read_text())
    panels = [*dash["panels"], *(q for p in dash["panels"] for q in p.get("panels", []))]
    return [(p["title"], t.get("legendFormat", ""), t["expr"]) for p in panels for t in p.get("targets", [])]


def grafana_expr(expr: str) -> str:
    """expr with Grafana's variables substituted: the interval ones as Grafana resolves them here,
    the dashboard's own query variables by their "All" value (a regex matching everything)."""
    dash = json.loads(DASHBOARD.read_text())
    own = {v["name"]: ".*" for v in dash.get("templating", {}).get("list", []) if v.get("type") != "datasource"}
    values = {**own, **GRAFANA_VARS}

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"unknown Grafana variable ${name} in {expr}"
        return values[name]
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", sub, expr)


def test_grafana_variables_are_substituted():
    assert grafana_expr("rate(x[$__rate_interval])") == "rate(x[1m])"
    assert grafana_expr("rate(x[${__interval}])") == "rate(x[5s])"
    with pytest.raises(AssertionError, match="unknown Grafana variable"):
        grafana_expr('x{instance=~"$nosuchvar"}')


def test_the_load_ran_through_the_proxy(monitored):
    _, _, load = monitored
    assert load["failures"] == [], load["failures"][:5]
    kinds = {"completions", "completions stream", "chat", "chat stream"}
    assert set(load["done"]) == kinds and min(load["done"].values()) >= MIN_EACH, load["done"]


def test_prometheus_scrapes_every_process_and_each_is_up(monitored):
    prom, topo, _ = monitored
    active = prom.get("/api/v1/targets", state="active")["activeTargets"]
    got = {(t["labels"]["job"], t["labels"]["instance"], t["labels"].get("role")): t["health"] for t in active}
    want = {(compose.PROXY_JOB, f"{p.host}:{p.port}", None) for p in topo.proxies}
    want |= {(compose.VLLM_JOB, f"{i.host}:{i.port}", i.role) for i in topo.instances}
    assert set(got) == want
    assert set(got.values()) == {"up"}, [(t["scrapeUrl"], t["lastError"]) for t in active if t["health"] != "up"]
    assert {r["metric"]["instance"] for r in prom.query("up == 1")} == {i for _, i, _ in want}
    # Scraped every second: a 1m window holds many samples of a series that grew with the load.
    samples = prom.query('count_over_time(xpyd_requests_total{status="200"}[1m])')
    assert samples and max(float(r["value"][1]) for r in samples) >= 10, samples


@pytest.mark.parametrize("title,legend,expr", _targets(), ids=[f"{t}: {lg}" for t, lg, _ in _targets()])
def test_every_dashboard_query_has_data(monitored, title: str, legend: str, expr: str):
    """What Grafana draws for this query: at least one series, and a number (not NaN) in one."""
    prom, _, _ = monitored
    result = prom.query(grafana_expr(expr))
    assert result, f"panel {title!r} ({legend}): no series for {expr}"
    values = [float(r["value"][1]) for r in result]
    assert any(math.isfinite(v) for v in values), f"panel {title!r} ({legend}): only NaN/Inf {result}"


def test_per_instance_proxy_panels_name_the_vllm_instances(monitored):
    """The proxy's per-instance series carry the vLLM instance's address in their own `instance`
    label, which Prometheus renames exported_instance (the scrape's `instance` is the proxy's):
    the dashboard groups and labels those panels by exported_instance."""
    prom, topo, _ = monitored
    want = {(i.role, f"{i.host}:{i.port}") for i in topo.instances}
    proxies = {f"{p.host}:{p.port}" for p in topo.proxies}
    checked = 0
    for title, legend, expr in _targets():
        if not re.search(r"xpyd_(instance_in_flight|upstream_errors)", expr):
            continue
        assert "{{exported_instance}}" in legend and "{{instance}}" not in legend, (title, legend)
        got = {(r["metric"].get("role"), r["metric"].get("exported_instance")) for r in prom.query(grafana_expr(expr))}
        assert got == want, (title, expr, got)
        assert not {r["metric"].get("instance") for r in prom.query(grafana_expr(expr))} - proxies - {None}
        checked += 1
    assert checked >= 2

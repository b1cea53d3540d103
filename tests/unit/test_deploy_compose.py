"""docker-compose.yml agrees with configs/topologies/ (cheap: no docker needed).

The checks: the committed files are exactly what `python -m xpyd_deploy.compose` renders (nobody
edited them by hand); read as docker compose reads them (variables interpolated), each
profile (gpu, cpu) holds exactly its topology's proxy and instances with their roles, ports,
GPU devices, health checks and the proxy's address, independent of the renderer's code; the
proxy's variables have defaults (no env file needed) and overriding them moves every use.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

from xpyd_deploy import compose  # noqa: E402  (xpyd_deploy/compose.py)
from xpyd_deploy.topology import load_topology  # noqa: E402  (xpyd_deploy/topology.py)

VAR = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(:-([^}]*))?\}")
MONITORING = {"prometheus", "grafana"}


def _interpolate(text: str, env: dict[str, str]) -> str:
    """docker compose's ${VAR} and ${VAR:-default} substitution."""
    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(3) or ""
        return env.get(name) or default
    return VAR.sub(sub, text)


def _compose(env: dict[str, str] | None = None) -> dict:
    """Parsed, then interpolated value by value, as docker compose does (values stay strings)."""
    env = env or {}

    def walk(v):
        if isinstance(v, str):
            return _interpolate(v, env)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v
    return walk(yaml.safe_load((ROOT / compose.COMPOSE_FILE).read_text()))


def _profile_services(doc: dict, profile: str) -> dict:
    return {n: s for n, s in doc["services"].items() if s.get("profiles") == [profile]}


def test_committed_files_are_rendered_from_the_topologies():
    stale = [p for p, text in compose.rendered_files().items()
             if not (ROOT / p).exists() or (ROOT / p).read_text() != text]
    assert stale == [], f"rerun `python -m xpyd_deploy.compose`: {stale}"
    # The entry point as the README runs it agrees.
    out = subprocess.run([sys.executable, "-m", "xpyd_deploy.compose", "--check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("profile,topo_name", compose.PROFILES)
def test_profile_services_match_topology(profile: str, topo_name: str):
    topo = load_topology(topo_name)
    doc = _compose()
    services = _profile_services(doc, profile)
    net = f"xpyd-{profile}"
    (proxy,) = topo.proxies
    proxy_svc = f"{profile}-{proxy.name}"
    # Exactly the topology's processes, each named <profile>-<name>.
    assert sorted(services) == sorted(f"{profile}-{n}" for n in [proxy.name, *(i.name for i in topo.instances)])
    # The proxy: its ports and discovery port are the topology's, published on loopback only.
    p = services[proxy_svc]
    cmd = p["command"]
    assert cmd[cmd.index("--port") + 1] == str(proxy.port)
    assert cmd[cmd.index("--discovery-port") + 1] == str(proxy.discovery_port)
    assert p["ports"] == [f"127.0.0.1:{proxy.port}:{proxy.port}"]
    assert f":{proxy.port}/health" in " ".join(p["healthcheck"]["test"])
    assert p["networks"] == [net, "edge"]
    for inst in topo.instances:
        name = f"{profile}-{inst.name}"
        svc = services[name]
        cmd = svc["command"]
        assert cmd[cmd.index("--port") + 1] == str(inst.port)
        assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
        assert cmd[cmd.index("--served-model-name") + 1] == topo.served_model_name
        kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert kv["kv_role"] == {"P": "kv_producer", "D": "kv_consumer"}[inst.role]
        assert kv["kv_port"] == inst.kv_port
        extra = kv["kv_connector_extra_config"]
        # Peers and the proxy reach the engine by its service name; it reaches its profile's proxy by its.
        assert extra["kv_ip"] == extra["http_host"] == name
        assert extra["http_port"] == inst.port
        assert (extra["proxy_ip"], extra["proxy_port"]) == (proxy_svc, proxy.discovery_port)
        assert svc["depends_on"] == {proxy_svc: {"condition": "service_healthy"}}
        assert f":{inst.port}/health" in " ".join(svc["healthcheck"]["test"])
        assert "ports" not in svc  # only the proxy is published
        assert svc["networks"] == [net]
        if profile == "gpu":
            (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
            assert dev["device_ids"] == [str(d) for d in inst.devices] and dev["capabilities"] == ["gpu"]
            # (the shipped gpu profile runs TP 1: tp > 1 is checked on gpu-tp2 below)
            assert "--tensor-parallel-size" not in cmd if inst.tp == 1 else \
                cmd[cmd.index("--tensor-parallel-size") + 1] == str(inst.tp)
        else:
            assert "deploy" not in svc
    if profile == "cpu":
        assert doc["networks"][net]["internal"] is True  # the CPU engines have no route out
    # Prometheus (monitoring profile) scrapes exactly this profile's proxy and instances under its label.
    prom = yaml.safe_load((ROOT / compose.PROMETHEUS_FILE).read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"]
               if sc["labels"]["profile"] == profile for t in sc["targets"]}
    assert targets == {f"{proxy_svc}:{proxy.port}"} | {f"{profile}-{i.name}:{i.port}" for i in topo.instances}
    assert net in doc["services"]["prometheus"]["networks"]


def test_a_tensor_parallel_topology_renders_its_tp_devices_and_rank_ports():
    """gpu-tp2 (TP 2 on P and D) through the gpu profile's renderer: every rank's GPU is
    reserved, vLLM gets --tensor-parallel-size, the workers share IPC, every rank's KV port
    is reachable on the profile's network."""
    topo = load_topology("gpu-tp2")
    services = compose.render_services("gpu", topo)
    for inst in topo.instances:
        assert inst.tp == 2 and len(inst.devices) == 2
        svc = services[compose.service_name("gpu", inst.name)]
        cmd = svc["command"]
        assert cmd.count("--tensor-parallel-size") == 1 and cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["device_ids"] == [str(d) for d in inst.devices]
        assert svc["ipc"] == "host"
        assert len(set(inst.kv_ports)) == 2 and {str(p) for p in inst.kv_ports} <= set(svc["expose"])


def test_every_service_is_in_one_profile_and_stays_inside_it():
    doc = _compose()
    profiles = {p for p, _ in compose.PROFILES}
    assert profiles == {"gpu", "cpu"}
    for name, svc in doc["services"].items():
        want = ["monitoring"] if name in MONITORING else None
        assert svc.get("profiles") == want or (want is None and len(svc["profiles"]) == 1
                                               and svc["profiles"][0] in profiles), name
        if name in MONITORING:
            continue
        (profile,) = svc["profiles"]
        # compose refuses a dependency outside the enabled profiles; nothing talks across profiles.
        assert all(doc["services"][d]["profiles"] == [profile] for d in svc.get("depends_on", {})), name
        assert set(svc["networks"]) <= {f"xpyd-{profile}", "edge"}, name
        assert svc["build"]["dockerfile"] == compose.DOCKERFILES[profile]
    for vol in doc["services"]["prometheus"]["volumes"] + doc["services"]["grafana"]["volumes"]:
        assert (ROOT / vol.split(":")[0]).exists(), vol


def test_variables_have_defaults_and_overrides_reach_every_use():
    text = (ROOT / compose.COMPOSE_FILE).read_text()
    used = VAR.findall(text)
    assert used and all(sep for _, sep, _ in used), "every ${VAR} needs a default: no env file is shipped"
    env = {"XPYD_PROXY_PORT": "18000", "XPYD_DISCOVERY_PORT": "31001", "XPYD_PROXY_HOST": "proxy.example"}
    doc = _compose(env)
    for profile, topo_name in compose.PROFILES:
        topo = load_topology(topo_name)
        services = _profile_services(doc, profile)
        p = services[f"{profile}-{topo.proxies[0].name}"]
        cmd = p["command"]
        assert (cmd[cmd.index("--port") + 1], cmd[cmd.index("--discovery-port") + 1]) == ("18000", "31001")
        assert p["ports"] == ["127.0.0.1:18000:18000"]
        assert ":18000/health" in " ".join(p["healthcheck"]["test"])
        for inst in topo.instances:
            cmd = services[f"{profile}-{inst.name}"]["command"]
            extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
            assert (extra["proxy_ip"], extra["proxy_port"]) == ("proxy.example", 31001)
    # No topology value that a variable stands for is left hard-coded in the proxies or the kv configs.
    for profile, topo_name in compose.PROFILES:
        (proxy,) = load_topology(topo_name).proxies
        for svc in _profile_services(doc, profile).values():
            assert str(proxy.discovery_port) not in json.dumps(svc)
            assert f'"{profile}-{proxy.name}"' not in json.dumps(svc.get("command", []))


def test_the_images_the_compose_file_builds_exist():
    builds = {svc["build"]["dockerfile"] for svc in _compose()["services"].values() if "build" in svc}
    assert builds == set(compose.DOCKERFILES.values())
    for df in builds:
        assert (ROOT / df).exists(), df


def test_dockerfiles_copy_what_the_services_import():
    for df in compose.DOCKERFILES.values():
        text = (ROOT / df).read_text()
        for pkg in ("proxy", "connector", "configs", "scripts"):  # scripts/: the launcher
            assert f"COPY {pkg} {pkg}" in text, (df, pkg)
    build = ROOT / "configs/docker/build-cpu-image.sh"
    assert build.stat().st_mode & 0o111
    # It runs docker from the repo root, with the compose file's Dockerfile.
    assert f"-f {compose.DOCKERFILES['cpu']} " in build.read_text()
    assert 'cd "$(dirname "$0")/../.."' in build.read_text()

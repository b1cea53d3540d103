"""The committed compose files agree with configs/topologies/ (cheap: no docker needed).

Two checks: the files are exactly what `python -m deploy.compose` renders (nobody edited
them by hand), and, read as docker compose reads them (with .env interpolated), every
topology instance is a service with its role, ports, GPU devices, health check and the
proxy's address, independent of the renderer's code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from deploy import compose
from deploy.topology import ROOT, load_topology


def _env() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k] = v
    return out


def _interpolate(text: str, env: dict[str, str]) -> str:
    """docker compose's ${VAR} and ${VAR:-default} substitution."""
    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(3) or ""
        return env.get(name, default)
    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*)(:-([^}]*))?\}", sub, text)


def _compose(path: str) -> dict:
    """Parsed, then interpolated value by value, as docker compose does (values stay strings)."""
    env = _env()

    def walk(v):
        if isinstance(v, str):
            return _interpolate(v, env)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v
    return walk(yaml.safe_load((ROOT / path).read_text()))


def test_committed_files_are_rendered_from_the_topologies():
    stale = [p for p, text in compose.rendered_files().items()
             if not (ROOT / p).exists() or (ROOT / p).read_text() != text]
    assert stale == [], f"rerun `python -m deploy.compose`: {stale}"


@pytest.mark.parametrize("topo_name,target,path", compose.RENDERED)
def test_compose_services_match_topology(topo_name: str, target: str, path: str):
    topo = load_topology(topo_name)
    doc = _compose(path)
    services = doc["services"]
    (proxy,) = topo.proxies
    env = _env()
    # The proxy: its service, ports and discovery port are the topology's, published on loopback only.
    assert env["XPYD_PROXY_HOST"] == proxy.name and proxy.name in services
    p = services[proxy.name]
    cmd = p["command"]
    assert cmd[cmd.index("--port") + 1] == str(proxy.port)
    assert cmd[cmd.index("--discovery-port") + 1] == str(proxy.discovery_port)
    assert p["ports"] == [f"127.0.0.1:{proxy.port}:{proxy.port}"]
    assert str(proxy.port) in " ".join(p["healthcheck"]["test"])
    engines = [s for s in services if s not in (proxy.name, "prometheus", "grafana")]
    assert sorted(engines) == sorted(i.name for i in topo.instances)
    for inst in topo.instances:
        svc = services[inst.name]
        cmd = svc["command"]
        assert cmd[cmd.index("--port") + 1] == str(inst.port)
        assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
        kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert kv["kv_role"] == {"P": "kv_producer", "D": "kv_consumer"}[inst.role]
        assert kv["kv_port"] == inst.kv_port
        extra = kv["kv_connector_extra_config"]
        # Peers and the proxy reach the engine by its service name; it reaches the proxy by its.
        assert extra["kv_ip"] == extra["http_host"] == inst.name
        assert extra["http_port"] == inst.port
        assert (extra["proxy_ip"], extra["proxy_port"]) == (proxy.name, proxy.discovery_port)
        assert svc["depends_on"][proxy.name]["condition"] == "service_healthy"
        assert f":{inst.port}/health" in " ".join(svc["healthcheck"]["test"])
        assert "ports" not in svc  # only the proxy is published
        if target == "gpu":
            (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
            assert dev["device_ids"] == [str(d) for d in inst.devices] and dev["capabilities"] == ["gpu"]
            if inst.tp > 1:
                assert cmd[cmd.index("--tensor-parallel-size") + 1] == str(inst.tp)
        else:
            assert "deploy" not in svc
            assert svc["networks"] == ["xpyd"] and doc["networks"]["xpyd"]["internal"] is True
    # Prometheus scrapes exactly the proxy and the instances.
    prom = yaml.safe_load((ROOT / f"configs/prometheus-{topo.name}.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{proxy.name}:{proxy.port}"} | {f"{i.name}:{i.port}" for i in topo.instances}
    for vol in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        assert (ROOT / vol.split(":")[0]).exists(), vol


def test_the_images_the_compose_files_build_exist():
    for _, _, path in compose.RENDERED:
        for svc in _compose(path)["services"].values():
            if "build" in svc:
                assert (ROOT / svc["build"]["dockerfile"]).exists()


def test_dockerfiles_copy_what_the_services_import():
    for df in ("docker/Dockerfile.gpu", "docker/Dockerfile.cpu"):
        text = (ROOT / df).read_text()
        for pkg in ("proxy", "connector", "deploy"):
            assert f"COPY {pkg} {pkg}" in text, (df, pkg)
    assert Path(ROOT / "docker/build-cpu-image.sh").stat().st_mode & 0o111

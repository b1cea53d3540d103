"""configs/haproxy/multinode.cfg: rendered from configs/topologies/multinode.yaml by
xpyd_deploy/haproxy_cfg.py (no drift), accepted by `haproxy -c` where haproxy is installed, and
the settings the multi-proxy failover relies on (tests/deploy/test_e2e_multinode.py runs it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from xpyd_deploy import haproxy_cfg  # noqa: E402  (xpyd_deploy/haproxy_cfg.py)
from xpyd_deploy.topology import TopologyError, load_topology  # noqa: E402

CFG = ROOT / "configs" / "haproxy" / "multinode.cfg"
HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None)


def test_checked_in_copy_is_what_the_topology_renders():
    assert CFG.read_text() == haproxy_cfg.render(load_topology("multinode")), \
        "stale: rerun python -m xpyd_deploy.haproxy_cfg"
    assert haproxy_cfg.main(["--check"]) == 0


def test_check_reports_a_stale_copy(tmp_path, capsys):
    stale = tmp_path / "multinode.cfg"
    stale.write_text(CFG.read_text().replace("retries 2", "retries 3"))
    assert haproxy_cfg.main(["--check", "-o", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err


def test_servers_are_the_topologys_proxies_and_follow_a_port_offset():
    topo = load_topology("multinode").with_port_offset(100)
    text = haproxy_cfg.render(topo, stats=("127.0.0.10", 9999))
    assert re.findall(r"^\s+server (\S+) (\S+)$", text, re.M) == [
        (p.name, f"{p.host}:{p.port}") for p in topo.proxies]
    assert "bind 127.0.0.10:8100" in text and "bind 127.0.0.10:9999" in text


def test_the_failover_settings():
    text = CFG.read_text()
    for line in ("option httpchk GET /ready", "http-check expect status 200", "option redispatch 1",
                 "retry-on conn-failure empty-response", "option http-buffer-request", "balance roundrobin",
                 "option http-server-close", "timeout server 21m"):
        assert re.search(rf"^\s+{re.escape(line)}$", text, re.M), line
    # the stats page (and no admin socket) on loopback only
    assert "stats socket" not in text.replace("No `stats socket`", "")
    assert re.findall(r"^frontend stats\n\s+bind (\S+):", text, re.M) == ["127.0.0.1"]


def test_the_balancer_must_not_take_a_proxys_address():
    topo = load_topology("multinode")
    p = topo.proxies[0]
    with pytest.raises(TopologyError):
        haproxy_cfg.render(topo, listen=(p.host, p.port))


@pytest.mark.tool("haproxy")  # skipped without it; a failure where CI=true (tests/conftest.py)
def test_haproxy_accepts_it():
    r = subprocess.run([HAPROXY, "-c", "-f", str(CFG)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Configuration file is valid" in r.stdout + r.stderr

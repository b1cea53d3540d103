"""docker-compose.yml's cpu profile brought up for real: proxy + 1 P + 1 D containers on an
internal network, KV between containers addressed by service name, a completion through the
proxy's published loopback port equal to D's own greedy answer.

Marked `docker`; skipped where no Docker engine answers (CI has none). The image is (re)built
by configs/docker/build-cpu-image.sh: the first build makes a Debian root filesystem and
installs vLLM (~15 min); later builds reuse those layers and copy only the sources.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.proxy_helpers import free_port

# Also `vllm`: it starts vLLM servers (in containers), so `-m "not vllm"` runs skip it too.
pytestmark = [pytest.mark.docker, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is a city where"
BUILD_TIMEOUT_S = 45 * 60
UP_TIMEOUT_S = 15 * 60


def _compose_cmd() -> list[str] | None:
    """Compose v2 (`docker compose`) or v1 (`docker-compose`, Debian's package)."""
    if shutil.which("docker"):
        v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if v2.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def _engine_up() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (loopback)
        return json.loads(resp.read())


def _wait_ready(url: str, base: list[str], env: dict[str, str], deadline: float) -> dict:
    last: object = None
    while time.monotonic() < deadline:
        # An engine that exited (a bad image, too little /dev/shm) will not come back.
        ps = subprocess.run([*base, "ps", "-a"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert "exit" not in ps.stdout.lower(), f"a container stopped:\n{ps.stdout}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 (loopback)
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:  # 503 until a P and a D registered
            last = e.read()[:200]
        except OSError as e:
            last = e
        time.sleep(3)
    raise AssertionError(f"proxy not ready within {UP_TIMEOUT_S}s: {last}")


@pytest.fixture(scope="module")
def cpu_stack():
    compose = _compose_cmd()
    if compose is None or not _engine_up():
        pytest.skip("no Docker engine (or compose) on this machine")
    subprocess.run(["bash", "configs/docker/build-cpu-image.sh"], cwd=ROOT, check=True,
                   timeout=BUILD_TIMEOUT_S)
    port = free_port()
    project = f"xpyd-test-{os.getpid()}"
    env = {**os.environ, "XPYD_PROXY_PORT": str(port)}
    base = [*compose, "-p", project, "--profile", "cpu"]
    try:
        subprocess.run([*base, "up", "-d", "--no-build"], cwd=ROOT, env=env, check=True, timeout=UP_TIMEOUT_S)
        yield base, env, f"http://127.0.0.1:{port}"
    finally:
        logs = subprocess.run([*base, "logs", "--no-color", "--tail", "40"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        print(logs.stdout[-6000:])
        subprocess.run([*base, "down", "-v", "--remove-orphans", "-t", "30"], cwd=ROOT, env=env,
                       timeout=300)


def test_cpu_profile_serves_disaggregated_tokens(cpu_stack):
    base, env, url = cpu_stack
    ready = _wait_ready(url + "/ready", base, env, time.monotonic() + UP_TIMEOUT_S)
    assert ready["prefill"] == 1 and ready["decode"] == 1, ready
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    via_proxy = _post(url + "/v1/completions", body)
    # The KV went from the P container to the D container by service name: D computed only
    # the last prompt token.
    xpyd = (via_proxy.get("kv_transfer_params") or {}).get("xpyd") or {}
    assert xpyd.get("loaded_tokens", 0) > 0, via_proxy
    # D alone, asked inside its container (its port is not published): the colocated answer.
    # Another cache_salt keeps it off the blocks the disaggregated request loaded from P.
    alone_body = {**body, "cache_salt": "colocated-baseline"}
    probe = ("import json,urllib.request as u;"
             "r=u.Request('http://127.0.0.1:8200/v1/completions',json.dumps(%r).encode(),"
             "{'content-type':'application/json'});print(u.urlopen(r,timeout=120).read().decode())"
             % alone_body)
    alone = subprocess.run([*base, "exec", "-T", "cpu-decode-0", "/xpyd/.venv/bin/python", "-c", probe],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True)
    colocated = json.loads(alone.stdout)
    assert via_proxy["choices"][0]["text"] == colocated["choices"][0]["text"]
    assert via_proxy["usage"]["completion_tokens"] == colocated["usage"]["completion_tokens"] == 12

"""A real xPyD system for the end-to-end tests: proxy + P + D + a colocated
baseline, all vLLM CPU-build servers on 127.0.0.1 with free ports."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from connector.transport import KVAuth, TcpTransport  # noqa: E402
from tests.support import cluster  # noqa: E402  (tests/support/cluster.py)
from tests.support.cluster import free_port, free_port_pair  # noqa: E402,F401  (re-exported to tests)

# The connector's own send_timeout_s default, and a load deadline above it: a transfer that
# stalls a few seconds on a saturated 2-core box (three vLLM servers busy-waiting; seen in CI
# with 3 s: a reserve's reply took longer) still loads, as it would for a user. The fault
# tests that wait these out cost ~20 s more per binding than with 3 s / 6 s.
KV_LOAD_TIMEOUT_S = 12.0
SEND_TIMEOUT_S = 10.0
BUFFER_TTL_S = 8.0
MAX_BATCHED_TOKENS = 256  # prompts longer than this are prefilled in chunks
# Prompts under this many estimated tokens (~4 characters each) go to D alone.
LOCAL_PREFILL_THRESHOLD = 16
# P and D authenticate their KV control sockets: every transfer in the suite is signed.
KV_SECRET = "e2e-kv-secret"


@dataclass
class E2ECluster:
    proxy: cluster.Server
    prefill: cluster.Server
    decode: cluster.Server
    colocated: cluster.Server
    discovery_port: int
    log_dir: Path
    prefill_extra: dict[str, object] = field(default_factory=dict)  # P's connector config beyond the defaults

    def servers(self) -> list[cluster.Server]:
        return [self.proxy, self.prefill, self.decode, self.colocated]

    def kv_addr(self, s: cluster.Server) -> str:
        return f"127.0.0.1:{s.kv_port}"

    def engine_stats(self, s: cluster.Server, secret: str | None = KV_SECRET) -> dict:
        """Buffer accounting of a server's rank-0 KV engine, over its control socket
        (a call signed with ``secret``; None: unsigned)."""
        return self.kv_call(s, {"op": "stats"}, secret)

    def kv_call(self, s: cluster.Server, header: dict, secret: str | None = KV_SECRET) -> dict:
        """One control call to a server's rank-0 KV engine; its reply header."""
        t = TcpTransport(auth=KVAuth.from_secret(secret) if secret else None)
        try:
            reply, _ = t.call(self.kv_addr(s), header, timeout_s=5.0)
        finally:
            t.close()
        return reply

    def stop(self) -> None:
        for s in self.servers():
            s.stop()


def wait_instances(proxy: cluster.Server, prefill: int, decode: int, timeout: float = 60.0) -> None:
    """Until the proxy routes to (at least) this many live P and D instances."""
    deadline = time.monotonic() + timeout
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        status, raw = cluster.http_get(proxy.url + "/instances")
        if status == 200:
            live = [i for i in json.loads(raw) if i.get("healthy", True) and not i.get("pending", False)]
            counts = {r: sum(1 for i in live if i["role"] == r) for r in ("P", "D")}
            if counts["P"] >= prefill and counts["D"] >= decode:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{proxy.name} routes to {counts}, not {prefill} P and {decode} D, after {timeout}s")


def bind_env(bind: str | None) -> dict[str, str | None]:
    """None: vLLM's own default CPU thread binding (what users get: the variable is
    unset even if this process has it); else VLLM_CPU_OMP_THREADS_BIND=bind."""
    return {"VLLM_CPU_OMP_THREADS_BIND": bind}


def secret_file(log_dir: Path, name: str, secret: str) -> Path:
    """A file holding ``secret``, readable by this user only: how the engines get it (a secret in
    kv_connector_extra_config is printed by vLLM at start-up and sits in its command line)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / name
    path.touch(mode=0o600)
    path.write_text(secret + "\n")
    return path


def start(log_dir: Path, timeout: float = 600.0, bind: str | None = None,
          prefill_extra: dict[str, object] | None = None, proxy_extra: list[str] | None = None) -> E2ECluster:
    """Proxy, P, D and a colocated server; ``prefill_extra``: more of P's connector config,
    ``proxy_extra``: more proxy flags."""
    disc = free_port()
    # --forward-debug-params: the power tests ask D (allow_debug_corruption) to zero the KV it loads.
    proxy = cluster.start_proxy(free_port(), disc, log_dir, ["--heartbeat-timeout", "5", "--local-prefill-threshold",
                                                             str(LOCAL_PREFILL_THRESHOLD), "--forward-debug-params",
                                                             *(proxy_extra or [])])
    common = dict(max_num_batched_tokens=MAX_BATCHED_TOKENS, env=bind_env(bind))
    p_port, d_port = free_port(), free_port()
    p_kv, d_kv = free_port_pair(), free_port_pair()
    timeouts = dict(kv_load_timeout_s=KV_LOAD_TIMEOUT_S, send_timeout_s=SEND_TIMEOUT_S,
                    buffer_ttl_s=BUFFER_TTL_S, kv_secret_file=str(secret_file(log_dir, "kv-secret", KV_SECRET)))
    prefill = cluster.start_vllm(
        "prefill", p_port, log_dir,
        kv_config=cluster.kv_transfer_config("kv_producer", p_kv, p_port, disc, **timeouts, **(prefill_extra or {})),
        **common)
    decode = cluster.start_vllm(
        "decode", d_port, log_dir,
        kv_config=cluster.kv_transfer_config("kv_consumer", d_kv, d_port, disc,
                                             allow_debug_corruption=True, **timeouts), **common)
    colocated = cluster.start_vllm("colocated", free_port(), log_dir, **common)
    c = E2ECluster(proxy, prefill, decode, colocated, disc, log_dir, dict(prefill_extra or {}))
    try:
        cluster.wait_until([proxy], "/health", 60)
        cluster.wait_until([prefill, decode, colocated], "/health", timeout)
        deadline = time.monotonic() + 30
        while cluster.http_get(proxy.url + "/ready")[0] != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("proxy never saw P and D register")
            time.sleep(0.3)
    except BaseException:
        c.stop()
        raise
    return c

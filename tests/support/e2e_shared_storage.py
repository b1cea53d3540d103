"""A real xPyD system on the SharedStorageConnector for the end-to-end tests:
proxy + P (kv_producer) + D (kv_consumer) sharing one directory, and a colocated
server without a connector as the reference. All on 127.0.0.1, free ports. With an
OTLP receiver, P and D export their spans to it (vLLM's --otlp-traces-endpoint)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from connector.shared_storage import config as ss_config
from tests.support import e2e_cluster
from tests.support.e2e_cluster import cluster, free_port, free_port_pair
from tests.support.otlp_receiver import OtlpReceiver

KV_LOAD_TIMEOUT_S = 6.0  # D's wait for a block file P has not written yet
MAX_BATCHED_TOKENS = 256  # prompts longer than this are prefilled in chunks


def kv_config(role: str, store: Path, http_port: int, kv_port: int, proxy_port: int | None, **extra: object) -> dict:
    """A SharedStorageConnector instance's --kv-transfer-config; the proxy keys are
    the P2P connector's (kv_port is only the address the proxy puts in request ids)."""
    ec: dict[str, object] = {"http_port": http_port, "kv_ip": cluster.HOST, "kv_load_timeout_s": KV_LOAD_TIMEOUT_S}
    if proxy_port is not None:
        ec.update(proxy_ip=cluster.HOST, proxy_port=proxy_port, heartbeat_interval_s=1.0)
    ec.update(extra)
    return ss_config.kv_transfer_config(role, store, kv_port=kv_port, **ec)


@dataclass
class SSCluster:
    proxy: cluster.Server
    prefill: cluster.Server
    decode: cluster.Server
    colocated: cluster.Server
    store: Path
    log_dir: Path
    discovery_port: int
    decode_config: dict = field(default_factory=dict)
    decode_tracing: dict = field(default_factory=dict)  # start_vllm's env and extra_args for D's spans
    restarts: int = 0

    def servers(self) -> list[cluster.Server]:
        return [self.proxy, self.prefill, self.decode, self.colocated]

    def kv_addr(self, s: cluster.Server) -> str:
        return f"127.0.0.1:{s.kv_port}"

    def block_files(self) -> list[Path]:
        return sorted(self.store.rglob("*.kv"))

    def restart_decode(self, timeout: float = 300.0) -> None:
        """Stop D (by PID) and start it again with the same ports and directory."""
        self.decode.stop()
        self.restarts += 1
        self.decode = cluster.start_vllm(f"decode-{self.restarts}", self.decode.port, self.log_dir,
                                         kv_config=self.decode_config, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                                         **self.decode_tracing)
        cluster.wait_until([self.decode], "/health", timeout)
        wait_ready(self.proxy)

    def stop(self) -> None:
        for s in self.servers():
            s.stop()


def wait_ready(proxy: cluster.Server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while cluster.http_get(proxy.url + "/ready")[0] != 200:
        if time.monotonic() > deadline:
            raise TimeoutError("proxy never saw P and D register")
        time.sleep(0.3)


def _tracing(traces: OtlpReceiver | None, service: str) -> dict:
    if traces is None:
        return {}
    return {"env": traces.export_env(service), "extra_args": ["--otlp-traces-endpoint", traces.endpoint]}


def start(log_dir: Path, store: Path, timeout: float = 600.0, traces: OtlpReceiver | None = None) -> SSCluster:
    disc = free_port()
    proxy = cluster.start_proxy(free_port(), disc, log_dir, ["--heartbeat-timeout", "5"])
    p_port, d_port = free_port(), free_port()
    p_cfg = kv_config("kv_producer", store, p_port, free_port_pair(), disc)
    d_cfg = kv_config("kv_consumer", store, d_port, free_port_pair(), disc)
    common = dict(max_num_batched_tokens=MAX_BATCHED_TOKENS)
    d_tracing = _tracing(traces, "vllm-decode")
    prefill = cluster.start_vllm("prefill", p_port, log_dir, kv_config=p_cfg, **common,
                                 **_tracing(traces, "vllm-prefill"))
    decode = cluster.start_vllm("decode", d_port, log_dir, kv_config=d_cfg, **common, **d_tracing)
    colocated = cluster.start_vllm("colocated", free_port(), log_dir, **common)
    c = SSCluster(proxy, prefill, decode, colocated, store, log_dir, disc, decode_config=d_cfg,
                  decode_tracing=d_tracing)
    try:
        cluster.wait_until([proxy], "/health", 60)
        cluster.wait_until([prefill, decode, colocated], "/health", timeout)
        wait_ready(proxy)
    except BaseException:
        c.stop()
        raise
    return c


__all__ = ["SSCluster", "e2e_cluster", "kv_config", "start", "wait_ready"]

"""Start and stop vLLM (CPU build) servers and proxies for the end-to-end tests and the
benchmarks: the one process spawner they share (spare ports, one server at a time).
Every server listens on 127.0.0.1; every process we start runs in its own
session and is stopped by its PID (process group), nothing else is touched.
The operators' bring-up is the launcher (xpyd_deploy/launch.py, `xpyd launch`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.ports import port_free, spare_port  # noqa: F401  (port_free: re-exported)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / ".models" / "tiny-llama"
HOST = "127.0.0.1"


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    kv_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group (vLLM's engine children included)."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL the whole group at once: a crash, for fault tests."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def free_port() -> int:
    """A spare port (outside the ephemeral range: the servers here bind it later)."""
    return spare_port()


def free_port_pair() -> int:
    """A spare port p with p+1 free too (kv_port + rank for two ranks)."""
    return spare_port(2)


def kv_transfer_config(
    role: str,
    kv_port: int,
    http_port: int,
    proxy_port: int | None,
    send_type: str = "PUT_ASYNC",
    **extra: object,
) -> dict:
    """The --kv-transfer-config an existing P2pNcclConnector deployment uses, plus
    kv_connector_module_path. vLLM 0.32 rejects top-level kv_ip/kv_buffer_size, so
    those sit in kv_connector_extra_config."""
    ec: dict[str, object] = {"http_port": http_port, "send_type": send_type, "kv_ip": HOST,
                             "kv_buffer_size": 1e9}
    if proxy_port is not None:
        ec.update(proxy_ip=HOST, proxy_port=proxy_port, heartbeat_interval_s=1.0)
    ec.update(extra)
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_connector_module_path": "connector",
        "kv_role": role,
        "kv_port": kv_port,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": ec,
    }


def _spawn(name: str, port: int, cmd: list[str], log_dir: Path, env: dict[str, str | None],
           drop_env: tuple[str, ...] = (), kv_port: int | None = None, cwd: Path = ROOT) -> Server:
    """Start cmd in its own session (so stop() can signal the whole group), output
    to log_dir/name.log, with this repo importable in every child process (after ``cwd``'s
    packages, which ``python -m`` imports first)."""
    penv: dict[str, str] = {k: v for k, v in os.environ.items() if k not in drop_env}
    penv["PYTHONPATH"] = f"{ROOT}{os.pathsep}{penv.get('PYTHONPATH', '')}"
    for k, v in env.items():  # None: unset what this process inherited
        if v is None:
            penv.pop(k, None)
        else:
            penv[k] = v
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=penv,
                                start_new_session=True, cwd=cwd)
    return Server(name, port, proc, log_path, kv_port=kv_port)


def start_vllm(
    name: str,
    port: int,
    log_dir: Path,
    model: Path = DEFAULT_MODEL,
    kv_config: dict | None = None,
    max_num_batched_tokens: int | None = None,
    cpus: str | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str | None] | None = None,
) -> Server:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny-llama",
        "--host", HOST, "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "4096", "--seed", "0",
        "--enforce-eager", "--kv-cache-memory-bytes", str(256 * 1024 * 1024),
    ]
    if max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    cmd += extra_args or []
    if cpus:
        cmd = ["taskset", "-c", cpus] + cmd
    penv = {
        # One list for a single-rank server ("0,1"); "|" would separate per-rank lists.
        **({"VLLM_CPU_OMP_THREADS_BIND": cpus} if cpus else {}),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
        **(env or {}),
    }
    return _spawn(name, port, cmd, log_dir, penv, drop_env=("VLLM_CPU_KVCACHE_SPACE",),  # overrides the byte flag
                  kv_port=(kv_config or {}).get("kv_port"))


def start_proxy(port: int, discovery_port: int, log_dir: Path, extra_args: list[str] | None = None,
                name: str = "proxy", env: dict[str, str | None] | None = None, checkout: Path | None = None) -> Server:
    """``checkout``: run the proxy package of another tree (e.g. ``git archive REV proxy xpyd_wire``
    unpacked there), for a benchmark's before/after in one run."""
    cmd = [sys.executable, "-m", "proxy", "--host", HOST, "--port", str(port),
           "--discovery-host", HOST, "--discovery-port", str(discovery_port)] + (extra_args or [])
    return _spawn(name, port, cmd, log_dir, env or {}, cwd=checkout or ROOT)


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name) of every live process:
    fields[2] is the process group, fields[3] the session, fields[11:13] utime and stime."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                yield int(d), f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile


def stop_all(servers: list[Server]) -> None:
    """Stop servers, the last started first; one that fails to stop is reported and the others
    still stopped (the benchmarks' teardown)."""
    for s in reversed(servers):
        try:
            s.stop()
        except Exception as e:  # noqa: BLE001 - keep stopping the others
            print(f"stopping {s.name}: {e}", file=sys.stderr)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback)
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until(servers: list[Server], path: str, timeout: float) -> None:
    """Poll GET path on each server until 200; fail fast if one exits."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive():
                raise RuntimeError(f"{s.name} exited early (rc={s.proc.returncode}):\n{s.log()[-4000:]}")
            try:
                if http_get(s.url + path, timeout=1.0)[0] == 200:
                    pending.remove(s)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout}s: {[s.name for s in pending]}")
        if pending:
            time.sleep(0.5)

"""GPU: a prefill engine and a decode engine in two processes move CUDA KV blocks over real
NCCL (the library torch ships; no vLLM), for every vLLM KV cache layout and send mode.

Both processes share one GPU. NCCL refuses two ranks of one communicator on one GPU when
they look like one host ("Duplicate GPU detected"); different NCCL_HOSTID values (with
NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1) make them two hosts joined by NCCL's socket
transport on loopback. Skipped without CUDA (CI has none).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PEER = REPO / "tests" / "gpu_kv_peer.py"
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(host_id: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(NCCL_HOSTID=host_id, NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1", PYTHONUNBUFFERED="1")
    return env


def _json_line(proc: subprocess.Popen, what: str) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"{what} ended without output: {proc.stderr.read()[-3000:]}")
    return json.loads(line)


def run_pair(layout: str, send_type: str, transport: str = "nccl", device: str = "cuda",
             timeout: float = 90.0) -> tuple[dict, dict]:
    p_port, d_port = _free_port(), _free_port()
    common = ["--layout", layout, "--send-type", send_type, "--transport", transport, "--timeout", "60",
              "--device", device]
    d = subprocess.Popen([sys.executable, str(PEER), "--role", "d", "--port", str(d_port), "--peer-port",
                          str(p_port), *common], env=_env("xpyd-test-d"), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p = subprocess.Popen([sys.executable, str(PEER), "--role", "p", "--port", str(p_port), "--peer-port",
                          str(d_port), *common], env=_env("xpyd-test-p"), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _json_line(d, "decode").get("ready")
        assert _json_line(p, "prefill").get("ready")
        d.stdin.write("go\n")
        d.stdin.flush()
        d_out = _json_line(d, "decode")
        p.stdin.close()
        p_out = _json_line(p, "prefill")
        d.wait(timeout)
        p.wait(timeout)
        return p_out, d_out
    finally:
        for proc in (p, d):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("send_type", ["PUT_ASYNC", "PUT", "GET"])
def test_cuda_blocks_move_over_real_nccl(layout, send_type):
    p_out, d_out = run_pair(layout, send_type)
    assert p_out["transport"] == d_out["transport"] == "nccl"
    assert d_out["loaded"], d_out
    assert d_out["sha"] == p_out["sha"]  # every layer's blocks byte-identical
    assert d_out["others_untouched"]
    assert sum(d_out["communicators"].values()) == 1  # D took (PUT) or made (GET) one communicator


@pytest.mark.gpu
def test_cuda_blocks_over_tcp_between_processes_match_nccl():
    """The same pair over tcp (host staging): the baseline the nccl run must equal."""
    p_out, d_out = run_pair("LBHNC", "PUT_ASYNC", transport="tcp")
    assert d_out["loaded"] and d_out["sha"] == p_out["sha"]


@pytest.mark.parametrize("layout, send_type", [("BLHNC", "GET"), ("LHBNC", "PUT_ASYNC")])
def test_two_process_harness_on_cpu(layout, send_type):
    """The harness of the GPU test, on CPU caches over tcp: so CI keeps it working (a GPU
    run is rare) and its checks have power (the two caches start different)."""
    p_out, d_out = run_pair(layout, send_type, transport="tcp", device="cpu")
    assert d_out["loaded"] and d_out["others_untouched"]
    assert d_out["sha"] == p_out["sha"]

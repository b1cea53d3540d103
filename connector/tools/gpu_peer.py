"""One side (prefill or decode) of the two-process engine test: a real KVEngine over KV
caches laid out as a vLLM KVCacheLayout, talking to the other process over the transport
the config names (nccl with the real library on a GPU machine). Needs torch, not vLLM. Run
by ``run_pair`` (tests/unit/test_gpu_nccl_engine.py, ``xpyd doctor``):

    python -m connector.tools.gpu_peer --role d --port P --peer-port Q --layout BLHNC --send-type PUT_ASYNC

Prints one JSON line: the sha256 of every layer's source blocks (P) or destination blocks
(D), whether D's other blocks are untouched, and what the engine reported. NCCL refuses two
ranks of one communicator on one GPU when they look like one host ("Duplicate GPU
detected"): on one GPU each process gets its own NCCL_HOSTID (with NCCL_SOCKET_IFNAME=lo,
NCCL_IB_DISABLE=1), so NCCL joins them with its socket transport on loopback; on two GPUs
they run as they would in production (P2P/SHM).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from connector import layout as kvlayout
from connector.config import ConnectorConfig
from connector.p2p.engine import KVEngine
from connector.p2p.metadata import LoadSpec, SaveSpec

HOST = "127.0.0.1"
KEY = "0123456789abcdef0123456789abcdef"
# Logical [L, B, H, N, C] -> physical order, as vLLM's KVCacheLayout values.
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
SRC_IDS = (3, 4, 9, 1, 12)
DST_IDS = (7, 2, 11)  # D has the first 2 blocks already (prefix hit)
FIRST = 2


def make_caches(layout: str, seed: int, layers: int = 4, blocks: int = 16, heads: int = 8, tokens: int = 16,
                content: int = 128, dtype: torch.dtype = torch.bfloat16,
                device: str = "cuda") -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views over one buffer, strided as vLLM lays out ``layout``."""
    shape = (layers, blocks, heads, tokens, content)
    order = LAYOUTS[layout]
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    raw = torch.randint(0, 1 << 15, (step,), dtype=torch.int16, generator=gen).view(dtype).to(device)
    view = torch.as_strided(raw, shape, strides)
    return {f"model.layers.{i}.self_attn.attn": view[i] for i in range(layers)}


def block_sha(cache: torch.Tensor, ids: tuple[int, ...]) -> str:
    data = cache[list(ids)].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("p", "d"), required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--peer-port", type=int, required=True)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    ap.add_argument("--send-type", default="PUT_ASYNC")
    ap.add_argument("--granularity", choices=("request", "layer"), default="request",
                    help="layer: P reports each layer written, as vLLM's save_kv_layer does, then the step's end")
    ap.add_argument("--transport", default="nccl")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--device", default="cuda", help="cpu: check this script itself (tcp only)")
    args = ap.parse_args()

    caches = make_caches(args.layout, seed=1 if args.role == "p" else 2, device=args.device)
    first = next(iter(caches.values()))
    tokens = first.shape[2]
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: SimpleNamespace(name=args.layout), num_gpu_blocks=first.shape[0]))
    layout = kvlayout.detect(vcfg, caches)
    cfg = ConnectorConfig(
        role="kv_producer" if args.role == "p" else "kv_consumer", kv_ip=HOST, kv_port=args.port, http_host=HOST,
        http_port=None, proxies=(), send_type=args.send_type, kv_buffer_size=1 << 30, kv_load_timeout_s=args.timeout,
        send_timeout_s=args.timeout, buffer_ttl_s=120.0, heartbeat_interval_s=3.0, transport=args.transport,
        thread_affinity="off", discovery_secret=None, allow_debug_corruption=False,
        send_granularity=args.granularity)
    engine = KVEngine(cfg, 0, caches, layout)
    n_prompt = len(SRC_IDS) * tokens - 3
    out: dict = {"role": args.role, "transport": engine._transport.name, "layout": str(layout),
                 "layerwise": engine.layerwise}
    try:
        if args.role == "p":
            out["sha"] = [block_sha(c, SRC_IDS[FIRST:]) for c in caches.values()]
            print(json.dumps({"ready": True}), flush=True)
            spec = SaveSpec(req_id="P-req", transfer_key=KEY, decode_addr=f"{HOST}:{args.peer_port}",
                            prefill_addr=f"{HOST}:{args.port}", block_ids=SRC_IDS, num_tokens=n_prompt,
                            delay_free=args.send_type == "PUT_ASYNC")
            for name in caches:  # layer-wise: each layer goes as it is reported (no-op otherwise)
                engine.save_layer(spec, name)
            engine.save(spec)
            sent = set()
            deadline = time.monotonic() + args.timeout
            while args.send_type == "PUT_ASYNC" and "P-req" not in sent and time.monotonic() < deadline:
                sent |= engine.poll({"P-req"}).finished_sending
                time.sleep(0.01)
            out["sent"] = "P-req" in sent or args.send_type != "PUT_ASYNC"
            sys.stdin.readline()  # GET: D fetches from us; the test closes stdin when D is done
        else:
            before = {k: v.clone() for k, v in caches.items()}
            print(json.dumps({"ready": True}), flush=True)
            sys.stdin.readline()  # P is up (GET) or has been told to send (PUT)
            engine.add_load(LoadSpec(req_id="D-req", transfer_key=KEY, prefill_addr=f"{HOST}:{args.peer_port}",
                                     dst_block_ids=DST_IDS, first_block=FIRST,
                                     num_tokens=n_prompt - 1 - FIRST * tokens, prompt_tokens=n_prompt,
                                     prompt_blocks=len(SRC_IDS)))
            engine.release([KEY])
            done, failed = set(), set()
            t0 = time.monotonic()
            while "D-req" not in done and time.monotonic() - t0 < args.timeout:
                r = engine.poll(set())
                done |= r.finished_recving
                failed |= r.failed_recving
                time.sleep(0.005)
            if args.device != "cpu":
                torch.cuda.synchronize()
            out["load_ms"] = (time.monotonic() - t0) * 1e3
            out["loaded"] = "D-req" in done and not failed
            out["sha"] = [block_sha(c, DST_IDS) for c in caches.values()]
            others = [b for b in range(first.shape[0]) if b not in DST_IDS]
            out["others_untouched"] = all(torch.equal(c[others].view(torch.int16), before[k][others].view(torch.int16))
                                          for k, c in caches.items())
            out["communicators"] = getattr(engine._transport, "communicators", dict)()
    finally:
        engine.close()
    print(json.dumps(out), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that imports this checkout (``-m connector...``)."""
    repo = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH")))), **extra}


def split_host_env(host_id: str) -> dict[str, str]:
    """This process as an NCCL host of its own, joined to the others over loopback sockets."""
    return {"NCCL_HOSTID": host_id, "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


class _Peer:
    """One engine process of a pair. Its stderr goes to a file (a pipe nobody reads until the
    end could fill up and stall it); stdout carries its JSON lines, among whatever else is
    printed there (NCCL_DEBUG without NCCL_DEBUG_FILE writes to stdout)."""

    def __init__(self, what: str, cmd: list[str], env: dict[str, str]) -> None:
        self.what = what
        self.err = tempfile.TemporaryFile(mode="w+", prefix=f"xpyd-{what}-")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True)
        self.other: list[str] = []  # stdout lines that were not ours

    def stderr_tail(self) -> str:
        self.err.seek(0)
        return (self.err.read()[-3000:] + "".join(self.other)[-1000:]).strip()

    def json_line(self, deadline: float) -> dict:
        """The next JSON object the peer prints. One that prints none by ``deadline``
        (monotonic) is killed: a hung peer ends the check instead of hanging the doctor."""
        while True:
            box: list[str] = []
            reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                self.proc.kill()  # its stdout closes: the read returns
                reader.join(10)
                raise TimeoutError(f"{self.what} printed nothing in time (killed): {self.stderr_tail()}")
            if not box or not box[0]:
                self.proc.wait(10)
                raise RuntimeError(f"{self.what} ended without output: {self.stderr_tail()}")
            if box[0].startswith("{"):
                return json.loads(box[0])
            self.other.append(box[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.err.close()


def run_pair(layout: str, send_type: str, transport: str = "nccl", device: str = "cuda",
             timeout: float = 90.0, p_device: str | None = None, d_device: str | None = None,
             split_hosts: bool = True, granularity: str = "request") -> tuple[dict, dict]:
    """A prefill and a decode engine, each in a process of its own, move one request's
    blocks; returns what each printed (checksums, load result). ``p_device``/``d_device``
    (default ``device``) put them on two GPUs; ``split_hosts`` makes the two processes two
    NCCL hosts (needed when they share a GPU, not otherwise). Everything ends by ``timeout``."""
    common = ["--layout", layout, "--send-type", send_type, "--transport", transport, "--timeout",
              str(int(timeout * 2 / 3)), "--granularity", granularity]

    def start(role: str, port: int, peer_port: int, dev: str) -> _Peer:
        env = child_env(PYTHONUNBUFFERED="1")
        if split_hosts:
            env.update(split_host_env(f"xpyd-pair-{role}"))
        return _Peer("decode" if role == "d" else "prefill",
                     [sys.executable, "-m", "connector.tools.gpu_peer", "--role", role, "--port", str(port),
                      "--peer-port", str(peer_port), "--device", dev, *common], env)

    deadline = time.monotonic() + timeout
    # A free port can be taken before the peer binds it: by another pair running beside this
    # one (pytest-xdist) or by NCCL's own loopback listeners. Such a pair starts again on
    # fresh ports, within the same deadline.
    for attempt in range(3):
        p_port, d_port = _free_port(), _free_port()
        peers: list[_Peer] = []
        try:
            d = start("d", d_port, p_port, d_device or device)
            peers.append(d)
            p = start("p", p_port, d_port, p_device or device)
            peers.append(p)
            try:
                ready = d.json_line(deadline).get("ready") and p.json_line(deadline).get("ready")
            except RuntimeError as e:
                if "Address already in use" in str(e) and attempt < 2:
                    continue
                raise
            if not ready:
                raise RuntimeError("a peer did not get ready")
            d.proc.stdin.write("go\n")
            d.proc.stdin.flush()
            d_out = d.json_line(deadline)
            p.proc.stdin.close()
            p_out = p.json_line(deadline)
            d.proc.wait(max(1.0, deadline - time.monotonic()))
            p.proc.wait(max(1.0, deadline - time.monotonic()))
            return p_out, d_out
        finally:
            for peer in peers:
                peer.stop()
    raise AssertionError("unreachable: the last attempt returns or raises")

if __name__ == "__main__":
    main()

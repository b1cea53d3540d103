"""``xpyd doctor`` (or ``python -m connector.tools.doctor``): the first thing to run on a machine
that will serve with xPyD. It reports the environment, then checks what this machine can:

* everywhere: NCCL found, loads, its version; our ``ncclConfig_t`` against the ``nccl.h``
  beside that library (when there is one and a C compiler); the tcp transport round trip;
  gather/scatter of every KV cache layout on CPU; a prefill and a decode engine in two
  processes moving a request's KV over tcp (PUT, PUT_ASYNC, GET, layer-wise PUT_ASYNC);
* with a GPU: the same engine pair over real NCCL for every layout and send mode, with
  checksums (two GPUs when there are two, as production runs them; else one GPU shared by
  two processes made two NCCL hosts), pinned staging, and GB/s of NCCL send/recv,
  gather/scatter and staging against a device copy measured in the same run;
* ``--vllm MODEL`` (two GPUs): 1P1D through the launcher (``python -m xpyd_deploy.launch``,
  shipped in the same wheel) against one colocated vLLM server, greedy tokens compared.

Prints a table; ``--json FILE`` writes everything. Exit codes: 0 every check passed (GPU
included); 1 a check failed; 2 bad arguments; 3 no GPU here: every device-free check passed,
the GPU checks could not run (the JSON's ``not_checked`` says which).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3
SEND_TYPES = ("PUT_ASYNC", "PUT", "GET")
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Check:
    name: str
    status: str  # pass | fail | skip | info
    detail: str = ""
    seconds: float = 0.0
    data: Any = None


@dataclass
class Report:
    environment: dict = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    verbose: bool = True

    def run(self, name: str, fn: Callable[[], tuple[str, str, Any]]) -> Check:
        """``fn`` returns (status, detail, data); an exception is a failure naming it."""
        t0 = time.monotonic()
        try:
            status, detail, data = fn()
        except Exception as e:  # noqa: BLE001 - a check that raises failed; the rest still run
            status, detail, data = "fail", f"{type(e).__name__}: {e}", traceback.format_exc(limit=8)
        check = Check(name, status, detail, round(time.monotonic() - t0, 2), data)
        self.checks.append(check)
        if self.verbose:
            print(f"  {status.upper():5s} {name} ({check.seconds:.1f} s) {detail}", flush=True)
        return check

    def exit_code(self, gpu: bool) -> int:
        if any(c.status == "fail" for c in self.checks):
            return EXIT_FAILED
        return EXIT_OK if gpu else EXIT_NO_GPU

    def to_json(self, gpu: bool) -> dict:
        return {"tool": "xpyd doctor", "exit_code": self.exit_code(gpu), "gpu": gpu,
                "environment": self.environment, "checks": [asdict(c) for c in self.checks],
                "not_checked": self.not_checked}


# ------------------------------------------------------------------ environment


def _run_text(cmd: list[str], timeout: float = 10.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def environment() -> dict:
    import torch

    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available()}
    if env["cuda_available"]:
        env["gpus"] = [{"name": torch.cuda.get_device_name(i),
                        "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                        "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                       for i in range(torch.cuda.device_count())]
        with contextlib.suppress(Exception):
            env["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    smi = shutil.which("nvidia-smi")
    env["driver"] = _run_text([smi, "--query-gpu=driver_version", "--format=csv,noheader"]) if smi else None
    env["nccl_library_env"] = os.environ.get("XPYD_NCCL_LIBRARY")
    nccl_vars = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    env["nccl_env"] = nccl_vars  # process-wide NCCL settings change every communicator
    try:
        import vllm

        env["vllm"] = getattr(vllm, "__version__", "?")
        from vllm import envs as venvs

        env["vllm_kv_cache_layout"] = (venvs.VLLM_KV_CACHE_LAYOUT
                                       or "not forced: vLLM resolves it per model at start-up (the attention "
                                          "backend's first supported layout)")
    except Exception as e:  # noqa: BLE001 - vLLM missing or broken: reported, not fatal
        env["vllm"] = f"not importable ({type(e).__name__}: {e})"
    from connector import layout as kvlayout

    env["layouts_supported"] = sorted(kvlayout.LAYOUT_ORDERS)
    return env


# ------------------------------------------------------------------ device-free checks


def check_nccl_library(gpu: bool) -> tuple[str, str, Any]:
    from connector.transport import nccl_lib

    try:
        lib = nccl_lib.CtypesNccl()
    except nccl_lib.NcclUnavailable as e:
        if gpu:
            return "fail", f"no usable libnccl: {e}", None
        return "skip", f"no usable libnccl (the nccl transport needs one on a GPU; tcp works without): {e}", None
    data = {"path": getattr(lib._lib, "_name", "?"), "version": lib.version()}
    return "pass", f"NCCL {lib.version()} at {data['path']}", data


def check_vllm_binding() -> tuple[str, str, Any]:
    from connector.transport import nccl_lib

    try:
        lib = nccl_lib.VllmNccl()
    except nccl_lib.NcclUnavailable as e:
        return "info", f"vLLM's NCCL binding not used: {e} (ours is used over the same libnccl)", None
    return "info", f"vLLM's binding loads NCCL {lib.version()} (one libnccl in the process)", lib.version()


def check_unique_id() -> tuple[str, str, Any]:
    from connector.transport import nccl_lib

    lib = nccl_lib.CtypesNccl()
    a, b = lib.unique_id(), lib.unique_id()
    if len(a) != 128 or a == b:
        return "fail", f"unique ids: {len(a)} bytes, distinct={a != b}", None
    return "pass", "128-byte unique ids", None


CONFIG_C = r"""
#include <stdio.h>
#include <stddef.h>
#include <string.h>
#include "nccl.h"
#define F(name) printf("\"%s\": [%zu, %lld], ", #name, offsetof(ncclConfig_t, name), (long long)c.name)
int main(int argc, char** argv) {
  /* as parseCommConfig: NCCL's initializer, then min(our size, sizeof) of our bytes over it */
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  ncclConfig_t dflt = NCCL_CONFIG_INITIALIZER;
  unsigned char ours[256];
  size_t n = strlen(argv[1]) / 2;
  for (size_t i = 0; i < n && i < sizeof(ours); i++) sscanf(argv[1] + 2 * i, "%2hhx", &ours[i]);
  size_t size; memcpy(&size, ours, sizeof(size));
  memcpy(&c, ours, size < sizeof(c) ? size : sizeof(c));
  printf("{\"sizeof\": %zu, \"code\": %d, \"default_magic\": %u, ", sizeof(ncclConfig_t), NCCL_VERSION_CODE,
         dflt.magic);
  F(size); F(magic); F(version); F(blocking); F(cgaClusterSize); F(minCTAs); F(maxCTAs); F(splitShare);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 26, 0)
  F(trafficClass);
  printf("\"default_trafficClass\": %d, ", dflt.trafficClass);
#endif
  printf("\"netName\": [%zu, %d], ", offsetof(ncclConfig_t, netName), c.netName == NULL);
  printf("\"undef\": %d}\n", NCCL_CONFIG_UNDEF_INT);
  return 0;
}
"""
# nccl.h includes CUDA's headers for two handle types only; the check compiles without CUDA.
_STUB_CUDA_RUNTIME = "typedef struct CUstream_st* cudaStream_t;\ntypedef struct CUevent_st* cudaEvent_t;\n"


def nccl_h_view(include_dir: Path, num_channels: int | None = None) -> dict:
    """Compile against ``include_dir/nccl.h`` and return what NCCL's parseCommConfig makes of
    our config bytes: each field's offset and value, and NCCL's defaults. Raises when no C
    compiler is found or the header does not compile."""
    from connector.transport.nccl_api import CommConfig
    from connector.transport.nccl_lib import make_config

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc)")
    cfg = make_config(CommConfig(num_channels=num_channels))
    ours = ctypes.string_at(ctypes.addressof(cfg), ctypes.sizeof(cfg))
    with tempfile.TemporaryDirectory(prefix="xpyd-nccl-h-") as tmp:
        d = Path(tmp)
        (d / "cuda_runtime.h").write_text(_STUB_CUDA_RUNTIME)
        for name in ("cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h"):
            (d / name).write_text("")
        (d / "config.c").write_text(CONFIG_C)
        subprocess.run([cc, "-I", str(d), "-I", str(include_dir), "-o", str(d / "config"), str(d / "config.c")],
                       check=True, capture_output=True, timeout=60)
        out = subprocess.run([str(d / "config"), ours.hex()], check=True, capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)


def config_mismatches(seen: dict, num_channels: int | None = None) -> list[str]:
    """What in ``nccl_h_view``'s answer differs from what we mean to send; [] when all agree."""
    from connector.transport.nccl_lib import CONFIG_VERSION, ncclConfig

    bad = []
    for name, _ in ncclConfig._fields_:
        if name in seen and seen[name][0] != getattr(ncclConfig, name).offset:
            bad.append(f"{name} at offset {seen[name][0]} in nccl.h, {getattr(ncclConfig, name).offset} in ours")
    if seen["sizeof"] < ctypes.sizeof(ncclConfig):
        bad.append(f"nccl.h's ncclConfig_t is {seen['sizeof']} bytes, ours {ctypes.sizeof(ncclConfig)}")
    undef = seen["undef"]
    want = {"magic": seen["default_magic"], "size": ctypes.sizeof(ncclConfig), "version": CONFIG_VERSION,
            "blocking": 0, "cgaClusterSize": undef, "splitShare": undef,
            "minCTAs": num_channels or undef, "maxCTAs": num_channels or undef}
    if "trafficClass" in seen:
        want["trafficClass"] = seen["default_trafficClass"]
    for name, value in want.items():
        if seen[name][1] != value:
            bad.append(f"NCCL would read {name}={seen[name][1]}, we mean {value}")
    if seen["netName"][1] != 1:
        bad.append("NCCL would read a netName we did not set")
    return bad


def check_config_struct() -> tuple[str, str, Any]:
    from connector.transport import nccl_lib

    size = ctypes.sizeof(nccl_lib.ncclConfig)
    offsets = {name: getattr(nccl_lib.ncclConfig, name).offset for name, _ in nccl_lib.ncclConfig._fields_}
    data: dict[str, Any] = {"sizeof": size, "offsets": offsets}
    if ctypes.sizeof(ctypes.c_void_p) == 8 and (size, offsets["netName"], offsets["trafficClass"]) != (48, 32, 44):
        return "fail", f"ncclConfig_t layout off: {data}", data
    header = None
    with contextlib.suppress(nccl_lib.NcclUnavailable):
        lib_path = Path(getattr(nccl_lib.CtypesNccl()._lib, "_name", ""))
        for cand in (lib_path.parent.parent / "include" / "nccl.h", lib_path.parent / "include" / "nccl.h"):
            if cand.is_file():
                header = cand
                break
    if header is None:
        return "pass", ("48 bytes, offsets as nccl.h of 2.18.1-2.32.3 (CI checks every wheel); "
                        "no nccl.h beside this libnccl to compile against"), data
    bad = []
    for channels in (None, 4):
        try:
            seen = nccl_h_view(header.parent, channels)
        except (RuntimeError, subprocess.CalledProcessError) as e:
            return "pass", f"48 bytes, offsets as recorded; {header} not compiled: {e}", data
        bad += config_mismatches(seen, channels)
    data["header"] = str(header)
    if bad:
        return "fail", "; ".join(bad), data
    return "pass", f"every field NCCL reads is what we mean, per {header}", data


def check_init_without_gpu() -> tuple[str, str, Any]:
    """No device: NCCL must refuse with its CUDA error (our config is read after that)."""
    import threading

    from connector.transport import nccl_lib
    from connector.transport.nccl_api import CommConfig, NcclError

    lib = nccl_lib.CtypesNccl()
    box: list[Any] = []

    def attempt() -> None:
        try:
            box.append(lib.init_rank(2, bytes(128), 1, CommConfig()))
        except NcclError as e:
            box.append(e)

    t = threading.Thread(target=attempt, daemon=True)  # a fresh thread: NCCL keeps per-thread group state
    t.start()
    t.join(30)
    if not box:
        return "fail", "ncclCommInitRankConfig did not return within 30 s without a GPU", None
    e = box[0]
    if isinstance(e, NcclError) and e.code == 1:
        return "pass", f"refused with the CUDA error, as it must without a GPU ({e})", None
    return "fail", f"expected ncclUnhandledCudaError without a GPU, got {e!r}", None


def check_tcp_roundtrip() -> tuple[str, str, Any]:
    """A tensor round trip over the tcp transport's two channels: the first call goes over
    zmq and names the server's byte stream, the second goes over that stream (the KV path)."""
    import torch

    from connector.transport import TcpTransport

    def sha(ts: list) -> list[str]:
        return [hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for t in ts]

    server, client = TcpTransport(), TcpTransport()
    server.start("127.0.0.1", 0, lambda h, ts: ({"sha": sha(ts)}, ts[::-1]))
    g = torch.Generator().manual_seed(0)
    sent = [torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=g).view(dt)
            for n, dt in ((4096, torch.bfloat16), (1 << 20, torch.float16), (333, torch.int16))]
    wrong = []
    try:
        for channel in ("zmq", "byte stream"):
            reply, back = client.call(f"127.0.0.1:{server.bound_port}", {"op": "echo"}, sent, timeout_s=30)
            if not (reply.get("sha") == sha(sent) and sha(back) == sha(sent[::-1])):
                wrong.append(channel)
        streamed = client.stream_calls
    finally:
        client.close()
        server.close()
    nbytes = sum(t.numel() * t.element_size() for t in sent)
    if wrong:
        return "fail", f"bytes changed over {' and '.join(wrong)}", None
    if streamed != 1:
        return "fail", "the second call did not go over the byte stream (its port refused on loopback?)", None
    return "pass", f"{nbytes} bytes both ways, over zmq and over the byte stream", None


def check_layouts_cpu() -> tuple[str, str, Any]:
    import torch

    from connector import layout as kvlayout
    from connector.tools.gpu_peer import LAYOUTS, make_caches

    src_ids, dst_ids = [3, 4, 9, 1, 12], [7, 2, 11, 0, 15]
    bad = []
    for name in sorted(LAYOUTS):
        src = next(iter(make_caches(name, 1, layers=1, device="cpu").values()))
        dst = next(iter(make_caches(name, 2, layers=1, device="cpu").values()))
        kvlayout.scatter_packed(dst, dst_ids, kvlayout.gather_packed(src, src_ids))
        if not torch.equal(dst[dst_ids].view(torch.int16), src[src_ids].view(torch.int16)):
            bad.append(name)
    if bad:
        return "fail", f"gather/scatter round trip wrong for {bad}", None
    return "pass", f"gather/scatter round trip for {', '.join(sorted(LAYOUTS))}", None


def _pair_check(layout: str, send_type: str, transport: str, **kw: Any) -> tuple[str, str, Any]:
    from connector.tools.gpu_peer import run_pair

    p_out, d_out = run_pair(layout, send_type, transport=transport, **kw)
    problems = []
    if p_out.get("transport") != transport or d_out.get("transport") != transport:
        problems.append(f"transports {p_out.get('transport')}/{d_out.get('transport')}, wanted {transport}")
    if not d_out.get("loaded"):
        problems.append("decode did not load")
    if d_out.get("sha") != p_out.get("sha"):
        problems.append("blocks differ (checksums)")
    if not d_out.get("others_untouched"):
        problems.append("other blocks changed")
    data = {"load_ms": d_out.get("load_ms"), "communicators": d_out.get("communicators")}
    if problems:
        return "fail", "; ".join(problems), {**data, "p": p_out, "d": d_out}
    return "pass", f"checksums equal, load {d_out.get('load_ms', 0):.0f} ms", data


# ------------------------------------------------------------------ GPU checks


def check_single_rank_nccl() -> tuple[str, str, Any]:
    import torch

    from connector.transport import nccl_lib
    from connector.transport.nccl_api import NCCL_IN_PROGRESS, NCCL_SUCCESS, CommConfig

    lib = nccl_lib.load_nccl_library()
    dev = torch.device("cuda", 0)
    t0 = time.monotonic()
    comm = lib.init_rank(1, lib.unique_id(), 0, CommConfig(), device=dev)
    while (code := lib.status(comm)) == NCCL_IN_PROGRESS and time.monotonic() - t0 < 60:
        time.sleep(0.005)
    if code != NCCL_SUCCESS:
        lib.abort(comm)
        return "fail", f"a one-rank communicator: {code} {lib.error_string(code)}", None
    lib.destroy(comm)
    return "pass", f"{lib.name} binding, NCCL {lib.version()}, ready in {time.monotonic() - t0:.2f} s", \
        {"library": lib.name, "fallbacks": getattr(lib, "fallbacks", 0)}


def check_bench_transfers(two_gpus: bool, channels: int | None) -> tuple[str, str, Any]:
    from connector.tools.gpu_bench import measure_transfers_fresh

    res = measure_transfers_fresh([4, 64, 256], repeats=5, nccl_channels=channels, split_hosts=not two_gpus,
                                  server_device="cuda:1" if two_gpus else "cuda")
    big = res["rows"][-1]
    detail = (f"{big['mib']} MiB: nccl PUT {big['nccl_put']:.2f}, GET {big['nccl_get']:.2f}, tcp {big['tcp_put']:.2f}, "
              f"device copy {big['d2d_copy']:.1f} GB/s ({'P2P between 2 GPUs' if two_gpus else 'loopback sockets, 1 GPU'})")
    return ("pass" if res["ok"] else "fail"), ("" if res["ok"] else "bytes differ; ") + detail, res


def check_bench_layouts() -> tuple[str, str, Any]:
    from connector.tools.gpu_bench import bench_layouts

    rows = bench_layouts("cuda", repeats=5)
    data = [dict(zip(("layout", "bytes", "gather", "scatter", "copy"), r, strict=True)) for r in rows]
    slow = [r[0] for r in rows if min(r[2], r[3]) < 0.7 * r[4]]
    if not slow:
        return "pass", "gather and scatter >= 70 % of a device copy", data
    # A speed figure under its bar, not a fault: the bytes were checked by the engine pairs.
    worst = min(min(r[2], r[3]) / r[4] for r in rows)
    return "info", f"gather/scatter down to {worst:.0%} of a device copy (bar 70 %) in {', '.join(slow)}", data


def check_bench_staging() -> tuple[str, str, Any]:
    from connector.tools.gpu_bench import bench_staging

    rows = bench_staging(repeats=5)
    keys = ("mib", "d2h_pool", "d2h_pinned", "h2d_pool", "h2d_pinned")
    return "pass", f"256 MiB: pool D2H {rows[-1][1]:.1f} / pinned {rows[-1][2]:.1f} GB/s", \
        [dict(zip(keys, r, strict=True)) for r in rows]


# ------------------------------------------------------------------ --vllm: 1P1D vs colocated

PROMPTS = ("The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):",
           "List three prime numbers:")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_json(url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_up(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before {url} answered")
        with contextlib.suppress(OSError, ValueError):
            _http_json(url, timeout=5)
            return
        time.sleep(2)
    raise TimeoutError(f"{url} did not answer in time")


def _stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to the process group we started, then SIGKILL after the grace period."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _completions(base: str, model: str) -> list[str]:
    return [_http_json(f"{base}/v1/completions", {"model": model, "prompt": p, "max_tokens": 32, "temperature": 0,
                                                  "seed": 0})["choices"][0]["text"] for p in PROMPTS]


def check_vllm_1p1d(model: str, timeout_s: float, log_dir: Path) -> tuple[str, str, Any]:
    """1P1D (GPU 0: prefill, GPU 1: decode) through the launcher and proxy, then the same
    greedy prompts on one colocated vLLM server on GPU 0; the texts must be equal."""
    launch = REPO / "scripts" / "launch.py"
    if not launch.is_file():
        return "skip", "needs the xPyD repository checkout (xpyd_deploy/launch.py)", None
    log_dir.mkdir(parents=True, exist_ok=True)
    proxy_port, disc = _free_port(), _free_port()
    topo = {"name": "doctor-1p1d", "description": "xpyd doctor --vllm", "device": "cuda", "model": model,
            "served_model_name": model, "vllm_args": ["--max-model-len=4096", "--gpu-memory-utilization=0.8",
                                                      "--seed=0"],
            "kv_transfer": {"send_type": "PUT_ASYNC", "kv_buffer_size": 2.0e9},
            "proxies": [{"name": "proxy", "host": "127.0.0.1", "port": proxy_port, "discovery_port": disc}],
            "instances": [{"name": "prefill-0", "role": "P", "host": "127.0.0.1", "port": _free_port(),
                           "kv_port": _free_port(), "devices": [0]},
                          {"name": "decode-0", "role": "D", "host": "127.0.0.1", "port": _free_port(),
                           "kv_port": _free_port(), "devices": [1]}]}
    topo_file = log_dir / "doctor-1p1d.yaml"
    topo_file.write_text(json.dumps(topo))  # JSON is YAML
    deadline = time.monotonic() + timeout_s
    with open(log_dir / "launch.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "xpyd_deploy.launch", "up", str(topo_file),
                                 "--log-dir", str(log_dir), "--timeout", str(int(timeout_s))],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_up(f"http://127.0.0.1:{proxy_port}/v1/models", proc, deadline)
            time.sleep(5)  # the launcher's own first request and registration
            disagg = _completions(f"http://127.0.0.1:{proxy_port}", model)
        finally:
            _stop(proc)
    port = _free_port()
    with open(log_dir / "colocated.log", "w") as log:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len=4096",
                                 "--gpu-memory-utilization=0.8", "--seed=0"], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_up(f"http://127.0.0.1:{port}/v1/models", proc, deadline)
            colocated = _completions(f"http://127.0.0.1:{port}", model)
        finally:
            _stop(proc)
    rows = [{"prompt": p, "equal": a == b, "disaggregated": a, "colocated": b}
            for p, a, b in zip(PROMPTS, disagg, colocated, strict=True)]
    same = sum(r["equal"] for r in rows)
    status = "pass" if same == len(rows) else "fail"
    return status, f"{same}/{len(rows)} greedy completions identical to a colocated server (logs: {log_dir})", rows


# ------------------------------------------------------------------ main


def _table(report: Report) -> str:
    width = max(len(c.name) for c in report.checks) if report.checks else 10
    lines = [f"{'check':<{width}}  {'result':<6} {'s':>6}  detail", "-" * (width + 60)]
    for c in report.checks:
        lines.append(f"{c.name:<{width}}  {c.status:<6} {c.seconds:>6.1f}  {c.detail}")
    return "\n".join(lines)


def run_doctor(args: argparse.Namespace) -> tuple[Report, bool]:
    import torch

    report = Report(verbose=not args.quiet)
    report.environment = environment()
    gpu = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if gpu else 0
    if not args.quiet:
        print("xpyd doctor: " + json.dumps({k: report.environment.get(k) for k in
                                            ("torch", "torch_cuda", "driver", "vllm", "cuda_available")}))
    lib = report.run("nccl.library", lambda: check_nccl_library(gpu))
    if not str(report.environment.get("vllm")).startswith("not importable"):
        report.run("nccl.vllm_binding", check_vllm_binding)
    if lib.status == "pass":
        report.run("nccl.unique_id", check_unique_id)
        report.run("nccl.config_struct", check_config_struct)
        if not gpu:
            report.run("nccl.init_without_gpu", check_init_without_gpu)
    report.run("transport.tcp_roundtrip", check_tcp_roundtrip)
    report.run("layout.cpu_gather_scatter", check_layouts_cpu)
    cpu_layouts = ("LBHNC", "BLHNC", "LHBNC")  # one per send mode here; the GPU run does every pair
    for send_type, layout in zip(SEND_TYPES, cpu_layouts, strict=True):
        report.run(f"engine.cpu_tcp[{layout},{send_type}]",
                   lambda layout=layout, send_type=send_type: _pair_check(layout, send_type, "tcp", device="cpu",
                                                                        split_hosts=False))
    report.run("engine.cpu_tcp[BLNHC,PUT_ASYNC,layer]",
               lambda: _pair_check("BLNHC", "PUT_ASYNC", "tcp", device="cpu", split_hosts=False, granularity="layer"))
    if gpu:
        two = n_gpus >= 2
        report.run("nccl.single_rank_communicator", check_single_rank_nccl)
        kw = ({"p_device": "cuda:0", "d_device": "cuda:1", "split_hosts": False} if two
              else {"device": "cuda", "split_hosts": True})
        from connector.tools.gpu_peer import LAYOUTS

        for layout in sorted(LAYOUTS):
            for send_type in SEND_TYPES:
                report.run(f"engine.gpu_nccl[{layout},{send_type}]",
                           lambda layout=layout, send_type=send_type: _pair_check(layout, send_type, "nccl", **kw))
            # Layer-wise: each layer's send waits on its own CUDA event, not the step's.
            report.run(f"engine.gpu_nccl[{layout},PUT_ASYNC,layer]",
                       lambda layout=layout: _pair_check(layout, "PUT_ASYNC", "nccl", granularity="layer", **kw))
        report.run("engine.gpu_tcp[LBHNC,PUT_ASYNC]", lambda: _pair_check("LBHNC", "PUT_ASYNC", "tcp", **kw))
        for channels in (None, 8):  # NCCL's choice vs vLLM P2P's fixed 8
            report.run(f"bench.nccl_transfers[channels={channels or 'auto'}]",
                       lambda channels=channels: check_bench_transfers(two, channels))
        report.run("bench.gather_scatter", check_bench_layouts)
        report.run("bench.pinned_staging", check_bench_staging)
        if not two:
            report.not_checked.append("NCCL over P2P/SHM between two GPUs (one GPU here: its two processes talk "
                                      "over NCCL's socket transport on loopback)")
        if args.vllm:
            if two:
                report.run("vllm.1p1d_vs_colocated",
                           lambda: check_vllm_1p1d(args.vllm, args.vllm_timeout, Path(args.log_dir)))
            else:
                report.not_checked.append("--vllm: 1P1D needs two GPUs (the launcher gives each instance its own)")
    else:
        report.not_checked += [
            "NCCL communicators between two processes (needs a GPU)",
            "KV over real NCCL for every layout and send mode, with checksums (needs a GPU)",
            "pinned staging and every GB/s figure (needs a GPU)",
            "our ncclConfig_t as NCCL itself parses it (without a driver NCCL stops at its CUDA error first)",
        ]
        if args.vllm:
            report.not_checked.append("--vllm: 1P1D against a colocated server (needs two GPUs)")
    return report, gpu


def main(argv: list[str] | None = None, prog: str = "python -m connector.tools.doctor") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                 epilog="exit codes: 0 all passed, 1 a check failed, 2 usage, "
                                        "3 no GPU (device-free checks passed, GPU checks not run)")
    ap.add_argument("--json", metavar="FILE", help="write the full report here ('-' for stdout)")
    ap.add_argument("--vllm", metavar="MODEL", help="also run 1P1D vs a colocated vLLM server with MODEL (2 GPUs)")
    ap.add_argument("--vllm-timeout", type=float, default=1200.0, help="seconds for --vllm's servers to come up")
    ap.add_argument("--log-dir", default=str(REPO / ".logs" / "doctor"), help="--vllm's server logs")
    ap.add_argument("--quiet", action="store_true", help="only the table")
    args = ap.parse_args(argv)
    report, gpu = run_doctor(args)
    code = report.exit_code(gpu)
    print("\n" + _table(report))
    if report.not_checked:
        print("\nnot checked here:\n" + "\n".join(f"  - {x}" for x in report.not_checked))
    verdict = {EXIT_OK: "every check passed", EXIT_FAILED: "SOME CHECKS FAILED (see above; send us the JSON)",
               EXIT_NO_GPU: "no GPU here: the device-free checks passed; run again on a GPU machine"}[code]
    print(f"\nxpyd doctor: {verdict} (exit {code})")
    if args.json:
        text = json.dumps(report.to_json(gpu), indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return code


if __name__ == "__main__":
    sys.exit(main())

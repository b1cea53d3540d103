"""Our NCCL binding (connector/transport/nccl_lib.py) against the real libnccl.so.2 of every
NCCL wheel torch and vLLM pin (scripts/nccl_wheels.py: fetched once into .nccl-wheels/,
about 1.7 GB of wheels, ~30 s here; reused after). No GPU needed and none used: without a
CUDA driver NCCL answers every call that does not need the device, and refuses the rest with
its CUDA error, which is itself checked.

Each library version runs in a child process of its own (several libnccl.so.2 in one
process would share NCCL's process-wide state: its environment cache, bootstrap threads).
Per version: the version code, the error string of every result code, unique ids (128
bytes, distinct; each one starts a bootstrap thread and socket that stay until both ranks
joined, a fact asserted here so a change in NCCL shows), ncclCommInitRankConfig with our
config, non-blocking and blocking, failing with ncclUnhandledCudaError and a NULL handle
(never invalid argument/usage, never a crash, no thread or fd left behind), GetAsyncError /
Abort / Destroy on the NULL handle a failed init leaves (init.cc: invalid argument, success,
success), and vLLM's binding: refused below NCCL 2.29.7 (it needs ncclCommSuspend), with
``auto`` falling back to ours over the same file. The ncclConfig_t prefix is compiled
against each wheel's nccl.h: our offsets, and what NCCL's parseCommConfig copy makes of our
48 bytes (NCCL_CONFIG_INITIALIZER, then our bytes over it), field by field.

A download failure fails this module (CI has PyPI); it never skips.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("nccl_wheels", REPO / "scripts" / "nccl_wheels.py")
nccl_wheels = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(nccl_wheels)

pytestmark = pytest.mark.nccl  # NVIDIA's libraries: the rest tier (tests/conftest.py's NOT_UNIT)

VERSIONS = [version for _, version, _ in nccl_wheels.WHEELS]
VLLM_MIN = (2, 29, 7)  # vLLM 0.32's NCCLLibrary raises without ncclCommSuspend below this
CHILD_TIMEOUT_S = 120


def _vtuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


@pytest.fixture(scope="module")
def libs() -> dict[str, Path]:
    """version -> directory holding libnccl.so.2 and include/nccl.h."""
    t0 = time.monotonic()
    try:
        rows = nccl_wheels.fetch_all()
    except Exception as e:  # noqa: BLE001 - any failure to get them fails the module, loudly
        pytest.fail(f"could not fetch the NCCL wheels into {nccl_wheels.CACHE} (needs PyPI): {e}", pytrace=False)
    fetched = [r for r in rows if not r["cached"]]
    if fetched:
        print(f"\nfetched {len(fetched)} NCCL wheels, {sum(r['bytes'] for r in fetched) / 1e6:.0f} MB, "
              f"in {time.monotonic() - t0:.1f} s")
    return {r["version"]: Path(r["path"]) for r in rows}


def _child(*args: str, env: dict[str, str] | None = None, timeout: float = CHILD_TIMEOUT_S) -> dict:
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, f"child {args} rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def probes(libs):
    """version -> what the child saw; the children run 4 at a time, started at once (most of
    each is importing torch and vLLM, and waiting)."""
    pool = ThreadPoolExecutor(max_workers=4)
    futures = {v: pool.submit(_child, "probe", str(libs[v] / "libnccl.so.2")) for v in VERSIONS}
    yield lambda version: futures[version].result(timeout=CHILD_TIMEOUT_S * len(VERSIONS))
    pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------ per version, in the child


@pytest.mark.parametrize("version", VERSIONS)
def test_version_is_parsed(probes, version):
    p = probes(version)
    assert p["version"] == version
    major, minor, patch = _vtuple(version)
    assert p["code"] == major * 10000 + minor * 100 + patch


@pytest.mark.parametrize("version", VERSIONS)
def test_error_strings_of_every_result_code(probes, version):
    """The codes the transport tells apart, and the ones it only logs, have NCCL's text."""
    errors = {int(k): v for k, v in probes(version)["errors"].items()}
    assert errors[0] == "no error"
    assert "cuda" in errors[1].lower()
    assert "system error" in errors[2]
    assert "internal error" in errors[3]
    assert "invalid argument" in errors[4]
    assert "invalid usage" in errors[5]
    assert "remote process exited" in errors[6]
    assert errors[7] == "NCCL operation in progress"
    if _vtuple(version) >= (2, 30, 0):
        assert errors[8] == "timeout"  # ncclTimeout, new in 2.30
    else:
        assert "unknown" in errors[8]


@pytest.mark.parametrize("version", VERSIONS)
def test_unique_ids_and_the_bootstrap_thread_each_one_leaves(probes, version):
    ids = probes(version)["ids"]
    assert ids["lengths"] == [128, 128, 128] and ids["distinct"] == 3
    # A fact of every version, not a wish: each id starts NCCL's bootstrap root (a thread
    # and a listening socket) that waits until both ranks joined; 1 s later it is still there.
    assert ids["threads_per_id"] == 1 and ids["fds_per_id"] == 1


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("blocking", [False, True])
def test_init_with_our_config_fails_with_the_cuda_error(probes, version, blocking):
    """No driver here: NCCL refuses with its CUDA error (cudaGetDevice comes before the config
    is read), not invalid argument/usage (which would be our struct) and not a crash; the
    handle stays NULL and our blocking fallback is not taken for it."""
    init = probes(version)["init"][str(blocking)]
    assert init["code"] == 1, init
    assert "cuda" in init["text"].lower()
    assert init["raw_handle"] is None and not init["hung"]
    assert init["fallbacks"] == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_failed_inits_leave_no_thread_or_fd(probes, version):
    leak = probes(version)["failed_init_leak"]
    assert leak["threads_per_init"] <= 0 and leak["fds_per_init"] <= 0, leak  # < 0: a transient one ended


@pytest.mark.parametrize("version", VERSIONS)
def test_null_communicator_calls_behave_as_nccl_implements_them(probes, version):
    """A failed init leaves a NULL handle: GetAsyncError refuses it (invalid argument), Abort
    and Destroy of NULL are no-ops that succeed (init.cc), so our abort path is safe on it."""
    p = probes(version)
    assert p["async_null"] == 4
    assert p["status_null"] == 4  # our status() passes the refusal through: not "ready"
    assert p["abort_null"] == "ok" and p["destroy_null"] == "ok"
    assert p["group_after_failed_init"] == [0, 0]


@pytest.mark.parametrize("version", VERSIONS)
def test_vllms_binding_is_used_from_2_29_7_and_auto_falls_back_below(probes, version):
    v = probes(version)["vllm"]
    if v.get("no_vllm"):
        pytest.skip("vLLM not importable here")
    if _vtuple(version) >= VLLM_MIN:
        assert v["prefer_vllm"] == "vllm " + version
        assert v["auto"] == "vllm " + version
    else:
        assert v["prefer_vllm"].startswith("NcclUnavailable")
        assert "ncclComm" in v["prefer_vllm"]  # names the symbol vLLM missed
        assert v["auto"] == "ctypes " + version  # ours over the same libnccl
    assert v["vllm_prototypes_intact"]


# ------------------------------------------------------------------ nccl.h of every version


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("channels", [None, 4])
def test_config_struct_against_each_versions_nccl_h(libs, version, channels):
    """Compiled against the wheel's nccl.h (CUDA's two handle types stubbed): the offsets of
    our fields, and every field NCCL's parseCommConfig copy makes of our 48 bytes."""
    from connector.tools.doctor import config_mismatches, nccl_h_view
    from connector.transport.nccl_lib import ncclConfig

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.fail("no C compiler: the nccl.h checks need one", pytrace=False)
    seen = nccl_h_view(libs[version] / "include", channels)
    major, minor, patch = _vtuple(version)
    assert seen["code"] == major * 10000 + minor * 100 + patch
    assert seen["sizeof"] >= ctypes.sizeof(ncclConfig) == 48
    assert ("trafficClass" in seen) == (_vtuple(version) >= (2, 26, 0))
    assert seen["magic"][1] == 0xCAFEBEEF and seen["minCTAs"][1] == (channels or seen["undef"])
    assert config_mismatches(seen, channels) == []


def test_config_check_has_power():
    """What a wrong struct would look like to NCCL is reported, field by field."""
    from connector.tools.doctor import config_mismatches

    undef = -(2**31)
    good = {"sizeof": 72, "undef": undef, "default_magic": 0xCAFEBEEF, "default_trafficClass": undef,
            "size": [0, 48], "magic": [8, 0xCAFEBEEF], "version": [12, 21800], "blocking": [16, 0],
            "cgaClusterSize": [20, undef], "minCTAs": [24, undef], "maxCTAs": [28, undef], "netName": [32, 1],
            "splitShare": [40, undef], "trafficClass": [44, undef]}
    assert config_mismatches(good) == []
    assert config_mismatches({**good, "trafficClass": [44, 0]}) == ["NCCL would read trafficClass=0, we mean "
                                                                     f"{undef}"]
    assert "splitShare at offset 36" in config_mismatches({**good, "splitShare": [36, undef]})[0]
    assert config_mismatches(good, num_channels=4)  # minCTAs/maxCTAs not what we meant


# ------------------------------------------------------------------ the transport's failed set-up


# A peer that agrees to NCCL and then fails its init gets the caller's unique id first: that
# id's bootstrap root (a thread and a socket) waits for a rank that never comes, for good.
# Bounded (connector/transport/nccl.py): at most _MAX_FAILED_SETUPS such attempts per peer and
# _MAX_FAILED_SETUPS_TOTAL in all, then NCCL is off (tcp) until restart; below the bound each
# attempt still leaves one. Strict: passes once none is left.
_INIT_FAILS = pytest.param("nccl-init-fails", marks=pytest.mark.xfail(
    strict=True, reason="issue 20 defect 3, remaining: an id made for a peer whose init then fails leaks its "
                        "bootstrap thread and socket (+1 each per attempt on the real library, at most 4 per "
                        "peer and 16 in all)"))


@pytest.mark.parametrize("version", [VERSIONS[0], VERSIONS[-1]])
@pytest.mark.parametrize("peer", ["tcp-only", _INIT_FAILS])
def test_failed_nccl_set_ups_leave_no_thread_or_fd(libs, version, peer):
    """The issue's defect 3 on the real library: a caller whose NCCL set-up with a peer
    fails (a tcp-only peer, or one whose NCCL init fails: no CUDA here) must not keep a
    thread or a socket per attempt. Measured in the caller's process as its growth per new
    peer over NcclTransport, minus the same over a plain TcpTransport (the control socket
    every peer costs either way)."""
    lib = str(libs[version] / "libnccl.so.2")
    peers = 4
    server = subprocess.Popen([sys.executable, __file__, "serve", peer, str(2 * peers + 2)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO), "XPYD_NCCL_LIBRARY": lib})
    try:
        line = server.stdout.readline()
        assert line, server.stderr.read()[-3000:]
        ports = json.loads(line)["ports"]
        got = _child("call", lib, json.dumps(ports), env={"XPYD_NCCL_LIBRARY": lib})
    finally:
        server.stdin.close()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    assert got["replies_ok"], got
    assert got["nccl"]["set_ups"] == peers + 1, got  # each peer was asked (and said no)
    extra_threads = (got["nccl"]["threads"] - got["tcp"]["threads"]) / peers
    extra_fds = (got["nccl"]["fds"] - got["tcp"]["fds"]) / peers
    assert (extra_threads, extra_fds) == (0, 0), got


# ------------------------------------------------------------------ child processes


def _counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _on_thread(fn, timeout_s: float = 30.0) -> tuple[object, bool]:
    """Run fn on a fresh thread (a failed NCCL call can leave per-thread group state)."""
    box: list[object] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    return (box[0] if box else None), t.is_alive()


def _probe(path: str) -> dict:
    from connector.transport import nccl_lib
    from connector.transport.nccl_api import CommConfig, NcclError

    lib = nccl_lib.CtypesNccl(ctypes.CDLL(path))
    out: dict = {"version": lib.version(), "code": lib.version_code(),
                 "errors": {code: lib.error_string(code) for code in range(10)}}
    before = _counts()
    ids = [lib.unique_id() for _ in range(3)]
    time.sleep(1.0)
    after = _counts()
    out["ids"] = {"lengths": [len(i) for i in ids], "distinct": len(set(ids)),
                  "threads_per_id": (after[0] - before[0]) / 3, "fds_per_id": (after[1] - before[1]) / 3}

    out["init"] = {}
    for blocking in (False, True):
        cfg = CommConfig(blocking=blocking, num_channels=2)

        def ours(cfg=cfg) -> dict:
            try:
                return {"code": 0, "text": "", "comm": repr(lib.init_rank(2, ids[0], 1, cfg))}
            except NcclError as e:
                return {"code": e.code, "text": str(e)}

        def raw(cfg=cfg) -> int | None:
            comm = nccl_lib.ncclComm_t()
            uid = nccl_lib.ncclUniqueId()
            ctypes.memmove(ctypes.addressof(uid), ids[0], 128)
            conf = nccl_lib.make_config(cfg)
            lib._f["ncclCommInitRankConfig"](ctypes.byref(comm), 2, uid, 1, ctypes.byref(conf))
            return comm.value

        res, hung = _on_thread(ours)
        res = dict(res or {})
        res["hung"] = hung
        res["raw_handle"], _ = _on_thread(raw)
        res["fallbacks"] = lib.fallbacks
        out["init"][str(blocking)] = res

    _on_thread(lambda: _swallow(lambda: lib.init_rank(2, ids[1], 0, CommConfig())))  # one-time set-up costs
    time.sleep(0.5)
    before = _counts()
    for i in range(4):
        _on_thread(lambda i=i: _swallow(lambda: lib.init_rank(2, ids[i % 3], i % 2, CommConfig(blocking=i > 1))))
    time.sleep(0.5)
    after = _counts()
    out["failed_init_leak"] = {"threads_per_init": (after[0] - before[0]) / 4, "fds_per_init": (after[1] - before[1]) / 4}

    state = ctypes.c_int(-99)
    out["async_null"] = lib._f["ncclCommGetAsyncError"](None, ctypes.byref(state))
    out["status_null"] = lib.status(nccl_lib.ncclComm_t())
    out["abort_null"] = _swallow(lambda: lib.abort(nccl_lib.ncclComm_t())) or "ok"
    out["destroy_null"] = _swallow(lambda: lib.destroy(nccl_lib.ncclComm_t())) or "ok"
    out["group_after_failed_init"], _ = _on_thread(lambda: [lib._f["ncclGroupStart"](), lib._f["ncclGroupEnd"]()])
    out["vllm"] = _probe_vllm(path)
    return out


def _swallow(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported as text
        return f"{type(e).__name__}: {e}"
    return None


def _probe_vllm(path: str) -> dict:
    """prefer="vllm" and "auto" (CUDA pretended: the choice is made before any device call)."""
    import torch

    from connector.transport import nccl_lib

    try:
        from vllm.distributed.device_communicators import pynccl_wrapper
    except ImportError:
        return {"no_vllm": True}
    os.environ["VLLM_NCCL_SO_PATH"] = path
    os.environ[nccl_lib.ENV_LIBRARY] = path
    out: dict = {}
    try:
        lib = nccl_lib.load_nccl_library("vllm")
        out["prefer_vllm"] = f"{lib.name} {lib.version()}"
    except nccl_lib.NcclUnavailable as e:
        out["prefer_vllm"] = f"NcclUnavailable: {e}"
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        lib = nccl_lib.load_nccl_library("auto")
        out["auto"] = f"{lib.name} {lib.version()}"
    finally:
        torch.cuda.is_available = real
    # vLLM's own calls still work after ours bound over its CDLL (where it loads at all)
    try:
        vlib = pynccl_wrapper.NCCLLibrary(path)
        out["vllm_prototypes_intact"] = len(bytes(vlib.ncclGetUniqueId().internal)) == 128
    except Exception:  # noqa: BLE001 - vLLM refuses this version: nothing of its to break
        out["vllm_prototypes_intact"] = True
    return out


def _serve(kind: str, n: int) -> None:
    """n servers, each a peer that cannot do NCCL: tcp-only, or NCCL whose init fails."""
    import torch

    from connector.transport import TcpTransport
    from connector.transport.nccl import NcclTransport
    from connector.transport.nccl_lib import CtypesNccl

    def handler(header, tensors):
        if str(header.get("op", "")).startswith("_nccl"):
            return {"ok": False, "unknown_op": True, "error": "tcp only"}, []
        return {"ok": True, "n": len(tensors)}, []

    servers = []
    for _ in range(n):
        t = TcpTransport() if kind == "tcp-only" else NcclTransport(CtypesNccl(), torch.device("cpu"))
        t.start("127.0.0.1", 0, handler)
        servers.append(t)
    print(json.dumps({"ports": [s.bound_port for s in servers]}), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    for s in servers:
        s.close()


def _call(path: str, ports: list[int]) -> dict:
    import torch

    from connector.transport import TcpTransport
    from connector.transport.nccl import NcclTransport
    from connector.transport.nccl_lib import CtypesNccl

    lib = CtypesNccl(ctypes.CDLL(path))
    nccl = NcclTransport(lib, torch.device("cpu"))
    tcp = TcpTransport()
    half = len(ports) // 2
    out: dict = {"replies_ok": True}
    for name, t, mine in (("tcp", tcp, ports[:half]), ("nccl", nccl, ports[half:])):
        hellos = []
        if name == "nccl":  # count set-ups by the hellos the transport sends (id made or not)
            real_call = nccl._control.call

            def call(peer, header, *a, real_call=real_call, hellos=hellos, **kw):
                if header.get("op", "").startswith("_nccl"):
                    hellos.append(peer)
                return real_call(peer, header, *a, **kw)

            nccl._control.call = call
        reply, _ = t.call(f"127.0.0.1:{mine[0]}", {"op": "x"}, [torch.ones(8)], timeout_s=20)  # one-time costs
        out["replies_ok"] &= bool(reply.get("ok"))
        time.sleep(0.3)
        before = _counts()
        for port in mine[1:]:
            # Twice: the second call goes over the peer's byte stream (a pooled connection
            # either transport keeps per peer), whatever the nccl set-up took before it.
            for _ in range(2):
                reply, _ = t.call(f"127.0.0.1:{port}", {"op": "x"}, [torch.ones(8)], timeout_s=20)
                out["replies_ok"] &= bool(reply.get("ok"))
        time.sleep(1.0)
        after = _counts()
        out[name] = {"threads": after[0] - before[0], "fds": after[1] - before[1], "set_ups": len(set(hellos))}
    nccl.close()
    tcp.close()
    return out


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "probe":
        result = _probe(sys.argv[2])
    elif cmd == "call":
        result = _call(sys.argv[2], json.loads(sys.argv[3]))
    elif cmd == "serve":
        _serve(sys.argv[2], int(sys.argv[3]))
        sys.exit(0)
    else:
        raise SystemExit(f"unknown command {cmd}")
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # NCCL's bootstrap threads of the ids above must not hold the exit up

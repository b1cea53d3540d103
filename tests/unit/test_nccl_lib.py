"""The real NCCL library objects (connector/transport/nccl_lib.py).

Without NCCL (CI): the binding runs against a small C stand-in for libnccl compiled here
(the other side of the ctypes boundary, built from nccl.h's own declarations), so the C
compiler, not a hand count, says where ncclConfig_t's fields are and what each call
receives; library discovery; the transport factory's fallback. Marked `gpu`: the calls
against torch's real libnccl, two processes on one GPU (different NCCL_HOSTID values make
NCCL treat them as two hosts and use its socket transport)."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from connector.transport import TcpTransport, make_transport, nccl_lib
from connector.transport.nccl_api import NCCL_IN_PROGRESS, NCCL_SUCCESS, CommConfig, NcclError
from connector.transport.nccl_lib import NcclUnavailable, make_config, ncclConfig

# A stand-in libnccl: nccl.h's declarations (ncclConfig_t as of 2.26: 2.18's fields, then
# trafficClass in what was 2.18's tail padding), each call recording what it received.
FAKE_NCCL_C = r"""
#include <stddef.h>
#include <string.h>
#include <unistd.h>

typedef int ncclResult_t;
typedef void* ncclComm_t;
typedef void* cudaStream_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclConfig_v21700 {  /* nccl.h, NCCL 2.26 */
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
  int splitShare;
  int trafficClass;
} ncclConfig_t;

size_t config_layout[11] = {
  sizeof(ncclConfig_t), offsetof(ncclConfig_t, size), offsetof(ncclConfig_t, magic),
  offsetof(ncclConfig_t, version), offsetof(ncclConfig_t, blocking),
  offsetof(ncclConfig_t, cgaClusterSize), offsetof(ncclConfig_t, minCTAs),
  offsetof(ncclConfig_t, maxCTAs), offsetof(ncclConfig_t, netName),
  offsetof(ncclConfig_t, splitShare), offsetof(ncclConfig_t, trafficClass)};

int version_code = 21805;
int async_state = 0;   /* what ncclCommGetAsyncError reports */
int next_result = 0;   /* when set: the next call's result */
size_t got_size; unsigned int got_magic, got_version;
int got_blocking, got_cga, got_min, got_max, got_split, got_traffic, got_net_null;
char got_net[32];
int got_nranks, got_rank; unsigned char got_uid[128];
void *got_buf, *got_comm, *got_stream; size_t got_count; int got_dtype, got_peer;
unsigned long long got_sum;
int groups_started, groups_ended; void *aborted, *destroyed;
int init_rank_calls, init_sleep_ms, group_sleep_ms;  /* the blocking calls, made slow at will */
int config_result;  /* when set: ncclCommInitRankConfig's own result (a refused config) */

static ncclResult_t take(ncclResult_t dflt) { int r = next_result; next_result = 0; return r ? r : dflt; }

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case 0: return "no error";
    case 4: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case 6: return "remote process exited or there was a network error";
    case 7: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}
ncclResult_t ncclGetVersion(int* v) { *v = version_code; return take(0); }
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 7 + 3);
  return take(0);
}
#ifndef OLD_NCCL
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  ncclConfig_t c;  /* as NCCL does: copy `size` bytes, no more */
  size_t n = config->size < sizeof(c) ? config->size : sizeof(c);
  if (config_result) return config_result;
  memset(&c, 0, sizeof(c));
  memcpy(&c, config, n);
  got_size = c.size; got_magic = c.magic; got_version = c.version; got_blocking = c.blocking;
  got_cga = c.cgaClusterSize; got_min = c.minCTAs; got_max = c.maxCTAs; got_split = c.splitShare;
  got_traffic = c.trafficClass;
  got_net_null = c.netName == NULL;
  memset(got_net, 0, sizeof(got_net));
  if (c.netName) strncpy(got_net, c.netName, sizeof(got_net) - 1);
  got_nranks = nranks; got_rank = rank; memcpy(got_uid, id.internal, 128);
  *comm = (void*)(size_t)(0x1000 + rank);
  return take(c.blocking == 0 ? 7 : 0);
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  got_comm = comm; *state = async_state; return take(0);
}
#endif
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  got_nranks = nranks; got_rank = rank; memcpy(got_uid, id.internal, 128);
  init_rank_calls++;
  if (init_sleep_ms) usleep(init_sleep_ms * 1000);
  *comm = (void*)(size_t)(0x2000 + rank); return take(0);
}
static void p2p(void* buf, size_t count, int dtype, int peer, ncclComm_t comm, cudaStream_t s) {
  got_buf = buf; got_count = count; got_dtype = dtype; got_peer = peer; got_comm = comm; got_stream = s;
}
ncclResult_t ncclSend(const void* buf, size_t count, int dtype, int peer, ncclComm_t comm, cudaStream_t s) {
  p2p((void*)buf, count, dtype, peer, comm, s);
  got_sum = 0;
  for (size_t i = 0; i < count; i++) got_sum += ((const unsigned char*)buf)[i];
  return take(0);
}
ncclResult_t ncclRecv(void* buf, size_t count, int dtype, int peer, ncclComm_t comm, cudaStream_t s) {
  p2p(buf, count, dtype, peer, comm, s);
  memset(buf, 0xAB, count);
  return take(0);
}
ncclResult_t ncclGroupStart(void) { groups_started++; return take(0); }
ncclResult_t ncclGroupEnd(void) {  /* non-blocking: launches in the background */
  groups_ended++;
  if (group_sleep_ms) { usleep(group_sleep_ms * 1000); return take(0); }
  return take(7);
}
ncclResult_t ncclCommAbort(ncclComm_t c) { aborted = c; return take(0); }
ncclResult_t ncclCommDestroy(ncclComm_t c) { destroyed = c; return take(0); }
/* the rest of what vLLM's NCCLLibrary binds: present, never called here */
#define STUB(name) ncclResult_t name(void) { return 5; }
STUB(ncclAllGather) STUB(ncclAllReduce) STUB(ncclBroadcast) STUB(ncclReduce) STUB(ncclReduceScatter)
STUB(ncclCommSuspend) STUB(ncclCommResume) STUB(ncclCommWindowRegister) STUB(ncclCommWindowDeregister)
STUB(ncclCommQueryProperties)
"""


@pytest.fixture(scope="module")
def fake_builds(tmp_path_factory) -> dict[str, Path]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in libnccl")
    d = tmp_path_factory.mktemp("fake_nccl")
    (d / "fake.c").write_text(FAKE_NCCL_C)
    out = {}
    for kind, flags in (("new", []), ("old", ["-DOLD_NCCL"])):
        out[kind] = d / f"{kind}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", *flags, "-o", str(out[kind]), str(d / "fake.c")],
                       check=True, timeout=60)
    return out


@pytest.fixture
def fake_nccl(fake_builds, tmp_path) -> Path:
    """A private copy (its own dlopen handle, so its recorded globals start fresh)."""
    path = tmp_path / "libnccl.so.2"
    shutil.copy(fake_builds["new"], path)
    return path


def _got(cdll: ctypes.CDLL, name: str, ctype=ctypes.c_int):
    return ctype.in_dll(cdll, name).value


def test_config_struct_matches_the_c_compilers_layout(fake_builds):
    """ncclConfig_t's first fields as the C compiler lays them out on this machine; on
    x86-64: size_t(0) 2 uint(8,12) 4 int(16..28) pointer(32) 2 int(40, 44): 48 bytes, the
    size 2.18's 44 bytes of fields were padded to."""
    layout = list((ctypes.c_size_t * 11).in_dll(ctypes.CDLL(str(fake_builds["new"])), "config_layout"))
    ours = [ctypes.sizeof(ncclConfig)] + [getattr(ncclConfig, name).offset for name, _ in ncclConfig._fields_]
    assert ours == layout
    if ctypes.sizeof(ctypes.c_void_p) == 8:
        assert layout == [48, 0, 8, 12, 16, 20, 24, 28, 32, 40, 44]  # trafficClass: 2.18's tail padding
    assert ctypes.sizeof(nccl_lib.ncclUniqueId) == 128


def test_config_mapping_keeps_nccl_defaults_for_what_we_do_not_set():
    c = make_config(CommConfig())
    assert (c.size, c.magic, c.version) == (48, 0xCAFEBEEF, 21800)
    assert c.blocking == 0  # non-blocking: a dead peer can never hang a thread
    assert c.minCTAs == c.maxCTAs == c.cgaClusterSize == c.splitShare == -(2**31)  # NCCL_CONFIG_UNDEF_INT
    assert c.trafficClass == -(2**31)  # not 0: 2.26 reads it without a version check
    assert c.netName is None
    c = make_config(CommConfig(blocking=True, num_channels=4, net_name="Socket"))
    assert (c.blocking, c.minCTAs, c.maxCTAs, c.netName) == (1, 4, 4, b"Socket")
    with pytest.raises(ValueError, match="num_channels"):
        make_config(CommConfig(num_channels=0))


def test_init_rank_hands_nccl_the_config_and_unique_id_it_was_given(fake_nccl, monkeypatch):
    monkeypatch.setenv(nccl_lib.ENV_LIBRARY, str(fake_nccl))
    lib = nccl_lib.load_nccl_library("ctypes")
    c = lib._lib
    assert (lib.name, lib.version()) == ("ctypes", "2.18.5")
    uid = lib.unique_id()
    assert uid == bytes((i * 7 + 3) % 256 for i in range(128))
    uid = bytes(range(128))[::-1]
    comm = lib.init_rank(2, uid, 1, CommConfig(num_channels=3, net_name="Socket"))
    assert comm.value == 0x1001
    assert bytes((ctypes.c_ubyte * 128).in_dll(c, "got_uid")) == uid
    assert (_got(c, "got_nranks"), _got(c, "got_rank")) == (2, 1)
    assert (_got(c, "got_size", ctypes.c_size_t), _got(c, "got_magic", ctypes.c_uint),
            _got(c, "got_version", ctypes.c_uint)) == (48, 0xCAFEBEEF, 21800)
    assert (_got(c, "got_blocking"), _got(c, "got_min"), _got(c, "got_max")) == (0, 3, 3)
    assert (_got(c, "got_cga"), _got(c, "got_split")) == (-(2**31), -(2**31))
    assert _got(c, "got_traffic") == -(2**31)  # NCCL 2.26.x took our padding's 0 as traffic class 0
    assert bytes((ctypes.c_char * 32).in_dll(c, "got_net").value) == b"Socket"
    lib.init_rank(2, uid, 0, CommConfig(blocking=True))
    assert (_got(c, "got_blocking"), _got(c, "got_min"), _got(c, "got_net_null")) == (1, -(2**31), 1)
    with pytest.raises(ValueError, match="128 bytes"):
        lib.init_rank(2, uid[:-1], 0, CommConfig())


def test_send_and_recv_move_the_tensors_bytes_on_the_given_stream(fake_nccl):
    lib = nccl_lib.CtypesNccl(ctypes.CDLL(str(fake_nccl)))
    c = lib._lib
    comm = lib.init_rank(2, lib.unique_id(), 0, CommConfig())
    stream = type("S", (), {"cuda_stream": 0xBEEF})()
    src = torch.randint(0, 256, (3, 333), dtype=torch.uint8)
    lib.send(comm, src, 1, stream)
    assert (_got(c, "got_count", ctypes.c_size_t), _got(c, "got_dtype"), _got(c, "got_peer")) == (999, 1, 1)
    assert _got(c, "got_sum", ctypes.c_ulonglong) == int(src.sum())
    assert (_got(c, "got_comm", ctypes.c_void_p), _got(c, "got_stream", ctypes.c_void_p)) == (0x1000, 0xBEEF)
    dst = torch.zeros(10, 7, dtype=torch.float16)
    lib.recv(comm, dst, 1, stream)
    assert _got(c, "got_count", ctypes.c_size_t) == 140  # bytes, not elements
    assert _got(c, "got_buf", ctypes.c_void_p) == dst.data_ptr()
    assert bool((dst.view(torch.uint8) == 0xAB).all())
    with pytest.raises(ValueError, match="contiguous"):
        lib.send(comm, src.t(), 1, stream)
    lib.group_start()
    lib.group_end()  # "in progress" is the normal answer of a non-blocking group
    assert (_got(c, "groups_started"), _got(c, "groups_ended")) == (1, 1)
    lib.abort(comm)
    assert _got(c, "aborted", ctypes.c_void_p) == 0x1000
    lib.destroy(ctypes.c_void_p(0x1001))
    assert _got(c, "destroyed", ctypes.c_void_p) == 0x1001


def test_results_map_to_status_and_errors(fake_nccl):
    lib = nccl_lib.CtypesNccl(ctypes.CDLL(str(fake_nccl)))
    c = lib._lib
    comm = lib.init_rank(2, lib.unique_id(), 0, CommConfig())
    for state in (NCCL_IN_PROGRESS, NCCL_SUCCESS, 6):
        ctypes.c_int.in_dll(c, "async_state").value = state
        assert lib.status(comm) == state
    ctypes.c_int.in_dll(c, "next_result").value = 4  # the query itself failed
    assert lib.status(comm) == 4
    ctypes.c_int.in_dll(c, "next_result").value = 6
    with pytest.raises(NcclError, match="remote process exited") as e:
        lib.group_end()
    assert e.value.code == 6
    ctypes.c_int.in_dll(c, "next_result").value = 4
    with pytest.raises(NcclError, match="invalid argument") as e:
        lib.init_rank(2, lib.unique_id(), 0, CommConfig())
    assert e.value.code == 4
    assert lib.error_string(NCCL_IN_PROGRESS) == "NCCL operation in progress"


def _set(cdll: ctypes.CDLL, name: str, value: int) -> None:
    ctypes.c_int.in_dll(cdll, name).value = value


def _until(pred, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.parametrize("refusal", [3, 4, 5])  # internal error, invalid argument, invalid usage
def test_refused_non_blocking_init_falls_back_to_vllms_blocking_init_on_a_thread(fake_nccl, refusal):
    """NCCL refusing our config (or non-blocking mode) before this rank joined: the same
    unique id goes to ncclCommInitRank, on a thread, and the caller sees a non-blocking
    communicator: in progress until the blocking call returned, then ready."""
    lib = nccl_lib.CtypesNccl(ctypes.CDLL(str(fake_nccl)))
    c = lib._lib
    _set(c, "config_result", refusal)
    _set(c, "init_sleep_ms", 300)
    uid = bytes(range(128))
    t0 = time.monotonic()
    comm = lib.init_rank(2, uid, 1, CommConfig())
    assert time.monotonic() - t0 < 0.2  # returned at once, the blocking call runs elsewhere
    assert lib.status(comm) == NCCL_IN_PROGRESS and lib.fallbacks == 1
    assert _until(lambda: lib.status(comm) != NCCL_IN_PROGRESS)
    assert lib.status(comm) == NCCL_SUCCESS
    assert _got(c, "init_rank_calls") == 1 and _got(c, "got_rank") == 1
    assert bytes((ctypes.c_ubyte * 128).in_dll(c, "got_uid")) == uid  # the id the peer was given
    # a group on it runs on its thread too: in progress while NCCL's group end blocks
    _set(c, "group_sleep_ms", 300)
    stream = type("S", (), {"cuda_stream": 0xBEEF})()
    src = torch.arange(10, dtype=torch.uint8)
    lib.group_start()
    lib.send(comm, src, 0, stream)
    lib.group_end()
    assert lib.status(comm) == NCCL_IN_PROGRESS
    assert _until(lambda: lib.status(comm) != NCCL_IN_PROGRESS)
    assert lib.status(comm) == NCCL_SUCCESS
    assert (_got(c, "got_count", ctypes.c_size_t), _got(c, "got_comm", ctypes.c_void_p)) == (10, 0x2001)
    assert _got(c, "got_sum", ctypes.c_ulonglong) == 45
    lib.abort(comm)
    assert _got(c, "aborted", ctypes.c_void_p) == 0x2001


def test_peer_or_cuda_errors_do_not_fall_back(fake_nccl):
    """A CUDA or system error is not our config: the blocking call would meet it too."""
    lib = nccl_lib.CtypesNccl(ctypes.CDLL(str(fake_nccl)))
    for code in (1, 2, 6):
        _set(lib._lib, "config_result", code)
        with pytest.raises(NcclError) as e:
            lib.init_rank(2, bytes(128), 0, CommConfig())
        assert e.value.code == code
    assert _got(lib._lib, "init_rank_calls") == 0 and lib.fallbacks == 0
    with pytest.raises(NcclError):  # a blocking config asked for and refused: nothing to fall back to
        _set(lib._lib, "config_result", 4)
        lib.init_rank(2, bytes(128), 0, CommConfig(blocking=True))


def test_blocking_fallback_aborted_mid_call_is_aborted_when_the_call_returns(fake_nccl):
    """The caller's deadline passed while the blocking init is still inside NCCL: abort
    returns at once, the communicator is aborted by its thread once NCCL returns, and no
    more than MAX_STUCK_BLOCKING such threads are allowed before set-ups are refused."""
    lib = nccl_lib.CtypesNccl(ctypes.CDLL(str(fake_nccl)))
    c = lib._lib
    _set(c, "config_result", 4)
    _set(c, "init_sleep_ms", 400)
    stuck = [lib.init_rank(2, bytes(128), r, CommConfig()) for r in range(nccl_lib.MAX_STUCK_BLOCKING)]
    t0 = time.monotonic()
    for comm in stuck:
        lib.abort(comm)
    assert time.monotonic() - t0 < 0.2
    assert _got(c, "aborted", ctypes.c_void_p) is None  # not yet: NCCL still has the call
    with pytest.raises(NcclError, match="still inside NCCL"):
        lib.init_rank(2, bytes(128), 0, CommConfig())
    assert _until(lambda: not any(comm.busy() for comm in stuck))
    assert _got(c, "aborted", ctypes.c_void_p) in (0x2000, 0x2001)
    _set(c, "init_sleep_ms", 0)
    comm = lib.init_rank(2, bytes(128), 0, CommConfig())  # the threads returned: allowed again
    assert _until(lambda: lib.status(comm) == NCCL_SUCCESS)
    with pytest.raises(NcclError, match="aborted"):
        lib.group_start()
        try:
            lib.send(stuck[0], torch.zeros(4, dtype=torch.uint8), 1, type("S", (), {"cuda_stream": 0})())
        finally:
            lib.group_end()


def test_library_without_the_non_blocking_api_is_refused(fake_builds, tmp_path):
    old = tmp_path / "libnccl.so.2"
    shutil.copy(fake_builds["old"], old)
    with pytest.raises(NcclUnavailable, match="ncclCommInitRankConfig, ncclCommGetAsyncError"):
        nccl_lib.CtypesNccl(ctypes.CDLL(str(old)))
    new = tmp_path / "libnccl.so.2.17"
    shutil.copy(fake_builds["new"], new)
    cdll = ctypes.CDLL(str(new))
    ctypes.c_int.in_dll(cdll, "version_code").value = 21703
    with pytest.raises(NcclUnavailable, match="2.17.3 is older than 2.18"):
        nccl_lib.CtypesNccl(cdll)


def test_vllm_adapter_shares_vllms_libnccl_and_leaves_its_prototypes_alone(fake_nccl, monkeypatch):
    """One libnccl in the process: ours calls the CDLL vLLM loaded, and vLLM's own calls
    (its ncclUniqueId class, for its TP communicators) still work after ours bound."""
    wrapper = pytest.importorskip("vllm.distributed.device_communicators.pynccl_wrapper")
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", str(fake_nccl))
    lib = nccl_lib.load_nccl_library("vllm")
    assert lib.name == "vllm"
    vlib = wrapper.NCCLLibrary()
    assert lib._lib is vlib.lib
    assert bytes(vlib.ncclGetUniqueId().internal) == lib.unique_id()
    vlib.ncclCommInitRank(2, vlib.unique_id_from_bytes(bytes(range(128))), 1)
    assert bytes((ctypes.c_ubyte * 128).in_dll(lib._lib, "got_uid")) == bytes(range(128))
    lib.init_rank(2, bytes(128), 0, CommConfig())
    assert bytes((ctypes.c_ubyte * 128).in_dll(lib._lib, "got_uid")) == bytes(128)


def test_vllm_adapter_refuses_a_libnccl_without_non_blocking_init(fake_builds, tmp_path, monkeypatch):
    pytest.importorskip("vllm.distributed.device_communicators.pynccl_wrapper")
    old = tmp_path / "libnccl.so.2"
    shutil.copy(fake_builds["old"], old)
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", str(old))
    with pytest.raises(NcclUnavailable, match="vLLM's libnccl cannot run non-blocking.*ncclCommInitRankConfig"):
        nccl_lib.load_nccl_library("vllm")


def test_explicit_library_path_that_does_not_load_is_named(monkeypatch, tmp_path):
    missing = tmp_path / "libnccl.so.2"
    monkeypatch.setenv(nccl_lib.ENV_LIBRARY, str(missing))
    assert nccl_lib._candidates() == [str(missing)]  # explicit: nothing else is tried
    with pytest.raises(NcclUnavailable, match=str(missing)):
        nccl_lib.find_nccl_library()
    with pytest.raises(NcclUnavailable, match=str(missing)):
        nccl_lib.load_nccl_library("ctypes")


def test_torch_wheel_copy_is_searched_before_the_loader_path(monkeypatch, tmp_path, fake_builds):
    monkeypatch.delenv(nccl_lib.ENV_LIBRARY, raising=False)
    broken = tmp_path / "a" / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    good = tmp_path / "b" / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    for p in (broken, good):
        p.parent.mkdir(parents=True)
    broken.write_bytes(b"not an ELF")  # found first, fails to load, the search goes on
    shutil.copy(fake_builds["new"], good)
    monkeypatch.setattr("sys.path", [str(tmp_path / "a"), str(tmp_path / "b")])
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)  # a real wheel's, where one is imported
    cands = nccl_lib._candidates()
    assert cands[:2] == [str(broken), str(good)] and cands[-1] == "libnccl.so.2"
    lib = nccl_lib.CtypesNccl()
    assert lib._lib._name == str(good) and lib.version() == "2.18.5"
    good.unlink()
    with pytest.raises(NcclUnavailable) as e:
        if torch.cuda.is_available():  # a GPU machine may well load a later candidate
            raise NcclUnavailable(str(broken))
        nccl_lib.find_nccl_library()
    assert str(broken) in str(e.value)


def test_prefer_is_checked_and_auto_needs_cuda():
    with pytest.raises(ValueError, match="prefer"):
        nccl_lib.load_nccl_library("nvshmem")
    if not torch.cuda.is_available():
        with pytest.raises(NcclUnavailable, match="no CUDA"):
            nccl_lib.load_nccl_library()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback on a machine without CUDA")
def test_factory_falls_back_to_tcp_under_auto_and_refuses_explicit_nccl(caplog):
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING):
        t = make_transport("auto", cuda)
    try:
        assert isinstance(t, TcpTransport)
        assert "NCCL unavailable" in caplog.text
    finally:
        t.close()
    with pytest.raises(ValueError, match="transport nccl"):
        make_transport("nccl", cuda)
    with pytest.raises(ValueError, match="needs the KV cache on CUDA"):
        make_transport("nccl", torch.device("cpu"))
    assert isinstance(make_transport("auto", torch.device("cpu")), TcpTransport)
    with pytest.raises(ValueError, match="unknown transport"):
        make_transport("rdma", cuda)


# ------------------------------------------------------------------ GPU: the real library


def _wait_ready(lib, comm, deadline: float) -> None:
    """Poll ncclCommGetAsyncError until the communicator (or its last group) is ready."""
    while (code := lib.status(comm)) == NCCL_IN_PROGRESS:
        if time.monotonic() > deadline:
            raise TimeoutError("communicator still in progress at the deadline")
        time.sleep(0.005)
    if code != NCCL_SUCCESS:
        raise NcclError(code, lib.error_string(code))


def _gpu_child_env(host: str, log_dir: str) -> None:
    """Set in a fresh child before NCCL loads: this process is its own "host"."""
    os.environ.update(NCCL_HOSTID=host, NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1",
                      NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV,NET",
                      NCCL_DEBUG_FILE=os.path.join(log_dir, f"nccl.{host}.log"))


def _gpu_peer(rank: int, uid_q, out_q, nbytes: int, seed: int, log_dir: str) -> None:
    _gpu_child_env(f"xpyd-test-host-{rank}", log_dir)
    try:
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        lib = nccl_lib.load_nccl_library("ctypes")
        if rank == 0:
            uid = lib.unique_id()  # rank 0's process runs the bootstrap root: it creates the id
            uid_q.put(uid)
        else:
            uid = uid_q.get(timeout=60)
        t0 = time.monotonic()
        comm = lib.init_rank(2, uid, rank, CommConfig(num_channels=2, net_name="Socket"), device=dev)
        _wait_ready(lib, comm, t0 + 60)
        init_s = time.monotonic() - t0
        gen = torch.Generator(device=dev).manual_seed(seed)
        expect = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=gen)
        buf = expect if rank == 0 else torch.zeros_like(expect)
        stream = lib.new_stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))  # the bytes are written on the default stream
        t0 = time.monotonic()
        lib.group_start()
        (lib.send if rank == 0 else lib.recv)(comm, buf, 1 - rank, stream)
        lib.group_end()
        _wait_ready(lib, comm, t0 + 60)  # launched: only now is the transfer on the stream
        done = stream.record_event()
        while not done.query():
            if time.monotonic() > t0 + 60:
                raise TimeoutError("transfer not complete at the deadline")
            code = lib.status(comm)
            if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                raise NcclError(code, lib.error_string(code))
            time.sleep(0.001)
        xfer_s = time.monotonic() - t0
        same = bool(torch.equal(buf, expect))
        lib.destroy(comm)
        out_q.put((rank, "ok", same, init_s, xfer_s, lib.version()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which asserts
        out_q.put((rank, "error", repr(e), 0.0, 0.0, ""))


def _lonely_rank(out_q, log_dir: str) -> None:
    _gpu_child_env("xpyd-lonely", log_dir)
    try:
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        lib = nccl_lib.load_nccl_library("ctypes")
        comm = lib.init_rank(2, lib.unique_id(), 0, CommConfig(), device=dev)
        states = set()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            states.add(lib.status(comm))
            time.sleep(0.05)
        t0 = time.monotonic()
        lib.abort(comm)
        out_q.put(("ok", sorted(states), time.monotonic() - t0))
    except BaseException as e:  # noqa: BLE001
        out_q.put(("error", repr(e), 0.0))


@pytest.mark.gpu
def test_real_library_basics():
    lib = nccl_lib.load_nccl_library("ctypes")
    assert tuple(int(x) for x in lib.version().split(".")[:2]) >= (2, 18)
    uid = lib.unique_id()
    assert len(uid) == 128 and uid != lib.unique_id()
    assert "progress" in lib.error_string(NCCL_IN_PROGRESS)


@pytest.mark.gpu
def test_single_rank_communicator_is_ready():
    lib = nccl_lib.load_nccl_library("ctypes")
    comm = lib.init_rank(1, lib.unique_id(), 0, CommConfig(num_channels=2), device=torch.device("cuda", 0))
    _wait_ready(lib, comm, time.monotonic() + 30)
    lib.destroy(comm)


@pytest.mark.gpu
def test_two_processes_on_one_gpu_move_64_mib_identically(tmp_path):
    """The host-id trick: rank 0 sends 64 MiB of random bytes, rank 1 receives them."""
    ctx = mp.get_context("spawn")
    uid_q, out_q = ctx.Queue(), ctx.Queue()
    nbytes = 64 << 20
    procs = [ctx.Process(target=_gpu_peer, args=(r, uid_q, out_q, nbytes, 1234, str(tmp_path)), daemon=True)
             for r in (0, 1)]
    results = _collect(procs, out_q, 2, 180)
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("nccl.*.log"))
    by_rank = {r[0]: r for r in results}
    for rank in (0, 1):
        assert by_rank[rank][1] == "ok", f"rank {rank}: {by_rank[rank][2]}\n{logs[-4000:]}"
        assert by_rank[rank][2] is True, f"rank {rank}: bytes differ"
    print(f"\nNCCL {by_rank[0][5]}: init {by_rank[1][3]:.2f}s, 64 MiB in {by_rank[1][4] * 1e3:.1f} ms "
          f"(loopback socket, not a link figure)")
    print("\n".join(line for line in logs.splitlines() if "config" in line.lower() or "NET/" in line)[-3000:])


@pytest.mark.gpu
def test_abort_of_a_set_up_whose_peer_never_joins_returns_promptly(tmp_path):
    """Non-blocking init: rank 0 of 2 stays in progress while rank 1 never comes, and
    ncclCommAbort ends it within the deadline: a dead peer cannot hang a thread."""
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    proc = ctx.Process(target=_lonely_rank, args=(out_q, str(tmp_path)), daemon=True)
    (result,) = _collect([proc], out_q, 1, 120)
    assert result[0] == "ok", result[1]
    assert result[1] == [NCCL_IN_PROGRESS]
    assert result[2] < 10.0


def _collect(procs, out_q, n_results: int, timeout_s: float) -> list[tuple]:
    """Start the spawn children, gather their results under one deadline, and leave none behind."""
    for p in procs:
        p.start()
    results: list[tuple] = []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(n_results):
            results.append(out_q.get(timeout=max(0.1, deadline - time.monotonic())))
    except queue.Empty:
        pytest.fail(f"{len(results)} of {n_results} results within {timeout_s}s: {results}")
    finally:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return results

"""The NCCL library objects behind the nccl transport (``nccl_api.NcclLibrary``).

``load_nccl_library()`` prefers vLLM's binding (``pynccl_wrapper.NCCLLibrary``) when vLLM is
importable: it finds and loads the ``libnccl`` vLLM itself uses, so the process has one NCCL.
vLLM's call wrappers raise on every result but success, and a non-blocking communicator
answers "in progress" (``ncclGroupEnd``, ``ncclCommInitRankConfig``), so the calls go through
our own ctypes prototypes over that same loaded library; vLLM also binds neither
``ncclCommInitRankConfig`` nor ``ncclCommGetAsyncError``. Our prototypes live on function
pointers of our own (``cdll[name]``), never on the CDLL's cached attributes, which carry
vLLM's prototypes (its own ``ncclUniqueId`` class) for its TP communicators. vLLM 0.32's
binding refuses a libnccl without ``ncclCommSuspend`` (NCCL < 2.29.7): ``auto`` then uses
ours over the same file.
Without vLLM (the GPU test machine has torch and NCCL only) the library is found by
``XPYD_NCCL_LIBRARY``, the copy torch ships (the ``nvidia-nccl-cu*`` wheel, or torch/lib),
then the loader's search path.

Checked against the real libraries (tests/unit/test_nccl_real_lib.py, every CI run, no GPU):
the nvidia-nccl-cu12/cu13 wheels 2.18.1, 2.21.5, 2.26.2, 2.27.5, 2.29.7, 2.30.7, 2.32.3.

Where this path differs from vLLM's GPU path, and why (``pynccl.py`` / ``pynccl_wrapper.py``
of vLLM 0.32, and the P2P NCCL connector's ``p2p_nccl_engine.py`` that vLLM removed):

* Init: ``ncclCommInitRankConfig`` non-blocking, not ``ncclCommInitRank`` (blocking). A peer
  that never joins would hold a blocking init, and the thread in it, until process exit
  (vLLM's P2P engine ran it on its only listener thread); only a non-blocking communicator
  can be aborted mid-init. Where non-blocking itself is the risk (NCCL refuses our config
  or the mode: internal error, invalid argument/usage, returned before this rank joined the
  bootstrap) the same unique id is joined with vLLM's exact call, blocking, on a thread of
  its own (``_BlockingComm``): the caller's deadline and abort still hold.
* Channels: per communicator in ``ncclConfig_t`` (minCTAs = maxCTAs), not vLLM P2P's
  ``NCCL_MIN/MAX_NCHANNELS`` (and ``NCCL_CUMEM_ENABLE``) set in ``os.environ`` around the
  init: the environment is process-wide (vLLM's TP communicators, other threads) and NCCL
  reads each such variable once per process, so the second communicator on sees the first
  one's values. Default: NCCL's choice (vLLM P2P forced 8); the doctor measures both.
* Data type: bytes (``ncclUint8``, count = nbytes) for every dtype, not vLLM's per-dtype
  count: send/recv never reduce, so the type only scales the count; fp8 (an NCCL type only
  since 2.24) and bool go the same way (vLLM's pynccl sends fp8 as uint8 too).
* Groups: every transfer's tensors are one ``ncclGroupStart/End`` (as vLLM's
  ``batch_isend_irecv``); P2P engine called ``ncclSend`` alone per tensor. One group per
  call is one launch, and on a non-blocking communicator the group is what "in progress"
  and ``ncclCommGetAsyncError`` report on.
* Streams: one stream per communicator, ordered after the caller's current stream
  (``wait_stream``); vLLM's pynccl uses the caller's current stream, the P2P engine one
  send and one receive stream shared by every peer with no ordering after the producer's
  stream. Completion is seen by an event recorded after the group launched (polled, with
  the call's deadline), not ``stream.synchronize()``, which blocks without bound.
* Errors: ``ncclCommGetAsyncError`` is polled while waiting (vLLM never calls it), and a
  communicator that failed is aborted, never destroyed (``ncclCommDestroy`` waits for the
  peer; vLLM's pynccl also aborts, on a thread, when it tears down).
* No warm-up ``all_reduce`` after init (pynccl does one): these communicators carry
  point-to-point transfers only, and the first transfer sets its own connection up.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from .nccl_api import NCCL_IN_PROGRESS, NCCL_SUCCESS, UNIQUE_ID_BYTES, CommConfig, NcclError

__all__ = ["CtypesNccl", "NcclUnavailable", "VllmNccl", "find_nccl_library", "load_nccl_library"]

logger = logging.getLogger(__name__)

ENV_LIBRARY = "XPYD_NCCL_LIBRARY"
NCCL_UINT8 = 1  # ncclDataType_t: every transfer moves bytes
CONFIG_MAGIC = 0xCAFEBEEF
CONFIG_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT (INT_MIN)
# We declare NCCL 2.18's version: NCCL copies min(size, its sizeof) bytes of ours over its own
# NCCL_CONFIG_INITIALIZER and resets every field newer than the declared version to its
# default (init.cc parseCommConfig, 2.27 on; 2.26 does not reset trafficClass, hence that
# field below), so a later NCCL runs with its own defaults for what we do not know.
CONFIG_VERSION = 2 * 10000 + 18 * 100 + 0  # NCCL_VERSION(2, 18, 0)
# Results that mean NCCL refused our config or non-blocking mode, not the peer, when
# ncclCommInitRankConfig returns them itself: the rank never reached the bootstrap, so the
# same unique id can still be joined by vLLM's blocking ncclCommInitRank.
NCCL_INTERNAL_ERROR, NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE = 3, 4, 5
_FALLBACK_CODES = frozenset({NCCL_INTERNAL_ERROR, NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE})
# Blocking calls may stay inside NCCL after their communicator was given up (a peer that
# never joins): at most this many such threads per library, then set-ups are refused.
MAX_STUCK_BLOCKING = 2

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p


class NcclUnavailable(RuntimeError):
    """No usable NCCL library here; the transport factory falls back to tcp under "auto"."""


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class ncclConfig(ctypes.Structure):
    """The first fields of ``ncclConfig_t``: x86-64, 48 bytes. Checked against nccl.h and
    init.cc (parseCommConfig) of NCCL 2.18.1 and 2.30.7 (NVIDIA/nccl), and, by compiling
    against each wheel's nccl.h in tests/unit/test_nccl_real_lib.py, 2.18.1, 2.21.5, 2.26.2,
    2.27.5, 2.29.7, 2.30.7 and 2.32.3: same offsets, same NCCL_CONFIG_INITIALIZER values.
    ``trafficClass`` (2.26 on) fills what was tail padding in 2.18's 44-byte struct: 2.26.x
    reads it from our 48 bytes without a version check, so it must be INT_MIN, not 0."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
        ("trafficClass", ctypes.c_int),
    ]


def make_config(config: CommConfig) -> ncclConfig:
    """NCCL_CONFIG_INITIALIZER with our settings: unset fields stay NCCL's defaults."""
    if config.num_channels is not None and config.num_channels < 1:
        raise ValueError(f"num_channels must be >= 1, got {config.num_channels}")
    c = ncclConfig()
    c.size = ctypes.sizeof(ncclConfig)
    c.magic = CONFIG_MAGIC
    c.version = CONFIG_VERSION
    c.blocking = 1 if config.blocking else 0
    c.cgaClusterSize = CONFIG_UNDEF_INT
    c.minCTAs = config.num_channels if config.num_channels else CONFIG_UNDEF_INT
    c.maxCTAs = config.num_channels if config.num_channels else CONFIG_UNDEF_INT
    c.netName = config.net_name.encode() if config.net_name else None  # NCCL_CONFIG_UNDEF_PTR
    c.splitShare = CONFIG_UNDEF_INT
    c.trafficClass = CONFIG_UNDEF_INT
    return c


# name -> (restype, argtypes): the functions the transport needs.
_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetVersion": (ncclResult_t, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetErrorString": (ctypes.c_char_p, [ncclResult_t]),
    "ncclGetUniqueId": (ncclResult_t, [ctypes.POINTER(ncclUniqueId)]),
    "ncclCommInitRankConfig": (ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int,
                                              ctypes.POINTER(ncclConfig)]),
    "ncclCommInitRank": (ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int]),
    "ncclCommGetAsyncError": (ncclResult_t, [ncclComm_t, ctypes.POINTER(ncclResult_t)]),
    "ncclSend": (ncclResult_t, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ncclComm_t,
                                ctypes.c_void_p]),
    "ncclRecv": (ncclResult_t, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ncclComm_t,
                                ctypes.c_void_p]),
    "ncclGroupStart": (ncclResult_t, []),
    "ncclGroupEnd": (ncclResult_t, []),
    "ncclCommAbort": (ncclResult_t, [ncclComm_t]),
    "ncclCommDestroy": (ncclResult_t, [ncclComm_t]),
}


def _wheel_dirs() -> list[str]:
    """``nvidia/nccl/lib`` of the nvidia-nccl-cu* wheel: the namespace package's locations
    (a .pth or an editable install may put it off sys.path), then every sys.path entry."""
    roots: list[str] = []
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("nvidia")
        if spec is not None and spec.submodule_search_locations:
            roots += [os.path.dirname(loc) for loc in spec.submodule_search_locations]
    roots += [base for base in sys.path if base]
    return [os.path.join(root, "nvidia", "nccl", "lib") for root in dict.fromkeys(roots)]


def _candidates() -> list[str]:
    """Where libnccl may be, in order: the env override (alone: an explicit path that does
    not load is an error, not a reason to load some other NCCL), torch's wheel, torch/lib,
    the loader's search path."""
    if os.environ.get(ENV_LIBRARY):
        return [os.environ[ENV_LIBRARY]]
    out: list[str] = []
    for lib_dir in _wheel_dirs():
        out += sorted(glob.glob(os.path.join(lib_dir, "libnccl.so*")))
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    out += sorted(glob.glob(str(torch_lib / "libnccl*.so*")))
    found = ctypes.util.find_library("nccl")
    if found:
        out.append(found)
    out.append("libnccl.so.2")
    return list(dict.fromkeys(out))


def find_nccl_library() -> ctypes.CDLL:
    """Load the first libnccl that loads; NcclUnavailable names every path tried."""
    tried = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
    raise NcclUnavailable(f"no loadable libnccl (set {ENV_LIBRARY}); tried: " + "; ".join(tried))


class _BlockingComm:
    """A communicator made by vLLM's blocking ``ncclCommInitRank`` (the fallback, see the
    module docstring). Every call on it that can wait for the peer (the init, a group of
    send/recv, whose connection set-up waits for the peer's matching group) runs on a
    thread of its own, so callers see what a non-blocking communicator shows: ``status``
    says in progress until that call returned, then its result. Aborted while a call is
    still inside NCCL, it is aborted by that thread once the call returns (NCCL does not
    support aborting a blocking communicator under a running call); the tensors of the
    call stay referenced until then."""

    def __init__(self) -> None:
        self.handle = ncclComm_t()
        self.lock = threading.Lock()  # guards the fields below
        self.worker: threading.Thread | None = None
        self.result = NCCL_IN_PROGRESS  # of the last call run on the worker
        self.aborted = False

    def busy(self) -> bool:
        return self.worker is not None and self.worker.is_alive()


class CtypesNccl:
    """Our binding over a loaded libnccl (``cdll``); ``find_nccl_library()`` when None."""

    name = "ctypes"

    def __init__(self, cdll: ctypes.CDLL | None = None) -> None:
        self._lib = cdll if cdll is not None else find_nccl_library()
        self._f: dict[str, Any] = {}
        missing = []
        for fname, (restype, argtypes) in _PROTOTYPES.items():
            try:
                fn = self._lib[fname]  # a new function pointer: the CDLL's cached one may be vLLM's
            except AttributeError:
                missing.append(fname)
                continue
            fn.restype, fn.argtypes = restype, argtypes
            self._f[fname] = fn
        if missing:
            raise NcclUnavailable(f"libnccl {getattr(self._lib, '_name', '?')} lacks {', '.join(missing)} "
                                  "(NCCL >= 2.18 needed for non-blocking communicators)")
        raw = ctypes.c_int()
        self._check(self._f["ncclGetVersion"](ctypes.byref(raw)))
        self._version = raw.value
        if self._version < CONFIG_VERSION:
            raise NcclUnavailable(f"NCCL {self.version()} is older than 2.18 (no non-blocking communicators)")
        self._group = threading.local()  # per thread, as NCCL's groups: ops on fallback communicators
        self._blocking_lock = threading.Lock()
        self._blocking: list[_BlockingComm] = []  # fallback communicators, to count stuck calls
        self.fallbacks = 0  # set-ups that fell back to the blocking init (logs, doctor)

    def _check(self, code: int) -> int:
        if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise NcclError(code, self.error_string(code))
        return code

    def version(self) -> str:
        v = self._version  # NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"

    def version_code(self) -> int:
        return self._version

    def error_string(self, code: int) -> str:
        text = self._f["ncclGetErrorString"](code)
        return text.decode(errors="replace") if text else f"code {code}"

    def unique_id(self) -> bytes:
        uid = ncclUniqueId()
        self._check(self._f["ncclGetUniqueId"](ctypes.byref(uid)))
        return bytes(ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES))

    def init_rank(self, nranks: int, unique_id: bytes, rank: int, config: CommConfig,
                  device: torch.device | None = None) -> ncclComm_t | _BlockingComm:
        """NCCL binds the communicator to the calling thread's current CUDA device; ``device``
        (optional, beyond the protocol) makes it that one for the call."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"unique id must be {UNIQUE_ID_BYTES} bytes")
        uid = ncclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        comm = ncclComm_t()
        cfg = make_config(config)
        with _on_device(device):
            code = self._f["ncclCommInitRankConfig"](ctypes.byref(comm), nranks, uid, rank, ctypes.byref(cfg))
        if code in _FALLBACK_CODES and not config.blocking:
            return self._blocking_init(nranks, uid, rank, device, code)
        self._check(code)
        return comm

    def _blocking_init(self, nranks: int, uid: ncclUniqueId, rank: int, device: torch.device | None,
                       why: int) -> _BlockingComm:
        with self._blocking_lock:
            self._blocking = [b for b in self._blocking if b.busy()]
            stuck = sum(1 for b in self._blocking if b.aborted)
            if stuck >= MAX_STUCK_BLOCKING:
                raise NcclError(why, f"{self.error_string(why)}; no blocking fallback: {stuck} earlier "
                                     "blocking calls are still inside NCCL")
            bc = _BlockingComm()
            self._blocking.append(bc)
            self.fallbacks += 1
        logger.warning("NCCL %s refused a non-blocking communicator (%s): this one uses the blocking "
                       "ncclCommInitRank vLLM uses, on a thread of its own", self.version(), self.error_string(why))

        def run() -> None:
            with _on_device(device):
                return self._f["ncclCommInitRank"](ctypes.byref(bc.handle), nranks, uid, rank)

        self._start_worker(bc, run)
        return bc

    def _start_worker(self, bc: _BlockingComm, call: Any) -> None:
        """Run ``call`` (one NCCL call or group on ``bc``) on a thread; its result becomes
        ``bc.result``; a communicator aborted meanwhile is aborted once the call returned."""

        def work() -> None:
            try:
                code = call()
            except Exception:  # noqa: BLE001 - ctypes/torch failure: reported as NCCL's internal error
                logger.exception("blocking NCCL call failed")
                code = NCCL_INTERNAL_ERROR
            with bc.lock:
                bc.result = code
                late_abort = bc.aborted
            if late_abort and bc.handle.value:
                self._f["ncclCommAbort"](bc.handle)

        with bc.lock:
            bc.result = NCCL_IN_PROGRESS
            bc.worker = threading.Thread(target=work, name="xpyd-nccl-blocking", daemon=True)
            bc.worker.start()

    def status(self, comm: ncclComm_t | _BlockingComm) -> int:
        if isinstance(comm, _BlockingComm):
            with comm.lock:
                if comm.busy():
                    return NCCL_IN_PROGRESS
                if comm.result != NCCL_SUCCESS:
                    return comm.result
            comm = comm.handle
        state = ncclResult_t()
        code = self._f["ncclCommGetAsyncError"](comm, ctypes.byref(state))
        return code if code != NCCL_SUCCESS else state.value

    def _p2p(self, fname: str, comm: ncclComm_t | _BlockingComm, tensor: torch.Tensor, peer: int,
             stream: Any) -> None:
        if not tensor.is_contiguous():
            raise ValueError("nccl moves contiguous tensors only")
        if isinstance(comm, _BlockingComm):
            pending = getattr(self._group, "ops", None)
            if pending is None:  # outside a group: a group of one
                self.group_start()
                try:
                    self._p2p(fname, comm, tensor, peer, stream)
                finally:
                    self.group_end()
                return
            pending.append((fname, comm, tensor, peer, stream))
            return
        nbytes = tensor.numel() * tensor.element_size()
        with _on_device(tensor.device):
            self._check(self._f[fname](ctypes.c_void_p(tensor.data_ptr()), nbytes, NCCL_UINT8, peer, comm,
                                       ctypes.c_void_p(stream.cuda_stream)))

    def send(self, comm: ncclComm_t | _BlockingComm, tensor: torch.Tensor, peer: int, stream: Any) -> None:
        self._p2p("ncclSend", comm, tensor, peer, stream)

    def recv(self, comm: ncclComm_t | _BlockingComm, tensor: torch.Tensor, peer: int, stream: Any) -> None:
        self._p2p("ncclRecv", comm, tensor, peer, stream)

    def group_start(self) -> None:
        self._group.ops = []
        self._check(self._f["ncclGroupStart"]())

    def group_end(self) -> None:
        ops = getattr(self._group, "ops", None) or []
        self._group.ops = None
        self._check(self._f["ncclGroupEnd"]())  # in progress is normal when non-blocking
        if ops:
            self._launch_blocking(ops)

    def _launch_blocking(self, ops: list[tuple]) -> None:
        """A group's ops on a fallback communicator, as one NCCL group on its worker."""
        comms = {id(op[1]): op[1] for op in ops}
        if len(comms) != 1:
            raise ValueError("a group on a blocking-fallback communicator must not mix communicators")
        bc = ops[0][1]
        with bc.lock:
            if bc.busy():
                raise NcclError(NCCL_INVALID_USAGE, "the communicator's previous call has not returned")
            if bc.aborted or bc.result != NCCL_SUCCESS:
                raise NcclError(NCCL_INVALID_USAGE, "the communicator is aborted or failed")

        def run() -> int:
            code = self._f["ncclGroupStart"]()
            for fname, _, tensor, peer, stream in ops:
                if code == NCCL_SUCCESS:
                    with _on_device(tensor.device):
                        code = self._f[fname](ctypes.c_void_p(tensor.data_ptr()),
                                              tensor.numel() * tensor.element_size(), NCCL_UINT8, peer,
                                              bc.handle, ctypes.c_void_p(stream.cuda_stream))
            end = self._f["ncclGroupEnd"]()
            return code if code != NCCL_SUCCESS else end

        self._start_worker(bc, run)

    def abort(self, comm: ncclComm_t | _BlockingComm) -> None:
        if isinstance(comm, _BlockingComm):
            with comm.lock:
                if comm.aborted:
                    return
                comm.aborted = True
                if comm.busy():
                    return  # the worker aborts it when its call returns
            comm = comm.handle
        self._check(self._f["ncclCommAbort"](comm))

    def destroy(self, comm: ncclComm_t | _BlockingComm) -> None:
        if isinstance(comm, _BlockingComm):
            with comm.lock:
                if comm.busy() or comm.aborted:
                    raise NcclError(NCCL_INVALID_USAGE, "destroy of a busy or aborted communicator")
                comm.aborted = True
            comm = comm.handle
        self._check(self._f["ncclCommDestroy"](comm))

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)


def _on_device(device: torch.device | None) -> contextlib.AbstractContextManager[Any]:
    """The CUDA device current for an NCCL call (NCCL reads cudaGetDevice); a no-op off CUDA."""
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


class VllmNccl(CtypesNccl):
    """The libnccl vLLM's ``NCCLLibrary`` loaded (one NCCL per process), called through
    our prototypes (see the module docstring for why not through its wrappers)."""

    name = "vllm"

    def __init__(self) -> None:
        try:
            from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
        except ImportError as e:
            raise NcclUnavailable(f"vLLM's NCCL binding is not importable: {e}") from e
        try:
            vlib = NCCLLibrary()
        except Exception as e:  # noqa: BLE001 - vLLM raises whatever ctypes raised
            raise NcclUnavailable(f"vLLM could not load libnccl: {e}") from e
        cdll = getattr(vlib, "lib", None)
        if not isinstance(cdll, ctypes.CDLL):
            raise NcclUnavailable("vLLM's NCCLLibrary has no loaded CDLL at .lib (vLLM changed its binding)")
        try:
            super().__init__(cdll)
        except NcclUnavailable as e:
            raise NcclUnavailable(f"vLLM's libnccl cannot run non-blocking communicators: {e}") from e


def load_nccl_library(prefer: str = "auto") -> CtypesNccl:
    """``auto``: vLLM's library when importable and it loads, else ours; ``vllm`` or
    ``ctypes`` force one. Raises NcclUnavailable when none loads (``auto`` names why
    vLLM's did not too)."""
    if prefer not in ("auto", "vllm", "ctypes"):
        raise ValueError(f"prefer must be auto, vllm or ctypes, got {prefer!r}")
    if not torch.cuda.is_available() and prefer == "auto":
        raise NcclUnavailable("no CUDA device")
    if prefer == "vllm":
        return VllmNccl()
    if prefer == "ctypes":
        return CtypesNccl()
    try:
        return VllmNccl()
    except NcclUnavailable as vllm_why:
        try:
            return CtypesNccl()
        except NcclUnavailable as e:
            raise NcclUnavailable(f"{e}; vLLM's: {vllm_why}") from e

"""The NCCL library objects behind the nccl transport (``nccl_api.NcclLibrary``).

``load_nccl_library()`` prefers vLLM's binding (``pynccl_wrapper.NCCLLibrary``) when vLLM is
importable: it finds and loads the ``libnccl`` vLLM itself uses, so the process has one NCCL.
vLLM's call wrappers raise on every result but success, and a non-blocking communicator
answers "in progress" (``ncclGroupEnd``, ``ncclCommInitRankConfig``), so the calls go through
our own ctypes prototypes over that same loaded library; vLLM also binds neither
``ncclCommInitRankConfig`` nor ``ncclCommGetAsyncError``. Our prototypes live on function
pointers of our own (``cdll[name]``), never on the CDLL's cached attributes, which carry
vLLM's prototypes (its own ``ncclUniqueId`` class) for its TP communicators.
Without vLLM (the GPU test machine has torch and NCCL only) the library is found by
``XPYD_NCCL_LIBRARY``, the copy torch ships (the ``nvidia-nccl-cu*`` wheel, or torch/lib),
then the loader's search path.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .nccl_api import NCCL_IN_PROGRESS, NCCL_SUCCESS, UNIQUE_ID_BYTES, CommConfig, NcclError

__all__ = ["CtypesNccl", "NcclUnavailable", "VllmNccl", "find_nccl_library", "load_nccl_library"]

ENV_LIBRARY = "XPYD_NCCL_LIBRARY"
NCCL_UINT8 = 1  # ncclDataType_t: every transfer moves bytes
CONFIG_MAGIC = 0xCAFEBEEF
CONFIG_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT (INT_MIN)
# The ncclConfig_t prefix below is NCCL 2.18's; NCCL copies min(size, its sizeof) bytes over
# its own NCCL_CONFIG_INITIALIZER, so every later field keeps that version's default.
CONFIG_VERSION = 2 * 10000 + 18 * 100 + 0  # NCCL_VERSION(2, 18, 0)

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p


class NcclUnavailable(RuntimeError):
    """No usable NCCL library here; the transport factory falls back to tcp under "auto"."""


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class ncclConfig(ctypes.Structure):
    """``ncclConfig_t`` up to ``splitShare`` (nccl.h of 2.18, struct ncclConfig_v21700);
    x86-64: 48 bytes."""

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
    return c


# name -> (restype, argtypes): the functions the transport needs.
_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetVersion": (ncclResult_t, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetErrorString": (ctypes.c_char_p, [ncclResult_t]),
    "ncclGetUniqueId": (ncclResult_t, [ctypes.POINTER(ncclUniqueId)]),
    "ncclCommInitRankConfig": (ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int,
                                              ctypes.POINTER(ncclConfig)]),
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

    def _check(self, code: int) -> int:
        if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise NcclError(code, self.error_string(code))
        return code

    def version(self) -> str:
        v = self._version  # NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"

    def error_string(self, code: int) -> str:
        text = self._f["ncclGetErrorString"](code)
        return text.decode(errors="replace") if text else f"code {code}"

    def unique_id(self) -> bytes:
        uid = ncclUniqueId()
        self._check(self._f["ncclGetUniqueId"](ctypes.byref(uid)))
        return bytes(ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES))

    def init_rank(self, nranks: int, unique_id: bytes, rank: int, config: CommConfig,
                  device: torch.device | None = None) -> ncclComm_t:
        """NCCL binds the communicator to the calling thread's current CUDA device; ``device``
        (optional, beyond the protocol) makes it that one for the call."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"unique id must be {UNIQUE_ID_BYTES} bytes")
        uid = ncclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        comm = ncclComm_t()
        cfg = make_config(config)
        with _on_device(device):
            self._check(self._f["ncclCommInitRankConfig"](ctypes.byref(comm), nranks, uid, rank, ctypes.byref(cfg)))
        return comm

    def status(self, comm: ncclComm_t) -> int:
        state = ncclResult_t()
        code = self._f["ncclCommGetAsyncError"](comm, ctypes.byref(state))
        return code if code != NCCL_SUCCESS else state.value

    def _p2p(self, fname: str, comm: ncclComm_t, tensor: torch.Tensor, peer: int, stream: Any) -> None:
        if not tensor.is_contiguous():
            raise ValueError("nccl moves contiguous tensors only")
        nbytes = tensor.numel() * tensor.element_size()
        with _on_device(tensor.device):
            self._check(self._f[fname](ctypes.c_void_p(tensor.data_ptr()), nbytes, NCCL_UINT8, peer, comm,
                                       ctypes.c_void_p(stream.cuda_stream)))

    def send(self, comm: ncclComm_t, tensor: torch.Tensor, peer: int, stream: Any) -> None:
        self._p2p("ncclSend", comm, tensor, peer, stream)

    def recv(self, comm: ncclComm_t, tensor: torch.Tensor, peer: int, stream: Any) -> None:
        self._p2p("ncclRecv", comm, tensor, peer, stream)

    def group_start(self) -> None:
        self._check(self._f["ncclGroupStart"]())

    def group_end(self) -> None:
        self._check(self._f["ncclGroupEnd"]())  # in progress is normal when non-blocking

    def abort(self, comm: ncclComm_t) -> None:
        self._check(self._f["ncclCommAbort"](comm))

    def destroy(self, comm: ncclComm_t) -> None:
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

"""The real NCCL library objects (connector/transport/nccl_lib.py): what can be checked
without NCCL here (struct layout, config mapping, library discovery, the transport
factory's fallback), and, marked `gpu`, the calls themselves against torch's libnccl."""

from __future__ import annotations

import ctypes
import logging
import time

import pytest
import torch

from connector.transport import TcpTransport, make_transport, nccl_lib
from connector.transport.nccl_api import NCCL_IN_PROGRESS, NCCL_SUCCESS, CommConfig
from connector.transport.nccl_lib import NcclUnavailable, make_config, ncclConfig


def test_config_struct_matches_the_c_layout():
    """ncclConfig_t of NCCL 2.18 on x86-64: size_t, 2 uint, 4 int, a pointer, an int."""
    assert ctypes.sizeof(ncclConfig) == 48
    offsets = {name: getattr(ncclConfig, name).offset for name, _ in ncclConfig._fields_}
    assert offsets == {"size": 0, "magic": 8, "version": 12, "blocking": 16, "cgaClusterSize": 20,
                       "minCTAs": 24, "maxCTAs": 28, "netName": 32, "splitShare": 40}
    assert ctypes.sizeof(nccl_lib.ncclUniqueId) == 128


def test_config_mapping_keeps_nccl_defaults_for_what_we_do_not_set():
    c = make_config(CommConfig())
    assert (c.size, c.magic, c.version) == (48, 0xCAFEBEEF, 21800)
    assert c.blocking == 0  # non-blocking: a dead peer can never hang a thread
    assert c.minCTAs == c.maxCTAs == c.cgaClusterSize == c.splitShare == -(2**31)  # NCCL_CONFIG_UNDEF_INT
    assert c.netName is None
    c = make_config(CommConfig(blocking=True, num_channels=4, net_name="Socket"))
    assert (c.blocking, c.minCTAs, c.maxCTAs, c.netName) == (1, 4, 4, b"Socket")


def test_explicit_library_path_that_does_not_load_is_named(monkeypatch, tmp_path):
    missing = tmp_path / "libnccl.so.2"
    monkeypatch.setenv(nccl_lib.ENV_LIBRARY, str(missing))
    with pytest.raises(NcclUnavailable, match=str(missing)):
        nccl_lib.find_nccl_library()


def test_torch_wheel_copy_is_searched_before_the_loader_path(monkeypatch, tmp_path):
    monkeypatch.delenv(nccl_lib.ENV_LIBRARY, raising=False)
    lib = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"not an ELF")  # found first, fails to load, the search goes on
    monkeypatch.setattr("sys.path", [str(tmp_path)])
    cands = nccl_lib._candidates()
    assert cands[0] == str(lib) and cands[-1] == "libnccl.so.2"
    with pytest.raises(NcclUnavailable) as e:
        if not torch.cuda.is_available():
            nccl_lib.find_nccl_library()
        else:  # a GPU machine may well load the last candidate
            raise NcclUnavailable(str(lib))
    assert str(lib) in str(e.value)


def test_library_without_the_non_blocking_api_is_refused():
    from types import SimpleNamespace

    old = SimpleNamespace(**{name: SimpleNamespace() for name in ("ncclGetVersion", "ncclGetErrorString",
                                                                  "ncclGetUniqueId", "ncclSend", "ncclRecv")})
    with pytest.raises(NcclUnavailable, match="ncclCommInitRankConfig"):
        nccl_lib.CtypesNccl(old)  # type: ignore[arg-type]


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


@pytest.mark.gpu
def test_real_library_basics():
    lib = nccl_lib.load_nccl_library("ctypes")
    assert lib.version() >= "2.18"
    uid = lib.unique_id()
    assert len(uid) == 128 and uid != lib.unique_id()
    assert lib.error_string(NCCL_IN_PROGRESS)


@pytest.mark.gpu
def test_set_up_with_a_peer_that_never_joins_can_be_aborted():
    """Non-blocking init: rank 0 of 2 stays in progress while rank 1 never comes, and
    ncclCommAbort ends it promptly: a dead peer cannot hang a thread."""
    lib = nccl_lib.load_nccl_library("ctypes")
    comm = lib.init_rank(2, lib.unique_id(), 0, CommConfig())
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        assert lib.status(comm) == NCCL_IN_PROGRESS
        time.sleep(0.05)
    t0 = time.monotonic()
    lib.abort(comm)
    assert time.monotonic() - t0 < 10.0


@pytest.mark.gpu
def test_single_rank_communicator_is_ready():
    lib = nccl_lib.load_nccl_library("ctypes")
    comm = lib.init_rank(1, lib.unique_id(), 0, CommConfig(num_channels=2))
    deadline = time.monotonic() + 30
    while lib.status(comm) == NCCL_IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lib.status(comm) == NCCL_SUCCESS
    lib.destroy(comm)

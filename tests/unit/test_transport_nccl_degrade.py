"""Degrade, never break (issue 20, "What to build" 3), on the host-memory NCCL double: when
NCCL cannot be set up with a peer or its transfers keep failing, that peer's calls move to
the host-staged tcp path (one WARN naming the NCCL error, ``on_fallback(reason)`` for the
metric, ``fallbacks()``), their tensors still arrive, and NCCL is tried again later."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from connector.transport.nccl import NcclTransport
from tests.support.nccl_double import Fabric, FakeNccl, rand_bytes, until

HOST = "127.0.0.1"
CPU = torch.device("cpu")
LOGGER = "connector.transport.nccl"


def _echo(header, tensors):
    return {"sums": [int(t.sum()) for t in tensors]}, [t.flip(0) for t in tensors]


@pytest.fixture(params=[True, False], ids=["socket", "p2p"])
def pair(request):
    """(client, server, address, reasons): reasons collects the client's on_fallback calls."""
    fabric = Fabric(abort_reaches_peer=request.param)
    made: list[NcclTransport] = []

    def make(server_lib=None, client_lib=None, **kw):
        server = NcclTransport(server_lib or FakeNccl(fabric), CPU, **kw)
        server.start(HOST, 0, _echo)
        client = NcclTransport(client_lib or FakeNccl(fabric), CPU, **kw)
        made.extend((client, server))
        reasons: list[str] = []
        client.on_fallback = reasons.append
        return client, server, f"{HOST}:{server.bound_port}", reasons

    make.fabric = fabric
    yield make
    for t in made:
        t.close()
    fabric.close()


def _roundtrip(client, addr, seed: int, n: int = 3000, timeout_s: float = 5.0) -> None:
    t = rand_bytes(n, seed)
    reply, back = client.call(addr, {"op": "x"}, [t], timeout_s=timeout_s)
    assert reply["ok"] and reply["sums"] == [int(t.sum())] and torch.equal(back[0], t.flip(0))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == LOGGER
            and "host-staged" in r.getMessage()]


def test_init_refused_moves_the_peer_to_tcp_at_once_and_nccl_is_tried_again_later(pair, caplog):
    server_lib = FakeNccl(pair.fabric, init_error=2)
    client, server, addr, reasons = pair(server_lib=server_lib, retry_s=0.5)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for seed in range(3):
            _roundtrip(client, addr, seed)
        assert server_lib.recv_bytes == 0  # all inline, through host memory
        assert reasons == ["setup"]
        (warn,) = _warnings(caplog)
        assert "unhandled system error" in warn and addr in warn  # names the NCCL error and the peer
        assert client.fallbacks()[addr]["reason"] == "setup"
        assert len(server_lib.configs) == 0  # asked once, refused, not asked per call
        server_lib._init_error = None  # fixed (say, the other side restarted)
        time.sleep(0.6)
        _roundtrip(client, addr, 7)
        assert until(lambda: client.communicators()["out"] == 1)
        _roundtrip(client, addr, 8)
        assert server_lib.recv_bytes > 0 and client.fallbacks() == {}
        assert any("back on NCCL" in r.getMessage() for r in caplog.records)
    assert reasons == ["setup"] and len(_warnings(caplog)) == 1


def test_a_retry_that_fails_again_backs_off_quietly(pair, caplog):
    server_lib = FakeNccl(pair.fabric, init_error=2)
    client, server, addr, reasons = pair(server_lib=server_lib, retry_s=0.3)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _roundtrip(client, addr, 1)
        first = client.fallbacks()[addr]["retry_in_s"]
        time.sleep(0.4)
        _roundtrip(client, addr, 2)  # retries NCCL, fails again: still inline
        assert until(lambda: client.fallbacks().get(addr, {}).get("retry_in_s", 0) > first)
    assert reasons == ["setup"] and len(_warnings(caplog)) == 1  # one WARN, one count per switch


def test_send_errors_resend_inline_and_n_in_a_row_move_the_peer_to_tcp(pair, caplog):
    client_lib = FakeNccl(pair.fabric)
    client, server, addr, reasons = pair(client_lib=client_lib, fallback_after=3)
    _roundtrip(client, addr, 0)
    assert server._lib.recv_bytes > 0
    before = server._lib.recv_bytes
    client_lib.send_error = 3
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for seed in range(1, 6):
            _roundtrip(client, addr, seed)  # every request keeps its tensors
    assert client_lib.send_calls == 1 + 3  # the warm-up, then three tries; then no more NCCL
    assert server._lib.recv_bytes == before
    assert reasons == ["transfers"]
    (warn,) = _warnings(caplog)
    assert "internal error" in warn and "3 transfers in a row" in warn


def test_a_success_between_failures_resets_the_count(pair):
    client_lib = FakeNccl(pair.fabric)
    client, server, addr, reasons = pair(client_lib=client_lib, fallback_after=3)
    for _ in range(3):
        client_lib.send_error = 3
        _roundtrip(client, addr, 1)
        _roundtrip(client, addr, 2)
        client_lib.send_error = None
        _roundtrip(client, addr, 3)  # a fresh communicator, over NCCL
    assert reasons == [] and client.fallbacks() == {}


def test_transfers_hanging_past_their_deadline_move_the_peer_to_tcp(pair):
    """The peer's NCCL wedges (nothing posted ever launches): each call ends by its deadline,
    and after fallback_after of them the peer's calls take the host path, promptly. Each
    call's 2 s covers a new communicator's set-up on a loaded box (0.6 s did not: a set-up
    that timed out is no transfer failure, and the count fell short)."""
    client, server, addr, reasons = pair(fallback_after=3, max_wait_s=5.0)
    _roundtrip(client, addr, 0)
    server._lib.stall = True
    for seed in range(1, 4):
        t0 = time.monotonic()
        try:
            _roundtrip(client, addr, seed, timeout_s=2.0)  # resent inline if time was left
        except Exception as e:  # noqa: BLE001 - a TransportError at the deadline is fine here
            assert "timeout" in str(e) or "nccl" in str(e), e
        assert time.monotonic() - t0 < 2.0 + 3.0  # by its deadline (slack for a loaded box)
    assert reasons == ["transfers"]
    t0 = time.monotonic()
    _roundtrip(client, addr, 9, timeout_s=30.0)
    assert time.monotonic() - t0 < 10.0  # the host path, not NCCL's wait to the 30 s deadline


def test_a_peer_on_another_nccl_version_is_one_fallback(pair):
    client, server, addr, reasons = pair(server_lib=FakeNccl(pair.fabric, version="2.21.5"))
    for seed in range(3):
        _roundtrip(client, addr, seed)
    assert reasons == ["version"] and client.fallbacks()[addr]["reason"] == "version"


def test_set_ups_that_keep_failing_stop_after_a_few(pair, caplog):
    """Each set-up that fails after its unique id was made leaves NCCL's bootstrap thread
    and socket behind (real library): after _MAX_FAILED_SETUPS in a row NCCL with that
    peer is off until restart, so no more ids are made for it; its KV still goes inline."""
    from connector.transport import nccl as nccl_mod

    server_lib = FakeNccl(pair.fabric, init_error=2)
    client_lib = FakeNccl(pair.fabric)
    client, server, addr, reasons = pair(server_lib=server_lib, client_lib=client_lib, retry_s=0.05)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for seed in range(nccl_mod._MAX_FAILED_SETUPS * 3):
            _roundtrip(client, addr, seed)
            time.sleep(0.12)  # past the (short) back-off: every call may retry NCCL
    assert addr in client.quarantined()
    assert client_lib.unique_ids == nccl_mod._MAX_FAILED_SETUPS  # then no more
    assert server_lib.recv_bytes == 0
    assert sum("set-ups failed in a row" in r.getMessage() for r in caplog.records) == 1


def test_failed_set_ups_in_all_turn_nccl_off_here(pair, monkeypatch):
    """Across peers too: after _MAX_FAILED_SETUPS_TOTAL failed set-ups NCCL is off here
    (each may leave a bootstrap thread behind), and calls keep their tensors inline."""
    from connector.transport import nccl as nccl_mod

    monkeypatch.setattr(nccl_mod, "_MAX_FAILED_SETUPS_TOTAL", 2)
    client_lib = FakeNccl(pair.fabric)
    client, _, addr1, _ = pair(server_lib=FakeNccl(pair.fabric, init_error=2), client_lib=client_lib, retry_s=60)
    _, _, addr2, _ = pair(server_lib=FakeNccl(pair.fabric, init_error=2))
    _, _, addr3, _ = pair()  # a healthy peer, asked after the bound was reached
    for seed, addr in enumerate((addr1, addr2, addr3)):
        _roundtrip(client, addr, seed)
    assert client_lib.unique_ids == 2  # none for the third peer
    assert client.communicators()["out"] == 0

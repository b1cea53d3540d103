"""Two real KVEngines over the nccl transport, the NCCL library object replaced by the
host-memory double: the engine's send modes, the control plane and the caps run as they
do on GPUs; only the library underneath is the double (the GPU run uses the real one)."""

from __future__ import annotations

import pytest
import torch

from connector.transport.nccl import NcclTransport
from tests.support.kv_engines import (
    SRC_IDS,
    load_and_check,
    load_spec,
    plan_load,
    poll_until,
    rank0,
    save_spec,
    snapshot,
)
from tests.support.nccl_double import Fabric, FakeNccl

CPU = torch.device("cpu")


@pytest.fixture
def nccl_engines(engines):
    fabric = Fabric()
    libs: list[FakeNccl] = []

    def start(role: str, send_type: str, lib_kw: dict | None = None, **kw):
        def build(cfg):
            lib = FakeNccl(fabric, **(lib_kw or {}))
            libs.append(lib)
            return NcclTransport(lib, CPU, max_msg_bytes=cfg.kv_buffer_size + (1 << 20))

        eng = engines(role, send_type, transport=build, **kw)
        eng.nccl = libs[-1]
        return eng

    yield start
    fabric.close()


@pytest.mark.parametrize("send_type", ["PUT_ASYNC", "PUT", "GET"])
def test_send_modes_move_the_blocks_over_nccl(nccl_engines, send_type):
    prod = nccl_engines("kv_producer", send_type, seed=1)
    cons = nccl_engines("kv_consumer", send_type, seed=2)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), delay_free=send_type == "PUT_ASYNC"))
    load_and_check(cons, prod, before)
    # The blocks went over the communicator, not inline over the control socket.
    payload = sum(c[list(SRC_IDS)].numel() * c.element_size() for c in prod.caches.values())
    assert cons.nccl.recv_bytes == payload  # PUT: D served the tensors; GET: D fetched them
    if send_type == "PUT_ASYNC":
        poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})


def test_many_transfers_reuse_one_communicator(nccl_engines):
    prod = nccl_engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = nccl_engines("kv_consumer", "PUT_ASYNC", seed=2)
    for i in range(6):
        key = f"{i:032x}"
        prod.save(save_spec(prod, rank0(cons), req_id=f"P{i}", key=key))
        plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2, req_id=f"D{i}", key=key))
        res, _ = poll_until(cons, lambda r, i=i: f"D{i}" in r.finished_recving)
        assert res.failed_recving == set()
    assert prod._transport.communicators() == {"out": 1, "in": 0}


def test_nccl_producer_falls_back_to_inline_for_a_tcp_decode(nccl_engines, engines):
    """A decode instance on the tcp transport (CPU caches, or NCCL unavailable there):
    the prefill's nccl transport learns it at the hello and ships the blocks inline."""
    prod = nccl_engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    load_and_check(cons, prod, before)
    assert prod.nccl.configs == []  # no communicator was ever created


def test_layout_mismatch_over_nccl_fails_the_load_not_the_cache(nccl_engines):
    from tests.support.kv_engines import make_caches

    prod = nccl_engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = nccl_engines("kv_consumer", "PUT_ASYNC", caches=make_caches(2, dtype=torch.float16))
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    for name, cache in cons.caches.items():
        assert torch.equal(cache, before[name])


@pytest.mark.parametrize("send_type", ["PUT_ASYNC", "PUT", "GET"])
def test_requests_keep_their_kv_when_nccl_cannot_be_set_up(nccl_engines, send_type):
    """The decode's NCCL refuses every communicator (PUT: P calls D; GET: D calls P, whose
    NCCL is the refusing one then): the KV goes over the host path, loads intact, and the
    caller counts one fallback (reason setup) for vLLM's /metrics."""
    refusing = {"init_error": 2}
    prod = nccl_engines("kv_producer", send_type, seed=1, lib_kw=refusing if send_type == "GET" else None)
    cons = nccl_engines("kv_consumer", send_type, seed=2, lib_kw=None if send_type == "GET" else refusing)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons), delay_free=send_type == "PUT_ASYNC"))
    load_and_check(cons, prod, before)
    assert cons.nccl.recv_bytes == 0 and prod.nccl.recv_bytes == 0  # nothing went over NCCL
    caller = cons if send_type == "GET" else prod
    assert caller.xfer_stats.peek().fallbacks("setup") == 1
    reply, _ = caller._transport._control.call(rank0(prod if caller is cons else cons), {"op": "ping"}, timeout_s=2)
    assert reply["ok"]
    stats = caller._handle({"op": "stats"}, [])[0]
    assert list(stats["fallbacks"].values())[0]["reason"] == "setup"


def test_requests_keep_their_kv_when_nccl_sends_fail(nccl_engines):
    """P's NCCL sends fail after a first good transfer: every later transfer still loads
    (resent inline), and after three failures in a row P counts one fallback."""
    prod = nccl_engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = nccl_engines("kv_consumer", "PUT_ASYNC", seed=2)
    for i in range(5):
        if i == 1:
            prod.nccl.send_error = 3
        key = f"{i:032x}"
        prod.save(save_spec(prod, rank0(cons), req_id=f"P{i}", key=key))
        plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2, req_id=f"D{i}", key=key))
        res, _ = poll_until(cons, lambda r, i=i: f"D{i}" in r.finished_recving)
        assert res.failed_recving == set()
    assert prod.xfer_stats.peek().fallbacks("transfers") == 1
    assert prod.xfer_stats.peek().failures("send", "transport") == 0


def test_get_keeps_its_kv_when_the_prefill_cannot_send_over_nccl(nccl_engines):
    """GET: P's NCCL refuses its reply sends; the reply tensors come inline (the handler ran
    once), every load is intact, and D moves P to the host path after two in a row."""
    prod = nccl_engines("kv_producer", "GET", seed=1)
    cons = nccl_engines("kv_consumer", "GET", seed=2)
    prod.nccl.send_error = 3
    for i in range(3):
        key = f"{i:032x}"
        prod.save(save_spec(prod, rank0(cons), req_id=f"P{i}", key=key))
        plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2, req_id=f"D{i}", key=key))
        res, _ = poll_until(cons, lambda r, i=i: f"D{i}" in r.finished_recving)
        assert res.failed_recving == set()
    assert prod.nccl.send_calls == 2 and cons.nccl.recv_bytes == 0
    assert cons.xfer_stats.peek().fallbacks("transfers") == 1

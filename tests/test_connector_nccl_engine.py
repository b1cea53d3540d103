"""Two real KVEngines over the nccl transport, the NCCL library object replaced by the
host-memory double: the engine's send modes, the control plane and the caps run as they
do on GPUs; only the library underneath is the double (the GPU run uses the real one)."""

from __future__ import annotations

import pytest
import torch
from test_connector_engine import (
    SRC_IDS,
    load_and_check,
    load_spec,
    plan_load,
    poll_until,
    rank0,
    save_spec,
    snapshot,
)

from connector.transport.nccl import NcclTransport
from tests.nccl_double import Fabric, FakeNccl

CPU = torch.device("cpu")


@pytest.fixture
def nccl_engines(engines):
    fabric = Fabric()
    libs: list[FakeNccl] = []

    def build(cfg):
        lib = FakeNccl(fabric)
        libs.append(lib)
        return NcclTransport(lib, CPU, max_msg_bytes=cfg.kv_buffer_size + (1 << 20))

    def start(role: str, send_type: str, **kw):
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
    from test_connector_engine import make_caches

    prod = nccl_engines("kv_producer", "PUT_ASYNC", seed=1)
    cons = nccl_engines("kv_consumer", "PUT_ASYNC", caches=make_caches(2, dtype=torch.float16))
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == {"D-req"}
    for name, cache in cons.caches.items():
        assert torch.equal(cache, before[name])

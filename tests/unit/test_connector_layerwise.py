"""Layer-wise sends (``send_granularity: layer``): P ships each layer's blocks as soon as the
worker reports the layer written, D joins the parts into the payload a whole-request sender
would have sent. Two real KVEngines on loopback (test_connector_engine's helpers) and
``PartAssembler`` on its own."""

from __future__ import annotations

import time

import pytest
import torch

from connector.p2p.assembly import PartAssembler
from connector.p2p.buffer import GONE, KVBuffer, tensor_bytes
from tests.support.connector_log import connector_log
from tests.support.kv_engines import (
    KEY,
    SRC_IDS,
    ZERO,
    assert_loaded,
    load_spec,
    plan_load,
    poll_until,
    rank0,
    save_spec,
    snapshot,
    wait_for,
)
from tests.support.layerwise import LAYERS


def layerwise(engines, **over):
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer", **over)
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    assert prod.layerwise and not cons.layerwise
    return prod, cons


def test_auto_is_layerwise_over_tcp(engines):
    """The default (auto) over the tcp transport: layer by layer."""
    assert engines("kv_producer", "PUT_ASYNC").layerwise
    assert not engines("kv_producer", "PUT").layerwise


def test_layers_reach_decode_while_the_forward_pass_runs(engines):
    """Each layer is on D before the next one is written and before the forward pass ends; the
    joined payload loads exactly the blocks a whole-request send loads."""
    prod, cons = layerwise(engines)
    dst_before = snapshot(cons.caches)
    spec = save_spec(prod, rank0(cons))

    prod.save_layer(spec, LAYERS[0])
    wait_for(lambda: cons.stats()["partial_payloads"] == 1)  # layer 0 arrived; layer 1 is not written
    assert cons.stats()["recv_items"] == 0 and cons.stats()["recv_reserved_bytes"] > 0
    prod.save_layer(spec, LAYERS[1])
    wait_for(lambda: cons.stats()["recv_items"] == 1)  # whole: before the forward pass ended
    assert cons.stats()["partial_payloads"] == 0 and cons.stats()["recv_reserved_bytes"] == 0
    prod.save(spec)  # wait_for_save: the end of the forward pass

    plan_load(cons, load_spec(rank0(prod), (0, 15, 5, 6, 8), 0))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set()
    assert_loaded(cons, dst_before, prod, (0, 15, 5, 6, 8), SRC_IDS)
    assert cons.stats() == ZERO
    res, _ = poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    assert prod.stats() == ZERO


def test_request_granularity_sends_nothing_before_the_forward_pass_ends(engines):
    """The control for the test above: whole-request sends ignore the layer reports."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="request")
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    assert not prod.layerwise
    spec = save_spec(prod, rank0(cons))
    for name in LAYERS:
        prod.save_layer(spec, name)
    time.sleep(0.3)
    assert cons.stats()["recv_reserved_bytes"] == 0 and cons.stats()["partial_payloads"] == 0
    assert prod.stats()["pending_sends"] == 0
    prod.save(spec)
    wait_for(lambda: cons.stats()["recv_items"] == 1)


@pytest.mark.parametrize("reported", [(), (1,), (1, 0), (0, 0)], ids=["none", "out-of-order", "reversed", "repeated"])
def test_layers_not_reported_in_order_go_when_the_forward_pass_ends(engines, reported):
    """A layer the worker never reported (or reported out of order) is sent once the forward
    pass is over; what D loads is still the prompt's blocks."""
    prod, cons = layerwise(engines)
    dst_before = snapshot(cons.caches)
    spec = save_spec(prod, rank0(cons))
    for i in reported:
        prod.save_layer(spec, LAYERS[i])
    prod.save_layer(spec, "model.layers.9.mlp")  # not a cache of ours: ignored
    if 0 in reported:  # layer 0 went at once
        wait_for(lambda: cons.stats()["partial_payloads"] == 1)
    else:
        time.sleep(0.2)
        assert cons.stats()["recv_reserved_bytes"] == 0  # layer 0 was never reported written
    prod.save(spec)
    plan_load(cons, load_spec(rank0(prod), (0, 15, 5, 6, 8), 0))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set()
    assert_loaded(cons, dst_before, prod, (0, 15, 5, 6, 8), SRC_IDS)


@pytest.mark.parametrize("reported", [2, 0])
def test_the_send_log_says_how_many_layers_were_reported_before_the_end(engines, reported):
    """'layers_reported=2/2': vLLM reported every layer (save_kv_layer) before the forward pass
    ended; '0/2': it reported none, and the whole payload went at the step's end."""
    prod, cons = layerwise(engines)
    spec = save_spec(prod, rank0(cons))
    with connector_log() as lines:
        for name in LAYERS[:reported]:
            prod.save_layer(spec, name)
        prod.save(spec)
        wait_for(lambda: any("kv sent" in ln for ln in lines.lines))
    sent = next(ln for ln in lines.lines if "kv sent" in ln)
    assert sent.endswith(f" layers_reported={reported}/2"), sent


def test_two_prompts_of_one_step_to_one_decode(engines):
    prod, cons = layerwise(engines)
    dst_before = snapshot(cons.caches)
    a = save_spec(prod, rank0(cons), req_id="P-a", key="a" * 32, block_ids=SRC_IDS)
    b = save_spec(prod, rank0(cons), req_id="P-b", key="b" * 32, block_ids=(0, 2, 5, 6, 7))
    for name in LAYERS:
        prod.save_layer(a, name)
        prod.save_layer(b, name)
    prod.save(a)
    prod.save(b)
    plan_load(cons, load_spec(rank0(prod), (8, 9, 10, 11, 12), 0, req_id="D-a", key="a" * 32))
    plan_load(cons, load_spec(rank0(prod), (1, 3, 4, 13, 14), 0, req_id="D-b", key="b" * 32))
    res, _ = poll_until(cons, lambda r: {"D-a", "D-b"} <= r.finished_recving)
    assert res.failed_recving == set()
    for name, cache in cons.caches.items():
        for d, s in zip((8, 9, 10, 11, 12), SRC_IDS, strict=True):
            assert torch.equal(cache[d], prod.caches[name][s])
        for d, s in zip((1, 3, 4, 13, 14), (0, 2, 5, 6, 7), strict=True):
            assert torch.equal(cache[d], prod.caches[name][s])
    untouched = [i for i in range(16) if i not in (8, 9, 10, 11, 12, 1, 3, 4, 13, 14)]
    for name, cache in cons.caches.items():
        assert torch.equal(cache[untouched], dst_before[name][untouched])
    res, _ = poll_until(prod, lambda r: {"P-a", "P-b"} <= r.finished_sending, finished={"P-a", "P-b"})


def test_a_layerwise_send_to_a_dead_decode_ends_within_its_deadline(engines):
    """Nothing listens at the decode's address: the send fails, and its blocks are freed
    within send_timeout_s of the forward pass's end."""
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_granularity="layer", send_timeout_s=1.0)
    spec = save_spec(prod, "127.0.0.1:1")
    prod.save_layer(spec, LAYERS[0])
    prod.save(spec)
    t0 = time.monotonic()
    poll_until(prod, lambda r: "P-req" in r.finished_sending, finished={"P-req"})
    assert time.monotonic() - t0 < 5.0
    assert prod.stats() == ZERO


def test_prompts_of_one_step_go_layer_by_layer_together(engines):
    """Two prompts completed in the same step to one decode: the second one's first layer is on
    D before the first one's last layer is written (it does not queue behind the whole first)."""
    prod, cons = layerwise(engines)
    a = save_spec(prod, rank0(cons), req_id="P-a", key="a" * 32)
    b = save_spec(prod, rank0(cons), req_id="P-b", key="b" * 32, block_ids=(0, 2))
    prod.save_layer(a, LAYERS[0])
    prod.save_layer(b, LAYERS[0])
    wait_for(lambda: cons.stats()["partial_payloads"] == 2)
    assert cons.stats()["recv_items"] == 0
    prod.save_layer(a, LAYERS[1])
    wait_for(lambda: cons.stats()["recv_items"] == 1)  # a is whole; b waits for its layer 1
    prod.save(a)
    prod.save(b)
    wait_for(lambda: cons.stats()["recv_items"] == 2)
    poll_until(prod, lambda r: {"P-a", "P-b"} <= r.finished_sending, finished={"P-a", "P-b"})
    assert cons.stats()["partial_payloads"] == 0


def test_a_preempted_layerwise_send_is_over_when_wait_sends_returns(engines):
    """Preemption (after the step that wrote the blocks): whether the send was cancelled while
    queued or had started, nothing of it is on its way once wait_sends returns."""
    prod, cons = layerwise(engines)
    specs = [save_spec(prod, rank0(cons), req_id=f"P-{i}", key=f"{i}" * 32) for i in range(4)]
    for name in LAYERS:
        for spec in specs:
            prod.save_layer(spec, name)
    for spec in specs:
        prod.save(spec)
    prod.wait_sends([s.req_id for s in specs])
    stats = cons.stats()
    assert stats["partial_payloads"] == 0 and stats["recv_reserved_bytes"] == 0
    assert prod.stats()["pending_sends"] == 0
    time.sleep(0.2)
    assert cons.stats()["recv_items"] == stats["recv_items"]  # nothing arrives afterwards


# ------------------------------------------------------------- PartAssembler alone


def _parts(key: str = KEY, layers: int = 3, runs: tuple[int, ...] = (2, 1)):
    """A payload of ``layers`` layers, each in ``runs`` tensors, split one layer per part."""
    names = [f"l{i}" for i in range(layers)]
    header = {"op": "put", "key": key, "num_tokens": 40, "num_blocks": sum(runs), "layers": names,
              "runs": list(runs), "dtype": "bfloat16"}
    gen = torch.Generator().manual_seed(0)
    tensors = [[torch.randn((n, 2, 4), generator=gen).to(torch.bfloat16) for n in runs] for _ in names]
    parts = [({**header, "part": [i, i + 1]}, tensors[i]) for i in range(layers)]
    return header, [t for per in tensors for t in per], parts


def test_parts_in_order_join_into_the_whole_payload():
    recv = KVBuffer("recv", 10**6, 60.0)
    asm = PartAssembler(recv)
    header, whole, parts = _parts()
    assert recv.reserve(KEY, tensor_bytes(whole)) is None
    for h, t in parts[:-1]:
        assert asm.add(KEY, h, t) == (None, None)
    payload, why = asm.add(KEY, *parts[-1])
    assert why is None and payload is not None
    assert payload.header == header and payload.nbytes == tensor_bytes(whole)
    assert all(a is b for a, b in zip(payload.tensors, whole, strict=True))
    assert len(asm) == 0
    assert recv.put(KEY, payload) is None  # fills its reservation exactly


def test_several_layers_in_one_part():
    recv = KVBuffer("recv", 10**6, 60.0)
    asm = PartAssembler(recv)
    header, whole, _ = _parts()
    recv.reserve(KEY, tensor_bytes(whole))
    assert asm.add(KEY, {**header, "part": [0, 2]}, whole[:4]) == (None, None)
    payload, why = asm.add(KEY, {**header, "part": [2, 3]}, whole[4:])
    assert why is None and payload is not None and payload.tensors == whole


def _refused(mutate) -> tuple[str, KVBuffer]:
    recv = KVBuffer("recv", 10**6, 60.0)
    asm = PartAssembler(recv)
    header, whole, parts = _parts()
    recv.reserve(KEY, tensor_bytes(whole))
    asm.add(KEY, *parts[0])
    h, t = mutate(header, whole, parts)
    payload, why = asm.add(KEY, h, t)
    assert payload is None and why
    assert len(asm) == 0 and recv.reservation(KEY) is None  # the transfer failed as a whole
    assert recv.failure(KEY) == why  # so its load fails at once
    return why, recv


@pytest.mark.parametrize("mutate, match", [
    (lambda h, w, p: p[2], "out of order"),
    (lambda h, w, p: p[0], "out of order"),  # repeated
    (lambda h, w, p: ({**p[1][0], "num_tokens": 41}, p[1][1]), "differs"),
    (lambda h, w, p: (p[1][0], p[1][1][:1]), "tensor count"),
    (lambda h, w, p: ({**p[1][0], "part": [1, 4]}, p[1][1] * 3), "outside"),
    (lambda h, w, p: ({**p[1][0], "part": "1:2"}, p[1][1]), "malformed"),
    (lambda h, w, p: (p[1][0], [torch.zeros((9, 2, 4), dtype=torch.bfloat16), p[1][1][1]]), "exceed"),
])
def test_a_part_that_does_not_fit_the_transfer_fails_it(mutate, match):
    why, _ = _refused(mutate)
    assert match in why


def test_a_part_without_its_reservation_is_refused():
    recv = KVBuffer("recv", 10**6, 60.0)
    asm = PartAssembler(recv)
    _, _, parts = _parts()
    payload, why = asm.add(KEY, *parts[0])
    assert payload is None and "reservation" in why and len(asm) == 0
    other = "f" * 32
    _, _, parts = _parts(other)
    recv.reserve(other, 10**3)
    payload, why = asm.add(other, *parts[1])  # not layer 0
    assert payload is None and "before layer 0" in why


def test_a_part_for_a_key_released_mid_send_is_unneeded_not_a_failure():
    """D released the key between two parts (its request finished or found the prompt in its
    own cache): the rest is refused as GONE, the parts go, and no failure is recorded."""
    recv = KVBuffer("recv", 10**6, 60.0)
    asm = PartAssembler(recv)
    _, whole, parts = _parts()
    recv.reserve(KEY, tensor_bytes(whole))
    assert asm.add(KEY, *parts[0]) == (None, None)
    recv.discard(KEY)
    assert asm.add(KEY, *parts[1]) == (None, GONE)
    assert len(asm) == 0 and recv.failure(KEY) is None and recv.gone(KEY)


def test_each_part_keeps_the_reservation_alive_and_a_gap_longer_than_it_drops_the_parts():
    ttl = 0.5
    recv = KVBuffer("recv", 10**6, 60.0, reservation_ttl_s=ttl)
    asm = PartAssembler(recv)
    _, whole, parts = _parts()
    t0 = time.monotonic()
    recv.reserve(KEY, tensor_bytes(whole))
    assert asm.add(KEY, *parts[0]) == (None, None)
    time.sleep(0.7 * ttl)
    assert asm.add(KEY, *parts[1]) == (None, None)  # moves the expiry on
    time.sleep(0.7 * ttl)
    if time.monotonic() - t0 < 1.6 * ttl:  # (a stalled box may have slept past the new expiry)
        assert recv.expire() == [] and asm.sweep() == []  # past the first expiry, still held
    time.sleep(1.1 * ttl)
    assert recv.expire() == [KEY]  # a gap between layers longer than the TTL
    assert asm.sweep() == [KEY] and len(asm) == 0
    payload, why = asm.add(KEY, *parts[2])
    assert payload is None and "reservation" in why


def test_an_abort_drops_the_parts():
    recv = KVBuffer("recv", 10**6, 60.0)
    asm = PartAssembler(recv)
    _, whole, parts = _parts()
    recv.reserve(KEY, tensor_bytes(whole))
    asm.add(KEY, *parts[0])
    assert asm.drop(KEY) and not asm.drop(KEY)
    assert len(asm) == 0

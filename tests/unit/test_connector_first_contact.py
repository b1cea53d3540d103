"""First contact between a prefill and a decode engine (issue 21): made ahead of the
send when the scheduler announces the peer, and given the send's budget, not a cap of
its own that a loaded box's ordinary stall outlasts."""

from __future__ import annotations

import re
import time

from connector.p2p.metadata import P2pConnectorMetadata
from tests.support.connector_log import connector_log
from tests.support.kv_engines import (
    SRC_IDS,
    assert_loaded,
    load_spec,
    plan_load,
    poll_until,
    rank0,
    save_spec,
    snapshot,
    wait_for,
)
from tests.support.kv_fronts import SlowHello


def test_scheduler_announces_peers_of_new_requests_once_per_step():
    from connector.p2p.scheduler import P2pScheduler
    from tests.support.kv_engines import make_cfg

    class Req:  # the fields on_new_request reads
        def __init__(self, rid: str) -> None:
            self.request_id, self.num_prompt_tokens, self.kv_transfer_params = rid, 100, None

    sched = P2pScheduler(make_cfg("kv_producer", "PUT_ASYNC", 1), 16, start_registrar=False)
    d1, d2 = "127.0.0.1:7001", "127.0.0.1:7002"
    for i, d in enumerate((d1, d2, d1)):
        sched.on_new_request(Req(f"cmpl-___prefill_addr_127.0.0.1:1___decode_addr_{d}_{i:032x}-0-abcdef12"))

    class Out:
        num_scheduled_tokens: dict = {}
        total_num_scheduled_tokens = 0
        preempted_req_ids = None
        scheduled_new_reqs: list = []

        class scheduled_cached_reqs:  # noqa: N801
            req_ids: list = []
            num_computed_tokens: list = []

    assert sched.build_connector_meta(Out()).contacts == [d1, d2]
    assert sched.build_connector_meta(Out()).contacts == []


def test_first_contact_is_made_ahead_of_the_send(engines):
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    slow = SlowHello(rank0(cons), delay_s=3.0)  # a send that said hello again would take 3 s more
    try:
        peer = prod.producer.peer(slow.address)
        prod.producer.prepare(slow.address)
        wait_for(lambda: peer.contacted)  # no send yet: the hello was made on its own
        assert slow.hellos == 1
        before = snapshot(cons.caches)
        t0 = time.monotonic()
        prod.save(save_spec(prod, slow.address))
        plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
        res, t_done = poll_until(cons, lambda r: "D-req" in r.finished_recving)
        assert res.failed_recving == set()
        assert_loaded(cons, before, prod, (7, 2, 11), SRC_IDS[2:])
        assert slow.hellos == 1  # the send did not say hello again
        assert t_done - t0 < slow.delay_s  # and did not wait for one
        prod.producer.prepare(slow.address)  # contact made: nothing more to do
        time.sleep(0.2)
        assert slow.hellos == 1
    finally:
        slow.close()


def test_first_contact_slower_than_two_seconds_still_delivers(engines):
    """The hello used to be capped at 2 s whatever send_timeout_s was: a peer slow to
    answer its first call (2.5 s here; seen on loaded boxes) failed the transfer and was
    marked dead. It now has the send's own budget."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, send_timeout_s=6.0)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, send_timeout_s=6.0)
    slow = SlowHello(rank0(cons), delay_s=2.5)
    try:
        before = snapshot(cons.caches)
        prod.save(save_spec(prod, slow.address))
        plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
        res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving or bool(r.failed_recving), timeout=10)
        assert res.failed_recving == set()
        assert_loaded(cons, before, prod, (7, 2, 11), SRC_IDS[2:])
        assert prod.producer.peer(slow.address).dead_since is None
    finally:
        slow.close()


def test_worker_prepares_contacts_from_the_metadata(engines):
    """The worker half turns the metadata's contacts into first contacts (before the
    forward pass: the connector calls it from bind_connector_metadata)."""
    from connector.p2p.worker import P2pWorker

    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    worker = P2pWorker(prod.cfg, None, 0)
    worker.engine = prod
    worker.prepare(P2pConnectorMetadata(contacts=[rank0(cons)]))
    wait_for(lambda: prod.producer.peer(rank0(cons)).contacted)


def test_a_sends_log_line_counts_from_the_forward_end_including_its_wait_in_the_queue(engines):
    """The 'kv sent ... ms=' figure is the KV arrival lag (forward end -> D acknowledged the
    last byte): a send queued behind another one's slow first contact says so."""
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1)
    slow = SlowHello(rank0(cons), delay_s=2.0)  # the phases' bounds below leave a loaded box 0.5 s
    try:
        with connector_log() as lines:
            prod.save(save_spec(prod, slow.address, req_id="first", key="k-first", block_ids=SRC_IDS[:2]))
            prod.save(save_spec(prod, slow.address, req_id="second", key="k-second", block_ids=SRC_IDS[2:]))
            wait_for(lambda: sum("kv sent" in ln for ln in lines.lines) == 2)
    finally:
        slow.close()
    sent = {re.search(r"req=(\S+)", ln).group(1): ln for ln in lines.lines if "kv sent" in ln}
    phases = {rid: dict((k, float(v)) for k, v in re.findall(r"(\w+):([0-9.]+)", ln.split("phases_ms=")[1]))
              for rid, ln in sent.items()}
    total = {rid: float(re.search(r" ms=([0-9.]+)", ln).group(1)) for rid, ln in sent.items()}
    assert phases["first"]["contact"] >= 1900 and phases["first"]["queue"] < 500, sent["first"]
    # The second waited in the queue while the first made contact; its total includes that.
    assert phases["second"]["queue"] >= 1400 and phases["second"]["contact"] < 500, sent["second"]
    # (each figure is rounded to 0.1 ms in the line, and the total and the phases come from
    # separate clock reads: a loaded box put them 0.6 ms apart once; 1 ms of slack)
    assert total["second"] >= phases["second"]["queue"] + phases["second"]["put"] - 1.0, sent["second"]

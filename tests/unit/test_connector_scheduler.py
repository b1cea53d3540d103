"""P2pScheduler, the scheduler-side half of the connector, driven the way vLLM 0.32's
scheduler drives it.

The vLLM side uses vLLM's own Request, KVCacheBlocks and SchedulerOutput dataclasses;
only the KV cache manager is a double (``get_block_ids(req_id)`` and ``usage``).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request

from connector.p2p.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
from connector.p2p.scheduler import REPORT_KEY_PARAM, SIBLING_GRACE_S, P2pScheduler
from connector.stats import XpydStats
from tests.support.connector_log import connector_log
from tests.support.scheduler import BS, D_ADDR, KEY, P_ADDR, FakeKVCacheManager, kv_blocks, make_cfg, pd_id, sched_out
from xpyd_wire.discovery import Load

KEY2 = "fedcba9876543210fedcba9876543210"
TK = f"{KEY}-0"  # the transfer key of prompt 0 of KEY's request
OTHER = "127.0.0.1:23001"


def make_req(rid: str, n_prompt: int, kv_transfer_params: dict | None = None) -> Request:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=16, extra_args=extra), None)


def consumer(**kw) -> P2pScheduler:
    return P2pScheduler(make_cfg("kv_consumer", **kw), BS, start_registrar=False)


def producer(send_type: str = "PUT_ASYNC", kvm: FakeKVCacheManager | None = None, **kw) -> P2pScheduler:
    s = P2pScheduler(make_cfg("kv_producer", send_type=send_type, **kw), BS, start_registrar=False)
    s.bind(kvm or FakeKVCacheManager())
    return s


def admit(s: P2pScheduler, req: Request, num_computed: int, block_ids) -> tuple[int, bool]:
    """What vLLM does for a waiting request: ask, allocate, report the allocation."""
    n, is_async = s.get_num_new_matched_tokens(req, num_computed)
    s.update_state_after_alloc(req, kv_blocks(block_ids), n)
    return n, is_async


# ======================================================================== consumer


def test_consumer_plain_request_is_not_loaded():
    s = consumer()
    req = make_req("cmpl-3f1c2a9d-0-1a2b3c4d", 300)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, kv_blocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(sched_out(new=[(req.request_id, 0, 300)]))
    assert meta.loads == [] and meta.saves == []
    assert not meta.idle  # a step that computes: the worker must not wait in it
    assert s.request_finished(req, [1, 2, 3]) == (False, None)


def test_a_step_that_computes_nothing_is_marked_idle():
    """The worker may wait for transfers only in a step with no token scheduled."""
    assert consumer().build_connector_meta(sched_out()).idle
    assert producer().build_connector_meta(sched_out(finished=["x"])).idle
    assert not producer().build_connector_meta(sched_out(cached=[("r", 10, 1)])).idle


@pytest.mark.parametrize("chat", [False, True])
def test_consumer_pd_request_is_loaded_async(chat):
    s = consumer()
    req = make_req(pd_id(chat=chat), 300)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (299, True)
    # Side-effect free: asking again (e.g. the allocation failed) answers the same
    # and plans nothing.
    assert s.get_num_new_matched_tokens(req, 0) == (299, True)
    assert s.build_connector_meta(sched_out()).loads == []
    s.update_state_after_alloc(req, kv_blocks([7, 3, 9]), 299)
    meta = s.build_connector_meta(sched_out())
    assert meta.loads == [LoadSpec(req_id=req.request_id, transfer_key=TK, prefill_addr=P_ADDR,
                                   dst_block_ids=(7, 3, 9), first_block=0, num_tokens=299,
                                   prompt_tokens=300, prompt_blocks=3)]


def test_consumer_loads_a_transfer_carried_in_kv_transfer_params():
    """The Responses API names its engine request after the body's request_id (the response
    id the client sees): the proxy carries the transfer id in kv_transfer_params instead."""
    s = consumer()
    carried = pd_id().removeprefix("cmpl-").removesuffix("-0-1a2b3c4d")
    req = make_req("resp_0123456789abcdef", 300, {"xpyd_transfer_id": carried})
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (299, True)
    s.update_state_after_alloc(req, kv_blocks([7, 3, 9]), 299)
    (spec,) = s.build_connector_meta(sched_out()).loads
    assert (spec.transfer_key, spec.prefill_addr, spec.dst_block_ids) == (TK, P_ADDR, (7, 3, 9))
    assert s.request_finished(req, [7, 3, 9])[1] == {"xpyd": {"loaded_tokens": 299, "load_failed": False}}


@pytest.mark.parametrize("params", [None, {"xpyd_transfer_id": "resp_0123"}, {"xpyd_transfer_id": 7},
                                    {"xpyd_transfer_id": pd_id() + "x" * 600}])
def test_consumer_ignores_what_is_not_a_carried_transfer(params):
    s = consumer()
    req = make_req("resp_0123456789abcdef", 300, params)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)


def test_producer_ships_a_transfer_carried_in_kv_transfer_params():
    kvm = FakeKVCacheManager()
    s = producer(kvm=kvm)
    carried = pd_id(chat=True).removeprefix("chatcmpl-").removesuffix("-1a2b3c4d")
    req = make_req("resp_0123456789abcdef", 200, {"xpyd_transfer_id": carried})
    kvm.blocks[req.request_id] = [4, 5]
    s.on_new_request(req)
    (spec,) = s.build_connector_meta(sched_out(new=[(req.request_id, 0, 200)])).saves
    assert (spec.transfer_key, spec.decode_addr, spec.block_ids) == (TK, D_ADDR, (4, 5))


@pytest.mark.parametrize("value, want_prompt", [(256, 256), (255, 257), ("256", 257), (None, 257)])
def test_consumer_continuing_from_p_token_loads_all_of_p_prompt(value, want_prompt):
    """The proxy's first-token mode: D's prompt is P's 256 tokens plus P's token, so D loads
    all 256 (two whole blocks) and checks the payload against P's prompt length. Any other
    value is ignored: the payload check refuses a mismatch then, as without it."""
    s = consumer()
    req = make_req(pd_id(), 257, {"xpyd_prefill_prompt_tokens": value} if value is not None else None)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (256, True)
    s.update_state_after_alloc(req, kv_blocks([7, 3, 9]), 256)
    (spec,) = s.build_connector_meta(sched_out()).loads
    assert (spec.dst_block_ids, spec.num_tokens, spec.prompt_tokens) == ((7, 3), 256, want_prompt)
    assert spec.prompt_blocks == -(-want_prompt // BS)


@dataclass
class ArrivalDouble:
    """Stands in for D's worker control sockets (the ``ready`` op): which keys are here."""

    here: set[str] = field(default_factory=set)
    asked: list[str] = field(default_factory=list)
    started: set[str] | None = None  # keys a sender began (None: every key, as without boards)

    def arrived(self, key: str) -> bool:
        self.asked.append(key)
        return key in self.here

    def begun(self, key: str) -> bool:
        return self.started is None or key in self.started or key in self.here

    def close(self) -> None:
        pass


def test_consumer_kv_already_here_is_a_synchronous_load():
    probe = ArrivalDouble({TK})
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False, probe=probe)
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    assert admit(s, req, 128, [11, 4, 6]) == (171, False)  # block 11: a local hit
    (spec,) = s.build_connector_meta(sched_out()).loads
    assert spec.sync and (spec.first_block, spec.dst_block_ids, spec.num_tokens) == (1, (4, 6), 171)
    assert probe.asked == [TK]
    # Not here: asynchronous, as without a probe; a plain request is never asked about.
    late = make_req(pd_id(key=KEY2), 300)
    plain = make_req("cmpl-plain-0-1a2b3c4d", 300)
    for r in (late, plain):
        s.on_new_request(r)
    assert admit(s, late, 0, [1, 2, 3]) == (299, True)
    assert admit(s, plain, 0, [5, 6, 7]) == (0, False)
    (spec,) = s.build_connector_meta(sched_out()).loads
    assert not spec.sync
    assert probe.asked == [TK, f"{KEY2}-0"]


def test_consumer_synchronous_answer_is_per_call():
    """vLLM asks again when the allocation failed: the KV may have come meanwhile (or the
    request was aborted first, which must leave nothing behind)."""
    probe = ArrivalDouble()
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False, probe=probe)
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (299, True)  # no room: not allocated
    probe.here.add(TK)
    assert admit(s, req, 0, [1, 2, 3]) == (299, False)
    assert s.build_connector_meta(sched_out()).loads[0].sync
    aborted = make_req(pd_id(key=KEY2), 300)
    probe.here.add(f"{KEY2}-0")
    s.on_new_request(aborted)
    assert s.get_num_new_matched_tokens(aborted, 0) == (299, False)
    s.request_finished(aborted, [])
    assert s._sync == set()


def test_consumer_waits_without_blocks_until_the_prefill_begins(monkeypatch):
    """Concurrent dispatch asks D before P has begun: the request waits in vLLM's queue holding
    no blocks (None) and no load planned, until the sender begins; the load's deadline then
    runs from there. Past kv_prefill_wait_s without a sender, D computes the prompt itself."""
    import dataclasses

    from connector.p2p import scheduler as sched

    clock = [1000.0]
    monkeypatch.setattr(sched.time, "monotonic", lambda: clock[0])
    probe = ArrivalDouble(started=set())
    cfg = dataclasses.replace(make_cfg("kv_consumer"), kv_prefill_wait_s=60.0)
    s = P2pScheduler(cfg, BS, start_registrar=False, probe=probe)
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    for _ in range(3):
        assert s.get_num_new_matched_tokens(req, 0) == (None, False)
        clock[0] += 10.0
    waiting = s.build_connector_meta(sched_out())
    # An idle step waits for a sender to begin (the worker's bounded wait), not back to back.
    assert waiting.loads == [] and waiting.idle and waiting.awaiting_senders
    # The heartbeat tells the proxies it waits for P's KV, not for D's compute (autoscaling).
    assert s.load_report() == Load(0, 1, 0.0, 0.0, waiting_for_kv=1)
    probe.started.add(TK)  # P reserved room in D's buffer: its KV is on its way
    assert admit(s, req, 0, [1, 2, 3]) == (299, True)
    planned = s.build_connector_meta(sched_out())
    assert planned.loads[0].num_tokens == 299 and not planned.awaiting_senders
    assert s.load_report().waiting_for_kv == 0
    # Never begun: asked before P answered (the proxy's early mark), D waits kv_prefill_wait_s,
    # then computes it (the key let go, the load reported failed).
    late = make_req(pd_id(key=KEY2).replace("___prefill_addr_", "xpyd-early___prefill_addr_"), 300)
    s.on_new_request(late)
    assert s.get_num_new_matched_tokens(late, 0) == (None, False)
    clock[0] += 59.0
    assert s.get_num_new_matched_tokens(late, 0) == (None, False)
    clock[0] += 1.0
    assert admit(s, late, 0, [4, 5, 6]) == (0, False)
    assert f"{KEY2}-0" in s.build_connector_meta(sched_out()).release
    assert s.request_finished(late, [4, 5, 6])[1] == {"xpyd": {"loaded_tokens": 0, "load_failed": True}}
    # Asked after P answered (no mark): P's send has begun or will not come (a wrong secret):
    # kv_load_timeout_s (30 s here), not kv_prefill_wait_s.
    after = make_req(pd_id(key="cd" * 16), 300)
    s.on_new_request(after)
    assert s.get_num_new_matched_tokens(after, 0) == (None, False)
    clock[0] += 30.0
    assert s.get_num_new_matched_tokens(after, 0) == (0, False)
    # Aborted while waiting: nothing is left behind.
    gone = make_req(pd_id(key="ab" * 16), 300)
    s.on_new_request(gone)
    assert s.get_num_new_matched_tokens(gone, 0) == (None, False)
    s.request_finished(gone, [])
    assert s._unstarted == {}
    assert not s.build_connector_meta(sched_out()).awaiting_senders


def test_consumer_waiting_request_is_answered_without_parsing_its_id_again(monkeypatch):
    """vLLM asks every engine step for every request waiting for its prefill (bench_waiting:
    64 of them cost D's running stream 3.6x its ITL): the transfer id is parsed at the first
    ask only, and the answer still follows the board (the sender begins: the load is planned)."""
    from connector.p2p import scheduler as sched

    parsed = []
    real = sched._transfer
    monkeypatch.setattr(sched, "_transfer", lambda r: parsed.append(r.request_id) or real(r))
    probe = ArrivalDouble(started=set())
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False, probe=probe)
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    parsed.clear()
    for _ in range(5):
        assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    assert parsed == [req.request_id]
    probe.started.add(TK)
    assert admit(s, req, 0, [1, 2, 3]) == (299, True)
    assert s.build_connector_meta(sched_out()).loads[0].num_tokens == 299


def test_consumer_waiting_request_covered_by_a_local_hit_stops_waiting():
    """A request waiting for its prefill whose prompt this instance's prefix cache came to hold
    (another request computed it meanwhile) is computed from the hit: it no longer waits for a
    sender (an idle step would otherwise still wait for a begin that does not matter)."""
    probe = ArrivalDouble(started=set())
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False, probe=probe)
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    assert s.build_connector_meta(sched_out()).awaiting_senders
    assert admit(s, req, 299, [1, 2, 3]) == (0, False)
    assert not s.build_connector_meta(sched_out()).awaiting_senders
    assert s.request_finished(req, [1, 2, 3]) == (False, None)


def test_consumer_kv_that_arrived_needs_no_begun_mark():
    probe = ArrivalDouble({TK}, started=set())
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False, probe=probe)
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    assert admit(s, req, 0, [1, 2, 3]) == (299, False)


@pytest.mark.parametrize("extra", [{"send_type": "GET"}, {"sync_load": False}])
def test_consumer_without_synchronous_loads_never_asks(extra):
    import dataclasses

    probe = ArrivalDouble({TK})
    cfg = dataclasses.replace(make_cfg("kv_consumer", send_type=extra.get("send_type", "PUT_ASYNC")),
                              sync_load=extra.get("sync_load", True))
    s = P2pScheduler(cfg, BS, start_registrar=False, probe=probe)
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    assert admit(s, req, 0, [1, 2, 3]) == (299, True)
    assert probe.asked == []


def test_consumer_prefix_hit_loads_only_the_rest_once():
    s = consumer()
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    n, is_async = admit(s, req, 128, [11, 4, 6])  # block 11 is the local hit
    assert (n, is_async) == (171, True)
    meta = s.build_connector_meta(sched_out())
    assert len(meta.loads) == 1
    spec = meta.loads[0]
    assert spec.first_block == 1
    assert spec.dst_block_ids == (4, 6)
    assert spec.num_tokens == 171
    assert (spec.req_id, spec.transfer_key, spec.prefill_addr) == (req.request_id, TK, P_ADDR)
    assert not spec.corrupt_for_test
    # Announced only once.
    assert s.build_connector_meta(sched_out()).loads == []
    assert s.build_connector_meta(sched_out(cached=[(req.request_id, 299, 1)])).loads == []


@pytest.mark.parametrize(
    "n_prompt, computed, blocks, want",
    [
        # (prompt, local hit, allocated blocks) -> (n, first_block, dst)
        (257, 0, [5, 6, 7], (256, 0, (5, 6))),  # last token alone in block 2: computed on D
        (256, 0, [5, 6], (255, 0, (5, 6))),
        (256, 128, [5, 6], (127, 1, (6,))),
        (129, 128, [5, 6], (0, None, None)),  # only the last token is left: nothing to load
        (1, 0, [5], (0, None, None)),
    ],
)
def test_consumer_block_arithmetic(n_prompt, computed, blocks, want):
    s = consumer()
    req = make_req(pd_id(), n_prompt)
    s.on_new_request(req)
    n, is_async = admit(s, req, computed, blocks)
    meta = s.build_connector_meta(sched_out())
    assert n == want[0] and is_async == (want[0] > 0)
    if want[1] is None:
        assert meta.loads == []
    else:
        (spec,) = meta.loads
        assert (spec.num_tokens, spec.first_block, spec.dst_block_ids) == want


def test_consumer_never_loads_a_request_twice():
    """Preempted after the load, or the load failed and vLLM recomputes: vLLM resets
    num_computed_tokens to 0 and asks again; the answer must be "compute it"."""
    s = consumer()
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    admit(s, req, 0, [1, 2, 3])
    assert len(s.build_connector_meta(sched_out()).loads) == 1
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.get_num_new_matched_tokens(req, 128) == (0, False)
    s.update_state_after_alloc(req, kv_blocks([4, 5, 6]), 0)
    assert s.build_connector_meta(sched_out(new=[(req.request_id, 0, 300)])).loads == []


def test_consumer_request_finished_reports_loaded_tokens():
    s = consumer()
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    admit(s, req, 128, [11, 4, 6])
    s.build_connector_meta(sched_out())
    assert s.request_finished(req, [11, 4, 6]) == (
        False, {"xpyd": {"loaded_tokens": 171, "load_failed": False}})
    # Its state is gone.
    assert s.request_finished(req, [11, 4, 6]) == (False, None)


@pytest.mark.parametrize("ask, reported", [(None, False), (False, False), ("false", False), (0, False),
                                           (True, True), ("true", True), (1, True)])
def test_transfer_key_reported_only_when_asked(ask, reported):
    """The key names the KV in flight: it reaches the client's response only on request."""
    params = {} if ask is None else {REPORT_KEY_PARAM: ask}
    want = {"transfer_key": TK} if reported else {}
    s = consumer()
    req = make_req(pd_id(), 300, params)
    s.on_new_request(req)
    admit(s, req, 128, [11, 4, 6])
    s.build_connector_meta(sched_out())
    assert s.request_finished(req, [11, 4, 6]) == (
        False, {"xpyd": {**want, "loaded_tokens": 171, "load_failed": False}})
    kvm = FakeKVCacheManager()
    s = producer(kvm=kvm)
    req = make_req(pd_id(), 200, params)
    kvm.blocks[req.request_id] = [3, 1]
    s.on_new_request(req)
    assert len(s.build_connector_meta(sched_out(new=[(req.request_id, 0, 200)])).saves) == 1
    assert s.request_finished(req, [3, 1]) == (
        True, {"xpyd": {**want, "send_type": "PUT_ASYNC", "prompt_tokens": 200, "shipped_blocks": 2,
                        "skipped_blocks": 0}})


def test_consumer_abort_before_allocation():
    s = consumer()
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (299, True)
    assert s.request_finished(req, []) == (False, None)
    assert s.build_connector_meta(sched_out()).loads == []


def test_producer_role_does_not_consume():
    s = producer()
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)


def test_kv_both_consumes_only_when_decode_address_is_its_own():
    s = P2pScheduler(make_cfg("kv_both", addr=D_ADDR), BS, start_registrar=False)
    s.bind(FakeKVCacheManager(blocks={}))
    mine = make_req(pd_id(KEY, p=OTHER, d=D_ADDR), 300)
    theirs = make_req(pd_id(KEY2, p=OTHER, d=OTHER), 300)
    for r in (mine, theirs):
        s.on_new_request(r)
    assert s.get_num_new_matched_tokens(mine, 0) == (299, True)
    assert s.get_num_new_matched_tokens(theirs, 0) == (0, False)


def test_kv_both_produces_only_when_prefill_address_is_its_own():
    kvm = FakeKVCacheManager(blocks={})
    s = P2pScheduler(make_cfg("kv_both", addr=P_ADDR), BS, start_registrar=False)
    s.bind(kvm)
    mine = make_req(pd_id(KEY, p=P_ADDR, d=OTHER), 200)
    theirs = make_req(pd_id(KEY2, p=OTHER, d=OTHER), 200)
    kvm.blocks = {mine.request_id: [1, 2], theirs.request_id: [3, 4]}
    for r in (mine, theirs):
        s.on_new_request(r)
    meta = s.build_connector_meta(sched_out(new=[(mine.request_id, 0, 200), (theirs.request_id, 0, 200)]))
    assert [sv.req_id for sv in meta.saves] == [mine.request_id]
    assert meta.saves[0].decode_addr == OTHER


@pytest.mark.parametrize(
    "allow, params, corrupt",
    [
        (False, {"xpyd_debug_corrupt_kv": True}, False),  # clients cannot corrupt production
        (True, {"xpyd_debug_corrupt_kv": True}, True),
        (True, {"xpyd_debug_corrupt_kv": False}, False),
        (True, None, False),
        (True, {}, False),
    ],
)
def test_debug_corruption_needs_the_config_switch(allow, params, corrupt):
    s = consumer(allow_debug_corruption=allow)
    req = make_req(pd_id(), 300, kv_transfer_params=params)
    s.on_new_request(req)
    admit(s, req, 0, [1, 2, 3])
    (spec,) = s.build_connector_meta(sched_out()).loads
    assert spec.corrupt_for_test is corrupt


def test_metadata_is_picklable():
    """The metadata crosses process boundaries (EngineCore -> workers)."""
    s = consumer()
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    admit(s, req, 128, [11, 4, 6])
    meta = s.build_connector_meta(sched_out(preempted={"x"}))
    meta.saves.append(SaveSpec("r", KEY, D_ADDR, P_ADDR, (1, 2), 200, True))
    back = pickle.loads(pickle.dumps(meta))
    assert isinstance(back, P2pConnectorMetadata)
    assert (back.saves, back.loads, back.preempted) == (meta.saves, meta.loads, meta.preempted)


# ======================================================================== producer


def test_producer_saves_only_in_the_step_that_completes_the_prompt():
    kvm = FakeKVCacheManager()
    s = producer(kvm=kvm)
    req = make_req(pd_id(), 300)
    rid = req.request_id
    # Lookahead/spare blocks beyond the prompt must not be sent.
    kvm.blocks[rid] = [5, 2, 8, 13]
    s.on_new_request(req)
    # Chunked prefill with a 128-token budget: 128 + 128 + 44.
    assert s.build_connector_meta(sched_out(new=[(rid, 0, 128)])).saves == []
    assert s.build_connector_meta(sched_out(cached=[(rid, 128, 128)])).saves == []
    assert kvm.calls == []
    meta = s.build_connector_meta(sched_out(cached=[(rid, 256, 44)]))
    assert meta.saves == [SaveSpec(req_id=rid, transfer_key=TK, decode_addr=D_ADDR, prefill_addr=P_ADDR,
                                   block_ids=(5, 2, 8), num_tokens=300, delay_free=True)]
    # Decode steps: no more saves.
    assert s.build_connector_meta(sched_out(cached=[(rid, 300, 1)])).saves == []
    assert s.build_connector_meta(sched_out(cached=[(rid, 301, 1)])).saves == []


def test_producer_prefix_hit_saves_all_prompt_blocks_at_once():
    kvm = FakeKVCacheManager()
    s = producer(kvm=kvm)
    req = make_req(pd_id(), 300)
    kvm.blocks[req.request_id] = [40, 41, 9]  # 40, 41: local prefix hit
    s.on_new_request(req)
    (spec,) = s.build_connector_meta(sched_out(new=[(req.request_id, 256, 44)])).saves
    assert spec.block_ids == (40, 41, 9) and spec.num_tokens == 300


@pytest.mark.parametrize("skip_tokens, n_prompt, want_first", [
    (256, 300, 2),  # D holds two whole blocks: the third alone is shipped
    (200, 300, 1),  # only whole blocks are skipped
    (384, 385, 2),  # never the block D computes from: token n-2 (383) is in block 2
    (384, 386, 3),  # ... which here is block 3
    (-5, 300, 0), ("256", 300, 0), (True, 300, 0),  # garbage: ship everything
])
def test_producer_skips_the_blocks_the_proxy_says_d_holds(skip_tokens, n_prompt, want_first):
    kvm = FakeKVCacheManager()
    s = producer(kvm=kvm)
    req = make_req(pd_id(), n_prompt, {"xpyd_skip_tokens": skip_tokens})
    kvm.blocks[req.request_id] = [40, 41, 9, 17]
    s.on_new_request(req)
    (spec,) = s.build_connector_meta(sched_out(new=[(req.request_id, 0, n_prompt)])).saves
    n_blocks = -(-n_prompt // BS)
    assert spec.first_block == want_first and spec.block_ids == (40, 41, 9, 17)[want_first:n_blocks]
    _, params = s.request_finished(req, [])
    assert params["xpyd"]["skipped_blocks"] == want_first
    assert params["xpyd"]["shipped_blocks"] == n_blocks - want_first


def test_producer_ignores_plain_requests_and_other_steps():
    kvm = FakeKVCacheManager()
    s = producer(kvm=kvm)
    plain = make_req("cmpl-3f1c2a9d-0-1a2b3c4d", 300)
    pd = make_req(pd_id(), 100)
    kvm.blocks = {plain.request_id: [1, 2, 3], pd.request_id: [4]}
    s.on_new_request(plain)
    s.on_new_request(pd)
    # pd is not scheduled this step: nothing for it.
    meta = s.build_connector_meta(sched_out(new=[(plain.request_id, 0, 300)]))
    assert meta.saves == []
    meta = s.build_connector_meta(sched_out(cached=[(plain.request_id, 300, 1)], new=[(pd.request_id, 0, 100)]))
    assert [x.req_id for x in meta.saves] == [pd.request_id]
    assert s.request_finished(plain, [1, 2, 3]) == (False, None)


def test_consumer_role_never_saves():
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False)
    s.bind(FakeKVCacheManager())
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    assert s.build_connector_meta(sched_out(new=[(req.request_id, 0, 300)])).saves == []


def test_producer_resumed_after_preemption_mid_prefill_saves_once():
    kvm = FakeKVCacheManager()
    s = producer(kvm=kvm)
    req = make_req(pd_id(), 300)
    rid = req.request_id
    kvm.blocks[rid] = [1, 2, 3]
    s.on_new_request(req)
    assert s.build_connector_meta(sched_out(new=[(rid, 0, 128)])).saves == []
    # Preempted before the prompt completed: no save in flight to wait for.
    meta = s.build_connector_meta(sched_out(preempted={rid}))
    assert meta.saves == [] and meta.preempted == []
    # Resumed with new blocks, recomputed from scratch in one step.
    kvm.blocks[rid] = [7, 8, 9]
    meta = s.build_connector_meta(sched_out(cached=[(rid, 0, 300)], resumed={rid}))
    assert [x.block_ids for x in meta.saves] == [(7, 8, 9)]
    assert s.build_connector_meta(sched_out(cached=[(rid, 300, 1)])).saves == []


def test_producer_preempted_with_save_in_flight():
    kvm = FakeKVCacheManager()
    s = producer(kvm=kvm)
    req = make_req(pd_id(), 300)
    other = make_req(pd_id(KEY2), 300)
    rid = req.request_id
    kvm.blocks = {rid: [1, 2, 3], other.request_id: [4, 5, 6]}
    s.on_new_request(req)
    s.on_new_request(other)
    assert len(s.build_connector_meta(sched_out(new=[(rid, 0, 300)])).saves) == 1
    # Preempted while decoding: the worker must finish the send before its blocks
    # are reused. `other` (no save yet) and unknown ids are not listed.
    meta = s.build_connector_meta(sched_out(preempted={rid, other.request_id, "cmpl-x-0-1"}))
    assert meta.preempted == [rid]
    # Resumed and recomputed (prompt + outputs): the worker cancelled the send if it
    # had not started, so it is planned again (D refuses a duplicate if the first came).
    kvm.blocks[rid] = [7, 8, 9]
    meta = s.build_connector_meta(sched_out(cached=[(rid, 0, 302)], resumed={rid}))
    assert [(x.req_id, x.block_ids, x.transfer_key) for x in meta.saves] == [(rid, (7, 8, 9), TK)]
    assert s.build_connector_meta(sched_out(cached=[(rid, 302, 1)])).saves == []  # once
    assert s.build_connector_meta(sched_out(preempted=set())).preempted == []
    # Reported when it finishes; the blocks wait for the send.
    assert s.request_finished(req, [1, 2, 3]) == (
        True, {"xpyd": {"send_type": "PUT_ASYNC", "prompt_tokens": 300, "shipped_blocks": 3, "skipped_blocks": 0}})
    # Once finished it is no longer listed on preemption.
    assert s.build_connector_meta(sched_out(preempted={rid})).preempted == []


def test_producer_request_finished_before_prompt_completed():
    kvm = FakeKVCacheManager()
    s = producer(kvm=kvm)
    req = make_req(pd_id(), 300)
    rid = req.request_id
    kvm.blocks[rid] = [1, 2, 3]
    s.on_new_request(req)
    assert s.build_connector_meta(sched_out(new=[(rid, 0, 128)])).saves == []
    assert s.request_finished(req, [1]) == (False, None)
    # Even if the id showed up completing the prompt afterwards: no save, ever.
    assert s.build_connector_meta(sched_out(cached=[(rid, 128, 172)])).saves == []
    assert kvm.calls == []


@pytest.mark.parametrize("send_type, delay_free", [("PUT_ASYNC", True), ("PUT", False), ("GET", False)])
def test_producer_delay_free_by_send_type(send_type, delay_free):
    kvm = FakeKVCacheManager()
    s = producer(send_type, kvm=kvm)
    req = make_req(pd_id(), 200)
    kvm.blocks[req.request_id] = [3, 1]
    s.on_new_request(req)
    (spec,) = s.build_connector_meta(sched_out(new=[(req.request_id, 0, 200)])).saves
    assert spec.delay_free is delay_free
    assert s.request_finished(req, [3, 1]) == (
        delay_free, {"xpyd": {"send_type": send_type, "prompt_tokens": 200, "shipped_blocks": 2, "skipped_blocks": 0}})


def test_load_report():
    kvm = FakeKVCacheManager(usage=0.25)
    s = P2pScheduler(make_cfg("kv_producer"), BS, start_registrar=False)
    assert s.load_report() == Load(0, 0, 0.0, 0.0)  # not bound yet
    s.bind(kvm)
    reqs = [make_req(f"cmpl-plain{i}-0-1a2b3c4d", 10) for i in range(3)]
    for r in reqs:
        s.on_new_request(r)
    assert s.load_report() == Load(0, 3, 0.25)
    s.build_connector_meta(sched_out(new=[(reqs[0].request_id, 0, 10), (reqs[1].request_id, 0, 10)]))
    assert s.load_report() == Load(2, 1, 0.25)
    s.request_finished(reqs[2], [])
    assert s.load_report() == Load(2, 0, 0.25)
    s.request_finished(reqs[0], [])
    s.build_connector_meta(sched_out(cached=[(reqs[1].request_id, 10, 1)]))
    assert s.load_report() == Load(1, 0, 0.25)
    kvm.usage = 1.7
    assert s.load_report().kv_usage == 1.0
    kvm.usage = -0.5
    assert s.load_report().kv_usage == 0.0

    class Broken:
        @property
        def usage(self):
            raise RuntimeError("no block pool")

    s.bind(Broken())
    assert s.load_report() == Load(1, 0, 0.0)


def test_load_report_carries_the_workers_buffer_occupancy():
    """Two worker ranks' stats, aggregated as vLLM does, reach the heartbeat."""
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False)
    stats = XpydStats.of(0, 300, 1000).aggregate(XpydStats.of(1, 100, 1000))
    s.update_connector_output(set(), stats)
    assert s.load_report().kv_buffer_usage == pytest.approx(0.2)
    s.update_connector_output(set(), None)  # a step without stats keeps the last figure
    assert s.load_report().kv_buffer_usage == pytest.approx(0.2)
    # A later step's figure for a rank replaces the earlier one (a gauge, not a sum).
    later = stats.aggregate(XpydStats.of(0, 0, 1000))
    assert later.reduce() == {"kv_buffer_used_bytes": 100, "kv_buffer_usage": 0.05}
    assert pickle.loads(pickle.dumps(later)).buffer_usage() == pytest.approx(0.05)


def test_transport_fallbacks_are_summed_for_the_heartbeat():
    """Workers report fallbacks per step (a counter's increments): the scheduler keeps the
    total, and the registration it sends carries it."""
    from connector.registration import Registrar

    s = P2pScheduler(make_cfg("kv_producer"), BS, start_registrar=False)
    a, b = XpydStats.of(0, 0, 0), XpydStats.of(1, 0, 0)
    a.record_fallback("setup")
    b.record_fallback("transfers")
    b.record_fallback("transfers")
    s.update_connector_output(set(), a.aggregate(b))
    s.update_connector_output(set(), None)
    assert s.fallbacks_total() == 3
    reg = Registrar.__new__(Registrar)  # its registration only: no thread, no sockets
    reg._cfg, reg._load_report, reg._fallbacks_report = make_cfg("kv_producer"), s.load_report, s.fallbacks_total
    reg._key = "0" * 32  # the instance key __init__ draws
    assert reg._registration().kv_transport_fallbacks == 3


def test_no_registrar_without_proxies_or_when_disabled():
    s = P2pScheduler(make_cfg("kv_producer"), BS, start_registrar=True)  # no proxies configured
    assert s._registrar is None
    s.shutdown()


# ================================================================ outcome & cleanup


def test_consumer_failed_load_is_reported_as_such():
    s = consumer()
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    admit(s, req, 0, [1, 2, 3])
    s.build_connector_meta(sched_out())
    s.update_connector_output({req.request_id, "some-other-request"})
    assert s.request_finished(req, [1, 2, 3]) == (
        False, {"xpyd": {"loaded_tokens": 0, "load_failed": True}})


def test_consumer_pd_request_that_loaded_nothing_releases_its_transfer():
    """Full local hit or gone before admission: P may still push; D must drop it."""
    s = consumer()
    full_hit = make_req(pd_id(), 129)
    s.on_new_request(full_hit)
    assert s.get_num_new_matched_tokens(full_hit, 128) == (0, False)
    s.request_finished(full_hit, [5, 6])
    other = "f" * 32
    never_admitted = make_req(pd_id(key=other), 300)
    s.on_new_request(never_admitted)
    s.request_finished(never_admitted, [])
    plain = make_req("cmpl-plain-0-1a2b3c4d", 300)
    s.on_new_request(plain)
    s.request_finished(plain, [])
    assert s.build_connector_meta(sched_out()).release == [TK, f"{other}-0"]
    assert s.build_connector_meta(sched_out()).release == []  # announced once


def test_consumer_full_local_hit_says_the_kv_is_not_needed():
    """A transfer's request whose own prefix hit covers the prompt: D says at INFO that P's KV
    is not needed (P then hears "gone" for it), once, and releases the key."""
    with connector_log("scheduler") as log:
        s = consumer()
        full_hit = make_req(pd_id(), 129)
        s.on_new_request(full_hit)
        assert s.get_num_new_matched_tokens(full_hit, 128) == (0, False)
        assert s.get_num_new_matched_tokens(full_hit, 128) == (0, False)  # asked again: said once
        s.update_state_after_alloc(full_hit, kv_blocks([5, 6]), 0)
        partial = make_req(pd_id(key="f" * 32), 300)
        s.on_new_request(partial)
        assert admit(s, partial, 128, [7, 8, 9]) == (171, True)  # loads the rest: nothing to say
        assert s.build_connector_meta(sched_out()).release == [TK, f"{'f' * 32}-0"]
    said = [ln for ln in log.lines if "not needed" in ln]
    assert said == [f"kv load not needed req={full_hit.request_id} transfer={TK} local_hit=128: "
                    "this instance's prefix cache holds the prompt"]


def test_consumer_release_comes_with_the_last_planned_load():
    s = consumer()
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    admit(s, req, 0, [1, 2, 3])
    meta = s.build_connector_meta(sched_out())
    assert [x.transfer_key for x in meta.loads] == [TK] and meta.release == [TK]
    s.request_finished(req, [1, 2, 3])
    assert s.build_connector_meta(sched_out()).release == []


def test_consumer_n_children_share_one_transfer_released_after_the_last(monkeypatch):
    """n=2: vLLM adds children "0_<id>" and "1_<id>" one by one; both load the prompt's
    one payload, which the worker may drop only once both were planned, and, since
    the engine never learns n, a grace period later (a sibling may still come)."""
    clock = [100.0]
    monkeypatch.setattr("connector.p2p.scheduler.time.monotonic", lambda: clock[0])
    s = consumer()
    base = pd_id()
    kids = [make_req(f"{i}_{base}", 300) for i in range(3)]
    s.on_new_request(kids[0])
    admit(s, kids[0], 0, [1, 2, 3])
    meta = s.build_connector_meta(sched_out())
    assert [x.transfer_key for x in meta.loads] == [TK] and meta.release == []
    # The second child arrives after the first was planned: it loads too.
    clock[0] += SIBLING_GRACE_S / 2
    s.on_new_request(kids[1])
    admit(s, kids[1], 0, [4, 5, 6])
    meta = s.build_connector_meta(sched_out())
    assert [(x.req_id, x.transfer_key, x.dst_block_ids) for x in meta.loads] == [(kids[1].request_id, TK, (4, 5, 6))]
    assert meta.release == []
    clock[0] += SIBLING_GRACE_S * 0.99
    assert s.build_connector_meta(sched_out()).release == []
    clock[0] += SIBLING_GRACE_S * 0.02
    assert s.build_connector_meta(sched_out()).release == [TK]
    assert s.build_connector_meta(sched_out()).release == []  # once
    # A child that shows up after the release computes its prompt itself.
    s.on_new_request(kids[2])
    assert s.get_num_new_matched_tokens(kids[2], 0) == (0, False)
    s.update_state_after_alloc(kids[2], kv_blocks([7, 8, 9]), 0)
    assert s.build_connector_meta(sched_out()) == P2pConnectorMetadata(idle=True)


def test_consumer_batch_prompts_get_a_transfer_each():
    s = consumer()
    xid = f"___prefill_addr_{P_ADDR}___decode_addr_{D_ADDR}_{KEY}"
    reqs = [make_req(f"cmpl-{xid}-{i}-1a2b3c4{i}", 200 + i) for i in range(2)]
    for i, r in enumerate(reqs):
        s.on_new_request(r)
        admit(s, r, 0, [10 * i + 1, 10 * i + 2])
    meta = s.build_connector_meta(sched_out())
    assert [(x.transfer_key, x.prompt_tokens) for x in meta.loads] == [(f"{KEY}-0", 200), (f"{KEY}-1", 201)]
    assert meta.release == [f"{KEY}-0", f"{KEY}-1"]


def test_producer_sends_each_prompt_once_whatever_n():
    """P given n=2 (by a proxy that does not cut n) plans one send per prompt; a
    batch of two prompts plans two."""
    kvm = FakeKVCacheManager()
    s = producer(kvm=kvm)
    xid = f"___prefill_addr_{P_ADDR}___decode_addr_{D_ADDR}_{KEY}"
    ids = [f"{c}_cmpl-{xid}-{p}-aaaaaaa{p}" for p in range(2) for c in range(2)]
    for i, rid in enumerate(ids):
        kvm.blocks[rid] = [i + 1, i + 11]
        s.on_new_request(make_req(rid, 200))
    meta = s.build_connector_meta(sched_out(new=[(rid, 0, 200) for rid in ids]))
    assert sorted((x.req_id, x.transfer_key) for x in meta.saves) == [
        (ids[0], f"{KEY}-0"), (ids[2], f"{KEY}-1")]
    assert s.request_finished(make_req(ids[1], 200), [])[1] is None  # the sibling sent nothing


# ======================================================================== exact figures


def test_plan_lines_are_exact(caplog):
    """bench_e2e and operators read these lines (mode, blocks, probe time): their fields."""
    import logging
    import re

    rid = pd_id()
    kvm = FakeKVCacheManager(blocks={rid: [4, 5, 6]})
    p = producer(kvm=kvm)
    req = make_req(rid, 300, {"xpyd_skip_tokens": 128})
    with caplog.at_level(logging.INFO, logger="vllm.xpyd.connector.p2p.scheduler"):
        p.on_new_request(req)
        (save,) = p.build_connector_meta(sched_out(new=[(rid, 0, 300)])).saves
        assert p.build_connector_meta(sched_out(preempted={rid})).preempted == [rid]
        (again,) = p.build_connector_meta(sched_out(new=[(rid, 0, 300)])).saves
        probe = ArrivalDouble({TK})
        d = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False, probe=probe)
        sync, plain = make_req(rid, 300), make_req(pd_id(key=KEY2), 300)
        d.on_new_request(sync)
        d.on_new_request(plain)
        admit(d, sync, 128, [11, 4, 6])
        consumer_only = consumer()
        consumer_only.on_new_request(plain)
        admit(consumer_only, plain, 0, [1, 2, 3])
    # the re-planned send starts where the first did: D's own blocks are still skipped
    assert (save.first_block, again.first_block, again.block_ids) == (1, 1, (5, 6))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [
        f"kv send planned req={rid} transfer={TK} tokens=300 blocks=2 skipped=1 to={D_ADDR} mode=PUT_ASYNC",
        f"kv send re-planned after preemption req={rid} transfer={TK}",
        f"kv send planned req={rid} transfer={TK} tokens=300 blocks=2 skipped=1 to={D_ADDR} mode=PUT_ASYNC",
    ]
    assert re.fullmatch(rf"kv load planned req={re.escape(rid)} transfer={TK} local_hit=128 external=171 blocks=2 "
                        r"mode=sync probe_ms=\d+\.\d\d", lines[3]), lines[3]
    assert lines[4] == (f"kv load planned req={plain.request_id} transfer={KEY2}-0 local_hit=0 external=299 "
                        "blocks=3 mode=async")


@pytest.mark.parametrize("params, first_block", [
    (None, 0), ({"xpyd_skip_tokens": 0}, 0), ({"xpyd_skip_tokens": 1}, 1), ({"xpyd_skip_tokens": -1}, 0),
    ({"xpyd_skip_tokens": "3"}, 0), ({"xpyd_skip_tokens": 100}, 8),  # never past token n-2 (n = 10)
])
def test_skip_tokens_at_block_size_1(params, first_block):
    """vLLM allows a block size of 1: every skipped token is a skipped block."""
    rid = pd_id()
    s = P2pScheduler(make_cfg("kv_producer"), 1, start_registrar=False)
    s.bind(FakeKVCacheManager(blocks={rid: list(range(10))}))
    s.on_new_request(make_req(rid, 10, params))
    (save,) = s.build_connector_meta(sched_out(new=[(rid, 0, 10)])).saves
    assert save.first_block == first_block and save.block_ids == tuple(range(first_block, 10))


def test_a_two_token_prompt_skips_nothing_at_block_size_1():
    rid = pd_id()
    s = P2pScheduler(make_cfg("kv_producer"), 1, start_registrar=False)
    s.bind(FakeKVCacheManager(blocks={rid: [7, 8]}))
    s.on_new_request(make_req(rid, 2, {"xpyd_skip_tokens": 5}))
    (save,) = s.build_connector_meta(sched_out(new=[(rid, 0, 2)])).saves
    assert (save.first_block, save.block_ids) == (0, (7, 8))


def test_consumer_loads_a_single_missing_token():
    s = consumer()
    req = make_req(pd_id(), 300)
    s.on_new_request(req)
    assert admit(s, req, 298, [1, 2, 3]) == (1, True)
    (spec,) = s.build_connector_meta(sched_out()).loads
    assert spec.num_tokens == 1


def test_invalid_blocks_fail_only_the_synchronous_load_that_owns_them():
    """vLLM reports a failed synchronous load by its blocks; asynchronous loads fail by request id."""
    probe = ArrivalDouble({TK})
    s = P2pScheduler(make_cfg("kv_consumer"), BS, start_registrar=False, probe=probe)
    sync, other_sync, late = make_req(pd_id(), 300), make_req(pd_id(key=KEY2), 300), make_req(pd_id(key="a" * 32), 300)
    probe.here.add(f"{KEY2}-0")
    for r in (sync, other_sync, late):
        s.on_new_request(r)
    admit(s, sync, 0, [1, 2, 3])
    admit(s, other_sync, 0, [4, 5, 6])
    probe.here.clear()
    admit(s, late, 0, [7, 8, 9])  # asynchronous
    s.update_connector_output(set(), None, {2, 9})
    got = {r.request_id: s.request_finished(r, [])[1]["xpyd"]["load_failed"] for r in (sync, other_sync, late)}
    assert got == {sync.request_id: True, other_sync.request_id: False, late.request_id: False}


def test_transport_fallbacks_add_up_across_steps():
    s = consumer()
    for _ in range(2):
        st = XpydStats.of(0, 0, 1000)
        st.data["fallbacks"] = {"nccl_error": 2, "peer": 1}
        s.update_connector_output(set(), st)
    s.update_connector_output(set(), XpydStats.of(0, 0, 1000))  # none this step
    assert s.fallbacks_total() == 6


def test_producer_key_is_free_again_once_its_owner_finished():
    """A retry of the same transfer (same key) after the first attempt finished is sent."""
    rid = pd_id()
    retry = pd_id(suffix="5e6f7a8b")
    kvm = FakeKVCacheManager(blocks={rid: [1, 2, 3], retry: [4, 5, 6]})
    s = producer(kvm=kvm)
    s.on_new_request(make_req(rid, 300))
    s.build_connector_meta(sched_out(new=[(rid, 0, 300)]))
    s.request_finished(make_req(rid, 300), [])
    s.on_new_request(make_req(retry, 300))
    (save,) = s.build_connector_meta(sched_out(new=[(retry, 0, 300)])).saves
    assert save.req_id == retry and save.block_ids == (4, 5, 6)


@pytest.mark.parametrize("send_type, contacts", [("PUT_ASYNC", [D_ADDR]), ("PUT", []), ("GET", [])])
def test_only_put_async_announces_first_contact(send_type, contacts):
    s = producer(send_type=send_type)
    s.on_new_request(make_req(pd_id(), 300))
    assert s.build_connector_meta(sched_out()).contacts == contacts


def test_released_keys_are_remembered_up_to_the_bound_oldest_forgotten_first():
    from connector.p2p.scheduler import _RELEASED_MEMORY

    s = consumer()
    keys = [f"{i:032x}" for i in range(_RELEASED_MEMORY + 1)]
    for k in keys:
        r = make_req(pd_id(key=k), 4)
        s.on_new_request(r)
        admit(s, r, 0, [1])
        s.request_finished(r, [])
    def loads_again(k):
        r = make_req(pd_id(key=k, suffix="99999999"), 4)
        s.on_new_request(r)
        return s.get_num_new_matched_tokens(r, 0) != (0, False)
    # the oldest key fell out: a late sibling of it would load (and fail fast at D's buffer);
    # the next oldest and the newest are still known as released: recomputed instead
    assert [loads_again(keys[0]), loads_again(keys[1]), loads_again(keys[-1])] == [True, False, False]


# ======================================================================== the arrival probe, on real sockets


class _Rank:
    """A worker rank's control socket (real tcp): answers ``ready`` from a set of keys."""

    def __init__(self, port: int, here: set[str], ready_value=True) -> None:
        from connector.transport import TcpTransport

        self.asked: list[dict] = []
        self._here, self._value = here, ready_value
        self.t = TcpTransport()
        self.t.start("127.0.0.1", port, self._handle)

    def _handle(self, header, tensors):
        self.asked.append(dict(header))
        return {"ok": True, "ready": self._value if header.get("key") in self._here else False}, []


@pytest.fixture
def probe_of():
    """probe_of(ranks, here, ready_value=True) -> (probe, ranks' servers, their addresses); all closed after."""
    from connector.p2p.scheduler import ArrivalProbe
    from tests.support.ports import spare_port

    made = []

    def make(ranks: int, here: set[str], ready_value=True):
        base = spare_port(ranks)
        cfg = make_cfg("kv_consumer", addr=f"127.0.0.1:{base}")
        servers = [_Rank(base + r, here, ready_value) for r in range(ranks)]
        made.append((ArrivalProbe(cfg, ranks), servers, [f"127.0.0.1:{base + r}" for r in range(ranks)]))
        return made[-1]

    yield make
    for probe, servers, _ in made:
        probe.close()
        for s in servers:
            s.t.close()


def _arrives(probe, key: str, within_s: float = 10.0) -> bool:
    """True once the probe says the key is here. The probe says no on any doubt, a slow answer
    included (its bound is 50 ms: a first connection on a loaded box can take longer), so a
    test of a yes asks again, over the connection the first call left open."""
    deadline = time.monotonic() + within_s
    while not probe.arrived(key):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_arrival_probe_reads_every_ranks_board_then_asks_every_rank(probe_of):
    from connector.p2p.arrivals import ArrivalWriter, board_path

    probe, servers, addrs = probe_of(2, {TK})
    boards = [ArrivalWriter(board_path(a)) for a in addrs]
    try:
        boards[0].publish(TK)  # on one board only: every rank is asked
        assert _arrives(probe, TK)
        assert all(s.asked for s in servers)
        assert {(h["op"], h["key"]) for s in servers for h in s.asked} == {("ready", TK)}
        for s in servers:
            s.asked.clear()
        assert probe.arrived(f"{KEY2}-0") is False  # no rank has it
        assert [(h["op"], h["key"]) for h in servers[0].asked] == [("ready", f"{KEY2}-0")]  # said no, not timed out
        for s in servers:
            s.asked.clear()
        boards[1].publish(TK)  # on every board: nobody is asked
        assert probe.arrived(TK) is True
        assert [s.asked for s in servers] == [[], []]
    finally:
        for b in boards:
            b.close()


def _says_no(probe, key: str, caplog, within_s: float = 10.0) -> bool:
    """The probe's no, from an answer: a call that timed out (it logs why) is asked again."""
    import logging

    deadline = time.monotonic() + within_s
    with caplog.at_level(logging.WARNING, logger="vllm.xpyd.connector.p2p.scheduler"):
        while time.monotonic() < deadline:
            caplog.clear()
            if probe.arrived(key):
                return False
            if not any("kv arrival probe" in r.getMessage() for r in caplog.records):
                return True
    return False


def test_arrival_probe_needs_every_rank_and_a_true_answer(probe_of, caplog):
    probe, servers, _ = probe_of(2, {TK})
    assert _arrives(probe, TK)  # both ranks have it
    servers[1]._here = set()  # rank 1 lacks it
    assert _says_no(probe, TK, caplog)
    probe, servers, _ = probe_of(1, {TK}, ready_value=1)  # a truthy non-True answer is doubt
    assert _says_no(probe, TK, caplog)


def test_arrival_probe_of_a_silent_rank_says_no_within_its_bound(caplog):
    import logging

    from connector.p2p.scheduler import ARRIVAL_PROBE_TIMEOUT_S, ArrivalProbe
    from tests.support.ports import spare_port

    base = spare_port(1)
    probe = ArrivalProbe(make_cfg("kv_consumer", addr=f"127.0.0.1:{base}"), 1)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.xpyd.connector.p2p.scheduler"):
            t0 = time.monotonic()
            assert probe.arrived(TK) is False
            assert time.monotonic() - t0 < ARRIVAL_PROBE_TIMEOUT_S + 1.0  # slack for a loaded box
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith(f"kv arrival probe of 127.0.0.1:{base} failed (loads stay asynchronous): ")
    finally:
        probe.close()


@pytest.mark.parametrize("kv_auth, byte_stream", [("mac", True), ("curve", True), ("mac", False)])
def test_arrival_probe_speaks_the_instances_kv_auth_and_framing(kv_auth, byte_stream):
    """With kv_secret set, the worker's control socket refuses an unauthenticated call: the
    probe must use the instance's secret, auth mode and framing, or every load is asynchronous."""
    import dataclasses

    from connector.p2p.scheduler import ArrivalProbe
    from connector.transport import KVAuth, TcpTransport
    from tests.support.ports import spare_port

    secret = "s" * 32
    base = spare_port(1)
    cfg = dataclasses.replace(make_cfg("kv_consumer", addr=f"127.0.0.1:{base}"), kv_secret=secret, kv_auth=kv_auth,
                              byte_stream=byte_stream)
    server = TcpTransport(auth=KVAuth.from_secret(secret, kv_auth), byte_stream=byte_stream)
    server.start("127.0.0.1", base, lambda h, t: ({"ok": True, "ready": h.get("key") == TK}, []))
    probe = ArrivalProbe(cfg, 1)
    try:
        assert _arrives(probe, TK)
        assert probe.arrived(f"{KEY2}-0") is False
    finally:
        probe.close()
        server.close()

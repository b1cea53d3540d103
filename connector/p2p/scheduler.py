"""Scheduler-side half of the connector (runs in vLLM's EngineCore process).

Decides, per request, what to load (consumer) or send (producer), and tells the
workers through ``P2pConnectorMetadata``. Shares nothing else with them.

One transfer per prompt: the key is the proxy's uuid plus the prompt's index in
a batch (``request_id``). The ``n`` children of one prompt carry the same key:
P sends it once, D loads it into every child and drops it after the last.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connector.p2p.arrivals import ArrivalReader, board_path
from connector.config import ConnectorConfig, as_bool
from connector.log import get_logger
from connector.p2p.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
from connector.registration import Registrar, heartbeat_load
from connector.scheduler_output import tokens_computed_before
from connector.stats import XpydStats
from connector.tracing import LOAD, SEND, TransferSpans
from connector.transport import KVAuth, TcpTransport, TransportError
from connector.transport.auth import RateLimitedLog
from xpyd_wire import request_id
from xpyd_wire.discovery import Load
from xpyd_wire.kv_transfer import (
    DEBUG_CORRUPT_KV_PARAM,
    PREFILL_PROMPT_TOKENS_PARAM,
    REPORT_KEY_PARAM,
    RESPONSE_KEY,
    SKIP_TOKENS_PARAM,
    Ready,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)

# Keys a consumer released, remembered so that a late sibling (an n>1 child
# added after the others were planned) recomputes instead of waiting for KV
# that was already dropped. Bounded: old keys fall out first.
_RELEASED_MEMORY = 4096
# vLLM adds the n children of a request to the engine one by one; a sibling may
# arrive after the others were planned. A key of children is released this long
# after its last known consumer was planned (a plain request's at once).
SIBLING_GRACE_S = 1.0
# request_finished's kv_transfer_params reach the client's response. The transfer key
# names the KV in flight (without kv_secret, whoever knows it can feed or fail that
# transfer), so it is only reported to a request whose kv_transfer_params ask for it
# (REPORT_KEY_PARAM, defined with the protocol: xpyd_wire.kv_transfer).


def _prefill_prompt_tokens(request: "Request") -> int:
    """The length of the prompt P computed: this request's, or, when the proxy sent D the
    prompt plus P's first token (its first-token mode), one fewer. Any other value is
    ignored: the payload check then refuses a mismatch as before."""
    n = request.num_prompt_tokens
    value = (request.kv_transfer_params or {}).get(PREFILL_PROMPT_TOKENS_PARAM)
    return n - 1 if type(value) is int and value == n - 1 else n


def _skip_tokens(request: "Request") -> int:
    """xpyd_skip_tokens, set by the proxy: P ships only the blocks after them. D checks what
    arrives and recomputes what it lacks (a payload that starts after D's own prefix hit is
    refused as a whole)."""
    value = (request.kv_transfer_params or {}).get(SKIP_TOKENS_PARAM, 0)
    return value if type(value) is int and value > 0 else 0


def _transfer(request: "Request") -> request_id.TransferId | None:
    """The transfer this request is part of (its engine id, or the id the proxy carried in
    kv_transfer_params where the engine id is the client's: the Responses API); None: plain."""
    return request_id.transfer_of(request.request_id, request.kv_transfer_params)


def _asked_for_key(request: "Request") -> bool:
    return as_bool((request.kv_transfer_params or {}).get(REPORT_KEY_PARAM, False))


@dataclass(slots=True)
class _Outgoing:
    tid: request_id.TransferId
    num_prompt_tokens: int
    skip_tokens: int = 0  # leading tokens D holds already (the proxy's word)


@dataclass(slots=True)
class _Unstarted:
    """A request waiting (unallocated) for its prefill to begin sending: its transfer, parsed at
    its first ask (it is asked every engine step), since when it waits and when D gives up."""

    tid: request_id.TransferId
    since: float
    until: float


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The scheduler asks its own workers' control sockets (loopback or this host) whether a
# transfer's KV is here, on vLLM's scheduling thread: a short bound, then load asynchronously.
ARRIVAL_PROBE_TIMEOUT_S = 0.05


class ArrivalProbe:
    """Whether a transfer's whole KV has arrived at every worker rank of this instance, so the
    load can be synchronous: first each rank's arrival board (shared memory, no system call;
    connector/p2p/arrivals.py), then, unless every board said yes, each rank's control socket (op
    ``ready``). Any doubt (an error, a slow answer) says no: the load is then asynchronous, as
    it would be without the probe."""

    def __init__(self, cfg: ConnectorConfig, ranks: int) -> None:
        self._addrs = [request_id.rank_address(cfg.advertised_address, r) for r in range(ranks)]
        self._boards = [ArrivalReader(board_path(a)) for a in self._addrs]
        auth = KVAuth.from_secret(cfg.kv_secret, cfg.kv_auth) if cfg.kv_secret else None
        self._transport = TcpTransport(auth=auth, max_idle_per_peer=1, byte_stream=cfg.byte_stream)
        self._log = RateLimitedLog(logger.warning)

    def begun(self, key: str) -> bool:
        """Whether a sender began the transfer (or its KV arrived) at some rank, as the boards
        say; True where no board can be read (nothing to wait on: the load then waits under
        its deadline, as without the boards)."""
        seen = [b.begun(key) for b in self._boards]
        return any(s is not False for s in seen)

    def arrived(self, key: str) -> bool:
        if all(b.arrived(key) for b in self._boards):
            return True
        deadline = time.monotonic() + ARRIVAL_PROBE_TIMEOUT_S
        for addr in self._addrs:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                reply, _ = self._transport.call(addr, Ready(key).encode(), timeout_s=left)
            except TransportError as e:
                self._log("probe", "kv arrival probe of %s failed (loads stay asynchronous): %s", addr, e)
                return False
            if not Ready.is_ready(reply):
                return False
        return True

    def close(self) -> None:
        for b in self._boards:
            b.close()
        self._transport.close()


class P2pScheduler:
    def __init__(self, cfg: ConnectorConfig, block_size: int, start_registrar: bool = True,
                 probe: ArrivalProbe | None = None, spans: TransferSpans | None = None) -> None:
        self._cfg = cfg
        self._spans = spans  # the requests' kv load/send spans (connector/tracing.py); None: not tracing
        self._block_size = block_size
        # Consumer (PUT modes): asks whether a request's KV is here already (a synchronous load);
        # None: every load is asynchronous. GET pulls the KV only once the load is planned.
        self._probe = probe if cfg.loads_sync else None
        self._sync: set[str] = set()  # requests told "synchronous" by the last matched-tokens call
        # Requests waiting (unallocated) for their prefill to begin sending, and those that
        # stopped waiting (computed here, reported as a failed load).
        self._unstarted: dict[str, _Unstarted] = {}
        self._gave_up: set[str] = set()
        self._probe_ms: dict[str, float] = {}  # how long the last probe of a request took (its log line)
        self._kv_cache_manager: KVCacheManager | None = None
        # Producer: requests whose prompt still has to be sent, sends planned,
        # and which live request owns each key's send (n>1 children on P share it).
        self._outgoing: dict[str, _Outgoing] = {}
        self._saving: dict[str, SaveSpec] = {}
        self._key_owner: dict[str, str] = {}
        # Consumer: loads to announce in the next metadata, and what each
        # request got (so a preempted or failed one is never loaded twice).
        self._new_loads: list[LoadSpec] = []
        self._loaded: dict[str, LoadSpec] = {}
        self._failed_loads: set[str] = set()  # from the workers' failed_recving
        self._covered: dict[str, int] = {}  # requests whose own prefix hit covers the prompt -> the hit
        self._contacts: dict[str, None] = {}  # producer: decode addresses to announce (ordered set)
        # Consumer: per key, the live requests that may still plan a load of it.
        self._unplanned: dict[str, set[str]] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        self._release: list[str] = []  # to announce in the next metadata
        self._grace: dict[str, float] = {}  # key of n>1 children -> when to release it
        # Load figures for the heartbeat.
        self._live: set[str] = set()
        self._running = 0
        self._buffer_usage = 0.0  # the workers' receive buffers, from their stats
        self._fallbacks = 0  # the workers' NCCL -> tcp fallbacks since start, from their stats
        self._registrar = (
            Registrar(cfg, self.load_report, self.fallbacks_total) if start_registrar and cfg.proxies and cfg.http_port else None
        )

    def bind(self, kv_cache_manager: "KVCacheManager") -> None:
        self._kv_cache_manager = kv_cache_manager

    def fallbacks_total(self) -> int:
        """Times the workers' KV transport left NCCL for tcp with a peer, since start (heartbeat)."""
        return self._fallbacks

    def load_report(self) -> Load:
        """Load figures for the discovery heartbeat."""
        return heartbeat_load(self._kv_cache_manager, self._running, len(self._live), self._buffer_usage,
                              len(self._unstarted))

    # ---- which side of a transfer this instance is on ----
    def _consumes(self, tid: request_id.TransferId) -> bool:
        if not self._cfg.is_consumer:
            return False
        return self._cfg.role != "kv_both" or tid.decode_addr == self._cfg.advertised_address

    def _produces(self, tid: request_id.TransferId) -> bool:
        if not self._cfg.is_producer:
            return False
        return self._cfg.role != "kv_both" or tid.prefill_addr == self._cfg.advertised_address

    # ---- consumer: who may still load a key ----
    def _planned(self, rid: str, key: str) -> None:
        """rid will plan no (further) load of key; release the key after the last."""
        waiting = self._unplanned.get(key)
        if waiting is None or rid not in waiting:
            return
        waiting.discard(rid)
        if waiting:
            return
        del self._unplanned[key]
        if request_id.child_index(rid) is not None:
            self._grace[key] = time.monotonic() + SIBLING_GRACE_S
        else:
            self._release_key(key)

    def _release_key(self, key: str) -> None:
        self._release.append(key)
        self._released[key] = None
        while len(self._released) > _RELEASED_MEMORY:
            self._released.popitem(last=False)

    def _release_due(self, now: float) -> None:
        for key in [k for k, t in self._grace.items() if t <= now]:
            del self._grace[key]
            self._release_key(key)

    # ---- vLLM hooks ----
    def on_new_request(self, request: "Request") -> None:
        rid = request.request_id
        self._live.add(rid)
        tid = _transfer(request)
        if tid is None:
            return
        if self._produces(tid) and tid.key not in self._key_owner:
            self._key_owner[tid.key] = rid
            self._outgoing[rid] = _Outgoing(tid, request.num_prompt_tokens, _skip_tokens(request))
            if self._cfg.send_type == "PUT_ASYNC":
                self._contacts[tid.decode_addr] = None
            if self._spans is not None:
                self._spans.seen(request, SEND, tid.key)
        if self._consumes(tid) and tid.key not in self._released:
            self._grace.pop(tid.key, None)  # a late sibling: it loads too
            self._unplanned.setdefault(tid.key, set()).add(rid)
            if self._spans is not None:
                self._spans.seen(request, LOAD, tid.key)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        waiting = self._unstarted.get(rid)
        if waiting is not None:
            # vLLM asks every engine step for every request waiting for its prefill: the common
            # answer from the transfer parsed at the first ask and the board (which remembers a
            # key not begun until something is written), before anything else; the rest (begun,
            # covered by a local hit, given up) takes the full path below.
            assert self._probe is not None  # only requests probed wait
            if (request.num_tokens - 1 > num_computed_tokens and not self._probe.begun(waiting.tid.key)
                    and time.monotonic() < waiting.until):
                return None, False
            tid = waiting.tid
        else:
            if rid in self._loaded:
                return 0, False  # loaded (or failed) once already: recompute locally
            tid = _transfer(request)
            if tid is None or not self._consumes(tid):
                return 0, False
        if rid not in self._unplanned.get(tid.key, ()):
            # A sibling that came after the key's KV was released: compute it.
            return 0, False
        # Leave the last prompt token to compute: D must run one forward step to
        # produce logits for the first output token.
        n = request.num_tokens - 1 - num_computed_tokens
        if n <= 0:
            self._unstarted.pop(rid, None)  # waited for a prefill its own prefix cache now holds
            self._covered[rid] = num_computed_tokens
            return 0, False
        self._sync.discard(rid)
        if self._probe is not None:
            # Asked every engine step while the prefill has not begun: the board alone answers
            # that (no system call), before the arrival probe, which may ask the worker.
            if not self._probe.begun(tid.key):
                return self._prefill_not_begun(rid, tid)
            self._unstarted.pop(rid, None)
            t0 = time.perf_counter()
            here = self._probe.arrived(tid.key)
            self._probe_ms[rid] = (time.perf_counter() - t0) * 1e3
            if here:
                # The KV is here: load it in the step that schedules the request, not one later.
                self._sync.add(rid)
                return n, False
        return n, True

    def _prefill_not_begun(self, rid: str, tid: request_id.TransferId) -> tuple[int | None, bool]:
        """No sender began this transfer: the request waits in vLLM's queue without blocks
        (None: ask again next step), its load deadline not running, for kv_prefill_wait_s when
        the proxy asked D before P answered (P may be queued or computing), else for
        kv_load_timeout_s (P answered: its send has begun, or will not come, e.g. refused for
        a wrong secret); then D computes the prompt itself, reported as a failed load (the
        key is released: a late payload is refused as unneeded)."""
        now = time.monotonic()
        waiting = self._unstarted.get(rid)
        if waiting is None:
            wait_s = self._cfg.kv_prefill_wait_s if tid.early else self._cfg.kv_load_timeout_s
            waiting = self._unstarted[rid] = _Unstarted(tid, now, now + wait_s)
        if now < waiting.until:
            return None, False
        del self._unstarted[rid]
        self._gave_up.add(rid)
        logger.error("kv load timed out req=%s transfer=%s: no sender began it in %.1fs; computing the prompt here",
                     rid, tid.key, now - waiting.since)
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tid = _transfer(request)
        if tid is None:
            return
        sync = request.request_id in self._sync
        self._sync.discard(request.request_id)
        if num_external_tokens > 0:
            self._plan_load(request, tid, blocks, num_external_tokens, sync)
        covered = self._covered.pop(request.request_id, None)
        if covered is not None and num_external_tokens == 0:
            # P's KV is on its way (or here) for nothing: a late one is refused as unneeded.
            logger.info("kv load not needed req=%s transfer=%s local_hit=%d: this instance's prefix cache "
                        "holds the prompt", request.request_id, tid.key, covered)
        self._planned(request.request_id, tid.key)

    def _plan_load(self, request: "Request", tid: request_id.TransferId, blocks: "KVCacheBlocks",
                   num_external_tokens: int, sync: bool = False) -> None:
        block_ids = blocks.get_block_ids()[0]
        local = request.num_tokens - 1 - num_external_tokens  # block-aligned local hit
        first = local // self._block_size
        last = _cdiv(local + num_external_tokens, self._block_size)
        params = request.kv_transfer_params or {}
        p_tokens = _prefill_prompt_tokens(request)
        spec = LoadSpec(
            req_id=request.request_id,
            transfer_key=tid.key,
            prefill_addr=tid.prefill_addr,
            dst_block_ids=tuple(block_ids[first:last]),
            first_block=first,
            num_tokens=num_external_tokens,
            prompt_tokens=p_tokens,
            prompt_blocks=_cdiv(p_tokens, self._block_size),
            corrupt_for_test=self._cfg.allow_debug_corruption
            and bool(params.get(DEBUG_CORRUPT_KV_PARAM, False)),
            sync=sync,
        )
        self._new_loads.append(spec)
        self._loaded[request.request_id] = spec
        probe_ms = self._probe_ms.pop(request.request_id, None)
        if self._spans is not None:
            self._spans.planned(request.request_id, {"xpyd.kv.tokens": num_external_tokens, "xpyd.kv.local_hit": local,
                                "xpyd.kv.blocks": len(spec.dst_block_ids), "xpyd.kv.mode": "sync" if sync else "async"})
        logger.info("kv load planned req=%s transfer=%s local_hit=%d external=%d blocks=%d mode=%s%s",
                    request.request_id, tid.key, local, num_external_tokens, len(spec.dst_block_ids),
                    "sync" if sync else "async", "" if probe_ms is None else f" probe_ms={probe_ms:.2f}")

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> P2pConnectorMetadata:
        if self._grace:
            self._release_due(time.monotonic())
        meta = P2pConnectorMetadata(loads=self._new_loads, release=self._release, contacts=list(self._contacts),
                                    idle=scheduler_output.total_num_scheduled_tokens == 0,
                                    awaiting_senders=bool(self._unstarted))
        self._new_loads = []
        self._release = []
        self._contacts.clear()
        self._running = len(scheduler_output.num_scheduled_tokens)
        if scheduler_output.preempted_req_ids:
            meta.preempted = self._preempt(scheduler_output.preempted_req_ids)
        if self._outgoing:
            computed_before = tokens_computed_before(scheduler_output)
            for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
                out = self._outgoing.get(rid)
                if out is None or rid not in computed_before:
                    continue
                if computed_before[rid] + n_sched < out.num_prompt_tokens:
                    continue  # chunked prefill: prompt not complete yet
                meta.saves.append(self._plan_save(rid, out))
                del self._outgoing[rid]
        return meta

    def _preempt(self, preempted: set[str] | list[str]) -> list[str]:
        """Preempted requests with a send planned. With PUT_ASYNC the worker cancels
        a send that has not started (its blocks are about to be reused), so the
        prompt is sent again once the recomputation completes it. PUT and GET
        finished their send or copy inside the step that planned it."""
        out = [r for r in preempted if r in self._saving]
        for rid in out:
            spec = self._saving.pop(rid)
            if spec.delay_free:
                uuid, _, index = spec.transfer_key.rpartition("-")
                tid = request_id.TransferId(uuid, int(index), spec.prefill_addr, spec.decode_addr)
                self._outgoing[rid] = _Outgoing(tid, spec.num_tokens, spec.first_block * self._block_size)
                logger.info("kv send re-planned after preemption req=%s transfer=%s", rid, spec.transfer_key)
        return out

    def _plan_save(self, rid: str, out: _Outgoing) -> SaveSpec:
        assert self._kv_cache_manager is not None, "kv cache manager not bound"
        n_blocks = _cdiv(out.num_prompt_tokens, self._block_size)
        # Whole blocks D holds are skipped, but never the one D computes from: D loads up to
        # the prompt's last token, so at least the block holding token n-2 is shipped.
        skip = min(out.skip_tokens // self._block_size, max(0, out.num_prompt_tokens - 2) // self._block_size)
        block_ids = self._kv_cache_manager.get_block_ids(rid)[0][skip:n_blocks]
        spec = SaveSpec(
            req_id=rid,
            transfer_key=out.tid.key,
            decode_addr=out.tid.decode_addr,
            prefill_addr=out.tid.prefill_addr,
            block_ids=tuple(block_ids),
            num_tokens=out.num_prompt_tokens,
            delay_free=self._cfg.send_type == "PUT_ASYNC",
            first_block=skip,
        )
        self._saving[rid] = spec
        if self._spans is not None:
            self._spans.planned(rid, {"xpyd.kv.tokens": spec.num_tokens, "xpyd.kv.blocks": len(block_ids),
                                "xpyd.kv.skipped_blocks": skip, "xpyd.kv.peer": spec.decode_addr,
                                "xpyd.kv.mode": self._cfg.send_type})
        logger.info("kv send planned req=%s transfer=%s tokens=%d blocks=%d skipped=%d to=%s mode=%s",
                    rid, spec.transfer_key, spec.num_tokens, len(block_ids), skip, spec.decode_addr,
                    self._cfg.send_type)
        return spec

    def update_connector_output(self, failed_recving: set[str], stats: object = None,
                                invalid_block_ids: set[int] = frozenset()) -> None:
        self._failed_loads.update(r for r in failed_recving if r in self._loaded)
        if invalid_block_ids:  # a synchronous load that failed reports its blocks, not its request
            self._failed_loads.update(r for r, spec in self._loaded.items()
                                      if spec.sync and not invalid_block_ids.isdisjoint(spec.dst_block_ids))
        if isinstance(stats, XpydStats):
            if stats.has_buffers():
                self._buffer_usage = stats.buffer_usage()
            self._fallbacks += sum(stats.data.get("fallbacks", {}).values())

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Returns (delay_free, kv_transfer_params); the params reach the client's
        response as ``kv_transfer_params: {"xpyd": {...}}`` (with ``transfer_key`` only
        when the request's kv_transfer_params carry ``xpyd_report_transfer_key: true``)."""
        rid = request.request_id
        self._live.discard(rid)
        self._sync.discard(rid)  # told "synchronous", then aborted before its blocks came
        unstarted = self._unstarted.pop(rid, None) is not None  # aborted while its prefill had not begun
        self._probe_ms.pop(rid, None)
        self._covered.pop(rid, None)
        self._outgoing.pop(rid, None)  # finished before its prompt completed
        tid = _transfer(request)
        if tid is not None and unstarted:
            # It held no blocks and no load: nothing to cancel but the wait (said for operators).
            logger.info("kv wait cancelled req=%s transfer=%s: finished before a sender began", rid, tid.key)
        if tid is not None:
            if self._key_owner.get(tid.key) == rid:
                del self._key_owner[tid.key]
            # Aborted before admission, or loaded nothing: no load will come from it.
            self._planned(rid, tid.key)
        key = {"transfer_key": tid.key} if tid is not None and _asked_for_key(request) else {}
        if rid in self._gave_up:  # no sender began its transfer: computed here
            self._gave_up.discard(rid)
            return False, {RESPONSE_KEY: {**key, "loaded_tokens": 0, "load_failed": True}}
        save = self._saving.pop(rid, None)
        if save is not None:
            # With PUT_ASYNC the send may still be running: this says what was
            # handed to the sender, not what arrived.
            return save.delay_free, {RESPONSE_KEY: {**key, "send_type": self._cfg.send_type,
                                              "prompt_tokens": save.num_tokens,
                                              "shipped_blocks": len(save.block_ids),
                                              "skipped_blocks": save.first_block}}
        load = self._loaded.pop(rid, None)
        if load is not None:
            failed = rid in self._failed_loads
            self._failed_loads.discard(rid)
            return False, {RESPONSE_KEY: {**key, "loaded_tokens": 0 if failed else load.num_tokens,
                                    "load_failed": failed}}
        return False, None

    def shutdown(self) -> None:
        if self._registrar is not None:
            self._registrar.stop()
        if self._probe is not None:
            self._probe.close()

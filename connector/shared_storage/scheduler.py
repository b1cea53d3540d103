"""Scheduler-side half of the SharedStorageConnector (vLLM's EngineCore process).

Consumer: for a waiting request, count the stored blocks that continue its local
prefix-cache hit (file existence, per worker rank) and claim them as external
tokens, loaded asynchronously. A request the proxy sent to a producer first (its
id carries a transfer) also claims the blocks the producer was told to store but
has not written yet: the loader waits for them up to ``kv_load_timeout_s``. One asked
before P answered (the proxy's early mark, concurrent dispatch) waits without blocks
until P's first file is there (up to ``kv_prefill_wait_s``; P may be queued), then as
above; meanwhile the worker's idle steps wait instead of spinning.

Producer: each step, the prompt's blocks completed by that step (chunked prefill
included) are handed to the workers to store, each once per request.

One token is always left for vLLM to compute (it needs logits): a block that
holds the prompt's last token is loaded whole but claimed one token short, and
vLLM rewrites that token's slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connector.log import get_logger
from connector.registration import Registrar, heartbeat_load
from connector.scheduler_output import tokens_computed_before
from connector.shared_storage import keys as kvkeys
from connector.shared_storage.config import SharedStorageConfig
from connector.shared_storage.metadata import FetchSpec, SharedStorageMetadata, StoreSpec
from connector.shared_storage.store import is_stored
from connector.stats import XpydStats
from connector.tracing import LOAD, SEND, TransferSpans
from xpyd_wire import request_id
from xpyd_wire.discovery import Load
from xpyd_wire.kv_transfer import RESPONSE_KEY

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _Claim:
    """The answer get_num_new_matched_tokens gave (it may be asked again)."""

    local_tokens: int
    first_block: int
    end_block: int
    external_tokens: int
    wait_s: float


@dataclass(slots=True)
class _Req:
    request: "Request"
    seed: bytes
    keys: list[bytes]
    stored: int = 0  # producer: prompt blocks [0, stored) handed to the writer
    claim: _Claim | None = None
    load: FetchSpec | None = None  # the load in flight or last done
    load_claim: _Claim | None = None
    loads: int = 0
    loaded_tokens: int = 0
    load_failed: bool = False


class SharedStorageScheduler:
    def __init__(self, cfg: SharedStorageConfig, block_size: int, world_size: int, model_id: str,
                 start_registrar: bool = True, spans: TransferSpans | None = None) -> None:
        self._cfg = cfg
        self._bs = block_size
        self._world = world_size
        self._model_id = model_id
        self._reqs: dict[str, _Req] = {}
        self._new_loads: list[FetchSpec] = []
        # Requests asked before P answered whose producer has stored no file yet -> since when.
        self._awaiting: dict[str, float] = {}
        self._kvm: KVCacheManager | None = None
        self._running = 0
        self._queue_usage = 0.0  # the workers' writer queues, from their stats
        self._spans = spans  # the requests' kv load/store spans (connector/tracing.py); None: not tracing
        self._registrar = (
            Registrar(cfg.base, self.load_report)
            if start_registrar and cfg.base.proxies and cfg.base.http_port else None
        )

    def bind(self, kv_cache_manager: "KVCacheManager") -> None:
        self._kvm = kv_cache_manager

    def load_report(self) -> Load:
        return heartbeat_load(self._kvm, self._running, len(self._reqs), self._queue_usage, len(self._awaiting))

    # ---- keys ----
    def _state(self, request: "Request") -> _Req | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            if request.prompt_token_ids is None or request.mm_features:
                return None  # prompt embeddings / multimodal: tokens do not determine the KV
            lora = request.lora_request.lora_name if request.lora_request is not None else None
            seed = kvkeys.root(self._model_id, self._bs, lora, request.cache_salt)
            st = _Req(request, seed, [])
            self._reqs[request.request_id] = st
        return st

    def _keys(self, st: _Req, n_blocks: int) -> list[bytes]:
        """The chain keys of the request's first n_blocks full blocks (extended lazily)."""
        have = len(st.keys)
        if n_blocks > have:
            tokens = st.request.all_token_ids[:n_blocks * self._bs]
            st.keys.extend(kvkeys.chain(st.seed, tokens, self._bs, start=have,
                                        prev=st.keys[-1] if st.keys else None))
        return st.keys[:n_blocks]

    def _stored(self, key: bytes) -> bool:
        k = kvkeys.name(key)
        return all(is_stored(self._cfg.path, k, r, self._world) for r in range(self._world))

    def _producer_asked(self, request: "Request") -> request_id.TransferId | None:
        """The transfer of a request the proxy sent to a producer too, which stores its prompt."""
        tid = request_id.transfer_of(request.request_id, request.kv_transfer_params)
        if tid is None:
            return None
        return tid if self._cfg.role == "kv_consumer" or tid.decode_addr == self._cfg.base.advertised_address else None

    def _traced(self, request: "Request", role: str, tid: request_id.TransferId | None = None) -> None:
        """The request's span, when vLLM traces it: a load's starts now, a store's at its first part.
        ``tid``: the request's transfer when the caller has it (else read from its id)."""
        if self._spans is None or not getattr(request, "trace_headers", None):
            return
        if tid is None:
            tid = request_id.transfer_of(request.request_id, request.kv_transfer_params)
        self._spans.seen(request, role, tid.key if tid is not None else None)

    def _not_begun(self, st: _Req, request: "Request", tid: request_id.TransferId) -> tuple[int | None, bool]:
        """Asked before P answered (concurrent dispatch) and none of P's files is here: P is
        queued or computing. Like the P2P consumer, wait without blocks (None: ask again next
        step) for kv_prefill_wait_s, then compute the prompt here."""
        now = time.monotonic()
        since = self._awaiting.setdefault(request.request_id, now)
        if now - since < self._cfg.base.kv_prefill_wait_s:
            self._traced(request, LOAD, tid)  # its wait for P is part of the load (asked every step)
            return None, False
        del self._awaiting[request.request_id]
        st.load_failed = True  # not asked again: computed here
        if self._spans is not None:
            self._spans.gave_up(request.request_id, "no_sender")
        logger.error("kv storage wait timed out req=%s: no file of the producer's in %.1fs; computing the prompt here",
                     request.request_id, self._cfg.base.kv_prefill_wait_s)
        return 0, False

    # ---- vLLM hooks ----
    def on_new_request(self, request: "Request") -> None:
        self._state(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._cfg.is_consumer:
            return 0, False
        st = self._state(request)
        if st is None or st.load_failed:
            return 0, False  # a load of it failed once: recompute rather than retry
        limit = request.num_tokens - 1  # vLLM computes at least one token itself
        usable = min(_cdiv(limit, self._bs), request.num_tokens // self._bs)
        first = num_computed_tokens // self._bs
        if first >= usable:
            return 0, False
        keys = self._keys(st, usable)
        hit = first
        while hit < usable and self._stored(keys[hit]):
            hit += 1
        wait_s = 0.0
        if hit < usable and st.loads == 0 and (tid := self._producer_asked(request)) is not None:
            expected = min(usable, request.num_prompt_tokens // self._bs)
            if expected > hit:
                if tid.early and hit == first:
                    return self._not_begun(st, request, tid)
                self._awaiting.pop(request.request_id, None)
                hit, wait_s = expected, self._cfg.base.kv_load_timeout_s
        ext = min(hit * self._bs, limit) - num_computed_tokens
        if ext <= 0:
            return 0, False
        st.claim = _Claim(num_computed_tokens, first, hit, ext, wait_s)
        self._traced(request, LOAD)
        return ext, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.claim is None:
            return
        c, st.claim = st.claim, None
        if num_external_tokens != c.external_tokens:  # vLLM trimmed the claim
            c = _Claim(c.local_tokens, c.first_block, _cdiv(c.local_tokens + num_external_tokens, self._bs),
                       num_external_tokens, c.wait_s)
        block_ids = blocks.get_block_ids()[0][c.first_block:c.end_block]
        spec = FetchSpec(
            req_id=request.request_id,
            block_ids=tuple(block_ids),
            keys=tuple(kvkeys.name(k) for k in st.keys[c.first_block:c.end_block]),
            first_index=c.first_block,
            wait_s=c.wait_s,
        )
        self._new_loads.append(spec)
        st.load, st.load_claim = spec, c
        st.loads += 1
        if self._spans is not None:
            self._spans.planned(request.request_id, {
                "xpyd.kv.tokens": num_external_tokens, "xpyd.kv.local_hit": c.local_tokens,
                "xpyd.kv.blocks": len(block_ids), "xpyd.kv.first_block": c.first_block,
                "xpyd.kv.waited_for_producer": c.wait_s > 0})
        logger.info("kv storage load planned req=%s local_hit=%d external=%d blocks=%d first_block=%d wait_s=%.1f",
                    request.request_id, c.local_tokens, num_external_tokens, len(block_ids), c.first_block,
                    c.wait_s)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> SharedStorageMetadata:
        meta = SharedStorageMetadata(loads=self._new_loads, idle=scheduler_output.total_num_scheduled_tokens == 0,
                                     awaiting=bool(self._awaiting))
        self._new_loads = []
        self._running = len(scheduler_output.num_scheduled_tokens)
        if self._cfg.is_producer:
            self._plan_stores(scheduler_output, meta)
        return meta

    def _plan_stores(self, so: "SchedulerOutput", meta: SharedStorageMetadata) -> None:
        computed_before = tokens_computed_before(so)
        for rid, n_sched in so.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None or rid not in computed_before:
                continue
            n_prompt = st.request.num_prompt_tokens
            if st.stored >= n_prompt // self._bs:
                continue
            full = min(computed_before[rid] + n_sched, n_prompt) // self._bs
            if full <= st.stored:
                continue
            assert self._kvm is not None, "kv cache manager not bound"
            keys = self._keys(st, full)
            block_ids = self._kvm.get_block_ids(rid)[0][st.stored:full]
            meta.stores.append(StoreSpec(rid, tuple(block_ids), tuple(kvkeys.name(k) for k in keys[st.stored:full]),
                                         st.stored))
            st.stored = full
            if self._spans is not None:
                self._traced(st.request, SEND)
                self._spans.part_planned(rid, {"xpyd.kv.blocks": full, "xpyd.kv.tokens": n_prompt})

    def update_connector_output(self, finished_recving: set[str], invalid_block_ids: set[int],
                                stats: object = None) -> None:
        for rid in finished_recving:
            st = self._reqs.get(rid)
            if st is None or st.load is None or st.load_claim is None:
                continue
            spec, c = st.load, st.load_claim
            bad = next((i for i, b in enumerate(spec.block_ids) if b in invalid_block_ids), None)
            if bad is None:
                st.loaded_tokens = c.external_tokens
            else:
                good_end = (spec.first_index + bad) * self._bs
                st.loaded_tokens = max(0, min(c.external_tokens, good_end - c.local_tokens))
                st.load_failed = True
        if isinstance(stats, XpydStats) and stats.has_buffers():
            self._queue_usage = stats.buffer_usage()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Nothing to keep (stores copied their blocks out in the step that computed
        them); the params reach the client as ``kv_transfer_params: {"xpyd": ...}``."""
        st = self._reqs.pop(request.request_id, None)
        self._awaiting.pop(request.request_id, None)  # aborted while P had stored nothing
        if st is None or (st.stored == 0 and st.load is None):
            return False, None
        info: dict[str, Any] = {"storage": "shared"}
        if st.stored:
            info["stored_blocks"] = st.stored
        if st.load is not None:
            info.update(loaded_tokens=st.loaded_tokens, load_failed=st.load_failed,
                        waited_for_producer=st.load.wait_s > 0)
        return False, {RESPONSE_KEY: info}

    def shutdown(self) -> None:
        if self._registrar is not None:
            self._registrar.stop()

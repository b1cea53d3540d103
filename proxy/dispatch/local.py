"""D prefills the prompt itself: the rules that pick a local path, and the path.

A plain request id (xpyd_wire.request_id.build_local) tells D's connector there is no KV to
load, so D computes the prompt as a colocated server would."""

from __future__ import annotations

import time

from proxy.config import ProxyConfig
from proxy.dispatch.call import (
    DISAGGREGATED,
    LOCAL_CACHED,
    LOCAL_NO_PREFILL,
    LOCAL_PROMPT_LOGPROBS,
    LOCAL_SHORT,
    LOCAL_VERDICT,
    Call,
)
from proxy.dispatch.decode import Decode
from proxy.dispatch.first_token import lax_bool
from proxy.dispatch.relay import Answer
from proxy.errors import ProxyError
from proxy.metrics import Metrics
from proxy.openai_api import COMPLETIONS
from proxy.registry import Instance
from proxy.request import RouteRequest
from proxy.routing.selection import Selector
from xpyd_wire import request_id
from xpyd_wire.headers import XPYD_PATH_RAW


def choose_path(cfg: ProxyConfig, selector: Selector, req: RouteRequest, d: Instance) -> str:
    """The path for `req` on D `d`: disaggregated, or one of the local ones (and why)."""
    if req.verdict:
        return LOCAL_VERDICT
    if _wants_prompt_logprobs(req):
        return LOCAL_PROMPT_LOGPROBS
    if not selector.available("P", req.model):
        if not cfg.fallback_to_decode:
            raise ProxyError(503, "no prefill instance is available", "no_prefill_instance")
        return LOCAL_NO_PREFILL
    threshold = cfg.local_prefill_threshold
    if threshold > 0:
        if req.tokens < threshold:
            return DISAGGREGATED if _streaming(d) else LOCAL_SHORT
        left = selector.uncached_tokens("D", d, req)
        if left is not None and left < threshold:
            return LOCAL_CACHED
    return DISAGGREGATED


def _streaming(d: Instance) -> bool:
    """Whether D is relaying another answer of this proxy: D's own prefill of a short prompt
    would then sit between that answer's tokens (on the CPU bench a 256-token prompt's is an
    80-90 ms step against ~10 ms ones); through P, D only loads the KV, and under concurrent
    dispatch the prompt's TTFT barely moves. An answer whose last bytes went out (done) no
    longer counts: D's body end, which the relay still awaits, stalls no one."""
    return any(not f.done for f in d.relaying)


class Local:
    def __init__(self, metrics: Metrics, decode: Decode) -> None:
        self.metrics = metrics
        self.decode = decode

    async def answer(self, call: Call, d: Instance, path: str, limit: float | None = None) -> Answer:
        """D prefills the prompt itself: a plain request id, so its connector loads nothing."""
        call.went_local = True
        self.metrics.dispatch(path)
        rid = request_id.build_local()
        call.flight.extra.append((XPYD_PATH_RAW, path.encode()))
        headers = {**call.req.headers, "x-request-id": rid}
        t = time.perf_counter()
        opening = self.decode.open(call.req, d, headers)
        answer = await self.decode.first_bytes(call.loop, d, opening, headers, limit, call.req.client_id)
        self.decode.observe_ttfb(call, t)
        return answer


def _wants_prompt_logprobs(req: RouteRequest) -> bool:
    """The answer carries the prompt's logprobs, which vLLM computes in the prefill (a
    completion's echo with logprobs, or prompt_logprobs on either endpoint), or no new token
    at all (echo with max_tokens 0: the prompt scored, nothing to decode)."""
    body = req.body
    if body.get("prompt_logprobs") is not None:
        return True
    # echo as vLLM's request model reads a bool: 1 and "yes" are true too
    return req.path == COMPLETIONS and lax_bool(body.get("echo")) is True and (
        body.get("logprobs") is not None or body.get("max_tokens") == 0)

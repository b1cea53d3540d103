"""What every dispatch path shares: the request's Call, the path names, DecodeFailed.

The paths (each one module, each an object whose ``answer(call, d, ...)`` returns D's
opened Answer or raises):
- disaggregated.py: P prefills (retried on another P), D decodes from P's KV; with the first
  token from P, P's token may be the whole answer (prefill_alone);
- continuation.py: the first token from P goes to the client at once, D's continuation after;
- local.py: D prefills the prompt itself (the path rules say when);
- rescue.py: D alone, once, after every disaggregated attempt failed before D's first byte;
- decode.py: what they all do with D: open its answer, judge its first bytes, shape its errors.
dispatcher.py runs them: the retry across D, the choice of path, the relay of the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from proxy.asgi import Flight, Send
from proxy.errors import ProxyError
from proxy.request import RouteRequest
from proxy.tracing import RequestTrace

# Dispatch paths, as counted in xpyd_dispatch_total.
DISAGGREGATED = "disaggregated"
LOCAL_SHORT = "local_short"  # prompt below local_prefill_threshold
LOCAL_CACHED = "local_cached"  # D holds all but a short tail of the prompt
LOCAL_NO_PREFILL = "local_no_prefill"  # no P live or reachable
LOCAL_RESCUE = "local_rescue"  # D failed disaggregated attempts before its first byte
PREFILL_ALONE = "prefill_alone"  # first-token mode, one token asked for: P's answer is all of it
# The answer needs the prompt's logprobs (echo with logprobs, prompt_logprobs): vLLM computes
# them in the prefill, so D would recompute the whole prompt and load none of P's KV.
LOCAL_PROMPT_LOGPROBS = "local_prompt_logprobs"
# A request the proxy cannot read (not JSON, not the shape it routes by, a model no instance
# lists): one D's vLLM judges it, so the client gets vLLM's own answer (its 4xx, or the
# answer where vLLM accepts what the proxy could not read).
LOCAL_VERDICT = "local_verdict"
# A Responses request that follows a stored response (previous_response_id): only the D that
# stores it can render the conversation, and its prefix cache likely holds most of it.
LOCAL_STORED = "local_stored"


class DecodeFailed(Exception):
    """D failed before anything reached the client: the request may go to another D, or
    to D alone. Raised for D's 5xx (or a stream's server error event before any generated
    content), a refused, reset or dropped connection, a connect timeout and an invalid
    response; not for D's 4xx (its verdict on the request, the same on any D), an answer
    over max_response_bytes (as large anywhere) nor a D silent for decode_ttfb_timeout
    (the deadline is spent): those are ProxyErrors, relayed."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(slots=True)
class Call:
    """What every step of one request needs."""

    req: RouteRequest
    send: Send
    flight: Flight
    t0: float  # perf_counter() at arrival
    loop: asyncio.AbstractEventLoop  # the request's (given, not looked up: see proxy/deadline.py)
    t_decode: float = 0.0  # when D's part began: P answered, or D was asked alone
    # When the current disaggregated attempt's D answer became due (P answered): a rescue
    # gets what is left of that attempt's decode_ttfb_timeout, never a new one.
    decode_due: float | None = None
    went_local: bool = False  # D was asked alone: a rescue would be a second try of that
    # A Responses answer that loaded P's KV: P's prompt-cache figures, told instead of D's.
    cache_usage: tuple[int, int] | None = None
    # Sends what the client connection holds now (proxy/serving/corked.py); None: not corked.
    flush: Callable[[], None] | None = None
    # The request's span (--tracing: proxy/tracing.py); None: tracing off.
    trace: RequestTrace | None = None

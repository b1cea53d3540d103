"""D alone, once, after every disaggregated attempt failed before D's first byte
(typically D's 500 for a KV load that failed: vLLM's kv_load_failure_policy=fail)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from proxy.config import ProxyConfig
from proxy.dispatch.call import LOCAL_RESCUE, Call, DecodeFailed
from proxy.dispatch.local import Local
from proxy.dispatch.relay import Answer
from proxy.errors import ProxyError
from proxy.registry import Instance
from proxy.routing.selection import Selector
from xpyd_wire.headers import XPYD_DECODE_INSTANCE_RAW

log = logging.getLogger("xpyd.proxy.dispatch")


class Rescue:
    def __init__(self, cfg: ProxyConfig, selector: Selector, local: Local,
                 serve: Callable[[Call, Instance, Answer], Awaitable[int]]) -> None:  # fmt: skip
        self.cfg = cfg
        self.selector = selector
        self.local = local
        self._serve = serve  # relays the answer (dispatcher.py): the status sent
        self._expose = cfg.expose_routing_headers

    async def run(self, call: Call, tried: list[Instance], failed: ProxyError, attempt: int) -> int:
        """Nothing reached the client, so the request may be redone; a plain request id makes
        D prefill itself. If this fails too, the client gets `failed`, as without it."""
        req = call.req
        due = call.decode_due if call.decode_due is not None else time.perf_counter()
        deadline = due + self.cfg.decode_ttfb_timeout
        if deadline <= time.perf_counter():
            log.warning("decode rescue skipped attempt=%d reason=deadline_spent", attempt)
            raise failed
        saved = list(call.flight.extra)  # the failed attempt's id, which `failed` quotes
        try:
            async with asyncio.timeout(deadline - time.perf_counter()):
                # An untried D if any; else any D: the one that failed when it is the only
                # one (a failed KV load leaves D healthy), cooling-down ones last.
                d = await self.selector.acquire("D", req, tried)
                if d is None:
                    d = await self.selector.acquire("D", req)
        except (TimeoutError, ProxyError) as e:  # no slot in time, or shed (429)
            log.warning("decode rescue skipped attempt=%d reason=no_slot error=%s", attempt, e)
            raise failed from None
        if d is None:  # every D left meanwhile
            log.warning("decode rescue skipped attempt=%d reason=no_instance", attempt)
            raise failed
        log.warning(
            "decode rescue: D alone instance=%s attempt=%d failed_status=%d error=%s",
            d.http_address, attempt, failed.status, failed.message,
        )  # fmt: skip
        try:
            call.flight.extra.clear()
            if self._expose:
                call.flight.extra.append((XPYD_DECODE_INSTANCE_RAW, d.http_address.encode()))
            if call.trace is not None:
                call.trace.instance("D", d.http_address, LOCAL_RESCUE)
            try:
                answer = await self.local.answer(call, d, LOCAL_RESCUE, deadline - time.perf_counter())
            except (DecodeFailed, ProxyError) as e:
                log.warning(
                    "decode rescue failed instance=%s attempt=%d error=%s relaying_status=%d",
                    d.http_address, attempt, e, failed.status,
                )  # fmt: skip
                call.flight.extra[:] = saved
                raise failed from None
            return await self._serve(call, d, answer)
        finally:
            self.selector.release(d, req)

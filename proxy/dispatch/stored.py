"""Finding the D that stores a response (proxy/routing/stored.py records them): from the
record, else by asking every live D for it (``GET /v1/responses/{id}``), within the probe
deadline. Used for follow-ups (``previous_response_id``: dispatcher.py) and for the stored
response routes (serving/passthrough.py)."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote

from proxy.config import ProxyConfig
from proxy.deadline import Deadline
from proxy.metrics import Metrics
from proxy.registry import Instance, Registry
from proxy.routing.stored import ResponseHolders
from proxy.upstream.base import Upstream, UpstreamError

log = logging.getLogger("xpyd.proxy.dispatch")

# A response id longer than this is not one vLLM made or accepts as a path segment here.
MAX_RESPONSE_ID = 256


def response_path(response_id: str) -> str:
    return "/v1/responses/" + quote(response_id, safe="")


class StoredResponses:
    def __init__(self, cfg: ProxyConfig, registry: Registry, metrics: Metrics, upstream: Upstream) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.upstream = upstream
        self.holders = ResponseHolders(registry, cfg.response_holders, cfg.response_holders_ttl)

    def record(self, response_id: str, d: Instance, usage: tuple[int, int] | None = None) -> None:
        self.holders.record(response_id, d, usage)

    def usage(self, response_id: str) -> tuple[int, int] | None:
        """P's prompt-cache figures the client was told for this response (rewrite.UsageRewrite)."""
        return self.holders.usage(response_id)

    async def locate(self, response_id: str, headers: dict[str, str]) -> Instance | None:
        """The D that stores `response_id`, or None when no live D answers that it does."""
        d = self.holders.holder(response_id)
        if d is not None or len(response_id) > MAX_RESPONSE_ID:
            return d
        found = await self._ask_every_d(response_id, {k: v for k, v in headers.items() if k != "content-type"})
        if found is not None:
            self.holders.record(response_id, found)
        return found

    async def _ask_every_d(self, response_id: str, headers: dict[str, str]) -> Instance | None:
        ds = list(self.registry.live("D"))
        if not ds:
            return None
        loop = asyncio.get_running_loop()
        path = response_path(response_id)

        async def ask(d: Instance) -> bool:
            try:
                async with Deadline.after(loop, self.cfg.probe_timeout):
                    resp = await self.upstream.request("GET", d.url + path, None, headers)
                    await resp.aclose()  # the status says it; the body may be large
            except (UpstreamError, TimeoutError) as e:
                kind = e.kind if isinstance(e, UpstreamError) else "timeout"
                self.metrics.upstream_error("D", d.http_address, kind)
                log.warning("stored response lookup failed instance=%s error=%s", d.http_address, kind)
                return False
            return resp.status == 200

        answers = await asyncio.gather(*(ask(d) for d in ds))
        for d, has in zip(ds, answers):
            if has:
                log.info("stored response found response_id=%s instance=%s", response_id, d.http_address)
                return d
        return None

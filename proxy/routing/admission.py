"""Admission control: a per-instance in-flight limit and a bounded FIFO wait queue per role.

A request whose every candidate is at its limit waits here. A slot that frees (release) or
appears (an instance joins) is handed straight to the first waiter that may use it, so
waiters are served in arrival order and a newcomer never overtakes them. A full queue or a
wait past its deadline is shed with 429 + Retry-After (OpenAI's rate_limit_error).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from proxy.errors import ProxyError
from proxy.metrics import Metrics
from proxy.registry import Instance, Registry
from proxy.request import RouteRequest

log = logging.getLogger("xpyd.proxy.admission")

# Seconds a shed client is told to wait: the proxy has no service-rate estimate, and a
# short hint keeps well-behaved clients (the OpenAI SDK honours it) retrying promptly.
RETRY_AFTER_S = 1


@dataclass(slots=True, eq=False)
class _Waiter:
    req: RouteRequest
    exclude: Collection[Instance]
    fut: asyncio.Future[Instance]


@dataclass(frozen=True, slots=True)
class Limits:
    limit: int  # requests in flight per instance
    size: int  # most requests waiting
    timeout: float  # seconds one wait may last


class Slots(Protocol):
    """Who counts a request in flight on an instance (the Selector)."""

    def take(self, inst: Instance, req: RouteRequest) -> None: ...

    def release(self, inst: Instance, req: RouteRequest) -> None: ...


class WaitQueue:
    """The waiters for one role's instances, each limited to `limit` requests in flight."""

    def __init__(self, role: str, limits: Limits, registry: Registry, metrics: Metrics,
                 slots: Slots) -> None:  # fmt: skip
        self.role = role
        self.limit = limits.limit
        self.size = limits.size
        self.timeout = limits.timeout
        self.registry = registry
        self.metrics = metrics
        self._take = slots.take
        self._release = slots.release
        self.waiters: deque[_Waiter] = deque()
        self._depth = metrics.queue_depth.labels(role)

    async def wait(self, req: RouteRequest, exclude: Collection[Instance]) -> Instance:
        """Wait for a slot on an instance of req's pool (not in `exclude`); the slot is
        already counted as in flight when this returns. Raises ProxyError 429."""
        if len(self.waiters) >= self.size:
            raise self._shed("queue_full", f"{len(self.waiters)} requests already waiting")
        fut: asyncio.Future[Instance] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(req, exclude, fut)
        self.waiters.append(waiter)
        self._depth.set(len(self.waiters))
        try:
            async with asyncio.timeout(self.timeout):
                return await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # handed a slot as the deadline hit
                return fut.result()
            raise self._shed("queue_timeout", f"no slot freed within {self.timeout}s") from None
        except BaseException:
            # Cancelled (the client left) after a slot was handed over: pass it on.
            if fut.done() and not fut.cancelled():
                self._release(fut.result(), req)
            raise
        finally:
            if not fut.done():
                fut.cancel()
            try:
                self.waiters.remove(waiter)
            except ValueError:
                pass  # offer() already took it out
            self._depth.set(len(self.waiters))

    def offer(self, inst: Instance) -> None:
        """`inst` may have room: hand it to the first waiters that can use it."""
        if not self.waiters or not inst.healthy:
            return
        live = self.registry.live(self.role)
        if inst not in live:  # removed meanwhile: nobody should be sent there
            return
        while inst.in_flight < self.limit:
            waiter = self._first_for(inst)
            if waiter is None:
                return
            self.waiters.remove(waiter)
            self._take(inst, waiter.req)
            waiter.fut.set_result(inst)
        self._depth.set(len(self.waiters))

    def _first_for(self, inst: Instance) -> _Waiter | None:
        for waiter in self.waiters:
            if waiter.fut.done() or inst in waiter.exclude:
                continue
            model = waiter.req.model
            if model is None or self.registry.serves(inst, model):
                return waiter
        return None

    def _shed(self, reason: str, detail: str) -> ProxyError:
        self.metrics.shed(reason)
        log.warning("request shed role=%s reason=%s %s", self.role, reason, detail)
        return ProxyError(
            429,
            f"every {'prefill' if self.role == 'P' else 'decode'} instance is at its in-flight "
            f"limit ({self.limit}) and {detail}; retry later",
            reason,
            headers={"retry-after": str(RETRY_AFTER_S)},
        )

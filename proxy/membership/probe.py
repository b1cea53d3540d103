"""What the proxy asks the instances by itself: whether a newly discovered instance answers at
all (its join probe: /v1/models, else /health; until one answers it stays pending, never
selected), each instance's models (/v1/models, on joining and every models_refresh_interval)
and the health of static instances (/health, every health_interval). Every probe has a
deadline (probe_timeout); a failed probe is logged and counted, never fatal: an instance
whose models are unknown stays eligible for any model. Join probes go to addresses that anyone
who reaches the discovery port may advertise, so they are bounded: probe_concurrency at once,
retries only in free slots, failures logged at a limited rate and not counted per address."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import orjson

from proxy.config import ProxyConfig
from proxy.credentials import probe_headers
from proxy.membership.discovery import LogLimiter
from proxy.membership.static import parse_static
from proxy.metrics import Metrics
from proxy.registry import Instance, Registry
from proxy.upstream.base import Upstream, UpstreamError

log = logging.getLogger("xpyd.proxy.probe")

# A probe's answer (/health, /v1/models) is read whole: at most this much (or
# max_response_bytes when smaller). vLLM's model cards are under 1 KiB each.
PROBE_MAX_BYTES = 4 * 1024 * 1024
# A join probe that failed so got no HTTP answer at all (refused, unreachable, silent, not
# HTTP): /health would fail the same way, so it is not asked.
_UNREACHED = frozenset({"connect", "connect_timeout", "timeout", "disconnect", "protocol"})


class ProbeError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Prober:
    def __init__(
        self, cfg: ProxyConfig, registry: Registry, metrics: Metrics, upstream: Upstream
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.upstream = upstream
        # The upstream key, not the clients' one (proxy/credentials.py has the rule).
        self._headers = probe_headers(cfg)
        self._max_bytes = min(cfg.max_response_bytes, PROBE_MAX_BYTES)
        self.static: list[Instance] = []
        self._fetching: dict[Instance, asyncio.Task[bool]] = {}
        self._models_at: dict[Instance, float] = {}  # monotonic time of the last success
        # (instance, what): one warning per failing probe until it succeeds again.
        self._warned: set[tuple[Instance, str]] = set()
        self._task: asyncio.Task | None = None
        # Join probes of pending instances (one task each, in flight or waiting for a slot).
        self._join_slots = asyncio.Semaphore(cfg.probe_concurrency)
        self._joining: dict[Instance, asyncio.Task[bool]] = {}
        self._tried_at: dict[Instance, float] = {}  # monotonic start of the last join probe
        self._join_log = LogLimiter()

    async def start(self) -> None:
        for role, specs in (("P", self.cfg.prefill), ("D", self.cfg.decode)):
            for spec in specs:
                s = parse_static(role, spec)
                self.static.append(self.registry.add_static(role, s.http_address, s.zmq_address,
                                                           s.kv_events))
        self.registry.listeners.append(self._joined)
        self.registry.pending_listeners.append(self._registered)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="xpyd-probe")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._fetching.values(), *self._joining.values())
                 if t is not None]  # fmt: skip
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._task = None
        self._fetching.clear()
        self._joining.clear()

    # ------------------------------------------------------------------ joining

    def _registered(self, inst: Instance) -> None:
        if self._task is not None:  # probe it right away, off the registration path
            self.admit_soon(inst)

    def admit_soon(self, inst: Instance) -> asyncio.Task[bool]:
        return _once(self._joining, inst, self.admit)

    async def admit(self, inst: Instance) -> bool:
        """The join probe of a pending instance: it becomes a routing candidate once it
        answers /v1/models (its models learned on the way) or, when that answers with an
        error (no models route, a key the proxy lacks), /health. True once admitted."""
        models_error: ProbeError | None = None
        async with self._join_slots:
            if not inst.pending or not self.registry.holds(inst):
                return not inst.pending  # admitted meanwhile, or gone
            self._tried_at[inst] = time.monotonic()
            try:
                models = _parse_models(await self._get(inst, "/v1/models"))
            except ProbeError as e:
                models, models_error = None, e
                if e.kind in _UNREACHED:
                    self._unanswered(inst, e)
                    return False
                try:
                    await self._get(inst, "/health")
                except ProbeError as e2:
                    self._unanswered(inst, e2)
                    return False
        if not self.registry.holds(inst):
            return False  # expired or left while we asked
        # It answered: from here on it is an instance like any other (counted, logged).
        if models is not None:
            self._warned.discard((inst, "models"))
            self._models_at[inst] = time.monotonic()
            self.registry.set_models(inst, models)
        elif models_error is not None:
            self._failed(inst, "models", models_error)
        self.registry.admit(inst)
        return True

    def _unanswered(self, inst: Instance, e: ProbeError) -> None:
        first = inst.probe_error is None
        inst.probe_error = e.kind
        # Not in xpyd_upstream_errors_total: a label per address that anyone may advertise
        # would grow /metrics without bound (xpyd_instances_pending counts them instead).
        if first and self._join_log.allow(time.monotonic()):
            log.warning("instance not answering, kept pending (never selected) role=%s "
                        "instance=%s kind=%s error=%s suppressed_since_last=%d", inst.role,
                        inst.http_address, e.kind, e, self._join_log.take_suppressed())  # fmt: skip
        else:
            log.debug("instance still not answering role=%s instance=%s kind=%s",
                      inst.role, inst.http_address, e.kind)  # fmt: skip

    def _retry_pending(self) -> None:
        """Ask the pending instances again (one may have registered before its HTTP server
        was up). Retries take only free slots, least recently tried first: a new instance's
        first probe never queues behind a crowd of dead addresses being retried."""
        free = self.cfg.probe_concurrency - len(self._joining)
        if free <= 0:
            return
        waiting = [i for i in self.registry.pending() if i not in self._joining]
        waiting.sort(key=lambda i: self._tried_at.get(i, 0.0))
        for inst in waiting[:free]:
            self.admit_soon(inst)

    # ------------------------------------------------------------------ models

    def _joined(self, inst: Instance) -> None:
        # A static instance healthy again: its models may have changed. (A discovered one
        # joins through admit(), which has just asked.)
        if self._task is not None and inst.static:
            self.fetch_models_soon(inst)

    def fetch_models_soon(self, inst: Instance) -> asyncio.Task[bool]:
        return _once(self._fetching, inst, self.fetch_models)

    async def fetch_models(self, inst: Instance) -> bool:
        """Learn inst's models from its /v1/models; False (logged) when that fails."""
        try:
            data = await self._get(inst, "/v1/models")
            models = _parse_models(data)
        except ProbeError as e:
            self._failed(inst, "models", e)
            return False
        self._warned.discard((inst, "models"))
        self._models_at[inst] = time.monotonic()
        self.registry.set_models(inst, models)
        return True

    async def learn_unknown(self) -> None:
        """Fetch the models of every live instance that has none known yet (for /v1/models)."""
        unknown = [i for i in self.registry.all() if i.models is None]
        if unknown:
            await asyncio.gather(*(self.fetch_models_soon(i) for i in unknown))

    # ------------------------------------------------------------------ health

    async def check_health(self, inst: Instance) -> bool:
        try:
            await self._get(inst, "/health")
        except ProbeError as e:
            self._failed(inst, "health", e)
            self.registry.set_healthy(inst, False)
            return False
        self._warned.discard((inst, "health"))
        self.registry.set_healthy(inst, True)
        return True

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        cfg = self.cfg
        while True:
            try:
                if self.static:
                    await asyncio.gather(*(self.check_health(i) for i in self.static))
                now = time.monotonic()
                for inst in self.registry.all():
                    learned = self._models_at.get(inst)
                    # Unknown models are retried every tick, known ones refreshed.
                    if learned is None or now - learned >= cfg.models_refresh_interval:
                        self.fetch_models_soon(inst)
                self._retry_pending()
                # Forget instances that are gone (discovered ones are new objects on return).
                known = set(self.registry.every())
                for table in (self._models_at, self._fetching, self._tried_at):
                    for inst in [i for i in table if i not in known]:
                        table.pop(inst, None)
                self._warned = {w for w in self._warned if w[0] in known}
            except Exception as e:  # a bug here must not stop health checking
                log.exception("probe round failed: %s", e)
            await asyncio.sleep(cfg.health_interval)

    # ------------------------------------------------------------------ plumbing

    async def _get(self, inst: Instance, path: str) -> bytes:
        try:
            async with asyncio.timeout(self.cfg.probe_timeout):
                resp = await self.upstream.request("GET", inst.url + path, None, self._headers)
                try:
                    data = await resp.read(self._max_bytes)
                finally:
                    await resp.aclose()
        except TimeoutError:
            raise ProbeError("timeout", f"no answer within {self.cfg.probe_timeout}s") from None
        except UpstreamError as e:
            raise ProbeError(e.kind, str(e)) from None
        if not 200 <= resp.status < 300:
            raise ProbeError(f"http_{resp.status}", f"HTTP {resp.status}: {data[:200]!r}")
        return data

    def _failed(self, inst: Instance, what: str, e: ProbeError) -> None:
        self.metrics.upstream_error(inst.role, inst.http_address, f"{what}_{e.kind}")
        level = logging.DEBUG if (inst, what) in self._warned else logging.WARNING
        self._warned.add((inst, what))
        log.log(level, "probe failed what=%s role=%s instance=%s kind=%s error=%s",
                what, inst.role, inst.http_address, e.kind, e)  # fmt: skip


def _once(tasks: dict[Instance, asyncio.Task[bool]], inst: Instance,
          probe: Callable[[Instance], Awaitable[bool]]) -> asyncio.Task[bool]:
    """The task running probe(inst), started unless one is running already; it leaves
    ``tasks`` when done."""
    task = tasks.get(inst)
    if task is None or task.done():
        task = asyncio.get_running_loop().create_task(probe(inst))
        tasks[inst] = task
        task.add_done_callback(lambda t: tasks.pop(inst, None) if tasks.get(inst) is t else None)
    return task


def _parse_models(data: bytes) -> dict[str, dict]:
    try:
        body = orjson.loads(data)
    except ValueError:
        raise ProbeError("invalid", "/v1/models is not JSON") from None
    items = body.get("data") if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise ProbeError("invalid", "/v1/models has no 'data' list")
    models = {}
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("id"), str) and item["id"]:
            models[item["id"]] = item
    if not models:
        raise ProbeError("invalid", "/v1/models lists no model")
    return models

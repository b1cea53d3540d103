"""LoRA adapters on every instance: the admin routes POST /v1/load_lora_adapter and
/v1/unload_lora_adapter fanned out to every live P and D, and the adapters loaded through the
proxy loaded again on each instance that joins (or comes back) without them.

- Who may: "Authorization: Bearer <--admin-api-key>", never the clients' --api-key; without
  an admin key the routes answer 404, as a vLLM without runtime LoRA updating does.
- What goes out: the body and Content-Type as the admin sent them (each vLLM parses and
  judges them), with the credentials of the proxy's own requests (proxy/credentials.py), to
  every live instance serving the base model (several served: name it, ?base_model=NAME),
  each under --adapter-timeout. Then every instance asked is asked its /v1/models again, so
  that routing (Registry.pool: an adapter's pool holds only the instances that list it)
  sees the change before the answer goes out.
- What comes back: vLLM's own answer when the instances agree: its 200 and "Success: ..."
  text when all succeeded, its status and error body when each refused alike (the adapter
  directory does not exist: 404 everywhere); otherwise 502 in the OpenAI error shape with an
  entry per instance, never a 200. Unloading counts an instance that did not hold the
  adapter (vLLM's 404) as done when another unloaded it. Every answer carries x-xpyd-fanout
  (role, /instances label or, with --expose-routing-headers, address, and status or
  failure, per instance). The fan-out runs to its end even if the admin hangs up.
- Joining: the adapters loaded through this proxy (at most --max-adapters; each load body
  at most 64 KiB) are kept in this object. An instance that becomes a candidate, or whose
  models change, and lacks one of them is loaded with it; until its /v1/models lists the
  adapter it is no candidate for it (Registry.serves). A failure is logged and counted
  (xpyd_adapter_syncs_total{result="failed"}) and leaves it out of that adapter's pool. A
  static instance back from unhealthy may have restarted: the kept adapters are struck from
  its models until it is asked again. Changes and syncs run one at a time (one lock).

The SageMaker-style routes vLLM also serves (POST /adapters, DELETE /adapters/{name}) are
not: they are the same operation in SageMaker's container contract (another body, other
answers, adapter ids in headers for /invocations), called by SageMaker on a container it runs,
not by a client through a router; one admin path keeps one set of answers to keep exact.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs

import orjson

from proxy.asgi import ClientGone, Headers, Receive, Scope, Send, read_body, send_error
from proxy.config import ProxyConfig
from proxy.credentials import probe_headers
from proxy.errors import ProxyError, error_dict
from proxy.membership.probe import Prober
from proxy.metrics import Metrics
from proxy.registry import Instance, Registry
from proxy.upstream.base import Upstream, UpstreamError
from xpyd_wire.headers import XPYD_FANOUT_RAW

log = logging.getLogger("xpyd.proxy.adapters")

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
ROUTES = (LOAD, UNLOAD)
MAX_BODY_BYTES = 64 * 1024  # vLLM's load body: a name, a path, two flags
MAX_ANSWER_BYTES = 64 * 1024  # vLLM's answers here: a line of text or a small error


@dataclass(frozen=True, slots=True)
class Kept:
    """An adapter loaded through this proxy, as it was asked for (sent again to joiners)."""

    name: str
    body: bytes
    content_type: str | None
    base: str | None  # the base model named with ?base_model= (None: every instance's)


@dataclass(slots=True)
class Result:
    """One instance's answer to a load or unload."""

    inst: Instance
    status: int | None  # None: no HTTP answer (kind says why)
    body: bytes = b""
    content_type: str | None = None
    kind: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


class _Route:
    """A raw ASGI app for one admin route (an object: Starlette mounts it as an app)."""

    __slots__ = ("adapters", "path")

    def __init__(self, adapters: Adapters, path: str) -> None:
        self.adapters = adapters
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.adapters.handle(self.path, scope, receive, send)


class Adapters:
    def __init__(self, cfg: ProxyConfig, registry: Registry, metrics: Metrics, upstream: Upstream,
                 prober: Prober, name_of: Callable[[Instance], str]) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.upstream = upstream
        self.prober = prober
        self.name_of = name_of  # how answers and logs name an instance
        self._admin = ("Bearer " + cfg.admin_api_key).encode() if cfg.admin_api_key else None
        self._auth = probe_headers(cfg)  # the proxy's own requests' credentials
        self.kept: dict[str, Kept] = {}  # in load order
        self._lock = asyncio.Lock()
        self._syncing: dict[Instance, asyncio.Task] = {}
        self._running = False

    def endpoint(self, path: str) -> _Route:
        return _Route(self, path)

    def start(self) -> None:
        self.registry.listeners.append(self._joined)
        self.registry.models_listeners.append(self._changed)
        self._running = True

    async def stop(self) -> None:
        self._running = False
        tasks = list(self._syncing.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._syncing.clear()

    # ------------------------------------------------------------------ the admin routes

    async def handle(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        status = 500
        try:
            status, body, ctype, fanout = await self._serve(path, scope, receive)
            headers: Headers = [(b"content-length", b"%d" % len(body)), (XPYD_FANOUT_RAW, fanout)]
            if ctype:
                headers.append((b"content-type", ctype.encode("latin-1")))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        except ProxyError as e:
            status = e.status
            await send_error(send, e, [])
        except ClientGone:
            status = 499
        finally:
            self.metrics.observe_request(path, status, time.perf_counter() - t0)

    def _check_admin(self, headers: Headers) -> None:
        if self._admin is None:
            raise ProxyError(404, "LoRA adapter routes are off: this proxy was started without --admin-api-key",
                             "admin_routes_off")
        for k, v in headers:
            if k == b"authorization":
                if hmac.compare_digest(v, self._admin):
                    return
                break
        raise ProxyError(401, "missing or invalid admin API key: send 'Authorization: Bearer <admin key>'",
                         "invalid_admin_key", headers={"www-authenticate": "Bearer"})

    async def _serve(self, path: str, scope: Scope, receive: Receive) -> tuple[int, bytes, str | None, bytes]:
        self._check_admin(scope["headers"])
        length = ctype = None
        for k, v in scope["headers"]:
            if k == b"content-length":
                length = v
            elif k == b"content-type":
                ctype = v.decode("latin-1")
        raw = await read_body(receive, length, MAX_BODY_BYTES)
        name = _name_in(raw)
        base = self._base(scope) if path == LOAD else None
        try:
            async with asyncio.timeout(self.cfg.adapter_timeout):
                await self._lock.acquire()
        except TimeoutError:
            raise ProxyError(503, "another adapter change is still running", "adapter_busy") from None
        try:
            if path == LOAD and name is not None and name not in self.kept and len(self.kept) >= self.cfg.max_adapters:
                raise ProxyError(400, f"this proxy keeps at most {self.cfg.max_adapters} LoRA adapters "
                                 "(--max-adapters): unload one first", "too_many_adapters")
            targets = [i for i in self.registry.all() if base is None or i.models is None or base in i.models]
            if not targets:
                raise ProxyError(503, "no instance is available", "no_instance")
            results = await asyncio.gather(*(self._call(i, path, raw, ctype) for i in targets))
            self._remember(path, name, raw, ctype, base, results)
            # Requests for the adapter are routed by the instances' models: learn them now.
            await asyncio.gather(*(self.prober.fetch_models(r.inst) for r in results))
        finally:
            self._lock.release()
        return self._answer(path, name, results)

    def _base(self, scope: Scope) -> str | None:
        """The base model named with ?base_model= (None: all instances); required when
        the live instances serve several (an adapter fits one)."""
        bases = [k for k, card in self.registry.models().items() if not card.get("parent")]
        named = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("base_model")
        if named:
            if named[0] not in bases:
                raise ProxyError(400, f"base_model {named[0]!r} is not served (served: {', '.join(bases)})",
                                 "unknown_base_model", "base_model")
            return named[0]
        if len(bases) > 1:
            raise ProxyError(400, f"this proxy serves several base models ({', '.join(bases)}): name the "
                             "adapter's with ?base_model=NAME", "missing_base_model", "base_model")
        return None

    def _remember(self, path: str, name: str | None, raw: bytes, ctype: str | None, base: str | None,
                  results: list[Result]) -> None:
        if name is None:  # a body vLLM refused: nothing changed
            return
        if path == LOAD:
            if any(r.ok for r in results):
                self.kept.pop(name, None)  # to the end: the load order
                self.kept[name] = Kept(name, raw, ctype, base)
        elif any(r.ok for r in results) or all(r.status == 404 for r in results):
            self.kept.pop(name, None)

    def _answer(self, path: str, name: str | None, results: list[Result]) -> tuple[int, bytes, str | None, bytes]:
        fanout = ", ".join(f"{r.inst.role} {self.name_of(r.inst)} {r.status or r.kind}" for r in results)
        header = fanout.encode("latin-1", "replace")
        done = [r for r in results if r.ok]
        # Unloading: an instance that did not hold the adapter (vLLM's 404) is as wanted.
        failed = [r for r in results if not r.ok and not (done and path == UNLOAD and r.status == 404)]
        if not failed:  # vLLM's success is text without a content type: so is ours
            return done[0].status or 200, done[0].body, None, header
        first = results[0]
        if not done and first.status is not None and all(
                r.status == first.status and r.body == first.body for r in results):
            return first.status, first.body, first.content_type, header  # vLLM's verdict, everywhere alike
        what = "loaded" if path == LOAD else "unloaded"
        message = (f"LoRA adapter {name!r} {what} on {len(done)} of {len(results)} instances; failed: "
                   + "; ".join(f"{r.inst.role} {self.name_of(r.inst)}: {_why(r)}" for r in failed))
        body = error_dict(message, 502, "partial_failure" if done else "adapter_failed")
        body["instances"] = [{"role": r.inst.role, "instance": self.name_of(r.inst), "status": r.status,
                              "error": None if r.ok else _why(r)} for r in results]  # fmt: skip
        log.warning("adapter %s incomplete name=%s %s", what, name, fanout)
        return 502, orjson.dumps(body), "application/json", header

    async def _call(self, inst: Instance, path: str, body: bytes, ctype: str | None) -> Result:
        headers = dict(self._auth)
        if ctype is not None:
            headers["content-type"] = ctype
        try:
            async with asyncio.timeout(self.cfg.adapter_timeout):
                resp = await self.upstream.request("POST", inst.url + path, body, headers)
                try:
                    data = await resp.read(MAX_ANSWER_BYTES)
                finally:
                    await resp.aclose()
        except TimeoutError:
            kind = "timeout"
        except UpstreamError as e:
            kind = e.kind
        else:
            if not 200 <= resp.status < 300:
                log.warning("adapter call refused path=%s role=%s instance=%s status=%d body=%r", path,
                            inst.role, inst.http_address, resp.status, data[:300])  # fmt: skip
            return Result(inst, resp.status, data, resp.content_type)
        self.metrics.upstream_error(inst.role, inst.http_address, "adapter_" + kind)
        log.warning("adapter call failed path=%s role=%s instance=%s kind=%s", path, inst.role,
                    inst.http_address, kind)  # fmt: skip
        return Result(inst, None, kind=kind)

    # ------------------------------------------------------------------ instances that join

    def _missing(self, inst: Instance) -> list[Kept]:
        models = inst.models
        return [k for k in self.kept.values() if models is None
                or (k.name not in models and (k.base is None or k.base in models))]  # fmt: skip

    def _live(self, inst: Instance) -> bool:
        return self.registry.holds(inst) and not inst.pending and inst.healthy

    def _joined(self, inst: Instance) -> None:
        """A candidate now: admitted, or a static instance healthy again, which may have
        restarted since its models were read: it is no candidate for the kept adapters
        until asked again (_sync asks first)."""
        if not self._running or not self.kept:
            return
        if inst.static and inst.models and any(name in inst.models for name in self.kept):
            self.registry.set_models(inst, {k: v for k, v in inst.models.items() if k not in self.kept})
        self._changed(inst)

    def _changed(self, inst: Instance) -> None:
        if not self._running or inst in self._syncing or not self._live(inst) or not self._missing(inst):
            return
        task = asyncio.get_running_loop().create_task(self._sync(inst))
        self._syncing[inst] = task
        task.add_done_callback(lambda t: self._syncing.pop(inst, None) if self._syncing.get(inst) is t else None)

    async def _sync(self, inst: Instance) -> None:
        """Load on `inst` every kept adapter its /v1/models does not list."""
        try:
            async with asyncio.timeout(self.cfg.adapter_timeout):
                await self._lock.acquire()
        except TimeoutError:
            self.metrics.adapter_syncs.labels("failed").inc(len(self._missing(inst)))
            log.warning("adapters not loaded on a joining instance: another change held the lock "
                        "role=%s instance=%s", inst.role, inst.http_address)  # fmt: skip
            return
        try:
            if not self._live(inst):
                return
            await self.prober.fetch_models(inst)  # what it holds now (a static one: maybe all)
            loaded = 0
            for kept in self._missing(inst):
                if not self._live(inst):
                    return
                r = await self._call(inst, LOAD, kept.body, kept.content_type)
                self.metrics.adapter_syncs.labels("loaded" if r.ok else "failed").inc()
                if r.ok:
                    loaded += 1
                    log.info("adapter loaded on a joining instance name=%s role=%s instance=%s",
                             kept.name, inst.role, inst.http_address)  # fmt: skip
                else:
                    log.warning("adapter not loaded on a joining instance, no candidate for it name=%s role=%s "
                                "instance=%s %s", kept.name, inst.role, inst.http_address, _why(r))  # fmt: skip
            if loaded:
                await self.prober.fetch_models(inst)
        finally:
            self._lock.release()


def _name_in(raw: bytes) -> str | None:
    """The adapter a load or unload body names (None: a body vLLM will refuse)."""
    try:
        body = orjson.loads(raw)
    except ValueError:
        return None
    name = body.get("lora_name") if isinstance(body, dict) else None
    return name if isinstance(name, str) and name else None


def _why(r: Result) -> str:
    """An instance's failure in a few words: vLLM's error message, or the failure's kind."""
    if r.status is None:
        return str(r.kind)
    try:
        data = orjson.loads(r.body)
        message = data["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.body[:200].decode("utf-8", "replace")
    return f"HTTP {r.status}: {message}"

"""Announces this instance to the xPyD proxies (the discovery heartbeat).

Runs in the scheduler process, where the load figures live (one per engine,
rank-0 semantics). Announces only once the instance's own HTTP server answers
/health, so a proxy never routes to an instance that cannot take requests yet.

A proxy given by DNS name (e.g. a Kubernetes headless Service) is resolved to all its
addresses, again every proxy_resolve_interval_s, and every address gets its own socket
and every heartbeat: behind a load-balanced name each connection would reach one replica
only, and replicas that never hear from an instance never route to it.

Every heartbeat carries this instance's key (xpyd_wire.discovery: ``instance_key``), drawn
once per start: a proxy binds the instance's record to it, so no other registrant can rewrite
or remove it. A restart draws a new key; the proxy takes it once the old one's heartbeats
have stopped for half its --heartbeat-timeout (at once after this instance's ``leave``).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from connector.config import ConnectorConfig, ProxyName
from connector.log import get_logger
from xpyd_wire.discovery import (
    MAX_LOAD_COUNT,
    Load,
    ProtocolError,
    Registration,
    decode,
    encode,
    new_instance_key,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

logger = get_logger(__name__)

LoadReport = Callable[[], Load]
# socket.getaddrinfo's signature; injectable so tests control what a name resolves to.
GetAddrInfo = Callable[..., list[tuple[Any, ...]]]
# getaddrinfo has no timeout of its own (a dead DNS server can stall it for long): a lookup
# not answered within the interval (at least 1 s, at most 5 s) counts as failed, its last
# answer stands, and no second lookup of that name starts while it is still stuck.
RESOLVE_DEADLINE_S = (1.0, 5.0)


def heartbeat_load(kv_cache_manager: KVCacheManager | None, running: int, known: int,
                   buffer_usage: float, waiting_for_kv: int = 0) -> Load:
    """The load a scheduler reports in its heartbeats: running and waiting requests (of the
    `known` ones; of the waiting, `waiting_for_kv` held until their prefill begins sending), KV
    cache usage (best effort) and the connector's own buffer usage."""
    usage = 0.0
    if kv_cache_manager is not None:
        try:
            usage = float(kv_cache_manager.usage)
        except Exception:  # usage is best effort
            usage = 0.0
    waiting = max(0, known - running)
    return Load(running, waiting, _fraction(usage), _fraction(buffer_usage), min(waiting, max(0, waiting_for_kv)))


def _fraction(x: float) -> float:
    """Clamped to 0..1 (NaN -> 0): the proxy drops a heartbeat whose usage is out of range."""
    return min(1.0, max(0.0, x)) if x == x else 0.0


def endpoint(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def resolve(getaddrinfo: GetAddrInfo, name: ProxyName) -> frozenset[str]:
    """Every IPv4 and IPv6 address the name has, as ZMQ endpoints (may block: see callers)."""
    infos = getaddrinfo(name.host, name.port, type=socket.SOCK_STREAM)
    return frozenset(endpoint(str(info[4][0]), int(info[4][1])) for info in infos
                     if info[0] in (socket.AF_INET, socket.AF_INET6))


@dataclass(slots=True)
class _Lookup:
    """A DNS proxy name's resolution state (the heartbeat thread's only)."""

    endpoints: frozenset[str] = frozenset()
    resolved: bool = False  # answered at least once
    failure: str | None = None  # the failure last logged; None: resolving fine
    started: float | None = None  # monotonic start of the lookup in flight
    overdue: bool = False  # the lookup in flight passed its deadline (counted as failed)


@dataclass(frozen=True, slots=True)
class _Answer:
    name: ProxyName
    endpoints: frozenset[str]
    error: str | None


class _Replicas:
    """One DEALER per proxy address. ZMQ sockets are not thread-safe: only the heartbeat
    thread uses this."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._sockets: dict[str, zmq.Socket] = {}
        self._owners: dict[ProxyName, frozenset[str]] = {}  # two names may share an address
        self._dropping: set[str] = set()

    def __len__(self) -> int:
        return len(self._sockets)

    def assign(self, name: ProxyName, endpoints: frozenset[str]) -> list[str]:
        """name now means these addresses: opens the new ones (returned), closes the ones
        no name has any more."""
        self._owners[name] = endpoints
        wanted = frozenset().union(*self._owners.values())
        added = sorted(wanted - self._sockets.keys())
        removed = sorted(self._sockets.keys() - wanted)
        for ep in removed:
            # linger 0: whatever is queued for a vanished replica is dropped, not retried.
            self._sockets.pop(ep).close(linger=0)
            self._dropping.discard(ep)
        for ep in added:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 500)  # the leave on stop gets a moment; close never blocks
            s.setsockopt(zmq.SNDHWM, 4)  # a dead replica holds at most 4 heartbeats
            s.setsockopt(zmq.IPV6, 1)
            s.connect(ep)
            self._sockets[ep] = s
        if added or removed:
            logger.info("discovery: heartbeating to %d proxy address(es); %s added %s, removed %s",
                        len(self._sockets), name, ",".join(added) or "none", ",".join(removed) or "none")
        return added

    def send(self, msg: bytes, only: Iterable[str] | None = None) -> None:
        for ep in list(only) if only is not None else list(self._sockets):
            try:
                self._sockets[ep].send(msg, flags=zmq.NOBLOCK)
            except zmq.Again:
                if ep not in self._dropping:  # once per outage, not every heartbeat
                    self._dropping.add(ep)
                    logger.warning("discovery heartbeats to proxy=%s dropped (queue full: unreachable?)", ep)
                continue
            if ep in self._dropping:
                self._dropping.discard(ep)
                logger.info("discovery heartbeats to proxy=%s queue again", ep)

    def close(self) -> None:
        for s in self._sockets.values():
            s.close()
        self._sockets.clear()


_WAKE = object()  # stop(): the heartbeat thread's wait ends at once


class Registrar:
    def __init__(self, cfg: ConnectorConfig, load_report: LoadReport,
                 fallbacks_report: Callable[[], int] | None = None, *,
                 getaddrinfo: GetAddrInfo = socket.getaddrinfo) -> None:
        self._cfg = cfg
        self._load_report = load_report
        self._fallbacks_report = fallbacks_report
        self._getaddrinfo = getaddrinfo
        self._names = tuple(ProxyName.parse(a) for a in cfg.proxies)  # a bad address fails here
        self._answers: queue.SimpleQueue[_Answer | object] = queue.SimpleQueue()
        self._replica_count = 0
        self._key = new_instance_key()  # this start's identity: never logged
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name="xpyd-registrar", daemon=True)
        self._thread.start()

    @property
    def replicas(self) -> int:
        """Proxy addresses this instance currently heartbeats to."""
        return self._replica_count

    def _registration(self, leave: bool = False) -> Registration:
        return Registration(
            role="P" if self._cfg.role == "kv_producer" else "D",
            http_address=f"{self._cfg.http_host}:{self._cfg.http_port}",
            zmq_address=self._cfg.advertised_address,
            load=self._load_report(),
            leave=leave,
            kv_transport_fallbacks=min(self._fallbacks_report(), MAX_LOAD_COUNT) if self._fallbacks_report else 0,
            kv_events=self._cfg.kv_events,
            output_limits=self._cfg.output_limits,
            generation=self._cfg.generation,
            instance_key=self._key,
        )

    def _healthy(self) -> bool:
        url = f"http://{self._cfg.http_host}:{self._cfg.http_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:  # noqa: S310 (own loopback/http host)
                return r.status == 200
        except OSError:
            return False

    def check(self) -> str | None:
        """Why the proxy would drop this instance's registrations (its own parser says), or
        None. Heartbeats are sent regardless; this makes a bad address visible at start-up."""
        try:
            decode(encode(self._registration(), self._cfg.discovery_secret), self._cfg.discovery_secret)
        except ProtocolError as e:
            return str(e)
        return None

    # ---- resolution: off the heartbeat thread, one lookup per name at a time ----
    def _lookup(self, name: ProxyName) -> None:
        try:
            eps = resolve(self._getaddrinfo, name)
            self._answers.put(_Answer(name, eps, None if eps else "no IPv4/IPv6 address"))
        except Exception as e:  # gaierror, or whatever an injected resolver raises
            self._answers.put(_Answer(name, frozenset(), f"{type(e).__name__}: {e}"))

    def _start_lookups(self, lookups: dict[ProxyName, _Lookup], now: float) -> None:
        for name, lk in lookups.items():
            if lk.started is None:  # a stuck lookup is not doubled: threads stay one per name
                lk.started, lk.overdue = now, False
                threading.Thread(target=self._lookup, args=(name,), name="xpyd-resolve", daemon=True).start()

    def _failed(self, name: ProxyName, lk: _Lookup, why: str) -> None:
        if not lk.resolved:  # never resolved: this instance is invisible to that proxy, say so each time
            logger.warning("discovery: proxy name %s does not resolve (%s); retrying every %gs",
                           name, why, self._cfg.proxy_resolve_interval_s)
        elif lk.failure is None:  # once per change of state, not every interval
            logger.warning("discovery: re-resolving proxy name %s failed (%s); keeping its %d known address(es)",
                           name, why, len(lk.endpoints))
        lk.failure = why

    def _answered(self, answer: _Answer, lookups: dict[ProxyName, _Lookup], replicas: _Replicas) -> list[str]:
        """Applies a lookup's answer; returns the addresses it added."""
        lk = lookups[answer.name]
        lk.started = None
        if answer.error is not None:
            if not lk.overdue:  # an overdue lookup was already counted as failed
                self._failed(answer.name, lk, answer.error)
            return []
        if lk.failure is not None and lk.resolved:
            logger.info("discovery: proxy name %s resolves again", answer.name)
        lk.resolved, lk.failure, lk.endpoints = True, None, answer.endpoints
        return replicas.assign(answer.name, answer.endpoints)

    def _run(self) -> None:
        interval = self._cfg.proxy_resolve_interval_s
        deadline = min(max(interval, RESOLVE_DEADLINE_S[0]), RESOLVE_DEADLINE_S[1])
        replicas = _Replicas(self._ctx)
        lookups: dict[ProxyName, _Lookup] = {}
        for name in self._names:
            if name.literal:
                replicas.assign(name, frozenset({endpoint(name.host, name.port)}))
            else:
                lookups[name] = _Lookup()
        self._replica_count = len(replicas)
        problem = self.check()
        if problem is not None:
            logger.error("the proxies will drop this instance's registrations: %s", problem)
        healthy = False
        next_beat = next_resolve = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if lookups and now >= next_resolve:
                    self._start_lookups(lookups, now)
                    next_resolve = now + interval
                for name, lk in lookups.items():
                    if lk.started is not None and not lk.overdue and now - lk.started >= deadline:
                        lk.overdue = True
                        self._failed(name, lk, f"no answer within {deadline:g}s")
                if now >= next_beat:
                    healthy = self._healthy()
                    if healthy:
                        replicas.send(encode(self._registration(), self._cfg.discovery_secret))
                    next_beat = time.monotonic() + self._cfg.heartbeat_interval_s
                wake = [next_beat] + ([next_resolve] if lookups else []) + [
                    lk.started + deadline for lk in lookups.values() if lk.started is not None and not lk.overdue]
                try:
                    answer = self._answers.get(timeout=max(0.0, min(wake) - time.monotonic()))
                except queue.Empty:
                    continue
                if isinstance(answer, _Answer):
                    added = self._answered(answer, lookups, replicas)
                    self._replica_count = len(replicas)
                    if added and healthy:  # a new replica hears now, not one heartbeat later
                        replicas.send(encode(self._registration(), self._cfg.discovery_secret), only=added)
            replicas.send(encode(self._registration(leave=True), self._cfg.discovery_secret))
        finally:
            replicas.close()
            self._replica_count = 0

    def stop(self) -> None:
        self._stop.set()
        self._answers.put(_WAKE)
        self._thread.join(timeout=3.0)

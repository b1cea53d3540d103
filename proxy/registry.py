"""The table of live P and D instances, fed by discovery and read by the router.

A discovered instance starts *pending*: listed, never a routing candidate, until the prober hears it answer
(proxy/membership/probe.py, Prober.admit), so an address where nothing listens (mistyped, or a flood of them)
never costs a client request. Discovered instances are bounded per role and per source host; registrations
beyond the bounds are refused (RegistrationRefused).

A record belongs to what first registered it: its source host (the discovery connection's peer address, which a
sender cannot choose) and its instance_key when it sent one (xpyd_wire.discovery). A heartbeat or a leave for
the same http_address from another owner is refused (reason "conflict"), whoever holds the discovery secret;
only once the owner has been silent for half the heartbeat timeout (it restarted with a new key, or died) does a
new owner take the address, as a new pending instance. A change of an owned record's addresses is logged as
such. The KV-event endpoints an instance advertises are taken on its source host (a registrant on this machine
may name any address of this machine): a registration cannot make the proxy connect to any other host."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from xpyd_wire.discovery import GenerationDefaults, Load, OutputLimits, Registration
from xpyd_wire.kv_events import EventsEndpoint, split_endpoint

log = logging.getLogger("xpyd.proxy.registry")

class RegistrationRefused(Exception):
    """reason: role_limit or source_limit (the label of xpyd_discovery_refused_total)."""

    # "conflict": the address belongs to another owner (another source or instance_key).

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True, eq=False)
class Instance:
    role: str
    http_address: str
    zmq_address: str
    url: str
    registered_at: float  # wall clock, for /instances
    last_heartbeat: float  # monotonic, for expiry
    last_heartbeat_wall: float
    load: Load | None = None
    # Proxy-tracked load: requests and estimated prompt tokens currently sent to it.
    in_flight: int = 0
    in_flight_tokens: int = 0
    # D only: requests sent ahead of their P's answer (concurrent dispatch) not answered by P yet,
    # and the flights of this proxy's answers it streams (a prefill on D would stall: dispatch/local.py).
    early: int = 0
    relaying: set = field(default_factory=set)
    # Monotonic deadline until which routing avoids it after a refused connection.
    cooldown_until: float = 0.0
    served: int = 0
    # Model id -> its card from the instance's /v1/models; None until learned (then the
    # instance is eligible for any model).
    models: dict[str, dict] | None = None
    # Given on the command line: never expires by heartbeat, live only while /health passes.
    static: bool = False
    healthy: bool = True
    # Times its KV transport left NCCL for tcp with a peer (from its heartbeats).
    kv_transport_fallbacks: int = 0
    # Discovered and not heard from yet: listed, never selected (see the module docstring).
    pending: bool = False
    # Kind of the last failed join probe ("connect", "timeout", "http_503", ...), for /instances.
    probe_error: str | None = None
    # Host of the discovery connection it registered from (None: unknown), for the bounds.
    source: str | None = None
    # Where it publishes vLLM's KV events (from its registration, on its source host; or
    # the static option), and what its registration advertised.
    kv_events: EventsEndpoint | None = None
    advertised_events: EventsEndpoint | None = None
    # How its vLLM caps generated tokens (from its registration); None: not known.
    output_limits: OutputLimits | None = None
    generation: GenerationDefaults | None = None  # D's sampling defaults (first token from P)
    # Its owner (see the module docstring): a digest of its instance_key (None: it sent
    # none), and whether any registration bound it yet (a static one starts unbound).
    key_digest: bytes | None = None
    bound: bool = False

    def to_json(self, now_wall: float) -> dict:
        load = self.load
        return {
            "role": self.role,
            "http_address": self.http_address,
            "zmq_address": self.zmq_address,
            "registered_at": self.registered_at,
            "last_heartbeat": self.last_heartbeat_wall,
            "heartbeat_age_s": round(max(0.0, now_wall - self.last_heartbeat_wall), 3),
            "in_flight": self.in_flight,
            "in_flight_tokens": self.in_flight_tokens,
            "early": self.early,
            "served": self.served,
            "cooling_down": self.cooldown_until > time.monotonic(),
            "models": None if self.models is None else sorted(self.models),
            "static": self.static,
            "healthy": self.healthy,
            "kv_transport_fallbacks": self.kv_transport_fallbacks,
            "pending": self.pending,
            "probe_error": self.probe_error,
            "source": self.source,
            "output_limits": None if self.output_limits is None else dataclasses.asdict(self.output_limits),
            "generation": None if self.generation is None else {**self.generation.to_wire(),
                                                                "tool_parser": self.generation.tool_parser},
            "load": None
            if load is None
            else {"running": load.running, "waiting": load.waiting, "waiting_for_kv": load.waiting_for_kv,
                  "kv_usage": load.kv_usage, "kv_buffer_usage": load.kv_buffer_usage},
        }


@dataclass(slots=True)
class Registry:
    heartbeat_timeout: float
    # Discovered (non-static) instances held, live or pending, per role and per source host.
    max_per_role: int = 1024
    max_per_source: int = 64
    _by_role: dict[str, dict[str, Instance]] = field(default_factory=lambda: {"P": {}, "D": {}})
    # Snapshot lists per role, rebuilt only on membership change: the hot path reads these.
    _lists: dict[str, list[Instance]] = field(default_factory=lambda: {"P": [], "D": []})
    # (role, model) -> live instances that serve it (or whose models are not known yet).
    _pools: dict[tuple[str, str], list[Instance]] = field(default_factory=dict)
    _models: dict[str, dict] | None = None  # models() cache
    # Called with each instance that becomes live (answered its join probe, or healthy again).
    listeners: list[Callable[[Instance], None]] = field(default_factory=list)
    # Called with each newly discovered instance, pending until it answers (the prober).
    pending_listeners: list[Callable[[Instance], None]] = field(default_factory=list)
    # Called with each instance whose list of models changed (proxy/serving/adapters.py).
    models_listeners: list[Callable[[Instance], None]] = field(default_factory=list)
    # Discovered instances held per role and per source host (keys at 0 are deleted).
    _per_role: dict[str, int] = field(default_factory=lambda: {"P": 0, "D": 0})
    _per_source: dict[str, int] = field(default_factory=dict)
    # Heartbeats refused as someone else's record, since start (for tests and /metrics).
    conflicts: int = 0

    @property
    def rebind_after_s(self) -> float:
        """Silence after which an address's owner may be replaced (a restart's new key)."""
        return self.heartbeat_timeout / 2

    def _owned(self, inst: Instance, reg: Registration, source: str | None) -> bool:
        if not inst.bound:
            return True
        if inst.source != source:
            return False
        if inst.key_digest is None:
            return reg.instance_key is None
        return reg.instance_key is not None and hmac.compare_digest(inst.key_digest, _digest(reg.instance_key))

    def _check_owner(self, inst: Instance, reg: Registration, source: str | None, now: float) -> bool:
        """True: reg is from inst's owner. False: the owner is gone and reg may take the
        address. Raises RegistrationRefused("conflict") while the owner is alive."""
        if self._owned(inst, reg, source):
            return True
        silent = now - inst.last_heartbeat
        if silent < self.rebind_after_s:
            self.conflicts += 1
            raise RegistrationRefused(
                "conflict", f"{reg.http_address} belongs to another instance (source "
                f"{inst.source}, {'keyed' if inst.key_digest else 'no key'}; this one: source "
                f"{source}, {'keyed' if reg.instance_key else 'no key'}), heard from "
                f"{silent:.1f}s ago")  # fmt: skip
        log.warning("instance address taken over by a new owner after %.1fs of silence (restart?) "
                    "role=%s http=%s source=%s->%s", silent, reg.role, reg.http_address,
                    inst.source, source)  # fmt: skip
        return False

    def _rebuild(self, role: str) -> None:
        self._lists[role] = [i for i in self._by_role[role].values()
                             if i.healthy and not i.pending]  # fmt: skip
        self._pools.clear()
        self._models = None

    def _notify(self, inst: Instance, listeners: list[Callable[[Instance], None]]) -> None:
        for listener in listeners:
            try:
                listener(inst)
            except Exception:  # a listener's bug must not break registration
                log.exception("registry listener failed instance=%s", inst.http_address)

    def upsert(
        self, reg: Registration, now: float | None = None, source: str | None = None
    ) -> Instance:
        """A heartbeat: updates a known instance, or adds a new one as pending (raises
        RegistrationRefused when its role or its source is at its bound). `source` is the
        host the message came from; None (unknown) is bounded per role only."""
        now = time.monotonic() if now is None else now
        table = self._by_role[reg.role]
        inst = table.get(reg.http_address)
        wall = time.time()
        if inst is not None and not self._check_owner(inst, reg, source, now):
            if inst.static:  # the operator named it: rebind in place, never removed
                inst.bound = False
            else:
                self.remove(inst.role, inst.http_address, "new_owner")
                inst = None
        if inst is None:
            if self._per_role[reg.role] >= self.max_per_role:
                raise RegistrationRefused(
                    "role_limit", f"{self.max_per_role} {reg.role} instances registered already"
                )
            if source is not None and self._per_source.get(source, 0) >= self.max_per_source:
                raise RegistrationRefused(
                    "source_limit", f"{self.max_per_source} instances registered from {source}"
                )
            inst = Instance(
                role=reg.role,
                http_address=reg.http_address,
                zmq_address=reg.zmq_address,
                url="http://" + reg.http_address,
                registered_at=wall,
                last_heartbeat=now,
                last_heartbeat_wall=wall,
                load=reg.load,
                kv_transport_fallbacks=reg.kv_transport_fallbacks,
                kv_events=_on_source(reg.kv_events, source),  # after the bounds: once each
                advertised_events=reg.kv_events,
                output_limits=reg.output_limits,
                generation=reg.generation,
                pending=True,
                source=source,
                key_digest=None if reg.instance_key is None else _digest(reg.instance_key),
                bound=True,
            )
            table[reg.http_address] = inst
            self._per_role[reg.role] += 1
            if source is not None:
                self._per_source[source] = self._per_source.get(source, 0) + 1
            # Not a candidate yet: the live lists are unchanged (no rebuild: a burst of
            # registrations costs O(1) each).
            log.info(
                "instance registered, pending until it answers role=%s http=%s zmq=%s source=%s keyed=%s",
                reg.role, reg.http_address, reg.zmq_address, source, reg.instance_key is not None,
            )  # fmt: skip
            self._notify(inst, self.pending_listeners)
            return inst
        if not inst.bound:  # a static instance's first registration: it owns it from now on
            inst.bound = True
            inst.source = source
            inst.key_digest = None if reg.instance_key is None else _digest(reg.instance_key)
            log.info("static instance bound to its registration role=%s http=%s source=%s keyed=%s",
                     reg.role, reg.http_address, source, reg.instance_key is not None)  # fmt: skip
        if reg.kv_events == inst.advertised_events and source == inst.source:
            kv_events = inst.kv_events  # as resolved at the last change: no syscall per heartbeat
        else:
            kv_events = _on_source(reg.kv_events, source)
        if inst.zmq_address != reg.zmq_address or inst.kv_events != kv_events:
            # The owner moved its KV or event endpoints: an event worth a line of its own.
            log.warning(
                "instance addresses changed by its owner role=%s http=%s zmq=%s->%s "
                "kv_events=%s->%s", reg.role, reg.http_address, inst.zmq_address,
                reg.zmq_address, _show(inst.kv_events), _show(kv_events),
            )  # fmt: skip
            inst.zmq_address = reg.zmq_address
        inst.last_heartbeat = now
        inst.last_heartbeat_wall = wall
        if reg.load is not None:
            inst.load = reg.load
        inst.kv_transport_fallbacks = reg.kv_transport_fallbacks
        inst.kv_events = kv_events
        inst.advertised_events = reg.kv_events
        inst.output_limits = reg.output_limits
        inst.generation = reg.generation
        return inst

    def leave(self, reg: Registration, now: float | None = None, source: str | None = None) -> bool:
        """A leave message: removes the instance if reg is from its owner (else
        RegistrationRefused("conflict")); False when there was nothing to remove."""
        inst = self._by_role[reg.role].get(reg.http_address)
        if inst is None:
            return False
        now = time.monotonic() if now is None else now
        if not self._owned(inst, reg, source):
            self.conflicts += 1
            raise RegistrationRefused("conflict", f"leave for {reg.http_address} from another owner "
                                                  f"(source {source})")  # fmt: skip
        return self.remove(reg.role, reg.http_address, "leave")

    def add_static(self, role: str, http_address: str, zmq_address: str,
                   kv_events: EventsEndpoint | None = None) -> Instance:
        """A command-line instance: out of the live list until set_healthy(True)."""
        wall = time.time()
        inst = Instance(role=role, http_address=http_address, zmq_address=zmq_address,
                        url="http://" + http_address, registered_at=wall,
                        last_heartbeat=math.inf, last_heartbeat_wall=wall,
                        static=True, healthy=False, kv_events=kv_events)  # fmt: skip
        self._by_role[role][http_address] = inst
        self._rebuild(role)
        log.info("static instance added role=%s http=%s zmq=%s", role, http_address, zmq_address)
        return inst

    def holds(self, inst: Instance) -> bool:
        """inst is still in the table (not removed or replaced by a re-registration)."""
        return self._by_role[inst.role].get(inst.http_address) is inst

    def admit(self, inst: Instance) -> None:
        """A pending instance answered its join probe: it becomes a routing candidate."""
        if not inst.pending:
            return
        inst.pending = False
        inst.probe_error = None
        if not self.holds(inst):
            return
        self._rebuild(inst.role)
        log.info("instance answered, now a candidate role=%s http=%s",
                 inst.role, inst.http_address)  # fmt: skip
        self._notify(inst, self.listeners)

    def pending(self) -> list[Instance]:
        """Discovered instances that have not answered yet, in registration order."""
        return [i for table in self._by_role.values() for i in table.values() if i.pending]

    def count_pending(self, role: str) -> int:
        return sum(1 for i in self._by_role[role].values() if i.pending)

    def set_healthy(self, inst: Instance, healthy: bool) -> None:
        if inst.healthy == healthy:
            return
        inst.healthy = healthy
        if self._by_role[inst.role].get(inst.http_address) is not inst:
            return
        self._rebuild(inst.role)
        log.info("instance %s role=%s http=%s", "healthy" if healthy else "unhealthy",
                 inst.role, inst.http_address)  # fmt: skip
        if healthy:
            self._notify(inst, self.listeners)

    def set_models(self, inst: Instance, models: dict[str, dict]) -> None:
        if inst.models is not None and inst.models.keys() == models.keys():
            inst.models = models
            return
        log.info("instance models role=%s http=%s models=%s", inst.role, inst.http_address,
                 ",".join(sorted(models)))  # fmt: skip
        inst.models = models
        self._pools.clear()
        self._models = None
        self._notify(inst, self.models_listeners)

    def serves(self, inst: Instance, model: str) -> bool:
        """Whether a request for `model` may go to `inst`: it lists the model, or its models
        are not known yet and `model` is no LoRA adapter (an adapter runs only where it is
        loaded: a base-model P's KV is wrong for it, and vLLM answers 404 without it)."""
        if inst.models is not None:
            return model in inst.models
        card = self.models().get(model)
        return card is None or not card.get("parent")

    def pool(self, role: str, model: str | None) -> list[Instance]:
        """Live instances of `role` that serve `model` (None: all); do not mutate."""
        if model is None:
            return self._lists[role]
        key = (role, model)
        found = self._pools.get(key)
        if found is not None:
            return found
        found = [i for i in self._lists[role] if self.serves(i, model)]
        # Cache only models some instance serves: client-chosen names must not grow this.
        if any(i.models is not None and model in i.models for i in found):
            self._pools[key] = found
        return found

    def models(self) -> dict[str, dict]:
        """Every model a live instance serves (id -> the first card seen): base models
        sorted by id, then LoRA adapters (cards with a parent) in the order listed, as vLLM."""
        if self._models is not None:
            return self._models
        cards: dict[str, dict] = {}
        for inst in self.all():
            for name, card in (inst.models or {}).items():
                cards.setdefault(name, card)
        base = sorted(((k, v) for k, v in cards.items() if not v.get("parent")), key=lambda kv: kv[0])
        self._models = dict(base + [(k, v) for k, v in cards.items() if v.get("parent")])
        return self._models

    def remove(self, role: str, http_address: str, reason: str) -> bool:
        table = self._by_role.get(role, {})
        inst = table.get(http_address)
        if inst is None:
            return False
        if inst.static:  # the prober decides about static instances, not discovery
            log.info("static instance kept role=%s http=%s reason=%s", role, http_address, reason)
            return False
        del table[http_address]
        self._per_role[role] -= 1
        if inst.source is not None:
            left = self._per_source[inst.source] - 1
            if left:
                self._per_source[inst.source] = left
            else:  # keyed by whatever addresses connect: keep no empty entries
                del self._per_source[inst.source]
        if not inst.pending:  # a pending one was never in the live lists
            self._rebuild(role)
        log.info("instance removed role=%s http=%s reason=%s", role, http_address, reason)
        return True

    def expire(self, now: float | None = None) -> list[Instance]:
        """Remove every instance whose last heartbeat is older than the timeout."""
        now = time.monotonic() if now is None else now
        deadline = now - self.heartbeat_timeout
        gone = [
            inst
            for table in self._by_role.values()
            for inst in table.values()
            if inst.last_heartbeat < deadline and not inst.static
        ]
        for inst in gone:
            self.remove(inst.role, inst.http_address, "heartbeat_timeout")
        return gone

    def live(self, role: str) -> list[Instance]:
        """Instances of a role in registration order; do not mutate the list."""
        return self._lists[role]

    def all(self) -> list[Instance]:
        return self._lists["P"] + self._lists["D"]

    def every(self) -> list[Instance]:
        """Live or not (static instances failing their health check), for /instances."""
        return [*self._by_role["P"].values(), *self._by_role["D"].values()]

    def count(self, role: str) -> int:
        return len(self._lists[role])


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _show(ep: EventsEndpoint | None) -> str:
    return "none" if ep is None else ep.endpoint


def _source_host(source: str) -> str | None:
    """A peer address as the host part of a tcp:// endpoint (None: not an IP address)."""
    ip = _ip(source)
    if ip is None:
        return None
    return f"[{ip}]" if isinstance(ip, ipaddress.IPv6Address) else str(ip)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP literal (bracketed IPv6 too; an IPv4-mapped one as IPv4), else None."""
    try:
        ip = ipaddress.ip_address(host[1:-1] if host.startswith("[") else host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _is_local(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """An address of this machine (loopback, or one a socket can bind)."""
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if isinstance(ip, ipaddress.IPv6Address) else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
    except OSError:
        return False
    return True


def _on_source(ep: EventsEndpoint | None, source: str | None) -> EventsEndpoint | None:
    """The advertised event endpoints on the registration's source host: a host other than
    the source is replaced by it (the registrant picks the ports, never the host the proxy
    connects to; vLLM's tcp://*:PORT publisher answers on every interface). A registrant on
    this machine (loopback source) may name any address of this machine: an instance bound
    to one local address (multinode.yaml's 127.0.0.x hosts) heartbeats from 127.0.0.1."""
    if ep is None or source is None:
        return ep
    src = _ip(source)
    host = _source_host(source)
    if src is None or host is None:
        return ep

    def moved(endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        advertised_host, port = split_endpoint(endpoint)
        ip = _ip(advertised_host)
        if ip == src or (src.is_loopback and ip is not None and _is_local(ip)):
            return endpoint
        return f"tcp://{host}:{port}"

    out = dataclasses.replace(ep, endpoint=moved(ep.endpoint), replay_endpoint=moved(ep.replay_endpoint))
    if out != ep:
        log.warning("kv events endpoint moved to the registration's source host source=%s %s->%s",
                    source, ep.endpoint, out.endpoint)  # fmt: skip
    return ep if out == ep else out

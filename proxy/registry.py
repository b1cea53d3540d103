"""The table of live P and D instances, fed by discovery and read by the router."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from proxy.protocol import Load, Registration

log = logging.getLogger("xpyd.proxy.registry")


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
    # Monotonic deadline until which routing avoids it after a refused connection.
    cooldown_until: float = 0.0
    served: int = 0

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
            "served": self.served,
            "cooling_down": self.cooldown_until > time.monotonic(),
            "load": None
            if load is None
            else {"running": load.running, "waiting": load.waiting, "kv_usage": load.kv_usage,
                  "kv_buffer_usage": load.kv_buffer_usage},
        }


@dataclass(slots=True)
class Registry:
    heartbeat_timeout: float
    _by_role: dict[str, dict[str, Instance]] = field(default_factory=lambda: {"P": {}, "D": {}})
    # Snapshot lists per role, rebuilt only on membership change: the hot path reads these.
    _lists: dict[str, list[Instance]] = field(default_factory=lambda: {"P": [], "D": []})

    def upsert(self, reg: Registration, now: float | None = None) -> Instance:
        now = time.monotonic() if now is None else now
        table = self._by_role[reg.role]
        inst = table.get(reg.http_address)
        wall = time.time()
        if inst is None:
            inst = Instance(
                role=reg.role,
                http_address=reg.http_address,
                zmq_address=reg.zmq_address,
                url="http://" + reg.http_address,
                registered_at=wall,
                last_heartbeat=now,
                last_heartbeat_wall=wall,
                load=reg.load,
            )
            table[reg.http_address] = inst
            self._lists[reg.role] = list(table.values())
            log.info(
                "instance registered role=%s http=%s zmq=%s",
                reg.role,
                reg.http_address,
                reg.zmq_address,
            )
            return inst
        if inst.zmq_address != reg.zmq_address:
            log.info(
                "instance zmq address changed role=%s http=%s zmq=%s->%s",
                reg.role,
                reg.http_address,
                inst.zmq_address,
                reg.zmq_address,
            )
            inst.zmq_address = reg.zmq_address
        inst.last_heartbeat = now
        inst.last_heartbeat_wall = wall
        if reg.load is not None:
            inst.load = reg.load
        return inst

    def remove(self, role: str, http_address: str, reason: str) -> bool:
        table = self._by_role.get(role, {})
        if table.pop(http_address, None) is None:
            return False
        self._lists[role] = list(table.values())
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
            if inst.last_heartbeat < deadline
        ]
        for inst in gone:
            self.remove(inst.role, inst.http_address, "heartbeat_timeout")
        return gone

    def live(self, role: str) -> list[Instance]:
        """Instances of a role in registration order; do not mutate the list."""
        return self._lists[role]

    def all(self) -> list[Instance]:
        return self._lists["P"] + self._lists["D"]

    def count(self, role: str) -> int:
        return len(self._lists[role])

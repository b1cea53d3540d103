"""The discovery wire format, shared by the proxy and the connector.

Upstream-compatible core: ``msgpack({"type": "P"|"D", "http_address": "host:port",
"zmq_address": "host:port"})``. Optional xPyD fields:

- ``load``: ``{"running": int, "waiting": int, "kv_usage": float, "kv_buffer_usage": float}``
  (usages 0..1; ``kv_buffer_usage``: the KV connector's receive buffer)
- ``leave``: ``True`` to deregister gracefully
- ``ts``: sender's wall-clock time (float seconds); required when signed
- ``hmac``: hex HMAC-SHA256 over the canonical encoding of every other field,
  keyed by the shared discovery secret

This module imports nothing heavy so that vLLM's processes can use it too.
"""

from __future__ import annotations

import hashlib
import hmac as _hmac
import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

ROLES = ("P", "D")
# Signed messages older or newer than this are rejected (replay protection).
MAX_CLOCK_SKEW_S = 30.0


class ProtocolError(ValueError):
    """A discovery message that is not well formed, or not signed correctly."""


@dataclass(frozen=True, slots=True)
class Load:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_buffer_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class Registration:
    role: str
    http_address: str
    zmq_address: str
    load: Load | None = None
    leave: bool = False
    ts: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _canonical(fields: dict[str, Any]) -> bytes:
    # Sorted keys: the signature must not depend on dict insertion order.
    return msgpack.packb({k: fields[k] for k in sorted(fields)}, use_bin_type=True)


def sign(fields: dict[str, Any], secret: str) -> str:
    body = {k: v for k, v in fields.items() if k != "hmac"}
    return _hmac.new(secret.encode(), _canonical(body), hashlib.sha256).hexdigest()


def encode(reg: Registration, secret: str | None = None) -> bytes:
    fields: dict[str, Any] = {
        "type": reg.role,
        "http_address": reg.http_address,
        "zmq_address": reg.zmq_address,
    }
    if reg.load is not None:
        fields["load"] = {
            "running": reg.load.running,
            "waiting": reg.load.waiting,
            "kv_usage": reg.load.kv_usage,
            "kv_buffer_usage": reg.load.kv_buffer_usage,
        }
    if reg.leave:
        fields["leave"] = True
    ts = reg.ts
    if secret is not None and ts is None:
        ts = time.time()
    if ts is not None:
        fields["ts"] = ts
    if secret is not None:
        fields["hmac"] = sign(fields, secret)
    return msgpack.packb(fields, use_bin_type=True)


def _check_address(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{name} must be a non-empty 'host:port' string")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProtocolError(f"{name} {value!r} is not 'host:port'")
    return value


def _check_load(value: Any) -> Load:
    if not isinstance(value, dict):
        raise ProtocolError("load must be a map")
    try:
        running = int(value.get("running", 0))
        waiting = int(value.get("waiting", 0))
        kv_usage = float(value.get("kv_usage", 0.0))
        kv_buffer_usage = float(value.get("kv_buffer_usage", 0.0))
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"bad load field: {e}") from None
    if running < 0 or waiting < 0 or not 0.0 <= kv_usage <= 1.0 or not 0.0 <= kv_buffer_usage <= 1.0:
        raise ProtocolError("load values out of range")
    return Load(running, waiting, kv_usage, kv_buffer_usage)


def decode(
    data: bytes, secret: str | None = None, now: float | None = None
) -> Registration:
    """Parse and validate one discovery message; raise ProtocolError if bad."""
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(fields, dict):
        raise ProtocolError("message is not a map")
    role = fields.get("type")
    if role not in ROLES:
        raise ProtocolError(f"unknown type {role!r}")
    http_address = _check_address(fields.get("http_address"), "http_address")
    zmq_address = _check_address(fields.get("zmq_address"), "zmq_address")
    ts = fields.get("ts")
    # NaN must be refused here: it would pass the clock-skew comparison below.
    if ts is not None and (not isinstance(ts, (int, float)) or not math.isfinite(ts)):
        raise ProtocolError("ts must be a finite number")
    if secret is not None:
        given = fields.get("hmac")
        if not isinstance(given, str):
            raise ProtocolError("unsigned message")
        if not _hmac.compare_digest(given, sign(fields, secret)):
            raise ProtocolError("bad signature")
        if ts is None:
            raise ProtocolError("signed message without ts")
        now = time.time() if now is None else now
        if abs(now - float(ts)) > MAX_CLOCK_SKEW_S:
            raise ProtocolError("stale or future ts")
    load = _check_load(fields["load"]) if "load" in fields else None
    known = {"type", "http_address", "zmq_address", "load", "leave", "ts", "hmac"}
    return Registration(
        role=role,
        http_address=http_address,
        zmq_address=zmq_address,
        load=load,
        leave=bool(fields.get("leave", False)),
        ts=float(ts) if ts is not None else None,
        extra={k: v for k, v in fields.items() if k not in known},
    )

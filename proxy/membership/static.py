"""Static instances: P and D given on the command line
(--prefill/--decode URL[,kv=HOST:PORT][,events=tcp://HOST:PORT][,replay=tcp://HOST:PORT])
for setups without discovery. They never expire by heartbeat; instead the prober checks
their /health and keeps them out of the live lists while it fails."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from proxy.errors import ConfigError
from xpyd_wire.kv_events import EventError, EventsEndpoint, decode_endpoint

# vLLM's KVTransferConfig.kv_port default: where the connector listens unless told otherwise.
DEFAULT_KV_PORT = 14579


@dataclass(frozen=True, slots=True)
class StaticSpec:
    role: str
    http_address: str  # host:port
    zmq_address: str  # host:port of the instance's KV connector
    kv_events: EventsEndpoint | None = None  # its vLLM KV-event publisher (and replay)


def _host_port(text: str, what: str, spec: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} in {spec!r} must be HOST:PORT, got {text!r}")
    return host, int(port)


def parse_static(role: str, spec: str) -> StaticSpec:
    """`http://host:port[,kv=HOST:PORT]` (the scheme may be left out; only http is
    spoken). Without kv= the connector is assumed on the URL's host at vLLM's default
    kv_port 14579, which is right for one instance per host."""
    url, *options = (part.strip() for part in spec.split(","))
    flag = "--prefill" if role == "P" else "--decode"
    if "://" in url:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ConfigError(f"{flag} {spec!r}: only http:// URLs are supported")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ConfigError(f"{flag} {spec!r}: give the server root, without a path")
        url = parts.netloc
    host, port = _host_port(url, f"{flag} URL", spec)
    kv = f"{host}:{DEFAULT_KV_PORT}"
    events: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if key == "kv" and sep:
            kv_host, kv_port = _host_port(value, "kv=", spec)
            kv = f"{kv_host}:{kv_port}"
        elif key in ("events", "replay") and sep:
            events["endpoint" if key == "events" else "replay_endpoint"] = value
        else:
            raise ConfigError(f"{flag} {spec!r}: unknown option {option!r} "
                              "(kv=HOST:PORT, events=tcp://HOST:PORT, replay=tcp://HOST:PORT)")
    endpoint = None
    if events:
        if "endpoint" not in events:
            raise ConfigError(f"{flag} {spec!r}: replay= needs events= too")
        try:
            endpoint = decode_endpoint(events)
        except EventError as e:
            raise ConfigError(f"{flag} {spec!r}: {e}") from None
    return StaticSpec(role, f"{host}:{port}", kv, endpoint)

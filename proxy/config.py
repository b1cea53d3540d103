"""Proxy configuration: one typed dataclass, loaded from CLI > XPYD_* env > YAML > defaults."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from proxy.config_help import HELP  # re-exported: proxy.config.HELP, the flags' help texts
from proxy.errors import ConfigError  # re-exported: proxy.config.ConfigError is what callers catch

ENV_PREFIX = "XPYD_"
POLICIES = ("round_robin", "least_loaded", "power_of_two", "cache_aware", "precise")
DISPATCH_MODES = ("sequential", "concurrent")
FIRST_TOKEN_MODES = ("prefill", "decode")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    # Loopback by default, like every port here: a wider address serves anyone who reaches it
    # (the proxy warns at start-up when it does so without an api_key).
    host: str = "127.0.0.1"
    port: int = 8000
    # Loopback by default: a reachable discovery socket lets anyone add or remove instances.
    discovery_host: str = "127.0.0.1"
    discovery_port: int = 30001
    # Shared secret that registrations must be signed with (HMAC); None accepts unsigned.
    discovery_secret: str | None = field(default=None, repr=False)  # secrets stay out of logs
    # Each secret may come from a file instead (kept out of argv: proxy/secret_files.py).
    discovery_secret_file: str | None = None
    # Binding discovery beyond loopback without a secret needs this explicit opt-in.
    allow_unauthenticated_discovery: bool = False
    heartbeat_timeout: float = 10.0
    # Discovered instances the proxy holds (live or pending) per role, and per source host
    # (the discovery connection's peer address): registrations beyond are refused, so a
    # flood of addresses cannot grow the registry or the probing without bound.
    discovery_max_per_role: int = 1024
    discovery_max_per_source: int = 64
    # What discovery senders may cost (proxy/membership/discovery.py): the share of each second
    # its receive loop may work (then it waits: the rest is queued in ZMQ), messages a second per
    # source host (the rest dropped undecoded), connections held (also at most a quarter of the
    # fd limit) and per source host.
    discovery_cpu_share: float = 0.2
    discovery_max_source_rate: int = 200
    discovery_max_connections: int = 2 * 1024 + 64
    discovery_max_connections_per_source: int = 128
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    # cache_aware: the proxy's model of each instance's prefix cache, and when to follow it
    # (defaults measured with scripts/bench_routing.py; see README).
    cache_aware_chunk_tokens: int = 16
    cache_aware_capacity_tokens: int = 500_000
    cache_aware_min_match: float = 0.5
    cache_aware_balance_abs: float = 8.0
    cache_aware_balance_rel: float = 1.5
    # KV-event intake (proxy/routing/kv_events.py; on for every instance that advertises events):
    # blocks indexed per instance at most (an advertised KV capacity only lowers it), and
    # seconds without a word from its publisher before its index counts as unknown.
    kv_index_max_blocks: int = 262_144
    kv_events_silence: float = 10.0
    # The model's tokenizer (directory or Hugging Face name) for the `precise` policies:
    # prompts are tokenized as vLLM does to look up the instances' KV indexes.
    tokenizer: str | None = None
    # Tokenizing budget (proxy/routing/prompt_keys.py): longest prompt tokenized (bytes), jobs queued
    # on the tokenizer's thread, and the longest a request waits; past any, the guess.
    tokenize_max_bytes: int = 1024 * 1024
    tokenize_max_pending: int = 8
    tokenize_timeout: float = 1.0
    # A request's own chat template is refused (400, vLLM's answer) unless trusted; the
    # proxy never runs it either way (vLLM needs its own --trust-request-chat-template).
    trust_request_chat_template: bool = False
    # P ships only the KV blocks D lacks, when D's KV events say it holds the prompt's first
    # blocks (with --decode-policy precise); D recomputes anything it no longer holds.
    send_only_missing: bool = True
    # Clients must send "Authorization: Bearer <api_key>" when set.
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    # /metrics answers only with the API key too (/instances always needs it when set).
    metrics_require_api_key: bool = False
    # Instance addresses in response headers and /instances, and vLLM's internal request
    # id (it names P's and D's KV addresses) left in responses; off: a neutral id instead.
    expose_routing_headers: bool = False
    # X-Request-Id on every response, as vLLM's own flag of that name adds it (off: none, as vLLM).
    enable_request_id_headers: bool = False
    # Sent as "Authorization: Bearer KEY" to instances started with their own --api-key.
    upstream_api_key: str | None = field(default=None, repr=False)
    upstream_api_key_file: str | None = None
    # Pass the client's Authorization header on to the instances (off: never forwarded).
    forward_client_auth: bool = False
    # The LoRA admin routes want "Authorization: Bearer <admin_api_key>" (unset: refused);
    # adapters remembered for instances that join later; one load's deadline per instance.
    admin_api_key: str | None = field(default=None, repr=False)
    admin_api_key_file: str | None = None
    max_adapters: int = 64
    adapter_timeout: float = 120.0
    # Test hook: a client's kv_transfer_params xpyd_debug_* fields reach the instances (off:
    # stripped like every field the proxy owns, proxy/serving/intake.py).
    forward_debug_params: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    # What bodies may cost (proxy/asgi.py): bytes all requests' bodies hold at once, counted at
    # about their parsed size until their request ends (503 past it), and the JSON values and
    # arrays/objects one body may hold (413 past them: parsing holds the event loop).
    max_held_body_bytes: int = 1024 * 1024 * 1024
    max_body_values: int = 1024 * 1024
    max_body_containers: int = 64 * 1024
    # The HTTP edge (proxy/serving/edge.py), before any authentication: request line + headers
    # (431 above), seconds to receive them from a connection's first byte (or its opening),
    # seconds to receive a body once its headers are in (408 after either), and client
    # connections held at once (new ones get 503; also capped by half the fd limit).
    max_header_bytes: int = 32 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections: int = 4096
    # Largest non-streamed upstream answer (and /v1/models) the proxy buffers; above: 502.
    max_response_bytes: int = 64 * 1024 * 1024
    # Per-phase deadlines, seconds.
    connect_timeout: float = 5.0
    prefill_timeout: float = 600.0
    # For a non-streaming request D's first byte comes with the whole answer: be generous.
    decode_ttfb_timeout: float = 600.0
    stream_idle_timeout: float = 120.0
    # Extra prefill attempts on another P after a connect error or timeout.
    prefill_retries: int = 2
    # Redo a request on another D (with a new P/D pair) when D fails before its first byte.
    decode_retries: int = 1
    # concurrent: D gets the request as soon as P is chosen (it parses, tokenizes and queues it
    # while P prefills, holding no KV blocks until P begins sending: connector/p2p/scheduler.py), and
    # computes the first token itself; sequential: D gets the request when P has answered.
    dispatch: str = "concurrent"
    # Concurrent dispatch: requests this proxy has asked one D ahead of P's answer that still wait
    # for it. Each waits in D's engine queue, which vLLM's scheduler walks every step (D's
    # decoding slows with them: scripts/bench_waiting.py); past the bound a request's D is asked
    # once P answered, as with sequential dispatch. 0: no bound.
    decode_max_early: int = 8
    # prefill: the client's first token is P's, sent as soon as P answers, and D continues
    # from prompt + that token (streaming completions whose parameters allow it:
    # proxy/dispatch/first_token.py); TTFT then waits for neither the transfer nor D's first step.
    # With sequential dispatch only (concurrent: D computes it), and a one-token answer is P's
    # alone with either. decode: D computes it after loading the KV, for every request.
    first_token: str = "prefill"
    # Prompts shorter than this many (estimated) tokens go to D alone; 0 disables. 128:
    # below it D alone answers faster than P + transfer (scripts/bench_e2e.py
    # --short-sweep) and its prefill costs D's streams less than a few of their steps.
    local_prefill_threshold: int = 128
    # With no P live or reachable, D prefills the prompt itself instead of a 503.
    fallback_to_decode: bool = True
    # An instance that refused a connection is avoided for this long (unless it is the only one).
    failure_cooldown: float = 2.0
    # Admission control: requests in flight per instance (0: unlimited). A request whose
    # every candidate is full waits in a FIFO queue (at most queue_size, queue_timeout s
    # per wait), else 429.
    prefill_max_in_flight: int = 0
    decode_max_in_flight: int = 0
    queue_size: int = 1024
    queue_timeout: float = 30.0
    # Static instances (no discovery): "URL[,kv=HOST:PORT]" each, health-checked.
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    health_interval: float = 2.0
    # Deadline of one /health or /v1/models probe; models are re-read every interval.
    probe_timeout: float = 5.0
    models_refresh_interval: float = 30.0
    # Routes no instance generates on (tokenize, render, pooling, scoring, ...: proxy/api_routes.py
    # ONE_INSTANCE) go to an instance of this role (the other when it has none): P by default,
    # so that D's decoding streams do not share their steps with that work.
    passthrough_role: str = "P"
    # Paths of routes a later vLLM adds that generate nothing, forwarded like those (the table,
    # proxy/api_routes.py, lists vLLM 0.32's; any other path gets vLLM's 404).
    passthrough_routes: tuple[str, ...] = ()
    # Stored responses (vLLM's Responses API with its store on): the D holding each, remembered
    # for at most this many responses and this long; an id not remembered is asked of every D.
    response_holders: int = 100_000
    response_holders_ttl: float = 86_400.0
    # Join probes (of instances not yet answered) in flight at once.
    probe_concurrency: int = 32
    shutdown_grace_s: float = 30.0
    log_level: str = "info"
    # One OpenTelemetry trace per request, exported over OTLP as the OTEL_* variables say
    # (proxy/tracing.py; needs the `tracing` extra). Off: no OpenTelemetry import, no cost.
    tracing: bool = False
    # Runtime choices (see README for the measurements behind the defaults).
    upstream_client: str = "native"
    loop: str = "auto"
    http: str = "auto"

    def validate(self) -> ProxyConfig:
        for name in ("port", "discovery_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ConfigError(f"{name} must be in 0..65535, got {value}")
        for name in (
            "heartbeat_timeout",
            "connect_timeout",
            "prefill_timeout",
            "decode_ttfb_timeout",
            "stream_idle_timeout",
            "queue_timeout",
            "health_interval",
            "probe_timeout",
            "models_refresh_interval",
            "kv_events_silence",
            "tokenize_timeout",
            "header_timeout",
            "body_timeout",
            "response_holders_ttl",
            "adapter_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if not 0.0 < self.discovery_cpu_share <= 1.0:
            raise ConfigError("discovery_cpu_share must be in (0, 1]")
        if self.failure_cooldown < 0 or self.shutdown_grace_s < 0:
            raise ConfigError("failure_cooldown and shutdown_grace_s must be >= 0")
        if self.max_body_bytes <= 0 or self.max_response_bytes <= 0:
            raise ConfigError("max_body_bytes and max_response_bytes must be > 0")
        if self.max_held_body_bytes < 2 * self.max_body_bytes:
            raise ConfigError("max_held_body_bytes must hold at least one body of max_body_bytes (twice it)")
        if self.max_body_values < 1 or self.max_body_containers < 1:
            raise ConfigError("max_body_values and max_body_containers must be >= 1")
        for name in ("api_key", "discovery_secret", "upstream_api_key", "admin_api_key"):
            value = getattr(self, name)
            # An empty key must not silently mean "authentication off".
            if value is not None and not value.strip():
                raise ConfigError(f"{name} must not be empty (leave it unset to disable it)")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ConfigError("admin_api_key must differ from api_key: clients must not manage adapters")
        if (
            self.discovery_secret is None
            and not self.allow_unauthenticated_discovery
            and not is_loopback(self.discovery_host)
        ):
            raise ConfigError(
                f"discovery binds {self.discovery_host!r} without --discovery-secret: anyone "
                "who reaches it can add or remove instances. Set --discovery-secret (and the "
                "same discovery_secret in each instance's kv_connector_extra_config), bind "
                "--discovery-host 127.0.0.1, or pass --allow-unauthenticated-discovery"
            )
        for name in ("prefill_retries", "decode_retries", "local_prefill_threshold",
                     "prefill_max_in_flight", "decode_max_in_flight", "queue_size",
                     "decode_max_early"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        for name in ("discovery_max_per_role", "discovery_max_per_source", "probe_concurrency",
                     "discovery_max_source_rate", "discovery_max_connections",
                     "discovery_max_connections_per_source",
                     "kv_index_max_blocks", "tokenize_max_bytes", "tokenize_max_pending",
                     "max_connections", "response_holders", "max_adapters"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.max_header_bytes < 1024:
            raise ConfigError("max_header_bytes must be >= 1024")
        if self.cache_aware_chunk_tokens < 1:
            raise ConfigError("cache_aware_chunk_tokens must be >= 1")
        if self.cache_aware_capacity_tokens < self.cache_aware_chunk_tokens:
            raise ConfigError("cache_aware_capacity_tokens must be >= cache_aware_chunk_tokens")
        if not 0.0 <= self.cache_aware_min_match <= 1.0:
            raise ConfigError("cache_aware_min_match must be in 0..1")
        if self.cache_aware_balance_abs < 0 or self.cache_aware_balance_rel < 1:
            raise ConfigError("cache_aware_balance_abs must be >= 0, cache_aware_balance_rel >= 1")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise ConfigError(f"{name} must be one of {', '.join(POLICIES)}")
            if getattr(self, name) == "precise" and not self.tokenizer:
                raise ConfigError(f"{name} precise needs --tokenizer (the served model's tokenizer "
                                  "directory or name): it looks prompts up by their token ids")
        choices = {
            "upstream_client": ("native", "aiohttp", "httpx"),
            "loop": ("auto", "uvloop", "asyncio"),
            "http": ("auto", "httptools", "h11"),
            "dispatch": DISPATCH_MODES,
            "passthrough_role": ("P", "D"),
            "first_token": FIRST_TOKEN_MODES,
            "log_level": ("debug", "info", "warning", "error", "critical"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}")
        from proxy.api_routes import ROUTES  # late: config must stay import-light
        from proxy.membership.static import parse_static

        known = {r.path for r in ROUTES}
        for path in self.passthrough_routes:
            if not path.startswith("/") or "{" in path or any(c.isspace() for c in path):
                raise ConfigError(f"passthrough_routes: {path!r} is not a path (e.g. /v1/new_route)")
            if path in known or path in ("/ready", "/instances"):
                raise ConfigError(f"passthrough_routes: {path} is a route the proxy already serves "
                                  "(proxy/api_routes.py says how)")

        for role, specs in (("P", self.prefill), ("D", self.decode)):
            for spec in specs:
                parse_static(role, spec)  # raises ConfigError
        return self


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    import ipaddress

    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xpyd-proxy",
        description="OpenAI-compatible prefill/decode proxy for vLLM with ZMQ discovery. "
        "Every flag can also be set in the YAML --config file (snake_case key) "
        "or as an XPYD_<NAME> environment variable; precedence: flag > env > file > default.",
    )
    parser.add_argument("--config", default=None, help="YAML config file (env XPYD_CONFIG)")
    for f in fields(ProxyConfig):
        kwargs: dict[str, Any] = {"default": None, "dest": f.name}
        if f.name in ("prefill_policy", "decode_policy"):
            kwargs["choices"] = POLICIES
        elif f.name == "dispatch":
            kwargs["choices"] = DISPATCH_MODES
        elif f.name == "first_token":
            kwargs["choices"] = FIRST_TOKEN_MODES
        if _is_list(f):
            kwargs["action"] = "append"
            kwargs["metavar"] = "PATH" if f.name == "passthrough_routes" else "URL[,kv=HOST:PORT]"
        kwargs["type"] = _scalar_type(f)
        if kwargs["type"] is _parse_bool:
            # "--flag" alone means true; "--flag false" still turns a default-on flag off.
            kwargs.update(nargs="?", const=True, metavar="BOOL")
        kwargs["help"] = f"{HELP.get(f.name, '')} (default: {f.default})"
        parser.add_argument(_flag(f.name), **kwargs)
    return parser


def _parse_bool(value: str) -> bool:
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(value)


def _scalar_type(f: dataclasses.Field) -> Any:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if t.startswith("bool"):
        return _parse_bool
    if t.startswith("int"):
        return int
    if t.startswith("float"):
        return float
    return str


def _is_list(f: dataclasses.Field) -> bool:
    return str(f.type).startswith("tuple[")


def _coerce_list(f: dataclasses.Field, value: Any, source: str) -> tuple[str, ...]:
    """A list field: a YAML list (or one string), or an env string whose entries are
    separated by ';' or whitespace (',' belongs to an entry's options)."""
    if isinstance(value, str):
        items: list[Any] = value.replace(";", " ").split()
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif value is None:
        return ()
    else:
        raise ConfigError(f"{f.name} ({source}) must be a list of strings, got {value!r}")
    if not all(isinstance(v, str) and v.strip() for v in items):
        raise ConfigError(f"{f.name} ({source}) must be a list of non-empty strings")
    return tuple(v.strip() for v in items)


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    """Convert an env string or YAML value to the field's type, or raise ConfigError."""
    if _is_list(f):
        return _coerce_list(f, value, source)
    kind = _scalar_type(f)
    optional = "None" in str(f.type)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{f.name} ({source}) must not be empty")
    if isinstance(value, str) and value == "" and kind is not str:
        raise ConfigError(f"{f.name} ({source}) must not be empty")
    try:
        if kind is _parse_bool:
            return value if isinstance(value, bool) else _parse_bool(str(value))
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
    except (TypeError, ValueError):
        expected = "bool" if kind is _parse_bool else kind.__name__
        raise ConfigError(f"{f.name} ({source}) must be {expected}, got {value!r}") from None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"{f.name} ({source}) must be a string, got {value!r}")
    return str(value)


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml  # only needed with --config

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping")
    known = {f.name for f in fields(ProxyConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(f"unknown key {key!r} in {path}")
        out[name] = value
    return out


def load_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ProxyConfig:
    """Resolve each field as: CLI flag > XPYD_* env var > YAML file > dataclass default."""
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    config_path = args.config or env.get(ENV_PREFIX + "CONFIG")
    from_file = _read_yaml(config_path) if config_path else {}
    values: dict[str, Any] = {}
    for f in fields(ProxyConfig):
        cli = getattr(args, f.name)
        env_key = ENV_PREFIX + f.name.upper()
        if cli is not None:
            values[f.name] = tuple(cli) if _is_list(f) else cli
        elif env_key in env:
            values[f.name] = _coerce(f, env[env_key], env_key)
        elif f.name in from_file:
            values[f.name] = _coerce(f, from_file[f.name], str(config_path))
    from proxy import secret_files  # the *_file options; a warning for a secret in argv

    try:
        secret_files.resolve(values, vars(args))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return ProxyConfig(**values).validate()

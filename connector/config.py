"""Typed view of the connector's slice of vLLM's --kv-transfer-config."""

from __future__ import annotations

import ipaddress
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from connector.log import get_logger
from connector.server_args import tool_parser_adjusts
from xpyd_wire.discovery import GenerationDefaults, OutputLimits, ProtocolError, check_generation, check_output_limits
from xpyd_wire.kv_events import EventError, EventsEndpoint, advertised
from xpyd_wire.secret_file import read_secret_file

logger = get_logger(__name__)

SendType = Literal["PUT", "PUT_ASYNC", "GET"]
SEND_TYPES: tuple[str, ...] = ("PUT", "PUT_ASYNC", "GET")
# "request": P ships a prompt's KV once, after the forward pass that completed it; "layer":
# each layer's blocks as soon as that layer's attention ran, overlapping the later layers;
# "auto": layer over tcp (measured: README, Layer-wise sends), request over nccl (not measured).
SEND_GRANULARITIES: tuple[str, ...] = ("auto", "request", "layer")  # the default first
DEFAULT_SEND_GRANULARITY = SEND_GRANULARITIES[0]


@dataclass(frozen=True, slots=True)
class ProxyName:
    """One configured proxy address: an IP literal, used as is, or a DNS name to resolve."""

    host: str
    port: int

    @property
    def literal(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    @staticmethod
    def parse(addr: str) -> "ProxyName":
        """host:port, [v6]:port or v6-literal:port (the port is the last colon's)."""
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"proxy address must be host:port, got {addr!r}")
        return ProxyName(host.removeprefix("[").removesuffix("]"), int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def _proxies(extra: dict[str, Any]) -> tuple[str, ...]:
    """Upstream uses proxy_ip/proxy_port; we also accept a list under "proxies"."""
    out: list[str] = []
    if extra.get("proxy_ip") and extra.get("proxy_port"):
        out.append(f"{extra['proxy_ip']}:{int(extra['proxy_port'])}")
    for addr in extra.get("proxies", []) or []:
        if addr not in out:
            out.append(str(addr))
    for addr in out:
        ProxyName.parse(addr)  # a malformed address is a start-up error, not a silent registrar
    return tuple(out)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only (a name may resolve to anything)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _flag(value: Any) -> bool:
    """A boolean option; JSON strings like "false" or "0" mean False (bool() says True)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


# A secret is a token, not a document: a larger file is a mistake (or a device), refused.
def _read_secret_file(path: str, where: str) -> tuple[str, str]:
    """(the secret in ``path`` less one trailing newline, where it came from); ValueError."""
    return read_secret_file(path, where, logger.warning), f"{where} ({path})"


def _secret(extra: dict[str, Any], key: str, env: str, path: Any = None) -> str | None:
    """A shared secret: ``extra[key]``, else the file ``path`` (the extra config's
    ``{key}_file``), else env ``env``, else the file env ``{env}_FILE`` names. Two of these at
    one level (the extra config, the env) is an error; so is a secret set but empty: it must
    not silently mean "unsigned". vLLM prints kv_connector_extra_config in its start-up
    "non-default args" line (it redacts only its own secrets): a secret there is warned about."""
    if extra.get(key) is not None:
        if path is not None:
            raise ValueError(f"kv_connector_extra_config sets both {key} and {key}_file: keep one")
        logger.warning("kv_connector_extra_config[%r] is printed by vLLM in its start-up 'non-default args' "
                       "line (and readable in /proc/<pid>/cmdline): use %s_file, or env %s / %s_FILE, instead",
                       key, key, env, env)
        value, where = str(extra[key]), f"kv_connector_extra_config[{key!r}]"
    elif path is not None:
        value, where = _read_secret_file(str(path), f"kv_connector_extra_config[{key + '_file'!r}]")
    elif env in os.environ:
        if os.environ.get(env + "_FILE"):
            raise ValueError(f"both env {env} and {env}_FILE are set: keep one")
        value, where = os.environ[env], f"env {env}"
    elif os.environ.get(env + "_FILE"):
        value, where = _read_secret_file(os.environ[env + "_FILE"], f"env {env}_FILE")
    else:
        return None
    if not value.strip():
        raise ValueError(f"{where} is empty: leave it unset to turn {key} off")
    return value


def _choice(extra: dict[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    value = str(extra.get(key, allowed[0])).lower()
    if value not in allowed:
        raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
    return value


def _positive_int(extra: dict[str, Any], key: str) -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).strip().isdigit() \
            or int(value) < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return int(value)


def _idle_wait_ms(extra: dict[str, Any]) -> float:
    value = extra.get("idle_wait_ms", DEFAULT_IDLE_WAIT_MS)
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = -1.0
    if isinstance(value, bool) or not (0 <= ms <= MAX_IDLE_WAIT_MS):
        raise ValueError(f"idle_wait_ms must be a number of milliseconds in [0, {MAX_IDLE_WAIT_MS:g}], got {value!r}")
    return ms


def _positive_seconds(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key)
    if value is None:
        return default
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{key} must be a number of seconds > 0, got {value!r}")
    return seconds


# How long an engine step that computes nothing may wait for a transfer to move. A request
# that reaches an engine waiting this way starts at most this much later. 5 ms ended the
# stall of scripts/bench_kv_wait.py (P's request waited out D's whole KV wait) as 20 ms did.
DEFAULT_IDLE_WAIT_MS = 5.0
MAX_IDLE_WAIT_MS = 1000.0

# Pinned staging per role. A decode instance receives every prompt's KV; 1 GiB of overflow
# beyond kv_buffer_size holds ~8k tokens of an 8B GQA model (Llama-3-8B: 128 KiB/token), i.e.
# a short burst, without pinning much of the host (pinned pages cannot be swapped; the pool
# is allocated and pinned, at exactly this size, in the background as the engine starts). A
# prefill-only instance receives no KV in any send mode (GET copies live in its send store),
# so it gets none.
DEFAULT_POOL_GB = {"kv_consumer": 1.0, "kv_both": 1.0, "kv_producer": 0.0}


def _pool_gb(extra: dict[str, Any], role: str) -> float:
    value = extra.get("mem_pool_size_gb")
    if value is None:
        return DEFAULT_POOL_GB.get(role, 0.0)
    try:
        gb = float(value)
    except (TypeError, ValueError):
        gb = -1.0
    if not gb >= 0:
        raise ValueError(f"mem_pool_size_gb must be a number >= 0, got {value!r}")
    return gb


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    role: str  # kv_producer | kv_consumer | kv_both
    kv_ip: str
    kv_port: int
    http_host: str
    http_port: int | None
    proxies: tuple[str, ...]
    send_type: SendType
    kv_buffer_size: int
    kv_load_timeout_s: float
    send_timeout_s: float
    buffer_ttl_s: float
    heartbeat_interval_s: float
    transport: str
    thread_affinity: str  # "auto": move our threads off the cores OpenMP pinned; "off": leave them
    discovery_secret: str | None = field(repr=False)  # never in a logged config
    # Test hook: honour kv_transfer_params["xpyd_debug_corrupt_kv"] on load. Off
    # unless explicitly enabled, so clients cannot corrupt a production instance.
    allow_debug_corruption: bool
    # Shared secret of the KV control sockets (kv_secret, else XPYD_KV_SECRET, else the
    # discovery secret); None: anyone who reaches a KV port is served (upstream behaviour).
    kv_secret: str | None = field(default=None, repr=False)
    kv_auth: str = "mac"  # "mac": a MAC on every call; "curve": ZMQ CURVE (encrypted, slower)
    # NCCL channels of the KV communicators only (their ncclConfig_t); None: NCCL decides.
    nccl_num_channels: int | None = None
    # Pinned host pool for received KV beyond kv_buffer_size on a GPU (GiB; 0: none).
    mem_pool_size_gb: float = 0.0
    # How often proxy names (e.g. a headless Service) are resolved again to find every replica.
    proxy_resolve_interval_s: float = 10.0
    # Where vLLM publishes this instance's KV events (from --kv-events-config), advertised to
    # the proxy in the heartbeat; None: events off or not reachable over tcp.
    kv_events: EventsEndpoint | None = None
    # How this instance's vLLM caps generated tokens, advertised to the proxy (which then
    # knows the limit of a request that sets none); None: not known.
    output_limits: OutputLimits | None = None
    # The sampling defaults this instance's vLLM applies and whether a reasoning parser reads
    # its chat answers, advertised to the proxy (its first token from P needs them); None: not known.
    generation: GenerationDefaults | None = None
    # D: when a prompt's KV is already here as the scheduler plans its load, load it
    # synchronously (before the forward pass of the step that schedules the request) instead
    # of one engine step later; False: always asynchronously.
    sync_load: bool = True
    # D: a request whose prefill has not begun sending (no reservation, part or refusal on the
    # arrival board) waits in vLLM's queue without KV-cache blocks and without its load deadline
    # running, for at most this long; then D computes the prompt itself. The load deadline
    # (kv_load_timeout_s) runs from when the sender began: a P that is queued or slow cannot
    # fail D's load (the proxy's concurrent dispatch asks D before P has even started).
    kv_prefill_wait_s: float = 600.0
    # Longest a worker waits for a transfer to progress (KV arriving, a send ending) in an
    # engine step that computes nothing: vLLM steps without pause while a request waits for
    # remote KV or its blocks wait for a send, and on a CPU box shared with another engine
    # that loop can hold the other engine off for as long as it lasts. 0: never wait (vLLM's
    # own behaviour).
    idle_wait_ms: float = DEFAULT_IDLE_WAIT_MS
    # P (PUT_ASYNC): "request" ships a prompt's KV after the forward pass; "layer" ships each
    # layer's blocks while the later layers run (README: Layer-wise sends); "auto" picks per transport.
    send_granularity: str = DEFAULT_SEND_GRANULARITY
    # tcp: calls (and KV) over the transport's byte stream, a plain TCP port of its own beside
    # the KV port (transport/stream.py); False: zmq alone (for a firewall that passes only
    # the KV ports).
    byte_stream: bool = True
    # A KV port bound beyond loopback without kv_secret needs this explicit opt-in: anyone who
    # reaches it can put KV for a transfer (which vLLM's prefix cache then serves to others).
    allow_unauthenticated_kv: bool = False
    # zmq connections a KV port holds, in all and from one host; new ones beyond are shut down.
    kv_max_connections: int = 1024
    kv_max_connections_per_host: int = 256

    def layerwise_on(self, transport: str) -> bool:
        """Whether this instance ships each layer as its forward ends, over ``transport`` ("tcp"
        or "nccl"). Only PUT_ASYNC sends apart from the step ("layer" with another send type
        is refused at start-up; "auto" then means request)."""
        if not self.is_producer or self.send_type != "PUT_ASYNC":
            return False
        if self.send_granularity == "auto":
            return transport == "tcp"
        return self.send_granularity == "layer"

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @property
    def loads_sync(self) -> bool:
        """D may load synchronously (KV already here); GET pulls only once a load is planned."""
        return self.is_consumer and self.sync_load and self.send_type != "GET"

    @property
    def advertised_address(self) -> str:
        """The zmq address peers (and the proxy's request ids) use for rank 0."""
        return f"{self.kv_ip}:{self.kv_port}"

    @staticmethod
    def from_vllm(kv_transfer_config: Any, kv_events_config: Any = None,
                  kv_blocks: int | None = None, model_config: Any = None,
                  reasoning_parser: str | None = None) -> "ConnectorConfig":
        extra: dict[str, Any] = dict(kv_transfer_config.kv_connector_extra_config or {})
        send_type = str(extra.get("send_type", "PUT_ASYNC")).upper()
        if send_type not in SEND_TYPES:
            raise ValueError(f"send_type must be one of {SEND_TYPES}, got {send_type!r}")
        role = kv_transfer_config.kv_role
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"unsupported kv_role {role!r}")
        # vLLM 0.32 rejects top-level kv_ip / kv_buffer_size, so they live here.
        kv_ip = str(extra.get("kv_ip", "127.0.0.1"))
        http_port = extra.get("http_port")
        granularity = _choice(extra, "send_granularity", SEND_GRANULARITIES)
        if granularity == "layer" and send_type != "PUT_ASYNC":
            # PUT sends inside the step (nothing to overlap it with); GET copies once for D to pull.
            raise ValueError(f"send_granularity 'layer' needs send_type PUT_ASYNC, got {send_type!r}")
        discovery_secret = _secret(extra, "discovery_secret", "XPYD_DISCOVERY_SECRET",
                                   extra.get("discovery_secret_file"))
        kv_secret = _secret(extra, "kv_secret", "XPYD_KV_SECRET", extra.get("kv_secret_file")) or discovery_secret
        allow_open = _flag(extra.get("allow_unauthenticated_kv", False))
        if kv_secret is None and not allow_open and not is_loopback(kv_ip):
            raise ValueError(
                f"the KV port binds {kv_ip!r} without kv_secret: anyone who reaches it can put KV for a transfer "
                "(vLLM's prefix cache then serves it to other requests with the same prefix), read or fail "
                "transfers, and make the engine hold what it sends. Set kv_secret_file (or XPYD_KV_SECRET, or "
                "discovery_secret) alike on every instance, bind kv_ip to 127.0.0.1, or set "
                "allow_unauthenticated_kv: true for a network only trusted peers reach")
        return ConnectorConfig(
            role=role,
            kv_ip=kv_ip,
            kv_port=int(kv_transfer_config.kv_port),
            http_host=str(extra.get("http_host", kv_ip)),
            http_port=int(http_port) if http_port is not None else None,
            proxies=_proxies(extra),
            send_type=send_type,  # type: ignore[arg-type]
            kv_buffer_size=int(float(extra.get("kv_buffer_size", 1e9))),
            kv_load_timeout_s=float(extra.get("kv_load_timeout_s", 30.0)),
            send_timeout_s=float(extra.get("send_timeout_s", 10.0)),
            buffer_ttl_s=float(extra.get("buffer_ttl_s", 60.0)),
            heartbeat_interval_s=float(extra.get("heartbeat_interval_s", 3.0)),
            transport=_choice(extra, "transport", ("auto", "tcp", "nccl")),
            thread_affinity=_choice(extra, "thread_affinity", ("auto", "off")),
            discovery_secret=discovery_secret,
            allow_debug_corruption=_flag(extra.get("allow_debug_corruption", False)),
            kv_secret=kv_secret,
            kv_auth=_choice(extra, "kv_auth", ("mac", "curve")),
            nccl_num_channels=_positive_int(extra, "nccl_num_channels"),
            mem_pool_size_gb=_pool_gb(extra, role),
            proxy_resolve_interval_s=_positive_seconds(extra, "proxy_resolve_interval_s", 10.0),
            kv_events=events_endpoint(kv_events_config, kv_ip, kv_blocks),
            output_limits=output_limits(model_config),
            generation=generation_defaults(model_config, reasoning_parser),
            sync_load=_flag(extra.get("sync_load", True)),
            kv_prefill_wait_s=_positive_seconds(extra, "kv_prefill_wait_s", 600.0),
            idle_wait_ms=_idle_wait_ms(extra),
            send_granularity=granularity,
            byte_stream=_flag(extra.get("byte_stream", True)),
            allow_unauthenticated_kv=allow_open,
            kv_max_connections=_positive_int(extra, "kv_max_connections") or 1024,
            kv_max_connections_per_host=_positive_int(extra, "kv_max_connections_per_host") or 256,
        )


def output_limits(model_config: Any) -> OutputLimits | None:
    """How vLLM's OpenAI server caps generated tokens, worked out as vLLM 0.32's serving
    classes do (chat and completions alike): a request without a limit gets the generation
    config's max_new_tokens (``get_diff_sampling_param``'s max_tokens), every request is
    capped by that same value when --generation-config names a path, else by
    --override-generation-config's max_new_tokens, and by the context left (max_model_len
    less the prompt). None where the model config does not say (an older or newer vLLM):
    the proxy then treats the limits as unknown."""
    if model_config is None:
        return None
    try:
        default = model_config.get_diff_sampling_param().get("max_tokens")
        if model_config.generation_config not in ("auto", "vllm"):
            override = default
        else:
            override = (getattr(model_config, "override_generation_config", None) or {}).get("max_new_tokens")
    except Exception as e:  # noqa: BLE001 - reading a generation config can fail many ways
        logger.warning("output limits not known (%s: %s): the proxy keeps requests without a token "
                       "limit on D's first token", type(e).__name__, e)
        return None
    try:
        return check_output_limits({"default": default, "override": override,
                                    "context": getattr(model_config, "max_model_len", None)})
    except ProtocolError as e:
        logger.warning("output limits not advertised: %s", e)
        return None


def generation_defaults(model_config: Any, reasoning_parser: str | None,
                        argv: Sequence[str] | None = None) -> GenerationDefaults | None:
    """The sampling values vLLM's OpenAI server applies where a request leaves the field out
    (vLLM 0.32's serving classes take them from ``get_diff_sampling_param``: the generation
    config's, with --override-generation-config; max_tokens goes in OutputLimits), whether
    --reasoning-parser is set, and which chat requests a tool parser adjusts (read from the
    server's command line, ``argv``: this process's by default; connector/server_args.py).
    None where the model config does not say."""
    if model_config is None:
        return None
    try:
        sampling = {k: v for k, v in model_config.get_diff_sampling_param().items() if k != "max_tokens"}
        tool_parser = tool_parser_adjusts(sys.argv[1:] if argv is None else argv, model_config)
        logger.info("chat requests a tool parser adjusts: %s", tool_parser or "not known")
        return check_generation({"sampling": sampling, "reasoning_parser": bool(reasoning_parser)}, tool_parser)
    except Exception as e:  # noqa: BLE001 - reading a generation config can fail many ways
        logger.warning("generation defaults not advertised (%s: %s): the proxy keeps this instance's requests on "
                       "its own first token", type(e).__name__, e)
        return None


def _bound_by_vllm(endpoint: str) -> bool:
    """vLLM's ZmqEventPublisher binds wildcard (and ipc) endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def events_endpoint(kv_events_config: Any, kv_host: str, kv_blocks: int | None = None) -> EventsEndpoint | None:
    """What the heartbeat advertises of vLLM's KV-event publisher: its bind endpoints with this
    instance's KV host (``tcp://*:5557`` -> ``tcp://{kv_host}:5557``), the topic, and the KV
    capacity in blocks when known (the proxy bounds its index of this instance by it). None
    when events are off, or published where a proxy cannot subscribe (logged)."""
    if kv_events_config is None or not getattr(kv_events_config, "enable_kv_cache_events", False):
        return None
    if getattr(kv_events_config, "publisher", None) != "zmq":
        return None
    endpoint = str(kv_events_config.endpoint)
    replay = getattr(kv_events_config, "replay_endpoint", None)
    try:
        if not _bound_by_vllm(endpoint):
            raise EventError(f"vLLM connects (does not bind) {endpoint!r}")
        ep = advertised(endpoint, kv_host)
        rep = advertised(str(replay), kv_host) if replay else None
    except EventError as e:
        logger.warning("kv events not advertised to the proxy: %s (use tcp://*:PORT)", e)
        return None
    blocks = kv_blocks if isinstance(kv_blocks, int) and kv_blocks > 0 else None
    return EventsEndpoint(ep, rep, str(getattr(kv_events_config, "topic", "") or ""), blocks)

"""The discovery wire format, shared by the proxy and the connector (xpyd_wire owns it).

Upstream-compatible core: ``msgpack({"type": "P"|"D", "http_address": "host:port",
"zmq_address": "host:port"})``. Optional xPyD fields:

- ``load``: ``{"running": int, "waiting": int, "kv_usage": float, "kv_buffer_usage": float,
  "waiting_for_kv": int?}`` (counts 0..MAX_LOAD_COUNT, usages 0..1; ``kv_buffer_usage``: the KV
  connector's receive buffer; ``waiting_for_kv``: of the waiting, those a D holds until their
  prefill begins sending, which concurrent dispatch sends ahead of P; absent: 0, and proxies
  before it ignore it)
- ``kv_transport_fallbacks``: int 0..MAX_LOAD_COUNT, times the instance's KV transport left
  NCCL for the host-staged tcp path with a peer since it started (0 and absent alike)
- ``leave``: ``True`` to deregister gracefully
- ``output_limits``: ``{"default": int?, "override": int?, "context": int?}`` (each
  1..MAX_OUTPUT_TOKENS), how the instance's vLLM caps generated tokens: ``default`` where a
  request sets no limit (the generation config's ``max_new_tokens``), ``override`` whatever
  the request says, and the context (``max_model_len``) every answer ends at. Absent: not
  known
- ``kv_events``: where the instance publishes vLLM's KV events, ``{"endpoint": "tcp://host:port",
  "replay_endpoint": "tcp://host:port"?, "topic": str?, "blocks": int?}`` (xpyd_wire.kv_events);
  both hosts must be the host of ``zmq_address``, so a registration can only point the proxy
  at the instance's own KV host
- ``generation``: ``{"sampling": {name: number}?, "reasoning_parser": bool?}``, what else the
  instance's vLLM decides of an answer that a request cannot see: the sampling values it
  applies where a request leaves the field out (the generation config's, ``sampling``: at
  most MAX_SAMPLING_DEFAULTS names of lowercase letters and ``_``, finite numbers) and
  whether a reasoning parser reads its chat answers. Absent: not known (the proxy keeps its
  requests on D's first token, where such things cannot make an answer differ)
- ``tool_parser``: ``"none"`` | ``"tool_choice"`` | ``"always"``, when the instance's vLLM lets a
  tool parser adjust a chat request before it is sampled (``--tool-call-parser`` with
  ``--enable-auto-tool-choice``; the parser may keep special tokens, ``skip_special_tokens``
  false): never, for requests whose ``tool_choice`` is not ``"none"`` (``null`` included), or
  for every one. Read with ``generation`` (a field of its own: older proxies refuse unknown keys
  inside ``generation``); absent: not known (chat requests keep D's first token)
- ``instance_key``: random hex (16..32 bytes), drawn once per instance start and sent in
  every heartbeat: the proxy binds the record of ``http_address`` to the first key (and source
  host) it registered with, and drops heartbeats and ``leave`` messages for that address with
  another key, so one instance (or anyone holding the discovery secret) cannot rewrite or
  remove another's record. Absent (upstream senders, older connectors): the record is bound to
  its source host only. It is sent in clear: it keeps out other registrants, not someone who
  reads the discovery traffic
- ``ts``: sender's wall-clock time (float seconds); required when signed
- ``nonce``: random hex (16 bytes from the sender), required when signed: the proxy
  remembers nonces for the clock-skew window, so a captured message cannot be replayed
- ``hmac``: hex HMAC-SHA256 over the canonical encoding of every other field,
  keyed by the shared discovery secret

Every field is validated: a host is a DNS name (RFC 1123 labels), an IPv4 literal or a
bracketed IPv6 literal, a port is 1..65535 in ASCII digits, and nothing else gets through
(no whitespace, control characters, slashes, userinfo, percent signs): the addresses end up
in URLs and in the request ids the proxy sends upstream as a header. Every failure is a
ProtocolError whose ``reason`` is one of DROP_REASONS, never another exception.

This module imports nothing heavy so that vLLM's processes can use it too.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac as _hmac
import ipaddress
import math
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from xpyd_wire.kv_events import EventError, EventsEndpoint, decode_endpoint, split_endpoint

ROLES = ("P", "D")
# Signed messages older or newer than this are rejected; within it, nonces catch replays.
MAX_CLOCK_SKEW_S = 30.0
# Registrations are a few hundred bytes; refuse anything absurd before it is parsed.
MAX_MESSAGE_BYTES = 64 * 1024
# Known fields are 13; a few unknown ones are tolerated (and ignored, never kept) for compatibility.
MAX_FIELDS = 24
# Any one string or bytes value (an address is at most MAX_ADDRESS_LEN, an endpoint a little more),
# and the entries of any map or array (twice MAX_FIELDS: the field checks say why up to there):
# larger ones are refused while decoding, before they cost an object each.
MAX_VALUE_BYTES = 1024
MAX_ENTRIES = 2 * MAX_FIELDS
MAX_KEY_LEN = 64
MAX_HOST_LEN = 253  # RFC 1035 limit on a DNS name's text form
MAX_ADDRESS_LEN = MAX_HOST_LEN + 6  # ":65535"
# Requests running or waiting on one instance; far above any real engine, far below overflow.
MAX_LOAD_COUNT = 10_000_000
NONCE_BYTES = 16
INSTANCE_KEY_BYTES = 16

# Why a message was dropped: the label values of xpyd_discovery_messages_total (fixed set).
MALFORMED = "malformed"  # not a msgpack map of string keys within the size limits
INVALID_FIELD = "invalid_field"  # a field missing or outside its rules
UNAUTHORIZED = "unauthorized"  # unsigned, wrong signature, stale or future ts
REPLAYED = "replayed"  # a signed message whose nonce was already seen
DROP_REASONS = (MALFORMED, INVALID_FIELD, UNAUTHORIZED, REPLAYED)

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*", re.ASCII)
_IPV6_CHARS = re.compile(r"[0-9A-Fa-f:.]{2,45}", re.ASCII)
_PORT = re.compile(r"[1-9][0-9]{0,4}", re.ASCII)
_HEX_HMAC = re.compile(r"[0-9a-f]{64}", re.ASCII)
_HEX_NONCE = re.compile(r"[0-9a-f]{16,64}", re.ASCII)
_HEX_KEY = re.compile(r"[0-9a-f]{32,64}", re.ASCII)
# A token limit beyond any context length vLLM runs with.
MAX_OUTPUT_TOKENS = 2**31 - 1
_LIMIT_KEYS = ("default", "override", "context")
# When a tool parser adjusts a chat request (GenerationDefaults.tool_parser).
TOOL_PARSER_ADJUSTS = ("none", "tool_choice", "always")
# vLLM's generation-config sampling fields are 7; room for a few more from a newer vLLM.
MAX_SAMPLING_DEFAULTS = 16
_SAMPLING_NAME = re.compile(r"[a-z_]{1,32}", re.ASCII)
_LOAD_COUNTS = ("running", "waiting", "waiting_for_kv")
_LOAD_USAGES = ("kv_usage", "kv_buffer_usage")


class ProtocolError(ValueError):
    """A discovery message that is not well formed, or not signed correctly."""

    def __init__(self, message: str, reason: str = INVALID_FIELD) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Load:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_buffer_usage: float = 0.0
    # Of `waiting`: requests held until their prefill's KV begins to come (not D's compute).
    waiting_for_kv: int = 0


@dataclass(frozen=True, slots=True)
class OutputLimits:
    """How an instance's vLLM caps generated tokens (vLLM 0.32's serving layer: the least of
    the request's limit, else ``default``; ``override``; and the context left). ``default``:
    the generation config's ``max_new_tokens``; ``override``: the same when
    ``--generation-config`` names a path, else ``--override-generation-config``'s. None: no
    such cap."""

    default: int | None = None
    override: int | None = None
    context: int | None = None  # max_model_len: prompt and answer together end there

    def limit(self, requested: int | None) -> int | None:
        """What the server allows a request that asks for ``requested`` tokens (None: sets no
        limit), before the context left; None: only the context limits it."""
        caps = [x for x in (requested if requested is not None else self.default, self.override) if x is not None]
        return min(caps) if caps else None


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What an instance's vLLM decides of an answer beyond its token limits (OutputLimits):
    ``sampling``, the values it applies where a request leaves a sampling field out (vLLM's
    ``ModelConfig.get_diff_sampling_param()`` less max_tokens: the generation config's,
    with --override-generation-config), sorted by name; ``reasoning_parser``, whether one
    reads its chat answers (--reasoning-parser); ``tool_parser``, which chat requests a tool
    parser adjusts (TOOL_PARSER_ADJUSTS; None: not known), carried as a field of its own."""

    sampling: tuple[tuple[str, float], ...] = ()
    reasoning_parser: bool = False
    tool_parser: str | None = "none"

    def to_wire(self) -> dict[str, Any]:
        return {"sampling": dict(self.sampling), "reasoning_parser": self.reasoning_parser}


@dataclass(frozen=True, slots=True)
class Registration:
    role: str
    http_address: str
    zmq_address: str
    load: Load | None = None
    leave: bool = False
    ts: float | None = None
    nonce: str | None = None
    kv_transport_fallbacks: int = 0
    kv_events: EventsEndpoint | None = None
    output_limits: OutputLimits | None = None
    generation: GenerationDefaults | None = None
    # The sender's per-start secret identity (see the module docstring); None: not sent.
    instance_key: str | None = field(default=None, repr=False)


def new_instance_key() -> str:
    """A fresh instance_key (one per instance start)."""
    return secrets.token_hex(INSTANCE_KEY_BYTES)


def _show(value: Any, limit: int = 80) -> str:
    """A value for an error message: repr (so CR/LF are escaped), bounded."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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
        if reg.load.waiting_for_kv:
            fields["load"]["waiting_for_kv"] = reg.load.waiting_for_kv
    if reg.kv_transport_fallbacks:
        fields["kv_transport_fallbacks"] = reg.kv_transport_fallbacks
    if reg.kv_events is not None:
        fields["kv_events"] = reg.kv_events.to_wire()
    if reg.output_limits is not None:
        fields["output_limits"] = {k: v for k in _LIMIT_KEYS if (v := getattr(reg.output_limits, k)) is not None}
    if reg.generation is not None:
        fields["generation"] = reg.generation.to_wire()
        if reg.generation.tool_parser is not None:
            fields["tool_parser"] = reg.generation.tool_parser
    if reg.instance_key is not None:
        fields["instance_key"] = reg.instance_key
    if reg.leave:
        fields["leave"] = True
    ts = reg.ts
    if secret is not None and ts is None:
        ts = time.time()
    if ts is not None:
        fields["ts"] = ts
    nonce = reg.nonce
    if secret is not None and nonce is None:
        nonce = secrets.token_hex(NONCE_BYTES)
    if nonce is not None:
        fields["nonce"] = nonce
    if secret is not None:
        fields["hmac"] = sign(fields, secret)
    return msgpack.packb(fields, use_bin_type=True)


def _check_host(host: str) -> bool:
    if host.startswith("["):
        inner = host[1:-1]
        if not host.endswith("]") or not _IPV6_CHARS.fullmatch(inner):
            return False
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            return False
        return True
    if len(host) > MAX_HOST_LEN or not _DNS_NAME.fullmatch(host):
        return False
    if host.rsplit(".", 1)[-1].isdigit():  # numeric last label: must be a real IPv4 literal
        try:
            ipaddress.IPv4Address(host)  # strict: no leading zeros, no short forms
        except ValueError:
            return False
    return True


def _check_address(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{name} must be a 'host:port' string, got {type(value).__name__}")
    if not value or len(value) > MAX_ADDRESS_LEN:
        raise ProtocolError(f"{name} must be 1..{MAX_ADDRESS_LEN} characters")
    host, sep, port = value.rpartition(":")
    if not sep or not _PORT.fullmatch(port) or int(port) > 65535:
        raise ProtocolError(f"{name} {_show(value)}: port must be 1..65535")
    if not _check_host(host):
        raise ProtocolError(
            f"{name} {_show(value)}: host must be a DNS name, an IPv4 or a [IPv6] literal"
        )
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_load(value: Any) -> Load:
    if not isinstance(value, dict):
        raise ProtocolError("load must be a map")
    if len(value) > MAX_FIELDS:
        raise ProtocolError("load has too many fields")
    counts: list[int] = []
    for key in _LOAD_COUNTS:
        n = value.get(key, 0)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOAD_COUNT:
            raise ProtocolError(f"load.{key} must be an integer 0..{MAX_LOAD_COUNT}, got {_show(n)}")
        counts.append(n)
    usages: list[float] = []
    for key in _LOAD_USAGES:
        u = value.get(key, 0.0)
        # NaN fails the range check too (every comparison with NaN is false).
        if not _is_number(u) or not 0.0 <= u <= 1.0:
            raise ProtocolError(f"load.{key} must be a number 0..1, got {_show(u)}")
        usages.append(float(u))
    if counts[2] > counts[1]:
        raise ProtocolError(f"load.waiting_for_kv ({counts[2]}) exceeds load.waiting ({counts[1]})")
    return Load(counts[0], counts[1], usages[0], usages[1], counts[2])


def check_output_limits(value: Any) -> OutputLimits:
    """The wire's ``output_limits`` map as OutputLimits (None values: absent), or ProtocolError.
    The connector checks its own with it too: an advertised limit the proxy would refuse
    would get the whole heartbeat dropped."""
    if not isinstance(value, dict) or set(value) - set(_LIMIT_KEYS):
        raise ProtocolError(f"output_limits must be a map of {', '.join(_LIMIT_KEYS)}")
    got: list[int | None] = []
    for key in _LIMIT_KEYS:
        n = value.get(key)
        if n is not None and (type(n) is not int or not 1 <= n <= MAX_OUTPUT_TOKENS):
            raise ProtocolError(f"output_limits.{key} must be an int 1..{MAX_OUTPUT_TOKENS}, got {_show(n)}")
        got.append(n)
    return OutputLimits(*got)


def check_tool_parser(value: Any) -> str | None:
    """The wire's ``tool_parser`` field (None: absent, not known), or ProtocolError."""
    if value is not None and (not isinstance(value, str) or value not in TOOL_PARSER_ADJUSTS):
        raise ProtocolError(f"tool_parser must be one of {', '.join(TOOL_PARSER_ADJUSTS)}, got {_show(value)}")
    return value


def check_generation(value: Any, tool_parser: Any = None) -> GenerationDefaults:
    """The wire's ``generation`` map (and ``tool_parser`` field) as GenerationDefaults, or
    ProtocolError. The connector checks its own with it too (a value the proxy refuses would
    drop the whole heartbeat)."""
    if not isinstance(value, dict) or set(value) - {"sampling", "reasoning_parser"}:
        raise ProtocolError("generation must be a map of sampling, reasoning_parser")
    sampling = value.get("sampling", {})
    if not isinstance(sampling, dict) or len(sampling) > MAX_SAMPLING_DEFAULTS:
        raise ProtocolError(f"generation.sampling must be a map of at most {MAX_SAMPLING_DEFAULTS} entries")
    for name, number in sampling.items():
        if not isinstance(name, str) or not _SAMPLING_NAME.fullmatch(name) or not _is_number(number) \
                or not math.isfinite(number):
            raise ProtocolError(f"generation.sampling has an invalid entry {_show(name)}: {_show(number)}")
    reasoning = value.get("reasoning_parser", False)
    if not isinstance(reasoning, bool):
        raise ProtocolError(f"generation.reasoning_parser must be a boolean, got {_show(reasoning)}")
    return GenerationDefaults(tuple(sorted((k, float(v)) for k, v in sampling.items())), reasoning,
                              check_tool_parser(tool_parser))


def _check_ts(ts: Any) -> float | None:
    # NaN must be refused: it would pass the clock-skew comparison.
    if ts is not None and (not _is_number(ts) or not math.isfinite(ts)):
        raise ProtocolError("ts must be a finite number")
    return None if ts is None else float(ts)


def _verify(fields: dict[str, Any], secret: str, now: float | None) -> None:
    """Raise unless the message carries a valid signature, a fresh ts and a nonce."""
    sender = _show(fields.get("http_address"), 60)
    given = fields.get("hmac")
    if given is None:
        raise ProtocolError(f"unsigned message (http_address={sender})", UNAUTHORIZED)
    # Checked before compare_digest, which raises TypeError on a non-ASCII str.
    if not isinstance(given, str) or not _HEX_HMAC.fullmatch(given):
        raise ProtocolError(f"malformed hmac (http_address={sender})", UNAUTHORIZED)
    try:
        expected = sign(fields, secret)
    except Exception as e:  # a value msgpack can read but not write back (e.g. too deep)
        raise ProtocolError(f"cannot canonicalize: {type(e).__name__}", MALFORMED) from None
    if not _hmac.compare_digest(given, expected):
        raise ProtocolError(f"bad signature (http_address={sender})", UNAUTHORIZED)
    ts = _check_ts(fields.get("ts"))
    if ts is None:
        raise ProtocolError(f"signed message without ts (http_address={sender})", UNAUTHORIZED)
    now = time.time() if now is None else now
    if abs(now - ts) > MAX_CLOCK_SKEW_S:
        raise ProtocolError(
            f"stale or future ts ({now - ts:+.1f}s, http_address={sender})", UNAUTHORIZED
        )
    if fields.get("nonce") is None:
        raise ProtocolError(f"signed message without nonce (http_address={sender})", UNAUTHORIZED)


def decode(
    data: bytes, secret: str | None = None, now: float | None = None
) -> Registration:
    """Parse and validate one discovery message; raise ProtocolError if bad.

    With a secret, the signature, ts and nonce's presence are checked here; whether the
    nonce was seen before is the receiver's business (ReplayGuard).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"payload must be bytes, got {type(data).__name__}", MALFORMED)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes > {MAX_MESSAGE_BYTES}", MALFORMED)
    try:
        # Bounded as it is read: no field holds more than a few entries or a short string, so
        # a 64 KiB message of unknown fields cannot make tens of thousands of objects.
        fields = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=MAX_VALUE_BYTES,
                                 max_bin_len=MAX_VALUE_BYTES, max_array_len=MAX_ENTRIES, max_map_len=MAX_ENTRIES,
                                 max_ext_len=MAX_VALUE_BYTES)
    except ValueError as e:
        if "exceeds max_" in str(e):  # msgpack's words for a bound broken: say which
            raise ProtocolError(f"a value over the decoding bounds: {e}", MALFORMED) from None
        raise ProtocolError(f"not msgpack: {type(e).__name__}", MALFORMED) from None
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"not msgpack: {type(e).__name__}", MALFORMED) from None
    if not isinstance(fields, dict):
        raise ProtocolError(f"message is a {type(fields).__name__}, not a map", MALFORMED)
    if len(fields) > MAX_FIELDS:
        raise ProtocolError(f"message has {len(fields)} fields > {MAX_FIELDS}", MALFORMED)
    for key in fields:
        if not isinstance(key, str) or len(key) > MAX_KEY_LEN:
            raise ProtocolError(f"field name {_show(key, 40)} is not a short string", MALFORMED)
    if secret is not None:
        _verify(fields, secret, now)
    role = fields.get("type")
    if not isinstance(role, str) or role not in ROLES:
        raise ProtocolError(f"unknown type {_show(role)}")
    http_address = _check_address(fields.get("http_address"), "http_address")
    zmq_address = _check_address(fields.get("zmq_address"), "zmq_address")
    ts = _check_ts(fields.get("ts"))
    nonce = fields.get("nonce")
    if nonce is not None and (not isinstance(nonce, str) or not _HEX_NONCE.fullmatch(nonce)):
        raise ProtocolError("nonce must be 16..64 lowercase hex digits")
    key = fields.get("instance_key")
    if key is not None and (not isinstance(key, str) or not _HEX_KEY.fullmatch(key)):
        raise ProtocolError("instance_key must be 32..64 lowercase hex digits")
    leave = fields.get("leave", False)
    if not isinstance(leave, bool):
        raise ProtocolError(f"leave must be a boolean, got {_show(leave)}")
    load = _check_load(fields["load"]) if "load" in fields else None
    fallbacks = fields.get("kv_transport_fallbacks", 0)
    if type(fallbacks) is not int or not 0 <= fallbacks <= MAX_LOAD_COUNT:
        raise ProtocolError(f"kv_transport_fallbacks must be an int 0..{MAX_LOAD_COUNT}, got {_show(fallbacks)}")
    kv_events = _check_kv_events(fields["kv_events"], zmq_address) if "kv_events" in fields else None
    limits = check_output_limits(fields["output_limits"]) if "output_limits" in fields else None
    tool_parser = check_tool_parser(fields.get("tool_parser"))
    generation = check_generation(fields["generation"], tool_parser) if "generation" in fields else None
    return Registration(
        role=role,
        http_address=http_address,
        zmq_address=zmq_address,
        load=load,
        leave=leave,
        ts=ts,
        nonce=nonce,
        kv_transport_fallbacks=fallbacks,
        kv_events=kv_events,
        output_limits=limits,
        generation=generation,
        instance_key=key,
    )


def _check_kv_events(value: Any, zmq_address: str) -> EventsEndpoint:
    try:
        ep = decode_endpoint(value)
        kv_host = zmq_address.rpartition(":")[0]
        for endpoint in (ep.endpoint, ep.replay_endpoint):
            if endpoint is not None and split_endpoint(endpoint)[0] != kv_host:
                raise EventError(f"{endpoint!r:.80} is not on the KV host {kv_host!r:.60}")
    except EventError as e:
        raise ProtocolError(f"kv_events: {e}") from None
    return ep


@dataclass(slots=True)
class ReplayGuard:
    """The nonces of signed messages accepted within the clock-skew window.

    A nonce is remembered until its message's ts leaves the window (after that the ts check
    refuses the message anyway), so memory is bounded by the message rate times the window,
    and by max_entries: when full, new messages are refused rather than old nonces forgotten
    (forgetting one would let its message be replayed)."""

    window_s: float = MAX_CLOCK_SKEW_S
    max_entries: int = 100_000
    _expiry: dict[str, float] = field(default_factory=dict)
    _heap: list[tuple[float, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._expiry)

    def _evict(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] < now:
            _, nonce = heapq.heappop(heap)
            self._expiry.pop(nonce, None)

    def check(self, nonce: str, ts: float, now: float) -> str | None:
        """Remember a nonce; None if fresh, else why the message must be dropped."""
        self._evict(now)
        if nonce in self._expiry:
            return "nonce seen before"
        if len(self._expiry) >= self.max_entries:
            return f"replay cache full ({self.max_entries} nonces in the window)"
        expiry = ts + self.window_s
        self._expiry[nonce] = expiry
        heapq.heappush(self._heap, (expiry, nonce))
        return None

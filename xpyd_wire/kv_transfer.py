"""The P<->D KV protocol: the control messages two connector engines exchange, and the
``kv_transfer_params`` fields the proxy and vLLM carry for them. Built and read here only.

Each message is one msgpack map (plus tensors) over the transport (connector/transport:
``wire.py`` adds ``"tensors"`` and ``"_id"``, auth adds its frame). The map's ``"op"`` names
what is asked; the answer is a map with ``"ok"``:

- ``hello`` (first contact, P -> each D rank), with the caller's ``KV_PROTOCOL_VERSION``: the
  answer is a ``Hello``, what the peer's KV looks like (TP, layout, dtype, block shape), which
  rank answered and its protocol version;
- ``reserve`` ``Reserve(key, nbytes)``: room in D's receive buffer before the bytes come;
- ``put`` ``PutHeader`` + tensors: a payload (or, with ``part``, one run of its layers);
- ``abort`` ``Abort(keys={key: why})``: the sender gave those transfers up;
- ``get`` / ``release`` ``Get(key)`` / ``Release(key)`` (GET mode: D pulls from P, then lets go);
- ``ready`` ``Ready(key)``: has a transfer's KV arrived (the instance's own scheduler asks);
- ``ping`` ``Ping()``, ``stats``: liveness and buffer accounting.

Each request is a frozen dataclass: ``encode()`` gives the wire map (the same bytes the dict
literals gave before they were typed: field order kept), ``decode(map)`` gives the message or
raises ValueError with the refusal's reason, which the engine sends back as a ``Refusal``.

A refused request gets ``Refusal``: ``{"ok": false, "error": why}`` plus at most one flag:
``gone`` (nobody here needs that KV any more: not a failure), ``final`` (GET: it will never
be there), ``unknown_op``. A call the transport refused before any handler saw it
(authentication, size) carries ``refused`` (its reason) instead.

Nothing here imports torch, zmq or vLLM: the proxy and tools load it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "Abort", "CLIENT_PARAMS", "DEBUG_CORRUPT_KV_PARAM", "DEBUG_PARAM_PREFIX", "Get", "Hello", "KV_PROTOCOL_VERSION",
    "Op", "PARAM_PREFIX", "PREFILL_PROMPT_TOKENS_PARAM", "Ping", "PutHeader", "REPORT_KEY_PARAM", "RESPONSE_KEY",
    "Ready", "Refusal", "Release", "Reserve", "SKIP_TOKENS_PARAM", "TRANSFER_ID_PARAM", "is_part", "ok",
    "version_mismatch",
]

# The protocol's version, exchanged in every hello (request and reply). Bump it when a message
# changes shape or meaning so that a peer of the old version would misread it; P then refuses
# to ship KV to a D of another version (and D refuses a hello from a P of another version), each
# with a log line naming both versions, instead of either side misplacing KV.
# History:
#   (none)  until issue 38: no version; the hello reply was the engine's TP and block-layout
#           describe() dicts merged. When the version came no deployment mixed xPyD versions, so
#           a peer that sends no version is treated as older and refused at first contact, not
#           guessed at. (D still answers a hello without a version, with its own: tools and the
#           tests ask it; the caller judges.)
#   1       issue 38: "kv_protocol" in the hello both ways; ops, put header, replies as above.
KV_PROTOCOL_VERSION = 1
VERSION_KEY = "kv_protocol"


class Op:
    """The control ops an engine serves (``header["op"]``)."""

    HELLO = "hello"
    RESERVE = "reserve"
    PUT = "put"
    ABORT = "abort"
    GET = "get"
    RELEASE = "release"
    READY = "ready"
    PING = "ping"
    STATS = "stats"


OP_KEY = "op"
# Ops that name one transfer by "key" and mean nothing without it.
KEYED_OPS = (Op.RESERVE, Op.PUT, Op.GET, Op.RELEASE)

# ---------------------------------------------------------------------------- replies

OK_KEY = "ok"
ERROR_KEY = "error"
GONE_KEY = "gone"  # a refusal that is no failure: every request for that KV is gone
FINAL_KEY = "final"  # GET: the payload will never be there (failed or expired at P)
UNKNOWN_OP_KEY = "unknown_op"  # the op is not served here (a caller's optional feature)
REFUSED_KEY = "refused"  # set by the transport: refused before the handler (auth, size)


def ok(**fields: Any) -> dict[str, Any]:
    """A successful reply, with the op's own fields after ``ok``."""
    return {OK_KEY: True, **fields}


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the peer did not serve, and why."""

    error: str
    gone: bool = False
    final: bool = False
    unknown_op: bool = False
    refused: str | None = None  # the transport's reason, when no handler saw the request

    def encode(self) -> dict[str, Any]:
        out: dict[str, Any] = {OK_KEY: False, ERROR_KEY: self.error}
        for name in (GONE_KEY, FINAL_KEY, UNKNOWN_OP_KEY):
            if getattr(self, name):
                out[name] = True
        if self.refused is not None:
            out[REFUSED_KEY] = self.refused
        return out

    @classmethod
    def decode(cls, reply: dict[str, Any]) -> "Refusal | None":
        """The refusal a reply carries; None for a successful reply."""
        if reply.get(OK_KEY):
            return None
        refused = reply.get(REFUSED_KEY)
        return cls(str(reply.get(ERROR_KEY)), gone=bool(reply.get(GONE_KEY)), final=bool(reply.get(FINAL_KEY)),
                   unknown_op=bool(reply.get(UNKNOWN_OP_KEY)), refused=None if refused is None else str(refused))


# ---------------------------------------------------------------------------- first contact

# The fields that say what a side's KV looks like: a hello reply and every put header carry
# them (the TP side's, then the block layout's), and D checks a payload against its own.
TP_FIELDS = ("tp_size", "num_kv_heads", "is_mla")
LAYOUT_FIELDS = ("layout", "dtype", "block_shape")


@dataclass(frozen=True, slots=True)
class Hello:
    """A decode rank's answer to ``hello``: which rank answered and what its KV looks like."""

    rank: int
    tp_size: int
    num_kv_heads: int
    is_mla: bool
    layout: str
    dtype: str
    block_shape: tuple[int, ...]
    version: int | None = KV_PROTOCOL_VERSION  # None: a peer from before the version existed

    @staticmethod
    def request() -> dict[str, Any]:
        return {OP_KEY: Op.HELLO, VERSION_KEY: KV_PROTOCOL_VERSION}

    def encode(self) -> dict[str, Any]:
        out = ok(rank=self.rank, tp_size=self.tp_size, num_kv_heads=self.num_kv_heads, is_mla=self.is_mla,
                 layout=self.layout, dtype=self.dtype, block_shape=list(self.block_shape))
        if self.version is not None:
            out[VERSION_KEY] = self.version
        return out

    @classmethod
    def decode(cls, reply: dict[str, Any]) -> "Hello":
        """A hello reply as sent; ValueError (with the field) when it is not one."""
        try:
            return cls(_int(reply["rank"]), _int(reply["tp_size"]), _int(reply["num_kv_heads"]),
                       bool(reply["is_mla"]), str(reply["layout"]), str(reply["dtype"]),
                       tuple(_int(d) for d in reply["block_shape"]), _opt_int(reply.get(VERSION_KEY)))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed hello: {type(e).__name__}: {e}") from None


def version_mismatch(theirs: Any) -> str | None:
    """Why a peer whose hello says ``theirs`` (its VERSION_KEY field, None when absent) cannot
    exchange KV with this one; None when it speaks this version."""
    if type(theirs) is int and theirs == KV_PROTOCOL_VERSION:
        return None
    said = ("sends no kv protocol version (an xPyD from before versions)" if theirs is None
            else f"speaks kv protocol version {theirs!r:.40}")
    return (f"kv protocol mismatch: the peer {said}, this instance speaks version {KV_PROTOCOL_VERSION}; "
            "run the same xPyD release on prefill and decode")


def _int(v: Any) -> int:
    if type(v) is not int:
        raise TypeError(f"expected an int, got {type(v).__name__}")
    return v


# ---------------------------------------------------------------------------- requests


def _key(header: dict[str, Any], op: str) -> str:
    key = header.get("key")
    if not isinstance(key, str):
        raise ValueError(f"{op} without key")
    return key


def _check_op(header: dict[str, Any], op: str) -> None:
    if header.get(OP_KEY) != op:
        raise ValueError(f"op {header.get(OP_KEY)!r:.40} is not {op!r}")


@dataclass(frozen=True, slots=True)
class Reserve:
    """P asks D for ``nbytes`` of receive buffer for transfer ``key`` before it sends them."""

    key: str
    nbytes: int

    def encode(self) -> dict[str, Any]:
        return {OP_KEY: Op.RESERVE, "key": self.key, "nbytes": self.nbytes}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> "Reserve":
        _check_op(header, Op.RESERVE)
        key = _key(header, Op.RESERVE)
        nbytes = header.get("nbytes")
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError("reserve needs nbytes")
        return cls(key, nbytes)


@dataclass(frozen=True, slots=True)
class Get:
    """GET mode: D asks P for transfer ``key``'s payload (answered like a put, or refused)."""

    key: str

    def encode(self) -> dict[str, Any]:
        return {OP_KEY: Op.GET, "key": self.key}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> "Get":
        _check_op(header, Op.GET)
        return cls(_key(header, Op.GET))


@dataclass(frozen=True, slots=True)
class Release:
    """GET mode: D holds transfer ``key``'s payload; P may let it go."""

    key: str

    def encode(self) -> dict[str, Any]:
        return {OP_KEY: Op.RELEASE, "key": self.key}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> "Release":
        _check_op(header, Op.RELEASE)
        return cls(_key(header, Op.RELEASE))


@dataclass(frozen=True, slots=True)
class Ready:
    """The instance's own scheduler asks its worker whether transfer ``key``'s KV is whole;
    the answer is ``ok(ready=bool)``."""

    key: str

    def encode(self) -> dict[str, Any]:
        return {OP_KEY: Op.READY, "key": self.key}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> "Ready":
        _check_op(header, Op.READY)
        return cls(_key(header, Op.READY))

    @staticmethod
    def answer(ready: bool) -> dict[str, Any]:
        return ok(ready=ready)

    @staticmethod
    def is_ready(reply: dict[str, Any]) -> bool:
        """A reply says ready only when it says so with True (a refusal is not ready)."""
        return reply.get("ready") is True


@dataclass(frozen=True, slots=True)
class Abort:
    """P gave up transfers it had begun or promised: ``keys`` maps each to why. Decoding keeps
    the entries whose key is a string (the reason is made one): a bad entry fails no other."""

    keys: dict[str, str]

    def encode(self) -> dict[str, Any]:
        return {OP_KEY: Op.ABORT, "keys": self.keys}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> "Abort":
        _check_op(header, Op.ABORT)
        keys = header.get("keys")
        if not isinstance(keys, dict):
            raise ValueError("abort needs keys")
        return cls({k: str(why) for k, why in keys.items() if isinstance(k, str)})


@dataclass(frozen=True, slots=True)
class Ping:
    """Liveness: the answer is ``ok(address=...)``, the answering engine's address."""

    def encode(self) -> dict[str, Any]:
        return {OP_KEY: Op.PING}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> "Ping":
        _check_op(header, Op.PING)
        return cls()


# ---------------------------------------------------------------------------- put

# Header fields that differ between the layer-wise parts of one payload.
PART_KEY = "part"
# Fields a heterogeneous-TP sender adds: this is piece ``piece`` of ``pieces`` of a
# transfer, heads [heads[0], heads[1]) of sender rank ``src_rank``.
PIECE_FIELDS = ("piece", "pieces", "src_rank", "heads")


@dataclass(frozen=True, slots=True)
class PutHeader:
    """The header of a ``put`` (and of a GET reply): one transfer's blocks, one tensor per run
    of blocks per layer. The tensors hold the prompt's blocks [first_block, num_blocks)."""

    key: str
    num_tokens: int
    num_blocks: int
    first_block: int
    layers: list[str]
    runs: list[int]
    layout: str
    dtype: str
    block_shape: list[int]
    tp_size: int
    num_kv_heads: int
    is_mla: bool
    part: tuple[int, int] | None = None  # layer-wise: only layers [part[0], part[1])
    piece: int | None = None
    pieces: int | None = None
    src_rank: int | None = None
    heads: tuple[int, int] | None = None

    def encode(self) -> dict[str, Any]:
        """The wire map; field order as it always was (msgpack keeps it: same bytes)."""
        out: dict[str, Any] = {
            OP_KEY: Op.PUT, "key": self.key, "num_tokens": self.num_tokens,
            # The prompt blocks the payload covers, from 0: the tensors hold the last
            # num_blocks - first_block of them. A consumer that predates first_block sees
            # runs that do not add up to num_blocks and refuses the payload, never
            # misplaces it.
            "num_blocks": self.num_blocks, "first_block": self.first_block,
            "layers": self.layers, "runs": self.runs,
            "layout": self.layout, "dtype": self.dtype, "block_shape": list(self.block_shape),
            "tp_size": self.tp_size, "num_kv_heads": self.num_kv_heads, "is_mla": self.is_mla,
        }
        if self.part is not None:
            out[PART_KEY] = list(self.part)
        if self.piece is not None:
            out.update(piece=self.piece, pieces=self.pieces, src_rank=self.src_rank,
                       heads=None if self.heads is None else list(self.heads))
        return out

    @classmethod
    def decode(cls, header: dict[str, Any]) -> "PutHeader":
        """A put header as a sender of this protocol writes it; ValueError when it is not.
        (D checks payloads field by field where it loads them, with the reason per field.)"""
        if header.get(OP_KEY) != Op.PUT:
            raise ValueError(f"not a put: op={header.get(OP_KEY)!r}")
        try:
            part = header.get(PART_KEY)
            heads = header.get("heads")
            return cls(
                key=_str(header["key"]), num_tokens=_int(header["num_tokens"]), num_blocks=_int(header["num_blocks"]),
                first_block=_int(header.get("first_block", 0)), layers=[_str(x) for x in header["layers"]],
                runs=[_int(x) for x in header["runs"]], layout=_str(header["layout"]), dtype=_str(header["dtype"]),
                block_shape=[_int(x) for x in header["block_shape"]], tp_size=_int(header["tp_size"]),
                num_kv_heads=_int(header["num_kv_heads"]), is_mla=bool(header["is_mla"]),
                part=None if part is None else _pair(part), piece=_opt_int(header.get("piece")),
                pieces=_opt_int(header.get("pieces")), src_rank=_opt_int(header.get("src_rank")),
                heads=None if heads is None else _pair(heads),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed put header: {type(e).__name__}: {e}") from None


def is_part(header: dict[str, Any]) -> bool:
    """A layer-wise sender's put: one run of layers of a payload."""
    return PART_KEY in header


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a str, got {type(v).__name__}")
    return v


def _opt_int(v: Any) -> int | None:
    return None if v is None else _int(v)


def _pair(v: Any) -> tuple[int, int]:
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise TypeError(f"expected two ints, got {v!r}")
    return _int(v[0]), _int(v[1])


# ---------------------------------------------------------------------------- kv_transfer_params

# Fields of a request's ``kv_transfer_params`` (set by the proxy or a client, read by the
# connector's scheduler; xpyd_wire.request_id re-exports the first two).
# How many leading prompt tokens D already holds (D's KV events say so): P ships only the rest.
SKIP_TOKENS_PARAM = "xpyd_skip_tokens"
# Set in D's request when D continues from P's first token: the length of P's prompt. D's
# prompt is that prompt plus the one token, so P's KV covers all of D's prompt but its last
# token (proxy/first_token.py).
PREFILL_PROMPT_TOKENS_PARAM = "xpyd_prefill_prompt_tokens"
# A client asks for the transfer key in its response (it names KV in flight: only on request).
REPORT_KEY_PARAM = "xpyd_report_transfer_key"
# The transfer id (``request_id.build``'s form) for an endpoint whose engine request id is
# not the X-Request-Id header: vLLM's Responses API names its engine request after the body's
# ``request_id``, which is also the response id the client sees and fetches a stored response
# by, so the proxy keeps that id vLLM-shaped and carries the transfer here instead.
TRANSFER_ID_PARAM = "xpyd_transfer_id"
# Test hook (with the connector's allow_debug_corruption): corrupt the loaded KV.
DEBUG_CORRUPT_KV_PARAM = "xpyd_debug_corrupt_kv"
# Every field above is named xpyd_*; the proxy owns them all (it strips a client's) but those a
# client may ask with; debug fields pass only where the proxy is told to (a test hook).
PARAM_PREFIX = "xpyd_"
DEBUG_PARAM_PREFIX = "xpyd_debug_"
CLIENT_PARAMS = frozenset({REPORT_KEY_PARAM})
# The key under which the connector reports a finished request's transfer in the response's
# ``kv_transfer_params``: ``{"xpyd": {...}}`` (send_type, prompt_tokens, shipped_blocks,
# skipped_blocks on P; loaded_tokens, load_failed on D; transfer_key when asked).
RESPONSE_KEY = "xpyd"

"""vLLM's KV-cache event stream: where an instance publishes it, what it sends, and the
chained block keys the proxy indexes blocks by.

vLLM (0.32/0.33, ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:PORT", "replay_endpoint": "tcp://*:PORT2"}'``) publishes on a ZMQ PUB
socket multipart messages ``[topic, seq (8 bytes big-endian), payload]``; the payload is
msgspec-msgpack of ``KVEventBatch`` = array ``[ts, events, data_parallel_rank?]`` and each
event a map tagged ``{"type": "BlockStored"|"BlockRemoved"|"AllBlocksCleared", ...}``
(vllm/distributed/kv_events.py). ``seq`` starts at 0 when the engine starts. The optional
ROUTER ``replay_endpoint`` answers ``[b"", start_seq (8 bytes)]`` from a DEALER with every
buffered ``[b"", topic, seq, payload]`` from start_seq on, then ``[b"", b"", -1 (8 bytes,
signed), b""]``.

Decoding is done here, with msgpack into typed dataclasses: every type and bound is checked
and anything else raises EventError with a ``reason`` from DROP_REASONS, never another
exception. The registration advertises the endpoints (``kv_events`` field, see
xpyd_wire.discovery): ``{"endpoint": "tcp://host:port", "replay_endpoint":
"tcp://host:port"?, "topic": str?, "blocks": int?}``.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

# What vLLM's publisher uses for "end of replay".
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# One batch is one engine step's events; a step of a long prompt is a few hundred blocks
# (a 128k-token step is ~0.4 MiB). 4 MiB holds ~80k blocks of 16 tokens: far above vLLM's
# steps, and the most one message makes the proxy decode (~0.2 s of Python, off its loop).
MAX_BATCH_BYTES = 4 * 1024 * 1024
MAX_EVENTS_PER_BATCH = 100_000
MAX_BLOCKS_PER_EVENT = 100_000
MAX_BLOCK_SIZE = 4096
MAX_TOKEN_ID = 2**32 - 1
MAX_TOPIC_LEN = 256
MAX_LORA_NAME_LEN = 256
MAX_HASH_BYTES = 64  # vLLM's block hashes are 32-byte sha256 digests (or ints)
MAX_SEQ = 2**63 - 1
MAX_CAPACITY_BLOCKS = 1 << 32

# Why an event message was dropped: label values of xpyd_kv_events_total{result} (fixed set).
MALFORMED = "malformed"  # wrong frame count, not msgpack, not a KVEventBatch
INVALID_EVENT = "invalid_event"  # an event outside its rules (type, bounds)
WRONG_TOPIC = "wrong_topic"
DROP_REASONS = (MALFORMED, INVALID_EVENT, WRONG_TOPIC)

_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])",
                   re.ASCII)  # fmt: skip
_ENDPOINT = re.compile(r"tcp://(?P<host>[^/]+?):(?P<port>[1-9][0-9]{0,4})", re.ASCII)


class EventError(ValueError):
    """An event message, or an advertised endpoint, that breaks the rules."""

    def __init__(self, message: str, reason: str = INVALID_EVENT) -> None:
        super().__init__(message)
        self.reason = reason


BlockHash = bytes | int  # vLLM's ExternalBlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]  # len == len(block_hashes) * block_size
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None
    # The blocks' hashes cover more than tokens and LoRA (a cache_salt, multimodal inputs,
    # prompt embeddings: vLLM's extra_keys): a prompt's token keys cannot name them.
    extra: bool = False


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[Event, ...]


@dataclass(frozen=True, slots=True)
class EventsEndpoint:
    """Where one instance publishes its events, as advertised in its registration."""

    endpoint: str  # tcp://host:port (PUB)
    replay_endpoint: str | None = None  # tcp://host:port (ROUTER)
    topic: str = ""
    blocks: int | None = None  # its KV cache capacity in blocks, when known

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"endpoint": self.endpoint}
        if self.replay_endpoint:
            out["replay_endpoint"] = self.replay_endpoint
        if self.topic:
            out["topic"] = self.topic
        if self.blocks is not None:
            out["blocks"] = self.blocks
        return out


# ---------------------------------------------------------------- endpoints


def split_endpoint(endpoint: Any) -> tuple[str, int]:
    """("host", port) of a ``tcp://host:port`` endpoint; EventError otherwise."""
    if not isinstance(endpoint, str) or len(endpoint) > 300:
        raise EventError(f"endpoint must be a 'tcp://host:port' string, got {endpoint!r:.80}")
    m = _ENDPOINT.fullmatch(endpoint)
    if m is None or not _HOST.fullmatch(m["host"]) or int(m["port"]) > 65535:
        raise EventError(f"endpoint {endpoint!r:.80} is not tcp://host:port")
    return m["host"], int(m["port"])


def advertised(endpoint: str, host: str) -> str:
    """The address others connect to for a vLLM bind endpoint: ``tcp://*:5557`` (or
    ``0.0.0.0``/``::``) becomes ``tcp://{host}:5557``; a concrete host stays as given."""
    if not endpoint.startswith("tcp://"):
        raise EventError(f"only tcp:// event endpoints can be advertised, got {endpoint!r:.80}")
    bind_host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        raise EventError(f"event endpoint {endpoint!r:.80} needs a fixed port")
    if bind_host in ("*", "0.0.0.0", "::", "[::]", ""):
        bind_host = host
    elif bind_host.lower().startswith("[::ffff:") and bind_host.endswith("]"):
        # vLLM binds only wildcard or "::" endpoints; an IPv4-mapped one is how to make it
        # bind one IPv4 address (ZMQ binds the IPv4 address itself), e.g. loopback.
        bind_host = bind_host[len("[::ffff:"):-1]
    out = f"tcp://{bind_host}:{port}"
    split_endpoint(out)
    return out


def decode_endpoint(value: Any) -> EventsEndpoint:
    """The registration's ``kv_events`` field; EventError (reason INVALID_EVENT) if bad."""
    if not isinstance(value, dict) or len(value) > 8:
        raise EventError("kv_events must be a small map")
    endpoint = value.get("endpoint")
    split_endpoint(endpoint)
    replay = value.get("replay_endpoint")
    if replay is not None:
        split_endpoint(replay)
    topic = value.get("topic", "")
    if not isinstance(topic, str) or len(topic) > MAX_TOPIC_LEN:
        raise EventError(f"kv_events.topic must be a string of <= {MAX_TOPIC_LEN} characters")
    blocks = value.get("blocks")
    if blocks is not None and (type(blocks) is not int or not 0 < blocks <= MAX_CAPACITY_BLOCKS):
        raise EventError(f"kv_events.blocks must be an int 1..{MAX_CAPACITY_BLOCKS}")
    return EventsEndpoint(endpoint, replay, topic, blocks)


# ---------------------------------------------------------------- batches


def _hash(value: Any) -> BlockHash:
    if type(value) is int or (isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES):
        return value
    raise EventError(f"block hash must be bytes (<= {MAX_HASH_BYTES}) or an int")


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_BLOCKS_PER_EVENT:
        raise EventError(f"block_hashes must be a list of 1..{MAX_BLOCKS_PER_EVENT}")
    return tuple(_hash(h) for h in value)


def _opt_str(event: dict, key: str) -> str | None:
    value = event.get(key)
    if value is not None and (not isinstance(value, str) or len(value) > MAX_LORA_NAME_LEN):
        raise EventError(f"{key} must be a short string")
    return value


def _opt_int(event: dict, key: str) -> int | None:
    value = event.get(key)
    if value is not None and (type(value) is not int or not 0 <= value < 1 << 16):
        raise EventError(f"{key} must be a small int")
    return value


def _extra(value: Any, lora: str | None) -> bool:
    """Whether vLLM's extra_keys (one entry per block: the LoRA name when there is one, then
    multimodal pairs, the cache_salt, embedding digests) hold anything beyond the LoRA name."""
    if value is None:
        return False
    if not isinstance(value, list):
        raise EventError("extra_keys must be a list")
    own = 1 if lora is not None else 0
    for entry in value:
        if entry is not None and (not isinstance(entry, list) or len(entry) > own):
            return True
    return False


def _event(raw: Any) -> Event:
    if not isinstance(raw, dict):
        raise EventError("event is not a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        hashes = _hashes(raw.get("block_hashes"))
        parent = raw.get("parent_block_hash")
        block_size = raw.get("block_size")
        if type(block_size) is not int or not 0 < block_size <= MAX_BLOCK_SIZE:
            raise EventError(f"block_size must be an int 1..{MAX_BLOCK_SIZE}")
        tokens = raw.get("token_ids")
        if not isinstance(tokens, list) or len(tokens) != len(hashes) * block_size:
            raise EventError("token_ids must hold block_size tokens per block hash")
        for t in tokens:
            if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                raise EventError("token ids must be ints 0..2**32-1")
        lora = _opt_str(raw, "lora_name")
        return BlockStored(hashes, None if parent is None else _hash(parent), tuple(tokens),
                           block_size, lora, _opt_str(raw, "medium"),
                           _opt_int(raw, "group_idx"), _extra(raw.get("extra_keys"), lora))  # fmt: skip
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(raw.get("block_hashes")), _opt_str(raw, "medium"),
                            _opt_int(raw, "group_idx"))  # fmt: skip
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventError(f"unknown event type {kind!r:.40}")


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise EventError(f"seq frame of {len(frame)} bytes, not 8", MALFORMED)
    seq = int.from_bytes(frame, "big", signed=True)
    if seq < 0:
        raise EventError("negative seq", MALFORMED)
    return seq


def decode_batch(frames: Sequence[bytes], topic: str = "") -> EventBatch:
    """One published (or replayed) message ``[topic, seq, payload]``; EventError if bad."""
    if len(frames) != 3:
        raise EventError(f"{len(frames)} frames, not 3", MALFORMED)
    topic_frame, seq_frame, payload = (bytes(f) for f in frames)
    if topic_frame != topic.encode():
        raise EventError(f"topic {topic_frame[:40]!r}", WRONG_TOPIC)
    seq = decode_seq(seq_frame)
    if len(payload) > MAX_BATCH_BYTES:
        raise EventError(f"payload of {len(payload)} bytes", MALFORMED)
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True,
                              max_array_len=max(MAX_EVENTS_PER_BATCH, MAX_BLOCKS_PER_EVENT * 16))
    except Exception as e:  # msgpack raises several unrelated types
        raise EventError(f"not msgpack: {type(e).__name__}", MALFORMED) from None
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise EventError("payload is not a KVEventBatch array", MALFORMED)
    ts, events = raw[0], raw[1]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts != ts:
        raise EventError("batch ts must be a number", MALFORMED)
    if not isinstance(events, list) or len(events) > MAX_EVENTS_PER_BATCH:
        raise EventError("batch events must be a list", MALFORMED)
    return EventBatch(seq, float(ts), tuple(_event(e) for e in events))


def encode_batch(batch: EventBatch, topic: str = "") -> list[bytes]:
    """The frames vLLM would publish for `batch` (tests, and doubles of a publisher)."""
    events: list[dict[str, Any]] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            events.append({"type": "BlockStored", "block_hashes": list(e.block_hashes),
                           "parent_block_hash": e.parent_block_hash, "token_ids": list(e.token_ids),
                           "block_size": e.block_size, "lora_id": None, "medium": e.medium,
                           "lora_name": e.lora_name, "group_idx": e.group_idx,
                           "extra_keys": _extra_keys(e)})  # fmt: skip
        elif isinstance(e, BlockRemoved):
            events.append({"type": "BlockRemoved", "block_hashes": list(e.block_hashes),
                           "medium": e.medium, "group_idx": e.group_idx})  # fmt: skip
        else:
            events.append({"type": "AllBlocksCleared"})
    payload = msgpack.packb([batch.ts, events, 0], use_bin_type=True)
    return [topic.encode(), batch.seq.to_bytes(8, "big"), payload]


def _extra_keys(e: BlockStored) -> list[list[Any]] | None:
    if not e.extra:
        return None if e.lora_name is None else [[e.lora_name]] * len(e.block_hashes)
    salted = ([e.lora_name] if e.lora_name is not None else []) + ["salt"]
    return [salted] * len(e.block_hashes)


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends the replay ROUTER to get every buffered batch from start_seq."""
    return [b"", start_seq.to_bytes(8, "big")]


# ---------------------------------------------------------------- block keys


def _digest(parent: int, tokens: Sequence[int], salt: str | None) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "big"))
    if salt:
        h.update(b"\x01" + salt.encode())
    h.update(b"\x00")
    h.update(struct.pack(f">{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "big")


ROOT_KEY = 0  # the parent key of a sequence's first block


def chain_block_key(parent_key: int, block_tokens: Sequence[int], salt: str | None = None) -> int:
    """The key of one full block whose predecessor has key `parent_key` (ROOT_KEY first)."""
    return _digest(parent_key, block_tokens, salt)


def chain_block_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The chained keys of the full blocks of a token sequence (a trailing partial block has
    none): key[i] = blake2b-64(key[i-1] (8 bytes, ROOT_KEY for i == 0), salt, the block's
    token ids as 4-byte big-endian) as an int. Deterministic across processes and runs (no
    Python hash()); `salt` is the LoRA adapter's name (None for the base model), so the same
    tokens under different adapters never share a key. The proxy's KV index (proxy/kv_index.py)
    keys what instances report with it, and a prompt's keys computed with it are looked up
    there (longest_prefix)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    keys: list[int] = []
    parent = ROOT_KEY
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _digest(parent, token_ids[start:start + block_size], salt)
        keys.append(parent)
    return keys

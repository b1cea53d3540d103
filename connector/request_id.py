"""Transfer identity: P and D agree on a key although vLLM gives them different
engine request ids (it appends a random suffix per instance).

The proxy sends ``X-Request-Id: ___prefill_addr_{P}___decode_addr_{D}_{uuid hex}``
to both. vLLM embeds that in the engine id (``cmpl-<id>-0-<8 hex>`` for
completions, ``chatcmpl-<id>-<8 hex>`` for chat), so we search for the pattern
rather than strip known prefixes: the same code handles both endpoints and any
future prefix. The 32-hex uuid is the transfer key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PATTERN = re.compile(
    r"___prefill_addr_(?P<prefill>[^\s]+?:\d+)___decode_addr_(?P<decode>[^\s]+?:\d+)_(?P<key>[0-9a-f]{32})"
)


@dataclass(frozen=True, slots=True)
class TransferId:
    key: str  # the proxy's uuid hex; identical on P and D
    prefill_addr: str  # P's kv host:port (rank 0)
    decode_addr: str  # D's kv host:port (rank 0)


def parse(request_id: str) -> TransferId | None:
    """The transfer id inside an engine request id, or None for plain requests."""
    m = _PATTERN.search(request_id)
    if m is None:
        return None
    return TransferId(key=m["key"], prefill_addr=m["prefill"], decode_addr=m["decode"])


def rank_address(addr: str, rank: int) -> str:
    """Worker `rank` of an instance listens on its advertised port + rank."""
    host, _, port = addr.rpartition(":")
    return f"{host}:{int(port) + rank}"

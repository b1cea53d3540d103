"""The request-id wire format, built (proxy) and parsed (connector) here only.

The proxy sends ``X-Request-Id: ___prefill_addr_{P}___decode_addr_{D}_{uuid hex}``
to P and D (``xpyd-early`` in front when D is asked before P answered: EARLY). vLLM turns that header into engine ids of its own:

- completions: ``cmpl-{id}-{prompt index}-{8 hex}`` (one per prompt of a batch),
- chat: ``chatcmpl-{id}-{8 hex}``,
- ``n > 1``: children ``{child index}_{parent id}`` of each of those,
- with ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` the ``-{8 hex}`` suffix is absent.

The random suffix differs between P and D, so the transfer key is the uuid plus
the prompt index: every prompt of a batch has its own transfer, and the ``n``
children of one prompt share one. We search for the pattern rather than strip
known prefixes, so the same code handles every endpoint and future prefixes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# The kv_transfer_params fields the proxy sets, defined with the KV protocol; kept importable
# from here, where they were first defined.
from xpyd_wire.kv_transfer import PREFILL_PROMPT_TOKENS_PARAM, SKIP_TOKENS_PARAM, TRANSFER_ID_PARAM  # noqa: F401

# A prompt index has at most 7 digits, the random suffix exactly 8 hex digits:
# that tells a completion's "-{index}" from a chat's all-digit "-{suffix}".
_PATTERN = re.compile(
    r"(?P<early>xpyd-early)?___prefill_addr_(?P<prefill>\S+?:\d+)___decode_addr_(?P<decode>\S+?:\d+)"
    r"_(?P<uuid>[0-9a-f]{32})(?:-(?P<index>\d{1,7}))?(?:-[0-9a-f]{8})?$"
)
# Marks a transfer whose D request the proxy sends before P answered (concurrent dispatch): D
# may wait long for P to begin sending (P may be queued). Without it, P answered first, so its
# send has begun or will not come. A prefix, so a parser that predates it still finds the rest.
EARLY = "xpyd-early"


@dataclass(frozen=True, slots=True)
class TransferId:
    uuid: str  # the proxy's uuid hex; identical on P and D
    prompt_index: int  # which prompt of a batch (0 for chat and single prompts)
    prefill_addr: str  # P's kv host:port (rank 0)
    decode_addr: str  # D's kv host:port (rank 0)
    early: bool = False  # D was asked before P answered (EARLY)

    @property
    def key(self) -> str:
        """What P and D call this transfer: one per prompt, shared by its n children."""
        return f"{self.uuid}-{self.prompt_index}"


def new_uuid() -> str:
    """uuid.uuid4().hex without building a UUID object (a third of the cost)."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    return b.hex()


def build(prefill_addr: str, decode_addr: str, uuid: str | None = None, early: bool = False) -> str:
    """The X-Request-Id the proxy sends to P and D for one client request; `early`: D is asked
    before P answered."""
    head = EARLY if early else ""
    return f"{head}___prefill_addr_{prefill_addr}___decode_addr_{decode_addr}_{uuid or new_uuid()}"


def build_local(uuid: str | None = None) -> str:
    """The X-Request-Id of a request D serves alone (no transfer): parse() ignores it."""
    return f"xpyd-local-{uuid or new_uuid()}"


def parse(request_id: str) -> TransferId | None:
    """The transfer id inside an engine request id, or None for plain requests."""
    m = _PATTERN.search(request_id)
    if m is None:
        return None
    return TransferId(
        uuid=m["uuid"],
        prompt_index=int(m["index"] or 0),
        prefill_addr=m["prefill"],
        decode_addr=m["decode"],
        early=m["early"] is not None,
    )


def transfer_of(engine_id: str, kv_transfer_params: object) -> TransferId | None:
    """The transfer an engine request belongs to: named by its engine id (the X-Request-Id
    the proxy sent, completions, chat, messages, generate) or, where the engine id is the
    body's own ``request_id`` (Responses), by ``kv_transfer_params[TRANSFER_ID_PARAM]``."""
    tid = parse(engine_id)
    if tid is not None or not isinstance(kv_transfer_params, dict):
        return tid
    carried = kv_transfer_params.get(TRANSFER_ID_PARAM)
    return parse(carried) if isinstance(carried, str) and len(carried) <= _MAX_CARRIED else None


# A transfer id is ~100 characters; a longer value is not one (and is not searched).
_MAX_CARRIED = 512

_CHILD = re.compile(r"(\d+)_")


def child_index(request_id: str) -> int | None:
    """Which of the n samples an engine id is (vLLM's "{index}_{parent id}"), or None
    for a request with n == 1. The engine is never told n itself: children carry n=1."""
    m = _CHILD.match(request_id)
    return int(m.group(1)) if m else None


def rank_address(addr: str, rank: int) -> str:
    """Worker `rank` of an instance listens on its advertised port + rank."""
    host, _, port = addr.rpartition(":")
    return f"{host}:{int(port) + rank}"

"""What the scheduler process tells the worker processes each step.

This module is the only thing the two sides share: plain picklable dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # the worker engine without vLLM (GPU tests, benchmarks) never builds one

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Producer: ship the prompt's blocks of one request to its decode instance."""

    req_id: str  # engine request id (local to this instance)
    transfer_key: str
    decode_addr: str  # rank-0 kv address; the worker adds its rank
    prefill_addr: str
    block_ids: tuple[int, ...]  # whole blocks of the prompt from first_block on, in order
    num_tokens: int  # prompt length
    # False for PUT (synchronous) and GET (copied into P's buffer): the scheduler
    # frees blocks at once. True for PUT_ASYNC: freed after the worker reports the send finished.
    delay_free: bool
    # The prompt's leading blocks not shipped: the proxy knows D already holds them (its KV
    # events), so block_ids[0] is the prompt's block first_block.
    first_block: int = 0


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Consumer: fill local blocks from the KV the producer sent."""

    req_id: str
    transfer_key: str
    prefill_addr: str
    # Destination blocks and which of the producer's blocks go there: block i of
    # the prompt lands in dst_block_ids[i - first_block].
    dst_block_ids: tuple[int, ...]
    first_block: int
    num_tokens: int  # tokens loaded (prompt minus local hit minus last token)
    prompt_tokens: int  # the whole prompt: the payload must say the same
    prompt_blocks: int  # blocks P ships for the whole prompt (sizes a GET reservation)
    corrupt_for_test: bool = False
    # The payload was in D's receive buffer when the scheduler planned this load: the worker
    # applies it before this step's forward pass (vLLM's synchronous load), not in a later step.
    sync: bool = False


@dataclass(slots=True)
class P2pConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # Requests preempted this step: their in-flight sends must finish before
    # the blocks are reused (the scheduler plans the send again).
    preempted: list[str] = field(default_factory=list)
    # Consumer: transfer keys for which no further load will be planned (every
    # request carrying the key was planned or is gone). The worker drops their
    # KV once the loads already planned took it, and refuses late arrivals.
    release: list[str] = field(default_factory=list)
    # Producer (PUT_ASYNC): decode instances (rank-0 kv addresses) of requests that arrived
    # since the last step: the worker makes first contact with them during this step's
    # forward pass, so the send after it does not pay for a new connection and hello.
    contacts: list[str] = field(default_factory=list)
    # This step computes nothing (no token scheduled): the engine is only waiting for KV to
    # arrive or for sends to end, so the worker may wait for that (bounded) instead of
    # returning at once into vLLM's next, equally empty step.
    idle: bool = False
    # Consumer: requests wait, without blocks, for a sender to begin their transfer (concurrent
    # dispatch: D asked while P is queued or computing). An idle step waits for a begin too:
    # without it vLLM's loop runs empty steps back to back for all of P's prefill, and on a
    # CPU box that shares cores with P, the spinning engine starves P's OpenMP threads (a
    # 60 s prefill of 300 tokens seen with three engines on two cores).
    awaiting_senders: bool = False

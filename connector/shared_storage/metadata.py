"""What the scheduler process tells the worker processes each step (picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """Write blocks ``first_index ...`` of a request's prompt (already computed)."""

    req_id: str
    block_ids: tuple[int, ...]  # local cache blocks, in prompt order
    keys: tuple[str, ...]  # the chain keys of those blocks
    first_index: int  # position of block_ids[0] in the prompt


@dataclass(frozen=True, slots=True)
class FetchSpec:
    """Read stored blocks into local cache blocks (asynchronously)."""

    req_id: str
    block_ids: tuple[int, ...]  # destination blocks, in prompt order
    keys: tuple[str, ...]
    first_index: int
    # >0: a producer was told to store these blocks and may not have finished:
    # wait this long for a missing file. 0: a missing file is a miss at once.
    wait_s: float


@dataclass(slots=True)
class SharedStorageMetadata(KVConnectorMetadata):
    stores: list[StoreSpec] = field(default_factory=list)
    loads: list[FetchSpec] = field(default_factory=list)
    # This step computes nothing: the worker may wait (idle_wait_ms) for a read to finish
    # rather than return into vLLM's next, equally empty step (a read waiting for P's files
    # would otherwise spin D's engine for all of P's prefill, starving a P on shared cores).
    idle: bool = False
    # Requests wait, without blocks, for a producer's first file (asked before P answered):
    # an idle step waits its bound then too.
    awaiting: bool = False

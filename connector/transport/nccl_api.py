"""The lowest boundary of the nccl transport: what it needs from an NCCL library object.

Two real implementations live in ``nccl_lib.py`` (vLLM's ``NCCLLibrary`` when importable,
else our own ctypes binding over the ``libnccl.so.2`` torch ships); the tests' double
(``tests/support/nccl_double.py``) implements the same protocol on host memory. Everything above
this protocol (handshake, deadlines, abort, staging, layouts) is the transport's own code
and runs unchanged over either.

Semantics follow NCCL: communicators are created non-blocking (``init_rank`` returns at
once, ``status`` says when the communicator is ready); ``send``/``recv`` (inside
``group_start``/``group_end``) return at once, and their launch may go on in the background
(``status`` in progress) until the peer posted the matching operations; once launched,
completion is observed with ``stream.record_event().query()``.
A communicator whose peer died is ``abort``-ed, which ends its pending operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

# ncclResult_t values the transport tells apart (nccl.h).
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
UNIQUE_ID_BYTES = 128


class NcclError(RuntimeError):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"nccl error {code}: {text}")
        self.code = code


@dataclass(frozen=True, slots=True)
class CommConfig:
    """Per-communicator settings (``ncclConfig_t``): never the process environment, which
    every other communicator of the process (vLLM's own, for TP) would see too."""

    blocking: bool = False  # non-blocking init/ops: a dead peer can never hang a thread
    num_channels: int | None = None  # minCTAs = maxCTAs = this; None: NCCL's choice
    net_name: str | None = None  # e.g. "Socket", "IB"; None: NCCL's choice


class Event(Protocol):
    def query(self) -> bool: ...


class Stream(Protocol):
    def record_event(self) -> Event: ...

    def wait_event(self, event: Any) -> None: ...


class NcclLibrary(Protocol):
    name: str  # "vllm", "ctypes" or a double's name, for logs

    def version(self) -> str: ...

    def unique_id(self) -> bytes:
        """A new ncclUniqueId, as its UNIQUE_ID_BYTES raw bytes."""
        ...

    def init_rank(self, nranks: int, unique_id: bytes, rank: int, config: CommConfig) -> Any:
        """Start creating a communicator; returns its handle at once (non-blocking config).
        Raises NcclError when NCCL refuses outright."""
        ...

    def status(self, comm: Any) -> int:
        """``ncclCommGetAsyncError``: NCCL_SUCCESS (ready / all fine), NCCL_IN_PROGRESS
        (still initialising), or an error code."""
        ...

    def send(self, comm: Any, tensor: torch.Tensor, peer: int, stream: Stream) -> None:
        """Enqueue sending ``tensor``'s bytes (contiguous) to rank ``peer`` on ``stream``."""
        ...

    def recv(self, comm: Any, tensor: torch.Tensor, peer: int, stream: Stream) -> None:
        """Enqueue receiving into ``tensor`` (contiguous) from rank ``peer`` on ``stream``."""
        ...

    def group_start(self) -> None:
        """``ncclGroupStart``: the operations until ``group_end`` launch together."""
        ...

    def group_end(self) -> None:
        """``ncclGroupEnd``. On a non-blocking communicator the group may still be launching
        when this returns (``status`` says NCCL_IN_PROGRESS): the operations are on the
        stream only once ``status`` says NCCL_SUCCESS, so an event recorded before that may
        complete early. Raises NcclError on failure."""
        ...

    def abort(self, comm: Any) -> None:
        """``ncclCommAbort``: end the communicator now, pending operations included."""
        ...

    def destroy(self, comm: Any) -> None:
        """``ncclCommDestroy`` of a healthy communicator (waits for its pending work)."""
        ...

    def error_string(self, code: int) -> str: ...

    def new_stream(self, device: torch.device) -> Stream:
        """A stream of its own on ``device`` for this library's operations."""
        ...

"""Stand-ins in front of an engine's KV port (the other side of the boundary): a real TcpTransport
server on loopback that forwards each call to the engine through a client TcpTransport; the
tests' subclasses delay, hold or rewrite some ops on their way."""

from __future__ import annotations

import time

import torch

from connector.transport.base import Deferred
from connector.transport.tcp import TcpTransport
from tests.support.kv_engines import HOST


class ForwardingPeer:
    """Forwards every call to the engine at ``target`` and answers with its reply. The server
    starts in the constructor and may get a call at once: a subclass sets its own attributes
    BEFORE calling ``super().__init__``, and overrides ``_handle`` (calling ``forward``)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._client = TcpTransport()
        self._server = TcpTransport()
        self._server.start(HOST, 0, self._handle)
        self.address = f"{HOST}:{self._server.bound_port}"

    def forward(self, header: dict, tensors: list, timeout_s: float = 10) -> tuple[dict, list[torch.Tensor]]:
        """The target's reply to this call."""
        return self._client.call(self.target, header, tensors, timeout_s=timeout_s)

    def _handle(self, header: dict, tensors: list) -> tuple[dict, list[torch.Tensor]] | Deferred:
        return self.forward(header, tensors)

    def close(self) -> None:
        self._server.close()
        self._client.close()


class SlowHello(ForwardingPeer):
    """Answers each hello (first contact) only ``delay_s`` after it came (a peer slow to answer
    its first call); counts the hellos."""

    def __init__(self, target: str, delay_s: float) -> None:
        self.delay_s = delay_s
        self.hellos = 0
        super().__init__(target)

    def _handle(self, header: dict, tensors: list) -> tuple[dict, list[torch.Tensor]]:
        if header.get("op") == "hello":
            self.hellos += 1
            time.sleep(self.delay_s)
        return self.forward(header, tensors)

"""Transport interface: a generic "message + tensors" RPC between connector instances.

The KV connector's engine builds PUT / PUT_ASYNC / GET on top of :class:`Transport`; a
transport only moves one header dict plus a list of tensors to a peer and brings back the
peer handler's reply. Implementations: :class:`connector.transport.tcp.TcpTransport`
(pyzmq, any host); an NCCL transport can slot in behind the same interface.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Literal

import torch

__all__ = ["FALLBACK_REASONS", "REFUSAL_REASONS", "Deferred", "Fallback", "Handler", "HandshakeRefused", "Refusal",
           "Transport", "TransportError", "TransportRefused"]

# Why a request never reached the handler (a fixed set: these label a Prometheus series).
# unauthenticated: no auth frame (or, with no secret here, a signed call); bad_mac: a
# MAC that does not verify (another secret, or tampered); stale: timestamp outside the
# window (clock skew or an old capture); replay: a nonce seen before; handshake: a
# CURVE peer refused at the handshake; oversized: over the size or frame cap;
# malformed: not the wire format.
Refusal = Literal["unauthenticated", "bad_mac", "stale", "replay", "handshake", "oversized", "malformed"]
REFUSAL_REASONS: tuple[Refusal, ...] = ("unauthenticated", "bad_mac", "stale", "replay", "handshake", "oversized",
                                        "malformed")


# Why a device transport (nccl) moved a peer's tensors to the host-staged tcp path (a fixed
# set: these label a Prometheus series). setup: NCCL could not be set up with the peer
# (init refused or failed, not ready in time); version: the peer runs another NCCL version;
# peer_no_nccl: the peer does no NCCL (tcp only, CPU caches, none loaded); transfers: that
# many transfers in a row failed; abort_hung: an ncclCommAbort with that peer never returned.
Fallback = Literal["setup", "version", "peer_no_nccl", "transfers", "abort_hung"]
FALLBACK_REASONS: tuple[Fallback, ...] = ("setup", "version", "peer_no_nccl", "transfers", "abort_hung")


class TransportError(RuntimeError):
    """Transport-level failure: peer unreachable, timeout, malformed reply, transport closed.

    Application-level failures (a handler that raised, a request the server could not
    decode) are *not* raised: they come back as a reply header with ``ok`` False.
    """


class TransportRefused(TransportError):
    """The peer refused the call before its handler saw it (authentication, size):
    its answer says why, but is not signed, so it only ever means failure."""


class HandshakeRefused(TransportRefused):
    """The peer refused the connection itself at its handshake (another kv_secret, or a secret
    on one side only): no call of ours reaches it, and it counted and logged the refusal."""


class Deferred:
    """A reply a handler gives later: the handler returns this object at once and someone
    calls ``resolve`` once (from any thread). The server sends the reply when it comes and
    forgets it, unsent, after ``until`` (monotonic): the caller has given up by then."""

    __slots__ = ("until", "_lock", "_result", "_sink")

    def __init__(self, until: float) -> None:
        self.until = until
        self._lock = threading.Lock()
        self._result: tuple[dict, list[torch.Tensor]] | None = None
        self._sink: Callable[[Deferred], None] | None = None

    def resolve(self, header: dict, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Give the reply; only the first call counts."""
        with self._lock:
            if self._result is not None:
                return
            self._result = (header, list(tensors))
            sink = self._sink
        if sink is not None:
            sink(self)

    def result(self) -> tuple[dict, list[torch.Tensor]] | None:
        with self._lock:
            return self._result

    def on_resolve(self, sink: Callable[["Deferred"], None]) -> None:
        """The transport: call ``sink(self)`` once resolved (now, if it is already)."""
        with self._lock:
            self._sink = sink
            ready = self._result is not None
        if ready:
            sink(self)


# handler(header, tensors) -> (reply_header, reply_tensors), or a Deferred resolved later
# (transports that support it: tcp); runs in the server thread.
Handler = Callable[[dict, list[torch.Tensor]], tuple[dict, list[torch.Tensor]] | Deferred]


class Transport(ABC):
    """One endpoint: optionally a server (``start``) and a client for any number of peers."""

    name: str
    # Called with the reason of every request refused before the handler (metrics).
    on_refuse: Callable[[str], None] | None = None
    # Called with a FALLBACK_REASONS entry each time a peer's tensors move to the host path
    # (metrics); never by transports that have no other path (tcp).
    on_fallback: Callable[[str], None] | None = None

    def refusals(self) -> dict[str, int]:
        """Requests dropped before reaching the handler, by reason, since start."""
        return {}

    @abstractmethod
    def start(self, bind_host: str, port: int, handler: Handler) -> None:
        """Bind a server at ``bind_host:port`` and serve calls with ``handler``.

        For every incoming call the transport runs ``handler(header, tensors)`` in its
        server thread and sends back the returned ``(reply_header, reply_tensors)``.
        Handlers run one at a time. Received tensors are the handler's to keep. Reply
        tensors may be sent after the handler returned (zero-copy): their memory must
        not change afterwards, so return copies rather than views of live KV blocks.
        """

    @abstractmethod
    def call(
        self,
        peer: str,
        header: dict,
        tensors: Sequence[torch.Tensor] = (),
        timeout_s: float = 5.0,
    ) -> tuple[dict, list[torch.Tensor]]:
        """Send ``header`` + ``tensors`` to ``peer`` ("host:port") and wait for the reply.

        Thread-safe. Raises :class:`TransportError` on timeout, unreachable peer or a
        malformed reply. ``timeout_s`` covers the whole exchange, payloads included.
        Once ``call`` returns or raises, the transport no longer reads ``tensors``.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop the server thread and close all sockets. Idempotent."""

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

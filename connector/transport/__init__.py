"""KV transports: a generic "message + tensors" RPC the connector's engine builds on.

``make_transport("auto")`` picks the best available transport; today that is always
``tcp`` (an NCCL transport for CUDA is planned and will be preferred when available).
"""

from __future__ import annotations

from .auth import KVAuth, derive_kv_key
from .base import Handler, Transport, TransportError, TransportRefused
from .tcp import TcpTransport

__all__ = ["Handler", "KVAuth", "TcpTransport", "Transport", "TransportError", "TransportRefused", "derive_kv_key",
           "make_transport"]


def make_transport(name: str = "auto", **kwargs) -> Transport:
    """Build a transport by name: ``"tcp"`` or ``"auto"``."""
    if name in ("auto", "tcp"):
        return TcpTransport(**kwargs)
    raise ValueError(f"unknown transport {name!r} (known: auto, tcp)")

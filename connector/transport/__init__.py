"""KV transports: a generic "message + tensors" RPC the connector's engine builds on.

``make_transport("auto", device)`` picks ``nccl`` when the KV cache is on CUDA and an NCCL
library loads (vLLM's binding, else ours over torch's libnccl), else ``tcp``; ``tcp`` stays
the CPU path and the fallback.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .auth import KVAuth, derive_kv_key
from .base import Handler, HandshakeRefused, Transport, TransportError, TransportRefused
from .tcp import TcpTransport

__all__ = ["Handler", "HandshakeRefused", "KVAuth", "TcpTransport", "Transport", "TransportError", "TransportRefused", "derive_kv_key",
           "make_transport"]

TRANSPORTS = ("auto", "tcp", "nccl")

logger = logging.getLogger(__name__)


def make_transport(name: str = "auto", device: torch.device | None = None, *, nccl_lib: Any = None,
                   num_channels: int | None = None, **kwargs: Any) -> Transport:
    """Build a transport by name: ``"auto"``, ``"tcp"`` or ``"nccl"``.

    ``nccl`` needs the KV cache on CUDA and a loadable NCCL (``nccl_lib`` overrides the
    library object, for tests); ``auto`` falls back to ``tcp`` with a warning when it has
    not. ``kwargs`` configure the tcp (control) transport either way.
    """
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r} (known: {', '.join(TRANSPORTS)})")
    on_cuda = device is not None and device.type == "cuda"
    if name == "tcp" or (name == "auto" and not on_cuda):
        return TcpTransport(**kwargs)
    if nccl_lib is None:
        if not on_cuda:
            raise ValueError(f"transport nccl needs the KV cache on CUDA, it is on {device}")
        from .nccl_lib import NcclUnavailable, load_nccl_library

        try:
            nccl_lib = load_nccl_library()
        except NcclUnavailable as e:
            if name == "nccl":
                raise ValueError(f"transport nccl: {e}") from e
            logger.warning("NCCL unavailable (%s): KV goes over tcp via host memory", e)
            return TcpTransport(**kwargs)
    from .nccl import NcclTransport

    return NcclTransport(nccl_lib, device or torch.device("cpu"), num_channels=num_channels, **kwargs)

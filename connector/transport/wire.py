"""The message format both tcp channels share (zmq frames and the byte stream, ``stream.py``).

A message is a msgpack header (the caller's dict plus the transport's keys: ``"tensors"``,
one ``{"dtype", "shape"}`` entry per tensor, and ``"_id"``, the call id echoed in the reply)
followed by each tensor's raw bytes. With ``mac`` authentication an auth frame goes first;
its MAC covers the header and the byte length of every part after it (``auth.MacAuth``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgpack
import numpy as np
import torch

TENSORS_KEY = "tensors"
ID_KEY = "_id"
STREAM_KEY = "_stream"  # in a zmq reply: where the server's byte stream listens (stream.py)
RESERVED_KEYS = (TENSORS_KEY, ID_KEY, STREAM_KEY)
# A header is a small map (op, key, layer names, runs, tensor metas); a larger one is
# refused before it is hashed or decoded, so garbage cannot buy CPU by the gigabyte.
MAX_HEADER_BYTES = 1 << 20

DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType(
    {
        str(dt).removeprefix("torch."): dt
        for dt in (
            torch.float32, torch.float16, torch.bfloat16, torch.float64,
            torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
            getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
        )
        if dt is not None
    }
)
DTYPE_NAMES: MappingProxyType[torch.dtype, str] = MappingProxyType({dt: name for name, dt in DTYPES.items()})


class Malformed(ValueError):
    """An incoming message that does not follow the wire format."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


# ---------------------------------------------------------------------------- encoding


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of ``t``'s bytes; zero-copy when ``t`` is contiguous on CPU.

    The array's base is the (possibly copied) tensor, so handing the array to a socket keeps
    the memory alive until it is sent. bf16 has no numpy dtype, hence uint8.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def encode(header: dict, tensors: Sequence[torch.Tensor], call_id: int | None,
           own: dict[str, Any] | None = None) -> list[Any]:
    """``[header_msgpack, tensor_bytes...]`` for one message; ``own``: the transport's keys."""
    if not isinstance(header, dict):
        raise TypeError(f"header must be a dict, got {type(header).__name__}")
    for key in RESERVED_KEYS:
        if key in header:
            raise ValueError(f"header key {key!r} is reserved for the transport")
    metas, bufs = [], []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors must be torch.Tensor, got {type(t).__name__}")
        name = DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"unsupported tensor dtype {t.dtype}")
        metas.append({"dtype": name, "shape": list(t.shape)})
        bufs.append(tensor_bytes(t))
    wire = dict(header)
    if own:
        wire.update(own)
    wire[TENSORS_KEY] = metas
    if call_id is not None:
        wire[ID_KEY] = call_id
    return [msgpack.packb(wire, use_bin_type=True), *bufs]


def frame_lens(frames: Sequence[Any]) -> list[int]:
    """Byte lengths of an outgoing message's parts (bytes and numpy buffers)."""
    return [f.nbytes if isinstance(f, np.ndarray) else len(f) for f in frames]


# ---------------------------------------------------------------------------- decoding


def decode_header(buf: Any) -> dict:
    try:
        header = msgpack.unpackb(buf, raw=False)
    except Exception as e:  # msgpack raises a zoo of exception types
        raise Malformed(f"header is not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise Malformed(f"header is a {type(header).__name__}, not a map")
    return header


def tensor_specs(metas: Any) -> list[TensorSpec]:
    """What the header's ``"tensors"`` entry announces; Malformed if it is not the format."""
    if not isinstance(metas, list):
        raise Malformed(f"header[{TENSORS_KEY!r}] must be a list")
    out = []
    for i, meta in enumerate(metas):
        if not isinstance(meta, dict):
            raise Malformed(f"tensor {i}: metadata is not a map")
        name = meta.get("dtype")
        dtype = DTYPES.get(name) if isinstance(name, str) else None  # a dict is unhashable
        if dtype is None:
            raise Malformed(f"tensor {i}: unknown dtype {meta.get('dtype')!r}")
        shape = meta.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise Malformed(f"tensor {i}: bad shape {shape!r}")
        out.append(TensorSpec(dtype, tuple(shape), math.prod(shape) * dtype.itemsize))
    return out


class BytesAt:
    """A writable numpy array interface over ``nbytes`` at ``addr``, holding ``keep`` (what
    owns that memory: a zmq frame, the receive buffer) alive; ``on_free`` runs once the last
    array and tensor over it are gone. ``torch.frombuffer`` on a read-only buffer would warn
    and copy; this memory is private to the message, so exposing it writable is safe."""

    __slots__ = ("_iface", "_keep", "_on_free")

    def __init__(self, addr: int, nbytes: int, keep: Any, on_free: Any = None) -> None:
        self._iface = {"data": (addr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        self._keep = keep
        self._on_free = on_free

    @property
    def __array_interface__(self) -> dict:
        return self._iface

    def __del__(self) -> None:
        if self._on_free is not None:
            self._on_free()


def printable(text: str, limit: int = 300) -> str:
    """Peer-controlled text for a log line or an error: bounded, one line."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])

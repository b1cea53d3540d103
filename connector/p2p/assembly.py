"""D's side of layer-wise sends: a payload that arrives in parts, a run of layers each.

A layer-wise sender (``send_granularity: layer``) reserves the whole payload once, then
ships each layer's blocks as soon as the layer's forward ended, as a ``put`` whose header
is the whole payload's header plus ``"part": [first_layer, end_layer]``. Parts come in layer
order over one connection. Once the last layer is here the parts become one ``Payload``,
exactly what a whole-request sender would have sent, and are stored as such: the loads
never see parts.

Memory stays bounded by the reservation: a part is taken only while its transfer's
reservation holds, and only while the parts so far fit in it; each part moves the
reservation's expiry on (a slow forward pass spaces the parts). A part that does not fit the
transfer fails it (its loads fail at once and vLLM recomputes); parts of a transfer that
failed, was aborted or whose reservation expired are dropped by ``drop``/``sweep``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from connector.p2p.buffer import GONE, KVBuffer, Payload, tensor_bytes
from xpyd_wire.kv_transfer import PART_KEY

# Header fields that differ between the parts of one payload.
_PART_FIELDS = (PART_KEY,)


@dataclass(slots=True)
class _Partial:
    header: dict[str, Any]  # the payload's header (without "part")
    layers: int  # layers the payload covers
    next_layer: int = 0  # the next part must start here
    nbytes: int = 0
    tensors: list[torch.Tensor] = field(default_factory=list)


def _span(header: dict[str, Any]) -> tuple[int, int] | None:
    part = header.get(PART_KEY)
    if not isinstance(part, list | tuple) or len(part) != 2 or not all(type(x) is int for x in part):
        return None
    return part[0], part[1]


class PartAssembler:
    """Joins the parts of layer-wise payloads; any thread (the transport's)."""

    def __init__(self, recv: KVBuffer) -> None:
        self._recv = recv
        self._lock = threading.Lock()
        self._partial: dict[str, _Partial] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._partial)

    def add(self, key: str, header: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[Payload | None, str | None]:
        """Take one part: (the whole payload once its last part is here, None), (None, None)
        while parts are missing, or (None, why) when the part was refused; a refusal fails
        the transfer (its reservation goes, its loads fail at once)."""
        why = self._take(key, header, tensors)
        if why is not None:
            self.drop(key)
            if why != GONE:
                self._recv.fail(key, why)
            return None, why
        with self._lock:
            p = self._partial.get(key)
            if p is None or p.next_layer < p.layers:
                return None, None
            del self._partial[key]
        return Payload(p.header, p.tensors, p.nbytes), None

    def _take(self, key: str, header: dict[str, Any], tensors: list[torch.Tensor]) -> str | None:
        span = _span(header)
        layers = header.get("layers")
        runs = header.get("runs")
        if span is None or not isinstance(layers, list) or not isinstance(runs, list) or not runs:
            return "malformed part header"
        lo, hi = span
        if not 0 <= lo < hi <= len(layers):
            return f"part {lo}:{hi} is outside the payload's {len(layers)} layers"
        if len(tensors) != (hi - lo) * len(runs):
            return "part tensor count does not match its header"
        reserved = self._recv.extend(key)  # also keeps the reservation alive while parts come
        if reserved is None:
            # Released mid-send (its requests are gone): unneeded; otherwise a lost reservation.
            return GONE if self._recv.gone(key) else "part without a reservation (expired, failed or never made)"
        nbytes = tensor_bytes(tensors)
        base = {k: v for k, v in header.items() if k not in _PART_FIELDS}
        with self._lock:
            p = self._partial.get(key)
            if p is None:
                if lo != 0:
                    return f"part {lo}:{hi} came before layer 0"
                p = self._partial[key] = _Partial(base, len(layers))
            elif base != p.header:
                return "part header differs from the payload's first part"
            elif lo != p.next_layer:
                return f"part {lo}:{hi} out of order (expected layer {p.next_layer})"
            if p.nbytes + nbytes > reserved:
                return f"parts of {p.nbytes + nbytes} bytes exceed the reservation of {reserved}"
            p.next_layer = hi
            p.nbytes += nbytes
            p.tensors.extend(tensors)
        return None

    def drop(self, key: str) -> bool:
        """Forget a transfer's parts (it failed or was aborted)."""
        with self._lock:
            return self._partial.pop(key, None) is not None

    def sweep(self) -> list[str]:
        """Drop the parts of transfers whose reservation is gone (expired, failed)."""
        with self._lock:
            keys = list(self._partial)
        gone = [k for k in keys if self._recv.reservation(k) is None]
        with self._lock:
            for k in gone:
                self._partial.pop(k, None)
        return gone

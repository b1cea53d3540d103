"""pyzmq TCP transport: works between any two hosts (and processes) without a GPU fabric.

Wire format, one multipart message per call and per reply::

    [header_msgpack, tensor_frame_0, tensor_frame_1, ...]

``header`` is the caller's dict plus two keys owned by the transport: ``"tensors"``
(``[{"dtype": "bfloat16", "shape": [...]}, ...]``, one entry per tensor frame) and
``"_id"`` (the call id, echoed in the reply). Each tensor travels as its raw bytes in one
frame. Sends are zero-copy from the tensor's memory (pyzmq ``copy=False``) and received
tensors are zero-copy views of the zmq frames (the tensor keeps its frame alive).

Server: one ROUTER socket served by one daemon thread; handlers run in that thread.
Client: DEALER sockets pooled per peer; a socket is used by one call at a time and is
discarded (linger 0) whenever a call fails, so a late reply can never be read as the reply
to a later call. Replies are also matched by call id as a second line of defence.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from connector.affinity import CpuPlan, pin_current_thread

from .base import Handler, Transport, TransportError

__all__ = ["TcpTransport"]

logger = logging.getLogger(__name__)

TENSORS_KEY = "tensors"
ID_KEY = "_id"
RESERVED_KEYS = (TENSORS_KEY, ID_KEY)
_RELEASE_WAIT_S = 0.5  # bound on waiting for libzmq to drop a failed call's send buffers (ms in practice)

_DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType(
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
_DTYPE_NAMES: MappingProxyType[torch.dtype, str] = MappingProxyType(
    {dt: name for name, dt in _DTYPES.items()}
)


class _Malformed(ValueError):
    """An incoming message that does not follow the wire format."""


# ---------------------------------------------------------------------------- encoding


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of ``t``'s bytes; zero-copy when ``t`` is contiguous on CPU.

    The array's base is the (possibly copied) tensor, so handing the array to zmq keeps
    the memory alive until libzmq has sent it. bf16 has no numpy dtype, hence uint8.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _encode(header: dict, tensors: Sequence[torch.Tensor], call_id: int | None) -> list[Any]:
    if not isinstance(header, dict):
        raise TypeError(f"header must be a dict, got {type(header).__name__}")
    for key in RESERVED_KEYS:
        if key in header:
            raise ValueError(f"header key {key!r} is reserved for the transport")
    metas, bufs = [], []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors must be torch.Tensor, got {type(t).__name__}")
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"unsupported tensor dtype {t.dtype}")
        metas.append({"dtype": name, "shape": list(t.shape)})
        bufs.append(_tensor_bytes(t))
    wire = dict(header)
    wire[TENSORS_KEY] = metas
    if call_id is not None:
        wire[ID_KEY] = call_id
    return [msgpack.packb(wire, use_bin_type=True), *bufs]


# ---------------------------------------------------------------------------- decoding


class _FrameArray:
    """Writable numpy array interface over a received zmq frame; holds the frame alive.

    ``torch.frombuffer`` on the frame's read-only memoryview would warn (and torch cannot
    mark tensors read-only anyway). The frame's memory is private to this message, so
    exposing it writable is safe and avoids both the warning and a copy.
    """

    __slots__ = ("frame", "_iface")

    def __init__(self, frame: zmq.Frame, addr: int, nbytes: int) -> None:
        self.frame = frame
        self._iface = {"data": (addr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}

    @property
    def __array_interface__(self) -> dict:
        return self._iface


def _frame_to_tensor(frame: zmq.Frame, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    nbytes = len(frame)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    addr = np.frombuffer(frame.buffer, dtype=np.uint8).ctypes.data
    flat = torch.from_numpy(np.asarray(_FrameArray(frame, addr, nbytes)))
    if addr % dtype.itemsize:
        # Small frames may sit at an odd offset inside libzmq's shared receive buffer;
        # copy those into an aligned allocation rather than hand out misaligned tensors.
        flat = flat.clone()
    return flat.view(dtype).reshape(shape)


def _decode_header(frame: zmq.Frame) -> dict:
    try:
        header = msgpack.unpackb(frame.buffer, raw=False)
    except Exception as e:  # msgpack raises a zoo of exception types
        raise _Malformed(f"header is not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise _Malformed(f"header is a {type(header).__name__}, not a map")
    return header


def _decode_tensors(metas: Any, frames: Sequence[zmq.Frame]) -> list[torch.Tensor]:
    if not isinstance(metas, list):
        raise _Malformed(f"header[{TENSORS_KEY!r}] must be a list")
    if len(metas) != len(frames):
        raise _Malformed(f"header lists {len(metas)} tensors but {len(frames)} tensor frames arrived")
    out = []
    for i, (meta, frame) in enumerate(zip(metas, frames)):
        if not isinstance(meta, dict):
            raise _Malformed(f"tensor {i}: metadata is not a map")
        dtype = _DTYPES.get(meta.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise _Malformed(f"tensor {i}: unknown dtype {meta.get('dtype')!r}")
        shape = meta.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _Malformed(f"tensor {i}: bad shape {shape!r}")
        expected = math.prod(shape) * dtype.itemsize
        if len(frame) != expected:
            raise _Malformed(
                f"tensor {i}: {meta['dtype']}{shape} needs {expected} bytes, frame has {len(frame)}"
            )
        out.append(_frame_to_tensor(frame, dtype, shape))
    return out


def _split_peer(peer: str) -> str:
    """``"host:port"`` (or ``"[v6]:port"``) -> zmq endpoint."""
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransportError(f"bad peer address {peer!r}, expected 'host:port'")
    return f"tcp://{host}:{port}"


def _ms_left(deadline: float) -> int:
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


# ---------------------------------------------------------------------------- transport


class TcpTransport(Transport):
    """pyzmq ROUTER/DEALER transport. See the module docstring for the wire format.

    Args:
        hwm: SNDHWM/RCVHWM in messages (the server may queue this many replies).
        sock_buf_bytes: SO_SNDBUF/SO_RCVBUF; ``None`` keeps the kernel's autotuning.
        max_idle_per_peer: idle client sockets kept per peer for reuse.
        poll_interval_s: how often the server thread checks for ``close()``.
        cpus: CPUs for the server thread and libzmq's I/O threads (see ``connector.affinity``).
        max_msg_bytes: the server drops (and disconnects) a peer sending a larger frame,
            so a rogue peer cannot make it allocate more than the KV buffer allows.
    """

    name = "tcp"

    def __init__(
        self,
        *,
        hwm: int = 1000,
        sock_buf_bytes: int | None = None,
        max_idle_per_peer: int = 4,
        poll_interval_s: float = 0.05,
        cpus: CpuPlan | None = None,
        max_msg_bytes: int | None = None,
    ) -> None:
        self._hwm = hwm
        self._cpus = cpus
        self._max_msg_bytes = max_msg_bytes
        self._sock_buf_bytes = sock_buf_bytes
        self._max_idle = max_idle_per_peer
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._ctx = zmq.Context(io_threads=1)
        if cpus is not None:
            # libzmq starts its I/O threads with the first socket: set before that.
            for cpu in sorted(cpus.cpus):
                self._ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        self._lock = threading.Lock()  # guards everything below
        self._idle: dict[str, list[zmq.Socket]] = {}
        self._inflight = 0
        self._serving = False
        self._closed = False
        self._ctx_termed = False
        self._server_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ids = itertools.count(1)  # next() is atomic under the GIL
        self.bound_port: int | None = None

    # ------------------------------------------------------------------ sockets

    def _configure(self, sock: zmq.Socket, host: str) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        # Detect peers that vanished without a FIN (host crash, cable pull).
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 10)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        if self._sock_buf_bytes:
            sock.setsockopt(zmq.SNDBUF, self._sock_buf_bytes)
            sock.setsockopt(zmq.RCVBUF, self._sock_buf_bytes)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)

    # ------------------------------------------------------------------ server

    def start(self, bind_host: str, port: int, handler: Handler) -> None:
        """Bind ``tcp://bind_host:port`` (port 0: any free port, see ``bound_port``)."""
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            if self._serving:
                raise RuntimeError("server already started")
            self._serving = True
        sock = self._ctx.socket(zmq.ROUTER)
        try:
            self._configure(sock, bind_host.strip("[]"))
            if self._max_msg_bytes:
                sock.setsockopt(zmq.MAXMSGSIZE, self._max_msg_bytes)
            if port == 0:
                self.bound_port = sock.bind_to_random_port(f"tcp://{bind_host}")
            else:
                sock.bind(f"tcp://{bind_host}:{port}")
                self.bound_port = port
        except zmq.ZMQError as e:
            sock.close(linger=0)
            with self._lock:
                self._serving = False
            raise TransportError(f"cannot bind tcp://{bind_host}:{port}: {e}") from e
        self._server_thread = threading.Thread(
            target=self._serve, args=(sock, handler), name=f"xpyd-tcp-server:{self.bound_port}",
            daemon=True,
        )
        self._server_thread.start()
        logger.info("tcp transport serving", extra={"bind": f"{bind_host}:{self.bound_port}"})

    def _serve(self, sock: zmq.Socket, handler: Handler) -> None:
        pin_current_thread(self._cpus)
        try:
            while not self._stop.is_set():
                try:
                    if not sock.poll(self._poll_ms, zmq.POLLIN):
                        continue
                    frames = sock.recv_multipart(copy=False)
                except zmq.ZMQError as e:
                    if self._stop.is_set():
                        break
                    logger.error("tcp transport: receive failed: %s", e)
                    self._stop.wait(self._poll_ms / 1000)  # don't spin on a persistent error
                    continue
                # ROUTER prepends the caller's identity frame.
                ident, body = frames[0], frames[1:]
                reply = self._serve_one(body, handler)
                try:
                    # ROUTER never blocks: a reply to a caller that went away is dropped.
                    sock.send_multipart([ident, *reply], copy=False)
                except zmq.ZMQError as e:
                    logger.warning("tcp transport: sending reply failed: %s", e)
        except Exception:  # pragma: no cover - the loop above is meant to catch everything
            logger.exception("tcp transport: server thread crashed")
        finally:
            sock.close(linger=0)
            with self._lock:
                self._serving = False
            self._maybe_term_ctx()

    def _serve_one(self, body: list[zmq.Frame], handler: Handler) -> list[Any]:
        call_id = None
        try:
            if not body:
                raise _Malformed("empty message")
            header = _decode_header(body[0])
            call_id = header.pop(ID_KEY, None)
            if not isinstance(call_id, int | None):
                call_id = None
                raise _Malformed("call id is not an int")
            tensors = _decode_tensors(header.pop(TENSORS_KEY, []), body[1:])
        except _Malformed as e:
            logger.warning("tcp transport: malformed request: %s", e)
            return _encode({"ok": False, "error": f"malformed request: {e}"}, (), call_id)
        try:
            reply_header, reply_tensors = handler(header, tensors)
            reply_header = dict(reply_header)
            reply_header.setdefault("ok", True)
            return _encode(reply_header, reply_tensors, call_id)
        except Exception as e:
            logger.exception("tcp transport: handler failed")
            return _encode({"ok": False, "error": f"handler error: {type(e).__name__}: {e}"}, (), call_id)

    # ------------------------------------------------------------------ client

    def call(
        self,
        peer: str,
        header: dict,
        tensors: Sequence[torch.Tensor] = (),
        timeout_s: float = 5.0,
    ) -> tuple[dict, list[torch.Tensor]]:
        deadline = time.monotonic() + timeout_s
        call_id = next(self._ids)
        # `frames` references the tensors' memory: it must outlive the send, which is
        # guaranteed once the reply arrived (or the socket was closed on failure).
        frames = _encode(header, tensors, call_id)
        sock = self._checkout(peer)
        reusable = False
        tracker = None
        try:
            # IMMEDIATE=1: POLLOUT only once a connection is up, so an unreachable peer is
            # told apart from a slow one and no message sits queued for a dead endpoint.
            if not sock.poll(_ms_left(deadline), zmq.POLLOUT):
                raise TransportError(f"peer {peer} unreachable: no connection within {timeout_s:g}s")
            tracker = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False, track=len(frames) > 1)
            while True:
                left = _ms_left(deadline)
                if left <= 0 or not sock.poll(left, zmq.POLLIN):
                    raise TransportError(f"timeout after {timeout_s:g}s waiting for reply from {peer}")
                reply = sock.recv_multipart(copy=False)
                try:
                    rheader = _decode_header(reply[0])
                    rid = rheader.pop(ID_KEY, None)
                    if rid is not None and rid != call_id:
                        logger.warning("tcp transport: dropping stale reply %s (want %s) from %s", rid, call_id, peer)
                        continue
                    rtensors = _decode_tensors(rheader.pop(TENSORS_KEY, []), reply[1:])
                except _Malformed as e:
                    raise TransportError(f"malformed reply from {peer}: {e}") from None
                reusable = True
                return rheader, rtensors
        except zmq.ZMQError as e:
            raise TransportError(f"zmq error talking to {peer}: {e}") from e
        finally:
            self._checkin(peer, sock, reusable)
            if not reusable and tracker is not None:
                # The socket is closed (linger 0), so libzmq drops the message; wait until it
                # has let go of the tensors' memory, so that the caller may reuse it (e.g.
                # free KV blocks) as soon as call() raises without a late partial send.
                try:
                    tracker.wait(_RELEASE_WAIT_S)
                except zmq.NotDone:
                    logger.warning("tcp transport: send buffers to %s not released after close", peer)

    def _checkout(self, peer: str) -> zmq.Socket:
        endpoint = _split_peer(peer)
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            self._inflight += 1
            idle = self._idle.get(peer)
            if idle:
                return idle.pop()
        try:
            sock = self._ctx.socket(zmq.DEALER)
            self._configure(sock, endpoint[len("tcp://"):].rpartition(":")[0].strip("[]"))
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(endpoint)
            return sock
        except zmq.ZMQError as e:
            self._checkin(peer, None, False)
            raise TransportError(f"cannot connect to {peer}: {e}") from e

    def _checkin(self, peer: str, sock: zmq.Socket | None, reusable: bool) -> None:
        with self._lock:
            self._inflight -= 1
            if sock is not None and reusable and not self._closed:
                idle = self._idle.setdefault(peer, [])
                if len(idle) < self._max_idle:
                    idle.append(sock)
                    sock = None
        if sock is not None:
            sock.close(linger=0)  # on failure: drops any queued message and late reply
        self._maybe_term_ctx()

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = [s for socks in self._idle.values() for s in socks]
            self._idle.clear()
        self._stop.set()
        for s in idle:
            s.close(linger=0)
        t = self._server_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)
            if t.is_alive():
                logger.warning("tcp transport: server thread still inside a handler; it exits after it")
        # The zmq context goes once the server thread and in-flight calls let go of it.
        self._maybe_term_ctx()
        logger.info("tcp transport closed", extra={"bind_port": self.bound_port})

    def _maybe_term_ctx(self) -> None:
        with self._lock:
            if not self._closed or self._inflight or self._serving or self._ctx_termed:
                return
            self._ctx_termed = True
        self._ctx.term()

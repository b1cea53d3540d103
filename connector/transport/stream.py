"""The tcp transport's byte stream: calls on plain TCP connections, received into reused memory.

Why beside zmq: libzmq receives every message into a fresh ``malloc`` (a large one is a
fresh ``mmap``: one page fault per 4 KiB, then ``munmap``) and hands each message between
its I/O thread and ours. For KV payloads of megabytes that halves the loopback throughput
(``scripts/bench_transport.py``). Here the receiving thread reads a message's tensors straight
into :class:`RecvMemory` (one buffer, carved per message, pages faulted once and reused),
and the sender writes each tensor from its own memory with one ``sendmsg`` gather.

Wire, per message (a request, then its reply, on one connection; one call at a time)::

    magic(4) server_token(8) auth_len(u32) header_len(u32) | auth | header | tensor bytes...

``header`` and ``auth`` are what the zmq channel sends as frames (``wire.py``, ``auth.py``):
the same MAC covers the same parts, so authentication is unchanged. A client learns a
server's stream port and token from its zmq replies (``wire.STREAM_KEY``) and opens each
connection with ``HELLO`` and that token (random per server start): the server answers
an empty ``REPLY``, or ``NACK`` if the token is not its own (the port was a restarted
peer's, now someone else's) or it has no room for another connection. Only then do calls
go, so a refused client knows nothing ran and sends its call over zmq instead. CURVE
(encryption) has no stream: those calls stay on zmq.
"""

from __future__ import annotations

import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from connector.affinity import CpuPlan, pin_current_thread
from connector.log import get_logger

from .base import TransportError
from .wire import MAX_HEADER_BYTES, BytesAt, TensorSpec

logger = get_logger(__name__)

PREFIX = struct.Struct("<4s8sII")
HELLO, REQUEST, REPLY, NACK = b"XKVh", b"XKVq", b"XKVr", b"XKVn"
MAX_AUTH_BYTES = 256
ALIGN = 64  # each received tensor starts on a cache line
IOV_MAX = 512  # parts per sendmsg (Linux allows 1024)
MAX_CONNECTIONS = 64  # per server; beyond, a caller is told NACK and uses zmq
_TCP_KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
CONNECT_TIMEOUT_S = 2.0  # a stream port that does not answer soon is treated as absent
_TIMEVAL = struct.Struct("@ll")  # struct timeval (Linux: two longs) for SO_SNDTIMEO / SO_RCVTIMEO


class StreamClosed(TransportError):
    """The other side closed the connection (or sent nothing) where a message should be."""


def tune(sock: socket.socket) -> None:
    """No Nagle (a reply is one small write), keepalive for peers gone without a FIN."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, val in _TCP_KEEPALIVE:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), val)


def is_open(sock: socket.socket) -> bool:
    """Whether a pooled, idle connection is still up: nothing may be waiting on it between
    calls, so readable means the peer closed it (EOF or reset)."""
    try:
        sock.setblocking(False)
        try:
            sock.recv(1, socket.MSG_PEEK)
            return False  # EOF, or bytes no call asked for: either way not reusable
        finally:
            sock.setblocking(True)
    except BlockingIOError:
        return True
    except OSError:
        return False


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


# ---------------------------------------------------------------------------- memory


@dataclass(slots=True)
class _Free:
    offset: int
    nbytes: int


class RecvMemory:
    """Receive memory reused across messages: one buffer of ``capacity`` bytes, reserved
    (virtual) at first use and carved first-fit per message, so the pages a message faults in
    serve every later one. A message that does not fit gets fresh memory instead (counted)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        # Reentrant: a message's memory may come back (a tensor freed by the cyclic GC) while
        # this thread is inside _take.
        self._lock = threading.RLock()
        self._buf: torch.Tensor | None = None
        self._free: list[_Free] = [_Free(0, self.capacity)]  # sorted by offset, coalesced
        self.lent_bytes = 0
        self.fresh = 0  # messages that did not fit

    def _take(self, nbytes: int) -> int | None:
        with self._lock:
            for i, f in enumerate(self._free):
                if f.nbytes >= nbytes:
                    off = f.offset
                    if f.nbytes == nbytes:
                        del self._free[i]
                    else:
                        f.offset += nbytes
                        f.nbytes -= nbytes
                    self.lent_bytes += nbytes
                    return off
            self.fresh += 1
            return None

    def _return(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self.lent_bytes -= nbytes
            free = self._free
            i = 0
            while i < len(free) and free[i].offset < offset:
                i += 1
            free.insert(i, _Free(offset, nbytes))
            if i + 1 < len(free) and offset + nbytes == free[i + 1].offset:
                free[i].nbytes += free.pop(i + 1).nbytes
            if i > 0 and free[i - 1].offset + free[i - 1].nbytes == offset:
                free[i - 1].nbytes += free.pop(i).nbytes

    def lend(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` (ALIGN-rounded) that returns itself when
        every tensor over it is gone."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if self._buf is None and self.capacity:
            with self._lock:
                if self._buf is None:  # virtual until touched: pages come in as messages use them
                    self._buf = torch.empty(self.capacity, dtype=torch.uint8)
        off = self._take(size) if self.capacity else None
        if off is None:
            try:
                return np.empty(size, dtype=np.uint8)
            except MemoryError:  # what a peer announced, on a transport with no max_msg_bytes
                raise TransportError(f"stream: no memory for a message of {size} bytes") from None
        assert self._buf is not None
        buf = self._buf
        # The memory comes back when the last tensor over it dies (reference counting: the
        # tensors keep their array, the array this base), whoever holds it.
        return np.asarray(BytesAt(buf.data_ptr() + off, size, buf, lambda: self._return(off, size)))


# ---------------------------------------------------------------------------- byte I/O


def _kernel_timeout(sock: socket.socket, option: int, deadline: float) -> None:
    """Blocking I/O bounded by the kernel: ``option`` (SO_SNDTIMEO or SO_RCVTIMEO) set to
    what is left of ``deadline``. Python's own timeout mode polls before every call instead:
    a poll and a send or recv per chunk the kernel takes, ~10-20 % more CPU a byte for
    payloads of megabytes (the other side of a raw socket pays neither)."""
    left = _left(deadline)
    sec = int(left)
    usec = max(0 if sec else 1, int((left - sec) * 1e6))  # 0 s 0 us would mean no timeout at all
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(sec, usec))


def send_parts(sock: socket.socket, parts: Sequence[Any], deadline: float) -> None:
    """Write ``parts`` (bytes or numpy arrays) in order, gathered: one blocking ``sendmsg``
    for all of them (up to IOV_MAX) unless the deadline cuts it short (TimeoutError)."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    i = 0
    sock.settimeout(None)  # a blocking fd: the kernel's timer bounds each call
    while i < len(views):
        _kernel_timeout(sock, socket.SO_SNDTIMEO, deadline)
        try:
            sent = sock.sendmsg(views[i:i + IOV_MAX])
        except BlockingIOError:  # EAGAIN: the timer ran out before a byte went
            raise TimeoutError("deadline passed") from None
        while sent and i < len(views):
            n = len(views[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def recv_exact(sock: socket.socket, view: memoryview, deadline: float, first: bool = False) -> None:
    """Fill ``view``; StreamClosed on EOF (``first``: before any byte of a message)."""
    got, n = 0, len(view)
    while got < n:
        sock.settimeout(_left(deadline))
        k = sock.recv_into(view[got:])
        if not k:
            raise StreamClosed("connection closed" + (" between messages" if first and not got else " mid-message"))
        got += k


def recv_whole(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """``recv_exact`` for a message's tensor bytes: blocking, bounded by the kernel's timer
    (``_kernel_timeout``), with MSG_WAITALL, so a tensor of megabytes is one ``recv_into``
    straight into its memory. StreamClosed on EOF, TimeoutError past the deadline."""
    got, n = 0, len(view)
    sock.settimeout(None)
    while got < n:
        _kernel_timeout(sock, socket.SO_RCVTIMEO, deadline)
        try:
            k = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        except BlockingIOError:  # EAGAIN: the timer ran out before a byte came
            raise TimeoutError("deadline passed") from None
        if not k:
            raise StreamClosed("connection closed mid-message")
        got += k


@dataclass(frozen=True, slots=True)
class Head:
    kind: bytes  # REQUEST, REPLY or NACK
    token: bytes
    auth: bytes | None
    header: bytes


def read_head(sock: socket.socket, deadline: float) -> Head:
    """A message's prefix, auth and header; its tensors are left for ``read_tensors``."""
    raw = bytearray(PREFIX.size)
    recv_exact(sock, memoryview(raw), deadline, first=True)
    kind, token, auth_len, header_len = PREFIX.unpack(raw)
    if kind not in (HELLO, REQUEST, REPLY, NACK):
        raise TransportError(f"stream: not a message (prefix {bytes(raw[:4])!r})")
    if auth_len > MAX_AUTH_BYTES or header_len > MAX_HEADER_BYTES:
        raise TransportError(f"stream: auth of {auth_len} or header of {header_len} bytes is over the cap")
    body = bytearray(auth_len + header_len)
    recv_exact(sock, memoryview(body), deadline)
    return Head(kind, token, bytes(body[:auth_len]) if auth_len else None, bytes(body[auth_len:]))


def read_tensors(sock: socket.socket, specs: Sequence[TensorSpec], deadline: float,
                 memory: RecvMemory) -> list[torch.Tensor]:
    """The tensors ``specs`` announce, read into one region of ``memory``."""
    offsets, total = [], 0
    for s in specs:
        offsets.append(total)
        total += -(-s.nbytes // ALIGN) * ALIGN
    if not total:
        return [torch.empty(s.shape, dtype=s.dtype) for s in specs]
    arr = memory.lend(total)
    view = memoryview(arr).cast("B")
    for o, s in zip(offsets, specs):
        if s.nbytes:
            recv_whole(sock, view[o:o + s.nbytes], deadline)
    flat = torch.from_numpy(arr)
    return [flat[o:o + s.nbytes].view(s.dtype).reshape(s.shape) if s.nbytes else torch.empty(s.shape, dtype=s.dtype)
            for o, s in zip(offsets, specs)]


def message(kind: bytes, token: bytes, auth: bytes | None, header: bytes, tensor_parts: Sequence[Any]) -> list[Any]:
    return [PREFIX.pack(kind, token, len(auth or b""), len(header)) + (auth or b"") + header, *tensor_parts]


# ---------------------------------------------------------------------------- server


# serve(head, sock) -> (reply parts, keep the connection), or None: close it unanswered.
Serve = Callable[[Head, socket.socket], "tuple[list[Any], bool] | None"]


class StreamServer:
    """Accepts connections on ``bind_host:0`` and serves each on a thread of its own."""

    def __init__(self, bind_host: str, serve: Serve, cpus: CpuPlan | None, name: str) -> None:
        self.token = secrets.token_bytes(8)
        self._serve = serve
        self._cpus = cpus
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        family = socket.AF_INET6 if ":" in bind_host.strip("[]") else socket.AF_INET
        self._listener = socket.create_server((bind_host.strip("[]"), 0), family=family, backlog=64)
        self._listener.settimeout(0.2)  # accept wakes to see close()
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name=f"xpyd-stream:{name}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        pin_current_thread(self._cpus)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break  # closed
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS or self._stop.is_set()
                if not full:
                    self._conns.add(conn)
            if full:
                self._nack_and_close(conn)
                continue
            threading.Thread(target=self._connection, args=(conn,), name="xpyd-stream-conn", daemon=True).start()

    @staticmethod
    def _nack_and_close(conn: socket.socket) -> None:
        try:
            conn.settimeout(0.5)
            conn.sendall(message(NACK, bytes(8), None, b"", ())[0])
        except OSError:
            pass
        conn.close()

    def _connection(self, conn: socket.socket) -> None:
        pin_current_thread(self._cpus)
        try:
            tune(conn)
            hello = read_head(conn, time.monotonic() + CONNECT_TIMEOUT_S)
            ok = hello.kind == HELLO and hello.token == self.token
            conn.settimeout(CONNECT_TIMEOUT_S)
            conn.sendall(message(REPLY if ok else NACK, bytes(8), None, b"", ())[0])
            if not ok:
                # The port was another server's before (a restarted peer), or not our client.
                return
            while not self._stop.is_set():
                try:
                    # Idle between calls for as long as the client pools the connection
                    # (keepalive finds a host that vanished).
                    head = read_head(conn, time.monotonic() + 1e9)
                except StreamClosed:
                    return
                if head.kind != REQUEST or head.token != self.token:
                    return  # not our client's: close unread
                served = self._serve(head, conn)
                if served is None:
                    return
                reply, keep = served
                send_parts(conn, reply, time.monotonic() + 60.0)
                if not keep:
                    return
        except (OSError, TransportError) as e:
            if not self._stop.is_set():
                logger.debug("stream connection ended: %s", e)
        except Exception:  # noqa: BLE001 - e.g. MemoryError for what an uncapped header announced
            logger.exception("stream connection failed; closed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() now, not at its 0.2 s timeout
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes its thread's recv
            except OSError:
                pass
        self._thread.join(timeout=2.0)

"""pyzmq TCP transport: works between any two hosts (and processes) without a GPU fabric.

Wire format, one multipart message per call and per reply::

    [header_msgpack, tensor_frame_0, tensor_frame_1, ...]

``header`` is the caller's dict plus keys owned by the transport (``wire.py``): ``"tensors"``
(``[{"dtype": "bfloat16", "shape": [...]}, ...]``, one entry per tensor frame) and
``"_id"`` (the call id, echoed in the reply). Each tensor travels as its raw bytes in one
frame. Sends are zero-copy from the tensor's memory (pyzmq ``copy=False``) and received
tensors are zero-copy views of the zmq frames (the tensor keeps its frame alive).

Byte stream (``stream.py``, on unless ``byte_stream=False`` or CURVE): the server also listens
on a plain TCP port and says where in every zmq reply (``"_stream"``); once a client knows
it, its calls to that peer go over pooled plain connections, the same header and auth,
with received tensors read into reused memory (``recv_memory_bytes``) instead of a fresh
zmq message each: libzmq's per-message allocation and thread hand-off cost half the
throughput of KV-sized payloads. A peer whose stream is gone or refuses it gets the call
over zmq.

With ``auth`` (a shared secret, see ``connector.transport.auth``) requests and replies
carry an auth frame in front (``mac``, whose zmq connections also authenticate at their
handshake: PLAIN with a token derived from the secret), or the sockets run CURVE
(``curve``). A connection that fails its handshake is closed before libzmq takes any of its
messages (counted as ``handshake``; the caller is told at once, not at its deadline). A request
that fails authentication, or that is larger than ``max_msg_bytes`` over all its frames
(or has more than ``max_frames``), never reaches the handler: it is counted by reason
(``refusals()``, ``on_refuse``), logged at most once per 10 s per reason, and answered
with a plain ``{"ok": false, "error": ..., "refused": reason}`` so the caller learns why.
A client with a secret treats such an unauthenticated answer as a failure only
(``TransportRefused``): it acts on nothing a holder of the key did not sign.

Connections to the zmq port are counted as libzmq accepts them (its socket monitor): past
``max_connections``, or ``max_connections_per_host`` from one host, a new one is shut down at
once; one that does not complete its handshake within HANDSHAKE_S is dropped by libzmq.

Server: one ROUTER socket served by one daemon thread; handlers run in that thread. A
handler may answer later instead (it returns a :class:`Deferred` and resolves it from
another thread): the server thread goes on serving and sends that reply when it comes,
or drops it after its deadline (the caller has given up by then). The nccl transport
waits for received tensors that way, so pings and hellos never queue behind a transfer.
Client: DEALER sockets pooled per peer; a socket is used by one call at a time and is
discarded (linger 0) whenever a call fails, so a late reply can never be read as the reply
to a later call. Replies are also matched by call id as a second line of defence.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from connector.affinity import CpuPlan, pin_current_thread

from . import stream
from .auth import PLAIN_USERNAME, ZAP_DOMAIN, KVAuth, MacAuth, RateLimitedLog, ZapHandler, is_reply_auth, is_request_auth
from .base import REFUSAL_REASONS, Deferred, Handler, HandshakeRefused, Transport, TransportError, TransportRefused
from .wire import (
    ID_KEY,
    MAX_HEADER_BYTES,
    STREAM_KEY,
    TENSORS_KEY,
    BytesAt,
    Malformed,
    decode_header,
    encode,
    frame_lens,
    printable,
    tensor_specs,
)

__all__ = ["Deferred", "TcpTransport"]

logger = logging.getLogger(__name__)

_RELEASE_WAIT_S = 0.5  # bound on waiting for libzmq to drop a failed call's send buffers (ms in practice)
_REFUSAL_TEXT: MappingProxyType[str, str] = MappingProxyType({
    "unauthenticated": "kv auth: this engine requires a kv_secret and the call carried none",
    "bad_mac": "kv auth: MAC does not verify (is kv_secret the same on both sides?)",
    "stale": "kv auth: timestamp outside the accepted window (are the hosts' clocks in sync?)",
    "replay": "kv auth: nonce already seen (replayed message)",
    "signed_no_secret": "kv auth: this engine has no kv_secret but the caller signed its call "
                        "(set the same kv_secret on both sides)",
})
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
HANDSHAKE_S = 5.0  # a connection to the zmq port must complete its handshake within this
MAX_CONNECTIONS, MAX_CONNECTIONS_PER_HOST = 1024, 256  # zmq connections an engine port holds

class _NotServed(Exception):
    """A peer's byte stream did not take the call (no connection, refused): nothing ran."""

    def __init__(self, why: str, unreachable: bool = False, blocked: bool = False) -> None:
        super().__init__(why)
        self.unreachable = unreachable  # no connection at all (vs. refused by a live server)
        self.blocked = blocked  # the connect timed out: packets dropped on the way


@dataclass(slots=True)
class _Later:
    """A deferred reply the server thread waits for: where it goes and how it is signed."""

    deferred: Deferred
    call_id: int | None
    nonce: bytes | None
    ident: Any = None


# ---------------------------------------------------------------------------- decoding


def _frame_to_tensor(frame: zmq.Frame, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    nbytes = len(frame)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    addr = np.frombuffer(frame.buffer, dtype=np.uint8).ctypes.data
    flat = torch.from_numpy(np.asarray(BytesAt(addr, nbytes, frame)))
    if addr % dtype.itemsize:
        # Small frames may sit at an odd offset inside libzmq's shared receive buffer;
        # copy those into an aligned allocation rather than hand out misaligned tensors.
        flat = flat.clone()
    return flat.view(dtype).reshape(shape)


def _decode_tensors(metas: Any, frames: Sequence[zmq.Frame]) -> list[torch.Tensor]:
    specs = tensor_specs(metas)
    if len(specs) != len(frames):
        raise Malformed(f"header lists {len(specs)} tensors but {len(frames)} tensor frames arrived")
    for i, (spec, frame) in enumerate(zip(specs, frames)):
        if len(frame) != spec.nbytes:
            raise Malformed(f"tensor {i}: {spec.dtype}{list(spec.shape)} needs {spec.nbytes} bytes, "
                            f"frame has {len(frame)}")
    return [_frame_to_tensor(f, s.dtype, list(s.shape)) for s, f in zip(specs, frames)]


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
        max_msg_bytes: cap on one message, requests and replies, over all its frames. libzmq
            drops (and disconnects) a peer sending a larger *frame*; a larger message
            made of smaller frames is dropped once received and refused ("oversized").
        max_frames: cap on the header and tensor frames of one message (each costs memory
            even when empty).
        auth: authenticate every call with a key derived from a shared secret; ``None``
            accepts anyone who reaches the port (upstream-compatible).
        byte_stream: serve and use the byte stream (``stream.py``); never with CURVE.
        recv_memory_bytes: memory reused for tensors received over the stream (default:
            ``max_msg_bytes``, else 1 GiB); virtual until messages touch it.
        max_connections, max_connections_per_host: zmq connections the server holds, in all
            and from one host; new ones beyond are shut down as they come.
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
        max_frames: int | None = None,
        auth: KVAuth | None = None,
        byte_stream: bool = True,
        recv_memory_bytes: int | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_host: int = MAX_CONNECTIONS_PER_HOST,
    ) -> None:
        self._hwm = hwm
        self._cpus = cpus
        self._max_msg_bytes = max_msg_bytes
        self._max_frames = max_frames
        self._auth = auth
        self._mac = MacAuth(auth) if auth is not None and auth.mode == "mac" else None
        self._curve = auth if auth is not None and auth.mode == "curve" else None
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
        self._zap: ZapHandler | None = None
        self._stop = threading.Event()
        self._ids = itertools.count(1)  # next() is atomic under the GIL
        self._refused = dict.fromkeys(REFUSAL_REASONS, 0)
        # Deferred replies: resolved ones queue here and wake the server thread (a socket
        # pair it polls beside the ROUTER: a zmq socket is not for other threads to touch).
        self._resolved: queue.SimpleQueue[Deferred] = queue.SimpleQueue()
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._log_refusal = RateLimitedLog(logger.warning)
        self.on_refuse: Callable[[str], None] | None = None  # e.g. the engine's metrics
        self.bound_port: int | None = None
        # Handlers run one at a time, whichever channel's thread received the call.
        self._handler_lock = threading.Lock()
        self._handler: Handler | None = None
        self._use_stream = byte_stream and self._curve is None
        self._stream_server: stream.StreamServer | None = None
        self._stream_at: dict[str, tuple[int, bytes]] = {}  # peer -> its stream (port, token)
        # peer -> the stream that could not be reached: not tried again until the peer
        # restarts (a new token), so a firewalled port costs one connect timeout, not one a call.
        self._stream_unreachable: dict[str, tuple[int, bytes]] = {}
        self._stream_idle: dict[str, list[socket.socket]] = {}
        self._recv_memory = stream.RecvMemory(
            recv_memory_bytes if recv_memory_bytes is not None else (max_msg_bytes or 1 << 30))
        self.stream_calls = 0  # calls this client made over the stream (tests, benchmarks)
        self.stream_received_bytes = 0  # tensor bytes this server received over it (engine stats)
        # Server: zmq connections held (descriptor -> peer host), per host; the server thread's.
        self._max_conns, self._max_per_host = max_connections, max_connections_per_host
        self._conns: dict[int, str] = {}
        self._per_host: Counter[str] = Counter()
        self.refused_connections = 0  # shut down past a cap (tests, stats)
        # Client: the monitor of each new socket until its handshake is done (id(socket) ->).
        self._handshakes: dict[int, zmq.Socket] = {}

    @property
    def authenticated(self) -> bool:
        return self._auth is not None

    def refusals(self) -> dict[str, int]:
        """Requests dropped before the handler, by reason, since start."""
        with self._lock:
            return dict(self._refused)

    def _count_refusal(self, reason: str, detail: str) -> None:
        with self._lock:
            self._refused[reason] += 1
        self._log_refusal(reason, "tcp transport: refused %s request on port %s: %s",
                          reason, self.bound_port, printable(detail))
        hook = self.on_refuse
        if hook is not None:
            try:
                hook(reason)
            except Exception:  # noqa: BLE001 - counting must never break serving
                logger.exception("tcp transport: refusal hook failed")

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
        if self._max_msg_bytes:
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_msg_bytes)  # per frame; totals: _recv_message
        if self._sock_buf_bytes:
            sock.setsockopt(zmq.SNDBUF, self._sock_buf_bytes)
            sock.setsockopt(zmq.RCVBUF, self._sock_buf_bytes)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)

    def _recv_message(self, sock: zmq.Socket) -> tuple[list[zmq.Frame], bool]:
        """The next message's frames, and whether it broke a cap. libzmq delivers a
        message only once all of it arrived; past a cap the rest is read and dropped
        at once rather than kept (the first frame stays: a ROUTER's is the caller)."""
        cap, max_frames = self._max_msg_bytes, self._max_frames
        out: list[zmq.Frame] = []
        total = 0
        over = False
        more = True
        while more:
            f = sock.recv(copy=False)
            more = f.more
            if over:
                continue
            total += len(f)
            out.append(f)
            # + 2: a ROUTER's caller frame and the auth frame are not counted in max_frames.
            if (cap is not None and total > cap) or (max_frames is not None and len(out) > max_frames + 2):
                over = True
                del out[1:]
        return out, over

    # ------------------------------------------------------------------ server

    def start(self, bind_host: str, port: int, handler: Handler) -> None:
        """Bind ``tcp://bind_host:port`` (port 0: any free port, see ``bound_port``)."""
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            if self._serving:
                raise RuntimeError("server already started")
            self._serving = True
        self._handler = handler
        sock = self._ctx.socket(zmq.ROUTER)
        monitor = None
        try:
            self._configure(sock, bind_host.strip("[]"))
            sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
            if self._auth is not None:
                # ZAP must answer before the first handshake; it admits the derived client
                # key (curve) or the connect token (mac) only.
                self._zap = ZapHandler(self._ctx, self._auth,
                                       lambda addr, mech: self._count_refusal(
                                           "handshake", f"{mech} client {addr} with another key (kv_secret?)"))
                sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
                if self._curve is not None:
                    sock.setsockopt(zmq.CURVE_SERVER, 1)
                    sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.curve_server[1])
                else:
                    sock.setsockopt(zmq.PLAIN_SERVER, 1)
            # Every connection as libzmq accepts and drops it (the caps), and every failed
            # handshake (a peer with another secret, or none: counted).
            monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            if port == 0:
                self.bound_port = sock.bind_to_random_port(f"tcp://{bind_host}")
            else:
                sock.bind(f"tcp://{bind_host}:{port}")
                self.bound_port = port
        except zmq.ZMQError as e:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            if self._zap is not None:
                self._zap.close()
            with self._lock:
                self._serving = False
            raise TransportError(f"cannot bind tcp://{bind_host}:{port}: {e}") from e
        if self._use_stream:
            try:
                self._stream_server = stream.StreamServer(bind_host, self._serve_stream, self._cpus,
                                                          str(self.bound_port))
            except OSError as e:  # zmq serves alone; clients keep to it
                logger.warning("tcp transport: no byte stream (%s); calls stay on zmq", e)
        self._wake = socket.socketpair()
        for w in self._wake:
            w.setblocking(False)
        self._server_thread = threading.Thread(
            target=self._serve, args=(sock, handler, monitor), name=f"xpyd-tcp-server:{self.bound_port}",
            daemon=True,
        )
        self._server_thread.start()
        logger.info("tcp transport serving", extra={
            "bind": f"{bind_host}:{self.bound_port}", "auth": self._auth.mode if self._auth else "none",
            "stream_port": self._stream_server.port if self._stream_server else None})

    def _serve(self, sock: zmq.Socket, handler: Handler, monitor: zmq.Socket | None) -> None:
        pin_current_thread(self._cpus)
        assert self._wake is not None
        wake = self._wake[0]
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        later: dict[int, _Later] = {}  # id(deferred) -> where its reply goes
        try:
            while not self._stop.is_set():
                try:
                    ready = dict(poller.poll(self._poll_ms))
                    if monitor is not None and monitor in ready:
                        self._connection_events(monitor)
                    if later or wake in ready:
                        self._send_resolved(sock, wake, later)
                    if sock not in ready:
                        continue
                    frames, oversized = self._recv_message(sock)
                except zmq.ZMQError as e:
                    if self._stop.is_set():
                        break
                    logger.error("tcp transport: receive failed: %s", e)
                    self._stop.wait(self._poll_ms / 1000)  # don't spin on a persistent error
                    continue
                # ROUTER prepends the caller's identity frame.
                ident, body = frames[0], frames[1:]
                try:
                    reply = self._serve_one(body, oversized, handler)
                except Exception as e:  # noqa: BLE001 - no message may stop the server thread
                    logger.exception("tcp transport: serving a request failed")
                    reply = encode({"ok": False, "error": f"server error: {type(e).__name__}"}, (), None)
                if isinstance(reply, _Later):
                    reply.ident = ident
                    later[id(reply.deferred)] = reply
                    reply.deferred.on_resolve(self._on_resolved)
                    continue
                self._send_reply(sock, ident, reply)
        except Exception:  # pragma: no cover - the loop above is meant to catch everything
            logger.exception("tcp transport: server thread crashed")
        finally:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            for w in self._wake:
                w.close()
            if self._zap is not None:
                self._zap.close()
            with self._lock:
                self._serving = False
            self._maybe_term_ctx()

    @staticmethod
    def _send_reply(sock: zmq.Socket, ident: Any, reply: list[Any]) -> None:
        try:
            # ROUTER never blocks: a reply to a caller that went away is dropped.
            sock.send_multipart([ident, *reply], copy=False)
        except zmq.ZMQError as e:
            logger.warning("tcp transport: sending reply failed: %s", e)

    def _on_resolved(self, deferred: Deferred) -> None:
        """Any thread: a deferred reply is ready; wake the server thread."""
        self._resolved.put(deferred)
        self._wake_server()

    def _wake_server(self) -> None:
        wake = self._wake
        try:
            if wake is not None:
                wake[1].send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already, or the server is gone

    def _send_resolved(self, sock: zmq.Socket, wake: socket.socket, later: dict[int, _Later]) -> None:
        """Server thread: send the deferred replies that came, forget those past their time."""
        for _ in range(64):  # drain the wake-ups (one byte each; bounded)
            try:
                if not wake.recv(4096):
                    break
            except (BlockingIOError, OSError):
                break
        while True:
            try:
                d = self._resolved.get_nowait()
            except queue.Empty:
                break
            item = later.pop(id(d), None)
            result = d.result()
            if item is None or result is None:
                continue
            try:
                frames = self._reply_frames(result, item.call_id)
            except Exception as e:  # noqa: BLE001 - as for a handler's reply
                logger.exception("tcp transport: encoding a deferred reply failed")
                frames = encode({"ok": False, "error": f"server error: {type(e).__name__}"}, (), item.call_id)
            self._send_reply(sock, item.ident, self._signed(frames, item.nonce))
        now = time.monotonic()
        for key in [k for k, v in later.items() if v.deferred.until < now]:
            del later[key]  # never resolved in time: the caller gave up

    def _reply_frames(self, result: tuple[dict, Sequence[torch.Tensor]], call_id: int | None) -> list[Any]:
        reply_header, reply_tensors = result
        reply_header = dict(reply_header)
        reply_header.setdefault("ok", True)
        srv = self._stream_server  # where this server's byte stream is (signed with the reply)
        return encode(reply_header, reply_tensors, call_id, {STREAM_KEY: [srv.port, srv.token]} if srv else None)

    def _connection_events(self, monitor: zmq.Socket) -> None:
        for _ in range(256):  # bounded: the server thread goes back to its messages
            if not monitor.poll(0):
                return
            event = recv_monitor_message(monitor)
            kind, fd = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            elif kind == zmq.EVENT_DISCONNECTED:
                host = self._conns.pop(fd, None)
                if host is not None:
                    self._per_host[host] -= 1
                    if self._per_host[host] <= 0:
                        del self._per_host[host]
            elif kind & (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                # EVENT_HANDSHAKE_FAILED_AUTH is ZAP's refusal, counted by the ZAP handler.
                self._count_refusal("handshake", "handshake failed (another kv_secret or kv_auth, or a secret on "
                                    "one side only)")

    def _accepted(self, fd: int) -> None:
        """A connection libzmq accepted: counted, or past a cap shut down at once (its read
        fails and libzmq drops it: nothing of it is held)."""
        try:  # a descriptor of our own: libzmq's stays libzmq's
            conn = socket.socket(fileno=os.dup(fd))
        except OSError:
            return  # closed already
        try:
            try:
                if conn.getsockname()[1] != self.bound_port:
                    return  # the number was reused by another connection meanwhile
                host = str(conn.getpeername()[0])
            except (OSError, IndexError):
                return
            if len(self._conns) < self._max_conns and self._per_host[host] < self._max_per_host:
                self._conns[fd] = host
                self._per_host[host] += 1
                return
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            with self._lock:
                self.refused_connections += 1
            self._log_refusal("connections", "tcp transport: connection from %s refused on port %s: %d held, %d from "
                              "its host (caps %d, %d per host)", host, self.bound_port, len(self._conns),
                              self._per_host[host], self._max_conns, self._max_per_host)  # fmt: skip
        finally:
            conn.close()

    def _refuse(self, reason: str, detail: str, text: str | None = None) -> list[Any]:
        self._count_refusal(reason, detail)
        return encode({"ok": False, "error": text or _REFUSAL_TEXT.get(reason, detail), "refused": reason}, (), None)

    def _refuse_oversized(self) -> list[Any]:
        return self._refuse("oversized", "over the cap", f"message over {self._max_msg_bytes} bytes or "
                            f"{self._max_frames} frames (kv_buffer_size of the receiving engine)")

    def _serve_one(self, body: list[zmq.Frame], oversized: bool, handler: Handler) -> list[Any] | _Later:
        if oversized:
            return self._refuse_oversized()
        if len(body) > (self._mac is not None) and len(body[self._mac is not None]) > MAX_HEADER_BYTES:
            return self._refuse("oversized", "header frame too large",
                                f"header frame over {MAX_HEADER_BYTES} bytes")
        # With a secret the first frame is the auth frame; without, one there is refused.
        signed = len(body) >= 2 if self._mac is not None else bool(body) and is_request_auth(body[0].buffer)
        auth, body = (body[0].buffer, body[1:]) if signed else (None, body)
        refusal, nonce = self._authenticate(auth, body[0].buffer if body else b"", [len(f) for f in body],
                                            f"{len(body) + signed} frames, {sum(len(f) for f in body)} bytes")
        if refusal is not None:
            return refusal
        call_id = None
        try:
            if not body:
                raise Malformed("empty message")
            header = decode_header(body[0].buffer)
            call_id = header.pop(ID_KEY, None)
            if not isinstance(call_id, int | None):
                call_id = None
                raise Malformed("call id is not an int")
            tensors = _decode_tensors(header.pop(TENSORS_KEY, []), body[1:])
        except Malformed as e:
            self._count_refusal("malformed", str(e))
            return self._signed(encode({"ok": False, "error": f"malformed request: {printable(str(e))}",
                                        "refused": "malformed"}, (), call_id), nonce)
        reply = self._dispatch(handler, header, tensors, call_id)
        if isinstance(reply, Deferred):
            return _Later(reply, call_id, nonce)
        return self._signed(reply, nonce)

    def _dispatch(self, handler: Handler, header: dict, tensors: list[torch.Tensor],
                  call_id: int | None) -> list[Any] | Deferred:
        """Run the handler (one at a time, whichever channel): its reply frames, unsigned."""
        try:
            with self._handler_lock:
                result = handler(header, tensors)
            if isinstance(result, Deferred):
                return result
            return self._reply_frames(result, call_id)
        except Exception as e:
            logger.exception("tcp transport: handler failed")
            return encode({"ok": False, "error": f"handler error: {type(e).__name__}: {e}"}, (), call_id)

    def _serve_stream(self, head: stream.Head, conn: socket.socket) -> tuple[list[Any], bool] | None:
        """A stream connection's thread: admit one request as ``_serve_one`` does (same caps,
        same MAC over the same parts), then read its tensors into reused memory and serve it.
        A refused request is answered and its connection closed (its bytes stay unread)."""
        handler = self._handler
        assert handler is not None
        auth_len = len(head.auth) if head.auth is not None else 0

        def closing(refusal: list[Any]) -> tuple[list[Any], bool]:  # answer, then close unread
            return stream.message(stream.REPLY, bytes(8), None, refusal[0], ()), False

        try:
            header = decode_header(head.header)
            specs = tensor_specs(header.pop(TENSORS_KEY, []))
            call_id = header.pop(ID_KEY, None)
            if not isinstance(call_id, int | None):
                raise Malformed("call id is not an int")
        except Malformed as e:
            return closing(self._refuse("malformed", str(e), f"malformed request: {printable(str(e))}"))
        lens = [len(head.header), *(s.nbytes for s in specs)]
        if (self._max_msg_bytes is not None and auth_len + sum(lens) > self._max_msg_bytes) or \
                (self._max_frames is not None and len(lens) > self._max_frames + 1):
            return closing(self._refuse_oversized())
        refusal, nonce = self._authenticate(head.auth, head.header, lens, f"{len(lens)} parts, {sum(lens)} bytes")
        if refusal is not None:
            return closing(refusal)
        # Bounded by a floor of 0.1 GB/s: a sender that stalls longer has given up.
        tensors = stream.read_tensors(conn, specs, time.monotonic() + 30.0 + sum(lens) / 1e8, self._recv_memory)
        with self._lock:
            self.stream_received_bytes += sum(lens) - lens[0]
        reply = self._dispatch(handler, header, tensors, call_id)
        del tensors  # the handler kept what it wanted; the rest of the memory goes back now
        if isinstance(reply, Deferred):
            done = threading.Event()
            reply.on_resolve(lambda _d: done.set())
            result = reply.result() if done.wait(max(0.0, reply.until - time.monotonic())) else None
            if result is None:
                return None  # never resolved in time: the caller has given up
            try:
                reply = self._reply_frames(result, call_id)
            except Exception as e:  # noqa: BLE001 - as for a handler's reply
                logger.exception("tcp transport: encoding a deferred reply failed")
                reply = encode({"ok": False, "error": f"server error: {type(e).__name__}"}, (), call_id)
        auth = self._mac.sign_reply(nonce, reply[0], frame_lens(reply)) if nonce is not None and self._mac else None
        return stream.message(stream.REPLY, bytes(8), auth, reply[0], reply[1:]), True

    def _authenticate(self, auth: Any, header: Any, lens: list[int],
                      detail: str) -> tuple[list[Any] | None, bytes | None]:
        """Both channels' request check: (None, the nonce to sign the reply with), or the
        refusal to answer. ``lens``: the header's and every tensor's byte length."""
        if self._mac is None:
            if auth is not None:
                return self._refuse("malformed", "signed call, no secret here", _REFUSAL_TEXT["signed_no_secret"]), None
            return None, None
        if auth is None:
            return self._refuse("unauthenticated", detail), None
        reason, nonce = self._mac.check_request(auth, header, lens)
        if reason is not None:
            return self._refuse(reason, detail), None
        return None, nonce

    def _signed(self, frames: list[Any], nonce: bytes | None) -> list[Any]:
        """A reply to an authenticated request carries the MAC bound to its nonce."""
        if nonce is None or self._mac is None:
            return frames
        return [self._mac.sign_reply(nonce, frames[0], frame_lens(frames)), *frames]

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
        frames = encode(header, tensors, call_id)
        nonce = None
        if self._mac is not None:
            auth_frame, nonce = self._mac.sign_request(frames[0], frame_lens(frames))
            frames = [auth_frame, *frames]
        at = self._stream_at.get(peer) if self._use_stream else None
        if at is not None:
            try:
                return self._call_stream(peer, at, frames, nonce, call_id, deadline, timeout_s)
            except _NotServed as e:
                self._forget_stream(peer, unreachable=e.unreachable)
                (logger.warning if e.blocked else logger.info)(
                    "tcp transport: %s's byte stream is not serving (%s); calls go over zmq%s", peer, e,
                    " until it restarts: is its port blocked? (byte_stream: false turns the stream off)"
                    if e.blocked else "")
        sock = self._checkout(peer)
        reusable = False
        tracker = None
        try:
            # IMMEDIATE=1: POLLOUT only once a connection is up, so an unreachable peer is
            # told apart from a slow one and no message sits queued for a dead endpoint.
            if not self._connected(sock, peer, deadline):
                # Nothing was sent, so no late reply can come on it: it stays pooled and its
                # connection (a handshake slow under load) goes on for the next call.
                reusable = True
                hint = (" (a peer with another kv_secret refuses the handshake and may look like this; see its "
                        "refused counter)" if self._auth is not None else "")
                raise TransportError(f"peer {peer} unreachable: no connection within {timeout_s:g}s{hint}")
            # Tracked only with tensors: the caller's memory (a tracker costs ~0.1 ms).
            tracker = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False, track=bool(tensors))
            while True:
                left = _ms_left(deadline)
                if left <= 0 or not sock.poll(left, zmq.POLLIN):
                    raise TransportError(f"timeout after {timeout_s:g}s waiting for reply from {peer}")
                reply, oversized = self._recv_message(sock)
                if oversized:
                    raise TransportError(f"reply from {peer} over {self._max_msg_bytes} bytes or "
                                         f"{self._max_frames} frames")
                if nonce is not None:
                    reply = self._verified(peer, nonce, reply)
                    if reply is None:
                        continue  # a late reply to an earlier call
                try:
                    rheader = decode_header(reply[0].buffer)
                    rid = rheader.pop(ID_KEY, None)
                    if rid is not None and rid != call_id:
                        logger.warning("tcp transport: dropping stale reply %s (want %s) from %s", rid, call_id, peer)
                        continue
                    rtensors = _decode_tensors(rheader.pop(TENSORS_KEY, []), reply[1:])
                except Malformed as e:
                    raise TransportError(f"malformed reply from {peer}: {e}") from None
                reusable = True
                self._learn_stream(peer, rheader.pop(STREAM_KEY, None))
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

    # ------------------------------------------------------------------ client: byte stream

    def _learn_stream(self, peer: str, at: Any) -> None:
        if not self._use_stream or at is None:
            return
        if (isinstance(at, list) and len(at) == 2 and type(at[0]) is int and 0 < at[0] < 65536
                and isinstance(at[1], bytes) and len(at[1]) == 8):
            with self._lock:
                if self._stream_unreachable.get(peer) != (at[0], at[1]):
                    self._stream_at[peer] = (at[0], at[1])

    def _forget_stream(self, peer: str, unreachable: bool = False) -> None:
        """Back to zmq until a zmq reply says where the peer's stream is (again); if it could
        not be reached, until the peer says it is somewhere else."""
        with self._lock:
            at = self._stream_at.pop(peer, None)
            if unreachable and at is not None:
                self._stream_unreachable[peer] = at
            idle = self._stream_idle.pop(peer, [])
        for s in idle:
            s.close()

    def _call_stream(self, peer: str, at: tuple[int, bytes], frames: list[Any], nonce: bytes | None,
                     call_id: int, deadline: float, timeout_s: float) -> tuple[dict, list[torch.Tensor]]:
        """``call`` over the byte stream. _NotServed: the call never reached a handler."""
        sock = self._stream_checkout(peer, at, deadline)
        ok = False
        try:
            auth, body = (frames[0], frames[1:]) if nonce is not None else (None, frames)
            stream.send_parts(sock, stream.message(stream.REQUEST, at[1], auth, body[0], body[1:]), deadline)
            head = stream.read_head(sock, deadline)
            if head.kind != stream.REPLY:
                raise TransportError(f"stream from {peer}: {head.kind!r} where a reply belongs")
            try:
                rheader = decode_header(head.header)
                specs = tensor_specs(rheader.pop(TENSORS_KEY, []))
            except Malformed as e:
                raise TransportError(f"malformed reply from {peer}: {e}") from None
            lens = [len(head.header), *(s.nbytes for s in specs)]
            if nonce is not None:
                self._check_reply(peer, nonce, head.auth, head.header, lens)
            if self._max_msg_bytes is not None and sum(lens) > self._max_msg_bytes:
                raise TransportError(f"reply from {peer} over {self._max_msg_bytes} bytes")
            rtensors = stream.read_tensors(sock, specs, deadline, self._recv_memory)
            rid = rheader.pop(ID_KEY, None)
            if rid is not None and rid != call_id:
                raise TransportError(f"stream from {peer}: reply to call {rid}, not {call_id}")
            rheader.pop(STREAM_KEY, None)
            ok = True
            with self._lock:
                self.stream_calls += 1
            return rheader, rtensors
        except TimeoutError:
            raise TransportError(f"timeout after {timeout_s:g}s waiting for reply from {peer}") from None
        except stream.StreamClosed as e:
            raise TransportError(f"peer {peer} closed the connection before replying ({e}): it gave the "
                                 "call up (a reply not ready in time) or went away") from None
        except OSError as e:
            raise TransportError(f"stream to {peer} failed: {e}") from e
        finally:
            self._stream_checkin(peer, sock, ok)
            if not ok:
                self._forget_stream(peer)

    def _stream_checkout(self, peer: str, at: tuple[int, bytes], deadline: float) -> socket.socket:
        """A pooled connection that is still open, or a new one its server accepted."""
        while True:
            with self._lock:
                if self._closed:
                    raise TransportError("transport is closed")
                idle = self._stream_idle.get(peer)
                sock = idle.pop() if idle else None
            if sock is None:
                break
            if stream.is_open(sock):
                return sock
            sock.close()  # the peer closed it (restarted, or its transport closed)
        host = peer.rpartition(":")[0].strip("[]")
        sock = None
        limit = 0.0
        try:
            limit = min(stream.CONNECT_TIMEOUT_S, max(0.0, deadline - time.monotonic()))
            sock = socket.create_connection((host, at[0]), timeout=limit)
            stream.tune(sock)
            stream.send_parts(sock, stream.message(stream.HELLO, at[1], None, b"", ()), deadline)
            head = stream.read_head(sock, min(deadline, time.monotonic() + stream.CONNECT_TIMEOUT_S))
        except (OSError, TransportError) as e:
            if sock is not None:
                sock.close()
            # Refused: nothing listens there (the peer restarted). A full connect timeout: a
            # port that drops packets (a firewall). A shorter one says only that this call
            # was nearly out of time.
            timed_out = isinstance(e, TimeoutError)
            raise _NotServed(f"connecting to port {at[0]}: {e or type(e).__name__}",
                             unreachable=not timed_out or limit >= stream.CONNECT_TIMEOUT_S,
                             blocked=timed_out and limit >= stream.CONNECT_TIMEOUT_S) from None
        if head.kind != stream.REPLY:
            sock.close()
            raise _NotServed("the server refused the connection (restarted, or at its connection cap)")
        return sock

    def _stream_checkin(self, peer: str, sock: socket.socket, reusable: bool) -> None:
        with self._lock:
            if reusable and not self._closed:
                idle = self._stream_idle.setdefault(peer, [])
                if len(idle) < self._max_idle:
                    idle.append(sock)
                    return
        sock.close()

    def _check_reply(self, peer: str, nonce: bytes, auth: bytes | None, header: bytes, lens: list[int]) -> None:
        """A stream reply must be signed for this call (one call per connection at a time:
        a stale one is as wrong as a forged one)."""
        assert self._mac is not None
        if auth is not None and is_reply_auth(auth):
            if self._mac.check_reply(nonce, auth, header, lens) is not None:
                raise TransportError(f"reply from {peer} failed authentication (tampered, or not a peer "
                                     "with this kv_secret)")
            return
        try:
            error = printable(str(decode_header(header).get("error", "no reason given")))
        except Malformed:
            error = "an answer that is neither signed nor readable"
        raise TransportRefused(f"peer {peer} refused the call (unauthenticated answer): {error}")

    def _verified(self, peer: str, nonce: bytes, reply: list[zmq.Frame]) -> list[zmq.Frame] | None:
        """The body of a reply signed for this call; None for a late reply to an earlier
        one. An unsigned answer is the peer refusing the call: its text (unverifiable,
        so only ever a failure) says why."""
        assert self._mac is not None
        if reply and is_reply_auth(reply[0].buffer):
            if len(reply) < 2:
                raise TransportError(f"malformed reply from {peer}: auth frame alone")
            why = self._mac.check_reply(nonce, reply[0].buffer, reply[1].buffer, [len(f) for f in reply[1:]])
            if why == "stale":
                return None
            if why is not None:
                raise TransportError(f"reply from {peer} failed authentication (tampered, or not a peer "
                                     "with this kv_secret)")
            return reply[1:]
        try:
            error = printable(str(decode_header(reply[0].buffer).get("error", "no reason given")))
        except (Malformed, IndexError):
            error = "an answer that is neither signed nor readable"
        raise TransportRefused(f"peer {peer} refused the call (unauthenticated answer): {error}")

    def _connected(self, sock: zmq.Socket, peer: str, deadline: float) -> bool:
        """Whether the socket can send before the deadline. A new one's handshake is watched:
        a peer that refuses it (another kv_secret, or a secret on one side only) is a
        TransportRefused at once, not a wait until the deadline."""
        monitor = self._handshakes.get(id(sock))
        if monitor is None:
            return bool(sock.poll(_ms_left(deadline), zmq.POLLOUT))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLOUT)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(_ms_left(deadline)))
            if sock in ready:
                self._unwatch(sock)
                return True
            if monitor not in ready:
                return False  # the deadline
            event = recv_monitor_message(monitor)
            kind = event["event"]
            if kind & _HANDSHAKE_FAILED:
                self._unwatch(sock)
                why = ("it refused this kv_secret" if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                       else "it speaks another kv_auth, or has a kv_secret where this side has none (or the reverse)")
                raise HandshakeRefused(f"peer {peer} refused the connection at its handshake: {why}; is kv_secret the "
                                       "same on both sides?")

    def _unwatch(self, sock: zmq.Socket) -> None:
        monitor = self._handshakes.pop(id(sock), None)
        if monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)

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
            if self._curve is not None:
                sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.curve_server[0])
                sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.curve_client[0])
                sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.curve_client[1])
            elif self._auth is not None:  # mac: the connection proves the key at its handshake
                sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USERNAME)
                sock.setsockopt(zmq.PLAIN_PASSWORD, self._auth.connect_token)
            self._handshakes[id(sock)] = sock.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
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
            self._unwatch(sock)
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
            idle_streams = [s for socks in self._stream_idle.values() for s in socks]
            self._stream_idle.clear()
        self._stop.set()
        self._wake_server()  # it polls with a timeout: without this, close waits up to poll_interval_s
        for s in idle:
            self._unwatch(s)
            s.close(linger=0)
        for s in idle_streams:
            s.close()
        if self._stream_server is not None:
            self._stream_server.close()
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

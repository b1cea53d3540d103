"""NCCL transport: control messages over the tcp transport, tensors over NCCL, device to device.

Every call still goes over the engine's ZMQ control socket (``TcpTransport``: same
authentication, size caps and refusal counters); only the tensors move over NCCL, straight
between the two GPUs' memory. Per peer pair there is one communicator per direction of
initiation (two ranks; the caller that created it is rank 0), created lazily on the first
call over the control socket (``_nccl_hello`` carries the unique id), on its own stream.

A call with tensors: the caller enqueues its sends on the communicator's stream, then sends
the header with the tensors' shapes over the control socket; the server allocates, enqueues
the matching receives, waits for them (bounded by the caller's remaining time), runs the
handler and answers. Reply tensors go back the same way, the other direction. Calls on one
communicator are serialised (NCCL matches sends and receives in order).

Nothing waits unbounded: communicator set-up has ``init_timeout_s``, a transfer has the
call's deadline, reply sends the server could not deliver are reaped. A communicator that
missed a deadline, whose peer vanished or which saw any error is aborted (``ncclCommAbort``,
non-blocking communicators) and the next call creates a new one. A peer that cannot do NCCL
(tcp-only, CPU caches, no libnccl) answers the hello with a refusal: calls to it carry their
tensors inline over the control socket, copied through host memory.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import Handler, Transport, TransportError
from .nccl_api import NCCL_IN_PROGRESS, NCCL_SUCCESS, UNIQUE_ID_BYTES, CommConfig, NcclLibrary
from .tcp import TcpTransport

__all__ = ["NcclTransport"]

logger = logging.getLogger(__name__)

NCCL_KEY = "_nccl"  # request: {"cid", "metas", "budget_ms"}
REPLY_KEY = "_nccl_reply"  # reply: metas of the tensors coming back over NCCL
CONSUMED_KEY = "_nccl_consumed"  # reply: the server received every tensor the call sent
RESET_KEY = "_nccl_reset"  # reply: the server does not know (or dropped) that communicator
HELLO_OP = "_nccl_hello"
_POLL_S = 0.0005  # between status/event polls: completion is usually a few ms away
_REAP_S = 0.5
# A peer that refused NCCL is asked again after this long (it may have been restarted).
_NO_NCCL_RETRY_S = 30.0

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
               torch.int16, torch.int32, torch.int64, torch.bool,
               getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if dt is not None
}


@dataclass(slots=True)
class _Pending:
    tensors: list[torch.Tensor]
    until: float
    event: Any = None


@dataclass(slots=True)
class _Comm:
    cid: str
    peer: str
    rank: int  # 0: we created it (the caller side), 1: the peer did
    handle: Any
    stream: Any
    created: float = field(default_factory=time.monotonic)
    ready: bool = False
    broken: str | None = None  # why it was aborted
    # One call at a time; also held around ncclCommAbort, which must not run while another
    # thread is inside an NCCL call on the same communicator. Re-entrant: calls abort.
    lock: threading.RLock = field(default_factory=threading.RLock)
    # Reply sends the server posted and their deadline; their tensors stay alive until the
    # stream ran them. ``unsettled``: NCCL may still be launching them (the caller posts its
    # receives only once it has the reply), so no event was recorded for them yet.
    pending: list[_Pending] = field(default_factory=list)
    unsettled: bool = False

    @property
    def other(self) -> int:
        return 1 - self.rank


def _metas(tensors: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in tensors]


def _checked_metas(metas: Any, max_bytes: int | None, max_frames: int | None) -> list[tuple[torch.dtype, list[int]]]:
    """Validate tensor descriptions from the wire before a byte is allocated for them."""
    if not isinstance(metas, list):
        raise ValueError("tensor metas must be a list")
    if max_frames is not None and len(metas) > max_frames:
        raise ValueError(f"{len(metas)} tensors over the cap of {max_frames}")
    out, total = [], 0
    for m in metas:
        if not isinstance(m, dict):
            raise ValueError("tensor meta must be a map")
        dt = _DTYPES.get(m.get("dtype"))  # type: ignore[arg-type]
        shape = m.get("shape")
        if dt is None:
            raise ValueError(f"unsupported dtype {m.get('dtype')!r}")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise ValueError(f"bad shape {shape!r}")
        total += math.prod(shape) * torch.empty((), dtype=dt).element_size()
        out.append((dt, shape))
    if max_bytes is not None and total > max_bytes:
        raise ValueError(f"{total} bytes over the cap of {max_bytes} (kv_buffer_size of the receiving engine)")
    return out


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class NcclTransport(Transport):
    """Tensors over NCCL between devices, everything else over a :class:`TcpTransport`.

    Args:
        lib: the NCCL library object (``nccl_lib.load_nccl_library()``, or a test double).
        device: where received tensors are allocated and sent tensors must live.
        num_channels: NCCL channels of this transport's communicators only (``ncclConfig_t``).
        init_timeout_s: bound on creating one communicator.
        max_wait_s: bound on the server waiting for a call's tensors, whatever the caller asked.
        control: the control transport (its auth and caps apply to every call);
            ``control_kwargs`` build one when not given.
    """

    name = "nccl"
    device_native = True

    def __init__(self, lib: NcclLibrary, device: torch.device, *, num_channels: int | None = None,
                 init_timeout_s: float = 10.0, max_wait_s: float = 30.0,
                 control: TcpTransport | None = None, **control_kwargs: Any) -> None:
        self._lib = lib
        self._device = torch.device(device)
        self._config = CommConfig(blocking=False, num_channels=num_channels)
        self._init_timeout_s = init_timeout_s
        self._max_wait_s = max_wait_s
        self._control = control or TcpTransport(**control_kwargs)
        self._max_bytes: int | None = control_kwargs.get("max_msg_bytes")
        self._max_frames: int | None = control_kwargs.get("max_frames")
        self._id = uuid.uuid4().hex[:12]
        self._cids = itertools.count(1)
        self._lock = threading.Lock()  # guards the tables below
        self._out: dict[str, _Comm] = {}  # peer address -> communicator we created
        self._in: dict[str, _Comm] = {}  # cid -> communicator a peer created
        self._creating: dict[str, threading.Lock] = {}  # peer -> lock: one set-up at a time
        self._no_nccl: dict[str, float] = {}  # peer -> monotonic time it refused NCCL
        self._address = "?"
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.aborted = 0  # communicators aborted since start (tests, logs)

    # ---------------------------------------------------------------- properties
    @property
    def authenticated(self) -> bool:
        return bool(getattr(self._control, "authenticated", False))

    @property
    def on_refuse(self) -> Callable[[str], None] | None:  # type: ignore[override]
        return self._control.on_refuse

    @on_refuse.setter
    def on_refuse(self, fn: Callable[[str], None] | None) -> None:
        self._control.on_refuse = fn

    def refusals(self) -> dict[str, int]:
        return self._control.refusals()

    @property
    def bound_port(self) -> int | None:
        return self._control.bound_port

    def communicators(self) -> dict[str, int]:
        with self._lock:
            return {"out": sum(1 for c in self._out.values() if c.broken is None),
                    "in": sum(1 for c in self._in.values() if c.broken is None)}

    # ---------------------------------------------------------------- lifecycle
    def start(self, bind_host: str, port: int, handler: Handler) -> None:
        self._control.start(bind_host, port, lambda h, t: self._serve(h, t, handler))
        self._address = f"{bind_host}:{self._control.bound_port or port}"
        self._reaper = threading.Thread(target=self._reap_loop, name="xpyd-nccl-reap", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._control.close()
        with self._lock:
            comms = list(self._out.values()) + list(self._in.values())
            self._out.clear()
            self._in.clear()
        for c in comms:
            self._abort(c, "transport closed", log=False, wait_s=2.0)
        if self._reaper is not None:
            self._reaper.join(timeout=2.0)

    # ---------------------------------------------------------------- helpers
    def _abort(self, comm: _Comm, why: str, log: bool = True, wait_s: float | None = None) -> None:
        """End a communicator for good; its pending operations end with it. Waits (at most
        ``wait_s``, default the longest call) for a call in flight on it to end first."""
        with self._lock:
            if comm.broken is not None:
                return
            comm.broken = why
            if self._out.get(comm.peer) is comm:
                del self._out[comm.peer]
            self._in.pop(comm.cid, None)
            comm.pending.clear()
            self.aborted += 1
        if log:
            logger.warning("nccl communicator %s with %s aborted: %s", comm.cid, comm.peer, why)
        if not comm.lock.acquire(timeout=self._max_wait_s + 1.0 if wait_s is None else wait_s):
            logger.warning("nccl communicator %s still in use: not aborted (left to process exit)", comm.cid)
            return
        try:
            self._lib.abort(comm.handle)
        except Exception as e:  # noqa: BLE001 - the communicator is gone either way
            logger.warning("nccl abort of %s failed: %s", comm.cid, e)
        finally:
            comm.lock.release()

    def _wait_ready(self, comm: _Comm, deadline: float) -> str | None:
        """Poll a communicator being created until ready; None, or why not."""
        while True:
            if comm.broken is not None:
                return comm.broken
            code = self._lib.status(comm.handle)
            if code == NCCL_SUCCESS:
                comm.ready = True
                return None
            if code != NCCL_IN_PROGRESS:
                return f"nccl error {code}: {self._lib.error_string(code)}"
            if time.monotonic() >= deadline or self._stop.is_set():
                return "communicator not ready before the deadline (peer gone or too slow)"
            time.sleep(_POLL_S)

    def _settle(self, comm: _Comm, deadline: float) -> str | None:
        """Wait until NCCL launched what was posted on a non-blocking communicator (status
        leaves in-progress: for a first send that is when the peer posted its receive);
        None, or why not."""
        while True:
            code = self._lib.status(comm.handle)
            if code == NCCL_SUCCESS:
                return None
            if code != NCCL_IN_PROGRESS:
                return f"nccl error {code}: {self._lib.error_string(code)}"
            if comm.broken is not None:
                return comm.broken
            if time.monotonic() >= deadline or self._stop.is_set():
                return "nccl did not launch the transfer before the deadline (peer gone or too slow)"
            time.sleep(_POLL_S)

    def _wait_event(self, comm: _Comm, event: Any, deadline: float) -> str | None:
        """Wait for launched stream work to finish; None, or why not (deadline, peer error)."""
        spins = 0
        while not event.query():
            spins += 1
            if spins % 64 == 0:  # an error on the communicator ends the wait early
                code = self._lib.status(comm.handle)
                if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                    return f"nccl error {code}: {self._lib.error_string(code)}"
            if comm.broken is not None:
                return comm.broken
            if time.monotonic() >= deadline or self._stop.is_set():
                return "transfer not finished before the deadline"
            time.sleep(_POLL_S if spins > 16 else 0)
        return None

    def _complete(self, comm: _Comm, deadline: float) -> str | None:
        """Wait until what was posted has launched, then until the stream ran it."""
        why = self._settle(comm, deadline)
        if why is None:
            why = self._wait_event(comm, comm.stream.record_event(), deadline)
        return why

    def _on_our_device(self) -> Any:
        """NCCL attaches a new communicator to the calling thread's current CUDA device:
        make that ours (a worker on cuda:1 whose threads default to cuda:0)."""
        return torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext()

    def _after_current_stream(self, stream: Any) -> None:
        """Order the communicator's stream after work the calling thread enqueued (the
        tensors it passes may still be being written on its current stream)."""
        if self._device.type == "cuda":
            stream.wait_stream(torch.cuda.current_stream(self._device))

    def _post(self, comm: _Comm, tensors: Sequence[torch.Tensor], send: bool) -> bool:
        """Post sends (or receives) of whole tensors as one NCCL group; False if there was
        nothing to move. Does not wait: with a non-blocking communicator the group may
        finish launching only once the peer posted its side."""
        todo = [t for t in tensors if t.numel() > 0]
        if not todo:
            return False
        op = self._lib.send if send else self._lib.recv
        self._lib.group_start()
        try:
            for t in todo:
                op(comm.handle, _flat_bytes(t), comm.other, comm.stream)
        finally:
            self._lib.group_end()
        return True

    def _on_device(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors must be torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _DTYPES.values():
                raise TypeError(f"unsupported dtype {t.dtype}")
            if t.device != self._device:
                t = t.to(self._device)
            out.append(t if t.is_contiguous() else t.contiguous())
        return out

    # ---------------------------------------------------------------- client
    def _comm_for(self, peer: str, deadline: float) -> _Comm | None:
        """The ready communicator we created with ``peer``; made now if there is none.
        None when the peer does not do NCCL (its tensors then go inline)."""
        with self._lock:
            c = self._out.get(peer)
            if c is not None and c.ready:
                return c
            refused_at = self._no_nccl.get(peer)
            if refused_at is not None and time.monotonic() - refused_at < _NO_NCCL_RETRY_S:
                return None
            creating = self._creating.setdefault(peer, threading.Lock())
        if not creating.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransportError(f"nccl set-up with {peer} still running at the deadline")
        try:
            with self._lock:
                c = self._out.get(peer)
            if c is not None and c.ready:
                return c
            return self._create(peer, min(deadline, time.monotonic() + self._init_timeout_s))
        finally:
            creating.release()

    def _create(self, peer: str, deadline: float) -> _Comm | None:
        try:
            uid = self._lib.unique_id()
        except Exception as e:  # noqa: BLE001 - see below
            raise TransportError(f"nccl unique id: {type(e).__name__}: {e}") from e
        cid = f"{self._id}-{next(self._cids)}"
        reply, _ = self._control.call(
            peer, {"op": HELLO_OP, "cid": cid, "uid": uid, "from": self._address},
            timeout_s=max(0.05, deadline - time.monotonic()))
        if not reply.get("ok"):
            if reply.get("no_nccl") or reply.get("unknown_op"):
                with self._lock:
                    self._no_nccl[peer] = time.monotonic()
                logger.warning("kv peer %s does not do nccl (%s): its tensors go over tcp via host memory",
                               peer, reply.get("error"))
                return None
            raise TransportError(f"nccl set-up refused by {peer}: {reply.get('error')}")
        try:
            with self._on_our_device():  # NCCL binds a communicator to the current device
                handle = self._lib.init_rank(2, uid, 0, self._config)
            comm = _Comm(cid, peer, 0, handle, self._lib.new_stream(self._device))
        except Exception as e:  # noqa: BLE001 - a library failure is this call's failure, not a crash
            raise TransportError(f"nccl set-up with {peer} failed here: {type(e).__name__}: {e}") from e
        why = self._wait_ready(comm, deadline)
        if why is not None:
            self._abort(comm, f"set-up failed: {why}")
            raise TransportError(f"nccl set-up with {peer} failed: {why}")
        with self._lock:
            self._out[peer] = comm
            self._no_nccl.pop(peer, None)
        logger.info("nccl communicator %s with %s ready in %.0f ms (lib=%s channels=%s)", cid, peer,
                    (time.monotonic() - comm.created) * 1e3, self._lib.name, self._config.num_channels or "auto")
        return comm

    def call(self, peer: str, header: dict, tensors: Sequence[torch.Tensor] = (),
             timeout_s: float = 5.0) -> tuple[dict, list[torch.Tensor]]:
        deadline = time.monotonic() + timeout_s
        if not isinstance(header, dict):
            raise TypeError(f"header must be a dict, got {type(header).__name__}")
        for key in (NCCL_KEY, REPLY_KEY, CONSUMED_KEY, RESET_KEY):
            if key in header:
                raise ValueError(f"header key {key!r} is reserved for the transport")
        try:
            sends = self._on_device(tensors)
        except torch.OutOfMemoryError as e:
            raise TransportError(f"no device memory to stage a send to {peer}: {e}") from e
        for _ in range(2):  # a peer that lost our communicator (restart) gets one new one
            comm = self._comm_for(peer, deadline)
            if comm is None:
                return self._control.call(peer, header, tensors, max(0.0, deadline - time.monotonic()))
            result = self._call_on(comm, header, sends, deadline)
            if result is not None:
                return result
        raise TransportError(f"nccl communicator with {peer} reset twice")

    def _call_on(self, comm: _Comm, header: dict, sends: list[torch.Tensor],
                 deadline: float) -> tuple[dict, list[torch.Tensor]] | None:
        """One call over a ready communicator; None if the peer did not know it (retry)."""
        if not comm.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransportError(f"timeout waiting for the nccl communicator with {comm.peer}")
        try:
            if comm.broken is not None:
                return None
            code = self._lib.status(comm.handle)
            if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):  # the peer went away since the last call
                self._abort(comm, f"found broken: nccl error {code}: {self._lib.error_string(code)}")
                return None
            posted = False
            if sends:
                self._after_current_stream(comm.stream)
                try:
                    # Not waited for here: the peer posts its receives when our header arrives.
                    posted = self._post(comm, sends, True)
                except RuntimeError as e:
                    self._abort(comm, f"send not posted: {e}")
                    raise TransportError(f"nccl send to {comm.peer}: {e}") from None
            wire = dict(header)
            wire[NCCL_KEY] = {"cid": comm.cid, "metas": _metas(sends),
                              "budget_ms": max(1, int((deadline - time.monotonic()) * 1000))}
            try:
                reply, inline = self._control.call(comm.peer, wire, (), max(0.0, deadline - time.monotonic()))
            except TransportError as e:
                if posted:  # our sends may be left unmatched on the stream
                    self._abort(comm, f"control call failed: {e}")
                raise
            if reply.pop(RESET_KEY, False):
                self._abort(comm, f"peer does not know it: {reply.get('error')}")
                return None
            consumed = bool(reply.pop(CONSUMED_KEY, False))
            if posted and not consumed:
                self._abort(comm, f"peer took no tensors: {reply.get('error')}")
                return reply, inline
            if posted:
                why = self._complete(comm, deadline)
                if why is not None:
                    self._abort(comm, why)
                    raise TransportError(f"nccl send to {comm.peer}: {why}")
            metas = reply.pop(REPLY_KEY, None)
            if metas is None:
                return reply, inline
            return reply, self._receive(comm, metas, deadline)
        finally:
            comm.lock.release()

    def _receive(self, comm: _Comm, metas: Any, deadline: float) -> list[torch.Tensor]:
        try:
            specs = _checked_metas(metas, self._max_bytes, self._max_frames)
            out = [torch.empty(shape, dtype=dt, device=self._device) for dt, shape in specs]
            posted = self._post(comm, out, False)
        except (ValueError, RuntimeError) as e:  # caps, allocation failures, nccl errors
            self._abort(comm, f"reply tensors not received: {e}")
            raise TransportError(f"nccl reply from {comm.peer}: {e}") from None
        why = self._complete(comm, deadline) if posted else None
        if why is not None:
            self._abort(comm, why)
            raise TransportError(f"nccl receive from {comm.peer}: {why}")
        return out

    # ---------------------------------------------------------------- server
    def _serve(self, header: dict, inline: list[torch.Tensor], handler: Handler) -> tuple[dict, list[torch.Tensor]]:
        if header.get("op") == HELLO_OP:
            return self._hello(header), []
        req = header.pop(NCCL_KEY, None)
        for key in (REPLY_KEY, CONSUMED_KEY, RESET_KEY):
            header.pop(key, None)
        if req is None:
            return handler(header, inline)  # a peer without NCCL: tensors came inline
        if not isinstance(req, dict) or not isinstance(req.get("cid"), str):
            return {"ok": False, "error": "malformed nccl request"}, []
        with self._lock:
            comm = self._in.get(req["cid"])
        if comm is None:
            return {"ok": False, "error": f"unknown nccl communicator {req['cid']}", RESET_KEY: True}, []
        budget = req.get("budget_ms")
        budget_s = budget / 1000 if type(budget) is int and budget > 0 else self._max_wait_s
        deadline = time.monotonic() + min(budget_s, self._max_wait_s)
        with comm.lock:
            why = self._wait_ready(comm, deadline) if not comm.ready else None
            if why is not None:
                self._abort(comm, f"set-up failed: {why}")
                return {"ok": False, "error": f"nccl set-up failed: {why}", RESET_KEY: True}, []
            why = self._settle_replies(comm, deadline)
            if why is not None:
                self._abort(comm, f"earlier reply: {why}")
                return {"ok": False, "error": f"nccl: earlier reply not taken: {why}", RESET_KEY: True}, []
            try:
                specs = _checked_metas(req.get("metas", []), self._max_bytes, self._max_frames)
                tensors = [torch.empty(shape, dtype=dt, device=self._device) for dt, shape in specs]
                posted = self._post(comm, tensors, False)
            except (ValueError, RuntimeError) as e:  # caps, allocation failure, nccl error
                # The caller's sends stay unmatched: the communicator cannot be used again.
                self._abort(comm, f"refused a call's tensors: {e}")
                return {"ok": False, "error": f"nccl receive refused: {e}"}, []
            if posted:
                why = self._complete(comm, deadline)
                if why is not None:
                    self._abort(comm, why)
                    return {"ok": False, "error": f"nccl receive: {why}"}, []
            try:
                reply, out = handler(header, tensors)
                reply = dict(reply)
            except Exception as e:  # noqa: BLE001 - answered, as the tcp transport does
                logger.exception("nccl transport: handler failed")
                reply, out = {"ok": False, "error": f"handler error: {type(e).__name__}: {e}"}, []
            reply[CONSUMED_KEY] = True
            if out:
                try:
                    out = self._on_device(out)
                    self._after_current_stream(comm.stream)
                    # Launches once the caller, holding this reply, posts its receives.
                    if self._post(comm, out, True):
                        comm.unsettled = True
                except (TypeError, RuntimeError) as e:
                    self._abort(comm, f"reply send failed: {e}")
                    return {"ok": False, "error": f"nccl reply send failed: {e}", CONSUMED_KEY: True}, []
                comm.pending.append(_Pending(out, time.monotonic() + min(budget_s, self._max_wait_s)))
                reply[REPLY_KEY] = _metas(out)
            return reply, []

    def _hello(self, header: dict) -> dict:
        cid, uid, peer = header.get("cid"), header.get("uid"), header.get("from")
        if not isinstance(cid, str) or not isinstance(uid, bytes) or len(uid) != UNIQUE_ID_BYTES:
            return {"ok": False, "error": "malformed nccl hello"}
        if self._stop.is_set():
            return {"ok": False, "error": "closing"}
        try:
            with self._on_our_device():
                handle = self._lib.init_rank(2, uid, 1, self._config)
        except Exception as e:  # noqa: BLE001 - NCCL broken here: the caller falls back to tcp
            logger.warning("nccl init for %s failed: %s", peer, e)
            return {"ok": False, "error": f"nccl init failed here: {e}", "no_nccl": True}
        comm = _Comm(cid, str(peer), 1, handle, self._lib.new_stream(self._device))
        with self._lock:
            old = self._in.get(cid)
            self._in[cid] = comm
        if old is not None:
            self._abort(old, "replaced by a new hello")
        return {"ok": True}

    def _settle_replies(self, comm: _Comm, deadline: float) -> str | None:
        """Before the next operation on a communicator: the reply sends posted last time
        must have launched (NCCL takes nothing new on a non-blocking communicator before)."""
        if not comm.unsettled:
            return None
        why = self._settle(comm, deadline)
        if why is None:
            comm.unsettled = False
            event = comm.stream.record_event()
            for p in comm.pending:
                if p.event is None:
                    p.event = event
        return why

    def _reap_loop(self) -> None:
        """Abort communicators whose reply tensors were never taken (the caller gave up)
        and let go of reply tensors the stream has sent."""
        while not self._stop.wait(_REAP_S):
            with self._lock:
                comms = list(self._in.values())
            for c in comms:
                if not c.lock.acquire(blocking=False):
                    continue  # serving a call: its own deadline covers it
                try:
                    now = time.monotonic()
                    why = self._settle_replies(c, now) if c.unsettled else None  # a poll, no wait
                    if why is not None and "deadline" not in why:
                        late = why
                    else:
                        c.pending[:] = [p for p in c.pending if p.event is None or not p.event.query()]
                        late = "reply tensors not taken before the deadline" \
                            if any(p.until < now for p in c.pending) else None
                finally:
                    c.lock.release()
                if late:
                    self._abort(c, late)

"""NCCL transport: control messages over the tcp transport, tensors over NCCL, device to device.

Every call still goes over the engine's ZMQ control socket (``TcpTransport``: same
authentication, size caps and refusal counters); only the tensors move over NCCL, straight
between the two GPUs' memory. Per peer pair there is one communicator per direction of
initiation (two ranks; the caller that created it is rank 0), on its own stream.

Set-up runs on a thread of its own with its own budget (``init_timeout_s``), never a
call's: a cold NCCL init can outlast the 1-2 s of a probe or a hello. First ``_nccl_hello``
(our NCCL version; the peer says whether it will), and only if the peer agreed a unique id
(each ``ncclGetUniqueId`` starts a bootstrap thread and socket that live until both ranks
joined) goes to it in ``_nccl_init``; both ranks then initialise non-blocking. A call
finding no ready communicator waits for a set-up in progress at most half of its own time,
then carries its tensors inline over the control socket (through host memory): slower,
never wrong.

Degrade, never break: when NCCL cannot be set up with a peer (init refused or failed, not
ready in time, another NCCL version, none there) or ``fallback_after`` NCCL transfers in a
row failed, that peer's calls go inline (the host-staged tcp path) - one WARN naming the
error, ``on_fallback(reason)`` for the metric, ``fallbacks()`` for operators - and NCCL is
tried again after ``retry_s`` (doubling to ``_RETRY_MAX_S`` while it keeps failing). A call
whose NCCL part failed before the peer's handler saw it (a send not posted, a receive the
peer could not complete) is resent inline within its deadline, so its KV still arrives;
reply tensors the server could not send over NCCL come inline in its reply.

A call with tensors: the caller enqueues its sends on the communicator's stream, then sends
the header with the tensors' shapes over the control socket; the server allocates (on the
communicator's stream), enqueues the matching receives, waits for them (bounded by the
caller's remaining time) on a worker thread - the control socket's thread keeps serving
pings and hellos meanwhile (the reply is deferred) - runs the handler and answers. Reply
tensors go back the same way, the other direction. Calls on one communicator are
serialised (NCCL matches sends and receives in order).

Nothing waits unbounded: set-up has ``init_timeout_s``, a transfer has the call's deadline,
reply sends the caller never took are reaped, and so are incoming communicators whose
set-up never finished, that sat idle for ``idle_timeout_s``, or that their caller replaced
with a new one. A communicator that missed a deadline, whose peer vanished or which saw any
error is aborted (``ncclCommAbort``) on a thread of its own - NCCL asks all ranks to abort
together, and one-sided aborts are reported to hang (NVIDIA/nccl #863, #992, #1777) - which
holds the memory NCCL may still touch until the abort returned. An abort that does not
return within ``abort_timeout_s`` quarantines that peer (tcp only, until restart). The
caller tells the peer when it aborted (``_nccl_bye``): over P2P/SHM the peer would never
learn it otherwise.

Where this differs from the removed vLLM ``p2p_nccl_engine`` (one communicator per peer,
blocking init inside the first send, receives on a listener thread): init is non-blocking
and polled against a deadline, and every wait (init, launch, completion) has one, so a dead
peer costs a timeout, never a hung thread.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import Deferred, Fallback, Handler, Transport, TransportError
from .nccl_api import NCCL_IN_PROGRESS, NCCL_SUCCESS, UNIQUE_ID_BYTES, CommConfig, NcclLibrary
from .tcp import TcpTransport

__all__ = ["NcclTransport"]

logger = logging.getLogger(__name__)

NCCL_KEY = "_nccl"  # request: {"cid", "metas", "budget_ms"}
REPLY_KEY = "_nccl_reply"  # reply: metas of the tensors coming back over NCCL
CONSUMED_KEY = "_nccl_consumed"  # reply: the server received every tensor the call sent
RESET_KEY = "_nccl_reset"  # reply: the server does not know (or dropped) that communicator
HELLO_OP = "_nccl_hello"  # may we set up? our NCCL version; makes no NCCL resource
INIT_OP = "_nccl_init"  # the unique id: join as rank 1
BYE_OP = "_nccl_bye"  # the caller aborted its side: abort yours
# reply: NCCL failed before the handler saw the call (the caller may resend it inline)
FAILED_KEY = "_nccl_failed"
_POLL_S = 0.0005  # between status/event polls: completion is usually a few ms away
_REAP_S = 0.25
# NCCL with a peer on the host path is tried again after retry_s, doubling while it keeps
# failing, up to this.
_RETRY_MAX_S = 600.0
# A set-up whose control calls found the peer unreachable: again soon (the calls fail anyway).
_UNREACHABLE_RETRY_S = 1.0
_BYE_TIMEOUT_S = 1.0
# Server: threads waiting for receives; calls beyond this many in progress are refused.
_SERVE_THREADS = 16
_MAX_SERVING = 64
# Aborts that did not return: after this many, no NCCL at all (each holds a thread, and
# NCCL's state is not to be trusted any more).
_MAX_HUNG_ABORTS = 2
# Failed set-ups in a row with one peer before NCCL with it is off until restart (each may
# leave NCCL's bootstrap thread and socket for its unique id behind).
_MAX_FAILED_SETUPS = 4
# ... and failed set-ups in all (any peers) before NCCL is off here until restart.
_MAX_FAILED_SETUPS_TOTAL = 16

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


@dataclass(eq=False, slots=True)
class _Comm:
    cid: str
    peer: str  # outgoing: the peer's address; incoming: the caller (address, else its id)
    rank: int  # 0: we created it (the caller side), 1: the peer did
    handle: Any
    stream: Any
    caller: str = ""  # incoming: caller and the address it called; a new set-up from it replaces this one
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    ready: bool = False
    broken: str | None = None  # why it was given up: no NCCL call may start on it after this
    # Set, under ``lock``, just before ncclCommAbort: the handle is gone from then on. Every
    # NCCL call on the handle is made holding ``lock`` after checking ``broken``.
    freed: bool = False
    # One call at a time; held around ncclCommAbort, which must not run while another
    # thread is inside an NCCL call on the same communicator. Re-entrant: calls abort.
    lock: threading.RLock = field(default_factory=threading.RLock)
    # What the call in progress posted: NCCL may read or write it until the call finished or
    # the abort returned, so it is held here until then (the abort runs on another thread).
    inflight: list[torch.Tensor] = field(default_factory=list)
    # Reply sends the server posted and their deadline; their tensors stay alive until the
    # stream ran them. ``unsettled``: NCCL may still be launching them (the caller posts its
    # receives only once it has the reply), so no event was recorded for them yet.
    pending: list[_Pending] = field(default_factory=list)
    unsettled: bool = False

    @property
    def other(self) -> int:
        return 1 - self.rank


@dataclass(eq=False, slots=True)
class _AbortJob:
    comm: _Comm
    started: float
    bye: bool  # tell the peer (we created the communicator and the peer did not end it)
    done: threading.Event = field(default_factory=threading.Event)
    hung: bool = False  # reported as not returning within abort_timeout_s


@dataclass(slots=True)
class _PeerState:
    """A peer we call: the set-up in progress, and whether (and until when) its calls go
    over the host path instead of NCCL."""

    setup: threading.Event | None = None  # set when the running set-up ended; None: none runs
    inline_until: float = 0.0  # monotonic: until then no NCCL with it
    fails: int = 0  # NCCL transfers failed in a row
    fallback: Fallback | None = None  # why its calls go over the host path; None: NCCL
    error: str = ""  # the NCCL error that sent it there
    backoffs: int = 0  # fallbacks in a row: the next wait doubles
    failed_setups: int = 0  # set-ups that failed since the last one that worked


class _NoNccl(Exception):
    """The peer will not do NCCL with us (none there, another version, quarantined)."""

    def __init__(self, reason: Fallback, why: str) -> None:
        super().__init__(why)
        self.reason: Fallback = reason


class _NcclFailed(TransportError):
    """NCCL failed during a call. ``unsent``: before the peer's handler saw the call, so it
    may be resent inline; else the call fails (the handler may have run)."""

    def __init__(self, why: str, unsent: bool) -> None:
        super().__init__(why)
        self.unsent = unsent


class _Unreachable(Exception):
    """A set-up's control call failed: the peer is down or slow (its calls fail too)."""


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
        init_timeout_s: bound on creating one communicator (its own budget, not a call's).
        max_wait_s: bound on the server waiting for a call's tensors, whatever the caller asked.
        abort_timeout_s: an abort not returned by then quarantines its peer.
        idle_timeout_s: an incoming communicator unused this long is ended (its caller sets
            up a new one when it needs it).
        fallback_after: NCCL transfers failed in a row with a peer before its calls go over
            the host-staged tcp path (a failed set-up sends them there at once). 2: a GET
            whose reply tensors fail is retried twice by the consumer, so its last try goes
            inline (a failed send is resent inline at once anyway).
        retry_s: how long a peer stays on the host path before NCCL is tried again (doubling
            while it keeps failing, up to 10 minutes).
        control: the control transport (its auth and caps apply to every call);
            ``control_kwargs`` build one when not given.
    """

    name = "nccl"
    device_native = True

    def __init__(self, lib: NcclLibrary, device: torch.device, *, num_channels: int | None = None,
                 init_timeout_s: float = 10.0, max_wait_s: float = 30.0, abort_timeout_s: float = 10.0,
                 idle_timeout_s: float = 600.0, fallback_after: int = 2, retry_s: float = 30.0,
                 control: TcpTransport | None = None, **control_kwargs: Any) -> None:
        self._lib = lib
        self._device = torch.device(device)
        self._config = CommConfig(blocking=False, num_channels=num_channels)
        self._init_timeout_s = init_timeout_s
        self._max_wait_s = max_wait_s
        self._abort_timeout_s = abort_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._fallback_after = max(1, fallback_after)
        self._retry_s = retry_s
        self.on_fallback: Callable[[str], None] | None = None
        self._control = control or TcpTransport(**control_kwargs)
        self._max_bytes: int | None = control_kwargs.get("max_msg_bytes")
        self._max_frames: int | None = control_kwargs.get("max_frames")
        self._id = uuid.uuid4().hex[:12]
        self._version = str(lib.version())
        self._cids = itertools.count(1)
        self._lock = threading.Lock()  # guards the tables below
        self._out: dict[str, _Comm] = {}  # peer address -> ready communicator we created
        self._in: dict[str, _Comm] = {}  # cid -> communicator a peer created
        self._peers: dict[str, _PeerState] = {}  # peer address -> set-up state
        self._aborting: list[_AbortJob] = []  # running, and hung ones (they keep their memory)
        self._quarantined: dict[str, str] = {}  # peer -> why: no NCCL with it until restart
        self._failed_setups_total = 0  # with any peer, since start (see _MAX_FAILED_SETUPS_TOTAL)
        self._serving = 0  # deferred NCCL calls in progress on the server side
        # Handlers run one at a time, as on the tcp transport (the server thread and the
        # workers that finish NCCL calls both run them).
        self._handler_lock = threading.Lock()
        self._workers = ThreadPoolExecutor(_SERVE_THREADS, thread_name_prefix="xpyd-nccl-serve")
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

    def fallbacks(self) -> dict[str, dict[str, Any]]:
        """Peers whose calls go over the host-staged tcp path now: reason, the NCCL error,
        and in how many seconds NCCL is tried again."""
        now = time.monotonic()
        with self._lock:
            return {peer: {"reason": st.fallback, "error": st.error,
                           "retry_in_s": round(max(0.0, st.inline_until - now), 1)}
                    for peer, st in self._peers.items() if st.fallback is not None}

    def quarantined(self) -> dict[str, str]:
        """Peers this transport does no NCCL with any more (an abort with them hung), and why."""
        with self._lock:
            return dict(self._quarantined)

    # ---------------------------------------------------------------- lifecycle
    def start(self, bind_host: str, port: int, handler: Handler) -> None:
        self._control.start(bind_host, port, lambda h, t: self._serve(h, t, handler))
        self._address = f"{bind_host}:{self._control.bound_port or port}"
        self._ensure_reaper()

    def _ensure_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None or self._stop.is_set():
                return
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
            self._abort(c, "transport closed", log=False, bye=False)
        deadline = time.monotonic() + 2.0
        with self._lock:
            jobs = list(self._aborting)
        for job in jobs:
            job.done.wait(max(0.0, deadline - time.monotonic()))
        self._workers.shutdown(wait=False, cancel_futures=True)
        if self._reaper is not None:
            self._reaper.join(timeout=2.0)

    # ---------------------------------------------------------------- degrade
    def _fall_back(self, peer: str, reason: Fallback, error: str) -> None:
        """``peer``'s calls go over the host path for a while: said once (WARN, metric) when
        it leaves NCCL, quietly again while retries keep failing."""
        with self._lock:
            st = self._peers.setdefault(peer, _PeerState())
            first = st.fallback is None
            st.backoffs += 1
            wait = min(self._retry_s * 2 ** (st.backoffs - 1), _RETRY_MAX_S)
            st.fallback, st.error, st.fails = reason, error, 0
            st.inline_until = time.monotonic() + wait
            hook = self.on_fallback
        if not first:
            logger.info("kv peer %s: NCCL still failing (%s: %s): host path for %.0fs more", peer, reason, error, wait)
            return
        logger.warning("kv peer %s: KV leaves NCCL for the host-staged tcp path (%s: %s); NCCL is tried again "
                       "in %.0fs", peer, reason, error, wait)
        if hook is not None:
            try:
                hook(reason)
            except Exception:  # noqa: BLE001 - counting must never break a call
                logger.exception("nccl transport: fallback hook failed")

    def _nccl_failed(self, peer: str, error: str) -> None:
        with self._lock:
            st = self._peers.setdefault(peer, _PeerState())
            st.fails += 1
            n = st.fails
        if n >= self._fallback_after:
            self._fall_back(peer, "transfers", f"{n} transfers in a row failed, the last: {error}")

    def _nccl_ok(self, peer: str) -> None:
        st = self._peers.get(peer)
        if st is None or (st.fails == 0 and st.backoffs == 0):  # the common case, without the lock
            return
        with self._lock:
            was, st.fallback, st.error, st.fails, st.backoffs = st.fallback, None, "", 0, 0
        if was is not None:
            logger.info("kv peer %s: KV back on NCCL (it had left for %s)", peer, was)

    # ---------------------------------------------------------------- abort
    def _abort(self, comm: _Comm, why: str, log: bool = True, bye: bool | None = None) -> None:
        """Give a communicator up for good; returns at once. ncclCommAbort runs on a thread
        of its own (it can hang, and must not stop the caller or the server), which keeps
        the memory NCCL may still touch until it returned. ``bye``: tell the peer (by
        default when we created it)."""
        with self._lock:
            if comm.broken is not None:
                return
            comm.broken = why
            if self._out.get(comm.peer) is comm:
                del self._out[comm.peer]
            if self._in.get(comm.cid) is comm:
                del self._in[comm.cid]
            self.aborted += 1
            job = _AbortJob(comm, time.monotonic(), bye=(comm.rank == 0 if bye is None else bye)
                            and not self._stop.is_set())
            self._aborting.append(job)
        if log:
            logger.warning("nccl communicator %s with %s aborted: %s", comm.cid, comm.peer, why)
        threading.Thread(target=self._run_abort, args=(job,), name="xpyd-nccl-abort", daemon=True).start()
        self._ensure_reaper()  # watches the abort's deadline (a caller-only transport too)

    def _run_abort(self, job: _AbortJob) -> None:
        comm = job.comm
        # Whoever holds the lock sees ``broken`` and lets go within a poll interval (or is
        # stuck inside NCCL: then this abort is reported hung by the reaper).
        if not comm.lock.acquire(timeout=self._abort_timeout_s):
            logger.error("nccl communicator %s still in use after %.1fs: not aborted", comm.cid, self._abort_timeout_s)
            return
        try:
            comm.freed = True
            try:
                self._lib.abort(comm.handle)
            except Exception as e:  # noqa: BLE001 - the communicator is gone either way
                logger.warning("nccl abort of %s failed: %s", comm.cid, e)
        finally:
            comm.lock.release()
        # NCCL let go of them now. A CUDA caching allocator reuses the memory only once the
        # communicator's stream ran past this point (recorded when they were posted).
        comm.inflight.clear()
        comm.pending.clear()
        job.done.set()
        with self._lock:
            if job in self._aborting:
                self._aborting.remove(job)
        if job.bye:
            self._send_bye(comm.peer, comm.cid)

    def _check_aborts(self, now: float) -> None:
        """Aborts that did not return in time: quarantine their peer (tcp only from now on)."""
        with self._lock:
            late = [j for j in self._aborting if not j.hung and not j.done.is_set()
                    and now - j.started > self._abort_timeout_s]
            for j in late:
                j.hung = True
                self._quarantined[j.comm.peer] = (f"ncclCommAbort of communicator {j.comm.cid} did not return within "
                                                  f"{self._abort_timeout_s:g}s")
            hung = sum(j.hung for j in self._aborting)
        for j in late:
            logger.error("nccl abort of communicator %s with %s did not return within %.1fs: no NCCL with that "
                         "peer until restart (its tensors go over tcp via host memory); the memory NCCL may "
                         "still use is kept%s", j.comm.cid, j.comm.peer, self._abort_timeout_s,
                         "; too many hung aborts: no NCCL with any peer" if hung >= _MAX_HUNG_ABORTS else "")
            self._fall_back(j.comm.peer, "abort_hung", f"ncclCommAbort of {j.comm.cid} hung")

    def _nccl_off(self, peer: str) -> str | None:
        """Why no NCCL with ``peer`` at all now (caller holds self._lock), or None."""
        if self._stop.is_set():
            return "closing"
        why = self._quarantined.get(peer)
        if why is None and sum(j.hung for j in self._aborting) >= _MAX_HUNG_ABORTS:
            why = f"{_MAX_HUNG_ABORTS} nccl aborts hung here"
        if why is None and self._failed_setups_total >= _MAX_FAILED_SETUPS_TOTAL:
            why = f"{self._failed_setups_total} nccl set-ups failed here"
        return why

    def _send_bye(self, peer: str, cid: str) -> None:
        """Best effort: the peer aborts its side too (over P2P/SHM nothing else tells it)."""
        if self._stop.is_set() or peer == "?":
            return
        try:
            self._control.call(peer, {"op": BYE_OP, "cid": cid, "id": self._id, "from": self._address},
                               timeout_s=_BYE_TIMEOUT_S)
        except TransportError:
            pass  # its reaper ends it: set-up or idle timeout, or a new set-up from us

    # ---------------------------------------------------------------- waits
    def _status(self, comm: _Comm) -> int | None:
        """ncclCommGetAsyncError, or None once the communicator was given up. The caller
        holds ``comm.lock``: the handle cannot be freed under it."""
        if comm.broken is not None or comm.freed:
            return None
        return self._lib.status(comm.handle)

    def _wait_ready(self, comm: _Comm, deadline: float) -> str | None:
        """Poll a communicator being created until ready; None, or why not."""
        while True:  # bounded by the deadline
            code = self._status(comm)
            if code is None:
                return comm.broken or "aborted"
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
        while True:  # bounded by the deadline
            code = self._status(comm)
            if code is None:
                return comm.broken or "aborted"
            if code == NCCL_SUCCESS:
                return None
            if code != NCCL_IN_PROGRESS:
                return f"nccl error {code}: {self._lib.error_string(code)}"
            if time.monotonic() >= deadline or self._stop.is_set():
                return "nccl did not launch the transfer before the deadline (peer gone or too slow)"
            time.sleep(_POLL_S)

    def _wait_event(self, comm: _Comm, event: Any, deadline: float) -> str | None:
        """Wait for launched stream work to finish; None, or why not (deadline, peer error)."""
        spins = 0
        while not event.query():  # bounded by the deadline
            spins += 1
            if spins % 64 == 0:  # an error on the communicator ends the wait early
                code = self._status(comm)
                if code is None:
                    return comm.broken or "aborted"
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

    # ---------------------------------------------------------------- devices and streams
    def _on_our_device(self) -> Any:
        """NCCL attaches a new communicator to the calling thread's current CUDA device:
        make that ours (a worker on cuda:1 whose threads default to cuda:0)."""
        return torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext()

    def _after_current_stream(self, stream: Any) -> None:
        """Order the communicator's stream after work the calling thread enqueued (the
        tensors it passes may still be being written on its current stream)."""
        if self._device.type == "cuda":
            stream.wait_stream(torch.cuda.current_stream(self._device))

    def _alloc(self, comm: _Comm, specs: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor]:
        """Receive buffers, allocated on the stream NCCL writes them on: the caching
        allocator then never hands their memory to that stream's later work early. (Their
        readers on other streams record those: the consumer does, after its copy.)"""
        ctx = torch.cuda.stream(comm.stream) if self._device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            return [torch.empty(shape, dtype=dt, device=self._device) for dt, shape in specs]

    def _post(self, comm: _Comm, tensors: Sequence[torch.Tensor], send: bool) -> bool:
        """Post sends (or receives) of whole tensors as one NCCL group; False if there was
        nothing to move. Does not wait: with a non-blocking communicator the group may
        finish launching only once the peer posted its side. The caller holds comm.lock
        and keeps ``tensors`` (``inflight`` or ``pending``) until done or aborted."""
        todo = [t for t in tensors if t.numel() > 0]
        if not todo:
            return False
        if comm.broken is not None:
            raise RuntimeError(f"communicator aborted: {comm.broken}")
        for t in todo:
            if t.is_cuda:  # allocated on another stream (the caller's): used on this one too
                t.record_stream(comm.stream)
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
        """The ready communicator we created with ``peer``, or None: the call then carries
        its tensors inline. Starts a set-up (its own thread and budget) when none runs and
        none failed lately, and waits for one in progress at most half the call's time."""
        with self._lock:
            c = self._out.get(peer)
            if c is not None and c.ready and c.broken is None:
                return c
            st = self._peers.setdefault(peer, _PeerState())
            if time.monotonic() < st.inline_until or self._nccl_off(peer) is not None:
                return None
            done = st.setup
            if done is None:
                done = st.setup = threading.Event()
                threading.Thread(target=self._set_up, args=(peer, st, done), name="xpyd-nccl-setup",
                                 daemon=True).start()
        done.wait(max(0.0, (deadline - time.monotonic()) / 2))
        with self._lock:
            c = self._out.get(peer)
            return c if c is not None and c.ready and c.broken is None else None

    def _set_up(self, peer: str, st: _PeerState, done: threading.Event) -> None:
        """A set-up thread: one communicator with ``peer`` within ``init_timeout_s``."""
        t0 = time.monotonic()
        try:
            comm = self._create(peer, t0 + self._init_timeout_s)
            with self._lock:
                closing = self._stop.is_set()
                if not closing:
                    self._out[peer] = comm
                    st.failed_setups = 0
            if closing:
                self._abort(comm, "closing", log=False, bye=False)
            else:
                logger.info("nccl communicator %s with %s ready in %.0f ms (lib=%s %s, channels=%s)", comm.cid, peer,
                            (time.monotonic() - t0) * 1e3, self._lib.name, self._version,
                            self._config.num_channels or "auto")
        except _NoNccl as e:
            if e.reason == "setup":  # its NCCL init failed: our unique id may be left waiting
                self._count_failed_setup(peer, st, str(e))
            self._fall_back(peer, e.reason, str(e))
        except _Unreachable as e:  # its calls fail too: not NCCL's fault, no fallback
            logger.info("nccl set-up with %s: peer unreachable (%s)", peer, e)
            with self._lock:
                st.inline_until = max(st.inline_until, time.monotonic() + _UNREACHABLE_RETRY_S)
        except Exception as e:  # noqa: BLE001 - NcclError, TransportError, anything: calls go inline meanwhile
            error = str(e) if isinstance(e, TransportError) else f"{type(e).__name__}: {e}"
            self._count_failed_setup(peer, st, error)
            self._fall_back(peer, "setup", error)
        finally:
            with self._lock:
                st.setup = None
            done.set()

    def _count_failed_setup(self, peer: str, st: _PeerState, error: str) -> None:
        """A set-up that fails after the unique id was made leaves that id's bootstrap thread
        and socket in NCCL, waiting for a rank that never joins (no call frees them): after
        _MAX_FAILED_SETUPS in a row, no NCCL with this peer until restart, so they stay few."""
        with self._lock:
            st.failed_setups += 1
            self._failed_setups_total += 1
            given_up = st.failed_setups >= _MAX_FAILED_SETUPS and peer not in self._quarantined
            if given_up:
                self._quarantined[peer] = (f"{st.failed_setups} NCCL set-ups failed in a row, the last: {error} "
                                           "(each may leave an NCCL bootstrap thread behind)")
        if given_up:
            logger.error("kv peer %s: %d NCCL set-ups failed in a row; no NCCL with it until restart (tcp via "
                         "host memory meanwhile): %s", peer, _MAX_FAILED_SETUPS, error)

    def _create(self, peer: str, deadline: float) -> _Comm:
        """Set up one communicator with ``peer`` (we are rank 0). Raises _NoNccl when the
        peer will not, _Unreachable when it does not answer, else TransportError."""

        def left() -> float:
            return max(0.05, deadline - time.monotonic())

        try:
            reply, _ = self._control.call(
                peer, {"op": HELLO_OP, "version": self._version, "from": self._address, "id": self._id},
                timeout_s=left())
        except TransportError as e:
            raise _Unreachable(str(e)) from None
        if not reply.get("ok") and reply.get("error") == "closing":
            raise _Unreachable(f"{peer} is closing")
        if not reply.get("ok"):
            if reply.get("no_nccl") or reply.get("unknown_op"):
                reason = reply.get("reason")
                raise _NoNccl(reason if reason in ("version", "abort_hung", "setup") else "peer_no_nccl",
                              f"{peer}: {reply.get('error')}")
            raise TransportError(f"nccl set-up refused by {peer}: {reply.get('error')}")
        if reply.get("version") != self._version:
            # NCCL's init compares the full version of every rank and fails: do not try.
            raise _NoNccl("version", f"NCCL {self._version} here, {reply.get('version')} at {peer} (NCCL needs the "
                                     "same version on both sides)")
        # Only now a unique id: each starts a bootstrap thread and socket that live until
        # both ranks joined, so none is made for a peer that would not join.
        try:
            uid = self._lib.unique_id()
        except Exception as e:  # noqa: BLE001 - a library failure is a failed set-up
            raise TransportError(f"nccl unique id: {type(e).__name__}: {e}") from e
        cid = f"{self._id}-{next(self._cids)}"
        try:
            reply, _ = self._control.call(
                peer, {"op": INIT_OP, "cid": cid, "uid": uid, "from": self._address, "id": self._id, "to": peer},
                timeout_s=left())
        except TransportError as e:
            self._send_bye(peer, cid)  # it may have joined late
            raise _Unreachable(str(e)) from None
        if not reply.get("ok"):
            if reply.get("no_nccl"):
                reason = reply.get("reason")
                raise _NoNccl(reason if reason in ("abort_hung",) else "setup", f"{peer}: {reply.get('error')}")
            raise TransportError(f"nccl set-up refused by {peer}: {reply.get('error')}")
        try:
            with self._on_our_device():  # NCCL binds a communicator to the current device
                handle = self._lib.init_rank(2, uid, 0, self._config)
            comm = _Comm(cid, peer, 0, handle, self._lib.new_stream(self._device))
        except Exception as e:  # noqa: BLE001 - a library failure is a failed set-up, not a crash
            self._send_bye(peer, cid)  # its side was made
            raise TransportError(f"nccl set-up with {peer} failed here: {type(e).__name__}: {e}") from e
        with comm.lock:
            why = self._wait_ready(comm, deadline)
        if why is not None:
            self._abort(comm, f"set-up failed: {why}")  # its thread tells the peer
            raise TransportError(f"nccl set-up with {peer} failed: {why}")
        return comm

    def call(self, peer: str, header: dict, tensors: Sequence[torch.Tensor] = (),
             timeout_s: float = 5.0) -> tuple[dict, list[torch.Tensor]]:
        deadline = time.monotonic() + timeout_s
        if not isinstance(header, dict):
            raise TypeError(f"header must be a dict, got {type(header).__name__}")
        for key in (NCCL_KEY, REPLY_KEY, CONSUMED_KEY, RESET_KEY, FAILED_KEY):
            if key in header:
                raise ValueError(f"header key {key!r} is reserved for the transport")
        try:
            sends = self._on_device(tensors)
        except torch.OutOfMemoryError as e:
            raise TransportError(f"no device memory to stage a send to {peer}: {e}") from e
        for _ in range(2):  # a peer that lost our communicator (restart) gets one new one
            comm = self._comm_for(peer, deadline)
            if comm is None:  # no NCCL with it (now)
                break
            try:
                result = self._call_on(comm, header, sends, deadline)
            except _NcclFailed as e:
                self._nccl_failed(peer, str(e))
                if not e.unsent:
                    raise TransportError(str(e)) from None
                logger.info("nccl call to %s failed before its handler (%s): sent inline", peer, e)
                break  # the peer's handler never saw it: resend inline, within the call's time
            if result is not None:
                reply, out, moved = result
                if moved:  # tensors went over NCCL: its data path works (a call without any proves nothing)
                    self._nccl_ok(peer)
                return reply, out
        else:
            raise TransportError(f"nccl communicator with {peer} reset twice")
        # The host path: tensors inline over the control socket, through host memory.
        return self._control.call(peer, header, tensors, max(0.0, deadline - time.monotonic()))

    def _call_on(self, comm: _Comm, header: dict, sends: list[torch.Tensor],
                 deadline: float) -> tuple[dict, list[torch.Tensor], bool] | None:
        """One call over a ready communicator: (reply, tensors, whether tensors moved over
        NCCL); None if the peer did not know it (retry)."""
        if not comm.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransportError(f"timeout waiting for the nccl communicator with {comm.peer}")
        try:
            code = self._status(comm)
            if code is None:
                return None
            if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):  # the peer went away since the last call
                self._abort(comm, f"found broken: nccl error {code}: {self._lib.error_string(code)}")
                return None
            comm.last_used = time.monotonic()
            posted = False
            if sends:
                self._after_current_stream(comm.stream)
                comm.inflight = list(sends)  # until sent, or the abort returned
                try:
                    # Not waited for here: the peer posts its receives when our header arrives.
                    posted = self._post(comm, sends, True)
                except RuntimeError as e:
                    self._abort(comm, f"send not posted: {e}")
                    raise _NcclFailed(f"nccl send to {comm.peer}: {e}", unsent=True) from None
            wire = dict(header)
            wire[NCCL_KEY] = {"cid": comm.cid, "metas": _metas(sends),
                              "budget_ms": max(1, int((deadline - time.monotonic()) * 1000))}
            try:
                reply, inline = self._control.call(comm.peer, wire, (), max(0.0, deadline - time.monotonic()))
            except TransportError as e:
                if posted:  # our sends may be left unmatched on the stream (a hung transfer looks so)
                    self._abort(comm, f"control call failed: {e}")
                    raise _NcclFailed(f"{e} (nccl sends posted)", unsent=False) from None
                raise
            if reply.pop(RESET_KEY, False):
                self._abort(comm, f"peer does not know it: {reply.get('error')}", bye=False)
                return None
            consumed = bool(reply.pop(CONSUMED_KEY, False))
            nccl_failed = bool(reply.pop(FAILED_KEY, False))
            if posted and not consumed:
                self._abort(comm, f"peer took no tensors: {reply.get('error')}")
                if nccl_failed:  # its handler never saw the call
                    raise _NcclFailed(f"nccl receive at {comm.peer}: {reply.get('error')}", unsent=True)
                return reply, inline, False  # refused (caps): inline would be too
            if posted:
                why = self._complete(comm, deadline)
                if why is not None:
                    self._abort(comm, why)
                    raise _NcclFailed(f"nccl send to {comm.peer}: {why}", unsent=False)
            comm.inflight = []
            if nccl_failed:  # the peer's reply tensors could not go over NCCL: they came inline
                self._abort(comm, f"peer's reply send failed: {reply.get('error')}", bye=False)
                self._nccl_failed(comm.peer, f"reply tensors from {comm.peer} not sent over nccl")
                return reply, inline, False
            metas = reply.pop(REPLY_KEY, None)
            if metas is None:
                return reply, inline, posted
            return reply, self._receive(comm, metas, deadline), True
        finally:
            comm.lock.release()

    def _receive(self, comm: _Comm, metas: Any, deadline: float) -> list[torch.Tensor]:
        try:
            specs = _checked_metas(metas, self._max_bytes, self._max_frames)
            out = self._alloc(comm, specs)
            comm.inflight = out
            posted = self._post(comm, out, False)
        except (ValueError, RuntimeError) as e:  # caps, allocation failures, nccl errors
            self._abort(comm, f"reply tensors not received: {e}")
            raise _NcclFailed(f"nccl reply from {comm.peer}: {e}", unsent=False) from None
        why = self._complete(comm, deadline) if posted else None
        if why is not None:
            self._abort(comm, why)
            raise _NcclFailed(f"nccl receive from {comm.peer}: {why}", unsent=False)
        comm.inflight = []
        return out

    # ---------------------------------------------------------------- server
    def _run_handler(self, handler: Handler, header: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[Any]]:
        with self._handler_lock:
            result = handler(header, tensors)
        assert not isinstance(result, Deferred), "the nccl transport's handler answers at once"
        reply, out = result
        return dict(reply), list(out)

    def _serve(self, header: dict, inline: list[torch.Tensor], handler: Handler) -> tuple[dict, list[Any]] | Deferred:
        op = header.get("op")
        if op == HELLO_OP:
            return self._hello(header), []
        if op == INIT_OP:  # NCCL's init may take a while: off the control socket's thread
            return self._deferred(time.monotonic() + self._init_timeout_s, self._init_in, header)
        if op == BYE_OP:
            return self._bye(header), []
        req = header.pop(NCCL_KEY, None)
        for key in (REPLY_KEY, CONSUMED_KEY, RESET_KEY, FAILED_KEY):
            header.pop(key, None)
        if req is None:  # a peer without NCCL (or calling inline): tensors came inline
            with self._handler_lock:
                return handler(header, inline)
        if not isinstance(req, dict) or not isinstance(req.get("cid"), str):
            return {"ok": False, "error": "malformed nccl request"}, []
        with self._lock:
            comm = self._in.get(req["cid"])
        if comm is None:
            return {"ok": False, "error": f"unknown nccl communicator {req['cid']}", RESET_KEY: True}, []
        budget = req.get("budget_ms")
        budget_s = min(budget / 1000 if type(budget) is int and budget > 0 else self._max_wait_s, self._max_wait_s)
        # Give up a little before the caller does, so that it hears why (and may resend inline).
        deadline = time.monotonic() + budget_s - min(0.25, budget_s / 10)
        # The receive is waited for on a worker: pings and hellos from other instances are
        # answered meanwhile (queued behind it they would time out and mark us dead).
        return self._deferred(deadline + 1.0, self._serve_on, comm, req, header, handler, deadline)

    def _deferred(self, until: float, fn: Callable[..., dict], *args: Any) -> Deferred | tuple[dict, list[Any]]:
        """Run ``fn(*args) -> reply header`` on a worker; its reply is sent when it returns."""
        with self._lock:
            if self._serving >= _MAX_SERVING or self._stop.is_set():
                busy = True
            else:
                busy = False
                self._serving += 1
        if busy:
            comm = args[0] if args and isinstance(args[0], _Comm) else None
            if comm is not None:  # the caller's sends stay unmatched: it cannot be used again
                self._abort(comm, "too many nccl calls in progress here")
            return {"ok": False, "error": f"nccl: {_MAX_SERVING} calls in progress here, or closing",
                    FAILED_KEY: True}, []
        d = Deferred(until)

        def run() -> None:
            reply: dict = {"ok": False, "error": "nccl: server error"}
            inline: list[torch.Tensor] = []
            try:
                result = fn(*args)
                reply, inline = result if isinstance(result, tuple) else (result, [])
            except Exception as e:  # noqa: BLE001 - answered, as the tcp transport does
                logger.exception("nccl transport: serving a call failed")
                reply = {"ok": False, "error": f"server error: {type(e).__name__}: {e}"}
            finally:
                with self._lock:
                    self._serving -= 1
                d.resolve(reply, inline)

        try:
            self._workers.submit(run)
        except RuntimeError:  # shut down: closing
            with self._lock:
                self._serving -= 1
            return {"ok": False, "error": "closing"}, []
        return d

    def _serve_on(self, comm: _Comm, req: dict, header: dict, handler: Handler,
                  deadline: float) -> dict | tuple[dict, list[torch.Tensor]]:
        """A worker: receive a call's tensors over ``comm``, run the handler, post the reply's
        (or, when NCCL will not take them, put them inline in the reply)."""
        if not comm.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._abort(comm, "busy past the call's deadline")  # its sends stay unmatched
            return {"ok": False, "error": "nccl communicator busy past the call's deadline", FAILED_KEY: True}
        try:
            if comm.broken is not None:
                return {"ok": False, "error": f"nccl communicator ended: {comm.broken}", RESET_KEY: True}
            comm.last_used = time.monotonic()
            why = self._wait_ready(comm, deadline) if not comm.ready else None
            if why is not None:
                self._abort(comm, f"set-up failed: {why}")
                return {"ok": False, "error": f"nccl set-up failed: {why}", RESET_KEY: True}
            why = self._settle_replies(comm, deadline)
            if why is not None:
                self._abort(comm, f"earlier reply: {why}")
                return {"ok": False, "error": f"nccl: earlier reply not taken: {why}", RESET_KEY: True}
            try:
                specs = _checked_metas(req.get("metas", []), self._max_bytes, self._max_frames)
            except ValueError as e:  # caps: refused whichever way the tensors come
                # The caller's sends stay unmatched: the communicator cannot be used again.
                self._abort(comm, f"refused a call's tensors: {e}")
                return {"ok": False, "error": f"nccl receive refused: {e}"}
            try:
                tensors = self._alloc(comm, specs)
                comm.inflight = tensors
                posted = self._post(comm, tensors, False)
            except RuntimeError as e:  # device allocation, nccl error: the host path may still work
                self._abort(comm, f"could not receive a call's tensors: {e}")
                return {"ok": False, "error": f"nccl receive failed: {e}", FAILED_KEY: True}
            if posted:
                why = self._complete(comm, deadline)
                if why is not None:
                    self._abort(comm, why)
                    return {"ok": False, "error": f"nccl receive: {why}", FAILED_KEY: True}
            comm.inflight = []
            try:
                reply, out = self._run_handler(handler, header, tensors)
            except Exception as e:  # noqa: BLE001 - answered, as the tcp transport does
                logger.exception("nccl transport: handler failed")
                reply, out = {"ok": False, "error": f"handler error: {type(e).__name__}: {e}"}, []
            reply[CONSUMED_KEY] = True
            if out:
                try:
                    out = self._on_device(out)
                    self._after_current_stream(comm.stream)
                    # Launches once the caller, holding this reply, posts its receives.
                    # The caller takes them before its deadline (ours, give or take the wire) or never.
                    pending = _Pending(out, max(deadline, time.monotonic()) + 1.0)
                    comm.pending.append(pending)  # kept until sent or the abort returned
                    if self._post(comm, out, True):
                        comm.unsettled = True
                except TypeError as e:  # not tensors we can send: the handler's bug
                    self._abort(comm, f"reply send failed: {e}")
                    return {"ok": False, "error": f"nccl reply send failed: {e}", CONSUMED_KEY: True}
                except RuntimeError as e:  # NCCL refused: the handler ran, its tensors go the host path
                    self._abort(comm, f"reply send failed: {e}")
                    try:
                        host = [t.cpu() for t in out]
                    except RuntimeError as e2:
                        return {"ok": False, "error": f"nccl reply send failed: {e}; host copy: {e2}",
                                CONSUMED_KEY: True, FAILED_KEY: True}
                    reply[FAILED_KEY] = True
                    return reply, host
                reply[REPLY_KEY] = _metas(out)
            return reply
        finally:
            comm.lock.release()

    @staticmethod
    def _caller(header: dict) -> str:
        """Who set up a communicator with us: its address when it serves one, else its id."""
        frm, cid = header.get("from"), header.get("id")
        if isinstance(frm, str) and frm and frm != "?":
            return frm
        return f"id:{cid}" if isinstance(cid, str) else "?"

    def _hello(self, header: dict) -> dict:
        """May the caller set up a communicator with us? Makes nothing: the unique id (and
        its bootstrap thread) comes only once both sides agreed."""
        if self._stop.is_set():
            return {"ok": False, "error": "closing"}
        theirs, caller = header.get("version"), self._caller(header)
        if theirs != self._version:
            logger.info("nccl hello from %s refused: NCCL %s there, %s here", caller, theirs, self._version)
            return {"ok": False, "no_nccl": True, "version": self._version, "reason": "version",
                    "error": f"NCCL {theirs} at the caller, {self._version} here (NCCL needs the same version on both "
                             "sides)"}
        with self._lock:
            off = self._nccl_off(caller)
        if off is not None:
            return {"ok": False, "no_nccl": True, "reason": "abort_hung", "error": f"no nccl with you here: {off}"}
        return {"ok": True, "version": self._version}

    def _init_in(self, header: dict) -> dict:
        """A worker: join the caller's communicator as rank 1; a new one from the same caller
        replaces its old one (its side is gone, or it would not set up again)."""
        cid, uid = header.get("cid"), header.get("uid")
        if not isinstance(cid, str) or not isinstance(uid, bytes) or len(uid) != UNIQUE_ID_BYTES:
            return {"ok": False, "error": "malformed nccl init"}
        caller = self._caller(header)
        with self._lock:
            off = self._nccl_off(caller)
        if off is not None:
            return {"ok": False, "no_nccl": True, "reason": "abort_hung", "error": f"no nccl with you here: {off}"}
        try:
            with self._on_our_device():
                handle = self._lib.init_rank(2, uid, 1, self._config)
            stream = self._lib.new_stream(self._device)
        except Exception as e:  # noqa: BLE001 - NCCL broken here: the caller falls back to tcp
            logger.warning("nccl init for %s failed: %s", caller, e)
            return {"ok": False, "error": f"nccl init failed here: {e}", "no_nccl": True, "reason": "setup"}
        comm = _Comm(cid, caller, 1, handle, stream, caller=f"{caller}>{header.get('to')}")
        with self._lock:
            old = [c for c in self._in.values() if c.caller == comm.caller or c.cid == cid]
            self._in[cid] = comm
        for c in old:
            self._abort(c, "replaced by a new set-up from the same caller", log=False)
        self._ensure_reaper()
        return {"ok": True}

    def _bye(self, header: dict) -> dict:
        """The caller aborted its side of a communicator: abort ours (asynchronously)."""
        cid = header.get("cid")
        with self._lock:
            comm = self._in.get(cid) if isinstance(cid, str) else None
        if comm is not None and comm.peer == self._caller(header):
            self._abort(comm, "its caller ended it", log=False)
        return {"ok": True}

    def _settle_replies(self, comm: _Comm, deadline: float) -> str | None:
        """Before the next operation on a communicator: the reply sends posted last time
        must have launched (NCCL takes nothing new on a non-blocking communicator before)."""
        if not comm.unsettled:
            return None
        why = self._settle(comm, deadline)
        if why is None:
            self._settled(comm)
        return why

    @staticmethod
    def _settled(comm: _Comm) -> None:
        comm.unsettled = False
        event = comm.stream.record_event()
        for p in comm.pending:
            if p.event is None:
                p.event = event

    # ---------------------------------------------------------------- reaper
    def _reap_loop(self) -> None:
        """End incoming communicators nobody will use (set-up never finished, reply tensors
        never taken, idle), let go of reply tensors the stream has sent, and watch aborts."""
        while not self._stop.wait(_REAP_S):
            now = time.monotonic()
            with self._lock:
                comms = list(self._in.values())
            for c in comms:
                why = self._reap_one(c, now)
                if why is not None:
                    self._abort(c, why)
            self._check_aborts(now)

    def _reap_one(self, c: _Comm, now: float) -> str | None:
        """Why ``c`` should go, or None. Polls, never waits."""
        if not c.lock.acquire(blocking=False):
            return None  # serving a call: its own deadline covers it
        try:
            code = self._status(c)
            if code is None:
                return None  # aborted meanwhile
            if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                return f"nccl error {code}: {self._lib.error_string(code)}"
            if not c.ready:
                if code == NCCL_SUCCESS:
                    c.ready = True
                elif now - c.created > self._init_timeout_s:
                    # The caller gave up (its abort never reaches us over P2P/SHM).
                    return f"set-up not finished within {self._init_timeout_s:g}s"
                return None
            if c.unsettled and code == NCCL_SUCCESS:
                self._settled(c)
            c.pending[:] = [p for p in c.pending if p.event is None or not p.event.query()]
            if any(p.until < now for p in c.pending):
                return "reply tensors not taken before the deadline"
            if not c.pending and now - c.last_used > self._idle_timeout_s:
                return f"idle for {self._idle_timeout_s:g}s"
            return None
        finally:
            c.lock.release()

"""A double of the NCCL library object (the nccl transport's lowest boundary) on host memory.

It keeps NCCL's semantics that the transport relies on, in their strictest form, so that
everything above the library runs on CPU CI as on a GPU: communicators are created
non-blocking and are ready only once both ranks joined; a posted ``send``/``recv`` is
launched onto its stream in the background (a progress thread), and only once the peer
posted the matching operation (until then
``status`` says in progress, and an event recorded on the stream does not cover it: a
caller that records events before the launch finished sees them complete early, as it
would on a GPU); launched operations run in stream order, a send completes only when the
matching receive took its bytes; ``abort`` ends the communicator's pending operations (both
ranks see an error afterwards).

Like NCCL, the double keeps raw pointers, not references: a posted operation holds its
tensor's memory only weakly, so memory the transport lets go of while NCCL may still use it
(before the operation finished, or before ``abort`` returned) is counted
(``freed_buffer_uses``), as is any call on a communicator after ``abort`` freed it
(``freed_handle_uses``): on a GPU both are silent corruption or a crash.

Faults: ``FakeNccl(join=False)`` never joins the communicators it is asked to create (a
peer stuck in set-up); ``init_delay_s`` joins them only after that long (a cold init);
``init_error`` refuses ``init_rank``; ``version`` is what ``version()`` says (P and D must
match); ``abort_gate`` makes ``abort`` hang until the event is set (NVIDIA/nccl #863,
#992); ``send_error`` (settable) makes ``send`` refuse; ``stall`` (settable) leaves what is
posted unlaunched for ever, status in progress (a wedged NCCL); ``kill()`` freezes an instance like a dead process: its streams stop, its pending
operations are never matched, and nothing it held is released.

One :class:`Fabric` stands for the network: every ``FakeNccl`` of a test shares one.
``Fabric(abort_reaches_peer=False)`` is a single-node pair over P2P/SHM: an abort (or a
death) on one side is never seen by the other, whose operations just hang. Each
``ncclGetUniqueId`` starts a bootstrap root (a thread and a socket in real NCCL) that stays
until every rank of its communicator joined: ``Fabric.open_bootstraps()`` counts them.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from connector.transport.nccl_api import NCCL_IN_PROGRESS, NCCL_SUCCESS, CommConfig, NcclError

NCCL_REMOTE_ERROR = 6
NCCL_INVALID_USAGE = 5
_SLICE_S = 0.02  # waits inside the double re-check abort/stop this often
_GATE_MAX_S = 60.0  # a gated abort hangs at most this long (a test that forgot to open it)


class _Buf:
    """What NCCL keeps of a tensor: its address, not a reference. The memory counts as
    freed once no tensor holds its storage any more (torch keeps one storage object per
    storage while a tensor uses it: a weak reference to it dies with the memory)."""

    __slots__ = ("_owner", "_offset", "_nbytes")

    def __init__(self, tensor: torch.Tensor) -> None:
        self._owner = weakref.ref(tensor.untyped_storage())
        self._offset = tensor.storage_offset() * tensor.element_size()
        self._nbytes = tensor.numel() * tensor.element_size()

    def get(self) -> torch.Tensor | None:
        """The bytes, or None when their memory was freed."""
        owner = self._owner()
        if owner is None:
            return None
        return torch.empty(0, dtype=torch.uint8).set_(owner, self._offset, (self._nbytes,))

    @property
    def alive(self) -> bool:
        return self._owner() is not None

    @property
    def nbytes(self) -> int:
        return self._nbytes


class HostEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def set(self) -> None:
        self._done.set()


class HostStream:
    """A CUDA stream's ordering on host threads: operations run one after another."""

    def __init__(self, owner: "FakeNccl") -> None:
        self._owner = owner
        self._cond = threading.Condition()
        self._ops: deque[Callable[[], None]] = deque()
        self._thread = threading.Thread(target=self._run, name="nccl-double-stream", daemon=True)
        self._thread.start()

    def enqueue(self, op: Callable[[], None]) -> None:
        with self._cond:
            self._ops.append(op)
            self._cond.notify()

    def record_event(self) -> HostEvent:
        ev = HostEvent()
        self.enqueue(ev.set)
        return ev

    def wait_event(self, event: HostEvent) -> None:
        self.enqueue(lambda: self._owner.wait_until(event.query))

    def wait_stream(self, other: "HostStream") -> None:
        self.wait_event(other.record_event())

    def _run(self) -> None:
        while not self._owner.stopped:
            with self._cond:
                if not self._ops:
                    self._cond.wait(_SLICE_S)
                    continue
                op = self._ops.popleft()
            op()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@dataclass(slots=True)
class _Msg:
    data: _Buf
    taken: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False, slots=True)
class _Op:
    send: bool
    buf: _Buf
    peer: int
    stream: "HostStream"
    seq: int  # its index among this rank's operations of its kind with that peer
    lib: "FakeNccl"


@dataclass(slots=True)
class _Group:
    nranks: int
    joined: set[int] = field(default_factory=set)
    aborted: bool = False  # seen by every rank (socket transport, or a truncation error)
    version: str | None = None  # of the first rank that joined: NCCL's bootstrap fails another
    mail: dict[tuple[int, int], deque[_Msg]] = field(default_factory=dict)
    # Operations posted so far per (sender, receiver), by kind: what the other side matches.
    sends_posted: dict[tuple[int, int], int] = field(default_factory=dict)
    recvs_posted: dict[tuple[int, int], int] = field(default_factory=dict)
    comms: dict[int, "FakeComm"] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def launch_ready(self) -> None:
        """Move every rank's posted operations whose counterpart was posted onto their
        streams, in posting order (caller holds the lock)."""
        for comm in self.comms.values():
            while comm.unlaunched and not comm.aborted:
                op = comm.unlaunched[0]
                if op.send:
                    ready = self.recvs_posted.get((comm.rank, op.peer), 0) > op.seq
                else:
                    ready = self.sends_posted.get((op.peer, comm.rank), 0) > op.seq
                if not ready or op.lib.stopped or op.lib.stall:
                    break
                comm.unlaunched.popleft()
                run = op.lib._send if op.send else op.lib._recv
                op.stream.enqueue(lambda run=run, op=op, comm=comm: run(comm, op))


@dataclass(eq=False, slots=True)
class FakeComm:
    group: _Group
    rank: int
    config: CommConfig
    unlaunched: deque[_Op] = field(default_factory=deque)
    # Posted and not finished (launched or not): NCCL may still touch their memory.
    inflight: list[_Op] = field(default_factory=list)
    aborted: bool = False  # this rank's abort (what the peer sees depends on the fabric)
    freed: bool = False  # ncclCommAbort/Destroy returned: the handle is gone

    def stopped(self) -> bool:
        return self.aborted or self.group.aborted


class Fabric:
    """The network between doubles: communicators by unique id."""

    def __init__(self, launch_every_s: float = 0.002, abort_reaches_peer: bool = True) -> None:
        self._lock = threading.Lock()
        self._groups: dict[bytes, _Group] = {}
        self._ids: dict[bytes, int] = {}  # unique id -> ranks its communicator needs (0: unknown yet)
        self.abort_reaches_peer = abort_reaches_peer
        self.libs: list[FakeNccl] = []
        self._stop = threading.Event()
        self._every = launch_every_s
        self._progress = threading.Thread(target=self._launch_loop, name="nccl-double-progress", daemon=True)
        self._progress.start()

    def _launch_loop(self) -> None:
        while not self._stop.wait(self._every):
            with self._lock:
                groups = list(self._groups.values())
            for g in groups:
                with g.lock:
                    if not g.aborted:
                        g.launch_ready()

    def group(self, uid: bytes, nranks: int) -> _Group:
        with self._lock:
            g = self._groups.get(uid)
            if g is None:
                g = self._groups[uid] = _Group(nranks)
            return g

    def new_id(self) -> bytes:
        uid = os.urandom(128)
        with self._lock:
            self._ids[uid] = 0
        return uid

    def open_bootstraps(self) -> int:
        """Unique ids whose communicator has not had every rank join yet: in real NCCL each
        holds a bootstrap thread and a listening socket in the process that made it."""
        with self._lock:
            ids = list(self._ids)
            groups = dict(self._groups)
        n = 0
        for uid in ids:
            g = groups.get(uid)
            if g is None:
                n += 1
                continue
            with g.lock:
                n += len(g.joined) < g.nranks
        return n

    def close(self) -> None:
        self._stop.set()
        self._progress.join(1.0)
        for lib in self.libs:
            lib.kill()
        for lib in self.libs:
            lib.join()


class FakeNccl:
    """Implements ``connector.transport.nccl_api.NcclLibrary`` on host memory."""

    def __init__(self, fabric: Fabric, *, join: bool = True, name: str = "double", init_delay_s: float = 0.0,
                 init_error: int | None = None, version: str = "2.27.5",
                 abort_gate: threading.Event | None = None) -> None:
        self.name = name
        self._fabric = fabric
        self._join = join
        self._init_delay_s = init_delay_s
        self._init_error = init_error
        self._version = version
        self.abort_gate = abort_gate
        self.send_error: int | None = None
        self.stall = False
        self.send_calls = 0
        self.stopped = False
        self._streams: list[HostStream] = []
        self.configs: list[CommConfig] = []  # every config init_rank was given
        self.recv_bytes = 0  # counted before the receive completes: exact once its event fired
        self.aborts = 0  # abort calls that returned
        self.aborting = 0  # abort calls entered
        self.groups = 0  # group_start calls
        self.unique_ids = 0  # ncclGetUniqueId calls
        self.freed_handle_uses = 0  # calls on a communicator after abort/destroy returned
        self.freed_buffer_uses = 0  # memory of an operation freed while NCCL could still use it
        self.abort_threads: list[str] = []  # names of the threads abort ran on
        fabric.libs.append(self)

    # ---- the protocol ----
    def version(self) -> str:
        return self._version

    def unique_id(self) -> bytes:
        self.unique_ids += 1
        return self._fabric.new_id()

    def init_rank(self, nranks: int, unique_id: bytes, rank: int, config: CommConfig) -> FakeComm:
        if self.stopped:
            raise NcclError(3, "library closed")
        if self._init_error is not None:
            raise NcclError(self._init_error, self.error_string(self._init_error))
        self.configs.append(config)
        g = self._fabric.group(unique_id, nranks)
        comm = FakeComm(g, rank, config)
        if self._join:
            if self._init_delay_s > 0:
                t = threading.Timer(self._init_delay_s, self._joined, (comm,))
                t.daemon = True
                t.start()
            else:
                self._joined(comm)
        return comm

    def _joined(self, comm: FakeComm) -> None:
        g = comm.group
        with g.lock:
            if not self.stopped and not comm.aborted:
                if g.version is None:
                    g.version = self._version
                elif g.version != self._version:  # NCCL's init compares every rank's version
                    g.aborted = True
                g.joined.add(comm.rank)
                g.comms[comm.rank] = comm

    def _live(self, comm: FakeComm) -> bool:
        """False (and counted) for a communicator whose abort already returned."""
        if comm.freed:
            self.freed_handle_uses += 1
            return False
        return True

    def status(self, comm: FakeComm) -> int:
        if not self._live(comm):
            return NCCL_INVALID_USAGE
        g = comm.group
        with g.lock:
            if comm.stopped():
                return NCCL_REMOTE_ERROR
            if len(g.joined) < g.nranks or comm.unlaunched:
                return NCCL_IN_PROGRESS
            return NCCL_SUCCESS

    def group_start(self) -> None:
        self.groups += 1

    def group_end(self) -> None:
        pass

    def _post(self, comm: FakeComm, send: bool, tensor: torch.Tensor, peer: int, stream: HostStream) -> None:
        assert tensor.is_contiguous()
        if not self._live(comm):
            raise NcclError(NCCL_INVALID_USAGE, "communicator used after abort")
        g = comm.group
        with g.lock:
            if comm.stopped():
                return
            counts = g.sends_posted if send else g.recvs_posted
            key = (comm.rank, peer) if send else (peer, comm.rank)
            seq = counts.get(key, 0)
            counts[key] = seq + 1
            op = _Op(send, _Buf(tensor), peer, stream, seq, self)
            comm.unlaunched.append(op)
            comm.inflight.append(op)
        # Launched by the fabric's progress thread, later: like NCCL's background launch of a
        # non-blocking group, which is why callers must wait for status before an event.

    def send(self, comm: FakeComm, tensor: torch.Tensor, peer: int, stream: HostStream) -> None:
        self.send_calls += 1
        if self.send_error is not None:
            raise NcclError(self.send_error, self.error_string(self.send_error))
        self._post(comm, True, tensor, peer, stream)

    def recv(self, comm: FakeComm, tensor: torch.Tensor, peer: int, stream: HostStream) -> None:
        self._post(comm, False, tensor, peer, stream)

    def abort(self, comm: FakeComm) -> None:
        if not self._live(comm):
            return
        self.aborting += 1
        self.abort_threads.append(threading.current_thread().name)
        if self.abort_gate is not None:
            self.abort_gate.wait(_GATE_MAX_S)
        g = comm.group
        with g.lock:
            comm.aborted = True
            if self._fabric.abort_reaches_peer:
                g.aborted = True
            # Until abort returns NCCL may still read or write what was posted.
            self.freed_buffer_uses += sum(not op.buf.alive for op in comm.inflight)
            comm.inflight.clear()
            comm.unlaunched.clear()
        comm.freed = True
        self.aborts += 1

    def destroy(self, comm: FakeComm) -> None:
        self.abort(comm)

    def error_string(self, code: int) -> str:
        return {2: "unhandled system error", 3: "internal error", 5: "invalid usage",
                NCCL_REMOTE_ERROR: "remote process exited or there was a network error"}.get(code, f"code {code}")

    def new_stream(self, device: torch.device) -> HostStream:
        s = HostStream(self)
        self._streams.append(s)
        return s

    # ---- faults and teardown ----
    def kill(self) -> None:
        self.stopped = True

    def join(self) -> None:
        for s in self._streams:
            s.join(1.0)

    # ---- what the streams run ----
    def wait_until(self, pred: Callable[[], bool], comm: FakeComm | None = None) -> bool:
        """Block this stream until ``pred``; False when aborted or stopped first."""
        while not pred():
            if self.stopped or (comm is not None and comm.stopped()):
                return False
            threading.Event().wait(_SLICE_S)
        return True

    def _done(self, comm: FakeComm, op: _Op) -> None:
        with comm.group.lock:
            if op in comm.inflight:
                comm.inflight.remove(op)

    def _send(self, comm: FakeComm, op: _Op) -> None:
        g = comm.group
        msg = _Msg(op.buf)
        with g.lock:
            if comm.stopped():
                return
            g.mail.setdefault((comm.rank, op.peer), deque()).append(msg)
        if self.wait_until(msg.taken.is_set, comm):
            self._done(comm, op)

    def _recv(self, comm: FakeComm, op: _Op) -> None:
        g = comm.group
        peer = op.peer
        box: Any = None

        def arrived() -> bool:
            nonlocal box
            with g.lock:
                q = g.mail.get((peer, comm.rank))
                if q:
                    box = q.popleft()
                    return True
            return False

        if not self.wait_until(arrived, comm):
            return
        if box.data.nbytes != op.buf.nbytes:  # NCCL: truncation is an error, the comm is done
            with g.lock:
                g.aborted = True
            return
        src, dst = box.data.get(), op.buf.get()
        if src is None or dst is None:  # on a GPU: bytes of reused memory, silently
            self.freed_buffer_uses += 1
        else:
            dst.copy_(src)
            self.recv_bytes += dst.numel()
        box.taken.set()
        self._done(comm, op)


# ---- helpers the nccl transport tests share ----

def rand_bytes(n: int, seed: int) -> torch.Tensor:
    """n reproducible random bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def until(pred: Callable[[], Any], timeout_s: float = 30.0) -> bool:
    """Poll pred until it holds or timeout_s passed; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())

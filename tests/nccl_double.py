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

Faults: ``FakeNccl(join=False)`` never joins the communicators it is asked to create (a
peer stuck in set-up); ``kill()`` freezes an instance like a dead process: its streams stop,
its pending operations are never matched, and nothing it held is released.

One :class:`Fabric` stands for the network: every ``FakeNccl`` of a test shares one.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from connector.transport.nccl_api import NCCL_IN_PROGRESS, NCCL_SUCCESS, CommConfig, NcclError

NCCL_REMOTE_ERROR = 6
_SLICE_S = 0.02  # waits inside the double re-check abort/stop this often


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
    data: torch.Tensor
    taken: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class _Op:
    send: bool
    tensor: torch.Tensor
    peer: int
    stream: "HostStream"
    seq: int  # its index among this rank's operations of its kind with that peer
    lib: "FakeNccl"


@dataclass(slots=True)
class _Group:
    nranks: int
    joined: set[int] = field(default_factory=set)
    aborted: bool = False
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
            while comm.unlaunched:
                op = comm.unlaunched[0]
                if op.send:
                    ready = self.recvs_posted.get((comm.rank, op.peer), 0) > op.seq
                else:
                    ready = self.sends_posted.get((op.peer, comm.rank), 0) > op.seq
                if not ready or op.lib.stopped:
                    break
                comm.unlaunched.popleft()
                run = op.lib._send if op.send else op.lib._recv
                op.stream.enqueue(lambda run=run, op=op, comm=comm: run(comm, op.tensor, op.peer))


@dataclass(slots=True)
class FakeComm:
    group: _Group
    rank: int
    config: CommConfig
    unlaunched: deque[_Op] = field(default_factory=deque)


class Fabric:
    """The network between doubles: communicators by unique id."""

    def __init__(self, launch_every_s: float = 0.002) -> None:
        self._lock = threading.Lock()
        self._groups: dict[bytes, _Group] = {}
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

    def close(self) -> None:
        self._stop.set()
        self._progress.join(1.0)
        for lib in self.libs:
            lib.kill()
        for lib in self.libs:
            lib.join()


class FakeNccl:
    """Implements ``connector.transport.nccl_api.NcclLibrary`` on host memory."""

    def __init__(self, fabric: Fabric, *, join: bool = True, name: str = "double") -> None:
        self.name = name
        self._fabric = fabric
        self._join = join
        self.stopped = False
        self._streams: list[HostStream] = []
        self.configs: list[CommConfig] = []  # every config init_rank was given
        self.recv_bytes = 0  # counted before the receive completes: exact once its event fired
        self.aborts = 0
        self.groups = 0  # group_start calls
        fabric.libs.append(self)

    # ---- the protocol ----
    def version(self) -> str:
        return "double"

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def init_rank(self, nranks: int, unique_id: bytes, rank: int, config: CommConfig) -> FakeComm:
        if self.stopped:
            raise NcclError(3, "library closed")
        self.configs.append(config)
        g = self._fabric.group(unique_id, nranks)
        comm = FakeComm(g, rank, config)
        if self._join:
            with g.lock:
                g.joined.add(rank)
                g.comms[rank] = comm
        return comm

    def status(self, comm: FakeComm) -> int:
        g = comm.group
        with g.lock:
            if g.aborted:
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
        g = comm.group
        with g.lock:
            if g.aborted:
                return
            counts = g.sends_posted if send else g.recvs_posted
            key = (comm.rank, peer) if send else (peer, comm.rank)
            seq = counts.get(key, 0)
            counts[key] = seq + 1
            comm.unlaunched.append(_Op(send, tensor, peer, stream, seq, self))
        # Launched by the fabric's progress thread, later: like NCCL's background launch of a
        # non-blocking group, which is why callers must wait for status before an event.

    def send(self, comm: FakeComm, tensor: torch.Tensor, peer: int, stream: HostStream) -> None:
        self._post(comm, True, tensor, peer, stream)

    def recv(self, comm: FakeComm, tensor: torch.Tensor, peer: int, stream: HostStream) -> None:
        self._post(comm, False, tensor, peer, stream)

    def abort(self, comm: FakeComm) -> None:
        self.aborts += 1
        with comm.group.lock:
            comm.group.aborted = True

    def destroy(self, comm: FakeComm) -> None:
        self.abort(comm)

    def error_string(self, code: int) -> str:
        return {NCCL_REMOTE_ERROR: "remote process exited or there was a network error"}.get(code, f"code {code}")

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
    def wait_until(self, pred: Callable[[], bool], group: _Group | None = None) -> bool:
        """Block this stream until ``pred``; False when aborted or stopped first."""
        while not pred():
            if self.stopped or (group is not None and group.aborted):
                return False
            threading.Event().wait(_SLICE_S)
        return True

    def _send(self, comm: FakeComm, tensor: torch.Tensor, peer: int) -> None:
        g = comm.group
        msg = _Msg(tensor)
        with g.lock:
            if g.aborted:
                return
            g.mail.setdefault((comm.rank, peer), deque()).append(msg)
        self.wait_until(msg.taken.is_set, g)

    def _recv(self, comm: FakeComm, tensor: torch.Tensor, peer: int) -> None:
        g = comm.group
        box: Any = None

        def arrived() -> bool:
            nonlocal box
            with g.lock:
                q = g.mail.get((peer, comm.rank))
                if q:
                    box = q.popleft()
                    return True
            return False

        if not self.wait_until(arrived, g):
            return
        if box.data.numel() != tensor.numel():  # NCCL: truncation is an error, the comm is done
            with g.lock:
                g.aborted = True
            return
        tensor.copy_(box.data)
        self.recv_bytes += tensor.numel()
        box.taken.set()

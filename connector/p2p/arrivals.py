"""D's arrival board: which transfers' KV reached this worker rank, in shared memory.

D's scheduler (vLLM's EngineCore process) plans a load as synchronous when the prompt's KV
is already in the worker's receive buffer (connector/p2p/scheduler.py). Asking the worker's
control socket costs a round trip through two processes on vLLM's scheduling thread
(0.4 ms median on a 2-core box, 3-10 ms when the box is loaded); reading this board costs
no system call. The worker rank writes, the scheduler reads, both on the same host (the
probe's own condition): a small file in /dev/shm named after the rank's KV address.

Layout: a 16-byte magic, the writer's pid (8 bytes, little-endian), the count of digests
written so far (8 bytes, little-endian: a reader that looked for a key at that count need not
look again until it moves; a request waiting for its prefill is asked about every step), then
``SLOTS`` slots of 16 bytes, each a 128-bit BLAKE2b digest
of a transfer key whose whole payload was stored (every piece, for heterogeneous TP), or of
``begun:`` and a key that a sender began to send (its reservation, its first part, its refusal
or its abort: the transfer has started or will not come), written round-robin. "Arrived" is
only ever a yes (a reader asks the worker when it sees no yes); "begun" is read from a board
the reader can map, and lets D's scheduler wait for a prefill that has not begun without
holding KV-cache blocks (connector/p2p/scheduler.py). "Arrived": a payload dropped since (its TTL) fails a synchronous load as it would fail
an asynchronous one (the blocks go to vLLM's kv_load_failure_policy), and keys are
per-request uuids, so an old or stale entry never names a new request's transfer. A torn
slot (read while written) matches nothing: the worker is asked then.

vLLM may end a worker without closing its connector (a signal), which leaves its board
behind: a writer starting up removes the boards (and half-made ones) of this user whose
writer is no longer alive, so what is left over is bounded by one board per dead instance
until the next one starts.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
import threading
import time
from pathlib import Path

from connector.log import get_logger

logger = get_logger(__name__)

MAGIC = b"xpyd-arrivals-v3"  # 16 bytes: this layout (v3: 4,096 slots, "begun" digests)
HEADER = 32  # the magic, the writer's pid, the count of digests written
_COUNT = slice(24, 32)
DIGEST = 16
SLOTS = 4096  # the last 4,096 events (two or more per transfer): far more than wait at once
SIZE = HEADER + SLOTS * DIGEST
_PREFIX = "xpyd-arrivals-"
_REMEMBERED = 4096  # keys a reader remembers as not begun (cleared past it: a scan each, once)
_SWEEP_MAX = 1024  # directory entries a sweep looks at


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=DIGEST).digest()


def _begun_digest(key: str) -> bytes:
    return hashlib.blake2b(b"begun:" + key.encode(), digest_size=DIGEST).digest()


def board_path(kv_address: str, directory: str | None = None) -> Path:
    """The board of the worker rank whose KV socket is ``kv_address`` (host:port), for this
    user: the writer and its readers derive the same name."""
    base = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in kv_address)
    return Path(base) / f"{_PREFIX}{os.getuid()}-{safe}"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists (another user's): not ours to judge
        return True
    return True


def _owner(path: Path) -> int | None:
    """The pid that wrote a board (or a half-made one, from its name); None: not a board."""
    if path.name.endswith(".tmp"):
        pid = path.name.rsplit(".", 2)[-2]
        return int(pid) if pid.isdigit() else None
    try:
        with path.open("rb") as f:
            head = f.read(HEADER)
    except OSError:
        return None
    if len(head) != HEADER or head[: len(MAGIC)] != MAGIC:
        return None
    return int.from_bytes(head[len(MAGIC):len(MAGIC) + 8], "little")


def sweep(directory: Path) -> list[Path]:
    """Remove this user's boards whose writer is gone; returns what was removed."""
    mine = f"{_PREFIX}{os.getuid()}-"
    gone: list[Path] = []
    try:
        with os.scandir(directory) as it:
            for n, entry in enumerate(it):
                if n >= _SWEEP_MAX:
                    break
                if not entry.name.startswith(mine) or not entry.is_file(follow_symlinks=False):
                    continue
                pid = _owner(Path(entry.path))
                if pid is not None and pid != os.getpid() and not _alive(pid):
                    try:
                        os.unlink(entry.path)
                        gone.append(Path(entry.path))
                    except OSError:
                        pass
    except OSError:
        pass
    return gone


class ArrivalWriter:
    """The worker rank's side: ``publish`` each transfer whose whole KV was stored."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()  # transport threads publish concurrently
        self._next = 0
        removed = sweep(path.parent)
        if removed:
            logger.info("kv arrival boards of ended instances removed: %d", len(removed))
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._mm[: len(MAGIC)] = MAGIC
        self._mm[len(MAGIC):len(MAGIC) + 8] = os.getpid().to_bytes(8, "little")
        self._inode = os.stat(tmp).st_ino
        os.replace(tmp, path)  # readers never open a half-made board

    @property
    def path(self) -> Path:
        return self._path

    def publish(self, key: str) -> None:
        """The whole payload of `key` is stored."""
        self._write(_digest(key))

    def publish_begun(self, key: str) -> None:
        """A sender began `key` (reserved, sent a part, was refused or gave up)."""
        self._write(_begun_digest(key))

    def _write(self, h: bytes) -> None:
        with self._lock:
            at = HEADER + (self._next % SLOTS) * DIGEST
            self._next += 1
            self._mm[at:at + DIGEST] = h
            self._mm[_COUNT] = self._next.to_bytes(8, "little")  # after the slot: a reader at this count sees it

    def close(self) -> None:
        with self._lock:
            self._mm.close()
        try:
            if os.stat(self._path).st_ino == self._inode:  # not a newer instance's board
                self._path.unlink()
        except OSError:
            pass


class ArrivalReader:
    """The scheduler's side. Only a "yes" is final: "no" (not arrived, or the board cannot
    be read: not made yet, another layout) leaves the answer to the worker's control
    socket, so a board that is stale (a previous instance's) or missing costs what asking
    always cost and never a wrong answer."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._mm: mmap.mmap | None = None
        self._inode = -1  # of the board mapped
        # Keys last found not begun, and the board's count then (bounded: the waiting requests').
        self._not_begun: dict[str, int] = {}
        self._stale_check_at = 0.0  # monotonic time the next miss may look for a newer board

    def _open(self) -> bool:
        self.close()
        try:
            fd = os.open(self._path, os.O_RDONLY)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if st.st_size != SIZE:
                return False
            mm = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return False
        finally:
            os.close(fd)
        if mm[: len(MAGIC)] != MAGIC:
            mm.close()
            return False
        self._mm, self._inode = mm, st.st_ino
        return True

    def _replaced(self) -> bool:
        """Another board took the name (the mapped one is a previous instance's)."""
        try:
            return os.stat(self._path).st_ino != self._inode
        except OSError:
            return False

    def _find(self, h: bytes) -> bool:
        assert self._mm is not None
        at = self._mm.find(h, HEADER)
        for _ in range(SLOTS):  # a match across two slots is not one: look on (bounded)
            if at < 0:
                return False
            if (at - HEADER) % DIGEST == 0:
                return True
            at = self._mm.find(h, at + 1)
        return False

    def arrived(self, key: str) -> bool:
        if self._mm is None and not self._open():
            return False
        h = _digest(key)
        if self._find(h):
            return True
        # A miss costs one stat more: a board mapped before this instance's worker made its
        # own (a stale file of the same name) is swapped for the live one.
        return self._replaced() and self._open() and self._find(h)

    def begun(self, key: str) -> bool | None:
        """Whether a sender began `key` or it arrived; None when no board can be read (ask
        the worker then)."""
        if self._mm is None and not self._open():
            return None
        count = self._mm[_COUNT]
        if self._not_begun.get(key) == count:
            return False  # nothing written since this key was last looked for
        hs = (_begun_digest(key), _digest(key))
        found = any(self._find(h) for h in hs)
        now = time.monotonic()
        if not found and now >= self._stale_check_at and self._replaced():  # a stat at most once a second
            if not self._open():
                return None
            count = self._mm[_COUNT]
            found = any(self._find(h) for h in hs)
        if not found:
            self._stale_check_at = now + 1.0
        if found:
            self._not_begun.pop(key, None)
            return True
        if len(self._not_begun) >= _REMEMBERED:
            self._not_begun.clear()
        self._not_begun[key] = count
        return False

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
            self._inode = -1

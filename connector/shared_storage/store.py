"""Block files on the shared path: format, atomic writes, verified reads, LRU eviction.

One file per (block key, worker rank)::

    {root}/{key[:2]}/{key}.r{rank}of{world}.kv

    b"XPYDKV01" | u32 header length | JSON header | payload

The header records what the payload is (model, block size, layout, dtype, block
shape, layer names, rank) plus its byte count and CRC32; a reader checks all of
it. A mismatch (another configuration wrote the file) or damage (bad magic,
truncation, CRC) is a *miss*, never an exception for the caller; damaged files
are deleted so a producer writes them again.

Writes go to a unique temp file in the same directory, then ``os.replace``: a
reader sees the old state or the whole new file, and two writers of the same
block both produce a complete file (the last rename wins; contents are equal).

Recency for eviction is the file's mtime: a read or a skipped re-store touches
it, so least-recently-*used* files go first, whichever instance used them.

Inside the store nothing is followed: the key directories and block files are opened
relative to their parent's descriptor with O_NOFOLLOW, so a link planted in the store
(by whoever else may write there) is a miss, never a read or a write elsewhere; a file that
is not a regular one is a miss too. What the store creates is its owner's alone: directories
0700, files 0600 (the root is the configured path: created 0700 when missing, else as it is).
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import struct
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from connector.log import get_logger

logger = get_logger(__name__)

MAGIC = b"XPYDKV01"
_PREFIX = struct.Struct("<8sI")
MAX_HEADER_BYTES = 1 << 20
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
# Temp files older than this are leftovers of a crashed writer.
STALE_TMP_S = 600.0


def block_path(root: Path, key: str, rank: int, world: int) -> Path:
    return root / key[:2] / _block_name(key, rank, world)


def _block_name(key: str, rank: int, world: int) -> str:
    return f"{key}.r{rank}of{world}{SUFFIX}"


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under a block's name is not waited on (fstat refuses it).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _key_dir(root: Path, key: str, create: bool = False) -> int:
    """A descriptor of the key's directory in the store, never through a link (OSError:
    ELOOP/ENOTDIR for one, FileNotFoundError when absent)."""
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if create:
            try:
                os.mkdir(key[:2], 0o700, dir_fd=rfd)
            except FileExistsError:
                pass
        return os.open(key[:2], _DIR_FLAGS, dir_fd=rfd)
    finally:
        os.close(rfd)


def is_stored(root: Path, key: str, rank: int, world: int) -> bool:
    """A block file is in place: a regular file in a real directory of the store (a link is
    not: read_into would refuse it)."""
    try:
        dfd = _key_dir(root, key)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.stat(_block_name(key, rank, world), dir_fd=dfd, follow_symlinks=False).st_mode)
    except OSError:
        return False
    finally:
        os.close(dfd)


@dataclass(frozen=True, slots=True)
class FileMeta:
    """What a block file must say to be loadable here."""

    model_id: str
    block_size: int
    layout: str
    dtype: str
    block_shape: tuple[int, ...]
    layers: tuple[str, ...]
    rank: int
    world: int

    def header(self) -> dict[str, Any]:
        d = asdict(self)
        d["block_shape"] = list(self.block_shape)
        d["layers"] = list(self.layers)
        return d

    def mismatch(self, h: dict[str, Any]) -> str | None:
        for k, mine in self.header().items():
            if h.get(k) != mine:
                return f"{k} mismatch: file {h.get(k)!r} vs local {mine!r}"
        return None


class Miss(Exception):
    """A block could not be loaded; ``damaged`` means the file itself is bad."""

    def __init__(self, reason: str, damaged: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.damaged = damaged


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (any dtype, bf16 included)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class BlockStore:
    def __init__(self, root: Path, meta: FileMeta, verify: bool = True, fsync: bool = False) -> None:
        self.root = Path(root)
        self.meta = meta
        self.verify = verify
        self.fsync = fsync
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return block_path(self.root, key, self.meta.rank, self.meta.world)

    def _name(self, key: str) -> str:
        return _block_name(key, self.meta.rank, self.meta.world)

    def stored(self, key: str) -> bool:
        return is_stored(self.root, key, self.meta.rank, self.meta.world)

    # ---- write ----
    def write(self, key: str, index: int, block: torch.Tensor) -> int:
        """Store one block (all layers, contiguous CPU tensor) unless a file for the
        key exists; returns the bytes written (0: it existed, and was touched)."""
        name = self._name(key)
        dfd = _key_dir(self.root, key, create=True)
        try:
            if _touch(dfd, name):
                return 0
            payload = _bytes_view(block)
            header = dict(self.meta.header(), key=key, index=index, nbytes=len(payload),
                          crc32=zlib.crc32(payload), created=time.time())
            hb = json.dumps(header, separators=(",", ":")).encode()
            tmp = f"{TMP_PREFIX}{name}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"
            try:
                with os.fdopen(os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=dfd), "wb") as f:
                    f.write(_PREFIX.pack(MAGIC, len(hb)))
                    f.write(hb)
                    f.write(payload)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                # Atomic (readers see no file or the whole file); a link at `name` is replaced, not followed.
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise
            return _PREFIX.size + len(hb) + len(payload)
        finally:
            os.close(dfd)

    # ---- read ----
    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous CPU tensor of one block's size) from the key's file,
        or raise Miss. Damaged files are deleted; mismatched ones are left alone."""
        name = self._name(key)
        try:
            dfd = _key_dir(self.root, key)
        except FileNotFoundError:
            raise Miss("not stored") from None
        except OSError as e:  # ELOOP / ENOTDIR: a link where the key's directory belongs
            raise Miss(f"unreadable: {e}") from None
        try:
            try:
                f = os.fdopen(os.open(name, _READ_FLAGS, dir_fd=dfd), "rb")
            except FileNotFoundError:
                raise Miss("not stored") from None
            except OSError as e:  # ELOOP: a link
                raise Miss(f"unreadable: {e}") from None
            try:
                with f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        raise Miss("not a regular file")
                    try:
                        self._read(f, key, _bytes_view(out))
                    except Miss as m:
                        if m.damaged:
                            _unlink_if_same(dfd, name, f)
                        raise
            except OSError as e:
                raise Miss(f"read error: {e}") from None
            _touch(dfd, name)
        finally:
            os.close(dfd)

    def _read(self, f: Any, key: str, out: memoryview) -> None:
        prefix = f.read(_PREFIX.size)
        if len(prefix) != _PREFIX.size:
            raise Miss("truncated header", damaged=True)
        magic, hlen = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise Miss("bad magic", damaged=True)
        if hlen > MAX_HEADER_BYTES:
            raise Miss("header too large", damaged=True)
        raw = f.read(hlen)
        try:
            h = json.loads(raw)
            if not isinstance(h, dict):
                raise ValueError("header is not an object")
        except ValueError as e:
            raise Miss(f"bad header: {e}", damaged=True) from None
        if h.get("key") != key:
            raise Miss(f"file holds key {h.get('key')!r}", damaged=True)
        bad = self.meta.mismatch(h)
        if bad:
            raise Miss(bad)
        if h.get("nbytes") != len(out):
            raise Miss(f"payload is {h.get('nbytes')} bytes, a block here is {len(out)}")
        n = f.readinto(out)
        if n != len(out):
            raise Miss(f"truncated payload: {n} of {len(out)} bytes", damaged=True)
        if f.read(1):
            raise Miss("trailing bytes after payload", damaged=True)
        if self.verify and zlib.crc32(out) != h.get("crc32"):
            raise Miss("checksum mismatch", damaged=True)


def _touch(dfd: int, name: str) -> bool:
    """Mark a file used now (eviction order); False if it does not exist. A link is touched
    itself, never what it points at."""
    try:
        os.utime(name, dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    except OSError:  # e.g. a read-only share: still a hit
        try:
            os.stat(name, dir_fd=dfd, follow_symlinks=False)
            return True
        except OSError:
            return False


def _unlink_if_same(dfd: int, name: str, f: Any) -> None:
    """Delete a damaged file unless a writer already replaced it with a new one."""
    try:
        if os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino == os.fstat(f.fileno()).st_ino:
            os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


@dataclass(slots=True)
class _Entry:
    mtime: float
    size: int
    path: Path


class Evictor:
    """Keeps the directory under ``max_bytes`` by deleting least-recently-used files.

    The total is tracked from this process's writes and refreshed by a directory
    scan when it passes the limit or every ``rescan_s`` (other instances write and
    touch files too). Eviction goes down to ``low_water`` of the limit so that a
    full store does not scan on every write.
    """

    def __init__(self, root: Path, max_bytes: int, rescan_s: float = 30.0, low_water: float = 0.9) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.rescan_s = rescan_s
        self.low_water = low_water
        self.total = 0
        self._scanned_at = float("-inf")
        self.evicted_files = 0
        self.evicted_bytes = 0

    def scan(self) -> list[_Entry]:
        entries: list[_Entry] = []
        now = time.time()
        try:
            subdirs = [d for d in os.scandir(self.root) if d.is_dir(follow_symlinks=False)]
        except OSError:
            return entries
        for d in subdirs:
            try:
                it = list(os.scandir(d.path))
            except OSError:
                continue
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # evicted or renamed meanwhile
                if e.name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        _quiet_unlink(Path(e.path))
                    continue
                if e.name.endswith(SUFFIX):
                    entries.append(_Entry(st.st_mtime, st.st_size, Path(e.path)))
        self.total = sum(x.size for x in entries)
        self._scanned_at = time.monotonic()
        return entries

    def added(self, nbytes: int) -> None:
        self.total += nbytes

    def maybe_evict(self) -> int:
        """Evict if over the limit; returns the number of files deleted."""
        if self.max_bytes <= 0:
            return 0
        if self.total <= self.max_bytes and time.monotonic() - self._scanned_at < self.rescan_s:
            return 0
        entries = self.scan()
        if self.total <= self.max_bytes:
            return 0
        target = int(self.max_bytes * self.low_water)
        entries.sort(key=lambda x: x.mtime)
        n = 0
        for e in entries:
            if self.total <= target:
                break
            if _quiet_unlink(e.path):
                n += 1
                self.evicted_bytes += e.size
            self.total -= e.size  # gone either way (someone else may have evicted it)
        self.evicted_files += n
        if n:
            logger.info("kv storage evicted files=%d now_bytes=%d limit=%d", n, self.total, self.max_bytes)
        return n


def _quiet_unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False

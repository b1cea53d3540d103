"""Reading a secret from a file, the same way on both sides (the proxy's ``--*-file`` flags,
the connector's ``*_secret_file`` keys): a secret is a token, not a document, so a larger
file is a mistake (or a device) and refused; one trailing newline is dropped. Only a regular
file is read (opened without blocking: a FIFO or a device refuses at once instead of holding
start-up); one that its group or anyone may read is read with a warning (Docker and Kubernetes
mount secrets 0444/0644 in a container of their own: refusing those would refuse them)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

MAX_SECRET_FILE_BYTES = 64 * 1024


def read_secret_file(path: str, what: str, warn: Callable[[str], object] | None = None) -> str:
    """The secret in ``path`` less one trailing newline; ValueError naming ``what`` says why
    not (unreadable, not a regular file, too large, not UTF-8). ``warn`` gets a line when others
    than its owner may read the file. An empty secret is the caller's to judge."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what}: {path} is not a regular file (a pipe, device or directory holds no secret)")
        if st.st_mode & 0o044 and warn is not None:
            who = "its group and everyone" if st.st_mode & 0o004 and st.st_mode & 0o040 else (
                "everyone" if st.st_mode & 0o004 else "its group")
            warn(f"{what}: {path} is readable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): "
                 f"chmod 600 it, unless its container is its only reader")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_SECRET_FILE_BYTES:
            chunk = os.read(fd, MAX_SECRET_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if size > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"{what}: {path} is over {MAX_SECRET_FILE_BYTES} bytes, not a secret")
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what}: {path} is not UTF-8 text") from None
    return text.removesuffix("\n").removesuffix("\r")

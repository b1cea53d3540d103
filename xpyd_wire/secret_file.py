"""Reading a secret from a file, the same way on both sides (the proxy's ``--*-file`` flags,
the connector's ``*_secret_file`` keys): a secret is a token, not a document, so a larger
file is a mistake (or a device) and refused; one trailing newline is dropped."""

from __future__ import annotations

MAX_SECRET_FILE_BYTES = 64 * 1024


def read_secret_file(path: str, what: str) -> str:
    """The secret in ``path`` less one trailing newline; ValueError naming ``what`` says why
    not (unreadable, too large, not UTF-8). An empty secret is the caller's to judge."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"{what}: {path} is over {MAX_SECRET_FILE_BYTES} bytes, not a secret")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what}: {path} is not UTF-8 text") from None
    return text.removesuffix("\n").removesuffix("\r")

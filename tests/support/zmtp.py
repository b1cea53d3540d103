"""Raw ZMTP 3.0 for tests that play a peer libzmq would never be: one that completes the NULL
handshake and then says nothing, or sends frames with MORE set and never the last one."""

from __future__ import annotations

import socket

# The greeting (signature, version 3.0, mechanism NULL, as-server 0) and the NULL mechanism's
# READY command: after these a connection is a DEALER as far as its server can tell.
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
_READY = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
READY = b"\x04" + bytes([len(_READY)]) + _READY


def frame_head(size: int, more: bool) -> bytes:
    """A message frame's flags and size (long form: 8 bytes)."""
    return bytes([0x02 | (0x01 if more else 0)]) + size.to_bytes(8, "big")


def idle_connection(port: int, source: str = "127.0.0.1", host: str = "127.0.0.1") -> socket.socket:
    """A connection that completes ZMTP's NULL handshake (as far as it goes) and then stays silent."""
    s = socket.create_connection((host, port), timeout=5, source_address=(source, 0))
    s.sendall(GREETING + READY)
    return s


def closed(s: socket.socket) -> bool:
    """Whether the other side closed this connection (what it sent before is read and dropped)."""
    s.settimeout(0.0)
    try:
        while True:
            if not s.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True

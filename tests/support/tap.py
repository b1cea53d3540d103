"""A recording TCP relay for the end-to-end tests: put in front of a vLLM server (its connector
advertises the relay's port as the server's, so the proxy reaches the server through it), it
passes every connection through and keeps the last bytes each way, so a failing comparison can
show D's own answer beside what the proxy made of it. Threads, loopback only, bounded: every open
connection and the last KEEP closed ones (the connector's /health polls close theirs; the proxy's
pooled connections stay open), the last MAX_BYTES of each direction of each."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

KEEP = 16
MAX_BYTES = 8 * 1024 * 1024


@dataclass
class Stream:
    """One direction of one connection: its last MAX_BYTES, and how many bytes passed in all."""

    total: int = 0
    tail: bytearray = field(default_factory=bytearray)

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self.tail += data
        if len(self.tail) > MAX_BYTES:
            del self.tail[: len(self.tail) - MAX_BYTES]

    def since(self, total: int) -> bytes:
        """What passed after ``total`` bytes had (as far as the tail still holds it)."""
        n = min(self.total - total, len(self.tail))
        return bytes(self.tail[len(self.tail) - n:]) if n > 0 else b""


@dataclass
class Connection:
    sent: Stream = field(default_factory=Stream)  # to the server: requests
    answer: Stream = field(default_factory=Stream)  # from the server: answers
    ended: int = 0  # directions that ended (2: closed)


Mark = dict[int, tuple[int, int]]


class Tap:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self._target = (host, target_port)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[Connection] = []
        self._lock = threading.Lock()
        self._closing = False
        threading.Thread(target=self._accept, name="tap-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._target, timeout=30)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            conn = Connection()
            with self._lock:
                closed = [c for c in self._conns if c.ended == 2]
                drop = {id(c) for c in closed[: max(0, len(closed) - KEEP)]}
                self._conns = [c for c in self._conns if id(c) not in drop] + [conn]
            threading.Thread(target=self._pipe, args=(client, server, conn, conn.sent), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, conn, conn.answer), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, conn: Connection, keep: Stream) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                with self._lock:
                    keep.add(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            src.close()
            with self._lock:
                conn.ended += 1

    def mark(self) -> Mark:
        """Where every connection stands now."""
        with self._lock:
            return {id(c): (c.sent.total, c.answer.total) for c in self._conns}

    def since(self, mark: Mark) -> list[tuple[bytes, bytes]]:
        """(requests, answers) each connection carried after ``mark``, those that carried a POST."""
        with self._lock:
            out = []
            for c in self._conns:
                sent, answered = mark.get(id(c), (0, 0))
                got = (c.sent.since(sent), c.answer.since(answered))
                if b"POST " in got[0]:
                    out.append(got)
            return out

    def close(self) -> None:
        self._closing = True
        self._listener.close()

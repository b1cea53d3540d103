"""Helpers of tests/unit/test_transport_auth.py that other tests use too (moved from it)."""

from __future__ import annotations

import zmq

from connector.transport.auth import PLAIN_USERNAME, KVAuth, MacAuth
from connector.transport.wire import encode as _encode
from connector.transport.wire import frame_lens as _lens


class Raw:
    """A bare zmq DEALER: sends whatever frames it is given. With ``auth`` (mac) it passes the
    connection's handshake as a holder of the secret does (PLAIN, the connect token): a peer
    that read the token off the wire, or a faulty one; without, a ``mac`` port lets it no
    further than the handshake."""

    def __init__(self, peer: str, auth: KVAuth | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if auth is not None:
            self.sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USERNAME)
            self.sock.setsockopt(zmq.PLAIN_PASSWORD, auth.connect_token)
        self.sock.connect(f"tcp://{peer}")

    def ask(self, frames: list[bytes], timeout_ms: int = 5000) -> list[bytes] | None:
        self.sock.send_multipart(frames)
        if not self.sock.poll(timeout_ms):
            return None
        return self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def signed(mac: MacAuth, header: dict, tensors=(), call_id: int = 1) -> list[bytes]:
    """What TcpTransport.call puts on the wire with ``mac``."""
    body = _encode(header, tensors, call_id)
    frame, _ = mac.sign_request(body[0], _lens(body))
    return [frame, body[0], *(bytes(b) for b in body[1:])]
